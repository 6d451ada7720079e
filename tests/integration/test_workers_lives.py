"""``hotloop serve --workers N``: the supervisor and its workers' lives (real processes on
127.0.0.1)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx

from tests.conftest import free_port, run_server
from tests.integration.test_scaleout import poll, serving_pids
from tests.integration.test_workers_restart_backoff import _at


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=10).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _reaped(pids: list[int]) -> Iterator[None]:
    """Kill (by pid) whatever of ``pids`` a failing test leaves behind."""
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_workers_do_not_outlive_a_killed_supervisor(tmp_path: Path) -> None:
    """SIGKILL of the parent (OOM killer, ``kill -9``): its workers must not go on serving the port
    as orphans (nobody restarts or stops them, and a new server on the port would share it)."""
    with run_server(tmp_path, "--workers", "2", "--sim-rate", "0") as s:
        workers = _children(s.proc.pid)
        assert len(workers) == 2, workers
        with _reaped(workers):
            s.proc.kill()
            s.proc.wait(timeout=10)
            deadline = time.monotonic() + 15
            while any(_alive(w) for w in workers) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(_alive(w) for w in workers), "workers still running after their supervisor was killed"


def test_a_workers_server_refuses_a_port_another_server_listens_on(tmp_path: Path) -> None:
    """A single server refuses a busy port (exit 3); ``--workers`` must too, instead of joining the
    other server's SO_REUSEPORT group and splitting its traffic with an unrelated server."""
    with run_server(tmp_path, "--workers", "2", "--sim-rate", "0") as s:
        env = dict(os.environ, HOTLOOP_DATA_DIR=str(tmp_path / "other"))
        cmd = [sys.executable, "-m", "hotloop", "serve", "--host", "127.0.0.1", "--port", str(s.port), "--workers", "2"]
        second = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            code = second.wait(timeout=20)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if second.poll() is None:
                second.terminate()
                try:
                    second.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    second.kill()
                    second.wait(timeout=10)
        assert code == 3, "a second --workers server started on a port already in use"


def test_sigterm_while_the_workers_are_forked_stops_every_worker_promptly(tmp_path: Path) -> None:
    """SIGTERM that reaches the parent while it is still forking its workers (a stop right after a
    start): every worker must be told to stop, none left running until ``kill_after`` kills it."""
    port = free_port()
    log = tmp_path / "server.log"
    env = dict(os.environ, HOTLOOP_DATA_DIR=str(tmp_path / "data"))
    cmd = [sys.executable, "-m", "hotloop", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "16", "--sim-rate", "0", "--shutdown-grace", "1"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while b"started worker" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.0005)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            code = proc.wait(timeout=25)  # kill_after(1) is 43 s
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            workers = _children(proc.pid)
            proc.kill()
            proc.wait(timeout=10)
            for w in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert code == 0 and took < 20, f"exit {code} after {took:.1f} s"
    assert "did not stop in time" not in text


def test_new_connections_are_refused_while_workers_finish_their_responses(tmp_path: Path) -> None:
    """README, Shutdown: on SIGTERM the server stops accepting connections (a single server refuses
    them at once). With --workers the parent keeps its listening sockets open during the grace: a new
    connection is accepted by the kernel and then hangs, unanswered, until the workers are done."""
    slow = ("--workers", "2", "--sim-rate", "10", "--sim-output-tokens", "60", "--shutdown-grace", "20")
    with run_server(tmp_path, *slow) as s:

        def stream() -> None:
            body = {"model": "hotloop-sim", "input": "hi", "stream": True}
            with contextlib.suppress(httpx.HTTPError):
                with httpx.stream("POST", s.v1 + "/responses", json=body, timeout=30) as r:
                    for _ in r.iter_lines():
                        pass

        streams = [threading.Thread(target=stream) for _ in range(4)]  # both workers, ~6 s each
        for t in streams:
            t.start()
        time.sleep(1.0)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        outcomes = []
        for _ in range(4):
            try:
                outcomes.append(httpx.get(s.base + "/healthz", timeout=2).status_code)
            except httpx.ConnectError:
                outcomes.append("refused")
            except httpx.HTTPError as exc:
                outcomes.append(type(exc).__name__)
        for t in streams:
            t.join(timeout=30)
        assert s.proc.wait(timeout=60) == 0
    assert outcomes == ["refused"] * 4, outcomes


def _wakeups(pid: int) -> int:
    """How often ``pid`` (single-threaded) went to sleep and woke since it started."""
    with open(f"/proc/{pid}/status") as fh:
        return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)$", fh.read(), re.M).group(1))  # type: ignore[union-attr]


def test_the_supervisor_sleeps_while_idle_and_sees_a_death_at_once(tmp_path: Path) -> None:
    """An idle supervisor wakes about once a second (it polled every 50 ms: 30 wake-ups in 1.5 s
    of a server doing nothing), yet handles a worker's death at once (SIGCHLD ends its wait), not
    up to a poll later: until it does, the dead worker's socket still gets its share of new
    connections, and they are reset when it is closed. Both workers are killed, the second 0.6 s
    after the first's death was handled (past the replacement's 0.5 s delay, which wakes the
    supervisor too): each death is logged within 0.25 s of its kill (a 1 s poll would miss that)."""
    with run_server(tmp_path, "--workers", "2", "--sim-rate", "0") as s:
        workers = poll(lambda: p if len(p := serving_pids(s, 16, 2.0)) == 2 else None, "both workers")
        time.sleep(0.2)
        before = _wakeups(s.proc.pid)
        time.sleep(1.5)
        woke = _wakeups(s.proc.pid) - before
        late = []
        for pid in sorted(workers):
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            line = poll(lambda: re.search(rf"^(\S+ \S+) \w+ hotloop\.server: worker {pid} exited", s.logs(), re.M), "the death's line")
            late.append(round(_at(line.group(1)) - killed, 3))
            time.sleep(0.6)
    assert woke <= 5, f"the idle supervisor woke {woke} times in 1.5 s"
    assert all(t < 0.25 for t in late), late
