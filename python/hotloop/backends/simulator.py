"""The built-in simulator backend: a model that streams at a configured rate, for tests and benchmarks.

Token-accurate: output text is real o200k_base tokens (one delta per token), and the reported
usage counts them. Pacing uses absolute deadlines (``t0 + ttft + i / rate``): the generator sleeps
only when it is more than ``TICK`` (half a millisecond) ahead of schedule and emits every token
due before then at once, so there is no drift and no busy loop, and the simulator itself costs almost
nothing. uvloop's clock and timers count whole milliseconds and round a delay to the nearest one:
a sleep of half of one or less was a ``call_soon`` that found the token still not due, several
loop turns per token above 1,000 tokens/s. A token may thus come up to half a millisecond early, as a
model server's tokens arrive several to a read at such rates; at 1,000 tokens/s or less nothing
changes (each token is a millisecond or more after the one before).

What it answers is decided per request, in this order:

1. ``metadata["sim"]``: comma-separated directives (see :func:`parse_directives`), e.g.
   ``"reasoning,tools:2"``, ``"text,tokens:50"``, ``"fail:server_error"``, ``"rate_limit"``.
2. A scripted scenario (``--sim-script FILE``, JSON): directives per turn, where the turn number
   counts the assistant turns already in the conversation (see :class:`Script`). A scripted turn
   may also name the tools it calls and their exact arguments (``{"calls": [...]}``).
3. The agent default: with tools available (and ``tool_choice`` not ``"none"``), a new user
   message gets a function call and a function-call output gets a text answer; without tools,
   text. ``tool_choice`` ``"required"`` or a named function always calls.

The request's ``tool_choice`` wins over 1 and 2 as it would over a model (see :func:`_under_choice`):
``"none"`` never calls (the turn answers in text), a named function is the only one called.

Deterministic: the same seed and the same conversation give the same output.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import re
import zlib
from pathlib import Path
from typing import Any, AsyncIterator, TypeGuard

import msgspec
import regex  # type: ignore[import-untyped]  # (tiktoken's own dependency) matching with a time bound

from hotloop import errors, tokenizer
from hotloop.backends.base import BackendRequest, model_object
from hotloop.config import SIM_MAX_STALL, SIM_MAX_TOKENS, SIM_MIN_RATE
from hotloop.protocol.chunks import Chunk, Failure, Finish, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, FunctionTool, Message, Reasoning, TextFormat

_WORDS = (
    "the loop keeps agents hot while each turn streams tokens from a fast model and the server "
    "only reads what is new so latency stays low across long sessions with many tool calls and "
    "results that flow back into context before the next answer arrives quickly enough for "
    "people to notice how much smoother coding feels when nothing waits on slow bookkeeping"
).split()

DEFAULT_MODELS = ("hotloop-sim", "gpt-oss-120b")


class Call(msgspec.Struct, frozen=True):
    """One scripted function call: the tool's name and its arguments (JSON text), as given."""

    name: str
    arguments: str


class Directives(msgspec.Struct, kw_only=True):
    """What one simulated response does."""

    text: bool = False
    tools: int = 0  # number of function calls
    reasoning: bool = False
    tokens: int | None = None  # answer length
    fail: str | None = None  # model failure (response.failed) with this code
    error: str | None = None  # backend error raised mid-stream: server_error|disconnect
    rate_limit: bool = False  # 429 before the first token
    stall: float = 0.0  # seconds of silence mid-stream
    rate: float | None = None  # tokens/s for this response (overrides the server's --sim-rate)
    calls: tuple[Call, ...] = ()  # scripted calls (name, exact arguments) instead of example ones


# Bounds on what a request may ask of the simulator (a directive past them is a 400).
MAX_TOKENS = SIM_MAX_TOKENS  # --sim-output-tokens is held to it too (hotloop.config)
MAX_TOOLS = 64
MAX_STALL = SIM_MAX_STALL  # --sim-ttft too
MIN_RATE = SIM_MIN_RATE  # a paced rate's gap between tokens is a silence too: at most MAX_STALL (--sim-rate too)
TICK = 0.0005  # the generator sleeps only longer than this: uvloop makes a timer of such delays only (see above)
# an unpaced (or late) stream lets the event loop run after this many tokens without a sleep: a
# consumer that never awaits (a JSON answer) would otherwise hold the server for a whole answer
YIELD_EVERY = 256
# characters of JSON the simulator builds for one call's arguments (a schema asking for more is a
# 400): nested arrays' minItems multiply, and the arguments are built on the event loop
MAX_ARGUMENT_CHARS = 100_000

_FLAGS = ("text", "text+tool", "reasoning", "rate_limit")  # directives that take no value
_KNOWN = "text, tools:N, text+tool, reasoning, tokens:N, rate:N, fail:CODE, error, disconnect, rate_limit, stall:S"


def parse_directives(spec: str) -> Directives:
    """``"reasoning,tools:2,tokens:40"`` -> :class:`Directives`. Unknown or out-of-range words are a 400."""
    d = Directives()
    for raw in spec.split(","):
        word = raw.strip()
        if not word:
            continue
        name, sep, arg = word.partition(":")
        why = ""
        try:
            if name in _FLAGS and sep:
                why = f"'{name}' takes no value"
                raise ValueError(word)
            if name == "text":
                d.text = True
            elif name in ("tool", "tools"):
                why = f"tools must be a whole number from 0 to {MAX_TOOLS}"
                d.tools = int(arg) if arg else 1
            elif name == "text+tool":
                d.text, d.tools = True, 1
            elif name == "reasoning":
                d.reasoning = True
            elif name == "tokens":
                why = f"tokens must be a whole number from 0 to {MAX_TOKENS}"
                d.tokens = int(arg)
            elif name == "fail":
                d.fail = arg or "server_error"
            elif name == "error":
                why = "error takes no value, or 'server_error' or 'disconnect'"
                if arg not in ("", "server_error", "disconnect"):
                    raise ValueError(word)
                d.error = "disconnect" if arg == "disconnect" else "error"
            elif name == "disconnect":
                why = "'disconnect' takes no value"
                if sep:
                    raise ValueError(word)
                d.error = "disconnect"
            elif name == "rate_limit":
                d.rate_limit = True
            elif name == "stall":
                why = f"stall must be from 0 to {MAX_STALL:g} seconds"
                d.stall = float(arg or "1")
            elif name == "rate":
                why = f"rate must be 0 (unpaced) or at least {MIN_RATE:.6g} tokens/s (a token at least every {MAX_STALL:g} s)"
                d.rate = float(arg)
            else:
                why = f"expected {_KNOWN}"
                raise ValueError(word)
            if not (0 <= (d.tokens or 0) <= MAX_TOKENS and 0 <= d.tools <= MAX_TOOLS and 0 <= d.stall <= MAX_STALL):
                raise ValueError(word)
            if d.rate is not None and not (d.rate == 0 or d.rate >= MIN_RATE):  # NaN too
                raise ValueError(word)
        except ValueError:
            raise errors.InvalidValue(
                f"Invalid simulator directive '{errors.clip(word)}' in metadata.sim" + (f": {why}." if why else "."),
                param="metadata.sim",
            ) from None
    return d


def _scripted_calls(i: int, calls: Any) -> tuple[Call, ...]:
    """A script entry's ``calls``: ``[{"name": "exec_command", "arguments": {"cmd": "ls"}}]``
    (``arguments`` a JSON object, or a string sent as it is)."""
    if not isinstance(calls, list) or not calls or len(calls) > MAX_TOOLS:
        raise ValueError(f"simulator script turn {i}: calls must be a list of 1 to {MAX_TOOLS} calls")
    out = []
    for call in calls:
        if not isinstance(call, dict) or set(call) - {"name", "arguments"}:
            raise ValueError(f"simulator script turn {i}: a call is {{\"name\": ..., \"arguments\": ...}}")
        name, args = call.get("name"), call.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise ValueError(f"simulator script turn {i}: a call needs the tool's name")
        if isinstance(args, dict):
            args = json.dumps(args, separators=(",", ":"))
        elif not isinstance(args, str):
            raise ValueError(f"simulator script turn {i}: a call's arguments are a JSON object or a string")
        if len(args) > MAX_ARGUMENT_CHARS:
            raise ValueError(f"simulator script turn {i}: a call's arguments are over {MAX_ARGUMENT_CHARS:,} characters")
        out.append(Call(name=name, arguments=args))
    return tuple(out)


class Script:
    """Scripted scenario: ``{"turns": ["tools:1", "tools:2", "text"], "repeat": false}``.

    Turn *n* (the number of assistant turns already in the conversation) uses ``turns[n]``; past
    the end the last entry repeats (or the list cycles with ``"repeat": true``). Faults go in the
    same strings, e.g. ``"rate_limit"`` at turn 3.

    An entry may instead be an object: ``{"sim": "reasoning", "calls": [{"name": "exec_command",
    "arguments": {"cmd": "ls"}}]}`` calls the named function tools with exactly those arguments
    (one call each, in order, streamed as the example ones are) after what ``sim`` asks for; a
    request without a function tool of that name that its ``tool_choice`` allows is a 400, but
    for the choices that decide the calls themselves (``"none"``, a named function: see
    :func:`_under_choice`).
    """

    def __init__(self, turns: list[str | dict[str, Any]], repeat: bool = False) -> None:
        if not turns:
            raise ValueError("a simulator script needs at least one turn")
        self.turns = []
        for i, t in enumerate(turns):
            calls = None
            if isinstance(t, str):
                spec = t
            else:
                if set(t) - {"sim", "calls"}:
                    raise ValueError(f"simulator script turn {i}: an entry object has the keys 'sim' and 'calls'")
                spec = t.get("sim", "")
                if not isinstance(spec, str):
                    raise ValueError(f"simulator script turn {i}: 'sim' is a string of directives")
                calls = _scripted_calls(i, t["calls"]) if "calls" in t else None
            try:
                d = parse_directives(spec)
            except errors.InvalidValue as exc:  # said of the script, not of a request's metadata.sim
                raise ValueError(f"simulator script turn {i}: {exc.message.replace(' in metadata.sim', '')}") from None
            if calls is not None:
                if d.tools:
                    raise ValueError(f"simulator script turn {i}: give either tools:N or calls, not both")
                d.calls, d.tools = calls, len(calls)
            self.turns.append(d)
        self.repeat = repeat

    @classmethod
    def load(cls, path: str | Path) -> "Script":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:  # (UnicodeDecodeError, JSONDecodeError): said with the file
            raise ValueError(f"simulator script {path}: {exc}") from None
        turns = data if isinstance(data, list) else data.get("turns") if isinstance(data, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, (str, dict)) for t in turns):
            raise ValueError(
                f"simulator script {path}: expected a list of directive strings (or entry objects), "
                f"or {{\"turns\": [...]}}"
            )
        repeat = data.get("repeat", False) if isinstance(data, dict) else False
        if not isinstance(repeat, bool):  # ("false", a string, read as true, cycled the turns)
            raise ValueError(f"simulator script {path}: \"repeat\" must be true or false, not {json.dumps(repeat)[:40]}")
        return cls(turns, repeat)

    def at(self, turn: int) -> Directives:
        if self.repeat:
            return self.turns[turn % len(self.turns)]
        return self.turns[min(turn, len(self.turns) - 1)]


class _Corpus:
    """Pre-tokenized ASCII text: every token decodes to a clean string on its own."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        words = [rng.choice(_WORDS) for _ in range(4000)]
        # every word with its space before it, the first one too: an answer that runs past the
        # end of the corpus and on from its start (take) keeps its words apart
        text = "".join(" " + w for w in words)
        enc = tokenizer.encoding()
        self.pieces = [enc.decode_single_token_bytes(t).decode("ascii") for t in enc.encode_ordinary(text)]

    def take(self, start: int, n: int) -> list[str]:
        p = self.pieces
        start %= len(p)
        out = p[start : start + n]
        while len(out) < n:
            out += p[: n - len(out)]
        return out


def _sentence(pieces: list[str]) -> list[str]:
    """Corpus tokens read as text: no leading space on the first one (still one token each)."""
    if pieces:
        pieces[0] = pieces[0].lstrip() or pieces[0]
    return pieces


def _pieces(text: str) -> list[str]:
    enc = tokenizer.encoding()
    out: list[str] = []
    buf = b""
    for t in enc.encode_ordinary(text):
        buf += enc.decode_single_token_bytes(t)
        try:
            out.append(buf.decode("utf-8"))
            buf = b""
        except UnicodeDecodeError:
            continue
    if buf:
        out.append(buf.decode("utf-8", "replace"))
    return out


class _TooLarge(ValueError):
    """A schema asks for more arguments than :data:`MAX_ARGUMENT_CHARS`."""


class _Budget:
    __slots__ = ("left", "checks")

    def __init__(self, chars: int) -> None:
        self.left = chars
        self.checks = MAX_PATTERN_CHECKS  # pattern matches left (_finds)

    def spend(self, chars: int) -> None:
        self.left -= chars
        if self.left < 0:
            raise _TooLarge("the arguments would be too large")


_FORMATS = {
    "date": "2026-01-01",
    "date-time": "2026-01-01T00:00:00Z",
    "time": "00:00:00Z",
    "duration": "P1D",
    "email": "user@example.com",
    "hostname": "example.com",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "uri": "https://example.com/",
}


def _number(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _resolve(ref: Any, root: Any) -> Any:
    """A local ``$ref`` (``#``, ``#/$defs/Name``...) in ``root``; anything else is unreadable."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise ValueError(f"unsupported $ref {ref!r}")
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _merged(schema: dict[str, Any], root: Any, depth: int) -> dict[str, Any]:
    """``allOf``: its schemas' keys together (properties and required lists joined)."""
    out = {k: v for k, v in schema.items() if k != "allOf"}
    # one dict and one list, added to (a copy of each per part made a long allOf N x N)
    props: dict[str, Any] = dict(out.get("properties", {}))
    required: list[Any] = list(out.get("required", []))
    for sub in schema["allOf"]:
        while isinstance(sub, dict) and "$ref" in sub and depth <= MAX_SCHEMA_DEPTH:
            sub, depth = _resolve(sub["$ref"], root), depth + 1
        for k, v in sub.items():
            if k == "properties":
                props.update(v)
            elif k == "required":
                required.extend(v)
            else:
                out.setdefault(k, v)
    if props or "properties" in out:
        out["properties"] = props
    if required or "required" in out:
        out["required"] = required
    return out


def _integer(schema: dict[str, Any]) -> int:
    lo, xlo, hi, xhi = (schema.get(k) for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"))
    lower = None
    if _number(lo):
        lower = math.ceil(lo)
    if _number(xlo):
        lower = max(lower if lower is not None else math.floor(xlo) + 1, math.floor(xlo) + 1)
    v = lower if lower is not None else 1
    step = schema.get("multipleOf")
    if _number(step) and step > 0 and step == int(step):
        v = -(-v // int(step)) * int(step)
    if _number(hi) and v > hi:
        v = math.floor(hi)
    if _number(xhi) and v >= xhi:
        v = math.ceil(xhi) - 1
    return v


def _float(schema: dict[str, Any]) -> float:
    lo, xlo, hi, xhi = (schema.get(k) for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"))
    lower = float(lo) if _number(lo) else float(xlo) + 0.5 if _number(xlo) else None
    v = lower if lower is not None else 1.5
    if _number(hi) and v > hi:
        v = float(hi)
    if _number(xhi) and v >= xhi:
        v = (max(float(lo) if _number(lo) else float("-inf"), float(xlo) if _number(xlo) else float(xhi) - 2) + xhi) / 2
    step = schema.get("multipleOf")
    if _number(step) and step > 0:
        # the multiple at or above it, else (above a maximum) the one below
        k = math.ceil(v / step)
        if (_number(hi) and k * step > hi) or (_number(xhi) and k * step >= xhi):
            k = math.floor(v / step)
        v = k * step
    return v


@functools.lru_cache(maxsize=256)
def _parse(pattern: str) -> Any:
    """``pattern`` as Python's ``re`` reads it (its parser's tree), or None when it cannot (or
    when it is longer than ``MAX_PATTERN_CHARS``: neither parsed nor compiled, on the event loop,
    where a 100 KB one took about 0.9 s). Kept per pattern (a schema repeats them)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return None
    try:
        return re._parser.parse(pattern)  # type: ignore[attr-defined]
    except (re.error, ValueError, TypeError, RecursionError, OverflowError):
        return None


def _finds(pattern: str, parsed: Any, text: str, budget: _Budget | None) -> bool | None:
    """Whether ``pattern`` (a client's; ``parsed``: :func:`_parse`'s) finds ``text``: matched by
    ``regex``, whose matching is bounded in time (``PATTERN_SECONDS``), on the event loop;
    ``re`` is not, and a pattern such as ``(a|aa)+c`` backtracks there for ever. None when it
    cannot tell: a pattern ``re`` cannot read, one whose counted repeats ``regex`` would expand
    for ever when it compiles (``a{1000000000}``: only one whose repeats, nested, count to
    MAX_WRITTEN_CHARS at most is matched), the bound passed, the document's matches spent
    (``MAX_PATTERN_CHECKS``)."""
    if parsed is None or budget is not None and budget.checks <= 0:
        return None
    if budget is not None:
        budget.checks -= 1
    try:
        if not _tame(parsed):
            return None
        return regex.search(pattern, text, timeout=PATTERN_SECONDS) is not None
    except (regex.error, TimeoutError, ValueError, TypeError, RecursionError, OverflowError):
        return None


_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")


def _tame(parsed: Any, scale: int = 1) -> bool:
    """Whether the counted repeats of a parsed pattern, nested, count to ``MAX_WRITTEN_CHARS``
    at most (an open-ended one counts its least)."""
    for op, arg in parsed:
        if str(op) in _REPEATS:
            least, most, sub = arg
            n = scale * max(1, least if most == re._constants.MAXREPEAT else most)  # type: ignore[attr-defined]
            if n > MAX_WRITTEN_CHARS or not _tame(sub, n):
                return False
            continue
        for part in arg if isinstance(arg, (tuple, list)) else (arg,):
            if isinstance(part, re._parser.SubPattern):  # type: ignore[attr-defined]
                if not _tame(part, scale):
                    return False
            elif isinstance(part, (tuple, list)):
                if not all(_tame(x, scale) for x in part if isinstance(x, re._parser.SubPattern)):  # type: ignore[attr-defined]
                    return False
    return True


def _from_pattern(pattern: str, parsed: Any, budget: _Budget | None = None, least: int = 0) -> str | None:
    """A short string ``pattern`` (a JSON schema's, read as a Python regular expression;
    ``parsed``: :func:`_parse`'s) finds, at least ``least`` characters long where its repeats
    allow (a ``minLength`` beside the pattern), or None when it is not one this can write
    (back-references, look-arounds that refuse it, more than ``MAX_WRITTEN_CHARS``)."""
    try:
        text = _write(parsed)
        if len(text) < least:  # again, the first repeats with room taking what is missing
            text = _write(parsed, [least - len(text)])
    except (ValueError, RecursionError, TypeError, OverflowError):
        return None
    return None if _finds(pattern, parsed, text, budget) is False else text  # (unchecked: as written)


_CATEGORY_CHAR = {"CATEGORY_DIGIT": "0", "CATEGORY_NOT_DIGIT": "a", "CATEGORY_WORD": "a", "CATEGORY_NOT_WORD": "-",
                  "CATEGORY_SPACE": " ", "CATEGORY_NOT_SPACE": "a"}


def _write(parsed: Any, need: list[int] | None = None) -> str:
    """The shortest string ``parsed`` matches, lengthened by ``need[0]`` characters (or a few
    more: whole repetitions) where its first repeats have room (more than their least count)."""
    out = []
    if need is None:
        need = [0]
    for op, arg in parsed:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(arg))
        elif name == "ANY":
            out.append("a")
        elif name == "IN":
            out.append(_one_of(arg))
        elif name in _REPEATS:
            least, most, sub_pattern = arg
            sub = _write(sub_pattern)
            count = least
            if need[0] > 0 and sub and most > least:  # (most: MAXREPEAT when unbounded)
                more = min(most - least, -(-need[0] // len(sub)), MAX_WRITTEN_CHARS)
                count += more
                need[0] -= more * len(sub)
            if len(sub) * count > MAX_WRITTEN_CHARS:  # before it is made: a{1000000000} is 1 GB
                raise ValueError("too long")
            out.append(sub * count)
        elif name == "SUBPATTERN":
            out.append(_write(arg[-1], need))
        elif name == "ATOMIC_GROUP":
            out.append(_write(arg, need))
        elif name == "BRANCH":
            out.append(_write(arg[1][0], need))
        elif name in ("AT", "ASSERT", "ASSERT_NOT"):
            continue  # anchors and look-arounds write nothing (re.search checks the result)
        else:
            raise ValueError(name)  # back-references, conditionals
    text = "".join(out)
    if len(text) > MAX_WRITTEN_CHARS:
        raise ValueError("too long")
    return text


def _one_of(items: Any) -> str:
    """A character a ``[...]`` class matches."""
    negated = bool(items) and str(items[0][0]) == "NEGATE"
    if negated:
        refused = "".join(_one_of([item]) for item in items[1:] if str(item[0]) != "CATEGORY")
        for c in "a0 _-xZ":
            if c not in refused:
                return c
        raise ValueError("NEGATE")
    op, arg = items[0]
    name = str(op)
    if name == "LITERAL":
        return chr(arg)
    if name == "RANGE":
        return chr(arg[0])
    if name == "CATEGORY":
        return _CATEGORY_CHAR[str(arg)]
    raise ValueError(name)


def _string(schema: dict[str, Any], name: str, budget: _Budget) -> str:
    fmt = schema.get("format")
    text = _FORMATS.get(fmt, f"example {name}") if isinstance(fmt, str) else f"example {name}"
    pattern = schema.get("pattern")
    parsed = _parse(pattern) if isinstance(pattern, str) else None
    shortest, longest = schema.get("minLength"), schema.get("maxLength")
    if parsed is not None and isinstance(pattern, str) and not _finds(pattern, parsed, text, budget):  # (unchecked: written)
        least = min(int(shortest), MAX_WRITTEN_CHARS) if _number(shortest) and shortest > 0 else 0
        written = _from_pattern(pattern, parsed, budget, least)  # (parsed: at most MAX_PATTERN_CHARS)
        if written is not None:
            budget.spend(len(written) + 2)
            return written
    if _number(shortest) and len(text) < shortest:
        budget.spend(int(shortest))
        text += "x" * (int(shortest) - len(text))
    if _number(longest) and len(text) > longest:
        text = text[: max(0, int(longest))]
    budget.spend(len(text) + 2)
    return text


SHALLOW_DEPTH = 4  # schema depth from which example_value writes the smallest valid value
# ... and from which it writes null (a schema that recurses through required properties ends).
# Each $ref, property, items and anyOf is a level: five nested Pydantic models reach 10, and at
# 8 their innermost required fields came out null (invalid; responses.parse failed).
MAX_SCHEMA_DEPTH = 32
MAX_PATTERN_CHARS = 1000  # a longer string pattern is not written from (its format or name is used)
MAX_WRITTEN_CHARS = 1000  # nor is one whose shortest match is longer
# A client's pattern is matched for at most this long (_finds), and at most this many times per
# document: 16 patterns that each take their whole bound hold the event loop 32 ms. Past them
# (or the bound) a string is written from its pattern without a check.
PATTERN_SECONDS = 0.002
MAX_PATTERN_CHECKS = 16
_SCALARS = ("null", "string", "integer", "number", "boolean")


def example_value(
    schema: dict[str, Any], name: str = "value", depth: int = 0, *, root: Any = None, budget: _Budget | None = None
) -> Any:
    """A value valid for a (strict-mode style) JSON schema, deterministic.

    Follows local ``$ref`` (``$defs``, as SDKs generate them) and ``allOf``, and keeps numbers,
    strings and arrays within their bounds. At most :data:`MAX_ARGUMENT_CHARS` of JSON: a schema
    that asks for more (nested arrays' ``minItems`` multiply) raises ``ValueError``.
    """
    if root is None:
        root = schema
    if budget is None:
        budget = _Budget(MAX_ARGUMENT_CHARS)
    if depth > MAX_SCHEMA_DEPTH:
        budget.spend(4)
        return None
    deep = depth >= SHALLOW_DEPTH  # past it: the smallest value that still fits (a recursive schema ends)
    if not isinstance(schema, dict):
        raise TypeError("a schema must be an object")
    if "$ref" in schema:
        return example_value(_resolve(schema["$ref"], root), name, depth + 1, root=root, budget=budget)
    if schema.get("allOf"):
        return example_value(_merged(schema, root, depth), name, depth + 1, root=root, budget=budget)
    if "enum" in schema and schema["enum"]:
        value = schema["enum"][0]
        budget.spend(len(json.dumps(value)))
        return value
    if "const" in schema:
        budget.spend(len(json.dumps(schema["const"])))
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            options = schema[key]
            pick = options[0]
            if deep:  # a branch that ends here (null, a scalar) before one that recurses
                pick = next((o for o in options if isinstance(o, dict) and o.get("type") in _SCALARS), pick)
            return example_value(pick, name, depth + 1, root=root, budget=budget)
    typ = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(typ, list):
        typ = next((t for t in typ if t != "null"), "null")
    budget.spend(1)
    if typ == "object":
        props: dict[str, Any] = schema.get("properties", {})
        listed = schema.get("required", list(props))
        if not isinstance(props, dict) or not isinstance(listed, list):
            raise TypeError("properties must be an object and required an array")
        # a set (a list made this N x N: N optional properties, N other names required); each
        # property looked at costs a character of the budget, written or not
        required = {r for r in listed if isinstance(r, str)}
        fewest = schema.get("minProperties")
        # minProperties: optional properties too, in order, as many as the required ones lack
        optional = max(0, min(int(fewest), len(props)) - len(required & props.keys())) if _number(fewest) and not deep else 0
        out: dict[str, Any] = {}
        for k in props:
            budget.spend(1)
            if k in required or optional > 0:
                if k not in required:
                    optional -= 1
                budget.spend(len(k) + 2)
                out[k] = example_value(props[k], k, depth + 1, root=root, budget=budget)
        extra = schema.get("additionalProperties")
        if _number(fewest) and not deep and len(out) < fewest and isinstance(extra, dict):
            # a map (pydantic's dict[str, X] with min_length): keys of its own
            for i in range(len(out), min(int(fewest), MAX_ARGUMENT_CHARS // 4)):
                k = f"key{i + 1}"
                budget.spend(len(k) + 3)
                out[k] = example_value(extra, k, depth + 1, root=root, budget=budget)
        return out
    if typ == "array":
        items = schema.get("items", {"type": "string"})
        prefix = schema.get("prefixItems")
        if isinstance(items, list):  # draft 7's tuple (zod-to-json-schema writes it): items are prefixItems
            prefix, items = items, schema.get("additionalItems", {})
        prefix = [p for p in prefix if isinstance(p, dict)] if isinstance(prefix, list) else []
        least, most = schema.get("minItems"), schema.get("maxItems")
        n = int(least) if _number(least) and least >= 1 else 0 if deep or (_number(most) and most < 1) else 1
        n = max(n, len(prefix))  # (a tuple's positions: each one written)
        if n * 2 > budget.left:  # every value costs a character or more (and its comma)
            raise _TooLarge("the arguments would be too large")
        unique = schema.get("uniqueItems") is True
        values: list[Any] = []
        seen: set[str] = set()  # (uniqueItems: the values' canonical JSON)
        for i in range(n):
            sub = prefix[i] if i < len(prefix) else items if isinstance(items, dict) else {}
            v = example_value(sub, name, depth + 1, root=root, budget=budget)
            if unique:
                key = _key(v)
                if key in seen:
                    v = _another(sub, name, i, seen, depth + 1, root, budget, v)
                    if _key(v) == key:  # no other value found: the rest may repeat (no more searches)
                        unique = False
                seen.add(_key(v))
            values.append(v)
        return values
    if typ == "integer":
        number = _integer(schema)
        budget.spend(len(str(number)))  # (a bound of 1e308 writes 309 digits)
        return number
    if typ == "number":
        return _float(schema)
    if typ == "boolean":
        return True
    if typ == "null":
        return None
    return _string(schema, name, budget)


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


UNIQUE_TRIES = 64  # numbers a uniqueItems array tries beyond the index's own (then a repeat stays)


def _another(
    schema: dict[str, Any], name: str, i: int, taken: set[str], depth: int, root: Any, budget: _Budget, value: Any
) -> Any:
    """For ``uniqueItems``: a value of ``schema`` whose :func:`_key` is not ``taken`` (item
    ``i``): the enum's ``i``-th value, a number moved by ``i`` steps within its bounds (or the
    nearest free one in ``UNIQUE_TRIES``), a string written for another name; else ``value``
    as it is (the simulator searches no further: a string of a ``pattern`` or ``format``, say)."""
    for _ in range(MAX_SCHEMA_DEPTH):
        if not (isinstance(schema, dict) and "$ref" in schema):
            break
        schema = _resolve(schema["$ref"], root)
    if not isinstance(schema, dict):
        return value
    enum = schema.get("enum")
    if isinstance(enum, list):
        # item i takes the enum's value i (one look, whatever the array's length)
        if i < len(enum) and (key := _key(enum[i])) not in taken:
            budget.spend(len(key))
            return enum[i]
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        hi, xhi = schema.get("maximum"), schema.get("exclusiveMaximum")
        lo, xlo = schema.get("minimum"), schema.get("exclusiveMinimum")
        step = schema.get("multipleOf")
        unit: float = step if _number(step) and step > 0 else 1
        if isinstance(value, int) and unit != int(unit):
            if not (1 / unit).is_integer():
                return value  # no integer step keeps the multiple
            unit = 1
        if isinstance(value, int):
            unit = int(unit)
        for k in (i, *range(1, UNIQUE_TRIES), *range(-1, -UNIQUE_TRIES, -1)):
            move = k * unit
            v = value + move
            if not (math.isfinite(move) and math.isfinite(v)):  # (1e308 steps: no Infinity written)
                continue
            if (_number(hi) and v > hi) or (_number(xhi) and v >= xhi) or (_number(lo) and v < lo) or (_number(xlo) and v <= xlo):
                continue
            if _key(v) not in taken:
                budget.spend(len(str(v)))
                return v
        return value
    if isinstance(value, str) and "pattern" not in schema and "format" not in schema:
        v = example_value(schema, f"{name} {i + 1}", depth, root=root, budget=budget)
        return v if _key(v) not in taken else value
    return value  # a string of a pattern or format: the simulator makes one (the array repeats it)


def _example_arguments(tool: FunctionTool) -> str:
    """JSON arguments valid for the tool's schema; a schema the simulator cannot read, or that
    asks for more than :data:`MAX_ARGUMENT_CHARS` of arguments, is a 400."""
    try:
        value = example_value(tool.parameters or {"type": "object", "properties": {}})
        return json.dumps(value, separators=(",", ":"))
    except _TooLarge:
        raise errors.InvalidValue(
            f"The simulator cannot build arguments for tool '{errors.clip(tool.name)}': its parameters schema "
            f"asks for more than {MAX_ARGUMENT_CHARS:,} characters of them.",
            param="tools",
        ) from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError, OverflowError):
        raise errors.InvalidValue(
            f"The simulator cannot build arguments from the parameters schema of tool '{errors.clip(tool.name)}'.",
            param="tools",
        ) from None


def _example_document(fmt: TextFormat) -> str:
    """The answer under ``text.format``: ``json_schema`` a JSON value valid for its schema,
    ``json_object`` a small JSON object; a schema the simulator cannot read is a 400."""
    if fmt.type == "json_object":
        return json.dumps({"answer": "example answer"})
    try:
        return json.dumps(example_value(fmt.schema or {"type": "object", "properties": {}}))
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError, OverflowError):
        raise errors.InvalidValue(
            "The simulator cannot build an answer from the schema of text.format.", param="text.format.schema"
        ) from None


class SimulatorBackend:
    name = "simulator"

    def __init__(
        self,
        *,
        rate: float = 1000.0,
        ttft: float = 0.0,
        output_tokens: int = 64,
        seed: int = 0,
        script: Script | None = None,
        models: tuple[str, ...] = DEFAULT_MODELS,
    ) -> None:
        self.rate = rate
        self.ttft = ttft
        self.output_tokens = output_tokens
        self.seed = seed
        self.script = script
        self.models = models
        self.default_model = models[0]
        self._corpus: _Corpus | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # The encoding splits answers into tokens on the event loop (_pieces): built off it, then
        # claimed by it before the corpus is made on another thread (tokenizer.claim_encoding).
        await loop.run_in_executor(None, tokenizer.encoding)
        tokenizer.claim_encoding()
        self._corpus = await loop.run_in_executor(None, _Corpus, self.seed)

    async def close(self) -> None:
        pass

    async def list_models(self) -> list[dict[str, Any]]:
        return [model_object(m, "hotloop") for m in self.models]

    # -- deciding what to answer ---------------------------------------------------------------

    def directives(self, req: BackendRequest) -> Directives:
        """What to answer: a fresh :class:`Directives` (the caller may change it; a script's own
        entries are never changed)."""
        spec = req.metadata.get("sim") if req.metadata else None
        if isinstance(spec, str):
            return _under_choice(parse_directives(spec), req)
        if self.script is not None:
            return _under_choice(msgspec.structs.replace(self.script.at(_assistant_turns(req.items))), req)
        d = Directives()
        choice = req.tool_choice
        if not _callable(req) or choice == "none":
            d.text = True
        elif choice == "required" or (
            isinstance(choice, dict) and (choice.get("type") == "function" or choice.get("mode") == "required")
        ):
            d.tools = 1
        else:  # "auto", or allowed tools in mode "auto"
            last = req.items[-1] if req.items else None
            if type(last) is FunctionCallOutput:
                d.text = True
            else:
                d.tools = 1
        return d

    def _tool_for(self, req: BackendRequest, k: int) -> FunctionTool:
        tools = _callable(req)
        return tools[k % len(tools)]

    def _seed_for(self, req: BackendRequest) -> int:
        last = req.items[-1] if req.items else None
        key = repr(_content(last)).encode() if last is not None else b""
        return zlib.crc32(key, self.seed & 0xFFFFFFFF) ^ len(req.items)

    # -- streaming -----------------------------------------------------------------------------

    async def stream(self, req: BackendRequest) -> AsyncIterator[Chunk]:
        d = self.directives(req)
        if d.tools and not _callable(req):
            raise errors.InvalidRequest(
                "The simulator was asked for a tool call but the request has no function tools "
                "that its tool_choice allows.",
                param="tools",
            )
        if d.calls:
            allowed = {t.name for t in _callable(req)}
            for call in d.calls:
                if call.name not in allowed:
                    raise errors.InvalidRequest(
                        f"The simulator script calls tool '{errors.clip(call.name)}' but the request has no "
                        "function tool of that name that its tool_choice allows.",
                        param="tools",
                    )
        if not req.parallel_tool_calls:
            d.tools = min(d.tools, 1)
        if d.rate_limit:
            raise errors.RateLimited(
                "Rate limit reached for the simulated model. Please try again in 1s.", retry_after=1.0
            )
        if self._corpus is None:
            await self.start()
        assert self._corpus is not None
        seed = self._seed_for(req)
        rng = random.Random(seed)
        budget = req.max_output_tokens
        n_answer = d.tokens if d.tokens is not None else self.output_tokens
        if budget is not None:
            n_answer = min(n_answer, budget + 1)  # one past the budget is enough to hit it
        plan: list[tuple[str, Any]] = []  # (kind, payload)
        if d.reasoning:
            for piece in _sentence(self._corpus.take(rng.randrange(1 << 16), max(4, n_answer // 2))):
                plan.append(("r", piece))
        if d.text or not d.tools:
            start = rng.randrange(1 << 16)
            fmt = req.text_format
            if fmt is not None and fmt.type in ("json_schema", "json_object"):
                # structured output: a JSON document valid for the schema, as a model under
                # response_format writes it (tokens:N does not cut it; max_output_tokens does)
                text_pieces = _pieces(_example_document(fmt))
            else:
                text_pieces = _sentence(self._corpus.take(start, n_answer))
            for piece in text_pieces:
                plan.append(("t", piece))
        made: dict[int, str] = {}  # a tool's arguments, made once a response (tools:64 made them 64 times)
        for k in range(d.tools):
            if d.calls:
                name, args = d.calls[k].name, d.calls[k].arguments
            else:
                tool = self._tool_for(req, k)
                if id(tool) not in made:
                    made[id(tool)] = _example_arguments(tool)
                name, args = tool.name, made[id(tool)]
            call_id = f"call_{seed & 0xFFFFFFFF:08x}{k:02d}"
            pieces = _pieces(args)
            plan.append(("c", ToolCallDelta(index=k, call_id=call_id, name=name)))
            for piece in pieces:
                plan.append(("c", ToolCallDelta(index=k, arguments=piece)))
        # A fault comes in the middle of what is streamed: of the plan up to where the output
        # budget cuts it, so that max_output_tokens never hides it; with nothing to stream (tokens:0),
        # before the end (index len(plan) stands for the end)
        end = len(plan)
        if budget is not None:
            counted = 0
            for i, (kind, payload) in enumerate(plan):
                if counted >= budget:
                    end = i
                    break
                if kind != "c" or payload.arguments:
                    counted += 1
        fail_at = end // 2 if (d.fail or d.error or d.stall) else -1

        loop = asyncio.get_running_loop()
        rate = self.rate if d.rate is None else d.rate
        interval = 1.0 / rate if rate > 0 else 0.0
        t0 = loop.time() + self.ttft
        emitted = reasoning = 0
        awake = 0  # chunks since the generator last let the loop run
        for i in range(len(plan) + 1):
            if i == fail_at:
                if d.stall:
                    await asyncio.sleep(d.stall)
                    t0 += d.stall  # silence, then the pace as before (not a burst of what is due)
                if d.fail:
                    yield Usage(output_tokens=emitted, reasoning_tokens=reasoning)
                    yield Failure(code=d.fail, message="The simulated model failed to generate a response.")
                    return
                if d.error == "disconnect":
                    raise errors.BackendError("The model backend closed the connection mid-stream.")
                if d.error:
                    raise errors.BackendError("The model backend failed mid-stream.")
            if i == len(plan):
                break
            kind, payload = plan[i]
            if budget is not None and emitted >= budget:
                yield Usage(output_tokens=emitted, reasoning_tokens=reasoning)
                yield Finish("length")
                return
            awake += 1
            if interval:
                due = t0 + i * interval
                now = loop.time()
                if due - now > TICK:
                    await asyncio.sleep(due - now)
                    awake = 0
            elif i == 0 and self.ttft:
                await asyncio.sleep(self.ttft)
                awake = 0
            if awake >= YIELD_EVERY:  # unpaced, or late: the loop's other work runs too
                await asyncio.sleep(0)
                awake = 0
            if kind == "t":
                yield TextDelta(payload)
            elif kind == "r":
                reasoning += 1
                yield ReasoningDelta(payload)
            else:
                yield payload
            if kind != "c" or payload.arguments:
                emitted += 1
        yield Usage(output_tokens=emitted, reasoning_tokens=reasoning)
        yield Finish("tool_calls" if d.tools else "stop")


def _under_choice(d: Directives, req: BackendRequest) -> Directives:
    """``d`` (a request's directives or a script's turn, a fresh copy: changed in place) as a
    model under the request's ``tool_choice`` answers: the constraint wins over what was asked
    for, as it would over the model (its constrained decoding), instead of a tool call the client
    said may not happen or a 400 a model never answers.

    - ``"none"``: no call. A turn that asked for calls (``tools:N``, ``text+tool``, scripted
      ``calls``) answers in text instead: the text the ``text`` directive gives the same request
      (the same seed, so deterministic; ``tokens:N`` is its length), after its reasoning, if any.
      Faults (``fail``, ``rate_limit``, ...) stay.
    - A named function ``{"type": "function", "name": X}``: the model must call X, and only X
      (the chat backends send X alone, with a forced call), so the turn is a call of X, with no
      text (``text`` and ``text+tool`` become one call): scripted calls of X keep their exact
      arguments and order, scripted calls of other tools are not made, and a turn left with no
      call of X calls it once with arguments made from its schema (as the agent default does);
      ``tools:N`` calls X N times.
    - ``"required"`` (or allowed tools with ``mode: "required"``): at least one call; a turn that
      asked for none (``text``, ``tokens:N``, ``reasoning``, a scripted text turn) makes one,
      of the first tool it may call, with arguments made from its schema, after its reasoning.
    - ``"auto"``, allowed tools: unchanged (a scripted call of a tool the request does not have,
      or does not allow, is a 400 in ``stream``: the script and the request disagree).
    """
    choice = req.tool_choice
    required = choice == "required" or (
        isinstance(choice, dict) and choice.get("type") == "allowed_tools" and choice.get("mode") == "required"
    )
    if required:
        if not d.tools and not d.calls and _callable(req):
            d.tools, d.text = 1, False
    elif choice == "none":
        if d.tools:
            d.tools, d.calls, d.text = 0, (), True
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        d.text = False
        if d.calls:
            d.calls = tuple(c for c in d.calls if c.name == name)
            d.tools = len(d.calls) or 1  # none of X: one call of it, its arguments from its schema
        else:
            d.tools = max(d.tools, 1)
    return d


def _assistant_turns(items: list[Any]) -> int:
    """Assistant turns in a conversation: runs of the model's own items (its messages, function
    calls and reasoning), so that one turn's parallel calls, or its text and call, count once."""
    turns = 0
    inside = False
    for it in items:
        t = type(it)
        own = t is FunctionCall or t is Reasoning or (t is Message and it.role == "assistant")
        if own and not inside:
            turns += 1
        inside = own
    return turns


def _callable(req: BackendRequest) -> list[FunctionTool]:
    """The function tools the request's ``tool_choice`` lets the model call (as the chat backends
    send them: a named function alone, or the allowed tools that are functions)."""
    choice = req.tool_choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            return [t for t in req.tools if t.name == choice.get("name")]
        if kind == "allowed_tools":
            names = {
                t.get("name") for t in choice.get("tools", ()) if isinstance(t, dict) and t.get("type") == "function"
            }
            return [t for t in req.tools if t.name in names]
    return req.tools


def _content(item: Any) -> Any:
    """An item as the seed reads it: without the id and status the server may have given it (a
    random id made the same request answer differently each time)."""
    b = msgspec.to_builtins(item)
    if isinstance(b, dict) and b.get("type") != "item_reference":
        b.pop("id", None)
        b.pop("status", None)
        data = b.get("data")
        if isinstance(data, dict) and "id" in data:
            b["data"] = {k: v for k, v in data.items() if k != "id"}
    return b
