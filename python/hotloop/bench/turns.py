"""``hotloop bench agent-turns``: server CPU and added wall time per tool-call turn, per transport.

The loop is a coding agent's: every turn the model answers with one function call and the client
sends back its output (``--new-bytes`` of text, default 2 KB). The model is the paced
chat-completions mock (:mod:`hotloop.bench.mockchat`, its own process), reached by hotloop's
Cerebras backend. Measured side by side in one run:

* ``direct``: the same loop against the mock with no Responses layer (raw HTTP/1.1 keep-alive,
  the whole chat history each turn): the floor every transport is compared with. Its wall time
  per turn is the baseline, and the mock's own CPU per turn is a yardstick for "one process
  streaming these chunks".
* ``relay floor``: the least any proxy of these streams does. One uvloop protocol reads each of
  the mock's chunks over a keep-alive connection and writes it, unparsed, to a client socket in
  another process; nothing is parsed, validated, counted or framed. Its CPU per turn (the
  request is a fixed 2 KB one) is the floor a Responses server's CPU per turn is compared with;
  the ``history`` floor is the same relay sending the direct loop's requests (the whole history
  each turn), what any proxy in front of a stateless chat backend writes.
* ``ws-prev``: one WebSocket, ``previous_response_id``, only the new tool output, ``store: false``.
* ``http-full``: ``POST`` with SSE, the whole history each turn, ``store: false``.
* ``http-prev``: ``POST`` with SSE, ``previous_response_id``, ``store: true`` on SQLite.
* ``http-refs`` (only when asked for; no naive proxy, which cannot resolve references): the
  Vercel AI SDK's tool loop with a reasoning model (the mock's ``-think`` models): ``POST`` with
  SSE, ``store: true`` on SQLite, the whole history each turn with every earlier reasoning item
  as an ``item_reference`` and each call spelled out without its id.

Server CPU is the whole server process (every thread: event loop, tokenizer, store writer), read
with nanosecond resolution from its CPU-time clock (:func:`hotloop.bench.process_cpu_ns`) after
each turn. Reported per
transport: p50 and mean CPU per turn, turns 6-15 against turns 91-100, a least-squares line's
last turn against its turn 10, and the same growth paired turn by turn with a short conversation
(:func:`_growth_paired`: the machine's drift cancels), and wall time per turn against direct (p50
of the per-turn differences).

``hotloop bench paired`` (:func:`bench_paired`) compares two versions of the server on one
transport: two servers (``--base-path`` and ``--server-path``, each a ``python/`` source tree put
first on its ``PYTHONPATH``; either may be left out for the installed one) on one mock, the same
conversation's turns alternating between them, each server's CPU read per turn. Both see the
same machine at the same time, so the median of the paired ratios (B's turn i over A's turn i)
shows differences of a few percent that separate runs on a noisy machine hide; a server against
itself gives about 1.00. Beside it: the ratio of the means, the ratio of 5%-trimmed means (a few
turns the machine stalled on move the mean by several percent: one run of a change measured at
0.95-0.98 over four others came out 1.27), and a 95% interval of the ratio of the means from a
moving-block bootstrap over the turn pairs (:func:`paired_summary`): an interval that holds 1.0
says the run cannot tell the two apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import httpx

from hotloop.bench import _free_port, _pct, _text, mock_process, process_cpu_ns, process_switches, server, thread_cpu_ns
from hotloop.protocol import events as ev

TOOL = {
    "type": "function",
    "name": "run",
    "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"], "additionalProperties": False},
    "strict": True,
}
CHAT_TOOL = {"type": "function", "function": {"name": "run", "description": TOOL["description"], "parameters": TOOL["parameters"], "strict": True}}
SETTINGS: dict[str, Any] = {"tools": [TOOL]}  # what every turn of the loops sends besides its input


def agent_settings() -> dict[str, Any]:
    """Instructions and tools of the size a coding agent resends every turn: about 14 KB of
    instructions and ten tool definitions, 29 KB of JSON together (``paired --agent-settings``)."""
    rng = random.Random(7)
    words = ["You", "are", "a", "coding", "agent.", "Use", "the", "tools", "to", "read,", "change", "and", "test", "code;", "explain", "what", "you", "did."]
    instructions = " ".join(rng.choice(words) for _ in range(2600))
    tools = [TOOL]
    for i in range(9):
        props = {f"arg{j}": {"type": "string", "description": "What this argument of the tool means, and how it is used. " * 2} for j in range(8)}
        tools.append({
            "type": "function", "name": f"tool_{i}", "description": "A tool the agent may call to do one kind of work. " * 6,
            "parameters": {"type": "object", "properties": props, "required": list(props), "additionalProperties": False},
            "strict": True,
        })
    return {"instructions": instructions, "tools": tools}
_COMPLETED = ('"' + ev.COMPLETED + '"').encode()  # matched near the start of an event's JSON
_FAILED = [('"' + t + '"').encode() for t in (ev.ERROR, ev.FAILED)]


@contextlib.contextmanager
def naive_process(upstream: str) -> Iterator[tuple[str, int]]:
    """The naive one-hop proxy (:mod:`hotloop.bench.naive`) in its own process: (base URL, pid)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "hotloop.bench.naive", "--port", str(port), "--upstream", upstream]
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the naive proxy did not start (is aiohttp installed? pip install 'hotloop[bench]')")
            time.sleep(0.05)
        yield base, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


class _RawClient:
    """A minimal keep-alive HTTP/1.1 client: what an efficient direct caller would cost."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post_stream(self, path: str, body: bytes) -> bytes:
        head = f"POST {path} HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        self.sock.sendall(head.encode() + body)
        buf = b""
        while not (buf.endswith(b"\r\n0\r\n\r\n") and b"data: [DONE]" in buf):
            data = self.sock.recv(65536)
            if not data:
                raise RuntimeError("the mock closed the connection")
            buf += data
        return buf

    def close(self) -> None:
        self.sock.close()


_SINK = (
    "import socket\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True)\n"
    "c, _ = s.accept()\n"
    "while c.recv(1 << 16):\n"
    "    pass\n"
)


def _history_bodies(model: str, turns: int, new_bytes: int, seed: int) -> Iterator[bytes]:
    """The request bodies of the direct loop's ``turns`` turns (:func:`_direct`, and the relay's
    history floor), one at a time, each built once the turn before it is over: the whole chat
    history each turn, one call (each answer is one) and its ``new_bytes`` of output more every turn."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for i in range(turns):
        yield json.dumps({"model": model, "messages": messages, "tools": [CHAT_TOOL], "stream": True,
                          "stream_options": {"include_usage": True}}).encode()
        call_id = f"call_{i}"
        messages.append({"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "run", "arguments": "{}"}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _output(rng, new_bytes)})


def relay_floor(url: str, model: str, turns: int, new_bytes: int | None = None, seed: int = 0) -> float:
    """CPU of a bare relay per turn of the mock's stream, in milliseconds (see the module
    docstring): this thread's CPU over ``turns`` requests on one keep-alive connection.

    ``new_bytes`` (not None): each request is the direct loop's of that turn (the whole history,
    growing by a call and ``new_bytes`` of output a turn; each built between two turns, off the
    clock), so the floor includes writing the history to the backend, which any proxy in front of
    a stateless chat backend does every turn; None: a fixed 2 KB request."""
    import asyncio

    import uvloop

    class _Relay(asyncio.Protocol):
        def __init__(self, sink: asyncio.BaseTransport) -> None:
            self.sink = sink
            self.done: asyncio.Future[None] | None = None

        def data_received(self, data: bytes) -> None:
            self.sink.write(data)  # type: ignore[attr-defined]
            if data.endswith(b"\r\n0\r\n\r\n") and self.done is not None and not self.done.done():
                self.done.set_result(None)

    async def run() -> float:
        loop = asyncio.get_running_loop()
        sink_proc = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE)
        try:
            assert sink_proc.stdout is not None
            sink_port = int(sink_proc.stdout.readline())
            sink, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", sink_port)
            port = int(url.rsplit(":", 1)[1])
            upstream, relay = await loop.create_connection(lambda: _Relay(sink), "127.0.0.1", port)
            for t in (sink, upstream):
                t.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            messages = [{"role": "user", "content": "x" * 2048}]
            fixed = json.dumps({"model": model, "messages": messages, "tools": [CHAT_TOOL], "stream": True,
                                "stream_options": {"include_usage": True}}).encode()
            bodies = _history_bodies(model, turns, new_bytes, seed) if new_bytes is not None else [fixed] * turns
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\n"

            def request(body: bytes) -> bytes:
                return head + b"content-length: %d\r\n\r\n%s" % (len(body), body)

            async def turn(data: bytes) -> float:
                """The relay's CPU for one turn (its request built before)."""
                t = time.thread_time()
                relay.done = loop.create_future()
                upstream.write(data)
                await asyncio.wait_for(relay.done, 60)
                return time.thread_time() - t

            for _ in range(3):  # warm-up
                await turn(request(fixed))
            cpu = 0.0
            for body in bodies:
                cpu += await turn(request(body))
            upstream.close()
            sink.close()
            return cpu * 1e3 / turns
        finally:
            sink_proc.terminate()
            sink_proc.wait(10)

    return uvloop.run(run())


def _output(rng: random.Random, nbytes: int) -> str:
    return _text(rng, nbytes)


def _direct(url: str, model: str, turns: int, new_bytes: int, seed: int) -> list[float]:
    """The loop against the mock directly (:func:`_history_bodies`); wall seconds per turn."""
    port = int(url.rsplit(":", 1)[1])
    client = _RawClient(port)
    walls = []
    try:
        for body in _history_bodies(model, turns, new_bytes, seed):
            t0 = time.perf_counter()
            raw = client.post_stream("/v1/chat/completions", body)
            walls.append(time.perf_counter() - t0)
            if b'"tool_calls"' not in raw:
                raise RuntimeError("the mock did not answer with a tool call")
    finally:
        client.close()
    return walls


def _call_of(response: dict[str, Any]) -> str:
    calls = [o for o in response["output"] if o.get("type") == "function_call"]
    if len(calls) != 1 or json.loads(calls[0]["arguments"]).get("cmd") is None:
        raise RuntimeError(f"expected one function call, got {response['output']!r}")
    return str(calls[0]["call_id"])


def _ws_prev(
    base: str, model: str, turns: int, new_bytes: int, seed: int, tick: Callable[[float], None], settings: dict[str, Any] = SETTINGS,
    output: Callable[[random.Random, int], str] = _output,
) -> None:
    from websockets.sync.client import connect

    rng = random.Random(seed)
    prev: str | None = None
    call_id = ""
    with connect(base.replace("http", "ws", 1) + "/v1/responses", max_size=None, compression=None) as ws:
        for i in range(turns):
            frame: dict[str, Any] = {"type": ev.CLIENT_CREATE, "model": model, "store": False, **settings}
            if prev is None:
                frame["input"] = "Fix the failing test."
            else:
                frame["previous_response_id"] = prev
                frame["input"] = [{"type": "function_call_output", "call_id": call_id, "output": output(rng, new_bytes)}]
            payload = json.dumps(frame)
            sent = time.perf_counter()
            ws.send(payload)
            while True:
                raw = ws.recv(timeout=120)
                data = raw.encode() if isinstance(raw, str) else raw
                head = data[:64]
                if _COMPLETED in head:
                    response = json.loads(data)["response"]
                    break
                if any(f in head for f in _FAILED):
                    raise RuntimeError(f"turn {i} failed: {data[:300]!r}")
            tick(sent)
            prev, call_id = response["id"], _call_of(response)


def _streamed(client: httpx.Client, body: dict[str, Any], i: int, tick: Callable[[float], None]) -> dict[str, Any]:
    """Turn ``i``: ``body`` posted with SSE, its wall time ticked; the completed response."""
    payload = json.dumps(body).encode()
    sent = time.perf_counter()
    with client.stream("POST", "/responses", content=payload, headers={"content-type": "application/json"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"turn {i}: HTTP {r.status_code}: {r.read()[:300]!r}")
        raw = r.read()
    tick(sent)
    return _sse_completed(raw)


def _sse_completed(raw: bytes) -> dict[str, Any]:
    for block in reversed(raw.split(b"\n\n")):
        for line in block.split(b"\n"):
            if line.startswith(b"data: ") and _COMPLETED in line[:72]:
                return json.loads(line[6:])["response"]  # type: ignore[no-any-return]
    raise RuntimeError(f"no {ev.COMPLETED} in the stream: {raw[-300:]!r}")


def _http_full(
    base: str, model: str, turns: int, new_bytes: int, seed: int, tick: Callable[[float], None], settings: dict[str, Any] = SETTINGS,
    output: Callable[[random.Random, int], str] = _output,
) -> None:
    _http(base, model, turns, new_bytes, seed, tick, False, settings, output)


def _http_prev(
    base: str, model: str, turns: int, new_bytes: int, seed: int, tick: Callable[[float], None], settings: dict[str, Any] = SETTINGS,
    output: Callable[[random.Random, int], str] = _output,
) -> None:
    _http(base, model, turns, new_bytes, seed, tick, True, settings, output)


def _http_refs(
    base: str, model: str, turns: int, new_bytes: int, seed: int, tick: Callable[[float], None], settings: dict[str, Any] = SETTINGS,
    output: Callable[[random.Random, int], str] = _output,
) -> None:
    """The AI SDK's loop (``http-refs``, module docstring), on the ``-think`` variant of ``model``."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "Fix the failing test."}]
    with httpx.Client(base_url=base + "/v1", timeout=120) as client:
        for i in range(turns):
            body = {"model": model + "-think", **settings, "stream": True, "store": True, "input": history}
            response = _streamed(client, body, i, tick)
            call_id = _call_of(response)
            for item in response["output"]:
                if item["type"] == "reasoning":
                    history.append({"type": "item_reference", "id": item["id"]})
                elif item["type"] == "function_call":
                    history.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
            history.append({"type": "function_call_output", "call_id": call_id, "output": output(rng, new_bytes)})


def _http_json(
    base: str, model: str, turns: int, new_bytes: int, seed: int, tick: Callable[[float], None], settings: dict[str, Any] = SETTINGS
) -> None:
    """Chained turns (``previous_response_id``, ``store: true``) as non-streaming JSON requests."""
    rng = random.Random(seed)
    prev: str | None = None
    new: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "Fix the failing test."}]
    with httpx.Client(base_url=base + "/v1", timeout=120) as client:
        for i in range(turns):
            body: dict[str, Any] = {"model": model, **settings, "store": True, "input": new}
            if prev is not None:
                body["previous_response_id"] = prev
            payload = json.dumps(body).encode()
            sent = time.perf_counter()
            r = client.post("/responses", content=payload, headers={"content-type": "application/json"})
            if r.status_code != 200:
                raise RuntimeError(f"turn {i}: HTTP {r.status_code}: {r.content[:300]!r}")
            tick(sent)
            response = r.json()
            prev = response["id"]
            new = [{"type": "function_call_output", "call_id": _call_of(response), "output": _output(rng, new_bytes)}]


def _http(
    base: str, model: str, turns: int, new_bytes: int, seed: int, tick: Callable[[float], None], chained: bool,
    settings: dict[str, Any] = SETTINGS, output: Callable[[random.Random, int], str] = _output,
) -> None:
    rng = random.Random(seed)
    history: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "Fix the failing test."}]
    prev: str | None = None
    new: list[dict[str, Any]] = list(history)
    with httpx.Client(base_url=base + "/v1", timeout=120) as client:
        for i in range(turns):
            body: dict[str, Any] = {"model": model, **settings, "stream": True}
            if chained:
                body.update(store=True, input=new)
                if prev is not None:
                    body["previous_response_id"] = prev
            else:
                body.update(store=False, input=history)
            response = _streamed(client, body, i, tick)
            call_id = _call_of(response)
            prev = response["id"]
            out = {"type": "function_call_output", "call_id": call_id, "output": output(rng, new_bytes)}
            history.extend(response["output"])
            history.append(out)
            new = [out]


def _summary(
    name: str, cpu_ns: list[int], walls: list[float], switches: int, direct: list[float], main_ns: list[int] | None = None
) -> dict[str, Any]:
    """``cpu_ns``: the whole process's CPU per turn; ``main_ns``: its main thread's (the event
    loop's), when measured: the rest is its other threads' (the store's writer, the tokenizer)."""
    cpu_ms = [c / 1e6 for c in cpu_ns]
    early = statistics.mean(cpu_ms[5:15]) if len(cpu_ms) >= 15 else statistics.mean(cpu_ms)
    late = statistics.mean(cpu_ms[-10:])
    added = [w - d for w, d in zip(walls, direct)]
    # Growth with the history, from a least-squares line through every turn's CPU: the line's
    # value at the last turn over its value at turn 10. The two windows above are 10 turns each,
    # and a stored turn's cost comes in store batches (one commit every ``--store-commit-delay``,
    # about every third turn here, about 1 ms each): a window holds 3 or 4 of them, which moves
    # their ratio by about 5% either way, and single noisy turns by more.
    fit = None
    if len(cpu_ms) >= 15:
        slope, intercept = statistics.linear_regression(range(1, len(cpu_ms) + 1), cpu_ms)
        at10 = intercept + slope * 10
        fit = round((intercept + slope * len(cpu_ms)) / at10, 3) if at10 > 0 else None
    out = {
        "server": name,
        "turns": len(cpu_ms),
        "cpu_per_turn_p50_ms": round(_pct(cpu_ms, 0.5), 3),
        "cpu_per_turn_mean_ms": round(statistics.mean(cpu_ms), 3),
        "cpu_turns_6_15_ms": round(early, 3),
        "cpu_last_10_ms": round(late, 3),
        "last_over_early": round(late / early, 3) if early else None,
        "fit_last_over_turn_10": fit,
        "switches_per_turn": round(switches / len(cpu_ms), 1),  # context switches: about its wake-ups
        "wall_per_turn_p50_ms": round(_pct(walls, 0.5) * 1e3, 2),
        "added_over_direct_p50_ms": round(_pct(added, 0.5) * 1e3, 3),
    }
    if main_ns:
        # means: the other threads' CPU comes in bursts (a store commit every few turns)
        main = statistics.mean(main_ns) / 1e6
        out["main_thread_cpu_per_turn_mean_ms"] = round(main, 3)
        # (the process's clock and its main thread's are read one after the other, and a
        # process's may lag a running thread's: over a few turns the difference can come out
        # below 0, which stands for none)
        out["other_threads_cpu_per_turn_mean_ms"] = round(max(0.0, statistics.mean(cpu_ms) - main), 3)
    return out


def _measure(
    base: str, pid: int, loop: Callable[..., None], model: str, turns: int, new_bytes: int, seed: int
) -> tuple[list[int], list[float], int, list[int]]:
    """The loop's ``turns`` turns after a warm-up: per turn the process's CPU, the wall time and
    its main thread's CPU; and the context switches over all of them."""
    loop(base, model, 3, new_bytes, seed + 1, lambda sent: None)  # warm-up: connections, tokenizer
    cpu: list[int] = []
    main: list[int] = []
    walls: list[float] = []
    switched = process_switches(pid)
    mark = [process_cpu_ns(pid), thread_cpu_ns(pid)]

    def tick(sent: float) -> None:
        walls.append(time.perf_counter() - sent)
        now_cpu = process_cpu_ns(pid)
        now_main = thread_cpu_ns(pid)
        cpu.append(now_cpu - mark[0])
        main.append(now_main - mark[1])
        mark[0], mark[1] = now_cpu, now_main

    loop(base, model, turns, new_bytes, seed, tick)
    return cpu, walls, process_switches(pid) - switched, main


AGENT_TRANSPORTS = ("ws-prev", "http-full", "http-prev")  # what agent-turns measures unless told


def bench_agent_turns(
    turns: int = 100, new_bytes: int = 2048, rate: float = 1000.0, tokens: int = 16, ttft_ms: int = 20,
    transport: str = "lean", seed: int = 0, naive: bool = True, only: tuple[str, ...] = AGENT_TRANSPORTS,
    store_prefill: int = 0, server_path: str | None = None,
) -> dict[str, Any]:
    """Every transport of ``only`` (keys of ``_LOOPS``) through hotloop, and (``naive``) through
    the naive proxy, in one run.

    ``store_prefill``: before the measured conversation, the server first serves one of that many
    turns (another conversation, not measured) on the transports that store (``http-prev``,
    ``http-json``), so the measured turns write into a store that is not empty. A store file that
    starts empty makes its first writes cheap: its B-trees are one page each, so a commit of three
    turns wrote 13 pages of WAL at the first turns and 42 at turn 100 (a replay of one
    conversation's records into ``SQLiteStore``), and a store that already holds a conversation
    writes about as many at its first turns as at its last. The growth from turns 6-15 to turns
    91-100 (``last_over_early``) is then the conversation's own growth, not the file's.
    ``server_path``: the ``python/`` tree hotloop's server runs from (another version's)."""
    model = f"bench-{rate:g}-{tokens}-tool-ttft{ttft_ms}"
    results: list[dict[str, Any]] = []
    with mock_process() as (url, mock_pid):
        _direct(url, model, 3, new_bytes, seed + 1)  # warm-up
        m0 = process_cpu_ns(mock_pid)
        direct = _direct(url, model, turns, new_bytes, seed)
        mock_cpu_ms = (process_cpu_ns(mock_pid) - m0) / 1e6 / turns
        floor_ms = relay_floor(url, model, turns)
        history_floor_ms = relay_floor(url, model, turns, new_bytes, seed)
        os.environ.setdefault("CEREBRAS_API_KEY", "bench")
        for name in only:
            extra, loop = _LOOPS[name]
            row: dict[str, Any] = {"transport": name}
            args = ("--backend", "cerebras", "--base-url", url, "--backend-transport", transport, *extra)
            with server(*args, pythonpath=server_path) as (base, pid):
                if store_prefill and name in _STORING:
                    loop(base, model, store_prefill, new_bytes, seed + 7, lambda sent: None)
                    row["store_prefill"] = store_prefill
                cpu, walls, switches, main = _measure(base, pid, loop, model, turns, new_bytes, seed)
                row["hotloop"] = _summary("hotloop", cpu, walls, switches, direct, main)
                stats = httpx.get(base + "/hotloop/stats", timeout=10).json()
                if name in _STORING:  # responses the server stored or has queued: the prefill's too
                    row["stored_responses"] = stats["store"]["written"] + stats["store"]["pending"]
                if name in _WHOLE:  # how the whole histories were matched (warm-up turns too)
                    row["prefix_cache"] = {k: stats["prefix_cache"][k] for k in ("hits", "raw_hits", "misses")}
                # (after the counts above: its two conversations are not the measured one)
                row["hotloop"]["growth_paired"] = _growth_paired(base, pid, loop, model, turns, new_bytes, seed)
            if naive and name not in _NO_NAIVE:
                with naive_process(url) as (base, pid):
                    cpu, walls, switches, main = _measure(base, pid, loop, model, turns, new_bytes, seed)
                    row["naive"] = _summary("naive", cpu, walls, switches, direct, main)
                    row["naive"]["growth_paired"] = _growth_paired(base, pid, loop, model, turns, new_bytes, seed)
                h, n = row["hotloop"], row["naive"]
                row["cpu_p50_hotloop_over_naive"] = round(h["cpu_per_turn_p50_ms"] / n["cpu_per_turn_p50_ms"], 3)
            results.append(row)
    return {
        "scenario": "agent-turns",
        "backend_transport": transport,
        "model": model,
        "new_bytes": new_bytes,
        "direct_wall_per_turn_p50_ms": round(_pct(direct, 0.5) * 1e3, 2),
        "mock_cpu_per_turn_ms": round(mock_cpu_ms, 3),
        "relay_floor_cpu_per_turn_ms": round(floor_ms, 3),
        "relay_history_floor_cpu_per_turn_ms": round(history_floor_ms, 3),
        "transports": [
            dict(
                row,
                cpu_p50_hotloop_over_relay_floor=round(row["hotloop"]["cpu_per_turn_p50_ms"] / floor_ms, 2),
                cpu_p50_hotloop_over_history_floor=round(row["hotloop"]["cpu_per_turn_p50_ms"] / history_floor_ms, 2),
            )
            for row in results
        ],
    }


_STORING = ("http-prev", "http-json", "http-refs")  # the transports whose turns are stored (store_prefill)
_NO_NAIVE = ("http-refs",)  # the naive proxy cannot resolve item_reference items
_WHOLE = ("http-full", "http-refs")  # the transports that send the whole history each turn
_LOOPS: dict[str, tuple[tuple[str, ...], Callable[..., None]]] = {
    "ws-prev": ((), _ws_prev),
    "http-full": ((), _http_full),
    "http-prev": (("--store", "sqlite"), _http_prev),
    "http-json": (("--store", "sqlite"), _http_json),
    "http-refs": (("--store", "sqlite"), _http_refs),
}


class _Stopped(Exception):
    pass


class _Stepper:
    """One of the turn loops in a thread of its own, one turn per :meth:`step`."""

    def __init__(
        self, loop: Callable[..., None], base: str, model: str, new_bytes: int, seed: int, settings: dict[str, Any] = SETTINGS
    ) -> None:
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._stop = False
        self._started = False
        self.error: BaseException | None = None
        self.walls: list[float] = []  # each turn's wall time, seconds (request sent to its end)

        def tick(sent: float) -> None:
            self.walls.append(time.perf_counter() - sent)
            self._done.release()
            self._go.acquire()
            if self._stop:
                raise _Stopped()

        def run() -> None:
            try:
                loop(base, model, 1 << 30, new_bytes, seed, tick, settings)
            except _Stopped:
                pass
            except BaseException as exc:  # noqa: BLE001 - reported by step()
                self.error = exc
                self._done.release()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def step(self, timeout: float = 120.0) -> None:
        if self._started:
            self._go.release()
        self._started = True
        if not self._done.acquire(timeout=timeout):
            raise RuntimeError(f"a turn took more than {timeout:g} s")
        if self.error is not None:
            raise RuntimeError(f"the turn loop failed: {self.error!r}") from self.error

    def close(self) -> None:
        self._stop = True
        self._go.release()
        self._thread.join(10)


SHORT_CHAIN = 10  # turns of each short conversation _growth_paired alternates with the long one


def _growth_paired(
    base: str, pid: int, loop: Callable[..., None], model: str, turns: int, new_bytes: int, seed: int
) -> float | None:
    """Growth with the history, measured against the machine's drift: a conversation of ``turns``
    turns on the server, each turn followed by one of a short conversation (a new one every
    ``SHORT_CHAIN`` turns, so its history stays small). Each long turn's CPU over that of the
    short turn right after it (the same moment of the machine); the median of those ratios over
    the last ten turns over their median over turns 6-15. (Medians: a store commit lands in
    either turn of a pair, about every third turn.) What the server does after a turn's answer
    (caching and registering it) counts in the other conversation's next turn: a growth of that
    work alone would be understated. (Waiting for the server's CPU to settle after each turn
    avoids that, but a server left idle between turns wakes at a cost that varies more: five
    runs of ``http-prev`` gave 0.83-1.21 that way against 1.07-1.11.) A machine that slows
    down or speeds up during the run moves both the same way, which a ratio of windows of one
    conversation (``last_over_early``, ``fit_last_over_turn_10``) takes for growth. None under
    15 turns."""
    if turns < 15:
        return None
    long_cpu: list[int] = []
    short_cpu: list[int] = []
    chain = _Stepper(loop, base, model, new_bytes, seed + 11)
    short: _Stepper | None = None
    try:
        mark = process_cpu_ns(pid)
        for k in range(turns):
            chain.step()
            now = process_cpu_ns(pid)
            long_cpu.append(now - mark)
            if k % SHORT_CHAIN == 0:
                if short is not None:
                    short.close()
                # (its first turn starts now; the other conversation waits for its next step)
                short = _Stepper(loop, base, model, new_bytes, seed + 101 + k)
            assert short is not None
            short.step()
            mark = process_cpu_ns(pid)
            short_cpu.append(mark - now)
    finally:
        chain.close()
        if short is not None:
            short.close()
    pairs = [a / b for a, b in zip(long_cpu, short_cpu) if b > 0]
    if len(pairs) < turns:
        return None
    early, late = _pct(pairs[5:15], 0.5), _pct(pairs[-10:], 0.5)
    return round(late / early, 3) if early > 0 else None


TRIM = 0.05  # each side's share of its cheapest and of its dearest turns paired_summary leaves out
BLOCK = 10  # turn pairs a bootstrap block holds: a store commit every few turns correlates neighbours
RESAMPLES = 2000


def _trimmed_mean(values: list[float], share: float) -> float:
    """The mean without the ``share`` cheapest and the ``share`` dearest values (whole values:
    none under ``1 / share``)."""
    k = int(len(values) * share)
    return statistics.fmean(sorted(values)[k : len(values) - k])


def _ratio(b: float, a: float) -> float | None:
    return round(b / a, 3) if a > 0 else None


def paired_summary(a: list[float], b: list[float], seed: int = 0, block: int = BLOCK) -> dict[str, Any]:
    """B against A from per-turn figures paired by position (B's turn i ran beside A's turn i):
    the median of the per-turn ratios, the ratio of the means, the ratio of the ``TRIM``-trimmed
    means (``None`` where A's is 0: a clock of 10 ms ticks), and a 95% interval of the ratio of
    the means (``None`` under two blocks of pairs).

    The interval is a moving-block bootstrap: ``RESAMPLES`` series as long as the run, each made
    of ``block`` consecutive pairs at random starts (the last one cut to length), so what
    neighbouring turns share (where the store's commits fall, the machine slowing for a while)
    stays inside a block; the 2.5th and 97.5th percentiles of their ratios of means (a series
    whose A sums to 0 counts as no ratio: it is left out). ``seed`` makes it reproducible."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    if n == 0 or statistics.fmean(a) <= 0:
        raise ValueError("paired_summary needs turns with CPU on A")
    out: dict[str, Any] = {
        "b_over_a_paired_median": round(statistics.median(y / x for x, y in zip(a, b) if x > 0), 3),
        "b_over_a_mean": round(statistics.fmean(b) / statistics.fmean(a), 3),
        "b_over_a_trimmed_mean": _ratio(_trimmed_mean(b, TRIM), _trimmed_mean(a, TRIM)),
        "b_over_a_mean_ci95": None,
    }
    if n >= 2 * block:
        rng = random.Random(seed)
        starts = range(n - block + 1)
        whole, rest = divmod(n, block)
        lengths = [block] * whole + ([rest] if rest else [])
        ratios = []
        for _ in range(RESAMPLES):
            sa = sb = 0.0
            for s, length in zip(rng.choices(starts, k=len(lengths)), lengths):
                sa += sum(a[s : s + length])
                sb += sum(b[s : s + length])
            if sa > 0:
                ratios.append(sb / sa)
        if len(ratios) >= RESAMPLES // 2:
            ratios.sort()
            k = len(ratios)
            out["b_over_a_mean_ci95"] = [round(ratios[int(0.025 * k)], 3), round(ratios[-int(0.025 * k) - 1], 3)]
    return out


def bench_paired(
    base_path: str | None, server_path: str | None, transport: str = "ws-prev", turns: int = 100,
    new_bytes: int = 2048, rate: float = 1000.0, tokens: int = 16, ttft_ms: int = 20, seed: int = 0,
    server_args: list[str] | tuple[str, ...] = (), server_env: dict[str, str] | None = None,
    agent: bool = False,
) -> dict[str, Any]:
    """Server A (``base_path``) against server B (``server_path``, with ``server_args`` and the
    environment variables ``server_env`` too), turn by turn (module docstring). ``agent``: every
    turn sends :func:`agent_settings` instead of one small tool."""
    model = f"bench-{rate:g}-{tokens}-tool-ttft{ttft_ms}"
    extra, loop = _LOOPS[transport]
    os.environ.setdefault("CEREBRAS_API_KEY", "bench")
    with contextlib.ExitStack() as stack:
        url, _ = stack.enter_context(mock_process())
        args = ("--backend", "cerebras", "--base-url", url, *extra)
        servers = [
            stack.enter_context(server(*args, *more, pythonpath=p, env=e))
            for p, more, e in ((base_path, (), None), (server_path, tuple(server_args), server_env))
        ]
        steppers = []
        for base, _ in servers:
            st = _Stepper(loop, base, model, new_bytes, seed, agent_settings() if agent else SETTINGS)
            stack.callback(st.close)
            steppers.append(st)
        for _ in range(5):  # warm-up: connections, caches, the tokenizer
            for st in steppers:
                st.step()
        for st in steppers:
            st.walls.clear()
        marks = [process_cpu_ns(pid) for _, pid in servers]
        cpu: list[list[float]] = [[], []]
        for k in range(turns):
            for i in ((0, 1) if k % 2 == 0 else (1, 0)):  # neither always goes first
                steppers[i].step()
                # from the end of this server's previous turn: what it did after answering
                # (storage, the ledger) while the other server ran counts as well
                now = process_cpu_ns(servers[i][1])
                cpu[i].append((now - marks[i]) / 1e6)
                marks[i] = now
    walls = [st.walls for st in steppers]
    side = [
        {
            "server": name,
            "python_path": path or "(installed)",
            "cpu_per_turn_p50_ms": round(_pct(c, 0.5), 3),
            "cpu_per_turn_mean_ms": round(statistics.mean(c), 3),
            "wall_per_turn_p50_ms": round(_pct(w, 0.5) * 1e3, 3),
        }
        for name, path, c, w in (("A", base_path, cpu[0], walls[0]), ("B", server_path, cpu[1], walls[1]))
    ]
    return {
        "scenario": "paired",
        "transport": transport,
        "model": model,
        "turns": turns,
        "server_b_args": list(server_args),
        "server_b_env": dict(server_env or {}),
        "agent_settings": agent,
        "servers": side,
        **paired_summary(cpu[0], cpu[1]),
        # the same turn's wall time on B minus on A (the mock's pacing is the same for both)
        "b_minus_a_wall_paired_median_ms": round(statistics.median(b - a for a, b in zip(*walls)) * 1e3, 3),
    }
