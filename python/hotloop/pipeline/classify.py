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
  ``[REDACTED:<kind>]``) instead of the originals; ``findings`` say where, per item text;
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

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeVar, Union

import msgspec

from hotloop import _accel
from hotloop.protocol.request import (
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    OtherItem,
    Reasoning,
    Refusal,
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

#: OtherItem data keys holding text a model reads (custom tool calls and their outputs).
OTHER_TEXT_KEYS = ("input", "output", "arguments", "text")


def _part_texts(parts: Sequence[Any], prefix: TextPath) -> list[tuple[TextPath, str]]:
    out: list[tuple[TextPath, str]] = []
    for i, part in enumerate(parts):
        if isinstance(part, Refusal):
            out.append(((*prefix, i, "refusal"), part.refusal))
        else:
            text = getattr(part, "text", None)
            if isinstance(text, str):
                out.append(((*prefix, i, "text"), text))
    return out


def item_texts(item: Item) -> list[tuple[TextPath, str]]:
    """The text fields of ``item`` a model reads, with their paths: message text parts (or a
    string content), function call arguments, function call outputs, reasoning summaries and
    texts, and the ``OTHER_TEXT_KEYS`` strings of unmodelled items. Images, files and audio are
    not text and are not returned."""
    if isinstance(item, Message):
        if isinstance(item.content, str):
            return [(("content",), item.content)]
        return _part_texts(item.content, ("content",))
    if isinstance(item, FunctionCall):
        return [(("arguments",), item.arguments)]
    if isinstance(item, FunctionCallOutput):
        if isinstance(item.output, str):
            return [(("output",), item.output)]
        return _part_texts(item.output, ("output",))
    if isinstance(item, Reasoning):
        out = _part_texts(item.summary, ("summary",))
        if item.content:
            out += _part_texts(item.content, ("content",))
        return out
    if isinstance(item, OtherItem):
        return [((k,), v) for k in OTHER_TEXT_KEYS if isinstance(v := item.data.get(k), str)]
    return []


def _replace_text(item: Any, path: TextPath, text: str) -> Any:
    """A copy of ``item`` with the text at ``path`` replaced (structs are immutable values)."""
    if isinstance(item, OtherItem):
        return msgspec.structs.replace(item, data={**item.data, path[0]: text})
    field = path[0]
    assert isinstance(field, str)
    if len(path) == 1:
        return msgspec.structs.replace(item, **{field: text})
    parts = list(getattr(item, field))
    index = path[1]
    assert isinstance(index, int)
    parts[index] = _replace_text(parts[index], path[2:], text)
    return msgspec.structs.replace(item, **{field: parts})


# -- secrets -----------------------------------------------------------------------------------

SecretsPolicy = Literal["off", "flag", "redact", "block"]
POLICIES: tuple[str, ...] = ("off", "flag", "redact", "block")


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
    each secret) and ``block`` (:class:`Block`). A text with more secrets than the scanner's
    ``max_matches`` cannot be redacted completely, so ``redact`` blocks it instead.
    """

    name = "secrets"
    state_type = SecretsState

    def __init__(self, policy: SecretsPolicy = "flag", scanner: Any = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"secrets policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy: SecretsPolicy = policy
        self.scanner = default_secret_scanner() if scanner is None else scanner

    def initial_state(self) -> SecretsState:
        return SecretsState()

    def classify(
        self, items: Sequence[Item], state: SecretsState
    ) -> tuple[Verdict, SecretsState]:
        if self.policy == "off":
            return ALLOW, state
        redacting = self.policy == "redact"
        run: Callable[[str], Any] = self.scanner.redact if redacting else self.scanner.scan
        cap = self.scanner.max_matches
        findings: list[Finding] = []
        new_items: list[Item] = list(items)
        capped = False
        for index, item in enumerate(items):
            for path, text in item_texts(item):
                if not text:
                    continue
                result = run(text)
                spans = result[1] if redacting else result
                if not spans:
                    continue
                capped = capped or len(spans) >= cap
                findings.extend(Finding(index, path, kind, s, e) for kind, s, e in spans)
                if redacting:
                    new_items[index] = _replace_text(new_items[index], path, result[0])
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
        if self.policy == "redact" and not capped:
            return Redact(labels=labels, findings=tuple(findings), items=tuple(new_items)), state
        reason = "The input contains credentials (" + ", ".join(kinds) + ")."
        if capped and self.policy == "redact":
            reason = "The input contains too many credentials to redact (" + ", ".join(kinds) + ")."
        return Block(reason=reason, labels=labels, code="secret_detected", findings=tuple(findings[:1])), state
