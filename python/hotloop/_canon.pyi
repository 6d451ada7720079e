"""Canonical JSON for fingerprinting conversation items (Cython, ``cython_ext/canon.pyx``).

The pure twin is ``hotloop._pure.canonical_json``; import either through ``hotloop._accel``.
"""

from typing import Final

MAX_DEPTH: Final[int]
"""Most nested containers (lists, tuples, dicts) ``canonical_json`` accepts: 256."""

def canonical_json(obj: object) -> bytes:
    """Deterministic compact JSON of a JSON-able value, as UTF-8 bytes.

    Equals ``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
    allow_nan=False).encode("utf-8")`` byte for byte, including float ``repr``, the escaping of
    control characters and json's dict-key handling: items are sorted by key first (so mixed
    key types such as ``{1: 0, "a": 0}`` raise ``TypeError``), then ``int``/``float``/``bool``/
    ``None`` keys are coerced to strings (``{2: 0, 10: 0}`` gives ``{"2":0,"10":0}``).

    Accepts ``dict``, ``list``, ``tuple``, ``str``, ``int``, ``float``, ``bool``, ``None`` and
    their subclasses, like json.

    :raises ValueError: NaN or infinity; nesting deeper than ``MAX_DEPTH`` containers (this also
        catches reference cycles, which json reports as ``ValueError`` too).
    :raises TypeError: an unsupported type, a dict key of an unsupported type, or unorderable
        keys.
    :raises UnicodeEncodeError: a str holding a lone surrogate.

    Strings are encoded as they are written, so when the input has several faults the first one
    in traversal order raises (json.dumps would report a lone surrogate only after encoding
    everything else). Both twins behave the same way.
    """
