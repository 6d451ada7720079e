"""The benchmarks' CPU clock for a server process: per thread, to the nanosecond."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from hotloop.bench import _proc_cpu_seconds, process_cpu_ns, process_switches, thread_cpu_ns


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


def test_process_switches_counts_each_time_the_process_slept() -> None:
    """40 sleeps of 1 ms in a one-thread child process are 40 switches or more (each one goes
    idle and wakes); a process that does not exist is charged none. (A child: the count is the
    live threads', and threads of this process may end while it measures.)"""
    code = (
        "import sys, time\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
        "for _ in range(40): time.sleep(0.001)\n"
        "print('done', flush=True); sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "ready\n"
        before = process_switches(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        assert process_switches(child.pid) - before >= 40
    finally:
        child.kill()
        child.wait(10)
    assert process_switches(child.pid) == 0  # gone


def test_thread_cpu_is_the_main_threads_alone() -> None:
    """12 ms burnt in another thread count in the process's CPU, not in its main thread's; 3 ms
    burnt in the main thread count in both; a thread named by its id is measured alone."""
    pid = os.getpid()
    proc0, main0 = process_cpu_ns(pid), thread_cpu_ns(pid)
    worker = threading.Thread(target=_burn, args=(0.012,))
    worker.start()
    worker.join()
    proc1, main1 = process_cpu_ns(pid), thread_cpu_ns(pid)
    assert proc1 - proc0 >= 12_000_000
    # (starting and joining the thread, and reading /proc: well under the other thread's 12 ms,
    # with room for a loaded machine, where 1.5 ms was once exceeded)
    assert main1 - main0 < 6_000_000
    _burn(0.003)
    assert thread_cpu_ns(pid) - main1 >= 3_000_000
    spent: list[int] = []

    def measured() -> None:
        tid = threading.get_native_id()
        t0 = thread_cpu_ns(pid, tid)
        _burn(0.002)
        spent.append(thread_cpu_ns(pid, tid) - t0)

    t = threading.Thread(target=measured)
    t.start()
    t.join()
    assert 2_000_000 <= spent[0] < 6_000_000


def test_thread_cpu_of_another_process() -> None:
    """Another process's main thread (read from /proc: a process may read only its own threads'
    CPU clocks): its 30 ms of CPU count, to well under a clock tick (10 ms) above that."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nend = time.thread_time() + 0.03\nwhile time.thread_time() < end: pass\n"
         "print(time.thread_time_ns(), flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        own = int(child.stdout.readline())  # the child's own reading, after its burn
        seen = thread_cpu_ns(child.pid)
        assert own <= seen < own + 5_000_000
        assert seen >= 30_000_000
    finally:
        child.kill()
        child.wait(10)
