"""``TokenCounter`` against tiktoken: the native counter (its own pre-tokenizer and merge), the
pure twin and ``tokenizer.encoding().encode_ordinary`` give the same count on the repository's own
files, on adversarial strings for every rule of the o200k pattern and on random mixes.

The native assertions run whenever ``hotloop._native`` imports (``HOTLOOP_PURE_PYTHON=1`` too);
they skip only when it is not built, unless ``HOTLOOP_REQUIRE_NATIVE=1``. The property test is
tests/property/test_token_counter_props.py.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken

from hotloop import _accel, _pure, tokenizer

REQUIRE_NATIVE = os.environ.get("HOTLOOP_REQUIRE_NATIVE", "") == "1"
try:
    from hotloop import _native
except ImportError as exc:
    if REQUIRE_NATIVE:
        raise
    _native = None  # type: ignore[assignment]
    NATIVE_MISSING = f"hotloop._native is not built: {exc}"
else:
    NATIVE_MISSING = ""

needs_native = pytest.mark.skipif(_native is None, reason=NATIVE_MISSING or "-")

REPO = Path(__file__).resolve().parents[2]
# installed JavaScript packages and caches: not the repository's files
SKIP_DIRS = {"node_modules", "__pycache__", ".hypothesis", ".pytest_cache", ".mypy_cache"}


@pytest.fixture(scope="module")
def enc() -> tiktoken.Encoding:
    return tokenizer.encoding()


@pytest.fixture(scope="module")
def counters() -> dict[str, Any]:
    ranks = tokenizer._vocabulary()
    out: dict[str, Any] = {"pure": _pure.TokenCounter(ranks)}
    if _native is not None:
        out["native"] = _native.TokenCounter(ranks)
    return out


def assert_counts(enc: tiktoken.Encoding, counters: dict[str, Any], texts: list[str], label: str = "") -> None:
    for text in texts:
        want = len(enc.encode_ordinary(text))
        got = {name: c.count(text) for name, c in counters.items()}
        assert got == dict.fromkeys(counters, want), f"{label} {text[:120]!r} (len {len(text)})"


def test_both_implementations_are_checked(counters: dict[str, Any]) -> None:
    """The counts below compare the native counter only when it is built: say so when it is not."""
    if _native is None:
        pytest.skip(NATIVE_MISSING)
    assert set(counters) == {"native", "pure"}
    assert type(counters["native"]).__module__ == "hotloop._native"


# -- the repository's own text ------------------------------------------------------------------


def _repo_texts() -> Iterator[tuple[str, str]]:
    roots = [REPO / "python", REPO / "rust", REPO / "tests"]
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
            for name in sorted(filenames):
                path = Path(dirpath) / name
                try:
                    text = path.read_bytes().decode("utf-8")
                except UnicodeDecodeError:
                    continue  # the vocabulary, built extensions: not text
                if "\0" not in text:
                    yield str(path.relative_to(REPO)), text
    yield "README.md", (REPO / "README.md").read_text(encoding="utf-8")


def test_repository_files(enc: tiktoken.Encoding, counters: dict[str, Any]) -> None:
    texts = list(_repo_texts())
    assert len(texts) > 100 and any(p.endswith(".rs") for p, _ in texts)
    for path, text in texts:
        assert_counts(enc, counters, [text], path)


# -- adversarial strings, per rule of the pattern ----------------------------------------------

SPACES = [" ", "\t", "\r", "\n", "\u00a0", "\u2028", "\u3000", "\x0b", "\x0c", "\x85", "\u2029"]
CONTRACTIONS = ["s", "t", "re", "ve", "m", "ll", "d"]
MARKS = ["\u0301", "\u0308", "\u20dd", "\u0903"]  # Mn, Mn, Me, Mc
LETTERS = ["a", "A", "z", "Z", "é", "É", "ǅ", "ʰ", "中", "ß", "Σ", "ς", "ſ", "K", "\u212a", "ﬀ"]
OTHERS = ["!", "/", ".", "'", '"', "_", "-", "😀", "\U0001f1fa\U0001f1f8", "\U00010400", "\U0001d400", "½", "²", "Ⅻ", "٣"]


def _adversarial() -> list[str]:
    out: list[str] = []
    # whitespace runs of every mix, before letters, digits, punctuation and the end
    rng = random.Random(1)
    for n in range(1, 7):
        for _ in range(60):
            run = "".join(rng.choice(SPACES) for _ in range(n))
            for after in ["", "x", "X", "1", "!", "\u0301", " x", "\n"]:
                out.append("a" + run + after)
                out.append(run + after)
    # contractions in every case, after every kind of letter run and alone
    for c in CONTRACTIONS:
        forms = {c, c.upper(), c.capitalize(), c[0] + c[1:].upper()}
        if c == "s":
            forms.add("ſ")
        for form in forms:
            for before in ["", "it", "IT", "It", "iT", "中", "ʰ", "a\u0301", "\u0301", " x", "!", "1", "ǅ", " "]:
                for after in ["", "x", "X", " ", "'", "'s", "1"]:
                    out.append(before + "'" + form + after)
    # digit runs of 1-10, next to letters, spaces and other numbers
    for n in range(1, 11):
        digits = "1234567890"[:n]
        out += [digits, " " + digits, "x" + digits + "y", digits + "½²", "٣" * n, "a " + digits + " b"]
    # combining marks after letters, spaces, punctuation, digits, line breaks and at the start
    for m in MARKS:
        for before in ["", "a", "A", "AB", " ", "  ", "!", "!!", "1", "\n", "\t", "中", "ʰ", "ǅ", "'", m]:
            for after in ["", "a", "A", "ABC", "Abc", "'s", "'S", " ", "1", "!", m]:
                out.append(before + m + after)
    # letters of every class in runs
    for a in LETTERS:
        for b in LETTERS:
            out += [a + b, " " + a + b + "'s", a + b + b + a + "!", "!" + a + b]
    # punctuation runs followed by line breaks and slashes, with and without a leading space
    for p in ["!", "...", "//", "}", "*/", "\U0001f600", "_"]:
        for tail in ["\r\n/", "\n/", "/\n", "\r\r\n//", "\n \n", "\r\n/x", "/a"]:
            out += [p + tail, " " + p + tail, "x " + p + tail, "  " + p + tail]
    for o in OTHERS:
        out += [o, o * 3, " " + o, "a" + o + "b", o + "\u0301", "\t" + o, o + "'s"]
    return out


ADVERSARIAL = _adversarial()


def test_adversarial_strings(enc: tiktoken.Encoding, counters: dict[str, Any]) -> None:
    assert len(ADVERSARIAL) > 3000
    assert_counts(enc, counters, ADVERSARIAL)
    # and all of them at once: pieces meeting at other seams
    assert_counts(enc, counters, ["".join(ADVERSARIAL), "\n".join(ADVERSARIAL), " ".join(ADVERSARIAL)])


@pytest.mark.parametrize(
    "text",
    ["!" * 200_000, "a" * 200_000, "A" * 200_000, " " * 200_000 + "a", "\n" * 100_000 + " x", "中" * 70_000,
     "1" * 200_000, "ab" * 100_000, "\u0301" * 100_000],
    ids=["bang", "lower", "upper", "spaces", "newlines", "cjk", "digits", "ab", "marks"],
)
def test_long_runs(enc: tiktoken.Encoding, counters: dict[str, Any], text: str) -> None:
    assert_counts(enc, counters, [text])


def _random_code_point(rng: random.Random) -> str:
    while True:
        cp = rng.choice([rng.randrange(0x80), rng.randrange(0x800), rng.randrange(0x10000), rng.randrange(0x110000)])
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def test_random_mix(enc: tiktoken.Encoding, counters: dict[str, Any]) -> None:
    rng = random.Random(20240607)
    alphabet = SPACES + MARKS + LETTERS + OTHERS + ["'", "'s", "'LL", "'ſ", "1", "22", "333", "\r\n", "a", "the", " "]
    texts = []
    for _ in range(6000):
        n = rng.randrange(1, 24)
        texts.append("".join(rng.choice(alphabet) if rng.random() < 0.8 else _random_code_point(rng) for _ in range(n)))
    assert_counts(enc, counters, texts)


# -- the contract ------------------------------------------------------------------------------


SURROGATES = ["a\ud800b", "\udfff", "x \ud83d\ude00 y", "\ud83d", "\ude00\ud83d", "\ud800\ud800\udc00", "it'\ud800s"]


@pytest.mark.parametrize("text", SURROGATES)
def test_lone_surrogates_count_as_tiktoken_encodes_them(
    enc: tiktoken.Encoding, counters: dict[str, Any], text: str
) -> None:
    """tiktoken retries a text it cannot convert to UTF-8 after a UTF-16 round trip: a high and a
    low surrogate become one character, every other surrogate U+FFFD."""
    assert_counts(enc, counters, [text, text * 3000])
    fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    assert len(enc.encode_ordinary(fixed)) == len(enc.encode_ordinary(text))


def test_empty_and_special_token_text(enc: tiktoken.Encoding, counters: dict[str, Any]) -> None:
    for c in counters.values():
        assert c.count("") == 0
    assert_counts(enc, counters, ["<|endoftext|>", "a<|endofprompt|>b", "<|endoftext|>" * 50])


def _impls() -> list[Any]:
    return [_pure.TokenCounter] + ([_native.TokenCounter] if _native is not None else [])


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the class is the observable
        return ("err", type(exc))


BYTES: dict[Any, Any] = {bytes([b]): b for b in range(256)}


@pytest.mark.parametrize(
    ("ranks", "exc"),
    [
        (list(BYTES.items()), TypeError),
        ({**BYTES, "ab": 300}, TypeError),
        ({**BYTES, b"ab": "300"}, TypeError),
        ({**BYTES, b"ab": 1.0}, TypeError),
        ({**BYTES, b"ab": -1}, OverflowError),
        ({**BYTES, b"ab": 1 << 32}, OverflowError),
        ({k: v for k, v in BYTES.items() if k != b"\x80"}, ValueError),
        ({**BYTES, b"ab": 7}, ValueError),
        ({**BYTES, b"ab": (1 << 32) - 1}, None),
    ],
)
def test_construction_checks_agree(ranks: Any, exc: type | None) -> None:
    results = [outcome(impl, ranks) for impl in _impls()]
    for kind, value in results:
        if exc is None:
            assert kind == "ok"
        else:
            assert (kind, value) == ("err", exc)


@pytest.mark.parametrize("bad", [b"text", None, 3, ["a"]])
def test_count_takes_only_str(counters: dict[str, Any], bad: object) -> None:
    for c in counters.values():
        with pytest.raises(TypeError):
            c.count(bad)


def test_pieces_through_a_vocabulary_of_every_substring() -> None:
    """o200k's own vocabulary hides most splitting mistakes: it was trained on these pieces, so
    hardly a token spans two of them, and joining two pieces seldom changes the count. Over a
    vocabulary holding every substring of the texts, each piece is one token and a count is the
    number of pieces."""
    texts = [t for t in ADVERSARIAL if len(t.encode()) <= 16]
    rng = random.Random(11)
    alphabet = LETTERS + MARKS + SPACES + OTHERS + ["'s", "'T", "1", "22"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 7))) for _ in range(3000)]
    texts = [t for t in dict.fromkeys(texts) if len(t.encode()) <= 20]
    ranks = dict(BYTES)
    for t in texts:
        b = t.encode()
        for i in range(len(b)):
            for j in range(i + 2, len(b) + 1):
                ranks.setdefault(b[i:j], len(ranks))
    enc = tokenizer.encoding_of(ranks)
    counters: dict[str, Any] = {"pure": _pure.TokenCounter(ranks)}
    if _native is not None:
        counters["native"] = _native.TokenCounter(ranks)
    assert len(texts) > 2000
    assert_counts(enc, counters, texts)
    assert len(enc.encode_ordinary("\u0301ABC")) == 2  # the mark alone, then "ABC"


def _small_vocabulary(rng: random.Random) -> dict[bytes, int]:
    """The single bytes and merges of a few letters, ranked at random: long chains of merges,
    ties between equal pairs, tokens no merge of their parts forms."""
    ranks = dict(BYTES)
    pool = list(range(256, 256 + 400))
    rng.shuffle(pool)
    for _ in range(rng.randrange(10, 200)):
        token = bytes(rng.choice(b"ab !'") for _ in range(rng.randrange(2, 7)))
        if token not in ranks:
            ranks[token] = pool.pop()
    return ranks


def test_merges_over_small_vocabularies() -> None:
    """The byte-pair merge itself, where o200k's vocabulary hides little: both counters against a
    tiktoken encoding with the o200k pattern over random small vocabularies."""
    rng = random.Random(7)
    for _ in range(40):
        ranks = _small_vocabulary(rng)
        enc = tokenizer.encoding_of(ranks)
        counters: dict[str, Any] = {"pure": _pure.TokenCounter(ranks)}
        if _native is not None:
            counters["native"] = _native.TokenCounter(ranks)
        texts = ["".join(rng.choice("ab !'") for _ in range(rng.randrange(1, 300))) for _ in range(60)]
        texts += ["a" * rng.randrange(100, 2000), "!" * rng.randrange(100, 2000), "ab" * 600]
        assert_counts(enc, counters, texts)


@needs_native
def test_counting_in_threads(enc: tiktoken.Encoding, counters: dict[str, Any]) -> None:
    """One counter, many threads at once (long texts release the GIL)."""
    native = counters["native"]
    texts = ["".join(ADVERSARIAL[i::7]) * 3 for i in range(7)]
    want = [len(enc.encode_ordinary(t)) for t in texts]
    got: dict[int, list[int]] = {}

    def work(k: int) -> None:
        got[k] = [native.count(t) for t in texts for _ in range(3)][::3]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == dict.fromkeys(range(4), want)


# -- hotloop.tokenizer ---------------------------------------------------------------------------


def test_tokenizer_counts_with_the_accelerated_counter(enc: tiktoken.Encoding) -> None:
    tokenizer.preload()
    assert isinstance(tokenizer.counter(), _accel.TokenCounter)
    assert tokenizer.counter() is tokenizer.counter()
    tokenizer.claim()
    assert tokenizer.count("") == 0
    for text in ADVERSARIAL[::50] + ["<|endoftext|>", "hello world"]:
        assert tokenizer.count(text) == len(tokenizer.encode(text)) == len(enc.encode_ordinary(text))


def test_the_pure_counter_counts_long_texts_in_pieces(
    enc: tiktoken.Encoding, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The twin builds token lists: a long text is counted in pieces cut at seams no piece
    crosses, and the pieces add up to the count of the whole."""
    counter = _pure.TokenCounter(tokenizer._vocabulary())
    seen: list[int] = []
    real = enc.encode_ordinary

    class Spy:
        def encode_ordinary(self, text: str) -> list[int]:
            seen.append(len(text))
            return real(text)

    counter._encoding = Spy()  # type: ignore[assignment]
    rng = random.Random(3)
    pieces = [" ", "  ", "\n", " \n", "\t", "a", "Word", "'s", "123", ".", " /", "é", "日本", "😀", "<|endoftext|>"]
    for chunk in [8, 16, 64, 300]:
        monkeypatch.setattr(_pure, "COUNT_CHUNK", chunk)
        for _ in range(100):
            text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 300)))
            assert counter.count(text) == len(real(text)), repr(text[:80])
    monkeypatch.setattr(_pure, "COUNT_CHUNK", 1000)
    text = "alpha beta, gamma 42 " * 1000
    seen.clear()
    assert counter.count(text) == len(real(text))
    assert len(seen) > 20 and max(seen) <= 1000
