"""``hotloop serve --workers N``: a worker that dies by a signal while it starts (a segfault in a
native extension, the OOM killer) is replaced after a delay that doubles while its slot keeps
failing, not every 0.5 s for ever; the delay starts again once a worker has stayed up. Real
processes on 127.0.0.1: the workers load a ``--classifier`` module that kills its own process
with SIGKILL on the imports the test picks (numbered across every process of the server)."""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

from hotloop.server.workers import RESTART_DELAY
from tests.conftest import Server, run_server
from tests.integration.test_scaleout import poll, serving_pids

# How each replacement is logged: pid, index, how it ended, how long it lived, the delay.
RESTART = re.compile(
    r"^(\S+ \S+) \w+ hotloop\.server: worker (\d+) exited \(index (\d+), signal (\w+), up (\S+) s\); "
    r"starting another in (\S+) s$", re.M
)
STARTED = re.compile(r"^(\S+ \S+) \w+ hotloop\.server: started worker (\d+) \(index (\d+)\)$", re.M)

_CRASHING = '''
import os, signal
from tests.classifier_examples import counting  # noqa: F401 - what a worker that starts loads

def _ordinal() -> int:
    here, n = os.path.dirname(os.path.abspath(__file__)), 0
    while True:  # the first free number: one per import, in every process of the server
        try:
            os.close(os.open(os.path.join(here, f"import-{{n}}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            n += 1

if {crash}:
    os.kill(os.getpid(), signal.SIGKILL)
'''


def _classifier(tmp: Path, crash: str) -> dict[str, str]:
    """A ``--classifier crashing:counting`` module whose import ``crash`` (a Python condition on
    ``_ordinal()``) kills; the environment that finds it."""
    (tmp / "crashing.py").write_text(_CRASHING.format(crash=crash))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH", "")) if p)}


def _at(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _restarts(s: Server) -> list[tuple[float, int, int, str, float, float]]:
    """Every replacement the supervisor logged: (when, pid, index, signal, up, delay)."""
    return [(_at(t), int(p), int(i), sig, float(up), float(d)) for t, p, i, sig, up, d in RESTART.findall(s.logs())]


def test_a_slot_whose_workers_are_killed_while_starting_backs_off(tmp_path: Path) -> None:
    """Every worker after the first dies by SIGKILL while it starts: one slot serves, the other's
    replacements come 0.5, 1 and 2 s after each death (each logged with its index, the signal and
    the delay), not every 0.5 s."""
    env = _classifier(tmp_path, "_ordinal() >= 1")
    args = ("--workers", "2", "--sim-rate", "0", "--classifier", "crashing:counting")
    with run_server(tmp_path, *args, env=env) as s:
        failing = poll(lambda: len(r := _restarts(s)) >= 3 and r, "three replacements of the failing slot", 12.0)
        logs = s.logs()
        # the other slot serves (short tries: one the kernel queued on the dying worker's socket
        # before the supervisor closed it is reset or waits)
        poll(lambda: serving_pids(s, 1, 0.5), "the other slot to answer")
    assert len({index for _, _, index, *_ in failing}) == 1, failing
    assert [sig for _, _, _, sig, _, _ in failing] == ["SIGKILL"] * len(failing)
    delays = [delay for *_, delay in failing]
    assert delays[:3] == [RESTART_DELAY, 2 * RESTART_DELAY, 4 * RESTART_DELAY], delays
    # each replacement was started its delay after the death, not sooner
    started = [(_at(t), int(i)) for t, _, i in STARTED.findall(logs)]
    for died, _, index, _, _, delay in failing[:2]:
        after = min(at for at, i in started if i == index and at >= died)
        assert delay - 0.01 <= after - died < delay + 1.0, (after - died, delay)


def test_a_slot_s_delay_starts_again_once_a_worker_stayed_up(tmp_path: Path) -> None:
    """The slot's first worker dies while it starts (its delay doubles), its replacement stays up
    (here ``STAYED_UP`` is 3 s instead of 10, not to wait it out) and is then killed: it is
    replaced after ``RESTART_DELAY`` again, not after the doubled delay."""
    stayed_up = 3.0
    entry = ("-c", f"import sys, hotloop.server.workers as w; w.STAYED_UP = {stayed_up}; "
                   "from hotloop.cli import main; sys.exit(main(sys.argv[1:]))")
    env = _classifier(tmp_path, "_ordinal() == 1")
    args = ("--workers", "2", "--sim-rate", "0", "--classifier", "crashing:counting")
    with run_server(tmp_path, *args, env=env, entry=entry) as s:
        (died, _, index, _, up, delay), = poll(lambda: _restarts(s), "the failing start's replacement")
        assert up < stayed_up and delay == RESTART_DELAY

        def replacement() -> tuple[float, int] | None:
            found = [(_at(t), int(p)) for t, p, i in STARTED.findall(s.logs()) if int(i) == index and _at(t) > died]
            return found[0] if found else None

        _, pid = poll(replacement, "the replacement to start")
        poll(lambda: pid in serving_pids(s, 4, 1.0), "the replacement to serve")
        time.sleep(stayed_up + 0.3)  # it stays up from when it was ready, which it was by its answer
        os.kill(pid, signal.SIGKILL)
        again = poll(lambda: [r for r in _restarts(s) if r[1] == pid], "the killed worker's replacement")
    (_, _, again_index, sig, again_up, again_delay), = again
    assert (again_index, sig) == (index, "SIGKILL") and again_up >= stayed_up
    assert again_delay == RESTART_DELAY, again_delay  # reset: not the 1 s the failing start left
    assert s.proc.returncode == 0


def test_a_worker_that_dies_before_it_was_ready_backs_off_however_long_its_start_took(tmp_path: Path) -> None:
    """The failing slot's workers take longer to start than ``STAYED_UP`` (here 0.5 s instead of
    10, not to wait it out) and die by SIGKILL before they serve. Before, "stayed up" was counted
    from the fork, so each was replaced after ``RESTART_DELAY`` as if it had served (a crash loop
    at full speed for a slow start); now only a worker that said it was ready and then stayed up
    resets the delay: these back off, 0.5 then 1 s, logged as errors."""
    entry = ("-c", "import sys, hotloop.server.workers as w; w.STAYED_UP = 0.5; "
                   "from hotloop.cli import main; sys.exit(main(sys.argv[1:]))")
    env = _classifier(tmp_path, '_ordinal() >= 1 and __import__("time").sleep(1.0) is None')
    args = ("--workers", "2", "--sim-rate", "0", "--classifier", "crashing:counting")
    with run_server(tmp_path, *args, env=env, entry=entry) as s:
        failing = poll(lambda: len(r := _restarts(s)) >= 2 and r, "two replacements of the failing slot", 8.0)
        levels = re.findall(r"^\S+ \S+ (\w+) hotloop\.server: worker \d+ exited", s.logs(), re.M)
    assert all(up > 0.5 for *_, up, _ in failing[:2]), failing  # started for longer than STAYED_UP
    assert [delay for *_, delay in failing[:2]] == [RESTART_DELAY, 2 * RESTART_DELAY], failing
    assert levels[:2] == ["ERROR", "ERROR"], levels
