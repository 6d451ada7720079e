"""Post-inference bookkeeping, off the critical path: persistence and the usage ledger.

:class:`Persistence` owns the response store and one writer thread. A finished turn *submits* its
record and returns at once; the writer stores it while the connection already serves the next
turn. Until a record is written it sits in ``pending``, so reads see their own writes.

Usage records are batched: they accumulate in memory and go to the store as one write every
``USAGE_FLUSH_SECONDS`` (or at ``USAGE_BATCH`` records, or on flush/close), so a turn pays a list
append for its ledger entry, not a thread hand-off.

Bounds: the submission queue holds at most ``max_pending`` records (default 1,024). When it is
full, ``submit`` waits (backpressure on the turn that finished, never on one in flight): records
are never dropped. The usage buffer holds at most ``USAGE_BATCH`` records before it is queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hotloop.protocol.request import Item, item_from_dict, item_to_dict
from hotloop.state.context import CachedResponse, Context
from hotloop.state.store import ResponseStore, StoredResponse, UsageRecord, page_items

log = logging.getLogger("hotloop.post")


def to_record(entry: CachedResponse) -> StoredResponse:
    ctx = entry.context
    return StoredResponse(
        response=entry.response,
        items=[item_to_dict(it) for it in ctx.items],
        fps=list(ctx.chain.fingerprints()),
        toks=[int(ctx.chain.tokens_upto(i + 1) - ctx.chain.tokens_upto(i)) for i in range(len(ctx))],
        input_len=entry.input_len,
    )


def from_record(rec: StoredResponse) -> CachedResponse:
    items = [item_from_dict(d) for d in rec.items]
    ctx = Context()
    ctx.extend(items, rec.fps, rec.toks)
    return CachedResponse(rec.response, ctx, rec.input_len, True)


def usage_record(response: dict[str, Any]) -> UsageRecord | None:
    u = response.get("usage")
    if not u:
        return None
    return UsageRecord(
        model=str(response.get("model")),
        input_tokens=int(u["input_tokens"]),
        output_tokens=int(u["output_tokens"]),
        cached_tokens=int(u["input_tokens_details"]["cached_tokens"]),
        reasoning_tokens=int(u["output_tokens_details"]["reasoning_tokens"]),
        at=time.time(),
    )


class Persistence:
    USAGE_FLUSH_SECONDS = 1.0
    USAGE_BATCH = 512

    def __init__(self, store: ResponseStore, max_pending: int = 1024) -> None:
        self.store = store
        self.max_pending = max_pending
        self.pending: dict[str, CachedResponse] = {}
        self._queue: asyncio.Queue[tuple[str, Any]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotloop-store")
        self.written = 0
        self.failed = 0
        self._usage: list[UsageRecord] = []
        self._waiting: set[asyncio.Future[None]] = set()  # shielded puts into a full queue
        self._usage_timer: asyncio.TimerHandle | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._queue = asyncio.Queue(self.max_pending)
            self._task = asyncio.get_running_loop().create_task(self._run(), name="hotloop-writer")

    async def flush(self) -> None:
        if self._queue is not None:
            if self._usage:
                await self._queue.put(("usage", self._take_usage()))
            await self._queue.join()

    def _take_usage(self) -> list[UsageRecord]:
        batch, self._usage = self._usage, []
        if self._usage_timer is not None:
            self._usage_timer.cancel()
            self._usage_timer = None
        return batch

    def _usage_due(self) -> None:
        self._usage_timer = None
        if self._usage and self._queue is not None:
            try:
                self._queue.put_nowait(("usage", self._take_usage()))
            except asyncio.QueueFull:  # busy writer: try again later, the buffer stays bounded
                self._usage_timer = asyncio.get_running_loop().call_later(self.USAGE_FLUSH_SECONDS, self._usage_due)

    async def close(self) -> None:
        if self._task is not None:
            await self.flush()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await asyncio.get_running_loop().run_in_executor(self._pool, self.store.close)
        self._pool.shutdown(wait=True)

    async def _run(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            kind, payload = await self._queue.get()
            try:
                if kind == "put":
                    entry: CachedResponse = payload
                    await loop.run_in_executor(self._pool, self.store.put, to_record(entry))
                    self.pending.pop(entry.id, None)
                    self.written += 1
                elif kind == "usage":
                    await loop.run_in_executor(self._pool, self.store.record_usage, payload)
            except Exception:  # a storage failure must not kill the writer; it is logged
                self.failed += 1
                log.exception("store write failed")
                if kind == "put":
                    self.pending.pop(payload.id, None)
            finally:
                self._queue.task_done()

    # -- writes --------------------------------------------------------------------------------

    async def submit(self, entry: CachedResponse) -> None:
        """Queue a finished response: the usage ledger always, the response if it is stored."""
        if self._queue is None:
            self.start()
        assert self._queue is not None
        rec = usage_record(entry.response)
        if rec is not None:
            self._usage.append(rec)
            if len(self._usage) >= self.USAGE_BATCH:
                await self._enqueue(("usage", self._take_usage()))
            elif self._usage_timer is None:
                self._usage_timer = asyncio.get_running_loop().call_later(self.USAGE_FLUSH_SECONDS, self._usage_due)
        if entry.store:
            self.pending[entry.id] = entry
            await self._enqueue(("put", entry))

    async def _enqueue(self, job: tuple[str, Any]) -> None:
        """Queue a job without ever losing it to the caller's cancellation.

        The common case does not suspend at all. When the queue is full the caller waits (the
        back-pressure), but on a task of its own, shielded: a caller cancelled meanwhile (a
        client that left) does not take the job with it.
        """
        assert self._queue is not None
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            task = asyncio.ensure_future(self._queue.put(job))
            self._waiting.add(task)
            task.add_done_callback(self._waiting.discard)
            await asyncio.shield(task)

    # -- reads ---------------------------------------------------------------------------------

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def load(self, response_id: str) -> CachedResponse | None:
        """A stored response, hydrated into a continuable context (or ``None``)."""
        entry = self.pending.get(response_id)
        if entry is not None:
            return entry
        rec = await self._call(self.store.get, response_id)
        return None if rec is None else from_record(rec)

    async def find_item(self, item_id: str) -> Item | None:
        """An item of a stored response, by id (for ``item_reference``)."""
        for entry in self.pending.values():
            found = entry.context.find(item_id)
            if found is not None:
                return found
        raw = await self._call(self.store.get_item, item_id)
        return None if raw is None else item_from_dict(raw)

    async def get_response(self, response_id: str) -> dict[str, Any] | None:
        entry = self.pending.get(response_id)
        if entry is not None:
            return entry.response
        return await self._call(self.store.get_response, response_id)  # type: ignore[no-any-return]

    async def input_items(
        self, response_id: str, after: str | None, limit: int, order: str
    ) -> tuple[list[dict[str, Any]], bool] | None | bool:
        """A page of input items; ``None`` if the response is unknown, ``False`` if ``after`` is."""
        entry = self.pending.get(response_id)
        if entry is not None:
            items = [item_to_dict(it) for it in entry.input_items]
        else:
            rec = await self._call(self.store.get, response_id)
            if rec is None:
                return None
            items = rec.items[: rec.input_len]
        page = page_items(items, after, limit, order)
        return False if page is None else page

    async def delete(self, response_id: str) -> bool:
        await self.flush()  # a pending write must not resurrect what is deleted now
        return bool(await self._call(self.store.delete, response_id))

    async def usage(self) -> list[dict[str, Any]]:
        await self.flush()
        return await self._call(self.store.usage)  # type: ignore[no-any-return]

