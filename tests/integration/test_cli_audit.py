"""The operator's command line: values an operator can get wrong are refused at start-up in one
line (exit 2 for a value of the wrong type, 3 for one ``hotloop serve`` cannot run with), never
accepted to fail later, and never echoed when they are secrets."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

HOTLOOP = shutil.which("hotloop") or os.path.join(os.path.dirname(sys.executable), "hotloop")


def run(*args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HOTLOOP, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}, cwd=cwd
    )


def test_an_empty_host_is_refused_not_bound_to_every_interface(tmp_path) -> None:
    """``HOTLOOP_HOST=`` (an unset variable in a unit file) bound 0.0.0.0 and :: (asyncio's
    reading of an empty host): every interface instead of the loopback default."""
    for args, env in (((), {"HOTLOOP_HOST": ""}), (("--host", ""), {}), (("--host", "  "), {})):
        p = run("serve", "--port", "0", *args, env={"HOTLOOP_DATA_DIR": str(tmp_path), **env})
        assert p.returncode == 3, (args, env, p.stderr)
        assert p.stderr == "hotloop: start-up failed: --host (HOTLOOP_HOST) must not be empty\n", p.stderr


def test_an_empty_data_dir_is_refused_not_the_working_directory(tmp_path) -> None:
    """``HOTLOOP_DATA_DIR=`` put the store (every tenant's responses, the keys' hashes) and its
    fingerprint key in the working directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = run("serve", "--port", "0", env={"HOTLOOP_DATA_DIR": ""}, cwd=str(cwd))
    assert p.returncode == 3, p.stderr
    assert p.stderr == "hotloop: start-up failed: --data-dir (HOTLOOP_DATA_DIR) must not be empty\n", p.stderr
    for args in (("keys", "create", "k", "--data-dir", ""), ("keys", "list"), ("usage",)):
        p = run(*args, env={"HOTLOOP_DATA_DIR": ""}, cwd=str(cwd))
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr == f"hotloop {args[0]}: error: --data-dir (HOTLOOP_DATA_DIR) must not be empty\n", p.stderr
        assert p.stdout == ""
    assert list(cwd.iterdir()) == []


def test_a_data_dir_under_a_tilde_is_in_the_home_directory(tmp_path) -> None:
    """``HOTLOOP_DATA_DIR=~/hl`` (systemd's Environment= and docker's env files do not expand it)
    and ``--data-dir=~/hl`` (nor does the shell) made a directory named ``~`` in the working one."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    p = run("keys", "create", "k", env={"HOME": str(home), "HOTLOOP_DATA_DIR": "~/hl"}, cwd=str(cwd))
    assert p.returncode == 0, p.stderr
    assert (home / "hl" / "hotloop.sqlite3").is_file()
    p = run("keys", "list", "--data-dir=~/hl", env={"HOME": str(home)}, cwd=str(cwd))
    assert p.returncode == 0 and p.stdout.splitlines()[1].startswith("k "), p.stderr
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("args", [("keys", "list"), ("keys", "create", "k"), ("usage",)])
def test_a_bad_environment_value_under_keys_and_usage_is_one_line(tmp_path, args: tuple[str, ...]) -> None:
    """A HOTLOOP_* value of the wrong type (shared with `serve`'s environment) printed a
    traceback and exit 1 from `hotloop keys` and `hotloop usage`."""
    p = run(*args, env={"HOTLOOP_DATA_DIR": str(tmp_path), "HOTLOOP_PORT": "abc"})
    assert p.returncode == 2, p.stderr
    assert p.stderr == f"hotloop {args[0]}: error: HOTLOOP_PORT='abc': expected an integer\n", p.stderr


def test_a_bad_store_under_keys_and_usage_is_a_usage_error(tmp_path) -> None:
    for args in (("keys", "list"), ("usage",)):
        p = run(*args, env={"HOTLOOP_DATA_DIR": str(tmp_path), "HOTLOOP_STORE": "bogus"})
        assert p.returncode == 2, p.stderr
        assert p.stderr == f"hotloop {args[0]}: error: --store (HOTLOOP_STORE) must be one of sqlite, memory, redis; got 'bogus'\n"


@pytest.mark.parametrize("key", ["", " hl-secret-1234", "hl-secret-1234\n", "hl-secret\t1234"])
def test_an_admin_key_no_client_can_send_is_refused_unechoed(tmp_path, key: str) -> None:
    """An empty admin key left the server open (no authentication, and no warning on a loopback
    address); one with surrounding whitespace (a secret file's newline) or a control character
    can never match a bearer token (the field's value is trimmed), so the admin key never worked."""
    for args, env in ((("--api-key", key), {}), ((), {"HOTLOOP_API_KEY": key})):
        p = run("serve", "--port", "0", *args, env={"HOTLOOP_DATA_DIR": str(tmp_path), **env})
        assert p.returncode == 3, (key, p.stderr)
        want = (
            "--api-key (HOTLOOP_API_KEY) must not be empty (unset it for no admin key)" if not key else
            "--api-key (HOTLOOP_API_KEY) must not begin or end with whitespace nor hold a control character"
        )
        assert p.stderr == f"hotloop: start-up failed: {want}\n", p.stderr
        assert "secret" not in p.stderr


@pytest.mark.parametrize("var, value, says", [
    ("HOTLOOP_RESPONSE_CACHE_ENTRIES", "-1", "HOTLOOP_RESPONSE_CACHE_ENTRIES must be 0 or more; got -1"),
    ("HOTLOOP_WS_CACHE_BYTES", "-5", "HOTLOOP_WS_CACHE_BYTES must be 0 or more; got -5"),
    ("HOTLOOP_STORE_MAX_RESPONSES", "-1", "HOTLOOP_STORE_MAX_RESPONSES must be 0 or more; got -1"),
    ("HOTLOOP_STORE_TTL_SECONDS", "nan", "HOTLOOP_STORE_TTL_SECONDS must be 0 or more; got nan"),
    ("HOTLOOP_STORE_TTL_SECONDS", "inf", "HOTLOOP_STORE_TTL_SECONDS must be 0 or more; got inf"),
])
def test_a_negative_bound_stops_start_up(tmp_path, var: str, value: str, says: str) -> None:
    """HOTLOOP_RESPONSE_CACHE_ENTRIES=-1 started a server whose every response ended in an
    unhandled error (a traceback in the log) after its answer, and was never stored;
    HOTLOOP_STORE_TTL_SECONDS=inf, one whose Redis store failed every write (int(inf))."""
    p = run("serve", "--port", "0", env={"HOTLOOP_DATA_DIR": str(tmp_path), var: value})
    assert p.returncode == 3, p.stderr
    assert p.stderr == f"hotloop: start-up failed: {says}\n", p.stderr


def test_a_setting_without_a_flag_is_named_by_its_variable_alone(tmp_path) -> None:
    """The message named a flag that does not exist (`--backend-timeout (HOTLOOP_BACKEND_TIMEOUT)`)."""
    p = run("serve", "--port", "0", env={"HOTLOOP_DATA_DIR": str(tmp_path), "HOTLOOP_BACKEND_TIMEOUT": "0"})
    assert p.returncode == 3, p.stderr
    assert p.stderr == "hotloop: start-up failed: HOTLOOP_BACKEND_TIMEOUT must be a positive number of seconds; got 0.0\n"


def test_an_unreachable_redis_store_is_named_without_its_password() -> None:
    """``hotloop keys list --store redis`` printed the whole ``--redis-url``, password included."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for command in (["keys", "list"], ["usage"]):
        proc = subprocess.run(
            [sys.executable, "-m", "hotloop", *command, "--store", "redis", "--redis-url", f"redis://:hunter2-pw@127.0.0.1:{port}/0"],
            capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 1, proc.stderr
        assert "hunter2-pw" not in proc.stderr + proc.stdout
        assert f"the store at redis://***@127.0.0.1:{port}/0 is unreachable" in proc.stderr


def test_a_limit_that_is_not_a_number_is_said_so(tmp_path: Any) -> None:
    """``hotloop keys create k --rpm abc`` said "invalid _positive value: 'abc'" (a function's name)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hotloop", "keys", "create", "k", "--rpm", "abc", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "argument --rpm: 'abc' is not an integer" in proc.stderr and "_positive" not in proc.stderr


@pytest.mark.parametrize("backend", ["openai-compat", "cerebras"])
def test_a_base_url_that_is_not_http_is_one_start_up_line(tmp_path: Any, backend: str) -> None:
    """A base URL of another scheme was found once the application started: three error lines
    (hotloop's, then uvicorn's twice). Now one line, before anything starts, without the
    URL's password."""
    env = {**os.environ, "HOTLOOP_DATA_DIR": str(tmp_path), "CEREBRAS_API_KEY": "csk-test"}
    proc = subprocess.run(
        [HOTLOOP, "serve", "--backend", backend, "--base-url", "ftp://u:pw-secret@host/v1", "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode == 3, proc.stderr
    errors_ = [line for line in proc.stderr.splitlines() if "ERROR" in line or "start-up failed" in line]
    assert len(errors_) == 1 and "is not an http(s) URL: 'ftp://***@host" in errors_[0], proc.stderr
    assert "pw-secret" not in proc.stderr + proc.stdout and "Uvicorn running" not in proc.stderr
