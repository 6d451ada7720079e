"""What the HTTP and WebSocket transports share: ASGI types, request ids, JSON encoding."""

from __future__ import annotations

import secrets
from typing import Any, Awaitable, Callable

import msgspec

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_HEADER = (b"content-type", b"application/json")
encode = msgspec.json.Encoder().encode


def request_id() -> str:
    return "req_" + secrets.token_hex(16)
