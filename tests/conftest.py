"""Shared fixtures: a real ``hotloop serve`` process on a free loopback port."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import httpx
import pytest

if TYPE_CHECKING:
    from tests.mock_chat_server import MockChatServer

STARTUP_TIMEOUT = 30.0
TERMINAL_EVENTS = ("response.completed", "response.failed", "response.incomplete", "error")


def raw_until_terminal(ws: Any) -> list[dict[str, Any]]:
    """The JSON events a sync ``websockets`` client receives up to and including a terminal
    one (or an error frame)."""
    out = []
    while True:
        e = json.loads(ws.recv(timeout=30))
        out.append(e)
        if e["type"] in TERMINAL_EVENTS:
            return out


@pytest.fixture(scope="module")
def mock() -> Iterator["MockChatServer"]:
    """The scripted chat-completions mock (tests.mock_chat_server), one per test module."""
    from tests.mock_chat_server import MockChatServer

    with MockChatServer() as m:
        yield m


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


BIND_ATTEMPTS = 3


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on ``port`` (any address: ``--host``
    may be 0.0.0.0 or ::), from Linux's ``/proc``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            for line in fh.readlines()[1:]:
                f = line.split()
                if f[1].endswith(f":{port:04X}") and f[3] == "0A":  # LISTEN
                    inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return False
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return True
    return False


def _lost_port(server: "Server") -> bool:
    """Whether ``server`` exited at start-up because its port was taken. Waits until it listens
    on its port or exits (another process holding the port would answer ``/healthz`` for it)."""
    if not os.path.exists("/proc/net/tcp"):
        return False
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while server.proc.poll() is None and time.monotonic() < deadline:
        if _listens(server.proc.pid, server.port):
            return False
        time.sleep(0.02)
    return server.proc.poll() is not None and "address already in use" in server.logs().lower()


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.base = f"http://127.0.0.1:{port}"
        self.v1 = self.base + "/v1"
        self.ws = f"ws://127.0.0.1:{port}/v1"

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def run_server(
    tmp: Path, *args: str, env: dict[str, str] | None = None, entry: tuple[str, ...] = ("-m", "hotloop")
) -> Iterator[Server]:
    """Start ``python -m hotloop serve`` with ``args``; wait for /healthz; stop it afterwards.
    ``entry``: what the interpreter runs instead of ``-m hotloop`` (a ``-c`` script that calls
    ``hotloop.cli.main(sys.argv[1:])``, say, after shortening a bound a test cannot wait out).

    The port is free when :func:`free_port` returns it, not always when the server binds it: a
    client connection of a test running alongside may take it as its own port meanwhile. A server
    that could not bind it is started again on another port (``BIND_ATTEMPTS`` in all)."""
    for attempt in range(BIND_ATTEMPTS):
        port = free_port()
        log = tmp / f"server-{port}.log"
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("HOTLOOP_DATA_DIR", str(tmp / f"data-{port}"))
        cmd = [sys.executable, *entry, "serve", "--host", "127.0.0.1", "--port", str(port), *args]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env)
        server = Server(proc, port, log)
        if not _lost_port(server) or attempt == BIND_ATTEMPTS - 1:
            break
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{server.logs()}")
            try:
                if httpx.get(server.base + "/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{server.logs()}")
            time.sleep(0.05)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        tail = server.logs()
        assert "Traceback" not in tail, f"server logged a traceback:\n{tail}"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default server: simulator (unpaced for speed), SQLite store in a temp dir."""
    with run_server(tmp_path_factory.mktemp("server"), "--sim-rate", "0") as s:
        yield s
