"""What the HTTP and WebSocket transports share: ASGI types, request ids, JSON encoding."""

from __future__ import annotations

import os
from typing import Any, Awaitable, Callable

import msgspec

from hotloop.protocol.objects import IdGen

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_HEADER = (b"content-type", b"application/json")
encode = msgspec.json.Encoder().encode


# ``req_`` and 32 hex digits, drawn from the OS CSPRNG in 4 KiB pools (IdGen), not one getrandom
# syscall per request; a forked worker draws its own
_request_ids = IdGen(id_bytes=16)
os.register_at_fork(after_in_child=_request_ids.forget)


def request_id() -> str:
    return _request_ids.new("req")
