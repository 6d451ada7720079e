"""One WebSocket-mode connection, sans-I/O: frames in, actions out.

The session parses each client text frame and says what the connection must do next, in order:
run a ``response.create``, send an error frame, or nothing (``response.processed``). It owns the
FIFO discipline (one response in flight per connection, later ``response.create`` frames queued,
at most ``max_queued``), and the connection's lifetime (OpenAI's 60-minute limit).

The transport (``hotloop.server.ws``) feeds frames and executes the actions strictly in order,
so an error about a malformed frame can never interleave with the events of a response that is
still streaming.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from hotloop import errors
from hotloop.protocol import events as ev
from hotloop.protocol.request import STREAM_ID_RE, CreateRequest, convert_body, shown


class RunCreate(msgspec.Struct):
    request: CreateRequest
    mark: float = 0.0  # the transport's CPU clock when the frame arrived (for turn statistics)


class SendError(msgspec.Struct):
    error: errors.HotloopError
    stream_id: str | None = None
    evict: str | None = None  # the parent a failed continuation names: the cache drops it


class Close(msgspec.Struct):
    code: int
    reason: str = ""


Action = Union[RunCreate, SendError, Close]

_decode = msgspec.json.Decoder(dict[str, Any]).decode

_UNSUPPORTED = {
    ev.CLIENT_STEER: f"Steering ('{ev.CLIENT_STEER}') is not supported by this server.",
    ev.CLIENT_INJECT: f"'{ev.CLIENT_INJECT}' is not supported by this server.",
    ev.CLIENT_APPEND: f"'{ev.CLIENT_APPEND}' (the 2026-02-04 beta) is not supported; use "
    f"'{ev.CLIENT_CREATE}' with 'previous_response_id'.",
}


class Session:
    """State of one connection. ``clock`` is injected: the session never reads time itself."""

    def __init__(
        self, *, opened_at: float, max_age: float = 3600.0, max_queued: int = 64, max_lanes: int = 32
    ) -> None:
        self.opened_at = opened_at
        self.max_lanes = max_lanes
        self.lanes: set[str] = set()
        self.max_age = max_age
        self.max_queued = max_queued
        self.queued = 0  # accepted frames whose action has not finished yet
        self.closing = False

    def expired(self, now: float) -> bool:
        return now - self.opened_at >= self.max_age

    def expire(self) -> list[Action]:
        """The connection reached its age limit (the transport's timer says so, or a frame arrived
        after it): say why, then close with 1001. Anything queued is not started."""
        if self.closing:
            return []
        self.closing = True
        return [SendError(self.limit_error()), Close(1001, "connection limit reached")]

    def limit_error(self) -> errors.HotloopError:
        minutes = self.max_age / 60
        return errors.ConnectionLimitReached(
            f"Responses websocket connection limit reached ({minutes:g} minutes). Create a new "
            "websocket connection to continue."
        )

    def lane_allowed(self, stream_id: str) -> bool:
        if stream_id in self.lanes:
            return True
        if len(self.lanes) >= self.max_lanes:
            return False
        if STREAM_ID_RE.match(stream_id):
            self.lanes.add(stream_id)
        return True

    def receive(self, data: str | bytes, now: float) -> list[Action]:
        """Actions for one client frame (binary frames are rejected, as Codex expects text)."""
        if self.closing:
            return []
        if isinstance(data, bytes):
            return [SendError(errors.InvalidRequest("Binary frames are not supported; send JSON text frames."))]
        try:
            frame = _decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return [SendError(errors.InvalidJSON("The frame is not a valid JSON object."))]
        except RecursionError:
            return [SendError(errors.InvalidJSON("The frame's JSON is nested too deeply."))]
        kind = frame.get("type")
        if kind == ev.CLIENT_PROCESSED:
            return []  # Codex's acknowledgement expects no reply
        stream_id = frame.get("stream_id") if isinstance(frame.get("stream_id"), str) else None
        if kind != ev.CLIENT_CREATE:
            if isinstance(kind, str) and kind in _UNSUPPORTED:
                return [SendError(errors.UnsupportedParameter(_UNSUPPORTED[kind], param="type"), stream_id)]
            return [
                SendError(
                    errors.InvalidValue(
                        f"Invalid 'type': {shown(kind)}. Supported client events are '{ev.CLIENT_CREATE}' "
                        f"and '{ev.CLIENT_PROCESSED}'.",
                        param="type",
                    ),
                    stream_id,
                )
            ]
        if self.expired(now):
            return self.expire()
        if self.queued >= self.max_queued:
            return [
                SendError(
                    errors.QueueFull(
                        f"Too many queued '{ev.CLIENT_CREATE}' events on this connection (limit "
                        f"{self.max_queued}); wait for responses to complete.",
                    ),
                    stream_id,
                )
            ]
        if stream_id is not None and not self.lane_allowed(stream_id):
            return [
                SendError(
                    errors.InvalidValue(
                        f"This WebSocket connection has reached its maximum number of distinct stream IDs "
                        f"({self.max_lanes}). Reuse an existing stream_id or open a new WebSocket connection.",
                        param="stream_id",
                        code="websocket_stream_limit_reached",
                    ),
                    stream_id,
                )
            ]
        try:
            req = convert_body(frame)
        except errors.HotloopError as exc:
            prev = frame.get("previous_response_id")
            return [SendError(exc, stream_id, prev if isinstance(prev, str) else None)]
        self.queued += 1
        return [RunCreate(req)]

    def done(self) -> None:
        """The transport finished one ``RunCreate``."""
        self.queued -= 1
