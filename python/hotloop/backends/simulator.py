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
   counts the assistant turns already in the conversation (see :class:`Script`).
3. The agent default: with tools available (and ``tool_choice`` not ``"none"``), a new user
   message gets a function call and a function-call output gets a text answer; without tools,
   text. ``tool_choice`` ``"required"`` or a named function always calls.

Deterministic: the same seed and the same conversation give the same output.
"""

from __future__ import annotations

import asyncio
import json
import random
import zlib
from pathlib import Path
from typing import Any, AsyncIterator

import msgspec

from hotloop import errors, tokenizer
from hotloop.backends.base import BackendRequest, model_object
from hotloop.protocol.chunks import Chunk, Failure, Finish, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, FunctionTool, Message

_WORDS = (
    "the loop keeps agents hot while each turn streams tokens from a fast model and the server "
    "only reads what is new so latency stays low across long sessions with many tool calls and "
    "results that flow back into context before the next answer arrives quickly enough for "
    "people to notice how much smoother coding feels when nothing waits on slow bookkeeping"
).split()

DEFAULT_MODELS = ("hotloop-sim", "gpt-oss-120b")


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


# Bounds on what a request may ask of the simulator (a directive past them is a 400).
MAX_TOKENS = 100_000
MAX_TOOLS = 64
MAX_STALL = 600.0
TICK = 0.0005  # the generator sleeps only longer than this: uvloop makes a timer of such delays only (see above)


def parse_directives(spec: str) -> Directives:
    """``"reasoning,tools:2,tokens:40"`` -> :class:`Directives`. Unknown or out-of-range words are a 400."""
    d = Directives()
    for raw in spec.split(","):
        word = raw.strip()
        if not word:
            continue
        name, _, arg = word.partition(":")
        try:
            if name == "text":
                d.text = True
            elif name in ("tool", "tools"):
                d.tools = int(arg) if arg else 1
            elif name == "text+tool":
                d.text, d.tools = True, 1
            elif name == "reasoning":
                d.reasoning = True
            elif name == "tokens":
                d.tokens = int(arg)
            elif name == "fail":
                d.fail = arg or "server_error"
            elif name in ("error", "disconnect"):
                d.error = name if not arg else arg
            elif name == "rate_limit":
                d.rate_limit = True
            elif name == "stall":
                d.stall = float(arg or "1")
            elif name == "rate":
                d.rate = float(arg)
            else:
                raise ValueError(word)
            if not (0 <= (d.tokens or 0) <= MAX_TOKENS and 0 <= d.tools <= MAX_TOOLS and 0 <= d.stall <= MAX_STALL):
                raise ValueError(word)
            if d.rate is not None and not d.rate >= 0:
                raise ValueError(word)
        except ValueError:
            raise errors.InvalidValue(
                f"Invalid simulator directive '{errors.clip(word)}' in metadata.sim.", param="metadata.sim"
            ) from None
    return d


class Script:
    """Scripted scenario: ``{"turns": ["tools:1", "tools:2", "text"], "repeat": false}``.

    Turn *n* (the number of assistant turns already in the conversation) uses ``turns[n]``; past
    the end the last entry repeats (or the list cycles with ``"repeat": true``). Faults go in the
    same strings, e.g. ``"rate_limit"`` at turn 3.
    """

    def __init__(self, turns: list[str], repeat: bool = False) -> None:
        if not turns:
            raise ValueError("a simulator script needs at least one turn")
        self.turns = [parse_directives(t) for t in turns]
        self.repeat = repeat

    @classmethod
    def load(cls, path: str | Path) -> "Script":
        data = json.loads(Path(path).read_text())
        if isinstance(data, list):
            return cls([str(t) for t in data])
        return cls([str(t) for t in data["turns"]], bool(data.get("repeat", False)))

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


def example_value(schema: dict[str, Any], name: str = "value", depth: int = 0) -> Any:
    """A value valid for a (strict-mode style) JSON schema, deterministic."""
    if depth > 8:
        return None
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return example_value(schema[key][0], name, depth + 1)
    typ = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(typ, list):
        typ = next((t for t in typ if t != "null"), "null")
    if typ == "object":
        props: dict[str, Any] = schema.get("properties", {})
        required = schema.get("required", list(props))
        return {k: example_value(props[k], k, depth + 1) for k in props if k in required}
    if typ == "array":
        items = schema.get("items", {"type": "string"})
        n = min(16, max(1, int(schema.get("minItems", 1))))
        return [example_value(items, name, depth + 1) for _ in range(n)]
    if typ == "integer":
        return int(schema.get("minimum", 1))
    if typ == "number":
        return float(schema.get("minimum", 1.5))
    if typ == "boolean":
        return True
    if typ == "null":
        return None
    if schema.get("format") == "date":
        return "2026-01-01"
    return f"example {name}"


def _example_arguments(tool: FunctionTool) -> str:
    """JSON arguments valid for the tool's schema; a schema the simulator cannot read is a 400."""
    try:
        value = example_value(tool.parameters or {"type": "object", "properties": {}})
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError):
        raise errors.InvalidValue(
            f"The simulator cannot build arguments from the parameters schema of tool '{tool.name}'.",
            param="tools",
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
        self._corpus = await loop.run_in_executor(None, _Corpus, self.seed)

    async def close(self) -> None:
        pass

    async def list_models(self) -> list[dict[str, Any]]:
        return [model_object(m, "hotloop") for m in self.models]

    # -- deciding what to answer ---------------------------------------------------------------

    def directives(self, req: BackendRequest) -> Directives:
        spec = req.metadata.get("sim") if req.metadata else None
        if isinstance(spec, str):
            return parse_directives(spec)
        turn = sum(1 for it in req.items if type(it) is FunctionCall or (type(it) is Message and it.role == "assistant"))
        if self.script is not None:
            return self.script.at(turn)
        d = Directives()
        choice = req.tool_choice
        if not req.tools or choice == "none":
            d.text = True
        elif choice == "required" or isinstance(choice, dict):
            d.tools = 1
        else:
            last = req.items[-1] if req.items else None
            if type(last) is FunctionCallOutput:
                d.text = True
            else:
                d.tools = 1
        return d

    def _tool_for(self, req: BackendRequest, k: int) -> FunctionTool:
        choice = req.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            for t in req.tools:
                if t.name == choice["name"]:
                    return t
        if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
            allowed = [t.get("name") for t in choice.get("tools", ())]
            tools = [t for t in req.tools if t.name in allowed] or req.tools
            return tools[k % len(tools)]
        return req.tools[k % len(req.tools)]

    def _seed_for(self, req: BackendRequest) -> int:
        last = req.items[-1] if req.items else None
        key = repr(msgspec.to_builtins(last)).encode() if last is not None else b""
        return zlib.crc32(key, self.seed & 0xFFFFFFFF) ^ len(req.items)

    # -- streaming -----------------------------------------------------------------------------

    async def stream(self, req: BackendRequest) -> AsyncIterator[Chunk]:
        d = self.directives(req)
        if d.tools and not req.tools:
            raise errors.InvalidRequest(
                "The simulator was asked for a tool call but the request has no function tools.",
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
            for piece in _sentence(self._corpus.take(rng.randrange(1 << 16), n_answer)):
                plan.append(("t", piece))
        for k in range(d.tools):
            tool = self._tool_for(req, k)
            args = _example_arguments(tool)
            call_id = f"call_{seed & 0xFFFFFFFF:08x}{k:02d}"
            pieces = _pieces(args)
            plan.append(("c", ToolCallDelta(index=k, call_id=call_id, name=tool.name)))
            for piece in pieces:
                plan.append(("c", ToolCallDelta(index=k, arguments=piece)))
        fail_at = len(plan) // 2 if (d.fail or d.error or d.stall) else -1

        loop = asyncio.get_running_loop()
        rate = self.rate if d.rate is None else d.rate
        interval = 1.0 / rate if rate > 0 else 0.0
        t0 = loop.time() + self.ttft
        emitted = reasoning = 0
        for i, (kind, payload) in enumerate(plan):
            if i == fail_at:
                if d.stall:
                    await asyncio.sleep(d.stall)
                if d.fail:
                    yield Usage(output_tokens=emitted, reasoning_tokens=reasoning)
                    yield Failure(code=d.fail, message="The simulated model failed to generate a response.")
                    return
                if d.error == "disconnect":
                    raise errors.BackendError("The model backend closed the connection mid-stream.")
                if d.error:
                    raise errors.BackendError("The model backend failed mid-stream.")
            if budget is not None and emitted >= budget:
                yield Usage(output_tokens=emitted, reasoning_tokens=reasoning)
                yield Finish("length")
                return
            if interval:
                due = t0 + i * interval
                now = loop.time()
                if due - now > TICK:
                    await asyncio.sleep(due - now)
            elif i == 0 and self.ttft:
                await asyncio.sleep(self.ttft)
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
