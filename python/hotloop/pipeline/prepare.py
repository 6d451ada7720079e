"""Pre-inference: turn a validated request plus its resolved parent into a :class:`Plan`.

Only the request's *new* items are examined here: the parent's context (items, fingerprints, token
counts, call ids) was computed when the parent finished. Work is O(new input).
"""

from __future__ import annotations

from typing import Any

import msgspec

from hotloop import errors, tokenizer
from hotloop.pipeline import items as itemlib
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
    item_from_dict,
)
from hotloop.state.context import CachedResponse, Context

_ID_PREFIX = {Message: "msg", FunctionCall: "fc", FunctionCallOutput: "fco", Reasoning: "rs"}


class Plan:
    """Everything the backend call and the turn need, computed before inference."""

    __slots__ = ("prepared", "context", "new_items", "input_tokens", "cached_tokens", "parent")

    def __init__(
        self,
        prepared: Prepared,
        context: Context,
        new_items: list[Item],
        input_tokens: int,
        cached_tokens: int,
        parent: CachedResponse | None,
    ) -> None:
        self.prepared = prepared
        self.context = context
        self.new_items = new_items
        self.input_tokens = input_tokens
        self.cached_tokens = cached_tokens
        self.parent = parent


def _with_id(item: Item, ids: IdGen) -> Item:
    prefix = _ID_PREFIX.get(type(item))
    if prefix is not None and getattr(item, "id", None) is None:
        return msgspec.structs.replace(item, id=ids.new(prefix))  # type: ignore[type-var]
    return item


def _resolve_reference(ref: ItemReference, index: int, base: Context | None, seen: list[Item]) -> Item:
    for it in seen:
        if getattr(it, "id", None) == ref.id:
            return it
    found = base.find(ref.id) if base is not None else None
    if found is None:
        raise errors.ItemNotFound(
            f"Item with id '{ref.id}' not found. Items are not persisted when `store` is set to false.",
            param=f"input[{index}]",
        )
    return found


def settings_tokens(p: Prepared, cache: itemlib.TokenCache | None) -> int:
    """Tokens of what the model sees besides items: instructions and tool definitions."""
    n = tokenizer.TOKENS_PER_REQUEST
    if p.req.instructions:
        n += itemlib.blob_tokens(p.req.instructions, cache) + tokenizer.TOKENS_PER_ITEM
    for tool in p.tools:
        n += itemlib.blob_tokens(tool, cache)
    return n


def prepare(
    p: Prepared,
    parent: CachedResponse | None,
    ids: IdGen,
    cache: itemlib.TokenCache | None = None,
) -> Plan:
    """Resolve references, check function-call outputs, analyze only the new items."""
    base = parent.context if parent is not None else None
    new: list[Item] = []
    known_calls = base.call_ids if base is not None else set()
    pending_calls: set[str] = set()
    for i, item in enumerate(p.items):
        if type(item) is ItemReference:
            item = _resolve_reference(item, i, base, new)  # type: ignore[arg-type]
        t = type(item)
        if t is FunctionCall:
            pending_calls.add(item.call_id)  # type: ignore[union-attr]
        elif t is FunctionCallOutput:
            cid = item.call_id  # type: ignore[union-attr]
            if cid not in known_calls and cid not in pending_calls:
                raise errors.InvalidRequest(
                    f"No tool call found for function call output with call_id {cid}.",
                    param=f"input[{i}].call_id",
                )
        new.append(_with_id(item, ids))
    fps, toks = itemlib.analyze(new, cache)
    ctx = base.derive() if base is not None else Context()
    ctx.extend(new, fps, toks)
    settings = settings_tokens(p, cache)
    cached = 0
    if parent is not None and base is not None:
        # What a prompt cache would hold: the parent's whole conversation, plus the settings
        # rendered before it (instructions, tools) when they did not change.
        cached = base.tokens
        prev = parent.response
        if prev.get("instructions") == p.req.instructions and prev.get("tools") == p.tools:
            cached += settings
    input_tokens = ctx.tokens + settings
    return Plan(p, ctx, new, input_tokens, cached, parent)


def output_items(response: dict[str, Any]) -> list[Item]:
    """The Response's output items as typed items (for the continuation context)."""
    out: list[Item] = []
    for d in response["output"]:
        try:
            out.append(item_from_dict(d))
        except errors.HotloopError:
            out.append(OtherItem(type=str(d.get("type")), data=d))
    return out


def finished(plan: Plan, response: dict[str, Any], cache: itemlib.TokenCache | None = None) -> CachedResponse:
    """The cache entry for a finished response: its input context extended by its output."""
    ctx = plan.context
    input_len = len(ctx)
    outs = output_items(response)
    if outs:
        fps, toks = itemlib.analyze(outs, cache)
        ctx.extend(outs, fps, toks)
    return CachedResponse(response, ctx, input_len, bool(response.get("store", True)))
