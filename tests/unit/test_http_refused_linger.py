"""The lingering close of ``BoundedHttpToolsProtocol`` (``_close_lingering``), driven on a
recording transport: after an answer that ends the connection, a FIN (``write_eof``), reading
resumed, what comes dropped unparsed, and the close LINGER_SECONDS later (at most the read
timeout) or when the client's FIN comes first; a connection beyond the limit lingers only while
fewer than MAX_LINGERING_REJECTED do; a response on a connection that does not stay open lingers
only when the client sent bytes that were not read."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn

from hotloop.server import httpproto
from hotloop.server.httpproto import MAX_LINGERING_REJECTED, BoundedHttpToolsProtocol, HttpReader, Limits
from tests.unit.test_http_cork import Recorder


class Transport(Recorder):
    """A recording transport that takes a FIN and counts pauses of reading."""

    def __init__(self) -> None:
        super().__init__()
        self.eof = False
        self.after_eof: list[bytes] = []
        self.paused = False
        self.close_calls = 0

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        assert not self.closed
        self.eof = True

    def write(self, data: Any) -> None:
        if self.eof:  # (as uvloop's transport)
            self.after_eof.append(bytes(data))
            raise RuntimeError("Cannot call write() after write_eof()")
        super().write(data)

    def close(self) -> None:
        self.close_calls += 1
        super().close()

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


async def _app(scope: Any, receive: Any, send: Any) -> None:
    """Answers 404 at once, without reading the body (as an unknown route does); ``/slow`` reads
    the body 0.15 s later first."""
    if scope["path"] == "/slow":
        await asyncio.sleep(0.15)
        if (await receive())["type"] == "http.disconnect":
            return
    body = b'{"error":{}}'
    await send({"type": "http.response.start", "status": 404,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def _connection(limits: Limits) -> tuple[HttpReader, Transport]:
    cfg = uvicorn.Config(_app, lifespan="off", log_level="warning")
    cfg.load()
    proto = type("P", (BoundedHttpToolsProtocol,), {"limits": limits})
    reader = type("R", (HttpReader,), {"protocol": proto})(cfg, uvicorn.server.ServerState(), {}, asyncio.get_running_loop())
    transport = Transport()
    reader.connection_made(transport)
    return reader, transport


def _read(reader: HttpReader, data: bytes) -> None:
    while data:
        view = memoryview(reader.get_buffer(-1))
        k = min(len(view), len(data))
        view[:k] = data[:k]
        data = data[k:]
        reader.buffer_updated(k)


async def _until(check: Any, seconds: float = 2.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    assert check()


HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_refusal_writes_a_fin_drops_what_comes_and_closes_after_the_linger() -> None:
    async def main() -> None:
        reader, t = _connection(Limits(10, 0.2))  # the linger: min(LINGER_SECONDS, 0.2)
        _read(reader, b"NOT HTTP\r\n\r\n" + b"z" * 200_000)
        assert len(t.writes) == 1 and t.writes[0].startswith(b"HTTP/1.1 400 ")
        assert t.eof and not t.closed and not t.paused
        _read(reader, HEAD * 100)  # read and dropped, not parsed: no answer
        assert len(t.writes) == 1
        await asyncio.sleep(0.1)
        assert not t.closed
        await _until(lambda: t.closed, 1.0)
        reader.connection_lost(None)

    asyncio.run(main())


def test_connections_beyond_the_limit_linger_up_to_a_cap() -> None:
    async def main() -> None:
        limits = Limits(0, 30.0)  # every connection is beyond the limit
        conns = [_connection(limits) for _ in range(MAX_LINGERING_REJECTED + 1)]
        for reader, _ in conns:
            _read(reader, HEAD + b"x" * 1000)
        answered = [t for _, t in conns if t.writes and t.writes[0].startswith(b"HTTP/1.1 503 ")]
        assert len(answered) == len(conns)  # each is answered
        lingering = [t for _, t in conns if t.eof and not t.closed]
        assert len(lingering) == MAX_LINGERING_REJECTED and limits.lingering == MAX_LINGERING_REJECTED
        assert conns[-1][1].closed and not conns[-1][1].eof  # over the cap: closed at once
        reader, t = conns[0]
        _read(reader, b"y" * 100_000)  # dropped (no second answer)
        assert len(t.writes) == 1
        for reader, _ in conns:  # gone (their clients closed, or the linger ended)
            reader.connection_lost(None)
        assert limits.lingering == 0 and not limits.admitted
        reader, t = _connection(limits)  # room again
        _read(reader, HEAD)
        assert t.eof and not t.closed and limits.lingering == 1
        reader.connection_lost(None)
        assert limits.lingering == 0

    asyncio.run(main())


def test_an_admitted_lingering_connection_keeps_its_place_until_it_is_gone() -> None:
    async def main() -> None:
        limits = Limits(1, 0.1)
        reader, t = _connection(limits)
        _read(reader, b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 70_000)  # 431
        assert t.writes[0].startswith(b"HTTP/1.1 431 ") and t.eof
        assert len(limits.admitted) == 1
        await _until(lambda: t.closed, 1.0)
        reader.connection_lost(None)
        assert not limits.admitted and limits.lingering == 0

    asyncio.run(main())


def test_a_response_on_a_closing_connection_lingers_only_for_a_body_not_read() -> None:
    async def main() -> None:
        # the 404 comes before the body (200 KB declared, 1 KB sent): lingering
        reader, t = _connection(Limits(10, 0.2))
        _read(reader, b"POST /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 200000\r\n\r\n" + b"{" * 1000)
        await _until(lambda: bool(t.writes))
        assert t.writes[0].startswith(b"HTTP/1.1 404 ") and b"connection: close" in t.writes[0]
        await _until(lambda: t.eof)
        assert not t.closed and not t.paused
        written = b"".join(t.writes)
        assert written.endswith(b'{"error":{}}')
        _read(reader, b"{" * 199_000 + HEAD)  # the rest, and a request after it: dropped
        await asyncio.sleep(0.05)
        assert b"".join(t.writes) == written
        await _until(lambda: t.closed, 1.0)
        reader.connection_lost(None)
        # the whole request read: closed at once, as before
        reader, t = _connection(Limits(10, 0.2))
        _read(reader, b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await _until(lambda: t.closed)
        assert t.writes[0].startswith(b"HTTP/1.1 404 ") and not t.eof and t.close_calls == 1
        reader.connection_lost(None)

    asyncio.run(main())


def test_the_clients_fin_ends_the_linger() -> None:
    """eof_received returns nothing: the transport closes itself (uvloop's, asyncio's)."""
    async def main() -> None:
        reader, t = _connection(Limits(10, 30.0))
        _read(reader, b"NOT HTTP\r\n\r\n")
        assert t.eof and not t.closed
        eof_received: Any = reader.eof_received
        assert not eof_received()  # (a false value: the transport closes itself)
        reader.connection_lost(None)  # (what the transport's close leads to)
        assert reader.http._linger_timer is None  # cancelled with it

    asyncio.run(main())


def test_a_408_while_the_application_has_not_asked_for_the_body_sends_no_100_after_the_fin() -> None:
    """A request that asked for 100 Continue times out before its application reads the body:
    the 408, the FIN, and the application's receive() writes no 100 Continue after them."""
    async def main() -> None:
        reader, t = _connection(Limits(10, 0.1))  # 408 at 0.1 s, closed at 0.2 s
        _read(reader, b"POST /slow HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n")
        await _until(lambda: t.eof)
        assert b"".join(t.writes).startswith(b"HTTP/1.1 408 ")
        assert not t.closed
        await asyncio.sleep(0.3)  # the application asked for the body at 0.15 s
        assert t.after_eof == [] and t.closed
        reader.connection_lost(None)

    asyncio.run(main())


def test_the_linger_is_at_most_the_read_timeout() -> None:
    assert httpproto.LINGER_SECONDS == 2.0

    async def main() -> None:
        reader, t = _connection(Limits(10, 0.05))
        _read(reader, b"NOT HTTP\r\n\r\n")
        await asyncio.sleep(0.15)
        assert t.closed
        reader.connection_lost(None)

    asyncio.run(main())
