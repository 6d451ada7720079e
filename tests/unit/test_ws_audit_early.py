"""Bytes a client sends after its handshake request and before the server's 101 (frames
pipelined behind the upgrade, or sent without waiting for it): the real protocol class on a
recording transport, the application accepting only after they arrived."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config as UvicornConfig
from uvicorn.server import ServerState
from websockets.frames import Close, Frame, Opcode

from hotloop.server.wsproto import CorkedWebSocketProtocol
from tests.unit.test_ws_fast_text import HANDSHAKE, _masked, _Transport

async def _early(reads: bytes, accept: bool = True) -> tuple[bytes, list[Any], _Transport]:
    """Feed the handshake, then ``reads`` before the application answers it; then let it
    accept (or refuse). What the server wrote, and the messages the application received."""
    go = asyncio.Event()
    got: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        got.append(await receive())  # websocket.connect
        await go.wait()  # authenticating, say
        if not accept:
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "websocket.accept"})
        while True:
            msg = await receive()
            got.append(msg)
            if msg["type"] == "websocket.disconnect":
                return

    cfg = UvicornConfig(app=app, ws=CorkedWebSocketProtocol, ws_max_size=100_000, ws_per_message_deflate=False, lifespan="off")
    cfg.load()
    proto = CorkedWebSocketProtocol(config=cfg, server_state=ServerState(), app_state={})
    transport = _Transport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.data_received(HANDSHAKE)
    await asyncio.sleep(0)
    proto.data_received(reads)
    await asyncio.sleep(0)
    go.set()
    for _ in range(20):
        await asyncio.sleep(0)
    proto._flush()
    return b"".join(transport.written), got, transport


def test_a_ping_before_the_101_is_answered_after_it() -> None:
    async def main() -> None:
        out, got, transport = await _early(_masked(Opcode.PING, b"early") + _masked(Opcode.TEXT, b'{"a":1}'))
        assert out.startswith(b"HTTP/1.1 101 "), out[:40]
        assert out.endswith(b"\r\n\r\n" + Frame(Opcode.PONG, b"early").serialize(mask=False)), out[-20:]
        assert [m.get("text") for m in got[1:]] == ['{"a":1}']
        assert transport.reading  # the application took the message: reading is on again

    asyncio.run(main())


def test_a_close_before_the_101_is_answered_after_it_and_the_application_sees_it() -> None:
    async def main() -> None:
        out, got, _ = await _early(_masked(Opcode.CLOSE, Close(1000, "bye").serialize()))
        assert out.startswith(b"HTTP/1.1 101 "), out[:40]
        assert out.endswith(Frame(Opcode.CLOSE, Close(1000, "bye").serialize()).serialize(mask=False))
        assert got[-1]["type"] == "websocket.disconnect" and got[-1]["code"] == 1000

    asyncio.run(main())


def test_frames_before_a_refusal_are_dropped() -> None:
    async def main() -> None:
        out, got, _ = await _early(_masked(Opcode.PING, b"early") + _masked(Opcode.TEXT, b"x"), accept=False)
        assert out.startswith(b"HTTP/1.1 403 "), out[:40]
        assert b"early" not in out
        assert len(got) == 1

    asyncio.run(main())
