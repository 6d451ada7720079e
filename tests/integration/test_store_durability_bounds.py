"""Persistence's documented bounds with a store that is slow, stuck or failing (real server
processes, and Persistence directly)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from hotloop.pipeline.post import Persistence
from hotloop.state.store import SQLiteStore
from tests.conftest import run_server
from tests.unit.test_persistence import _entry


def test_a_writer_stuck_on_a_locked_file_makes_finished_turns_wait(tmp_path: Path) -> None:
    """README, Crash safety: while the oldest queued write has waited ``--store-max-lag`` (0.2 s),
    finished turns wait for the writer, so SIGKILL loses only responses completed within about
    that long. Here another process holds the SQLite write lock (within the 5 s busy timeout):
    the writer is stuck, yet turns kept being answered at once (the lag is not checked below a
    batch of 64 queued writes), and SIGKILL 2.5 s later lost every one of them."""
    data = tmp_path / "data"
    with run_server(tmp_path, "--sim-rate", "0", env={"HOTLOOP_DATA_DIR": str(data)}) as s:
        lock = sqlite3.connect(data / "hotloop.sqlite3", isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # e.g. `hotloop keys ...`, a backup, another worker's long write
        seen: list[tuple[str, float]] = []
        try:
            with httpx.Client(timeout=10) as c:
                start = time.monotonic()
                while time.monotonic() - start < 2.5:
                    try:
                        r = c.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi", "store": True})
                    except httpx.ReadTimeout:  # held back by the writer: the bound at work
                        break
                    seen.append((r.json()["id"], time.monotonic()))
                    time.sleep(0.1)
            killed = time.monotonic()
            s.proc.kill()
            s.proc.wait(timeout=10)
            s.log.write_text("")  # a write that waited out the busy timeout logs its failure: expected
        finally:
            lock.execute("ROLLBACK")
            lock.close()
    store = SQLiteStore(data / "hotloop.sqlite3")
    try:
        lost = [round(killed - t, 2) for rid, t in seen if store.get_response(rid) is None]
    finally:
        store.close()
    old = [age for age in lost if age > 0.5]
    # the write in progress when the lock was taken and the batch queued behind it: "one write"
    assert len(old) <= 3, f"{len(old)} responses completed more than 0.5 s before the kill were lost: {old}"


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root only; skipped elsewhere), unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, timeout=10)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def _fill(mnt: Path) -> None:
    fh = open(mnt / "filler", "wb", buffering=0)  # noqa: SIM115
    with contextlib.suppress(OSError):
        while True:
            fh.write(b"x" * 4096)
    with contextlib.suppress(OSError):
        fh.close()


def test_store_sync_full_never_completes_a_response_whose_ledger_entry_was_not_written(full_disk: Path, tmp_path: Path) -> None:
    """README, Crash safety: ``--store-sync full`` writes the response *and its ledger entry* before
    the terminal event: nothing a client saw complete is lost from the ledger. On a full disk the
    ledger write of a ``store: false`` response fails, yet the client was told ``completed``."""
    data = full_disk / "data"
    with run_server(tmp_path, "--sim-rate", "0", "--store-sync", "full", env={"HOTLOOP_DATA_DIR": str(data)}) as s:
        _fill(full_disk)
        completed = 0
        with httpx.Client(timeout=20) as c:
            for _ in range(5):
                r = c.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": "y" * 20000, "store": False})
                completed += r.status_code == 200 and r.json().get("status") == "completed"
        os.remove(full_disk / "filler")
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0
        s.log.write_text("")  # the failed writes' log lines (store write failed) are expected here
    store = SQLiteStore(data / "hotloop.sqlite3")
    try:
        ledger = sum(int(row["responses"]) for row in store.usage())
    finally:
        store.close()
    assert ledger >= completed, f"{completed} responses completed under --store-sync full, {ledger} in the ledger"


class _HungStore(SQLiteStore):
    """A store whose writes hang (a stalled disk, an NFS mount gone away) until released."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.release = threading.Event()
        self.entered = threading.Event()

    def put(self, rec: Any) -> None:
        self.entered.set()
        self.release.wait(60)
        super().put(rec)


def test_close_returns_within_its_timeout_when_the_store_hangs(tmp_path: Path) -> None:
    """``Persistence.close``: "waiting at most ``timeout`` seconds: a store that hangs cannot hold
    the process forever". After the flush times out it still runs ``store.close`` on the writer's
    one thread, behind the hung write, and waits for it without a bound."""
    store = _HungStore(tmp_path / "h.sqlite3")

    async def main() -> float:
        p = Persistence(store)
        await p.submit(_entry("resp_hung"))
        await asyncio.to_thread(store.entered.wait, 10)
        t = time.monotonic()
        try:
            await asyncio.wait_for(p.close(timeout=0.5), 5)
        except TimeoutError:
            pass
        return time.monotonic() - t

    try:
        took = asyncio.run(main())
    finally:
        store.release.set()
    assert took < 3, f"close(timeout=0.5) had not returned after {took:.1f} s"
