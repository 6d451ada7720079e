"""SharedPersistence.close (``--workers``, Redis) writes out what responses ending during its flush
submit or charge (Persistence._drain), and stops an idle writer instead of cancelling it (see
Persistence.close, "Late records"); a writer busy with what arrived after its flush (while close()
waits for a read or for publishing) is waited for within the deadline, not cancelled."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from tests.unit.test_persist_edge_close import _rec
from tests.unit.test_persistence import GatedStore, _entry, _used


def test_what_the_writer_left_when_a_subclass_stopped_it_is_written_by_close(tmp_path: Path) -> None:
    """SharedPersistence (``--workers``, Redis) flushes and stops the writer itself, then calls
    Persistence.close: what came after its flush (submissions, a charge) is still queued then, and
    is written before the store's close, one job at a time on a store without transactions."""
    from hotloop.pipeline.shared import SharedPersistence
    from tests.unit.test_persistence import GatedStore

    store = GatedStore()
    gate = threading.Event()

    async def main() -> SharedPersistence:
        p = SharedPersistence(store, commit_delay=0.0)
        store.gates["resp_slow"] = gate
        await p.submit(_entry("resp_slow"))
        assert await asyncio.to_thread(store.entered.setdefault("resp_slow", threading.Event()).wait, 10)
        closing = asyncio.ensure_future(p.close(timeout=10))
        await asyncio.sleep(0.05)
        for i in range(3):
            await asyncio.wait_for(p.submit(_used(_entry(f"resp_during{i}")), "key_during"), 5)
        p.charge(_rec("key_during"))
        gate.set()
        await asyncio.wait_for(closing, 15)
        return p

    p = asyncio.run(main())
    stored = {f"resp_during{i}" for i in range(3) if store.get_response(f"resp_during{i}") is not None}
    assert stored == {f"resp_during{i}" for i in range(3)}, stored
    assert sum(r["responses"] for r in store.usage("key_during")) == 4
    assert p.failed == 0 and p.usage_failed == 0 and p.usage_written == 4


class _ReadGatedStore(GatedStore):
    """A GatedStore whose reads (``get_response``) wait for ``read_gate``, and whose close is seen."""

    def __init__(self) -> None:
        super().__init__()
        self.read_gate = threading.Event()
        self.read_entered = threading.Event()
        self.closed = False

    def get_response(self, rid: str, scope: str | None = None) -> Any:
        self.read_entered.set()
        self.read_gate.wait(30)
        return super().get_response(rid, scope)

    def close(self) -> None:
        self.closed = True
        super().close()


async def _late_during_a_read(store: _ReadGatedStore, timeout: float) -> tuple[Any, asyncio.Future[None], asyncio.Future[Any]]:
    """close(timeout) started while a read is in flight (its flush done); then a response ends
    (stored, charged) and the writer enters its put; then the read ends. Returns the persistence,
    close()'s future and the read's."""
    from hotloop.pipeline.shared import SharedPersistence

    p = SharedPersistence(store, commit_delay=0.0)
    store.gates["resp_late"] = threading.Event()
    await p.submit(_used(_entry("resp_first")), "key_a")
    await asyncio.wait_for(p.flush(), 5)
    read = asyncio.ensure_future(p.get_response("resp_unknown"))  # a GET in flight
    assert await asyncio.to_thread(store.read_entered.wait, 5)
    closing = asyncio.ensure_future(p.close(timeout=timeout))
    await asyncio.sleep(0.1)  # close(): its flush done, it waits for the read
    assert not closing.done()
    await asyncio.wait_for(p.submit(_used(_entry("resp_late")), "key_late"), 5)  # a response ending now
    assert await asyncio.to_thread(store.entered.setdefault("resp_late", threading.Event()).wait, 5)
    store.read_gate.set()  # the read ends: close() goes on, the writer inside its batch
    return p, closing, read


def test_a_writer_busy_with_what_came_during_a_read_is_waited_for_not_cancelled() -> None:
    """A response ending while close() waits for a read in flight is picked up by the writer;
    close() then waits for that batch within its deadline (the writer was not stuck: 10 s
    remained), writes the ledger record still buffered, and closes the store. (It cancelled the
    writer: the response, written by its thread all the same, was reported lost, its ledger record
    logged as not written "within the shutdown bound", and the store was left unclosed.)"""
    store = _ReadGatedStore()

    async def main() -> tuple[Any, bool]:
        p, closing, read = await _late_during_a_read(store, timeout=10)
        try:
            await asyncio.sleep(0.3)
            waited = not closing.done()  # close() waits for the writer's batch
        finally:
            store.gates["resp_late"].set()  # the put finishes
        await asyncio.wait_for(closing, 15)
        await asyncio.wait_for(asyncio.gather(read, return_exceptions=True), 5)
        return p, waited

    p, waited = asyncio.run(main())
    assert store.get_response("resp_late") is not None
    assert (p.failed, p.lost("resp_late"), p.usage_failed, p.stuck) == (0, False, 0, False)
    assert (p.written, p.usage_written) == (2, 2)
    assert sum(r["responses"] for r in store.usage("key_late")) == 1
    assert store.closed
    assert waited


def test_a_writer_busy_past_the_deadline_is_given_up_within_the_bound() -> None:
    """The same writer still inside the store at close()'s deadline: close() returns within its
    bound, the store stuck (not closed under the thread), the response and its ledger record
    counted as not written."""
    store = _ReadGatedStore()

    async def main() -> tuple[Any, float]:
        p, closing, read = await _late_during_a_read(store, timeout=1.0)
        started = time.monotonic()
        try:
            await asyncio.wait_for(closing, 5)
        finally:
            store.gates["resp_late"].set()
        elapsed = time.monotonic() - started
        await asyncio.wait_for(asyncio.gather(read, return_exceptions=True), 5)
        return p, elapsed

    p, elapsed = asyncio.run(main())
    assert elapsed < 1.5, elapsed
    assert p.stuck and not store.closed
    assert (p.failed, p.lost("resp_late"), p.usage_failed) == (1, True, 1)


def test_other_workers_deletions_are_heard_while_every_reader_thread_is_busy(tmp_path: Path) -> None:
    """--workers on SQLite: the poll for the deletions other workers make ran in the reader
    threads, behind the requests' reads; under read load it fell behind a DELETE's settle time,
    and this worker answered from its cache what another had deleted and answered 200 for."""
    from hotloop.pipeline.shared import DELETE_SETTLE_SECONDS, READER_THREADS, DeletionLog, SharedPersistence
    from hotloop.state.store import SQLiteStore

    path = tmp_path / "h.sqlite3"
    store = SQLiteStore(path)
    gate = threading.Event()
    evicted: list[str] = []

    async def main() -> None:
        p = SharedPersistence(store, commit_delay=0.0)
        p.evict = evicted.append  # type: ignore[assignment]
        p.start()
        try:
            await asyncio.sleep(0.2)  # the poll has read where the log stands
            busy = [p._call(gate.wait, 30) for _ in range(READER_THREADS)]  # reads that take long
            reads = asyncio.gather(*busy)
            other = DeletionLog(str(path))  # another worker's delete
            other.record("resp_gone")
            other.close()
            deadline = asyncio.get_running_loop().time() + 10 * DELETE_SETTLE_SECONDS
            while not evicted and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            heard = list(evicted)  # while the reads still hold every reader thread
            gate.set()
            await reads
            assert heard == ["resp_gone"]
        finally:
            gate.set()
            await p.close(timeout=10)

    asyncio.run(main())


def test_the_delete_subscription_is_tried_again_within_a_quarter_second(monkeypatch: Any) -> None:
    """While Redis is unreachable the delete subscriber tries again with a backoff capped at
    SUBSCRIBER_RETRY_CAP_SECONDS, not the store's 2 s: a DELETE made through another process as
    Redis returns is not heard until the subscription is back, and this process served the
    response from its cache until then (up to 2 s)."""
    import types

    import pytest

    from hotloop.pipeline import shared
    from tests.conftest import free_port

    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        if len(delays) >= 10:
            raise asyncio.CancelledError

    monkeypatch.setattr(asyncio, "sleep", sleep)
    me = types.SimpleNamespace(forget=None, deleted=None, evict=None)
    with pytest.raises(asyncio.CancelledError):  # Redis refuses every connection
        asyncio.run(shared.SharedPersistence._listen(me, f"redis://127.0.0.1:{free_port()}/0"))  # type: ignore[arg-type]
    assert len(delays) == 10 and delays[0] == 0.05
    assert max(delays) == shared.SUBSCRIBER_RETRY_CAP_SECONDS == 0.25, delays


def test_while_redis_is_unreachable_the_queue_admits_by_count_and_bytes_and_one_record_always() -> None:
    """While the store retries its writes, a finished response's record joins the queue within
    its count and byte bounds, whatever the lag (its client is answered instead of waiting for
    Redis), and one record always may join an empty queue, however large, as ever."""
    import types

    from hotloop.pipeline.post import Persistence
    from hotloop.pipeline.shared import SharedPersistence

    store = types.SimpleNamespace(available=False, batch=None)
    p = SharedPersistence.__new__(SharedPersistence)
    Persistence.__init__(p, store, max_pending=3, max_pending_bytes=1000)  # type: ignore[arg-type]
    assert p._has_room(2000)  # empty: one record always
    for _ in range(3):
        p._jobs.append(p._job("put", None, 100))
        p._jobs_bytes += 100
    p._jobs[0] = p._jobs[0]._replace(at=p._jobs[0].at - 60)  # its oldest write waited a minute: past the lag
    assert not p._has_room(10)  # the count bound
    p._jobs.pop()
    p._jobs_bytes -= 100
    assert p._has_room(10) and not p._has_room(900)  # within the count, then the byte bound
    assert not p.writable()  # a new store: true response is still refused (its oldest waited)
    store.available = True
    assert not p._has_room(10)  # reachable again: the lag bound holds, as ever
