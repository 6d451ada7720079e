"""``hotloop bench classify-turns``: the secrets classifier's time per turn as a conversation grows.

The target: cost is O(new input), so over a 100-turn, 200 KB conversation the classifier's time per
turn is flat (turn 100 within 1.2x of turn 10).

The server runs ``--secrets redact``, under which the built-in secrets classifier scans each
turn's new input inline, before the backend request (``Engine.classify_settings`` and
``Engine.classify``), timed in the ``classify`` stage of ``hotloop_stage_seconds`` (under the
default ``flag`` the scan runs after the backend request is out and is in no stage). The backend is
the simulator (what the classifier does does not depend on it), told to answer every turn with one
call of :data:`~hotloop.bench.turns.TOOL`. The loop is a coding agent's (the loops of
:mod:`hotloop.bench.turns`): each turn the client sends the tool's output, ``--new-bytes`` (default
2 KB) of code, diffs and log lines holding no credentials, so that the history reaches turns x
new-bytes. The same conversation goes over three transports, each on a fresh server:

* ``ws-prev``: one WebSocket, ``previous_response_id``, only the new output, ``store: false``;
* ``http-prev``: ``POST`` (SSE), ``previous_response_id``, ``store: true`` on SQLite;
* ``http-full``: ``POST`` (SSE), the whole history each turn, ``store: false``: prefix reuse
  leaves only the new suffix to classify.

Each server first runs a conversation of its own (``WARMUP`` turns: a new server's first turns are
slower). After each turn the benchmark reads ``GET /metrics`` (on by default; a server with API
keys wants one, or ``--metrics-public``; these have none): the growth of the stage's ``_sum`` and
``_count`` since the last reading is this turn's time (the count must grow by exactly one).
Reported per transport for ``classify`` and ``prepare`` (where the new items are hashed and their
tokens counted): the p50 over all turns, the p50 of turns 6-15 and of the last ten (91-100), and
their ratio, against the 1.2 target (``flat``).

The times are tens of microseconds, and on a shared machine a slow spell of a few seconds moves a
window's p50 by more than 20%. So each turn of the long conversation is followed, on the same
server, by a turn of a short one (a new one every ``FRESH_CHAIN`` turns, its history at most a few
KB, the same size of new input): ``paired`` is the p50 of (long turn / short turn) over the last
ten turns against the same over turns 6-15, which a slow spell moves for both alike
(``flat_paired``). ``--repeat N`` runs it all N times on fresh servers and takes each turn's
median over the runs.
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
import statistics
import time
from typing import Any

import httpx

from hotloop.bench import _pct, server
from hotloop.bench.turns import _LOOPS, TOOL, _Stepper

TRANSPORTS = ("ws-prev", "http-prev", "http-full")
STAGES = ("classify", "prepare")
TARGET = 1.2  # late p50 over early p50
MIN_TURNS = 4  # the early and late windows (see _window) need two turns each after the first
FRESH_CHAIN = 5  # turns of each short conversation measured beside the long one (the first, a short message, is not)
WARMUP = 20  # turns of a conversation of its own before the measured one (the first turns on a new server are slower)
MODEL = "hotloop-sim"
# every turn: one call of the tool, whatever the input ends with
SETTINGS: dict[str, Any] = {"tools": [TOOL], "tool_choice": "required", "metadata": {"sim": "tools:1"}}

_STAGE_LINE = re.compile(r'^hotloop_stage_seconds_(sum|count)\{[^}]*\bstage="([a-z_]+)"[^}]*\} (\S+)$', re.M)

# -- the tool's output: code, diffs and logs ---------------------------------------------------

_MODULES = ["engine", "prepare", "reuse", "store", "tokenizer", "window", "guard", "http", "websocket", "metrics"]
_FUNCS = ["start", "resolve", "classify", "fit_window", "encode", "count_input", "match", "render", "turn", "settle"]
_VARS = ["items", "plan", "prefix", "parent", "tokens", "req", "state", "chunk", "offset", "limit"]
_LEVELS = ["DEBUG", "INFO", "INFO", "INFO", "WARNING", "ERROR"]


def _code_line(rng: random.Random) -> str:
    v, w, f = rng.choice(_VARS), rng.choice(_VARS), rng.choice(_FUNCS)
    return rng.choice([
        f"def {f}(self, {v}: list[Item], {w}: int = {rng.randint(0, 4096)}) -> {rng.choice(['int', 'Plan', 'None'])}:",
        f"    if {v} is None or len({w}) > {rng.randint(1, 512)}:",
        f"        return {f}({v}[{rng.randint(0, 9)}:], {w})",
        f"    {v} = self.{f}({w}, key=lambda x: x.{rng.choice(_VARS)})",
        f"    for i, {v} in enumerate({w}):",
        f'        log.debug("{f}: %d {v} (%s)", len({w}), {v}.id)',
        f"    assert {v}.{w} == {rng.randint(0, 99)}, {v}",
    ])


def code_log_text(rng: random.Random, nbytes: int) -> str:
    """``nbytes`` of what a coding agent's tools print: log lines with ids and timings, a traceback,
    pytest's lines, source and diff hunks, a commit hash; no credentials (nothing the secrets
    scanner reports)."""
    lines: list[str] = []
    size = 0
    while size <= nbytes:  # the lines joined: size - 1 characters
        mod, func = rng.choice(_MODULES), rng.choice(_FUNCS)
        kind = rng.randrange(6)
        if kind == 0:
            chunk = [
                f"2025-0{rng.randint(1, 9)}-{rng.randint(10, 28)}T{rng.randint(10, 23)}:{rng.randint(10, 59)}:"
                f"{rng.randint(10, 59)}.{rng.randint(100, 999)}Z {rng.choice(_LEVELS)} hotloop.{mod}[{rng.randint(1000, 9999)}] "
                f"{func} request_id=req_{rng.getrandbits(48):012x} items={rng.randint(1, 300)} "
                f"duration_ms={rng.uniform(0.1, 90):.2f} status={rng.choice([200, 200, 200, 400, 429, 500])}"
                for _ in range(rng.randint(1, 4))
            ]
        elif kind == 1:
            chunk = ["Traceback (most recent call last):"]
            for _ in range(rng.randint(2, 4)):
                m = rng.choice(_MODULES)
                chunk += [f'  File "/src/hotloop/server/{m}.py", line {rng.randint(10, 1200)}, in {rng.choice(_FUNCS)}', _code_line(rng)]
            chunk.append(f"ValueError: {rng.choice(_VARS)} out of range: {rng.randint(0, 1 << 16)}")
        elif kind == 2:
            chunk = [
                f"tests/unit/test_{rng.choice(_MODULES)}.py::test_{rng.choice(_FUNCS)}_{rng.choice(_VARS)} "
                f"{rng.choice(['PASSED', 'PASSED', 'PASSED', 'FAILED', 'SKIPPED'])} [{rng.randint(1, 100):3d}%]"
                for _ in range(rng.randint(2, 6))
            ]
        elif kind == 3:
            chunk = [_code_line(rng) for _ in range(rng.randint(3, 8))]
        elif kind == 4:
            a, b = rng.randint(1, 900), rng.randint(3, 12)
            chunk = [f"--- a/python/hotloop/{mod}.py", f"+++ b/python/hotloop/{mod}.py", f"@@ -{a},{b} +{a},{b + 1} @@"]
            chunk += [rng.choice("+- ") + _code_line(rng) for _ in range(rng.randint(3, 7))]
        else:
            chunk = [
                f"commit {rng.getrandbits(160):040x}",
                f"    {func}: {rng.choice(_VARS)} of the {mod} kept across {rng.randint(2, 90)} turns",
            ]
        for line in chunk:
            lines.append(line)
            size += len(line) + 1
    return "\n".join(lines)[:nbytes]


# -- measuring ---------------------------------------------------------------------------------


def stage_totals(client: httpx.Client) -> dict[str, tuple[float, int]]:
    """``hotloop_stage_seconds`` from ``GET /metrics``: per stage (sum of seconds, count of
    responses) over every label set."""
    r = client.get("/metrics")
    r.raise_for_status()
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for kind, stage, value in _STAGE_LINE.findall(r.text):
        if kind == "sum":
            sums[stage] = sums.get(stage, 0.0) + float(value)
        else:
            counts[stage] = counts.get(stage, 0) + int(float(value))
    if "classify" not in counts:
        raise RuntimeError('no hotloop_stage_seconds{stage="classify"} in /metrics (was the server started with --no-metrics?)')
    return {s: (sums.get(s, 0.0), counts.get(s, 0)) for s in counts}


class _Meter:
    """Each response's stage times, from the growth of ``/metrics`` since the last reading. A
    response is recorded as it ends, which may be a moment after its client has it, so each
    reading waits for the count it expects, and any other count stops the run at once (a lagging
    record would otherwise shift every turn's time onto the next)."""

    def __init__(self, client: httpx.Client, responses: int | None = None) -> None:
        """``responses``: how many the server has answered so far, waited for before the first
        reading (``None``: take what is there)."""
        self.client = client
        self.last = stage_totals(client) if responses is None else self._wait(responses)
        self.steps: list[int] = []  # how much the count grew at each reading (1 each)

    def _wait(self, count: int) -> dict[str, tuple[float, int]]:
        deadline = time.monotonic() + 10
        while True:
            now = stage_totals(self.client)
            if now["classify"][1] >= count or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        if now["classify"][1] != count:
            raise RuntimeError(f"/metrics counts {now['classify'][1]} responses where {count} were answered")
        return now

    def turn(self) -> dict[str, float]:
        """Seconds per stage of the one response that ended since the last call."""
        now = self._wait(self.last["classify"][1] + 1)
        self.steps.append(now["classify"][1] - self.last["classify"][1])
        out = {s: now[s][0] - self.last[s][0] for s in STAGES}
        self.last = now
        return out


def run_transport(name: str, turns: int, new_bytes: int, seed: int = 0, secrets: str = "redact") -> dict[str, dict[str, list[float]]]:
    """One transport on a fresh server: the long conversation's turns, each followed by a turn of a
    short one (``FRESH_CHAIN`` turns, then a new one); per stage, each turn's seconds (``long``,
    ``fresh``)."""
    extra, loop_fn = _LOOPS[name]
    loop = functools.partial(loop_fn, output=code_log_text)
    times: dict[str, dict[str, list[float]]] = {k: {s: [] for s in STAGES} for k in ("long", "fresh")}
    with contextlib.ExitStack() as stack:
        base, _pid = stack.enter_context(server("--sim-rate", "0", "--secrets", secrets, *extra))
        client = stack.enter_context(httpx.Client(base_url=base, timeout=30))
        loop(base, MODEL, WARMUP, new_bytes, seed + 1, lambda sent: None, SETTINGS)  # a conversation of its own
        meter = _Meter(client, WARMUP)
        long = _Stepper(loop, base, MODEL, new_bytes, seed, SETTINGS)
        stack.callback(long.close)
        fresh: _Stepper | None = None
        made = 0
        try:
            for _ in range(turns):
                long.step()
                for s, t in meter.turn().items():
                    times["long"][s].append(t)
                if fresh is None or made == FRESH_CHAIN:
                    if fresh is not None:
                        fresh.close()
                    fresh = _Stepper(loop, base, MODEL, new_bytes, seed + 1000 + len(times["fresh"]["classify"]), SETTINGS)
                    fresh.step()  # its first turn: the user's short message, not measured
                    meter.turn()
                    made = 1
                fresh.step()
                made += 1
                for s, t in meter.turn().items():
                    times["fresh"][s].append(t)
        finally:
            if fresh is not None:
                fresh.close()
    if any(c != 1 for c in meter.steps):
        raise RuntimeError(f"{name}: the classify stage's count grew by {meter.steps} over the turns (expected 1 each)")
    return times


def _window(n: int, late: bool) -> tuple[int, int]:
    """Turns 6-15 (``late``: the last ten) as a slice, or with fewer than 30 turns the first half
    from turn 2 (the last half): turn 1 is the user's short message. At least ``MIN_TURNS``."""
    if n >= 30:
        return (n - 10, n) if late else (5, 15)
    return (n // 2, n) if late else (min(1, n - 1), max(2, n // 2))


def _stage_summary(seconds: list[float], fresh: list[float]) -> dict[str, Any]:
    us = [x * 1e6 for x in seconds]
    fresh_us = [x * 1e6 for x in fresh]
    (e0, e1), (l0, l1) = _window(len(us), False), _window(len(us), True)
    e, l = _pct(us[e0:e1], 0.5), _pct(us[l0:l1], 0.5)
    # each turn against the short conversation's turn right after it (the same moment of the machine)
    paired = [a / b if b > 0 else float("inf") for a, b in zip(us, fresh_us)]
    pe, pl = _pct(paired[e0:e1], 0.5), _pct(paired[l0:l1], 0.5)
    return {
        "p50_us": round(_pct(us, 0.5), 1),
        "mean_us": round(statistics.mean(us), 1),
        "early_turns": f"{e0 + 1}-{e1}",
        "early_p50_us": round(e, 1),
        "late_turns": f"{l0 + 1}-{l1}",
        "late_p50_us": round(l, 1),
        "late_over_early": round(l / e, 3) if e > 0 else None,
        "fresh_p50_us": round(_pct(fresh_us, 0.5), 1),
        "early_over_fresh": round(pe, 3),
        "late_over_fresh": round(pl, 3),
        "late_over_early_paired": round(pl / pe, 3) if pe > 0 else None,
        "series_us": [round(x, 1) for x in us],
        "fresh_series_us": [round(x, 1) for x in fresh_us],
    }


_RUN_KEYS = ("p50_us", "late_over_early", "late_over_early_paired")


def _run_summaries(times: dict[str, dict[str, list[float]]]) -> list[tuple[str, dict[str, Any]]]:
    """One run's summary per stage (what ``--repeat`` lists for each run)."""
    return [(s, _stage_summary(times["long"][s], times["fresh"][s])) for s in STAGES]


def bench_classify_turns(
    turns: int = 100, new_bytes: int = 2048, repeat: int = 1, seed: int = 0,
    transports: tuple[str, ...] = TRANSPORTS, secrets: str = "redact",
) -> dict[str, Any]:
    """Every transport in turn, ``repeat`` times (each run on fresh servers, the same texts); with
    several runs each turn's time is the median over the runs, and each run's own figures are in
    ``runs``."""
    if turns < MIN_TURNS or repeat < 1 or new_bytes < 1:
        raise ValueError(f"classify-turns needs --turns >= {MIN_TURNS}, --repeat >= 1 and --new-bytes >= 1")
    if unknown := [t for t in transports if t not in TRANSPORTS]:
        raise ValueError(f"classify-turns: unknown transports {unknown} (known: {', '.join(TRANSPORTS)})")
    runs = [{t: run_transport(t, turns, new_bytes, seed, secrets) for t in transports} for _ in range(repeat)]
    rows = []
    for t in transports:
        row: dict[str, Any] = {"transport": t}
        for s in STAGES:
            row[s] = _stage_summary(
                *([statistics.median(run[t][k][s][i] for run in runs) for i in range(turns)] for k in ("long", "fresh"))
            )
        if repeat > 1:
            row["runs"] = [
                {f"{s}_{k}": summary[k] for s, summary in _run_summaries(run[t]) for k in _RUN_KEYS} for run in runs
            ]
        c = row["classify"]
        row["flat"] = c["late_over_early"] is not None and c["late_over_early"] <= TARGET
        row["flat_paired"] = c["late_over_early_paired"] is not None and c["late_over_early_paired"] <= TARGET
        rows.append(row)
    return {
        "scenario": "classify-turns",
        "secrets": secrets,
        "backend": "simulator",
        "turns": turns,
        "new_bytes": new_bytes,
        "history_bytes": turns * new_bytes,
        "repeats": repeat,
        "target_late_over_early": TARGET,
        "flat": all(r["flat"] for r in rows),
        "flat_paired": all(r["flat_paired"] for r in rows),
        "transports": rows,
    }


def render(report: dict[str, Any]) -> str:
    """The human table: one line per transport and stage (and with ``--repeat``, each run's ratios)."""
    rows = report["transports"]
    head = rows[0]["classify"] if rows else {}
    early, late = f"turns {head.get('early_turns', '')}", f"turns {head.get('late_turns', '')}"
    runs = report["repeats"]
    target = report["target_late_over_early"]
    lines = [
        f"classify-turns: --secrets {report['secrets']}, {report['turns']} turns x {report['new_bytes']} B of new input "
        f"(history {report['history_bytes'] / 1024:.0f} KB), simulator backend"
        + (f", median of {runs} runs per turn" if runs > 1 else ""),
        f"{'transport':10s} {'stage':9s} {'p50 us':>7s} {early + ' us':>15s} {late + ' us':>16s} {'late/early':>10s} "
        f"{'fresh us':>8s} {'paired':>7s}",
    ]
    for r in rows:
        for s in STAGES:
            st = r[s]
            ratio, paired = st["late_over_early"], st["late_over_early_paired"]
            mark = f"  {'ok' if r['flat'] else 'OVER'} / {'ok' if r['flat_paired'] else 'OVER'}" if s == "classify" else ""
            lines.append(
                f"{r['transport']:10s} {s:9s} {st['p50_us']:7.1f} {st['early_p50_us']:15.1f} {st['late_p50_us']:16.1f} "
                f"{ratio if ratio is not None else '-':>10} {st['fresh_p50_us']:8.1f} {paired if paired is not None else '-':>7}{mark}"
            )
        for i, run in enumerate(r.get("runs", ())):
            lines.append(
                f"{'':10s} run {i + 1}: classify p50 {run['classify_p50_us']} us, late/early {run['classify_late_over_early']}, "
                f"paired {run['classify_late_over_early_paired']}; prepare p50 {run['prepare_p50_us']} us, "
                f"late/early {run['prepare_late_over_early']}, paired {run['prepare_late_over_early_paired']}"
            )
    lines.append(
        "paired: each turn's time over that of a turn of a short conversation run right after it on the same server "
        "(late over early of that ratio), which a slow spell of the machine moves less"
    )
    for label, key in (("late/early", "flat"), ("paired", "flat_paired")):
        over = [r["transport"] for r in rows if not r[key]]
        verdict = "met on every transport" if not over else "NOT met on " + ", ".join(over)
        lines.append(f"target (classify {label} <= {target}): {verdict}")
    return "\n".join(lines)
