"""Post-inference bookkeeping, off the critical path: persistence and the usage ledger.

:class:`Persistence` owns the response store and one writer thread. A finished turn *submits* its
record and returns at once; the writer stores it while the connection already serves the next
turn. Until a record is written it sits in ``pending``, so reads see their own writes.

What a submission costs the event loop is proportional to what the response added, never to the
length of its conversation: it takes the slice of the response's own item objects (items are
immutable, and a finished context is only ever copied, never changed) and an estimate of their
size. Everything else (item dicts, fingerprints and token counts from the native chain, JSON
encoding, hashing, SQL) runs in the writer thread. A record holds its parent's id and only its
own items (see :mod:`hotloop.state.store`); when the parent is not stored (``store: false``, or
removed meanwhile) the writer stores the whole history instead.

When the store offers ``batch()`` (SQLite), the writer takes what is queued, up to ``WRITE_BATCH``
jobs, in one thread hand-off and one transaction: one commit (one disk sync with
``--store-sync full``) for every turn that finished meanwhile. Other stores get one job at a time.
With ``commit_delay`` (``--store-commit-delay``, such stores only, at most half of ``max_lag``)
the idle writer, woken by a job, first waits until that job is ``commit_delay`` old, so that the
turns finishing meanwhile join its transaction (group commit): a write made alone, cold, costs a
few times what it costs in a run of them. A full batch, a :meth:`flush` barrier or a submission
waiting for room ends the wait at once.

Usage records are batched: they accumulate in memory and go to the store as one write every
``USAGE_FLUSH_SECONDS`` (or at ``USAGE_BATCH`` records, or on flush/close), so a turn pays a list
append for its ledger entry, not a thread hand-off.

Bounds: the write queue holds at most ``max_pending`` jobs (default 1,024), at most
``max_pending_bytes`` of estimated record bytes (default 256 MiB; one record larger than that is
still admitted into an empty queue), and nothing older than ``max_lag`` seconds (default 0.2):
while the oldest queued job has waited that long, the writer is behind, so a crash would lose
more than the documented bound (README, Crash safety). When any is reached, ``submit`` waits, in
FIFO order (back-pressure on the turn that finished, never on one in flight): records are never
dropped.
The usage buffer holds ``USAGE_BATCH`` records before it is queued; while the writer is behind
(a slow disk, Redis unreachable) it grows to at most ``USAGE_BUFFER`` records instead of making
the turn that completes a batch wait for the writer, and only then applies back-pressure.

:meth:`Persistence.flush` is a barrier: every job gets a sequence number and ``flush`` waits until
the writer has finished the jobs submitted before the call, however many arrive after it.

At shutdown :meth:`Persistence.close` writes the queue out, what responses ending meanwhile
submit or charge included; a usage record that comes once the store is closed cannot be written
and is logged at ERROR with what the ledger would have counted (key, model, tokens, response id)
and counted, never dropped silently (see there).

Failed writes. A batch that waited out SQLite's busy timeout behind another connection's write
lock ("database is locked": nothing of it was stored, :func:`hotloop.state.store.locked`) is
tried again, whole and in order, ``LOCKED_RETRY_PAUSE`` seconds after each failed try (each try
waits up to the busy timeout), until it is written or ``LOCKED_RETRY_SECONDS`` have passed since
its first try. Meanwhile it counts against
``max_lag`` like any write in progress, so new submissions wait (the queue stays within its
bounds) and ``flush`` waits for it (with ``--store-sync full`` the terminal event waits). Any
other failure (a full disk, an I/O error), and a batch still locked out at that bound, is final:
the write is counted and a response's remembered by id (:meth:`Persistence.lost`). The counts
have one unit each, so that a failure ratio compares like with like: responses in ``written`` and
``failed`` (``hotloop_store_written``, ``hotloop_store_failed``, ``/hotloop/stats``), usage ledger
records (one per charged response; a ledger batch holds hundreds) in ``usage_written`` and
``usage_failed`` (``hotloop_store_usage_written``, ``hotloop_store_usage_failed``). Failures are logged in one line each, without a traceback (a
bug, an error that is no storage failure, keeps its traceback): the first of each kind at once,
then at most one line per kind every ``FAILURE_LOG_SECONDS`` saying how many more failed, and one
line when writes succeed again. The writer keeps going: the next write is tried as usual.

A DELETE and a usage listing wait for the writes queued before them, but not for those retries:
on SQLite the wait and their own write share one bound, the busy timeout, past which they raise
:class:`~hotloop.state.store.StoreBusy` (a 503) with nothing done (:meth:`Persistence.delete`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import msgspec

from hotloop import errors
from hotloop.pipeline import items as itemlib
from hotloop.pipeline.classifiers import freeze, frozen
from hotloop.protocol.request import FunctionCall, InputAudio, Item, OtherItem, item_from_dict, item_to_dict
from hotloop.state.context import CachedResponse, Context, held_extra
from hotloop.state.store import (
    LEGACY_OWNER, History, MissingParent, ResponseStore, StoreBusy, StoredResponse, TransactionLost, UsageRecord, UsageRow,
    failure_kind, locked, page_items,
)

log = logging.getLogger("hotloop.post")

DEFAULT_MAX_PENDING_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_LAG = 0.2  # seconds the oldest queued write may wait before submissions wait too
LOST_IDS = 1024  # failed writes remembered by id (Persistence.lost)
WRITE_BATCH = 64  # queued jobs written together (one store transaction, one commit)
CLOSE_FLUSH_SECONDS = 30.0  # the bound on writing the queue out at shutdown
ADMIT_POLL_SECONDS = 0.25  # how often a submission waiting for room looks at it again (_enqueue)
ITEM_OVERHEAD = 256  # estimated bytes of a stored item beyond its strings (ids, fps, row)
# A failure kind (SQLITE_FULL, SQLITE_IOERR_WRITE...) is logged at its first occurrence, then at
# most once per this many seconds, with the count of writes that failed meanwhile (_FailureLog)
FAILURE_LOG_SECONDS = 60.0
# A batch locked out by another connection's write lock past the busy timeout is tried again
# LOCKED_RETRY_PAUSE seconds after each failed try, for at most LOCKED_RETRY_SECONDS from its first
LOCKED_RETRY_PAUSE = 0.05
LOCKED_RETRY_SECONDS = 60.0


class Snapshot(NamedTuple):
    """What the event loop takes of a finished response for the writer: O(its own items)."""

    entry: CachedResponse
    own: list[Item]  # context.items[base_len:end]
    base_len: int
    end: int  # len(context) when submitted


def snapshot(entry: CachedResponse) -> Snapshot:
    items = entry.context.items
    base = entry.base_len if entry.parent_id is not None else 0
    return Snapshot(entry, items[base:], base, len(items))


def stored_base(reused: CachedResponse, n: int, entry: CachedResponse) -> bool:
    """Whether a response that names no parent is kept (in memory and in the store) as the
    continuation of ``reused``, the prefix cache's entry it reused: a request that resent a whole
    history whose first ``n`` items are all of ``reused``'s history. It is then stored as that
    response's child with only its new items (the store's rows grow with each turn's new items,
    not with the history: a Vercel AI SDK loop under ``store: true`` resends everything every
    step); otherwise (either is not stored, ``reused`` is another key's, or only part of its
    history was reused) with its whole input. Nothing a client sees changes: the Response names no parent,
    and ``input_items`` lists the whole input either way; the items of ``reused`` are that
    response's own, not this one's, as from scratch (a reference to one resolves while ``reused``
    is stored). A parent deleted before the write is written whole instead (``MissingParent``)."""
    return entry.store and reused.store and reused.owner == entry.owner and n == len(reused.context) and reused.id != entry.id


_enc = msgspec.json.Encoder()
_TEXT_FIELDS = ("text", "refusal", "image_url", "file_data", "file_url")


def _parts_nbytes(parts: Any) -> int:
    if type(parts) is str:
        return len(parts)
    n = 0
    for p in parts or ():
        for f in _TEXT_FIELDS:
            v = getattr(p, f, None)
            if type(v) is str:
                n += len(v)
        if type(p) is InputAudio:
            n += len(_enc.encode(p.input_audio))
    return n


def approx_nbytes(items: list[Item]) -> int:
    """Estimated bytes a stored record of ``items`` holds: their strings plus ``ITEM_OVERHEAD``
    each and what the decoded items hold beyond that (:func:`~hotloop.state.context.held_extra`:
    content parts, non-ASCII strings, an item kept verbatim as all its decoded values)."""
    n = ITEM_OVERHEAD * len(items)
    for it in items:
        t = type(it)
        n += held_extra(it)
        if t is OtherItem:
            continue  # (held_extra counted all of it)
        n += _parts_nbytes(getattr(it, "content", None)) + _parts_nbytes(getattr(it, "output", None))
        n += _parts_nbytes(getattr(it, "summary", None))
        if t is FunctionCall:
            n += len(it.arguments) + len(it.name)  # type: ignore[union-attr]
    return n


def _record(
    entry: CachedResponse, items: list[Item], start: int, end: int, parent_id: str | None, own_from: int
) -> StoredResponse:
    """``items`` (history positions ``start`` to ``end``) as a record; items from position
    ``own_from`` on are the response's own, whose ids the server minted unless the client
    supplied them (inherited items of a whole record count as supplied: nobody vouches for them)."""
    chain = entry.context.chain
    # a response's own items: their fingerprints alone (fingerprints() copies the whole chain's)
    fps = [chain.fingerprint_at(i) for i in range(start, end)] if start else list(chain.fingerprints()[:end])
    upto = [int(chain.tokens_upto(i)) for i in range(start, end + 1)]
    dicts = [item_to_dict(it) for it in items]
    supplied = entry.supplied
    minted = [start + i >= own_from and d.get("id") not in supplied for i, d in enumerate(dicts)]
    return StoredResponse(
        response=entry.response,
        items=dicts,
        fps=fps,
        toks=[b - a for a, b in zip(upto, upto[1:])],
        input_len=entry.input_len,
        parent_id=parent_id,
        base_len=start,
        owner=entry.owner,
        minted=minted,
        states=freeze(entry.states),
    )


def own_record(snap: Snapshot) -> StoredResponse:
    """The record of ``snap``: its parent's id and its own items (writer thread)."""
    parent = snap.entry.parent_id if snap.base_len else None
    return _record(snap.entry, snap.own, snap.base_len, snap.end, parent, snap.base_len)


def whole_record(snap: Snapshot) -> StoredResponse:
    """The record of ``snap`` with its whole history and no parent (writer thread)."""
    items = snap.entry.context.items[: snap.base_len] + snap.own
    return _record(snap.entry, items, 0, snap.end, None, snap.base_len)


def to_record(entry: CachedResponse) -> StoredResponse:
    """``entry`` as one self-contained record (its whole history, no parent)."""
    return whole_record(snapshot(entry))


def from_record(rec: History | StoredResponse) -> CachedResponse:
    """A loaded history (or a self-contained record) as a continuable cache entry."""
    items = [item_from_dict(d) for d in rec.items]
    fps = rec.fps
    if None in fps:  # dropped by the store (made under another key or scheme): recompute
        fps = [itemlib.fingerprint(it) if fp is None else fp for fp, it in zip(fps, items)]
    ctx = Context()
    ctx.extend(items, fps, rec.toks)  # type: ignore[arg-type]  # no None left
    own_from = rec.base_len if rec.parent_id is not None else 0
    minted = rec.minted or [False] * len(rec.items)
    supplied = frozenset(
        iid for d, m in zip(rec.items[own_from:], minted[own_from:]) if not m and isinstance(iid := d.get("id"), str)
    )
    return CachedResponse(
        rec.response, ctx, rec.input_len, True, rec.parent_id, rec.base_len, rec.owner, supplied, frozen(rec.states)
    )


def usage_record(
    response: dict[str, Any], key: str = LEGACY_OWNER, findings: dict[str, int] | None = None, name: str | None = None
) -> UsageRecord | None:
    """The ledger record of a response, under the key id ``key`` (shown with its ``name``)."""
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
        key=key,
        findings=findings or None,
        key_name=name,
    )


class _FailureLog:
    """Log lines about failed store writes, bounded (event loop only). Per kind: its first
    failure at once (a traceback only for an error that is no storage failure), then at most one
    line every ``interval`` seconds, with the writes that failed since its last line. Once writes
    succeed again, one line says so with the failures not yet logged (at most one such line per
    ``interval``; the rest are logged with the kind's next line, or at close)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        # kind -> [failures since its last line, monotonic time of that line, description]
        self._kinds: dict[str, list[Any]] = {}
        self._failing = False  # a failure (or a wait) since the last "succeed again" line
        self._ok_at = -float("inf")

    def _due(self, kind: str, now: float) -> list[Any] | None:
        entry = self._kinds.get(kind)
        return None if entry is None or now - entry[1] >= self.interval else entry

    def failed(self, exc: BaseException, n: int, what: str) -> None:
        """``n`` writes failed with ``exc`` (``what``: what became of them, e.g. "not stored")."""
        kind, text, expected = failure_kind(exc)
        now = time.monotonic()
        self._failing = True
        entry = self._due(kind, now)
        if entry is not None:
            entry[0] += n
            return
        last = self._kinds.get(kind)
        self._kinds[kind] = [0, now, text]
        if last is None:
            log.error(
                "store write failed: %s; %d write(s) %s (further failures of this kind: at most one line "
                "per %g s; counted in hotloop_store_failed, ledger records in hotloop_store_usage_failed)",
                text, n, what, self.interval,
                exc_info=None if expected else exc,
            )
        else:
            log.error("store write failed: %s; %d write(s) failed in the last %.1f s", text, last[0] + n, now - last[1])

    def note(self, kind: str, message: str, failing: bool = True, level: int = logging.WARNING) -> None:
        """A line of ``kind`` that is no failed write (``message``), at most once per ``interval``;
        ``failing``: it is about writes that do not go through (then their success is logged)."""
        now = time.monotonic()
        self._failing = self._failing or failing
        if self._due(kind, now) is None:
            self._kinds[kind] = [0, now, message]
            log.log(level, "%s", message)

    def ok(self) -> None:
        """Writes succeed (again)."""
        now = time.monotonic()
        if self._failing and now - self._ok_at >= self.interval:
            self._failing = False
            self._ok_at = now
            self.report("store writes succeed again", always=True)

    def report(self, prefix: str, always: bool = False) -> None:
        """The failures not logged yet, in one line (none: only if ``always``)."""
        left = [f"{e[0]} more write(s) failed ({e[2]})" for e in self._kinds.values() if e[0]]
        for e in self._kinds.values():
            e[0] = 0
        if left:
            log.warning("%s; since the last line: %s", prefix, "; ".join(left))
        elif always:
            log.warning("%s", prefix)


class _Job(NamedTuple):
    seq: int
    kind: str  # "put" (payload: Snapshot) or "usage" (payload: list[UsageRecord])
    payload: Any
    nbytes: int
    at: float  # time.monotonic() when queued


class Persistence:
    USAGE_FLUSH_SECONDS = 1.0
    USAGE_BATCH = 512
    USAGE_BUFFER = 16 * 512  # records buffered while the writer is behind, before turns wait for it

    def __init__(
        self,
        store: ResponseStore,
        max_pending: int = 1024,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        max_lag: float = DEFAULT_MAX_LAG,
        commit_delay: float = 0.0,
    ) -> None:
        self.store = store
        self.max_pending = max(1, max_pending)
        self.max_pending_bytes = max_pending_bytes
        self.max_lag = max_lag
        # jobs the writer takes at once: a batch when the store commits many writes together
        self._store_batch: Any = getattr(store, "batch", None)
        self._batch = WRITE_BATCH if self._store_batch is not None else 1
        # group commit: the writer waits this long after a batch's first job for more to join
        # it (stores with batch() only; at most half of max_lag, so the durability bound holds)
        self.commit_delay = min(max(0.0, commit_delay), max_lag / 2) if self._store_batch is not None else 0.0
        self.pending: dict[str, CachedResponse] = {}
        self._jobs: deque[_Job] = deque()  # queued, in sequence order
        self._jobs_bytes = 0
        self._blocked: deque[tuple[_Job, asyncio.Future[None]]] = deque()  # waiting for room, FIFO
        self._barriers: deque[tuple[int, asyncio.Future[None]]] = deque()  # flush() calls, by target
        self._seq = 0  # last sequence number handed out
        self._done = 0  # last sequence number the writer finished (jobs finish in order)
        self._wakeup: asyncio.Future[None] | None = None  # the idle (or gathering) writer waits on it
        self._gathering: asyncio.TimerHandle | None = None  # the end of a group commit's delay
        self._task: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotloop-store")
        # What became of the writes, in two units (never mixed in one ratio): responses (a stored
        # response's record: hotloop_store_written / _failed, /hotloop/stats) and usage ledger
        # records (one per charged response: hotloop_store_usage_written / _usage_failed)
        self.written = 0  # responses stored
        self.failed = 0  # responses not stored (a failed write, given up at shutdown, or submitted after close)
        self.usage_written = 0  # ledger records written
        self.usage_failed = 0  # ledger records not written: failed, dropped (buffer full), or unrecorded (close)
        self._failures = _FailureLog(FAILURE_LOG_SECONDS)  # bounded log lines about failed writes
        self._at_close: tuple[int, int] | None = None  # (failed, usage_failed) when close() began
        self.usage_dropped = 0  # ledger records charge() dropped (its buffer full; in usage_failed too)
        # ids of the last LOST_IDS responses whose write failed (--store-sync full reports them)
        self._lost: OrderedDict[str, None] = OrderedDict()
        # sequence numbers of the last LOST_IDS ledger batches whose write failed (ledger_lost)
        self._lost_usage: deque[int] = deque(maxlen=LOST_IDS)
        # the batch the writer thread is writing: when its oldest job was queued, and its size
        # (a stuck write counts against max_lag, and close() reports it)
        self._writing_at: float | None = None
        self._writing = 0
        self.stuck = False  # close() gave up on a writer thread still inside the store
        self._halt = False  # close(): the writer takes no new batch (close() writes what is left itself)
        # close() has taken what was left to write: from here on nothing can be queued, and a
        # charge or a submission (a response still running after the shutdown grace) is logged
        # for reconciliation and counted instead (_late, _unrecorded)
        self._stopped = False
        self._retry_wait = False  # the writer waits to write a locked-out batch again (not in the store)
        self._usage: list[UsageRecord] = []
        self._usage_timer: asyncio.TimerHandle | None = None
        # the process-wide cache's evict (set by the app): responses the store's bounds pruned
        # (store.take_pruned, after each batch of writes) are not served from it either
        self.evict: Callable[[str], None] | None = None
        self._take_pruned: Callable[[], list[str]] | None = getattr(store, "take_pruned", None)

    @property
    def queued_bytes(self) -> int:
        return self._jobs_bytes

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None and not self._stopped:  # (never again on a closed store)
            self._task = asyncio.get_running_loop().create_task(self._run(), name="hotloop-writer")

    def closing(self) -> None:
        """Mark where the shutdown begins, for :meth:`lost_at_shutdown` (the first call counts)."""
        if self._at_close is None:
            self._at_close = (self.failed, self.usage_failed)

    def lost_at_shutdown(self) -> int:
        """Responses and ledger records not stored since the shutdown began (given up at its
        bound, failed, or come after the store closed): the server then exits with
        ``WRITES_LOST`` instead of 0, so that what runs it can tell (all named in the log)."""
        if self._at_close is None:
            return 0
        failed, usage_failed = self._at_close
        return self.failed - failed + self.usage_failed - usage_failed

    def lost(self, response_id: str) -> bool:
        """Whether the write of ``response_id`` failed (among the last ``LOST_IDS`` failures)."""
        return response_id in self._lost

    @property
    def seq(self) -> int:
        """The last sequence number handed out (a job queued later has a higher one)."""
        return self._seq

    def ledger_lost(self, after: int, upto: int) -> bool:
        """Whether a ledger batch queued after sequence number ``after`` and by ``upto`` failed
        (``--store-sync full``: a record submitted after ``after`` and flushed by ``upto`` is in one)."""
        return any(after < seq <= upto for seq in self._lost_usage)

    async def flush(self) -> int:
        """Wait until every job submitted before this call is written (a barrier: later jobs
        do not delay it); the sequence number it waited for."""
        # the buffered ledger records are this call's last job: numbered before any wait for
        # room, so jobs submitted while it waits are not waited for
        target = await self._enqueue("usage", self._take_usage(), 0) if self._usage else self._seq
        if self._done >= target or self._task is None:
            return target
        fut = asyncio.get_running_loop().create_future()
        self._barriers.append((target, fut))
        self._wake()  # a barrier does not wait for the commit delay
        await fut
        return target

    def _take_usage(self) -> list[UsageRecord]:
        batch, self._usage = self._usage, []
        if self._usage_timer is not None:
            self._usage_timer.cancel()
            self._usage_timer = None
        return batch

    def _usage_due(self) -> None:
        self._usage_timer = None
        if self._usage and not self._stopped:
            if not self._blocked and self._has_room(0):
                self._push(self._job("usage", self._take_usage(), 0))
            else:  # busy writer: try again later, the buffer stays bounded
                self._usage_timer = asyncio.get_running_loop().call_later(self.USAGE_FLUSH_SECONDS, self._usage_due)

    async def _drain(self) -> None:
        """:meth:`flush` until nothing came while it waited: what a response ending during the
        shutdown flush submits or charges is written with the rest (close())."""
        while True:
            await self.flush()
            if not self._usage and not self._blocked and self._done >= self._seq:
                return

    async def close(self, timeout: float = CLOSE_FLUSH_SECONDS) -> None:
        """Write everything queued, then close the store, within ``timeout`` seconds in all (the
        flush and the store's own close share the one deadline: a store that hangs cannot hold the
        process forever). A flush cut short is one log line with the writes not stored; a close
        cut short is one line too, and its thread is left to the process's exit (``stuck``).

        Late records. A response may still end while (or after) the store closes: one running
        past the shutdown grace and the abort window charges what it used (:meth:`charge`) or
        submits itself when its task ends. Usage records are billing data, so none is lost
        silently:

        * while the queue is written out, what arrives is written too (:meth:`_drain` waits for
          it), and what arrives while the writer stops is written here, directly in the store's
          thread, before the store's close and within the same deadline (the store is still open);
        * once the store is closing or closed (or its writer gave up at the deadline) a record
          cannot be written any more: it is not queued (no writer is started again on a closed
          store, nothing waits, nothing raises to the response's task), but logged at ERROR, one
          line per ledger row it would have added to, with its day, key id and name, model,
          tokens, flags and the response's id when known, so that an operator can add it to the
          ledger, and counted (``usage_failed``: ``hotloop_store_usage_failed``). A response
          submitted then is not stored (logged, counted in ``failed``, :meth:`lost`).

        What close() adds to the shutdown is bounded: the late records written here share its
        deadline, and a late record after it costs one log line."""
        self.closing()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        late = False  # the flush was cut short (and said so): the close, if cut short too, is not told again
        task = self._task
        if task is not None:
            try:
                await asyncio.wait_for(self._drain(), timeout)
            except TimeoutError:
                late = True
            # the writer stops before its next batch (one that began after the drain: awaited)
            self._halt = True
            self._wake()
            if not late:
                await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
            if late or not task.done():
                late = True
                log.error(
                    "store flush at shutdown timed out after %g s: %d write(s) not stored",
                    timeout, len(self._jobs) + len(self._blocked) + self._writing + bool(self._usage),
                )
                self.stuck = self._writing_at is not None and not self._retry_wait
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            self._task = None
        # From here on nothing is queued (_stopped, in the same step as what is left is taken).
        self._stopped = True
        left = self._take_left()
        if left and (late or self.stuck):  # no time left, or the store's thread is not free
            self._account(left, [], "not written: the store's writer did not finish within the shutdown bound")
            left = []
        if self.stuck:
            # the writer thread is still inside the store: closing it would wait behind that call
            # without a bound. Left to the process's exit (serve() does not join the thread).
            self._release_barriers()
            self._pool.shutdown(wait=False, cancel_futures=True)
            return
        # what came while the writer stopped: written before the store's close, on its thread
        writing = loop.run_in_executor(self._pool, self._write_left, left) if left else None
        closing = loop.run_in_executor(self._pool, self.store.close)
        done, _ = await asyncio.wait({closing}, timeout=max(0.0, deadline - loop.time()))
        if writing is not None:
            if writing.done():
                results = writing.result()
                for err in results:
                    if err is not None:
                        self._failures.failed(err, 1, "not stored")
                self._account(left, results, "its write failed at shutdown", detail=True)
            else:  # (then the close did not finish either: reported below)
                writing.add_done_callback(errors.retrieved)
                self._account(left, [], "its write was still running at the shutdown bound: it may be recorded")
        self._release_barriers()
        self._failures.report("store closed")
        if not done:  # a close waiting on the store (a lock held by a thread inside it, say)
            if not late:
                log.error("closing the store at shutdown did not finish within %g s: left to the process's exit", timeout)
            self.stuck = True  # its thread is not joined (serve() exits without it)
            closing.add_done_callback(errors.retrieved)
            self._pool.shutdown(wait=False, cancel_futures=True)
            return
        closing.result()  # a failing close raises, as it did when awaited directly
        self._pool.shutdown(wait=True)

    def _take_left(self) -> list[_Job]:
        """What is queued and not written, in order (close(), the writer stopped): the queue,
        the submissions waiting for room (their callers stop waiting: no writer will make room)
        and the ledger buffer."""
        left = list(self._jobs)
        self._jobs.clear()
        self._jobs_bytes = 0
        for job, fut in self._blocked:
            left.append(job)
            if not fut.done():
                fut.set_result(None)
        self._blocked.clear()
        if self._usage:
            left.append(self._job("usage", self._take_usage(), 0))
        elif self._usage_timer is not None:
            self._usage_timer.cancel()
            self._usage_timer = None
        return left

    def _write_left(self, jobs: list[_Job]) -> list[BaseException | None]:
        """What close() writes itself (the store's thread): each job's failure, never raised; in
        one transaction when the store offers one, else one job at a time (no retry at shutdown)."""
        if self._store_batch is None:
            out: list[BaseException | None] = []
            for job in jobs:
                try:
                    out.append(self._write_job(job))
                except Exception as exc:  # (locked out)
                    out.append(exc)
            return out
        try:
            return self._write_jobs(jobs)
        except Exception as exc:  # the batch failed as a whole (locked out: no retry at shutdown)
            return [exc] * len(jobs)

    def _release_barriers(self) -> None:
        """close(): no :meth:`flush` waits any longer (what it waited for is accounted for:
        :meth:`lost` and :meth:`ledger_lost` say what was not written)."""
        barriers, self._barriers = self._barriers, deque()
        for _, fut in barriers:
            if not fut.done():
                fut.set_result(None)

    def _account(self, jobs: list[_Job], done: list[BaseException | None], why: str, detail: bool = False) -> None:
        """Count what became of ``jobs`` (``done``: each one's failure, ``None``: written; those
        past its end never finished: close() gave up on them, ``why``). Responses count in
        ``written``/``failed``, ledger records in ``usage_written``/``usage_failed``. Ledger
        records that never finished (or failed, with ``detail``) are logged for reconciliation
        (:meth:`_unrecorded`); other failed writes were logged by kind (:class:`_FailureLog`)."""
        unrecorded: list[UsageRecord] = []
        for i, job in enumerate(jobs):
            finished = i < len(done)
            ok = finished and done[i] is None
            if job.kind == "put":
                rid = job.payload.entry.id
                self.pending.pop(rid, None)
                if ok:
                    self.written += 1
                else:
                    self.failed += 1
                    self._lose(rid)
            elif ok:
                self.usage_written += len(job.payload)
            else:
                self._lost_usage.append(job.seq)
                if finished and not detail:
                    self.usage_failed += len(job.payload)
                else:
                    unrecorded.extend(job.payload)
            self._finished(job.seq)
        if unrecorded:
            self._unrecorded(unrecorded, why)

    def _lose(self, response_id: str) -> None:
        self._lost[response_id] = None
        if len(self._lost) > LOST_IDS:
            self._lost.popitem(last=False)

    def _unrecorded(self, recs: list[UsageRecord], why: str, response_id: str | None = None) -> None:
        """Ledger records that cannot be written (close(): see there): counted in
        ``usage_failed`` and logged at ERROR, one line per ledger row they add to (UTC day, model,
        key id) with what it would count, so that an operator can add it to the ledger. Bounded
        by the records close() had left (the queue's bounds) or by the responses still running
        after it; names are quoted (a model name is a client's string)."""
        self.usage_failed += len(recs)
        rows: dict[tuple[str, str, str], list[Any]] = {}
        for r in recs:
            day = time.strftime("%Y-%m-%d", time.gmtime(r.at))
            row = rows.get((day, r.model, r.key))
            if row is None:
                row = rows[day, r.model, r.key] = [r.name, 0, 0, 0, 0, 0, 0, {}]
            row[1] += 1
            row[2] += r.input_tokens
            row[3] += r.output_tokens
            row[4] += r.cached_tokens
            row[5] += r.reasoning_tokens
            if r.findings:
                row[6] += 1
                for kind, n in r.findings.items():
                    row[7][kind] = row[7].get(kind, 0) + n
        response = "" if response_id is None else f" response={response_id!r}"
        for (day, model, key), (name, n, inp, out, cached, reasoning, flagged, found) in rows.items():
            log.error(
                "usage not recorded in the ledger (%s): day=%s key_id=%r key=%r model=%r responses=%d "
                "input_tokens=%d output_tokens=%d cached_tokens=%d reasoning_tokens=%d flagged=%d findings=%r%s "
                "(counted in hotloop_store_usage_failed; add it to the ledger to reconcile)",
                why, day, key, name, model, n, inp, out, cached, reasoning, flagged, found, response,
            )

    def _late(self, entry: CachedResponse, key: str, findings: dict[str, int] | None, ledger: bool, name: str | None) -> None:
        """:meth:`submit` after close() took what was left (see there): not stored, not queued."""
        if entry.store:
            self._late_put(entry.id)
        rec = usage_record(entry.response, key, findings, name) if ledger else None
        if rec is not None:
            self._late_usage([rec], entry.id)

    def _late_put(self, response_id: str) -> None:
        """A response to store after close() took what was left: not stored, logged, counted."""
        self.pending.pop(response_id, None)
        self.failed += 1
        self._lose(response_id)
        log.error("response %s ended after the store closed at shutdown: not stored (counted in hotloop_store_failed)", response_id)

    def _late_usage(self, recs: list[UsageRecord], response_id: str | None) -> None:
        """Ledger records after close() took what was left: numbered as a job that failed
        (:meth:`ledger_lost` tells a ``--store-sync full`` response its ledger entry was not
        written), logged and counted (:meth:`_unrecorded`)."""
        seq = self._job("usage", None, 0).seq
        self._lost_usage.append(seq)
        self._finished(seq)
        self._unrecorded(recs, "charged after the store closed at shutdown", response_id)

    # -- the queue -----------------------------------------------------------------------------

    def _job(self, kind: str, payload: Any, nbytes: int) -> _Job:
        self._seq += 1
        return _Job(self._seq, kind, payload, nbytes, time.monotonic())

    def _has_room(self, nbytes: int) -> bool:
        """Whether a job of ``nbytes`` may join the queue now. Less than one batch of jobs always
        may (the writer takes a whole batch at once, so the lag is checked from there on: a queue
        of old jobs admitting one job per batch would make the writer slower still)."""
        jobs = self._jobs
        n = len(jobs)
        if not jobs:
            return True
        if n >= self.max_pending or self._jobs_bytes + nbytes > self.max_pending_bytes:
            return False
        now = time.monotonic()
        if now - jobs[0].at < self.max_lag:
            return True
        # less than a batch, unless the batch being written is itself older than max_lag (a
        # write stuck on a lock or a slow disk): then nothing queued behind it would be durable
        # within the bound either
        writing = self._writing_at
        return n < self._batch and (writing is None or now - writing < self.max_lag)

    def has_room(self) -> bool:
        """Whether a submission now would be queued at once: the writer is not behind. A response
        answered before its submission (HTTP) is answered first only then; while the writer is
        behind, its answer waits for the submission, so that its client's next turn waits too
        (the back-pressure that bounds what a crash can lose)."""
        return not self._blocked and self._has_room(0)

    def _push(self, job: _Job) -> None:
        self._jobs.append(job)
        self._jobs_bytes += job.nbytes
        if self._gathering is None or len(self._jobs) >= self._batch:
            self._wake()

    def _wake(self) -> None:
        wake = self._wakeup
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _admit(self) -> None:
        """Move waiting jobs into the queue, in order, while there is room."""
        blocked = self._blocked
        while blocked and self._has_room(blocked[0][0].nbytes):
            job, fut = blocked.popleft()
            self._push(job)
            if not fut.done():
                fut.set_result(None)

    async def _enqueue(self, kind: str, payload: Any, nbytes: int) -> int:
        """Queue a job without ever losing it to the caller's cancellation; its sequence number
        (given before any wait: a job submitted meanwhile has a higher one), or the last one
        handed out when the store is closed and nothing is queued.

        The common case does not suspend at all. When the queue is full the caller waits in
        line (the back-pressure), shielded: a caller cancelled meanwhile (a client that left)
        does not take the job with it, and the job keeps its place in the order.
        """
        if self._task is None:
            if self._stopped:  # a submission that waited for room while close() took what was left
                if kind == "put":
                    self._late_put(payload.entry.id)
                else:
                    self._late_usage(payload, None)
                return self._seq
            self.start()
        job = self._job(kind, payload, nbytes)
        if not self._blocked and self._has_room(nbytes):
            self._push(job)
            return job.seq
        fut = asyncio.get_running_loop().create_future()
        self._blocked.append((job, fut))
        self._wake()  # a turn waits for room: no commit delay
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(fut), ADMIT_POLL_SECONDS)
                return job.seq
            except TimeoutError:
                # the room can change without the writer taking a batch (a store that became
                # unreachable meanwhile: SharedPersistence._has_room); looked at again
                self._admit()

    def _finished(self, seq: int) -> None:
        self._done = seq
        barriers = self._barriers
        while barriers and barriers[0][0] <= seq:
            _, fut = barriers.popleft()
            if not fut.done():
                fut.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._halt:
            if not self._jobs:
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
                continue
            delay = self.commit_delay and self._jobs[0].at + self.commit_delay - time.monotonic()
            if delay > 0 and len(self._jobs) < self._batch and not self._barriers and not self._blocked:
                # group commit: the turns that finish meanwhile join this transaction; a full
                # batch, a flush() or a waiting turn ends the wait early (see _push, _wake)
                self._wakeup = wake = loop.create_future()
                self._gathering = loop.call_at(loop.time() + delay, self._wake)
                try:
                    await wake
                finally:
                    self._wakeup = None
                    self._gathering.cancel()
                    self._gathering = None
                if self._halt:  # close(): it writes what is left itself
                    return
            queue = self._jobs
            jobs = [queue.popleft() for _ in range(min(len(queue), self._batch))]
            self._jobs_bytes -= sum(job.nbytes for job in jobs)
            self._admit()
            self._writing_at, self._writing = jobs[0].at, len(jobs)
            done: list[BaseException | None] = []
            try:
                done = await self._write_batch(loop, jobs)
            finally:
                self._writing_at, self._writing = None, 0
                # (cancelled: close() gave up on the queue at its deadline and logged how many
                # were not stored; the ledger records of this batch are logged one row a line)
                self._account(jobs, done, "its write was cut short at the shutdown bound: it may be recorded")
            if self._take_pruned is not None:
                pruned = self._take_pruned()
                if pruned:
                    await self._pruned(pruned)

    async def _pruned(self, ids: list[str]) -> None:
        """Responses the store's bounds pruned: dropped from the process-wide cache."""
        evict = self.evict
        if evict is not None:
            for rid in ids:
                evict(rid)

    async def _write_batch(self, loop: asyncio.AbstractEventLoop, jobs: list[_Job]) -> list[BaseException | None]:
        """Write ``jobs`` in the writer thread; each one's failure (``None``: written), logged and
        never raised. A batch locked out by another connection's write lock is written again
        (whole, in order) until ``LOCKED_RETRY_SECONDS`` have passed: nothing of it was stored."""
        give_up = time.monotonic() + LOCKED_RETRY_SECONDS
        tries = 0
        while True:
            try:
                done = await loop.run_in_executor(self._pool, self._write_jobs, jobs)
            except Exception as exc:  # the batch failed as a whole: none of it is stored
                if locked(exc) and time.monotonic() + LOCKED_RETRY_PAUSE < give_up:
                    tries += 1
                    self._failures.note(
                        "locked",
                        "store writes wait: another connection holds the SQLite write lock past the busy timeout; "
                        f"each batch is retried for up to {LOCKED_RETRY_SECONDS:g} s (at most one line per "
                        f"{self._failures.interval:g} s)",
                    )
                    self._retry_wait = True
                    try:
                        await asyncio.sleep(LOCKED_RETRY_PAUSE)
                    finally:
                        self._retry_wait = False
                    continue
                what = f"not stored (given up after {tries + 1} tries)" if locked(exc) else "not stored"
                self._failures.failed(exc, len(jobs), what)
                return [exc] * len(jobs)
            failed = [e for e in done if e is not None]
            for err in failed:
                self._failures.failed(err, 1, "not stored")
            if len(failed) < len(done):
                self._failures.ok()
            return done

    def _write_jobs(self, jobs: list[_Job]) -> list[BaseException | None]:
        """Write queued jobs (writer thread), in order: in one store transaction when the store
        offers one (``batch``: one commit, one disk sync, for everything queued); each one's
        failure (``None``: written). A job that fails alone does not stop the others; one whose
        failure voids the batch (:class:`TransactionLost`) or that was locked out (``locked``)
        raises, and the batch fails as a whole."""
        if len(jobs) == 1:
            return [self._write_job(jobs[0])]
        with self._store_batch():
            return [self._write_job(job) for job in jobs]

    def _write_job(self, job: _Job) -> BaseException | None:
        try:
            if job.kind == "put":
                self._write(job.payload)
            else:
                self.store.record_usage(job.payload)
            return None
        except TransactionLost:
            raise
        except Exception as exc:  # a storage failure must not kill the writer (logged by _write_batch)
            if locked(exc):  # nothing of it is stored: the batch is written again
                raise
            return exc

    def _write(self, snap: Snapshot) -> None:
        """Store one response (writer thread): its own items, or its whole history when its
        parent is not in the store."""
        if snap.base_len:
            try:
                self.store.put(own_record(snap))
                return
            except MissingParent:
                log.debug("parent of %s is not stored; storing its whole history", snap.entry.id)
        self.store.put(whole_record(snap))

    # -- writes --------------------------------------------------------------------------------

    async def submit(
        self, entry: CachedResponse, key: str = LEGACY_OWNER, findings: dict[str, int] | None = None,
        *, ledger: bool = True, name: str | None = None,
    ) -> None:
        """Queue a finished response: the usage ledger (under the key id ``key``, shown as ``name``, with the
        classifiers' ``findings`` per kind when it was flagged) unless ``ledger`` is false, the
        response if it is stored."""
        if self._task is None:
            if self._stopped:  # (after close(): see there)
                self._late(entry, key, findings, ledger, name)
                return
            self.start()
        rec = usage_record(entry.response, key, findings, name) if ledger else None
        if rec is not None:
            self._usage.append(rec)
            if self._usage_timer is None:  # (a batch taken below cancels it)
                self._usage_timer = asyncio.get_running_loop().call_later(self.USAGE_FLUSH_SECONDS, self._usage_due)
        if entry.store:
            # Queued (its job numbered: a DELETE's flush waits for it) before anything here may
            # suspend. After a ledger batch that waited for room (USAGE_BUFFER records while the
            # writer is behind), a DELETE that came meanwhile found nothing to delete, and the
            # response was stored after it.
            snap = snapshot(entry)
            self.pending[entry.id] = entry
            await self._enqueue("put", snap, approx_nbytes(snap.own))
        if rec is not None:
            n = len(self._usage)
            if n >= self.USAGE_BATCH and (n >= self.USAGE_BUFFER or (not self._blocked and self._has_room(0))):
                # a batch is due; while the writer is behind, the buffer grows (to USAGE_BUFFER)
                # rather than make this turn wait for a ledger write
                await self._enqueue("usage", self._take_usage(), 0)

    def charge(self, rec: UsageRecord | None, response_id: str | None = None) -> None:
        """A ledger record for a response that ended without ``submit`` (cut short, or failed),
        without waiting: it joins the buffer, written within ``USAGE_FLUSH_SECONDS``. Past
        ``USAGE_BUFFER`` records (a writer long behind) it is dropped, and the log says so
        (counted in ``usage_dropped`` and ``usage_failed``). After :meth:`close` it cannot be
        written: it is logged with its details (``response_id``, the response's, when known) and
        counted (see close()). Never raises, never waits."""
        if rec is None:
            return
        if self._task is None:
            if self._stopped:  # (after close(): see there)
                self._late_usage([rec], response_id)
                return
            self.start()
        if len(self._usage) >= self.USAGE_BUFFER:
            self.usage_dropped += 1
            self.usage_failed += 1
            self._failures.note(
                "ledger buffer full",
                f"usage ledger buffer full ({self.USAGE_BUFFER} records): records are dropped, "
                f"{self.usage_dropped} so far (at most one line per {self._failures.interval:g} s)",
                failing=False, level=logging.ERROR,
            )
            return
        self._usage.append(rec)
        if len(self._usage) >= self.USAGE_BATCH and not self._blocked and self._has_room(0):
            # a batch is due and the writer has room: queued now, as submit() does (without
            # waiting), so that only a writer that is behind lets the buffer grow to its bound
            self._push(self._job("usage", self._take_usage(), 0))
        elif self._usage_timer is None:
            self._usage_timer = asyncio.get_running_loop().call_later(self.USAGE_FLUSH_SECONDS, self._usage_due)

    # -- reads ---------------------------------------------------------------------------------

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # Every read takes the caller's ``scope``: an owner id, or ``None`` for every owner (see
    # hotloop.state.store). Another owner's response reads exactly like one that does not exist.

    def _pending(self, response_id: str, scope: str | None) -> CachedResponse | None:
        entry = self.pending.get(response_id)
        return entry if entry is not None and entry.visible(scope) else None

    async def load(self, response_id: str, scope: str | None = None) -> CachedResponse | None:
        """A stored response, hydrated into a continuable context (or ``None``)."""
        entry = self._pending(response_id, scope)
        if entry is not None:
            return entry
        rec = await self._call(self.store.get, response_id, scope)
        return None if rec is None else from_record(rec)

    async def find_item(self, item_id: str, scope: str | None = None) -> Item | None:
        """A server-minted item of a stored response, by id (for ``item_reference``)."""
        for entry in self.pending.values():
            if entry.visible(scope):
                found = entry.minted_item(item_id)
                if found is not None:
                    return found
        raw = await self._call(self.store.get_item, item_id, scope)
        return None if raw is None else item_from_dict(raw)

    async def get_response(self, response_id: str, scope: str | None = None) -> dict[str, Any] | None:
        entry = self._pending(response_id, scope)
        if entry is not None:
            return entry.response
        return await self._call(self.store.get_response, response_id, scope)  # type: ignore[no-any-return]

    async def input_items(
        self, response_id: str, after: str | None, limit: int, order: str, scope: str | None = None
    ) -> tuple[list[dict[str, Any]], bool] | None | bool:
        """A page of input items; ``None`` if the response is unknown, ``False`` if ``after`` is."""
        entry = self._pending(response_id, scope)
        if entry is not None:
            items = [item_to_dict(it) for it in entry.input_items]
        else:
            rec = await self._call(self.store.get, response_id, scope)
            if rec is None:
                return None
            items = rec.items[: rec.input_len]
        page = page_items(items, after, limit, order)
        return False if page is None else page

    # -- what a client's request writes (DELETE, the usage listing) ---------------------------------
    #
    # Each first waits for the writes queued before it (a write submitted earlier must not
    # resurrect what a DELETE deletes; a listing counts what was charged before it), then writes
    # itself. On a SQLite store (one with a ``busy_timeout``) the request has one bound, its
    # busy timeout from the request's start: the wait for the writer (which, locked out of the
    # file by another connection, retries its batch for up to LOCKED_RETRY_SECONDS) and the
    # request's own wait for the write lock share it, and past it the request raises StoreBusy
    # (a 503 to retry) with nothing of it done; the queued writes stay queued. Its own write
    # runs in a store thread, which may first finish a try of the writer's that began meanwhile
    # (at most one busy timeout more), and then tries at once. Other stores wait as their
    # writer does (a memory store never waits; Redis: a 503 once it is unreachable, shared).

    def _deadline(self) -> float | None:
        """When a client's request that writes gives up (``time.monotonic()``), or ``None``."""
        bound = getattr(self.store, "busy_timeout", None)
        return None if bound is None else time.monotonic() + bound

    async def _settled(self, deadline: float | None, what: str) -> None:
        """:meth:`flush`, within ``deadline`` (:class:`StoreBusy` past it, logged as the store
        logs its own, for the request ``what``; nothing is lost)."""
        if deadline is None:
            await self.flush()
            return
        try:
            await asyncio.wait_for(self.flush(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise self._waited_out(what) from None

    def _waited_out(self, what: str) -> StoreBusy:
        """The 503 of a request (``what``) that waited out its bound for the writer, logged as the
        store logs its own (at most once a minute)."""
        busy = getattr(self.store, "_busy", None)
        if busy is None:
            return StoreBusy()
        return busy(what, "the store's writer, retrying a batch locked out of the file, did not finish in time")  # type: ignore[no-any-return]

    def _store_delete(
        self, response_id: str, scope: str | None, deadline: float | None, on_delete: Callable[..., None] | None = None
    ) -> bool:
        """The store's delete (a store thread), waiting for the write lock until ``deadline``
        at most, counted when the thread takes the call (``on_delete``: see SQLiteStore.delete)."""
        store: Any = self.store
        if deadline is None:
            return bool(store.delete(response_id, scope))
        return bool(store.delete(response_id, scope, wait=deadline - time.monotonic(), on_delete=on_delete))

    def _store_usage(
        self, key: str | None, since: str | None, after: UsageRow | None, limit: int | None, deadline: float | None
    ) -> list[dict[str, Any]]:
        """The store's usage listing (a store thread), within ``deadline`` as :meth:`_store_delete`."""
        store: Any = self.store
        if deadline is None:
            return store.usage(key, since, after, limit)  # type: ignore[no-any-return]
        return store.usage(key, since, after, limit, wait=deadline - time.monotonic())  # type: ignore[no-any-return]

    async def delete(self, response_id: str, scope: str | None = None) -> bool:
        """:raises StoreBusy: a SQLite store locked out past the request's bound (nothing deleted)."""
        deadline = self._deadline()
        await self._settled(deadline, "a delete")  # a write submitted earlier must not resurrect what is deleted now
        return bool(await self._call(self._store_delete, response_id, scope, deadline))

    async def usage(
        self, key: str | None = None, since: str | None = None, after: UsageRow | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Ledger rows of the key id ``key`` (``None``: every key's) from UTC day ``since`` on,
        after the row ``after``, at most ``limit`` (see :meth:`Store.usage`).

        :raises StoreBusy: a SQLite store locked out past the request's bound."""
        deadline = self._deadline()
        await self._settled(deadline, "a usage listing")
        return await self._call(self._store_usage, key, since, after, limit, deadline)  # type: ignore[no-any-return]
