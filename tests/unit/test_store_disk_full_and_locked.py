"""The SQLite store's writer on a full disk and behind another connection's write lock, with
real SQLite files: a full disk (SQLite's ``max_page_count``, the real SQLITE_FULL; and a really
full tmpfs where the tests may mount one) is logged in
one line per kind without a traceback, counted (``failed``: ``hotloop_store_failed``), and the
writer works again once there is room; a write that waits out the busy timeout ("database is
locked") is written again once the lock is released, not dropped."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hotloop.pipeline import post
from hotloop.pipeline.post import Persistence
from hotloop.state.store import SQLiteStore, UsageRecord
from tests.integration.test_store_durability_bounds import _fill, full_disk  # noqa: F401  (a fixture)
from tests.unit.test_persistence import _entry

BIG = "x" * 20_000  # an input that needs new pages (overflow pages) in the file


def _limit_pages(store: SQLiteStore, full: bool) -> None:
    """A full disk for the store's connection: no page beyond those the file has (or no limit)."""
    with store._lock:
        if full:
            (pages,) = store._db.execute("PRAGMA page_count").fetchone()
            store._db.execute(f"PRAGMA max_page_count = {pages}")
        else:
            store._db.execute("PRAGMA max_page_count = 4294967294")


def _store_logs(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("hotloop.") and r.levelno >= logging.WARNING]


def _no_traceback(records: list[logging.LogRecord], caplog: pytest.LogCaptureFixture) -> None:
    assert all(r.exc_info is None for r in records), [r.getMessage() for r in records if r.exc_info]
    assert "Traceback" not in caplog.text


def _usage(i: int) -> UsageRecord:
    return UsageRecord(
        model=f"m{i % 3}", input_tokens=10, output_tokens=1, cached_tokens=0, reasoning_tokens=0, at=time.time(), key="k"
    )


def test_a_full_disk_is_logged_once_per_kind_counted_and_the_writer_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SQLiteStore(tmp_path / "full.sqlite3")
    caplog.set_level(logging.INFO)

    async def main() -> None:
        p = Persistence(store, commit_delay=0.0)
        _limit_pages(store, full=True)
        failing = [_entry(f"resp_full{i}", BIG) for i in range(12)]
        for e in failing[:6]:  # one at a time: each its own transaction
            await p.submit(e)
            await p.flush()
        for e in failing[6:]:  # together: one batch
            await p.submit(e)
        await p.flush()
        assert p.failed == len(failing) and p.written == 0
        assert all(p.lost(e.id) for e in failing)
        logged = _store_logs(caplog)
        assert len(logged) == 1, [r.getMessage() for r in logged]  # the first failure of the kind
        assert "database or disk is full" in logged[0].getMessage()
        _no_traceback(logged, caplog)

        _limit_pages(store, full=False)  # room again
        later = [_entry(f"resp_ok{i}", BIG) for i in range(5)]
        for e in later:
            await p.submit(e)
        await p.flush()
        assert p.written == len(later) and p.failed == len(failing)
        for e in later:
            assert store.get_response(e.id) is not None, e.id
        for e in failing:
            assert store.get_response(e.id) is None, e.id
        # one more line: the writes go through again, with what failed since the first line
        logged = _store_logs(caplog)
        assert len(logged) == 2, [r.getMessage() for r in logged]
        assert "11" in logged[1].getMessage()  # failures after the first line, counted
        _no_traceback(logged, caplog)
        await p.close()

    asyncio.run(main())


def test_full_disk_failures_are_summarised_at_most_once_per_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(post, "FAILURE_LOG_SECONDS", 0.3)
    store = SQLiteStore(tmp_path / "full.sqlite3")
    caplog.set_level(logging.INFO)

    async def main() -> None:
        p = Persistence(store, commit_delay=0.0)
        _limit_pages(store, full=True)
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < 1.0:
            await p.submit(_entry(f"resp_{n}", BIG))
            await p.flush()
            n += 1
        logged = _store_logs(caplog)
        # the first, then a summary per interval that had failures (4 intervals of 0.3 s at most)
        assert 2 <= len(logged) <= 5, [r.getMessage() for r in logged]
        assert n > len(logged) and p.failed == n
        _no_traceback(logged, caplog)
        await p.close()

    asyncio.run(main())


def test_a_full_disk_inside_a_batch_loses_exactly_what_it_reports(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SQLITE_FULL rolls back the whole transaction of a batch, the writes before the failed one
    included: every write of that batch is reported failed, and none of them is stored."""
    store = SQLiteStore(tmp_path / "batch.sqlite3")
    caplog.set_level(logging.INFO)

    async def main() -> None:
        p = Persistence(store, commit_delay=0.2, max_lag=1.0)
        await p.submit(_entry("resp_warm", BIG))  # grows the file a little: small rows fit after
        await p.flush()
        _limit_pages(store, full=True)
        batch = [_entry("resp_small0"), _entry("resp_big", BIG), _entry("resp_small1")]
        for e in batch:  # within the commit delay: one batch, one transaction
            await p.submit(e)
        await p.flush()
        stored = {e.id for e in batch if store.get_response(e.id) is not None}
        written = {e.id for e in batch if not p.lost(e.id)}
        assert stored == written, (stored, written)
        assert p.failed == len(batch) - len(written)
        logged = _store_logs(caplog)
        assert logged and all("no such savepoint" not in r.getMessage() for r in logged)
        assert "database or disk is full" in logged[0].getMessage()
        _no_traceback(logged, caplog)
        _limit_pages(store, full=False)
        await p.submit(_entry("resp_after", BIG))
        await p.flush()
        assert store.get_response("resp_after") is not None
        await p.close()

    asyncio.run(main())


class _Locker:
    """Another connection holding the file's write lock (``BEGIN IMMEDIATE``) for ``hold`` seconds."""

    def __init__(self, path: Path, hold: float) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("BEGIN IMMEDIATE")
        self.timer = threading.Timer(hold, self.release)
        self.timer.start()
        self.released = threading.Event()

    def release(self) -> None:
        if not self.released.is_set():
            self.db.execute("ROLLBACK")
            self.db.close()
            self.released.set()


def test_writes_locked_out_past_the_busy_timeout_are_retried_not_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--store-sync normal``: another process holds the write lock longer than the busy timeout,
    then releases it; every stored response and every ledger row is there afterwards."""
    path = tmp_path / "locked.sqlite3"
    store = SQLiteStore(path)
    with store._lock:
        store._db.execute("PRAGMA busy_timeout = 100")  # (5 s by default)
    caplog.set_level(logging.INFO)

    async def main() -> None:
        p = Persistence(store, commit_delay=0.0, max_lag=0.2)
        locker = _Locker(path, hold=1.0)
        try:
            entries = [_entry(f"resp_{i}") for i in range(8)]
            for i, e in enumerate(entries):  # a write taken alone, then the batches queued behind it
                p.charge(_usage(i))
                await asyncio.wait_for(p.submit(e), 8)
            await asyncio.wait_for(p.flush(), 8)
            waited = locker.released.is_set()
        finally:
            locker.release()
        for e in entries:
            assert store.get_response(e.id) is not None, e.id
        rows = await p.usage()
        assert sum(r["responses"] for r in rows) == len(entries)
        assert p.failed == 0 and waited, (p.failed, waited)
        logged = _store_logs(caplog)
        assert len(logged) <= 2, [r.getMessage() for r in logged]  # waiting on the lock; through again
        _no_traceback(logged, caplog)
        await p.close()

    asyncio.run(main())


def test_writes_locked_out_past_the_retry_bound_are_dropped_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(post, "LOCKED_RETRY_SECONDS", 0.5)
    path = tmp_path / "locked.sqlite3"
    store = SQLiteStore(path)
    with store._lock:
        store._db.execute("PRAGMA busy_timeout = 100")
    caplog.set_level(logging.INFO)

    async def main() -> None:
        p = Persistence(store, commit_delay=0.0)
        locker = _Locker(path, hold=3.0)
        try:
            entries = [_entry(f"resp_{i}") for i in range(4)]
            for e in entries:
                await asyncio.wait_for(p.submit(e), 8)
            await asyncio.wait_for(p.flush(), 8)
        finally:
            locker.release()
        assert p.failed == len(entries) and all(p.lost(e.id) for e in entries)
        dropped = [r for r in _store_logs(caplog) if r.levelno >= logging.ERROR]
        assert len(dropped) == 1, [r.getMessage() for r in dropped]
        assert "database is locked" in dropped[0].getMessage()
        _no_traceback(_store_logs(caplog), caplog)
        await p.submit(_entry("resp_after"))  # the lock is gone: the writer works again
        await p.flush()
        assert store.get_response("resp_after") is not None and p.failed == len(entries)
        await p.close()

    asyncio.run(main())


def test_a_locked_write_under_full_sync_completes_once_the_lock_is_released(tmp_path: Path) -> None:
    """``--store-sync full``: the terminal event waits for the write; a lock held past the busy
    timeout delays it (the write is retried) instead of failing the response."""
    import json

    import httpx
    import uvloop

    from hotloop.config import Config
    from hotloop.server.runner import make_app

    async def main() -> tuple[list[dict[str, Any]], int, bool]:
        app = make_app(Config(store="sqlite", data_dir=str(tmp_path), sim_rate=0, store_sync="full"))
        await app.startup()
        store = app.persistence.store
        assert isinstance(store, SQLiteStore)
        with store._lock:
            store._db.execute("PRAGMA busy_timeout = 100")
        try:
            transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                locker = _Locker(Path(store.path), hold=0.8)
                try:
                    body = {"model": "hotloop-sim", "input": "hi", "stream": True, "metadata": {"sim": "tokens:5"}}
                    r = await asyncio.wait_for(c.post("/v1/responses", json=body), 8)
                finally:
                    locker.release()
                events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]
                rid = events[-1]["response"]["id"]
                return events, app.persistence.failed, store.get_response(rid) is not None
        finally:
            await app.shutdown()

    events, failed, stored = uvloop.run(main())
    assert events[-1]["type"] == "response.completed", [e["type"] for e in events[-3:]]
    assert failed == 0 and stored


def test_a_real_full_disk_is_logged_once_per_kind_and_the_writer_recovers(
    full_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same on a filesystem that is really full (a 4 MiB tmpfs; root only): the writes fail
    in SQLite's commit (the WAL cannot grow), and the store works again once there is room."""
    store = SQLiteStore(full_disk / "data" / "store.sqlite3")
    caplog.set_level(logging.INFO)

    async def main() -> None:
        p = Persistence(store, commit_delay=0.0)
        _fill(full_disk)
        failing = [_entry(f"resp_full{i}", BIG) for i in range(10)]
        for e in failing[:5]:
            await p.submit(e)
            await p.flush()
        for e in failing[5:]:
            await p.submit(e)
        await p.flush()
        assert p.failed == len(failing) and p.written == 0
        failures = [r for r in _store_logs(caplog) if r.levelno >= logging.ERROR]
        assert 1 <= len(failures) <= 2, [r.getMessage() for r in failures]  # SQLITE_FULL (an I/O error kind)
        _no_traceback(_store_logs(caplog), caplog)
        (full_disk / "filler").unlink()
        later = [_entry(f"resp_ok{i}", BIG) for i in range(3)]
        for e in later:
            await p.submit(e)
        await p.flush()
        assert p.written == len(later)
        assert all(store.get_response(e.id) is not None for e in later)
        assert all(store.get_response(e.id) is None for e in failing)
        await p.close()

    asyncio.run(main())


def test_a_delete_the_file_refuses_to_write_is_a_503_in_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A DELETE (and a usage listing) whose write fails otherwise than locked out (here the file
    refuses every write: SQLITE_READONLY; a full disk or an I/O error alike) is a 503 to retry,
    logged in one line without a traceback; nothing is deleted, and once the file takes writes
    again the delete goes through. It was an unhandled error: a 500 and a traceback."""
    from hotloop import errors

    store = SQLiteStore(tmp_path / "ro.sqlite3")
    caplog.set_level(logging.INFO)

    async def main() -> None:
        p = Persistence(store, commit_delay=0.0)
        entry = _entry("resp_ro1")
        await p.submit(entry)
        await p.flush()
        with store._lock:
            store._db.execute("PRAGMA query_only = ON")
        for _ in range(3):
            with pytest.raises(errors.StoreUnavailable) as info:
                await p.delete("resp_ro1")
            assert info.value.status == 503 and "retry" in info.value.message
        logged = _store_logs(caplog)
        assert len(logged) == 1 and "a delete" in logged[0].getMessage() and "answered 503" in logged[0].getMessage()
        _no_traceback(logged, caplog)
        assert store.get("resp_ro1") is not None  # nothing deleted
        with store._lock:
            store._db.execute("PRAGMA query_only = OFF")
        assert await p.delete("resp_ro1") is True
        assert store.get("resp_ro1") is None
        await p.close()

    asyncio.run(main())
    store.close()


def test_a_delete_that_outwaits_the_writer_is_logged_as_a_locked_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A DELETE refused because the store's writer (retrying a batch another connection locks
    out) did not finish within the busy timeout says so in the log, at most once a minute, as a
    DELETE locked out of the file itself does."""
    store = SQLiteStore(tmp_path / "busy.sqlite3", busy_timeout=0.3)
    caplog.set_level(logging.INFO)

    async def main() -> None:
        p = Persistence(store, commit_delay=0.0)
        gate = asyncio.Event()

        async def never() -> None:
            await gate.wait()

        p.flush = never  # type: ignore[method-assign]  # the writer, behind a lock, never done
        for _ in range(2):
            with pytest.raises(post.StoreBusy):
                await p.delete("resp_x")
        lines = [r.getMessage() for r in _store_logs(caplog) if "answered 503" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("a delete: the store's writer"), lines
        gate.set()

    asyncio.run(main())
    store.close()
