"""A refused WebSocket handshake closes lingering: the refusal, a FIN (``write_eof``), reading
resumed (frames held since the request, and whatever comes after, are read and dropped), and the
connection closed when the client closes its side or a bound later, never at once (a socket
closed with bytes it has not read is reset: the client saw ``connection reset``, not the end of
the refusal). The real protocol class on a recording transport."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from uvicorn.config import Config as UvicornConfig
from uvicorn.server import ServerState
from websockets.frames import Opcode

from hotloop.server.wsproto import CorkedWebSocketProtocol
from tests.unit.test_ws_fast_text import HANDSHAKE, _masked, _Transport

LINGER = 0.2  # the bound of these tests (the read timeout's, when shorter than LINGER_SECONDS)


class _EofTransport(_Transport):
    def __init__(self, buffered: int = 0) -> None:
        super().__init__()
        self.eof = False
        self.aborted = False
        self.buffered = buffered

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        assert not self.closing
        self.eof = True

    def write(self, data: bytes) -> None:
        assert not self.eof, "written after the FIN"
        super().write(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def abort(self) -> None:
        self.closing = True
        self.aborted = True


async def _refused(
    refuse: str, early: bytes = b"", handshake: bytes = HANDSHAKE, buffered: int = 0
) -> tuple[CorkedWebSocketProtocol, _EofTransport, list[Any]]:
    """The handshake and ``early`` (before the application answers), then the application's
    refusal: ``close`` (a websocket.close before the accept), ``response`` (its own 401),
    ``raise`` (it fails before answering) or ``none`` (websockets refuses, the app never runs)."""
    go = asyncio.Event()
    got: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        got.append(await receive())
        await go.wait()
        if refuse == "close":
            await send({"type": "websocket.close", "code": 1008})
        elif refuse == "response":
            body = json.dumps({"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                         "param": None, "code": "invalid_api_key"}}).encode()
            await send({"type": "websocket.http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "websocket.http.response.body", "body": body[:10], "more_body": True})
            await send({"type": "websocket.http.response.body", "body": body[10:]})
        elif refuse == "raise":
            raise RuntimeError("the application failed")

    cfg = UvicornConfig(app=app, ws=CorkedWebSocketProtocol, ws_max_size=100_000, ws_per_message_deflate=False, lifespan="off")
    cfg.load()
    proto = CorkedWebSocketProtocol(config=cfg, server_state=ServerState(), app_state={})
    released: list[Any] = []
    proto.limits = SimpleNamespace(read_timeout=LINGER, release=released.append)
    transport = _EofTransport(buffered)
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.data_received(handshake)
    await asyncio.sleep(0)
    if early:
        proto.data_received(early)
        await asyncio.sleep(0)
        if refuse != "none":
            assert not transport.reading  # held until the application answers
    go.set()
    for _ in range(20):
        await asyncio.sleep(0)
    return proto, transport, got


def _lingering(transport: _EofTransport) -> None:
    assert not transport.closing, "closed at once: unread bytes reset the connection"
    assert transport.eof, "no FIN after the refusal"
    assert transport.reading, "reading stayed paused"


def _after(proto: CorkedWebSocketProtocol, transport: _EofTransport, got: list[Any]) -> None:
    """What comes next is read and dropped; the client's FIN closes the connection."""
    n, m = len(transport.written), len(got)
    proto.data_received(_masked(Opcode.TEXT, b'{"type":"response.create"}') + _masked(Opcode.PING, b"p"))
    proto.data_received(b"\x00garbage\xff" * 100)
    assert len(transport.written) == n and len(got) == m and transport.reading
    proto.eof_received()
    assert transport.closing and not transport.aborted
    proto.connection_lost(None)
    assert proto.close_timer is None


def test_the_applications_http_refusal_with_held_frames_lingers() -> None:
    async def main() -> None:
        proto, transport, got = await _refused("response", early=_masked(Opcode.TEXT, b"x" * 5000))
        out = b"".join(transport.written)
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401 ") and b"Connection: close" in head, head
        assert f"Content-Length: {len(body)}".encode() in head
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        _lingering(transport)
        assert proto.close_timer is not None  # uvicorn's run_asgi has left the transport open
        _after(proto, transport, got)

    asyncio.run(main())


def test_a_close_before_the_accept_lingers_after_its_403() -> None:
    async def main() -> None:
        proto, transport, got = await _refused("close", early=_masked(Opcode.PING, b"early"))
        out = b"".join(transport.written)
        assert out.startswith(b"HTTP/1.1 403 ") and b"early" not in out
        _lingering(transport)
        _after(proto, transport, got)

    asyncio.run(main())


def test_websockets_own_refusal_lingers() -> None:
    async def main() -> None:
        bad = HANDSHAKE.replace(b"Sec-WebSocket-Version: 13", b"Sec-WebSocket-Version: 8")
        proto, transport, got = await _refused("none", handshake=bad, early=_masked(Opcode.TEXT, b"x"))
        out = b"".join(transport.written)
        assert out.startswith(b"HTTP/1.1 400 ") and b"Sec-WebSocket-Version: 13" in out, out[:300]
        assert json.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_websocket_handshake"
        assert got == []  # the application never ran
        _lingering(transport)
        _after(proto, transport, got)

    asyncio.run(main())


def test_a_malformed_handshake_is_answered_once_and_lingers() -> None:
    async def main() -> None:
        cfg = UvicornConfig(app=lambda *a: None, ws=CorkedWebSocketProtocol, ws_per_message_deflate=False, lifespan="off")
        cfg.load()
        proto = CorkedWebSocketProtocol(config=cfg, server_state=ServerState(), app_state={})
        transport = _EofTransport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        proto.data_received(b"GET /v1/responses HTTP/1.1\r\nno colon here\r\n\r\n")
        proto.data_received(b"more bytes")
        out = b"".join(transport.written)
        assert out.count(b"HTTP/1.1 400 ") == 1, out
        _lingering(transport)
        _after(proto, transport, [])

    asyncio.run(main())


def test_a_failing_application_gets_its_500_and_the_connection_lingers() -> None:
    async def main() -> None:
        proto, transport, _ = await _refused("raise", early=_masked(Opcode.TEXT, b"x"))
        assert b"".join(transport.written).startswith(b"HTTP/1.1 500 ")
        _lingering(transport)
        await asyncio.sleep(LINGER + 0.1)
        assert transport.closing and not transport.aborted  # the bound, with nothing left to write

    asyncio.run(main())


def test_the_bound_closes_a_client_that_never_closes_and_aborts_one_that_never_reads() -> None:
    async def main() -> None:
        proto, transport, got = await _refused("response", early=_masked(Opcode.TEXT, b"x"))
        _lingering(transport)
        await asyncio.sleep(LINGER / 2)
        assert not transport.closing
        await asyncio.sleep(LINGER)
        assert transport.closing and not transport.aborted
        proto.connection_lost(None)
        # the refusal never left (a client that does not read): aborted at the bound
        proto, transport, got = await _refused("response", buffered=10_000)
        _lingering(transport)
        await asyncio.sleep(LINGER + 0.1)
        assert transport.closing and transport.aborted

    asyncio.run(main())


def test_a_shutdown_ends_the_linger_at_once() -> None:
    async def main() -> None:
        proto, transport, _ = await _refused("response", early=_masked(Opcode.TEXT, b"x"))
        _lingering(transport)
        proto.shutdown()
        assert transport.closing
        proto.connection_lost(None)
        assert proto.close_timer is None

    asyncio.run(main())


def test_without_write_eof_the_connection_still_lingers(monkeypatch: Any) -> None:
    """A transport that cannot half-close (TLS): no FIN first, the same bound."""

    async def main() -> None:
        monkeypatch.setattr(_EofTransport, "can_write_eof", lambda self: False)
        proto, transport, got = await _refused("response", early=_masked(Opcode.TEXT, b"x"))
        assert not transport.closing and not transport.eof and transport.reading
        await asyncio.sleep(LINGER + 0.1)
        assert transport.closing

    asyncio.run(main())
