"""A :class:`BackendRequest` -> a chat-completions request body (a dict, then bytes). I/O-free.

Pure and deterministic: the same history always gives the same bytes (the body is built in a fixed
key order, user-supplied objects such as tool schemas keep the order the client sent, nothing
time- or random-dependent goes in), so a backend's prompt cache sees a stable prefix turn after
turn. Rendering a history H and then H + new items gives the messages of H unchanged, followed by
the new ones; :class:`RenderCache` uses that to render and encode only a continuation's new items.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Union

import msgspec

from hotloop import errors
from hotloop.backends.base import BackendRequest
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
    model_view,
)
from hotloop.protocol.sealed import reasoning_text

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
_EFFORT = {"minimal": "low", "xhigh": "high", "max": "high"}  # Responses efforts a chat server has no word for

# a tool sent without parameters: no arguments, as a strict-mode schema says it (a backend that
# enforces strict schemas, as OpenAI's, refuses an object without additionalProperties: false)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


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


def _text_only(content: Union[str, list[Any]], dialect: Dialect, what: str, images: list[Any] | None = None) -> str:
    """Assistant and tool content: chat servers widely accept only a string there. With
    ``images`` (a list), image parts are appended to it instead of refused."""
    if isinstance(content, str):
        return content
    out: list[str] = []
    for p in content:
        kind = type(p)
        if kind is InputText or kind is OutputText:
            out.append(p.text)
        elif kind is InputImage and images is not None:
            images.append(p)
        elif kind is Refusal:
            # A refusal the assistant gave (a ``refusal`` part of an output message, sent back as
            # input or through previous_response_id) goes back as the assistant's content text,
            # not as OpenAI's assistant-message ``refusal`` field: every chat server reads content,
            # while ``refusal`` is OpenAI's own (a server that does not know it may drop it, and
            # the model would not see what it said, or reject the request), and the model reads
            # its own words either way. Parts are joined as they were streamed (no separator).
            out.append(p.refusal)
        elif kind is InputImage or kind is InputFile or kind is InputAudio:
            raise _unsupported(f"Images, files and audio in {what}", dialect)
    return "".join(out)


def _add_reasoning(merged: dict[str, Any], reasoning: str) -> None:
    """The reasoning that came before output merged into an assistant message: after the
    reasoning it holds (a model that reasoned again between its text and its call), not dropped."""
    if reasoning:
        held = merged.get("reasoning")
        merged["reasoning"] = f"{held}\n\n{reasoning}" if held else reasoning


def _answers_first(items: list[Any], open_calls: set[str]) -> tuple[list[Any], bool]:
    """``items`` in the order their messages are sent: a user, system or developer message that
    comes while the model's calls are open (``open_calls``: unanswered) waits for the outputs
    that follow it at once, and goes out after them. Strict chat servers refuse an assistant
    message with ``tool_calls`` that tool messages do not follow (OpenAI: "An assistant message
    with 'tool_calls' must be followed by tool messages"), and a WebSocket steer's successor has
    its steering input before the outputs (prepended, as ``response.steer.pending`` says).

    ``open_calls`` is updated to the calls still open after ``items`` (the state a cached
    rendering carries to its continuation). The flag: ``items`` end with such a message, which
    outputs in the next items would move (a rendering a continuation cannot extend). A message
    that anything but an output follows goes out before it, and the calls it came after count
    as abandoned: a later output does not move it."""
    if not open_calls and not any(type(it) is FunctionCall for it in items):
        return items, False
    out: list[Any] = []
    held: list[Any] = []
    for it in items:
        t = type(it)
        if t is FunctionCallOutput:
            open_calls.discard(it.call_id)
        elif t is Message and it.role != "assistant" and open_calls:
            held.append(it)
            continue
        else:
            if held:
                out += held
                held.clear()
                open_calls.clear()
            if t is FunctionCall:
                open_calls.add(it.call_id)
        out.append(it)
    return out + held, bool(held)


def _render_items(
    items: list[Any], dialect: Dialect, messages: list[dict[str, Any]], encoded: list[bytes], reasoning: str,
    open_calls: set[str],
) -> tuple[str, bool]:
    """Append the chat messages of ``items`` to ``messages`` (and their JSON to ``encoded``), in
    the order :func:`_answers_first` gives them (``open_calls``: the calls open before them,
    updated).

    Messages already in the lists are never mutated (a merge replaces the last one), so a cached
    rendering can be extended safely. Returns the reasoning (:func:`reasoning_text`) still
    waiting for the assistant message it preceded, and whether the rendering ends with messages
    that outputs in the next items would move (not to be extended).
    """
    enc = _encoder.encode

    def add(msg: dict[str, Any]) -> None:
        messages.append(msg)
        encoded.append(enc(msg))

    def after_calls(text: str) -> bool:
        """Assistant text right after the assistant's calls (the model wrote on after a call, or
        the assembler closed the call before the text): merged into the message that holds the
        calls, or the calls' results would no longer follow them at once, which strict chat
        servers refuse (OpenAI: "An assistant message with 'tool_calls' must be followed by
        tool messages"). Chat messages cannot interleave text and calls: the texts are joined."""
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or "tool_calls" not in last:
            return False
        prev = last.get("content")
        merged = {**last, "content": f"{prev}\n\n{text}" if prev and text else prev or text}
        _add_reasoning(merged, reasoning)
        reasoning = ""
        messages[-1] = merged
        encoded[-1] = enc(merged)
        return True

    # A tool's output may hold images (Codex's view_image, an AI SDK tool result), which a chat
    # server's tool message cannot: with a dialect that reads images they follow the run of tool
    # messages they came in (strict servers want every result of a turn's calls right after
    # them), as a user message naming the call (other parts of a tool's output are refused).
    shown: list[tuple[str, list[Any]]] = []

    def show() -> None:
        for call_id, images in shown:
            add({"role": "user", "content": [{"type": "text", "text": f"Images from the output of tool call {call_id}:"},
                                            *_content(images, dialect)]})
        shown.clear()

    ordered, tentative = _answers_first(items, open_calls)
    for item in ordered:
        if shown and not isinstance(item, FunctionCallOutput):
            show()
        if isinstance(item, Message):
            if item.role == "assistant":
                text = _text_only(item.content, dialect, "assistant messages")
                if after_calls(text):
                    continue
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
                _add_reasoning(merged, reasoning)
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
            images: list[Any] | None = [] if dialect.images else None
            text = _text_only(item.output, dialect, "function_call_output", images)
            add({"role": "tool", "tool_call_id": item.call_id, "content": text})
            if images:
                shown.append((item.call_id, images))
            reasoning = ""
        elif isinstance(item, Reasoning):
            # Its raw reasoning, else the text its encrypted_content seals if this server sealed
            # it (what the AI SDK and Codex send back with store: false; any other token, OpenAI's
            # or another server's, is ignored), else its summary: protocol.sealed.reasoning_text,
            # which its token count counts too. A summary hotloop streamed is the model's
            # reasoning verbatim (protocol.turn: no summarizer), and all such an item holds when
            # it comes back without a token (sent back, an item_reference, previous_response_id);
            # another server's summary is the closest thing to the reasoning the client has.
            if dialect.reasoning_history:
                reasoning += reasoning_text(item)
        elif isinstance(item, OtherItem):
            # Item types hotloop does not model (custom tool calls and their outputs, hosted tool
            # calls...) are rendered as text holding the item's JSON rather than dropped: the
            # model then still sees what happened earlier in the conversation. Outputs read as
            # user turns, everything else as the assistant's own. The JSON keeps the client's key
            # order, so the rendering is as stable as the item.
            role = "user" if item.type.endswith("_output") else "assistant"
            text = enc(model_view(item.data)).decode("utf-8")
            if role == "user" or not after_calls(text):
                add({"role": role, "content": text})
            reasoning = ""
        elif isinstance(item, ItemReference):
            # The server resolves references before calling a backend; one left here is a bug.
            raise errors.ServerError()
    if shown:
        # images of the last outputs, after them: outputs in the next items would go before
        # these (after the run of tool messages they join), so this rendering is not extended
        show()
        tentative = True
    return reasoning, tentative


MAX_PIECES = 64  # pieces of a cached conversation's messages before they are joined into one


class _Rendered:
    """A cached conversation: its items, and its messages' JSON as ``pieces`` that concatenate
    to the comma-separated messages except the last (a piece per continuation: every piece but
    the first starts with its comma, so a request joins them without a Python loop), the last
    message (kept apart: a function call that follows merges into it) and its JSON, and the
    reasoning still waiting for the assistant message it preceded."""

    __slots__ = ("items", "pieces", "last", "last_json", "reasoning", "size", "open_calls")

    def __init__(
        self, items: list[Any], pieces: list[bytes], last: dict[str, Any] | None, last_json: bytes, reasoning: str, size: int,
        open_calls: frozenset[str] = frozenset(),
    ) -> None:
        self.items = items
        self.pieces = pieces
        self.last = last
        self.last_json = last_json
        self.reasoning = reasoning
        self.size = size
        self.open_calls = open_calls  # the model's calls no output answered yet (_answers_first)


# Rendered tool arrays a RenderCache keeps (RenderCache.tools): 16, of TOOLS_MIN_BYTES to
# TOOLS_MAX_BYTES each (smaller and larger ones are rendered every time), so at most 16 MiB of
# JSON. Each holds its tool objects, which are normally the ones the tools cache of the server
# keeps (pipeline.settings) and accounts.
TOOLS_KEPT = 16
TOOLS_MIN_BYTES = 128
TOOLS_MAX_BYTES = 1024 * 1024


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
        # Rendered tool arrays by the identity of their tools (an agent's, decoded once and
        # shared by its turns: pipeline.settings), holding the tools so no id is recycled.
        self._tools: dict[tuple[int, ...], tuple[tuple[FunctionTool, ...], msgspec.Raw]] = {}

    def tools(self, tools: list[FunctionTool]) -> msgspec.Raw:
        """The chat ``tools`` array of ``tools``, encoded: once for the same tool objects (up
        to TOOLS_KEPT arrays of TOOLS_MIN_BYTES to TOOLS_MAX_BYTES, least recently used out)."""
        key = tuple(map(id, tools))
        hit = self._tools.pop(key, None)
        if hit is None:
            raw = msgspec.Raw(_encoder.encode([_tool(t) for t in tools]))
            if not TOOLS_MIN_BYTES <= len(raw) <= TOOLS_MAX_BYTES:
                return raw
            hit = (tuple(tools), raw)
            while len(self._tools) >= TOOLS_KEPT:
                del self._tools[next(iter(self._tools))]
        self._tools[key] = hit  # the newest last
        return hit[1]

    def render(self, items: list[Any]) -> list[bytes]:
        """The JSON of the messages of ``items``, comma-separated, as pieces to concatenate
        (empty: no message), reusing a cached prefix when there is one. Only the new items are
        rendered and encoded, and nothing of the prefix is copied: its pieces are shared."""
        if not items:
            return []
        key = id(items[0])
        hit = self._d.pop(key, None)
        if hit is not None:
            self.bytes -= hit.size
        n = len(hit.items) if hit is not None else 0
        # by identity: an equal item may render differently (an item hotloop does not model keeps
        # the client's JSON: key order, 1 against 1.0 or true)
        if hit is not None and n <= len(items) and all(map(operator.is_, hit.items, items)):
            self.hits += 1
            pieces, size, reasoning = hit.pieces, hit.size, hit.reasoning
            messages, encoded = ([hit.last], [hit.last_json]) if hit.last is not None else ([], [])
            size -= len(hit.last_json)
            rest = items[n:]
            open_calls = set(hit.open_calls)
        else:
            pieces, size, messages, encoded, reasoning, rest = [], 0, [], [], "", items
            open_calls = set()
        reasoning, tentative = _render_items(rest, self.dialect, messages, encoded, reasoning, open_calls)
        last, last_json = (messages[-1], encoded[-1]) if messages else (None, b"")
        if len(encoded) > 1:  # sealed: every message but the last (a new piece, shared from now on)
            done = b",".join(encoded[:-1])
            pieces = [*pieces, b"," + done if pieces else done]
            size += len(done) + 1
            if len(pieces) > MAX_PIECES:  # one copy per MAX_PIECES turns keeps writes few-vectored
                pieces = [b"".join(pieces)]
        size += len(last_json)
        entry = _Rendered(list(items), pieces, last, last_json, reasoning, size, frozenset(open_calls))
        # (a rendering that ends with messages waiting for the calls' outputs is not kept: the
        # outputs in the next turn's items go before them; that turn renders whole, once)
        if entry.size <= self.max_bytes // 4 and not tentative:
            self._d[key] = entry
            self.bytes += entry.size
            while len(self._d) > self.max_entries or self.bytes > self.max_bytes:
                self.bytes -= self._d.pop(next(iter(self._d))).size
        if last is None:  # no message at all
            return []
        return [*pieces, b"," + last_json] if pieces else [last_json]


def _system(req: BackendRequest) -> list[dict[str, Any]]:
    return [{"role": "system", "content": req.instructions}] if req.instructions else []


def render_messages(req: BackendRequest, dialect: Dialect) -> list[dict[str, Any]]:
    """The ``messages`` array for the conversation in ``req``."""
    messages = _system(req)
    _render_items(req.items, dialect, messages, [_encoder.encode(m) for m in messages], "", set())
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


def render(
    req: BackendRequest, dialect: Dialect, messages: Any = None, tools_of: Callable[[list[FunctionTool]], Any] | None = None
) -> dict[str, Any]:
    """The chat-completions request body (a streaming request with usage).

    ``messages`` may be given pre-encoded (a ``msgspec.Raw``; see :func:`encode_request`), and
    the ``tools`` array by ``tools_of`` (:meth:`RenderCache.tools`).
    """
    body: dict[str, Any] = {"model": req.model, "messages": render_messages(req, dialect) if messages is None else messages}
    tools, choice = _tools_and_choice(req, dialect)
    if tools:
        body["tools"] = tools_of(tools) if tools_of is not None else [_tool(t) for t in tools]
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
    return b"".join(encode_request_parts(req, dialect, cache))


def encode_request_parts(req: BackendRequest, dialect: Dialect, cache: RenderCache) -> list[bytes]:
    """:func:`encode_request` as pieces whose concatenation is the body, for a vectored write:
    the history's pieces are the cache's own, so the body is copied once, by the kernel, from
    where the messages were encoded (no joined copy of a conversation's history per turn)."""
    system = [_encoder.encode(m) for m in _system(req)]
    parts = cache.render(req.items)
    # The body around an empty messages array, cut where the messages go: "model" is the first
    # key and its value a JSON string (no unescaped quote inside), so the first '"messages":[]'
    # is the key's.
    empty = _encoder.encode(render(req, dialect, msgspec.Raw(b"[]"), cache.tools))
    if not parts and not system:
        return [empty]
    head, sep, tail = empty.partition(_MESSAGES)
    assert sep, "render() writes the messages right after the model"
    lead = head + _MESSAGES_OPEN
    if system:
        lead += b",".join(system)
        if parts:
            lead += b","
    return [lead, *parts, b"]" + tail]


_MESSAGES = b'"messages":[]'
_MESSAGES_OPEN = b'"messages":['
