"""``hotloop bench``: agent-loop benchmarks against a real server process.

The benchmark starts ``hotloop serve`` (simulator backend) on a free loopback port, drives it from
this process over real sockets, and reads the server's own per-response CPU accounting from
``GET /hotloop/stats`` (event-loop thread CPU from the moment a request arrives to its terminal
event), so client-side costs never count as server costs.

Scenarios:

* ``stream``: one WebSocket response of ``--tokens`` tokens at ``--rate`` tokens/s. Reports the
  delivered rate, server CPU per delta event and the server's share of a core while streaming.
* ``stream-cerebras``: the same through hotloop's Cerebras backend, against a paced
  chat-completions mock in its own process (:mod:`hotloop.bench.mockchat`).
* ``ws-loop``: ``--turns`` WebSocket turns chained with ``previous_response_id``, each adding
  ``--new-bytes`` of new input (the history grows to turns x new-bytes). Reports per-turn server
  CPU (p50, p90) and the ratio of the last turns to the first.
* ``http-loop``: the same conversation over HTTP, the client resending the full history each turn
  (no ``previous_response_id``): prefix reuse through the token cache. Both loops run the server
  on a CPU of its own where there are two or more (:func:`split_cpus`; ``--no-pin``).
* ``overhead``: a 20-turn agent loop at 1,000 tokens/s through hotloop (Cerebras backend, paced
  mock) against the same loop talking to the mock directly: the end-to-end cost of hotloop.
* ``agent-turns`` (:mod:`hotloop.bench.turns`): server CPU and added wall time per tool-call turn
  through the Cerebras backend, per transport (WebSocket continuation, HTTP full history, HTTP
  ``previous_response_id`` on SQLite), beside the same loop against the model directly and
  through a naive one-hop proxy (:mod:`hotloop.bench.naive`, needs ``hotloop[bench]``).
* ``http-throughput`` and ``store-cpu`` (:mod:`hotloop.bench.scaleout`, not part of ``all``): HTTP
  turns per second with 1 and 2 ``--workers``; server CPU per stored turn, SQLite against Redis.
* ``idle-ws`` and ``ws-fanout`` (:mod:`hotloop.bench.wsload`): server memory per idle WebSocket
  connection, and server CPU per delta event with many concurrent WebSocket streams.
* ``classify-turns`` (:mod:`hotloop.bench.classifyturns`, not part of ``all``): the secrets
  classifier's time per turn (``--secrets redact``, the ``classify`` and ``prepare`` stages of
  ``/metrics``) over a growing conversation, per transport: turns 6-15 against the last ten.
* ``loop`` (:mod:`hotloop.bench.loop`, its own options: ``hotloop bench loop -h``): scripted agent
  loops over the four transports against the direct floor, every stream and turn checked, against
  a hotloop started here or any Responses server by URL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import httpx

from hotloop.protocol import events as ev

_WORDS = "agent tool call result patch file test build error fix diff line code review loop".split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_switches(pid: int) -> int:
    """Context switches of ``pid``'s live threads so far, voluntary and not (``/proc/<pid>/task``):
    about one per time the server went idle and woke. Each costs a switch and a thread that meets
    cold caches, so it is the count to cut when a turn's CPU goes to waking up; unlike CPU time,
    it hardly varies from run to run. 0 where there is no ``/proc``."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                for line in fh:
                    if "ctxt_switches:" in line:  # voluntary_ctxt_switches, nonvoluntary_ctxt_switches
                        total += int(line.rsplit(None, 1)[-1])
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return total


def process_cpu_ns(pid: int) -> int:
    """CPU time of ``pid`` so far, every thread's, those that have exited included, in
    nanoseconds: the process's CPU-time clock (Linux: ``clock_getcpuclockid``, whose id is
    ``~pid << 3 | 2``). The sum of its live threads' schedstat lost an exited thread's time;
    ``/proc/<pid>/stat`` counts whole clock ticks (10 ms), the fallback where there is neither."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)
    except OSError:
        return _stat_ns(f"/proc/{pid}/stat")


def _stat_ns(path: str) -> int:
    """User plus system time of a ``/proc`` ``stat`` file (a process's or a thread's), in whole
    clock ticks, as nanoseconds."""
    with open(path) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def thread_cpu_ns(pid: int, tid: int | None = None) -> int:
    """CPU time of one thread of ``pid`` so far (by default its main thread, whose id is the
    process's), in nanoseconds. A thread of this process: its CPU-time clock (Linux:
    ``~tid << 3 | 6``). Another process's (Linux lets a process read only its own threads'
    clocks): ``/proc/<pid>/task/<tid>/schedstat``, to the nanosecond, or where a kernel has no
    schedstat, the whole clock ticks of ``/proc/<pid>/task/<tid>/stat``."""
    tid = pid if tid is None else tid
    if pid == os.getpid():
        with contextlib.suppress(OSError):
            return time.clock_gettime_ns(((~tid) << 3) | 6)
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
            return int(fh.read().split()[0])
    except FileNotFoundError:
        return _stat_ns(f"/proc/{pid}/task/{tid}/stat")


def _proc_cpu_seconds(pid: int) -> float:
    """CPU of a process so far, in seconds (:func:`process_cpu_ns`: to the nanosecond, where the
    ticks of ``/proc/<pid>/stat`` quantised a 20,000-event run to 0.5 us an event)."""
    return process_cpu_ns(pid) / 1e9


@contextlib.contextmanager
def server(
    *args: str, pythonpath: str | None = None, env: dict[str, str] | None = None, cpus: set[int] | None = None
) -> Iterator[tuple[str, int]]:
    """A ``hotloop serve`` subprocess; yields (base_url, pid).

    ``pythonpath``: a directory put first on the server's ``PYTHONPATH`` (another source tree's
    ``python/`` directory, to compare two versions of the server in one run). ``env``: more
    environment variables for the server (a tuning to compare, such as ``GLIBC_TUNABLES``).
    ``cpus``: the CPUs the server's threads may run on (:func:`split_cpus`).
    """
    port = _free_port()
    data = tempfile.mkdtemp(prefix="hotloop-bench-")
    cmd = [sys.executable, "-m", "hotloop", "serve", "--port", str(port), "--store", "memory", "--log-level", "warning", *args]
    env = {**os.environ, **(env or {}), "HOTLOOP_DATA_DIR": data}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, env=env)
    if cpus:
        # Popen returns once the child has started the interpreter, before it starts a thread;
        # threads inherit their creator's CPUs (each thread is set again once it is up, below)
        os.sched_setaffinity(proc.pid, cpus)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError("the server exited during start-up")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start within 30 s")
            time.sleep(0.05)
        if cpus:
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                with contextlib.suppress(OSError):  # a thread that has ended since
                    os.sched_setaffinity(int(tid), cpus)
        yield base, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)  # its store and fingerprint key


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(the server's CPU, the client's CPUs) when this process may run on two or more: the last
    CPU for the server, the others for the client. None on a single CPU.

    A client that shares a core with the server makes the server slower: its own work between
    turns (encoding a request, decoding an answer) evicts the server's data from the core's
    caches, so the server's next turn costs more. Measured on a 2-vCPU VM: a client that
    JSON-encodes 200 KB between its WebSocket turns raised the server's CPU per turn by 28% when
    the two could share a core, and by about 14% with each on a CPU of its own."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    return {allowed[-1]}, set(allowed[:-1])


@contextlib.contextmanager
def client_cpus(cpus: set[int] | None) -> Iterator[None]:
    """This process (and the threads it starts meanwhile) on ``cpus``, restored afterwards."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _stats(base: str) -> list[dict[str, Any]]:
    return list(httpx.get(base + "/hotloop/stats", timeout=10).json()["turns"])


def _token_hits(base: str) -> int:
    return int(httpx.get(base + "/hotloop/stats", timeout=10).json()["token_cache"]["hits"])


def _text(rng: random.Random, nbytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < nbytes:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:nbytes]


def _env_pair(pair: str) -> tuple[str, str]:
    """One ``--server-env`` value: ``NAME=VALUE``."""
    name, sep, value = pair.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {pair!r}")
    return name, value


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _stream_once(ws: Any, model: str, sim: str | None = None) -> tuple[int, float]:
    """One response over an open WebSocket; (delta events, seconds from first to last delta)."""
    frame: dict[str, Any] = {"type": ev.CLIENT_CREATE, "model": model, "input": "go", "store": False}
    if sim is not None:
        frame["metadata"] = {"sim": sim}
    ws.send(json.dumps(frame))
    deltas = 0
    first = last = 0.0
    while True:
        e = json.loads(ws.recv(timeout=120))
        if e["type"] == ev.OUTPUT_TEXT_DELTA:
            now = time.perf_counter()
            if deltas == 0:
                first = now
            last = now
            deltas += 1
        elif e["type"] == ev.COMPLETED:
            return deltas, max(last - first, 1e-9)
        elif e["type"] in (ev.ERROR, ev.FAILED):
            raise RuntimeError(f"stream failed: {e}")


def wait_listening(port: int, proc: subprocess.Popen[Any], what: str, timeout: float = 30.0) -> None:
    """Until ``proc`` accepts connections on ``port``; RuntimeError if it exits or times out."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.05)


@contextlib.contextmanager
def mock_process(tls: bool = False) -> Iterator[tuple[str, int]]:
    """The paced chat-completions mock (:mod:`hotloop.bench.mockchat`) in its own process:
    (base URL without /v1, pid). ``tls``: served over TLS with a certificate from a throwaway
    CA (trustme), which the servers started meanwhile trust through ``SSL_CERT_FILE``, as the
    lean transport and httpx read it (set in this process's environment, which they inherit,
    until the mock stops)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "hotloop.bench.mockchat", "--port", str(port)]
    with contextlib.ExitStack() as stack:
        url = f"http://127.0.0.1:{port}"
        if tls:
            try:
                import trustme
            except ImportError:
                raise SystemExit("--mock-tls needs trustme: pip install 'hotloop[bench]'") from None
            d = stack.enter_context(tempfile.TemporaryDirectory(prefix="hotloop-mock-tls-"))
            ca = trustme.CA()
            ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(f"{d}/server.pem")
            ca.cert_pem.write_to_path(f"{d}/ca.pem")
            cmd += ["--certfile", f"{d}/server.pem"]
            stack.enter_context(_environ("SSL_CERT_FILE", f"{d}/ca.pem"))
            url = f"https://localhost:{port}"
        proc = subprocess.Popen(cmd)
        try:
            wait_listening(port, proc, "the mock chat server")
            yield url, proc.pid
        finally:
            proc.terminate()
            proc.wait(10)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def mock_chat(tls: bool = False) -> Iterator[str]:
    """:func:`mock_process`, its URL only."""
    with mock_process(tls) as (url, _pid):
        yield url


def bench_stream(tokens: int, rate: float, backend: str = "simulator", tls: bool = False) -> dict[str, Any]:
    """At the model's rate (core share) and unpaced (CPU per chunk-in/frame-out), one run.

    ``backend="cerebras"`` runs hotloop's Cerebras backend against the paced mock instead of the
    simulator: the SDK client, request rendering and SSE parsing are then part of the measure
    (``tls``: the mock over TLS).
    """
    from websockets.sync.client import connect

    paced: tuple[str, str | None]
    unpaced: tuple[str, str | None]
    warm: tuple[str, str | None]
    with contextlib.ExitStack() as stack:
        if backend == "cerebras":
            url = stack.enter_context(mock_chat(tls))
            os.environ.setdefault("CEREBRAS_API_KEY", "bench")
            base, pid = stack.enter_context(server("--backend", "cerebras", "--base-url", url))
            paced = (f"bench-{rate:g}-{tokens}", None)
            unpaced = (f"bench-0-{tokens}", None)
            warm = ("bench-0-200", None)
        else:
            base, pid = stack.enter_context(server("--sim-rate", str(rate)))
            paced = ("hotloop-sim", f"tokens:{tokens}")
            unpaced = ("hotloop-sim", f"tokens:{tokens},rate:0")
            warm = ("hotloop-sim", "tokens:200,rate:0")
        ws_url = base.replace("http", "ws", 1) + "/v1/responses"
        with connect(ws_url, max_size=None, compression=None) as ws:
            _stream_once(ws, *warm)
            cpu0 = _proc_cpu_seconds(pid)
            deltas, wall = _stream_once(ws, *paced)
            proc_cpu = _proc_cpu_seconds(pid) - cpu0
            at_rate = _stats(base)[-1]
            _stream_once(ws, *unpaced)
            fast = _stats(base)[-1]
    out: dict[str, Any] = {
        "scenario": "stream" if backend == "simulator" else f"stream-{backend}",
        "tokens": deltas,
        "target_rate": rate,
        "delivered_rate": round((deltas - 1) / wall, 1),
        "server_loop_core_share": round(at_rate["cpu_us"] / 1e6 / wall, 4),
        "server_process_core_share": round(proc_cpu / wall, 4),
        "cpu_per_event_at_rate_us": round(at_rate["cpu_us"] / at_rate["events"], 2),
        "cpu_per_event_unpaced_us": round(fast["cpu_us"] / fast["events"], 2),
    }
    if backend == "cerebras":
        out["mock_tls"] = tls
    return out


def _output_keys(output: list[dict[str, Any]]) -> list[str]:
    """What tells a response's output items apart for the server's token cache: each item
    without its id and status (the fields :func:`hotloop.pipeline.items.semantic_view` leaves out)."""
    return [json.dumps({k: v for k, v in o.items() if k not in ("id", "status")}, sort_keys=True) for o in output]


def _chained_turn(ws: Any, frame: dict[str, Any], prev: str | None, outputs: list[str] | None = None) -> str:
    """Send one ``response.create`` continuing ``prev``; wait for completion; the new id. The
    response's output items go to ``outputs`` (:func:`_output_keys`)."""
    if prev:
        frame["previous_response_id"] = prev
    ws.send(json.dumps(frame))
    while True:
        e = json.loads(ws.recv(timeout=120))
        if e["type"] == ev.COMPLETED:
            if outputs is not None:
                outputs.extend(_output_keys(e["response"]["output"]))
            return str(e["response"]["id"])
        if e["type"] in (ev.ERROR, ev.FAILED):
            raise RuntimeError(f"turn failed: {e}")


def _ws_turns(base: str, turns: int, new_bytes: int, seed: int, outputs: list[str] | None = None) -> Iterator[None]:
    """Chained WebSocket turns, one per ``next()``; their output items go to ``outputs``."""
    from websockets.sync.client import connect

    rng = random.Random(seed)
    ws_url = base.replace("http", "ws", 1) + "/v1/responses"
    prev: str | None = None
    with connect(ws_url, max_size=None, compression=None) as ws:
        for _ in range(turns):
            frame = {
                "type": ev.CLIENT_CREATE,
                "model": "hotloop-sim",
                "store": False,
                "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": _text(rng, new_bytes)}]}],
                "metadata": {"sim": "text,tokens:16"},
            }
            prev = _chained_turn(ws, frame, prev, outputs)
            yield None


class HistoryBody:
    """The JSON body of a request that resends its whole history, built as items are added: the
    bytes ``json.dumps`` (compact, as httpx's ``json=`` and most clients write it) makes of
    ``{**before, "input": items, **after}``, without encoding the history again each turn.

    A load generator's own work lands on the machine it shares with the server: encoding 200 KB
    of history a turn cost the client about as much CPU as the server's whole turn, and slowed
    the server's next turn (see :func:`split_cpus`). A real client does that encoding on its
    own machine."""

    def __init__(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        self._head = _compact(before)[:-1] + (b',"input":[' if before else b'"input":[')
        self._tail = b"]" + (b"," + _compact(after)[1:] if after else b"}")
        self._items = bytearray()

    def add(self, item: dict[str, Any]) -> None:
        if self._items:
            self._items += b","
        self._items += _compact(item)

    def body(self) -> bytes:
        return b"".join((self._head, self._items, self._tail))


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _http_turns(base: str, turns: int, new_bytes: int, seed: int, outputs: list[str] | None = None) -> Iterator[tuple[int, int]]:
    """A client resending its whole history, one turn per ``next()``: ``(input_tokens,
    cached_tokens)`` of each; the output items go to ``outputs``."""
    rng = random.Random(seed)
    history = HistoryBody({"model": "hotloop-sim", "store": False}, {"metadata": {"sim": "text,tokens:16"}})
    with httpx.Client(base_url=base + "/v1", timeout=60) as client:
        for _ in range(turns):
            history.add({"type": "message", "role": "user", "content": [{"type": "input_text", "text": _text(rng, new_bytes)}]})
            r = client.post("/responses", content=history.body(), headers={"content-type": "application/json"})
            r.raise_for_status()
            body = r.json()
            u = body["usage"]
            for item in body["output"]:
                history.add(item)
            if outputs is not None:
                outputs.extend(_output_keys(body["output"]))
            yield int(u["input_tokens"]), int(u["input_tokens_details"]["cached_tokens"])


def _ws_loop(base: str, turns: int, new_bytes: int, seed: int, outputs: list[str] | None = None) -> None:
    for _ in _ws_turns(base, turns, new_bytes, seed, outputs):
        pass


def _http_loop(base: str, turns: int, new_bytes: int, seed: int, outputs: list[str] | None = None) -> list[tuple[int, int]]:
    """A client resending its whole history each turn; ``(input_tokens, cached_tokens)`` per turn."""
    return list(_http_turns(base, turns, new_bytes, seed, outputs))


def bench_loop(
    kind: str, turns: int, new_bytes: int, seed: int = 0, server_path: str | None = None, pin: bool = True, gap: float = 0.0
) -> dict[str, Any]:
    """``ws-loop``: chained WebSocket turns. ``http-loop``: a client resending its whole history
    over HTTP (prefix reuse) and, on the same server, the same conversation as chained WebSocket
    turns, the two interleaved turn by turn (so that a machine slowing down for a while slows
    both alike), reporting the cached tokens and the ratio of the two costs.

    ``pin``: the server on one CPU and this client on the others (:func:`split_cpus`), where
    there are two or more. ``gap``: seconds the client waits after each turn (after the turn's
    reading), as an agent's tool runs between its turns; 0: the next turn at once.

    Both conversations' turns are measured alike, so the ratio compares them; but a turn after
    an idle gap costs more (this VM: about 0.5 ms more for either kind after 30 ms, caches and
    the CPU's idle state), which the ratio then divides by. ``process_http_extra_last10_us``
    (what an HTTP turn costs over its WebSocket pair, in us) does not move with it."""
    usage: list[tuple[int, int]] = []
    ws_cpu: list[float] = []
    # The two conversations of ``http-loop`` have texts of their own (another seed, the same
    # sizes): with the same texts, the turn that came second found the first one's token counts
    # in the process-wide token cache and skipped its tokenizing (at 2 KB a turn, about a third
    # of a WebSocket turn's CPU), which made the WebSocket turn look cheaper than it is.
    ws_seed = seed + 3
    # The whole server process's CPU from each turn's request to its answer (every thread, the
    # request's reading and parsing and the response's writing included): the per-turn figures
    # from the server's own marks begin once the request's task runs and the turn is known.
    proc: list[float] = []
    proc_ws: list[float] = []
    # Every output item the server answered, in order. The simulator draws each answer from a
    # corpus of a few thousand positions, so two answers of the two conversations are sometimes
    # the same text (a few runs in a hundred), and the second one's count is then rightly found in
    # the token cache: such repeats are counted apart from the hits on the conversations' texts.
    outputs: list[str] = []
    cpus = split_cpus() if pin else None
    server_cpus, own_cpus = cpus if cpus else (None, None)
    with server("--sim-rate", "0", pythonpath=server_path, cpus=server_cpus) as (base, pid), client_cpus(own_cpus):
        (_ws_loop if kind == "ws-loop" else _http_loop)(base, 3, new_bytes, seed + 1, outputs)  # warm-up
        if kind == "http-loop":
            _ws_loop(base, 3, new_bytes, seed + 2, outputs)
        skip = len(_stats(base))
        hits0 = _token_hits(base)
        seen = len(outputs)
        if kind == "ws-loop":
            for _ in _timed(_ws_turns(base, turns, new_bytes, seed, outputs), pid, proc, gap):
                pass
        else:
            hi = _timed(_http_turns(base, turns, new_bytes, seed, outputs), pid, proc, gap)
            wi = _timed(_ws_turns(base, turns, new_bytes, ws_seed, outputs), pid, proc_ws, gap)
            for u, _ in zip(hi, wi):
                usage.append(u)
        stats = _stats(base)[skip:]
        hits = _token_hits(base) - hits0
        # turn_stats' transport: "ws" for WebSocket turns, "json" for non-streaming HTTP
        cpu = [t["cpu_us"] for t in stats if (t["transport"] == "ws") == (kind == "ws-loop")]
        ws_cpu = [t["cpu_us"] for t in stats if t["transport"] == "ws"] if kind == "http-loop" else []
    # measured outputs equal to one answered before (in this run, warm-up included)
    repeated = (len(outputs) - seen) - (len(set(outputs)) - len(set(outputs[:seen])))
    head = statistics.mean(cpu[:5])
    tail = statistics.mean(cpu[-5:])
    out: dict[str, Any] = {
        "scenario": kind,
        "turns": len(cpu),
        "history_bytes": turns * new_bytes,
        "pinned": cpus is not None,
        "gap_ms": round(gap * 1e3, 3),
        "server_cpu_per_turn_p50_us": round(_pct(cpu, 0.5), 1),
        "server_cpu_per_turn_p90_us": round(_pct(cpu, 0.9), 1),
        "first5_mean_us": round(head, 1),
        "last5_mean_us": round(tail, 1),
        "last_over_first": round(tail / head, 3),
        "process_cpu_per_turn_p50_us": round(_pct(proc, 0.5), 1),
        "process_last5_mean_us": round(statistics.mean(proc[-5:]), 1),
        # token counts found in the server's cache during the measured turns, and how many of
        # them were answers repeating an earlier answer's text (each conversation counts its own
        # texts: the difference is 0 unless an input text repeats)
        "token_cache_hits": hits,
        "repeated_outputs": repeated,
    }
    if usage:
        tail_ws = statistics.mean(ws_cpu[-5:])
        out.update(
            {
                "cached_tokens_last": usage[-1][1],
                "input_tokens_last": usage[-1][0],
                "cached_share_last": round(usage[-1][1] / max(1, usage[-1][0]), 4),
                "turns_with_cached_tokens": sum(1 for _, c in usage if c > 0),
                "ws_cpu_per_turn_p50_us": round(_pct(ws_cpu, 0.5), 1),
                "ws_last5_mean_us": round(tail_ws, 1),
                "http_over_ws_p50": round(_pct(cpu, 0.5) / _pct(ws_cpu, 0.5), 3),
                "http_over_ws_last5": round(tail / tail_ws, 3),
                # turn i over HTTP against turn i over WebSocket, run one after the other
                "http_over_ws_paired_p50": round(_pct([h / w for h, w in zip(cpu, ws_cpu)], 0.5), 3),
                # the same from the whole process's CPU
                "process_ws_cpu_per_turn_p50_us": round(_pct(proc_ws, 0.5), 1),
                "process_http_over_ws_paired_p50": round(_pct([h / w for h, w in zip(proc, proc_ws)], 0.5), 3),
                "process_http_over_ws_last5": round(statistics.mean(proc[-5:]) / statistics.mean(proc_ws[-5:]), 3),
                # the last ten pairs (the longest history), turn by turn: steadier than five means
                "process_http_over_ws_last10_paired_p50": round(_pct([h / w for h, w in zip(proc[-10:], proc_ws[-10:])], 0.5), 3),
                # the same pairs' difference: what an HTTP turn costs over its WebSocket pair (us)
                "process_http_extra_last10_us": round(_pct([h - w for h, w in zip(proc[-10:], proc_ws[-10:])], 0.5), 1),
            }
        )
    return out


# What a repeated loop reports for each of its runs, besides the medians of every figure
_RUN_KEYS = (
    "process_http_over_ws_paired_p50", "process_http_over_ws_last5", "process_http_over_ws_last10_paired_p50",
    "process_http_extra_last10_us", "http_over_ws_paired_p50", "server_cpu_per_turn_p50_us", "process_cpu_per_turn_p50_us",
)


def bench_loop_repeated(
    kind: str, turns: int, new_bytes: int, repeat: int, server_path: str | None = None, pin: bool = True, gap: float = 0.0
) -> dict[str, Any]:
    """:func:`bench_loop` ``repeat`` times, each on a server of its own with the same texts: the
    median of each figure over the runs, and each run's main figures (``runs``). One run's last
    ten pairs are ten samples, which move by 0.1 on this kind of machine from one run to the next."""
    outs = [bench_loop(kind, turns, new_bytes, server_path=server_path, pin=pin, gap=gap) for _ in range(repeat)]
    if repeat == 1:
        return outs[0]
    merged: dict[str, Any] = {"scenario": kind, "repeats": repeat}
    for key, value in outs[0].items():
        if key == "scenario":
            continue
        values = [o[key] for o in outs]
        merged[key] = round(statistics.median(values), 4) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    merged["runs"] = [{k: o[k] for k in _RUN_KEYS if k in o} for o in outs]
    return merged


# A turn's bookkeeping (caching, registering its input, the store's queue) runs right after its
# answer is written: a reading taken as soon as the client has the answer would count some of it
# in the next turn (of the other conversation). The server is idle once it is done.
_SETTLE = 0.003


def _timed(turns: Iterator[Any], pid: int, into: list[float], gap: float = 0.0) -> Iterator[Any]:
    """``turns``, each turn's whole-process server CPU (us) appended to ``into`` (read once the
    server has finished the turn's bookkeeping: ``_SETTLE``); then ``gap`` seconds of client
    time (a tool running) before the next turn."""

    while True:
        c = process_cpu_ns(pid)
        try:
            got = next(turns)
        except StopIteration:
            return
        time.sleep(_SETTLE)
        into.append((process_cpu_ns(pid) - c) / 1e3)
        if gap > 0:
            time.sleep(gap)
        yield got


def bench_overhead(turns: int, rate: float, tokens: int) -> dict[str, Any]:
    """An agent loop through hotloop vs the same client talking to the model server directly.

    Both sides stream ``turns`` responses of ``tokens`` tokens at ``rate`` tokens/s from the paced
    chat-completions mock: directly (raw chat completions over one keep-alive connection, as a
    client without hotloop would) and through hotloop's Cerebras backend over one WebSocket with
    ``previous_response_id`` chaining. The ratio of the wall times is hotloop's end-to-end cost.
    """
    from websockets.sync.client import connect

    model = f"bench-{rate:g}-{tokens}"
    with mock_chat() as url:
        messages: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        with httpx.Client(base_url=url, timeout=120) as http:
            for i in range(turns):
                messages.append({"role": "user", "content": f"step {i}"})
                text = []
                with http.stream("POST", "/v1/chat/completions", json={"model": model, "messages": messages, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            for choice in json.loads(line[6:]).get("choices", ()):
                                text.append(choice.get("delta", {}).get("content") or "")
                messages.append({"role": "assistant", "content": "".join(text)})
        direct = time.perf_counter() - t0
        os.environ.setdefault("CEREBRAS_API_KEY", "bench")
        with server("--backend", "cerebras", "--base-url", url) as (base, _pid):
            with connect(base.replace("http", "ws", 1) + "/v1/responses", max_size=None, compression=None) as ws:
                _stream_once(ws, "bench-0-8")  # warm-up (connection, tokenizer)
                prev: str | None = None
                t0 = time.perf_counter()
                for i in range(turns):
                    frame: dict[str, Any] = {"type": ev.CLIENT_CREATE, "model": model, "store": False, "input": f"step {i}"}
                    prev = _chained_turn(ws, frame, prev)
                via = time.perf_counter() - t0
    return {
        "scenario": "overhead",
        "turns": turns,
        "tokens_per_turn": tokens,
        "rate": rate,
        "direct_seconds": round(direct, 3),
        "via_hotloop_seconds": round(via, 3),
        "via_over_direct": round(via / direct, 4),
    }


# the counts and rates a run needs to measure anything (a stream of no tokens, no turns, no
# connections: a division by zero, or a figure that means nothing)
_AT_LEAST = {
    "tokens": 1, "turns": 1, "new_bytes": 0, "connections": 1, "streams": 1, "stream_tokens": 1, "rounds": 1,
    "tool_tokens": 1, "clients": 1,
}
_POSITIVE = ("rate", "stream_rate", "seconds")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["loop"]:
        from hotloop.bench.loop import main as loop_main

        return loop_main(argv[1:])
    p = argparse.ArgumentParser(prog="hotloop bench", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", nargs="?", default="all", choices=["all", "stream", "stream-cerebras", "ws-loop", "http-loop", "overhead", "idle-ws", "ws-fanout", "agent-turns", "loop", "http-throughput", "store-cpu", "paired", "classify-turns"])
    p.add_argument("--tokens", type=int, default=4000, help="stream: tokens in the response")
    p.add_argument("--rate", type=float, default=4000.0, help="stream: simulator tokens/s")
    p.add_argument("--turns", type=int, default=100, help="loops: number of turns")
    p.add_argument("--new-bytes", type=int, default=2048, help="loops: new input per turn")
    p.add_argument(
        "--repeat", type=int, default=1,
        help="ws-loop, http-loop, classify-turns: runs, each on a fresh server; the medians over them, and each run's main figures",
    )
    p.add_argument("--connections", type=int, default=1000, help="idle-ws: idle connections to open")
    p.add_argument("--streams", type=int, default=50, help="ws-fanout: concurrent WebSocket streams")
    p.add_argument("--stream-tokens", type=int, default=400, help="ws-fanout: tokens per stream and round")
    p.add_argument("--stream-rate", type=float, default=1000.0, help="ws-fanout: simulator tokens/s per stream")
    p.add_argument("--rounds", type=int, default=3, help="ws-fanout: responses per stream")
    p.add_argument(
        "--fanout-backend", choices=["simulator", "cerebras"], default="simulator",
        help="ws-fanout: the simulator, or the Cerebras backend against the paced mock",
    )
    p.add_argument("--server-path", help="idle-ws, ws-fanout, ws-loop, http-loop, agent-turns (hotloop's server), paired (server B): a python/ directory first on the server's PYTHONPATH")
    p.add_argument("--base-path", help="paired: server A's python/ directory (default: the installed hotloop)")
    p.add_argument(
        "--server-args", default="",
        help="paired: more `hotloop serve` flags for server B only, one string (e.g. '--flush-interval-ms 5')",
    )
    p.add_argument(
        "--agent-settings", action="store_true",
        help="paired: every turn sends 14 KB of instructions and ten tools (29 KB), as a coding agent does",
    )
    p.add_argument(
        "--server-env", action="append", default=[], metavar="NAME=VALUE", type=_env_pair,
        help="paired: an environment variable for server B only (repeatable; e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1)",
    )
    p.add_argument(
        "--turn-transport", choices=["ws-prev", "http-full", "http-prev", "http-json", "http-refs"],
        help="paired: the transport of the alternating turns (default ws-prev); agent-turns: only this transport "
        "(default ws-prev, http-full and http-prev; http-refs: the Vercel AI SDK's whole histories with "
        "item_reference items, store: true, no naive proxy)",
    )
    p.add_argument("--tool-tokens", type=int, default=16, help="agent-turns: tokens of each tool call")
    p.add_argument("--backend-transport", choices=["lean", "sdk"], default="lean", help="agent-turns: hotloop's backend transport")
    p.add_argument("--no-naive", action="store_true", help="agent-turns: skip the naive proxy reference")
    p.add_argument(
        "--store-prefill", type=int, default=0, metavar="N",
        help="agent-turns: the storing transports (http-prev, http-json) first serve N turns of another conversation, "
        "not measured, so the measured one writes into a store that is not empty (default 0)",
    )
    p.add_argument(
        "--no-pin", action="store_true",
        help="ws-loop, http-loop: let the server and this client share every CPU (by default, with two or more, "
        "the server runs on the last one and the client on the others)",
    )
    p.add_argument(
        "--gap-ms", type=float, default=0.0,
        help="ws-loop, http-loop: milliseconds the client waits after each turn, as a tool runs between an agent's turns (default 0)",
    )
    p.add_argument("--clients", type=int, default=16, help="http-throughput: keep-alive client connections")
    p.add_argument("--seconds", type=float, default=5.0, help="http-throughput: seconds per worker count")
    p.add_argument(
        "--secrets", choices=["off", "flag", "redact", "block"], default="redact",
        help="classify-turns: the server's --secrets (redact and block scan in the classify stage; flag after it, below 64 K characters of new input)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per scenario")
    p.add_argument(
        "--mock-tls", action="store_true",
        help="stream-cerebras, ws-fanout --fanout-backend cerebras: the mock over TLS (as Cerebras is), with a "
        "throwaway certificate the server trusts (SSL_CERT_FILE); needs trustme",
    )
    args = p.parse_args(argv)
    for name, low in _AT_LEAST.items():
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')}: at least {low}")
    for name in _POSITIVE:
        value = getattr(args, name)
        if not (value > 0 and value != float("inf")):
            p.error(f"--{name.replace('_', '-')}: a positive number")
    if args.repeat < 1:
        p.error("--repeat: at least 1")
    if not 0 <= args.gap_ms <= 10_000:
        p.error("--gap-ms: 0 to 10000")
    if args.store_prefill < 0:
        p.error("--store-prefill: 0 or more")
    if args.scenario == "loop":
        p.error("loop takes its own options, after its name: hotloop bench loop [options] (hotloop bench loop -h)")
    results = []
    if args.scenario in ("all", "stream"):
        results.append(bench_stream(args.tokens, args.rate))
    if args.scenario in ("all", "stream-cerebras"):
        results.append(bench_stream(args.tokens, args.rate, backend="cerebras", tls=args.mock_tls))
    for kind in ("ws-loop", "http-loop"):
        if args.scenario in ("all", kind):
            results.append(
                bench_loop_repeated(
                    kind, args.turns, args.new_bytes, args.repeat, server_path=args.server_path, pin=not args.no_pin,
                    gap=args.gap_ms / 1e3,
                )
            )
    if args.scenario in ("all", "overhead"):
        results.append(bench_overhead(20, 1000.0, 200))
    if args.scenario in ("all", "agent-turns"):
        from hotloop.bench.turns import AGENT_TRANSPORTS, bench_agent_turns

        results.append(
            bench_agent_turns(
                args.turns, args.new_bytes, tokens=args.tool_tokens, transport=args.backend_transport, naive=not args.no_naive,
                only=(args.turn_transport,) if args.turn_transport else AGENT_TRANSPORTS, store_prefill=args.store_prefill,
                server_path=args.server_path,
            )
        )
    if args.scenario in ("all", "idle-ws", "ws-fanout"):
        from hotloop.bench import wsload

        if args.scenario in ("all", "idle-ws"):
            results.append(wsload.bench_idle(args.connections, server_path=args.server_path))
        if args.scenario in ("all", "ws-fanout"):
            results.append(
                wsload.bench_fanout(
                    args.streams, args.stream_tokens, args.stream_rate, args.rounds,
                    server_path=args.server_path, backend=args.fanout_backend, tls=args.mock_tls,
                )
            )
    if args.scenario == "paired":  # not in "all": it compares two trees
        from hotloop.bench.turns import bench_paired

        results.append(
            bench_paired(
                args.base_path, args.server_path, args.turn_transport or "ws-prev", args.turns, args.new_bytes, tokens=args.tool_tokens,
                server_args=shlex.split(args.server_args), server_env=dict(args.server_env), agent=args.agent_settings,
            )
        )
    if args.scenario == "classify-turns":  # not in "all": a target check of its own (--secrets redact)
        from hotloop.bench.classifyturns import bench_classify_turns, render

        try:
            report = bench_classify_turns(args.turns, args.new_bytes, args.repeat, secrets=args.secrets)
        except ValueError as exc:
            print(f"hotloop bench: {exc}", file=sys.stderr)
            return 2
        if not args.json:
            print(render(report))
            return 0
        results.append(report)
    if args.scenario in ("http-throughput", "store-cpu"):  # not in "all": several servers, redis-server
        from hotloop.bench import scaleout

        if args.scenario == "http-throughput":
            results.append(scaleout.bench_throughput(args.clients, args.seconds))
        else:
            results.append(scaleout.bench_store_cpu(args.turns))
    for r in results:
        if args.json:
            print(json.dumps(r))
        else:
            print(r["scenario"])
            for k, v in r.items():
                if k == "scenario":
                    continue
                if k.endswith("_ci95") and isinstance(v, list):
                    print(f"  {k:28s} {v[0]} - {v[1]}")  # an interval
                elif isinstance(v, list):
                    print(f"  {k}")
                    for entry in v:
                        print(f"    {json.dumps(entry)}")
                else:
                    print(f"  {k:28s} {v}")
    return 0
