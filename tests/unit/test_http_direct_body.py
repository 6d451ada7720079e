"""Request bodies read straight into their own buffer (``BoundedHttpToolsProtocol.get_buffer``).

A Content-Length body of at most BODY_BUFFER bytes is read by the kernel into the buffer that the
application then receives, and the parser never sees it. These tests drive the protocol the way
uvloop drives a ``BufferedProtocol`` (``get_buffer``, fill, ``buffer_updated``), with reads cut
in awkward places, pipelined requests and the bodies that must still go through the parser; and
once through a real uvloop server on a socket, to check that the transport really reads into the
protocol's buffers.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
import uvicorn
import uvloop

from hotloop.server import httpproto
from hotloop.server.httpproto import BODY_BUFFER, READ_BUFFER, RECEIVE, BoundedHttpToolsProtocol, HttpReader, Limits
from tests.unit.test_http_cork import Recorder


class _App:
    """Answers each request with the SHA-256 of its body; keeps what the protocol's ``receive``
    (:data:`~hotloop.server.httpproto.RECEIVE`, as hotloop's app reads bodies) gave."""

    def __init__(self) -> None:
        self.bodies: list[list[Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        receive = scope["extensions"][RECEIVE]
        parts: list[Any] = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            parts.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        self.bodies.append(parts)
        digest = hashlib.sha256(b"".join(bytes(p) for p in parts)).hexdigest().encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(digest))]})
        await send({"type": "http.response.body", "body": digest})


def _reader_class() -> type[HttpReader]:
    proto = type("P", (BoundedHttpToolsProtocol,), {"limits": Limits(10, 30.0)})
    return type("R", (HttpReader,), {"protocol": proto})


def _config(app: _App) -> uvicorn.Config:
    cfg = uvicorn.Config(app, lifespan="off", log_level="warning")
    cfg.load()
    return cfg


def _request(body: bytes, *headers: bytes) -> bytes:
    extra = b"".join(h + b"\r\n" for h in headers)
    return b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n" % (len(body), extra) + body


def _body(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def _digests(out: bytes) -> list[bytes]:
    """The bodies of the responses written (each a 64-byte hex digest)."""
    found = []
    while out:
        head, _, rest = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        found.append(rest[:64])
        out = rest[64:]
    return found


@pytest.fixture
def on_body_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many bytes of body the parser handed over, one entry a call."""
    calls: list[int] = []
    real = BoundedHttpToolsProtocol.on_body

    def counted(self: Any, body: bytes) -> None:
        calls.append(len(body))
        real(self, body)

    monkeypatch.setattr(BoundedHttpToolsProtocol, "on_body", counted)
    return calls


def _read(reader: Any, data: bytes, buffers: list[Any]) -> None:
    """One read of ``data`` as uvloop makes it: into the buffer ``get_buffer`` gives, at most its
    size (a longer read goes on in the next buffer)."""
    while data:
        buf = reader.get_buffer(-1)
        buffers.append(buf)
        view = memoryview(buf)
        k = min(len(view), len(data))
        view[:k] = data[:k]
        data = data[k:]
        reader.buffer_updated(k)


async def _drive(reads: list[bytes], n_responses: int, limits: Limits | None = None) -> tuple[_App, list[Any], bytes]:
    """Feed ``reads`` to a connection; the app, the buffers given, and the output."""
    app = _App()
    reader_class = _reader_class()
    if limits is not None:
        reader_class.protocol.limits = limits
    reader = reader_class(_config(app), uvicorn.server.ServerState(), {}, asyncio.get_running_loop())
    transport = Recorder()  # the writes of the connection's transport
    reader.connection_made(transport)
    buffers: list[Any] = []
    for data in reads:
        _read(reader, data, buffers)
        await asyncio.sleep(0)
    for _ in range(500):
        if len(_digests(b"".join(transport.writes))) >= n_responses:
            break
        await asyncio.sleep(0.01)
    reader.connection_lost(None)
    return app, buffers, b"".join(transport.writes)


def test_a_body_is_read_into_the_buffer_the_application_receives(on_body_calls: list[int]) -> None:
    body = _body(300_000, 1)
    req = _request(body)
    head_len = len(req) - len(body)
    # the head with the body's first 1,000 bytes, then the rest in reads of 50,000
    reads = [req[: head_len + 1000]] + [req[i : i + 50_000] for i in range(head_len + 1000, len(req), 50_000)]
    app, buffers, out = asyncio.run(_drive(reads, 1))
    assert _digests(out) == [hashlib.sha256(body).hexdigest().encode()]
    [[got]] = app.bodies  # one piece: the whole body
    assert type(got) is bytearray and got == body
    # every read after the head's went straight into that body
    direct = [b for b in buffers[1:]]
    assert direct and all(type(b) is memoryview and b.obj is got for b in direct)
    assert on_body_calls == []  # the parser never saw a byte of it


def test_pipelined_requests_in_one_read_each_get_their_body() -> None:
    bodies = [_body(5_000, 2), _body(70_000, 3), _body(10, 4)]
    stream = b"".join(_request(b) for b in bodies)
    app, _, out = asyncio.run(_drive([stream], 3))
    assert _digests(out) == [hashlib.sha256(b).hexdigest().encode() for b in bodies]
    assert [b"".join(bytes(p) for p in parts) for parts in app.bodies] == bodies


@pytest.mark.parametrize("cut", [1, 2, 3], ids=["cr-lf-cr|lf", "cr-lf|cr-lf", "cr|lf-cr-lf"])
def test_a_head_whose_end_is_split_across_reads(cut: int, on_body_calls: list[int]) -> None:
    body = _body(200_000, 5)
    req = _request(body)
    end = req.index(b"\r\n\r\n") + 4
    # the first read stops inside the head's blank line; the second holds its rest and some body
    reads = [req[: end - cut], req[end - cut : end + 3000], req[end + 3000 :]]
    app, buffers, out = asyncio.run(_drive(reads, 1))
    assert _digests(out) == [hashlib.sha256(body).hexdigest().encode()]
    [[got]] = app.bodies
    assert got == body
    # the head's end is found across the reads: the body goes straight into its buffer, none
    # of it through the parser
    assert sum(on_body_calls) == 0
    assert type(buffers[-1]) is memoryview and buffers[-1].obj is got


def test_bodies_that_are_not_read_directly_still_arrive_whole(on_body_calls: list[int]) -> None:
    chunked_body = _body(20_000, 6)
    chunked = (
        b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(chunked_body[i : i + 4096]), chunked_body[i : i + 4096]) for i in range(0, len(chunked_body), 4096))
        + b"0\r\n\r\n"
    )
    large = _body(BODY_BUFFER + 10, 7)
    reads = [chunked[i : i + 30_000] for i in range(0, len(chunked), 30_000)]
    reads += [_request(large)[i : i + 200_000] for i in range(0, len(_request(large)), 200_000)]
    app, buffers, out = asyncio.run(_drive(reads, 2))
    assert _digests(out) == [hashlib.sha256(b).hexdigest().encode() for b in (chunked_body, large)]
    assert b"".join(bytes(p) for p in app.bodies[0]) == chunked_body
    assert b"".join(bytes(p) for p in app.bodies[1]) == large
    assert sum(on_body_calls) == len(chunked_body) + len(large)  # all through the parser
    assert all(type(b) is bytearray and len(b) == READ_BUFFER for b in buffers)  # the scratch buffer


def test_body_buffers_allocated_ahead_are_bounded_per_server(on_body_calls: list[int]) -> None:
    body = _body(100_000, 9)
    limits = Limits(10, 30.0)
    cap = httpproto._body_capacity(len(body))  # what its buffer allocates (whole BODY_STEPs)
    limits.direct_bytes = httpproto.DIRECT_BODY_BYTES - cap + 1  # one byte short of room
    app, buffers, out = asyncio.run(_drive([_request(body)], 1, limits))
    assert _digests(out) == [hashlib.sha256(body).hexdigest().encode()]
    assert sum(on_body_calls) == len(body)  # read through the parser instead
    limits.direct_bytes -= 1  # room now: read directly, and given back once read
    on_body_calls.clear()
    asyncio.run(_drive([_request(body)], 1, limits))
    assert on_body_calls == [] and limits.direct_bytes == httpproto.DIRECT_BODY_BYTES - cap


def test_a_body_cut_short_gives_its_buffer_back() -> None:
    async def main() -> tuple[Limits, int]:
        app = _App()
        reader_class = _reader_class()
        limits = reader_class.protocol.limits
        reader = reader_class(_config(app), uvicorn.server.ServerState(), {}, asyncio.get_running_loop())
        reader.connection_made(Recorder())
        req = _request(_body(100_000, 10))
        _read(reader, req[:50_000], [])
        during = limits.direct_bytes
        reader.connection_lost(None)
        await asyncio.sleep(0.01)
        assert app.bodies == []  # the application saw the client leave, no body
        return limits, during

    limits, during = asyncio.run(main())
    assert during == 2 * httpproto.BODY_STEP and limits.direct_bytes == 0  # its allocation, given back


@pytest.mark.parametrize(
    ("headers", "size"),
    [
        ([(b"content-length", b"%d" % READ_BUFFER)], READ_BUFFER),
        ([(b"content-length", b"%d" % (READ_BUFFER - 1))], 0),  # fits the read buffer: the parser's
        ([(b"content-length", b"12")], 0),
        ([(b"content-length", b"0")], 0),
        ([(b"content-length", b"%d" % BODY_BUFFER)], BODY_BUFFER),
        ([(b"content-length", b"%d" % (BODY_BUFFER + 1))], 0),
        ([(b"content-length", b"70000"), (b"content-length", b"70000")], 0),
        ([(b"content-length", b"+70000")], 0),
        ([(b"content-length", b"70000"), (b"transfer-encoding", b"chunked")], 0),
        ([(b"content-length", b"70000"), (b"expect", b"100-continue")], 0),
        ([], 0),
    ],
)
def test_which_bodies_are_read_directly(headers: list[tuple[bytes, bytes]], size: int) -> None:
    n = httpproto._body_length(headers)
    assert (n if httpproto._reads_directly(n) else 0) == size


@pytest.mark.parametrize(
    ("headers", "size"),
    [
        ([(b"content-length", b"12")], 12),  # a body the parser reads: its bytes are not searched for a head
        ([(b"content-length", b"%d" % (BODY_BUFFER + 1))], BODY_BUFFER + 1),
        ([(b"content-length", b"0")], 0),
        ([(b"content-length", b"12"), (b"content-length", b"12")], 0),  # unknown until the parser says
        ([(b"content-length", b"12"), (b"transfer-encoding", b"chunked")], 0),
        ([(b"content-length", b"12"), (b"expect", b"100-continue")], 0),
    ],
)
def test_the_declared_body_length_is_trusted_only_when_unambiguous(headers: list[tuple[bytes, bytes]], size: int) -> None:
    assert httpproto._body_length(headers) == size


def test_a_real_uvloop_server_reads_bodies_into_the_protocols_buffer(on_body_calls: list[int]) -> None:
    body = _body(400_000, 8)

    async def main() -> tuple[_App, bytes]:
        app = _App()
        cfg = _config(app)
        state = uvicorn.server.ServerState()
        loop = asyncio.get_running_loop()
        reader = _reader_class()
        server = await loop.create_server(lambda: reader(cfg, state, {}, loop), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            req = _request(body)
            head_len = len(req) - len(body)
            w.write(req[:head_len])  # the head alone, then the body in pieces
            await w.drain()
            await asyncio.sleep(0.05)
            for i in range(head_len, len(req), 65536):
                w.write(req[i : i + 65536])
                await w.drain()
            out = b""
            while len(_digests(out)) < 1 or len(out) < out.find(b"\r\n\r\n") + 4 + 64:
                chunk = await asyncio.wait_for(r.read(65536), 10)
                assert chunk
                out += chunk
            w.close()
            return app, out
        finally:
            server.close()

    app, out = uvloop.run(main())
    assert _digests(out) == [hashlib.sha256(body).hexdigest().encode()]
    [[got]] = app.bodies
    assert type(got) is bytearray and got == body
    assert on_body_calls == []  # the transport read the body into the protocol's buffer


@pytest.mark.parametrize("size", [READ_BUFFER, READ_BUFFER + 1, 100_000, 3 * httpproto.BODY_STEP, BODY_BUFFER])
def test_a_body_buffer_is_its_length_in_whole_steps(size: int) -> None:
    """A directly read body's buffer is the body's length, allocated in whole BODY_STEPs (what
    ``direct_bytes`` and the prefix cache count), so that a later body of the same steps can
    reuse the memory of one freed before it."""
    steps = -(-size // httpproto.BODY_STEP)
    assert httpproto._body_capacity(size) == steps * httpproto.BODY_STEP
    buf = httpproto.new_body(size)
    assert type(buf) is bytearray and len(buf) == size
    # the allocation is whole: at least the steps, less than one step more (bytearray's header)
    assert steps * httpproto.BODY_STEP <= buf.__sizeof__() < (steps + 1) * httpproto.BODY_STEP
    buf[-1:] = b"x"  # writable to its end
    assert buf[-1:] == b"x"


@pytest.mark.parametrize(
    "head",
    [
        b"POST /x HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: h2c\r\ncontent-length: 100000\r\n\r\n",
        b"CONNECT /x HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n",
    ],
)
def test_a_request_without_a_body_for_the_parser_gets_no_buffer(head: bytes) -> None:
    """An upgrade request (not to a WebSocket) or a CONNECT has no body for the parser whatever
    its Content-Length: its message completes with its head. No buffer is allocated for it,
    and none reaches the application unfilled (it held the memory of earlier requests: another
    client's body)."""
    secret = b'{"api_key":"sk-VICTIM-0123456789","prompt":"' + b"confidential " * 8000 + b'"}'

    async def main() -> tuple[_App, list[Any], bytes, Limits]:
        app, buffers, out = await _drive([_request(secret)], 1)
        limits = Limits(10, 30.0)
        app2, buffers2, out2 = await _drive([head], 0, limits)
        for _ in range(100):  # the application, if it runs, answers
            if out2 or app2.bodies:
                break
            await asyncio.sleep(0.01)
        return app2, buffers2, out2, limits

    app, buffers, out, limits = asyncio.run(main())
    assert all(b"".join(bytes(p) for p in parts) == b"" for parts in app.bodies)
    assert b"confidential" not in out and b"VICTIM" not in out
    assert all(len(b) == READ_BUFFER for b in buffers)  # the scratch buffer only: none for a body
    assert limits.direct_bytes == 0
