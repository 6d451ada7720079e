"""The internal vocabulary that backends produce and the turn machine consumes.

Backends never see wire JSON and never build events: they yield these small immutable records.
The turn machine (:mod:`hotloop.protocol.turn`) turns them into Responses events.
"""

from __future__ import annotations

from typing import Union

import msgspec


class TextDelta(msgspec.Struct, frozen=True, gc=False):
    """A piece of the assistant's visible answer."""

    text: str


class RefusalDelta(msgspec.Struct, frozen=True, gc=False):
    """A piece of the assistant's refusal (chat ``delta.refusal``): a ``refusal`` content part of
    the message, never output text."""

    text: str


class ReasoningDelta(msgspec.Struct, frozen=True, gc=False):
    """A piece of raw reasoning text (``reasoning_text`` content)."""

    text: str


class ToolCallDelta(msgspec.Struct, frozen=True, gc=False):
    """A piece of one function call.

    ``index`` identifies the call within the response (backends number them 0, 1, ...). The first
    delta of an index carries ``call_id`` and ``name``; later ones may leave them ``None``.
    ``cut``: the call was cut short (the response ended at a token limit before its arguments
    did), so it ends ``incomplete`` even when another item follows it (a backend interleaving
    parallel calls' arguments, whose calls hotloop emits one after the other at the end).
    """

    index: int
    arguments: str = ""
    call_id: str | None = None
    name: str | None = None
    cut: bool = False


class Usage(msgspec.Struct, frozen=True, gc=False):
    """Token accounting reported by the backend (any field may be unknown: ``None``)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None


class Finish(msgspec.Struct, frozen=True, gc=False):
    """The backend finished. ``reason``: stop, length, tool_calls or content_filter."""

    reason: str = "stop"


class Failure(msgspec.Struct, frozen=True, gc=False):
    """The model failed in a way that ends the response with ``response.failed``.

    This is a *model* outcome (a refusal to continue, an invalid generation), not a transport
    error: transport errors are raised as :class:`hotloop.errors.HotloopError`.
    """

    code: str = "server_error"
    message: str = "The model failed to generate a response."


Chunk = Union[TextDelta, RefusalDelta, ReasoningDelta, ToolCallDelta, Usage, Finish, Failure]
