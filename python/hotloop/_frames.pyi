"""Per-token event encoders (Cython, ``cython_ext/frames.pyx``).

Pure twins: ``hotloop._pure.encode_delta`` and ``hotloop._pure.encode_sse``; import either
through ``hotloop._accel``.
"""

def encode_delta(
    event_type: str,
    sequence_number: int,
    item_id: str,
    output_index: int,
    content_index: int,
    delta: str,
    logprobs: bool,
) -> bytes:
    """The JSON bytes of one streaming delta event, keys in this order: ``type``,
    ``sequence_number``, ``item_id``, ``output_index``, ``content_index`` (omitted when
    ``content_index < 0``), ``delta``, ``logprobs`` (``[]``, only when ``logprobs`` is true).

    Byte-identical to ``msgspec.json.encode`` of that dict: ``"``, ``\\`` and control characters
    escaped as ``\\"``, ``\\\\``, ``\\b\\f\\n\\r\\t`` or ``\\u00XX``; DEL, U+2028/U+2029 and
    non-ASCII written as UTF-8. Inputs off the fast path (non-exact types, ints outside int64,
    lone surrogates) are encoded by the pure twin, so results and exceptions (e.g.
    ``UnicodeEncodeError`` for a lone surrogate) are msgspec's.
    """

def encode_sse(event_type: str, payload: bytes) -> bytes:
    """One Server-Sent Event: ``b"event: " + event_type.encode() + b"\\ndata: " + payload +
    b"\\n\\n"``. ``payload`` must already be one line (JSON without raw newlines)."""

def body_buffer(size: int) -> bytearray:
    """A ``bytearray`` of ``size`` bytes for a request body that the socket's reads will fill
    (``hotloop.server.httpproto``). Its contents are not set (``bytearray(size)`` zeroes them,
    a pass over the memory that costs about as much as the read that fills it): nothing may
    read it before it is filled. ``ValueError`` for a negative size, as ``bytearray(size)``."""
