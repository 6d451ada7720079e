"""``hotloop bench agent-turns`` / ``paired`` loops against a real ``hotloop serve`` on the real
mock model: the Vercel AI SDK-shaped loop (``http-refs``) really sends reasoning references, and
the server matches its histories by their bytes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from hotloop.bench import mock_process, server, turns
from hotloop.bench.turns import _LOOPS


def test_the_ai_sdk_loop_refers_to_reasoning_and_is_matched_by_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CEREBRAS_API_KEY", "bench")
    answers: list[dict[str, Any]] = []
    completed = turns._sse_completed
    monkeypatch.setattr(turns, "_sse_completed", lambda raw: answers.append(completed(raw)) or answers[-1])
    extra, loop = _LOOPS["http-refs"]
    assert extra == ("--store", "sqlite")
    with mock_process() as (url, _), server("--backend", "cerebras", "--base-url", url, *extra) as (base, _pid):
        ticks: list[float] = []
        loop(base, "bench-0-6-tool", 5, 600, 1, ticks.append)
        assert len(ticks) == 5
        # the -think model reasons first: each turn's reasoning is named by reference afterwards
        assert [[o["type"] for o in a["output"]] for a in answers] == [["reasoning", "function_call"]] * 5
        stats = httpx.get(base + "/hotloop/stats", timeout=10).json()["prefix_cache"]
        # turn 1 by its items (the opening message is too short to be indexed by its bytes),
        # turns 2-4 by their bytes, their references to earlier reasoning still resolving
        assert (stats["hits"], stats["raw_hits"], stats["misses"]) == (4, 3, 1), stats
        stored = httpx.get(base + "/hotloop/stats", timeout=10).json()["store"]
        assert stored["written"] + stored["pending"] == 5
