"""An agent's tool definitions decoded, checked and encoded once, not on every turn.

A coding agent sends the same ``tools`` array, often tens of KB of JSON, with every request
(``previous_response_id`` carries no tools) and every full-history one. Each time it was decoded
into dicts, checked (a :class:`~hotloop.protocol.request.FunctionTool` per function) and encoded
again for the settings' token count. :class:`ToolsCache` keeps, per owner, the result for the
array's exact bytes; a request that sends those bytes again gets the same (shared, never changed)
list, and validating it takes the functions already checked
(:func:`hotloop.protocol.request.checked_tools`).

Exactness: the bytes are the key, so a hit is what decoding them would give. A ``tools`` value
that does not decode or check is never cached: the request is then decoded the ordinary way and
gets the ordinary error.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from hotloop.protocol.request import CheckedTools, CreateRequest, check_tools, share_checked

# The type CreateRequest declares for ``tools``, so a value decodes (or fails) as it does there
TOOLS_TYPE: Any = next(f.type for f in msgspec.structs.fields(CreateRequest) if f.name == "tools")
tools_decoder: Any = msgspec.json.Decoder(TOOLS_TYPE)
_encode = msgspec.json.encode  # as tools_json (pipeline.prepare)

# What an entry is counted as, per byte of its JSON: the bytes, their encoding again, the
# decoded dicts and strings and the checked functions (which copy each schema). Measured with
# tracemalloc: 3.5x for tools that are mostly descriptions, about 6x for a coding agent's, 12x
# for tools of detailed schemas (many small properties); counted on the safe side.
WEIGHT = 16
# And per entry, whatever its size: its key, the CheckedTools, the list and its dicts (a one-tool
# array of 130 bytes measured 17-21 times its JSON).
ENTRY_OVERHEAD = 1024


def entry_bytes(n: int) -> int:
    """What an entry of ``n`` bytes of JSON is counted as."""
    return WEIGHT * n + ENTRY_OVERHEAD


def decode_tools(raw: bytes) -> CheckedTools | None:
    """``raw`` (a request's ``tools`` JSON) decoded and checked; ``None`` for ``null`` or an
    empty array. Raises what decoding or checking raises."""
    tools = tools_decoder.decode(raw)
    if not tools:
        return None
    return CheckedTools(tools, check_tools(tools), _encode(tools))


# A key holds the array's length and its first and last EDGE bytes; a hit is then confirmed by
# comparing the whole array with the one kept (a memcmp). Hashing the whole array instead (a
# dict key of the bytes) cost 10.5 us for 31 KB, against about 2 us this way.
EDGE = 64


class ToolsCache:
    """``(owner, tools JSON bytes)`` -> :class:`CheckedTools`, LRU-bounded by entries and by
    bytes (each entry counted as WEIGHT times its JSON, plus ENTRY_OVERHEAD). Scoped by owner
    like the token counts: a hit skips tens of microseconds, which one key could otherwise time
    to learn another's tools. Arrays under ``min_bytes`` (at least 2 * EDGE) are not kept. A small array is worth
    keeping too: a hit (0.8 us for one 221-byte tool) costs less than decoding and checking it
    (1.8 us), and the shared array then skips, every turn, the work keyed on it downstream (the
    secrets scan of its texts, its rendering for the backend, its encoding in events).

    Looked up by length and edges (``EDGE``), confirmed by the whole bytes: two arrays of one
    owner alike in both but not in their middle take turns in one entry (each a miss when the
    other was last), never each other's result."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 16 * 1024 * 1024, min_bytes: int = 2 * EDGE) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_bytes = max(min_bytes, 2 * EDGE)
        # (owner, length, first EDGE bytes, last EDGE bytes) -> (the whole bytes, their result)
        self._d: OrderedDict[tuple[str, int, bytes, bytes], tuple[bytes, CheckedTools]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._d)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, owner: str, raw: Any) -> CheckedTools | None:
        """The checked tools of ``raw`` (bytes, or any object exposing them as a buffer, such as
        ``msgspec.Raw``) for ``owner``: cached, or decoded and checked now (and kept). ``None``:
        not kept here (no tools, or fewer than ``min_bytes`` of them, decoded by the caller as
        any other field). Raises what :func:`decode_tools` raises (nothing is kept)."""
        view = memoryview(raw)
        n = len(view)
        if n < self.min_bytes or self.max_entries <= 0:
            return None
        key = (owner, n, bytes(view[:EDGE]), bytes(view[n - EDGE :]))
        d = self._d
        got = d.get(key)
        if got is not None and got[0].startswith(view):  # same length: the same bytes
            d.move_to_end(key)
            self.hits += 1
            return got[1]
        self.misses += 1
        whole = bytes(view)
        c = decode_tools(whole)
        if c is None:
            return None
        share_checked(c)  # validating the request takes its functions (while it lives)
        size = entry_bytes(n)
        if size > self.max_bytes // 4:
            return c  # too large to keep
        if got is not None:  # alike at the edges, not in the middle: this one takes the entry
            del d[key]
            self._bytes -= size
        d[key] = (whole, c)
        self._bytes += size
        while len(d) > self.max_entries or self._bytes > self.max_bytes:
            (_, old, _, _), _ = d.popitem(last=False)
            self._bytes -= entry_bytes(old)
        return c
