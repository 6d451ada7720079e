"""Hypothesis: every native accelerator agrees with its pure twin on arbitrary inputs."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotloop import _frames, _pure
from hotloop import _native as native

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the class is the observable
        return ("err", type(exc))


# Any code point, lone surrogates included; control characters and astral planes weighted up.
any_char = st.one_of(
    st.characters(min_codepoint=0, max_codepoint=0x1F),
    st.sampled_from('"\\/\x7f\u2028\u2029\ufeff\u00e9\U0001f600\U0010ffff'),
    st.characters(codec=None, categories=None),
    st.integers(0xD800, 0xDFFF).map(chr),  # lone surrogates (st.characters never yields them)
)
any_text = st.text(any_char, max_size=40)


# -- Fingerprinter ------------------------------------------------------------------------------


@SETTINGS
@given(st.binary(min_size=16, max_size=64), st.binary(max_size=600))
def test_fingerprint(key: bytes, data: bytes) -> None:
    want = hashlib.blake2b(data, digest_size=16, key=key).digest()
    assert native.Fingerprinter(key)(data) == want
    assert _pure.Fingerprinter(key)(data) == want


@SETTINGS
@given(st.one_of(st.binary(max_size=80), st.text(max_size=40), st.none(), st.integers()))
def test_fingerprinter_keys_agree(key: Any) -> None:
    n = outcome(native.Fingerprinter, key)
    p = outcome(_pure.Fingerprinter, key)
    assert n[0] == p[0]
    if n[0] == "err":
        assert n == p
    else:
        assert n[1](b"x") == p[1](b"x")


# -- ItemChain ----------------------------------------------------------------------------------

fpish = st.one_of(
    st.integers(0, 5).map(lambda i: bytes([i]) * 16),  # equal fingerprints are likely
    st.binary(min_size=16, max_size=16),
    st.binary(max_size=20),  # mostly the wrong length
    st.sampled_from([0, "x" * 16, bytearray(16), None]),
)
u32ish = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([-1, 2**32]))
small_n = st.integers(-2, 12)
ops = st.one_of(
    st.tuples(st.just("push"), fpish, u32ish),
    st.tuples(st.just("extend"), st.lists(fpish, max_size=5), st.lists(u32ish, max_size=5)),
    st.tuples(st.just("common_prefix"), st.lists(fpish, max_size=8)),
    st.tuples(st.just("common_prefix"), st.lists(fpish, max_size=8), small_n),
    st.tuples(st.just("tokens_upto"), small_n),
    st.tuples(st.just("truncate"), small_n),
    st.tuples(st.just("copy")),
)


def _observe(chain: Any) -> tuple[Any, ...]:
    return (len(chain), chain.total_tokens, chain.fingerprints(), chain.max_items, repr(chain))


@SETTINGS
@given(st.integers(0, 10), st.lists(ops, max_size=40))
def test_item_chain_random_ops(max_items: int, program: list[tuple[Any, ...]]) -> None:
    chains: list[Any] = [native.ItemChain(max_items), _pure.ItemChain(max_items)]
    for op, *args in program:
        results = []
        for i, chain in enumerate(chains):
            if op == "copy":
                chains[i] = chain.copy()
                if len(chain) < max_items:
                    chain.push(bytes(16), 1)  # mutating the original must not show in the copy
                results.append(("ok", None))
            else:
                results.append(outcome(getattr(chain, op), *args))
        assert results[0] == results[1], (op, args)
        assert _observe(chains[0]) == _observe(chains[1])


# -- SseDecoder ---------------------------------------------------------------------------------

sse_piece = st.one_of(
    st.sampled_from([b"\n", b"\r", b"\r\n", b"data", b"data:", b"data: ", b"event:", b"event: ",
                     b"id: 1", b"retry: 5", b":comment", b":", b" ", b"message", b"\xef\xbb\xbf",
                     b"\xe2\x82\xac", b"\xff", b"\xe2\x82", b"\xf0\x9f\x98\x80", b"x"]),
    st.binary(max_size=6),
)
sse_stream = st.lists(sse_piece, max_size=40).map(b"".join)


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    out, prev = [], 0
    for p in points:
        out.append(data[prev:p])
        prev = p
    out.append(data[prev:])
    return out


def _feed_all(dec: Any, chunks: list[bytes]) -> list[tuple[str, str]]:
    return [ev for chunk in chunks for ev in dec.feed(chunk)]


@SETTINGS
@given(sse_stream, st.lists(st.integers(0, 300), max_size=12))
def test_sse_any_chunking_same_events(data: bytes, cuts: list[int]) -> None:
    want = native.SseDecoder().feed(data)
    chunks = _chunks(data, cuts)
    assert _feed_all(native.SseDecoder(), chunks) == want
    assert _feed_all(_pure.SseDecoder(), chunks) == want
    assert _pure.SseDecoder().feed(data) == want
    byte_chunks = [data[i : i + 1] for i in range(len(data))]
    assert _feed_all(native.SseDecoder(), byte_chunks) == want


@SETTINGS
@given(sse_stream, st.lists(st.integers(0, 300), max_size=12), st.integers(0, 24))
def test_sse_bounded_twins_agree_chunk_by_chunk(data: bytes, cuts: list[int], limit: int) -> None:
    decoders: list[Any] = [native.SseDecoder(limit), _pure.SseDecoder(limit)]
    for chunk in _chunks(data, cuts) + [b"\n\n"]:
        n, p = (outcome(d.feed, chunk) for d in decoders)
        assert n == p, chunk


# -- encode_delta / encode_sse ------------------------------------------------------------------

int64 = st.integers(-(2**63), 2**63 - 1)
some_int = st.one_of(st.integers(-3, 3), int64, st.integers(-(2**65), 2**65))


@SETTINGS
@given(any_text, some_int, any_text, some_int, some_int, any_text, st.booleans())
def test_encode_delta_matches_msgspec(
    event_type: str, seq: int, item_id: str, out_idx: int, content_idx: int, delta: str,
    logprobs: bool,
) -> None:
    d: dict[str, Any] = {"type": event_type, "sequence_number": seq, "item_id": item_id,
                         "output_index": out_idx}
    if content_idx >= 0:
        d["content_index"] = content_idx
    d["delta"] = delta
    if logprobs:
        d["logprobs"] = []
    want = outcome(msgspec.json.encode, d)
    args = (event_type, seq, item_id, out_idx, content_idx, delta, logprobs)
    assert outcome(_frames.encode_delta, *args) == want
    assert outcome(_pure.encode_delta, *args) == want


@SETTINGS
@given(any_text, st.binary(max_size=100))
def test_encode_sse(event_type: str, payload: bytes) -> None:
    want = outcome(lambda: b"event: " + event_type.encode() + b"\ndata: " + payload + b"\n\n")
    assert outcome(_frames.encode_sse, event_type, payload) == want
    assert outcome(_pure.encode_sse, event_type, payload) == want


# -- SecretScanner ------------------------------------------------------------------------------

_PATTERNS = _pure.SECRET_PATTERNS
_NATIVE_SCANNER = native.SecretScanner(_PATTERNS)
_PURE_SCANNER = _pure.SecretScanner(_PATTERNS)
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def _planted(a: str, up: str, hexits: str) -> list[tuple[str, str]]:
    """(kind, secret) pairs assembled from drawn characters (no literal secret is committed)."""

    def cyc(chars: str, n: int) -> str:
        return (chars * (n // len(chars) + 1))[:n]

    return [
        ("github_token", "gh" + "p_" + cyc(a, 36)),
        ("aws_access_key_id", "AK" + "IA" + cyc(up, 16)),
        ("openai_api_key", "sk-" + "proj-" + cyc(a, 60)),
        ("npm_token", "np" + "m_" + cyc(a, 36)),
        ("twilio_api_key", "S" + "K" + cyc(hexits, 32)),
    ]


# noise: any code point (lone surrogates and astral planes included) plus key-ish ASCII
_noise_char = st.one_of(
    any_char,
    st.sampled_from("=:\"' \n\t-_./+@AKIAskghp_0123456789xoxb-eyJ"),
)
_noise = st.text(_noise_char, max_size=30)
# separators around a planted secret that no pattern can extend into
_sep_char = st.one_of(
    st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF, codec=None),
    st.integers(0xD800, 0xDFFF).map(chr),
    st.sampled_from(" \n\t,;()<>|"),
)
_sep = st.text(_sep_char, min_size=1, max_size=6)


@SETTINGS
@given(
    st.lists(st.tuples(_noise, st.integers(0, 4), _sep, _sep), max_size=5),
    st.lists(st.sampled_from(_ALNUM), min_size=40, max_size=60, unique=True).map("".join),
    st.permutations("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567").map("".join),
    st.permutations("0123456789abcdef").map("".join),
    _noise,
    st.sampled_from([0, 1, 3, 10_000]),
)
def test_secret_scanner_twins_agree(
    pieces: list[tuple[str, int, str, str]], alnum: str, up: str, hexits: str, tail: str, cap: int
) -> None:
    secrets = _planted(alnum, up, hexits)
    text = ""
    planted: list[tuple[str, int, int]] = []
    for noise, which, left, right in pieces:
        kind, secret = secrets[which]
        text += noise + left
        planted.append((kind, len(text), len(text) + len(secret)))
        text += secret + right
    text += tail
    want = _PURE_SCANNER.scan(text)
    assert _NATIVE_SCANNER.scan(text) == want
    assert _NATIVE_SCANNER.redact(text) == _PURE_SCANNER.redact(text)
    # the noise can not swallow a planted secret: each is reported exactly where it was put
    # (noise next to a separator may add findings of its own, never overlapping these)
    assert set(planted) <= set(want)
    if cap != 10_000:
        n = native.SecretScanner(_PATTERNS, cap)
        p = _pure.SecretScanner(_PATTERNS, cap)
        assert n.scan(text) == p.scan(text) == want[:cap]


@SETTINGS
@given(st.text(_noise_char, max_size=200))
def test_secret_scanner_twins_agree_on_noise(text: str) -> None:
    assert _NATIVE_SCANNER.scan(text) == _PURE_SCANNER.scan(text)
    assert _NATIVE_SCANNER.redact(text) == _PURE_SCANNER.redact(text)
