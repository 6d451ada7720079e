"""One response's event sequence. Sans-I/O: chunks in, frames out.

A :class:`Turn` numbers events from 0 without gaps, assigns ``output_index`` and item ids, opens
and closes output items, and keeps the final Response object equal to what was streamed (item
ids, texts and arguments are the same in the stream and in ``response.completed``).

Item life cycle, as a table (DESIGN principle 2). The open item is one of ``None``, ``message``,
``reasoning`` or ``call:<index>``; a chunk whose target differs from the open item closes it
(``.done`` events) and opens its own (``.added`` events):

    chunk           target
    TextDelta       message (an ``output_text`` part)
    RefusalDelta    refusal (a ``refusal`` part of a message)
    ReasoningDelta  reasoning
    ToolCallDelta   call:<index>

A reasoning item is streamed in one of two shapes, chosen per response (``reasoning_summary``,
from the request's ``reasoning.summary``: :func:`objects.wants_summary`):

    raw (no summary asked for)   ``content: [reasoning_text]``, ``summary: []``;
                                 ``content_part.added``, ``reasoning_text.delta|done``,
                                 ``content_part.done``
    summary                      ``summary: [summary_text]``, no ``content``;
                                 ``reasoning_summary_part.added``, ``reasoning_summary_text.delta|done``,
                                 ``reasoning_summary_part.done`` (``summary_index`` 0)

hotloop has no summarizer model: the summary's text is the model's reasoning, verbatim (what
the backend streamed as ``delta.reasoning``), in one summary part. Clients that only read
summaries (the Vercel AI SDK, Codex without ``show_raw_agent_reasoning``, Goose, Zed) then show
it; the item coming back (sent back with its summary, referred to by id, chained by
``previous_response_id``) is rendered as reasoning history from its summary
(``backends.chat.render``). The final item does not repeat it as raw ``content``: the same text twice would double
the item's bytes in ``output_item.done``, ``response.completed``, the stored response and every
input that sends the item back, for no reader (the summary is the reasoning).

A reasoning item of a response that asked for it (``include`` ``reasoning.encrypted_content``,
or ``store: false``: :func:`objects.wants_encrypted_reasoning`) also carries ``encrypted_content``,
its text sealed (:mod:`hotloop.protocol.sealed`; the ``seal`` the turn is given), from its
``output_item.done`` on (the final item, so the terminal event, the JSON answer and what is
stored): once per item, when it closes. Not in ``output_item.added`` (where OpenAI's has it
too): the reasoning streams as it comes, so its text is not known then; clients read it from
the done event (the AI SDK, Codex). Any other response's events are unchanged.

``message`` and ``refusal`` are the same kind of output item, a message, with a different content
part open: going from one to the other keeps the message open and closes its part
(``output_text.done``/``refusal.done``, ``content_part.done``) and adds the next part at the next
``content_index`` (a chat message may carry content and a refusal). A refusal never goes into
output text: clients' ``output_text`` leaves it out, as OpenAI's does.

Terminal outcomes: ``finish()`` -> ``response.completed``, or ``response.incomplete`` when the
backend stopped for ``length``/``content_filter`` or the response was steered (``finish("steered")``
at a :attr:`Turn.steerable` boundary); ``fail()`` -> ``response.failed`` (preceded
on SSE by the nested ``error`` event when the failure is a transport/backend error).
"""

from __future__ import annotations

from typing import Any, Callable

from hotloop import errors
from hotloop._accel import PLAIN_ARGUMENTS, PLAIN_REASONING, PLAIN_TEXT, DeltaLane
from hotloop.protocol import events as ev
from hotloop.protocol.chunks import (
    Chunk,
    Failure,
    Finish,
    ReasoningDelta,
    RefusalDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from hotloop.protocol.events import Frame
from hotloop.protocol.objects import IdGen, usage_object

_MESSAGE = "message"
STEERED = "steered"  # finish() reason and incomplete_details.reason of a steered response
_text_delta = ev.text_delta
_REASONING = "reasoning"
_REFUSAL = "refusal"  # a message whose open content part is a refusal
_PARTS = (_MESSAGE, _REFUSAL)  # the keys of a message: its open part's kind


class _Quiet:
    """The event builders of a turn nobody reads the events of (a non-streaming response): each
    event still takes its sequence number (counts and metrics are the same), none is encoded."""

    NO_FRAME: Frame = ("", b"")

    @staticmethod
    def event(*_args: Any, **_kwargs: Any) -> Frame:
        return _Quiet.NO_FRAME

    text_delta = refusal_delta = reasoning_delta = summary_delta = arguments_delta = sse_error = response_event = event


_quiet_text_delta = _Quiet.text_delta
_SUMMARY_PART: dict[str, Any] = {"type": "summary_text", "text": ""}  # (encoded only: never mutated)

# Phases of the whole response (a table: which calls are legal in which phase).
_NEW, _STREAMING, _DONE = "new", "streaming", "done"
_LEGAL = {
    "start": {_NEW},
    "feed": {_STREAMING},
    "finish": {_STREAMING},
    "fail": {_NEW, _STREAMING},
}


def _empty_part(key: str) -> dict[str, Any]:
    """The content part ``content_part.added`` announces for a message part of kind ``key``."""
    if key == _REFUSAL:
        return {"type": "refusal", "refusal": ""}
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}


class TurnStateError(RuntimeError):
    """A programming error: a call the turn's phase does not allow."""


class _OpenItem:
    __slots__ = ("key", "output_index", "item_id", "parts", "call_id", "name", "lane", "content_index", "content",
                 "summary_fields", "cut")

    def __init__(self, key: str, output_index: int, item_id: str) -> None:
        self.key = key
        self.output_index = output_index
        self.item_id = item_id
        self.parts: list[str] = []  # the open content part's pieces (a call's: its arguments)
        self.content_index = 0  # the open content part's (a message may have several)
        self.content: list[dict[str, Any]] = []  # a message's closed content parts
        self.call_id = ""
        self.name = ""
        self.lane: DeltaLane | None = None  # Turn.lane
        self.summary_fields = b""  # a reasoning summary's delta fields (events.summary_delta_fields)
        self.cut = False  # a call cut short (ToolCallDelta.cut): closed incomplete whatever follows


class Turn:
    """Build one response's events.

    ``response`` is the in-progress Response object (see :func:`objects.response_object`); the
    turn owns it from here on and fills ``output``, ``status``, ``usage``, ``completed_at``.
    ``transport`` is ``"sse"`` or ``"ws"``: it only changes how mid-stream errors are reported.
    ``reasoning_summary``: stream reasoning as the item's summary (the request set
    ``reasoning.summary``), else as raw ``reasoning_text`` (the module's docstring).
    ``seal``: text -> a reasoning item's ``encrypted_content`` (:func:`sealed.seal`), for a
    response that asked for it; None: no such field.
    """

    def __init__(
        self,
        response: dict[str, Any],
        *,
        ids: IdGen,
        transport: str = "sse",
        input_tokens: int = 0,
        cached_tokens: int = 0,
        max_tool_calls: int | None = None,
        clock: Callable[[], float],
        quiet: bool = False,
        reasoning_summary: bool = False,
        seal: Callable[[str], str] | None = None,
    ) -> None:
        # quiet: the frames are placeholders (a JSON response is built from ``response`` alone)
        self._ev: Any = _Quiet if quiet else ev
        self.reasoning_summary = reasoning_summary
        self._seal = seal
        self._encoded: list[Any] = [None, None]  # this response's long instructions, encoded once
        self._text_delta = _quiet_text_delta if quiet else _text_delta
        self.response = response
        self.ids = ids
        self.transport = transport
        self.input_tokens = input_tokens
        self.cached_tokens = cached_tokens
        # input items ``truncation: "auto"`` dropped: reported in usage when any (usage_object)
        self.truncated_items = 0
        self.max_tool_calls = max_tool_calls
        self._clock = clock
        self._seq = 0
        self._lane: DeltaLane | None = None  # the lane handed over (lane()), if any
        self._phase = _NEW
        self._open: _OpenItem | None = None
        self._output: list[dict[str, Any]] = response["output"]
        self._closed_calls: set[int] = set()
        self._call_ids: set[str] = set()  # the call ids of this response's calls (_open_item)
        self._calls = 0
        self._dropped_calls: set[int] = set()
        self._usage: Usage | None = None
        self.error: errors.HotloopError | None = None  # what a failed response failed with
        self._output_tokens_seen = 0  # deltas counted, used when the backend reports no usage
        self._reasoning_seen = 0  # ... of them, reasoning deltas (counted as its items close)

    # -- helpers -------------------------------------------------------------------------------

    def _check(self, op: str) -> None:
        if self._phase not in _LEGAL[op]:
            raise TurnStateError(f"{op}() is not allowed in phase {self._phase!r}")

    def _next(self) -> int:
        seq = self._seq
        self._seq = seq + 1
        return seq

    @property
    def status(self) -> str:
        return str(self.response["status"])

    @property
    def events(self) -> int:
        """Events emitted so far."""
        self._sync()
        return self._seq

    @property
    def done(self) -> bool:
        return self._phase == _DONE

    def aside(self) -> int:
        """A sequence number for an event outside the turn's own sequence that joins its stream
        (a steering reply on WebSocket), so the numbers on the wire stay increasing."""
        self._sync()
        seq = self._next()
        if self._lane is not None:
            self._lane.seq = self._seq  # the lane's next event comes after this one
        return seq

    @property
    def steerable(self) -> bool:
        """Whether a steered response may stop here: a safe output boundary, never inside a
        function call's arguments and never once a function call was emitted (its output is
        owed by the client, so such a response runs to its own end)."""
        item = self._open
        return self._phase is _STREAMING and self._calls == 0 and (item is None or not item.key.startswith("call:"))

    # -- phases --------------------------------------------------------------------------------

    def start(self) -> list[Frame]:
        """``response.created`` and ``response.in_progress``."""
        self._check("start")
        self._phase = _STREAMING
        return [
            self._ev.response_event(ev.CREATED, self._next(), self.response, self._encoded),
            self._ev.response_event(ev.IN_PROGRESS, self._next(), self.response, self._encoded),
        ]

    def feed(self, chunk: Chunk) -> list[Frame]:
        """Events for one backend chunk (usually exactly one delta event)."""
        if self._lane is not None:
            self._sync()
        if self._phase is not _STREAMING:
            self._check("feed")
        kind = type(chunk)
        if kind is TextDelta:
            item = self._open
            text = chunk.text  # type: ignore[union-attr]
            if item is not None and text and item.key == _MESSAGE:
                # the common case, one more token of the open message: exactly one event
                item.parts.append(text)
                self._output_tokens_seen += 1
                seq = self._seq
                self._seq = seq + 1
                return [self._text_delta(seq, item.item_id, item.output_index, item.content_index, text)]
            return self._delta(_MESSAGE, text)
        if kind is ToolCallDelta:
            return self._call_delta(chunk)  # type: ignore[arg-type]
        if kind is ReasoningDelta:
            return self._delta(_REASONING, chunk.text)  # type: ignore[union-attr]
        if kind is RefusalDelta:
            return self._delta(_REFUSAL, chunk.text)  # type: ignore[union-attr]
        if kind is Usage:
            self._usage = chunk  # type: ignore[assignment]
            return []
        if kind is Finish:
            return self.finish(chunk.reason)  # type: ignore[union-attr]
        if kind is Failure:
            return self.fail(
                errors.ModelError(chunk.message, code=chunk.code),  # type: ignore[union-attr]
                error_event=False,
            )
        raise TypeError(f"unknown chunk {chunk!r}")

    def lane(self) -> DeltaLane | None:
        """The open item's :class:`DeltaLane`, handed over: its ``seq`` is this turn's next
        sequence number and its ``parts`` the item's pieces, so ``SseDecoder.feed_lane`` can
        read the item's plain deltas into events without this machine. Every method of the turn
        first takes back what the lane read since (``taken``, ``seq``); call this again after
        any of them before reading into the lane again. None when no item is open. A quiet
        turn has lanes too: their events are encoded (natively, cheaper than the general path
        that skips them) and not sent. A reasoning item streamed as its summary has a
        ``summary`` lane (its deltas are ``reasoning_summary_text.delta`` events, ``summary_index``
        0: the bytes of :func:`events.summary_delta`). A message's refusal part has none
        (``plain_delta`` never reads a refusal piece as plain): its deltas come as chunks,
        through :meth:`feed`."""
        self._sync()
        item = self._open
        if item is None or self._phase is not _STREAMING:
            return None
        lane = item.lane
        if lane is None:
            key = item.key
            if key == _MESSAGE:
                lane = DeltaLane(PLAIN_TEXT, 0, ev.OUTPUT_TEXT_DELTA, item.item_id, item.output_index,
                                 item.content_index, True, item.parts)
            elif key == _REFUSAL:
                self._lane = None
                return None
            elif key == _REASONING:
                summary = self.reasoning_summary  # its one summary part (summary_index 0), or content part 0
                kind = ev.REASONING_SUMMARY_TEXT_DELTA if summary else ev.REASONING_TEXT_DELTA
                lane = DeltaLane(PLAIN_REASONING, 0, kind, item.item_id, item.output_index, 0, False, item.parts,
                                 summary=summary)
            else:
                lane = DeltaLane(PLAIN_ARGUMENTS, int(key[5:]), ev.FUNCTION_CALL_ARGUMENTS_DELTA, item.item_id,
                                 item.output_index, -1, False, item.parts)
            item.lane = lane
        self._lane = lane
        lane.seq = self._seq
        return lane

    def _sync(self) -> None:
        """Take back what the handed-over lane read (:meth:`lane`): its events' numbers and its
        pieces (already in the item's parts)."""
        lane = self._lane
        if lane is not None and lane.taken:
            self._output_tokens_seen += lane.taken
            lane.taken = 0
            self._seq = lane.seq

    def _delta(self, key: str, text: str) -> list[Frame]:
        out: list[Frame] = []
        item = self._open
        if item is None or item.key != key:
            if item is not None and item.key in _PARTS and key in _PARTS:
                if not text:
                    return out  # nothing to say: no empty part
                self._next_part(item, key, out)  # text <-> refusal: the same message, its next part
            else:
                item = self._open_item(key, out)
        if not text:
            return out
        item.parts.append(text)
        self._output_tokens_seen += 1
        if key == _MESSAGE:
            out.append(self._ev.text_delta(self._next(), item.item_id, item.output_index, item.content_index, text))
        elif key == _REFUSAL:
            out.append(self._ev.refusal_delta(self._next(), item.item_id, item.output_index, item.content_index, text))
        elif self.reasoning_summary:
            out.append(self._ev.summary_delta(self._next(), item.summary_fields, text))
        else:
            out.append(self._ev.reasoning_delta(self._next(), item.item_id, item.output_index, 0, text))
        return out

    def _call_delta(self, chunk: ToolCallDelta) -> list[Frame]:
        out: list[Frame] = []
        key = f"call:{chunk.index}"
        item = self._open
        if item is None or item.key != key:
            if chunk.index in self._dropped_calls:
                return out
            if chunk.index in self._closed_calls:
                raise TurnStateError(f"tool call {chunk.index} continued after it was closed")
            if self.max_tool_calls is not None and self._calls >= self.max_tool_calls:
                # max_tool_calls reached: further calls are not emitted (OpenAI stops calling).
                self._dropped_calls.add(chunk.index)
                return out
            item = self._open_item(key, out, chunk)
        if chunk.cut:
            item.cut = True
        if chunk.arguments:
            item.parts.append(chunk.arguments)
            self._output_tokens_seen += 1
            out.append(self._ev.arguments_delta(self._next(), item.item_id, item.output_index, chunk.arguments))
        return out

    def _open_item(self, key: str, out: list[Frame], call: ToolCallDelta | None = None) -> _OpenItem:
        if self._open is not None:
            self._close_item("incomplete" if self._open.cut else "completed", out)
        index = len(self._output)
        if key in _PARTS:
            item = _OpenItem(key, index, self.ids.new("msg"))
            obj: dict[str, Any] = {
                "id": item.item_id,
                "type": "message",
                "status": "in_progress",
                "content": [],
                "role": "assistant",
            }
            part: dict[str, Any] | None = _empty_part(key)
        elif key == _REASONING:
            item = _OpenItem(key, index, self.ids.new("rs"))
            if self.reasoning_summary:
                # The summary is the model's reasoning verbatim (hotloop has no summarizer; see
                # the module's docstring): one summary part, no raw content.
                obj = {"id": item.item_id, "type": "reasoning", "summary": []}
                part = _SUMMARY_PART
                item.summary_fields = ev.summary_delta_fields(item.item_id, index, 0)
            else:
                obj = {"id": item.item_id, "type": "reasoning", "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
        else:
            assert call is not None
            item = _OpenItem(key, index, self.ids.new("fc"))
            call_id = call.call_id
            if not call_id or call_id in self._call_ids:
                # A backend that gives two calls of one response the same id: the second gets its
                # own, as a call without an id does. Clients tell a response's calls apart by
                # call_id (openai-python's and openai-node's stream helpers raise on a repeated
                # one) and answer each with a function_call_output naming it.
                call_id = self.ids.new("call")
            self._call_ids.add(call_id)
            item.call_id = call_id
            item.name = call.name or ""
            self._calls += 1
            obj = {
                "id": item.item_id,
                "type": "function_call",
                "status": "in_progress",
                "arguments": "",
                "call_id": item.call_id,
                "name": item.name,
            }
            part = None
        self._open = item
        self._output.append(obj)
        out.append(self._ev.event(ev.OUTPUT_ITEM_ADDED, self._next(), output_index=index, item=obj))
        if part is not None:  # its first part: a reasoning summary's, or a content part
            kind, place = (
                (ev.REASONING_SUMMARY_PART_ADDED, "summary_index") if part is _SUMMARY_PART
                else (ev.CONTENT_PART_ADDED, "content_index")
            )
            out.append(self._ev.event(kind, self._next(), item_id=item.item_id, output_index=index, **{place: 0}, part=part))
        return item

    def _close_part(self, item: _OpenItem, out: list[Frame]) -> dict[str, Any]:
        """The ``*.done`` event of the item's open content part, then ``content_part.done``;
        returns the part."""
        text = "".join(item.parts)
        ids = {"item_id": item.item_id, "output_index": item.output_index, "content_index": item.content_index}
        key = item.key
        if key == _MESSAGE:
            part: dict[str, Any] = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
            out.append(self._ev.event(ev.OUTPUT_TEXT_DONE, self._next(), **ids, text=text, logprobs=[]))
        elif key == _REFUSAL:
            part = {"type": "refusal", "refusal": text}
            out.append(self._ev.event(ev.REFUSAL_DONE, self._next(), **ids, refusal=text))
        else:
            part = {"type": "reasoning_text", "text": text}
            out.append(self._ev.event(ev.REASONING_TEXT_DONE, self._next(), **ids, text=text))
        out.append(self._ev.event(ev.CONTENT_PART_DONE, self._next(), **ids, part=part))
        return part

    def _close_summary(self, item: _OpenItem, out: list[Frame]) -> dict[str, Any]:
        """``reasoning_summary_text.done`` then ``reasoning_summary_part.done`` of a reasoning
        item's summary (its one part); returns the part."""
        text = "".join(item.parts)
        ids = {"item_id": item.item_id, "output_index": item.output_index, "summary_index": 0}
        part = {"type": "summary_text", "text": text}
        out.append(self._ev.event(ev.REASONING_SUMMARY_TEXT_DONE, self._next(), **ids, text=text))
        out.append(self._ev.event(ev.REASONING_SUMMARY_PART_DONE, self._next(), **ids, part=part))
        return part

    def _next_part(self, item: _OpenItem, key: str, out: list[Frame]) -> None:
        """Close the open message's content part and add one of kind ``key`` after it."""
        item.content.append(self._close_part(item, out))
        self._lane = item.lane = None  # the closed part's lane reads no more
        item.key = key
        item.parts = []
        item.content_index += 1
        out.append(
            self._ev.event(
                ev.CONTENT_PART_ADDED,
                self._next(),
                item_id=item.item_id,
                output_index=item.output_index,
                content_index=item.content_index,
                part=_empty_part(key),
            )
        )

    def _close_item(self, status: str, out: list[Frame]) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        self._lane = None
        idx = item.output_index
        if item.key in _PARTS:
            item.content.append(self._close_part(item, out))
            obj = {
                "id": item.item_id,
                "type": "message",
                "status": status,
                "content": item.content,
                "role": "assistant",
            }
        elif item.key == _REASONING:
            self._reasoning_seen += len(item.parts)  # (a piece per delta, the lane's too)
            obj = {"id": item.item_id, "type": "reasoning"}
            if self._seal is not None:  # (in OpenAI's order: before the summary)
                obj["encrypted_content"] = self._seal("".join(item.parts))
            if self.reasoning_summary:
                obj["summary"] = [self._close_summary(item, out)]
            else:
                obj["summary"] = []
                obj["content"] = [self._close_part(item, out)]
        else:
            text = "".join(item.parts)
            index = int(item.key[5:])
            self._closed_calls.add(index)
            if not text and status == "completed":
                # A call without arguments: some servers send none at all, or "" (a no-parameter
                # function), where OpenAI sends "{}" and clients parse the arguments as JSON (Codex
                # fails on ""). Streamed as a delta too, so the deltas still add up to the arguments.
                text = "{}"
                out.append(self._ev.arguments_delta(self._next(), item.item_id, idx, text))
            out.append(
                self._ev.event(
                    ev.FUNCTION_CALL_ARGUMENTS_DONE,
                    self._next(),
                    item_id=item.item_id,
                    output_index=idx,
                    name=item.name,
                    arguments=text,
                )
            )
            obj = {
                "id": item.item_id,
                "type": "function_call",
                "status": status,
                "arguments": text,
                "call_id": item.call_id,
                "name": item.name,
            }
        self._output[idx] = obj
        out.append(self._ev.event(ev.OUTPUT_ITEM_DONE, self._next(), output_index=idx, item=obj))

    def spent_usage(self) -> dict[str, Any]:
        """The usage so far, for a response that has none (cut short, or failed before any
        output): the backend's report if it sent one, else the input and the deltas counted."""
        return self._final_usage()

    def _final_usage(self) -> dict[str, Any]:
        u = self._usage
        input_tokens = self.input_tokens
        cached = self.cached_tokens
        output_tokens = self._output_tokens_seen
        reasoning = self._reasoning_seen
        if u is not None:
            if u.input_tokens is not None:
                input_tokens = u.input_tokens
            if u.output_tokens is not None:
                output_tokens = u.output_tokens
            if u.cached_tokens is not None:
                # Never more than the backend's prompt cache served (what it bills), and never
                # more than this key's own reused prefix: the backend's cache is shared by every
                # key this server serves, so its count alone could tell a key that another one
                # sent the same prefix (hotloop's own caches are scoped per key for that reason).
                cached = min(cached, u.cached_tokens)
            if u.reasoning_tokens is not None:
                reasoning = u.reasoning_tokens
        # (reasoning is output: a backend's reasoning count above its output count is not kept)
        return usage_object(input_tokens, output_tokens, min(cached, input_tokens), min(reasoning, output_tokens), self.truncated_items)

    def finish(self, reason: str = "stop") -> list[Frame]:
        """Close the open item and end with ``completed`` (or ``incomplete`` on a token limit)."""
        self._sync()
        self._check("finish")
        out: list[Frame] = []
        incomplete = reason in ("length", "content_filter", STEERED)
        self._close_item("incomplete" if incomplete else "completed", out)
        r = self.response
        r["usage"] = self._final_usage()
        if incomplete:
            r["status"] = "incomplete"
            r["incomplete_details"] = {
                "reason": "max_output_tokens" if reason == "length" else reason
            }
            kind = ev.INCOMPLETE  # completed_at stays null: "only present when the status is completed"
        else:
            r["status"] = "completed"
            r["completed_at"] = int(self._clock())
            kind = ev.COMPLETED
        self._phase = _DONE
        out.append(self._ev.response_event(kind, self._next(), r, self._encoded))
        return out

    def retract(self, err: errors.HotloopError) -> list[Frame]:
        """Replace the terminal event :meth:`finish` just produced, not yet sent, by
        ``response.failed`` (``err``) with its sequence number: the server could not keep the
        response it was about to report (``--store-sync full`` and its write failed)."""
        r = self.response
        if self._phase != _DONE or r.get("status") not in ("completed", "incomplete"):
            raise RuntimeError("retract() follows finish()")
        self._seq -= 1
        self.error = err
        r["status"] = "failed"
        r["error"] = {"code": err.code or "server_error", "message": err.message}
        r["incomplete_details"] = None
        r["completed_at"] = None
        out: list[Frame] = []
        if self.transport == "sse":
            out.append(self._ev.sse_error(err, self._next()))
        out.append(self._ev.response_event(ev.FAILED, self._next(), r, self._encoded))
        return out

    def fail(self, err: errors.HotloopError, *, error_event: bool = True) -> list[Frame]:
        """End with ``response.failed``.

        Open items are closed with status ``incomplete`` first, so every ``.added`` has its
        ``.done``. With ``error_event`` (a transport/backend error) SSE streams get the nested
        ``error`` event first, as OpenAI sends; WebSocket streams never do, because a client that
        ends the turn at the error frame would read the following ``response.failed`` as the
        first frame of its *next* turn. WebSocket errors before ``response.created`` are sent by
        the session as error frames instead.
        """
        self._sync()
        self._check("fail")
        out: list[Frame] = []
        if self._phase == _NEW:
            self._phase = _STREAMING
            out.append(self._ev.response_event(ev.CREATED, self._next(), self.response, self._encoded))
        self._close_item("incomplete", out)
        if error_event and self.transport == "sse":
            out.append(self._ev.sse_error(err, self._next()))
        self.error = err
        r = self.response
        r["status"] = "failed"
        r["error"] = {"code": err.code or "server_error", "message": err.message}
        r["usage"] = self._final_usage() if self._output else None
        self._phase = _DONE
        out.append(self._ev.response_event(ev.FAILED, self._next(), r, self._encoded))
        return out
