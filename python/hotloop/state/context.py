"""Conversation contexts and the bounded caches that hold finished responses.

A :class:`Context` is the effective item list of a conversation with, in native code, the
fingerprint and token count of every item (:class:`hotloop._accel.ItemChain`). A finished response
is cached as a :class:`CachedResponse` whose context already includes its output items, so a
continuation only appends the new input: nothing before it is re-validated or re-tokenized.

Bounds (DESIGN principle 8):

* :class:`ConnectionCache`: per WebSocket connection, ``max_entries`` responses (default 1: the
  most recent, as OpenAI's WebSocket mode documents; configurable).
* :class:`ResponseCache`: process-wide, for stored (``store: true``) responses, LRU bounded by
  entries (default 256) and by the total number of cached items (default 200,000), so chained
  HTTP requests resolve ``previous_response_id`` without a database round trip.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from hotloop import _accel
from hotloop.protocol.request import FunctionCall, Item


class Context:
    """Effective items plus their native chain (fingerprints and token counts) and call ids."""

    __slots__ = ("items", "chain", "call_ids", "_ids")

    MAX_ITEMS = 100_000

    def __init__(self, items: list[Item] | None = None, chain: Any = None, call_ids: set[str] | None = None) -> None:
        self.items: list[Item] = items if items is not None else []
        self.chain = chain if chain is not None else _accel.ItemChain(self.MAX_ITEMS)
        self.call_ids: set[str] = call_ids if call_ids is not None else set()
        self._ids: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self.items)

    @property
    def tokens(self) -> int:
        return int(self.chain.total_tokens)

    def extend(self, items: list[Item], fps: list[int], toks: list[int]) -> None:
        self.items.extend(items)
        self.extend_chain(items, fps, toks)

    def extend_chain(self, items: list[Item], fps: list[int], toks: list[int]) -> None:
        """Record ``items`` (already appended to ``self.items``) in the chain and call ids."""
        self.chain.extend(fps, toks)
        for it in items:
            if type(it) is FunctionCall:
                self.call_ids.add(it.call_id)
        self._ids = None

    def find(self, item_id: str) -> Item | None:
        """The item with this id (for ``item_reference``), or ``None``."""
        ids = self._ids
        if ids is None:
            ids = {}
            for i, it in enumerate(self.items):
                iid = getattr(it, "id", None)
                if iid is None and hasattr(it, "data"):
                    iid = it.data.get("id")  # type: ignore[union-attr]
                if iid:
                    ids[iid] = i
            self._ids = ids
        pos = ids.get(item_id)
        return None if pos is None else self.items[pos]


class CachedResponse:
    """A finished response, ready to be continued.

    ``context`` holds the effective input followed by the output items; ``input_len`` says where
    the input ends (what ``GET /input_items`` lists).
    """

    __slots__ = ("response", "context", "input_len", "store")

    def __init__(self, response: dict[str, Any], context: Context, input_len: int, store: bool) -> None:
        self.response = response
        self.context = context
        self.input_len = input_len
        self.store = store

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def input_items(self) -> list[Item]:
        return self.context.items[: self.input_len]


class ConnectionCache:
    """The WebSocket connection's own cache of its most recent response(s), per lane.

    Each lane (the default lane ``None`` or a named ``stream_id``) keeps its own ``max_entries``
    most recent responses; lookups search every lane, so another lane's response can be forked.
    At most ``max_lanes`` named lanes exist per connection (OpenAI allows 32).
    """

    def __init__(self, max_entries: int = 1, max_lanes: int = 32) -> None:
        self.max_entries = max(1, max_entries)
        self.max_lanes = max_lanes
        self._lanes: dict[str | None, OrderedDict[str, CachedResponse]] = {None: OrderedDict()}

    def __len__(self) -> int:
        return sum(len(d) for d in self._lanes.values())

    def lane_allowed(self, lane: str | None) -> bool:
        return lane in self._lanes or len(self._lanes) - 1 < self.max_lanes

    def get(self, response_id: str) -> CachedResponse | None:
        for d in self._lanes.values():
            e = d.get(response_id)
            if e is not None:
                return e
        return None

    def put(self, entry: CachedResponse, lane: str | None = None) -> None:
        d = self._lanes.get(lane)
        if d is None:
            if not self.lane_allowed(lane):
                return
            d = self._lanes[lane] = OrderedDict()
        d[entry.id] = entry
        d.move_to_end(entry.id)
        while len(d) > self.max_entries:
            d.popitem(last=False)

    def evict(self, response_id: str, lane: str | None = None) -> None:
        """Drop ``response_id`` if it belongs to ``lane`` (a failed fork from another lane keeps it)."""
        d = self._lanes.get(lane)
        if d is not None:
            d.pop(response_id, None)

    def clear(self) -> None:
        self._lanes = {None: OrderedDict()}


class ResponseCache:
    """Process-wide LRU of stored responses, bounded by entries and by total items."""

    def __init__(self, max_entries: int = 256, max_items: int = 200_000) -> None:
        self.max_entries = max_entries
        self.max_items = max_items
        self._d: OrderedDict[str, CachedResponse] = OrderedDict()
        self._items = 0

    def __len__(self) -> int:
        return len(self._d)

    @property
    def items(self) -> int:
        return self._items

    def get(self, response_id: str) -> CachedResponse | None:
        e = self._d.get(response_id)
        if e is not None:
            self._d.move_to_end(response_id)
        return e

    def put(self, entry: CachedResponse) -> None:
        old = self._d.pop(entry.id, None)
        if old is not None:
            self._items -= len(old.context)
        if len(entry.context) > self.max_items:
            return
        self._d[entry.id] = entry
        self._items += len(entry.context)
        while len(self._d) > self.max_entries or self._items > self.max_items:
            _, e = self._d.popitem(last=False)
            self._items -= len(e.context)

    def evict(self, response_id: str) -> None:
        e = self._d.pop(response_id, None)
        if e is not None:
            self._items -= len(e.context)

    def find_item(self, item_id: str) -> Item | None:
        """An item of any cached stored response, by id (newest responses first)."""
        for entry in reversed(self._d.values()):
            found = entry.context.find(item_id)
            if found is not None:
                return found
        return None
