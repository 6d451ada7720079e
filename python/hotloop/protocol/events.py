"""Every wire event of the Responses API. The only module that spells ``response.*`` names.

An event leaves this module as a :data:`Frame`: ``(type, json_bytes)``. The JSON payload is the
same for SSE and WebSocket (WebSocket mode sends the SSE ``data:`` JSON as one text frame); SSE
framing adds ``event:``/``data:`` lines (:func:`sse`). Only error frames differ between transports,
and the functions below say which shape each transport gets.
"""

from __future__ import annotations

from typing import Any

import msgspec

from hotloop import _accel
from hotloop.errors import HotloopError
from hotloop.protocol.request import checked_tools

Frame = tuple[str, bytes]

# --- server -> client event types ------------------------------------------------------------
CREATED = "response.created"
IN_PROGRESS = "response.in_progress"
COMPLETED = "response.completed"
INCOMPLETE = "response.incomplete"
FAILED = "response.failed"
OUTPUT_ITEM_ADDED = "response.output_item.added"
OUTPUT_ITEM_DONE = "response.output_item.done"
CONTENT_PART_ADDED = "response.content_part.added"
CONTENT_PART_DONE = "response.content_part.done"
OUTPUT_TEXT_DELTA = "response.output_text.delta"
OUTPUT_TEXT_DONE = "response.output_text.done"
REFUSAL_DELTA = "response.refusal.delta"
REFUSAL_DONE = "response.refusal.done"
REASONING_TEXT_DELTA = "response.reasoning_text.delta"
REASONING_TEXT_DONE = "response.reasoning_text.done"
# a reasoning item streamed as its summary (``reasoning.summary`` set: protocol.turn)
REASONING_SUMMARY_PART_ADDED = "response.reasoning_summary_part.added"
REASONING_SUMMARY_PART_DONE = "response.reasoning_summary_part.done"
REASONING_SUMMARY_TEXT_DELTA = "response.reasoning_summary_text.delta"
REASONING_SUMMARY_TEXT_DONE = "response.reasoning_summary_text.done"
FUNCTION_CALL_ARGUMENTS_DELTA = "response.function_call_arguments.delta"
FUNCTION_CALL_ARGUMENTS_DONE = "response.function_call_arguments.done"
ERROR = "error"
# The events --flush-interval-ms may hold back (a batch of nothing else: only_deltas)
DELTAS = frozenset(
    (OUTPUT_TEXT_DELTA, REFUSAL_DELTA, REASONING_TEXT_DELTA, REASONING_SUMMARY_TEXT_DELTA,
     FUNCTION_CALL_ARGUMENTS_DELTA)
)
# WebSocket-only steering replies (beta)
STEER_ACCEPTED = "response.steer.accepted"
STEER_PENDING = "response.steer.pending"
STEER_FAILED = "response.steer.failed"
STEER_WAITING = "waiting_for_required_input"  # response.steer.pending's reason

# --- client -> server WebSocket frame types --------------------------------------------------
CLIENT_CREATE = "response.create"
CLIENT_PROCESSED = "response.processed"  # Codex acknowledgement: accepted, never answered
CLIENT_APPEND = "response.append"
CLIENT_STEER = "response.steer"
CLIENT_INJECT = "response.inject"

# --- objects ---------------------------------------------------------------------------------
RESPONSE_OBJECT = "response"
INPUT_TOKENS_OBJECT = "response.input_tokens"

_encode = msgspec.json.Encoder().encode
_encode_delta = _accel.encode_delta
_encode_sse = _accel.encode_sse


def encode(obj: Any) -> bytes:
    return _encode(obj)


def event(kind: str, seq: int, **fields: Any) -> Frame:
    """A non-delta event. ``type`` and ``sequence_number`` come first, as OpenAI sends them."""
    return kind, _encode({"type": kind, "sequence_number": seq, **fields})


LONG_INSTRUCTIONS = 1024  # characters from which instructions are encoded once per response


def response_event(kind: str, seq: int, response: dict[str, Any], memo: list[Any] | None = None) -> Frame:
    """An event that carries the whole response (created, in progress, completed, ...). Its
    tools, when they are an array decoded once for many requests (:mod:`hotloop.pipeline.settings`),
    are written as the bytes they were encoded to then, and long instructions, with ``memo``
    (the response's: ``[None, None]`` at first), as the bytes its first such event encoded them
    to (the same bytes: one encoder, one value), not encoded again for every such event."""
    shared = checked_tools(response.get("tools"))
    instructions = response.get("instructions")
    long = memo is not None and type(instructions) is str and len(instructions) >= LONG_INSTRUCTIONS
    if shared is not None or long:
        response = dict(response)
        if shared is not None:
            response["tools"] = msgspec.Raw(shared.json)
        if long:
            assert memo is not None
            if memo[0] is not instructions:  # (the memo holds the string: its id is not reused)
                memo[0], memo[1] = instructions, msgspec.Raw(_encode(instructions))
            response["instructions"] = memo[1]
    return kind, _encode({"type": kind, "sequence_number": seq, "response": response})


def text_delta(seq: int, item_id: str, output_index: int, content_index: int, delta: str) -> Frame:
    return OUTPUT_TEXT_DELTA, _encode_delta(
        OUTPUT_TEXT_DELTA, seq, item_id, output_index, content_index, delta, True
    )


def refusal_delta(seq: int, item_id: str, output_index: int, content_index: int, delta: str) -> Frame:
    """``response.refusal.delta``: ``item_id, output_index, content_index, delta`` (no logprobs)."""
    return REFUSAL_DELTA, _encode_delta(REFUSAL_DELTA, seq, item_id, output_index, content_index, delta, False)


def reasoning_delta(seq: int, item_id: str, output_index: int, content_index: int, delta: str) -> Frame:
    return REASONING_TEXT_DELTA, _encode_delta(
        REASONING_TEXT_DELTA, seq, item_id, output_index, content_index, delta, False
    )


_SUMMARY_DELTA_HEAD = b'{"type":"' + REASONING_SUMMARY_TEXT_DELTA.encode() + b'","sequence_number":'


def summary_delta_fields(item_id: str, output_index: int, summary_index: int) -> bytes:
    """The bytes of a summary part's deltas between the sequence number and the delta (the same
    for every delta of the part): built once per part, for :func:`summary_delta`."""
    tail = b',"output_index":%d,"summary_index":%d,"delta":' % (output_index, summary_index)
    return b',"item_id":' + _encode(item_id) + tail


def summary_delta(seq: int, fields: bytes, delta: str) -> Frame:
    """``response.reasoning_summary_text.delta``: ``item_id, output_index, summary_index, delta``
    (``fields``: :func:`summary_delta_fields` of the part). The native delta encoder writes a
    ``content_index`` where this event has a ``summary_index``; this costs about the same (the
    bytes built once per part, the sequence number and the delta's JSON string, joined)."""
    return REASONING_SUMMARY_TEXT_DELTA, b"%s%d%s%s}" % (_SUMMARY_DELTA_HEAD, seq, fields, _encode(delta))


def arguments_delta(seq: int, item_id: str, output_index: int, delta: str) -> Frame:
    return FUNCTION_CALL_ARGUMENTS_DELTA, _encode_delta(
        FUNCTION_CALL_ARGUMENTS_DELTA, seq, item_id, output_index, -1, delta, False
    )


def sse(frame: Frame) -> bytes:
    """SSE framing: ``event: <type>`` then ``data: <json>`` and a blank line."""
    return _encode_sse(frame[0], frame[1])


# --- errors in the three wire shapes ---------------------------------------------------------


def http_error_body(err: HotloopError) -> bytes:
    """``{"error": {message, type, param, code}}`` for an HTTP error response."""
    return _encode({"error": err.body()})


def sse_error(err: HotloopError, seq: int) -> Frame:
    """The SSE ``error`` event, nested as real OpenAI streams send it (followed by ``response.failed``).

    openai-python raises ``APIError`` on it, which is what a streaming caller of OpenAI sees too.
    """
    return ERROR, _encode({"type": ERROR, "sequence_number": seq, "error": err.body()})


def stream_id_suffix(stream_id: str | None) -> bytes:
    """Named lanes echo ``stream_id`` on every event: these bytes replace an event's closing brace
    (``payload[:-1] + suffix``), so encoded events need not be decoded to carry it."""
    if stream_id is None:
        return b""
    return b',"stream_id":' + _encode(stream_id) + b"}"


def steer_accepted(seq: int, steer_id: str, previous_response_id: str) -> Frame:
    """``response.steer.accepted``: the server owns the input (the successor's ``response.created``
    commits it)."""
    return STEER_ACCEPTED, _encode(
        {
            "type": STEER_ACCEPTED,
            "sequence_number": seq,
            "steer": {"id": steer_id, "previous_response_id": previous_response_id},
        }
    )


def steer_pending(seq: int, steer_id: str, previous_response_id: str, required_input: list[dict[str, Any]]) -> Frame:
    """``response.steer.pending`` after ``response.completed``: the input waits for the client's
    tool output (``required_input`` stubs)."""
    return STEER_PENDING, _encode(
        {
            "type": STEER_PENDING,
            "sequence_number": seq,
            "steer": {"id": steer_id, "previous_response_id": previous_response_id},
            "reason": STEER_WAITING,
            "required_input": required_input,
        }
    )


def steer_failed(
    seq: int, code: str, message: str, previous_response_id: str, input: Any, steer_id: str | None = None
) -> Frame:
    """``response.steer.failed``: the input that was not committed comes back (with its id once
    one was allocated)."""
    steer: dict[str, Any] = {"input": input, "previous_response_id": previous_response_id}
    if steer_id is not None:
        steer["id"] = steer_id
    return STEER_FAILED, _encode(
        {
            "type": STEER_FAILED,
            "sequence_number": seq,
            "error": {"type": "invalid_request_error", "code": code, "message": message},
            "steer": steer,
        }
    )


def ws_error(err: HotloopError, stream_id: str | None = None) -> Frame:
    """The WebSocket error frame: ``status`` always present (Codex needs it), no sequence number."""
    obj: dict[str, Any] = {"type": ERROR, "status": err.status, "error": err.body()}
    if err.headers:
        obj["error"]["headers"] = err.headers
    if stream_id is not None:
        obj["stream_id"] = stream_id
    return ERROR, _encode(obj)


def only_deltas(batch: list[Frame]) -> bool:
    """Whether a pushed batch holds nothing but deltas (what ``--flush-interval-ms`` may hold
    back; an item's start or end goes out at once)."""
    for name, _ in batch:
        if name not in DELTAS:
            return False
    return True
