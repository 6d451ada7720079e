"""o200k_base token counts: the native ``TokenCounter`` against tiktoken (asv).

``words_2kb`` is a 2 KB tool output of English words (``hotloop bench``'s turns); ``python_32kb``
is 32 KB of hotloop's own Python source, where tiktoken's regex engine is slowest (whitespace
runs, punctuation). Each text's count is checked against tiktoken before it is timed (DESIGN
principle 10). There is no ``setup``: asv then batches the calls, where a ``setup`` would have it
time one call per sample (asv#966; see ``bench_native.batched``), and a 2 KB count is a few
microseconds. The first call reads the vocabulary (~0.5 s), so a ``--quick`` run's single
sample says nothing.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import hotloop
from hotloop import _native, tokenizer
from hotloop.bench.turns import _output

IMPLS = ["native", "tiktoken"]
TEXTS = ["words_2kb", "python_32kb"]


def _python_source(size: int) -> str:
    root = Path(hotloop.__file__).parent
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.py")))
    assert len(text) >= size
    return text[:size]


_TEXT: dict[str, Callable[[], str]] = {
    "words_2kb": lambda: _output(random.Random(0), 2048),
    "python_32kb": lambda: _python_source(32 * 1024),
}


_COUNTERS: dict[str, Callable[[str], Any]] = {}


def _counter(impl: str) -> Callable[[str], Any]:
    if not _COUNTERS:
        _COUNTERS["native"] = _native.TokenCounter(tokenizer._vocabulary()).count
        _COUNTERS["tiktoken"] = tokenizer.encoding().encode_ordinary
    return _COUNTERS[impl]


class CountTokens:
    params = (IMPLS, TEXTS)
    param_names = ["impl", "text"]

    def _prepare(self, impl: str, text: str) -> None:
        enc = tokenizer.encoding()
        self.text = _TEXT[text]()
        self.count = _counter(impl)
        got = self.count(self.text)
        assert (got if isinstance(got, int) else len(got)) == len(enc.encode_ordinary(self.text))
        self._params = (impl, text)

    def time_count(self, impl: str, text: str) -> None:
        if self.__dict__.get("_params") != (impl, text):
            self._prepare(impl, text)
        self.count(self.text)
