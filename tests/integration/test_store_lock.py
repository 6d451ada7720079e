"""One SQLite store, one server: a single-process server refuses to start beside another server
on its data directory, and a ``--workers`` server beside a single-process one (they do not
coordinate: one served what the other had deleted). Two ``--workers`` servers share it (a
rolling restart), and a server starts once the one before it has stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import free_port, run_server

REFUSAL = "another hotloop server is using the store"


def _refused(data: Path, *args: str) -> str:
    """Start a server on ``data`` that must refuse to: its log (it exits 3 at once)."""
    cmd = [sys.executable, "-m", "hotloop", "serve", "--host", "127.0.0.1", "--port", str(free_port()), *args]
    env = {"HOTLOOP_DATA_DIR": str(data), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)
    return done.stdout + done.stderr


def test_a_single_server_keeps_its_store_to_itself(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with run_server(tmp_path, "--sim-rate", "0", env={"HOTLOOP_DATA_DIR": str(data)}) as s:
        made = httpx.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi"}, timeout=30)
        assert made.status_code == 200
        for args in ((), ("--workers", "2")):
            log = _refused(data, *args)
            assert REFUSAL in log and "--workers" in log and "Traceback" not in log, log
        assert httpx.get(s.v1 + f"/responses/{made.json()['id']}", timeout=10).status_code == 200  # untouched
    # stopped: the next one starts, and finds what the first stored
    with run_server(tmp_path, "--sim-rate", "0", env={"HOTLOOP_DATA_DIR": str(data)}) as s:
        assert httpx.get(s.v1 + f"/responses/{made.json()['id']}", timeout=10).status_code == 200


def test_workers_servers_share_a_store_and_a_single_one_stays_out(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {"HOTLOOP_DATA_DIR": str(data)}
    with run_server(tmp_path, "--sim-rate", "0", "--workers", "2", env=env) as a:
        with run_server(tmp_path, "--sim-rate", "0", "--workers", "2", env=env) as b:  # a rolling restart
            made = httpx.post(a.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi"}, timeout=30)
            assert made.status_code == 200
            assert httpx.get(b.v1 + f"/responses/{made.json()['id']}", timeout=10).status_code == 200
        log = _refused(data)
        assert REFUSAL in log, log
