"""The installed ``hotloop`` command: version, help, start-up failures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import hotloop

HOTLOOP = shutil.which("hotloop") or os.path.join(os.path.dirname(sys.executable), "hotloop")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_version_both_ways() -> None:
    assert run(HOTLOOP, "--version").stdout.strip() == f"hotloop {hotloop.__version__}"
    assert run(sys.executable, "-m", "hotloop", "--version").stdout.strip() == f"hotloop {hotloop.__version__}"


def test_no_command_prints_help_and_fails() -> None:
    p = run(HOTLOOP)
    assert p.returncode == 2 and "serve" in p.stdout and "bench" in p.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (("stream", "--tokens", "0"), "--tokens: at least 1"),
        (("stream", "--rate", "-1"), "--rate: a positive number"),
        (("ws-fanout", "--stream-rate", "nan"), "--stream-rate: a positive number"),
        (("ws-loop", "--turns", "0"), "--turns: at least 1"),
        (("idle-ws", "--connections", "0"), "--connections: at least 1"),
        (("ws-fanout", "--streams", "0"), "--streams: at least 1"),
        (("loop", "--url", "notaurl", "--model", "m"), "--url: an http:// or https:// base URL"),
        (("loop", "--plot", "/nonexistent-dir/x.png"), "--plot: no writable directory"),
    ],
)
def test_bench_refuses_a_run_that_could_measure_nothing(args: tuple[str, ...], says: str) -> None:
    """A count of 0 or a rate that is not positive (a division by zero, a figure of -1e9, or a
    server that cannot start), a URL that is not one, a plot that cannot be written after the
    whole run: one line and exit 2, before anything runs."""
    p = run(HOTLOOP, "bench", *args)
    assert p.returncode == 2, (p.returncode, p.stderr[-500:])
    assert says in p.stderr and "Traceback" not in p.stderr


def test_bench_help_is_the_bench_commands_own() -> None:
    # `hotloop -h` points to `hotloop bench -h` for the scenarios and their options
    assert "hotloop bench -h" in run(HOTLOOP, "-h").stdout
    for args in (["-h"], ["--json", "-h"]):
        p = run(HOTLOOP, "bench", *args)
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("usage: hotloop bench") and "agent-turns" in p.stdout and "--turn-transport" in p.stdout


def test_misconfigured_backend_fails_clearly(tmp_path) -> None:
    """One `start-up failed` line, before the server starts (it was followed by uvicorn's lines,
    one repeating it)."""
    p = run(HOTLOOP, "serve", "--backend", "openai-compat", "--port", "0", env={"HOTLOOP_DATA_DIR": str(tmp_path)})
    assert p.returncode == 3
    assert "needs --base-url" in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.count("needs --base-url") == 1 and "uvicorn" not in p.stderr, p.stderr
    env = {k: v for k, v in os.environ.items() if k != "CEREBRAS_API_KEY"}
    env["HOTLOOP_DATA_DIR"] = str(tmp_path)
    p = subprocess.run([HOTLOOP, "serve", "--backend", "cerebras", "--port", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 3 and "CEREBRAS_API_KEY" in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.count("CEREBRAS_API_KEY") == 1 and "uvicorn" not in p.stderr, p.stderr


@pytest.mark.parametrize("flag, top", [("--flush-interval-ms", "1000"), ("--backend-read-pause-ms", "100")])
def test_milliseconds_out_of_range_stop_start_up(tmp_path, flag: str, top: str) -> None:
    var = "HOTLOOP_" + flag[2:].replace("-", "_").upper()
    for args, env in (((flag, "-1"), {}), ((), {var: str(int(top) * 5)}), ((flag, "nan"), {})):
        p = run(HOTLOOP, "serve", "--port", "0", "--store", "memory", *args, env={"HOTLOOP_DATA_DIR": str(tmp_path), **env})
        assert p.returncode == 3, (args, env, p.stderr)
        assert f"{flag} must be between 0 and {top}" in p.stderr and "Traceback" not in p.stderr


def test_read_pauses_for_no_streams_stop_start_up(tmp_path) -> None:
    p = run(HOTLOOP, "serve", "--port", "0", "--store", "memory", "--backend-read-pause-streams", "0", env={"HOTLOOP_DATA_DIR": str(tmp_path)})
    assert p.returncode == 3 and "--backend-read-pause-streams must be 1 or more" in p.stderr and "Traceback" not in p.stderr


def test_a_negative_commit_delay_stops_start_up(tmp_path) -> None:
    for flag, env in ((("--store-commit-delay", "-0.1"), {}), ((), {"HOTLOOP_STORE_COMMIT_DELAY": "nan"})):
        p = run(HOTLOOP, "serve", "--port", "0", *flag, env={"HOTLOOP_DATA_DIR": str(tmp_path), **env})
        assert p.returncode == 3, (flag, env, p.stderr)
        assert "--store-commit-delay must be 0 or more seconds" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("env, says", [
    ({"HOTLOOP_PORT": "abc"}, "HOTLOOP_PORT='abc': expected an integer"),
    ({"HOTLOOP_SHUTDOWN_GRACE": "1.5"}, "HOTLOOP_SHUTDOWN_GRACE='1.5': expected an integer"),
    ({"HOTLOOP_METRICS": "garbage"}, "HOTLOOP_METRICS='garbage': expected one of 1, true"),
])
def test_an_environment_value_of_the_wrong_type_is_refused_like_a_flag(tmp_path, env: dict[str, str], says: str) -> None:
    p = run(HOTLOOP, "serve", "--port", "0", env={"HOTLOOP_DATA_DIR": str(tmp_path), **env})
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("args, env, says", [
    ((), {"HOTLOOP_LOG_FORMAT": "xml"}, "--log-format (HOTLOOP_LOG_FORMAT) must be one of text, json"),
    ((), {"HOTLOOP_BACKEND_TRANSPORT": "bogus"}, "--backend-transport (HOTLOOP_BACKEND_TRANSPORT) must be one of lean, sdk"),
    ((), {"HOTLOOP_LOG_LEVEL": "verbose"}, "--log-level (HOTLOOP_LOG_LEVEL) must be one of"),
    (("--request-read-timeout", "nan"), {}, "--request-read-timeout (HOTLOOP_REQUEST_READ_TIMEOUT) must be a positive"),
    (("--request-read-timeout", "0"), {}, "--request-read-timeout (HOTLOOP_REQUEST_READ_TIMEOUT) must be a positive"),
    (("--max-connections", "0"), {}, "--max-connections (HOTLOOP_MAX_CONNECTIONS) must be 1 or more"),
    (("--port", "70000"), {}, "--port must be between 0 and 65535"),
    (("--workers", "0"), {}, "--workers (HOTLOOP_WORKERS) must be 1 or more"),
    (("--shutdown-grace", "-5"), {}, "--shutdown-grace (HOTLOOP_SHUTDOWN_GRACE) must be 0 or more seconds"),
    (("--store-max-lag", "-1"), {}, "--store-max-lag (HOTLOOP_STORE_MAX_LAG) must be 0 or more seconds"),
    ((), {"HOTLOOP_STORE_MAX_LAG": "nan"}, "--store-max-lag (HOTLOOP_STORE_MAX_LAG) must be 0 or more seconds"),
    (("--sim-ttft", "-3"), {}, "--sim-ttft (HOTLOOP_SIM_TTFT) must be between 0 and 600 seconds"),
    (("--sim-rate", "-1"), {}, "--sim-rate (HOTLOOP_SIM_RATE) must be 0 (unpaced) or at least 0.00166667 tokens"),
    (("--sim-rate", "inf"), {}, "--sim-rate (HOTLOOP_SIM_RATE) must be 0 (unpaced) or at least"),
    (("--sim-rate", "1e-300"), {}, "--sim-rate (HOTLOOP_SIM_RATE) must be 0 (unpaced) or at least"),
    (("--sim-output-tokens", "-5"), {}, "--sim-output-tokens (HOTLOOP_SIM_OUTPUT_TOKENS) must be between 1 and 100000"),
    (("--sim-output-tokens", "100001"), {}, "--sim-output-tokens (HOTLOOP_SIM_OUTPUT_TOKENS) must be between 1 and 100000"),
])
def test_settings_no_server_can_run_with_stop_start_up(tmp_path, args: tuple[str, ...], env: dict[str, str], says: str) -> None:
    p = run(HOTLOOP, "serve", "--port", "0", *args, env={"HOTLOOP_DATA_DIR": str(tmp_path), **env})
    assert p.returncode == 3 and says in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_what_start_up_meets_is_one_line_and_exit_3(tmp_path, workers: str) -> None:
    """A missing script, an unusable data dir, a backend URL the backend's start refuses (in the
    application's start-up, where uvicorn exits 3 itself: a worker used to exit 1 with a traceback
    and be restarted for ever): one line, exit 3, and workers are not restarted in a loop (the
    first generation failing stops the server)."""
    blocked = tmp_path / "blocked"
    (blocked / "hotloop.sqlite3").mkdir(parents=True)  # the database file is a directory
    bad_url = ("--backend", "openai-compat", "--base-url", "http://alice:pw/x@example.com/v1", "--model", "m")
    for args, env, says in (
        (("--sim-script", str(tmp_path / "missing.json")), {"HOTLOOP_DATA_DIR": str(tmp_path / "d")}, f"simulator script {tmp_path / 'missing.json'}: [Errno 2]"),
        ((), {"HOTLOOP_DATA_DIR": str(blocked)}, "start-up failed"),
        (bad_url, {"HOTLOOP_DATA_DIR": str(tmp_path / "u")}, "not a valid http(s) URL: 'http://***@example.com/v1'"),
    ):
        p = run(HOTLOOP, "serve", "--port", "0", "--workers", workers, *args, env=env)
        assert p.returncode == 3, (args, p.stderr)
        assert says in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.count("started worker") <= int(workers), p.stderr  # no restarts


def test_a_bad_simulator_script_is_named_and_json_logs_stay_json_from_the_first_line(tmp_path) -> None:
    """A script that is not JSON was refused with json's message alone (no file, no flag); and
    under --log-format json, a setting refused before logging was set up came out as text."""
    bad = tmp_path / "bad.json"
    bad.write_text("{bad")
    env = {"HOTLOOP_DATA_DIR": str(tmp_path / "d")}
    p = run(HOTLOOP, "serve", "--port", "0", "--sim-script", str(bad), env=env)
    assert p.returncode == 3 and f"simulator script {bad}: Expecting property name" in p.stderr, p.stderr
    for args, extra, code in (
        (("--port", "70000"), {}, 3),
        (("--port", "70000", "--workers", "2"), {}, 3),
        (("--port", "0"), {"HOTLOOP_SHUTDOWN_GRACE": "x"}, 2),
    ):
        p = run(HOTLOOP, "serve", "--log-format", "json", *args, env={**env, **extra})
        assert p.returncode == code, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert lines and all(json.loads(line)["level"] for line in lines), p.stderr
        assert json.loads(lines[-1])["level"] == "error", p.stderr


def test_keys_and_usage_say_in_one_line_when_they_cannot_open_the_store(tmp_path) -> None:
    (tmp_path / "blocked" / "hotloop.sqlite3").mkdir(parents=True)
    for args in (
        ("keys", "list", "--data-dir", str(tmp_path / "blocked")),
        ("usage", "--data-dir", str(tmp_path / "blocked")),
    ):
        p = run(HOTLOOP, *args)
        assert p.returncode == 1 and "cannot open the store" in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    # a URL that names no Redis is a setting's error, said before anything is opened
    p = run(HOTLOOP, "keys", "list", "--store", "redis", "--redis-url", "notaurl")
    assert p.returncode == 2 and "is not a valid Redis URL" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_the_redis_store_without_its_package_is_one_line_naming_the_extra(tmp_path) -> None:
    """redis-py is an extra (hotloop[redis]): without it, `--store redis` said ModuleNotFoundError
    (serve) or printed a traceback (keys)."""
    fake = tmp_path / "site" / "redis"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'redis'\", name='redis')\n")
    env = {"PYTHONPATH": str(tmp_path / "site"), "HOTLOOP_DATA_DIR": str(tmp_path / "d")}
    for args, code in ((("keys", "list", "--store", "redis"), 1), (("serve", "--port", "0", "--store", "redis"), 3)):
        p = run(HOTLOOP, *args, env=env)
        assert p.returncode == code, (args, p.stderr)
        assert "pip install 'hotloop[redis]'" in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_a_reader_that_stops_early_is_no_store_failure(tmp_path) -> None:
    """``hotloop keys list | head`` (the reader gone before the output is written): it printed
    "cannot open the store: BrokenPipeError" and exited 1, which a ``pipefail`` script reads as
    a failure. It exits 0, quietly."""
    env = {**os.environ, "HOTLOOP_DATA_DIR": str(tmp_path / "d")}
    made = run(HOTLOOP, "keys", "create", "alice", env=env)
    assert made.returncode == 0, made.stderr
    proc = subprocess.Popen([HOTLOOP, "keys", "list"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before it writes
    err = proc.stderr.read().decode()
    assert proc.wait(30) == 0, err
    assert "BrokenPipe" not in err and "cannot open the store" not in err, err


def test_a_store_file_that_cannot_be_written_stops_start_up(tmp_path) -> None:
    """SQLite opens a file it may only read read-only, without a word: the server started, and
    then answered every response ``completed`` while storing none. Start-up now fails, in one
    line (run without the capability that lets root write anyway)."""
    from hotloop.state.store import SQLiteStore
    from hotloop.tenants.keys import SQLiteKeyStore

    db = tmp_path / "hotloop.sqlite3"
    SQLiteStore(db).close()  # a store an earlier server made: its schema whole, nothing to add
    SQLiteKeyStore(str(db)).close()
    db.chmod(0o400)
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"] if os.geteuid() == 0 else []
    p = subprocess.run(
        [*prefix, HOTLOOP, "serve", "--port", "0"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "HOTLOOP_DATA_DIR": str(tmp_path)},
    )
    assert p.returncode == 3, p.stderr
    assert "start-up failed" in p.stderr and "can be read but not written" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "uvicorn running" not in p.stderr.lower()
    # hotloop usage only reads: the file will do
    p = subprocess.run(
        [*prefix, HOTLOOP, "usage"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "HOTLOOP_DATA_DIR": str(tmp_path)},
    )
    assert p.returncode == 0 and not p.stderr, p.stderr
