"""Per-turn and per-event server work, in process (no sockets): what the DESIGN targets measure.

* ``TurnPrepare``: pre-inference work of one WebSocket turn (2 KB of new input) on top of a cached
  200 KB / 100-turn conversation, against turn 1 of the same conversation: only the new input is
  analysed, so the two must stay close.
* ``BackendRequestBody``: the chat request body of a continued conversation, at turn 1 and 100.
* ``DeltaEvent``: one backend chunk in, one SSE frame out (turn machine + encoder).
* ``track_*``: the ``hotloop bench`` scenarios against a real server process (loopback), reported
  as asv tracked values (microseconds of server CPU).
"""

from __future__ import annotations

import random

from hotloop.pipeline import items as itemlib
from hotloop.pipeline.prepare import finished, prepare
from hotloop.protocol import events as ev
from hotloop.protocol.chunks import Finish, TextDelta
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import decode_body, validate
from hotloop.protocol.turn import Turn

WORDS = "agent tool call result patch file test build error fix diff line code review loop".split()


def _text(rng: random.Random, n: int) -> str:
    out, size = [], 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def _request(text: str, prev: str | None) -> bytes:
    import json

    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]}
    if prev:
        body["previous_response_id"] = prev
    return json.dumps(body).encode()


def _turn(parent, body: bytes, ids: IdGen, cache: itemlib.TokenCache):
    p = validate(decode_body(body))
    plan = prepare(p, parent, ids, cache)
    resp = response_object(p, ids.new("resp"), 0)
    turn = Turn(resp, ids=ids, clock=lambda: 0.0, input_tokens=plan.input_tokens)
    turn.start()
    turn.feed(TextDelta("ok"))
    turn.feed(Finish())
    return plan, finished(plan, resp, cache)


class TurnPrepare:
    params = [1, 100]
    param_names = ["turn"]

    def setup(self, turn: int) -> None:
        rng = random.Random(0)
        self.ids = IdGen(deterministic=True)
        self.cache = itemlib.TokenCache()
        parent = None
        for _ in range(turn - 1):
            _, parent = _turn(parent, _request(_text(rng, 2048), parent.id if parent else None), self.ids, self.cache)
        self.parent = parent
        self.body = _request(_text(rng, 2048), parent.id if parent else None)
        # correctness before timing: the new context is the parent's plus exactly one item
        plan = prepare(validate(decode_body(self.body)), self.parent, IdGen(deterministic=True), itemlib.TokenCache())
        expected = (len(parent.context) if parent else 0) + 1
        assert len(plan.context) == expected, (len(plan.context), expected)
        assert plan.input_tokens > 300 * turn  # ~376 tokens per 2 KB turn

    def time_prepare_new_turn(self, turn: int) -> None:
        # a fresh token cache each call: the new 2 KB really is tokenized every time
        prepare(validate(decode_body(self.body)), self.parent, self.ids, itemlib.TokenCache(16))


def _full_body(history: list[dict]) -> bytes:
    import json

    return json.dumps({"model": "m", "store": False, "input": history}).encode()


class PrefixTurn:
    """Pre-inference work of a full-history HTTP turn (no ``previous_response_id``) whose prefix is
    cached: the match on the body's bytes, the suffix's decoding and analysis. Compare with
    TurnPrepare."""

    params = [1, 100]
    param_names = ["turn"]

    def setup(self, turn: int) -> None:
        from hotloop.pipeline import reuse
        from hotloop.state.prefix import Prefix, PrefixCache

        rng = random.Random(0)
        self.ids = IdGen(deterministic=True)
        self.tokens = itemlib.TokenCache()
        self.prefixes = PrefixCache()
        history: list[dict] = []
        for _ in range(turn):
            history.append({"role": "user", "content": [{"type": "input_text", "text": _text(rng, 2048)}]})
            body = _full_body(history)
            req, hit, raw = reuse.decode_create(body, self.prefixes, "o")
            plan = self._prepare(req, hit, self.tokens)
            nbytes = plan.context.nbytes
            resp = response_object(plan.prepared, self.ids.new("resp"), 0)
            t = Turn(resp, ids=self.ids, clock=lambda: 0.0, input_tokens=plan.input_tokens)
            t.start()
            t.feed(TextDelta("ok"))
            t.feed(Finish())
            calls = frozenset(plan.context.call_ids)
            entry = finished(plan, resp, self.tokens, "o")
            if hit is not None:
                reuse.adopt(entry, plan.parent, hit)
            n = entry.input_len
            reg = reuse.registration(raw)
            head = reuse.head_of(reg.raw) if reg is not None else None
            last = itemlib.fingerprint(entry.context.items[n - 1])
            if reg is not None and head is not None:
                self.prefixes.put(Prefix(entry, n, last, nbytes, reg.raw, head, calls, reg.lead))
            else:
                self.prefixes.put(Prefix(entry, n, last, nbytes, None, None, calls))
            history += resp["output"]
        history.append({"role": "user", "content": [{"type": "input_text", "text": _text(rng, 2048)}]})
        self.body = _full_body(history)
        # correctness before timing: everything but the last two items is reused (from turn 2 on)
        req, hit, _ = reuse.decode_create(self.body, self.prefixes, "o")
        assert hit is not None and hit.n == len(history) - 2, (hit and hit.n, len(history))
        plan = self._prepare(req, hit, itemlib.TokenCache())
        assert len(plan.context) == len(history) and 0 < plan.cached_tokens < plan.input_tokens

    @staticmethod
    def _prepare(req, hit, tokens):
        from hotloop.pipeline import reuse

        p = validate(req)
        return prepare(p, reuse.parent_of(hit) if hit is not None else None, IdGen(deterministic=True), tokens)

    def time_prepare_full_history_turn(self, turn: int) -> None:
        from hotloop.pipeline import reuse

        req, hit, _ = reuse.decode_create(self.body, self.prefixes, "o")
        self._prepare(req, hit, itemlib.TokenCache(16))


class PrefixLookup:
    """Finding which registered body a full-history request repeats, when ``conversations``
    conversations of one key start with the same 29 KB (an agent's instructions and tools) and
    the same first message: the one that matches is the oldest registered, so every other is
    ruled out first (by its last bytes, not by comparing all that they share)."""

    params = [1, 64, 256]
    param_names = ["conversations"]

    def setup(self, conversations: int) -> None:
        import json

        from hotloop.pipeline import reuse
        from hotloop.state.context import CachedResponse, Context
        from hotloop.state.prefix import Prefix, PrefixCache

        rng = random.Random(0)
        settings = {"instructions": _text(rng, 14_000), "tools": [{"type": "function", "name": f"t{i}", "description": _text(rng, 1500)} for i in range(10)]}
        first = {"role": "user", "content": "Fix the failing test."}
        self.prefixes = PrefixCache(max_entries=conversations + 1)
        bodies = []
        for c in range(conversations):
            history = [first, {"role": "user", "content": _text(rng, 2048)}, {"role": "user", "content": _text(rng, 2048)}]
            body = json.dumps({"model": "m", **settings, "input": history}).encode()
            _, _, raw = reuse.decode_create(body, self.prefixes, "o")
            reg = reuse.registration(raw)
            entry = CachedResponse({"id": f"resp_{c}"}, Context(), len(history), False, owner="o")
            self.prefixes.put(Prefix(entry, len(history), b"fp%d" % c, 0, reg.raw, reuse.head_of(reg.raw), None, reg.lead))
            bodies.append((history, body))
        history = bodies[0][0] + [{"role": "user", "content": "next"}]
        self.body = json.dumps({"model": "m", **settings, "input": history}).encode()
        # correctness before timing: the first conversation's body is found, whole
        got = self.prefixes.by_body("o", self.body)
        assert got is not None and got[0].entry.response["id"] == "resp_0" and got[1] == len(bodies[0][1]) - 2

    def time_by_body(self, conversations: int) -> None:
        self.prefixes.by_body("o", self.body)


class AgentSettings:
    """Decoding a chained request that carries an agent's settings (13 KB of instructions and
    ten tools, 29 KB together, as ``hotloop bench paired --agent-settings`` sends): with the
    tools cache (``cached``: decoded and checked once, found by their bytes) and without it
    (``decoded``: every time), then validating it."""

    params = ["cached", "decoded"]
    param_names = ["tools"]

    def setup(self, tools: str) -> None:
        import json

        from hotloop.bench.turns import agent_settings
        from hotloop.pipeline.settings import ToolsCache
        from hotloop.state.prefix import PrefixCache

        self.body = json.dumps(
            {"model": "m", **agent_settings(), "previous_response_id": "resp_1", "input": [{"role": "user", "content": "next"}]}
        ).encode()
        self.prefixes = PrefixCache()
        self.tools = ToolsCache() if tools == "cached" else None
        # correctness before timing: the same request and functions either way
        plain = validate(decode_body(self.body))
        got = self._run()
        assert got.req == plain.req and got.function_tools == plain.function_tools

    def _run(self):
        from hotloop.pipeline import reuse

        return validate(reuse.decode_create(self.body, self.prefixes, "o", self.tools)[0])

    def time_decode_and_validate(self, tools: str) -> None:
        self._run()


class BackendRequestBody:
    """The chat-completions request body of a continued conversation (the Cerebras dialect):
    the cached messages of earlier turns and one new 2 KB tool output, at turn 1 and at turn 100
    (about 220 KB). Stateless chat backends need the whole history every turn, so this stays
    O(history) bytes; what the cache saves is rendering and encoding it again, and, in pieces
    (what the lean transport writes, one vectored write), copying it."""

    params = [1, 100]
    param_names = ["turn"]

    def setup(self, turn: int) -> None:
        import msgspec

        from hotloop.backends.base import BackendRequest
        from hotloop.backends.chat import CEREBRAS, RenderCache, encode_request, encode_request_parts
        from hotloop.protocol.request import decode_items

        rng = random.Random(0)
        self.cache = RenderCache(CEREBRAS)
        self.encode = encode_request
        self.encode_parts = encode_request_parts
        self.dialect = CEREBRAS
        items = decode_items([{"role": "user", "content": "Fix the failing test."}])
        base = BackendRequest(model="gpt-oss-120b", instructions="You are a coding agent.", items=[], tools=[], tool_choice="auto", parallel_tool_calls=True)
        for k in range(turn):
            items = items + decode_items([
                {"type": "function_call", "call_id": f"call_{k}", "name": "shell", "arguments": '{"cmd":"ls"}'},
                {"type": "function_call_output", "call_id": f"call_{k}", "output": _text(rng, 2048)},
            ])
            self.req = msgspec.structs.replace(base, items=items)
            body = encode_request(self.req, CEREBRAS, self.cache)
        # correctness before timing: the cached rendering gives the bytes of a rendering from scratch
        assert body == encode_request(self.req, CEREBRAS)
        assert len(body) > 2000 * turn

    def time_encode_request(self, turn: int) -> None:
        self.encode(self.req, self.dialect, self.cache)

    def time_encode_request_parts(self, turn: int) -> None:
        self.encode_parts(self.req, self.dialect, self.cache)


class DeltaEvent:
    def setup(self) -> None:
        p = validate(decode_body(b'{"model":"m","input":"x"}'))
        ids = IdGen(deterministic=True)
        self.turn = Turn(response_object(p, ids.new("resp"), 0), ids=ids, clock=lambda: 0.0)
        self.turn.start()
        self.turn.feed(TextDelta("warm"))
        self.chunk = TextDelta(" token")
        [frame] = self.turn.feed(self.chunk)
        assert ev.sse(frame).startswith(b"event: response.output_text.delta\ndata: {")
        self.sse = ev.sse

    def time_chunk_to_sse_frame(self) -> None:
        sse = self.sse
        for frame in self.turn.feed(self.chunk):
            sse(frame)


class ServerScenarios:
    """Real server, real sockets; one run each (values are medians inside the scenario)."""

    timeout = 300
    number = 1
    repeat = 1

    def track_ws_loop_cpu_p50_us(self) -> float:
        from hotloop.bench import bench_loop

        return float(bench_loop("ws-loop", 40, 2048)["server_cpu_per_turn_p50_us"])

    track_ws_loop_cpu_p50_us.unit = "us"  # type: ignore[attr-defined]

    def track_http_full_history_cpu_p50_us(self) -> float:
        from hotloop.bench import bench_loop

        return float(bench_loop("http-loop", 40, 2048)["server_cpu_per_turn_p50_us"])

    track_http_full_history_cpu_p50_us.unit = "us"  # type: ignore[attr-defined]

    def track_http_full_history_over_ws(self) -> float:
        from hotloop.bench import bench_loop

        return float(bench_loop("http-loop", 40, 2048)["http_over_ws_p50"])

    track_http_full_history_over_ws.unit = "ratio"  # type: ignore[attr-defined]

    def track_http_full_history_over_ws_process(self) -> float:
        from hotloop.bench import bench_loop

        return float(bench_loop("http-loop", 40, 2048)["process_http_over_ws_paired_p50"])

    track_http_full_history_over_ws_process.unit = "ratio"  # type: ignore[attr-defined]

    def track_stream_cpu_per_event_unpaced_us(self) -> float:
        from hotloop.bench import bench_stream

        return float(bench_stream(2000, 4000.0)["cpu_per_event_unpaced_us"])

    track_stream_cpu_per_event_unpaced_us.unit = "us"  # type: ignore[attr-defined]


