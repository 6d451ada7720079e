"""The ``--workers`` supervisor's request migration set-up (:func:`_request_migration`), without
forking: when it loads the eBPF program, what it says when nothing will move a dead worker's
queued connections, and that the program leaves the spreading of new connections to the kernel's
hash. Real sockets on 127.0.0.1; the program's own test is skipped where it cannot be loaded."""

from __future__ import annotations

import logging
import os
import select
import socket
from collections import Counter

import pytest

import hotloop.server.workers as w

SAID = "connections queued on the socket of a worker that dies are reset"


def _group(n: int) -> list[socket.socket]:
    first = w._listen("127.0.0.1", 0)
    port = first.getsockname()[1]
    return [first, *(w._listen("127.0.0.1", port) for _ in range(n - 1))]


@pytest.mark.parametrize(
    ("req", "loads", "said"),
    [
        (1, True, False),  # the sysctl moves them: no program loaded, nothing to say
        (0, True, False),  # the program moves them
        (0, False, True),  # no CAP_BPF: nothing moves them
        (None, True, True),  # no sysctl: a kernel before 5.14, where a program would move nothing
    ],
)
def test_the_program_is_loaded_only_where_it_moves_requests_and_the_log_says_when_none_does(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, req: int | None, loads: bool, said: bool
) -> None:
    loaded: list[int] = []
    tried: list[int] = []

    def program() -> int | None:
        tried.append(1)
        if not loads:
            return None
        r, wr = os.pipe()  # a descriptor to close; attaching it is faked too
        os.close(wr)
        loaded.append(r)
        return r

    monkeypatch.setattr(w, "_migrate_req", lambda: req)
    monkeypatch.setattr(w, "_migration_program", program)
    monkeypatch.setattr(w, "_attach", lambda sock, prog: prog is not None)
    socks = _group(2)
    try:
        with caplog.at_level(logging.INFO, logger="hotloop.server"):
            prog = w._request_migration(socks)
    finally:
        for s in socks:
            s.close()
        for fd in loaded:
            os.close(fd)
    assert (prog is not None) == (req == 0 and loads)
    assert (SAID in caplog.text) == said, caplog.text
    assert len(tried) == (1 if req == 0 else 0)  # never loaded where the sysctl decides


def test_the_program_leaves_new_connections_spread_by_their_hash() -> None:
    """Two listening sockets with the program attached: 64 connections reach both (the program
    selects none, so the kernel picks by hash as without it); one that starts listening later
    joins the group (its listen does not fail) and gets its share too."""
    prog = w._migration_program()
    if prog is None:
        pytest.skip("the eBPF program cannot be loaded here (no CAP_BPF, seccomp, kernel)")
    socks = _group(2)
    try:
        assert all(w._attach(s, prog) for s in socks)
        late = w._bind("127.0.0.1", socks[0].getsockname()[1])  # as a replacement's fresh socket
        socks.append(late)
        late.listen(64)
        got: Counter[int] = Counter()
        port = socks[0].getsockname()[1]
        for _ in range(96):
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                ready, _, _ = select.select(socks, [], [], 2.0)
                assert ready, "a connection no socket got"
                for s in ready:
                    conn, _ = s.accept()
                    conn.close()
                    got[socks.index(s)] += 1
        assert sorted(got) == [0, 1, 2] and min(got.values()) >= 10, got
    finally:
        for s in socks:
            s.close()
        os.close(prog)


def test_seccomp_filtered_reads_the_process_status(tmp_path: "os.PathLike[str]") -> None:
    status = os.path.join(tmp_path, "status")
    for field, filtered in (("0", False), ("2", True), ("1", True)):
        with open(status, "w") as fh:
            fh.write(f"Name:\tpython\nSeccomp:\t{field}\nSeccomp_filters:\t{int(field == '2')}\n")
        assert w._seccomp_filtered(status) is filtered
    assert w._seccomp_filtered(os.path.join(tmp_path, "missing")) is True  # unknown: not tried


_TRAP_BPF = r"""
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
# classic BPF: load the syscall number; bpf (321 on x86_64) -> SECCOMP_RET_TRAP, else allow
prog = b"".join([struct.pack("<HBBI", 0x20, 0, 0, 0), struct.pack("<HBBI", 0x15, 0, 1, 321),
                 struct.pack("<HBBI", 0x06, 0, 0, 0x00030000), struct.pack("<HBBI", 0x06, 0, 0, 0x7FFF0000)])
buf = ctypes.create_string_buffer(prog, len(prog))
fprog = ctypes.create_string_buffer(struct.pack("<HxxxxxxQ", 4, ctypes.addressof(buf)), 16)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
import hotloop.server.workers as w
w._migrate_req = lambda: 0  # as on a host with the sysctl at its default
print("program", w._migration_program(), "filtered", w._seccomp_filtered(), flush=True)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64" or not os.path.exists("/proc/self/status"), reason="x86_64 Linux")
def test_under_a_seccomp_filter_that_kills_for_bpf_the_program_is_not_tried() -> None:
    """systemd's ``SystemCallFilter=`` without ``SystemCallErrorNumber=`` answers a syscall it
    does not allow with SIGSYS, not an error: the supervisor died at start when it tried bpf()."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _TRAP_BPF], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "program None filtered True" in done.stdout
