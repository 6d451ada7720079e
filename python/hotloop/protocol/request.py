"""Decoding and validating the ``POST /v1/responses`` body (and the WebSocket ``response.create``).

Sans-I/O: bytes or dicts in, typed structs or :class:`hotloop.errors.InvalidRequest` out.

Tolerance (DESIGN principle 9): unknown top-level fields are ignored (real clients send new ones),
unknown *item* types are kept as :class:`OtherItem` and never rejected here, unknown *tool* types
are kept and rejected only when a request forces their use. Invariants the server relies on
(types, ranges, limits) are checked strictly and reported with the OpenAI ``param`` path.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Union

import msgspec

from hotloop import errors

# ---------------------------------------------------------------------------------------------
# Content parts
# ---------------------------------------------------------------------------------------------

_PART = {"tag_field": "type", "kw_only": True, "omit_defaults": True}


class InputText(msgspec.Struct, tag="input_text", **_PART):  # type: ignore[call-arg]
    text: str


class OutputText(msgspec.Struct, tag="output_text", **_PART):  # type: ignore[call-arg]
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class Refusal(msgspec.Struct, tag="refusal", **_PART):  # type: ignore[call-arg]
    refusal: str


class InputImage(msgspec.Struct, tag="input_image", **_PART):  # type: ignore[call-arg]
    image_url: str | None = None
    file_id: str | None = None
    # null is "auto": openai-python types an image in a function_call_output with
    # ``detail: Optional[...]`` (ResponseInputImageContentParam), and its callers send None
    detail: str | None = "auto"

    def __post_init__(self) -> None:
        if self.detail is None:
            self.detail = "auto"


class InputFile(msgspec.Struct, tag="input_file", **_PART):  # type: ignore[call-arg]
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class InputAudio(msgspec.Struct, tag="input_audio", **_PART):  # type: ignore[call-arg]
    input_audio: dict[str, Any]


class ReasoningText(msgspec.Struct, tag="reasoning_text", **_PART):  # type: ignore[call-arg]
    text: str


class SummaryText(msgspec.Struct, tag="summary_text", **_PART):  # type: ignore[call-arg]
    text: str


ContentPart = Union[
    InputText, OutputText, Refusal, InputImage, InputFile, InputAudio, ReasoningText, SummaryText
]

# ---------------------------------------------------------------------------------------------
# Items
# ---------------------------------------------------------------------------------------------

_ITEM = {"tag_field": "type", "kw_only": True, "omit_defaults": True}

Role = Literal["user", "assistant", "system", "developer"]


class Message(msgspec.Struct, tag="message", **_ITEM):  # type: ignore[call-arg]
    role: Role
    content: Union[str, list[ContentPart]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCall(msgspec.Struct, tag="function_call", **_ITEM):  # type: ignore[call-arg]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(msgspec.Struct, tag="function_call_output", **_ITEM):  # type: ignore[call-arg]
    call_id: str
    output: Union[str, list[ContentPart]]
    id: str | None = None
    status: str | None = None


class Reasoning(msgspec.Struct, tag="reasoning", **_ITEM):  # type: ignore[call-arg]
    id: str | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class ItemReference(msgspec.Struct, tag="item_reference", **_ITEM):  # type: ignore[call-arg]
    id: str


class OtherItem(msgspec.Struct, kw_only=True):
    """An item type hotloop does not model (custom tool calls, hosted tool calls, compaction...).

    Kept verbatim so it can be stored, listed and passed on; backends decide how to render it.
    """

    type: str
    data: dict[str, Any]


Item = Union[Message, FunctionCall, FunctionCallOutput, Reasoning, ItemReference, OtherItem]


def model_view(data: dict[str, Any]) -> dict[str, Any]:
    """What a model reads of an item kept verbatim (``OtherItem.data``): all of it but the id,
    which the server may have minted (``input_items`` pages by id), and the status (a client
    may send it back or not), so that the item renders and counts the same either way: its
    count is cached under a fingerprint that leaves both out (``items.semantic_view``), and a
    count made with the status stood for the item without it, or the other way round."""
    return {k: v for k, v in data.items() if k != "id" and k != "status"} if "id" in data or "status" in data else data

_ITEM_TYPES: dict[str, type] = {
    "message": Message,
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "reasoning": Reasoning,
    "item_reference": ItemReference,
}

# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: TextFormat = msgspec.field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None  # openai-python 3.57 ReasoningEffort
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: str | None = None


class CreateRequest(msgspec.Struct, kw_only=True):
    """The body of ``POST /v1/responses`` and of a WebSocket ``response.create`` frame."""

    model: str | None = None
    input: Union[str, list[Any], None] = None
    instructions: str | None = None
    previous_response_id: str | None = None
    # The SDKs type both as nullable (openai-python: ``store: Optional[bool]``, ``stream:
    # Optional[Literal[False]]``); null means the default (__post_init__). Declared ``bool`` to
    # the type checker: after decoding (or construction) they never hold None.
    if TYPE_CHECKING:
        store: bool = True
        stream: bool = False
    else:
        store: bool | None = True
        stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    generate: bool | None = None
    stream_id: str | None = None
    # The WebSocket frame's discriminator; absent on HTTP.
    type: str | None = None

    def __post_init__(self) -> None:
        if self.store is None:
            self.store = True
        if self.stream is None:
            self.stream = False


class FunctionTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    # openai-python FunctionToolParam: ``strict: Required[Optional[bool]]``. Null means the
    # Responses API's default, true (as omitted does); the type checker sees ``bool``.
    if TYPE_CHECKING:
        strict: bool = True
    else:
        strict: bool | None = True

    def __post_init__(self) -> None:
        if self.strict is None:
            self.strict = True


class Prepared(msgspec.Struct, kw_only=True):
    """A validated request: settings plus the request's own (new) input items."""

    req: CreateRequest
    items: list[Item]
    tools: list[dict[str, Any]]
    function_tools: dict[str, FunctionTool]
    tool_choice: Union[str, dict[str, Any]]
    parallel_tool_calls: bool


# ---------------------------------------------------------------------------------------------
# Limits (documented in the README)
# ---------------------------------------------------------------------------------------------

METADATA_MAX_KEYS = 16
METADATA_MAX_KEY_LEN = 64
METADATA_MAX_VALUE_LEN = 512
MAX_INPUT_ITEMS = 10_000
# A model name is a key of the model registry's cache, the usage ledger and the metrics: a name
# as long as the body (32 MiB) was kept whole in each. Model ids are tens of characters.
MAX_MODEL_CHARS = 256
# Most nested containers (arrays, objects) in an item's view, a tool definition, an output format's
# schema or a tool_choice object (hotloop.pipeline.items.MAX_DEPTH is this)
MAX_NESTING = 256


# Most JSON values (objects, arrays, strings, numbers... each one) in an input item of a type
# hotloop keeps verbatim (a custom tool's call or output, a hosted tool's): each is walked by the
# classifiers and encoded for the fingerprint and the store, so 8 MB of empty objects (2.7 million
# values) held the event loop for seconds and took 800 MB
MAX_VERBATIM_VALUES = 100_000


def json_weight(obj: Any, limit: int, chars: bool = True, per_value: int = 1) -> int:
    """How much the JSON value ``obj`` holds: ``per_value`` for each value (an object's key
    included), plus each string's length with ``chars``; counted until ``limit`` is reached
    (at most ``limit`` values are looked at, whatever ``obj`` holds)."""
    n = 0
    stack = [obj]
    pop, extend = stack.pop, stack.extend
    while stack and n < limit:
        v = pop()
        t = type(v)
        n += per_value
        if t is str:
            if chars:
                n += len(v)
        elif t is dict:
            n += per_value * len(v)  # its keys
            extend(v.values())
        elif t is list or t is tuple:
            extend(v)
    return n


def nests_deeper(obj: Any, limit: int) -> bool:
    """Whether the JSON value ``obj`` nests more than ``limit`` containers (iterative: any depth)."""
    level = [obj] if isinstance(obj, (list, tuple, dict)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [v for o in level for v in (o.values() if type(o) is dict else o) if isinstance(v, (list, tuple, dict))]
    return False
MAX_TOOLS = 512
TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,128}\Z")  # \Z: "$" would accept a final newline
STREAM_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,256}\Z")


def invalid_stream_id() -> errors.InvalidValue:
    """The error for a ``stream_id`` that is not ``STREAM_ID_RE`` (the guide's wording)."""
    return errors.InvalidValue(
        "The 'stream_id' field must be a non-empty string with at most 256 characters and may "
        "only contain letters, numbers, underscores, hyphens, and periods.",
        param="stream_id",
        code="invalid_stream_id",
    )
TRUNCATION_VALUES = ("auto", "disabled")
# openai-python 3.57 ServiceTier (``fast``, ``ultrafast`` added); chat backends pass on only
# the tiers they know (hotloop.backends.chat.render.Dialect.service_tiers)
SERVICE_TIERS = ("auto", "default", "flex", "priority", "scale", "fast", "ultrafast")
# "in_memory" is the API's spelling (openai-python 3.x); SDKs up to 2.32 wrote "in-memory": both
# are accepted and echoed as sent
PROMPT_CACHE_RETENTIONS = ("in_memory", "in-memory", "24h")
TOOL_CHOICE_STRINGS = ("none", "auto", "required")
# ``include``: openai-python 3.57 ResponseIncludable. Only one has an effect: a reasoning item's
# ``encrypted_content`` (protocol.sealed; objects.wants_encrypted_reasoning). The others name
# output hotloop never makes (hosted tools' results, logprobs, input image URLs). A value outside
# this set is accepted and ignored too, where OpenAI answers 400: the set grows with the API, and
# a client that learns a new value (Codex sends ``include`` on every turn) must not have every
# request refused by a server that predates it (the type, an array of strings, is checked).
ENCRYPTED_REASONING = "reasoning.encrypted_content"
INCLUDABLE = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    ENCRYPTED_REASONING,
    "message.output_text.logprobs",
)

_decoder = msgspec.json.Decoder(CreateRequest)
_AT_RE = re.compile(r" - at `\$(.*)`$")


def _param_from_path(path: str) -> str | None:
    """``.input[0].content`` -> ``input[0].content`` (OpenAI's ``param`` spelling)."""
    path = path.lstrip(".")
    return path or None


# The decoder's type names (and Python's, which some of its messages use) in JSON's words.
_JSON_TYPES = {
    "str": "a string",
    "bytes": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "null": "null",
    "None": "null",
    "NoneType": "null",
    "object": "an object",
    "dict": "an object",
    "array": "an array",
    "list": "an array",
    "tuple": "an array",
    "set": "an array",
    "any": "any value",
}
_EXPECTED_RE = re.compile(r"^Expected `([^`]*)`(.*?)(?:, got `([^`]*)`)?$")
_ENUM_RE = re.compile(r"^Invalid (?:enum )?value (.*)$", re.S)
_QUOTED_RE = re.compile(r"`([^`]*)`")


def _json_type(name: str) -> str:
    return _JSON_TYPES.get(name.strip(), "a value of another type")


def _one_of(names: str) -> str:
    """``str | array | null`` -> ``a string, an array or null``."""
    words = list(dict.fromkeys(_json_type(n) for n in names.split("|")))
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def shown(value: Any) -> str:
    """A client's value as an error message may repeat it: quoted, in JSON terms, clipped."""
    if isinstance(value, str):
        return "'" + errors.clip(value) + "'"
    try:
        text = msgspec.json.encode(value).decode()
    except (TypeError, ValueError, OverflowError, RecursionError):
        text = "a value of another type"
    return errors.clip(text)


def json_terms(detail: str) -> str:
    """A decoder's validation message, reworded for a JSON client (no Python type names, echoed
    input clipped)."""
    m = _EXPECTED_RE.match(detail)
    if m:
        expected, constraint, got = m.group(1), m.group(2).strip(), m.group(3)
        text = "expected " + _one_of(expected)
        if constraint:
            text += " " + _QUOTED_RE.sub(lambda q: _json_type(q.group(1)), constraint)
        return text + (f", but got {_json_type(got)} instead" if got else "")
    m = _ENUM_RE.match(detail)
    if m:
        raw = m.group(1)
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            raw = raw[1:-1]
        return f"'{errors.clip(raw)}' is not a supported value"
    # anything else: keep the words, never a Python type name or a long echo
    return errors.clip(_QUOTED_RE.sub(lambda q: _json_type(q.group(1)), detail).rstrip("."), 200)


# The decoder's words for a JSON number beyond what it holds (a float past 1.8e308, an integer
# past the 64 bits a typed field takes)
_OUT_OF_RANGE = ("Number out of range", "Integer value out of range")


def _from_validation_error(exc: msgspec.ValidationError, prefix: str = "") -> errors.InvalidRequest:
    text = str(exc)
    m = _AT_RE.search(text)
    param = _param_from_path(m.group(1)) if m else None
    detail = text[: m.start()] if m else text
    if prefix:
        param = prefix + ("" if param is None else ("" if param.startswith("[") else ".") + param)
    inside = False
    if param is not None and "[...]" in param:
        # the decoder names an object's key it does not keep as "[...]": the param names the
        # value that holds it (``tools[0]``, ``metadata``), never the decoder's placeholder
        param = param[: param.index("[...]")].rstrip(".") or None
        inside = True
    if detail.rstrip(".") in _OUT_OF_RANGE:
        what = "a number in it is out of range" if inside else "the number is out of range"
        if param is None:
            return errors.InvalidValue(f"Invalid value: {what.replace(' in it', '')}.", param=None)
        return errors.InvalidValue(f"Invalid value for '{param}': {what}.", param=param)
    if detail.startswith("Object missing required field"):
        field = detail.split("`")[1] if "`" in detail else None
        full = param + "." + field if param and field else (field or param)
        return errors.MissingParameter(f"Missing required parameter: '{full}'.", param=full)
    if detail.startswith("Expected"):
        return errors.InvalidType(f"Invalid type for '{param}': {json_terms(detail)}.", param=param)
    return errors.InvalidValue(f"Invalid value for '{param}': {json_terms(detail)}.", param=param)


TOO_DEEP = "The JSON is nested too deeply."


def decode_body(body: bytes | bytearray | str) -> CreateRequest:
    """Decode a JSON body. Raises :class:`errors.InvalidRequest` (never anything else)."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        if msg.startswith("Expected `object`") and " - at `" not in msg:  # the body itself
            raise errors.InvalidJSON("The request body must be a JSON object.") from None
        raise _from_validation_error(exc) from None
    except msgspec.DecodeError:
        raise errors.InvalidJSON(
            "We could not parse the JSON body of your request. The body must be valid JSON."
        ) from None
    except RecursionError:
        raise errors.InvalidJSON(TOO_DEEP) from None


def convert_body(obj: dict[str, Any]) -> CreateRequest:
    """Like :func:`decode_body` for an already-decoded JSON object (a WebSocket frame)."""
    try:
        return msgspec.convert(obj, CreateRequest)
    except msgspec.ValidationError as exc:
        raise _from_validation_error(exc) from None
    except RecursionError:
        raise errors.InvalidJSON(TOO_DEEP) from None


def decode_item(raw: Any, index: int, field: str = "input", stored: bool = False) -> Item:
    """Validate one input item. ``index`` names it in errors (``input[3].content``).

    An empty ``id`` is refused (``empty_string``, as OpenAI does): the id is what
    ``input_items`` pages by, and a page ending on ``""`` sent the SDKs' auto-pagination back
    to the first page for ever. ``stored``: an item read back from the store, which may hold one
    from before that rule (read as it was written)."""
    where = f"{field}[{index}]"
    if not isinstance(raw, dict):
        if isinstance(raw, str):
            # A bare string inside the list is not an item; OpenAI rejects it too.
            raise errors.InvalidType(
                f"Invalid type for '{where}': expected an input item object, but got a string.",
                param=where,
            )
        raise errors.InvalidType(
            f"Invalid type for '{where}': expected an input item object.", param=where
        )
    kind = raw.get("type")
    if kind is None:
        if "role" in raw:
            kind = "message"  # EasyInputMessage: type optional
        elif "id" in raw:
            # ItemReference: ``type`` is optional and nullable in the SDKs (openai-python
            # ``type: Optional[Literal["item_reference"]]``, openai-node ``type?: ... | null``)
            raw = {k: v for k, v in raw.items() if k != "type"}
            kind = "item_reference"
        else:
            raise errors.MissingParameter(
                f"Missing required parameter: '{where}.type'.", param=f"{where}.type"
            )
    if not isinstance(kind, str):
        raise errors.InvalidType(f"Invalid type for '{where}.type': expected a string.", param=f"{where}.type")
    if not stored and raw.get("id") == "":
        raise errors.EmptyString(
            f"Invalid '{where}.id': empty string. Expected a string with minimum length 1, but got an empty string instead.",
            param=f"{where}.id",
        )
    cls = _ITEM_TYPES.get(kind)
    if cls is None:
        # kept verbatim, but its id is what the store, ``input_items`` and the chain's id
        # lookups read: a string (or absent/null), as every modelled item's is
        iid = raw.get("id")
        if iid is not None and not isinstance(iid, str):
            raise errors.InvalidType(f"Invalid type for '{where}.id': expected a string.", param=f"{where}.id")
        if json_weight(raw, MAX_VERBATIM_VALUES + 1, chars=False) > MAX_VERBATIM_VALUES:
            raise errors.InvalidValue(
                f"Invalid '{where}': an item of type '{errors.clip(kind)}' may hold at most "
                f"{MAX_VERBATIM_VALUES:,} JSON values.",
                param=where,
            )
        return OtherItem(type=kind, data=raw)
    try:
        return msgspec.convert(raw, cls)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise _from_validation_error(exc, prefix=where) from None
    except RecursionError:
        raise errors.InvalidValue(f"Invalid '{where}': {TOO_DEEP}", param=where) from None


def decode_items(raw: str | list[Any] | None, field: str = "input") -> list[Item]:
    """Turn ``input`` (a string or a list of items) into typed items."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [Message(role="user", content=[InputText(text=raw)])]
    if len(raw) > MAX_INPUT_ITEMS:
        raise errors.InvalidValue(
            f"Invalid '{field}': too many items ({len(raw)}); the maximum is {MAX_INPUT_ITEMS}.",
            param=field,
        )
    return [decode_item(it, i, field) for i, it in enumerate(raw)]


def _check_metadata(md: dict[str, Any] | None) -> None:
    if md is None:
        return
    if len(md) > METADATA_MAX_KEYS:
        raise errors.InvalidValue(
            f"Invalid 'metadata': too many keys ({len(md)}); at most {METADATA_MAX_KEYS} are allowed.",
            param="metadata",
        )
    for k, v in md.items():
        if len(k) > METADATA_MAX_KEY_LEN:
            raise errors.InvalidValue(
                f"Invalid 'metadata': keys may be at most {METADATA_MAX_KEY_LEN} characters.",
                param="metadata",
            )
        if not isinstance(v, str):
            raise errors.InvalidType(
                f"Invalid type for 'metadata.{k}': expected a string.", param=f"metadata.{k}"
            )
        if len(v) > METADATA_MAX_VALUE_LEN:
            raise errors.InvalidValue(
                f"Invalid 'metadata.{k}': values may be at most {METADATA_MAX_VALUE_LEN} characters.",
                param=f"metadata.{k}",
            )


def _range(name: str, value: float | int | None, lo: float, hi: float | None = None) -> None:
    if value is None:
        return
    if value < lo or (hi is not None and value > hi):
        bound = f"between {_num(lo)} and {_num(hi)}" if hi is not None else f"at least {_num(lo)}"
        raise errors.InvalidValue(
            f"Invalid '{name}': {errors.clip(repr(value), 30)} is out of range; it must be {bound}.", param=name
        )


def _num(x: float | int) -> str:
    return str(x) if type(x) is int else f"{x:g}"


# The largest count a request may ask for (``max_output_tokens``, ``max_tool_calls``): a 32-bit
# integer, as backends take it (a JSON integer has no size of its own: 10**400 decoded).
MAX_COUNT = 2**31 - 1


class CheckedTools:
    """A ``tools`` array decoded and checked once (``tools``, its ``functions``, and ``json``,
    its encoding as :func:`hotloop.pipeline.prepare.tools_json` makes it), shared by the
    requests that send the same bytes again (:class:`hotloop.pipeline.settings.ToolsCache`).
    Shared, so never changed: nothing in hotloop writes into a request's tools."""

    __slots__ = ("tools", "functions", "json", "__weakref__")

    def __init__(self, tools: list[dict[str, Any]], functions: dict[str, FunctionTool], json: bytes) -> None:
        self.tools = tools
        self.functions = functions
        self.json = json


# The shared tools arrays alive, by identity: validating a request whose tools are one of them
# takes its functions instead of checking it again. Weak values: an array no cache keeps is
# dropped here with it (an id is reused only after its object is gone).
_CHECKED: weakref.WeakValueDictionary[int, CheckedTools] = weakref.WeakValueDictionary()
_CHECKED_REFS: dict[int, Callable[[], CheckedTools | None]] = _CHECKED.data  # type: ignore[attr-defined]


def share_checked(c: CheckedTools) -> None:
    """Make ``c`` known to :func:`checked_tools` (for as long as something keeps it)."""
    _CHECKED[id(c.tools)] = c


def checked_tools(tools: list[dict[str, Any]] | None) -> CheckedTools | None:
    """The shared, already checked array that ``tools`` is, if it is one."""
    if not tools:
        return None
    ref = _CHECKED_REFS.get(id(tools))  # the weak references themselves: C calls only (it is
    c = ref() if ref is not None else None  # asked several times a turn; .get runs Python)
    return c if c is not None and c.tools is tools else None


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, FunctionTool]:
    """The function tools of ``tools`` by name, after checking every tool (the errors name
    ``tools[i]``); an array already checked (:func:`checked_tools`) is not checked again."""
    fns: dict[str, FunctionTool] = {}
    if not tools:
        return fns
    shared = checked_tools(tools)
    if shared is not None:
        return shared.functions
    if len(tools) > MAX_TOOLS:
        raise errors.InvalidValue(f"Invalid 'tools': at most {MAX_TOOLS} tools are allowed.", param="tools")
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise _missing_or_mistyped(kind, f"tools[{i}].type", "a string")
        if kind != "function":
            continue  # kept; rejected only if a request forces its use
        try:
            fn = msgspec.convert(tool, FunctionTool)
        except msgspec.ValidationError as exc:
            raise _from_validation_error(exc, prefix=f"tools[{i}]") from None
        if not TOOL_NAME_RE.match(fn.name):
            raise errors.InvalidValue(
                f"Invalid 'tools[{i}].name': names may contain only a-z, A-Z, 0-9, underscores "
                "and dashes, at most 128 characters.",
                param=f"tools[{i}].name",
            )
        if fn.name in fns:
            raise errors.InvalidValue(
                f"Invalid 'tools': duplicate function name {shown(fn.name)}.", param=f"tools[{i}].name"
            )
        if fn.parameters is not None and fn.parameters.get("type", "object") != "object":
            raise errors.InvalidValue(
                f"Invalid 'tools[{i}].parameters': the schema must have type 'object'.",
                param=f"tools[{i}].parameters",
            )
        fns[fn.name] = fn
    return fns


def _check_tool_choice(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]], fns: dict[str, FunctionTool]
) -> str | dict[str, Any]:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_STRINGS:
            raise errors.InvalidValue(
                f"Invalid value for 'tool_choice': {shown(choice)}. Supported values are: 'none', "
                "'auto', 'required' or an object.",
                param="tool_choice",
            )
        if choice == "required" and not tools:
            raise errors.InvalidValue(
                "Invalid 'tool_choice': 'required' needs at least one tool in 'tools'.",
                param="tool_choice",
            )
        if choice == "required" and not fns:
            # only function tools reach a backend: a call forced among the others is forcing
            # their use (rejected, as a named hosted tool is), not a text answer
            raise errors.UnsupportedParameter(
                f"Invalid 'tool_choice': 'required' needs a function tool; tools of type "
                f"{shown(_first_kind(tools))} are not supported by this server.",
                param="tool_choice",
            )
        return choice
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _missing_or_mistyped(name, "tool_choice.name", "a string")
        if name not in fns:
            raise errors.InvalidValue(
                f"Tool choice {shown(name)} not found in 'tools' parameter.", param="tool_choice"
            )
        return choice
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise errors.InvalidValue(
                f"Invalid 'tool_choice.mode': {shown(mode)}. Expected 'auto' or 'required'.",
                param="tool_choice.mode",
            )
        allowed = choice.get("tools")
        if not isinstance(allowed, list) or not allowed:
            raise errors.InvalidValue(
                "Invalid 'tool_choice.tools': expected a non-empty array of tools.",
                param="tool_choice.tools",
            )
        callable_ = False
        for j, t in enumerate(allowed):
            name = t.get("name") if isinstance(t, dict) else None
            if not isinstance(t, dict) or (t.get("type") == "function" and not (isinstance(name, str) and name in fns)):
                raise errors.InvalidValue(
                    f"Invalid 'tool_choice.tools[{j}]': it names no function in 'tools'.",
                    param=f"tool_choice.tools[{j}]",
                )
            callable_ = callable_ or t.get("type") == "function"
        if mode == "required" and not callable_:
            # as "required" above (the chat backends refused it only once the response had started)
            raise errors.UnsupportedParameter(
                "Invalid 'tool_choice': the allowed tools name no function tool this server can call.",
                param="tool_choice",
            )
        return choice
    if isinstance(kind, str):
        # A hosted or custom tool: allowed only if such a tool was declared; even then no
        # backend can run it, so it is rejected clearly.
        raise errors.UnsupportedParameter(
            f"Invalid 'tool_choice': tools of type {shown(kind)} are not supported by this server.",
            param="tool_choice",
        )
    raise _missing_or_mistyped(kind, "tool_choice.type", "a string")


def _first_kind(tools: list[dict[str, Any]]) -> Any:
    """The type of the first tool that is not a function (checked to be a string)."""
    return next((t.get("type") for t in tools if t.get("type") != "function"), None)


def _missing_or_mistyped(value: Any, param: str, expected: str) -> errors.HotloopError:
    """A required field that is absent (or null), or present with the wrong type."""
    if value is None:
        return errors.MissingParameter(f"Missing required parameter: '{param}'.", param=param)
    return errors.InvalidType(f"Invalid type for '{param}': expected {expected}.", param=param)


def validate(req: CreateRequest, *, websocket: bool = False, counting: bool = False) -> Prepared:
    """Check the request's settings and decode its own input items (not the chained context).

    ``counting``: for ``POST /v1/responses/input_tokens``, where ``input`` is optional
    (openai-python's InputTokenCountParams): instructions and tools alone are counted."""
    if req.model is None:
        raise errors.MissingParameter("Missing required parameter: 'model'.", param="model")
    if not req.model:
        raise errors.InvalidValue("Invalid 'model': the model name must not be empty.", param="model")
    if len(req.model) > MAX_MODEL_CHARS:
        raise errors.InvalidValue(
            f"Invalid 'model': the model name must be at most {MAX_MODEL_CHARS} characters.", param="model"
        )
    if not req.model.isprintable():
        # a tab, a line break, an escape: in no model id, and the ledger's and logs' keys
        raise errors.InvalidValue("Invalid 'model': the model name must not contain control characters.", param="model")
    if req.input is None and req.previous_response_id is None and req.prompt is None and req.generate is not False and not counting:
        # A warm-up (``generate: false``) may prepare only tools and instructions: its input
        # is then empty (wire reference 1.8: "the tools, instructions, and/or custom messages").
        raise errors.MissingParameter("Missing required parameter: 'input'.", param="input")
    if req.background:
        where = "over WebSocket" if websocket else "by this server"
        raise errors.UnsupportedParameter(
            f"Background responses are not supported {where}; omit 'background'.", param="background"
        )
    if req.conversation is not None:
        raise errors.UnsupportedParameter(
            "The 'conversation' parameter is not supported by this server; use "
            "'previous_response_id' instead.",
            param="conversation",
        )
    if req.prompt is not None:
        raise errors.UnsupportedParameter(
            "Prompt templates ('prompt') are not supported by this server.", param="prompt"
        )
    if req.stream_id is not None and not STREAM_ID_RE.match(req.stream_id):
        raise invalid_stream_id()
    _range("temperature", req.temperature, 0, 2)
    _range("top_p", req.top_p, 0, 1)
    _range("max_output_tokens", req.max_output_tokens, 1, MAX_COUNT)
    _range("max_tool_calls", req.max_tool_calls, 1, MAX_COUNT)
    _range("top_logprobs", req.top_logprobs, 0, 20)
    if req.truncation is not None and req.truncation not in TRUNCATION_VALUES:
        raise errors.InvalidValue(
            f"Invalid value for 'truncation': {shown(req.truncation)}. Supported values are: 'auto' and "
            "'disabled'.",
            param="truncation",
        )
    if req.prompt_cache_retention is not None and req.prompt_cache_retention not in PROMPT_CACHE_RETENTIONS:
        raise errors.InvalidValue(
            f"Invalid value for 'prompt_cache_retention': {shown(req.prompt_cache_retention)}. Supported values "
            "are: 'in_memory', 'in-memory' and '24h'.",
            param="prompt_cache_retention",
        )
    if req.service_tier is not None and req.service_tier not in SERVICE_TIERS:
        raise errors.InvalidValue(
            f"Invalid value for 'service_tier': {shown(req.service_tier)}.", param="service_tier"
        )
    _check_metadata(req.metadata)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if not fmt.name:
            raise errors.MissingParameter(
                "Missing required parameter: 'text.format.name'.", param="text.format.name"
            )
        if fmt.schema is None:
            raise errors.MissingParameter(
                "Missing required parameter: 'text.format.schema'.", param="text.format.schema"
            )
    # as deep as an item or a tool may nest: what the classifiers read (and what is echoed,
    # stored and sent) is bounded, and nothing deeper goes unread
    if fmt is not None and nests_deeper(fmt.schema, MAX_NESTING):
        raise errors.InvalidValue(
            f"Invalid 'text.format.schema': it nests more than {MAX_NESTING} levels.", param="text.format.schema"
        )
    if type(req.tool_choice) is dict and nests_deeper(req.tool_choice, MAX_NESTING):
        raise errors.InvalidValue(f"Invalid 'tool_choice': it nests more than {MAX_NESTING} levels.", param="tool_choice")
    tools = req.tools or []
    fns = check_tools(tools)
    choice = _check_tool_choice(req.tool_choice, tools, fns)
    items = decode_items(req.input)
    return Prepared(
        req=req,
        items=items,
        tools=tools,
        function_tools=fns,
        tool_choice=choice,
        parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
    )




def item_to_dict(item: Item) -> dict[str, Any]:
    """The wire form of an item (what ``input_items`` lists and what is stored)."""
    if isinstance(item, OtherItem):
        return item.data
    return msgspec.to_builtins(item)  # type: ignore[no-any-return]


# Fields an item or a part is stored without when they hold their default (omit_defaults), and
# which OpenAI lists (and the SDKs' types require: openai-python typed a user message whose
# image had no ``detail`` as an assistant's output message, and left ``summary`` and
# ``annotations`` None for code that iterates them)
_PART_DEFAULTS: dict[str, tuple[tuple[str, Any], ...]] = {
    "output_text": (("annotations", ()), ("logprobs", ())),
    "input_image": (("detail", "auto"),),
}


def _listed_part(p: Any) -> Any:
    defaults = _PART_DEFAULTS.get(str(p.get("type"))) if type(p) is dict else None
    if not defaults or all(k in p for k, _ in defaults):
        return p
    return {**p, **{k: list(v) if type(v) is tuple else v for k, v in defaults if k not in p}}


def listed_item(d: dict[str, Any]) -> dict[str, Any]:
    """A stored input item as ``input_items`` lists it. A message sent in the short form
    (``{"role": "user", "content": "text"}``) is listed in its item form, as OpenAI lists it:
    content parts (``input_text``, ``output_text`` for the assistant) and a ``status``; the SDKs
    type a listed message by that form. Fields stored without their default value are listed
    with it (an ``output_text``'s ``annotations`` and ``logprobs``, an ``input_image``'s
    ``detail``, a reasoning item's ``summary``; a call's and a call output's ``status``). The
    stored item itself stays as it was sent."""
    kind = d.get("type")
    if kind == "reasoning":
        return d if "summary" in d else {**d, "summary": []}
    if kind == "function_call_output":  # its parts, as a message's (an image's ``detail``)
        output = d.get("output")
        if isinstance(output, list):
            parts = [_listed_part(p) for p in output]
            if any(a is not b for a, b in zip(parts, output)):
                d = {**d, "output": parts}
    if kind != "message":
        # a call or a call's output (function_call, custom_tool_call, computer_call_output...)
        # sent without a status: listed with one, which the SDKs' types of them require
        if isinstance(kind, str) and kind.endswith(("_call", "_call_output")) and d.get("status") is None:
            return {**d, "status": "completed"}
        return d
    content = d.get("content")
    if isinstance(content, str):
        part: dict[str, Any] = (
            {"type": "output_text", "text": content, "annotations": [], "logprobs": []}
            if d.get("role") == "assistant"
            else {"type": "input_text", "text": content}
        )
        d = {**d, "content": [part]}
    elif isinstance(content, list):
        parts = [_listed_part(p) for p in content]
        if any(a is not b for a, b in zip(parts, content)):
            d = {**d, "content": parts}
    if d.get("status") is None:
        d = {**d, "status": "completed"}
    return d


def item_from_dict(d: dict[str, Any]) -> Item:
    """Inverse of :func:`item_to_dict` for stored items (already validated once)."""
    return decode_item(d, 0, "item", stored=True)
