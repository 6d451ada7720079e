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
