"""Responses <-> chat completions: the mapping and the streaming loop both chat backends share.

Three parts, each usable on its own:

* :func:`render` / :func:`encode_request`: a :class:`BackendRequest` -> a chat-completions body
  (a dict, then bytes). Pure and deterministic: the same history always gives the same bytes (the
  body is built in a fixed key order, user-supplied objects such as tool schemas keep the order
  the client sent, nothing time- or random-dependent goes in), so a backend's prompt cache sees a
  stable prefix turn after turn. Rendering a history H and then H + new items gives the messages
  of H unchanged, followed by the new ones.
* :class:`ChunkAssembler`: decoded ``chat.completion.chunk`` objects -> the chunk vocabulary of
  :mod:`hotloop.protocol.chunks`, honouring the turn machine's contract for tool calls (see the
  class).
* :class:`ChatBackend`: the request/stream loop over any ``httpx.Response`` carrying SSE, with
  typed errors (:func:`status_error`) and a bounded retry before the first chunk. The Cerebras and
  OpenAI-compatible backends only say how to open the response and list models.

The stream is parsed here with :class:`hotloop._accel.SseDecoder` and msgspec structs rather than
with an SDK's pydantic models: about 2 us per chunk instead of ~10 us (see the README).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import operator
import re
import time
from typing import Any, AsyncGenerator, AsyncIterator, Mapping, Union

import httpx
import msgspec

from hotloop import errors
from hotloop._accel import SseDecoder
from hotloop.backends.base import BackendRequest, model_object
from hotloop.protocol.chunks import (
    Chunk,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from hotloop.protocol.request import (
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    InputAudio,
    InputFile,
    InputImage,
    InputText,
    ItemReference,
    Message,
    OtherItem,
    OutputText,
    Reasoning,
    Refusal,
)

log = logging.getLogger("hotloop.backends")

# Bounds (DESIGN principle 8).
MAX_SSE_EVENT_BYTES = 4 * 1024 * 1024  # one SSE line / event from the backend
MAX_BUFFERED_BYTES = 16 * 1024 * 1024  # deferred tool-call arguments and text (see ChunkAssembler)
MAX_ERROR_BODY_BYTES = 64 * 1024  # read of a non-2xx body
MAX_RETRY_DELAY = 20.0  # never wait longer than this for one retry; surface the 429 instead
DRAIN_TIMEOUT = 1.0  # after [DONE], how long to wait for the body's end (keeps the connection)
MODELS_TTL = 60.0  # seconds a backend's model list is cached
MAX_UPSTREAM_MESSAGE = 300  # characters of a backend's 400 message shown to clients


# ---------------------------------------------------------------------------------------------
# Dialects: what differs between the chat-completions servers we talk to
# ---------------------------------------------------------------------------------------------


class Dialect(msgspec.Struct, frozen=True, kw_only=True):
    """The handful of places where chat-completions servers disagree."""

    name: str  # used in client-visible messages ("the cerebras backend")
    images: bool  # input_image parts may be sent as image_url parts
    developer_role: str  # the role developer messages are sent with
    named_tool_choice: bool  # {"type": "function", ...} tool_choice is accepted as such
    reasoning_history: bool  # earlier reasoning goes back on assistant messages ("reasoning")
    max_tokens_field: str  # where max_output_tokens goes
    service_tiers: frozenset[str]  # service_tier values passed through (others are dropped)


CEREBRAS = Dialect(
    name="cerebras",
    images=False,
    developer_role="developer",
    # Cerebras documents only "none"/"auto"/"required"; a named function is emulated by sending
    # only that tool with tool_choice "required" (see _tools_and_choice).
    named_tool_choice=False,
    reasoning_history=True,
    max_tokens_field="max_completion_tokens",
    service_tiers=frozenset({"auto", "default", "flex", "priority"}),
)

OPENAI_COMPAT = Dialect(
    name="openai-compat",
    images=True,
    # llama.cpp, Ollama and older vLLM chat templates know only system/user/assistant/tool.
    developer_role="system",
    named_tool_choice=True,
    # There is no portable field for earlier reasoning (vLLM, llama.cpp and Ollama each read a
    # different one, OpenAI rejects unknown ones), so it is not sent back.
    reasoning_history=False,
    # max_completion_tokens is ignored by Ollama and older llama.cpp; every server reads max_tokens.
    max_tokens_field="max_tokens",
    service_tiers=frozenset(),
)

# Responses efforts -> the chat-completions set (none|low|medium|high).
_EFFORT = {"minimal": "low", "xhigh": "high"}

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


# ---------------------------------------------------------------------------------------------
# Rendering a request
# ---------------------------------------------------------------------------------------------


_encoder = msgspec.json.Encoder()


def _unsupported(what: str, dialect: Dialect, param: str = "input") -> errors.UnsupportedParameter:
    return errors.UnsupportedParameter(f"{what} are not supported by the {dialect.name} backend.", param=param)


def _content(content: Union[str, list[Any]], dialect: Dialect) -> Union[str, list[dict[str, Any]]]:
    """User/system/developer content: a string, or chat content parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for p in content:
        kind = type(p)
        if kind is InputText or kind is OutputText:
            parts.append({"type": "text", "text": p.text})
        elif kind is Refusal:
            parts.append({"type": "text", "text": p.refusal})
        elif kind is InputImage:
            if not dialect.images:
                raise _unsupported("Image inputs (input_image)", dialect)
            if p.image_url is None:
                raise _unsupported("Images given by file_id", dialect)
            parts.append({"type": "image_url", "image_url": {"url": p.image_url, "detail": p.detail}})
        elif kind is InputFile:
            raise _unsupported("File inputs (input_file)", dialect)
        elif kind is InputAudio:
            raise _unsupported("Audio inputs (input_audio)", dialect)
        # reasoning_text / summary_text parts carry no message content: skipped
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _text_only(content: Union[str, list[Any]], dialect: Dialect, what: str) -> str:
    """Assistant and tool content: chat servers widely accept only a string there."""
    if isinstance(content, str):
        return content
    out: list[str] = []
    for p in content:
        kind = type(p)
        if kind is InputText or kind is OutputText:
            out.append(p.text)
        elif kind is Refusal:
            out.append(p.refusal)
        elif kind is InputImage or kind is InputFile or kind is InputAudio:
            raise _unsupported(f"Images, files and audio in {what}", dialect)
    return "".join(out)


def _reasoning_text(item: Reasoning) -> str:
    # Raw reasoning only: summaries are not what the model wrote, encrypted content is opaque.
    return "".join(p.text for p in item.content) if item.content else ""


def _render_items(
    items: list[Any], dialect: Dialect, messages: list[dict[str, Any]], encoded: list[bytes], reasoning: str
) -> str:
    """Append the chat messages of ``items`` to ``messages`` (and their JSON to ``encoded``).

    Messages already in the lists are never mutated (a merge replaces the last one), so a cached
    rendering can be extended safely. Returns the raw reasoning still waiting for the assistant
    message it preceded.
    """
    enc = _encoder.encode

    def add(msg: dict[str, Any]) -> None:
        messages.append(msg)
        encoded.append(enc(msg))

    for item in items:
        if isinstance(item, Message):
            if item.role == "assistant":
                text = _text_only(item.content, dialect, "assistant messages")
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                if reasoning:
                    msg["reasoning"] = reasoning
                    reasoning = ""
                add(msg)
            else:
                role = dialect.developer_role if item.role == "developer" else item.role
                add({"role": role, "content": _content(item.content, dialect)})
                reasoning = ""
        elif isinstance(item, FunctionCall):
            fn = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": fn}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # Consecutive assistant output (text, then calls) is one chat message.
                merged = {**last, "tool_calls": [*last.get("tool_calls", ()), call]}
                if reasoning and "reasoning" not in merged:
                    merged["reasoning"] = reasoning
                reasoning = ""
                messages[-1] = merged
                encoded[-1] = enc(merged)
            else:
                msg = {"role": "assistant"}
                if reasoning:
                    msg["reasoning"] = reasoning
                    reasoning = ""
                msg["tool_calls"] = [call]
                add(msg)
        elif isinstance(item, FunctionCallOutput):
            add(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "content": _text_only(item.output, dialect, "function_call_output"),
                }
            )
            reasoning = ""
        elif isinstance(item, Reasoning):
            if dialect.reasoning_history:
                reasoning += _reasoning_text(item)
        elif isinstance(item, OtherItem):
            # Item types hotloop does not model (custom tool calls and their outputs, hosted tool
            # calls...) are rendered as text holding the item's JSON rather than dropped: the
            # model then still sees what happened earlier in the conversation. Outputs read as
            # user turns, everything else as the assistant's own. The JSON keeps the client's key
            # order, so the rendering is as stable as the item.
            role = "user" if item.type.endswith("_output") else "assistant"
            add({"role": role, "content": enc(item.data).decode("utf-8")})
            reasoning = ""
        elif isinstance(item, ItemReference):
            # The server resolves references before calling a backend; one left here is a bug.
            raise errors.ServerError()
    return reasoning


class _Rendered:
    __slots__ = ("items", "messages", "encoded", "reasoning", "size")

    def __init__(self, items: list[Any], messages: list[dict[str, Any]], encoded: list[bytes], reasoning: str) -> None:
        self.items = items
        self.messages = messages
        self.encoded = encoded
        self.reasoning = reasoning
        self.size = sum(map(len, encoded))


class RenderCache:
    """Renderings of recent conversations, so a continuation renders only its new items.

    A chained request's items are its parent's item *objects* followed by new ones (items are
    immutable), so an entry whose items are, by identity, a prefix of the request's items is
    reused and only the rest is rendered and encoded. Entries are keyed by the identity of the
    conversation's first item and hold references to their items, so an id cannot be recycled
    while cached. Bounded: ``max_entries`` conversations (default 32) and ``max_bytes`` of encoded
    messages (default 64 MiB; an entry holds about twice that in objects), least recently used
    out; a conversation larger than a quarter of the budget is not cached.
    """

    def __init__(self, dialect: Dialect, max_entries: int = 32, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.dialect = dialect
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: dict[int, _Rendered] = {}
        self.hits = 0

    def render(self, items: list[Any]) -> tuple[list[dict[str, Any]], list[bytes]]:
        """The messages of ``items`` and their JSON, reusing a cached prefix when there is one."""
        if not items:
            return [], []
        key = id(items[0])
        hit = self._d.pop(key, None)
        if hit is not None:
            self.bytes -= hit.size
        n = len(hit.items) if hit is not None else 0
        if hit is not None and n <= len(items) and all(map(operator.is_, hit.items, items)):
            self.hits += 1
            messages, encoded, reasoning = list(hit.messages), list(hit.encoded), hit.reasoning
            rest = items[n:]
        else:
            messages, encoded, reasoning, rest = [], [], "", items
        reasoning = _render_items(rest, self.dialect, messages, encoded, reasoning)
        entry = _Rendered(list(items), messages, encoded, reasoning)
        if entry.size <= self.max_bytes // 4:
            self._d[key] = entry
            self.bytes += entry.size
            while len(self._d) > self.max_entries or self.bytes > self.max_bytes:
                self.bytes -= self._d.pop(next(iter(self._d))).size
        return messages, encoded


def _system(req: BackendRequest) -> list[dict[str, Any]]:
    return [{"role": "system", "content": req.instructions}] if req.instructions else []


def render_messages(req: BackendRequest, dialect: Dialect) -> list[dict[str, Any]]:
    """The ``messages`` array for the conversation in ``req``."""
    messages = _system(req)
    _render_items(req.items, dialect, messages, [_encoder.encode(m) for m in messages], "")
    return messages


def _tool(t: FunctionTool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name}
    if t.description is not None:
        fn["description"] = t.description
    fn["parameters"] = t.parameters if t.parameters is not None else _EMPTY_PARAMETERS
    fn["strict"] = t.strict
    return {"type": "function", "function": fn}


def _tools_and_choice(
    req: BackendRequest, dialect: Dialect
) -> tuple[list[FunctionTool], Union[str, dict[str, Any], None]]:
    """The tools to send and the chat ``tool_choice`` (``None``: omit it, the default is auto)."""
    tools = req.tools
    choice = req.tool_choice
    if not tools:
        return [], None
    if isinstance(choice, str):
        return tools, None if choice == "auto" else choice
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if dialect.named_tool_choice:
            return tools, {"type": "function", "function": {"name": name}}
        # Emulation: only the named tool, and a call is required. This changes the rendered
        # tools (and so the prompt prefix) for this request only.
        return [t for t in tools if t.name == name], "required"
    if kind == "allowed_tools":
        names = {t.get("name") for t in choice.get("tools", ()) if isinstance(t, dict) and t.get("type") == "function"}
        allowed = [t for t in tools if t.name in names]
        mode = choice.get("mode", "auto")
        if not allowed:
            if mode == "required":
                raise errors.UnsupportedParameter(
                    "Invalid 'tool_choice': the allowed tools name no function tool this backend can call.",
                    param="tool_choice",
                )
            return [], None
        return allowed, None if mode == "auto" else mode
    # Validation rejects every other form before a backend is called.
    return tools, None


def render(req: BackendRequest, dialect: Dialect, messages: Any = None) -> dict[str, Any]:
    """The chat-completions request body (a streaming request with usage).

    ``messages`` may be given pre-encoded (a ``msgspec.Raw``; see :func:`encode_request`).
    """
    body: dict[str, Any] = {"model": req.model, "messages": render_messages(req, dialect) if messages is None else messages}
    tools, choice = _tools_and_choice(req, dialect)
    if tools:
        body["tools"] = [_tool(t) for t in tools]
        if choice is not None:
            body["tool_choice"] = choice
        if not req.parallel_tool_calls:
            body["parallel_tool_calls"] = False
    fmt = req.text_format
    if fmt is not None and fmt.type == "json_schema":
        schema: dict[str, Any] = {"name": fmt.name}
        if fmt.description is not None:
            schema["description"] = fmt.description
        schema["schema"] = fmt.schema
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.reasoning_effort is not None:
        body["reasoning_effort"] = _EFFORT.get(req.reasoning_effort, req.reasoning_effort)
    if req.max_output_tokens is not None:
        body[dialect.max_tokens_field] = req.max_output_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.prompt_cache_key is not None:
        body["prompt_cache_key"] = req.prompt_cache_key
    if req.service_tier is not None and req.service_tier in dialect.service_tiers:
        body["service_tier"] = req.service_tier
    if req.user is not None:
        body["user"] = req.user
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


def encode_request(req: BackendRequest, dialect: Dialect, cache: RenderCache | None = None) -> bytes:
    """:func:`render`, serialised (msgspec keeps insertion order: byte-stable).

    With a :class:`RenderCache`, the messages of a continued conversation are rendered and
    encoded only for its new items; the bytes are identical either way.
    """
    if cache is None:
        return _encoder.encode(render(req, dialect))
    system = [_encoder.encode(m) for m in _system(req)]
    _, encoded = cache.render(req.items)
    raw = msgspec.Raw(b"[" + b",".join(system + encoded) + b"]")
    return _encoder.encode(render(req, dialect, raw))


# ---------------------------------------------------------------------------------------------
# Decoding the stream
# ---------------------------------------------------------------------------------------------


class _Function(msgspec.Struct, gc=False):
    name: str | None = None
    arguments: str | None = None


class _ToolCall(msgspec.Struct):
    index: int | None = None
    id: str | None = None
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None  # Cerebras, Ollama, newer vLLM
    reasoning_content: str | None = None  # llama.cpp, SGLang, older vLLM
    refusal: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    finish_reason: str | None = None


class _PromptDetails(msgspec.Struct, gc=False):
    cached_tokens: int | None = None


class _CompletionDetails(msgspec.Struct, gc=False):
    reasoning_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None


class ChatChunk(msgspec.Struct):
    """The parts of a ``chat.completion.chunk`` hotloop reads (unknown fields are ignored)."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None  # an error object sent mid-stream (Cerebras, vLLM)
    status_code: int | None = None  # Cerebras' ErrorChunkResponse


chunk_decoder = msgspec.json.Decoder(ChatChunk)

_FINISH = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",  # the legacy name
    "content_filter": "content_filter",
}

_TEXT, _REASONING = "text", "reasoning"
_NEW, _LIVE, _SEALED, _DEFERRED = 0, 1, 2, 3  # tool call states


class _Call:
    __slots__ = ("call_id", "name", "args", "state", "index")

    def __init__(self) -> None:
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
    """

    __slots__ = ("_calls", "_open", "_deferred", "_buffered", "_next_index", "finish_reason", "usage")

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}
        self._open: Union[str, _Call, None] = None  # _TEXT, _REASONING, a live call, or None
        self._deferred: list[Union[tuple[str, str], _Call]] = []
        self._buffered = 0
        self._next_index = 0
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    # -- feeding -------------------------------------------------------------------------------

    def feed(self, chunk: ChatChunk) -> list[Chunk]:
        out: list[Chunk] = []
        if chunk.usage is not None:
            self.usage = _usage(chunk.usage)
        for choice in chunk.choices:
            if choice.index != 0:
                continue  # hotloop never asks for n > 1
            d = choice.delta
            if d is not None:
                r = d.reasoning or d.reasoning_content
                if r:
                    self._piece(_REASONING, r, out)
                if d.content:
                    self._piece(_TEXT, d.content, out)
                if d.refusal:
                    self._piece(_TEXT, d.refusal, out)
                if d.tool_calls:
                    for tc in d.tool_calls:
                        self._tool(tc, out)
            if choice.finish_reason:
                self.finish_reason = _FINISH.get(choice.finish_reason, "stop")
        return out

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
        if self._open is not kind and not self._may_switch():
            self._hold(len(text))
            self._deferred.append((kind, text))
            return
        self._open = kind
        out.append(TextDelta(text) if kind is _TEXT else ReasoningDelta(text))

    def _tool(self, tc: _ToolCall, out: list[Chunk]) -> None:
        key = tc.index if tc.index is not None else self._key_without_index(tc.id)
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _Call()
        if tc.id and call.call_id is None:
            call.call_id = tc.id
        fn = tc.function
        args = ""
        if fn is not None:
            if fn.name and call.name is None:
                call.name = fn.name  # servers that repeat the name in every delta: first one wins
            args = fn.arguments or ""
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
            if self._may_switch():
                self._open_call(call, out)
            else:
                call.state = _DEFERRED
                self._deferred.append(call)

    def _key_without_index(self, call_id: str | None) -> int:
        # Some servers omit ``index``: a known id continues its call, a new id starts one, no id
        # continues the latest call.
        if call_id is not None:
            for key, call in self._calls.items():
                if call.call_id == call_id:
                    return key
            return len(self._calls)
        return max(len(self._calls) - 1, 0)

    def _open_call(self, call: _Call, out: list[Chunk]) -> None:
        call.state = _LIVE
        call.index = self._next_index
        self._next_index += 1
        self._open = call
        out.append(ToolCallDelta(call.index, "".join(call.args), call.call_id, call.name))

    # -- the end -------------------------------------------------------------------------------

    def end(self) -> list[Chunk]:
        """Deferred output, usage and ``Finish``. Call once, when the stream ended normally."""
        out: list[Chunk] = []
        for call in self._calls.values():
            if call.name is None:
                raise errors.BackendError("The model backend sent a tool call without a name.")
        for entry in self._deferred:
            if isinstance(entry, _Call):
                self._open_call(entry, out)
            else:
                kind, text = entry
                self._open = kind
                out.append(TextDelta(text) if kind is _TEXT else ReasoningDelta(text))
        self._deferred = []
        if self.usage is not None:
            out.append(self.usage)
        out.append(Finish(self.finish_reason or "stop"))
        return out


def _usage(u: _Usage) -> Usage:
    p, c = u.prompt_tokens_details, u.completion_tokens_details
    return Usage(
        input_tokens=u.prompt_tokens,
        output_tokens=u.completion_tokens,
        cached_tokens=p.cached_tokens if p is not None else None,
        reasoning_tokens=c.reasoning_tokens if c is not None else None,
    )


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

_CONTEXT_PATTERNS = (
    "context length",
    "context_length",
    "context window",
    "maximum context",
    "too many tokens",
    "prompt is too long",
    "reduce the length",
)
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(value: str) -> float | None:
    """``"1.5"`` (seconds), ``"6m0s"`` / ``"250ms"`` (OpenAI's durations) -> seconds."""
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    total, pos = 0.0, 0
    for m in _DURATION_RE.finditer(value):
        if m.start() != pos:
            return None
        total += float(m.group(1)) * _DURATION_UNIT[m.group(2)]
        pos = m.end()
    return total if pos and pos == len(value) else None


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The delay a 429 asks for, in seconds (``None``: the backend did not say).

    ``retry-after-ms``, then ``retry-after`` (seconds or an HTTP date), then the
    ``x-ratelimit-reset-*`` headers (Cerebras: seconds as floats; OpenAI-style servers:
    durations). Of those, the resets whose matching ``x-ratelimit-remaining-*`` is 0 decide (the
    longest wins); without that information the shortest reset is used.
    """
    ms = headers.get("retry-after-ms")
    if ms is not None:
        v = _seconds(ms)
        if v is not None:
            return v / 1000.0
    ra = headers.get("retry-after")
    if ra is not None:
        v = _seconds(ra)
        if v is not None:
            return v
        try:
            when = email.utils.parsedate_to_datetime(ra)
        except (TypeError, ValueError):
            when = None
        if when is not None:
            return max(0.0, when.timestamp() - (time.time() if now is None else now))
    exhausted: list[float] = []
    resets: list[float] = []
    for name, value in headers.items():
        name = name.lower()
        if not name.startswith("x-ratelimit-reset-"):
            continue
        v = _seconds(value)
        if v is None:
            continue
        resets.append(v)
        remaining = headers.get("x-ratelimit-remaining-" + name[len("x-ratelimit-reset-") :])
        if remaining is not None and _seconds(remaining) == 0:
            exhausted.append(v)
    if exhausted:
        return max(exhausted)
    return min(resets) if resets else None


def _error_fields(body: object) -> tuple[str, str]:
    """(message, code) of an OpenAI-style ``{"error": {...}}`` or Cerebras' flat error body."""
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict):
            body = inner
        elif isinstance(inner, str):
            return inner, ""
        msg = body.get("message")
        code = body.get("code")
        return (msg if isinstance(msg, str) else ""), (code if isinstance(code, str) else "")
    if isinstance(body, str):
        return body, ""
    return "", ""


def _safe(message: str) -> str:
    """A backend's 400 message, bounded and reduced to printable characters."""
    text = "".join(ch if ch.isprintable() else " " for ch in message).strip()
    if len(text) > MAX_UPSTREAM_MESSAGE:
        text = text[: MAX_UPSTREAM_MESSAGE - 3] + "..."
    return text


def parse_body(raw: bytes) -> object:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw.decode("utf-8", "replace")


class TransientBackendError(errors.BackendError):
    """A backend failure worth retrying (5xx, a broken connection); same wire meaning as its base."""


def status_error(
    status: int, headers: Mapping[str, str], body: object, *, backend: str, model: str
) -> errors.HotloopError:
    """The client-visible error for a backend's non-2xx answer (or a mid-stream error object).

    Written for *our* client: 401/403 mean the backend rejected hotloop's own credentials, which
    is a server-side fault (502), not the client's (whose key hotloop accepted). Only a 400's
    ``message`` is passed on (bounded, printable), because it tells the client what to fix.
    """
    message, code = _error_fields(body)
    log.warning("%s backend answered HTTP %d: %s", backend, status, _safe(message) or "(no message)")
    if status == 429:
        delay = retry_after(headers)
        rate = {k: v for k, v in headers.items() if k.lower().startswith("x-ratelimit-")}
        hint = f" Please try again in {delay:.3g}s." if delay is not None else ""
        return errors.RateLimited(
            f"Rate limit reached for model '{model}' on the model backend.{hint}", retry_after=delay, headers=rate
        )
    lowered = message.lower()
    if status in (400, 413, 422):
        if code == "context_length_exceeded" or any(p in lowered for p in _CONTEXT_PATTERNS):
            return errors.ContextLengthExceeded(
                "The input exceeds the context window of this model. Please shorten the input.", param="input"
            )
        detail = _safe(message)
        return errors.InvalidRequest(
            f"The model backend rejected the request: {detail}" if detail else "The model backend rejected the request."
        )
    if status == 404:
        if "model" in lowered or code == "model_not_found":
            return errors.ModelNotFound(
                f"The model '{model}' does not exist or is not served by the model backend.", param="model"
            )
        return errors.BackendError("The model backend has no chat-completions endpoint at its configured URL.")
    if status in (401, 403):
        return errors.BackendError("The model backend rejected hotloop's credentials for it.")
    if status in (408, 504):
        return errors.BackendTimeout("The model backend timed out.")
    if status == 503:
        return errors.BackendUnavailable("The model backend is unavailable. Please try again later.")
    if status >= 500:
        return TransientBackendError(f"The model backend failed (HTTP {status}).")
    return errors.BackendError(f"The model backend failed (HTTP {status}).")


def _retry_delay(exc: errors.HotloopError, attempt: int) -> float | None:
    """How long to wait before retrying after ``exc`` (``None``: do not retry)."""
    if isinstance(exc, errors.RateLimited):
        delay = exc.retry_after if exc.retry_after is not None else 0.5 * 2**attempt
    elif isinstance(exc, (TransientBackendError, errors.BackendUnavailable, errors.BackendTimeout)):
        delay = min(0.25 * 2**attempt, 4.0)
    else:
        return None
    return delay if delay <= MAX_RETRY_DELAY else None


# ---------------------------------------------------------------------------------------------
# The shared backend
# ---------------------------------------------------------------------------------------------


def quiet_http_logs() -> None:
    """httpx logs every request at INFO: one line per turn is noise for a server (and costs
    time on the hot path). Left alone when logging is configured for debugging or explicitly."""
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return
    for name in ("httpx", "httpcore"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def http_timeout(first: float, idle: float) -> httpx.Timeout:
    """The HTTP client's own limits: a backstop behind the engine's first-chunk and idle timers.

    The read timeout covers both the wait for the response head and every gap between body reads,
    so it is the larger of the two engine timeouts (which fire first, with clearer messages).
    """
    return httpx.Timeout(connect=10.0, read=max(first, idle), write=30.0, pool=10.0)


class _Models(msgspec.Struct):
    data: list[dict[str, Any]] = []


_models_decoder = msgspec.json.Decoder(_Models)


class ChatBackend:
    """The request and stream loop for a chat-completions backend.

    Subclasses set ``name``, ``dialect`` and ``owned_by`` and implement :meth:`_open` (send the
    body; return the streaming response, or raise a typed error: :func:`status_error` for a non-2xx
    answer) and :meth:`_get_models` (the raw ``/models`` body).
    """

    name = "chat"
    dialect: Dialect = OPENAI_COMPAT
    owned_by = "backend"

    def __init__(self, *, model: str, retries: int) -> None:
        self.default_model = model
        self.retries = max(0, retries)
        self._models: list[dict[str, Any]] = []
        self._models_at = -MODELS_TTL
        self._renders = RenderCache(self.dialect)

    async def _open(self, body: bytes, model: str) -> httpx.Response:
        raise NotImplementedError

    async def _get_models(self) -> bytes:
        raise NotImplementedError

    # -- models --------------------------------------------------------------------------------

    async def list_models(self) -> list[dict[str, Any]]:
        """The backend's ``/models``, cached for ``MODELS_TTL`` seconds; the default model on error."""
        now = time.monotonic()
        if now - self._models_at < MODELS_TTL:
            return self._models
        try:
            raw = await self._get_models()
            listed = _models_decoder.decode(raw).data
            models = [
                model_object(
                    str(m["id"]),
                    str(m.get("owned_by") or self.owned_by),
                    int(m["created"]) if isinstance(m.get("created"), int) else 1_700_000_000,
                )
                for m in listed
                if isinstance(m.get("id"), str)
            ]
        except (errors.HotloopError, msgspec.DecodeError, ValueError):
            log.warning("%s backend: could not list models; offering the default model", self.name)
            models = []
        if not models and self.default_model:
            models = [model_object(self.default_model, self.owned_by)]
        self._models, self._models_at = models, now
        return models

    # -- streaming -----------------------------------------------------------------------------

    async def stream(self, req: BackendRequest) -> AsyncIterator[Chunk]:
        body = encode_request(req, self.dialect, self._renders)
        attempt = 0
        while True:
            yielded = False
            try:
                resp = await self._open(body, req.model)
                try:
                    async with contextlib.aclosing(self._chunks(resp, req.model)) as chunks:
                        async for chunk in chunks:
                            yielded = True
                            yield chunk
                finally:
                    await resp.aclose()
                return
            except errors.HotloopError as exc:
                # Retried only before anything reached the client, and only for transient errors.
                delay = None if yielded or attempt >= self.retries else _retry_delay(exc, attempt)
                if delay is None:
                    raise
                attempt += 1
                log.warning(
                    "%s backend: retrying in %.3gs (%s, attempt %d)", self.name, delay, type(exc).__name__, attempt
                )
                await asyncio.sleep(delay)

    async def _chunks(self, resp: httpx.Response, model: str) -> AsyncGenerator[Chunk, None]:
        assembler = ChunkAssembler()
        decoder = SseDecoder(MAX_SSE_EVENT_BYTES)
        decode = chunk_decoder.decode
        done = False
        body = resp.aiter_bytes()
        try:
            async for raw in body:
                try:
                    events = decoder.feed(raw)
                except ValueError:
                    raise errors.BackendError("The model backend sent a malformed stream.") from None
                for event, data in events:
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = decode(data)
                    except msgspec.DecodeError:
                        if not data.strip():
                            continue
                        raise errors.BackendError("The model backend sent a malformed stream.") from None
                    if chunk.error is not None or event == "error":
                        status = chunk.status_code or _error_status(chunk.error)
                        raise status_error(status, {}, {"error": chunk.error}, backend=self.name, model=model)
                    for out in assembler.feed(chunk):
                        yield out
                if done:
                    break
            if done:
                await _drain(body)
            elif assembler.finish_reason is None:
                raise errors.BackendError("The model backend closed the stream before finishing.")
        except httpx.TimeoutException:
            raise errors.BackendTimeout("The model backend stopped sending output.") from None
        except httpx.HTTPError:
            log.warning("%s backend: the connection broke mid-stream", self.name)
            raise TransientBackendError("The model backend closed the connection mid-stream.") from None
        for out in assembler.end():
            yield out


def _error_status(error: object) -> int:
    if isinstance(error, dict):
        for key in ("status_code", "code", "status"):
            v = error.get(key)
            if isinstance(v, int) and 400 <= v <= 599:
                return v
    return 500


async def _drain(body: AsyncIterator[bytes]) -> None:
    """Read the rest of a finished body (normally nothing) so the connection can be reused."""
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT):
            async for _ in body:
                pass
    except (TimeoutError, httpx.HTTPError):
        pass  # the connection is closed instead of reused; the response itself is complete


async def read_error_body(resp: httpx.Response) -> object:
    """A non-2xx body, read up to ``MAX_ERROR_BODY_BYTES`` and decoded if it is JSON."""
    buf = bytearray()
    try:
        async for raw in resp.aiter_bytes():
            buf += raw
            if len(buf) >= MAX_ERROR_BODY_BYTES:
                break
    except httpx.HTTPError:
        pass
    finally:
        await resp.aclose()
    return parse_body(bytes(buf[:MAX_ERROR_BODY_BYTES]))
