"""Graceful shutdown: SIGTERM to a real server mid-stream (SSE, WebSocket) lets the response
finish (within ``--shutdown-grace``), flushes the store, and the response is readable after a
restart; the WebSocket is then closed with 1001 and the process exits 0. A response still running
when the grace ends fails with ``server_error``."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.conftest import run_server


# a 1.5 s answer (60 tokens at 40/s): SIGTERM after its first events lands mid-response
SLOW = ("--sim-rate", "40", "--sim-output-tokens", "60", "--shutdown-grace", "20")


def data_env(tmp_path: Path) -> dict[str, str]:
    """One data directory for the server and the one restarted after it."""
    return {"HOTLOOP_DATA_DIR": str(tmp_path / "data")}


def stream_with_sigterm(s: Any, events: list[dict[str, Any]]) -> float:
    """POST a streamed response, send the server SIGTERM after its third event, read to the end;
    when the signal was sent (``time.monotonic()``)."""
    body = {"model": "hotloop-sim", "input": "hi", "stream": True}
    sent = 0.0
    with httpx.stream("POST", s.v1 + "/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[len("data: "):]))
            if len(events) == 3:
                s.proc.send_signal(signal.SIGTERM)  # mid-stream
                sent = time.monotonic()
    assert sent
    return sent


def test_sigterm_mid_stream_finishes_and_persists(tmp_path: Path) -> None:
    env = data_env(tmp_path)
    events: list[dict[str, Any]] = []
    with run_server(tmp_path, *SLOW, env=env) as s:
        sent = stream_with_sigterm(s, events)  # ~1.5 s of output still to come
        assert events[-1]["type"] == "response.completed", events[-1]
        assert time.monotonic() - sent > 0.5  # the stream really was in flight when the signal came
        assert s.proc.wait(timeout=20) == 0  # a graceful stop, though a signal asked for it
        # new connections are refused once it is stopping (the process is gone now)
        try:
            httpx.get(s.base + "/healthz", timeout=1)
            refused = False
        except httpx.HTTPError:
            refused = True
        assert refused
    resp = events[-1]["response"]
    assert isinstance(resp, dict)
    with run_server(tmp_path, env=env) as s2:
        got = httpx.get(f"{s2.v1}/responses/{resp['id']}", timeout=5)
        assert got.status_code == 200 and got.json()["status"] == "completed"
        assert got.json()["output"] == resp["output"]


def test_sigterm_lets_a_websocket_response_finish(tmp_path: Path) -> None:
    env = data_env(tmp_path)
    frames: list[dict[str, Any]] = []
    with run_server(tmp_path, *SLOW, env=env) as s:
        with ws_connect(s.ws + "/responses", open_timeout=10) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi"}))
            while True:
                try:
                    frames.append(json.loads(ws.recv(timeout=20)))
                except ConnectionClosed:
                    break
                if len(frames) == 3:
                    s.proc.send_signal(signal.SIGTERM)
                    time.sleep(0.3)  # the server is stopping now
                    # a new response on the open connection is refused: it would outlive the stop
                    ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "more"}))
                if frames[-1]["type"] in ("response.completed", "response.failed", "error"):
                    break
            assert frames[-1]["type"] == "response.completed", frames[-1]
            refused = json.loads(ws.recv(timeout=10))
            assert refused["type"] == "error" and refused["status"] == 503, refused
            assert refused["error"]["code"] == "server_error" and "shutting down" in refused["error"]["message"]
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        assert s.proc.wait(timeout=20) == 0
    rid = frames[-1]["response"]["id"]
    with run_server(tmp_path, env=env) as s2:
        got = httpx.get(f"{s2.v1}/responses/{rid}", timeout=5)
        assert got.status_code == 200 and got.json()["status"] == "completed"


# a 6 s answer (60 tokens at 10/s) against a 1 s grace: it cannot finish
ENDLESS = ("--sim-rate", "10", "--sim-output-tokens", "60", "--shutdown-grace", "1")


def test_a_response_outliving_the_grace_fails_with_server_error(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    frames: list[dict[str, Any]] = []
    with run_server(tmp_path, *ENDLESS) as s:
        with ws_connect(s.ws + "/responses", open_timeout=10) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi"}))
            frames.append(json.loads(ws.recv(timeout=10)))  # response.created: both run now
            sent = stream_with_sigterm(s, events)
            ended = time.monotonic() - sent
            while True:
                try:
                    frames.append(json.loads(ws.recv(timeout=10)))
                except ConnectionClosed as closed:
                    assert closed.rcvd is not None and closed.rcvd.code == 1001
                    break
        assert s.proc.wait(timeout=20) == 0
    for last in (events[-1], [f for f in frames if f["type"].startswith("response.")][-1]):
        assert last["type"] == "response.failed", last
        assert last["response"]["error"]["code"] == "server_error"
        assert "shutting down" in last["response"]["error"]["message"]
    assert 0.8 < ended < 4.5, ended  # at the grace's end, not at the answer's (6 s)
    # the partial output the client saw is in the failed response
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas
