"""The move of the oldest ledger (the ``usage`` table: one row per day and model, before the
ledger recorded keys) into the ledger by key id, on a real SQLite file that another connection
holds write-locked.

It was made at open with the connection's whole busy timeout (5 s by default, up to
``--store-busy-timeout``): a server starting while ``hotloop keys``, a backup or another worker
held the file waited all of it, then went on without a word with those rows left out of every
listing until a later open. It is now one of the tidy-ups of an open (``OPEN_WAIT`` at most,
done at once when the lock is free, one log line when left) and made again before every usage
listing (within the request's bound), as the move of the ledger kept by key name is."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from hotloop.state import store as store_mod
from hotloop.state.store import SQLiteStore, StoreBusy

BUSY = 3.0  # the store's busy timeout here: what the open used to wait
_OLDEST = """
CREATE TABLE usage (day TEXT NOT NULL, model TEXT NOT NULL, responses INTEGER NOT NULL, input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL,
    PRIMARY KEY (day, model));
INSERT INTO usage VALUES ('1969-12-31', 'old-model', 4, 40, 30, 2, 1);
"""


def _file_with_the_oldest_ledger(path: Path) -> None:
    SQLiteStore(path).close()  # today's schema, then the table an early version left
    db = sqlite3.connect(path)
    db.executescript(_OLDEST)
    db.commit()
    db.close()


class Lock:
    """Another connection holding the file's write lock until :meth:`release` (or ``after`` s)."""

    def __init__(self, path: Path, after: float | None = None) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("BEGIN IMMEDIATE")
        self._timer = threading.Timer(after, self.release) if after is not None else None
        self._done = threading.Lock()
        if self._timer is not None:
            self._timer.start()

    def release(self) -> None:
        with self._done:
            if self.db is not None:
                self.db.execute("ROLLBACK")
                self.db.close()
                self.db = None  # type: ignore[assignment]


def _oldest_rows(store: SQLiteStore) -> list[tuple[str, str, int, int]]:
    return [(r["day"], r["model"], r["responses"], r["input_tokens"]) for r in store.usage("anonymous")]


def test_the_oldest_ledger_move_at_open_is_bounded_and_made_by_the_next_listing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "h.sqlite3"
    _file_with_the_oldest_ledger(path)
    caplog.set_level(logging.INFO, logger="hotloop.store")
    lock = Lock(path)
    try:
        t0 = time.monotonic()
        store = SQLiteStore(path, busy_timeout=BUSY)
        took = time.monotonic() - t0
        try:
            assert took < store_mod.OPEN_WAIT + 1.0, f"the open waited {took:.2f} s (busy timeout {BUSY} s)"
            t0 = time.monotonic()
            with pytest.raises(StoreBusy):  # a listing while locked: a 503, within its bound, nothing lost
                store.usage(wait=0.2)
            assert time.monotonic() - t0 < 1.5
        finally:
            lock.release()
        lines = [r.getMessage() for r in caplog.records if "at open" in r.getMessage()]
        assert len(lines) == 1 and "before the next usage listing" in lines[0], lines
        assert _oldest_rows(store) == [("1969-12-31", "old-model", 4, 40)]
        store.close()
    finally:
        lock.release()
    with sqlite3.connect(path) as db:
        assert not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'usage'").fetchone()
    again = SQLiteStore(path)
    assert _oldest_rows(again) == [("1969-12-31", "old-model", 4, 40)]  # moved once, counted once
    again.close()


def test_the_oldest_ledger_move_at_open_finishes_as_soon_as_the_lock_is_released(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    _file_with_the_oldest_ledger(path)
    lock = Lock(path, after=0.1)
    try:
        t0 = time.monotonic()
        store = SQLiteStore(path, busy_timeout=BUSY)
        took = time.monotonic() - t0
    finally:
        lock.release()
    try:
        assert took < store_mod.OPEN_WAIT + 0.5, took
        with sqlite3.connect(path) as db:  # moved at open: the lock was gone within OPEN_WAIT
            assert not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'usage'").fetchone()
        assert _oldest_rows(store) == [("1969-12-31", "old-model", 4, 40)]
    finally:
        store.close()


def test_the_oldest_ledger_move_at_open_without_a_lock_is_immediate(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    _file_with_the_oldest_ledger(path)
    t0 = time.monotonic()
    store = SQLiteStore(path, busy_timeout=BUSY)
    try:
        assert time.monotonic() - t0 < 1.0
        assert _oldest_rows(store) == [("1969-12-31", "old-model", 4, 40)]
    finally:
        store.close()
