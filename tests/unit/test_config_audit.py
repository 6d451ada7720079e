"""Config: the settings a flag names, and the range every numeric setting is held to."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import fields

import pytest

from hotloop import config as config_mod
from hotloop.cli import _parser
from hotloop.config import Config


def _serve_dests() -> set[str]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest for a in sub.choices["serve"]._actions if a.option_strings and a.dest != "help"}


def test_flags_are_the_serve_commands_options() -> None:
    """What messages call a flag is one (and each setting with a flag is called by it)."""
    assert set(config_mod.FLAGS) == _serve_dests()
    assert set(config_mod.FLAGS) <= {f.name for f in fields(Config)}


def test_a_setting_without_a_flag_is_named_by_its_variable() -> None:
    assert config_mod._flag("backend_timeout") == "HOTLOOP_BACKEND_TIMEOUT"
    assert config_mod._flag("port") == "--port (HOTLOOP_PORT)"


NUMERIC = [
    f.name for f in fields(Config)
    if isinstance(getattr(Config(), f.name), (int, float)) and not isinstance(getattr(Config(), f.name), bool)
]


# checked when the application is made (hotloop.server.runner.make_app), with their own ranges
CHECKED_BY_MAKE_APP = {
    "flush_interval_ms", "backend_read_pause_ms", "backend_read_pause_streams", "store_commit_delay",
    "max_turn_input_items", "max_turn_input_bytes",
}


@pytest.mark.parametrize("name", [n for n in NUMERIC if n != "sim_seed" and n not in CHECKED_BY_MAKE_APP])
def test_every_numeric_setting_refuses_a_negative_value_and_nan(name: str) -> None:
    kind = type(getattr(Config(), name))
    for bad in (-1, math.nan, math.inf) if kind is float else (-1,):
        cfg = Config()
        setattr(cfg, name, kind(bad))
        with pytest.raises(ValueError, match=re.escape("--port" if name == "port" else config_mod._flag(name))):
            cfg.check()


def test_the_defaults_pass() -> None:
    Config().check()


def test_a_variable_is_read_as_its_settings_declared_type() -> None:
    """HOTLOOP_STORE_TTL_SECONDS=0.5 was refused ("expected an integer"): the default, an int,
    decided how the variable was read, though the setting is seconds as a float."""
    assert Config.from_env({"HOTLOOP_STORE_TTL_SECONDS": "0.5"}).store_ttl_seconds == 0.5
    cfg = Config()
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if value is not None:
            assert type(value).__name__ == f.type, (f.name, f.type, value)


def test_an_empty_data_dir_matters_to_the_sqlite_store_alone() -> None:
    with pytest.raises(ValueError, match=r"^--data-dir \(HOTLOOP_DATA_DIR\) must not be empty$"):
        Config(data_dir="").check()
    Config(data_dir="", store="memory").check()


@pytest.mark.parametrize(
    "url",
    [
        "redis://:q8ZtR2vKx9/Lm4PwYb7+Hc==@redis.internal:6379/0",  # an unescaped "/" ends the authority early
        "redis://:1234/Lm4PwYb7@redis.internal:6379/0",  # ... after digits, which read as a port
        "redis://:q8Zt#Lm4PwYb7@redis.internal/0",
        "http://redis.internal:6379/0",
    ],
)
def test_a_redis_url_that_cannot_be_used_is_refused_without_its_password(url: str) -> None:
    """redis-py's own error for such a URL ("Port could not be cast to integer value as
    'q8ZtR2vKx9'") quoted part of the password, in the start-up log and in ``hotloop keys``."""
    with pytest.raises(ValueError) as ei:
        Config(store="redis", redis_url=url).check_store()
    message = str(ei.value)
    assert message.startswith("--redis-url (HOTLOOP_REDIS_URL) is not a valid Redis URL")
    for secret in ("q8Zt", "Lm4PwYb7", "1234"):
        assert secret not in message
    for good in ("redis://127.0.0.1:6379/0", "rediss://user:p%2Fw@redis.internal:6380/1", "unix:///run/redis.sock"):
        Config(store="redis", redis_url=good).check_store()


@pytest.mark.parametrize(
    ("name", "bad", "good"),
    [
        # a rate whose gap between two tokens is longer than the simulator's longest silence
        ("sim_rate", config_mod.SIM_MIN_RATE / 2, config_mod.SIM_MIN_RATE),
        ("sim_rate", 1e-300, 0.0),
        ("sim_output_tokens", config_mod.SIM_MAX_TOKENS + 1, config_mod.SIM_MAX_TOKENS),
        ("sim_output_tokens", 0, 1),
        ("sim_ttft", config_mod.SIM_MAX_STALL * 2, config_mod.SIM_MAX_STALL),
    ],
)
def test_the_simulators_flags_are_held_to_what_a_request_may_ask_of_it(name: str, bad: float, good: float) -> None:
    """``--sim-rate``, ``--sim-output-tokens`` and ``--sim-ttft`` are held to the bounds a request's
    ``metadata.sim`` is (a token at least every 600 s, 100,000 tokens an answer): past them one
    flag made every answer a 100,000-token stream, or a first token due in a century."""
    cfg = Config()
    setattr(cfg, name, good)
    cfg.check()
    setattr(cfg, name, bad)
    with pytest.raises(ValueError, match=re.escape(config_mod._flag(name))):
        cfg.check()


def test_the_simulators_request_bounds_are_the_flags_bounds() -> None:
    from hotloop.backends import simulator

    assert (simulator.MAX_TOKENS, simulator.MAX_STALL, simulator.MIN_RATE) == (
        config_mod.SIM_MAX_TOKENS, config_mod.SIM_MAX_STALL, config_mod.SIM_MIN_RATE,
    )
