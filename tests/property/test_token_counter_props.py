"""Hypothesis: the native ``TokenCounter`` counts exactly what tiktoken encodes, on any text."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotloop import _native as native
from hotloop import tokenizer

SETTINGS = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_ENC = tokenizer.encoding()
_COUNTER = native.TokenCounter(tokenizer._vocabulary())

# The characters each rule of the o200k pattern turns on, weighted up against st.text()'s spread:
# whitespace of every kind, contraction letters (with U+017F, which (?i) folds to s), combining
# marks, letters of every class, numbers of every class, punctuation and line-break tails.
_tricky = st.sampled_from(
    [" ", "  ", "\t", "\r", "\n", "\r\n", "\u00a0", "\u2028", "\u3000", "\x85", "'", "'s", "'S", "'\u017f",
     "'t", "'re", "'VE", "'m", "'ll", "'D", "\u0301", "\u20dd", "\u0903", "a", "A", "\u01c5", "\u02b0",
     "\u4e2d", "\u00df", "1", "22", "\u00bd", "\u00b2", "\u2162", "!", "/", "//", "...", "_", "\U0001f600"]
)
_any_char = st.characters(codec=None, categories=None, exclude_categories=["Cs"])
_any_text = st.lists(st.one_of(_any_char, _tricky), max_size=60).map("".join)
# lone surrogates: tiktoken counts the text after a UTF-16 round trip, and so must the counter
_with_surrogates = st.lists(
    st.one_of(_any_char, _tricky, st.integers(0xD800, 0xDFFF).map(chr)), max_size=30
).map("".join)


@SETTINGS
@given(st.text())
def test_counts_any_text(text: str) -> None:
    assert _COUNTER.count(text) == len(_ENC.encode_ordinary(text))


@SETTINGS
@given(_any_text)
def test_counts_text_weighted_to_the_rules(text: str) -> None:
    assert _COUNTER.count(text) == len(_ENC.encode_ordinary(text))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_with_surrogates)
def test_counts_text_with_surrogates(text: str) -> None:
    assert _COUNTER.count(text) == len(_ENC.encode_ordinary(text))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_any_text, min_size=1, max_size=20), st.integers(1, 400))
def test_counts_long_repeated_text(parts: list[str], times: int) -> None:
    """Long pieces (runs of one character class) and the GIL-released path (4 KiB and more)."""
    text = "".join(parts) * times
    assert _COUNTER.count(text) == len(_ENC.encode_ordinary(text))
