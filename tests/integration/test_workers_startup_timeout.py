"""``hotloop serve --workers N``: a worker whose start hangs is stopped and replaced, not waited
for for good. Real processes started with the real CLI on 127.0.0.1. The hang is a user
``--classifier`` whose set-up (its factory, called while the worker builds its application)
never returns in the first process that loads it, as one waiting on a service at start-up would;
the processes after it load it at once. The bounds a test cannot wait out are shortened by a
``-c`` entry that patches :mod:`hotloop.server.workers` before it calls :func:`hotloop.cli.main`:
``STARTUP_TIMEOUT`` 6 s (60), ``STARTUP_TERM_WAIT`` 1 s (5), ``KILL_WAIT`` 1 s (5) and
``kill_after`` 2 s (42 and more).

- Its start hangs: 6 s after its fork the supervisor names it (pid, index, how long), stops it
  (SIGTERM), logs its end as a failed start, and its replacement serves; the other slot serves
  throughout. With both hanging the port stays the server's meanwhile: clients wait for a
  replacement instead of being refused.
- It ignores SIGTERM (a hang inside uvicorn's start-up, whose handler only notes the signal):
  SIGKILL 1 s after the SIGTERM.
- SIGKILL does not end it either (uninterruptible sleep, simulated: the supervisor's SIGKILLs are
  swallowed): named once more ``KILL_WAIT`` later, its slot waits for it; the stop exits 1 past
  its bound, and the shared rate-limits file is removed (the stuck worker's copy of the
  supervisor's lock is the supervisor's own: no "left to the other server" line)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import run_server
from tests.integration.test_scaleout import poll, serving_pids
from tests.integration.test_workers_lives import _alive, _reaped
from tests.integration.test_workers_restart_backoff import _at

# STARTUP_TIMEOUT above a healthy start on a loaded 2-core host (up to 3 s seen with two servers
# starting at once), so that only the hanging worker runs out of time
TIMEOUT, TERM_WAIT, KILL_WAIT, BOUND = 6.0, 1.0, 1.0, 2.0

_HANGING = '''
import os, signal, time
from tests.classifier_examples import counting


def hanging():
    """The first {hangs} processes to call it never get a classifier (their pids in hung-N.pid);
    the others do."""
    here = os.path.dirname(os.path.abspath(__file__))
    for n in range({hangs}):
        try:
            fd = os.open(os.path.join(here, f"hung-{{n}}.pid"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            continue
    else:
        return counting()
    os.write(fd, b"%d\\n" % os.getpid())
    os.close(fd)
    if {ignore_term}:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)
'''

# The supervisor's SIGKILLs are swallowed when ``unkillable`` (its workers get the real os.kill back).
_ENTRY = f"""
import os, signal, sys
import hotloop.server.workers as w

if {{unkillable}}:
    kill = os.kill

    def kill_but_not_sigkill(pid, sig):
        if sig != signal.SIGKILL:
            kill(pid, sig)

    os.kill = kill_but_not_sigkill
    os.register_at_fork(after_in_child=lambda: setattr(os, "kill", kill))
w.STARTUP_TIMEOUT, w.STARTUP_TERM_WAIT, w.KILL_WAIT = {TIMEOUT}, {TERM_WAIT}, {KILL_WAIT}
w.kill_after = lambda grace: {BOUND}
from hotloop.cli import main
sys.exit(main(sys.argv[1:]))
"""

LATE = r"^(\S+ \S+) ERROR hotloop\.server: worker {pid} \(index (\d)\) has not started listening (\S+) s after its start; stopping it \(SIGTERM, SIGKILL (\S+) s later\)$"
ENDED = r"^(\S+ \S+) ERROR hotloop\.server: worker {pid} failed to start \(index (\d), signal (\w+), up (\S+) s\); starting another in (\S+) s$"


def _setup(tmp: Path, ignore_term: bool, hangs: int = 1) -> dict[str, str]:
    (tmp / "hanging.py").write_text(_HANGING.format(ignore_term=ignore_term, hangs=hangs))
    path = os.pathsep.join(p for p in (str(tmp), os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    # the variable sets the bound where the configuration has it (--worker-start-timeout), the
    # entry's patch where it has not
    return {"PYTHONPATH": path, "HOTLOOP_DATA_DIR": str(tmp / "data"), "HOTLOOP_WORKER_START_TIMEOUT": f"{TIMEOUT:g}"}


def _hung(tmp: Path, n: int = 0) -> int:
    pid = tmp / f"hung-{n}.pid"
    return int(poll(lambda: pid.exists() and pid.read_text().strip(), "the hanging worker"))


@pytest.mark.parametrize(("hangs", "ignore_term"), [(1, False), (1, True), (2, False)],
                         ids=["sigterm", "sigterm-ignored", "every-worker"])
def test_a_worker_whose_start_hangs_is_stopped_and_replaced(tmp_path: Path, hangs: int, ignore_term: bool) -> None:
    """--workers 2, ``hangs`` of the first generation hang. It used to be waited for for good:
    its slot never served again, and no line said so (with both hanging, the server never
    served)."""
    env = _setup(tmp_path, ignore_term, hangs)
    entry = ("-c", _ENTRY.format(unkillable=False))
    args = ("--workers", "2", "--sim-rate", "0", "--classifier", "hanging:hanging")
    # with every worker hanging /healthz waits (the port listens) until a replacement serves
    with run_server(tmp_path, *args, env=env, entry=entry) as s:
        hung = [_hung(tmp_path, n) for n in range(hangs)]
        with _reaped(hung):
            lates = [poll(lambda: re.search(LATE.format(pid=p), s.logs(), re.M), "the hanging worker to be named", 8.0) for p in hung]
            endings = [poll(lambda: re.search(ENDED.format(pid=p), s.logs(), re.M), "its end to be logged", 6.0) for p in hung]
            assert not any(_alive(p) for p in hung)
            pids = poll(lambda: p if len(p := serving_pids(s, 16, 2.0)) == 2 else None, "both slots to serve", 10.0)
            assert not pids & set(hung)
            assert s.proc.poll() is None, s.logs()
    logs = s.logs()
    sig = "SIGKILL" if ignore_term else "SIGTERM"
    for late, ended in zip(lates, endings):
        index, took, term_wait = late.group(2), float(late.group(3)), float(late.group(4))
        assert TIMEOUT <= took < TIMEOUT + 1.5, logs  # its start's bound, not much later
        assert term_wait == TERM_WAIT
        assert (ended.group(2), ended.group(3), float(ended.group(5))) == (index, sig, 0.5), logs  # a failed start: backed off
        gap = _at(ended.group(1)) - _at(late.group(1))
        assert (TERM_WAIT - 0.1 <= gap < TERM_WAIT + 1.5) if ignore_term else gap < 1.0, (gap, logs)
    assert len(re.findall(LATE.format(pid=r"\d+"), logs, re.M)) == hangs, logs  # no other start ran out of time
    assert s.proc.returncode == 0, logs


def test_a_hanging_worker_that_sigkill_does_not_end_holds_its_slot_and_the_stop_is_bounded(tmp_path: Path) -> None:
    """--workers 2 on SQLite: the hanging worker ignores SIGTERM and the supervisor's SIGKILL does
    not reach it. Named at 6 s, SIGKILL at 7 s, named once more at 8 s; its slot is not replaced
    meanwhile (a replacement would pile up another), and its socket no longer takes connections;
    the other worker serves them all. The stop kills it at ``kill_after``, gives up ``KILL_WAIT``
    later and exits 1; the shared rate-limits file and its lock are removed, and the log says
    nothing of another server."""
    env = _setup(tmp_path, True)
    entry = ("-c", _ENTRY.format(unkillable=True))
    args = ("--workers", "2", "--sim-rate", "0", "--classifier", "hanging:hanging", "--shutdown-grace", "0")
    data = Path(env["HOTLOOP_DATA_DIR"])
    with run_server(tmp_path, *args, env=env, entry=entry) as s:
        hung = _hung(tmp_path)
        with _reaped([hung]):
            waits = rf"^\S+ \S+ ERROR hotloop\.server: worker {hung} \(index \d\) still running {KILL_WAIT:g} s after its SIGKILL; its slot waits for it$"
            poll(lambda: re.search(waits, s.logs(), re.M), "the unkillable worker to be named", 10.0)
            assert (data / "hotloop-limits.sqlite3").exists()
            time.sleep(1.0)  # nothing more comes of it
            logs = s.logs()
            assert len(re.findall(waits, logs, re.M)) == 1, logs
            assert len(re.findall(r"started worker \d+", logs)) == 2, logs  # no replacement for its slot
            # its socket (listening since the start) no longer takes connections nobody accepts
            start = time.monotonic()
            assert len(serving_pids(s, 16, 2.0)) == 1
            assert time.monotonic() - start < 2.0, "a connection waited on the stuck worker's socket"
            s.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            code = s.proc.wait(timeout=BOUND + KILL_WAIT + 8)
            took = time.monotonic() - sent
            assert _alive(hung)  # the simulation held: only the test's SIGKILL (_reaped) ends it
    logs = s.logs()
    assert code == 1, logs
    assert took < BOUND + KILL_WAIT + 3, f"{took:.1f} s"
    assert f"worker {hung} still running {KILL_WAIT:g} s after its SIGKILL; exiting without it" in logs, logs
    assert "left to" not in logs, logs
    left = sorted(p.name for p in data.iterdir() if "limits" in p.name)
    assert left == [], left


def test_a_refused_configuration_leaves_no_metrics_directory_behind(tmp_path: Path) -> None:
    """``--workers`` made its processes' metrics directory before it checked the configuration:
    each refused start left one in the temporary directory."""
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "hotloop", "serve", "--port", "70000", "--workers", "2"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 3 and "--port must be between 0 and 65535" in proc.stderr
    assert not list(tmp_path.glob("hotloop-metrics-*"))
