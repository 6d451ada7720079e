"""``hotloop bench classify-turns`` end to end: real ``hotloop serve`` processes (simulator backend),
the classifier's stage times read from their ``/metrics`` turn by turn."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Any

import httpx
import pytest

from hotloop.bench import server
from hotloop.bench.classifyturns import MIN_TURNS, STAGES, TRANSPORTS, _Meter, _stage_summary, bench_classify_turns, code_log_text
from hotloop.pipeline.classify import default_secret_scanner

TURNS = 8


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hotloop", "bench", "classify-turns", "--turns", str(TURNS), "--new-bytes", "1024", *args],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
    )


def _report(*args: str) -> dict[str, Any]:
    r = _bench("--json", *args)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout[-2000:]
    return json.loads(lines[0])


def test_redact_every_transport_times_every_turn() -> None:
    report = _report()
    assert report["scenario"] == "classify-turns" and report["secrets"] == "redact"
    assert report["turns"] == TURNS and report["new_bytes"] == 1024 and report["repeats"] == 1
    assert report["target_late_over_early"] == 1.2
    assert [t["transport"] for t in report["transports"]] == list(TRANSPORTS)
    assert report["flat"] == all(t["flat"] for t in report["transports"])
    for t in report["transports"]:
        for stage in STAGES:
            st = t[stage]
            # one time per turn, each > 0, for the long conversation and the short one beside it
            assert len(st["series_us"]) == TURNS and len(st["fresh_series_us"]) == TURNS, (t["transport"], stage)
            assert all(x > 0 for x in st["series_us"] + st["fresh_series_us"]), (t["transport"], stage, st)
            assert st["early_turns"] == "2-4" and st["late_turns"] == f"5-{TURNS}"
            assert 0 < st["p50_us"] < 1e5 and st["early_p50_us"] > 0 and st["late_p50_us"] > 0
            assert st["late_over_early"] == pytest.approx(st["late_p50_us"] / st["early_p50_us"], rel=0.01)
        assert t["flat"] == (t["classify"]["late_over_early"] <= 1.2)
        # something is timed in the stage (what is the scan's share: the two tests below)
        assert t["classify"]["p50_us"] > 3, t


def test_without_the_inline_scan_the_classify_stage_is_nearly_empty() -> None:
    # under `off` nothing scans; under the default `flag` the scan runs after the backend request,
    # outside the stage: far less than the same turns under redact
    redact = {t["transport"]: t["classify"]["p50_us"] for t in _report()["transports"]}
    for policy in ("off", "flag"):
        other = _report("--secrets", policy)
        assert other["secrets"] == policy
        for t in other["transports"]:
            assert t["classify"]["p50_us"] * 3 < redact[t["transport"]], (policy, t["transport"], t["classify"], redact)


def test_human_table_and_repeat() -> None:
    r = _bench("--repeat", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert out.startswith("classify-turns: --secrets redact") and "median of 2 runs per turn" in out
    for name in TRANSPORTS:
        assert f"{name:10s} classify" in out and f"{name:10s} prepare" in out
    assert out.count("run 1:") == len(TRANSPORTS) and out.count("run 2:") == len(TRANSPORTS)
    assert "target (classify late/early <= 1.2):" in out and "target (classify paired <= 1.2):" in out


def test_meter_counts_each_response_once() -> None:
    # the meter attributes to each turn the growth of /metrics since the last reading: one response
    # each, the classify stage's sum growing with what was scanned
    with server("--sim-rate", "0", "--secrets", "redact") as (base, _pid), httpx.Client(base_url=base, timeout=30) as client:
        def turn(text: str | list[dict[str, object]]) -> None:
            body = {"model": "hotloop-sim", "store": False, "input": text, "metadata": {"sim": "text,tokens:4"}}
            r = client.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text

        turn("hello")
        meter = _Meter(client, 1)
        rng = random.Random(5)
        # 48 KB in 400 messages (below the size scanned off the event loop): the stage walks and
        # scans each item, so it grows with them whatever the scanner's speed on one text
        texts = [code_log_text(rng, 120) for _ in range(400)]
        assert all(default_secret_scanner().scan(t) == [] for t in texts)
        big = [{"type": "message", "role": "user", "content": t} for t in texts]
        times = []
        for text in ("small", big, "small"):
            turn(text)
            times.append(meter.turn())
        assert meter.steps == [1, 1, 1]
        assert all(set(t) == set(STAGES) and all(v > 0 for v in t.values()) for t in times)
        # against the cheaper small turn: a pause of the machine only ever adds time (one small
        # turn once took 4.2 ms of the stage on a loaded CI machine, seven times the large one)
        assert times[1]["classify"] > 3 * min(times[0]["classify"], times[2]["classify"]), times


def test_paired_ratio_tells_growth_from_a_slow_spell() -> None:
    # a slow spell slows the long and the short conversation alike: the raw ratio sees it, the
    # paired one does not; growth of the long conversation's turns alone shows in both
    n = 100
    fresh = [50e-6] * 60 + [80e-6] * 40  # the machine slows down for the last 40 turns
    spell = _stage_summary([2 * f for f in fresh], fresh)
    assert spell["late_over_early"] == pytest.approx(1.6) and spell["late_over_early_paired"] == pytest.approx(1.0)
    assert spell["early_over_fresh"] == pytest.approx(2.0) and spell["late_over_fresh"] == pytest.approx(2.0)
    assert (spell["early_turns"], spell["late_turns"]) == ("6-15", "91-100")
    flat = [50e-6] * n
    growing = [50e-6 * (1 + i / 50) for i in range(n)]
    grown = _stage_summary(growing, flat)
    assert grown["late_over_early"] > 1.2
    assert grown["late_over_early_paired"] == pytest.approx(grown["late_over_early"], rel=1e-3)


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="--turns"):
        bench_classify_turns(turns=MIN_TURNS - 1)
    with pytest.raises(ValueError, match="unknown transports"):
        bench_classify_turns(turns=MIN_TURNS, transports=("http-json",))
    r = subprocess.run(
        [sys.executable, "-m", "hotloop", "bench", "classify-turns", "--turns", "1"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )
    assert r.returncode == 2 and "--turns >= 4" in r.stderr and "Traceback" not in r.stderr
