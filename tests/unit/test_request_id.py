"""Request ids: ``req_`` and 32 hex digits, unique, and never shared with a forked worker."""

from __future__ import annotations

import os
import re

from hotloop.server.common import request_id


def test_request_ids_are_unique_and_well_formed() -> None:
    ids = [request_id() for _ in range(2000)]  # several draws of the pool
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in ids)


def test_a_forked_child_does_not_repeat_the_parents_ids() -> None:
    request_id()  # the pool holds bytes the parent has not handed out yet
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(w, " ".join(request_id() for _ in range(5)).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        child = fh.read().split()
    os.waitpid(pid, 0)
    parent = [request_id() for _ in range(5)]
    assert len(child) == 5 and not set(child) & set(parent)
