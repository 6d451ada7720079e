"""Per-key rate limits shared by the worker processes of one host (``--workers`` on SQLite).

The same limits as :class:`~hotloop.tenants.limits.MemoryLimiter` (token buckets refilled
continuously, a token reservation corrected when the response ends, concurrency slots), kept in a
SQLite file that every worker opens, so a key's limits hold whichever workers its connections
land on. The checks themselves are MemoryLimiter's: each operation loads the key's rows into a
MemoryLimiter that serves as this process's view, runs it, and writes the buckets back, so the
refusals, their messages and ``retry-after`` headers are the same.

The file. ``hotloop-limits.sqlite3`` beside the store's file (:func:`limits_path`), not the
store's own: the buckets change with every limited request and must not contend for the store's
write lock (nor go into its backups). WAL with ``synchronous=OFF``: nothing in it needs to
survive a crash of the host (the buckets would start full, as at any start). The parent creates
it fresh before it forks the workers (:func:`create`: a restarted server starts with full
buckets, as a single server does) and removes it once its workers are gone (:func:`remove`). The
parent holds ``hotloop-limits.sqlite3-lock`` (``flock``, shared) and its workers inherit it: a
second ``--workers`` server on the same data directory finds it held, and shares the file as it
is instead of emptying it, and the file is removed only by the last of them to stop. Tables::

    buckets (key, kind, cap, level, at)   a bucket that is not full; kind 'rpm' or 'tpm'
    slots   (id, key, pid, started)       a response in flight of a key with max_concurrent

Time is ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the host), read
once a transaction holds the write lock, so the times stored never go backwards.

Transactions. Each operation (a request taken, a response admitted, responses finished) is one
``BEGIN IMMEDIATE`` transaction run on the event loop, synchronously: it never awaits while it
holds the lock, so a peer never waits on more than a few microseconds of work. Measured on a
2-core host (Python 3.12, SQLite 3.40, the file on ext4), per call: ``take_request`` 17 us,
``admit`` (tokens and a slot) 30 us, a grant's ``finish`` 26 us, alone; with a second process
hammering the same key, 20-50 us, 60-80 us and 60-70 us of wall time (lock waits included;
fewer than one call in 200 then finished off the loop). Off the loop, the hand-off alone (a
``run_in_executor`` round trip, uvloop) measured 79 us of wall time and 72 us of CPU: more than
the transaction. The lock is tried without waiting and retried at once for up to
``SPIN_SECONDS``; then the call returns an awaitable that retries every 1 ms (doubling to 20 ms)
off the request's path (a request cancelled meanwhile has taken nothing), up to
``BUSY_SECONDS`` in all, and then refuses the request with a 503 ``server_error``
(:class:`~hotloop.errors.StoreUnavailable`, ``retry-after: 1``), as it does at once on any other
SQLite failure (disk full, I/O error). The log says why, at most once per ``LOG_SECONDS``.

Concurrency slots. A slot is a row holding the process that took it: its pid and its start time
(``/proc/<pid>/stat``, field 22), so a pid reused by another process is not taken for its
holder. It is deleted when its response finishes. A worker that dies with responses in flight
(SIGKILL, a segfault) loses its slots: the parent deletes every slot of the pid it reaps
(:func:`free_slots`; a pid is not reused before it is reaped, and the parent forks the
replacement afterwards), and an admission that finds its key at ``max_concurrent`` first deletes
that key's slots whose process is gone (no such pid, a zombie, or another start time), so a slot
outlives its holder only until one of them runs.

Finishing (:meth:`SQLiteGrant.finish`, idempotent) queues the reservation's correction and the
slot's release and applies them in one transaction at once; when the file is busy or failing,
they are applied by a background retry or by this process's next transaction, whichever comes
first (at most ``MAX_RELEASES`` wait; beyond that the oldest are dropped, logged). Nothing of it
is raised into the response's path.

Bounds. A bucket is deleted when it is written full (a full bucket is the same as none), and
every ``SWEEP_SECONDS`` each process deletes those that have refilled since: at most two rows
per key with per-minute limits used within about the last two minutes. One slot per response in
flight, plus a dead worker's until it is reaped. The WAL is checkpointed every 1000 pages
(SQLite's default): a few MB.

The rate-limit headers are rendered from this process's view (the level its last transaction for
the key read or wrote, refilled locally since): exact for the request that made the transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import sqlite3
import time
from collections import deque
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

from hotloop import errors
from hotloop.state import create_private
from hotloop.state.store import locked
from hotloop.tenants.keys import Limits
from hotloop.tenants.limits import DEFAULT_MAX_KEYS, Bucket, Grant, LimitExceeded, MemoryLimiter, SharedGrant

log = logging.getLogger("hotloop.tenants")

T = TypeVar("T")

SPIN_SECONDS = 0.0002  # the lock retried at once, on the loop, for this long (a peer holds it microseconds)
BUSY_SECONDS = 0.5  # then retried off the request's path for this long in all; then a 503
RETRY_FIRST, RETRY_MAX = 0.001, 0.02  # the delays between those retries
SWEEP_SECONDS = 60.0  # how often a process deletes the buckets that have refilled
MAX_RELEASES = 4096  # finished responses waiting for their write; beyond it the oldest are dropped
LOG_SECONDS = 60.0  # a failing file is logged at most this often

_SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets (
  key TEXT NOT NULL, kind TEXT NOT NULL, cap INTEGER NOT NULL, level REAL NOT NULL, at REAL NOT NULL,
  PRIMARY KEY (key, kind)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS slots (
  id INTEGER PRIMARY KEY, key TEXT NOT NULL, pid INTEGER NOT NULL, started INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS slots_key ON slots (key);
"""


def limits_path(db_path: Path) -> Path:
    """The limits file of the store file ``db_path``: ``hotloop-limits.sqlite3`` beside it."""
    return db_path.with_name(f"{db_path.stem}-limits{db_path.suffix}")


def _connect(path: Path, timeout: float, create: bool) -> sqlite3.Connection:
    uri = f"{path.resolve().as_uri()}?mode={'rwc' if create else 'rw'}"
    db = sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA synchronous=OFF")
    return db


_held: dict[str, int] = {}  # limits files this process made (create) -> its descriptor of their lock


def _lock_path(path: Path) -> Path:
    return Path(f"{path}-lock")


def _lock(path: Path, *, create: bool) -> tuple[int, bool] | None:
    """A descriptor of ``path``'s lock file (made when ``create``), locked exclusively (``True``:
    no other server uses the file) or, when another server holds it, shared (``False``; only
    when ``create``); ``None``: no lock file, or in use and not ``create``. A lock file removed
    meanwhile by a server that stopped is opened again."""
    lock = _lock_path(path)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except BlockingIOError:
                if not create:
                    os.close(fd)
                    return None
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while another server's create empties it
                alone = False
            st = os.fstat(fd)
            try:
                same = os.stat(lock).st_ino == st.st_ino and os.stat(lock).st_dev == st.st_dev
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd, alone
        os.close(fd)


def _unlink(path: Path) -> None:
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm"), _lock_path(path)):  # the lock last
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _prepare(path: Path, empty: bool) -> None:
    # (its keys' ids and bucket levels are each tenant's activity: private as the store file is)
    create_private(str(path))
    db = _connect(path, BUSY_SECONDS, create=True)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
        if empty:
            db.executescript("BEGIN IMMEDIATE; DELETE FROM buckets; DELETE FROM slots; COMMIT;")
    finally:
        db.close()


def remove(path: Path) -> None:
    """Delete the limits file and its WAL and lock files, unless another server on the same data
    directory still uses them (its workers hold the lock file shared: the file is theirs now).
    The caller has no connection to the file open."""
    fd = _held.pop(str(path), None)
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("the rate-limits file %s is left to the other server that uses it", path)
                return
        else:
            got = _lock(path, create=False)
            if got is None and _lock_path(path).exists():  # in use by a server
                log.info("the rate-limits file %s is left to the server that uses it", path)
                return
            fd = got[0] if got is not None else None
        _unlink(path)
    finally:
        if fd is not None:
            os.close(fd)


def create(path: Path) -> None:
    """Make the limits file at ``path`` ready for this server's workers, which inherit its lock:
    emptied (full buckets, no slots: what an earlier server left is gone), unless another server
    on the same data directory still uses it (then shared with it, as it is: emptying it or
    making another would split a key's limits between the servers' workers). The caller has no
    connection to the file open."""
    old = _held.pop(str(path), None)
    if old is not None:  # this process's earlier server on it is gone
        os.close(old)
    got = _lock(path, create=True)
    assert got is not None
    fd, alone = got
    try:
        if not alone:
            log.warning(
                "the rate-limits file %s is in use by another server on this data directory: "
                "its limits are shared with it", path,
            )
        try:
            _prepare(path, empty=alone)
        except sqlite3.DatabaseError:  # not a database, or a damaged one (a host crash): a new one
            if not alone:
                raise
            for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            _prepare(path, empty=False)
        if alone:
            fcntl.flock(fd, fcntl.LOCK_SH)  # another server that starts shares it
    except BaseException:
        os.close(fd)
        raise
    _held[str(path)] = fd


def free_slots(path: Path, pid: int) -> int:
    """Delete the concurrency slots of process ``pid`` (a worker the caller reaped); how many.
    Never raises: a failure is logged (an admission at the limit deletes them anyway)."""
    try:
        if not path.exists():  # no limits file (the server has none): nothing to free
            return 0
        db = _connect(path, BUSY_SECONDS, create=False)
        try:
            n: int = db.execute("DELETE FROM slots WHERE pid = ?", (pid,)).rowcount
        finally:
            db.close()
    except (sqlite3.Error, OSError) as exc:
        log.warning("could not free the rate-limit slots of worker %d in %s (%s: %s)", pid, path, type(exc).__name__, exc)
        return 0
    if n:
        log.info("freed the %d rate-limit concurrency slot(s) of worker %d", n, pid)
    return n


def started(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot); ``None`` when it is gone or a
    zombie. Without ``/proc``, 0 for a process that exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rpartition(b")")[2].split()  # the name, in parentheses, may hold spaces
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


class _Locked(Exception):
    """The write lock is held by another connection (no waiting was asked for)."""


class SQLiteGrant(SharedGrant):
    """An admitted response whose release goes to the limits file."""

    __slots__ = ("tpm", "slot")

    def __init__(self, limiter: "SQLiteLimiter", key_id: str, tpm: int | None, reserved: int, slot: int | None) -> None:
        super().__init__(limiter, key_id, reserved)
        self.tpm = tpm
        self.slot = slot


class SQLiteLimiter:
    """:class:`~hotloop.tenants.limits.Limiter` whose buckets and slots are in a SQLite file."""

    def __init__(self, path: Path, *, max_keys: int = DEFAULT_MAX_KEYS, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._db: sqlite3.Connection | None
        self.view = MemoryLimiter(max_keys, clock)  # this process's last view of each key's buckets
        self.pid = os.getpid()
        self.started = started(self.pid) or 0
        db = self._db = _connect(path, BUSY_SECONDS, create=True)
        if db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'slots'").fetchone()[0] == 0:
            db.execute("PRAGMA journal_mode=WAL")  # a file the parent did not make (a server built in-process)
            db.executescript(_SCHEMA)
        db.execute("PRAGMA busy_timeout = 0")  # never waits on the loop: _tx retries
        # (key id, tpm, correction, slot id) of finished responses not written yet
        self.releases: deque[tuple[str, int | None, int, int | None]] = deque()
        self._flusher: asyncio.Task[None] | None = None
        self._sweep_at = clock() + SWEEP_SECONDS
        self._logged_at = -LOG_SECONDS
        self._unlogged = 0

    # -- transactions ---------------------------------------------------------------------------

    def _tx(self, op: Callable[..., T], *args: Any) -> T:
        """Run ``op(db, now, *args)`` in one ``BEGIN IMMEDIATE`` transaction, after the releases
        waiting; a refusal it raises comes after the commit. :raises _Locked: the lock is held"""
        db = self._db
        if db is None:
            raise errors.StoreUnavailable("The rate-limit store is unavailable. Please retry shortly.")
        deadline = 0.0
        while True:
            try:
                db.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError as exc:
                if not locked(exc):
                    raise
                now = time.monotonic()
                if not deadline:
                    deadline = now + SPIN_SECONDS
                elif now >= deadline:
                    raise _Locked() from None
        refused: LimitExceeded | None = None
        try:
            now = self.clock()
            applied = len(self.releases)
            for key_id, tpm, correction, slot in list(self.releases):
                self._release(db, now, key_id, tpm, correction, slot)
            if now >= self._sweep_at:
                db.execute("DELETE FROM buckets WHERE level + (? - at) * cap / 60.0 >= cap", (now,))
                self._sweep_at = now + SWEEP_SECONDS
            try:
                out = op(db, now, *args)
            except LimitExceeded as exc:
                refused = exc
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise
        for _ in range(applied):
            self.releases.popleft()
        if refused is not None:
            raise refused
        return out

    def _call(self, op: Callable[..., T], *args: Any) -> T | Awaitable[T]:
        """``op``'s answer now, or an awaitable of it when the file is busy (the module's docstring)."""
        try:
            return self._attempt(op, *args)
        except _Locked:
            return self._retry(op, *args)

    def _attempt(self, op: Callable[..., T], *args: Any) -> T:
        try:
            return self._tx(op, *args)
        except sqlite3.Error as exc:  # not a lock to wait for: disk full, I/O error, a file gone bad
            if locked(exc):
                raise _Locked() from None
            self._failed(f"{type(exc).__name__}: {exc}")
            refused = errors.StoreUnavailable("The rate-limit store is unavailable. Please retry shortly.")
            refused.headers["retry-after"] = "1"  # as the busy file's 503: paces the SDKs' retries
            raise refused from None

    async def _retry(self, op: Callable[..., T], *args: Any) -> T:
        deadline = time.monotonic() + BUSY_SECONDS
        delay = RETRY_FIRST
        while True:
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            try:
                return self._attempt(op, *args)
            except _Locked:
                if time.monotonic() >= deadline:
                    self._failed(f"locked by another connection for {BUSY_SECONDS:g} s")
                    exc = errors.StoreUnavailable("The rate-limit store is busy. Please retry shortly.")
                    exc.headers["retry-after"] = "1"
                    raise exc from None
            delay = min(delay * 2, RETRY_MAX)

    def _failed(self, why: str) -> None:
        now = time.monotonic()
        self._unlogged += 1
        if now - self._logged_at >= LOG_SECONDS:
            log.warning(
                "rate limits: the limits file %s failed (%s); %d operation(s) failed since the last such line",
                self.path, why, self._unlogged,
            )
            self._logged_at, self._unlogged = now, 0

    # -- rows -------------------------------------------------------------------------------------

    @staticmethod
    def _load(db: sqlite3.Connection, key_id: str, kind: str, b: Bucket, now: float) -> Bucket:
        """Set ``b`` to the stored bucket (full when none is stored, or one of another capacity)."""
        row = db.execute("SELECT level, at FROM buckets WHERE key = ? AND kind = ? AND cap = ?", (key_id, kind, b.capacity)).fetchone()
        b.level, b.at = (float(b.capacity), now) if row is None else row
        return b

    @staticmethod
    def _save(db: sqlite3.Connection, key_id: str, kind: str, b: Bucket) -> None:
        if b.level >= b.capacity:  # a full bucket is the same as none
            db.execute("DELETE FROM buckets WHERE key = ? AND kind = ?", (key_id, kind))
        else:
            db.execute("INSERT OR REPLACE INTO buckets VALUES (?, ?, ?, ?, ?)", (key_id, kind, b.capacity, b.level, b.at))

    def _release(self, db: sqlite3.Connection, now: float, key_id: str, tpm: int | None, correction: int, slot: int | None) -> None:
        if tpm is not None and correction:
            row = db.execute("SELECT cap, level, at FROM buckets WHERE key = ? AND kind = 'tpm'", (key_id,)).fetchone()
            if row is None or row[0] == tpm:  # else the key's tpm changed since the admission: the
                # bucket is the new limit's, the correction the old one's (a MemoryLimiter grant
                # corrects the old state it holds, which no admission reads any more)
                b = Bucket(tpm, now)
                if row is not None:
                    b.level, b.at = row[1], row[2]
                b.refill(now)
                b.level = min(b.capacity, b.level + correction)
                self._save(db, key_id, "tpm", b)
                st = self.view._states.get(key_id)
                if st is not None and st.tokens is not None and st.tokens.capacity == tpm:
                    st.tokens.level, st.tokens.at = b.level, b.at
        if slot is not None:
            db.execute("DELETE FROM slots WHERE id = ? AND pid = ? AND started = ?", (slot, self.pid, self.started))

    def _inflight(self, db: sqlite3.Connection, key_id: str, limit: int) -> int:
        """The key's slots; at ``limit`` or more, after deleting those whose process is gone."""
        n: int = db.execute("SELECT count(*) FROM slots WHERE key = ?", (key_id,)).fetchone()[0]
        if n >= limit:
            for pid, start in db.execute("SELECT DISTINCT pid, started FROM slots WHERE key = ?", (key_id,)).fetchall():
                if (pid, start) != (self.pid, self.started) and started(pid) != start:  # gone, or its pid reused
                    n -= db.execute("DELETE FROM slots WHERE pid = ? AND started = ?", (pid, start)).rowcount
                    log.info("freed the rate-limit slots of process %d, which is gone", pid)
        return n

    # -- the Limiter interface ----------------------------------------------------------------------

    def take_request(self, key_id: str, limits: Limits) -> Awaitable[None] | None:
        if limits.rpm is None:
            return None
        return self._call(self._take, key_id, limits)

    def _take(self, db: sqlite3.Connection, now: float, key_id: str, limits: Limits) -> None:
        b = self.view._state(key_id, limits, now).requests
        assert b is not None
        self._load(db, key_id, "rpm", b, now)
        self.view.take_request(key_id, limits)  # raises RequestsLimited
        self._save(db, key_id, "rpm", b)

    def admit(self, key_id: str, limits: Limits, tokens: int) -> Grant | Awaitable[Grant]:
        return self._call(self._admit, key_id, limits, tokens)

    def _admit(self, db: sqlite3.Connection, now: float, key_id: str, limits: Limits, tokens: int) -> Grant:
        st = self.view._state(key_id, limits, now)
        if st.tokens is not None:
            self._load(db, key_id, "tpm", st.tokens, now)
        if limits.max_concurrent is not None:
            st.inflight = self._inflight(db, key_id, limits.max_concurrent)
        try:
            self.view.admit(key_id, limits, tokens)  # raises RequestsLimited, TokensLimited
        finally:
            st.inflight = 0  # the count is the file's (and a view without one may be dropped)
        if st.tokens is not None:
            self._save(db, key_id, "tpm", st.tokens)
        slot = None
        if limits.max_concurrent is not None:
            slot = db.execute(
                "INSERT INTO slots (key, pid, started) VALUES (?, ?, ?)", (key_id, self.pid, self.started)
            ).lastrowid
        return SQLiteGrant(self, key_id, limits.tpm, tokens if limits.tpm is not None else 0, slot)

    def headers(self, key_id: str, limits: Limits) -> list[tuple[bytes, bytes]]:
        return self.view.headers(key_id, limits)

    # -- releases ---------------------------------------------------------------------------------

    def release(self, grant: SQLiteGrant, correction: int) -> None:
        """Correct the reservation and free the slot: now, or as soon as the file lets us."""
        if grant.slot is None and (grant.tpm is None or not correction):
            return
        self.releases.append((grant.key_id, grant.tpm, correction, grant.slot))
        if len(self.releases) > MAX_RELEASES:
            self.releases.popleft()
            self._failed(f"{MAX_RELEASES} finished responses waiting: the oldest dropped, its slot held until this process ends")
        try:
            self._attempt(_nothing)
        except (_Locked, errors.StoreUnavailable):
            self._flush_later()
        except Exception:  # never into the response's path
            log.exception("rate limits: releasing a grant failed")

    def _flush_later(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: the next transaction applies them
            return
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush(), name="hotloop-limits-release")

    async def _flush(self) -> None:
        while self.releases and self._db is not None:
            try:
                await self._retry(_nothing)
            except errors.StoreUnavailable:
                await asyncio.sleep(1.0)

    async def aclose(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        if self.releases:
            with contextlib.suppress(_Locked, errors.StoreUnavailable):
                self._attempt(_nothing)  # one last try; what is left the parent frees at the reap
        db, self._db = self._db, None
        if db is not None:
            db.close()


def _nothing(db: sqlite3.Connection, now: float) -> None:
    """An operation of its own: a transaction that applies the releases waiting."""
