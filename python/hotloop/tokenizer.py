"""The o200k_base tokenizer, built offline from the vocabulary shipped in the package.

tiktoken would download the vocabulary at first use, which fails on machines without network, so
the file ships as package data (``data/o200k_base.tiktoken.gz``), is checked against its published
sha256, and is turned into a :class:`tiktoken.Encoding` once per process (~0.5 s; call
:func:`preload` at start-up, off the event loop).

Token counts are cached *per item* by the pipeline: splitting text at arbitrary offsets changes
tokens at the seam, while each chat item sits between special tokens, so per-item counts add up.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import threading
from importlib import resources

import tiktoken

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

# The pattern of tiktoken_ext/openai_public.py for o200k_base.
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
_encoding: tiktoken.Encoding | None = None


class VocabularyError(RuntimeError):
    """The shipped vocabulary is missing or corrupt (a broken installation)."""


def _load() -> tiktoken.Encoding:
    raw = gzip.decompress(resources.files("hotloop").joinpath("data/o200k_base.tiktoken.gz").read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != O200K_SHA256:
        raise VocabularyError(f"o200k_base vocabulary checksum mismatch: {digest}")
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in raw.splitlines() if line)}
    return tiktoken.Encoding(
        name="o200k_base", pat_str=O200K_PAT, mergeable_ranks=ranks, special_tokens=SPECIAL_TOKENS
    )


def encoding() -> tiktoken.Encoding:
    """The process-wide encoding (built on first use)."""
    global _encoding
    enc = _encoding
    if enc is None:
        with _lock:
            if _encoding is None:
                _encoding = _load()
            enc = _encoding
    return enc


def preload() -> None:
    encoding()


def claim() -> None:
    """Make the calling thread the tokenizer's fast thread: call it on the event loop's thread at
    start-up, before any other thread counts. tiktoken shares its regex caches between threads
    through pools that serve only their first user without locking; every other thread takes a
    locked slow path on each match, which made counting 2 KB of text about 55% slower (42 against
    65-70 us). Small inputs are counted on the event loop, which must be that first user; only
    inputs of ``INLINE_TOKENIZE_CHARS`` and more are counted on the tokenizer thread."""
    encoding().encode_ordinary("hotloop")


# Longer texts are counted in pieces of about this many characters, so counting never builds a
# list of all token ids at once (~40 bytes a token: 300 MB for a 32 MiB input).
COUNT_CHUNK = 1 << 20


def _seam(text: str, lo: int, hi: int) -> int:
    """A cut in ``text[lo:hi]`` that no o200k piece crosses (0 if there is none): a single space
    between two non-space characters. Such a space always begins a new piece (no pattern joins a
    non-space character to the space after it, and the piece starting at the space does not
    depend on what came before), so the counts of both sides add up to the count of the whole."""
    while True:
        p = text.rfind(" ", lo, hi)
        if p <= lo:
            return 0
        if not text[p - 1].isspace() and not text[p + 1].isspace():
            return p
        hi = p


def count(text: str) -> int:
    """Tokens in ``text`` (special-token text counted as ordinary text, never rejected)."""
    if not text:
        return 0
    encode = encoding().encode_ordinary
    chunk = COUNT_CHUNK
    total = 0
    start = 0
    while len(text) - start > chunk:
        cut = _seam(text, start + chunk // 2, start + chunk)
        if not cut:
            break  # no safe cut near here: count the rest at once
        total += len(encode(text[start:cut]))
        start = cut
    return total + len(encode(text[start:] if start else text))


def encode(text: str) -> list[int]:
    return encoding().encode_ordinary(text)
