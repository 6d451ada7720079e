"""A server's store shutdown keeps to its one bound, ``CLOSE_FLUSH_SECONDS``, all of it: the write
queue's flush, the store's own close and the key store's (last uses, its close, the limiter's),
so a ``--workers`` worker is not killed in the middle of it (``kill_after`` gives it that bound,
then ``KILL_MARGIN`` for the rest). Each close cut short is one log line, and its thread is left
to the process's exit (``stuck``: ``serve`` does not join it). Real processes on 127.0.0.1: a
``redis-server`` stopped with SIGSTOP (it accepts, and never answers), another process holding
the SQLite file's write lock."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hotloop.config import Config
from hotloop.pipeline import post
from hotloop.pipeline.post import Persistence
from hotloop.server.runner import make_app
from hotloop.state.store import SQLiteStore
from tests.integration.test_shared_close_bound import _locked_by_another_process, _store_threads_done
from tests.services import redis_server
from tests.unit.test_persistence import _entry


def _error_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _threads_done(prefix: str, wait: float) -> None:
    deadline = time.monotonic() + wait
    while any(t.name.startswith(prefix) for t in threading.enumerate()):
        assert time.monotonic() < deadline, f"{prefix} threads still running"
        time.sleep(0.02)


def test_the_key_store_s_close_is_within_the_shutdown_bound_when_redis_stops_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """--store redis, and Redis stops answering as the server stops: the record of the keys' last
    use waits on it. Before, the key store's close came after the store's bound, unbounded (here
    redis-py's 5 s socket timeout), on ``KILL_MARGIN``'s time; now the app's whole shutdown
    returns within the bound, with one line naming what it gave up on."""
    timeout = 1.0
    monkeypatch.setattr(post, "CLOSE_FLUSH_SECONDS", timeout)
    caplog.set_level(logging.WARNING)
    with redis_server(tmp_path) as redis:
        app = make_app(Config(store="redis", redis_url=redis.url, sim_rate=0))
        _, secret = app.tenancy.keys.create("alice")

        async def main() -> float:
            scope = {"headers": [(b"authorization", b"Bearer " + secret.encode())]}
            assert (await app.tenancy.authenticate(scope)).name == "alice"  # a last use to record at close
            assert redis.proc is not None
            os.kill(redis.proc.pid, signal.SIGSTOP)
            try:
                caplog.clear()
                start = time.monotonic()
                await asyncio.wait_for(app.shutdown(), 30)
                return time.monotonic() - start
            finally:
                os.kill(redis.proc.pid, signal.SIGCONT)  # the touch left behind gets its answer

        took = asyncio.run(main())
        _threads_done("hotloop-keys", 10)
    assert took < timeout + 0.5, f"shutdown took {took:.1f} s with a bound of {timeout:g} s"
    assert app.stuck  # the thread left inside the key store is not joined
    lines = _error_lines(caplog)
    assert len(lines) == 1 and "key store" in lines[0], lines


def test_the_store_s_close_is_within_the_flush_bound_behind_a_delete_held_by_another_process_lock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A single server on SQLite stops while a DELETE waits on the file's write lock (another
    process holds it): the store's close waits behind it on the store's thread. Before, the flush
    was bounded and the close was not (until SQLite's 5 s busy timeout gave the DELETE up); now
    close() returns within its timeout, with one line, and leaves the thread to the exit."""
    path = tmp_path / "single.sqlite3"
    store = SQLiteStore(path)
    timeout = 1.0
    caplog.set_level(logging.WARNING, logger="hotloop.post")

    async def main() -> tuple[float, bool]:
        p = Persistence(store)
        p.start()
        await p.submit(_entry("resp_kept"))
        await p.flush()
        with _locked_by_another_process(path):
            deleting = asyncio.ensure_future(p.delete("resp_kept"))  # its store call waits for the lock
            await asyncio.sleep(0.3)
            caplog.clear()
            start = time.monotonic()
            await asyncio.wait_for(p.close(timeout=timeout), 30)
            took = time.monotonic() - start
            deleting.cancel()  # the request the server would have cancelled
        return took, p.stuck

    try:
        took, stuck = asyncio.run(main())
    finally:
        _store_threads_done(15)
    assert took < timeout + 0.5, f"close(timeout={timeout:g}) took {took:.1f} s"
    assert stuck  # the server exits without joining the store's thread
    lines = _error_lines(caplog)
    assert len(lines) == 1 and "closing the store" in lines[0], lines


def test_a_store_flush_that_used_the_bound_leaves_the_key_store_its_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The response store's flush cut short at the bound: the key store's close (healthy SQLite,
    a millisecond) still runs, within ``KEYS_CLOSE_FLOOR``, instead of being given up on at once,
    blamed in the log, and the process sent to ``os._exit``."""
    monkeypatch.setattr(post, "CLOSE_FLUSH_SECONDS", 0.5)
    caplog.set_level(logging.WARNING)
    app = make_app(Config(store="sqlite", data_dir=str(tmp_path), sim_rate=0))

    async def used_the_bound(timeout: float = 0.5) -> None:  # a flush cut short at its timeout
        await asyncio.sleep(timeout)

    async def main() -> None:
        await app.startup()
        monkeypatch.setattr(app.persistence, "close", used_the_bound)
        await app.shutdown()

    asyncio.run(main())
    assert not app.stuck
    assert not [line for line in _error_lines(caplog) if "key store" in line]
