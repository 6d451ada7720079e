"""Conversation contexts and the bounded caches that hold finished responses.

A :class:`Context` is the effective item list of a conversation with, in native code, the
fingerprint and token count of every item (:class:`hotloop._accel.ItemChain`). A finished response
is cached as a :class:`CachedResponse` whose context already includes its output items, so a
continuation only appends the new input: nothing before it is re-validated or re-tokenized.

Bounds (DESIGN principle 8):

* :class:`ConnectionCache`: per WebSocket connection, ``max_entries`` responses per lane
  (default 1: the most recent, as OpenAI's WebSocket mode documents; configurable), at most 32
  named lanes, and at most ``max_bytes`` for all lanes together (default 64 MiB).
* :class:`ResponseCache`: process-wide, for stored (``store: true``) responses, LRU bounded by
  entries (default 256), by the total number of cached items (default 200,000) and by bytes
  (default 128 MiB; one entry at most a quarter of it), so chained HTTP requests resolve
  ``previous_response_id`` without a database round trip.

Ownership: a :class:`CachedResponse` carries its ``owner`` (the tenant that created it) and the
ids its client supplied for its own items (``supplied``). :meth:`ResponseCache.get` and
:meth:`ResponseCache.find_item` take the caller's ``scope`` (an owner id, or ``None`` for every
owner) and answer as if another owner's entries did not exist; ``find_item`` (``item_reference``
across requests) resolves only ids the server minted, among each entry's own items. A
:class:`ConnectionCache` belongs to one WebSocket connection, hence to one tenant.

Sizes are estimates (:attr:`Context.nbytes`, :func:`entry_nbytes`): the canonical JSON of each
item plus a fixed per-item overhead, and the Response object's JSON weighted for its decoded
form (``RESPONSE_WEIGHT``; its tool definitions, unless the tools cache holds them,
``TOOLS_WEIGHT``).
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from typing import Any, Callable

import msgspec

from hotloop import _accel
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, Item, Message, OtherItem, Reasoning, checked_tools
from hotloop.state.store import LEGACY_OWNER, visible


# Per-item bytes beyond its content that an item costs in a cached context (the item and part
# objects, the list slot, its fingerprint and count in the chain): an estimate on the high side.
ITEM_OVERHEAD = 256


# What each content part (or reasoning summary/content part) of an item costs beyond its text's
# JSON: the part object, its list slot and its text's str header (measured about 100 bytes for a
# part with a 2-character text, whose JSON in the item's view is 7 bytes).
PART_OVERHEAD = 128

_getsizeof = sys.getsizeof


# Values a size walk visits at most (about 0.1 ms a thousand): past it, what is left is estimated
# from the JSON, at VERBATIM_WORST bytes held per byte (an array of empty objects, the worst shape
# measured, holds 24 times its JSON). A client's item of millions of tiny values costs the walk's
# bound, not seconds on the event loop (the JSON's encode, which sizes it, runs at C speed).
WALK_NODES = 4096
VERBATIM_WORST = 24
# Content parts an item's size looks at one by one; past them, the rest are counted like the
# ones seen (their overhead exactly, their extra by the average so far)
WALK_PARTS = 1024


def _tree_nbytes(obj: Any, budget: int = WALK_NODES) -> int | None:
    """Bytes a decoded JSON value holds: every container, key and scalar (iterative, any depth),
    or ``None`` when it has more than ``budget`` values (the caller estimates instead). Shared
    objects (small ints, ``None``) count too: the safe direction."""
    n = 0
    stack = [obj]
    pop, extend = stack.pop, stack.extend
    while stack:
        budget -= 1
        if budget < 0:
            return None
        o = pop()
        n += _getsizeof(o)
        t = type(o)
        if t is dict:
            extend(o.keys())
            extend(o.values())
        elif t is list or t is tuple:
            extend(o)
    return n


def _value_nbytes(value: Any) -> int:
    """:func:`_tree_nbytes`, or past its bound the worst case for the value's JSON."""
    n = _tree_nbytes(value)
    if n is not None:
        return n
    try:
        return VERBATIM_WORST * len(msgspec.json.encode(value))
    except (TypeError, ValueError, OverflowError):
        return 0


def _parts_extra(parts: Any) -> int:
    n = PART_OVERHEAD * len(parts)
    extra = seen = 0
    for p in parts:
        if seen == WALK_PARTS:  # the rest like these
            return n + extra * len(parts) // seen
        seen += 1
        for f in p.__struct_fields__:
            v = getattr(p, f)
            t = type(v)
            if t is str:
                if not v.isascii():
                    extra += _getsizeof(v)
            elif (t is list or t is dict) and v:
                extra += _value_nbytes(v)
    return n + extra


def held_extra(item: Item) -> int:
    """Bytes an item holds decoded beyond its JSON and ``ITEM_OVERHEAD`` (a few hundred ns for a
    message or a call): ``PART_OVERHEAD`` for each content part, a non-ASCII string whole (1 to 4
    bytes a character, and its UTF-8 copy once encoded, where its JSON has 1 to 4 bytes a
    character: text with one emoji held 4-5 times its JSON), and an item kept verbatim
    (``OtherItem``) as all its decoded values (an array of empty objects held 24 times its JSON).
    An ASCII string holds about its JSON length."""
    t = type(item)
    if t is Message or t is FunctionCallOutput:
        c = item.content if t is Message else item.output  # type: ignore[union-attr]
        if type(c) is str:
            return 0 if c.isascii() else _getsizeof(c)
        return _parts_extra(c)
    if t is FunctionCall:
        n = 0
        for s in (item.call_id, item.name, item.arguments):  # type: ignore[union-attr]
            if not s.isascii():
                n += _getsizeof(s)
        return n
    if t is Reasoning:
        r: Reasoning = item  # type: ignore[assignment]
        n = _parts_extra(r.summary) + (_parts_extra(r.content) if r.content else 0)
        e = r.encrypted_content
        return n + (_getsizeof(e) if e and not e.isascii() else 0)
    if t is OtherItem:
        return _value_nbytes(item.data)  # type: ignore[union-attr]
    return 0


def item_nbytes(item: Item) -> int:
    """Approximate bytes an item holds (its wire JSON plus ``ITEM_OVERHEAD`` and
    :func:`held_extra`), for items whose size nobody computed (loaded from the store). Slightly
    above the size :func:`hotloop.pipeline.items.split` reports for the same item (ids and type
    tags count)."""
    try:
        n = len(msgspec.json.encode(item)) + ITEM_OVERHEAD
    except (TypeError, ValueError, OverflowError):  # not JSON-encodable: count the overhead only
        n = ITEM_OVERHEAD
    return n + held_extra(item)


# A Response object decoded, against its JSON: measured 1.4x (output text) to 2.8x (tool
# definitions mostly descriptions); and its tool definitions, when the tools cache does not
# hold them (arrays under 128 bytes, or too large to keep): counted as the tools cache counts them
# (pipeline.settings.WEIGHT), 3.5-12x measured. A count of its JSON alone let a cache of
# responses with 429 KB of tools each hold about 8 times its byte budget.
RESPONSE_WEIGHT = 3
# Evicted response ids a ResponseCache remembers (ResponseCache.evicted_since), about 100 bytes
# each: loads that overlap more evictions than this are simply not cached.
GONE_ENTRIES = 4096
# Item ids whose holding response ResponseCache.find_item remembers, about 150 bytes each (then
# forgotten all at once and found by a scan again)
HOLDER_ENTRIES = 4096
TOOLS_WEIGHT = 16


def response_nbytes(response: dict[str, Any]) -> int:
    """Approximate bytes a Response object holds (its JSON, weighted; a few microseconds)."""
    try:
        # The two large fields an agent resends every turn are measured without encoding them
        # (14 KB of instructions and ten tools: 14 us encoded whole, 1 us this way): the
        # instructions by length, tools the tools cache holds by the JSON it keeps.
        tools = response.get("tools")
        shared = checked_tools(tools) if tools and type(tools) is list else None
        instructions = response.get("instructions")
        big = type(instructions) is str and len(instructions) >= 256
        if shared is None and not big:
            n = len(msgspec.json.encode(response))
        else:
            rest = dict(response)
            n = 0
            if shared is not None:
                rest["tools"] = None
                n += len(shared.json)
            if big:
                rest["instructions"] = None
                n += len(instructions) + 2  # type: ignore[arg-type]
            n += len(msgspec.json.encode(rest))
        n *= RESPONSE_WEIGHT
        if tools and type(tools) is list and shared is None:  # not the tools cache's
            n += TOOLS_WEIGHT * len(msgspec.json.encode(tools))
        # the two other values of any shape a client sets: an output format's schema (an array
        # of empty objects held 8 times its weighted JSON) and a tool_choice object, as decoded
        text = response.get("text")
        fmt = text.get("format") if type(text) is dict else None
        schema = fmt.get("schema") if type(fmt) is dict else None
        if schema:
            n += _value_nbytes(schema)
        choice = response.get("tool_choice")
        if type(choice) is dict:
            n += _value_nbytes(choice)
        return n
    except (TypeError, ValueError, OverflowError):
        return 0


#: Verbatim item types that pair by another key than ``call_id``: an MCP approval request (its id)
#: and its response.
PAIRED_BY = {"mcp_approval_request": "id", "mcp_approval_response": "approval_request_id"}


def pairing(it: Item) -> tuple[str, bool] | None:
    """The key a call or its output pairs by, and whether ``it`` is the output (``None``:
    neither): function calls and outputs by ``call_id``, and the item types kept verbatim that
    carry one (custom tools, shell, apply_patch, computer use; an MCP approval request by its
    ``id``, its response by ``approval_request_id``)."""
    t = type(it)
    if t is FunctionCall:
        return it.call_id, False  # type: ignore[union-attr]
    if t is FunctionCallOutput:
        return it.call_id, True  # type: ignore[union-attr]
    if t is OtherItem:
        data = it.data  # type: ignore[union-attr]
        kind = str(data.get("type"))
        cid = data.get(PAIRED_BY.get(kind, "call_id"))
        if type(cid) is not str:
            return None
        return cid, kind.endswith("_output") or kind == "mcp_approval_response"
    return None


# Call ids a truncated conversation remembers (DroppedCalls), newest kept: at most this many, and
# at most this many bytes of ids (as JSON strings), so that the stored form stays well under a
# chain state's bound (hotloop.pipeline.classifiers.MAX_STATE_BYTES, 64 KiB; it is stored without
# that check: hotloop.pipeline.prepare._with_dropped).
DROPPED_CALLS = 1024
DROPPED_CALLS_BYTES = 32 * 1024
#: The key of DroppedCalls in a response's chain states (stored with them; see
#: hotloop.pipeline.prepare.finished). Not a classifier's name: classifiers carry it along.
DROPPED_CALLS_STATE = "hotloop.window.dropped_calls"


class DroppedCalls:
    """What a truncated conversation remembers of the calls ``truncation: "auto"`` dropped, so
    that it goes on as a request holding its whole history would (:mod:`hotloop.pipeline.window`).

    ``calls``: for each call id whose latest call truncation dropped and that still awaits an
    output, whether it was answered (an output went with it); newest last. ``owed``: how many
    outputs each still awaits when not 1 (the calls with its id less the outputs that went with
    them: calls with one id before an output are one group). A dropped call with all its outputs,
    the usual case, is not remembered: an output that comes later with its id is a duplicate, the
    400 of an unknown call id as before any truncation, and a call with its id starts afresh.

    An item that comes later with one of these ids belongs to that dropped call as it would in the
    whole history (an output; a call with that id while it was unanswered), and is dropped with it
    by the next truncation, which ``forced`` then demands even when the input fits; a call with
    the id of an answered one starts afresh (pairing by call id: :func:`hotloop.pipeline.window._scan`).

    Never changed once made: the contexts continuing one another share it, as they share items;
    a truncation makes the next one. Bounded: ``DROPPED_CALLS`` ids and ``DROPPED_CALLS_BYTES``
    of them, the newest kept (an output of a call forgotten this way is the 400 of an unknown
    call id); counted in the context's ``nbytes``.
    """

    __slots__ = ("calls", "owed", "forced", "nbytes", "_json")

    def __init__(self, calls: dict[str, bool], forced: bool = False, owed: dict[str, int] | None = None) -> None:
        self.calls = calls
        self.owed: dict[str, int] = owed if owed is not None else {}
        self.forced = forced
        self.nbytes = sum(len(c) for c in calls) + 100 * len(calls) + 100 * len(self.owed)  # entries, str headers
        self._json: dict[str, Any] | None = None

    @classmethod
    def bounded(cls, calls: list[tuple[str, bool, int]]) -> "DroppedCalls | None":
        """The newest of ``calls`` (oldest first: call id, answered, outputs owed) within the
        bounds (``None``: none)."""
        kept: list[tuple[str, bool, int]] = []
        size = 0
        for entry in reversed(calls):
            cid = entry[0]
            plain = cid.isascii() and cid.isprintable() and '"' not in cid and "\\" not in cid
            size += len(cid) + 2 if plain else len(msgspec.json.encode(cid))
            if len(kept) == DROPPED_CALLS or size > DROPPED_CALLS_BYTES:
                break
            kept.append(entry)
        if not kept:
            return None
        kept.reverse()
        return cls({c: a for c, a, _ in kept}, False, {c: n for c, _, n in kept if n != 1})

    def owing(self, call_id: str) -> int:
        """The outputs the dropped call ``call_id`` (one of :attr:`calls`) still awaits."""
        return self.owed.get(call_id, 1)

    def hits(self, items: list[Item]) -> bool:
        """Whether one of ``items`` has one of these call ids."""
        calls = self.calls
        for it in items:
            key = pairing(it)
            if key is not None and key[0] in calls:
                return True
        return False

    def forcing(self) -> "DroppedCalls":
        return self if self.forced else DroppedCalls(self.calls, True, self.owed)

    def to_json(self) -> dict[str, Any]:
        """As a chain state (JSON values; made once): ``calls`` as ``[id, answered]``, or
        ``[id, answered, owed]`` when more than one output is owed."""
        if self._json is None:
            owed = self.owed
            self._json = {
                "calls": [[c, a, owed[c]] if c in owed else [c, a] for c, a in self.calls.items()],
                "forced": self.forced,
            }
        return self._json

    @classmethod
    def from_json(cls, value: Any) -> "DroppedCalls | None":
        """From :meth:`to_json`'s value, as stored (``None``: none, or not that shape). When it
        holds all of it, its :meth:`to_json` is ``value`` itself (stored again as it was)."""
        if type(value) is not dict:
            value = getattr(value, "value", None)  # a reloaded state (classifiers.Frozen)
        if type(value) is not dict:
            return None
        calls, forced = value.get("calls"), value.get("forced")
        if type(calls) is not list or type(forced) is not bool:
            return None
        entries: list[tuple[str, bool, int]] = []
        for e in calls:
            if type(e) is not list or len(e) not in (2, 3) or type(e[0]) is not str or type(e[1]) is not bool:
                return None
            n = e[2] if len(e) == 3 else 1
            if type(n) is not int or n < 1:
                return None
            entries.append((e[0], e[1], n))
        found = cls.bounded(entries)
        if found is None:
            return None
        if forced:
            found = found.forcing()
        if len(found.calls) == len(entries) and len(value) == 2:
            found._json = value
        return found


class Context:
    """Effective items plus their native chain (fingerprints and token counts) and call ids.

    ``nbytes`` approximates the bytes of all items (content plus ``ITEM_OVERHEAD`` each). It is
    kept incrementally: a continuation starts from its parent's ``nbytes`` (it shares the
    parent's item objects) and adds only its new items' sizes.

    ``dropped``: the calls truncation dropped from the conversation before these items
    (:class:`DroppedCalls`; ``None``: none, the usual case, which costs nothing).
    """

    __slots__ = ("items", "chain", "call_ids", "_ids", "nbytes", "dropped")

    MAX_ITEMS = 100_000

    def __init__(
        self,
        items: list[Item] | None = None,
        chain: Any = None,
        call_ids: set[str] | None = None,
        nbytes: int = 0,
        ids_from: "Context | None" = None,
        dropped: DroppedCalls | None = None,
    ) -> None:
        """``ids_from``: a context whose items begin ``items`` (the same objects, in the same
        order, as far as its id index reaches): its index is taken over instead of rebuilt.
        ``dropped``: the calls truncation dropped before ``items`` (a continuation's: its parent's)."""
        self.items: list[Item] = items if items is not None else []
        self.chain = chain if chain is not None else _accel.ItemChain(self.MAX_ITEMS)
        self.call_ids: set[str] = call_ids if call_ids is not None else set()
        # The id index (see position): where each id is last carried, over the first n items.
        # Never changed once made (a longer one is a new dict), so that contexts continuing this
        # one may share it until they extend it.
        self._ids: tuple[dict[str, int], int] | None = None
        if ids_from is not None and ids_from._ids is not None and ids_from._ids[1] <= len(self.items):
            self._ids = ids_from._ids
        self.nbytes = nbytes
        self.dropped = dropped

    def __len__(self) -> int:
        return len(self.items)

    @property
    def tokens(self) -> int:
        return int(self.chain.total_tokens)

    def extend(self, items: list[Item], fps: list[bytes], toks: list[int], sizes: list[int] | None = None) -> None:
        self.items.extend(items)
        self.extend_chain(items, fps, toks, sizes)

    def extend_chain(
        self, items: list[Item], fps: list[bytes], toks: list[int], sizes: list[int] | None = None
    ) -> None:
        """Record ``items`` (already appended to ``self.items``) in the chain, call ids and
        ``nbytes``. ``sizes`` are the items' sizes when known (:func:`hotloop.pipeline.items.split`
        has them), else they are estimated with :func:`item_nbytes`."""
        self.chain.extend(fps, toks)
        self.nbytes += sum(sizes) if sizes is not None else sum(map(item_nbytes, items))
        for it in items:
            if type(it) is FunctionCall:
                self.call_ids.add(it.call_id)
        dropped = self.dropped
        if dropped is not None and not dropped.forced and dropped.hits(items):
            self.dropped = dropped.forcing()  # (only after a truncation)

    def find(self, item_id: str) -> Item | None:
        """The item with this id (for ``item_reference``), or ``None``."""
        pos = self.position(item_id)
        return None if pos is None else self.items[pos]

    def position(self, item_id: str) -> int | None:
        """Where the (last) item with this id is, or ``None``.

        The index is made on first use and extended over items appended since; a context made
        ``ids_from`` another starts from that one's index. A client resending its history asks
        this of each turn's new context: rebuilt from scratch, that was a Python call per item
        of the conversation (39 us at 180 items), now a dict copy and the turn's new items."""
        held = self._ids
        items = self.items
        if held is None or held[1] != len(items):
            ids, start = (dict(held[0]), held[1]) if held is not None else ({}, 0)
            for i in range(start, len(items)):
                iid = item_id_of(items[i])
                if iid:
                    ids[iid] = i
            held = self._ids = (ids, len(items))
        return held[0].get(item_id)


def item_id_of(item: Item) -> str | None:
    """An item's id, also for item types kept verbatim."""
    iid = getattr(item, "id", None)
    if iid is None and hasattr(item, "data"):
        iid = item.data.get("id")  # type: ignore[union-attr]
    return iid if isinstance(iid, str) else None


class CachedResponse:
    """A finished response, ready to be continued.

    ``context`` holds the effective input followed by the output items; ``input_len`` says where
    the input ends (what ``GET /input_items`` lists). ``parent_id`` names the response this one
    continues and ``base_len`` counts the leading context items inherited from it (0 without a
    parent): ``context.items[base_len:]`` are this response's own items. ``owner`` is the tenant
    that created it; ``supplied`` holds the ids of its own items that its client chose (every
    other id of its own items was minted by the server). ``states`` holds the chain's classifier
    states after this response's input (:mod:`hotloop.pipeline.classifiers`; ``None``: none).
    ``settings`` is its request's tool definitions as JSON, as sent, and the token count of them
    and its instructions (``None``: not known, e.g. loaded from the store), so that a
    continuation that sends the same settings again does not count them again.
    """

    __slots__ = (
        "response", "context", "input_len", "store", "parent_id", "base_len", "owner", "supplied", "states", "settings",
        "nbytes",
    )

    def __init__(
        self,
        response: dict[str, Any],
        context: Context,
        input_len: int,
        store: bool,
        parent_id: str | None = None,
        base_len: int = 0,
        owner: str = LEGACY_OWNER,
        supplied: frozenset[str] = frozenset(),
        states: dict[str, Any] | None = None,
        settings: tuple[bytes, int] | None = None,
    ) -> None:
        self.response = response
        self.context = context
        self.input_len = input_len
        self.store = store
        self.parent_id = parent_id
        self.base_len = base_len
        self.owner = owner
        self.supplied = supplied
        self.states = states
        self.settings = settings
        self.nbytes: int | None = None  # entry_nbytes, once asked (the entry no longer changes)

    def visible(self, scope: str | None) -> bool:
        """Whether a caller of ``scope`` (``None``: every owner) may see this response."""
        return visible(self.owner, scope)

    def minted_item(self, item_id: str) -> Item | None:
        """One of its *own* items whose id the server minted, by id (``item_reference``)."""
        if item_id in self.supplied:
            return None
        pos = self.context.position(item_id)
        own_from = self.base_len if self.parent_id is not None else 0
        return self.context.items[pos] if pos is not None and pos >= own_from else None

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def input_items(self) -> list[Item]:
        return self.context.items[: self.input_len]


def entry_nbytes(entry: CachedResponse) -> int:
    """Approximate bytes a cached response holds: its context's items plus its Response object
    (computed once per entry: the caches that hold it all ask).

    Entries of one chain share their item objects, so summing this over a cache's entries
    over-counts what the cache really holds: the safe direction for a bound."""
    n = entry.nbytes
    if n is None:
        settings = entry.settings
        n = entry.nbytes = (
            entry.context.nbytes + response_nbytes(entry.response) + (len(settings[0]) if settings is not None else 0)
        )
    return n


class Deletions:
    """Responses deleted (``DELETE /v1/responses/{id}`` here, or another process's delete heard
    through the shared store), numbered, for the WebSocket connections' caches: a connection
    that cached a response before its delete no longer serves it (:meth:`ConnectionCache.get`),
    so a continuation gets ``previous_response_not_found`` as it does over HTTP and on any other
    connection, and the deleted content is not stored again as a new response's input.

    Responses pruned by this process's store bound are not deletions: a connection keeps
    continuing its own. (Another process's prunes reach this one as deletions, which cannot be
    told apart: a connection's response pruned by another worker is dropped from its cache too.)

    Bounded: the latest ``max_entries`` ids (about 100 bytes each). An entry cached before the
    oldest id let go is taken as deleted when asked about (the safe side: a miss, then the store)."""

    def __init__(self, max_entries: int = GONE_ENTRIES) -> None:
        self.max_entries = max(1, max_entries)
        self.generation = 0
        self._ids: OrderedDict[str, int] = OrderedDict()
        self._forgotten = 0  # the generation of the newest id let go

    def add(self, response_id: str) -> None:
        self.generation += 1
        ids = self._ids
        ids[response_id] = self.generation
        ids.move_to_end(response_id)
        if len(ids) > self.max_entries:
            self._forgotten = ids.popitem(last=False)[1]

    def since(self, response_id: str, generation: int) -> bool:
        """Whether ``response_id`` may have been deleted after ``generation`` was read."""
        if generation == self.generation:
            return False
        g = self._ids.get(response_id)
        return g > generation if g is not None else self._forgotten > generation


class CacheBudget:
    """The bytes all WebSocket connections' caches hold together (``ws_cache_total_bytes``,
    default 1 GiB): past it cached responses go, oldest first, of the owner (the tenant) whose
    connections hold the most bytes, so that one tenant's connections make room among their own
    before any other's lose a response. Each connection's own bound alone would let
    ``max_connections`` connections hold 64 MiB each.

    A connection that closes gives its entries back (:meth:`ConnectionCache.clear`). Finding the
    largest owner looks at every owner with bytes cached (at most one per tenant with a
    connection open), once per response dropped."""

    def __init__(self, max_bytes: int = 1024 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._bytes = 0
        self._entries = 0
        # owner -> [its bytes, (the cache's id, response id) -> the cache, oldest first]
        self._owners: dict[str, tuple[list[int], OrderedDict[tuple[int, str], ConnectionCache]]] = {}

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return self._entries

    def owner_bytes(self, owner: str) -> int:
        held = self._owners.get(owner)
        return held[0][0] if held is not None else 0

    def _add(self, cache: ConnectionCache, response_id: str, n: int) -> None:
        held = self._owners.get(cache.owner)
        if held is None:
            held = self._owners[cache.owner] = ([0], OrderedDict())
        held[1][(id(cache), response_id)] = cache
        held[0][0] += n
        self._bytes += n
        self._entries += 1
        while self._bytes > self.max_bytes:
            _, order = max(self._owners.values(), key=lambda h: h[0][0])
            (_, oldest), holder = next(iter(order.items()))
            holder._drop(oldest)  # calls _remove

    def _remove(self, cache: ConnectionCache, response_id: str, n: int) -> None:
        held = self._owners.get(cache.owner)
        if held is not None and held[1].pop((id(cache), response_id), None) is not None:
            held[0][0] -= n
            self._bytes -= n
            self._entries -= 1
            if not held[1]:
                del self._owners[cache.owner]


class ConnectionCache:
    """The WebSocket connection's own cache of its most recent response(s), per lane.

    Each lane (the default lane ``None`` or a named ``stream_id``) keeps its own ``max_entries``
    most recent responses; lookups search every lane, so another lane's response can be forked.
    At most ``max_lanes`` named lanes exist per connection (OpenAI allows 32).

    All lanes together hold at most ``max_bytes`` (:func:`entry_nbytes`, default 64 MiB): past it
    the oldest entries of any lane go first, and a response larger than ``max_bytes`` is not
    cached at all. A continuation of a response that is not cached here falls back to the
    process-wide cache and the store like any miss (so only a ``store: false`` response is lost).

    ``deletions``: the process's :class:`Deletions`; a response deleted after it was cached here
    is not served (and is dropped). ``budget``: the process's :class:`CacheBudget`, which may
    drop this cache's oldest entries to make room (``owner``: the tenant it counts against).
    """

    def __init__(
        self, max_entries: int = 1, max_lanes: int = 32, max_bytes: int = 64 * 1024 * 1024,
        deletions: Deletions | None = None, budget: CacheBudget | None = None, owner: str = "",
    ) -> None:
        self.max_entries = max(1, max_entries)
        self.max_lanes = max_lanes
        self.max_bytes = max_bytes
        self.deletions = deletions
        self.budget = budget
        self.owner = owner  # the tenant whose connection this is (CacheBudget)
        self._lanes: dict[str | None, OrderedDict[str, CachedResponse]] = {None: OrderedDict()}
        # id -> (lane, bytes, the deletions' generation when cached), oldest first
        self._order: OrderedDict[str, tuple[str | None, int, int]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._order)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def lane_allowed(self, lane: str | None) -> bool:
        return lane in self._lanes or len(self._lanes) - 1 < self.max_lanes

    def get(self, response_id: str) -> CachedResponse | None:
        for d in self._lanes.values():
            e = d.get(response_id)
            if e is not None:
                deletions = self.deletions
                if deletions is not None and deletions.since(response_id, self._order[response_id][2]):
                    self._drop(response_id)  # deleted since it was cached
                    return None
                return e
        return None

    def put(self, entry: CachedResponse, lane: str | None = None, nbytes: int | None = None) -> None:
        """Cache ``entry`` as ``lane``'s most recent response (``nbytes``: its size if known)."""
        d = self._lanes.get(lane)
        if d is None:
            if not self.lane_allowed(lane):
                return
            d = self._lanes[lane] = OrderedDict()
        rid = entry.id
        self._drop(rid)
        n = entry_nbytes(entry) if nbytes is None else nbytes
        d[rid] = entry
        self._order[rid] = (lane, n, self.deletions.generation if self.deletions is not None else 0)
        self._bytes += n
        while len(d) > self.max_entries:
            self._drop(next(iter(d)))
        budget = self.budget
        if n > self.max_bytes or (budget is not None and n > budget.max_bytes):
            self._drop(rid)  # too large to keep; the lane's older responses were still superseded
            return
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._order)))
        if budget is not None:
            budget._add(self, rid, n)

    def _drop(self, response_id: str) -> None:
        found = self._order.pop(response_id, None)
        if found is not None:
            lane, n, _ = found
            self._bytes -= n
            del self._lanes[lane][response_id]
            if self.budget is not None:
                self.budget._remove(self, response_id, n)

    def evict(self, response_id: str, lane: str | None = None) -> None:
        """Drop ``response_id`` if it belongs to ``lane`` (a failed fork from another lane keeps it)."""
        d = self._lanes.get(lane)
        if d is not None and response_id in d:
            self._drop(response_id)

    def clear(self) -> None:
        budget = self.budget
        if budget is not None:
            for rid, (_, n, _) in self._order.items():
                budget._remove(self, rid, n)
        self._lanes = {None: OrderedDict()}
        self._order.clear()
        self._bytes = 0


class ResponseCache:
    """Process-wide LRU of stored responses, bounded by entries, total items and total bytes.

    Defaults: 256 entries, 200,000 items, 128 MiB (:func:`entry_nbytes`). An entry with more than
    ``max_items`` items or larger than a quarter of ``max_bytes`` is not cached: it is served
    from the store. Entries of one chain share their item objects and each counts its whole
    context, so the byte total over-counts what is held (the safe direction). An entry older
    than ``ttl`` seconds (its ``created_at`` by ``clock``: the store's time to live) is gone,
    as it is from the store.
    """

    def __init__(
        self, max_entries: int = 256, max_items: int = 200_000, max_bytes: int = 128 * 1024 * 1024,
        ttl: float = float("inf"), clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_entries = max_entries
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self._d: OrderedDict[str, CachedResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._items = 0
        self._bytes = 0
        # Evictions from outside (a delete, a prune, another worker's delete, an expiry), numbered,
        # so that a load that began before one does not put back what it evicted (evicted_since):
        # the latest GONE_ENTRIES ids, and when the cache was last cleared.
        self.generation = 0
        self._gone: OrderedDict[str, int] = OrderedDict()
        self._cleared = 0
        self._holders: dict[str, str] = {}  # item id -> the response find_item last found it in

    def __len__(self) -> int:
        return len(self._d)

    @property
    def items(self) -> int:
        return self._items

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, response_id: str, scope: str | None = None) -> CachedResponse | None:
        """The cached response, if ``scope`` (``None``: every owner) may see it."""
        e = self._d.get(response_id)
        if e is None or not e.visible(scope):
            return None
        if e.response.get("created_at", 0) + self.ttl <= self.clock():
            self.evict(response_id)  # expired in the store too
            return None
        self._d.move_to_end(response_id)
        return e

    def put(self, entry: CachedResponse, nbytes: int | None = None) -> None:
        """Cache ``entry`` as the most recently used (``nbytes``: its size if known)."""
        self._drop(entry.id)
        n = entry_nbytes(entry) if nbytes is None else nbytes
        if len(entry.context) > self.max_items or n > self.max_bytes // 4:
            return
        self._d[entry.id] = entry
        self._sizes[entry.id] = n
        self._items += len(entry.context)
        self._bytes += n
        while len(self._d) > self.max_entries or self._items > self.max_items or self._bytes > self.max_bytes:
            self._drop(next(iter(self._d)))

    def holds(self, response_ids: frozenset[str]) -> bool:
        """Whether every one of ``response_ids`` is cached (one C-level pass over them)."""
        return self._d.keys() >= response_ids

    def evict(self, response_id: str) -> None:
        """Forget a response that is gone (deleted, pruned, expired, failed as a parent)."""
        self.generation += 1
        gone = self._gone
        gone[response_id] = self.generation
        gone.move_to_end(response_id)
        if len(gone) > GONE_ENTRIES:
            gone.popitem(last=False)
        self._drop(response_id)

    def evicted_since(self, response_id: str, generation: int) -> bool:
        """Whether ``response_id`` was evicted after ``generation`` (a value of
        :attr:`generation` read earlier) was read; True when that is no longer known. A response
        loaded from the store while it was being deleted is not cached then: the delete's
        eviction came first, and the load would put it back, served on after its delete."""
        if generation == self.generation:
            return False
        if self._cleared > generation:
            return True
        g = self._gone.get(response_id)
        if g is not None:
            return g > generation
        oldest = next(iter(self._gone.values()), None)  # evictions are kept in order
        return oldest is None or oldest > generation + 1  # some since then were not kept

    def _drop(self, response_id: str) -> None:
        e = self._d.pop(response_id, None)
        if e is not None:
            self._items -= len(e.context)
            self._bytes -= self._sizes.pop(response_id)

    def clear(self) -> None:
        self._d.clear()
        self._sizes.clear()
        self._holders.clear()
        self._items = 0
        self._bytes = 0
        self.generation += 1
        self._gone.clear()
        self._cleared = self.generation

    def find_item(self, item_id: str, scope: str | None = None) -> Item | None:
        """A server-minted item among the own items of the cached responses ``scope`` may see,
        by id (newest responses first).

        The response each id was last found in is remembered (``_holders``, at most
        HOLDER_ENTRIES ids, then forgotten all at once): an AI SDK history names every earlier
        reasoning item by reference each step, and the scan from the newest response made a
        step's look-ups grow with the square of its length. A remembered response that still
        holds the item (cached, visible, not expired) answers; any response that mints an id
        holds the same item under it (an id is minted once; a response that reused it holds that
        very item, or one loaded from the store with the same content)."""
        found = self._find(item_id, scope)
        return None if found is None else found[0]

    def find_item_held(self, item_id: str, scope: str | None = None) -> tuple[Item, str, float] | None:
        """:meth:`find_item`, with the id of the response it was found in and when that response
        expires (its creation plus the time to live): while that response stays cached (no
        delete, prune, expiry or the cache's bounds let it go) and until then, :meth:`find_item`
        finds the same item (:attr:`hotloop.state.prefix.Prefix.checked`)."""
        found = self._find(item_id, scope)
        if found is None:
            return None
        item, entry = found
        return item, entry.id, entry.response.get("created_at", 0) + self.ttl

    def _find(self, item_id: str, scope: str | None) -> tuple[Item, CachedResponse] | None:
        gone = self.clock() - self.ttl
        holders = self._holders
        rid = holders.get(item_id)
        if rid is not None:
            entry = self._d.get(rid)
            if entry is not None and entry.visible(scope) and entry.response.get("created_at", 0) > gone:
                found = entry.minted_item(item_id)
                if found is not None:
                    return found, entry
        for entry in reversed(self._d.values()):
            if entry.visible(scope) and entry.response.get("created_at", 0) > gone:
                found = entry.minted_item(item_id)
                if found is not None:
                    if len(holders) >= HOLDER_ENTRIES:
                        holders.clear()
                    holders[item_id] = entry.id
                    return found, entry
        return None
