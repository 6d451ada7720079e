"""What the HTTP and WebSocket transports share: ASGI types, request ids, JSON encoding."""

from __future__ import annotations

import os
import secrets
from typing import Any, Awaitable, Callable

import msgspec

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_HEADER = (b"content-type", b"application/json")
encode = msgspec.json.Encoder().encode


_POOL_BYTES = 4096  # 256 request ids per draw from the OS CSPRNG
_pool = b""
_pos = 0


def request_id() -> str:
    """``req_`` and 32 hex digits (16 random bytes). The bytes come from the OS CSPRNG 4 KiB at
    a time, not one ``getrandom`` syscall per request (as :class:`hotloop.protocol.objects.IdGen`
    draws response ids)."""
    global _pool, _pos
    pos = _pos
    if pos + 16 > len(_pool):
        _pool = secrets.token_bytes(_POOL_BYTES)
        pos = 0
    _pos = pos + 16
    return "req_" + _pool[pos : pos + 16].hex()


def _forget_pool() -> None:
    """A forked worker draws its own bytes: two processes never hand out the same ids."""
    global _pool, _pos
    _pool, _pos = b"", 0


os.register_at_fork(after_in_child=_forget_pool)
