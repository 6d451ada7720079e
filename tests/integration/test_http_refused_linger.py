"""HTTP-level refusals that close the connection while the client has sent bytes the server has
not read (the rest of a large body, frames sent behind a WebSocket handshake, what a client
sends while the answer is on its way): raw sockets on 127.0.0.1 against a real server.

A socket closed with unread bytes is reset by Linux: the client read ``connection reset`` after,
or instead of, the answer. Each refusal now closes *lingering* (the answer, a FIN, what the
client still sends read and dropped until it closes its side, at most ``LINGER_SECONDS``): the
client reads the whole answer (status line, headers, the OpenAI error body) and then a clean end
of file, within a bound, and the server holds nothing once the client is gone (or the bound has
passed)."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import Server, run_server
from tests.integration.test_ws_refused_held import _settled, _sockets, read_to_end

pytestmark = pytest.mark.timeout(180)

READ_TIMEOUT = 1.5  # the linger is min(LINGER_SECONDS, read timeout): 1.5 s here
TTFT = 2.5  # a POST /v1/responses takes this long: a response still running
MAX_BODY = 1024 * 1024
LARGE = 400_000  # more than one read: most of it is still unread when the answer is written
BOUND = 5.0  # the answer and its FIN come within this many seconds


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--request-read-timeout", str(READ_TIMEOUT), "--store", "memory", "--sim-rate", "0", "--sim-ttft", str(TTFT))
    with run_server(tmp_path_factory.mktemp("linger"), *args, env={"HOTLOOP_MAX_BODY_BYTES": str(MAX_BODY)}) as s:
        yield s


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """--max-connections 2: two slow requests fill it."""
    args = ("--max-connections", "2", "--request-read-timeout", str(READ_TIMEOUT), "--store", "memory",
            "--sim-rate", "0", "--sim-ttft", str(TTFT))
    with run_server(tmp_path_factory.mktemp("linger-full"), *args) as s:
        yield s


# -- the client -------------------------------------------------------------------------------


class Answer:
    def __init__(self, data: bytes, end: str, seconds: float, sock: socket.socket) -> None:
        self.data = data
        self.end = end  # "FIN", "RST" or "TIMEOUT"
        self.seconds = seconds
        self.sock = sock

    def responses(self) -> list[tuple[int, dict[str, str], bytes]]:
        """The complete Content-Length responses read, in order (an incomplete one fails)."""
        out = []
        rest = self.data
        while rest:
            head, sep, rest = rest.partition(b"\r\n\r\n")
            assert sep, f"an incomplete head: {head[:300]!r} ({self.end} after {self.seconds:.2f}s)"
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            length = int(headers["content-length"])
            assert len(rest) >= length, f"an incomplete body: {rest!r} ({self.end} after {self.seconds:.2f}s)"
            out.append((int(lines[0].split()[1]), headers, rest[:length]))
            rest = rest[length:]
        return out

    def refused(self, status: int, code: str | None = None, before: int = 0) -> dict[str, Any]:
        """The answers are ``before`` others and then the refusal, whole, followed by a FIN."""
        got = self.responses()
        assert len(got) == before + 1, (got, self.end)
        st, headers, body = got[-1]
        assert st == status, (st, body)
        assert headers["content-type"] == "application/json" and headers["connection"] == "close", headers
        assert headers["x-request-id"].startswith("req_"), headers
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
        if code is not None:
            assert error["code"] == code, error
        assert self.end == "FIN", f"{self.end} after {self.seconds:.3f}s: {self.data[-200:]!r}"
        assert self.seconds < BOUND, self.seconds
        return error


def exchange(
    port: int, first: bytes, then: bytes = b"", pause: float = 0.0, keep: bool = False, timeout: float = 10.0
) -> Answer:
    """Send ``first`` in one write and ``then`` in another ``pause`` seconds later (from a thread:
    a large send may wait for the server to read); read until the server's FIN, a reset or
    ``timeout``. ``keep``: the socket stays open (the caller closes it)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send() -> None:
        try:
            s.sendall(first)
            if pause:
                time.sleep(pause)
            if then:
                s.sendall(then)
        except OSError:
            pass  # (a reset: the end read says so)

    sender = threading.Thread(target=send, daemon=True)
    t0 = time.monotonic()
    sender.start()
    data, end = read_to_end(s, t0 + timeout)
    seconds = time.monotonic() - t0
    if not keep:
        s.close()
    sender.join(timeout=10)
    return Answer(data, end, seconds, s)


def _upgrade(path: bytes = b"/v1/responses") -> bytes:
    return (
        b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: " + base64.b64encode(os.urandom(16)) + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )


def _frames(size: int = LARGE) -> bytes:
    """Masked text frames of ``size`` bytes in all (what a client sends without waiting for the 101)."""
    out = b""
    while len(out) < size:
        payload = json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x" * 60_000}).encode()
        mask = os.urandom(4)
        out += bytes([0x81, 127]) + len(payload).to_bytes(8, "big") + mask
        out += bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return out


def _post(path: bytes, length: int, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (b"POST %s HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path, version, length, extra))


HEALTH = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
SLOW = _post(b"/v1/responses", 47) + b'{"model": "hotloop-sim", "input": "hi", "x": 1}'


@pytest.fixture
def baseline(srv: Server) -> int:
    if not os.path.isdir(f"/proc/{srv.proc.pid}/fd"):
        pytest.skip("needs /proc")
    time.sleep(0.2)
    return _sockets(srv.proc.pid)


def _clean(server: Server, before: int) -> None:
    log = server.logs()[before:]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


# -- refusals of a request the protocol reads (_refuse) ----------------------------------------


def test_a_handshake_pipelined_behind_a_request_is_refused_with_a_fin(srv: Server, baseline: int) -> None:
    """400 for a WebSocket handshake pipelined behind another request, frames in the same write."""
    before = len(srv.logs())
    a = exchange(srv.port, HEALTH + _upgrade() + _frames())
    assert a.responses()[0][0] == 200
    a.refused(400, "invalid_http_request", before=1)
    assert _settled(srv, baseline, 5.0) == baseline
    _clean(srv, before)


def test_a_head_too_large_is_refused_with_a_fin(srv: Server, baseline: int) -> None:
    """431: a head past MAX_REQUEST_HEAD (64 KiB) in a single write of 400 KB."""
    a = exchange(srv.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * LARGE + b"\r\n\r\n")
    a.refused(431, "request_header_fields_too_large")
    assert _settled(srv, baseline, 5.0) == baseline


def test_a_malformed_request_is_refused_with_a_fin(srv: Server, baseline: int) -> None:
    """400: not HTTP, followed by more bytes than one read."""
    a = exchange(srv.port, b"NOT HTTP AT ALL\r\n\r\n" + b"z" * LARGE)
    a.refused(400, "invalid_http_request")
    # the client closed on the FIN: that ends the linger (well before its READ_TIMEOUT bound)
    assert _settled(srv, baseline, READ_TIMEOUT - 0.5) == baseline


def test_a_bad_chunk_in_a_running_requests_body_is_refused_with_a_fin(srv: Server, baseline: int) -> None:
    """400: a chunked body whose chunk size is not one, the application waiting for it."""
    head = (b"POST /v1/responses/input_tokens HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    a = exchange(srv.port, head + b"5\r\n{\"a\":\r\n", then=b"zz\r\n" + b"z" * LARGE, pause=0.2)
    a.refused(400, "invalid_http_request")
    assert _settled(srv, baseline, 5.0) == baseline


def test_an_upgrade_with_an_unreadable_body_is_refused_with_a_fin(srv: Server, baseline: int) -> None:
    """400 unsupported_upgrade: an h2c upgrade with a chunked body."""
    head = (b"POST /v1/responses/input_tokens HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    a = exchange(srv.port, head + b"%x\r\n" % LARGE + b"z" * LARGE + b"\r\n0\r\n\r\n")
    a.refused(400, "unsupported_upgrade")
    assert _settled(srv, baseline, 5.0) == baseline


# -- the read timeout ---------------------------------------------------------------------------


def test_a_408_behind_a_running_response_ends_with_a_fin(srv: Server, baseline: int) -> None:
    """A request head that stalls behind a response still running is answered 408 once that
    response is written; meanwhile nothing more is read, and the client sent 400 KB more."""
    before = len(srv.logs())
    a = exchange(srv.port, SLOW + b"GET /healthz HTTP/1.1\r\nHost: x\r\n", then=b"X-Pad: " + b"a" * LARGE,
                 pause=READ_TIMEOUT + 0.3)
    assert a.responses()[0][0] == 200
    a.refused(408, "request_timeout", before=1)
    assert _settled(srv, baseline, 5.0) == baseline
    _clean(srv, before)


def test_a_408_read_while_the_client_still_sends_ends_with_a_fin(srv: Server, baseline: int) -> None:
    """The request's body stalls, the 408 is written, and the client sends the rest of it then
    (before reading the answer): read and dropped, the 408 read whole, then the FIN."""
    a = exchange(srv.port, _post(b"/v1/responses/input_tokens", 2 * LARGE) + b"{", then=b" " * LARGE,
                 pause=READ_TIMEOUT + 0.2)
    a.refused(408, "request_timeout")
    assert _settled(srv, baseline, 5.0) == baseline


# -- an answer to a request whose body is not read, on a connection that closes ------------------


@pytest.mark.parametrize(
    "request_head",
    [
        _post(b"/v1/responses", 4 * MAX_BODY, b"Connection: close\r\n"),
        _post(b"/v1/responses", 4 * MAX_BODY, version=b"1.0"),
        _post(b"/v1/no-such-route", 4 * MAX_BODY, b"Connection: close\r\n"),
    ],
    ids=["413-connection-close", "413-http-1.0", "404-connection-close"],
)
def test_an_answer_before_the_body_on_a_closing_connection_ends_with_a_fin(
    srv: Server, baseline: int, request_head: bytes
) -> None:
    """The application answers before it has read the body (a 413 once the limit is passed, a
    404 that never reads it) and the connection does not stay open (``Connection: close``,
    HTTP/1.0): the rest of the body is read and dropped."""
    a = exchange(srv.port, request_head + b" " * (4 * MAX_BODY))
    status = 404 if b"no-such-route" in request_head else 413
    a.refused(status, "request_too_large" if status == 413 else None)
    assert _settled(srv, baseline, 5.0) == baseline


def test_an_early_413_on_a_keep_alive_connection_reads_the_body(srv: Server, baseline: int) -> None:
    """Guard (already so): on a keep-alive connection the body after an early 413 is read and
    dropped, the connection serves the next request, and the client's close ends it."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    try:
        s.sendall(_post(b"/v1/responses", 2 * MAX_BODY) + b" " * (2 * MAX_BODY) + HEALTH)
        a = Answer(b"", "", 0.0, s)
        while len(a.data.split(b"HTTP/1.1 ")) < 3 or not a.data.endswith(b"}"):
            chunk = s.recv(1 << 16)
            assert chunk, a.data
            a.data += chunk
        assert [r[0] for r in a.responses()] == [413, 200]
    finally:
        s.close()
    assert _settled(srv, baseline, 5.0) == baseline


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(srv: Server, baseline: int) -> None:
    """A ``Content-Length`` over the body limit is a 413 at once: in place of the ``100 Continue``
    its client waits for (then connection: close), and before any of its body was sent."""
    a = exchange(srv.port, _post(b"/v1/responses", 4 * MAX_BODY, b"Expect: 100-continue\r\n"))
    assert not a.data.startswith(b"HTTP/1.1 100"), a.data[:100]
    a.refused(413, "request_too_large")
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    try:
        s.sendall(_post(b"/v1/responses", 4 * MAX_BODY))  # the head only: no body byte yet
        a = Answer(b"", "", 0.0, s)
        while not a.data.endswith(b"}"):
            chunk = s.recv(1 << 16)
            assert chunk, a.data
            a.data += chunk
        [(status, _, body)] = a.responses()
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    finally:
        s.close()
    assert _settled(srv, baseline, 5.0) == baseline


def test_a_client_that_keeps_its_socket_open_is_closed_within_the_bound(srv: Server, baseline: int) -> None:
    """The client reads the refusal and its FIN but never closes: the server does, at most the
    linger later."""
    a = exchange(srv.port, b"NOT HTTP AT ALL\r\n\r\n" + b"z" * LARGE, keep=True)
    try:
        a.refused(400, "invalid_http_request")
        t0 = time.monotonic()
        assert _settled(srv, baseline, 5.0) == baseline
        assert time.monotonic() - t0 < READ_TIMEOUT + 1.0
    finally:
        a.sock.close()
    assert httpx.get(srv.base + "/healthz", timeout=5).status_code == 200


# -- beyond --max-connections ---------------------------------------------------------------------


@pytest.mark.parametrize("late", [False, True], ids=["same-write", "later-write"])
@pytest.mark.parametrize("what", ["upgrade", "post"])
def test_a_connection_beyond_the_limit_is_refused_with_a_fin(full: Server, what: str, late: bool) -> None:
    """503 for a connection beyond --max-connections, its request followed by 400 KB (the frames
    of a WebSocket that did not wait for its 101, a body): the 503 whole, then the FIN."""
    if not os.path.isdir(f"/proc/{full.proc.pid}/fd"):
        pytest.skip("needs /proc")
    time.sleep(0.2)
    base = _sockets(full.proc.pid)
    before = len(full.logs())
    busy = [socket.create_connection(("127.0.0.1", full.port), timeout=10) for _ in range(2)]
    try:
        for s in busy:
            s.sendall(SLOW)
        time.sleep(0.3)  # both admitted, their responses running
        head = _upgrade() if what == "upgrade" else _post(b"/v1/responses/input_tokens", LARGE)
        rest = _frames() if what == "upgrade" else b" " * LARGE
        a = exchange(full.port, head, then=rest, pause=0.1) if late else exchange(full.port, head + rest)
        error = a.refused(503, "server_overloaded")
        assert error["type"] == "server_error"
        assert a.responses()[0][1]["retry-after"] == "1"
    finally:
        for s in busy:
            s.close()
    assert _settled(full, base, 5.0) == base
    _clean(full, before)
    assert httpx.get(full.base + "/healthz", timeout=5).status_code == 200
