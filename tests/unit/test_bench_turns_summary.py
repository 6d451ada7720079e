"""``hotloop bench agent-turns``' figures: its growth fit and the history the relay floor writes; ``paired``'s summary."""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

import pytest

from hotloop.bench import turns
from hotloop.bench.turns import _growth_paired, _history_bodies, _output, _summary


def _fit(cpu_ms: list[float]) -> float | None:
    out = _summary("hotloop", [round(c * 1e6) for c in cpu_ms], [0.03] * len(cpu_ms), 0, [0.029] * len(cpu_ms))
    return out["fit_last_over_turn_10"]  # type: ignore[no-any-return]


def test_growth_fit_reads_a_line_through_every_turn() -> None:
    # turn i costs i ms: turn 100 over turn 10 is 10
    assert _fit([float(i) for i in range(1, 101)]) == pytest.approx(10.0, abs=0.01)
    # 1 ms + 10 us a turn: (1 + 1.0) / (1 + 0.1)
    assert _fit([1.0 + 0.01 * i for i in range(1, 101)]) == pytest.approx(2.0 / 1.1, abs=0.01)


def test_growth_fit_is_not_moved_by_batches_the_windows_split_unevenly() -> None:
    """Flat turns with every third one 1.2 ms dearer (a store commit): the ten-turn windows hold
    three and four of those and read growth; the fitted line reads none."""
    cpu = [2.0 + (1.2 if i % 3 == 0 else 0.0) for i in range(100)]
    out = _summary("hotloop", [round(c * 1e6) for c in cpu], [0.03] * 100, 0, [0.029] * 100)
    assert out["last_over_early"] > 1.04  # the windows' bias
    assert out["fit_last_over_turn_10"] == pytest.approx(1.0, abs=0.01)


def test_growth_fit_needs_fifteen_turns() -> None:
    assert _fit([1.0] * 14) is None
    assert _fit([1.0] * 15) == 1.0


def test_history_bodies_are_the_direct_loops_requests() -> None:
    """Each body is the whole chat history of its turn: one call and the tool output more than
    the one before, the outputs those of the direct loop's generator for the same seed."""
    bodies = list(_history_bodies("m", 4, 512, 3))
    decoded = [json.loads(b) for b in bodies]
    assert [len(d["messages"]) for d in decoded] == [1, 3, 5, 7]
    rng = random.Random(3)
    outputs = [m["content"] for m in decoded[-1]["messages"] if m["role"] == "tool"]
    assert outputs == [_output(rng, 512) for _ in range(3)]
    assert all(d["stream"] and d["model"] == "m" for d in decoded)
    assert all(len(b) - len(a) >= 512 for a, b in zip(bodies, bodies[1:]))


def test_main_thread_and_the_others_split_the_process_cpu() -> None:
    cpu = [3_000_000, 2_000_000, 2_000_000]  # a store commit in the first turn
    main = [2_000_000, 2_000_000, 1_700_000]
    out = _summary("hotloop", cpu, [0.03] * 3, 0, [0.029] * 3, main)
    assert out["main_thread_cpu_per_turn_mean_ms"] == pytest.approx(1.9)
    assert out["other_threads_cpu_per_turn_mean_ms"] == pytest.approx(0.433, abs=0.001)
    assert "main_thread_cpu_per_turn_mean_ms" not in _summary("hotloop", cpu, [0.03] * 3, 0, [0.029] * 3)


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _fake_loop(per_turn_ms: float):
    """A turn loop whose turn ``i`` of the long conversation (``_growth_paired`` gives it the seed
    11) burns ``1 + per_turn_ms * i`` ms of CPU in this process (the "server"), and every turn of
    a short one 1 ms."""

    def loop(base: str, model: str, turns: int, new_bytes: int, seed: int, tick: Any, settings: Any = None) -> None:
        for i in range(turns):
            sent = time.perf_counter()
            _burn((1.0 + (per_turn_ms * i if seed == 11 else 0.0)) / 1e3)
            tick(sent)

    return loop


def test_growth_paired_sees_a_turn_that_grows_and_none_that_does_not() -> None:
    pid = os.getpid()
    flat = _growth_paired("http://x", pid, _fake_loop(0.0), "m", 30, 0, 0)
    assert flat is not None and 0.8 < flat < 1.25
    # the long conversation's turns 5-14 cost 2.5-5.2 ms, its last ten 7-9.7 ms, each short turn
    # 1 ms: medians of the ratios about 3.9 and 8.4
    grown = _growth_paired("http://x", pid, _fake_loop(0.3), "m", 30, 0, 0)
    assert grown is not None and grown > 1.8
    assert _growth_paired("http://x", pid, _fake_loop(0.1), "m", 14, 0, 0) is None


def test_growth_paired_is_not_moved_by_a_machine_that_slows_down() -> None:
    """Every turn of either conversation costs more than the one before it (a machine slowing
    down), whatever its history: no growth with the history, though the long conversation's own
    last turns cost about twice its early ones."""
    done = [0]

    def slowing(base: str, model: str, turns: int, new_bytes: int, seed: int, tick: Any, settings: Any = None) -> None:
        for _ in range(turns):
            sent = time.perf_counter()
            _burn((1.0 + 0.04 * done[0]) / 1e3)
            done[0] += 1
            tick(sent)

    ratio = _growth_paired("http://x", os.getpid(), slowing, "m", 30, 0, 0)
    assert ratio is not None and 0.85 < ratio < 1.2


def _noisy(rng: random.Random, n: int, scale: float = 1.0) -> list[float]:
    """Per-turn CPU of a paced loop: 2 ms, a store commit every third turn, noise."""
    return [scale * (2.0 + (1.2 if k % 3 == 0 else 0.0) + rng.gauss(0, 0.3)) for k in range(n)]


def test_paired_summary_of_a_server_against_itself_holds_one() -> None:
    rng = random.Random(1)
    a, b = _noisy(rng, 200), _noisy(rng, 200)
    out = turns.paired_summary(a, b)
    lo, hi = out["b_over_a_mean_ci95"]
    assert lo < 1.0 < hi and hi - lo < 0.1
    assert 0.95 < out["b_over_a_mean"] < 1.05 and 0.95 < out["b_over_a_trimmed_mean"] < 1.05


def test_paired_summary_separates_a_change_of_a_few_percent() -> None:
    rng = random.Random(2)
    a, b = _noisy(rng, 300), _noisy(rng, 300, 0.95)
    out = turns.paired_summary(a, b)
    lo, hi = out["b_over_a_mean_ci95"]
    assert lo < 0.95 < hi < 1.0  # the interval holds the true ratio and excludes 1
    assert out == turns.paired_summary(a, b)  # reproducible


def test_paired_summary_trims_the_turns_a_machine_stalled_on() -> None:
    rng = random.Random(3)
    a, b = _noisy(rng, 200), _noisy(rng, 200)
    for k in (40, 90, 140, 190):
        b[k] += 25.0  # four stalls of 25 ms on B only
    out = turns.paired_summary(a, b)
    assert out["b_over_a_mean"] > 1.15
    assert 0.95 < out["b_over_a_trimmed_mean"] < 1.05
    assert 0.95 < out["b_over_a_paired_median"] < 1.05


def test_paired_summary_follows_a_drift_both_servers_see() -> None:
    rng = random.Random(4)
    drift = [1.0 + k / 100 for k in range(200)]  # the machine slows down to half its speed
    a = [x * d for x, d in zip(_noisy(rng, 200), drift)]
    b = [x * d * 0.9 for x, d in zip(_noisy(rng, 200), drift)]
    out = turns.paired_summary(a, b)
    lo, hi = out["b_over_a_mean_ci95"]
    assert lo < 0.9 < hi < 1.0
    assert 0.85 < out["b_over_a_paired_median"] < 0.95


def test_paired_summary_of_a_short_run() -> None:
    out = turns.paired_summary([2.0] * 19, [1.0] * 19)
    assert out["b_over_a_mean_ci95"] is None and out["b_over_a_mean"] == 0.5 and out["b_over_a_trimmed_mean"] == 0.5
    with pytest.raises(ValueError):
        turns.paired_summary([], [])


def test_paired_summary_interval_is_the_middle_95_percent() -> None:
    # independent pairs, B's turns 1.0 +- 0.2 (sd) over A's constant 1.0: the ratio of the means
    # over 400 turns has a standard error of 0.01, so a 95% interval spans about +-0.0196
    rng = random.Random(6)
    b = [rng.gauss(1.0, 0.2) for _ in range(400)]
    lo, hi = turns.paired_summary([1.0] * 400, b, block=1)["b_over_a_mean_ci95"]
    mean = sum(b) / 400
    assert 0.015 < mean - lo < 0.025 and 0.015 < hi - mean < 0.025


def test_paired_summary_blocks_widen_the_interval_for_runs_of_dear_turns() -> None:
    # B slows down for stretches of 20 turns (a neighbour on the machine): its turns are
    # correlated, and an interval that resamples single pairs is too narrow for that
    rng = random.Random(7)
    a = [2.0 + rng.gauss(0, 0.1) for _ in range(300)]
    b = [2.0 + rng.gauss(0, 0.1) + (1.0 if (k // 20) % 3 == 0 else 0.0) for k in range(300)]
    lo1, hi1 = turns.paired_summary(a, b, block=1)["b_over_a_mean_ci95"]
    lo, hi = turns.paired_summary(a, b)["b_over_a_mean_ci95"]
    assert hi - lo > 1.5 * (hi1 - lo1)


def test_paired_summary_with_a_coarse_clock() -> None:
    # /proc's stat ticks (10 ms): most of A's turns read 0
    out = turns.paired_summary([0.0] * 39 + [10.0], [1.0] * 40)
    assert out["b_over_a_trimmed_mean"] is None and out["b_over_a_mean"] == 4.0
    assert out["b_over_a_mean_ci95"] is None  # most resamples have no A at all
