"""Persistence over a store other processes write too (``--store redis``, or ``--workers N``).

Read-your-writes across processes. A process sees its own queued writes at once (``pending``,
as :class:`~hotloop.pipeline.post.Persistence` always does). A response another process
produced is in the shared store once that process's writer has written it: its write is queued
before ``response.completed`` reaches the client and normally lands within a millisecond or
two. So a read that misses here (a ``previous_response_id``, an ``item_reference``, a retrieve
or ``input_items`` naming a response this process does not hold) is retried after
``READ_RETRY_DELAYS`` before it answers "not found": a response is readable on every process
once ``response.completed`` has been sent plus ``VISIBILITY_BOUND`` (300 ms: more than the
writer may fall behind, ``--store-max-lag``'s default 0.2 s, plus a write; a larger
``--store-max-lag`` widens it by the difference), unless the shared store is unreachable (503).
A genuinely unknown id costs that bound in latency before its 400/404.

Deletes are seen everywhere: every process drops a deleted response from its process-wide cache,
so a retrieve, ``input_items``, ``previous_response_id`` or ``item_reference`` served from that
cache does not find it. With Redis, a delete is published on ``hotloop:deleted`` (a subscriber
task per process, restarted with backoff when it fails). With SQLite shared by ``--workers``, a
delete is appended to the file's ``deleted_responses`` table (:class:`DeletionLog`, the newest
``DELETIONS_KEPT`` rows kept), which every worker polls every ``DELETE_POLL_SECONDS`` (50 ms; one
primary-key range query, off the event loop); the DELETE answers ``DELETE_SETTLE_SECONDS``
(100 ms) after its row is written, so a request sent after the answer does not find the response
on any worker whose event loop was not blocked meanwhile. The row is written in the delete's own
transaction: a response is deleted only with the record the other workers read, and a DELETE
locked out of the file (another connection's write lock past the busy timeout) answers 503 with
neither written, so its client retries it. (Written after the delete, in a transaction of its
own, a record locked out left the DELETE answering 200 while the other workers served the
response from their caches until they evicted it.) Requests pay nothing for it. A WebSocket
connection's own cache is the connection's, on one process, and needs no invalidation beyond
OpenAI's rule (a continuation of a deleted response still finds it there).

Unreachable Redis. While the store retries writes (``store.available`` is false) and the write
queue is full, :meth:`SharedPersistence.writable` is false and new ``store: true`` requests are
refused with a 503 (:class:`~hotloop.errors.StoreUnavailable`) instead of queueing without bound;
writes already acknowledged stay queued and are retried (the queue's back-pressure; the queue is
full once its oldest write has waited ``--store-max-lag``). A server stopping while the store is
unreachable retries its queued writes within the shutdown flush bound
(:data:`~hotloop.pipeline.post.CLOSE_FLUSH_SECONDS`), then logs what it could not write.

``--store-sync full`` makes the bound zero: a response is written to the shared store before its
terminal event is sent, so every process can read it as soon as a client has seen it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from hotloop import errors
from hotloop.pipeline.post import CLOSE_FLUSH_SECONDS, Persistence
from hotloop.protocol.request import Item
from hotloop.state.context import CachedResponse
from hotloop.state.store import PRUNED_KEPT, StoreBusy, UsageRow

log = logging.getLogger("hotloop.post")

READ_RETRY_DELAYS = (0.005, 0.02, 0.05, 0.1, 0.125)
VISIBILITY_BOUND = sum(READ_RETRY_DELAYS)
# The delete subscription is pinged after this many seconds of silence, and given up as dead (a
# flow dropped without FIN or RST: a NAT or load balancer idle timeout, a partition) when the
# ping has had no answer for as long again: deletes it may have missed are then forgotten.
SUBSCRIBER_HEARTBEAT_SECONDS = 5.0
# The delete subscription is tried again at most this long after a failure (not the store's 2 s
# backoff): until it is back, a DELETE made through another process once Redis returned was not
# heard here, and this process's cache served the response for up to that long.
SUBSCRIBER_RETRY_CAP_SECONDS = 0.25
READER_THREADS = 2
DELETE_POLL_SECONDS = 0.05  # how often a worker on a shared SQLite file reads the deletions
DELETE_SETTLE_SECONDS = 2 * DELETE_POLL_SECONDS  # a DELETE's answer waits this after its row
DELETIONS_KEPT = 100_000  # rows of deleted_responses kept (the newest)
DELETIONS_READ = 1000  # rows a poll reads at most
FLUSH_POLL_SECONDS = 0.05  # how often a request waiting for the writer checks that the store is reachable


def _append(db: sqlite3.Connection, *response_ids: str) -> None:
    """Append ``response_ids`` to ``deleted_responses``, inside the caller's transaction on ``db``
    (now and then the rows past the newest ``DELETIONS_KEPT`` leave)."""
    db.executemany("INSERT INTO deleted_responses (id) VALUES (?)", [(r,) for r in response_ids])
    seq = db.execute("SELECT max(seq) FROM deleted_responses").fetchone()[0] or 0
    if seq // 1024 != (seq - len(response_ids)) // 1024:  # now and then: keep the newest
        db.execute("DELETE FROM deleted_responses WHERE seq <= ?", (seq - DELETIONS_KEPT,))


class DeletionLog:
    """The deletes made through any worker on one SQLite file, in its ``deleted_responses``
    table (``seq`` ascending), for the other workers' process-wide caches. Its own connection,
    used from the reader threads under a lock (``busy_timeout``: the store's). A DELETE's row is
    written by the store's delete itself, in its transaction (:func:`_append`); pruned ids are
    recorded here."""

    def __init__(self, path: str, busy_timeout: float = 5.0) -> None:
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=busy_timeout)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS deleted_responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL)"
            )

    def record(self, *response_ids: str) -> None:
        """Append ``response_ids`` (one transaction)."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                _append(db, *response_ids)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def last(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT coalesce(max(seq), 0) FROM deleted_responses").fetchone()[0])

    def since(self, seq: int) -> list[tuple[int, str]]:
        with self._lock:
            return self._db.execute(
                "SELECT seq, id FROM deleted_responses WHERE seq > ? ORDER BY seq LIMIT ?", (seq, DELETIONS_READ)
            ).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()


class SharedPersistence(Persistence):
    """:class:`Persistence` whose misses are retried (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the process-wide cache's clear (its evict: Persistence.evict): deletes published while
        # the subscriber was away are not replayed
        self.forget: Callable[[], None] | None = None
        # what another process's delete is told to (Engine.deleted: the WebSocket connections'
        # caches too); Persistence.evict when unset
        self.deleted: Callable[[str], None] | None = None
        self._listener: asyncio.Task[None] | None = None  # Redis: the delete subscriber; SQLite: the poller
        self._deletions: DeletionLog | None = None  # SQLite shared by --workers
        self._publishing: asyncio.Task[None] | None = None  # records pruned ids there (_pruned)
        self._to_publish: deque[str] = deque(maxlen=PRUNED_KEPT)
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotloop-publish")
        # Reads run beside the writer thread, not behind it: a write being retried during an
        # outage must not hold up reads, which answer 503 at once. Pending writes stay visible
        # (an entry leaves ``pending`` only once written), so reads still see their own writes.
        self._readers = ThreadPoolExecutor(max_workers=READER_THREADS, thread_name_prefix="hotloop-store-read")
        # The deletions' poll (SQLite shared by --workers) has a thread of its own: behind the
        # requests' reads it fell behind a DELETE's settle time under read load, and another
        # worker answered from its cache what a DELETE had answered 200 for
        self._poller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotloop-deletions")
        self._reading: set[Future[Any]] = set()  # reads (and DELETEs, usage listings) in flight there
        self._sending = 0  # pruned ids being recorded by the publisher thread

    def writable(self) -> bool:
        """Whether a new ``store: true`` response may start: the store takes writes, or the
        write queue still has room for it (its oldest write has not waited ``--store-max-lag``)."""
        if getattr(self.store, "available", True):
            return True
        return not self._blocked and Persistence._has_room(self, 0)

    def _has_room(self, nbytes: int) -> bool:
        """:meth:`Persistence._has_room`, but while the store is unreachable only the queue's
        count and byte bounds hold, not its lag: a response that started before the queue filled
        is queued when it ends, instead of its client waiting (its answer, or a WebSocket's next
        turn, ``store: false`` too) until Redis is back or its write ahead gives up after 10
        minutes. No write made it durable sooner; new ``store: true`` requests are refused
        meanwhile (:meth:`writable`), so what joins the queue is what was running."""
        if getattr(self.store, "available", True) or not self._jobs:  # (one job always may, as ever)
            return super()._has_room(nbytes)
        return len(self._jobs) < self.max_pending and self._jobs_bytes + nbytes <= self.max_pending_bytes

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await self._call_on(self._readers, fn, *args)

    async def _call_on(self, pool: ThreadPoolExecutor, fn: Any, *args: Any) -> Any:
        # run_in_executor, with the call kept in ``_reading`` until its thread is done with it
        # (close() waits for those, within its bound)
        call = pool.submit(fn, *args)
        self._reading.add(call)
        call.add_done_callback(self._reading.discard)
        return await asyncio.wrap_future(call)

    async def _again(self, read: Callable[..., Awaitable[Any]], *args: Any, until: float | None = None) -> Any:
        """``read``, retried after ``READ_RETRY_DELAYS`` while it finds nothing (no retry ends
        past ``until``, ``time.monotonic()``: a request's bound)."""
        found = await read(*args)
        for delay in READ_RETRY_DELAYS:
            if found is not None or (until is not None and time.monotonic() + delay >= until):
                break
            await asyncio.sleep(delay)
            found = await read(*args)
        return found

    async def load(self, response_id: str, scope: str | None = None) -> CachedResponse | None:
        return await self._again(super().load, response_id, scope)  # type: ignore[no-any-return]

    async def find_item(self, item_id: str, scope: str | None = None) -> Item | None:
        return await self._again(super().find_item, item_id, scope)  # type: ignore[no-any-return]

    async def get_response(self, response_id: str, scope: str | None = None) -> dict[str, Any] | None:
        return await self._again(super().get_response, response_id, scope)  # type: ignore[no-any-return]

    async def input_items(
        self, response_id: str, after: str | None, limit: int, order: str, scope: str | None = None
    ) -> tuple[list[dict[str, Any]], bool] | None | bool:
        return await self._again(super().input_items, response_id, after, limit, order, scope)  # type: ignore[no-any-return]

    def _reachable(self) -> None:
        """A call that waits for the write queue (delete, usage) answers 503 during an outage."""
        if not getattr(self.store, "available", True):
            raise errors.StoreUnavailable()

    async def _settled(self, deadline: float | None, what: str) -> None:
        """:meth:`flush`, but a 503 as soon as the store is known to be unreachable (Redis: a
        request does not wait on the writer's retries, up to ``write_retry_seconds``) or the
        request's (``what``) ``deadline`` (SQLite: :class:`StoreBusy`, logged as
        :class:`Persistence` does) has passed. What it queued stays queued (a cancelled flush
        loses nothing)."""
        task = asyncio.ensure_future(self.flush())
        try:
            while True:
                wait = FLUSH_POLL_SECONDS if deadline is None else min(FLUSH_POLL_SECONDS, deadline - time.monotonic())
                done, _ = await asyncio.wait({task}, timeout=max(0.0, wait))
                if done:
                    task.result()
                    return
                self._reachable()
                if deadline is not None and time.monotonic() >= deadline:
                    raise self._waited_out(what)
        finally:
            if not task.done():
                task.cancel()

    async def usage(
        self, key: str | None = None, since: str | None = None, after: UsageRow | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        self._reachable()
        deadline = self._deadline()
        await self._settled(deadline, "a usage listing")
        return await self._call(self._store_usage, key, since, after, limit, deadline)  # type: ignore[no-any-return]

    async def delete(self, response_id: str, scope: str | None = None) -> bool:
        self._reachable()
        deadline = self._deadline()
        # a write on its way (another worker's) lands first
        await self._again(super().get_response, response_id, scope, until=deadline)
        await self._settled(deadline, "a delete")  # a write submitted earlier must not resurrect what is deleted now
        # SQLite: the record for the other workers in the delete's own transaction (module docstring)
        on_delete = _append if self._deletions is not None else None
        deleted = bool(await self._call(self._store_delete, response_id, scope, deadline, on_delete))
        if deleted:
            await self._publish(response_id)
        return deleted

    # -- deletes seen by every process (Redis) ----------------------------------------------------

    def start(self) -> None:
        super().start()
        if self._listener is not None:
            return
        url = getattr(self.store, "url", None)
        path = getattr(self.store, "path", None)
        loop = asyncio.get_running_loop()
        if url is not None:
            self._listener = loop.create_task(self._listen(url), name="hotloop-deleted")
        elif isinstance(path, str) and path != ":memory:":
            self._deletions = DeletionLog(path, getattr(self.store, "busy_timeout", 5.0))
            self._listener = loop.create_task(self._poll(self._deletions), name="hotloop-deleted")

    async def _publish(self, response_id: str) -> None:
        """A delete done: told to the other processes (Redis), or waited for their polls (SQLite:
        its row was written with it)."""
        # (Redis: the delete script published it itself, with the delete: redis_store._DELETE)
        if getattr(self.store, "r", None) is None and self._deletions is not None:
            await asyncio.sleep(DELETE_SETTLE_SECONDS)  # the other workers' polls

    async def _pruned(self, ids: list[str]) -> None:
        """Pruned responses leave the other workers' caches too, as deletes do (SQLite shared by
        ``--workers``; Redis expires them everywhere by TTL)."""
        await super()._pruned(ids)
        deletions = self._deletions
        if deletions is not None:
            # in the background (the writer's next batch does not wait for it), by one task at a
            # time, one transaction per round for everything pruned meanwhile (at most
            # PRUNED_KEPT ids wait: the newest), on its own thread (reads do not queue behind it)
            self._to_publish.extend(ids)
            if self._publishing is None or self._publishing.done():
                self._publishing = asyncio.get_running_loop().create_task(self._publish_pruned(deletions))

    async def _publish_pruned(self, deletions: DeletionLog) -> None:
        while self._to_publish:
            ids = list(self._to_publish)
            self._to_publish.clear()
            self._sending = len(ids)
            try:
                await asyncio.get_running_loop().run_in_executor(self._publisher, lambda: deletions.record(*ids))
            except Exception:  # noqa: BLE001 - their caches' TTL still ends them
                log.warning("could not publish %d pruned responses to other processes", len(ids))
            finally:
                self._sending = 0

    async def _poll(self, deletions: DeletionLog) -> None:
        """Evict what other workers deleted, every ``DELETE_POLL_SECONDS``."""
        last: int | None = None
        failing = False
        while True:
            try:
                if last is None:
                    last = await self._call_on(self._poller, deletions.last)  # a new worker's cache is empty
                    continue
                await asyncio.sleep(DELETE_POLL_SECONDS)
                rows = await self._call_on(self._poller, deletions.since, last)
            except sqlite3.Error as exc:  # busy beyond its timeout, or the file went away: try again
                if not failing:
                    log.warning("reading the deleted responses failed (%s); retrying", type(exc).__name__)
                failing = True
                await asyncio.sleep(DELETE_POLL_SECONDS)
                continue
            failing = False
            evict = self.deleted or self.evict
            for seq, response_id in rows:
                if evict is not None:
                    evict(response_id)
                last = seq

    async def _listen(self, url: str) -> None:
        import redis.asyncio as aredis

        from hotloop.state.redis_store import DELETED_CHANNEL, Breaker, redis_errors

        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        breaker = Breaker()
        breaker.CAP = SUBSCRIBER_RETRY_CAP_SECONDS  # (about 4 connection attempts a second while Redis is down)
        missed = False  # whether deletes may have been published while no subscription listened
        beat = SUBSCRIBER_HEARTBEAT_SECONDS
        loop = asyncio.get_running_loop()
        while True:
            # No retries inside redis-py: a reconnection it made on its own would resubscribe
            # without this loop learning that deletes may have been missed meanwhile.
            client = aredis.Redis.from_url(
                url, socket_connect_timeout=1.0, socket_timeout=beat, retry=Retry(NoBackoff(), 0)
            )
            try:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(DELETED_CHANNEL)
                breaker.ok()
                if missed and self.forget is not None:
                    # Redis does not replay them: forget every cached response instead, so a
                    # response deleted meanwhile is not served from this process's cache
                    self.forget()
                missed = False
                heard, pinged = loop.time(), False
                while True:
                    # never a read without a bound: a flow dropped silently would be read forever
                    msg = await pubsub.get_message(timeout=beat)
                    now = loop.time()
                    if msg is not None:
                        heard, pinged = now, False
                        evict = self.deleted or self.evict
                        if evict is not None and msg.get("type") == "message":
                            evict(msg["data"].decode())
                        continue
                    if now - heard >= 2 * beat:  # pinged, and no answer for a whole beat
                        raise ConnectionError("the delete subscription went silent")
                    if not pinged and now - heard >= beat:
                        await pubsub.ping()  # its answer ("pong") counts as heard
                        pinged = True
            except redis_errors():
                missed = True
                await asyncio.sleep(breaker.failed())
            except Exception:  # anything else: say so, and subscribe again
                missed = True
                log.exception("the delete subscriber failed; subscribing again")
                await asyncio.sleep(breaker.failed())
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose()

    async def close(self, timeout: float = CLOSE_FLUSH_SECONDS) -> None:
        """Stop: write the queue out, then close the store; returns within ``timeout`` seconds
        whatever the store does (a file locked by another process, Redis unreachable).

        The bound is the whole close, not each of its steps: the queued writes, the reads still
        running (a ``DELETE``'s write too), the pruned ids on their way to the other workers and
        the delete listener all run at once from the start and share one deadline. Its default,
        :data:`~hotloop.pipeline.post.CLOSE_FLUSH_SECONDS`, is the store flush's part of what a
        ``--workers`` worker is given to stop before it is killed,
        :func:`~hotloop.server.workers.kill_after` (the grace and ``ABORT_WINDOW`` come before
        it, and ``KILL_MARGIN`` after it covers the rest of the shutdown): so a worker is not
        killed in the middle of its flush. What is not done by the deadline is logged as one
        line with counts (writes not stored, pruned ids the other workers were not told of,
        reads still running), and a thread still inside the store is left to the process's exit
        (``stuck``: the server exits without joining it)."""
        self.closing()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def left() -> float:
            return max(0.0, deadline - loop.time())

        give_up_by = getattr(self.store, "give_up_by", None)
        if give_up_by is not None:  # stopping: the writer thread, too, stops retrying within the bound
            give_up_by(time.monotonic() + timeout)
        # the queue is written out from now on, while the rest stops (what a flush cancelled at
        # the deadline still waited for is counted below)
        # (_drain: what responses ending meanwhile submit or charge is written too, see Persistence.close)
        flushing = loop.create_task(self._drain()) if self._task is not None else None
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.wait({self._listener}, timeout=left())
            self._listener = None
        self._readers.shutdown(wait=False, cancel_futures=True)  # reads still queued: cancelled
        self._poller.shutdown(wait=False, cancel_futures=True)
        reading = [asyncio.wrap_future(call) for call in list(self._reading) if not call.done()]
        if reading:
            await asyncio.wait(reading, timeout=left())
        if flushing is not None:
            await asyncio.wait({flushing}, timeout=left())
        task = self._task
        if task is not None:  # the writer: stopped here, so that Persistence.close only closes
            # An idle writer stops before its next batch. One inside a batch (a response that
            # ended after the flush, while the reads ran) is waited for with the time left, as
            # Persistence.close does: only at the deadline is it cancelled (and stuck, below).
            # What it does not take is written by Persistence.close (_take_left, _write_left),
            # before the store's close.
            self._halt = True
            self._wake()
            await asyncio.wait({task}, timeout=left())
        # (after the writer: the pruned ids of its last batch too)
        publishing = self._publishing
        if publishing is not None:  # pruned ids on their way to the other workers (the last writes' too)
            await asyncio.wait({publishing}, timeout=left())
        unwritten = 0
        cut = False
        if flushing is not None and not flushing.done():
            flushing.cancel()
            cut = True
        if cut or (task is not None and not task.done()):  # (the writer busy at the deadline)
            unwritten = len(self._jobs) + len(self._blocked) + self._writing + bool(self._usage)
        unsent = 0
        if publishing is not None and not publishing.done():
            publishing.cancel()
            unsent = self._sending + len(self._to_publish)
        self._publisher.shutdown(wait=False, cancel_futures=True)
        reads = sum(not call.done() for call in list(self._reading))
        if unwritten or unsent or reads:
            log.log(
                logging.ERROR if unwritten or unsent else logging.WARNING,
                "store shutdown not finished within %g s: %d write(s) not stored, %d pruned response(s) "
                "not announced to the other workers, %d read(s) still running",
                timeout, unwritten, unsent, reads,
            )
        # threads still inside the store (or the deletions table): not joined, not closed under them
        # (a writer waiting to retry a locked-out batch is not inside the store)
        writing = self._writing_at is not None and not self._retry_wait
        self.stuck = writing or self._sending > 0 or reads > 0
        if task is not None:
            if not task.done():  # past the deadline
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._task = None
        if self._deletions is not None and not self.stuck:
            self._deletions.close()
            self._deletions = None
        await super().close(left())
