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


POST_HEAD = b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


def _slow_request(stream: bool, tokens: int = 60) -> bytes:
    """A request whose response takes about ``tokens / 40`` seconds (longer than the read timeout)."""
    body = json.dumps({"model": "m", "input": "hi", "stream": stream, "metadata": {"sim": f"text,tokens:{tokens},rate:40"}})
    return POST_HEAD % len(body) + body.encode()


def _first_response_end(out: bytes, stream: bool) -> int:
    """Where the first response on a connection ends in ``out`` (-1: it did not)."""
    if stream:
        end = out.find(b"\r\n0\r\n\r\n")
        return -1 if end < 0 or b"response.completed" not in out[:end] else end + 7
    head_end = out.find(b"\r\n\r\n")
    if head_end < 0:
        return -1
    length = int(out[:head_end].lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    end = head_end + 4 + length
    return end if len(out) >= end and b'"status":"completed"' in out[:end] else -1


def test_a_stalled_pipelined_request_gets_its_408_after_the_response_before_it(slow: Server) -> None:
    """The newest request's read timeout closed the connection with a 408 written into the
    middle of the streaming response of the request before it. Now that response is written
    whole, then the stalled request's 408, then the connection closes."""
    s = _connect(slow)
    second = json.dumps({"model": "m", "input": "hello"}).encode()
    s.sendall(_slow_request(True, 100) + POST_HEAD % len(second) + second[:5])  # the second stalls
    out, closed = _drain(s, WAIT)
    s.close()
    assert out.startswith(b"HTTP/1.1 200") and b"text/event-stream" in out.split(b"\r\n\r\n", 1)[0]
    end = _first_response_end(out, True)
    assert end > 0 and out[end:].startswith(b"HTTP/1.1 408") and out.count(b"HTTP/1.1 408") == 1
    assert closed is not None  # closed (after the read timeout), not left open


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_a_next_head_that_stalls_is_answered_after_the_running_response(slow: Server, stream: bool) -> None:
    """The next request's head stalls while a response longer than the read timeout is being
    made: a 408 written at once was the first answer on the connection (a client pairs it
    with its valid request, and the SDKs resend a POST on a 408)."""
    s = _connect(slow)
    s.sendall(_slow_request(stream))
    time.sleep(0.1)
    s.sendall(b"GET /heal")
    out, closed = _drain(s, WAIT)
    s.close()
    end = _first_response_end(out, stream)
    assert out.startswith(b"HTTP/1.1 200") and end > 0, out[:300]
    assert out[end:].startswith(b"HTTP/1.1 408") and closed is not None


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_a_malformed_pipelined_request_is_answered_after_the_one_before_it(slow: Server, stream: bool) -> None:
    s = _connect(slow)
    s.sendall(_slow_request(stream))
    time.sleep(0.2)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
    out, closed = _drain(s, WAIT)
    s.close()
    end = _first_response_end(out, stream)
    assert out.startswith(b"HTTP/1.1 200") and end > 0, out[:300]
    assert out[end:].startswith(b"HTTP/1.1 400") and b"invalid_http_request" in out[end:] and closed is not None


def test_a_pipelined_request_with_a_malformed_body_is_answered_after_the_one_before_it(slow: Server) -> None:
    """Its 400 waits for the response before it; the request itself never runs."""
    s = _connect(slow)
    s.sendall(_slow_request(True))
    time.sleep(0.2)
    s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    out, closed = _drain(s, WAIT)
    s.close()
    end = _first_response_end(out, True)
    assert out.startswith(b"HTTP/1.1 200") and end > 0, out[:300]
    assert out[end:].startswith(b"HTTP/1.1 400") and out.count(b"HTTP/1.1 200") == 1 and closed is not None


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_a_pipelined_websocket_handshake_is_refused_after_the_response_before_it(slow: Server, stream: bool) -> None:
    """Switched at once, its 101 went inside (or ahead of) the running response, whose bytes
    then went onto the WebSocket."""
    s = _connect(slow)
    s.sendall(_slow_request(stream))
    time.sleep(0.2)
    s.sendall(WS_UPGRADE)
    out, closed = _drain(s, WAIT)
    s.close()
    end = _first_response_end(out, stream)
    assert out.startswith(b"HTTP/1.1 200") and end > 0 and b"HTTP/1.1 101" not in out, out[:300]
    assert out[end:].startswith(b"HTTP/1.1 400") and closed is not None


def test_a_request_the_server_holds_back_is_not_timed_out(slow: Server) -> None:
    """A pipelined request waits, unread, for the response before it (the server pauses
    reading): its read timeout does not run meanwhile (it had cut that streaming response)."""
    second = json.dumps({"model": "m", "input": "x" * 200_000}).encode()  # read into its own buffer
    s = _connect(slow)
    s.sendall(_slow_request(True, 100))
    time.sleep(0.2)
    s.sendall(POST_HEAD % len(second) + second)  # whole, at once: the client is not slow
    out = b""
    deadline = time.monotonic() + WAIT * 2
    while out.count(b"HTTP/1.1 200") < 2 or not out.endswith(b"}"):
        if time.monotonic() > deadline:
            break
        out += _drain(s, 0.5)[0]
    s.close()
    assert _first_response_end(out, True) > 0 and out.count(b"HTTP/1.1 200") == 2, out[-300:]


def test_an_empty_line_after_a_response_does_not_keep_the_connection(slow: Server) -> None:
    """Bytes that begin no request (an empty line, which RFC 9112 lets a server ignore before a
    request line) had stopped the keep-alive timer (uvicorn's default, 5 s) for good, and the
    read timer never ran: such connections stayed open, and took every place in the server."""
    s = _connect(slow)
    s.sendall(HEALTH)
    assert _read_response(s)[0] == 200
    s.sendall(b"\r\n")
    t0 = time.monotonic()
    out, closed = _drain(s, 5 + WAIT)
    s.close()
    assert closed is not None and 4 < time.monotonic() - t0 and out == b""  # idle: no 408 either


_PADDED = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + (b"X-Pad: " + b"a" * 8000 + b"\r\n") * 12
_HEAD70 = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + (b"X-Pad: " + b"a" * 7000 + b"\r\n") * 10 + b"\r\n"


@pytest.mark.parametrize(
    "pieces",
    [
        [_PADDED],  # fields
        [b"GET /" + b"a" * 100_000],  # an endless URL
        [_PADDED + b"\r\n"],  # a whole head, in one read
        [_HEAD70[i : i + 8000] for i in range(0, len(_HEAD70), 8000)],  # 70 KB, the last read ending it
    ],
    ids=["fields", "url", "complete", "complete-in-pieces"],
)
def test_an_oversized_request_head_gets_431_and_a_close(slow: Server, pieces: list[bytes]) -> None:
    """The parser keeps a field, and the URL, until it ends: one unfinished head of 300 MB of
    fields took 300 MB, and a 64 MB URL 12 s of CPU. Now a head is at most 64 KiB, the read that
    completes it counted too (heads of up to 128 KiB that ended within a read were taken)."""
    s = _connect(slow)
    try:
        for piece in pieces:
            s.sendall(piece)
            if len(pieces) > 1:
                time.sleep(0.02)  # a read each
    except ConnectionError:
        pass
    status, headers, raw = _read_response(s)
    assert status == 431 and headers["connection"] == "close"
    assert json.loads(raw)["error"]["code"] == "request_header_fields_too_large"
    assert _closed_within(s, WAIT) is not None
    s.close()
    assert "Traceback" not in slow.logs()


def test_a_request_head_within_the_bound_is_answered(slow: Server) -> None:
    """60 KB of fields, in one read and in pieces: under the 64 KiB bound, answered."""
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + (b"X-Pad: " + b"a" * 6000 + b"\r\n") * 10 + b"\r\n"
    for pieces in ([head], [head[i : i + 8000] for i in range(0, len(head), 8000)]):
        s = _connect(slow)
        for piece in pieces:
            s.sendall(piece)
            time.sleep(0.02)
        status, _, _ = _read_response(s)
        s.close()
        assert status == 200


def test_the_body_of_a_request_with_an_unknown_upgrade_is_read_as_its_body(slow: Server) -> None:
    """curl --http2 offers h2c on every request. The parser took any upgrade request as bodiless
    and parsed its body as further requests: through a front proxy that reads it as a body,
    another client's connection would carry them (request smuggling)."""
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    s = _connect(slow)
    s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
              b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled)
    status, _, raw = _read_response(s)
    assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_json"  # the body, taken as one
    body = json.dumps({"model": "m", "input": "hi"}).encode()
    s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    status, _, raw = _read_response(s)
    assert status == 200 and json.loads(raw)["status"] == "completed"  # the connection is still in step
    out, _ = _drain(s, 0.5)
    assert b"smuggled" not in out
    # a body it cannot read as one (chunked): refused, and the connection closed
    s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(smuggled), smuggled))
    status, _, raw = _read_response(s)
    assert status == 400 and json.loads(raw)["error"]["code"] == "unsupported_upgrade"
    out, closed = _drain(s, WAIT)
    assert closed is not None and b"smuggled" not in out
    s.close()


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


def test_an_unknown_upgrade_whose_head_ends_across_reads_is_served_not_left_hanging(slow: Server) -> None:
    """The head's blank line split across reads: the parser stops at an upgrade's head and takes
    nothing after it, so the body's first bytes, fed with the head's end, were lost, and the
    request waited for them until the read timeout. The head's end is found across the reads,
    so the request is served as one whose head came in one read is."""
    body = b'{"model": "m", "input": "hi"}'
    head = (b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    s = _connect(slow)
    s.sendall(head[:-1])
    time.sleep(0.2)
    s.sendall(head[-1:] + body)
    t0 = time.monotonic()
    status, _, raw = _read_response(s)
    assert status == 200 and json.loads(raw)["status"] == "completed" and time.monotonic() - t0 < READ_TIMEOUT
    s.close()


def test_an_error_after_a_response_held_by_its_cork_comes_after_it(tmp_path: Path) -> None:
    """With the access log on, a JSON response is written corked: the 400 of the bytes after
    its request was written and the connection closed before the cork let the response go."""
    with run_server(tmp_path, "--store", "memory", "--sim-rate", "0", "--access-log") as server:
        body = json.dumps({"model": "m", "input": "hi"}).encode()
        s = _connect(server)
        s.sendall(POST_HEAD % len(body) + body + b"BAD REQUEST LINE\r\n\r\n")
        out, closed = _drain(s, WAIT)
        s.close()
        assert out.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 400" in out and out.index(b"HTTP/1.1 400") > 0
        assert closed is not None


def _scrape(server: Server) -> dict[tuple[str, str], float]:
    """/metrics (public) on a connection of its own: {(name, label value): value}."""
    s = _connect(server)
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        status, _, body = _read_response(s)
    finally:
        s.close()
    assert status == 200, body
    out = {}
    for line in body.decode().splitlines():
        if line.startswith("hotloop_") and ("connection" in line):
            name, value = line.rsplit(" ", 1)
            base, _, labels = name.partition("{")
            out[(base, labels.rstrip("}"))] = float(value)
    return out


def test_the_connection_count_and_the_refusals_are_exported(tmp_path: Path) -> None:
    """``hotloop_client_connections`` is every connection the server holds, idle ones included (what
    --max-connections bounds), and ``hotloop_connections_refused_total`` counts those refused beyond
    the limit and those closed by the read timeout."""
    args = ("--max-connections", "3", "--request-read-timeout", str(READ_TIMEOUT), "--metrics-public", "--store", "memory")
    with run_server(tmp_path, *args) as server:
        idle = [_connect(server), _connect(server)]  # admitted, nothing sent (yet)
        time.sleep(0.2)
        m = _scrape(server)
        assert m[("hotloop_client_connections", "")] == 3  # the two idle ones and the scrape's own
        assert m[("hotloop_open_connections", 'transport="http"')] == 1  # the scrape, being served
        assert m[("hotloop_connections_refused_total", 'reason="overloaded"')] == 0
        idle.append(_connect(server))  # the third: the limit
        time.sleep(0.2)
        beyond = _connect(server)
        beyond.sendall(HEALTH)
        assert _read_response(beyond)[0] == 503
        beyond.close()
        for s in idle:  # each is closed by the read timeout: it sent no request
            assert _closed_within(s, WAIT) is not None
            s.close()
        time.sleep(0.2)
        m = _scrape(server)
        assert m[("hotloop_client_connections", "")] == 1
        assert m[("hotloop_connections_refused_total", 'reason="overloaded"')] == 1
        assert m[("hotloop_connections_refused_total", 'reason="read_timeout"')] == 3
