"""``hotloop serve --workers N``: N server processes on one port, supervised by the parent.

The parent binds one listening socket per worker on the same address (``SO_REUSEPORT``: the
kernel spreads new connections evenly over the sockets that listen) and forks N workers, each
accepting on its own socket and running its own event loop (uvloop), app, caches and writer
thread, exactly like a single server. A worker holds only its own socket (it closes its copies of
the others when it is forked); the parent holds them all, so a socket outlives its worker only
while the parent keeps it.

Sockets of slots without a worker: when a worker dies, the parent closes its slot's socket (the
kernel then sends new connections to the sockets of the workers that serve instead of queueing
about 1/N of them, until the replacement serves, on a socket nobody accepts on: up to
``RESTART_DELAY_MAX`` plus a start-up for a slot that keeps failing). Right before the replacement
is forked the parent binds a fresh socket for the slot, without listening on it: the replacement's
server listens once it has started (uvicorn, on a socket it is given), so no connection waits on
a replacement that is starting, or fails to. A bind that fails (the address taken by another
program, no file descriptors left) is one log line, and is tried again after the slot's delay,
which doubles as for a failed start. Connections the kernel had already queued on a socket the
parent closes (accepted by the kernel, their requests sent, never accepted by a worker) are moved
by the kernel to another socket of the group ("request migration", Linux 5.14+) when
``net.ipv4.tcp_migrate_req`` is 1, or when the group has an eBPF program of type
``BPF_SK_REUSEPORT_SELECT_OR_MIGRATE``: the parent attaches one to the group at start when it may
(CAP_BPF and no seccomp filter; :func:`_migration_program`: two instructions that select no socket, so new connections
are spread by their hash exactly as without it; a replacement's socket joins the group, program
and all, as its worker listens). Otherwise they are reset (the client sees a connection error,
which the openai SDKs retry), and the parent says so in one line at start.
The parent never closes the last socket that listens: while no slot has a worker that
serves, one dead slot's socket stays open and listening, so the port stays the server's (nothing
else can bind it, so the replacements can) and new connections wait for a worker instead of being
refused; it is closed once another slot's socket listens, or used by its slot's replacement.
The sockets are not inheritable: a program a worker runs does not keep a slot's socket open.

What the workers share is the store: SQLite in
WAL mode (the parent creates the schema before forking; each worker's connection waits up to
5 s on a lock) or Redis; and each key's rate and concurrency limits: in Redis, or with SQLite in
a file of their own (:mod:`hotloop.tenants.sqlite_limits`) that the parent makes fresh before
forking (or shares, when another server on the data directory uses it), frees a dead worker's
concurrency slots in as it reaps it, and removes once its workers are gone (unless that other
server still runs). A WebSocket is one connection, so its connection cache lives in the one worker that
accepted it; HTTP continuations that land on another worker read the store
(:mod:`hotloop.pipeline.shared`).

Metrics: the parent points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh temporary directory (unless
it is already set) before prometheus-client is imported, so every worker's series go to files
there and ``/metrics`` on any worker serves the aggregate of all of them (dead workers' counters
included); the directory is removed on exit if the parent created it.

Supervision: a worker that dies is replaced after a delay, and every replacement is logged as one
line naming the worker's index (its slot), how it ended (an exit code, or the signal that killed it),
how long it lived (from its fork) and the delay. A worker is ready once its server has started
and listens: it then writes one byte to a pipe the parent gave it (:func:`hotloop.server.runner.serve`'s
``ready``). A worker of the first generation (the initial start) that fails to start, exit code 3,
stops the whole server with that code, as a single server does: the settings are wrong. Any other
worker that fails to start (exit code 3: say, Redis is briefly unreachable), or that dies, by any
exit code or signal (a segfault in a native extension, the OOM killer), before it was ready
(however long its start took) or less than ``STAYED_UP`` seconds after (a crash loop), does not
stop the healthy workers: it is replaced after a delay that doubles from ``RESTART_DELAY`` to
``RESTART_DELAY_MAX`` while its slot keeps failing, so a slot whose workers never start costs one
start-up per ``RESTART_DELAY_MAX`` instead of a busy core. A worker that dies after it was ready
and stayed up ``STAYED_UP`` seconds (exit code 3 aside) is replaced after ``RESTART_DELAY``, and
its slot's delay starts again from there. A start is bounded: a worker that has not started
listening ``STARTUP_TIMEOUT`` seconds (60; the configuration's ``worker_start_timeout`` where it
has one) after its fork (a start that hangs: a user classifier's set-up waiting on a service, a
file on a hung network mount, a lookup without a bound) is named in one line (pid, index, how
long), gets SIGTERM, and SIGKILL ``STARTUP_TERM_WAIT`` seconds later if it is still there; its
death is a failed start, whatever its exit code (the first generation's too: the settings may be
right, a service slow), and its slot backs off as above. A worker that SIGKILL does not end
(uninterruptible sleep) is named once more ``KILL_WAIT`` seconds later, its socket stops
listening (shut down: the stuck worker holds a copy; unless it is the last that listens), and its
slot waits for it: a replacement could only hang the same way, and such processes would pile
up. The parent sleeps while nothing happens (up to ``IDLE_POLL``, 1 s), and wakes at once when a
worker dies (SIGCHLD, through ``signal.set_wakeup_fd``: the dead worker's socket is closed before
more connections queue on it), says it is ready, or a stop comes; each worker resets those
signal handlers as it starts. SIGTERM or SIGINT to the parent is forwarded (SIGTERM) to every worker, which finish their
responses within ``--shutdown-grace``, fail what still runs and cancel it ``ABORT_WINDOW`` later,
and shut their stores down (the write queue's flush, the store's close, the key store's) within
``CLOSE_FLUSH_SECONDS`` in all (:meth:`hotloop.server.app.HotloopApp.shutdown`); workers still
alive :func:`kill_after` seconds after the stop (all of that plus ``KILL_MARGIN``) are killed. The
parent exits 0 after a requested stop; 1 when a worker still runs ``KILL_WAIT`` seconds after its
SIGKILL (a process in uninterruptible sleep, named in the log): the stop is bounded, whatever the
workers do. A supervisor that dies (SIGKILL, the OOM killer) cannot bound its workers' stop: each
worker stops on the SIGTERM it then gets (``PR_SET_PDEATHSIG``), and kills itself if it still runs
:func:`kill_after` seconds after (a thread blocked on a pipe only the supervisor can write to,
which ends as the supervisor does: no wake-up until then). A fork that fails (EAGAIN, ENOMEM) is
one log line, and the slot tries again after its delay, doubling as for a failed start.
"""

from __future__ import annotations

import ctypes
import logging
import logging.config
import math
import os
import platform
import select
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from typing import Any

from hotloop.config import Config

log = logging.getLogger("hotloop.server")

RESTART_DELAY = 0.5  # seconds before a dead worker is replaced (the first delay of a failing slot)
RESTART_DELAY_MAX = 10.0  # the bound on the doubling delay of a slot whose workers fail to start
# A worker that served this long (from the byte it writes to its readiness pipe once its server
# has started: the supervisor's word that it is ready) has stayed up: its death is not a start-up
# failure or a crash loop, and its slot's delay is reset. A worker that dies before it was ready,
# however long its start took, has not.
STAYED_UP = 10.0
# How long the supervisor sleeps when nothing happens: a worker's death (SIGCHLD), a worker ready
# (its pipe), a stop (SIGTERM/SIGINT) wake it at once, and a replacement due or the kill deadline
# when they come.
IDLE_POLL = 1.0
# A worker that has not started listening this long after its fork is stopped: SIGTERM, then
# SIGKILL ``STARTUP_TERM_WAIT`` seconds later if it is still there; its death is a failed start (the
# slot backs off). A healthy start takes about 1 s (imports, the vocabulary, the store, uvicorn's
# start); the longest wait a start may legitimately sit through is bounded elsewhere and shorter:
# a locked SQLite file (--store-busy-timeout, at most 30 s), Redis (1 s to connect, 5 s a command),
# the backend's model list (10 s). Twice the longest, so a slow but healthy start on a loaded host
# is never cut short, and a start that hangs (a user classifier's set-up waiting on a service, a
# file on a hung network mount, a lookup without a bound) costs its slot a minute, not for good.
# A start that needs longer (a user classifier loading a large model) needs a larger bound: the
# configuration's ``worker_start_timeout``, where it has one, replaces this default.
STARTUP_TIMEOUT = 60.0
# Seconds between the SIGTERM and the SIGKILL of a worker whose start ran out of time: a worker
# still building its application dies on SIGTERM at once; one in uvicorn's start-up only notes it
# (uvicorn's handler), so a start that hangs there ends by the SIGKILL.
STARTUP_TERM_WAIT = 5.0
KILL_MARGIN = 10.0  # seconds beyond a worker's own shutdown bounds before it is killed (its backend's close, its exit)
KILL_WAIT = 5.0  # seconds the supervisor waits for workers it killed (SIGKILL) before it stops without them
STARTUP_FAILURE = 3
WRITES_LOST = 4  # a worker that stopped with writes not stored (runner.WRITES_LOST)


def kill_after(grace: float) -> float:
    """Seconds after a stop before workers still alive are killed: what a worker may take to stop
    (``grace``, then :data:`~hotloop.server.runner.ABORT_WINDOW`, then the store's shutdown,
    :data:`~hotloop.pipeline.post.CLOSE_FLUSH_SECONDS`) plus ``KILL_MARGIN``. Imported here, not
    at module level: the parent imports the server modules only once it is stopping, after every
    worker has been forked."""
    from hotloop.pipeline.post import CLOSE_FLUSH_SECONDS
    from hotloop.server.runner import ABORT_WINDOW

    return grace + ABORT_WINDOW + CLOSE_FLUSH_SECONDS + KILL_MARGIN


def _probe(host: str, port: int) -> int:
    """The port, if nothing listens on ``host:port`` yet (``OSError`` otherwise): bound without
    ``SO_REUSEPORT``, so another server's sockets that have it (an earlier ``--workers`` server,
    or its orphaned workers) make it fail instead of letting our workers join their group and
    share their connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        return int(probe.getsockname()[1])


def _die_with(parent: int) -> None:
    """In a worker: SIGTERM when the supervisor dies (SIGKILL, OOM), so no worker serves on as an
    orphan; the worker then stops as on any SIGTERM (grace, store flush)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except Exception:  # not Linux: nothing to ask for
        pass
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(0)


BACKLOG = 2048  # uvicorn's, which the workers' servers pass when they listen


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` in the server's ``SO_REUSEPORT`` group, not listening: the
    kernel gives it no connection until it listens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _listen(host: str, port: int) -> socket.socket:
    sock = _bind(host, port)
    sock.listen(BACKLOG)
    return sock


MIGRATE_REQ = "/proc/sys/net/ipv4/tcp_migrate_req"
_BPF_SYSCALL = {"x86_64": 321, "aarch64": 280}  # __NR_bpf
_BPF_PROG_LOAD = 5
_BPF_PROG_TYPE_SK_REUSEPORT = 21
_BPF_SK_REUSEPORT_SELECT_OR_MIGRATE = 40
_SO_ATTACH_REUSEPORT_EBPF = 52
# r0 = SK_PASS (1); exit. No socket selected: the kernel picks one by the connection's hash, as
# with no program, and (the program's attach type) moves a closed socket's requests to another.
_SELECT_OR_MIGRATE_BY_HASH = struct.pack("<BBhiBBhi", 0xB7, 0, 0, 1, 0x95, 0, 0, 0)


def _migrate_req() -> int | None:
    """``net.ipv4.tcp_migrate_req`` of this network namespace; ``None`` where there is none."""
    try:
        with open(MIGRATE_REQ) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def _seccomp_filtered(status: str = "/proc/self/status") -> bool:
    """Whether this process runs under a seccomp filter (``Seccomp: 2``; 1 is strict mode, which
    would not have let it get this far); unknown counts as filtered."""
    try:
        with open(status) as fh:
            for line in fh:
                if line.startswith("Seccomp:"):
                    return line.split()[1] != "0"
    except (OSError, IndexError):
        pass
    return True


def _migration_program() -> int | None:
    """A file descriptor of the eBPF program that makes the kernel move the requests queued on a
    closed socket of the ``SO_REUSEPORT`` group to another (``BPF_SK_REUSEPORT_SELECT_OR_MIGRATE``,
    Linux 5.14+); ``None`` where it cannot be loaded (no CAP_BPF, another OS or architecture, an
    older kernel) or where trying could kill the process (any seccomp filter: :func:`_seccomp_filtered`). It selects no socket, so the kernel spreads new connections
    by their hash exactly as without it."""
    number = _BPF_SYSCALL.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    if _seccomp_filtered():
        # A seccomp filter may answer bpf() by killing the process (SIGSYS: systemd's
        # SystemCallFilter= without SystemCallErrorNumber=, where bpf is not in @system-service),
        # not with an error: the call is not tried under any filter.
        log.debug("no eBPF program for request migration (a seccomp filter is in place)")
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        insns = ctypes.create_string_buffer(_SELECT_OR_MIGRATE_BY_HASH, len(_SELECT_OR_MIGRATE_BY_HASH))
        licence = ctypes.create_string_buffer(b"Apache-2.0")
        attr = ctypes.create_string_buffer(72)  # union bpf_attr, BPF_PROG_LOAD: up to expected_attach_type
        struct.pack_into("<IIQQ", attr, 0, _BPF_PROG_TYPE_SK_REUSEPORT, 2, ctypes.addressof(insns), ctypes.addressof(licence))
        struct.pack_into("<I", attr, 68, _BPF_SK_REUSEPORT_SELECT_OR_MIGRATE)
        fd = int(libc.syscall(ctypes.c_long(number), ctypes.c_long(_BPF_PROG_LOAD), attr, ctypes.c_uint(len(attr))))
        errno = ctypes.get_errno()
    except Exception as exc:  # no libc.syscall: no program
        log.debug("no eBPF program for request migration (%s: %s)", type(exc).__name__, exc)
        return None
    if fd < 0:
        log.debug("no eBPF program for request migration (%s)", os.strerror(errno))
        return None
    return fd  # close-on-exec, as every bpf() descriptor


def _attach(sock: socket.socket, prog: int | None) -> bool:
    """Attach the migration program to the group of ``sock``, which listens. Never to a socket
    that does not listen yet: that gives it a group of its own, and its ``listen()`` then fails
    (EADDRINUSE). A socket that starts listening joins the group with its program: the
    replacements' fresh sockets, which their workers listen on, need none of their own (the
    group lives on: the parent never closes the last socket that listens)."""
    if prog is None:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_REUSEPORT_EBPF, prog)
    except OSError as exc:
        log.debug("could not attach the request migration program (%s: %s)", type(exc).__name__, exc)
        return False
    return True


def _request_migration(socks: list[socket.socket]) -> int | None:
    """At start, with the first sockets bound and listening: the migration program, attached to
    them, unless ``tcp_migrate_req`` already has the kernel move requests, or the kernel cannot
    (no such sysctl: before Linux 5.14, where the program would load and move nothing); one line
    when nothing moves them (connections queued on a dead worker's socket are then reset)."""
    req = _migrate_req()
    if req == 1:
        return None
    prog = _migration_program() if req is not None else None
    if prog is not None and not all([_attach(sock, prog) for sock in socks]):
        os.close(prog)
        prog = None
    if prog is None:
        how = (
            "set net.ipv4.tcp_migrate_req=1, or give the server CAP_BPF (and no seccomp filter), to have the kernel "
            "move them to the other workers"
            if req is not None else "this kernel cannot move them to the other workers (Linux 5.14+ can)"
        )
        log.info("connections queued on the socket of a worker that dies are reset: %s", how)
    return prog


def _outlive_bound(lifeline: int, bound: float) -> None:
    """In a worker, on a daemon thread: once its supervisor is gone (EOF on the pipe only the
    supervisor holds the write end of), the worker stops on the SIGTERM the kernel sends it
    (``PR_SET_PDEATHSIG``); if it still runs ``bound`` seconds later, it kills itself (SIGKILL),
    as the supervisor would have. The line saying so is written by a thread of its own, waited
    for 1 s: a main thread stuck holding the log's lock does not hold the kill back."""
    try:
        while os.read(lifeline, 64):
            pass
    except OSError:  # the descriptor is gone: nothing to watch
        return
    time.sleep(bound)
    pid = os.getpid()
    said = threading.Thread(
        target=log.error, args=("worker %d did not stop within %g s of its supervisor's death; killing it", pid, bound),
        daemon=True,
    )
    said.start()
    said.join(1.0)
    os.kill(pid, signal.SIGKILL)


def _listening(sock: socket.socket) -> bool:
    """Whether ``sock`` listens: the parent's copy says so once the worker's server listens on it.
    A socket closed meanwhile does not (a stop's signal handler closes them all, between any two
    steps of the supervisor's loop)."""
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


def _prepare_store(config: Config) -> None:
    """Create the SQLite schema once, before the workers open the file concurrently, and a fresh
    file for the per-key limits the workers share (:mod:`hotloop.tenants.sqlite_limits`: a
    restarted server starts with full buckets and no slot, as a single server does)."""
    if config.store != "sqlite":
        return
    from hotloop.state.store import SQLiteStore
    from hotloop.tenants import sqlite_limits
    from hotloop.tenants.keys import SQLiteKeyStore

    SQLiteStore(config.db_path, config.store_max_responses, config.store_ttl_seconds, busy_timeout=config.store_busy_timeout).close()
    SQLiteKeyStore(config.db_path).close()
    sqlite_limits.create(sqlite_limits.limits_path(config.db_path))


def _free_slots(config: Config, pid: int) -> None:
    """The concurrency slots a dead worker held in the limits file: its responses are gone."""
    if config.store == "sqlite":
        from hotloop.tenants import sqlite_limits

        sqlite_limits.free_slots(sqlite_limits.limits_path(config.db_path), pid)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal, say
        return str(signum)


def _worker(config: Config, sock: socket.socket, ready: int | None) -> int:
    from hotloop.server.runner import serve

    return serve(config, sock, ready)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # gone (a child not waited for yet is still there: a safeguard)
        pass


def _woken(signum: int, frame: Any) -> None:
    """SIGCHLD's handler in the supervisor: nothing, but with it the signal writes to the wake-up
    pipe (``signal.set_wakeup_fd``), so the supervisor's wait ends as a worker dies."""


def _drain(fd: int) -> None:
    """Read what a non-blocking pipe holds."""
    try:
        while os.read(fd, 512):
            pass
    except (BlockingIOError, InterruptedError):
        pass


class Supervisor:
    def __init__(self, config: Config, socks: list[socket.socket], prog: int | None = None) -> None:
        self.config = config
        self.prog = prog  # the request migration program (attached to the sockets' group), if any
        self.port = int(socks[0].getsockname()[1])
        # one per worker slot, listening; None while a slot without a worker has none (closed)
        self.socks: list[socket.socket | None] = list(socks)
        self.workers: dict[int, int] = {}  # pid -> slot
        self.born: dict[int, float] = {}  # pid -> when it was forked (monotonic)
        self.pipes: dict[int, int] = {}  # pid -> its readiness pipe's read end, until it says it is ready
        self.ready: dict[int, float] = {}  # pid -> when it said it was ready (monotonic)
        # pid -> (the signal last sent, when, the next step's time) of a worker whose start ran
        # out of time (_bound_starts); 0: nothing left to send (it outlived its SIGKILL: logged)
        self.late: dict[int, tuple[int, float, float]] = {}
        # the bound on a worker's start: the setting, where the configuration has one
        self.startup_timeout = float(getattr(config, "worker_start_timeout", None) or STARTUP_TIMEOUT)
        self.wake = self._wake_w = -1  # the wake-up pipe signals write to (run())
        self._life_r = self._life_w = -1  # the lifeline: workers read it, only the supervisor writes (run())
        self.first: set[int] = set()  # pids of the first generation
        self.due: dict[int, float] = {}  # slot -> when its replacement starts (monotonic)
        self.delay = [RESTART_DELAY] * len(socks)  # per slot: the next replacement's delay
        self.stopping = False
        self.failed = False
        self.abandoned = False  # a worker still ran KILL_WAIT after its SIGKILL: the stop left it
        self.lost = False  # a worker stopped with writes not stored (it exited WRITES_LOST)

    def spawn(self, slot: int) -> None:
        # A stop (SIGTERM/SIGINT) that comes while a worker is forked waits until the worker is
        # recorded, so that stop() reaches it too; so does SIGCHLD, so that the worker never runs
        # the supervisor's handler (nor writes to its wake-up pipe).
        parent = os.getpid()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD})
        try:
            sock = self.socks[slot]
            if self.stopping or sock is None:  # a stop came (it closed the sockets): start no more
                return
            try:  # the worker writes a byte to it once it serves (not inheritable: not by programs it runs)
                ready_r, ready_w = os.pipe()
            except OSError as exc:  # no file descriptors left: it starts, but its death counts as a failed start
                log.warning("no readiness pipe for index %d (%s: %s)", slot, type(exc).__name__, exc)
                ready_r = ready_w = -1
            try:
                pid = os.fork()
            except OSError as exc:  # EAGAIN, ENOMEM: no process for now; the slot tries again later
                for fd in (ready_r, ready_w):
                    if fd >= 0:
                        os.close(fd)
                delay = self._back_off(slot)
                self.due[slot] = time.monotonic() + delay
                log.error(
                    "could not start a worker for index %d (%s: %s); trying again in %g s",
                    slot, type(exc).__name__, exc, delay,
                )
                return
            if pid == 0:  # the worker
                code = 1
                try:
                    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                        signal.signal(sig, signal.SIG_DFL)
                    signal.set_wakeup_fd(-1)  # before its pipe is closed: the fd may be reused
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                    _die_with(parent)
                    for other in self.socks:  # only the parent may keep another slot's socket open
                        if other is not None and other is not sock:
                            other.close()
                    parents = (self.wake, self._wake_w, self._life_w, ready_r, *self.pipes.values())
                    for fd in (*parents, self.prog if self.prog is not None else -1):  # the parent's
                        if fd >= 0:
                            os.close(fd)
                    if self._life_r >= 0:  # bound its stop once the supervisor is gone
                        bound = kill_after(self.config.shutdown_grace)
                        threading.Thread(target=_outlive_bound, args=(self._life_r, bound), daemon=True).start()
                    code = _worker(self.config, sock, ready_w if ready_w >= 0 else None)
                except BaseException:
                    logging.getLogger("hotloop.server").exception("worker %d failed", os.getpid())
                finally:
                    os._exit(code)
            if ready_w >= 0:
                os.close(ready_w)
                os.set_blocking(ready_r, False)
                self.pipes[pid] = ready_r
            self.workers[pid] = slot
            self.born[pid] = time.monotonic()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        log.info("started worker %d (index %d)", pid, slot)

    def _readiness(self, pid: int) -> bool:
        """Read ``pid``'s readiness pipe (a byte: it is ready; EOF: it died, or closed it, without
        one); whether it said it is ready."""
        fd = self.pipes.pop(pid, -1)
        if fd < 0:
            return False
        try:
            said = os.read(fd, 1)
        except (BlockingIOError, InterruptedError):  # nothing yet (a process it forked holds the pipe)
            self.pipes[pid] = fd
            return False
        os.close(fd)
        if said and pid in self.workers:
            self.ready[pid] = time.monotonic()
            return True
        return False

    def _listens(self, pid: int) -> bool:
        """Whether worker ``pid`` has started listening: the byte on its readiness pipe (read now,
        if it came since the last wait). Its slot's socket cannot tell: the first generation's
        listen from the start, and so does a socket kept while no other listened, which the
        replacement is given. A worker without a pipe (the parent had no descriptor left for one)
        counts as listening: nothing tells when it does, so its start is not bounded."""
        if pid in self.ready:
            return True
        if pid in self.pipes:
            return self._readiness(pid)
        return True

    def _bound_starts(self, now: float) -> float:
        """Stop each worker that has not started listening (:meth:`_listens`) ``STARTUP_TIMEOUT``
        seconds after its fork: one line, SIGTERM, and SIGKILL ``STARTUP_TERM_WAIT`` seconds
        later if it is still there (unless it listens by then: a server stopping on its SIGTERM,
        whose responses get their grace, killed as at a stop); its death is a failed start
        (reap). One that SIGKILL has not ended ``KILL_WAIT`` seconds later (uninterruptible
        sleep) is named once, and its socket stops listening (:meth:`_unlisten`); its slot waits
        for it (a replacement could only hang the same way, and such processes would pile up).
        The time of the next step (``math.inf``: none)."""
        nxt = math.inf
        for pid, slot in list(self.workers.items()):
            late = self.late.get(pid)
            if late is None:
                if pid in self.ready:
                    continue
                due = self.born.get(pid, now) + self.startup_timeout
                if now < due:
                    nxt = min(nxt, due)
                    continue
                if self._listens(pid):
                    continue
                log.error(
                    "worker %d (index %d) has not started listening %.1f s after its start; stopping it "
                    "(SIGTERM, SIGKILL %g s later)", pid, slot, now - self.born.get(pid, now), STARTUP_TERM_WAIT,
                )
                late = (signal.SIGTERM, now, now + STARTUP_TERM_WAIT)
                _kill(pid, signal.SIGTERM)
            elif late[0] and now >= late[2]:
                sent, at, _ = late
                stopped = at + kill_after(self.config.shutdown_grace)
                if sent == signal.SIGTERM and self._listens(pid) and now < stopped:
                    late = (sent, at, stopped)  # it serves, and stops as any server does on SIGTERM
                elif sent == signal.SIGTERM:
                    late = (signal.SIGKILL, now, now + KILL_WAIT)
                    _kill(pid, signal.SIGKILL)
                else:
                    log.error(
                        "worker %d (index %d) still running %g s after its SIGKILL; its slot waits for it", pid, slot, KILL_WAIT
                    )
                    self._unlisten(slot)
                    late = (0, now, math.inf)
            self.late[pid] = late
            nxt = min(nxt, late[2])
        return nxt

    def _unlisten(self, slot: int) -> None:
        """Stop the socket of ``slot``, whose worker outlived its SIGKILL, from listening (a first
        generation's socket listens from the start): shut down, not closed, as the stuck worker
        holds a copy of it that nobody accepts on. New connections then go to the sockets of the
        workers that serve; those queued on it are moved or reset as at a worker's death. Not the
        last socket that listens (the module's docstring)."""
        sock = self.socks[slot]
        if sock is None or not _listening(sock):
            return
        if any(other is not None and other is not sock and _listening(other) for other in self.socks):
            try:
                sock.shutdown(socket.SHUT_RD)
            except OSError:  # closed by a stop meanwhile
                pass

    def stop(self, signum: int = signal.SIGTERM, frame: Any = None) -> None:
        first, self.stopping = not self.stopping, True
        if first:
            log.info("stopping %d workers", len(self.workers))
            # stop accepting: the workers close their copies as they stop; with the parent's
            # open, new connections would queue unanswered until every worker has finished
            self._close_all()
        for pid in list(self.workers):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, pid: int, status: int) -> None:
        self._readiness(pid)  # a byte it wrote before it died, not read yet
        slot = self.workers.pop(pid, 0)
        now = time.monotonic()
        up = now - self.born.pop(pid, now)
        ready = self.ready.pop(pid, None)
        late = self.late.pop(pid, None) is not None
        fd = self.pipes.pop(pid, -1)
        if fd >= 0:
            os.close(fd)
        try:
            self._replace(pid, slot, os.waitstatus_to_exitcode(status), up, ready, now, late)
        finally:  # after its socket is dealt with (the first time imports prometheus-client)
            _free_slots(self.config, pid)  # before any replacement is forked: its pid is not reused yet
            try:
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(pid)
            except Exception:  # its files stay; counters are meant to
                pass

    def _replace(self, pid: int, slot: int, code: int, up: float, ready: float | None, now: float, late: bool = False) -> None:
        """Schedule the replacement of the worker ``pid`` that ended with ``code`` (or stop).
        ``late``: it was stopped because its start ran out of time (a failed start, whatever its
        code: not a reason to stop the server, even in the first generation)."""
        first = pid in self.first
        self.first.discard(pid)
        if self.stopping:
            self.lost = self.lost or code == WRITES_LOST
            return
        if code == STARTUP_FAILURE and first and not late:
            log.error("worker %d failed to start (index %d, exit code %d); stopping", pid, slot, code)
            self.failed = True
            self.stop()
            return
        how = f"exit code {code}" if code >= 0 else f"signal {_signal_name(-code)}"
        if late or code == STARTUP_FAILURE or ready is None or now - ready < STAYED_UP:  # it never served, or barely: back off
            delay = self._back_off(slot)
            level = logging.ERROR
        else:  # it had stayed up: the slot's failures, if any, are over
            delay = self.delay[slot] = RESTART_DELAY
            level = logging.WARNING
        self.due[slot] = time.monotonic() + delay
        self._close_idle()  # its socket first: new connections go to the sockets that are served
        ended = "failed to start" if code == STARTUP_FAILURE or late else "exited"
        log.log(level, "worker %d %s (index %d, %s, up %.1f s); starting another in %g s", pid, ended, slot, how, up, delay)

    def _back_off(self, slot: int) -> float:
        """The slot's delay before its next try; the one after it doubles (up to the bound)."""
        delay = self.delay[slot]
        self.delay[slot] = min(RESTART_DELAY_MAX, delay * 2)
        return delay

    def _close_idle(self) -> None:
        """Close the socket of each slot waiting for its replacement, so that new connections go
        to the sockets that listen, unless no other socket listens (the module's docstring). Run
        at each death, when a worker says it is ready and whenever the supervisor wakes: a socket
        kept while no other listened is closed once another does (its worker's server has started)."""
        for slot in self.due:
            sock = self.socks[slot]
            if sock is None:
                continue
            if any(other is not None and other is not sock and _listening(other) for other in self.socks):
                sock.close()
                self.socks[slot] = None
            elif not _listening(sock) and not self.stopping:  # a replacement that failed before listening: clients wait
                try:
                    sock.listen(BACKLOG)
                except OSError:  # closed by a stop that came meanwhile (its signal handler)
                    continue
                _attach(sock, self.prog)  # a group of its own, if no socket of the old one was left

    def _close_all(self) -> None:
        for i, sock in enumerate(self.socks):
            if sock is not None:
                sock.close()
                self.socks[i] = None

    def _replace_due(self) -> None:
        now = time.monotonic()
        if any(when <= now for when in self.due.values()):
            self._close_idle()  # a socket kept while none other listened, if one does now: a fresh one
        for slot, when in list(self.due.items()):
            if when > now:
                continue
            if self.socks[slot] is None:  # closed when its worker died: a fresh one in the group
                try:
                    self.socks[slot] = _bind(self.config.host, self.port)
                except OSError as exc:  # the address taken by another program, no fds left: later
                    delay = self._back_off(slot)
                    log.error(
                        "could not bind %s:%d again for index %d (%s: %s); trying again in %g s",
                        self.config.host, self.port, slot, type(exc).__name__, exc, delay,
                    )
                    self.due[slot] = now + delay
                    continue
            del self.due[slot]
            self.spawn(slot)

    def _wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, until a signal comes (a worker's death: SIGCHLD; a stop)
        or a worker says it is ready."""
        pipes = {fd: pid for pid, fd in self.pipes.items()}
        poller = select.poll()
        for fd in (self.wake, *pipes):
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(math.ceil(max(0.0, timeout) * 1000)):
            if fd == self.wake:
                _drain(fd)
            elif self._readiness(pipes[fd]) and not self.stopping:
                self._close_idle()  # its socket listens: a socket kept while none other listened can go

    def run(self) -> int:
        # Signals wake the supervisor through a pipe (the self-pipe trick: one that comes between
        # the look for dead workers and the wait still ends the wait). SIGCHLD has a handler so
        # that it writes to it; a worker resets all this as it starts (spawn).
        self.wake, self._wake_w = os.pipe()
        for fd in (self.wake, self._wake_w):
            os.set_blocking(fd, False)
        self._life_r, self._life_w = os.pipe()  # ends (EOF in every worker) as the supervisor does
        old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        old_chld = signal.signal(signal.SIGCHLD, _woken)
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        try:
            return self._supervise()
        finally:
            signal.signal(signal.SIGCHLD, old_chld if old_chld is not None else signal.SIG_DFL)
            signal.set_wakeup_fd(old_wakeup)
            for fd in (self.wake, self._wake_w, self._life_r, self._life_w, *self.pipes.values()):
                os.close(fd)
            self.wake = self._wake_w = self._life_r = self._life_w = -1
            self.pipes.clear()

    def _supervise(self) -> int:
        for slot in range(self.config.workers):
            if self.stopping:  # a stop came during the start: start no more
                break
            self.spawn(slot)
        self.first = set(self.workers)
        deadline: float | None = None
        killed = False  # the workers still running at the deadline were killed (SIGKILL)
        while self.workers or (self.due and not self.stopping):
            if self.stopping and deadline is None:
                self.due.clear()
                deadline = time.monotonic() + kill_after(self.config.shutdown_grace)
            if not self.stopping:
                self._replace_due()
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                if self.workers:
                    break
                pid = 0  # every slot waits for its replacement
            if pid != 0:
                if pid in self.workers:
                    self.reap(pid, status)
                # else a process the supervisor never started: an orphan it reaped as PID 1 (a
                # container's entrypoint without an init), not a worker that died; taken for one
                # (slot 0), it started a worker beside the running one, one more per orphan
                continue
            if not self.stopping:
                self._close_idle()
            now = time.monotonic()
            starts = self._bound_starts(now) if not self.stopping else math.inf
            if deadline is not None and now > deadline:
                if killed:  # SIGKILL has not ended them (uninterruptible sleep): stop without them
                    for p in self.workers:
                        log.error("worker %d still running %g s after its SIGKILL; exiting without it", p, KILL_WAIT)
                    self.abandoned = True
                    break
                for p in list(self.workers):
                    log.error("worker %d did not stop in time; killing it", p)
                    os.kill(p, signal.SIGKILL)
                killed = True
                deadline = now + KILL_WAIT
            wait = IDLE_POLL
            if self.due and not self.stopping:
                wait = min(wait, min(self.due.values()) - now)
            if deadline is not None:
                wait = min(wait, deadline - now)
            self._wait(min(wait, starts - now))
        self._close_all()
        return STARTUP_FAILURE if self.failed else 1 if self.abandoned else WRITES_LOST if self.lost else 0


def serve_workers(config: Config) -> int:
    """Run ``config.workers`` supervised worker processes; the exit code."""
    try:
        config.check()  # first: a refused configuration leaves nothing behind
    except ValueError as exc:
        from hotloop.server.logs import startup_error

        startup_error(config.log_format, f"start-up failed: {exc}", "hotloop: ")
        return STARTUP_FAILURE
    created = None
    held: int | None = None  # the store's server lock (claim_store), shared, until the workers are gone
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        created = tempfile.mkdtemp(prefix="hotloop-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = created  # before prometheus-client is imported
    from hotloop.server.logs import log_config

    logging.config.dictConfig(log_config(config.log_level, config.log_format))
    try:
        if config.store == "memory":  # each worker would have its own: continuations would fail at random
            log.error("start-up failed: --workers needs a shared store: --store sqlite or redis")
            return STARTUP_FAILURE
        try:
            port = _probe(config.host, config.port)  # a port in use: exit 3, as a single server does
            socks = [_listen(config.host, port) for _ in range(config.workers)]
            if config.store == "sqlite":  # shared with another --workers server's, never a single one's
                from hotloop.state.store import claim_store

                held = claim_store(config.db_path, workers=True)
            _prepare_store(config)
        except ValueError as exc:  # another server's store
            log.error("start-up failed: %s", exc)
            return STARTUP_FAILURE
        except Exception as exc:  # the data dir or the store file (sqlite3.Error): one line, exit 3
            log.error("start-up failed: %s: %s", type(exc).__name__, exc)
            return STARTUP_FAILURE
        log.info("serving on http://%s:%d with %d workers", config.host, port, config.workers)
        prog = _request_migration(socks)
        try:
            return Supervisor(config, socks, prog).run()
        finally:  # its workers are gone: so are the limits they shared
            if prog is not None:
                os.close(prog)
            if config.store == "sqlite":
                from hotloop.tenants import sqlite_limits

                sqlite_limits.remove(sqlite_limits.limits_path(config.db_path))
    finally:
        if held is not None:
            os.close(held)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
