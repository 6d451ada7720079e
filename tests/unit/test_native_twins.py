"""Every native accelerator against its pure twin on fixed cases (property tests live in
tests/property/test_native_twins_props.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

# implementations() imports the extensions directly: a missing or broken build fails here.
from hotloop import _accel

Impl = dict[str, Any]
IMPLS: dict[str, dict[str, Any]] = _accel.implementations()  # raises if the build is broken


@pytest.fixture(params=["native", "pure"])
def impl(request: pytest.FixtureRequest) -> Impl:
    return IMPLS[request.param]


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """('ok', result) or ('err', exception class): what must agree between twins."""
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the class is the observable
        return ("err", type(exc))


# -- Fingerprinter ------------------------------------------------------------------------------

KEY = bytes(range(32))
FP_INPUTS = [b"", b"abc", b"a" * 127, b"a" * 128, b"a" * 129, bytes(range(256)) * 300]


def fp(i: int) -> bytes:
    """A well-formed fingerprint for chain tests."""
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("data", FP_INPUTS, ids=lambda d: f"len{len(d)}")
def test_fingerprint_is_keyed_blake2b_128(impl: Impl, data: bytes) -> None:
    assert impl["Fingerprinter"](KEY)(data) == hashlib.blake2b(data, digest_size=16, key=KEY).digest()


def test_fingerprint_known_vector(impl: Impl) -> None:
    # the vectors of rust/core/src/fingerprint.rs
    assert impl["Fingerprinter"](KEY)(b"abc").hex() == "1a64be47e4729d951c302ee543f97cf3"
    assert impl["Fingerprinter"](KEY)(b"").hex() == "3daf97bce7888fd59773c66bf647459c"


def test_fingerprint_depends_on_the_key(impl: Impl) -> None:
    make = impl["Fingerprinter"]
    assert make(b"a" * 32)(b"item") != make(b"b" * 32)(b"item")
    assert make(b"a" * 16)(b"item") != make(b"a" * 17)(b"item")  # the key length is hashed too
    assert make(b"k" * 64)(b"item") == hashlib.blake2b(b"item", digest_size=16, key=b"k" * 64).digest()
    assert make(b"a" * 32)(b"item") == make(b"a" * 32)(b"item")


@pytest.mark.parametrize(("key", "exc"), [(b"", ValueError), (b"k" * 15, ValueError), (b"k" * 65, ValueError),
                                          ("k" * 32, TypeError), (bytearray(32), TypeError), (None, TypeError)])
def test_fingerprinter_key_checks(impl: Impl, key: object, exc: type) -> None:
    with pytest.raises(exc):
        impl["Fingerprinter"](key)


@pytest.mark.parametrize("bad", ["abc", bytearray(b"abc"), memoryview(b"abc"), None, 3])
def test_fingerprint_refuses_non_bytes(impl: Impl, bad: object) -> None:
    with pytest.raises(TypeError):
        impl["Fingerprinter"](KEY)(bad)


def test_fingerprinter_never_shows_its_key(impl: Impl) -> None:
    key = b"S3CRET-" * 4
    f = impl["Fingerprinter"](key)
    assert repr(f) == str(f) == "Fingerprinter(<key hidden>)"
    assert not hasattr(f, "key")


# -- ItemChain ----------------------------------------------------------------------------------


def test_item_chain_basics(impl: Impl) -> None:
    chain = impl["ItemChain"]()
    assert len(chain) == 0
    assert chain.total_tokens == 0
    assert chain.max_items == 100_000
    chain.push(fp(11), 5)
    chain.extend([fp(12), fp(13)], [6, 7])
    assert len(chain) == 3
    assert chain.total_tokens == 18
    assert chain.fingerprints() == [fp(11), fp(12), fp(13)]
    assert [chain.fingerprint_at(i) for i in range(3)] == chain.fingerprints()
    assert [chain.tokens_upto(n) for n in range(4)] == [0, 5, 11, 18]
    assert chain.common_prefix([fp(11), fp(12), fp(99)]) == 2
    assert chain.common_prefix((fp(11), fp(12), fp(13), fp(14))) == 3
    assert chain.common_prefix([]) == 0
    assert chain.common_prefix([fp(11) + b"", bytes(fp(12))]) == 2  # equal bytes, not identity
    copy = chain.copy()
    chain.truncate(1)
    assert chain.fingerprints() == [fp(11)]
    assert chain.total_tokens == 5
    assert copy.fingerprints() == [fp(11), fp(12), fp(13)]
    chain.truncate(10)
    assert len(chain) == 1
    assert repr(copy) == "ItemChain(len=3, total_tokens=18, max_items=100000)"


def test_item_chain_limits(impl: Impl) -> None:
    chain = impl["ItemChain"](max_items=2)
    chain.push(b"\xff" * 16, 2**32 - 1)
    with pytest.raises(OverflowError):
        chain.extend([fp(1), fp(2)], [1, 1])  # all or nothing
    assert len(chain) == 1
    chain.push(fp(0), 0)
    with pytest.raises(OverflowError):
        chain.push(fp(1), 1)
    assert chain.total_tokens == 2**32 - 1
    with pytest.raises(IndexError):
        chain.tokens_upto(3)
    with pytest.raises(ValueError):
        chain.tokens_upto(-1)
    with pytest.raises(IndexError, match="out of range for a chain of 2 items"):
        chain.fingerprint_at(2)
    with pytest.raises(ValueError):
        chain.fingerprint_at(-1)
    with pytest.raises(OverflowError):
        chain.fingerprint_at(2**63)
    with pytest.raises(ValueError):
        chain.truncate(-1)
    with pytest.raises(ValueError):
        chain.extend([fp(1)], [])
    with pytest.raises(ValueError):
        impl["ItemChain"](-1)


@pytest.mark.parametrize(
    ("fp_", "tokens", "exc"),
    [(b"x" * 15, 0, ValueError), (b"x" * 17, 0, ValueError), (b"", 0, ValueError), (0, 0, TypeError),
     ("x" * 16, 0, TypeError), (bytearray(16), 0, TypeError), (fp(0), 2**32, OverflowError),
     (fp(0), -1, OverflowError), (fp(0), 1.0, TypeError), (b"short", 2**32, OverflowError)],
)
def test_item_chain_value_checks(impl: Impl, fp_: object, tokens: object, exc: type) -> None:
    chain = impl["ItemChain"]()
    with pytest.raises(exc):
        chain.push(fp_, tokens)
    with pytest.raises(exc):
        chain.extend([fp_], [tokens])
    assert len(chain) == 0


@pytest.mark.parametrize(("fps", "exc"), [("x" * 16, TypeError), (fp(1), TypeError), (None, TypeError),
                                          ([fp(1), 1], TypeError), ([fp(1), b"x"], ValueError)])
def test_item_chain_fingerprint_sequences(impl: Impl, fps: object, exc: type) -> None:
    chain = impl["ItemChain"]()
    chain.push(fp(1), 1)
    with pytest.raises(exc):
        chain.common_prefix(fps)
    with pytest.raises(exc):
        chain.extend(fps, [1, 1])
    assert chain.fingerprints() == [fp(1)]


# -- SseDecoder ---------------------------------------------------------------------------------

SSE_CASES: list[tuple[bytes, list[tuple[str, str]]]] = [
    (b"data: hello\n\n", [("message", "hello")]),
    (b"event: delta\r\ndata: {\"a\":1}\r\n\r\n", [("delta", '{"a":1}')]),
    (b"data:a\rdata: b\r\r", [("message", "a\nb")]),
    (b"data: a\r\r\n", [("message", "a")]),
    (b": ping\nid: 3\nretry: 10\nfoo\ndata\n\n", [("message", "")]),
    (b"event: x\n\ndata: y\n\n", [("message", "y")]),
    (b"event\ndata: y\n\n", [("message", "y")]),
    (b"data:  two\n\n", [("message", " two")]),
    (b"\xef\xbb\xbfdata: bom\n\n", [("message", "bom")]),
    (b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\n", []),
    (b"data: x\n\n\xef\xbb\xbfdata: y\n\n", [("message", "x")]),
    (b"data: \xff\xf0\x9f\x98\n\n", [("message", "\ufffd\ufffd")]),
    ("data: h\u00e9 \U0001f600\n\n".encode(), [("message", "h\u00e9 \U0001f600")]),
    (b"data: held", []),
]


@pytest.mark.parametrize(("stream", "events"), SSE_CASES)
def test_sse_fixed_cases_every_split(impl: Impl, stream: bytes, events: list[Any]) -> None:
    assert impl["SseDecoder"]().feed(stream) == events
    for split in range(len(stream) + 1):
        dec = impl["SseDecoder"]()
        got = dec.feed(stream[:split]) + dec.feed(b"") + dec.feed(stream[split:])
        assert got == events, split
    dec = impl["SseDecoder"]()
    assert [e for b in stream for e in dec.feed(bytes([b]))] == events


def test_sse_cr_then_lf_in_next_chunk_is_one_line_ending(impl: Impl) -> None:
    dec = impl["SseDecoder"]()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\n") == []  # completes "\r\n"; not a blank line
    assert dec.feed(b"\n") == [("message", "a")]


def test_sse_bounds(impl: Impl) -> None:
    dec = impl["SseDecoder"](max_buffer=8)
    assert dec.max_buffer == 8
    assert dec.feed(b"data: 12\n\n") == [("message", "12")]
    assert dec.feed(b"data: 12") == []
    with pytest.raises(ValueError):
        dec.feed(b"3")
    with pytest.raises(ValueError):  # failed for good
        dec.feed(b"\n\n")
    dec = impl["SseDecoder"](max_buffer=8)
    with pytest.raises(ValueError):
        dec.feed(b"data:1\ndata:2\ndata:3\ndata:4\ndata:5\n")
    with pytest.raises(TypeError):
        impl["SseDecoder"]().feed("data: x\n\n")


# -- encode_delta / encode_sse ------------------------------------------------------------------

DELTA_ARGS: list[tuple[Any, ...]] = [
    ("response.output_text.delta", 7, "msg_1", 0, 0, "Hello", False),
    ("response.output_text.delta", 7, "msg_1", 0, 0, "Hello", True),
    ("response.function_call_arguments.delta", 2**62, "fc_1", 3, -1, '{"a":', False),
    ("t", 0, "", 0, -5, "".join(map(chr, range(0x20))) + '"\\\x7f\u2028\U0001f600\u00e9', True),
    ("t", -3, "i", -1, 2, "", False),
    ("t", 2**63, "i", 0, 0, "x", False),  # off the int64 fast path
    ("t", True, "i", 0, 0, "x", False),  # bool is encoded as msgspec does
    ("t", 1, "i", 0, 0, "x", 1),  # truthy non-bool logprobs
]


@pytest.mark.parametrize("args", DELTA_ARGS, ids=repr)
def test_encode_delta_matches_msgspec(impl: Impl, args: tuple[Any, ...]) -> None:
    event_type, seq, item_id, out_idx, content_idx, delta, logprobs = args
    d: dict[str, Any] = {"type": event_type, "sequence_number": seq, "item_id": item_id,
                         "output_index": out_idx}
    if content_idx >= 0:
        d["content_index"] = content_idx
    d["delta"] = delta
    if logprobs:
        d["logprobs"] = []
    assert impl["encode_delta"](*args) == msgspec.json.encode(d)


@pytest.mark.parametrize(
    "args",
    [("t", 0, "i", 0, 0, "\ud800", False), ("\udfff", 0, "i", 0, 0, "x", False),
     ("t", 0, "i\ud800", 0, 0, "x", True), ("t", 2**64, "i", 0, 0, "x", False),
     ("t", 0, "i", 0, "0", "x", False), ("t", object(), "i", 0, 0, "x", False)],
    ids=lambda args: repr(tuple("<object>" if type(a) is object else a for a in args)),  # the same in every process
)
def test_encode_delta_errors_agree(args: tuple[Any, ...]) -> None:
    n = outcome(IMPLS["native"]["encode_delta"], *args)
    p = outcome(IMPLS["pure"]["encode_delta"], *args)
    assert n == p
    assert n[0] == "err" or args[1] == 2**64


@pytest.mark.parametrize(
    ("event_type", "payload"),
    [("response.output_text.delta", b'{"a":1}'), ("", b""), ("\u00e9v", b"x" * 2000),
     ("t", bytearray(b"ba")), ("t", memoryview(b"mv"))],
)
def test_encode_sse(impl: Impl, event_type: str, payload: Any) -> None:
    want = b"event: " + event_type.encode() + b"\ndata: " + bytes(payload) + b"\n\n"
    assert impl["encode_sse"](event_type, payload) == want


@pytest.mark.parametrize(("event_type", "payload"), [("\ud800", b"x"), (1, b"x"), ("t", "x")])
def test_encode_sse_errors_agree(event_type: Any, payload: Any) -> None:
    n = outcome(IMPLS["native"]["encode_sse"], event_type, payload)
    assert n[0] == "err"
    assert n == outcome(IMPLS["pure"]["encode_sse"], event_type, payload)


# -- body_buffer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4096, 200_000, 1024 * 1024])
def test_body_buffer(impl: Impl, size: int) -> None:
    buf = impl["body_buffer"](size)
    assert type(buf) is bytearray and len(buf) == size
    # writable through a view, as the socket's reads fill it
    if size:
        memoryview(buf)[size - 1 :] = b"x"
        assert buf[-1:] == b"x"


class _Index:
    def __index__(self) -> int:
        return 3


def test_body_buffer_takes_what_bytearray_takes() -> None:
    for impl in IMPLS.values():
        assert len(impl["body_buffer"](_Index())) == 3


@pytest.mark.parametrize("size", [-1, 1.5, -1.0, "3", None, 2**70])
def test_body_buffer_errors_agree(size: Any) -> None:
    n = outcome(IMPLS["native"]["body_buffer"], size)
    assert n[0] == "err"
    assert n == outcome(IMPLS["pure"]["body_buffer"], size)


# -- SecretScanner ------------------------------------------------------------------------------


def _secret_texts() -> list[str]:
    """Every positive and negative example of tests/unit/test_secrets.py, alone and together,
    in ASCII, non-ASCII and surrogate-holding surroundings."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "_secret_examples", Path(__file__).with_name("test_secrets.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    singles = [b + s + a for _, b, s, a in mod.POSITIVES] + [t for _, t in mod.NEGATIVES]
    texts = singles + ["\u00e9\u4e2d " + t for t in singles] + ["\ud800" + t for t in singles]
    texts.append("\n".join(singles))
    texts.append("".join(singles))  # glued: edges and overlaps between neighbours
    texts.append("\U0001f600".join(singles))
    texts.append("\\n".join(singles))  # JSON-encoded newlines: escape letters as boundaries
    texts.append("\\\\n".join(singles))  # an escaped backslash, then a plain letter
    texts.append("\\u003e".join(singles))  # a unicode escape (Go's JSON escapes < and > so)
    texts.append("\\\\u003e".join(singles))
    return texts


SECRET_TEXTS = _secret_texts()


def test_secret_scanner_twins_agree_on_examples() -> None:
    native = IMPLS["native"]["SecretScanner"](_accel.SECRET_PATTERNS)
    pure = IMPLS["pure"]["SecretScanner"](_accel.SECRET_PATTERNS)
    assert native.kinds == pure.kinds
    found = 0
    for text in SECRET_TEXTS:
        want = pure.scan(text)
        assert native.scan(text) == want, text
        assert native.redact(text) == pure.redact(text)
        found += len(want)
    assert found > 100  # the examples do contain secrets


def test_secret_scanner_twins_agree_on_the_cap() -> None:
    text = SECRET_TEXTS[-3]
    for cap in (0, 1, 2, 7, 10_000):
        n = IMPLS["native"]["SecretScanner"](_accel.SECRET_PATTERNS, cap)
        p = IMPLS["pure"]["SecretScanner"](_accel.SECRET_PATTERNS, max_matches=cap)
        assert n.max_matches == p.max_matches == cap
        assert n.scan(text) == p.scan(text)
        assert len(n.scan(text)) == min(cap, len(p.scan(text)))


CUSTOM = ("tok", "tok_[a-z]{4}", "", 0.0)


@pytest.mark.parametrize(
    "patterns,max_matches",
    [
        ([CUSTOM], 5),
        ([CUSTOM], -1),
        ("tok_[a-z]", 5),
        ([["tok", "x", "", 0.0]], 5),
        ([("tok", "x", "")], 5),
        ([("tok", "x", "", 0.0, 1)], 5),
        ([(1, "x", "", 0.0)], 5),
        ([("tok", "x", "", "1.0")], 5),
        ([("tok", "x", "", None)], 5),
        ([("Tok", "x", "", 0.0)], 5),
        ([("", "x", "", 0.0)], 5),
        ([CUSTOM, CUSTOM], 5),
        ([("tok", "(", "", 0.0)], 5),
        ([("tok", "x*", "", 0.0)], 5),
        ([("tok", "x", "\u00e9", 0.0)], 5),
        ([("tok", "x", "", -0.5)], 5),
        ([("tok", "x", "", float("inf"))], 5),
        ([("tok", "x", "", float("nan"))], 5),
        ([("tok", "x", "", 2)], 5),
        ([], 5),
        ([CUSTOM], "5"),
    ],
)
def test_secret_scanner_constructor_errors_agree(patterns: Any, max_matches: Any) -> None:
    def build(impl: str) -> tuple[str, Any]:
        return outcome(lambda: IMPLS[impl]["SecretScanner"](patterns, max_matches).kinds)

    assert build("native") == build("pure")


def test_secret_scanner_custom_table_and_empty_table() -> None:
    for impl in IMPLS.values():
        s = impl["SecretScanner"]([CUSTOM, ("key", "key=(?P<secret>[0-9]{3,})", "", 1.0)])
        assert s.kinds == ("tok", "key")
        assert s.scan("a tok_abcd key=1234 key=1111") == [("tok", 2, 10), ("key", 15, 19)]
        assert impl["SecretScanner"]([]).scan("tok_abcd") == []


# -- the HOTLOOP_PURE_PYTHON switch, end to end ---------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from hotloop import _accel as a
    from hotloop.pipeline import items
    from hotloop.protocol.request import item_from_dict
    fp = [bytes([i]) * 16 for i in range(10)]
    chain = a.ItemChain(10)
    chain.extend(fp[1:4], [4, 5, 6])
    dec = a.SseDecoder()
    events = dec.feed(b"event: e\\r\\ndata: 1\\r") + dec.feed(b"\\n\\r\\ndata: \\xff\\n\\n")
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi\\u2028"}]}
    out = {
        "native": a.NATIVE,
        "backends": sorted(set(a.BACKEND_NAMES.values())),
        "fingerprint": a.Fingerprinter(b"k" * 32)(b"hello").hex(),
        "item_fingerprint": (items.use_key(b"k" * 32), items.fingerprint(item_from_dict(item)).hex())[1],
        "canonical": items.canonical(item_from_dict(item)).decode(),
        "chain": [len(chain), chain.total_tokens, chain.tokens_upto(2), chain.common_prefix([fp[1], fp[9]])],
        "events": events,
        "delta": a.encode_delta("t", 1, "i", 0, 0, "d\\u00e9", True).decode(),
        "sse": a.encode_sse("t", b"{}").decode(),
        "secrets": a.SecretScanner(a.SECRET_PATTERNS).redact(
            "\\u00e9 token=" + "Zq8" + "Xw2Lp5Rt7Yv1" + " k=" + "AK" + "IA" + "QX7Z2M4N5P6R3S2T"),
    }
    print(json.dumps(out))
    """
)


def _run(pure: bool) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("HOTLOOP_PURE_PYTHON", None)
    if pure:
        env["HOTLOOP_PURE_PYTHON"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60,
        check=False, cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_pure_switch_in_a_subprocess_gives_identical_results() -> None:
    pure = _run(pure=True)
    assert pure["native"] is False
    assert pure["backends"] == ["hotloop._pure"]
    nat = _run(pure=False)
    assert nat["native"] is True
    assert "hotloop._pure" not in nat["backends"]
    for key in ("native", "backends"):
        del pure[key], nat[key]
    assert pure == nat


# -- plain_delta / DeltaLane / SseDecoder.feed_lane -----------------------------------------------

PLAIN_CASES = [
    '{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}],"usage":null}',
    '{"choices":[{"delta":{"tool_calls":[{"index":2,"function":{"arguments":"{\\"a"}}]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"","type":"function","function":{"name":"f","arguments":"x"}}]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":0,"function":null}]}}]}',
    '{"choices":[{"delta":{"reasoning":"","reasoning_content":"r"}}]}',
    '{"choices":[{"delta":{"reasoning":"a","reasoning_content":"b"}}]}',
    '{"choices":[{"delta":{"content":"\\u00e9\\n\\ud83d\\ude00"}}]}',
    "{}", '{"choices":[]}', '{"choices":[{"index":0}]}', '{"choices":[{"delta":null}]}',
    '{"choices":[{"delta":{"role":"assistant","content":""}}]}', '{"choices":[{"delta":{"tool_calls":[]}}]}',
    '{"x":1,"choices":[],"x":{"y":2,"y":3}}', '{"x":"\\ud83d\\ude00","choices":[]}',
    "", "[DONE]", "[]", "null", "5", '"x"',
    '{"choices":[{"delta":{"content":"a"}}],"usage":{"prompt_tokens":1}}',
    '{"choices":[{"delta":{"content":"a"}}],"error":{"message":"x"}}',
    '{"choices":[{"delta":{"content":"a"}}],"status_code":500}',
    '{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}',
    '{"choices":[{"delta":{"content":"a"},"finish_reason":""}]}',
    '{"choices":[{"index":1,"delta":{"content":"a"}}]}', '{"choices":[{"index":0.0,"delta":{"content":"a"}}]}',
    '{"choices":[{"index":-0,"delta":{"content":"a"}}]}', '{"choices":[{"index":true,"delta":{"content":"a"}}]}',
    '{"choices":[{"index":null,"delta":{"content":"a"}}]}',
    '{"choices":[{"delta":{"content":"a"}},{"index":1,"delta":{}}]}', '{"choices":null}',
    '{"choices":[{"delta":{"content":1}}]}', '{"choices":[{"delta":{"content":"a","reasoning":"b"}}]}',
    '{"choices":[{"delta":{"content":"a","refusal":"no"}}]}', '{"choices":[{"delta":{"refusal":"no"}}]}',
    '{"choices":[{"delta":{"reasoning":5}}]}', '{"choices":[{"delta":{"content":"a","tool_calls":[{"index":0}]}}]}',
    '{"choices":[{"delta":{"content":"a","tool_calls":[5]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":0},{"index":1}]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"x"}}]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_1","function":{"arguments":"x"}}]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":5}}]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":0,"function":"f"}]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":9223372036854775807}]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":9223372036854775808}]}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":-9223372036854775809}]}}]}',
    '{"choices":[{"delta":{"tool_calls":{"index":0}}}]}', '{"choices":[{"delta":"x"}]}',
    '{"choices":[{"delta":{"content":"\\ud800"}}]}', '{"choices":[],"x":"\\udc00"}',
    '{"choices":[],"x":1e999}', '{"choices":[],"x":NaN}', '{"choices":[]} x',
    # numbers at the float range's edge: the largest float (as a float, as an integer, in
    # another spelling) is a number; an integer beyond it is out of range, as a float beyond it
    '{"choices":[{"delta":{"content":"a"}}],"x":1.7976931348623158e308}',
    '{"choices":[{"delta":{"content":"a"}}],"x":1797693134862315708e290}',
    '{"choices":[{"delta":{"content":"a"}}],"x":' + str(2**1024 - 2**971) + "}",
    '{"choices":[{"delta":{"content":"a"}}],"x":1' + "0" * 309 + "}",
    '{"choices":[{"delta":{"content":"a"}}],"x":-1' + "0" * 309 + "}",
    '{"choices":[{"delta":{"content":"a"}}],"x":1.8e308}',
    '{"choices":[{"delta":{"content":5,"content":"b"}}]}', '{"choices":[{"delta":{"content":"a","content":"b"}}]}',
    '{"choices":[],"choices":[]}', '{"choices":[{"delta":{"tool_calls":[{"index":0,"index":0}]}}]}',
    '{"x":' + "[" * 126 + "]" * 126 + ',"choices":[]}', '{"x":' + "[" * 127 + "]" * 127 + ',"choices":[]}',
    '{"x":"[[[[' + "[" * 200 + '","choices":[]}',
    # deeper than msgspec reads without a RecursionError: None from both
    '{"choices":[],"x":' + "[" * 5000 + "]" * 5000 + "}",
    '{"choices":[{"delta":{"content":"a"}}],"x":' + "{\"a\":" * 3000 + "1" + "}" * 3000 + "}",
]


@pytest.mark.parametrize("data", PLAIN_CASES)
def test_plain_delta_twins_agree(data: str) -> None:
    native, pure = IMPLS["native"]["plain_delta"], IMPLS["pure"]["plain_delta"]
    assert outcome(native, data) == outcome(pure, data)


def test_plain_delta_takes_a_subclass_of_str() -> None:
    class S(str):
        pass

    data = S('{"choices":[{"delta":{"content":"a"}}]}')
    assert IMPLS["native"]["plain_delta"](data) == IMPLS["pure"]["plain_delta"](data) == (1, 0, "a")


def test_plain_delta_reads_the_usual_shapes() -> None:
    for impl in IMPLS.values():
        plain = impl["plain_delta"]
        assert plain(PLAIN_CASES[0]) == (_accel.PLAIN_TEXT, 0, "hi")
        assert plain(PLAIN_CASES[1]) == (_accel.PLAIN_ARGUMENTS, 2, '{"a')
        assert plain(PLAIN_CASES[5]) == (_accel.PLAIN_REASONING, 0, "r")
        assert plain("{}") == (_accel.PLAIN_NOTHING, 0, "")
        assert plain('{"choices":[{"delta":{"content":"a","content":"b"}}]}') is None
        assert outcome(plain, b"{}") == ("err", TypeError)


def _lane_stream(events: list[str]) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


def _lane(impl: Impl, kind: int, seq: int = 10, summary: bool = False) -> Any:
    lane = impl["DeltaLane"](kind, 4, "response.output_text.delta", "msg_1", 2, 0, True, ["x"], summary=summary)
    lane.seq = seq
    return lane


def _lane_state(lane: Any) -> tuple[Any, ...]:
    return (lane.kind, lane.call, lane.event_type, lane.item_id, lane.output_index, lane.content_index, lane.logprobs,
            lane.parts, lane.seq, lane.taken, lane.emit, lane.summary)


def _delta_json(ty: str, seq: int, item_id: str, output_index: int, index: int, delta: str, logprobs: bool,
                summary: bool) -> bytes:
    """A delta event as msgspec writes its dict: ``summary_index`` in place of ``content_index``
    for a summary lane."""
    if not summary:
        return IMPLS["pure"]["encode_delta"](ty, seq, item_id, output_index, index, delta, logprobs)
    d: dict[str, Any] = {"type": ty, "sequence_number": seq, "item_id": item_id, "output_index": output_index}
    if index >= 0:
        d["summary_index"] = index
    d["delta"] = delta
    if logprobs:
        d["logprobs"] = []
    return msgspec.json.encode(d)


@pytest.mark.parametrize(
    ("kind", "index", "events"),
    [
        (1, 0, ['{"choices":[{"delta":{"content":"a"}}]}', "{}", '{"choices":[{"delta":{"content":"b\\n\\u0001"}}]}',
                '{"choices":[{"delta":{"content":"c"},"finish_reason":"stop"}]}', "[DONE]"]),
        (3, 1, ['{"choices":[{"delta":{"tool_calls":[{"index":1,"function":{"arguments":"{\\"x"}}]}}]}',
                '{"choices":[{"delta":{"tool_calls":[{"index":1,"function":{"arguments":""}}]}}]}',
                '{"choices":[{"delta":{"tool_calls":[{"index":2,"function":{"arguments":"y"}}]}}]}']),
        (2, 0, ['{"choices":[{"delta":{"reasoning":"r"}}]}', '{"choices":[{"delta":{"content":"t"}}]}']),
        (0, 0, ['{"choices":[{"delta":{"content":"a"}}]}']),
        (7, 0, ['{"choices":[{"delta":{"content":"a"}}]}']),
        # an event of another type stops the taking: what follows keeps its place behind it
        (1, 0, ['{"choices":[{"delta":{"content":"a"}}]}', 'x\nevent: ping\ndata: {"choices":[{"delta":{"content":"b"}}]}',
                '{"choices":[{"delta":{"content":"c"}}]}']),
        (1, 0, ['x\nevent: error\ndata: {"error":{"message":"m"}}', '{"choices":[{"delta":{"content":"c"}}]}']),
    ],
)
@pytest.mark.parametrize("with_args", [False, True])
@pytest.mark.parametrize("summary", [False, True])
def test_feed_lane_twins_agree(kind: int, index: int, events: list[str], with_args: bool, summary: bool) -> None:
    stream = _lane_stream(events) + b"event: error\ndata: x\n\ndata: {\xff}\n\n"
    results = []
    for impl in IMPLS.values():
        lane = _lane(impl, kind, summary=summary)
        args: list[str] | None = ["y"] if with_args else None
        decoder = impl["SseDecoder"]()
        got = []
        for i in range(0, len(stream), 7):
            got.append(decoder.feed_lane(stream[i : i + 7], lane, index, args))
        results.append((got, _lane_state(lane), args))
    assert results[0] == results[1]
    got, state, args = results[0]
    pieces = state[7][1:]
    frames = [f for g in got for f in g[0]]
    assert len(pieces) == len(frames) == state[9] and state[8] == 10 + len(pieces)
    assert args is None or args[1:] == pieces
    for i, (ty, payload) in enumerate(frames):
        assert ty == "response.output_text.delta"
        assert payload == _delta_json(ty, 10 + i, "msg_1", 2, 0, pieces[i], True, summary)


@pytest.mark.parametrize("index", [0, 3, -1])
def test_a_summary_lane_writes_what_the_turn_writes(index: int) -> None:
    """A summary lane's events, native and pure, are byte for byte the Python path's
    ``reasoning_summary_text.delta`` (``events.summary_delta``): ``summary_index`` where a
    content lane writes ``content_index``, in the same place, and no logprobs."""
    from hotloop.protocol import events as ev

    pieces = ["a", 'b"\\\n\u0001\u2028', "\u00e9\U0001f600", "</s>"]
    stream = _lane_stream([json.dumps({"choices": [{"delta": {"reasoning": p}}]}) for p in pieces])
    fields = ev.summary_delta_fields("rs_\u00e9", 5, index)
    got = []
    for impl in IMPLS.values():
        lane = impl["DeltaLane"](_accel.PLAIN_REASONING, 0, ev.REASONING_SUMMARY_TEXT_DELTA, "rs_\u00e9", 5, index,
                                 False, [], summary=True)
        lane.seq = 7
        frames, rest = impl["SseDecoder"]().feed_lane(stream, lane, 0, None)
        assert rest == [] and lane.parts == pieces and lane.seq == 7 + len(pieces) and lane.taken == len(pieces)
        if index >= 0:
            assert frames == [ev.summary_delta(7 + i, fields, p) for i, p in enumerate(pieces)]
        else:  # no index at all, as a content lane with a negative index
            assert [json.loads(f[1]) for f in frames] == [
                {"type": ev.REASONING_SUMMARY_TEXT_DELTA, "sequence_number": 7 + i, "item_id": "rs_\u00e9",
                 "output_index": 5, "delta": p} for i, p in enumerate(pieces)]
        got.append(frames)
    assert got[0] == got[1]


def test_a_lane_whose_sequence_number_would_overflow_is_refused_unchanged() -> None:
    """The next sequence number beyond a signed 64-bit integer: the native lane wrapped it into
    its frames silently, the pure one refused it with its parts half added. Both refuse it now,
    with the lane as it was."""
    stream = _lane_stream(['{"choices":[{"delta":{"content":"a"}}]}', '{"choices":[{"delta":{"content":"b"}}]}'])
    for impl in IMPLS.values():
        for seq, taken in ((2**63 - 1, 0), (2**63 - 2, 0), (0, 2**63 - 1)):
            lane = _lane(impl, 1, seq=seq)
            lane.taken = taken
            with pytest.raises(OverflowError):
                impl["SseDecoder"]().feed_lane(stream, lane, 0, None)
            assert lane.parts == ["x"] and lane.seq == seq and lane.taken == taken
        lane = _lane(impl, 1, seq=2**63 - 3)
        frames, _ = impl["SseDecoder"]().feed_lane(stream, lane, 0, None)
        assert [json.loads(f[1])["sequence_number"] for f in frames] == [2**63 - 3, 2**63 - 2] and lane.seq == 2**63 - 1


@pytest.mark.parametrize("field", ["event_type", "item_id"])
def test_a_lane_with_a_lone_surrogate_is_refused_when_made(field: str) -> None:
    args = {"event_type": "response.output_text.delta", "item_id": "msg_1", field: "\ud800"}
    for impl in IMPLS.values():
        with pytest.raises(UnicodeEncodeError):
            impl["DeltaLane"](1, 0, args["event_type"], args["item_id"], 0, 0, False, [])


def test_feed_lane_takes_what_plain_delta_takes_and_feed_gives_the_rest() -> None:
    events = ['{"choices":[{"delta":{"content":"a"}}]}', '{"choices":[]}', '{"choices":[{"delta":{"content":"b"}}]}',
              '{"choices":[{"delta":{"content":"c"}}],"usage":{"x":1}}', '{"choices":[{"delta":{"content":"d"}}]}']
    stream = _lane_stream(events)
    for impl in IMPLS.values():
        lane = _lane(impl, 1, seq=0)
        frames, rest = impl["SseDecoder"]().feed_lane(stream, lane, 0, None)
        assert lane.parts == ["x", "a", "b"] and len(frames) == 2 and lane.seq == 2 and lane.taken == 2
        assert rest == impl["SseDecoder"]().feed(_lane_stream(events[3:]))


def test_feed_lane_takes_nothing_when_the_stream_is_broken() -> None:
    for impl in IMPLS.values():
        lane = _lane(impl, 1, seq=0)
        decoder = impl["SseDecoder"](64)
        data = _lane_stream(['{"choices":[{"delta":{"content":"a"}}]}']) + b"data: " + b"x" * 100
        assert outcome(decoder.feed_lane, data, lane, 0, None) == ("err", ValueError)
        assert lane.parts == ["x"] and lane.seq == 0 and lane.taken == 0


@pytest.mark.parametrize(
    "args",
    [("1", 0, "t", "i", 0, 0, True, []), (1, 0, b"t", "i", 0, 0, True, []), (1, 0, "t", None, 0, 0, True, []),
     (1, 0, "t", "i", 0, 0, 1, []), (1, 0, "t", "i", 0, 2**63, True, []), (2**64, 0, "t", "i", 0, 0, True, []),
     (1, 0, "t", "i", 0, 0, True, ()), (1, 0, "t", "i", 0, 0, True, None)],
)
def test_delta_lane_argument_errors_agree(args: tuple[Any, ...]) -> None:
    assert outcome(IMPLS["native"]["DeltaLane"], *args) == outcome(IMPLS["pure"]["DeltaLane"], *args)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1, 0, "t", "i", 0, 0, True, [], True), {}), ((1, 0, "t", "i", 0, 0, True, []), {"summary": 1}),
     ((1, 0, "t", "i", 0, 0, True, []), {"summary": None}), ((1, 0, "t", "i", 0, 0, True, []), {"summary": "yes"}),
     ((1, 0, "t", "i", 0, 0, True, []), {"summary": True, "x": 1}), ((1, 0, "t", "i", 0, 0, True, []), {"summary": True}),
     ((1, 0, "t", "i", 0, 0, True, []), {"summary": False})],
)
def test_delta_lane_summary_argument_agrees(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``summary`` is keyword-only and a bool, in both."""
    native, pure = (outcome(lambda: impl["DeltaLane"](*args, **kwargs)) for impl in IMPLS.values())
    if native[0] == "err" or pure[0] == "err":
        assert native == pure == ("err", TypeError)
    else:
        assert native[1].summary is pure[1].summary is kwargs["summary"]


def test_delta_lane_fields() -> None:
    for impl in IMPLS.values():
        parts: list[str] = []
        lane = impl["DeltaLane"](1, 0, "t", "i", 0, 0, True, parts)
        assert lane.parts is parts and lane.seq == 0 and lane.taken == 0 and lane.emit is None
        assert lane.summary is False  # a content lane unless asked
        with pytest.raises(AttributeError):
            lane.summary = True
        assert impl["DeltaLane"](2, 0, "t", "i", 0, 0, False, parts, summary=True).summary is True
        lane.seq, lane.taken, lane.emit = 5, 2, print
        assert (lane.seq, lane.taken, lane.emit) == (5, 2, print)
        with pytest.raises(AttributeError):
            lane.kind = 2
        with pytest.raises(AttributeError):
            lane.parts = []
        with pytest.raises(TypeError):
            lane.seq = "6"
        with pytest.raises(OverflowError):
            lane.taken = 2**63
        assert (lane.seq, lane.taken) == (5, 2)


@pytest.mark.parametrize("bad", [("x", 0, None), (b"", "0", None), (b"", 2**63, None), (b"", 0, ()), (b"", 0, "ab")])
def test_feed_lane_argument_errors_agree(bad: tuple[Any, Any, Any]) -> None:
    got = []
    for impl in IMPLS.values():
        lane = impl["DeltaLane"](1, 0, "t", "i", 0, 0, True, [])
        got.append(outcome(impl["SseDecoder"]().feed_lane, bad[0], lane, bad[1], bad[2]))
        got.append(outcome(impl["SseDecoder"]().feed_lane, b"", object(), 0, None))
    assert got[:2] == got[2:]
