"""Hypothesis: every native accelerator agrees with its pure twin on arbitrary inputs."""

from __future__ import annotations

import hashlib
import json
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
    st.sampled_from("=:\"' \n\t-_./+@AKIAskghp_0123456789xoxb-eyJ\\bfnrtu003eE"),
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


# The native scanner runs only the kinds a RegexSet pass reports below 4096 bytes of UTF-8
# (SET_BELOW in rust/core/src/secrets.rs) and every kind's own search from there on.
_SET_BELOW = 4096


@SETTINGS
@given(
    st.lists(st.tuples(_noise, st.integers(0, 4), _sep, _sep), min_size=1, max_size=5),
    st.lists(st.sampled_from(_ALNUM), min_size=40, max_size=60, unique=True).map("".join),
    st.permutations("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567").map("".join),
    st.permutations("0123456789abcdef").map("".join),
    st.sampled_from(["\n", " ", "\u00e9", "x = 1\n"]),
)
def test_secret_scanner_twins_agree_past_the_set_threshold(
    pieces: list[tuple[str, int, str, str]], alnum: str, up: str, hexits: str, pad_unit: str
) -> None:
    secrets = _planted(alnum, up, hexits)
    text = ""
    for noise, which, left, right in pieces:
        text += noise + left + secrets[which][1] + right
    # and a kind whose span is a group of its match (the scanner's captures path)
    text += " password=" + alnum[:20] + " "
    pad = pad_unit * (_SET_BELOW // len(pad_unit.encode()) + 1) + "\n"
    assert len((pad + text).encode("utf-8", "surrogatepass")) >= _SET_BELOW > len(text.encode("utf-8", "surrogatepass"))
    short = _NATIVE_SCANNER.scan(text)
    long = _NATIVE_SCANNER.scan(pad + text)
    assert long == _PURE_SCANNER.scan(pad + text)
    assert long == [(kind, start + len(pad), end + len(pad)) for kind, start, end in short]
    assert short and short[-1][0] == "generic_secret"  # the planted secrets always show
    redacted, spans = _NATIVE_SCANNER.redact(pad + text)
    assert (redacted, spans) == _PURE_SCANNER.redact(pad + text) and redacted.startswith(pad)
    capped = native.SecretScanner(_PATTERNS, 1)
    assert capped.scan(pad + text) == _pure.SecretScanner(_PATTERNS, 1).scan(pad + text) == long[:1]


@SETTINGS
@given(st.text(_noise_char, max_size=200))
def test_secret_scanner_twins_agree_on_noise(text: str) -> None:
    assert _NATIVE_SCANNER.scan(text) == _PURE_SCANNER.scan(text)
    assert _NATIVE_SCANNER.redact(text) == _PURE_SCANNER.redact(text)


# -- plain_delta / SseDecoder.feed_lane -------------------------------------------------------------

# text without lone surrogates (mostly), so that most generated chunks are valid JSON
_valid_text = st.text(st.one_of(st.characters(min_codepoint=0, max_codepoint=0x1F), st.sampled_from('"\\/\x7f\u2028\u00e9\U0001f600'),
                                st.characters(codec="utf-8")), max_size=12)
_some_text = st.one_of(_valid_text, _valid_text, _valid_text, any_text)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(allow_nan=False, allow_infinity=False),
                    _some_text, st.sampled_from(["", "a", "{", "-0"]))
_json_any = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.sampled_from(["x", "id", "type"]), inner, max_size=3)),
                         max_leaves=6)


def _maybe(key: str, value: Any) -> Any:
    """A value for ``key``: usually the expected shape, sometimes anything."""
    return st.one_of(*[value] * 7, _json_any).map(lambda v: (key, v))


def _obj(*fields: Any) -> Any:
    """A dict of a random subset of ``fields`` (each a strategy of (key, value)), plus noise."""
    return st.tuples(*[st.one_of(st.none(), f, f, f) for f in fields], st.lists(st.tuples(st.sampled_from(["x", "role"]), _json_any), max_size=2)).map(
        lambda parts: dict([p for p in parts[:-1] if p is not None] + parts[-1]))


_piece_text = st.one_of(st.sampled_from(["", "a", '{"', "\n", "\u00e9"]), _some_text)
_function = _obj(_maybe("name", st.one_of(st.none(), _piece_text)), _maybe("arguments", st.one_of(st.none(), _piece_text)))
_tool_call = _obj(_maybe("index", st.one_of(st.integers(-1, 3), st.just(2**63))), _maybe("id", st.sampled_from([None, "", "call_1"])),
                  _maybe("function", st.one_of(st.none(), _function)))
_delta = st.one_of(
    _obj(_maybe("content", _piece_text)),
    _obj(_maybe("reasoning", _piece_text)),
    _obj(_maybe("reasoning", st.sampled_from(["", None])), _maybe("reasoning_content", _piece_text)),
    _obj(_maybe("tool_calls", st.lists(_tool_call, min_size=1, max_size=1))),
    _obj(*[_maybe(k, st.one_of(st.none(), _piece_text)) for k in ("content", "reasoning", "reasoning_content", "refusal")],
         _maybe("tool_calls", st.one_of(st.none(), st.lists(_tool_call, max_size=2)))),
)
_choice = _obj(_maybe("index", st.sampled_from([0, 0, 1, 0.0])), _maybe("finish_reason", st.sampled_from([None, None, "", "stop"])),
               _maybe("delta", st.one_of(st.none(), _delta)))
_chunk = _obj(_maybe("choices", st.lists(_choice, min_size=1, max_size=2)), _maybe("usage", st.none()),
              _maybe("error", st.none()), _maybe("status_code", st.none()))


# the usual envelope around a random delta: most of these are plain
_usual = st.builds(lambda d, extra: {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": None}], **extra},
                   _delta, st.dictionaries(st.sampled_from(["usage", "model", "x"]), st.one_of(st.none(), _scalar), max_size=1))


@st.composite
def _chunk_json(draw: Any) -> str:
    """A chunk's JSON, sometimes with a key repeated, escaped or spaced out."""
    text = json.dumps(draw(st.one_of(_usual, _chunk)), ensure_ascii=draw(st.booleans()))
    edit = draw(st.sampled_from(["none", "none", "repeat", "spaces", "escape-key"]))
    if edit == "repeat":
        for key in ("content", "choices", "index", "x", "arguments"):
            if f'"{key}": ' in text:
                text = text.replace(f'"{key}": ', f'"{key}": null, "{key}": ', 1)
                break
    elif edit == "spaces":
        text = " \n" + text.replace(", ", " ,\t") + "\r\n "
    elif edit == "escape-key":
        text = text.replace('"content"', '"con\\u0074ent"', 1)
    return text


@SETTINGS
@given(_chunk_json())
def test_plain_delta(data: str) -> None:
    assert outcome(native.plain_delta, data) == outcome(_pure.plain_delta, data)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["", "", "", "message", "ping", "error"]), _chunk_json()), max_size=6),
       st.sampled_from([0, 1, 2, 3]), st.integers(-1, 3), st.booleans(), st.data())
def test_feed_lane(events: list[tuple[str, str]], kind: int, index: int, with_args: bool, data: st.DataObject) -> None:
    stream = "".join((f"event: {t}\n" if t else "") + f"data: {e}\n\n" for t, e in events).encode(
        "utf-8", "surrogatepass")  # invalid UTF-8 too
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    # the lane's own fields: a content or a summary index (or none), with or without logprobs
    summary, part, logprobs = data.draw(st.booleans()), data.draw(st.sampled_from([-1, 0, 2])), data.draw(st.booleans())
    got = []
    for mod in (native, _pure):
        lane = mod.DeltaLane(kind, 0, "response.function_call_arguments.delta", "fc_1", 1, part, logprobs, [],
                             summary=summary)
        lane.seq = 3
        args: list[str] | None = [] if with_args else None
        decoder = mod.SseDecoder()
        prev = 0
        out = []
        for cut in cuts + [len(stream)]:
            out.append(outcome(decoder.feed_lane, stream[prev:cut], lane, index, args))
            prev = cut
        got.append((out, lane.parts, lane.seq, lane.taken, args))
    assert got[0] == got[1]


@SETTINGS
@given(st.lists(_valid_text.filter(bool), min_size=1, max_size=5), _valid_text, st.integers(0, 2**62),
       st.integers(0, 2**62), st.booleans())
def test_summary_lane_writes_the_summary_delta(pieces: list[str], item_id: str, output_index: int, seq: int,
                                               ascii_only: bool) -> None:
    """A summary lane's events, native and pure, are the Python path's summary deltas byte for
    byte (``events.summary_delta``, what ``Turn.feed`` sends for a summary's reasoning)."""
    from hotloop.protocol import events as ev

    stream = "".join("data: " + json.dumps({"choices": [{"delta": {"reasoning": p}}]}, ensure_ascii=ascii_only) + "\n\n"
                     for p in pieces).encode()
    fields = ev.summary_delta_fields(item_id, output_index, 0)
    want = [ev.summary_delta(seq + i, fields, p) for i, p in enumerate(pieces)]
    for mod in (native, _pure):
        lane = mod.DeltaLane(2, 0, ev.REASONING_SUMMARY_TEXT_DELTA, item_id, output_index, 0, False, [], summary=True)
        lane.seq = seq
        assert mod.SseDecoder().feed_lane(stream, lane, 0, None) == (want, [])
