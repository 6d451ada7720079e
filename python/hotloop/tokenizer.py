"""The o200k_base tokenizer, built offline from the vocabulary shipped in the package.

tiktoken would download the vocabulary at first use, which fails on machines without network, so
the file ships as package data (``data/o200k_base.tiktoken.gz``), is checked against its published
sha256 and read once per process (~0.3 s; call :func:`preload` at start-up, off the event loop).

:func:`count` is the hot path: an ``_accel.TokenCounter`` gives exactly tiktoken's count without
running tiktoken (its regex engine was most of the cost), from the same vocabulary. The
:class:`tiktoken.Encoding` itself (:func:`encoding`, :func:`encode`) is built only when something
asks for token ids.

Token counts are cached *per item* by the pipeline: splitting text at arbitrary offsets changes
tokens at the seam, while each chat item sits between special tokens, so per-item counts add up.
"""

from __future__ import annotations

import binascii
import gzip
import hashlib
import threading
from importlib import resources
from typing import Any, Callable

import tiktoken

from hotloop._accel import TokenCounter

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

# The pattern of tiktoken_ext/openai_public.py for o200k_base. The native TokenCounter finds its
# pieces with hand-written rules (rust/core/src/tokens.rs): a change here must be made there too.
O200K_PAT = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
SPECIAL_TOKENS = {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}

# Tokens a chat format spends around each item (role header and separators): the count OpenAI's
# cookbook uses for its chat models. Added per item by the pipeline, plus a few per request.
TOKENS_PER_ITEM = 4
TOKENS_PER_REQUEST = 3

_lock = threading.Lock()
_ranks: dict[bytes, int] | None = None
_encoding: tiktoken.Encoding | None = None
_counter: TokenCounter | None = None


class VocabularyError(RuntimeError):
    """The shipped vocabulary is missing or corrupt (a broken installation)."""


def _vocabulary() -> dict[bytes, int]:
    """The mergeable ranks, read on first use (under ``_lock``)."""
    global _ranks
    if _ranks is None:
        raw = gzip.decompress(resources.files("hotloop").joinpath("data/o200k_base.tiktoken.gz").read_bytes())
        digest = hashlib.sha256(raw).hexdigest()
        if digest != O200K_SHA256:
            raise VocabularyError(f"o200k_base vocabulary checksum mismatch: {digest}")
        # Lines of "<base64 token> <rank>". The checksum above fixes the file, whose ranks run
        # 0, 1, 2, ... in line order: the ranks are the line numbers, not parsed (b64decode per
        # line and int() per rank took 0.38 s of every start-up, this 0.11 s).
        fields = raw.split()
        tokens = fields[0::2]
        _ranks = dict(zip(map(binascii.a2b_base64, tokens), range(len(tokens))))
    return _ranks


def encoding_of(ranks: dict[bytes, int]) -> tiktoken.Encoding:
    """The o200k_base encoding over ``ranks`` (the pure ``TokenCounter`` builds its own so over
    ranks other than the process's; over those it uses :func:`encoding`)."""
    return tiktoken.Encoding(
        name="o200k_base", pat_str=O200K_PAT, mergeable_ranks=ranks, special_tokens=SPECIAL_TOKENS
    )


def _built(name: str, build: Callable[[], Any]) -> Any:
    """The module global ``name``, built by ``build`` on first use (once, under ``_lock``)."""
    value = globals()[name]
    if value is None:
        with _lock:
            value = globals()[name]
            if value is None:
                value = globals()[name] = build()
    return value


def encoding() -> tiktoken.Encoding:
    """The process-wide encoding (built on first use, ~0.2 s on top of the vocabulary)."""
    enc: tiktoken.Encoding = _encoding or _built("_encoding", lambda: encoding_of(_vocabulary()))
    return enc


def counter() -> TokenCounter:
    """The process-wide counter (built on first use: the native one in 30-40 ms on top of the
    vocabulary)."""
    c: TokenCounter = _counter or _built("_counter", lambda: TokenCounter(_vocabulary()))
    return c


def preload() -> None:
    """Read the vocabulary and build the counter (start-up, off the event loop)."""
    counter()


def claim() -> None:
    """Make the calling thread the counter's fast thread: call it on the event loop's thread at
    start-up, before any other thread counts. tiktoken shares its regex caches between threads
    through pools that serve only their first user without locking; every other thread takes a
    locked slow path on each match, which made counting 2 KB of text about 55% slower (42 against
    65-70 us). That matters to the pure ``TokenCounter``, which counts with tiktoken; the native
    one runs no regex and shares nothing between threads (for it this only builds the counter).
    Small inputs are counted on the event loop, which must be that first user; only inputs of
    ``INLINE_TOKENIZE_CHARS`` and more are counted on the tokenizer thread."""
    counter().count("hotloop")


def claim_encoding() -> None:
    """:func:`claim` for the encoding itself, for a caller that makes token ids on the event loop
    (the simulator's answers): call it on that thread before any other thread encodes."""
    encoding().encode_ordinary("hotloop")


def count(text: str) -> int:
    """Tokens in ``text`` (special-token text counted as ordinary text, never rejected): exactly
    ``len(encoding().encode_ordinary(text))``. The native counter builds no list of token ids,
    so a long text costs no memory to count; the pure one counts long texts in pieces cut where
    no o200k piece crosses, for the same reason."""
    if not text:
        return 0
    return counter().count(text)


def encode(text: str) -> list[int]:
    return encoding().encode_ordinary(text)
