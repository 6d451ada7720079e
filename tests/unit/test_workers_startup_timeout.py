"""The ``--workers`` supervisor's bound on a worker's start (``Supervisor._bound_starts``), without
forking: what it sends to a worker that has not started listening, and when."""

from __future__ import annotations

import math
import os
import signal
import socket
from typing import Iterator

import pytest

import hotloop.server.workers as w
from hotloop.config import Config
from hotloop.server.workers import KILL_WAIT, STARTUP_TERM_WAIT, STARTUP_TIMEOUT, Supervisor, _bind, kill_after

PID = 4_000_000  # no such process: _kill is recorded, not sent


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    monkeypatch.setattr(w, "_kill", lambda pid, sig: out.append((pid, sig)))
    return out


@pytest.fixture
def sock() -> Iterator[socket.socket]:
    s = _bind("127.0.0.1", 0)
    try:
        yield s
    finally:
        s.close()


def _pipe(sup: Supervisor) -> tuple[int, int]:
    """A readiness pipe for PID, as spawn makes it."""
    r, wr = os.pipe()
    os.set_blocking(r, False)
    sup.pipes[PID] = r
    return r, wr


def _sup(sock: socket.socket) -> Supervisor:
    sup = Supervisor(Config(workers=1), [sock])
    sup.workers[PID] = 0
    sup.born[PID] = 100.0
    return sup


def test_a_start_that_hangs_gets_sigterm_then_sigkill_then_one_line(
    sent: list[tuple[int, int]], sock: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    w.log.addHandler(caplog.handler)  # whatever an earlier test's logging configuration left
    try:
        _hangs(sent, sock, caplog)
    finally:
        w.log.removeHandler(caplog.handler)


def _hangs(sent: list[tuple[int, int]], sock: socket.socket, caplog: pytest.LogCaptureFixture) -> None:
    sup = _sup(sock)
    _, wr = _pipe(sup)
    assert sup._bound_starts(100.0 + STARTUP_TIMEOUT - 1) == 100.0 + STARTUP_TIMEOUT and sent == []
    t = 100.0 + STARTUP_TIMEOUT + 0.2
    assert sup._bound_starts(t) == t + STARTUP_TERM_WAIT and sent == [(PID, signal.SIGTERM)]
    assert sup._bound_starts(t + 1) == t + STARTUP_TERM_WAIT and len(sent) == 1  # once
    k = t + STARTUP_TERM_WAIT
    assert sup._bound_starts(k) == k + KILL_WAIT and sent[1:] == [(PID, signal.SIGKILL)]
    assert sup._bound_starts(k + KILL_WAIT) == math.inf
    assert sup._bound_starts(k + 100) == math.inf and len(sent) == 2
    said = list(dict.fromkeys(r.getMessage() for r in caplog.records if r.name == "hotloop.server"))
    os.close(wr)
    os.close(sup.pipes.pop(PID))
    assert said == [
        f"worker {PID} (index 0) has not started listening {STARTUP_TIMEOUT + 0.2:.1f} s after its start; "
        f"stopping it (SIGTERM, SIGKILL {STARTUP_TERM_WAIT:g} s later)",
        f"worker {PID} (index 0) still running {KILL_WAIT:g} s after its SIGKILL; its slot waits for it",
    ]


def test_a_worker_that_said_it_listens_is_left_alone(sent: list[tuple[int, int]], sock: socket.socket) -> None:
    """Its byte read (ready), or on its readiness pipe and not read yet; or it has no pipe (the
    parent had no descriptor left: nothing tells). Its slot's socket is not asked: the first
    generation's listen from the start (here too)."""
    sock.listen(8)
    sup = _sup(sock)
    sup.ready[PID] = 101.0
    assert sup._bound_starts(1e6) == math.inf and sent == []
    del sup.ready[PID]
    assert sup._bound_starts(1e6) == math.inf and sent == []  # no pipe
    r, wr = _pipe(sup)
    os.write(wr, b"+")
    assert sup._bound_starts(1e6) == math.inf and sent == [] and PID in sup.ready
    os.close(wr)


def test_a_listening_socket_does_not_count_without_the_byte(sent: list[tuple[int, int]], sock: socket.socket) -> None:
    sock.listen(8)
    sup = _sup(sock)
    r, wr = _pipe(sup)
    try:
        assert sup._bound_starts(1e6) == 1e6 + STARTUP_TERM_WAIT and sent == [(PID, signal.SIGTERM)]
    finally:
        os.close(wr)
        os.close(sup.pipes.pop(PID))


def test_a_late_worker_that_listens_by_its_sigkill_gets_a_stop_s_bound(sent: list[tuple[int, int]], sock: socket.socket) -> None:
    """It started listening after its SIGTERM: a server stopping, whose responses get their grace;
    killed as at a stop, ``kill_after`` after its SIGTERM."""
    sup = _sup(sock)
    _, wr = _pipe(sup)
    t = 100.0 + STARTUP_TIMEOUT
    sup._bound_starts(t)
    os.write(wr, b"+")  # it listens
    os.close(wr)
    end = t + kill_after(sup.config.shutdown_grace)
    assert sup._bound_starts(t + STARTUP_TERM_WAIT) == end and sent == [(PID, signal.SIGTERM)]
    assert sup._bound_starts(end) == end + KILL_WAIT and sent[1:] == [(PID, signal.SIGKILL)]


def test_a_late_worker_s_death_is_a_failed_start_even_in_the_first_generation(sock: socket.socket) -> None:
    """Exit code 3 from the first generation stops the server (the settings are wrong); from a
    worker stopped because its start ran out of time it does not: its slot backs off."""
    sup = _sup(sock)
    sup.first = {PID}
    sup._replace(PID, 0, 3, STARTUP_TIMEOUT, None, 1000.0, late=True)
    assert not sup.failed and not sup.stopping
    assert 0 in sup.due and sup.delay[0] == 2 * w.RESTART_DELAY


def test_the_socket_of_a_worker_that_outlives_its_sigkill_stops_listening(sent: list[tuple[int, int]]) -> None:
    """A first generation's socket listens from the start, and the stuck worker holds a copy that
    nobody accepts on: shut down (every copy), so new connections go to the workers that serve;
    not while it is the only socket that listens (the port stays the server's)."""
    first = _bind("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = _bind("127.0.0.1", port)
    first.listen(8)
    try:
        sup = Supervisor(Config(workers=2), [first, second])
        sup.workers[PID] = 0
        sup.born[PID] = 100.0
        _, wr = _pipe(sup)
        copy = first.dup()  # the stuck worker's
        t = 100.0 + STARTUP_TIMEOUT
        for at in (t, t + STARTUP_TERM_WAIT, t + STARTUP_TERM_WAIT + KILL_WAIT):
            sup._bound_starts(at)
        assert w._listening(first)  # the only one that listens: kept
        sup.late[PID] = (signal.SIGKILL, 0.0, 0.0)  # named again, with another socket listening now
        second.listen(8)
        sup._bound_starts(t + 100)
        assert not w._listening(first) and not w._listening(copy) and w._listening(second)
        os.close(wr)
        os.close(sup.pipes.pop(PID))
        copy.close()
    finally:
        first.close()
        second.close()
