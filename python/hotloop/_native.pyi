"""hotloop's Rust extension (``rust/py`` over ``rust/core``).

Coarse calls typed with builtins: one call per item, turn or network chunk, never per token.
Every name has a pure-Python twin in ``hotloop._pure`` with identical results and exception
classes; import them through ``hotloop._accel``, which picks one.
"""

from collections.abc import Sequence

from typing import Any, Final, final

__all__ = [
    "PLAIN_ARGUMENTS",
    "PLAIN_NOTHING",
    "PLAIN_REASONING",
    "PLAIN_TEXT",
    "DeltaLane",
    "Fingerprinter",
    "ItemChain",
    "SecretScanner",
    "SseDecoder",
    "TokenCounter",
    "plain_delta",
]

PLAIN_NOTHING: Final[int]  # 0: a chunk that changes nothing
PLAIN_TEXT: Final[int]  # 1: message text
PLAIN_REASONING: Final[int]  # 2: reasoning text
PLAIN_ARGUMENTS: Final[int]  # 3: tool-call arguments

def plain_delta(data: str) -> tuple[int, int, str] | None:
    """Whether one chat-completions stream event's data (JSON) only continues the open output
    item, and its piece: ``(PLAIN_TEXT, 0, text)``, ``(PLAIN_REASONING, 0, text)``,
    ``(PLAIN_ARGUMENTS, index, arguments)`` (the call's ``index`` as the server numbers it;
    the arguments may be empty), ``(PLAIN_NOTHING, 0, "")``, or None: the event is for the
    general path (the chunk decoder and assembler).

    Plain means: a JSON object whose ``error``, ``usage`` and ``status_code`` are absent or null
    and whose ``choices`` is absent or holds at most one choice; that choice has ``index`` absent
    or the integer 0, ``finish_reason`` absent or null, and ``delta`` absent, null, or an object
    whose ``content``, ``reasoning``, ``reasoning_content`` and ``refusal`` are absent, null or
    strings (``refusal`` empty) and ``tool_calls`` absent, null or an array, with at most one
    non-empty piece among content, reasoning (``reasoning``, else ``reasoning_content``) and a
    single tool call. The tool call has an integer ``index``, an ``id`` that is absent, null or
    empty, and ``function`` absent, null, or an object whose ``name`` and ``arguments`` are
    absent, null or strings. Other keys are ignored.

    The JSON is read strictly: a duplicate key, NaN, a number beyond the float range, a lone
    surrogate or nesting deeper than 127 levels gives None, and ``-0`` is a float (no integer
    index). So whatever this accepts, msgspec's typed decoder reads with the same values.

    :raises TypeError: ``data`` is not ``str``.
    :raises UnicodeEncodeError: ``data`` holds a lone surrogate.
    """

@final
class DeltaLane:
    """The open output item whose plain deltas :meth:`SseDecoder.feed_lane` turns into events:
    ``kind`` (``PLAIN_TEXT``, ``PLAIN_REASONING`` or ``PLAIN_ARGUMENTS``), ``call`` (for
    arguments: the call's index in the response; ``feed_lane`` does not read it), the event's
    fields as ``hotloop._frames.encode_delta`` takes them, and ``parts``, the item's pieces so
    far, which ``feed_lane`` appends to. With ``summary`` (a reasoning summary's part:
    ``response.reasoning_summary_text.delta``), ``content_index`` is written as
    ``"summary_index"``, in the same place and likewise left out when negative; the events are
    otherwise ``encode_delta``'s. ``seq`` is the sequence number of the next event and
    ``taken`` counts the pieces taken (both start at 0; ``feed_lane`` adds to them, the owner
    sets them). ``emit`` is for the owner: a callable, or None, never called here.
    """

    def __new__(
        cls, kind: int, call: int, event_type: str, item_id: str, output_index: int,
        content_index: int, logprobs: bool, parts: list[str], *, summary: bool = False,
    ) -> DeltaLane:
        """:raises TypeError: an argument of the wrong type.
        :raises OverflowError: an int that does not fit in a signed 64-bit integer.
        :raises UnicodeEncodeError: ``event_type`` or ``item_id`` holds a lone surrogate."""

    @property
    def kind(self) -> int: ...
    @property
    def call(self) -> int: ...
    @property
    def event_type(self) -> str: ...
    @property
    def item_id(self) -> str: ...
    @property
    def output_index(self) -> int: ...
    @property
    def content_index(self) -> int: ...
    @property
    def logprobs(self) -> bool: ...
    @property
    def summary(self) -> bool: ...
    @property
    def parts(self) -> list[str]: ...
    @property
    def seq(self) -> int: ...
    @seq.setter
    def seq(self, value: int) -> None: ...
    @property
    def taken(self) -> int: ...
    @taken.setter
    def taken(self, value: int) -> None: ...
    @property
    def emit(self) -> Any: ...
    @emit.setter
    def emit(self, value: Any) -> None: ...

@final
class Fingerprinter:
    """Item fingerprints under one secret key: keyed BLAKE2b with a 16-byte digest (digest and
    key length in the parameter block, not a truncated BLAKE2b-512), by the ``blake2b_simd``
    crate.

    ``Fingerprinter(key)(data)`` equals ``hashlib.blake2b(data, digest_size=16, key=key).digest()``.
    The key is kept in Rust and never shown (``repr`` hides it).
    """

    def __new__(cls, key: bytes) -> Fingerprinter:
        """Fingerprints under ``key``.

        :raises ValueError: ``key`` is shorter than 16 or longer than 64 bytes.
        :raises TypeError: ``key`` is not ``bytes``.
        """

    def __call__(self, data: bytes) -> bytes:
        """The 16-byte fingerprint of ``data``. Inputs of 16 KiB or more are hashed with the GIL
        released.

        :raises TypeError: ``data`` is not ``bytes`` (bytearray and memoryview are refused too).
        """

@final
class ItemChain:
    """An ordered chain of conversation items, each a ``(fingerprint, tokens)`` pair, with
    running token sums, held in Rust.

    Fingerprints are 16-byte ``bytes`` (``Fingerprinter`` values): another type raises
    ``TypeError``, another length ``ValueError``. Token counts are unsigned 32-bit ints; other
    values raise ``OverflowError`` (out of range) or ``TypeError`` (not an int); token counts are
    checked before fingerprints. The chain is bounded: growing it beyond ``max_items`` raises
    ``OverflowError`` and leaves it unchanged.
    """

    def __new__(cls, max_items: int = 100000) -> ItemChain:
        """An empty chain holding at most ``max_items`` items.

        :raises ValueError: ``max_items`` is negative.
        """

    def push(self, fp: bytes, tokens: int) -> None:
        """Append one item.

        :raises OverflowError: the chain already holds ``max_items`` items, or ``tokens`` is out
            of range.
        :raises ValueError: ``fp`` is not 16 bytes long.
        """

    def extend(self, fps: Sequence[bytes], tokens: Sequence[int]) -> None:
        """Append many items, all or nothing.

        :raises ValueError: ``fps`` and ``tokens`` differ in length, or a fingerprint is not 16
            bytes long.
        :raises OverflowError: the chain would exceed ``max_items``, or a token count is out of
            range.
        """

    def __len__(self) -> int:
        """Number of items."""

    @property
    def total_tokens(self) -> int:
        """Sum of the tokens of all items."""

    @property
    def max_items(self) -> int:
        """The capacity bound given to the constructor."""

    def common_prefix(self, fps: Sequence[bytes], start: int = 0) -> int:
        """How many leading entries of ``fps`` equal this chain's fingerprints from item
        ``start`` on (0 when ``start`` is at or past the end; every entry of ``fps`` is validated
        as a 16-byte ``bytes`` first).

        :raises ValueError: ``start`` is negative.
        """

    def tokens_upto(self, n: int) -> int:
        """Sum of the tokens of the first ``n`` items (``tokens_upto(0) == 0``).

        :raises IndexError: ``n > len(self)``.
        :raises ValueError: ``n`` is negative.
        """

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` items; a no-op when ``n >= len(self)``.

        :raises ValueError: ``n`` is negative.
        """

    def copy(self) -> ItemChain:
        """An independent copy (same items and ``max_items``)."""

    def fingerprint_at(self, i: int) -> bytes:
        """The fingerprint of item ``i`` (without copying the others, as ``fingerprints()``
        would).

        :raises IndexError: ``i >= len(self)``.
        :raises ValueError: ``i`` is negative.
        """

    def fingerprints(self) -> list[bytes]:
        """The fingerprints, in order (a new list)."""

@final
class SseDecoder:
    """Incremental Server-Sent-Events decoder (WHATWG "event stream interpretation") for
    backend HTTP streams; one ``feed`` per network chunk.

    * Lines end in ``\\r\\n``, ``\\n`` or ``\\r``; a ``\\r`` ending one chunk and a ``\\n``
      starting the next are one line ending.
    * A line starting with ``:`` is a comment. ``field:value`` drops one leading space of the
      value; a line without ``:`` is a field with an empty value.
    * ``data`` values are joined with ``\\n``; ``event`` sets the type (``"message"`` when unset
      or empty); ``id``, ``retry`` and unknown fields are ignored.
    * A blank line dispatches the event if its data buffer is non-empty (no ``data`` line means
      no event) and always resets the data and type buffers.
    * Input is UTF-8; invalid sequences become U+FFFD; a BOM at the very start of the stream is
      dropped. An incomplete trailing event is held until more input arrives.
    """

    def __new__(cls, max_buffer: int = 8388608) -> SseDecoder:
        """A decoder bounding one line, and one event's data, to ``max_buffer`` bytes.

        :raises ValueError: ``max_buffer`` is negative.
        """

    @property
    def max_buffer(self) -> int:
        """The bound given to the constructor."""

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        """Consume one chunk and return the events it completed, as ``(event_type, data)``
        pairs in stream order (``feed(b"")`` returns ``[]``).

        :raises ValueError: a line (complete or pending, terminator excluded) exceeds
            ``max_buffer`` bytes, or an event's data buffer (values plus one ``\\n`` per ``data``
            line) does. The decoder is then failed: this and every later ``feed`` raise
            ``ValueError`` and no events are returned.
        :raises TypeError: ``data`` is not ``bytes``.
        """

    def feed_lane(
        self, data: bytes, lane: DeltaLane, index: int, args: list[str] | None
    ) -> tuple[list[tuple[str, bytes]], list[tuple[str, str]]]:
        """``feed``, taking the leading plain deltas of ``lane``'s item: events of type
        ``message`` whose data is valid UTF-8 and whose :func:`plain_delta` is of the lane's
        kind (for arguments, of the call the server numbers ``index``), or ``PLAIN_NOTHING``,
        are taken in order until the first that is not. Each non-empty piece taken is appended
        to ``lane.parts`` (and to ``args`` unless None) and becomes one Responses event
        ``(lane.event_type, json)`` (``encode_delta`` with the lane's fields; ``summary_index``
        in place of ``content_index`` for a ``summary`` lane) numbered from
        ``lane.seq``; ``lane.seq`` and ``lane.taken`` advance by their count. Returns those
        events, and the events from the first one not taken exactly as ``feed`` returns them.

        :raises ValueError: as ``feed`` (nothing is taken then).
        :raises TypeError: ``data`` is not ``bytes``, ``lane`` not a ``DeltaLane``, ``index``
            not an int, or ``args`` neither a list nor None.
        :raises OverflowError: ``index`` does not fit in a signed 64-bit integer, or the lane's
            ``seq`` or ``taken`` would not after this feed's pieces (the lane is left unchanged;
            the feed's events are not returned).
        """

@final
class SecretScanner:
    """Finds well-known credential formats (API keys, tokens, private keys, passwords in
    assignments) in text, from a pattern table compiled once; held in Rust.

    hotloop's table is ``hotloop._pure.SECRET_PATTERNS`` (one table for both implementations).
    A row is ``(kind, pattern, edge, min_entropy)``:

    * ``kind``: the id reported for a match and used in ``[REDACTED:<kind>]``
      (``[a-z][a-z0-9_]*``, unique);
    * ``pattern``: a regular expression in the subset the Rust ``regex`` crate and Python's
      ``re`` read alike (ASCII, explicit classes, no flags, anchors, word boundaries,
      look-around or back-references); a group named ``secret``, when present, is the reported
      span, otherwise the whole match;
    * ``edge``: ASCII characters that must not touch the span on either side;
    * ``min_entropy``: minimum Shannon entropy of the span in bits per character (0: none).

    Results are ``(kind, start, end)`` tuples with ``start``/``end`` as ``str`` indices (code
    points), sorted and non-overlapping. Each kind's regex finds its matches left to right,
    non-overlapping; matches failing the edge or entropy check are dropped; the rest are merged
    by start, the longer span winning at the same start, then the kind earlier in the table; a
    span overlapping an already reported one is dropped. At most ``max_matches`` spans are
    reported per text (the first ones). Lone surrogates count as non-ASCII characters.
    Texts of 4 KiB (UTF-8) or more are scanned with the GIL released.
    """

    def __new__(
        cls, patterns: Sequence[tuple[str, str, str, float]], max_matches: int = 10000
    ) -> SecretScanner:
        """Compile ``patterns``.

        :raises ValueError: a kind is malformed or repeated, an edge is not ASCII, a
            ``min_entropy`` is negative or not finite, a pattern does not compile or matches the
            empty string, a row is a tuple of the wrong length, or ``max_matches`` is negative.
        :raises TypeError: ``patterns`` is not a sequence of tuples of (str, str, str, float).
        """

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kind ids, in table order."""

    @property
    def max_matches(self) -> int:
        """The bound on spans reported per text, given to the constructor."""

    def scan(self, text: str) -> list[tuple[str, int, int]]:
        """The secrets in ``text`` as ``(kind, start, end)``, ``text[start:end]`` being the secret.

        :raises TypeError: ``text`` is not a ``str``.
        """

    def redact(self, text: str) -> tuple[str, list[tuple[str, int, int]]]:
        """``text`` with every span ``scan`` reports replaced by ``[REDACTED:<kind>]``, and those
        spans (offsets into the original ``text``). Without spans, ``text`` itself is returned.

        :raises TypeError: ``text`` is not a ``str``.
        """

@final
class TokenCounter:
    """Exact o200k_base token counts: ``count(text)`` equals
    ``len(encoding.encode_ordinary(text))`` for the tiktoken encoding of ``hotloop.tokenizer``
    (pattern ``O200K_PAT``, vocabulary ``ranks``), with no token list built and no regex engine
    run: a hand-written pre-tokenizer finds the pattern's pieces (the rules are in
    ``rust/core/src/tokens.rs``) and tiktoken's byte-pair merge counts each piece's tokens.
    Special-token text is ordinary text. The vocabulary is copied into Rust at construction.
    """

    def __new__(cls, ranks: dict[bytes, int]) -> TokenCounter:
        """A counter over ``ranks``, the mergeable ranks a ``tiktoken.Encoding`` is built from.

        :raises TypeError: ``ranks`` is not a dict, a key is not ``bytes`` or a rank not an int.
        :raises OverflowError: a rank does not fit in an unsigned 32-bit integer.
        :raises ValueError: a single byte has no token, or two tokens share a rank (tiktoken
            cannot encode such text, or refuses such a vocabulary).
        """

    def count(self, text: str) -> int:
        """The tokens of ``text`` (0 for ``""``). Texts of 4 KiB (UTF-8) or more are counted
        with the GIL released. A text with lone surrogates is counted as tiktoken encodes it:
        round-tripped through UTF-16 (``surrogatepass`` in, ``replace`` out), which joins a high
        and a low surrogate into one character and makes each other surrogate U+FFFD.

        :raises TypeError: ``text`` is not a ``str``.
        """
