"""Running the configured classifiers over a turn's new items, and their per-chain states.

The server holds an ordered list of classifiers (:func:`build`: the built-in
:class:`~hotloop.pipeline.classify.SecretsClassifier` under its policy, then the user's
``--classifier module:attr`` ones). For each turn :func:`classify_turn` runs them over the
request's *new* items only, each with the state its previous turn on the same chain left, and
returns the items to use (redacted where a classifier redacted; the next classifier sees the
redacted ones), every classifier's next state and the verdicts worth recording. A
:class:`~hotloop.pipeline.classify.Block` stops the turn (:func:`blocked_error`).

States travel with the chain as a ``{classifier name: state}`` dict on the cached response, like
token counts, so a continuation never re-scans its history. Stored responses keep them as JSON
(:func:`freeze`: ``msgspec.to_builtins`` of each state, at most ``MAX_STATE_BYTES`` encoded per
classifier; a state that cannot be encoded or is larger is not stored and that classifier
restarts from its ``initial_state`` after a reload, with a warning). A reloaded state stays JSON
(:class:`Frozen`) until its classifier next runs, which converts it with its ``state_type``
(any type ``msgspec.convert`` accepts) when it has one, else receives the JSON value as is.
States of classifiers no longer configured are carried along unchanged.
"""

from __future__ import annotations

import importlib
import logging
import traceback
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from hotloop import errors
from hotloop.pipeline.classify import (
    ALLOW,
    KEY,
    SETTINGS,
    Allow,
    Block,
    Classifier,
    Finding,
    Flag,
    Redact,
    SecretsClassifier,
    TextPath,
    Verdict,
)
from hotloop.protocol.request import (
    FunctionCall, FunctionCallOutput, Item, ItemReference, Message, OtherItem, Reasoning, json_weight,
)

log = logging.getLogger("hotloop.classify")

__all__ = [
    "ClassifierFailed",
    "ClassifierLoadError",
    "Frozen",
    "InputBlocked",
    "MAX_STATE_BYTES",
    "Outcome",
    "blocked_error",
    "build",
    "classify_turn",
    "freeze",
    "load",
    "text_chars",
    "thaw",
]

MAX_STATE_BYTES = 64 * 1024  # one classifier's stored state (JSON); larger is not stored
MAX_TALLY_KINDS = 64  # distinct finding kinds one turn records in the ledger (the rest: "other")

_enc = msgspec.json.Encoder()


class InputBlocked(errors.InvalidRequest):
    """A classifier refused the turn's input (400; ``code`` from the :class:`Block`)."""

    code: str | None = "input_blocked"


class ClassifierFailed(errors.HotloopError):
    """A classifier raised, or returned something other than ``(verdict, state)`` with a
    well-formed verdict: the turn is refused, not sent unclassified (a safety check that fails
    must not let what it was to stop through), with a 500 ``server_error`` (code
    ``classifier_error``) naming the classifier only; the log line says what went wrong. Like a
    block it leaves the chain as it was (the engine keeps the parent cached:
    ``engine._KEEPS_PARENT``), so the client can send the turn again."""

    status = 500
    type = "server_error"
    code: str | None = "classifier_error"

    def __init__(self, name: str) -> None:
        super().__init__(f"The input could not be classified (classifier {name} failed); it was not sent to the model.")


class ClassifierLoadError(ValueError):
    """A ``--classifier`` spec that cannot be loaded (the server does not start)."""


def load(spec: str) -> Classifier[Any]:
    """The classifier named by ``module:attr``: the attribute itself when it is a classifier (has
    ``name``, ``initial_state`` and ``classify``), else the result of calling it with no
    arguments."""
    module_name, sep, attr = spec.strip().partition(":")
    if not sep or not module_name or not attr:
        raise ClassifierLoadError(f"classifier {spec!r}: expected module:attr, e.g. mypkg.checks:classifier")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ClassifierLoadError(f"classifier {spec!r}: cannot import {module_name!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ClassifierLoadError(f"classifier {spec!r}: {module_name!r} has no attribute {attr!r}") from None
    if not _is_classifier(obj):
        if not callable(obj):
            raise ClassifierLoadError(
                f"classifier {spec!r}: {attr!r} is neither a classifier (name, initial_state, classify) nor a factory"
            )
        try:
            obj = obj()
        except Exception as exc:
            raise ClassifierLoadError(f"classifier {spec!r}: calling {attr}() failed: {exc}") from None
        if not _is_classifier(obj):
            raise ClassifierLoadError(
                f"classifier {spec!r}: {attr}() returned {type(obj).__name__}, not a classifier "
                "(name, initial_state, classify)"
            )
    return obj  # type: ignore[no-any-return]


def _is_classifier(obj: Any) -> bool:
    return (
        not isinstance(obj, type)
        and isinstance(getattr(obj, "name", None), str)
        and callable(getattr(obj, "initial_state", None))
        and callable(getattr(obj, "classify", None))
    )


def build(secrets: str, specs: Sequence[str] = (), *, call_id_key: bytes | None = None) -> list[Classifier[Any]]:
    """The server's classifiers: the secrets classifier unless its policy is ``off``, then each
    ``module:attr`` of ``specs`` in order. Names must be unique (they key the chain states).
    ``call_id_key``: the key of the secrets classifier's call id markers (the store's
    ``call_id_key``; None: this process's)."""
    out: list[Classifier[Any]] = []
    try:
        if secrets != "off":
            out.append(SecretsClassifier(secrets, call_id_key=call_id_key))  # type: ignore[arg-type]
    except ValueError as exc:
        raise ClassifierLoadError(str(exc)) from None
    for spec in specs:
        if spec.strip():
            out.append(load(spec))
    names = [c.name for c in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ClassifierLoadError(f"two classifiers are named {dup[0]!r}; names must be unique")
    return out


# -- states --------------------------------------------------------------------------------------


class Frozen(NamedTuple):
    """A state reloaded from the store, still JSON; converted when its classifier next runs."""

    value: Any


def thaw(classifier: Classifier[Any], state: Any) -> Any:
    """A chain's state for ``classifier`` as the classifier expects it."""
    if type(state) is not Frozen:
        return state
    state_type = getattr(classifier, "state_type", None)
    if state_type is None:
        return state.value
    try:
        return msgspec.convert(state.value, state_type)
    except (msgspec.ValidationError, TypeError) as exc:
        log.warning("stored state of classifier %s does not load (%s); starting it afresh", classifier.name, exc)
        return classifier.initial_state()


def freeze(states: dict[str, Any] | None) -> dict[str, Any] | None:
    """``states`` as JSON values for storage (``None`` when there are none)."""
    if not states:
        return None
    out: dict[str, Any] = {}
    for name, state in states.items():
        if type(state) is Frozen:
            out[name] = state.value
            continue
        try:
            value = msgspec.to_builtins(state, order="sorted")
            size = len(_enc.encode(value))
        except (TypeError, ValueError, OverflowError) as exc:
            log.warning("state of classifier %s is not JSON-encodable (%s); not stored", name, exc)
            continue
        if size > MAX_STATE_BYTES:
            log.warning("state of classifier %s has %d bytes (more than %d); not stored", name, size, MAX_STATE_BYTES)
            continue
        out[name] = value
    return out or None


def frozen(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """Stored JSON states as chain states (each :class:`Frozen` until used)."""
    if not raw:
        return None
    return {name: Frozen(value) for name, value in raw.items()}


# -- one turn ------------------------------------------------------------------------------------


class Outcome(NamedTuple):
    items: list[Item]  # the items to use (the originals unless a classifier redacted)
    states: dict[str, Any]  # every classifier's state after this turn (and carried-over ones)
    verdicts: list[tuple[str, Verdict]]  # (classifier name, verdict) for Flag and Redact verdicts
    block: tuple[str, Block] | None  # the first Block (the classifiers after it did not run)

    def tally(self) -> dict[str, int]:
        """What the ledger records for the turn: per finding kind the number of spans (a verdict
        without findings counts 1 per label); at most ``MAX_TALLY_KINDS`` kinds."""
        if not self.verdicts:
            return {}  # every turn without a finding (a Counter is a dozen Python calls)
        counts: Counter[str] = Counter()
        for _, v in self.verdicts:
            if isinstance(v, (Flag, Redact)):
                if v.findings:
                    counts.update(f.kind for f in v.findings)
                else:
                    counts.update(v.labels)
        if len(counts) > MAX_TALLY_KINDS:
            keep = dict(counts.most_common(MAX_TALLY_KINDS - 1))
            keep["other"] = sum(counts.values()) - sum(keep.values())
            return keep
        return dict(counts)


def classify_turn(
    classifiers: Sequence[Classifier[Any]], items: list[Item], states: dict[str, Any] | None
) -> Outcome:
    """Run ``classifiers`` in order over a turn's new ``items`` with the chain's ``states``.
    Raises :class:`ClassifierFailed` when a user classifier raises or returns a malformed result
    (logged, without the traceback: its type, message and innermost place)."""
    new_states = dict(states) if states else {}
    verdicts: list[tuple[str, Verdict]] = []
    for c in classifiers:
        state = new_states.get(c.name)
        if type(c) is SecretsClassifier:  # the built-in one: its results are well-formed
            verdict, state = c.classify(items, c.initial_state() if state is None else thaw(c, state))
        else:
            verdict, state = _run_user(c, items, state)
        new_states[c.name] = state
        t = type(verdict)
        if t is Block:
            return Outcome(items, new_states, verdicts, (c.name, verdict))  # type: ignore[arg-type]
        if t is Redact:
            items = list(verdict.items)  # type: ignore[union-attr]
        if t is Flag or t is Redact:
            verdicts.append((c.name, verdict))
    return Outcome(items, new_states, verdicts, None)


#: What a Redact verdict's items may be (hotloop.protocol.request.Item).
_ITEM_TYPES = (Message, FunctionCall, FunctionCallOutput, Reasoning, ItemReference, OtherItem)


def _run_user(c: Classifier[Any], items: list[Item], state: Any) -> tuple[Verdict, Any]:
    """``c.classify`` on ``items`` with the chain's ``state`` (None: none yet), its result checked;
    :class:`ClassifierFailed` when it raises or its result is malformed."""
    try:
        state = c.initial_state() if state is None else thaw(c, state)
        result = c.classify(items, state)
        problem = _malformed(result, len(items))
    except Exception as exc:  # noqa: BLE001  the operator's code: the turn is refused, the log says why
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ is not None else None
        at = f" at {where.filename}:{where.lineno}" if where is not None else ""
        log.error("classifier %s failed (%s: %s%s); the request is refused", c.name, type(exc).__name__,
                  errors.clip(str(exc), 200), at)
        raise ClassifierFailed(c.name) from None
    if problem:
        log.error("classifier %s failed (it returned %s); the request is refused", c.name, problem)
        raise ClassifierFailed(c.name)
    return result  # type: ignore[no-any-return]


def _malformed(result: Any, n: int) -> str:
    """What is wrong with a classifier's ``classify`` result for ``n`` items ("" when nothing)."""
    if type(result) not in (tuple, list) or len(result) != 2:
        return f"{type(result).__name__}, not a (verdict, state) tuple"
    v = result[0]
    if v is ALLOW or type(v) is Allow:
        return ""
    if type(v) not in (Flag, Redact, Block):
        return f"a verdict of type {type(v).__name__}, not Allow, Flag, Redact or Block"
    if type(v.labels) not in (tuple, list) or not all(type(x) is str for x in v.labels):
        return f"{type(v).__name__}.labels that are not a tuple of str"
    if type(v.findings) not in (tuple, list) or not all(type(f) is Finding for f in v.findings):
        return f"{type(v).__name__}.findings that are not a tuple of Finding"
    if type(v) is Block:
        if type(v.reason) is not str or not v.reason:
            return "a Block whose reason is not a non-empty str"
        if type(v.code) is not str or not v.code:
            return "a Block whose code is not a non-empty str"
    elif type(v) is Redact:
        if type(v.items) not in (tuple, list) or len(v.items) != n:
            return f"a Redact of {len(v.items) if type(v.items) in (tuple, list) else '?'} items for {n}"
        if not all(isinstance(it, _ITEM_TYPES) for it in v.items):
            return "a Redact whose items are not input items (hotloop.protocol.request.Item)"
    return ""


def text_chars(items: Sequence[Item], limit: int) -> int:
    """Characters of text in ``items``, counted until ``limit`` is reached (cheap: string
    contents and parts' ``text``; enough to decide whether a scan runs off the event loop)."""
    n = 0
    for it in items:
        if type(it) is OtherItem:
            # its strings at any depth (classify.item_texts), and its values: a walk of up to
            # ``limit`` of them (an item of many small values costs a scan what its text would)
            n += json_weight(it.data, limit - n)
        for field in ("content", "output", "arguments"):
            v = getattr(it, field, None)
            if type(v) is str:
                n += len(v)
            elif type(v) is list:
                for part in v:
                    t = getattr(part, "text", None)
                    if type(t) is str:
                        n += len(t)
        if n >= limit:
            break
    return n


def _param(path: TextPath, item_index: int, string_input: bool) -> str:
    if path and path[-1] == KEY:  # an object's key: the object (the key may be the secret)
        path = path[:-2]
    if item_index == SETTINGS:  # instructions, tools[i]..., text.format...
        out = str(path[0])
        path = path[1:]
    elif string_input:
        return "input"
    else:
        out = f"input[{item_index}]"
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def blocked_error(block: Block, string_input: bool = False) -> InputBlocked:
    """The 400 a blocked turn gets: ``block.code``, ``param`` at the first finding, and the
    classifier's ``reason`` (which names kinds, never the text)."""
    param = None
    if block.findings:
        f = block.findings[0]
        param = _param(f.path, f.item_index, string_input)
    return InputBlocked(block.reason, param=param, code=block.code)
