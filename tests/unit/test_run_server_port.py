"""The tests' own server start (``tests.conftest.run_server``): a port taken between
``free_port`` and the server's bind (a client connection of a test running alongside may take it
as its own) starts the server again on another port, never yields another process's server."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

import tests.conftest as conftest


def test_a_taken_port_is_not_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as hog:
        hog.bind(("127.0.0.1", 0))
        hog.listen()
        taken = hog.getsockname()[1]
        handed = iter([taken])
        free = conftest.free_port
        monkeypatch.setattr(conftest, "free_port", lambda: next(handed, 0) or free())
        with conftest.run_server(tmp_path, "--sim-rate", "0") as server:
            assert server.port != taken
            assert conftest._listens(server.proc.pid, server.port)
            assert not conftest._listens(server.proc.pid, taken)
            assert httpx.get(server.base + "/healthz", timeout=5).json()["status"] == "ok"
        assert len(list(tmp_path.glob("server-*.log"))) == 2  # the first start's log is kept
