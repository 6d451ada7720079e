"""Another connection takes the SQLite file's write lock at the worst moment, with real files and
a real second connection holding ``BEGIN IMMEDIATE`` (``hotloop keys``, a backup, an open
``sqlite3`` shell, another worker's write):

* right after a DELETE's wait for the writes queued before it, with a write queued meanwhile: the
  writer retries that write for up to a minute (``LOCKED_RETRY_SECONDS``), and the DELETE used to
  wait for those retries a second time; it answers 503 within its one bound, nothing deleted;
* right after a ``--workers`` delete's transaction: the record the other workers read is in that
  transaction, so a DELETE answered 200 is evicted from every worker's cache (it used to be a
  second transaction, locked out: 200 with a warning, the response still served elsewhere);
* while a server starts on a file holding an earlier version's ledger rows to move: it starts and
  serves reads (the move is left for the next listing), instead of failing after the busy timeout;

and ``--store-busy-timeout`` sets the store's busy timeout (and is held to its range).
"""

from __future__ import annotations

import asyncio
import logging
import math
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from hotloop import cli
from hotloop.config import Config
from hotloop.pipeline.shared import DELETE_POLL_SECONDS, SharedPersistence
from hotloop.server.runner import make_app, make_store
from hotloop.state import store as store_mod
from hotloop.state.store import SQLiteStore, StoreBusy
from tests.unit.test_persistence import _entry
from tests.unit.test_sqlite_write_lock_requests import (
    BOUND, BUSY, Lock, Running, _is_busy, _legacy_ledger_row, _serve,
)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "workers"])
def test_a_delete_locked_out_after_its_wait_for_the_writer_answers_503_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """The DELETE's wait for the writes queued before it ends; at once a turn's write is queued
    and another connection takes the lock. The writer retries that write for up to 60 s: the
    DELETE answers 503 within its bound (it waited for those retries: no answer for a minute),
    with nothing deleted; after the lock the write is stored and the DELETE goes through."""

    async def test(s: Running) -> None:
        victim = await s.create("delete me")
        await s.settled()
        p = s.app.persistence
        flush = p.flush
        lock: Lock | None = None

        async def flush_then_lock() -> int:
            nonlocal lock
            done = await flush()
            if lock is None:  # the DELETE's wait for the writer is over: the race
                lock = Lock(s.path)
                await p.submit(_entry("resp_queued"))  # a turn that finished meanwhile
            return done

        monkeypatch.setattr(p, "flush", flush_then_lock)
        try:
            t0 = time.monotonic()
            try:
                r = await s.client.delete(f"/v1/responses/{victim}", timeout=BOUND + 1.0)
            except httpx.ReadTimeout:
                pytest.fail(f"no answer within {BOUND + 1.0:.1f} s (the bound is {BOUND:.2f} s)")
            _is_busy(r, time.monotonic() - t0)
            assert lock is not None
        finally:
            if lock is not None:
                lock.release()
            monkeypatch.setattr(p, "flush", flush)
        await s.settled()
        assert p.failed == 0 and s.app.persistence.store.get_response("resp_queued") is not None
        assert (await s.client.get(f"/v1/responses/{victim}")).status_code == 200  # not deleted
        assert (await s.client.delete(f"/v1/responses/{victim}")).status_code == 200
        assert (await s.client.get(f"/v1/responses/{victim}")).status_code == 404

    _serve(tmp_path, workers, monkeypatch, test)


def _recorded(path: Path) -> list[str]:
    """The ids the other workers read from ``deleted_responses``."""
    db = sqlite3.connect(path)
    try:
        return [r[0] for r in db.execute("SELECT id FROM deleted_responses ORDER BY seq")]
    finally:
        db.close()


def test_a_delete_through_one_worker_is_recorded_for_the_others_with_it_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two workers' persistences on one file, the second's cache evicting what the deletion log
    names. Locked before the DELETE: 503, nothing deleted, nothing recorded. Locked right after
    the delete's own transaction: the record is already in it, so the other worker evicts the
    response (before: the record's own transaction waited out the busy timeout, and the DELETE
    answered 200 with "could not publish" while the other worker kept the response cached)."""
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(store_mod, "BUSY_TIMEOUT", BUSY)
    path = tmp_path / "shared.sqlite3"
    one, two = SQLiteStore(path), SQLiteStore(path)

    async def main() -> None:
        p1, p2 = SharedPersistence(one), SharedPersistence(two)
        evicted: list[str] = []
        p2.evict = evicted.append
        p1.start()
        p2.start()
        for p in (p1, p2):  # (the deletion log's own connection waits as long as the store's)
            assert p._deletions is not None
            with p._deletions._lock:
                p._deletions._db.execute(f"PRAGMA busy_timeout = {int(BUSY * 1000)}")
        try:
            for rid in ("resp_a", "resp_b"):
                await p1.submit(_entry(rid))
            await p1.flush()

            lock = Lock(path)  # locked before: neither the delete nor its record
            try:
                with pytest.raises(StoreBusy):
                    await asyncio.wait_for(p1.delete("resp_a"), BOUND)
            finally:
                lock.release()
            assert one.get_response("resp_a") is not None and _recorded(path) == [] and evicted == []

            real = one.delete
            after: Lock | None = None

            def delete_then_lock(*args: Any, **kwargs: Any) -> bool:
                nonlocal after
                deleted = real(*args, **kwargs)
                after = Lock(path)  # the lock comes right after the delete's transaction
                return deleted

            monkeypatch.setattr(one, "delete", delete_then_lock)
            try:
                t0 = time.monotonic()
                deleted = await asyncio.wait_for(p1.delete("resp_a"), BOUND)
                took = time.monotonic() - t0
                await asyncio.sleep(2 * DELETE_POLL_SECONDS)  # (the DELETE answered after its settle time)
            finally:
                if after is not None:
                    after.release()
            assert deleted and one.get_response("resp_a") is None
            assert evicted == ["resp_a"], f"the other worker did not evict the deleted response: {evicted}"
            assert _recorded(path) == ["resp_a"] and took < BOUND, took
            assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "publish" in r.getMessage()]
        finally:
            await p1.close()
            await p2.close()

    asyncio.run(main())


def test_a_server_starts_on_a_locked_file_with_an_earlier_versions_ledger_rows_to_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The file's ledger rows kept by key name (an earlier version's) are moved at open, a write:
    with another connection holding the lock the store failed to open after the busy timeout, and
    the server with it. It starts at once now, serves reads from the file, answers the usage
    listing 503 while locked, and lists the moved rows once the lock is gone."""
    monkeypatch.setattr(store_mod, "BUSY_TIMEOUT", BUSY)  # (before, the open failed after it)
    monkeypatch.setenv("HOTLOOP_STORE_BUSY_TIMEOUT", str(BUSY))
    caplog.set_level(logging.INFO, logger="hotloop.store")
    config = Config.from_env(store="sqlite", data_dir=str(tmp_path), sim_rate=0)

    async def serve(test: Any) -> Any:
        app = make_app(config)
        await app.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:  # type: ignore[arg-type]
                return await test(c)
        finally:
            await app.shutdown()

    async def earlier(c: httpx.AsyncClient) -> str:  # a server ran on the file before
        r = await c.post("/v1/responses", json={"model": "hotloop-sim", "input": "hi", "metadata": {"sim": "tokens:3"}})
        assert r.status_code == 200, r.text
        return str(r.json()["id"])

    rid = asyncio.run(serve(earlier))
    _legacy_ledger_row(str(config.db_path))
    lock = Lock(config.db_path)
    try:
        async def locked_out(c: httpx.AsyncClient) -> None:
            got = await c.get(f"/v1/responses/{rid}")
            assert got.status_code == 200 and got.json()["id"] == rid, got.text
            usage = await c.get("/hotloop/usage")
            assert usage.status_code == 503 and usage.headers.get("retry-after") == "1", usage.text

        t0 = time.monotonic()
        asyncio.run(serve(locked_out))
        assert time.monotonic() - t0 < BOUND
    finally:
        lock.release()
    lines = [r.getMessage() for r in caplog.records if "at open" in r.getMessage()]
    assert len(lines) == 1 and "moved before the next usage listing" in lines[0], lines

    async def listed(c: httpx.AsyncClient) -> None:
        rows = (await c.get("/hotloop/usage")).json()["data"]
        assert {(row["key_id"], row["model"]): row["responses"] for row in rows} == {
            ("anonymous", "old-model"): 3, ("anonymous", "hotloop-sim"): 1,
        }, rows

    asyncio.run(serve(listed))


def test_store_busy_timeout_sets_the_stores_busy_timeout_and_is_held_to_its_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--store-busy-timeout`` / ``HOTLOOP_STORE_BUSY_TIMEOUT``: the SQLite connection's busy
    timeout (its default is the store's ``BUSY_TIMEOUT``); more than 0, at most
    ``MAX_STORE_BUSY_TIMEOUT``, else the server does not start (exit code 3)."""
    from hotloop.config import MAX_STORE_BUSY_TIMEOUT

    assert Config().store_busy_timeout == store_mod.BUSY_TIMEOUT
    monkeypatch.setenv("HOTLOOP_STORE_BUSY_TIMEOUT", "1.5")
    assert Config.from_env().store_busy_timeout == 1.5
    store = make_store(Config.from_env(data_dir=str(tmp_path)))
    try:
        assert isinstance(store, SQLiteStore) and store.busy_timeout == 1.5
        with store._lock:
            assert store._db.execute("PRAGMA busy_timeout").fetchone()[0] == 1500
        store.delete("resp_none", wait=0.2)  # a request's shorter wait is only its own
        with store._lock:
            assert store._db.execute("PRAGMA busy_timeout").fetchone()[0] == 1500
    finally:
        store.close()
    for bad in (0.0, -1.0, math.nan, math.inf, MAX_STORE_BUSY_TIMEOUT + 1):
        with pytest.raises(ValueError, match="--store-busy-timeout"):
            Config(store_busy_timeout=bad).check()
    Config(store_busy_timeout=MAX_STORE_BUSY_TIMEOUT).check()
    monkeypatch.delenv("HOTLOOP_STORE_BUSY_TIMEOUT")
    code = cli.main(["serve", "--store-busy-timeout", "0", "--data-dir", str(tmp_path)])
    assert code == 3 and "--store-busy-timeout" in capsys.readouterr().err
