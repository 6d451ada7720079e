"""The WebSocket protocol's fast path for incoming text frames (``CorkedWebSocketProtocol.
data_received``) against websockets' own parser: the same reads, fed to the real protocol class
with the fast path on and off, must give the application the same messages and the client the
same bytes (pongs, close frames) and connection state; and the fast path must be the one taken
for a client's ordinary frames, never inside a frame or around anything unusual."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from uvicorn.config import Config as UvicornConfig
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState
from websockets.frames import Close, Frame, Opcode

from hotloop.server.wsproto import CorkedWebSocketProtocol

MAX_SIZE = 100_000
HANDSHAKE = (
    b"GET /v1/responses HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False
        self.reading = True
        self.pauses = 0

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def writelines(self, parts: Any) -> None:
        self.written.append(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        self.reading = False
        self.pauses += 1

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)


def _masked(opcode: Any, data: bytes, fin: bool = True) -> bytes:
    return Frame(opcode, data, fin).serialize(mask=True)


def _text(s: str) -> bytes:
    return _masked(Opcode.TEXT, s.encode())


async def opened(app: Any, fast: bool = True) -> tuple[CorkedWebSocketProtocol, _Transport]:
    """The real protocol class on a recording transport, after a handshake ``app`` accepted
    (what it wrote until then cleared)."""
    cfg = UvicornConfig(app=app, ws=CorkedWebSocketProtocol, ws_max_size=MAX_SIZE, ws_per_message_deflate=False, lifespan="off")
    cfg.load()
    proto = CorkedWebSocketProtocol(config=cfg, server_state=ServerState(), app_state={})
    proto.fast_text = fast
    transport = _Transport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.data_received(HANDSHAKE)
    for _ in range(20):
        await asyncio.sleep(0)
        if proto.handshake_complete:
            break
    assert proto.handshake_complete
    await asyncio.sleep(0)
    proto._flush()
    transport.written.clear()
    return proto, transport


async def _run(reads: list[bytes], fast: bool) -> tuple[list[Any], list[bytes], bool, int]:
    """Feed ``reads`` after a handshake: the application's messages, what the server wrote
    after the handshake, whether it closed, and how many reads websockets parsed."""

    done = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await done.wait()  # reads nothing more: messages stay in the queue

    proto, transport = await opened(app, fast)
    parsed = 0
    base = WebSocketsSansIOProtocol.data_received

    def counted(self: Any, data: bytes) -> None:
        nonlocal parsed
        parsed += 1
        base(self, data)

    WebSocketsSansIOProtocol.data_received = counted  # type: ignore[method-assign]
    try:
        for r in reads:
            if transport.closing:
                break
            proto.data_received(r)
    finally:
        WebSocketsSansIOProtocol.data_received = base  # type: ignore[method-assign]
    proto._flush()
    got = list(proto.queue._items or []), list(transport.written), transport.closing, parsed  # type: ignore[attr-defined]
    done.set()
    await asyncio.gather(*proto.tasks, return_exceptions=True)
    proto.connection_lost(None)
    return got


def _both(reads: list[bytes]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return asyncio.run(_run(reads, True)), asyncio.run(_run(reads, False))


split = _text("x" * 300)
inner = _text("looks like a frame")
# a binary frame whose payload, on the wire (a zero mask leaves it as it is), is a whole text frame
carrier = bytes([0x82, 0x80 | len(inner)]) + b"\0\0\0\0" + inner

def _head(b0: int, length: int, form: int) -> bytes:
    """A masked frame's header with the length in ``form`` (the 7-bit field's value: the
    length itself, 126 or 127), whatever the length."""
    if form == 126:
        return bytes([b0, 0x80 | 126]) + length.to_bytes(2, "big")
    if form == 127:
        return bytes([b0, 0x80 | 127]) + length.to_bytes(8, "big")
    return bytes([b0, 0x80 | length])


ZERO_MASK = b"\0\0\0\0"

CASES: dict[str, tuple[list[bytes], int]] = {
    # name: (reads, reads the fast path must take)
    "small": ([_text("hello")], 1),
    "empty": ([_text("")], 1),
    "16-bit length": ([_text("a" * 300)], 1),
    "64-bit length": ([_text("b" * 70_000)], 1),
    "non-ASCII": ([_text("é€😀" * 500)], 1),
    "one after another": ([_text(f"m{i}") for i in range(5)], 5),
    "invalid UTF-8": ([_masked(Opcode.TEXT, b"ok \xff\xfe")], 1),  # uvicorn closes with 1007 either way
    "binary": ([_masked(Opcode.BINARY, b"\x00\x01")], 0),
    "ping then text": ([_masked(Opcode.PING, b"p"), _text("after")], 1),
    "close": ([_masked(Opcode.CLOSE, Close(1000, "bye").serialize())], 0),
    "unmasked": ([Frame(Opcode.TEXT, b"plain").serialize(mask=False)], 0),
    "reserved bit": ([bytes([_text("r")[0] | 0x40]) + _text("r")[1:]], 0),
    "too large": ([_text("z" * (MAX_SIZE + 1))], 0),
    "fragmented then text": ([_masked(Opcode.TEXT, b"par", fin=False), _masked(Opcode.CONT, b"ts"), _text("next")], 1),
    "text inside a fragmented message": ([_masked(Opcode.TEXT, b"par", fin=False), _text("not a continuation")], 0),
    "two in one read": ([_text("one") + _text("two"), _text("three")], 1),
    "split after the header": ([split[:8], split[8:], _text("whole")], 1),
    "split after one byte": ([split[:1], split[1:], _text("whole")], 1),
    "payload that looks like a frame": ([carrier[:6], carrier[6:], _text("then")], 1),
    "a frame and the start of the next": ([_text("a") + split[:20], split[20:], _text("b")], 1),
    # an unmasked frame with four more bytes, so that its length is right for a masked one
    "unmasked, the length of a masked frame": ([bytes([0x81, 5]) + ZERO_MASK + b"plain"], 0),
    "16-bit length form for a short payload": ([_head(0x81, 5, 126) + ZERO_MASK + b"short"], 1),
    "64-bit length form for a short payload": ([_head(0x81, 5, 127) + ZERO_MASK + b"short"], 1),
    "64-bit length with the top bit set": ([bytes([0x81, 0xFF]) + (2**63 + 5).to_bytes(8, "big") + ZERO_MASK + b"short"], 0),
    "exactly the size limit": ([_text("m" * MAX_SIZE)], 1),
    "a first fragment alone": ([_masked(Opcode.TEXT, b"part", fin=False)], 0),
    "ping inside a fragmented message": (
        [_masked(Opcode.TEXT, b"a", fin=False), _masked(Opcode.PING, b"p"), _masked(Opcode.CONT, b"b"), _text("c")], 1
    ),
    "ping and text in one read": ([_masked(Opcode.PING, b"p") + _text("x"), _text("y")], 1),
    "reserved opcode": ([bytes([0x83, 0x80]) + ZERO_MASK], 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_fast_path_gives_what_websockets_parser_gives(name: str) -> None:
    reads, fast_reads = CASES[name]
    (fast_msgs, fast_out, fast_closed, fast_parsed), (slow_msgs, slow_out, slow_closed, slow_parsed) = _both(reads)
    assert fast_msgs == slow_msgs
    assert fast_out == slow_out  # pongs, close frames (unmasked: the same bytes)
    assert fast_closed == slow_closed
    assert fast_parsed == slow_parsed - fast_reads


def test_the_messages_are_the_texts_sent() -> None:
    texts = ["hello", "é" * 3000, os.urandom(40_000).hex()]
    (msgs, out, closed, parsed), _ = _both([_text(t) for t in texts])
    assert [m["text"] for m in msgs] == texts and all(m["type"] == "websocket.receive" for m in msgs)
    assert out == [] and not closed and parsed == 0


def test_reading_pauses_only_while_messages_wait() -> None:
    """An application that takes each message before the next arrives never has reading paused
    (two system calls a message); one that falls behind has it paused once a message arrives
    while INBOX_READ_AHEAD bytes of earlier ones wait (small ones read ahead meanwhile, so that
    pings are answered), and resumed once it has taken them all."""
    from hotloop.server.wsproto import INBOX_READ_AHEAD

    async def main() -> None:
        taken: list[str] = []
        go = asyncio.Event()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "websocket.accept"})
            while True:
                await go.wait()
                msg = await receive()
                if msg["type"] != "websocket.receive":
                    return
                taken.append(msg["text"])

        cfg = UvicornConfig(app=app, ws=CorkedWebSocketProtocol, ws_max_size=MAX_SIZE, ws_per_message_deflate=False, lifespan="off")
        cfg.load()
        proto = CorkedWebSocketProtocol(config=cfg, server_state=ServerState(), app_state={})
        transport = _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        proto.data_received(HANDSHAKE)
        for _ in range(20):
            await asyncio.sleep(0)
        assert proto.handshake_complete
        go.set()
        for i in range(5):  # the application keeps up
            proto.data_received(_text(f"a{i}"))
            for _ in range(5):
                await asyncio.sleep(0)
        assert taken == [f"a{i}" for i in range(5)] and transport.pauses == 0 and transport.reading
        go.clear()  # now it falls behind
        for _ in range(5):
            await asyncio.sleep(0)
        for i in range(50):
            proto.data_received(_text(f"b{i}"))
        assert transport.reading and transport.pauses == 0  # small messages wait: reading goes on
        big = "c" * INBOX_READ_AHEAD
        proto.data_received(_text(big))
        assert transport.reading  # it arrived with less than INBOX_READ_AHEAD waiting
        proto.data_received(_text("d"))
        assert not transport.reading and transport.pauses == 1  # one more after it: paused
        go.set()
        for _ in range(100):
            await asyncio.sleep(0)
        assert taken[-3:] == ["b49", big, "d"] and transport.reading  # taken: reading again
        assert proto.queue.nbytes == 0  # type: ignore[attr-defined]
        proto.connection_lost(None)
        await asyncio.gather(*proto.tasks, return_exceptions=True)

    asyncio.run(main())


def test_empty_messages_read_ahead_are_bounded_too() -> None:
    """Read-ahead counted the messages' bytes only: empty messages counted nothing, and a client
    could queue them without end while the application did not take them."""
    from hotloop.server.wsproto import INBOX_READ_AHEAD, MESSAGE_OVERHEAD

    async def main() -> None:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "websocket.accept"})
            await asyncio.sleep(30)  # takes nothing

        proto, transport = await opened(app)
        n = 0
        while transport.reading and n < 10 * INBOX_READ_AHEAD:
            proto.data_received(_text(""))
            n += 1
        assert not transport.reading and n <= INBOX_READ_AHEAD // MESSAGE_OVERHEAD + 1
        proto.connection_lost(None)
        for t in proto.tasks:
            t.cancel()
        await asyncio.gather(*proto.tasks, return_exceptions=True)

    asyncio.run(main())


def test_with_debug_logging_websockets_parses_every_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """websockets logs each frame it parses when its logger is at DEBUG: the fast path stands
    aside then (uvicorn's own logging set-up is skipped, or it would reset the level)."""
    import logging

    monkeypatch.setattr(UvicornConfig, "configure_logging", lambda self: None)
    logger = logging.getLogger("uvicorn.error")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        (msgs, _, _, parsed), _ = _both([_text("logged")])
    finally:
        logger.setLevel(level)
    assert [m["text"] for m in msgs] == ["logged"] and parsed == 1
