"""``hotloop serve --workers N``: while a slot has no serving worker (it died and its replacement
waits out its delay, or is still starting, or keeps failing to start), new connections go to the
workers that serve instead of hanging on a socket nobody accepts on; while every slot is down, one
socket stays open, so the port stays the server's and clients wait instead of being refused; a
socket that cannot be bound again for a replacement is one log line and a retry. Real processes
on 127.0.0.1; a worker dies by SIGKILL (the test's, or its ``--classifier`` module's at import)."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx

from tests.conftest import Server, run_server
from tests.integration.test_scaleout import poll, serving_pids
from tests.integration.test_workers_lives import _children
from tests.integration.test_workers_restart_backoff import _classifier

PROBES = 20  # fresh connections, one after another
PROBE_TIMEOUT = 1.0  # a worker answers /healthz in a few ms; a connection nobody accepts hangs
PROMPT = 0.5  # an answer slower than this waited for a worker that was not there


def _probe_fresh_connections(s: Server, spacing: float = 0.1) -> list[object]:
    """``PROBES`` GET /healthz, each on a new connection (the kernel picks the socket), spread over
    about ``PROBES * spacing`` seconds: each status code, the code and the time it took when that
    was not ``PROMPT``, or the error it met. Stops after three of those (each can cost
    ``PROBE_TIMEOUT``)."""
    outcomes: list[object] = []
    for _ in range(PROBES):
        try:
            with httpx.Client(timeout=PROBE_TIMEOUT) as c:
                sent = time.monotonic()
                code = c.get(s.base + "/healthz").status_code
                took = time.monotonic() - sent
            outcomes.append(code if took < PROMPT else f"{code} after {took:.2f} s")
        except httpx.HTTPError as exc:
            outcomes.append(type(exc).__name__)
        if sum(o != 200 for o in outcomes) >= 3:
            break
        time.sleep(spacing)
    return outcomes


def _exited(s: Server, pid: int | None = None) -> int:
    """How many worker deaths (of ``pid``, or of any worker) the supervisor has logged."""
    who = r"\d+" if pid is None else str(pid)
    return len(re.findall(rf"worker {who} exited \(index \d", s.logs()))


def test_new_connections_reach_the_serving_worker_while_a_slot_keeps_failing(tmp_path: Path) -> None:
    """--workers 2, every worker after the first dies by SIGKILL while it starts: the failing slot
    backs off (0.5, 1, 2 s ...) and each replacement dies again about a second into its start.
    Meanwhile every new connection is answered at once by the worker that serves."""
    env = _classifier(tmp_path, "_ordinal() >= 1")
    args = ("--workers", "2", "--sim-rate", "0", "--classifier", "crashing:counting")
    with run_server(tmp_path, *args, env=env) as s:
        poll(lambda: _exited(s) >= 1, "the failing slot's first worker to die")
        outcomes = _probe_fresh_connections(s)  # about 2 s: over a replacement's start and death
        assert outcomes == [200] * PROBES, outcomes
        assert _exited(s) >= 2, s.logs()  # the slot kept failing while the connections were made
        assert s.proc.poll() is None


def test_new_connections_reach_the_other_worker_while_a_killed_one_is_replaced(tmp_path: Path) -> None:
    """--workers 2: a worker that served is killed; until its replacement serves (0.5 s, then its
    start-up) every new connection is answered at once by the other worker, then by both."""
    with run_server(tmp_path, "--workers", "2", "--sim-rate", "0") as s:
        victim, _ = poll(lambda: sorted(p) if len(p := serving_pids(s, 16, 2.0)) == 2 else None, "both workers")
        os.kill(victim, signal.SIGKILL)
        poll(lambda: _exited(s, victim), "the killed worker's death to be logged")
        outcomes = _probe_fresh_connections(s)
        assert outcomes == [200] * PROBES, outcomes
        poll(lambda: len(serving_pids(s, 8, PROBE_TIMEOUT) - {victim}) == 2, "the replacement to serve")
    assert s.proc.returncode == 0


def test_the_port_stays_the_server_s_while_every_slot_is_down(tmp_path: Path) -> None:
    """--workers 2: both workers are killed and their replacements fail while a switch file
    exists. Once a replacement has failed too, the port is still bound (another program cannot
    take it) and a new connection is accepted, to wait, not refused; once the switch file is gone
    the replacements start, and both serve."""
    down = tmp_path / "down"
    env = _classifier(tmp_path, f"os.path.exists({str(down)!r})")
    args = ("--workers", "2", "--sim-rate", "0", "--classifier", "crashing:counting")
    with run_server(tmp_path, *args, env=env) as s:
        workers = poll(lambda: w if len(w := _children(s.proc.pid)) == 2 else None, "two workers")
        down.touch()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        poll(lambda: all(_exited(s, pid) for pid in workers), "both deaths to be logged")
        poll(lambda: _exited(s) >= 3, "a replacement to fail too")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                other.bind(("127.0.0.1", s.port))
                taken: int | None = None
            except OSError as exc:
                taken = exc.errno
        assert taken == errno.EADDRINUSE, "the port was free while every worker was down"
        with socket.create_connection(("127.0.0.1", s.port), timeout=2.0):
            pass  # accepted by the kernel (queued): not ConnectionRefusedError
        assert s.proc.poll() is None
        down.unlink()
        poll(lambda: len(serving_pids(s, 8, PROBE_TIMEOUT)) == 2, "both replacements to serve", 12.0)
        outcomes = _probe_fresh_connections(s, 0.0)
        assert outcomes == [200] * PROBES, outcomes
    assert s.proc.returncode == 0


# The server, with the first bind of a replacement's socket failing as when another program holds
# the address (the two binds of the start succeed).
_FAILING_REBIND = """
import errno, sys
import hotloop.server.workers as w

bind, calls = w._bind, []

def bind_failing_once(host, port):
    calls.append(1)
    if len(calls) == 3:
        raise OSError(errno.EADDRINUSE, "Address already in use")
    return bind(host, port)

w._bind = bind_failing_once
from hotloop.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_replacement_socket_that_cannot_be_bound_is_logged_and_retried(tmp_path: Path) -> None:
    """The socket of a killed worker's slot cannot be bound again (EADDRINUSE): one log line, the
    supervisor goes on, the other worker serves, and the bind is retried after the slot's delay,
    after which the replacement serves."""
    with run_server(tmp_path, "--workers", "2", "--sim-rate", "0", entry=("-c", _FAILING_REBIND)) as s:
        victim, _ = poll(lambda: sorted(p) if len(p := serving_pids(s, 16, 2.0)) == 2 else None, "both workers")
        os.kill(victim, signal.SIGKILL)
        failed = r"(?m)^.* ERROR hotloop\.server: could not bind 127\.0\.0\.1:\d+ again for index (\d) \(OSError: .*Address already in use\); trying again in (\S+) s$"
        line = poll(lambda: re.search(failed, s.logs()), "the failed bind to be logged")
        outcomes = _probe_fresh_connections(s, 0.0)
        assert outcomes == [200] * PROBES, outcomes
        poll(lambda: len(serving_pids(s, 8, PROBE_TIMEOUT) - {victim}) == 2, "the replacement to serve")
        assert len(re.findall(failed, s.logs())) == 1, s.logs()
        assert float(line.group(2)) > 0
        assert s.proc.poll() is None
    assert s.proc.returncode == 0


# The supervisor as a container's PID 1 without an init: it becomes the parent of processes
# orphaned under it (a subreaper), and its wait for any child reaps them too. A process with no
# worker of its own starts a shell 2 s in that leaves three background sleeps behind, orphans.
_ORPHANS = (
    "-c",
    "import ctypes, subprocess, sys, threading, hotloop.cli as c\n"
    "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER\n"
    "def orphans():\n"
    "    subprocess.Popen(['sh', '-c', 'sleep 0.3 & sleep 0.4 & sleep 0.5 &'])\n"
    "threading.Timer(2.0, orphans).start()\n"
    "sys.exit(c.main(sys.argv[1:]))",
)


def test_processes_orphaned_under_the_supervisor_are_not_taken_for_workers(tmp_path: Path) -> None:
    """A process the supervisor reaps that is none of its workers (an orphan reparented to it,
    as to a container's PID 1) was taken for slot 0's worker: a worker started beside the
    running one, one more for each orphan."""
    with run_server(tmp_path, "--workers", "2", "--sim-rate", "0", entry=_ORPHANS) as s:
        time.sleep(3.5)  # the orphans come 2 s after the start and are gone half a second later
        assert _exited(s) == 0, s.logs()
        assert len(_children(s.proc.pid)) == 2  # its two workers, no more
        assert all(code == 200 for code in _probe_fresh_connections(s))
