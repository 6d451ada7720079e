"""Usage charges and submissions that reach :class:`Persistence` while or after it closes (a
response still running after the shutdown grace plus the abort window), on a real SQLite file.

Usage records are billing data: a charge is never lost silently. While ``close()`` writes the
queue out, what arrives is written with it (the store is still open); once the store is closed, a
record cannot be written any more, so it is logged at ERROR with what an operator needs to add it
to the ledger (key id and name, model, day, tokens, the response's id) and counted
(``usage_failed``, ``hotloop_store_usage_failed``). Nothing raises to the caller, no writer is
started again on a closed store, and the shutdown stays bounded."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hotloop.pipeline.post import Persistence
from hotloop.state.store import SQLiteStore, UsageRecord
from tests.unit.test_persistence import _entry, _used


class GatedSQLite(SQLiteStore):
    """A real SQLite store whose ``put`` of a gated id waits (bounded) until ``gate`` opens."""

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.gated: set[str] = set()

    def put(self, rec: Any) -> None:
        if rec.response["id"] in self.gated:
            self.entered.set()
            self.gate.wait(10)
        super().put(rec)


def _rec(key: str, input_tokens: int = 11, output_tokens: int = 7) -> UsageRecord:
    return UsageRecord("m-late", input_tokens, output_tokens, 2, 1, time.time(), key, None, f"name-{key}")


def _ledger(path: Path, key: str) -> list[dict[str, Any]]:
    store = SQLiteStore(path)
    try:
        return store.usage(key)
    finally:
        store.close()


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hotloop") and r.levelno >= logging.ERROR]


async def _writer_inside(store: GatedSQLite, p: Persistence, rid: str) -> None:
    """``rid`` submitted and the writer thread inside its put (waiting on the gate)."""
    store.gated.add(rid)
    await p.submit(_entry(rid))
    assert await asyncio.to_thread(store.entered.wait, 10)


def test_a_charge_arriving_while_close_flushes_is_written(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    store = GatedSQLite(path)

    async def main() -> Persistence:
        p = Persistence(store, commit_delay=0.0)
        await _writer_inside(store, p, "resp_slow")
        closing = asyncio.ensure_future(p.close(timeout=10))
        await asyncio.sleep(0.05)  # close() is writing the queue out
        assert not closing.done()
        p.charge(_rec("key_during"))  # a response cut short at the end of the grace
        store.gate.set()
        await asyncio.wait_for(closing, 15)
        return p

    p = asyncio.run(main())
    rows = _ledger(path, "key_during")
    assert [(r["responses"], r["input_tokens"], r["output_tokens"]) for r in rows] == [(1, 11, 7)], rows
    assert p.failed == 0 and p.usage_failed == 0


def test_a_submit_arriving_while_close_flushes_is_stored_and_charged(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    store = GatedSQLite(path)

    async def main() -> Persistence:
        p = Persistence(store, commit_delay=0.0)
        await _writer_inside(store, p, "resp_slow")
        closing = asyncio.ensure_future(p.close(timeout=10))
        await asyncio.sleep(0.05)
        assert not closing.done()
        await asyncio.wait_for(p.submit(_used(_entry("resp_during")), "key_during"), 5)
        store.gate.set()
        await asyncio.wait_for(closing, 15)
        return p

    p = asyncio.run(main())
    again = SQLiteStore(path)
    try:
        assert again.get_response("resp_during") is not None
        assert [r["responses"] for r in again.usage("key_during")] == [1]
    finally:
        again.close()
    assert p.failed == 0 and not p.lost("resp_during") and p.written == 2


def test_a_charge_after_close_is_logged_for_reconciliation_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "h.sqlite3"
    caplog.set_level(logging.INFO)

    async def main() -> Persistence:
        p = Persistence(SQLiteStore(path), commit_delay=0.0)
        await p.submit(_entry("resp_a"))
        await p.close()
        caplog.clear()
        p.charge(_rec("key_after", 123, 45))  # never raises
        assert p._task is None  # no writer started again on the closed store
        await asyncio.sleep(Persistence.USAGE_FLUSH_SECONDS + 0.2)  # (a timer would have fired)
        return p

    p = asyncio.run(main())
    lines = _errors(caplog)
    assert len(lines) == 1, lines
    line = lines[0]
    for part in ("key_after", "name-key_after", "m-late", "input_tokens=123", "output_tokens=45", "cached_tokens=2",
                 "reasoning_tokens=1"):
        assert part in line, (part, line)
    assert "Traceback" not in caplog.text and all(r.exc_info is None for r in caplog.records)
    assert p.usage_failed == 1 and p.failed == 0
    assert _ledger(path, "key_after") == []  # (nothing wrote to the file behind the log's back)


def test_a_charge_after_close_names_its_response(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    async def main() -> None:
        p = Persistence(SQLiteStore(tmp_path / "h.sqlite3"))
        p.start()
        await p.close()
        caplog.clear()
        p.charge(_rec("key_after"), response_id="resp_cut_short")

    asyncio.run(main())
    lines = _errors(caplog)
    assert len(lines) == 1 and "resp_cut_short" in lines[0] and "key_after" in lines[0], lines


def test_a_submit_after_close_is_not_stored_but_logged_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "h.sqlite3"
    caplog.set_level(logging.INFO)

    async def main() -> Persistence:
        p = Persistence(SQLiteStore(path), commit_delay=0.0)
        await p.submit(_entry("resp_a"))
        await p.close()
        caplog.clear()
        await asyncio.wait_for(p.submit(_used(_entry("resp_late")), "key_late", name="late"), 1)  # never raises, never waits
        assert p._task is None
        await asyncio.sleep(Persistence.USAGE_FLUSH_SECONDS + 0.2)
        return p

    p = asyncio.run(main())
    lines = _errors(caplog)
    assert any("resp_late" in line and "not stored" in line for line in lines), lines
    usage = [line for line in lines if "key_late" in line]
    assert len(usage) == 1 and "resp_late" in usage[0] and "input_tokens=3" in usage[0], lines
    assert p.lost("resp_late") and p.failed == 1 and p.usage_failed == 1
    assert "resp_late" not in p.pending
    assert "Traceback" not in caplog.text


def test_close_stays_bounded_with_a_stuck_writer_and_what_it_could_not_write_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer thread stuck in the store past close()'s bound: close() returns within it; the
    charges that came during the close and after it are logged with their details, not lost."""
    path = tmp_path / "h.sqlite3"
    store = GatedSQLite(path)
    caplog.set_level(logging.INFO)

    async def main() -> tuple[Persistence, float]:
        p = Persistence(store, commit_delay=0.0)
        await _writer_inside(store, p, "resp_stuck")
        t0 = time.monotonic()
        closing = asyncio.ensure_future(p.close(timeout=0.5))
        await asyncio.sleep(0.05)
        p.charge(_rec("key_during"))
        await asyncio.wait_for(closing, 5)
        took = time.monotonic() - t0
        p.charge(_rec("key_after"))
        return p, took

    try:
        p, took = asyncio.run(main())
    finally:
        store.gate.set()
    assert took < 1.5, took
    assert p.stuck
    lines = _errors(caplog)
    assert any("key_during" in line and "input_tokens=11" in line for line in lines), lines
    assert any("key_after" in line and "input_tokens=11" in line for line in lines), lines
    assert p.usage_failed == 2



def test_close_writes_what_is_left_one_job_at_a_time_on_a_store_without_transactions() -> None:
    """What close() writes itself (records that came while the writer stopped, or that a subclass
    stopping the writer itself left queued, as SharedPersistence does for Redis) on a store
    without ``batch()``: each job alone, none failed for the lack of a transaction."""
    from hotloop.pipeline.post import snapshot
    from hotloop.state.store import MemoryStore

    store = MemoryStore()
    p = Persistence(store)
    entries = [_used(_entry(f"resp_left{i}")) for i in range(2)]
    jobs = [p._job("put", snapshot(e), 0) for e in entries] + [p._job("usage", [_rec("key_left"), _rec("key_left")], 0)]
    assert p._write_left(jobs) == [None, None, None]
    assert all(store.get_response(e.id) is not None for e in entries)
    assert [r["responses"] for r in store.usage("key_left")] == [2]


def test_a_submission_waiting_for_room_when_close_gives_up_returns_and_is_accounted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer stuck past close()'s bound with the queue full: a turn waiting for room (its
    record queued behind) returns instead of waiting forever for a writer that is gone, its
    response is reported lost and counted, its ledger record logged with its details."""
    store = GatedSQLite(tmp_path / "h.sqlite3")
    caplog.set_level(logging.INFO)

    async def main() -> tuple[Persistence, bool]:
        p = Persistence(store, max_pending=1, commit_delay=0.0)
        await _writer_inside(store, p, "resp_stuck")
        await p.submit(_used(_entry("resp_queued")), "key_q")  # the queue's one place
        waiting = asyncio.ensure_future(p.submit(_used(_entry("resp_waiting")), "key_w"))
        await asyncio.sleep(0.05)
        assert not waiting.done() and p._blocked  # waits for room
        await asyncio.wait_for(p.close(timeout=0.5), 5)
        await asyncio.wait_for(waiting, 1)  # (before: waited for ever)
        return p, waiting.exception() is None

    try:
        p, returned = asyncio.run(main())
    finally:
        store.gate.set()
    assert returned and p.stuck
    assert p.lost("resp_queued") and p.lost("resp_waiting") and not p.pending
    assert p.usage_failed == 2
    lines = _errors(caplog)
    assert any("key_w" in line and "input_tokens=3" in line for line in lines), lines
    assert any("key_q" in line and "input_tokens=3" in line for line in lines), lines
