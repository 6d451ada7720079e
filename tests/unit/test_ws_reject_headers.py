"""A WebSocket handshake refused with an error that carries headers (a 503's ``retry-after``)
keeps them, as the same error over HTTP does."""

from __future__ import annotations

import asyncio
from typing import Any

from hotloop import errors
from hotloop.server.ws import _reject
from hotloop.state.store import StoreBusy


def _refusal(exc: errors.HotloopError) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(_reject({"extensions": {"websocket.http.response": {}}}, send, exc))
    return sent


def test_a_refused_handshake_keeps_the_errors_headers() -> None:
    start, body = _refusal(StoreBusy())
    assert start["status"] == 503
    headers = dict(start["headers"])
    assert headers[b"retry-after"] == b"1" and headers[b"content-type"] == b"application/json"
    assert b'"type":"server_error"' in body["body"].replace(b" ", b"")
    start, _ = _refusal(errors.AuthenticationFailed("Incorrect API key provided."))
    assert start["status"] == 401 and b"retry-after" not in dict(start["headers"])


def test_a_connection_ended_by_two_lanes_at_once_is_closed_once() -> None:
    """Two lanes whose response.create each find the key revoked end the connection together:
    each sent websocket.close, and the second, after the first, was an ASGI error (a traceback in
    the log)."""
    from hotloop.server.ws import Connection

    sent: list[dict[str, Any]] = []

    async def main() -> None:
        async def send(message: dict[str, Any]) -> None:
            await asyncio.sleep(0)  # the first close is being sent when the second asks
            sent.append(message)

        conn = Connection(None, send)  # type: ignore[arg-type]
        await asyncio.gather(conn._close(1008, "invalid_api_key"), conn._close(1008, "invalid_api_key"))

    asyncio.run(main())
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "invalid_api_key"}]
