"""Pre-inference: turn a validated request plus its resolved parent into a :class:`Plan`.

Only the request's *new* items are examined here: the parent's context (items, fingerprints, token
counts, call ids) was computed when the parent finished. Work is O(new input).
"""

from __future__ import annotations

from typing import Any

import msgspec

from hotloop import errors, tokenizer
from hotloop.pipeline import items as itemlib
from hotloop.pipeline import window
from hotloop.pipeline.classifiers import Frozen
from hotloop.protocol.objects import IdGen
from hotloop.protocol.request import (
    FunctionCall,
    FunctionCallOutput,
    Item,
    ItemReference,
    Message,
    OtherItem,
    Prepared,
    Reasoning,
    checked_tools,
    item_from_dict,
)
from hotloop.state.context import DROPPED_CALLS_STATE, CachedResponse, Context, DroppedCalls, item_id_of
from hotloop.state.store import LEGACY_OWNER

_ID_PREFIX = {Message: "msg", FunctionCall: "fc", FunctionCallOutput: "fco", Reasoning: "rs"}


# New input smaller than this is tokenized on the event loop once the backend request is out,
# larger input in a worker thread; either way while the backend starts generating (the counts
# are only needed for the final usage; Engine._count_later). The thread hand-off costs more CPU
# than the native counter takes for tens of KB (about 5 us per 2 KB of prose, 25 us per 2 KB of
# code): `hotloop bench paired` with the threshold at 8 KB against 128 KB, 16 KB and 32 KB of new
# input a turn: 0.87 and 0.94 of the CPU a turn inline, and no more wall time. A 64 KB input of
# code holds the event loop about 0.8 ms, the most this lets a count take from other streams.
INLINE_TOKENIZE_CHARS = 65536
CHARS_PER_TOKEN = 4  # o200k_base on English prose; only an estimate before the real count


class Plan:
    """Everything the backend call and the turn need, computed before inference.

    ``items`` (the effective input) is ready at once. Token counts of new items may still be
    ``pending`` (texts to tokenize off the event loop); :meth:`settle` completes them, after which
    ``context`` and ``input_tokens`` are final.
    """

    __slots__ = (
        "prepared", "items", "new_items", "parent", "cached_tokens", "pending", "pending_blobs",
        "_fps", "_toks", "_settings", "_context", "_cache", "_settings_cached", "_sizes", "supplied",
        "states", "flags", "truncated", "base_kept", "tools_json",
    )

    def __init__(
        self,
        prepared: Prepared,
        parent: CachedResponse | None,
        new_items: list[Item],
        fps: list[bytes],
        toks: list[int],
        pending: list[tuple[int, str]],
        pending_blobs: list[tuple[bytes, str]],
        settings: int,
        cached_tokens: int,
        cache: itemlib.TokenCache | None,
        settings_cached: bool = False,
        sizes: list[int] | None = None,
    ) -> None:
        self.prepared = prepared
        self.parent = parent
        self.new_items = new_items
        base = parent.context if parent is not None else None
        self.items: list[Item] = (base.items + new_items) if base is not None else list(new_items)
        self._fps = fps
        self._toks = toks
        self.pending = pending
        self.pending_blobs = pending_blobs  # (fingerprint, text) of settings not yet counted
        self._settings = settings
        self.cached_tokens = cached_tokens
        self._cache = cache
        self._settings_cached = settings_cached  # unchanged settings count as cached prefix
        self._sizes = sizes  # bytes of the new items (None: Context estimates them)
        self._context: Context | None = None
        # ids of new items the server did not mint here (the client's own, and resolved references)
        self.supplied: frozenset[str] = frozenset()
        # classifier states after this turn (the parent's when nothing ran; see pipeline.classifiers)
        self.states: dict[str, Any] | None = parent.states if parent is not None else None
        self.flags: dict[str, int] | None = None  # this turn's findings per kind, for the ledger
        # items truncation dropped from the front of the input, and how many of the parent's
        # context items the input still holds (None: all; see pipeline.window)
        self.truncated = 0
        self.base_kept: int | None = None
        self.tools_json: bytes | None = None  # the request's tools as sent (None: not taken; see tools_json())

    @property
    def settled(self) -> bool:
        return self._context is not None

    @property
    def pending_chars(self) -> int:
        return sum(len(t) for _, t in self.pending) + sum(len(t) for _, t in self.pending_blobs)

    def pending_texts(self) -> tuple[list[str], list[str]]:
        return [t for _, t in self.pending], [t for _, t in self.pending_blobs]

    @property
    def last_fp(self) -> bytes | None:
        """The fingerprint of the last new input item (``None``: no new item)."""
        return self._fps[-1] if self._fps else None

    def settle(self, counts: tuple[list[int], list[int]] | None = None) -> None:
        """Fill pending counts (``None``: count them here; else :func:`itemlib.count_pending`'s
        result) and build the context."""
        if self._context is not None:
            return
        if self.pending or self.pending_blobs:
            if counts is None:
                counts = itemlib.count_pending(*self.pending_texts())
            item_counts, blob_counts = counts
            itemlib.fill(self._fps, self._toks, self.pending, item_counts, self._cache)
            for (fp, _), n in zip(self.pending_blobs, blob_counts):
                self._settings += n
                if self._settings_cached:
                    self.cached_tokens += n
                if self._cache is not None:
                    self._cache.misses += 1
                    self._cache.put(fp, n)
            self.pending = []
            self.pending_blobs = []
        base = self.parent.context if self.parent is not None else None
        ctx = (
            Context(self.items, base.chain.copy(), set(base.call_ids), base.nbytes, ids_from=base, dropped=base.dropped)
            if base is not None
            else Context(self.items)
        )
        ctx.extend_chain(self.new_items, self._fps, self._toks, self._sizes)
        self._context = ctx

    @property
    def context(self) -> Context:
        if self._context is None:
            raise RuntimeError("Plan.context before settle()")
        return self._context

    @property
    def input_tokens(self) -> int:
        return self.context.tokens + self._settings

    def input_estimate(self) -> int:
        """``input_tokens`` once settled; before that, the known counts plus one token per
        ``CHARS_PER_TOKEN`` characters still to count (for rate limits, corrected afterwards)."""
        if self._context is not None:
            return self.input_tokens
        base = self.parent.context.tokens if self.parent is not None else 0
        return base + sum(self._toks) + self._settings + self.pending_chars // CHARS_PER_TOKEN + 1


# Ids for item types kept verbatim (OtherItem), as OpenAI mints them; "item" for the rest.
_OTHER_ID_PREFIX = {"custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}


def _with_id(item: Item, ids: IdGen) -> Item:
    """``item`` with an id: ``input_items`` pages by id, so every stored item has one. An item
    kept verbatim gets it in its data; the id is not what the model reads (render.py and the
    token count leave it out), so minting it changes neither the rendering nor the count."""
    t = type(item)
    if t is OtherItem:
        data = item.data  # type: ignore[union-attr]
        if data.get("id") is None:
            iid = ids.new(_OTHER_ID_PREFIX.get(item.type, "item"))  # type: ignore[union-attr]
            return OtherItem(type=item.type, data={**data, "id": iid})  # type: ignore[union-attr]
        return item
    prefix = _ID_PREFIX.get(t)
    if prefix is not None and getattr(item, "id", None) is None:
        return msgspec.structs.replace(item, id=ids.new(prefix))  # type: ignore[type-var]
    return item


def _without_id(item: Item) -> Item:
    """``item`` without its id (:func:`_with_id` then mints one)."""
    if type(item) is OtherItem:
        data = item.data  # type: ignore[union-attr]
        return OtherItem(type=item.type, data={k: v for k, v in data.items() if k != "id"})  # type: ignore[union-attr]
    return msgspec.structs.replace(item, id=None)  # type: ignore[type-var]


def _resolve_reference(
    ref: ItemReference, index: int, base: Context | None, seen: list[Item], stored: dict[str, Item] | None,
    items: list[Item],
) -> Item:
    for it in seen:
        if getattr(it, "id", None) == ref.id:
            return it
    found = base.find(ref.id) if base is not None else None
    if found is None and stored:
        found = stored.get(ref.id)
    if found is None:
        if any(type(it) is not ItemReference and getattr(it, "id", None) == ref.id for it in items[index + 1 :]):
            # the item itself comes later in this input (so no store was searched for it): the
            # input holds it twice, as a reference after it does (prepare); not "not found"
            raise _duplicate(ref.id)
        raise errors.ItemNotFound(
            f"Item with id '{errors.clip(ref.id)}' not found. Items are not persisted when `store` is set to false.",
            param=f"input[{index}]",
        )
    return found


def _duplicate(item_id: str) -> errors.HotloopError:
    return errors.InvalidRequest(
        f"Duplicate item found with id {errors.clip(item_id)}. Remove duplicate items from your input and try again.",
        param="input",
    )


_encode = msgspec.json.encode


def tools_json(p: Prepared) -> bytes | None:
    """The tool definitions as JSON, as the client sent them (key order and number spelling
    included): with the instructions, what :func:`settings_tokens` counts, so that the same
    bytes and the same instructions mean the same count. ``None``: nested too deeply to encode.
    An array decoded once for many requests (:mod:`hotloop.pipeline.settings`) was encoded then."""
    shared = checked_tools(p.tools)
    if shared is not None:
        return shared.json
    try:
        return _encode(p.tools)
    except RecursionError:
        return None


def settings_tokens(p: Prepared, cache: itemlib.TokenCache | None) -> tuple[int, list[tuple[bytes, str]]]:
    """Tokens of what the model sees besides items (instructions, tool definitions): the known
    count, and the ``(fingerprint, text)`` of settings still to be counted."""
    n = tokenizer.TOKENS_PER_REQUEST
    missing: list[tuple[bytes, str]] = []
    blobs: list[Any] = list(p.tools)
    if p.req.instructions:
        n += tokenizer.TOKENS_PER_ITEM
        blobs.insert(0, p.req.instructions)
    for blob in blobs:
        count, text, fp = itemlib.blob_split(blob, cache)
        n += count
        if text is not None:
            missing.append((fp, text))
    return n, missing


def prepare(
    p: Prepared,
    parent: CachedResponse | None,
    ids: IdGen,
    cache: itemlib.TokenCache | None = None,
    *,
    defer: bool = False,
    stored: dict[str, Item] | None = None,
) -> Plan:
    """Resolve references, check function-call outputs, analyze only the new items.

    With ``defer``, the new input's token counting is left ``pending`` for the caller to run
    later or off the event loop (then :meth:`Plan.settle` with the counts); otherwise the plan
    is settled.
    ``stored`` holds items of stored responses that ``item_reference`` items may name (looked up
    by the caller, which does the I/O; see :func:`unresolved_references`).
    """
    base = parent.context if parent is not None else None
    if base is not None and base.dropped is None and parent.store and parent.states:  # type: ignore[union-attr]
        _restore_dropped(parent)  # type: ignore[arg-type]
    new: list[Item] = []
    known_calls = base.call_ids if base is not None else set()
    pending_calls: set[str] = set()
    supplied: set[str] = set()
    for i, item in enumerate(p.items):
        referenced = type(item) is ItemReference
        if referenced:
            item = _resolve_reference(item, i, base, new, stored, p.items)  # type: ignore[arg-type]
            rid = item_id_of(item)
            if rid is not None and base is not None and base.position(rid) is not None:
                # A reference to an item the chain already holds (a client resending its history
                # with previous_response_id): the model reads it again, as asked, and the copy is
                # a new item of this response with an id of its own: a chain holds each id once
                # (input_items pages by id). Refusing it (as a re-sent item with its id is
                # refused) would break clients that send references to any stored output. The
                # new id is minted below, so a later item_reference can name the copy too.
                item = _without_id(item)
        t = type(item)
        if t is FunctionCall:
            pending_calls.add(item.call_id)  # type: ignore[union-attr]
        elif t is FunctionCallOutput:
            cid = item.call_id  # type: ignore[union-attr]
            if cid not in known_calls and cid not in pending_calls:
                dropped = base.dropped if base is not None else None
                if dropped is None or cid not in dropped.calls:
                    raise errors.InvalidRequest(
                        f"No tool call found for function call output with call_id {errors.clip(cid)}.",
                        param=f"input[{i}].call_id",
                    )
                # the output of a call truncation dropped: "auto" drops it too (window.truncate),
                # as it would from the whole history
                if p.req.truncation != "auto":
                    raise window.orphaned_output(cid, i)
        given = item_id_of(item)
        if given is not None:
            if given in supplied or (not referenced and base is not None and base.position(given) is not None):
                # OpenAI's answer to an id sent twice, or to an item of the previous response sent
                # again with previous_response_id: input_items pages by id, and a chain holds
                # each item once (a reference names an item, and may name one in the chain, but
                # not one this input already holds: input_items paged such a duplicate forever)
                raise _duplicate(given)
            supplied.add(given)
        new.append(_with_id(item, ids))
    fps, toks, missing, sizes = itemlib.split(new, cache)
    key = tools_json(p)
    # the parent's instructions, sent again (its tools are compared below)
    same_instructions = parent is not None and parent.response.get("instructions") == p.req.instructions
    known = parent.settings if same_instructions and parent is not None else None
    missing_blobs: list[tuple[bytes, str]]
    if known is not None and key is not None and known[0] == key:
        # ... with its tools byte for byte: counted when it ran (an agent resends a few tens of
        # KB of them every turn); a chain keeps one copy of them
        settings, missing_blobs, key = known[1], [], known[0]
        same = True
    else:
        settings, missing_blobs = settings_tokens(p, cache)
        same = False
    cached = 0
    unchanged = False
    if parent is not None and base is not None:
        # What a prompt cache would hold: the parent's whole conversation and the settings
        # rendered before it (instructions, tools), when those did not change. A prompt is
        # cached by its prefix, and the settings come first: changed, nothing of the
        # conversation after them is served from the cache either. A prompt cache is the
        # model's own: after a change of model nothing is cached.
        unchanged = parent.response.get("model") == p.req.model and (
            same or (same_instructions and parent.response.get("tools") == p.tools)
        )
        if unchanged:
            cached = base.tokens + settings  # the part already counted; settle() adds the rest
    plan = Plan(p, parent, new, fps, toks, missing, missing_blobs, settings, cached, cache, unchanged, sizes)
    plan.supplied = frozenset(supplied)
    plan.tools_json = key
    if not defer or not (plan.pending or plan.pending_blobs):
        plan.settle()
    return plan


def _restore_dropped(parent: CachedResponse) -> None:
    """A parent loaded from the store: the calls truncation dropped from its conversation come
    back from its chain states (see :func:`finished`), once. Not for a stand-in holding a reused
    prefix (``store`` false, :func:`hotloop.pipeline.reuse.parent_of`): from the full history
    its client sent, nothing was dropped."""
    raw = parent.states.get(DROPPED_CALLS_STATE)  # type: ignore[union-attr]
    if raw is not None:
        parent.context.dropped = DroppedCalls.from_json(raw)


def _with_dropped(states: dict[str, Any] | None, dropped: DroppedCalls | None) -> dict[str, Any] | None:
    """``states`` holding ``dropped`` (stored with them; ``None``: without it). A new dict only
    when that changes: a turn that keeps its parent's memory passes its parent's states on (the
    same objects). The value goes in as :class:`Frozen`, which the writer's freeze stores as it
    is (no copy, no size check: DroppedCalls' bounds keep it under ``MAX_STATE_BYTES``); made
    once per memory (:meth:`DroppedCalls.to_json`; a reloaded one's is the stored value)."""
    if dropped is not None:
        value = dropped.to_json()
        held = states.get(DROPPED_CALLS_STATE) if states is not None else None
        if type(held) is not Frozen or held.value is not value:
            return {**(states or {}), DROPPED_CALLS_STATE: Frozen(value)}
    elif states and DROPPED_CALLS_STATE in states:
        return {k: v for k, v in states.items() if k != DROPPED_CALLS_STATE} or None
    return states


def unresolved_references(p: Prepared, parent: CachedResponse | None) -> list[str]:
    """Ids of ``item_reference`` items that neither the chain nor the request itself holds."""
    base = parent.context if parent is not None else None
    own = {getattr(it, "id", None) for it in p.items if type(it) is not ItemReference}
    return [
        it.id
        for it in p.items
        if type(it) is ItemReference and it.id not in own and (base is None or base.find(it.id) is None)
    ]


def output_items(response: dict[str, Any]) -> list[Item]:
    """The Response's output items as typed items (for the continuation context)."""
    out: list[Item] = []
    for d in response["output"]:
        try:
            out.append(item_from_dict(d))
        except errors.HotloopError:
            out.append(OtherItem(type=str(d.get("type")), data=d))
    return out


def finished(
    plan: Plan, response: dict[str, Any], cache: itemlib.TokenCache | None = None, owner: str = LEGACY_OWNER
) -> CachedResponse:
    """The cache entry for a finished response (``owner``'s): its input context extended by its output."""
    ctx = plan.context
    input_len = len(ctx)
    outs = output_items(response)
    if outs:
        fps, toks, sizes = itemlib.analyze(outs, cache)
        ctx.extend(outs, fps, toks, sizes)
    states = plan.states
    if ctx.dropped is not None or (states and DROPPED_CALLS_STATE in states):
        states = _with_dropped(states, ctx.dropped)  # (only after a truncation)
    parent = plan.parent
    return CachedResponse(
        response,
        ctx,
        input_len,
        bool(response.get("store", True)),
        parent.id if parent is not None else None,
        (len(parent.context) if plan.base_kept is None else plan.base_kept) if parent is not None else 0,
        owner,
        plan.supplied,
        states,
        (plan.tools_json, plan._settings) if plan.tools_json is not None else None,
    )
