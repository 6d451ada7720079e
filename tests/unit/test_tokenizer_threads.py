"""The tokenizer's threads: the event loop's thread is the first user of every tiktoken encoding the server
uses (the counts themselves: tests.unit.test_token_counter)."""

from __future__ import annotations

import pytest

_FIRST_ENCODER = r"""
import asyncio, threading
from hotloop import tokenizer
from hotloop.config import Config
from hotloop.server.runner import make_app

calls = []  # per encoding built: the threads that encoded with it, in order
build = tokenizer.encoding_of

def spied(ranks):
    enc = build(ranks)
    seen = []
    calls.append(seen)
    real = enc.encode_ordinary
    enc.encode_ordinary = lambda text: (seen.append(threading.get_ident()), real(text))[1]
    return enc

tokenizer.encoding_of = spied

async def main():
    app = make_app(Config(store="memory", sim_rate=0))  # the simulator encodes its corpus at start
    await app.startup()
    try:
        me = threading.get_ident()
        used = [seen for seen in calls if seen]
        print(len(calls), len(used), all(seen[0] == me for seen in used), any(len(set(seen)) > 1 for seen in used))
    finally:
        await app.shutdown()

asyncio.run(main())
"""


@pytest.mark.parametrize("pure", [False, True])
def test_the_event_loop_thread_encodes_first(pure: bool) -> None:
    """tiktoken's regex caches serve their first thread without a lock and every other thread
    through a locked slow path: every tiktoken encoding the server uses (the simulator's, and the
    pure twin's counter) has the event loop's thread, which uses it most, as its first user,
    before the simulator makes its corpus on another thread."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HOTLOOP_PURE_PYTHON": "1" if pure else "0"}
    out = subprocess.run([sys.executable, "-c", _FIRST_ENCODER], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    built, used, first, shared = out.stdout.split()
    # one encoding, the simulator's: the pure counter counts with it (not a second ~40 MB copy)
    assert (int(built), int(used)) == (1, 1)
    assert (first, shared) == ("True", "True")
