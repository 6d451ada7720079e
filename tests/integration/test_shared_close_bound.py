"""``SharedPersistence.close`` (``--workers`` on SQLite, ``--store redis``) keeps to its one bound
when the shared file is locked by another process (another worker's long write, ``hotloop keys``,
a backup): a worker's whole store shutdown fits in what ``kill_after`` gives it, instead of one
wait per step (up to twice the bound), so the supervisor does not SIGKILL it mid-flush."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from hotloop.pipeline.shared import SharedPersistence
from hotloop.state.store import SQLiteStore
from tests.unit.test_persistence import _entry

# Another process takes the file's write lock and holds it until its stdin closes.
_LOCKER = (
    "import sqlite3, sys\n"
    "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "db.execute('BEGIN IMMEDIATE')\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)


@contextlib.contextmanager
def _locked_by_another_process(path: Path) -> Iterator[None]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOCKER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the lock goes with the process
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _store_threads_done(wait: float) -> None:
    """Wait (at most ``wait`` seconds) for the threads close() left inside the store."""
    deadline = time.monotonic() + wait
    while any(t.name.startswith("hotloop-store") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "store threads still running"
        time.sleep(0.05)


def test_close_keeps_to_its_timeout_with_a_delete_and_a_write_held_by_another_process_lock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A DELETE's store write and a queued response both wait on the lock when the worker stops.
    Before, close() first waited for the DELETE's thread (until SQLite's 5 s busy timeout gave up),
    then gave the write queue its whole ``timeout`` again: about 6 s for ``timeout=1``."""
    path = tmp_path / "shared.sqlite3"
    store = SQLiteStore(path)
    timeout = 1.0
    caplog.set_level(logging.WARNING, logger="hotloop.post")

    async def main() -> float:
        p = SharedPersistence(store)
        p.start()  # a shared file: the deletions poller too
        await p.submit(_entry("resp_kept"))
        await p.flush()
        with _locked_by_another_process(path):
            deleting = asyncio.ensure_future(p.delete("resp_kept"))  # its store write waits for the lock
            await asyncio.sleep(0.3)
            await p.submit(_entry("resp_late"))  # queued behind it
            await asyncio.sleep(0.3)
            caplog.clear()
            start = time.monotonic()
            await asyncio.wait_for(p.close(timeout=timeout), 30)
            took = time.monotonic() - start
            deleting.cancel()  # the request the server would have cancelled
        assert p.stuck  # threads still inside the store: the server exits without joining them
        return took

    try:
        took = asyncio.run(main())
    finally:
        _store_threads_done(15)
        store.close()
    assert took < timeout + 1.0, f"close(timeout={timeout:g}) took {took:.1f} s"
    lines = [r for r in caplog.records if r.name == "hotloop.post" and r.levelno >= logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is None
    message = lines[0].getMessage()
    assert "1 write(s) not stored" in message and "1 read(s) still running" in message, message
