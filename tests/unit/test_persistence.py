"""Persistence: records hold only what is new, flush is a barrier, pending writes are bounded by
count and bytes (back-pressure, never dropped), continuations of unstored parents stay loadable."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from typing import Any

import pytest

from hotloop.pipeline import items as itemlib
from hotloop.pipeline.post import Persistence, approx_nbytes, snapshot
from hotloop.pipeline.prepare import finished, prepare
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import decode_body, item_to_dict, validate
from hotloop.state.context import CachedResponse
from hotloop.state.store import MemoryStore, SQLiteStore, UsageRecord

IDS = IdGen(deterministic=True)


def _entry(rid: str, text: str = "hi", parent: CachedResponse | None = None, store: bool = True) -> CachedResponse:
    body: dict[str, Any] = {"model": "m", "input": text, "store": store}
    if parent is not None:
        body["previous_response_id"] = parent.id
    plan = prepare(validate(decode_body(json.dumps(body))), parent, IDS, itemlib.TokenCache())
    response = response_object(plan.prepared, rid, 0)
    response["output"] = [
        {"type": "message", "id": f"msg_out_{rid}", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": f"answer {rid}", "annotations": []}]}
    ]
    return finished(plan, response)


class GatedStore(MemoryStore):
    """A memory store whose ``put`` of a gated id blocks until its gate opens; records put order."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, threading.Event] = {}
        self.order: list[str] = []
        self.entered: dict[str, threading.Event] = {}

    def put(self, rec: Any) -> None:
        rid = rec.response["id"]
        self.entered.setdefault(rid, threading.Event()).set()
        gate = self.gates.get(rid)
        if gate is not None:
            gate.wait(30)
        self.order.append(rid)
        super().put(rec)


def _history(entry: CachedResponse) -> list[dict[str, Any]]:
    return [item_to_dict(it) for it in entry.context.items]


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_a_stored_continuation_holds_only_its_own_items(kind, tmp_path) -> None:
    store: Any = SQLiteStore(tmp_path / "h.sqlite3") if kind == "sqlite" else MemoryStore()

    async def main() -> list[CachedResponse]:
        p = Persistence(store)
        entries = [_entry("resp_0", "first")]
        for i in range(1, 20):
            entries.append(_entry(f"resp_{i}", f"turn {i} " + "y" * 50, entries[-1]))
        for e in entries:
            await p.submit(e)
        await p.flush()
        for e in entries:
            loaded = await p.load(e.id)
            assert loaded is not None and loaded.parent_id == e.parent_id and loaded.base_len == e.base_len
            assert _history(loaded) == _history(e)
            assert loaded.context.chain.fingerprints() == e.context.chain.fingerprints()
            assert loaded.context.tokens == e.context.tokens and loaded.input_len == e.input_len
        await p.close()
        return entries

    entries = asyncio.run(main())
    own = sum(len(e.context) - e.base_len for e in entries)
    assert own == 2 * 20
    if kind == "sqlite":
        s2 = SQLiteStore(tmp_path / "h.sqlite3")
        (rows,) = s2._db.execute("SELECT COUNT(*) FROM response_items").fetchone()
        assert rows == own
        assert s2.get("resp_19").items == _history(entries[-1])
        s2.close()
    else:
        assert store.items == own


def test_the_parent_is_recorded_by_finished() -> None:
    a = _entry("resp_a")
    b = _entry("resp_b", "more", a)
    assert (a.parent_id, a.base_len) == (None, 0)
    assert (b.parent_id, b.base_len) == ("resp_a", len(a.context))
    snap = snapshot(b)
    assert snap.own == b.context.items[len(a.context):] and len(snap.own) == 2
    assert approx_nbytes(snap.own) >= len("more") + len("answer resp_b")


def test_a_continuation_of_an_unstored_parent_stores_its_whole_history() -> None:
    store = MemoryStore()

    async def main() -> None:
        p = Persistence(store)
        a = _entry("resp_a", "not stored", store=False)
        b = _entry("resp_b", "stored", a)
        await p.submit(a)
        await p.submit(b)
        await p.flush()
        rec = store.get("resp_b")
        assert rec is not None and rec.parent_id is None and rec.items == _history(b)
        assert store.get("resp_a") is None
        await p.close()

    asyncio.run(main())


def test_flush_is_a_barrier_under_a_stream_of_writes() -> None:
    store = GatedStore()

    async def main() -> None:
        p = Persistence(store)
        first = [_entry(f"resp_f{i}") for i in range(3)]
        later = [_entry(f"resp_l{i}") for i in range(50)]
        gate_first = threading.Event()
        gate_later = threading.Event()
        for e in first:
            store.gates[e.id] = gate_first
        for e in later:
            store.gates[e.id] = gate_later
        for e in first:
            await p.submit(e)
        barrier = asyncio.ensure_future(p.flush())
        submitted = 0

        async def stream() -> None:  # writes keep arriving while the barrier waits
            nonlocal submitted
            for e in later:
                await p.submit(e)
                submitted += 1
                await asyncio.sleep(0)

        writer = asyncio.ensure_future(stream())
        await asyncio.sleep(0)
        assert not barrier.done()
        gate_first.set()
        await asyncio.wait_for(barrier, 30)  # a guard against hanging, not a timing assertion
        assert store.order == [e.id for e in first]
        assert all(store.get(e.id) is not None for e in first)
        gate_later.set()
        await writer
        await p.flush()
        assert store.order == [e.id for e in first + later] and not p.pending
        await p.close()

    asyncio.run(main())


def test_a_barrier_that_waits_for_room_does_not_wait_for_writes_submitted_meanwhile() -> None:
    """flush() queues the buffered ledger records as its last job; when the queue is full that
    job waits for room, and a write submitted meanwhile is queued after it: the barrier does
    not wait for that one (a DELETE or a usage listing under a stream of writes)."""
    store = GatedStore()

    async def main() -> None:
        p = Persistence(store, max_pending=1)
        r1, r2, r3 = (_entry(f"resp_{i}") for i in (1, 2, 3))
        gate, never = threading.Event(), threading.Event()
        store.gates[r1.id] = gate
        store.gates[r3.id] = never  # opened only once the barrier has returned
        await p.submit(r1, ledger=False)
        while r1.id not in store.entered:  # the writer holds r1
            await asyncio.sleep(0.001)
        await p.submit(r2, ledger=False)  # the queue is full now
        p.charge(UsageRecord("m", 1, 1, 0, 0, time.time()))
        barrier = asyncio.ensure_future(p.flush())
        await asyncio.sleep(0)
        later = asyncio.ensure_future(p.submit(r3, ledger=False))  # after the call
        await asyncio.sleep(0)
        assert not barrier.done()
        gate.set()
        try:
            target = await asyncio.wait_for(barrier, 10)  # a guard: waiting for r3 would hang here
            assert store.order == [r1.id, r2.id] and store.usage() and r3.id not in store.order
            assert p.seq > target
        finally:
            never.set()
        await later
        await p.flush()
        assert store.order == [r1.id, r2.id, r3.id]
        await p.close()

    asyncio.run(main())


def test_pending_writes_are_bounded_by_bytes_and_never_dropped() -> None:
    store = GatedStore()

    async def main() -> None:
        entries = [_entry(f"resp_{i}", "z" * 600) for i in range(4)]
        size = approx_nbytes(snapshot(entries[0]).own)
        p = Persistence(store, max_pending=100, max_pending_bytes=size + size // 2)
        gate = threading.Event()
        for e in entries:
            store.gates[e.id] = gate
        await p.submit(entries[0])
        await asyncio.to_thread(store.entered.setdefault("resp_0", threading.Event()).wait, 30)
        await p.submit(entries[1])  # queued: one record's bytes
        third = asyncio.ensure_future(p.submit(entries[2]))  # would exceed the byte bound
        fourth = asyncio.ensure_future(p.submit(entries[3]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not third.done() and not fourth.done()
        assert p.queued_bytes == size
        third.cancel()  # a client that left: its record is still written
        gate.set()
        await asyncio.wait_for(fourth, 30)
        await p.flush()
        assert store.order == [e.id for e in entries]
        assert p.queued_bytes == 0 and not p.pending
        await p.close()

    asyncio.run(main())


def test_a_writer_behind_by_max_lag_makes_submissions_wait() -> None:
    """The crash-loss bound: while the oldest queued write has waited ``max_lag``, finished turns
    wait (in order, nothing dropped); a younger queue admits at once."""
    store = GatedStore()

    async def main() -> None:
        entries = [_entry(f"resp_{i}") for i in range(4)]
        p = Persistence(store, max_pending=100, max_lag=0.05)
        gate = threading.Event()
        for e in entries:
            store.gates[e.id] = gate
        await p.submit(entries[0])  # the writer takes it and blocks on the gate
        await asyncio.to_thread(store.entered.setdefault("resp_0", threading.Event()).wait, 30)
        await asyncio.wait_for(p.submit(entries[1]), 1)  # queued: young, admitted at once
        await asyncio.sleep(0.1)  # resp_1 is now older than max_lag
        third = asyncio.ensure_future(p.submit(entries[2]))
        fourth = asyncio.ensure_future(p.submit(entries[3]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not third.done() and not fourth.done()
        gate.set()
        await asyncio.wait_for(asyncio.gather(third, fourth), 30)
        await p.flush()
        assert store.order == [e.id for e in entries]
        await p.close()

    asyncio.run(main())


def test_a_record_larger_than_the_byte_bound_is_admitted_alone() -> None:
    store = MemoryStore()

    async def main() -> None:
        p = Persistence(store, max_pending_bytes=10)
        for i in range(3):
            await asyncio.wait_for(p.submit(_entry(f"resp_{i}", "w" * 1000)), 30)
        await p.flush()
        assert all(store.get(f"resp_{i}") is not None for i in range(3))
        await p.close()

    asyncio.run(main())


def test_delete_waits_for_earlier_writes_only() -> None:
    store = GatedStore()

    async def main() -> None:
        p = Persistence(store)
        a = _entry("resp_a")
        await p.submit(a)
        await p.flush()
        later = _entry("resp_later")
        gate = threading.Event()
        store.gates[later.id] = gate
        await p.submit(later)  # submitted before the delete: the delete waits for it
        deleting = asyncio.ensure_future(p.delete("resp_a"))
        await p.submit(_entry("resp_after"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not deleting.done()
        gate.set()
        assert await asyncio.wait_for(deleting, 30) is True
        assert store.get("resp_a") is None and store.get("resp_later") is not None
        await p.close()

    asyncio.run(main())


def test_size_estimates_cover_every_item_kind() -> None:
    from hotloop.protocol.request import FunctionCall, FunctionCallOutput, InputImage, Message, OtherItem

    items = [
        Message(role="user", content=[InputImage(image_url="data:image/png;base64," + "A" * 5000)]),
        FunctionCall(call_id="c", name="f", arguments="x" * 700),
        FunctionCallOutput(call_id="c", output="o" * 900),
        OtherItem(type="custom_tool_call", data={"type": "custom_tool_call", "input": "i" * 1100}),
    ]
    sizes = [approx_nbytes([it]) for it in items]
    assert [s > n for s, n in zip(sizes, (5000, 700, 900, 1100))] == [True] * 4
    assert approx_nbytes(items) == sum(sizes)
    # what the decoded items hold, not their JSON: an array of empty objects kept verbatim holds
    # about 24 times its JSON (the caches count it so too: state.context.held_extra)
    empties = OtherItem(type="x_call", data={"type": "x_call", "input": [{} for _ in range(10_000)]})
    assert approx_nbytes([empties]) >= 10 * len(b"{},") * 10_000


class CountingSQLiteStore(SQLiteStore):
    """SQLite whose first put waits on a gate; counts the batches (transactions) it is given."""

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        self._in: list[int] | None = None

    def batch(self) -> Any:
        self.batches.append(0)
        return super().batch()

    def put(self, rec: Any) -> None:
        if not self.entered.is_set():
            self.entered.set()
            self.gate.wait(30)
        if self.batches:
            self.batches[-1] += 1
        super().put(rec)


def test_queued_writes_go_to_the_store_in_one_transaction(tmp_path: Any) -> None:
    """What queued behind a slow write is written together (one batch), in order, and a job
    that fails inside the batch (a parent that is not stored) is stored whole, not lost."""
    store = CountingSQLiteStore(tmp_path / "db.sqlite3")

    async def main() -> None:
        p = Persistence(store)
        first = _entry("resp_first")
        await p.submit(first)
        await asyncio.to_thread(store.entered.wait, 30)
        unstored = _entry("resp_unstored", store=False)  # a parent the store never gets
        entries = [_entry(f"resp_{i}") for i in range(10)] + [_entry("resp_orphan", parent=unstored)]
        for e in entries:
            await p.submit(e)
        store.gate.set()
        await p.flush()
        # one transaction for all eleven (the orphan put twice: as a continuation, then whole)
        assert store.batches == [len(entries) + 1]
        for e in [first, *entries]:
            hist = store.get(e.id)
            assert hist is not None and hist.items == _history(e), e.id
        assert p.written == len(entries) + 1 and p.failed == 0
        await p.close()

    asyncio.run(main())


def test_a_batch_savepoint_undoes_only_the_failed_write(tmp_path: Any) -> None:
    store = SQLiteStore(tmp_path / "db.sqlite3")
    from hotloop.pipeline.post import own_record, whole_record
    from hotloop.state.store import MissingParent

    a, b = _entry("resp_a"), _entry("resp_b")
    orphan = _entry("resp_o", parent=_entry("resp_gone", store=False))
    with store.batch():
        store.put(whole_record(snapshot(a)))
        with pytest.raises(MissingParent):
            store.put(own_record(snapshot(orphan)))
        store.put(whole_record(snapshot(b)))
    assert store.get("resp_a") is not None and store.get("resp_b") is not None
    assert store.get("resp_o") is None
    with pytest.raises(RuntimeError), store.batch():
        store.put(whole_record(snapshot(_entry("resp_c"))))
        raise RuntimeError("the whole batch fails")
    assert store.get("resp_c") is None  # rolled back with its transaction
    store.close()


class SlowBatchStore(MemoryStore):
    """A store whose commit takes 20 ms (a disk sync), in a batch or alone: counts the commits."""

    def __init__(self) -> None:
        super().__init__()
        self.commits = 0
        self.batching = False

    def _commit(self) -> None:
        time.sleep(0.02)
        self.commits += 1

    def batch(self) -> Any:
        @contextlib.contextmanager
        def txn() -> Any:
            self.batching = True
            try:
                yield
            finally:
                self.batching = False
            self._commit()

        return txn()

    def record_usage(self, recs: Any) -> None:
        super().record_usage(recs)
        if not self.batching:
            self._commit()


def test_a_writer_behind_the_lag_still_writes_whole_batches() -> None:
    """Past ``max_lag`` new turns wait, but the writer keeps taking whole batches: jobs that
    waited are admitted a batch at a time, not one per commit."""
    store = SlowBatchStore()

    async def main() -> None:
        p = Persistence(store, max_lag=0.01)

        async def producer() -> None:
            for _ in range(20):
                await p._enqueue("usage", [], 0)
                await asyncio.sleep(0.001)

        await asyncio.gather(*(producer() for _ in range(50)))
        await p.flush()
        assert p.failed == 0
        assert store.commits <= 40, store.commits  # 1,000 jobs: 16 batches of 64 at best
        await p.close()

    asyncio.run(main())


def _used(entry: CachedResponse) -> CachedResponse:
    entry.response["usage"] = {
        "input_tokens": 3, "output_tokens": 2, "total_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0},
    }
    return entry


def test_ledger_batches_wait_for_a_writer_behind_only_past_their_buffer() -> None:
    """A turn completing a usage batch while the writer is stuck does not wait for it (the
    buffer grows, bounded); the records all reach the store once it answers."""
    store = GatedStore()

    async def main() -> None:
        p = Persistence(store, max_pending=1)
        gate = threading.Event()
        blocker = _entry("resp_block")
        store.gates[blocker.id] = gate
        await p.submit(blocker)
        await asyncio.to_thread(store.entered.setdefault(blocker.id, threading.Event()).wait, 30)
        await p.submit(_entry("resp_queued"))  # the queue's one place: now it is full
        quick = [_used(_entry(f"resp_u{i}", store=False)) for i in range(Persistence.USAGE_BATCH + 10)]
        for e in quick:  # past a whole batch: none of these waits
            await asyncio.wait_for(p.submit(e), 1)
        assert len(p._usage) == len(quick)
        gate.set()
        await p.flush()
        assert sum(r["responses"] for r in store.usage()) == len(quick)
        await p.close()

    asyncio.run(main())


class BatchCountingStore(SQLiteStore):
    """SQLite that counts its transactions (``batch()``) and the puts made outside one."""

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self.batches = 0
        self.alone = 0
        self._batching = False

    def batch(self) -> Any:
        self.batches += 1
        return super().batch()

    def put(self, rec: Any) -> None:
        if not self._batching:
            self.alone += 1
        super().put(rec)


def test_turns_finishing_within_the_commit_delay_share_one_transaction(tmp_path: Any) -> None:
    """Group commit: with a commit delay, turns that finish a few milliseconds apart (a client's
    chained turns) are written in one transaction, and each is readable (pending) meanwhile."""
    store = BatchCountingStore(tmp_path / "db.sqlite3")

    async def main() -> None:
        p = Persistence(store, max_lag=1.0, commit_delay=0.3)
        entries = []
        parent = None
        for i in range(4):
            parent = _entry(f"resp_{i}", parent=parent)
            entries.append(parent)
            await p.submit(parent)
            assert await p.get_response(parent.id) is not None  # seen before it is written
            await asyncio.sleep(0.01)
        assert p.written == 0  # still gathering
        await asyncio.sleep(0.6)
        assert p.written == 4 and p.failed == 0
        assert store.batches == 1 and store.alone == 0, (store.batches, store.alone)
        for e in entries:
            hist = store.get(e.id)
            assert hist is not None and hist.items == _history(e), e.id
        await p.close()

    asyncio.run(main())


def test_flush_and_close_do_not_wait_for_the_commit_delay(tmp_path: Any) -> None:
    """A barrier (a DELETE, ``--store-sync full``, shutdown) ends the gathering at once."""
    store = BatchCountingStore(tmp_path / "db.sqlite3")

    async def main() -> None:
        p = Persistence(store, max_lag=120.0, commit_delay=60.0)
        await p.submit(_entry("resp_a"))
        await asyncio.sleep(0.05)
        t = time.monotonic()
        await p.flush()
        assert time.monotonic() - t < 5 and p.written == 1
        await p.submit(_entry("resp_b"))
        await asyncio.sleep(0.05)
        t = time.monotonic()
        await p.close()
        assert time.monotonic() - t < 5 and p.written == 2

    asyncio.run(main())
    reopened = SQLiteStore(tmp_path / "db.sqlite3")
    assert reopened.get("resp_b") is not None
    reopened.close()


def test_a_full_batch_does_not_wait_for_the_commit_delay(tmp_path: Any) -> None:
    store = BatchCountingStore(tmp_path / "db.sqlite3")

    async def main() -> None:
        p = Persistence(store, max_lag=120.0, commit_delay=60.0)
        for i in range(p._batch):
            await p.submit(_entry(f"resp_{i}"))
        for _ in range(500):
            if p.written == p._batch:
                break
            await asyncio.sleep(0.01)
        assert p.written == p._batch
        await p.close()

    asyncio.run(main())


def test_the_commit_delay_is_bounded_by_half_the_lag_and_needs_batches(tmp_path: Any) -> None:
    assert Persistence(SQLiteStore(tmp_path / "a.sqlite3"), max_lag=0.2, commit_delay=5.0).commit_delay == 0.1
    assert Persistence(SQLiteStore(tmp_path / "b.sqlite3"), max_lag=0.2, commit_delay=0.05).commit_delay == 0.05
    assert Persistence(MemoryStore(), max_lag=0.2, commit_delay=0.05).commit_delay == 0.0  # one job at a time
