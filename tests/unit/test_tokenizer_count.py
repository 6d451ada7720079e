"""Counting long texts in pieces gives exactly the count of the whole text."""

from __future__ import annotations

import random

import pytest

from hotloop import tokenizer

_PIECES = [
    " ", "  ", "   ", "\n", " \n", "\n\n", "\t", " \t ", "\r\n", ".", ". ", ",", "'s", "'LL", "/", " /",
    "word", "Word", "WORD", "wOrD", "x", "123", "12345", " 42", "é", "naïve", "日本語", "Привет", "😀",
    "🙂 ", "-", "--", " -", "()", "{\"a\": 1}", "<|endoftext|>", "don't", "I'm", "_", "__init__",
]


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_PIECES) for _ in range(n))


@pytest.mark.parametrize("chunk", [8, 16, 64, 300])
def test_counting_in_pieces_equals_counting_the_whole(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    enc = tokenizer.encoding()
    rng = random.Random(chunk)
    texts = [_text(rng, rng.randrange(1, 400)) for _ in range(300)]
    texts += ["a " * 500, " " * 500, "a" * 500, "a  " * 300, "x\n" * 300]
    monkeypatch.setattr(tokenizer, "COUNT_CHUNK", chunk)
    for t in texts:
        assert tokenizer.count(t) == len(enc.encode_ordinary(t)), repr(t[:80])


def test_long_texts_are_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    enc = tokenizer.encoding()
    real = enc.encode_ordinary

    class Spy:
        def encode_ordinary(self, text: str) -> list[int]:
            seen.append(len(text))
            return real(text)

    monkeypatch.setattr(tokenizer, "encoding", lambda: Spy())
    monkeypatch.setattr(tokenizer, "COUNT_CHUNK", 1000)
    text = "alpha beta, gamma 42 " * 1000
    assert tokenizer.count(text) == len(real(text))
    assert len(seen) > 20 and max(seen) <= 1000


_FIRST_ENCODER = r"""
import asyncio, threading
from hotloop import tokenizer
from hotloop.config import Config
from hotloop.server.runner import make_app

calls = []
enc = tokenizer.encoding()
real = enc.encode_ordinary
enc.encode_ordinary = lambda text: (calls.append(threading.get_ident()), real(text))[1]

async def main():
    app = make_app(Config(store="memory", sim_rate=0))  # the simulator counts its corpus at start
    await app.startup()
    try:
        print(calls[0] == threading.get_ident(), len(set(calls)) > 1)
    finally:
        await app.shutdown()

asyncio.run(main())
"""


def test_the_event_loop_thread_counts_first() -> None:
    """tiktoken's regex caches serve their first thread without a lock and every other thread
    through a locked slow path: the server's start-up makes the event loop's thread (which counts
    most inputs) the first, before the simulator counts its corpus on another thread."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FIRST_ENCODER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]
