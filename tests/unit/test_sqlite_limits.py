"""Per-key limits shared through a SQLite file (``--workers`` on SQLite): two limiters on one
file stand for two workers; the clock is injected (no sleeps) except where the busy bound is."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from hotloop import errors
from hotloop.protocol import events as ev
from hotloop.tenants import sqlite_limits
from hotloop.tenants.keys import Limits
from hotloop.tenants.limits import Grant, LimitExceeded, MemoryLimiter, RequestsLimited, TokensLimited
from hotloop.tenants.sqlite_limits import SQLiteLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = sqlite_limits.limits_path(tmp_path / "hotloop.sqlite3")
    sqlite_limits.create(p)
    return p


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pair(path: Path, clock: Clock) -> Iterator[tuple[SQLiteLimiter, SQLiteLimiter]]:
    a, b = SQLiteLimiter(path, clock=clock), SQLiteLimiter(path, clock=clock)
    yield a, b
    for lim in (a, b):
        asyncio.run(lim.aclose())


def hdrs(lim: Any, key: str, limits: Limits) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in lim.headers(key, limits)}


def rows(path: Path, table: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as db:
        return db.execute(f"SELECT * FROM {table}").fetchall()


def admit(lim: SQLiteLimiter, key: str, limits: Limits, tokens: int) -> Grant:
    g = lim.admit(key, limits, tokens)
    assert isinstance(g, Grant), "answered off the event loop without a lock held"
    return g


def test_the_file_is_beside_the_store_and_starts_empty(tmp_path: Path) -> None:
    p = sqlite_limits.limits_path(tmp_path / "hotloop.sqlite3")
    assert p == tmp_path / "hotloop-limits.sqlite3"
    sqlite_limits.create(p)
    with sqlite3.connect(p) as db:
        db.execute("INSERT INTO buckets VALUES ('k', 'rpm', 3, 0.0, 1.0)")
    sqlite_limits.create(p)  # a restarted server: full buckets
    assert rows(p, "buckets") == []
    with sqlite3.connect(p) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    sqlite_limits.remove(p)
    assert not any(tmp_path.glob("hotloop-limits*"))


def test_the_file_and_its_companions_are_private_in_a_shared_directory(tmp_path: Path) -> None:
    """Its keys' ids and bucket levels are each tenant's activity: 0600 as the store file, in a
    data directory other users may list (0755)."""
    import os
    import stat

    tmp_path.chmod(0o755)
    p = sqlite_limits.limits_path(tmp_path / "hotloop.sqlite3")
    old = os.umask(0o022)
    try:
        sqlite_limits.create(p)
        with sqlite3.connect(p) as db:
            db.execute("INSERT INTO buckets VALUES ('k', 'rpm', 3, 0.0, 1.0)")
        made = sorted(tmp_path.glob("hotloop-limits*"))
        assert {f.name for f in made} >= {"hotloop-limits.sqlite3", "hotloop-limits.sqlite3-lock"}
        for f in made:
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    finally:
        os.umask(old)
        sqlite_limits.remove(p)


def test_requests_per_minute_are_shared(pair: tuple[SQLiteLimiter, SQLiteLimiter], clock: Clock) -> None:
    a, b = pair
    limits = Limits(rpm=3)
    assert a.take_request("k", limits) is None
    assert b.take_request("k", limits) is None
    assert a.take_request("k", limits) is None
    with pytest.raises(RequestsLimited) as ei:
        b.take_request("k", limits)
    err = ei.value
    assert (err.status, err.type, err.code) == (429, "requests", "rate_limit_exceeded")
    assert err.message == (
        "Rate limit reached on requests per min (RPM): Limit 3, Used 3, Requested 1. Please try again in 20s."
    )
    assert err.headers["retry-after"] == "20" and err.headers["retry-after-ms"] == "20000"
    # each process renders what its last transaction saw, refilled since
    assert hdrs(b, "k", limits) == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m0s",
    }
    clock.t += 20  # one request's worth, for either process
    assert b.take_request("k", limits) is None
    with pytest.raises(RequestsLimited):
        a.take_request("k", limits)
    assert a.take_request("other", limits) is None  # keys do not share buckets
    assert a.take_request("k", Limits()) is None  # no rpm: nothing taken


def test_tokens_are_reserved_and_corrected_across_processes(pair: tuple[SQLiteLimiter, SQLiteLimiter], clock: Clock) -> None:
    a, b = pair
    limits = Limits(tpm=600)  # 10 tokens a second
    g = admit(a, "k", limits, 500)
    assert hdrs(a, "k", limits)["x-ratelimit-remaining-tokens"] == "100"
    with pytest.raises(TokensLimited) as ei:
        b.admit("k", limits, 200)
    assert ei.value.message == (
        "Rate limit reached on tokens per min (TPM): Limit 600, Used 500, Requested 200. Please try again in 10s."
    )
    assert ei.value.headers["retry-after"] == "10"
    g.finish(100)  # used 100 of the 500 reserved: 400 back
    g.finish(0)  # idempotent
    g2 = admit(b, "k", limits, 400)
    assert hdrs(b, "k", limits)["x-ratelimit-remaining-tokens"] == "100"
    g2.finish(1000)  # used more than reserved: the bucket goes below zero
    with pytest.raises(TokensLimited) as ei:
        a.admit("k", limits, 10)
    assert "Used 600" in ei.value.message and "Please try again in 51s" in ei.value.message  # from -500
    clock.t += 51
    admit(a, "k", limits, 10).finish(10)


def test_too_large_is_memorys_answer(pair: tuple[SQLiteLimiter, SQLiteLimiter], path: Path) -> None:
    a, _ = pair
    with pytest.raises(TokensLimited) as ei:
        a.admit("k", Limits(tpm=100), 101)
    want = MemoryLimiter().admit
    with pytest.raises(TokensLimited) as mi:
        want("k", Limits(tpm=100), 101)
    assert (ei.value.message, ei.value.headers) == (mi.value.message, mi.value.headers)
    assert ei.value.headers == {"x-should-retry": "false"}
    assert rows(path, "buckets") == []


def test_concurrency_slots_are_shared(pair: tuple[SQLiteLimiter, SQLiteLimiter], path: Path) -> None:
    a, b = pair
    limits = Limits(max_concurrent=2)
    g1 = admit(a, "k", limits, 10)
    g2 = admit(b, "k", limits, 10)
    with pytest.raises(RequestsLimited) as ei:
        a.admit("k", limits, 10)
    assert ei.value.message == (
        "Too many concurrent requests: Limit 2. Please try again once a response in progress has finished."
    )
    assert ei.value.headers["retry-after"] == "1"
    g1.finish(5)
    g1.finish(5)  # idempotent: frees one slot, not two
    g3 = admit(b, "k", limits, 10)
    with pytest.raises(RequestsLimited):
        b.admit("k", limits, 10)
    g2.finish()
    g3.finish()
    assert rows(path, "slots") == []


def test_the_same_answers_as_the_memory_limiter(path: Path, clock: Clock) -> None:
    """One script, both limiters: the same admissions, refusals, messages and headers."""
    limits = Limits(rpm=4, tpm=1000, max_concurrent=2)
    lims: list[Any] = [MemoryLimiter(clock=clock), SQLiteLimiter(path, clock=clock)]
    out: list[list[Any]] = [[], []]
    t0 = clock.t
    for i, lim in enumerate(lims):
        clock.t = t0
        grants: list[Grant] = []
        for step in range(12):
            clock.t += 3.5
            try:
                lim.take_request("k", limits)
                g = lim.admit("k", limits, 150 + 40 * step)
                assert isinstance(g, Grant)
                grants.append(g)
                out[i].append("ok")
            except LimitExceeded as exc:
                out[i].append((exc.message, exc.headers))
            if step % 3 == 2 and grants:
                grants.pop(0).finish(100)
            out[i].append(hdrs(lim, "k", limits))
    asyncio.run(lims[1].aclose())
    assert out[0] == out[1]
    assert "ok" in out[0] and any(isinstance(o, tuple) for o in out[0])


def _forked_holder(path: Path, limits: Limits) -> int:
    """A child process that takes a slot and dies without finishing (as SIGKILL would leave it)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            g = SQLiteLimiter(path).admit("k", limits, 1)
            code = 0 if isinstance(g, Grant) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return pid


def test_a_dead_workers_slot_is_freed_at_the_limit(pair: tuple[SQLiteLimiter, SQLiteLimiter], path: Path) -> None:
    a, _ = pair
    limits = Limits(max_concurrent=1)
    dead = _forked_holder(path, limits)
    assert [r[2] for r in rows(path, "slots")] == [dead]
    g = admit(a, "k", limits, 1)  # at the limit: the dead holder's slot is swept
    assert [r[2] for r in rows(path, "slots")] == [os.getpid()]
    g.finish()


def test_the_parent_frees_a_reaped_workers_slots(path: Path) -> None:
    limits = Limits(max_concurrent=5)
    dead = _forked_holder(path, limits)
    assert sqlite_limits.free_slots(path, dead) == 1
    assert rows(path, "slots") == []
    assert sqlite_limits.free_slots(path.with_name("absent.sqlite3"), dead) == 0


def test_a_live_holders_slot_is_kept_and_a_reused_pid_is_not_its_holder(pair: tuple[SQLiteLimiter, SQLiteLimiter], path: Path) -> None:
    a, _ = pair
    limits = Limits(max_concurrent=1)
    live = subprocess.Popen(["sleep", "30"])
    try:
        start = sqlite_limits.started(live.pid)
        assert start is not None
        with sqlite3.connect(path) as db:
            db.execute("INSERT INTO slots (key, pid, started) VALUES ('k', ?, ?)", (live.pid, start))
        with pytest.raises(RequestsLimited):  # its holder lives: the slot stays taken
            a.admit("k", limits, 1)
        with sqlite3.connect(path) as db:  # the same pid, another process (another start time)
            db.execute("UPDATE slots SET started = started - 1")
        admit(a, "k", limits, 1).finish()
    finally:
        live.kill()
        live.wait(timeout=10)


def test_a_busy_file_answers_503_within_the_bound(pair: tuple[SQLiteLimiter, SQLiteLimiter], path: Path) -> None:
    a, b = pair
    limits = Limits(rpm=100, max_concurrent=5)
    g = admit(b, "k", limits, 1)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another connection keeps the write lock

    async def run() -> None:
        t0 = time.monotonic()
        pending = a.take_request("k", limits)
        assert inspect.isawaitable(pending)
        with pytest.raises(errors.StoreUnavailable) as ei:
            await pending
        took = time.monotonic() - t0
        assert sqlite_limits.BUSY_SECONDS <= took < sqlite_limits.BUSY_SECONDS + 0.5, took
        exc = ei.value
        assert (exc.status, exc.headers) == (503, {"retry-after": "1"})
        assert json.loads(ev.http_error_body(exc)) == {"error": {
            "message": "The rate-limit store is busy. Please retry shortly.", "type": "server_error",
            "param": None, "code": "server_error",
        }}
        g.finish()  # queued, never raised: written once the lock is free
        assert len(b.releases) == 1
        # the lock freed while a request waits: it is answered
        pending = a.admit("k", limits, 1)
        assert inspect.isawaitable(pending)
        asyncio.get_running_loop().call_later(0.05, holder.execute, "COMMIT")
        g2 = await pending
        assert isinstance(g2, Grant)
        await asyncio.sleep(0.1)  # the background retry writes the release
        assert not b.releases
        g2.finish()

    try:
        asyncio.run(run())
    finally:
        if holder.in_transaction:
            holder.execute("ROLLBACK")
        holder.close()
    assert rows(path, "slots") == []


def test_rows_are_bounded(pair: tuple[SQLiteLimiter, SQLiteLimiter], path: Path, clock: Clock) -> None:
    a, b = pair
    limits = Limits(rpm=60, tpm=600, max_concurrent=3)
    g = admit(a, "k", limits, 100)
    assert a.take_request("k", limits) is None
    assert sorted(r[1] for r in rows(path, "buckets")) == ["rpm", "tpm"] and len(rows(path, "slots")) == 1
    g.finish(0)  # the whole reservation back: the tokens bucket is full, so it is gone
    assert [r[1] for r in rows(path, "buckets")] == ["rpm"] and rows(path, "slots") == []
    clock.t += 1.0  # the requests bucket refilled: the next write of it deletes it
    assert b.take_request("k", limits) is None
    clock.t += 1.0
    admit(b, "k", limits, 1).finish(1)  # another key's bucket stays, below full
    assert b.take_request("k2", limits) is None
    clock.t += sqlite_limits.SWEEP_SECONDS + 1  # every process deletes what has refilled since
    assert a.take_request("k3", Limits(rpm=1000)) is None
    assert rows(path, "buckets") == [("k3", "rpm", 1000, 999.0, clock.t)]


def test_a_response_admitted_under_an_earlier_tpm_leaves_the_new_limits_bucket(pair: tuple[SQLiteLimiter, SQLiteLimiter], clock: Clock) -> None:
    """A key's tpm changed while a response admitted under the old one ran: its end corrects the
    old limit's bucket (MemoryLimiter's grant holds the old state), not the new limit's, which it
    must neither empty out (a correction given back) nor replace (one over its reservation)."""
    a, b = pair
    old, new = Limits(tpm=6000), Limits(tpm=600)
    mem = MemoryLimiter(clock=clock)
    for used in (0, 3000):
        for lim, other in ((mem, mem), (a, b)):
            g = lim.admit("k", old, 1000)
            assert isinstance(g, Grant)
            assert isinstance(other.admit("k", new, 500), Grant)  # the new limit: 100 left
            g.finish(used)
            with pytest.raises(TokensLimited):
                other.admit("k", new, 200)
        clock.t += 120  # every bucket full again


_SECOND_SERVER = """
import asyncio, sys
from pathlib import Path
from hotloop.tenants import sqlite_limits
from hotloop.tenants.keys import Limits
from hotloop.tenants.limits import LimitExceeded
p = Path(sys.argv[1])
sqlite_limits.create(p)  # a second --workers server's parent, on the same data directory
lim = sqlite_limits.SQLiteLimiter(p)  # its worker
try:
    lim.take_request("k", Limits(rpm=2))
    print("ok")
except LimitExceeded:
    print("refused")
asyncio.run(lim.aclose())
sqlite_limits.remove(p)  # it exits first
"""


def test_a_second_server_on_the_data_directory_neither_wipes_nor_removes_the_limits_file(path: Path) -> None:
    """The parent of a running server made ``path`` (the fixture); another server starting and
    stopping on the same data directory must not empty the file under the first one's workers
    nor delete it (its workers would go on alone, on an unlinked file, and its replacements on a
    new one): the key's limit holds across both servers."""
    a = SQLiteLimiter(path)
    try:
        limits = Limits(rpm=2)
        assert a.take_request("k", limits) is None
        out = subprocess.run(
            [os.sys.executable, "-c", _SECOND_SERVER, str(path)], capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["ok"]  # the second of the key's 2 requests
        assert path.exists(), "the first server's limits file was removed by the second server"
        with pytest.raises(RequestsLimited):
            a.take_request("k", limits)
    finally:
        asyncio.run(a.aclose())
    sqlite_limits.remove(path)  # the first server exits: now it goes
    assert not any(path.parent.glob("hotloop-limits*"))


def test_a_failing_file_answers_503_with_retry_after(tmp_path: Path) -> None:
    """A SQLite failure other than a lock (a disk full, an I/O error, a file gone bad) is a 503
    at once, paced like the busy file's (``retry-after: 1``), with nothing internal in it."""
    path = tmp_path / "limits.sqlite3"
    sqlite_limits.create(path)
    lim = SQLiteLimiter(path)
    try:
        db = lim._db
        assert db is not None
        db.execute("DROP TABLE buckets")  # the file gone bad under the limiter
        with pytest.raises(errors.StoreUnavailable) as ei:
            lim.take_request("k", Limits(rpm=10))
        exc = ei.value
        assert (exc.status, exc.headers) == (503, {"retry-after": "1"})
        assert json.loads(ev.http_error_body(exc))["error"]["message"] == "The rate-limit store is unavailable. Please retry shortly."
    finally:
        asyncio.run(lim.aclose())
        sqlite_limits.remove(path)

