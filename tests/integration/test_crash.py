"""SIGKILL under load: what the store and the usage ledger kept against what clients saw complete.

Agents run chained ``store: true`` turns against a real server (SQLite store) until the process is
killed with SIGKILL; the database is then opened as the next server would open it. With the default
``--store-sync normal`` a response may be lost only if its client saw it complete within
``DURABLE_WITHIN`` seconds of the kill (README, Crash safety: the documented bound is
``--store-max-lag`` plus a write; the asserted one leaves room for a loaded machine), and the ledger
only what it had not flushed (``Persistence.USAGE_FLUSH_SECONDS``). With ``--store-sync full``
nothing a client saw complete is ever missing, from the store or from the ledger.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from hotloop.pipeline.post import Persistence
from hotloop.state.store import SQLiteStore
from tests.conftest import run_server

AGENTS = 8
LOAD_SECONDS = 2.0
DURABLE_WITHIN = 0.5  # asserted bound (seconds before the kill): --store-max-lag 0.2 s + writes, room for load
LEDGER_WITHIN = Persistence.USAGE_FLUSH_SECONDS + DURABLE_WITHIN


async def _agent(v1: str, seen: list[tuple[str, float]], stop: asyncio.Event) -> None:
    prev: str | None = None
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            body: dict[str, Any] = {
                "model": "hotloop-sim",
                "input": [{"type": "message", "role": "user", "content": "x" * 2000}],
                "store": True,
            }
            if prev is not None:
                body["previous_response_id"] = prev
            try:
                r = await client.post(v1 + "/responses", json=body)
            except httpx.HTTPError:
                return  # the server is gone
            if r.status_code != 200:
                return
            resp = r.json()
            if resp["status"] == "completed":
                seen.append((resp["id"], time.monotonic()))
                prev = resp["id"]


async def _load_then_kill(s: Any) -> tuple[list[tuple[str, float]], float]:
    seen: list[tuple[str, float]] = []
    stop = asyncio.Event()
    agents = [asyncio.create_task(_agent(s.v1, seen, stop)) for _ in range(AGENTS)]
    await asyncio.sleep(LOAD_SECONDS)
    killed = time.monotonic()
    s.proc.send_signal(signal.SIGKILL)
    stop.set()
    await asyncio.gather(*agents)
    return [(rid, t) for rid, t in seen if t <= killed], killed


def _crash(tmp_path: Path, *args: str) -> tuple[list[tuple[str, float]], float, SQLiteStore]:
    data = tmp_path / "data"
    with run_server(tmp_path, "--sim-rate", "0", "--sim-output-tokens", "16", *args, env={"HOTLOOP_DATA_DIR": str(data)}) as s:
        seen, killed = asyncio.run(_load_then_kill(s))
        assert s.proc.wait(timeout=10) == -signal.SIGKILL
    return seen, killed, SQLiteStore(data / "hotloop.sqlite3")


def _ledger_responses(store: SQLiteStore) -> int:
    return sum(int(row["responses"]) for row in store.usage())


def _report(label: str, seen: list[tuple[str, float]], lost: list[float], ledger: int) -> None:
    worst = max(lost, default=0.0)
    print(
        f"\n{label}: {len(seen)} responses completed in {LOAD_SECONDS:.0f} s by {AGENTS} agents; "
        f"{len(lost)} lost, the oldest completed {worst * 1000:.1f} ms before the kill; ledger {ledger}"
    )


def test_sigkill_loses_only_responses_completed_just_before_it(tmp_path: Path) -> None:
    seen, killed, store = _crash(tmp_path)
    try:
        assert len(seen) > 50, "the load did not get going"
        lost = [killed - t for rid, t in seen if store.get_response(rid) is None]
        ledger = _ledger_responses(store)
        _report("--store-sync normal", seen, lost, ledger)
        assert all(age <= DURABLE_WITHIN for age in lost), sorted(lost)[-5:]
        # the ledger holds at least every response completed before its last flush could have run
        assert ledger >= sum(1 for _, t in seen if killed - t > LEDGER_WITHIN)
        assert ledger <= len(seen) + AGENTS  # nothing counted twice (in flight: at most one each)
        # what survived is whole: every stored chain reloads with its parents
        for rid, _ in seen[-AGENTS * 3 :]:
            hist = store.get(rid)
            # stored responses reload with their whole chain (a broken chain loads as None)
            assert (hist is None) == (store.get_response(rid) is None), rid
    finally:
        store.close()


def test_store_sync_full_loses_nothing_a_client_saw_complete(tmp_path: Path) -> None:
    seen, _, store = _crash(tmp_path, "--store-sync", "full")
    try:
        assert len(seen) > 20, "the load did not get going"
        missing = [rid for rid, _ in seen if store.get_response(rid) is None]
        ledger = _ledger_responses(store)
        _report("--store-sync full", seen, [0.0] * len(missing), ledger)
        assert missing == []
        assert ledger >= len(seen)
        for rid, _ in seen[-AGENTS:]:
            hist = store.get(rid)
            assert hist is not None and hist.items, rid
    finally:
        store.close()
