"""The agent loop's per-turn costs, at several history lengths (what ``hotloop bench loop`` measures
end to end, taken apart):

* ``PipelineTurn``: one tool-call turn through the whole in-process pipeline (decode, validate,
  prepare on top of the cached parent, the turn machine over 24 argument chunks, every event
  encoded as SSE, the finished cache entry), after 1 to 300 turns of 2 KB tool output.
* ``StoreTurn``: what ``store: true`` costs per turn on a real SQLite file in a temporary
  directory: writing one turn (its two own items, chained to its parent) and loading the whole
  history of a chain (a ``previous_response_id`` that missed the in-memory caches).
* ``LoopbackTurn``: one turn end to end over loopback against a real ``hotloop serve`` process
  (simulator, unpaced): ``ws-prev`` (WebSocket, ``previous_response_id``, only the new tool
  output) and ``http-full`` (``POST`` with the whole history). Wall time, client included.

Each ``setup`` checks the result before anything is timed.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hotloop.bench import _text
from hotloop.bench.turns import TOOL
from hotloop.pipeline import items as itemlib
from hotloop.pipeline.prepare import finished, prepare
from hotloop.protocol import events as ev
from hotloop.protocol.chunks import Finish, ToolCallDelta
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import decode_body, validate
from hotloop.protocol.turn import Turn

ARG_PIECES = ['{"cmd": "', *[" " + w for w in ("agent tool call result patch file test build error fix diff " * 2).split()], '"}']
HISTORY = [1, 10, 100, 300]


def _output(rng: random.Random, n: int = 2048) -> str:
    return _text(rng, n)


def _body(prev: str | None, call_id: str | None, text: str) -> bytes:
    if prev is None:
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": text}]
    else:
        items = [{"type": "function_call_output", "call_id": call_id, "output": text}]
    body: dict[str, Any] = {"model": "m", "tools": [TOOL], "input": items, "store": False}
    if prev is not None:
        body["previous_response_id"] = prev
    return json.dumps(body).encode()


def _pipeline_turn(parent: Any, body: bytes, ids: IdGen, cache: itemlib.TokenCache, n: int) -> tuple[list[bytes], Any]:
    """One tool-call turn: (its SSE frames, the finished cache entry)."""
    p = validate(decode_body(body))
    plan = prepare(p, parent, ids, cache)
    resp = response_object(p, ids.new("resp"), 0)
    turn = Turn(resp, ids=ids, clock=lambda: 0.0, input_tokens=plan.input_tokens)
    sse = ev.sse
    frames = [sse(f) for f in turn.start()]
    frames += [sse(f) for f in turn.feed(ToolCallDelta(index=0, call_id=f"call_{n}", name="run"))]
    for piece in ARG_PIECES:
        frames += [sse(f) for f in turn.feed(ToolCallDelta(index=0, arguments=piece))]
    frames += [sse(f) for f in turn.feed(Finish("tool_calls"))]
    return frames, finished(plan, resp, cache)


class PipelineTurn:
    params = HISTORY
    param_names = ["history_turns"]

    def setup(self, turns: int) -> None:
        rng = random.Random(0)
        self.ids = IdGen(deterministic=True)
        cache = itemlib.TokenCache()
        parent = None
        for n in range(turns):
            prev = parent.response["id"] if parent is not None else None
            _, parent = _pipeline_turn(parent, _body(prev, f"call_{n - 1}", _output(rng)), self.ids, cache, n)
        assert parent is not None
        self.parent = parent
        self.n = turns
        self.body = _body(parent.response["id"], f"call_{turns - 1}", _output(rng))
        # correctness before timing: the parent's context plus the output and the next call, and a
        # stream that ends completed with the call's whole arguments
        frames, entry = _pipeline_turn(parent, self.body, IdGen(deterministic=True), itemlib.TokenCache(), turns)
        assert len(entry.context) == len(parent.context) + 2, (len(entry.context), len(parent.context))
        assert frames[-1].startswith(b"event: " + ev.COMPLETED.encode()), frames[-1][:80]
        done = json.loads(frames[-1].split(b"data: ", 1)[1])
        assert json.loads(done["response"]["output"][0]["arguments"])["cmd"].startswith(" agent tool")

    def time_tool_call_turn(self, turns: int) -> None:
        # a fresh token cache each call: the new 2 KB really is tokenized every time
        _pipeline_turn(self.parent, self.body, self.ids, itemlib.TokenCache(16), self.n)


def _record(n: int, rid: str, parent: str | None, base: int, rng: random.Random, output: str | None = None) -> Any:
    from hotloop.state.store import StoredResponse

    items = [
        {"type": "function_call_output", "call_id": f"call_{n}", "output": _output(rng) if output is None else output},
        {"type": "function_call", "id": f"fc_{rid}", "call_id": f"call_{n + 1}", "name": "run", "status": "completed",
         "arguments": "".join(ARG_PIECES)},
    ]
    response = {"id": rid, "object": "response", "status": "completed", "model": "m", "output": [items[1]]}
    fps = [(n * 2 + 1).to_bytes(16, "little"), (n * 2 + 2).to_bytes(16, "little")]  # 16-byte, as served
    return StoredResponse(response, items, fps, [380, 26], 1, parent, base)


class StoreTurn:
    """``store: true`` on SQLite (synchronous=NORMAL, WAL, as served)."""

    params = HISTORY
    param_names = ["history_turns"]

    def setup(self, turns: int) -> None:
        from hotloop.state.store import SQLiteStore

        self.dir = tempfile.mkdtemp(prefix="hotloop-asv-")
        self.store = SQLiteStore(Path(self.dir) / "hotloop.db")
        rng = random.Random(0)
        parent: str | None = None
        for n in range(turns):
            rid = f"resp_{n:06d}"
            self.store.put(_record(n, rid, parent, 2 * n, rng))
            parent = rid
        assert parent is not None
        self.last = parent
        self.output = _output(rng)  # the timed write's tool output, made here: not timed
        self.rng = rng
        self.turns = turns
        self.count = 0
        # correctness before timing: the chain loads whole and in order
        hist = self.store.get(parent)
        assert hist is not None and len(hist.items) == 2 * turns
        assert [it["call_id"] for it in hist.items[::2]] == [f"call_{n}" for n in range(turns)]

    def teardown(self, turns: int) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def time_put_turn(self, turns: int) -> None:
        self.count += 1
        self.store.put(_record(self.turns, f"resp_x{self.count:08d}", self.last, 2 * self.turns, self.rng, self.output))

    def time_load_history(self, turns: int) -> None:
        self.store.get(self.last)


class LoopbackTurn:
    """A real server process on 127.0.0.1; history: the first user message, one call, its output."""

    params = ["ws-prev", "http-full"]
    param_names = ["transport"]
    timeout = 120
    repeat = (2, 5, 30.0)

    def setup(self, transport: str) -> None:
        import httpx
        from websockets.sync.client import connect

        from hotloop.bench import server

        self.stack = contextlib.ExitStack()
        base, _pid = self.stack.enter_context(server("--sim-rate", "0"))
        self.http = self.stack.enter_context(httpx.Client(base_url=base + "/v1", timeout=60))
        first: dict[str, Any] = {"model": "hotloop-sim", "tools": [TOOL], "tool_choice": "required", "store": False,
                 "input": [{"type": "message", "role": "user", "content": "Fix the failing test."}]}
        rng = random.Random(0)
        if transport == "ws-prev":
            self.ws = self.stack.enter_context(connect(base.replace("http", "ws", 1) + "/v1/responses", max_size=None, compression=None))
            # the parent is stored: every timed turn forks from it (the connection's cache holds
            # only its latest response, which the previous timed turn replaced)
            resp = self._ws({"type": ev.CLIENT_CREATE, **first, "store": True})
            call = resp["output"][0]
            self.frame = json.dumps({
                "type": ev.CLIENT_CREATE, "model": "hotloop-sim", "tools": [TOOL], "tool_choice": "required", "store": False,
                "previous_response_id": resp["id"],
                "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": _output(rng)}],
            })
            self.once = lambda: self._ws(self.frame)
        else:
            first["stream"] = True
            resp = self._post(json.dumps(first).encode())
            call = resp["output"][0]
            history = first["input"] + resp["output"] + [{"type": "function_call_output", "call_id": call["call_id"], "output": _output(rng)}]
            self.body = json.dumps({**first, "input": history}).encode()
            self.once = lambda: self._post(self.body)
        # correctness before timing: the timed turn completes with the next function call
        out = self.once()
        assert out["status"] == "completed" and out["output"][0]["type"] == "function_call", out

    def _ws(self, frame: Any) -> dict[str, Any]:
        self.ws.send(frame if isinstance(frame, str) else json.dumps(frame))
        while True:
            e = json.loads(self.ws.recv(timeout=60))
            if e["type"] == ev.COMPLETED:
                return e["response"]  # type: ignore[no-any-return]
            if e["type"] in (ev.FAILED, ev.ERROR):
                raise AssertionError(f"the turn failed: {e}")  # never time an error

    def _post(self, body: bytes) -> dict[str, Any]:
        r = self.http.post("/responses", content=body, headers={"content-type": "application/json"})
        r.raise_for_status()
        for line in reversed(r.content.split(b"\n")):  # the stream ends with the terminal event
            if line.startswith(b"data: {"):
                e = json.loads(line[6:])
                if e["type"] != ev.COMPLETED:
                    raise AssertionError(f"the turn failed: {e}")  # never time an error
                return e["response"]  # type: ignore[no-any-return]
        raise AssertionError(f"no event in {r.content[:200]!r}")

    def teardown(self, transport: str) -> None:
        self.stack.close()

    def time_turn(self, transport: str) -> None:
        self.once()
