"""Global bounds on raw sockets: the connection limit (503 for HTTP and WebSocket upgrades, and
recovery) and the request read timeout (slow clients are closed; idle keep-alive ones are not)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import Server, run_server

READ_TIMEOUT = 1.0
WAIT = 5.0  # bound on every wait in these tests

WS_UPGRADE = (
    b"GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)
HEALTH = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def _connect(server: Server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
    s.settimeout(WAIT)
    return s


def _read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response (a Content-Length or chunked body; a chunked body is returned raw)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response head: {buf!r}")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
    if headers.get("transfer-encoding") == "chunked":
        while not body.endswith(b"0\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return status, headers, body
    want = int(headers.get("content-length", "0"))
    while len(body) < want:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def _drain(s: socket.socket, seconds: float) -> tuple[bytes, float | None]:
    """What the server sends within ``seconds``, and the seconds until it closed the socket
    (None: still open)."""
    t0 = time.monotonic()
    s.settimeout(0.05)
    out = b""
    while time.monotonic() - t0 < seconds:
        try:
            data = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionError:
            return out, time.monotonic() - t0
        if not data:
            return out, time.monotonic() - t0
        out += data
    return out, None


def _closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed the socket (after any response bytes), or None."""
    return _drain(s, seconds)[1]


# -- read timeout ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--request-read-timeout", str(READ_TIMEOUT), "--store", "memory", "--sim-rate", "0")
    with run_server(tmp_path_factory.mktemp("slow"), *args) as s:
        yield s


def test_slowloris_connections_are_closed_after_the_read_timeout(slow: Server) -> None:
    partial = [b"", b"POST /v1/resp", b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "]
    socks = []
    for i in range(30):
        s = _connect(slow)
        s.sendall(partial[i % len(partial)])
        socks.append(s)
    t0 = time.monotonic()
    for s in socks:
        assert _closed_within(s, WAIT) is not None
        s.close()
    elapsed = time.monotonic() - t0
    assert READ_TIMEOUT * 0.8 <= elapsed <= READ_TIMEOUT + 2.0
    assert "Traceback" not in slow.logs()


def test_a_slow_body_gets_408_in_the_openai_shape(slow: Server) -> None:
    s = _connect(slow)
    body = json.dumps({"model": "m", "input": "hello"}).encode()
    s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5])
    t0 = time.monotonic()
    status, headers, raw = _read_response(s)
    assert READ_TIMEOUT * 0.8 <= time.monotonic() - t0 <= READ_TIMEOUT + 2.0
    assert status == 408 and headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert json.loads(raw) == {
        "error": {"message": f"The request did not arrive within {READ_TIMEOUT:g} seconds.", "type": "invalid_request_error", "param": None, "code": "request_timeout"}
    }
    assert _closed_within(s, WAIT) is not None
    s.close()


def test_a_stalled_pipelined_request_writes_no_408_into_the_response_before_it(slow: Server) -> None:
    """The newest request's read timeout closed the connection with a 408 written into the
    middle of the streaming response of the request before it."""
    s = _connect(slow)
    first = json.dumps({"model": "m", "input": "hi", "stream": True, "metadata": {"sim": "text,tokens:100,rate:40"}}).encode()
    second = json.dumps({"model": "m", "input": "hello"}).encode()
    head = b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    s.sendall(head % len(first) + first + head % len(second) + second[:5])  # the second stalls
    out, closed = _drain(s, WAIT)
    s.close()
    assert out.startswith(b"HTTP/1.1 200") and b"text/event-stream" in out.split(b"\r\n\r\n", 1)[0]
    assert b"HTTP/1.1 408" not in out and b"request_timeout" not in out
    assert closed is not None  # closed (by the read timeout), not left open


def test_idle_keep_alive_time_is_not_counted_and_fast_requests_pass(slow: Server) -> None:
    s = _connect(slow)
    for _ in range(3):
        s.sendall(HEALTH)
        assert _read_response(s)[0] == 200
        time.sleep(READ_TIMEOUT * 1.3)  # idle between requests: longer than the read timeout
    s.sendall(HEALTH)
    assert _read_response(s)[0] == 200
    s.close()
    # a WebSocket handshake that arrives in time is served, and the connection lives on
    ws = _connect(slow)
    ws.sendall(WS_UPGRADE)
    assert _read_response(ws)[0] == 101
    assert _closed_within(ws, READ_TIMEOUT * 1.5) is None
    ws.close()


def test_a_slow_websocket_handshake_is_closed(slow: Server) -> None:
    s = _connect(slow)
    s.sendall(WS_UPGRADE[:60])
    status, _, raw = _read_response(s)
    assert status == 408 and json.loads(raw)["error"]["code"] == "request_timeout"
    s.close()


# -- connection limit -----------------------------------------------------------------------------

LIMIT = 5


def test_connection_limit_gives_503_and_recovers(tmp_path: Path) -> None:
    with run_server(tmp_path, "--max-connections", str(LIMIT), "--store", "memory") as server:
        held = []
        for _ in range(LIMIT):  # WebSocket connections stay open
            s = _connect(server)
            s.sendall(WS_UPGRADE)
            assert _read_response(s)[0] == 101
            held.append(s)
        # HTTP beyond the limit: 503 in the OpenAI shape, then closed
        s = _connect(server)
        s.sendall(HEALTH)
        status, headers, raw = _read_response(s)
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
        err = json.loads(raw)["error"]
        assert err["type"] == "server_error" and err["code"] == "server_overloaded" and err["param"] is None
        assert _closed_within(s, WAIT) is not None
        s.close()
        # a WebSocket upgrade beyond the limit: rejected with the same 503
        s = _connect(server)
        s.sendall(WS_UPGRADE)
        status, _, raw = _read_response(s)
        assert status == 503 and json.loads(raw)["error"]["code"] == "server_overloaded"
        s.close()
        # one connection closes: a new one is served again
        held.pop().close()
        deadline = time.monotonic() + WAIT
        while True:
            s = _connect(server)
            s.sendall(HEALTH)
            status = _read_response(s)[0]
            s.close()
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert status == 200
        s = _connect(server)
        s.sendall(WS_UPGRADE)
        assert _read_response(s)[0] == 101
        held.append(s)
        for s in held:
            s.close()
        assert "Traceback" not in server.logs()
