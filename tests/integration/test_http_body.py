"""Request bodies through hotloop's HTTP protocol: collected until complete, handed over whole.

The protocol keeps a body's reads as they arrive and hands the application the whole body once
(or BODY_BUFFER bytes, reading paused until they are taken). These tests send bodies below and
above that bound in many small writes, on keep-alive and pipelined connections, and check that
every request is answered exactly as the same body sent in one piece.
"""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Callable

import httpx

from hotloop.server.httpproto import BODY_BUFFER
from tests.conftest import Server

WAIT = 30.0


def _connect(server: Server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
    s.settimeout(WAIT)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _request(body: bytes) -> bytes:
    return (
        b"POST /v1/responses/input_tokens HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body


def _responses(s: socket.socket, n: int) -> list[tuple[int, dict]]:
    """``n`` Content-Length responses read from ``s`` in order: (status, JSON body)."""
    buf = b""
    out: list[tuple[int, dict]] = []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            assert chunk, f"closed after {len(out)} responses"
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(headers["content-length"])  # hotloop sends whole JSON bodies with their length
        while len(rest) < length:
            chunk = s.recv(65536)
            assert chunk
            rest += chunk
        out.append((int(lines[0].split()[1]), json.loads(rest[:length])))
        buf = rest[length:]
    return out


def _body(words: int, seed: int) -> bytes:
    text = " ".join(f"w{(i * 7919 + seed) % 10007}" for i in range(words))
    return json.dumps({"model": "hotloop-sim", "input": [{"role": "user", "content": text}]}).encode()


def _counted(server: Server, body: bytes) -> int:
    r = httpx.post(server.v1 + "/responses/input_tokens", content=body, headers={"content-type": "application/json"}, timeout=WAIT)
    assert r.status_code == 200, r.text
    return int(r.json()["input_tokens"])


def test_bodies_sent_in_small_writes_arrive_whole_below_and_above_the_buffer(server: Server) -> None:
    small, large = _body(2_000, 1), _body(450_000, 2)
    assert len(small) < BODY_BUFFER < 2 * BODY_BUFFER < len(large)
    expected = [_counted(server, b) for b in (small, large)]
    s = _connect(server)
    try:
        for body, want in zip((small, large, small), expected + expected[:1]):  # keep-alive: one connection
            req = _request(body)
            for i in range(0, len(req), 8192):
                s.sendall(req[i : i + 8192])
                if i % (256 * 1024) == 0:
                    time.sleep(0.01)  # the server reads some pieces alone
            [(status, got)] = _responses(s, 1)
            assert status == 200 and got["input_tokens"] == want
    finally:
        s.close()


def test_pipelined_requests_are_answered_in_order(server: Server) -> None:
    bodies = [_body(500, 3), _body(400_000, 4), _body(50, 5)]
    expected = [_counted(server, b) for b in bodies]
    s = _connect(server)
    try:
        s.sendall(b"".join(_request(b) for b in bodies))  # all three before any answer
        got = _responses(s, 3)
        assert [status for status, _ in got] == [200, 200, 200]
        assert [b["input_tokens"] for _, b in got] == expected
    finally:
        s.close()


def test_pipelining_of_any_depth_is_answered_in_order_with_a_bounded_queue(server: Server) -> None:
    """uvicorn queued every pipelined request head of every read, without a bound: at most
    MAX_PIPELINED wait now, the bytes after them wait unparsed until a response makes room,
    and every request is still answered, in order."""
    from hotloop.server.httpproto import MAX_PIPELINED

    n = 20 * MAX_PIPELINED
    s = _connect(server)
    try:
        # distinct requests, to check the order: paths a server answers with their own 404s
        s.sendall(b"".join(b"GET /nope-%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(n)))
        buf = b""
        while buf.count(b"HTTP/1.1 ") < n or not buf.endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, (buf.count(b"HTTP/1.1 "), buf[-300:])
            buf += chunk
    finally:
        s.close()
    assert buf.count(b"HTTP/1.1 404 ") == n
    order = [int(m) for m in re.findall(rb"/nope-(\d+)", buf)]
    assert order == list(range(n)), order[:40]
    assert httpx.get(server.base + "/healthz", timeout=WAIT).status_code == 200


def test_pipelined_requests_with_bodies_beyond_the_queue_are_all_answered_in_order(server: Server) -> None:
    """Requests that read their bodies resume reading while bytes wait for room in the
    pipeline: what arrives then goes after those bytes, never over them."""
    from hotloop.server.httpproto import MAX_PIPELINED

    bodies = [_body(300 + i % 7, i) for i in range(4 * MAX_PIPELINED)]  # 2 KB each: several reads
    _pipeline_counts(server, bodies, _request)


def _pipeline_counts(server: Server, bodies: list[bytes], request: Callable[[bytes], bytes]) -> None:
    """``bodies`` counted by requests made with ``request``, all sent before any answer: every
    one answered 200, in order, with the count the same body gets alone."""
    expected = {b: _counted(server, b) for b in set(bodies)}
    s = _connect(server)
    try:
        s.sendall(b"".join(request(b) for b in bodies))
        got = _responses(s, len(bodies))
    finally:
        s.close()
    assert [status for status, _ in got] == [200] * len(bodies)
    assert [b["input_tokens"] for _, b in got] == [expected[b] for b in bodies]


def test_pipelined_responses_that_wait_on_their_model_are_all_answered_in_order(server: Server) -> None:
    """A response that waits for its model lets the event loop read on (its request's
    receive() resumed reading) while bytes wait for room in the pipeline: those reads go after
    them. Each answer echoes its request's metadata, so the order shows."""
    from hotloop.server.httpproto import MAX_PIPELINED

    n = 4 * MAX_PIPELINED
    pad = "x" * 2000  # several reads' worth of requests
    reqs = []
    for i in range(n):
        body = json.dumps({"model": "hotloop-sim", "input": pad, "store": False, "metadata": {"i": str(i), "sim": "text,tokens:2"}}).encode()
        reqs.append(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    s = _connect(server)
    try:
        s.sendall(b"".join(reqs))
        got = _responses(s, n)
    finally:
        s.close()
    assert [status for status, _ in got] == [200] * n
    assert [b["metadata"]["i"] for _, b in got] == [str(i) for i in range(n)]


def test_pipelined_chunked_bodies_beyond_the_queue_are_read_whole_and_answered_in_order(server: Server) -> None:
    """A chunked body is read through the parser, its chunks cut where a head would end: bytes
    are held only where a request begins, never in the middle of a body."""
    from hotloop.server.httpproto import MAX_PIPELINED

    bodies = [_body(300 + i % 5, i) for i in range(2 * MAX_PIPELINED)]

    def chunked(body: bytes) -> bytes:
        half = len(body) // 2
        return (
            b"POST /v1/responses/input_tokens HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
        )

    _pipeline_counts(server, bodies, chunked)


def test_a_body_over_the_limit_is_refused_and_the_server_stays_usable(tmp_path) -> None:
    from tests.conftest import run_server

    env = {"HOTLOOP_MAX_BODY_BYTES": str(BODY_BUFFER + BODY_BUFFER // 2)}
    with run_server(tmp_path, "--sim-rate", "0", env=env) as srv:
        s = _connect(srv)
        try:
            req = _request(_body(600_000, 6))  # about 4 MB: over the limit, and over the buffer
            try:
                s.sendall(req)
            except OSError:
                pass  # the server may answer and close before it has read everything
            [(status, got)] = _responses(s, 1)
            assert status == 413 and got["error"]["type"] == "invalid_request_error"
        finally:
            s.close()
        assert _counted(srv, _body(100, 7)) > 0


def test_a_client_expecting_100_continue_gets_it_before_sending_its_body(server: Server) -> None:
    body = _body(450_000, 8)  # above BODY_BUFFER as well
    want = _counted(server, body)
    s = _connect(server)
    try:
        head = _request(body)[: -len(body)]
        s.sendall(head.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n", 1))
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = s.recv(65536)
            assert chunk
            got += chunk
        assert got.startswith(b"HTTP/1.1 100 Continue\r\n")  # nothing of the body was sent yet
        for i in range(0, len(body), 65536):
            s.sendall(body[i : i + 65536])
        [(status, answer)] = _responses(s, 1)
        assert status == 200 and answer["input_tokens"] == want
    finally:
        s.close()


# uvicorn's keep-alive timeout (5 s) shortened to 1 s, so that a test can outlast it
_SHORT_KEEPALIVE = (
    "-c",
    "import sys, uvicorn.config as u, hotloop.cli as c\n"
    "init = u.Config.__init__\n"
    "def short(self, *a, **k):\n"
    "    k['timeout_keep_alive'] = 1\n"
    "    init(self, *a, **k)\n"
    "u.Config.__init__ = short\n"
    "sys.exit(c.main(sys.argv[1:]))",
)


def test_an_upload_answered_early_is_not_cut_off_by_the_keep_alive_timeout(tmp_path) -> None:
    """A request answered before its body has all come (a wrong key: 401) on a keep-alive
    connection: the keep-alive timeout ran from the answer while the body still came, and
    closed the connection under the upload (no lingering, the answer unread by a client that
    sends its whole body first). The request's read timeout bounds its body; the connection
    is idle from the body's end."""
    from tests.conftest import run_server

    with run_server(tmp_path, "--sim-rate", "0", "--api-key", "sk-right", entry=_SHORT_KEEPALIVE) as srv:
        s = _connect(srv)
        try:
            body = _body(200_000, 3)  # over the direct read's bound: read through the parser
            s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-wrong\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
            step = len(body) // 10
            for i in range(0, len(body), step):  # 2.5 s for the body: past the keep-alive timeout
                s.sendall(body[i : i + step])
                time.sleep(0.25)
            [(status, got)] = _responses(s, 1)
            assert status == 401 and got["error"]["code"] == "invalid_api_key"
            # the connection stays usable for the next request, then idles out as ever
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            s.settimeout(5)
            assert s.recv(65536) == b""  # closed by the keep-alive timeout once idle
        finally:
            s.close()


def test_an_endless_trailer_section_is_refused_as_an_oversized_head(server: Server) -> None:
    """A chunked body's trailer fields (after its last chunk) were bounded by nothing: the
    parser held each until it ended and the request's headers grew by every one (800 fields
    of 1 MiB took the server from 128 MB to 925 MB). Bytes of a body that hold no body byte are
    bounded as a head's are: a 431, and the server answers the next connection."""
    s = _connect(server)
    try:
        body = _body(100, 4)
        s.sendall(b"POST /v1/responses/input_tokens HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n" % (len(body), body))
        field = b"x-trailer: " + b"a" * 8000 + b"\r\n"
        try:
            for _ in range(200):  # 1.6 MB of trailer fields
                s.sendall(field)
        except OSError:
            pass  # refused and closed while they came
        [(status, got)] = _responses(s, 1)
        assert status == 431 and got["error"]["type"] == "invalid_request_error"
    finally:
        s.close()
    assert _counted(server, _body(100, 5)) > 0


def test_a_chunked_body_with_trailer_fields_is_answered(server: Server) -> None:
    s = _connect(server)
    try:
        body = _body(100, 6)
        s.sendall(b"POST /v1/responses/input_tokens HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\nx-trailer: yes\r\n\r\n" % (len(body), body))
        [(status, got)] = _responses(s, 1)
        assert status == 200 and got["input_tokens"] > 0
    finally:
        s.close()


def test_head_is_answered_wherever_get_is(server: Server) -> None:
    """RFC 9110, 9.1: HEAD wherever GET works (uptime probes, proxies): GET's status and headers,
    no body. It was a 405 on every route but /healthz."""
    created = httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi"}, timeout=30).json()
    for path in ("/v1/models", "/v1/models/hotloop-sim", f"/v1/responses/{created['id']}",
                 f"/v1/responses/{created['id']}/input_items", "/v1/responses/resp_missing"):
        get = httpx.get(server.base + path, timeout=10)
        head = httpx.head(server.base + path, timeout=10)
        assert head.status_code == get.status_code, path
        assert head.content == b"" and head.headers["content-length"] == get.headers["content-length"], path
    refused = httpx.put(server.base + "/v1/models", timeout=10)
    assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD"
    refused = httpx.put(server.base + f"/v1/responses/{created['id']}", timeout=10)
    assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD, DELETE"
