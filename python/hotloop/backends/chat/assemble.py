"""Decoded ``chat.completion.chunk`` objects -> the chunk vocabulary of :mod:`hotloop.protocol.chunks`.

I/O-free. :data:`chunk_decoder` reads the few fields hotloop needs with msgspec (about 1-2 us per
chunk, against ~10 us for an SDK's pydantic models); :class:`ChunkAssembler` honours the turn
machine's contract for tool calls (see the class), and reads a ``<think>`` block at the start of
the content as reasoning (see its ``_think_content``).
"""

from __future__ import annotations

import json
from typing import Any, Union

import msgspec

from hotloop import errors
from hotloop._accel import PLAIN_ARGUMENTS, PLAIN_REASONING, PLAIN_TEXT
from hotloop.protocol.chunks import (
    Chunk,
    Finish,
    ReasoningDelta,
    RefusalDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)

MAX_BUFFERED_BYTES = 16 * 1024 * 1024  # deferred tool-call arguments and text (see ChunkAssembler)

# ---------------------------------------------------------------------------------------------
# Decoding the stream
# ---------------------------------------------------------------------------------------------


class _Function(msgspec.Struct, gc=False):  # (decoded JSON holds no reference cycle)
    name: str | None = None
    # a JSON-encoded string, as OpenAI sends it; some servers send the JSON value itself
    # (llama-server, ggml-org/llama.cpp#20198; TGI): read as its JSON text (_arguments)
    arguments: Union[str, dict[str, Any], list[Any], None] = None


class _ToolCall(msgspec.Struct):
    index: int | None = None
    id: str | None = None
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None  # Cerebras, Ollama, newer vLLM
    reasoning_content: str | None = None  # llama.cpp, SGLang, older vLLM
    refusal: str | None = None  # OpenAI (safety and structured-output refusals), and servers proxying it
    tool_calls: list[_ToolCall] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    finish_reason: str | None = None


# Token counts as numbers: a server that writes them as floats (10.0) is read, not refused (a
# refused usage chunk failed the whole response as a malformed stream); see _count
class _PromptDetails(msgspec.Struct, gc=False):
    cached_tokens: int | float | None = None


class _CompletionDetails(msgspec.Struct, gc=False):
    reasoning_tokens: int | float | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | float | None = None
    completion_tokens: int | float | None = None
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None


class ChatChunk(msgspec.Struct):
    """The parts of a ``chat.completion.chunk`` hotloop reads (unknown fields are ignored)."""

    # null as well as absent or []: servers send ``"choices": null`` in a stream's usage chunk
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None  # an error object sent mid-stream (Cerebras, vLLM)
    status_code: int | None = None  # Cerebras' ErrorChunkResponse


chunk_decoder = msgspec.json.Decoder(ChatChunk)

_TEXT_FIELDS = ("content", "reasoning", "reasoning_content", "refusal")
_HIGH = ("\ud800", "\udbff")


class SplitSurrogates:
    """The chunks msgspec refuses because a string holds a lone UTF-16 surrogate escape, which
    is valid JSON grammar: a backend that cuts its text by UTF-16 unit (a JavaScript gateway)
    sends an emoji as ``"\\ud83d"`` at the end of one chunk and ``"\\ude00"`` at the start of the
    next. Such a chunk is decoded by ``json`` instead, and each text and arguments string is
    mended: a high surrogate at its end is held for the same string of the next chunk, the pair
    becomes its character, and a half left alone becomes U+FFFD (no event carries a lone
    surrogate, which no UTF-8 encoder writes). One per stream, made at its first chunk msgspec
    refused: a stream without surrogates pays nothing. Holds one character per string it saw
    end on a high surrogate (the response's choices, fields and tool calls: bounded with them)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: dict[tuple[Any, ...], str] = {}

    def decode(self, data: str) -> ChatChunk:
        """:raises ValueError: not JSON; :raises msgspec.ValidationError: not a chunk."""
        obj = json.loads(data)
        if isinstance(obj, dict):
            for ci, choice in enumerate(obj.get("choices") or ()):
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if not isinstance(delta, dict):
                    continue
                for field in _TEXT_FIELDS:
                    if isinstance(delta.get(field), str):
                        delta[field] = self._mend((ci, field), delta[field])
                for tc in delta.get("tool_calls") or ():
                    fn = tc.get("function") if isinstance(tc, dict) else None
                    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                        fn["arguments"] = self._mend((ci, "call", tc.get("index")), fn["arguments"])
        return msgspec.convert(obj, ChatChunk)

    def _mend(self, key: tuple[Any, ...], text: str) -> str:
        text = self.held.pop(key, "") + text
        if text and _HIGH[0] <= text[-1] <= _HIGH[1]:
            self.held[key] = text[-1]
            text = text[:-1]
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")

_FINISH = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",  # the legacy name
    "content_filter": "content_filter",
    # a token limit under other names: Mistral's context limit, Anthropic-style gateways'
    "model_length": "length",
    "max_tokens": "length",
}
# finish reasons that say the generation did not end (vLLM's and SGLang's "abort": the request
# was aborted in the engine; "error"; DeepSeek's "insufficient_system_resource": interrupted for
# want of capacity; watsonx's "time_limit" and "cancelled"): the response fails (a client retries
# it) instead of completing with what came, which would read as the model's whole answer. Other
# unknown reasons are a normal end.
_FAILED = ("abort", "error", "insufficient_system_resource", "time_limit", "cancelled")

_TEXT, _REASONING, _REFUSAL = "text", "reasoning", "refusal"
# a piece's chunk by its kind
_DELTA: dict[str, type[TextDelta | ReasoningDelta | RefusalDelta]] = {
    _TEXT: TextDelta,
    _REASONING: ReasoningDelta,
    _REFUSAL: RefusalDelta,
}
_NEW, _LIVE, _SEALED, _DEFERRED = 0, 1, 2, 3  # tool call states

# Reasoning in the content: Qwen3 and DeepSeek-R1-style models, served by a server that does not
# split it out (vLLM without --reasoning-parser, llama.cpp, LM Studio, Ollama's OpenAI endpoint,
# Cerebras' default reasoning_format for Qwen3), begin their content with it, in these tags.
_OPEN_TAG, _CLOSE_TAG = "<think>", "</think>"
# Where the content is in that respect (ChunkAssembler._think); _T_OFF is falsy: content is text.
# _T_START: nothing but whitespace yet (held, with a possible beginning of the opening tag);
# _T_LEAD: the block opened, nothing but whitespace in it yet (dropped); _T_IN: in the block
# (held: whitespace and a possible beginning of the closing tag at its end); _T_AFTER: closed,
# nothing but whitespace after it yet (dropped). _T_LEAD and above: a block is open.
_T_OFF, _T_AFTER, _T_START, _T_LEAD, _T_IN = 0, 1, 2, 3, 4
# The most whitespace held while waiting for what follows it (before a block: past it the content
# is text; at the end of a block's text so far: past it it is reasoning). Models put a newline or
# two there; the bound keeps a run of whitespace chunks from being copied over and over.
MAX_THINK_HELD = 4096


# Keys of calls whose server index another call took (ChunkAssembler._tool) count up from here,
# far above any index a server gives (and within the native decoder's integer range).
RETIRED_KEYS = 1 << 30


class _Call:
    __slots__ = ("key", "call_id", "name", "args", "state", "index")

    def __init__(self, key: int) -> None:
        self.key = key  # the index the server gives it
        self.call_id: str | None = None
        self.name: str | None = None
        self.args: list[str] = []  # the arguments so far (emitted or not)
        self.state = _NEW
        self.index = -1  # the index hotloop gives it (emission order)


def _complete_json(parts: list[str]) -> bool:
    if not parts:
        return False
    try:
        msgspec.json.decode("".join(parts))
    except msgspec.DecodeError:
        return False
    return True


class ChunkAssembler:
    """Chat chunks in, :mod:`hotloop.protocol.chunks` out. Sans-I/O.

    The turn machine wants each output item to be contiguous: a tool call's first delta must carry
    its id and name, and once another item has started, an earlier call gets no more deltas.
    Chat servers promise neither. So:

    * a call opens (is streamed) only once its name is known; arguments seen before are held;
    * the open ("live") call streams its argument deltas as they arrive;
    * anything for another item while a call is live closes that call only if its arguments
      already form a complete JSON value (the usual sequential case: call 0, then call 1, then
      perhaps text). Otherwise the call may still grow (interleaved indices, or arguments sent
      only in the final chunk), so the newcomer is *deferred*, and so is everything after it;
    * at the end, deferred items are emitted in their order of arrival, each call whole.

    Calls are renumbered 0, 1, ... in emission order. A call id the server omits is left to the
    turn machine to generate. Buffered data is bounded by ``MAX_BUFFERED_BYTES``.

    A ``<think>`` block at the start of the content is reasoning (``think_tags``, the default;
    see :meth:`_think_content`); with ``opened`` the content begins inside such a block, opening
    tag or not.
    """

    __slots__ = (
        "_calls", "_open", "_deferred", "_buffered", "_next_index", "_retired", "_think", "_held", "_opened",
        "finish_reason", "usage",
    )

    def __init__(self, think_tags: bool = True, opened: bool = False) -> None:
        self._calls: dict[int, _Call] = {}
        self._open: Union[str, _Call, None] = None  # _TEXT, _REASONING, _REFUSAL, a live call, or None
        self._deferred: list[Union[tuple[str, str], _Call]] = []
        self._buffered = 0
        self._next_index = 0
        self._retired = RETIRED_KEYS  # the last key given to a call whose server index was reused
        self._think = _T_START if think_tags else _T_OFF
        self._held = ""  # the content held while it may be, or be in, a <think> block
        # the chat template opened the block (--think-tags open): the content begins inside it
        self._opened = think_tags and opened
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    # -- feeding -------------------------------------------------------------------------------

    def feed(self, chunk: ChatChunk) -> list[Chunk]:
        out: list[Chunk] = []
        if chunk.usage is not None:
            self.usage = _usage(chunk.usage)
        for choice in chunk.choices or ():
            if choice.index != 0:
                continue  # hotloop never asks for n > 1
            d = choice.delta
            if d is not None:
                r = d.reasoning or d.reasoning_content
                if r:
                    if self._opened and self._think == _T_START and not self._held:
                        # reasoning in its own field before any content: this server splits it
                        # out, so the content that follows is not inside a block (--think-tags open)
                        self._opened = False
                    self._piece(_REASONING, r, out)
                if d.content:
                    self._piece(_TEXT, d.content, out)  # (a <think> block: see _piece)
                if d.refusal:
                    # a refusal part of the message (response.refusal.*), never output text
                    self._piece(_REFUSAL, d.refusal, out)
                if d.tool_calls:
                    for tc in d.tool_calls:
                        self._tool(tc, out)
            if choice.finish_reason:
                if choice.finish_reason in _FAILED:
                    raise errors.BackendError(
                        f"The model backend ended the response early (finish_reason '{choice.finish_reason}')."
                    )
                self.finish_reason = _FINISH.get(choice.finish_reason, "stop")  # unknown ones: a normal end
        return out

    def lane(self) -> tuple[int, int, int, list[str] | None] | None:
        """The open item, as ``SseDecoder.feed_lane`` reads its plain deltas: ``(PLAIN_TEXT, 0,
        0, None)``, ``(PLAIN_REASONING, 0, 0, None)``, or for the open call ``(PLAIN_ARGUMENTS,
        index, key, args)``: its index in the response, the index the server gives it, and the
        list its arguments are kept in (pieces read by ``feed_lane`` are appended to it). None
        when nothing is open, or a refusal is (its pieces are never plain deltas: ``plain_delta``
        refuses an event with a refusal, so the general path reads each one).

        While the content may be, or be in, a ``<think>`` block, no lane takes content: text is
        never open then (see :meth:`_piece`: the native decoder would make the block output
        text), and the reasoning item's lane is not offered either (the block's reasoning comes
        as content, which only the general path reads)."""
        cur = self._open
        if cur is _TEXT:
            return PLAIN_TEXT, 0, 0, None
        if cur is _REASONING:
            if self._held or self._think > _T_START:
                return None
            return PLAIN_REASONING, 0, 0, None
        if type(cur) is _Call and cur.state == _LIVE:
            return PLAIN_ARGUMENTS, cur.index, cur.key, cur.args
        return None

    def _hold(self, n: int) -> None:
        self._buffered += n
        if self._buffered > MAX_BUFFERED_BYTES:
            raise errors.BackendError("The model backend sent more buffered output than hotloop accepts.")

    def _may_switch(self) -> bool:
        """Whether a different item may start now (closing the open one)."""
        if self._deferred:
            return False
        cur = self._open
        if isinstance(cur, _Call):
            if not _complete_json(cur.args):
                return False
            cur.state = _SEALED
            cur.args = []
        return True

    def _piece(self, kind: str, text: str, out: list[Chunk]) -> None:
        if self._open is not kind:
            if kind is _TEXT and self._think:
                # content that may be, or be in, a <think> block. Text is never open then (it
                # opens here once _think is _T_OFF, for good), so the text after the first
                # content chunk of a response without a block costs nothing more.
                self._think_content(text, out)
                return
            if not self._may_switch():
                self._hold(len(text))
                self._deferred.append((kind, text))
                return
        self._open = kind
        out.append(_DELTA[kind](text))

    # -- <think> blocks ------------------------------------------------------------------------

    def _think_content(self, text: str, out: list[Chunk]) -> None:
        """A content piece while the content may begin with a ``<think>`` block.

        A content that begins, after whitespace, with ``<think>`` has the model's reasoning up to
        the first ``</think>``: it goes out as reasoning (the chunks of a ``delta.reasoning``),
        without the whitespace at its two ends, and the content after it, without the whitespace
        that begins it, as text; tags split across pieces anywhere are read whole. Any other
        content is text as it came, a ``<think>`` later in it too (what was held while it might
        have been a tag goes out first). A block the stream never closes is reasoning up to the
        end (:meth:`end`), what was held too; one with nothing but whitespace in it makes no
        reasoning at all.

        ``opened`` (``--think-tags open``): the model's chat template ends the prompt with the
        opening tag (DeepSeek-R1 since its 0528 release, Qwen3's thinking-only 2507 models), so
        its content begins inside the block and has only the closing tag. Any content is then
        reasoning up to the first ``</think>``, as if ``<think>`` came first (one that does come
        first is read as the tag, not as reasoning); a content without ``</think>`` is all
        reasoning. Nothing can tell such a content from text without the tag, which comes last:
        hence a setting, for servers of such models only. Whitespace is held up to ``MAX_THINK_HELD`` characters (a content that
        begins with more is text). A tool call ends a block, and ends the wait for one: what was
        held goes out before it (:meth:`_settle`).

        A server that sends both ``delta.reasoning`` and a block in the content: both are
        reasoning, in the one reasoning item, in the order they come (in one chunk, the field's
        first). None is known to send the same reasoning both ways; it would be shown twice.
        """
        state = self._think
        if state == _T_START:
            s = self._held + text
            rest = s.lstrip()
            if len(rest) < len(_OPEN_TAG) and _OPEN_TAG.startswith(rest) and len(s) <= MAX_THINK_HELD:
                self._held = s  # whitespace and perhaps the tag's beginning: wait for more
                return
            self._held = ""
            if rest.startswith(_OPEN_TAG):
                text = rest[len(_OPEN_TAG) :]
            elif self._opened:
                text = rest  # the template opened the block: this is its beginning
            else:
                self._think = _T_OFF
                self._piece(_TEXT, s, out)
                return
            state = _T_LEAD
        if state == _T_LEAD:
            text = text.lstrip()
            if not text:
                self._think = _T_LEAD
                return
            state = _T_IN
        if state == _T_IN:
            self._think = _T_IN
            if not self._held and "<" not in text and not text[-1].isspace():
                self._piece(_REASONING, text, out)  # the usual piece: no tag in it, none begun
                return
            s = self._held + text
            end = s.find(_CLOSE_TAG)
            if end < 0:
                # hold the end that may be the closing tag's beginning (it has one "<": the last
                # within its length), and the whitespace before it, which may end the block
                tag = s.rfind("<", max(len(s) - len(_CLOSE_TAG) + 1, 0))
                tag = tag if tag >= 0 and _CLOSE_TAG.startswith(s[tag:]) else len(s)
                cut = len(s[:tag].rstrip())
                if tag - cut > MAX_THINK_HELD:
                    cut = tag
                if cut:
                    self._piece(_REASONING, s[:cut], out)
                self._held = s[cut:]
                return
            reasoning = s[:end].rstrip()
            if reasoning:
                self._piece(_REASONING, reasoning, out)
            self._held = ""
            text = s[end + len(_CLOSE_TAG) :]
        text = text.lstrip()  # _T_AFTER
        if text:
            self._think = _T_OFF
            self._piece(_TEXT, text, out)
        else:
            self._think = _T_AFTER

    def _settle(self, out: list[Chunk]) -> None:
        """The content's end, or a tool call: what was held goes out, as text before a block
        (which then never opens) or as reasoning in one (which ends here)."""
        held = self._held
        self._held = ""
        if self._think == _T_START:
            if not self._opened:
                self._think = _T_OFF
                if held:
                    self._piece(_TEXT, held, out)
                return
            held = held.lstrip()  # opened: the block's beginning (whitespace, a tag's first characters)
        self._think = _T_AFTER
        held = held.rstrip()  # whitespace at the block's end is dropped; before a tag's beginning it is inside
        if held:
            self._piece(_REASONING, held, out)

    def _tool(self, tc: _ToolCall, out: list[Chunk]) -> None:
        key = tc.index if tc.index is not None else self._key_without_index(tc.id)
        call = self._calls.get(key)
        if call is not None and tc.id and call.call_id is not None and tc.id != call.call_id:
            # Another id at an index in use is another call: servers that give every parallel
            # call index 0 (Ollama, some proxies). The earlier call moves to a key no server
            # index uses; what comes at this index without an id continues the new one.
            call.key = self._retired = self._retired + 1
            self._calls[call.key] = call
            call = None
        if call is None:
            call = self._calls[key] = _Call(key)
        if tc.id and call.call_id is None:
            call.call_id = tc.id
        fn = tc.function
        args = ""
        if fn is not None:
            if fn.name and call.name is None:
                call.name = fn.name  # servers that repeat the name in every delta: first one wins
            a = fn.arguments
            args = a if type(a) is str else _arguments(a)
        state = call.state
        if state == _LIVE:
            if args:
                call.args.append(args)  # kept so a switch can tell whether the JSON is complete
                out.append(ToolCallDelta(call.index, args))
            return
        if state == _SEALED:
            if args.strip():
                raise errors.BackendError("The model backend sent a malformed tool call.")
            return
        if args:
            self._hold(len(args))
            call.args.append(args)
        if state == _NEW and call.name is not None:
            if self._think:
                self._settle(out)  # what the content held comes before the call; a block, or the wait for one, ends
            if self._may_switch():
                self._open_call(call, out)
            else:
                call.state = _DEFERRED
                self._deferred.append(call)

    def _key_without_index(self, call_id: str | None) -> int:
        # Some servers omit ``index``: a known id continues its call, a new id starts one, no id
        # continues the latest call. An empty id ("") is no id.
        if call_id:
            for key, call in self._calls.items():
                if call.call_id == call_id:
                    return key
            return len(self._calls)
        return max(len(self._calls) - 1, 0)

    def _open_call(self, call: _Call, out: list[Chunk], cut: bool = False) -> None:
        if call.state != _LIVE:
            self._buffered -= sum(map(len, call.args))  # what it held goes out now
        call.state = _LIVE
        call.index = self._next_index
        self._next_index += 1
        self._open = call
        out.append(ToolCallDelta(call.index, "".join(call.args), call.call_id, call.name, cut))

    # -- the end -------------------------------------------------------------------------------

    def end(self) -> list[Chunk]:
        """Deferred output, usage and ``Finish``. Call once, when the stream ended normally."""
        out: list[Chunk] = []
        for call in self._calls.values():
            if call.name is None:
                raise errors.BackendError("The model backend sent a tool call without a name.")
        if self._think:
            self._settle(out)  # what the content held (the content's end)
        # At a token limit, a call whose arguments are not whole was cut short: the deferred
        # calls (their arguments came interleaved) are emitted one after the other below, and
        # each would close the one before it as completed
        length = self.finish_reason == "length" and bool(self._deferred)
        cur = self._open
        if length and isinstance(cur, _Call) and not _complete_json(cur.args):
            out.append(ToolCallDelta(cur.index, cut=True))
        for entry in self._deferred:
            if isinstance(entry, _Call):
                self._open_call(entry, out, length and not _complete_json(entry.args))
            else:
                kind, text = entry
                self._open = kind
                out.append(_DELTA[kind](text))
        self._deferred = []
        if self.usage is not None:
            out.append(self.usage)
        out.append(Finish(self.finish_reason or "stop"))
        return out


def _arguments(value: object) -> str:
    """A call's arguments sent as a JSON value instead of a JSON-encoded string: its JSON text."""
    if value is None:
        return ""
    return msgspec.json.encode(value).decode()


def _usage(u: _Usage) -> Usage:
    p, c = u.prompt_tokens_details, u.completion_tokens_details
    return Usage(
        input_tokens=_count(u.prompt_tokens),
        output_tokens=_count(u.completion_tokens),
        cached_tokens=_count(p.cached_tokens) if p is not None else None,
        reasoning_tokens=_count(c.reasoning_tokens) if c is not None else None,
    )


def _count(n: int | float | None) -> int | None:
    """A backend's token count (a float one rounded down), or None (unknown: hotloop's own count
    is used) for a negative or infinite one, which would make the usage, the ledger and the
    counters go down (or fail to encode), and refund TPM."""
    if type(n) is int:
        return n if n >= 0 else None
    if n is None or not 0 <= n < float("inf"):  # (NaN too)
        return None
    return int(n)

