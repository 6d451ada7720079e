"""The benchmarks' CPU clock for a server process: per thread, to the nanosecond."""

from __future__ import annotations

import os
import threading
import time

from hotloop.bench import _proc_cpu_seconds, process_cpu_ns, process_switches


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_process_cpu_counts_every_thread_finer_than_a_clock_tick() -> None:
    """3 ms of CPU burnt in another thread shows as at least that much and well under a clock
    tick more (ticks of /proc/<pid>/stat would give 0 or 10 ms)."""
    pid = os.getpid()
    before = process_cpu_ns(pid)
    seconds = _proc_cpu_seconds(pid)
    worker = threading.Thread(target=_burn, args=(0.003,))
    worker.start()
    worker.join()
    spent = process_cpu_ns(pid) - before
    assert 3_000_000 <= spent < 9_000_000
    assert 0.003 <= _proc_cpu_seconds(pid) - seconds < 0.05


def test_process_switches_counts_each_time_a_thread_of_the_process_slept() -> None:
    """40 sleeps of 1 ms in another thread are 40 switches or more (each one goes idle and
    wakes), counted while the thread lives; a process without them is not charged with any."""
    pid = os.getpid()
    counted: list[int] = []

    def sleeper() -> None:
        for _ in range(40):
            time.sleep(0.001)
        counted.append(process_switches(pid))  # before the thread ends: the count is the live threads'

    before = process_switches(pid)
    worker = threading.Thread(target=sleeper)
    worker.start()
    worker.join()
    assert counted[0] - before >= 40
    assert process_switches(2**22 + 12345) == 0  # no such process
