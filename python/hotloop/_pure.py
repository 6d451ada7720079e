"""Pure-Python twins of every native accelerator.

Each name here has the same API, results and exception classes as its native counterpart
(``hotloop._native`` in Rust, ``hotloop._frames`` in Cython); the tests in
``tests/unit/test_native_twins.py`` and ``tests/property/test_native_twins_props.py`` prove it.
Do not import this module to pick an implementation: use ``hotloop._accel``, which is the one
place that chooses (``HOTLOOP_PURE_PYTHON=1`` forces these twins).

The twins favour obviously-correct code over speed, but they run on the hot path when the
extensions are unavailable, so they avoid gratuitous per-byte or per-char Python work.
"""

from __future__ import annotations

import heapq
import json
import math
import operator
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, SupportsIndex

import msgspec

if TYPE_CHECKING:
    import tiktoken

__all__ = [
    "DEFAULT_MAX_BUFFER",
    "DEFAULT_MAX_ITEMS",
    "DEFAULT_MAX_MATCHES",
    "FINGERPRINT_LEN",
    "MAX_KEY_LEN",
    "MIN_KEY_LEN",
    "PLAIN_ARGUMENTS",
    "PLAIN_NOTHING",
    "PLAIN_REASONING",
    "PLAIN_TEXT",
    "SECRET_PATTERNS",
    "Fingerprinter",
    "ItemChain",
    "SecretScanner",
    "DeltaLane",
    "SseDecoder",
    "TokenCounter",
    "encode_delta",
    "encode_sse",
    "plain_delta",
    "shannon_entropy",
]

DEFAULT_MAX_ITEMS = 100_000
DEFAULT_MAX_BUFFER = 8 * 1024 * 1024
DEFAULT_MAX_MATCHES = 10_000

_U32_MAX = (1 << 32) - 1
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1


# -- integer conversions with the semantics of pyo3's u32/i64 extraction -------------------


def _u32(x: SupportsIndex) -> int:
    v = operator.index(x)
    if not 0 <= v <= _U32_MAX:
        raise OverflowError(f"{v} does not fit in an unsigned 32-bit integer")
    return v


def _i64(x: SupportsIndex) -> int:
    v = operator.index(x)
    if not _I64_MIN <= v <= _I64_MAX:
        raise OverflowError(f"{v} does not fit in a signed 64-bit integer")
    return v


def _non_negative(name: str, x: SupportsIndex) -> int:
    v = operator.index(x)
    if not _I64_MIN <= v <= _I64_MAX:
        raise OverflowError(f"{name}={v} does not fit in a signed 64-bit integer")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def _int_seq(x: object, conv: Callable[[Any], int]) -> list[int]:
    if isinstance(x, str) or not isinstance(x, Sequence):
        raise TypeError(f"expected a sequence of ints, got {type(x).__name__}")
    return [conv(v) for v in x]


# -- Fingerprinter -----------------------------------------------------------------------------

MIN_KEY_LEN = 16
MAX_KEY_LEN = 64
FINGERPRINT_LEN = 16


class Fingerprinter:
    """Keyed BLAKE2b item fingerprints with a 16-byte digest; see
    ``hotloop._native.Fingerprinter`` for the contract."""

    __slots__ = ("_base",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, not {type(key).__name__}")
        if not MIN_KEY_LEN <= len(key) <= MAX_KEY_LEN:
            raise ValueError(f"a fingerprint key must be {MIN_KEY_LEN} to {MAX_KEY_LEN} bytes, got {len(key)}")
        # Copying a keyed state is cheaper than keying a new one per call (same digest).
        self._base = blake2b(digest_size=FINGERPRINT_LEN, key=key)

    def __call__(self, data: bytes) -> bytes:
        if not isinstance(data, bytes):
            raise TypeError(f"data must be bytes, not {type(data).__name__}")
        h = self._base.copy()
        h.update(data)
        return h.digest()

    def __repr__(self) -> str:
        return "Fingerprinter(<key hidden>)"


def _fp(x: object) -> bytes:
    if not isinstance(x, bytes):
        raise TypeError(f"a fingerprint must be bytes, not {type(x).__name__}")
    if len(x) != FINGERPRINT_LEN:
        raise ValueError(f"a fingerprint must be {FINGERPRINT_LEN} bytes, got {len(x)}")
    return x


def _fp_seq(x: object) -> list[bytes]:
    if isinstance(x, str) or not isinstance(x, Sequence):
        raise TypeError(f"expected a sequence of fingerprints, got {type(x).__name__}")
    return [_fp(v) for v in x]


# -- ItemChain ---------------------------------------------------------------------------------


class ItemChain:
    """An ordered chain of (fingerprint, tokens) items with running token sums; see
    ``hotloop._native.ItemChain`` for the contract."""

    __slots__ = ("_cum", "_fps", "_max")

    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        self._max = _non_negative("max_items", max_items)
        self._fps: list[bytes] = []
        self._cum: list[int] = []

    def push(self, fp: bytes, tokens: int) -> None:
        tokens = _u32(tokens)  # checked first, as the native twin extracts it first
        fp = _fp(fp)
        if len(self._fps) >= self._max:
            raise OverflowError(f"ItemChain is full (max_items={self._max})")
        cum = self._cum
        cum.append((cum[-1] if cum else 0) + tokens)
        self._fps.append(fp)

    def extend(self, fps: Sequence[bytes], tokens: Sequence[int]) -> None:
        new_tokens = _int_seq(tokens, _u32)  # checked first, as the native twin extracts it first
        new_fps = _fp_seq(fps)
        if len(new_fps) != len(new_tokens):
            raise ValueError(
                "fps and tokens must have equal lengths "
                f"(got {len(new_fps)} and {len(new_tokens)})"
            )
        if len(new_fps) > self._max - len(self._fps):
            raise OverflowError(f"ItemChain is full (max_items={self._max})")
        cum = self._cum
        total = cum[-1] if cum else 0
        for t in new_tokens:
            total += t
            cum.append(total)
        self._fps.extend(new_fps)

    def __len__(self) -> int:
        return len(self._fps)

    def __repr__(self) -> str:
        return (
            f"ItemChain(len={len(self._fps)}, total_tokens={self.total_tokens}, "
            f"max_items={self._max})"
        )

    @property
    def total_tokens(self) -> int:
        return self._cum[-1] if self._cum else 0

    @property
    def max_items(self) -> int:
        return self._max

    def common_prefix(self, fps: Sequence[bytes], start: int = 0) -> int:
        v = operator.index(start)  # as the binding's argument parsing: before the fingerprints
        if not _I64_MIN <= v <= _I64_MAX:
            raise OverflowError(f"start={v} does not fit in a signed 64-bit integer")
        other = _fp_seq(fps)
        start = _non_negative("start", v)
        n = 0
        for a, b in zip(self._fps[start:], other):
            if a != b:
                break
            n += 1
        return n

    def tokens_upto(self, n: int) -> int:
        n = _non_negative("n", n)
        if n > len(self._cum):
            raise IndexError(f"n={n} is out of range for a chain of {len(self._cum)} items")
        return self._cum[n - 1] if n else 0

    def truncate(self, n: int) -> None:
        n = _non_negative("n", n)
        del self._fps[n:]
        del self._cum[n:]

    def copy(self) -> ItemChain:
        new = ItemChain(self._max)
        new._fps = self._fps.copy()
        new._cum = self._cum.copy()
        return new

    def fingerprint_at(self, i: int) -> bytes:
        i = _non_negative("i", i)
        if i >= len(self._fps):
            raise IndexError(f"i={i} is out of range for a chain of {len(self._fps)} items")
        return self._fps[i]

    def fingerprints(self) -> list[bytes]:
        return self._fps.copy()


# -- SseDecoder --------------------------------------------------------------------------------

_BOM = b"\xef\xbb\xbf"


class SseDecoder:
    """Incremental WHATWG Server-Sent-Events decoder; see ``hotloop._native.SseDecoder``."""

    __slots__ = ("_at_start", "_data", "_data_len", "_event", "_failed", "_line", "_max",
                 "_skip_lf")

    def __init__(self, max_buffer: int = DEFAULT_MAX_BUFFER) -> None:
        self._max = _non_negative("max_buffer", max_buffer)
        self._line = b""  # the pending, not yet terminated line
        self._data: list[bytes] = []  # data values of the current event
        self._data_len = 0  # bytes of the data buffer: values plus one "\n" each
        self._event = b""  # the event type buffer
        self._skip_lf = False  # the previous chunk ended with "\r"
        self._at_start = True  # no line processed yet: a BOM may still be dropped
        self._failed = False

    @property
    def max_buffer(self) -> int:
        return self._max

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        return [_event_tuple(ty, payload) for ty, payload in self._checked(data, "feed")]

    def feed_lane(self, data: bytes, lane: DeltaLane, index: int,
                  args: list[str] | None) -> tuple[list[tuple[str, bytes]], list[tuple[str, str]]]:
        """``feed``, taking the leading plain deltas of ``lane``'s item (see the native stub)."""
        if not isinstance(lane, DeltaLane):
            raise TypeError(f"feed_lane() argument 'lane' must be DeltaLane, not {type(lane).__name__}")
        index = _i64(index)
        if args is not None and not isinstance(args, list):
            raise TypeError(f"feed_lane() argument 'args' must be list or None, not {type(args).__name__}")
        events = self._checked(data, "feed_lane")
        kind = lane.kind
        frames: list[tuple[str, bytes]] = []
        texts: list[str] = []
        taken = 0
        seq = lane.seq
        if kind in (PLAIN_TEXT, PLAIN_REASONING, PLAIN_ARGUMENTS):
            for ty, payload in events:
                if ty != b"message":
                    break
                try:
                    piece = plain_delta(payload.decode("utf-8"))
                except UnicodeDecodeError:
                    break
                if piece is None:
                    break
                k, i, text = piece
                if k != PLAIN_NOTHING:
                    if k != kind or (k == PLAIN_ARGUMENTS and i != index):
                        break
                    if text:
                        frames.append((lane.event_type, _delta_event(
                            lane.event_type, seq + len(frames), lane.item_id, lane.output_index,
                            lane._index_key, lane.content_index, text, lane.logprobs,
                        )))
                        texts.append(text)
                taken += 1
        if seq + len(frames) > _I64_MAX or lane.taken + len(frames) > _I64_MAX:  # refused before the lane changes
            raise OverflowError("the lane's sequence number overflows a signed 64-bit integer")
        lane.parts.extend(texts)
        if args is not None:
            args.extend(texts)
        lane.seq = seq + len(frames)
        lane.taken += len(frames)
        return frames, [_event_tuple(ty, payload) for ty, payload in events[taken:]]

    def _checked(self, data: bytes, name: str) -> list[tuple[bytes, bytes]]:
        if not isinstance(data, bytes):
            raise TypeError(f"{name}() argument 'data' must be bytes, not {type(data).__name__}")
        if self._failed:
            raise ValueError("SSE decoder failed earlier and accepts no more input")
        try:
            return self._feed(data)
        except ValueError:
            self._failed = True
            self._line = b""
            self._data = []
            self._data_len = 0
            self._event = b""
            raise

    def _feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The events completed by ``data``: (type, data) as bytes, type ``message`` by default."""
        if self._skip_lf and data:
            self._skip_lf = False
            if data[0] == 10:
                data = data[1:]
        buf = self._line + data if self._line else data
        lines = buf.splitlines(True)  # bytes.splitlines splits on \r\n, \n and \r only
        tail = b""
        if lines and lines[-1][-1] not in (10, 13):
            tail = lines.pop()
        elif lines and lines[-1][-1] == 13:
            self._skip_lf = True
        out: list[tuple[bytes, bytes]] = []
        limit = self._max
        for raw in lines:
            line = raw[:-2] if raw[-2:] == b"\r\n" else raw[:-1]
            if len(line) > limit:
                raise ValueError(f"SSE line exceeds max_buffer ({limit} bytes)")
            if self._at_start:
                self._at_start = False
                if line[:3] == _BOM:
                    line = line[3:]
            if not line:
                if self._data:
                    out.append((self._event or b"message", b"\n".join(self._data)))
                    self._data = []
                    self._data_len = 0
                self._event = b""
            elif line[0] == 58:  # ":" starts a comment
                continue
            else:
                field, sep, value = line.partition(b":")
                if value[:1] == b" ":
                    value = value[1:]
                if field == b"data":
                    self._data_len += len(value) + 1
                    if self._data_len > limit:
                        raise ValueError(f"SSE event data exceeds max_buffer ({limit} bytes)")
                    self._data.append(value)
                elif field == b"event":
                    self._event = value
        if len(tail) > limit:
            raise ValueError(f"SSE line exceeds max_buffer ({limit} bytes)")
        self._line = tail
        return out


def _event_tuple(ty: bytes, payload: bytes) -> tuple[str, str]:
    return ("message" if ty == b"message" else ty.decode("utf-8", "replace"), payload.decode("utf-8", "replace"))


# -- plain_delta -------------------------------------------------------------------------------

PLAIN_NOTHING, PLAIN_TEXT, PLAIN_REASONING, PLAIN_ARGUMENTS = 0, 1, 2, 3
_MAX_NESTING = 127  # serde_json's recursion limit: 128 nested arrays/objects are an error
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _too_deep(text: str) -> bool:
    if text.count("[") + text.count("{") <= _MAX_NESTING:
        return False
    depth = deepest = 0
    for ch in _JSON_STRING.sub("", text):
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest > _MAX_NESTING


def _negative_zero_float(literal: str) -> int | float:
    if literal == "-0":
        return -0.0
    n = int(literal)
    if not -_FLOAT_INT_MAX <= n <= _FLOAT_INT_MAX:
        try:
            float(n)  # an integer beyond the float range is an error, as in the native reader
        except OverflowError:
            raise ValueError("number out of range") from None
    return n


_FLOAT_INT_MAX = 2**1023  # (every integer up to this converts to a float: the check is for those beyond)


class _Repeated:
    """The value of a key that appears more than once in its object."""


_REPEATED = _Repeated()


def _mark_repeated(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        out[key] = _REPEATED if key in out else value
    return out


def _json_value(text: str) -> Any:
    """The JSON value as the native reader sees it: what msgspec reads (NaN, numbers beyond the
    f64 range and lone surrogates are errors), except that nesting deeper than 127 levels is an
    error, ``-0`` is a float, and a key that appears twice in its object has the value
    ``_REPEATED`` (refused where the rules read it, ignored elsewhere)."""
    if _too_deep(text):  # first: msgspec's own reading of a deeper nesting is a RecursionError
        raise ValueError("nested too deeply")
    msgspec.json.decode(text)  # the errors msgspec finds
    return json.loads(text, object_pairs_hook=_mark_repeated, parse_int=_negative_zero_float)


def _int(value: Any) -> int | None:
    """A JSON integer within i64, else None."""
    return value if type(value) is int and _I64_MIN <= value <= _I64_MAX else None


def _opt_str(obj: dict[str, Any], key: str) -> tuple[bool, str]:
    """(valid, the string or ""): absent, null or a string is valid."""
    v = obj.get(key)
    if v is None:
        return True, ""
    if type(v) is str:
        return True, v
    return False, ""


def plain_delta(data: str) -> tuple[int, int, str] | None:
    """One stream event's plain delta as ``(kind, index, text)``, or None when the general path
    must read it; see ``hotloop._native.plain_delta`` (the rules) and ``rust/core/src/plain.rs``."""
    if not isinstance(data, str):  # a subclass of str is a str, as for the native call
        raise TypeError(f"plain_delta() argument 'data' must be str, not {type(data).__name__}")
    data = str.__str__(data)  # its characters as a str (msgspec reads no subclass)
    data.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError, as in the native call
    try:
        top = _json_value(data)
    except ValueError:
        return None
    if type(top) is not dict or any(top.get(k) is not None for k in ("error", "usage", "status_code")):
        return None
    choices = top.get("choices", [])
    if type(choices) is not list or len(choices) > 1:
        return None
    if not choices:
        return PLAIN_NOTHING, 0, ""
    choice = choices[0]
    if type(choice) is not dict:
        return None
    if "index" in choice and _int(choice["index"]) != 0:
        return None
    if choice.get("finish_reason") is not None:
        return None
    delta = choice.get("delta")
    if delta is None:
        return PLAIN_NOTHING, 0, ""
    if type(delta) is not dict:
        return None
    pieces = [_opt_str(delta, k) for k in ("content", "reasoning", "reasoning_content", "refusal")]
    # a refusal piece is never plain: the general path makes it a message's refusal part
    # (response.refusal.*), which has no lane
    if not all(ok for ok, _ in pieces) or pieces[3][1]:
        return None
    content, reasoning = pieces[0][1], pieces[1][1] or pieces[2][1]
    calls = delta.get("tool_calls")
    if calls is None:
        calls = []
    elif type(calls) is not list:
        return None
    if content and not reasoning and not calls:
        return PLAIN_TEXT, 0, content
    if reasoning and not content and not calls:
        return PLAIN_REASONING, 0, reasoning
    if not content and not reasoning and not calls:
        return PLAIN_NOTHING, 0, ""
    if content or reasoning or len(calls) != 1 or type(calls[0]) is not dict:
        return None
    call = calls[0]
    index = _int(call.get("index"))
    ok, call_id = _opt_str(call, "id")
    if index is None or not ok or call_id:
        return None
    function = call.get("function")
    if function is None:
        return PLAIN_ARGUMENTS, index, ""
    if type(function) is not dict or not _opt_str(function, "name")[0]:
        return None
    ok, arguments = _opt_str(function, "arguments")
    return (PLAIN_ARGUMENTS, index, arguments) if ok else None


class DeltaLane:
    """The output item whose plain deltas ``SseDecoder.feed_lane`` turns into events; see
    ``hotloop._native.DeltaLane``."""

    __slots__ = ("_kind", "_call", "_event_type", "_item_id", "_output_index", "_content_index", "_logprobs",
                 "_summary", "_index_key", "_parts", "_seq", "_taken", "emit")

    def __init__(self, kind: int, call: int, event_type: str, item_id: str, output_index: int,
                 content_index: int, logprobs: bool, parts: list[str], *, summary: bool = False) -> None:
        for name, value in (("event_type", event_type), ("item_id", item_id)):
            if not isinstance(value, str):
                raise TypeError(f"argument '{name}' must be str, not {type(value).__name__}")
        for name, flag in (("logprobs", logprobs), ("summary", summary)):
            if not isinstance(flag, bool):
                raise TypeError(f"argument '{name}' must be bool, not {type(flag).__name__}")
        if not isinstance(parts, list):
            raise TypeError(f"argument 'parts' must be list, not {type(parts).__name__}")
        event_type.encode("utf-8")  # a lone surrogate: UnicodeEncodeError now, as the native
        item_id.encode("utf-8")  # lane's (not once a feed has taken its events)
        self._kind, self._call = _i64(kind), _i64(call)
        self._event_type, self._item_id = event_type, item_id
        self._output_index, self._content_index = _i64(output_index), _i64(content_index)
        self._logprobs = logprobs
        self._summary = summary
        self._index_key = "summary_index" if summary else "content_index"  # the key the index is written as
        self._parts = parts
        self._seq = self._taken = 0
        self.emit: Any = None

    kind = property(lambda self: self._kind, doc="PLAIN_TEXT, PLAIN_REASONING or PLAIN_ARGUMENTS")
    call = property(lambda self: self._call, doc="the call's index in the response (arguments)")
    event_type = property(lambda self: self._event_type)
    item_id = property(lambda self: self._item_id)
    output_index = property(lambda self: self._output_index)
    content_index = property(lambda self: self._content_index)
    logprobs = property(lambda self: self._logprobs)
    summary = property(lambda self: self._summary, doc="the index is written as summary_index, not content_index")
    parts = property(lambda self: self._parts, doc="the item's pieces so far (appended to)")

    @property
    def seq(self) -> int:
        """The sequence number of the next event."""
        return self._seq

    @seq.setter
    def seq(self, value: int) -> None:
        self._seq = _i64(value)

    @property
    def taken(self) -> int:
        """Pieces taken (added to by ``feed_lane``; the owner sets it back)."""
        return self._taken

    @taken.setter
    def taken(self, value: int) -> None:
        self._taken = _i64(value)


# -- encode_delta / encode_sse -----------------------------------------------------------------

_encode = msgspec.json.Encoder().encode


def encode_delta(
    event_type: str,
    sequence_number: int,
    item_id: str,
    output_index: int,
    content_index: int,
    delta: str,
    logprobs: bool,
) -> bytes:
    """``msgspec.json.encode`` of the delta event dict, keys in wire order."""
    return _delta_event(event_type, sequence_number, item_id, output_index, "content_index", content_index, delta,
                        logprobs)


def _delta_event(
    event_type: str,
    sequence_number: int,
    item_id: str,
    output_index: int,
    index_key: str,
    index: int,
    delta: str,
    logprobs: bool,
) -> bytes:
    """``encode_delta`` with the part index written as ``index_key`` (``content_index``, or a
    summary lane's ``summary_index``)."""
    d: dict[str, object] = {
        "type": event_type,
        "sequence_number": sequence_number,
        "item_id": item_id,
        "output_index": output_index,
    }
    if index >= 0:
        d[index_key] = index
    d["delta"] = delta
    if logprobs:
        d["logprobs"] = []
    return _encode(d)


def encode_sse(event_type: str, payload: bytes) -> bytes:
    """One Server-Sent Event: ``b"event: " + event_type + b"\\ndata: " + payload + b"\\n\\n"``."""
    return b"".join((b"event: ", event_type.encode("utf-8"), b"\ndata: ", payload, b"\n\n"))


def body_buffer(size: int) -> bytearray:
    """A ``bytearray`` of ``size`` bytes for a request body that reads will fill (the native
    twin leaves its contents unset; here they are zeros)."""
    size = operator.index(size)  # as bytearray(size): a TypeError for a float, any __index__ taken
    if size < 0:
        raise ValueError("negative count")
    return bytearray(size)


# -- secret scanner ----------------------------------------------------------------------------
#
# SECRET_PATTERNS is THE pattern table: the Rust scanner (``hotloop._native.SecretScanner``) is
# built from it too, so both implementations always scan for the same kinds with the same
# patterns. A row is ``(kind, pattern, edge, min_entropy)``:
#
# * kind: the id in verdicts and in ``[REDACTED:<kind>]``; earlier rows win ties (same span);
# * pattern: in the subset the Rust ``regex`` crate and ``re`` read alike: ASCII only, explicit
#   ASCII classes (no \w \d \s \b), no flags (case-insensitive words are spelled ``[Kk][Ee][Yy]``),
#   no anchors, look-around or back-references; a group named ``secret`` is the reported span;
# * edge: characters that must not touch the span on either side (a key glued to more key
#   characters is part of a longer token);
# * min_entropy: Shannon entropy of the span, bits per character (0: no check). Vendor tokens
#   need 3.0, which random tokens pass and placeholders (``ghp_xxxx...``) fail; generic
#   ``password=``/``token:`` assignments need 3.5 over a value of 12 or more characters.

_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_ALNUM = _UPPER + _UPPER.lower() + "0123456789"
_WORD = _ALNUM + "_"
_TOKEN = _ALNUM + "_-"

# A span ending so is not a secret: the placeholder keys of vendor documentation (AWS's
# AKIAIOSFODNN7EXAMPLE and its secret ...EXAMPLEKEY), which docs quote and models write (the
# Rust scanner's rule 1 too)
_PLACEHOLDER_ENDS = ("EXAMPLE", "EXAMPLEKEY")
TOKEN_MIN_ENTROPY = 3.0
GENERIC_MIN_ENTROPY = 3.5


def _ci(word: str) -> str:
    """A case-insensitive spelling of an ASCII word without flags: ``key`` -> ``[Kk][Ee][Yy]``."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in word)


# `"password": "`, `token = '`, `API_KEY=`, `secret => `, `\"token\":\"` (JSON inside JSON)
_ASSIGN = r"""\\?["']?[ \t]{0,8}(?:=>|:=|=|:)[ \t]{0,8}\\?["']?"""
_GENERIC_KEY = "(?:" + "|".join((
    _ci("password"), _ci("passwd"), _ci("secret"), _ci("token"),
    *(_ci(w) + "[_-]?" + _ci("key") for w in ("api", "access", "auth", "private")),
)) + ")"
_PEM_LABEL = r"[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?-----"
_PEM_BODY = r"[A-Za-z0-9+/=\\\r\n\t :,.]"  # a PEM block's characters but the dash

SECRET_PATTERNS: tuple[tuple[str, str, str, float], ...] = (
    # A PEM private key block; without its END line (a truncated paste), the header and at
    # least 64 characters of base64. The block's body holds no "--" (a dash is followed by
    # another character of the body: "DEK-Info", "AES-128-CBC"), so the search for its END line
    # stops at the next "-----" of the text: with "[...-]{16,}?" it ran on through every later
    # BEGIN line to the text's end, once per BEGIN line (quadratic: 18 s for a 1.8 MB text of
    # short BEGIN blocks, on the event loop).
    ("private_key",
     r"-----BEGIN" + _PEM_LABEL + r"(?:(?:" + _PEM_BODY + r"|-" + _PEM_BODY + r"){16,}?-----END" + _PEM_LABEL
     # (a backslash only with the character it escapes: a key in JSON text, "\n" between its
     # lines, does not end on the backslash of an escaped quote, which its redaction would take)
     + r"|(?:[A-Za-z0-9+/=\r\n]|\\[A-Za-z0-9+/=\\]){64,})", "", 0.0),
    ("aws_access_key_id", r"(?:AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16}", _ALNUM, TOKEN_MIN_ENTROPY),
    # 40 characters of base64 only after an AWS secret keyword
    ("aws_secret_access_key",
     "(?:" + _ci("aws") + "[A-Za-z0-9_.-]{0,20}" + _ci("secret") + "|" + _ci("secret") + "_?"
     + _ci("access") + "_?" + _ci("key") + ")[A-Za-z0-9_.-]{0,20}" + _ASSIGN
     + r"(?P<secret>[A-Za-z0-9/+]{40})", _ALNUM + "+/", TOKEN_MIN_ENTROPY),
    ("github_token", r"gh[pousr]_[A-Za-z0-9]{36,251}", _WORD, TOKEN_MIN_ENTROPY),
    ("github_fine_grained_token", r"github_pat_[A-Za-z0-9]{22}_[A-Za-z0-9]{59}", _WORD,
     TOKEN_MIN_ENTROPY),
    ("gitlab_token", r"gl(?:pat|dt|ptt|rt)-[A-Za-z0-9_.-]{20,}", _TOKEN, TOKEN_MIN_ENTROPY),
    ("slack_token", r"(?:xox[abposr]-[0-9]{6,}-[A-Za-z0-9-]{8,}|xapp-[0-9]-[A-Za-z0-9-]{10,})",
     _TOKEN, TOKEN_MIN_ENTROPY),
    ("slack_webhook_url",
     r"(?:https?://)?hooks\.slack\.com/services/T[A-Z0-9]{6,}/B[A-Z0-9]{6,}/[A-Za-z0-9]{20,}",
     _WORD, 0.0),
    ("stripe_secret_key", r"[rs]k_live_[A-Za-z0-9]{20,}", _WORD, TOKEN_MIN_ENTROPY),
    # Test-mode keys move no money but read and change the account's test data and settings.
    ("stripe_test_key", r"[rs]k_test_[A-Za-z0-9]{20,}", _WORD, TOKEN_MIN_ENTROPY),
    ("google_api_key", r"AIza[A-Za-z0-9_-]{35}", _TOKEN, TOKEN_MIN_ENTROPY),
    ("anthropic_api_key", r"sk-ant-(?:api|admin|oat|sid)[0-9]{2}-[A-Za-z0-9_-]{32,}", _TOKEN,
     TOKEN_MIN_ENTROPY),
    ("openai_api_key", r"sk-(?:(?:proj|svcacct|admin)-[A-Za-z0-9_-]{40,}|[A-Za-z0-9]{32,})",
     _TOKEN, TOKEN_MIN_ENTROPY),
    ("cerebras_api_key", r"csk-[A-Za-z0-9]{32,}", _TOKEN, TOKEN_MIN_ENTROPY),
    ("groq_api_key", r"gsk_[A-Za-z0-9]{48,}", _WORD, TOKEN_MIN_ENTROPY),
    ("huggingface_token", r"hf_[A-Za-z0-9]{34}", _WORD, TOKEN_MIN_ENTROPY),
    ("npm_token", r"npm_[A-Za-z0-9]{36}", _WORD, TOKEN_MIN_ENTROPY),
    ("pypi_token", r"pypi-AgE(?:IcHlwaS5vcmc|NdGVzdC5weXBpLm9yZw)[A-Za-z0-9_-]{50,}", _TOKEN,
     TOKEN_MIN_ENTROPY),
    ("twilio_api_key", r"SK[0-9a-f]{32}", _ALNUM, TOKEN_MIN_ENTROPY),
    ("sendgrid_api_key", r"SG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43}", _TOKEN, TOKEN_MIN_ENTROPY),
    ("azure_storage_account_key", r"[Aa]ccount[Kk]ey=(?P<secret>[A-Za-z0-9+/]{86}==)",
     _ALNUM + "+/", TOKEN_MIN_ENTROPY),
    ("digitalocean_token", r"do[opr]_v1_[a-f0-9]{64}", _WORD, TOKEN_MIN_ENTROPY),
    ("shopify_token", r"shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}", _WORD, TOKEN_MIN_ENTROPY),
    ("age_secret_key", r"AGE-SECRET-KEY-1[QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L]{58}", _ALNUM,
     TOKEN_MIN_ENTROPY),
    ("jwt", r"eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}", _TOKEN, 0.0),
    # the password of scheme://user:password@host
    ("url_password",
     r"""://[^ \t\r\n"'<>:@/\\]{0,128}:(?P<secret>[^ \t\r\n"'<>:@/\\]{3,128})@""", "",
     TOKEN_MIN_ENTROPY),
    ("authorization_header",
     _ci("authorization") + r"""\\?["']?[ \t]{0,8}[:=][ \t]{0,8}\\?["']?"""
     + r"(?:[Bb]earer|[Bb]asic|[Tt]oken)[ \t]{1,8}(?P<secret>[A-Za-z0-9_~+/=.-]{16,})", "",
     TOKEN_MIN_ENTROPY),
    ("generic_secret",
     _GENERIC_KEY + r"(?:[_.-][A-Za-z0-9_.-]{0,30})?" + _ASSIGN
     # a "$" ends the value: "$DB_PASSWORD", "root_$MYSQL_PWD", "prefix_$CI_JOB_ID" are a shell's
     # references, not secrets (a password holding a "$" is found when 12 characters precede it)
     + r"(?P<secret>[A-Za-z0-9+/=_~!@#%^&*?-]{12,})", "", GENERIC_MIN_ENTROPY),
)


def shannon_entropy(s: str) -> float:
    """Shannon entropy of the characters of ``s`` in bits per character (0.0 when empty):
    ``log2(n) - sum(c * log2(c) for each character count c, in code point order) / n``, the
    same float operations in the same order as the Rust scanner."""
    n = len(s)
    if not n:
        return 0.0
    total = 0.0
    for _, c in sorted(Counter(s).items()):
        total += c * math.log2(c)
    return math.log2(n) - total / n


def splice(text: str, cuts: Iterable[tuple[int, int, str]]) -> str:
    """``text`` with each cut ``(start, end, replacement)``, in order of start, replaced; a cut
    that starts inside the one before extends it (its own replacement dropped), and one that
    ends inside it is dropped. Not a twin: the redaction of spans the scanner did not find alone
    (:func:`redact_spans`), and of overlapping ones (``hotloop.pipeline.classify``)."""
    parts: list[str] = []
    at = 0
    for s, e, replacement in cuts:
        if e <= at:
            continue
        if s < at:
            at = e
            continue
        parts.append(text[at:s])
        parts.append(replacement)
        at = e
    parts.append(text[at:])
    return "".join(parts)


def redact_spans(text: str, spans: Iterable[tuple[str, int, int]]) -> str:
    """``text`` with each of ``spans`` (``(kind, start, end)``, the scanner's: sorted, apart)
    replaced by ``[REDACTED:<kind>]``: what ``SecretScanner.redact`` makes of its own scan."""
    return splice(text, ((s, e, f"[REDACTED:{kind}]") for kind, s, e in spans))


_KIND_RE = re.compile(r"[a-z][a-z0-9_]*")


#: Letters that end a two-character escape (``\\n``, ``\\t``...) in JSON or C-like text.
_ESCAPE_LETTERS = frozenset("bfnrt")
_HEX = frozenset("0123456789abcdefABCDEF")


def _odd_backslashes_before(text: str, i: int) -> bool:
    run = 0
    while i - run > 0 and text[i - run - 1] == "\\":
        run += 1
    return run % 2 == 1


def _escaped(text: str, i: int) -> bool:
    """Whether ``text[i]`` ends an escape: one of ``bfnrt`` after an odd run of backslashes, or
    the last hex digit of a ``\\uXXXX`` escape. A token right after ``\\n`` or ``\\u003e`` in
    JSON-encoded text (a tool output holding JSON) then starts at a boundary, as it would after
    the character the escape stands for."""
    if text[i] in _ESCAPE_LETTERS and _odd_backslashes_before(text, i):
        return True
    return (
        i >= 5
        and text[i - 4] == "u"
        and all(c in _HEX for c in text[i - 3 : i + 1])
        and _odd_backslashes_before(text, i - 4)
    )


class SecretScanner:
    """Finds well-known credential formats in text; see ``hotloop._native.SecretScanner``."""

    __slots__ = ("_kinds", "_max", "_rules")

    def __init__(
        self, patterns: Sequence[tuple[str, str, str, float]], max_matches: int = DEFAULT_MAX_MATCHES
    ) -> None:
        self._max = _non_negative("max_matches", max_matches)
        if isinstance(patterns, str) or not isinstance(patterns, Sequence):
            raise TypeError(f"patterns must be a sequence, not {type(patterns).__name__}")
        rows: list[tuple[str, str, str, float]] = []
        for row in patterns:
            if not isinstance(row, tuple):
                raise TypeError("each pattern must be a (kind, pattern, edge, min_entropy) tuple")
            if len(row) != 4:
                raise ValueError(f"expected tuple of length 4, but got tuple of length {len(row)}")
            kind, pattern, edge, min_entropy = row
            if not all(isinstance(x, str) for x in (kind, pattern, edge)):
                raise TypeError("kind, pattern and edge must be str")
            if isinstance(min_entropy, (str, bytes, bytearray)):
                raise TypeError("min_entropy must be a real number")
            rows.append((kind, pattern, edge, float(min_entropy)))
        rules: list[tuple[re.Pattern[str], int | None, frozenset[str], float]] = []
        kinds: list[str] = []
        for index, (kind, pattern, edge, min_entropy) in enumerate(rows):
            if not _KIND_RE.fullmatch(kind):
                raise ValueError(f"secret pattern {index}: kind {kind!r} is not [a-z][a-z0-9_]*")
            if kind in kinds:
                raise ValueError(f"secret pattern {index}: kind {kind!r} appears twice")
            if not edge.isascii():
                raise ValueError(f"secret pattern {index}: edge characters must be ASCII")
            if not (math.isfinite(min_entropy) and min_entropy >= 0.0):
                raise ValueError(f"secret pattern {index}: min_entropy must be finite and >= 0")
            try:
                rx = re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"secret pattern {index}: bad pattern: {exc}") from None
            if rx.search("") is not None:
                raise ValueError(f"secret pattern {index}: pattern matches the empty string")
            rules.append((rx, rx.groupindex.get("secret"), frozenset(edge), min_entropy))
            kinds.append(kind)
        self._rules = rules
        self._kinds = tuple(kinds)

    @property
    def kinds(self) -> tuple[str, ...]:
        return self._kinds

    @property
    def max_matches(self) -> int:
        return self._max

    def _kept(self, k: int, text: str) -> Iterator[tuple[int, int, int, int]]:
        """Kind ``k``'s kept matches as ``(start, -length, k, end)``, in text order."""
        rx, group, edge, min_entropy = self._rules[k]
        n = len(text)
        for m in rx.finditer(text):
            s, e = m.span(group or 0)
            if s == e:  # also a `secret` group that did not take part (-1, -1)
                continue
            if edge and ((s > 0 and text[s - 1] in edge and not _escaped(text, s - 1)) or (e < n and text[e] in edge)):
                continue
            if min_entropy > 0.0 and shannon_entropy(text[s:e]) < min_entropy:
                continue
            if text.endswith(_PLACEHOLDER_ENDS, s, e):  # vendor documentation's placeholder keys
                continue
            yield (s, s - e, k, e)

    def scan(self, text: str) -> list[tuple[str, int, int]]:
        if not isinstance(text, str):
            raise TypeError(f"scan() argument must be str, not {type(text).__name__}")
        out: list[tuple[str, int, int]] = []
        if self._max == 0 or not text:
            return out
        kinds = self._kinds
        last_end = 0
        for s, _, k, e in heapq.merge(*(self._kept(k, text) for k in range(len(kinds)))):
            if s < last_end:
                continue
            out.append((kinds[k], s, e))
            last_end = e
            if len(out) >= self._max:
                break
        return out

    def redact(self, text: str) -> tuple[str, list[tuple[str, int, int]]]:
        spans = self.scan(text)
        return (redact_spans(text, spans) if spans else text), spans


# -- TokenCounter ------------------------------------------------------------------------------

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


class TokenCounter:
    """o200k_base token counts by tiktoken itself; see ``hotloop._native.TokenCounter`` for the
    contract. The encoding is built at the first count from ``ranks`` as it is then (the native
    counter copies it at once; nobody changes it); over the process's own vocabulary it is the
    process's encoding (``hotloop.tokenizer.encoding``, which the simulator uses too), not a
    second copy of about 40 MB."""

    __slots__ = ("_encoding", "_lock", "_ranks")

    def __init__(self, ranks: dict[bytes, int]) -> None:
        if not isinstance(ranks, dict):
            raise TypeError(f"ranks must be a dict, not {type(ranks).__name__}")
        seen: set[int] = set()
        duplicate = False
        for key, rank in ranks.items():
            if not isinstance(key, bytes):
                raise TypeError(f"a vocabulary key must be bytes, not {type(key).__name__}")
            r = _u32(rank)
            duplicate = duplicate or r in seen
            seen.add(r)
        for b in range(256):
            if bytes((b,)) not in ranks:
                raise ValueError(f"the vocabulary has no token for the single byte {b:#04x}")
        if duplicate:
            raise ValueError("the vocabulary has more than one token of a rank")
        self._ranks = ranks
        self._encoding: tiktoken.Encoding | None = None
        self._lock = threading.Lock()

    def _encode(self) -> Callable[[str], list[int]]:
        enc = self._encoding
        if enc is None:
            with self._lock:
                if self._encoding is None:
                    from hotloop import tokenizer  # imports this module

                    own = self._ranks is tokenizer._ranks  # (built from these very ranks)
                    self._encoding = tokenizer.encoding() if own else tokenizer.encoding_of(self._ranks)
                enc = self._encoding
        return enc.encode_ordinary

    def count(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"count() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        encode = self._encode()
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
