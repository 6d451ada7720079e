"""Classifiers: per-turn checks over the new input items of a response chain.

A classifier sees only the items a turn adds (``hotloop.protocol.request`` item structs) and the
state its previous turn on the same chain left, and returns a verdict plus the state to keep with
the chain. States are immutable values: a chain that forks (two responses continuing the same
``previous_response_id``) simply carries the same state into both branches, the way token counts
travel with a chain.

Verdicts, from mildest to strongest:

* :class:`Allow`: nothing to report;
* :class:`Flag`: let the turn through, record ``labels`` (metrics, logs, stored metadata);
* :class:`Redact`: let the turn through with ``items`` (the new items with spans replaced by
  ``[REDACTED:<kind>]``, or in a call id by :func:`call_id_marker`'s ``[REDACTED:<kind>:<tag>]``)
  instead of the originals; ``findings`` say where, per item text;
* :class:`Block`: refuse the turn, with a ``reason`` safe to show the client.

Writing one (this one flags turns whose tool outputs are larger than a limit, and counts them)::

    class LargeToolOutputs:
        name = "large_tool_outputs"

        def initial_state(self) -> int:
            return 0  # flagged turns so far on this chain

        def classify(self, items: Sequence[Item], state: int) -> tuple[Verdict, int]:
            big = any(isinstance(i, FunctionCallOutput) and isinstance(i.output, str)
                      and len(i.output) > 100_000 for i in items)
            if not big:
                return ALLOW, state
            return Flag(labels=("large_tool_output",)), state + 1

:class:`SecretsClassifier` is the built-in one: it scans the text fields of the new items for
well-known credential formats (``hotloop._accel.SecretScanner``, one native call per text).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import hmac
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal, Protocol, TypeVar, Union

import msgspec

from hotloop import _accel
from hotloop._accel import redact_spans, splice
from hotloop.pipeline.items import MAX_DEPTH
from hotloop.state import fpkey
from hotloop.protocol.request import (
    CheckedTools,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    OtherItem,
    Prepared,
    Reasoning,
    Refusal,
    check_tools,
    checked_tools,
)

__all__ = [
    "ALLOW",
    "Allow",
    "Block",
    "Classifier",
    "Finding",
    "Flag",
    "Redact",
    "SecretsClassifier",
    "SecretsPolicy",
    "SecretsState",
    "Verdict",
    "call_id_marker",
    "default_secret_scanner",
    "item_texts",
]

S = TypeVar("S")

# -- verdicts ----------------------------------------------------------------------------------

#: Where a text sits inside an item: field names and list indices, e.g. ``("content", 0,
#: "text")`` for the first content part of a message, ``("arguments",)`` for a function call.
TextPath = tuple[Union[str, int], ...]


class Finding(msgspec.Struct, frozen=True):
    """One span of one text of one item: ``text[start:end]`` (``str`` indices) is a ``kind``."""

    item_index: int
    path: TextPath
    kind: str
    start: int
    end: int


class Allow(msgspec.Struct, frozen=True, tag="allow"):
    """Nothing to report."""


class Flag(msgspec.Struct, frozen=True, tag="flag"):
    """Let the turn through and record ``labels``."""

    labels: tuple[str, ...]
    findings: tuple[Finding, ...] = ()


class Redact(msgspec.Struct, frozen=True, tag="redact"):
    """Let the turn through with ``items`` in place of the new items (same length and order;
    items without findings are the original objects)."""

    labels: tuple[str, ...]
    findings: tuple[Finding, ...]
    items: tuple[Item, ...]


class Block(msgspec.Struct, frozen=True, tag="block"):
    """Refuse the turn. ``reason`` is meant for the client and never holds the offending text.

    The client gets a 400 ``invalid_request_error`` with ``code`` and, when there are
    ``findings``, a ``param`` naming the first one's item and field (``input[3].output``)."""

    reason: str
    labels: tuple[str, ...] = ()
    code: str = "input_blocked"
    findings: tuple[Finding, ...] = ()


Verdict = Union[Allow, Flag, Redact, Block]
ALLOW = Allow()


class Classifier(Protocol[S]):
    """What the pipeline calls once per turn, before inference, with the turn's new items."""

    #: a short id for labels, metrics and logs
    name: str

    def initial_state(self) -> S:
        """The state of a chain this classifier has not seen yet."""
        ...

    def classify(self, items: Sequence[Item], state: S) -> tuple[Verdict, S]:
        """The verdict on the new ``items`` and the chain's next state. Must not mutate
        ``items`` or ``state``."""
        ...


# -- the text fields of items ------------------------------------------------------------------

#: Top-level OtherItem data keys that are not text a model reads: the item's id (the renderers
#: leave it out). Every other string in the item, at any depth, is scanned (its ``call_id`` and
#: ``name`` too, which the model reads: ``local_shell_call.action.command``,
#: ``shell_call_output.output[].stdout``, ``apply_patch_call.operation.diff``...), but data URLs.
OTHER_SKIP_KEYS = frozenset(("id",))

#: Fields whose value may be inline data rather than text (base64 images and files, often large):
#: a data URL there (``data:<type>,...``) is not scanned. A URL the model is given to fetch is text
#: (it may carry a token in its query), and so is any other string starting with "data:".
DATA_FIELDS = frozenset(("image_url", "file_url", "file_data"))
_DATA_URL = re.compile(r"data:[^\s,]*,")


def _is_data(key: Any, value: str) -> bool:
    return key in DATA_FIELDS and _DATA_URL.match(value) is not None


#: Deepest nesting :func:`string_leaves` follows: as deep as an item or a tool may nest (deeper
#: ones are refused with a 400 before any backend call, :data:`hotloop.pipeline.items.MAX_DEPTH`).
MAX_LEAF_DEPTH = MAX_DEPTH


#: The last element of the path of an object's *key* (not its value): ``(*path, key, KEY)``. A
#: list index is never negative. A key cannot be redacted (it names what the JSON refers to).
KEY = -1


def string_leaves(value: Any, prefix: TextPath, skip: frozenset[str] = frozenset()) -> list[tuple[TextPath, str]]:
    """The strings in a JSON value (dicts, lists, strings), object keys among them (their paths
    end in :data:`KEY`), with their paths below ``prefix``, but inline data (``DATA_FIELDS``);
    ``skip``: keys of the top-level dict not followed."""
    out: list[tuple[TextPath, str]] = []
    limit = len(prefix) + MAX_LEAF_DEPTH  # containers this deep are not followed
    stack: list[tuple[TextPath, Any]]
    if type(value) is dict:
        stack = []
        for k, x in reversed(value.items()):
            if k in skip:
                continue
            if type(x) in _NESTED:
                stack.append(((*prefix, k), x))
            stack.append(((*prefix, k, KEY), k))
    else:
        stack = [(prefix, value)]
    pop, push = stack.pop, stack.append
    while stack:
        path, v = pop()
        t = type(v)
        if t is str:
            if not (path and _is_data(path[-1], v)):  # (a key's path ends in KEY: never data)
                out.append((path, v))
        elif len(path) >= limit:
            continue
        elif t is dict:
            for k, x in reversed(v.items()):
                if type(x) in _NESTED:
                    push(((*path, k), x))
                push(((*path, k, KEY), k))
        elif t is list:
            for i in range(len(v) - 1, -1, -1):
                x = v[i]
                if type(x) in _NESTED:
                    push(((*path, i), x))
    return out


_NESTED = (str, dict, list)


def set_leaves(value: Any, edits: Sequence[tuple[TextPath, str]]) -> Any:
    """A copy of the JSON ``value`` with the string at each path of ``edits`` replaced. Only the
    containers on the paths are copied, each once whatever the number of edits below it (linear
    in the edits; no recursion, whatever the depth); everything else is shared."""
    if any(not path for path, _ in edits):
        return edits[-1][1]  # the value itself is the string
    copied: set[int] = set()  # ids of the containers this call made

    def own(x: Any) -> Any:
        c = dict(x) if type(x) is dict else list(x)
        copied.add(id(c))
        return c

    out = own(value)
    for path, text in edits:
        node = out
        for key in path[:-1]:
            child = node[key]
            if id(child) not in copied:
                child = node[key] = own(child)
            node = child
        node[path[-1]] = text
    return out


def _part_texts(parts: Sequence[Any], prefix: TextPath) -> list[tuple[TextPath, str]]:
    out: list[tuple[TextPath, str]] = []
    for i, part in enumerate(parts):
        if isinstance(part, Refusal):
            out.append(((*prefix, i, "refusal"), part.refusal))
            continue
        for field in _PART_FIELDS:
            text = getattr(part, field, None)
            if isinstance(text, str) and not _is_data(field, text):
                out.append(((*prefix, i, field), text))
        notes = getattr(part, "annotations", None)
        if notes:  # citations: their urls and titles are stored and echoed
            out += string_leaves(notes, (*prefix, i, "annotations"))
    return out


#: Content part fields a model reads as text: the text, and the URLs it is given (an image's or a
#: file's, unless inline data).
_PART_FIELDS = ("text", "image_url", "file_url", "file_data", "filename")


def item_texts(item: Item) -> list[tuple[TextPath, str]]:
    """The text fields of ``item`` a model reads, with their paths: message text parts (or a
    string content) and image and file URLs, function call names, call ids and arguments,
    function call outputs, reasoning summaries and texts, and every string of an unmodelled item
    but its ``OTHER_SKIP_KEYS``. Inline images and files (``data:`` URLs) and audio are not text
    and are not returned."""
    if isinstance(item, Message):
        texts: list[tuple[TextPath, str]] = (
            [(("content",), item.content)] if isinstance(item.content, str) else _part_texts(item.content, ("content",))
        )
        if item.phase:  # (Codex's) stored and echoed
            texts.append((("phase",), item.phase))
        return texts
    if isinstance(item, FunctionCall):
        return [(("name",), item.name), (("call_id",), item.call_id), (("arguments",), item.arguments)]
    if isinstance(item, FunctionCallOutput):
        out: list[tuple[TextPath, str]] = [(("call_id",), item.call_id)]
        if isinstance(item.output, str):
            return out + [(("output",), item.output)]
        return out + _part_texts(item.output, ("output",))
    if isinstance(item, Reasoning):
        out = _part_texts(item.summary, ("summary",))
        if item.content:
            out += _part_texts(item.content, ("content",))
        if item.encrypted_content:  # opaque to the model, but stored and echoed
            out.append((("encrypted_content",), item.encrypted_content))
        return out
    if isinstance(item, OtherItem):
        return string_leaves(item.data, (), OTHER_SKIP_KEYS)
    return []


# Object keys that may name a secret their value holds (:meth:`SecretsClassifier._leaf_spans`):
# the words of the scanner's keyword kinds (generic_secret, authorization_header,
# aws_secret_access_key); a key of more characters is not looked at with its value.
_PAIR_KEY = re.compile(r"(?i)pass|pwd|secret|token|key|auth")
MAX_PAIR_KEY_CHARS = 64


# The kinds whose value the scanner ends at the first character its class does not hold (a
# password's "$", ".", "(" or "ñ"), and :func:`whole_values` takes on to the value's real end.
_OPEN_VALUE_KINDS = frozenset({"generic_secret"})
_VALUE_END = re.compile(r"""[\s"'`,;<>\\]""")
MAX_VALUE_TAIL_CHARS = 128


def whole_values(text: str, spans: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """``spans`` with each password-like value (``_OPEN_VALUE_KINDS``) taken on to the next
    white space, quote, comma, semicolon, angle bracket or backslash (at most
    ``MAX_VALUE_TAIL_CHARS`` more): the scanner's value class stops at the first character it
    does not hold, and ``DB_PASSWORD=Kx9mQ2vL7pZ4$wR8tY`` was redacted to ``...]$wR8tY``, its
    tail kept. Never into the next span."""
    if not spans or all(kind not in _OPEN_VALUE_KINDS for kind, _, _ in spans):
        return spans
    out: list[tuple[str, int, int]] = []
    for i, (kind, s, e) in enumerate(spans):
        if kind in _OPEN_VALUE_KINDS:
            limit = min(len(text), e + MAX_VALUE_TAIL_CHARS, spans[i + 1][1] if i + 1 < len(spans) else len(text))
            m = _VALUE_END.search(text, e, limit)
            e = m.start() if m is not None else limit
        out.append((kind, s, e))
    return out


def _joined_runs(item: Item) -> list[list[tuple[TextPath, str]]]:
    """The runs of two or more non-empty text parts of ``item`` a backend reads one after the
    other (:meth:`SecretsClassifier._seams`): a message's content parts, a function call
    output's parts, a reasoning item's content parts; images and files between them do not
    separate them (the assistant's and the tool's images go after the text). Reasoning summary
    parts are read one a line, and are not joined."""
    parts: Any
    if isinstance(item, Message):
        parts, field = item.content, "content"
    elif isinstance(item, FunctionCallOutput):
        parts, field = item.output, "output"
    elif isinstance(item, Reasoning):
        parts, field = item.content or [], "content"
    else:
        return []
    if isinstance(parts, str) or len(parts) < 2:
        return []
    run: list[tuple[TextPath, str]] = []
    for i, part in enumerate(parts):
        attr = "refusal" if isinstance(part, Refusal) else "text"
        text = getattr(part, attr, None)
        if isinstance(text, str) and text:
            run.append(((field, i, attr), text))
    return [run] if len(run) >= 2 else []


def _seam_edits(
    item: Item,
    edits: list[tuple[TextPath, str]],
    leaf_spans: dict[TextPath, list[tuple[str, int, int]]],
    seams: list[tuple[TextPath, str, int, int, str]],
) -> list[tuple[TextPath, str]]:
    """``edits`` with the parts a crossing secret touches redacted again from their own text:
    their own findings and their share of the crossing ones, overlapping spans merged."""
    by_path: dict[TextPath, list[tuple[int, int, str]]] = {}
    for path, kind, lo, hi, marker in seams:
        by_path.setdefault(path, []).append((lo, hi, marker))
    texts = dict(_joined_runs(item)[0])
    out = [(path, text) for path, text in edits if path not in by_path]
    for path, cuts in by_path.items():
        cuts += [(s, e, f"[REDACTED:{kind}]") for kind, s, e in leaf_spans.get(path, ())]
        cuts.sort(key=lambda c: (c[0], c[2] == ""))  # at one start, a marker before a cut without one
        out.append((path, splice(texts[path], cuts)))
    return out


def with_texts(item: Any, edits: Sequence[tuple[TextPath, str]]) -> Any:
    """A copy of ``item`` with the text at each path of ``edits`` replaced (structs are immutable
    values), built once: each list of parts is copied once, whatever the number of edits. An
    output text whose text is replaced loses its ``logprobs`` (they spell the old text)."""
    if isinstance(item, OtherItem):
        return msgspec.structs.replace(item, data=set_leaves(item.data, edits))
    changes: dict[str, Any] = {}
    nested: dict[tuple[str, int, str], list[tuple[TextPath, str]]] = {}  # a part's JSON field (annotations)
    for path, text in edits:
        field = path[0]
        assert isinstance(field, str)
        if len(path) == 1:
            changes[field] = text
            continue
        parts = changes.get(field)
        if parts is None:
            parts = changes[field] = list(getattr(item, field))
        index, attr = path[1], path[2]
        assert isinstance(index, int) and isinstance(attr, str)
        if len(path) > 3:
            nested.setdefault((field, index, attr), []).append((path[3:], text))
            continue
        part = parts[index]
        if attr == "text" and getattr(part, "logprobs", None):
            # an output text's logprobs spell its text token by token (and byte by byte): they
            # would keep what was redacted, and no longer describe the text
            parts[index] = msgspec.structs.replace(part, text=text, logprobs=[])
        else:
            parts[index] = msgspec.structs.replace(part, **{attr: text})
    for (field, index, attr), below in nested.items():
        parts = changes[field]
        parts[index] = msgspec.structs.replace(parts[index], **{attr: set_leaves(getattr(parts[index], attr), below)})
    return msgspec.structs.replace(item, **changes)


# -- the request's own texts -------------------------------------------------------------------

#: Finding.item_index of a text that is not an input item (``instructions``, a tool, the output
#: format); its path then starts at the request's root (``("tools", 2, "description")``).
SETTINGS = -1

#: Request fields that name the caller or a cache, sent to the backend and stored: scanned, and
#: under ``redact`` dropped rather than marked (one marker would put every redacted caller in one
#: bucket).
IDENTIFIERS = ("user", "safety_identifier", "prompt_cache_key")


_TYPE = frozenset(("type",))


def other_settings_texts(req: Any) -> list[tuple[TextPath, str]]:
    """The request's own texts but its instructions and tools (which have caches of their own,
    :meth:`SecretsClassifier.classify_settings`), with their paths from the request's root: the
    strings of a ``tool_choice`` object and the ``text.format`` name, description and schema (the
    model reads them), ``metadata`` values and the :data:`IDENTIFIERS` (stored or forwarded)."""
    out: list[tuple[TextPath, str]] = []
    if type(req.tool_choice) is dict:
        out += string_leaves(req.tool_choice, ("tool_choice",), _TYPE)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        for field in ("name", "description"):
            if value := getattr(fmt, field):
                out.append((("text", "format", field), value))
        if fmt.schema is not None:
            out += string_leaves(fmt.schema, ("text", "format", "schema"))
    if req.metadata:
        out += string_leaves(req.metadata, ("metadata",))
    for field in IDENTIFIERS:
        if value := getattr(req, field):
            out.append(((field,), value))
    return out


def _is_name(path: TextPath) -> bool:
    """Whether a settings path is a name the request's parts refer to each other by: a tool's,
    the output format's, or one in a ``tool_choice`` object."""
    return path[-1] == KEY or path[-1] == "name" and (len(path) == 3 and path[0] in ("tools", "text") or path[0] == "tool_choice")


def tools_texts(tools: Sequence[dict[str, Any]]) -> list[tuple[TextPath, str]]:
    """Every string of every tool but its ``type``, with its path (``("tools", 2, "description")``)."""
    out: list[tuple[TextPath, str]] = []
    for i, tool in enumerate(tools):
        out += string_leaves(tool, ("tools", i), _TYPE)
    return out


def redact_settings(p: Prepared, texts: dict[TextPath, str]) -> Prepared:
    """A copy of ``p`` with the settings texts at the paths of ``texts`` replaced (identifiers
    dropped; the tools copied and checked again; the originals, which a cache may share, are
    untouched)."""
    req = p.req
    groups: dict[Any, list[tuple[TextPath, str]]] = {}  # what is rebuilt -> its edits below it
    for path, text in texts.items():
        head = path[0]
        key: Any
        if head == "tools":  # ("tools", i, ...): that tool
            key, rest = (head, path[1]), path[2:]
        elif head == "text":  # ("text", "format", field, ...): that field of the format
            key, rest = (head, path[2]), path[3:]
        else:
            key, rest = head, path[1:]
        groups.setdefault(key, []).append((rest, text))
    changes: dict[str, Any] = {}
    prepared: dict[str, Any] = {}
    tools = list(p.tools)
    fmt = req.text.format if req.text is not None else None
    for key, edits in groups.items():
        if key == "instructions":
            changes["instructions"] = edits[0][1]
        elif key in IDENTIFIERS:
            changes[key] = None
        elif key == "metadata":
            changes["metadata"] = set_leaves(req.metadata, edits)
        elif key == "tool_choice":
            changes["tool_choice"] = set_leaves(req.tool_choice, edits)
            if type(p.tool_choice) is dict:
                prepared["tool_choice"] = set_leaves(p.tool_choice, edits)
        elif key[0] == "tools":
            tools[key[1]] = set_leaves(tools[key[1]], edits)
            prepared["tools"] = changes["tools"] = tools
        else:  # ("text", field): the output format's
            assert fmt is not None
            fmt = msgspec.structs.replace(fmt, **{key[1]: set_leaves(getattr(fmt, key[1]), edits)})
            assert req.text is not None
            changes["text"] = msgspec.structs.replace(req.text, format=fmt)
    if "tools" in prepared:
        prepared["function_tools"] = check_tools(tools)
    return msgspec.structs.replace(p, req=msgspec.structs.replace(req, **changes), **prepared)


# -- secrets -----------------------------------------------------------------------------------

SecretsPolicy = Literal["off", "flag", "redact", "block"]
POLICIES: tuple[str, ...] = ("off", "flag", "redact", "block")


#: The settings-scan cache (SecretsClassifier.classify_settings): texts shorter than this are
#: scanned every time (it costs less than looking them up); at most this many texts and chars.
SETTINGS_CACHE_MIN_CHARS = 2048
SETTINGS_CACHE_ENTRIES = 64
SETTINGS_CACHE_CHARS = 16 * 1024 * 1024


#: The default key of :func:`call_id_marker`'s keyed hash, for a classifier built without a
#: store's (tests, tools): random, one per process (:data:`hotloop.state.fpkey.CALL_ID_PROCESS_KEY`,
#: the memory store's too). The server's classifier uses its store's ``call_id_key`` instead,
#: shared by every process opening the store and kept with it. Never logged or served.
_CALL_ID_KEY = fpkey.CALL_ID_PROCESS_KEY

#: Hex characters of the keyed hash in a call id's marker (48 bits).
CALL_ID_TAG_CHARS = 12

#: The path of a call id in an item (:func:`item_texts`): a function call's and its output's, and
#: the top-level ``call_id`` of an item kept verbatim (``custom_tool_call``, ``local_shell_call``...).
CALL_ID: TextPath = ("call_id",)


def call_id_marker(kind: str, secret: str, key: bytes | None = None) -> str:
    """What replaces ``secret`` (a ``kind``) inside a call id under ``redact``:
    ``[REDACTED:<kind>:<tag>]``, ``tag`` the first :data:`CALL_ID_TAG_CHARS` hex characters of an
    HMAC-SHA256 of the secret under ``key`` (the store's ``call_id_key``; None: this process's
    :data:`_CALL_ID_KEY`). A call id names its call: with the text marker two calls holding two
    different secrets of one kind would get one id (the backend would see duplicate tool call ids
    and could not tell their outputs apart), so here distinct secrets get distinct markers and the
    same secret always the same one under one key (a call and its output keep pairing, across
    turns, stored responses, restarts, workers and replicas of one store). Keyed, so the marker
    does not let anyone confirm a guessed secret."""
    mac = hmac.new(_CALL_ID_KEY if key is None else key, secret.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return f"[REDACTED:{kind}:{mac.hexdigest()[:CALL_ID_TAG_CHARS]}]"


def redact_call_id(text: str, spans: Sequence[tuple[str, int, int]], key: bytes | None = None) -> str:
    """``text`` (a call id) with each of ``spans`` (``str`` indices, sorted, non-overlapping)
    replaced by its :func:`call_id_marker` under ``key``."""
    parts: list[str] = []
    at = 0
    for kind, s, e in spans:
        parts.append(text[at:s])
        parts.append(call_id_marker(kind, text[s:e], key))
        at = e
    parts.append(text[at:])
    return "".join(parts)


@functools.cache
def default_secret_scanner() -> Any:
    """The process-wide scanner over ``SECRET_PATTERNS`` (compiled once, thread-safe)."""
    return _accel.SecretScanner(_accel.SECRET_PATTERNS)


class SecretsState(msgspec.Struct, frozen=True):
    """What the secrets classifier remembers about a chain: the kinds seen so far and how many
    spans were found in all its turns."""

    kinds_seen: frozenset[str] = frozenset()
    findings: int = 0


class SecretsClassifier:
    """Scans the new items' texts (:func:`item_texts`) for credentials.

    Policies: ``off`` (no scan, always :data:`ALLOW`), ``flag`` (:class:`Flag` with labels
    ``secret:<kind>``), ``redact`` (:class:`Redact`: items with ``[REDACTED:<kind>]`` in place of
    each secret, in a call id :func:`call_id_marker`'s ``[REDACTED:<kind>:<tag>]``, distinct per
    secret) and ``block`` (:class:`Block`). A text with more secrets than the scanner's
    ``max_matches`` cannot be redacted completely, so ``redact`` blocks it instead.

    ``call_id_key``: the key of the call id markers' tags, the server's store's ``call_id_key``
    (the same in every process that opens the store, kept with it); None: this process's
    (:data:`_CALL_ID_KEY`). At least 16 bytes.
    """

    name = "secrets"
    state_type = SecretsState

    def __init__(self, policy: SecretsPolicy = "flag", scanner: Any = None, *, call_id_key: bytes | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"secrets policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if call_id_key is not None and (not isinstance(call_id_key, bytes) or len(call_id_key) < 16):
            raise ValueError("the call id key must be at least 16 bytes")  # never says what it was
        self.policy: SecretsPolicy = policy
        self.scanner = default_secret_scanner() if scanner is None else scanner
        self._call_id_key = _CALL_ID_KEY if call_id_key is None else call_id_key
        # What the request's own texts (classify_settings) were found to hold, so that a client
        # sending the same instructions and tools every turn has them scanned once:
        # long instructions by value (LRU, at most SETTINGS_CACHE_ENTRIES texts and
        # SETTINGS_CACHE_CHARS characters), shared tools arrays (CheckedTools, which the tools
        # cache keeps) by identity, for as long as they live. Scans may run in the tokenizer
        # thread, hence the lock.
        self._texts: OrderedDict[tuple[str, str], list[tuple[str, int, int]]] = OrderedDict()
        self._text_chars = 0
        self._tools: weakref.WeakKeyDictionary[CheckedTools, list[tuple[TextPath, list[tuple[str, int, int]]]]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def initial_state(self) -> SecretsState:
        return SecretsState()

    def classify(
        self, items: Sequence[Item], state: SecretsState
    ) -> tuple[Verdict, SecretsState]:
        if self.policy == "off":
            return ALLOW, state
        redacting = self.policy == "redact"
        cap = self.scanner.max_matches
        findings: list[Finding] = []
        new_items: list[Item] = list(items)
        capped = False
        key: Finding | None = None  # a finding in an object's key, which cannot be redacted
        for index, item in enumerate(items):
            edits: list[tuple[TextPath, str]] = []
            leaf_spans: dict[TextPath, list[tuple[str, int, int]]] = {}
            for path, text in item_texts(item):
                if not text:
                    continue
                spans = self._leaf_spans(path, text)
                if not spans:
                    continue
                capped = capped or len(spans) >= cap
                findings.extend(Finding(index, path, kind, s, e) for kind, s, e in spans)
                if path[-1] == KEY:
                    key = key or findings[-1]
                else:
                    leaf_spans[path] = spans
                    if redacting:  # a call id: one marker per secret (two calls keep two ids)
                        edits.append((path, redact_call_id(text, spans, self._call_id_key) if path == CALL_ID else redact_spans(text, spans)))
            seams = self._seams(item, leaf_spans)
            if seams:
                capped = capped or seams[0]
                # one finding a secret (in the part it starts in), however many parts it spans
                findings.extend(Finding(index, path, kind, s, e) for path, kind, s, e, marker in seams[1] if marker)
                if redacting:
                    edits = _seam_edits(item, edits, leaf_spans, seams[1])
            if edits:
                new_items[index] = with_texts(item, edits)
        if not findings:
            return ALLOW, state
        kinds = sorted({f.kind for f in findings})
        labels = tuple(f"secret:{k}" for k in kinds)
        state = SecretsState(
            kinds_seen=state.kinds_seen | frozenset(kinds),
            findings=state.findings + len(findings),
        )
        if self.policy == "flag":
            return Flag(labels=labels, findings=tuple(findings)), state
        if self.policy == "redact" and key is not None:
            reason = self._reason(kinds, False, " in a field name, which cannot be redacted")
            return Block(reason=reason, labels=labels, code="secret_detected", findings=(key,)), state
        if self.policy == "redact" and not capped:
            return Redact(labels=labels, findings=tuple(findings), items=tuple(new_items)), state
        return Block(reason=self._reason(kinds, capped), labels=labels, code="secret_detected", findings=tuple(findings[:1])), state

    def _seams(
        self, item: Item, found: dict[TextPath, list[tuple[str, int, int]]]
    ) -> tuple[bool, list[tuple[TextPath, str, int, int, str]]] | None:
        """The secrets that cross from one text part of ``item`` into the next: a backend reads
        an assistant message's, a function call output's and a reasoning item's parts joined
        with nothing between them (and a user message's one after the other), so a key split
        across two parts (a tool output streamed in pieces) reaches the model whole although no
        part holds it. Each crossing secret as one span per part it touches (the part's path,
        the kind, the span in that part, and the text its redaction puts there: the marker in
        the first part, nothing in the others); None when none crosses. Also a secret that lies
        in one part but that part's own scan could not find (its keyword ends the part before:
        ``["DB_PASSWORD=", "Kx9m..."]``). A match that begins inside a secret its first part's
        own scan ``found`` is not one (that secret is redacted there, and a token followed by a
        part that starts with letters keeps those letters), unless it is a password value
        (``_OPEN_VALUE_KINDS``) that runs to its part's end: its rest in the next part is cut too.
        With whether the joined scan hit the scanner's ``max_matches``."""
        runs = _joined_runs(item)
        if not runs:
            return None
        out: list[tuple[TextPath, str, int, int, str]] = []
        capped = False
        for run in runs:
            joined = "".join(text for _, text in run)
            spans = self.scanner.scan(joined)
            if not spans:
                continue
            capped = capped or len(spans) >= self.scanner.max_matches
            spans = whole_values(joined, spans)
            starts: list[int] = []
            at = 0
            for _, text in run:
                starts.append(at)
                at += len(text)
            for kind, s, e in spans:
                first = bisect.bisect_right(starts, s) - 1
                last = bisect.bisect_left(starts, e) - 1
                own = found.get(run[first][0], ())
                lo, hi = s - starts[first], e - starts[first]
                if first == last:
                    if not any(a < hi and lo < b for _, a, b in own):  # its keyword is in a part before
                        out.append((run[first][0], kind, lo, hi, f"[REDACTED:{kind}]"))
                    continue
                end = len(run[first][1])
                inside = [b for _, a, b in own if a <= lo < b]
                if inside and not (kind in _OPEN_VALUE_KINDS and max(inside) == end):
                    continue
                # (a value its part's own scan found runs on: that finding and its marker stand,
                # and the rest is cut from the parts after it)
                marker = "" if inside else f"[REDACTED:{kind}]"
                for j in range(first, last + 1):
                    path, text = run[j]
                    lo, hi = max(s - starts[j], 0), min(e - starts[j], len(text))
                    out.append((path, kind, lo, hi, marker if j == first else ""))
        return (capped, out) if out else None

    def _reason(self, kinds: Sequence[str], capped: bool, where: str = "") -> str:
        if capped and self.policy == "redact":
            return "The input contains too many credentials to redact (" + ", ".join(kinds) + ")."
        return "The input contains credentials (" + ", ".join(kinds) + ")" + where + "."

    # -- the request's own texts ---------------------------------------------------------------

    def classify_settings(self, p: Prepared, owner: str = "") -> tuple[Verdict, Prepared]:
        """The verdict on the request's own texts (instructions, :func:`tools_texts`,
        :func:`other_settings_texts`), which come with every request rather than once per chain,
        so they count in this turn's flags but not in the chain's state. ``redact`` returns a
        copy of ``p`` with those texts redacted (what the backend reads, and what the response
        echoes and stores; identifiers dropped); findings have ``item_index`` :data:`SETTINGS`
        and paths from the request's root (``tools[2].parameters.properties.path.description``)."""
        if self.policy == "off":
            return ALLOW, p
        found: list[tuple[TextPath, str, list[tuple[str, int, int]]]] = []
        req = p.req
        if req.instructions:
            spans = whole_values(req.instructions, self._scan_text(req.instructions, owner))
            if spans:
                found.append((("instructions",), req.instructions, spans))
        if p.tools:
            found += self._scan_tools(p.tools)
        for path, text in other_settings_texts(req):
            spans = self._leaf_spans(path, text)
            if spans:
                found.append((path, text, spans))
        if not found:
            return ALLOW, p
        findings = tuple(Finding(SETTINGS, path, kind, s, e) for path, _, spans in found for kind, s, e in spans)
        kinds = sorted({f.kind for f in findings})
        labels = tuple(f"secret:{k}" for k in kinds)
        capped = any(len(spans) >= self.scanner.max_matches for _, _, spans in found)
        if self.policy == "flag":
            return Flag(labels=labels, findings=findings), p
        names = [f for f in findings if _is_name(f.path)]
        if self.policy == "redact" and names:
            # a function or format name that is redacted no longer names what it named (nor
            # passes the name check): refused instead, naming it
            reason = self._reason(kinds, False, " in a name, which cannot be redacted")
            return Block(reason=reason, labels=labels, code="secret_detected", findings=(names[0],)), p
        if self.policy == "redact" and not capped:
            texts = {path: redact_spans(text, spans) for path, text, spans in found}
            return Redact(labels=labels, findings=findings, items=()), redact_settings(p, texts)
        return Block(reason=self._reason(kinds, capped), labels=labels, code="secret_detected", findings=findings[:1]), p

    def settings_chars(self, p: Prepared, limit: int, owner: str = "") -> int:
        """Characters of the request's own texts that :meth:`classify_settings` would scan now
        (those its caches do not hold), counted until ``limit`` is reached: enough to decide
        whether the scan runs off the event loop. Cheap: cache look-ups and lengths."""
        if self.policy == "off":
            return 0
        n = 0
        text = p.req.instructions
        if text:
            if len(text) < SETTINGS_CACHE_MIN_CHARS or len(text) > SETTINGS_CACHE_CHARS // 4:
                n += len(text)  # never cached: scanned every time
            else:
                with self._lock:
                    if (owner, text) not in self._texts:
                        n += len(text)
        if n < limit and p.tools:
            shared = checked_tools(p.tools)
            if shared is None:  # their JSON, encoded in C: at least their texts
                n += len(msgspec.json.encode(p.tools))
            else:
                with self._lock:
                    cached = shared in self._tools
                if not cached:
                    n += len(shared.json)  # its JSON: at least its texts
        if n < limit:
            n += sum(len(t) for _, t in other_settings_texts(p.req))
        return n

    def _scan_text(self, text: str, owner: str = "") -> list[tuple[str, int, int]]:
        # Kept per owner (the caller's key), as token counts are: a key must not learn, from how
        # fast its request is, whether another key sent the same instructions.
        if len(text) < SETTINGS_CACHE_MIN_CHARS:
            return self.scanner.scan(text)  # type: ignore[no-any-return]
        key = (owner, text)
        with self._lock:
            spans = self._texts.get(key)
            if spans is not None:
                self._texts.move_to_end(key)
                return spans
        spans = self.scanner.scan(text)
        if len(text) <= SETTINGS_CACHE_CHARS // 4:
            with self._lock:
                if key not in self._texts:
                    self._texts[key] = spans
                    self._text_chars += len(text)
                    while len(self._texts) > SETTINGS_CACHE_ENTRIES or self._text_chars > SETTINGS_CACHE_CHARS:
                        (_, old), _ = self._texts.popitem(last=False)
                        self._text_chars -= len(old)
        return spans

    def _scan_tools(self, tools: list[dict[str, Any]]) -> list[tuple[TextPath, str, list[tuple[str, int, int]]]]:
        shared = checked_tools(tools)
        if shared is not None:
            with self._lock:
                hits = self._tools.get(shared)
            if hits is None:
                hits = [(path, spans) for path, text in tools_texts(tools) if (spans := self._leaf_spans(path, text))]
                with self._lock:
                    self._tools[shared] = hits
            texts = dict(tools_texts(tools)) if hits else {}
            return [(path, texts[path], spans) for path, spans in hits]
        return [(path, text, spans) for path, text in tools_texts(tools) if (spans := self._leaf_spans(path, text))]

    def _leaf_spans(self, path: TextPath, text: str) -> list[tuple[str, int, int]]:
        """The secrets of one text at ``path``: the scanner's, and, for a string under an object
        key that may name one (``{"password": "..."}``, ``{"Authorization": "Bearer ..."}``, an
        MCP tool's headers, ``metadata``, an ``env``), those the key and the value say together
        (``key: value``), in the value: a keyword kind needs both, and each was scanned alone.
        Sorted, overlapping spans merged."""
        spans: list[tuple[str, int, int]] = whole_values(text, self.scanner.scan(text))
        key = path[-1] if path else None
        if type(key) is not str or len(key) > MAX_PAIR_KEY_CHARS or _PAIR_KEY.search(key) is None:
            return spans
        joined, off = f"{key}: {text}", len(key) + 2
        named = [(kind, max(s - off, 0), e - off) for kind, s, e in whole_values(joined, self.scanner.scan(joined)) if e > off]
        if not named:
            return spans
        merged: list[tuple[str, int, int]] = []
        for kind, s, e in sorted(spans + named, key=lambda x: (x[1], -x[2])):
            if merged and s < merged[-1][2]:
                last = merged[-1]
                merged[-1] = (last[0], last[1], max(last[2], e))
            else:
                merged.append((kind, s, e))
        return merged
