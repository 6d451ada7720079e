"""The context-window check, and ``truncation: "auto"``.

What must fit: the plan's input tokens (items, instructions and tool definitions, as
:attr:`Plan.input_tokens` counts them) within the model's context window; when the request sets
``max_output_tokens``, the input plus ``max_output_tokens`` must fit as well. A request whose
``max_output_tokens`` exceeds the model's output limit is refused too.

The check costs O(new input): the context's token total is a running sum kept in the native
chain, so only the new items' counts are added. A large new input still being counted (see
:func:`hotloop.pipeline.prepare.prepare`'s ``defer``) is first bounded from above (a token is
at least one UTF-8 byte); only when that bound does not fit are the counts awaited before the
backend is called.

Truncation (``"auto"``) drops whole items from the front of the effective input until it fits,
and only then costs O(history). It never drops: a system or developer message (instructions
given as input), the input's last item, or one item of a function call without the others
that share its ``call_id`` (call and output are dropped together or kept together; a call id a
conversation uses again pairs each call with the outputs that follow it). When nothing
droppable is left and the input still does not fit, the answer is the same 400 as with
``"disabled"``.

Along a chain of ``previous_response_id`` turns, truncation decides as a request holding the whole
history would. A cut may drop a call that has no output yet; its output, coming later, pairs with
it in the whole history, where that cut would now split them. So a truncated conversation remembers
the ids of the calls it dropped that still await an output
(:class:`hotloop.state.context.DroppedCalls`, bounded, kept with the chain's states in the store;
none in an agent session that answers each call in the next turn), and an item that continues such
a call (an output; a call with its id while it was unanswered) is dropped with it by the next
``"auto"`` turn, with everything before it but the kept messages, even when the input fits; when no
cut can do that (the item is the input's last, or a call and output that must stay together
straddle it) the answer is a 400 ``context_length_exceeded``, as from scratch. Sent without
``"auto"``, the output of such a call is refused with the same code (:func:`orphaned_output`: the
whole history, which holds the call, did not fit), and the parent stays cached for a retry with
``"auto"``. A call id used again for a new call once the dropped one was answered is a new call. A
dropped call with all its outputs is forgotten: one more output with its id (a duplicate, which
from scratch would go with the call) is taken as before any truncation, a ``function_call_output``
refused as the 400 of an unknown call id, an output kept verbatim passed on. Until a truncation has
dropped a call that awaits an output, none of this costs anything.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from hotloop import errors, tokenizer
from hotloop.models import ModelLimits
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, Item, Message, OtherItem
from hotloop.state.context import Context, DroppedCalls, pairing

if TYPE_CHECKING:
    from hotloop.pipeline.prepare import Plan

_KEPT_ROLES = ("system", "developer")


class WindowExceeded(errors.ContextLengthExceeded):
    """The input does not fit the model's window (found before any backend call: the parent
    stays cached, so a retry with less input or ``truncation: "auto"`` can continue it)."""


def budget(limits: ModelLimits, max_output_tokens: int | None) -> int | None:
    """Input tokens allowed, or ``None`` (no window known). Raises when ``max_output_tokens``
    alone cannot be honoured."""
    window = limits.context_window
    if max_output_tokens is not None and limits.max_output_tokens is not None:
        if max_output_tokens > limits.max_output_tokens:
            raise errors.InvalidValue(
                f"max_output_tokens is too large: {max_output_tokens}. This model supports at most "
                f"{limits.max_output_tokens} output tokens.",
                param="max_output_tokens",
            )
    if window is None:
        return None
    if max_output_tokens is not None:
        if max_output_tokens >= window:
            raise errors.InvalidValue(
                f"max_output_tokens is too large: {max_output_tokens}. This model's context window is "
                f"{window} tokens, input and output together.",
                param="max_output_tokens",
            )
        return window - max_output_tokens
    return window


def upper_bound(plan: "Plan") -> int:
    """At least the plan's input tokens, before its pending texts are counted (O(new input))."""
    if plan.settled:
        return plan.input_tokens
    if pending_cut(plan):
        return sys.maxsize  # fit() must see this input, whatever its size
    texts, blobs = plan.pending_texts()
    pending = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    pending += sum(len(t.encode("utf-8", "surrogatepass")) for t in blobs)
    pending += (len(texts) + len(blobs)) * tokenizer.TOKENS_PER_ITEM  # each item's overhead (count_texts)
    return plan.input_estimate() + pending  # the estimate's own share of pending text over-counts: safe


def exceeded(
    tokens: int, allowed: int, limits: ModelLimits, max_output_tokens: int | None, truncation: str | None = None
) -> errors.HotloopError:
    """The 400 of an input over the window; it advises ``truncation: "auto"`` only to a request
    that did not already set it (with it, what is left after truncation is still too long)."""
    window = limits.context_window
    advice = "" if truncation == "auto" else ", or set truncation to 'auto'"
    if max_output_tokens is not None:
        msg = (
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{tokens + max_output_tokens} tokens ({tokens} in the input, {max_output_tokens} in the "
            f"output). Please reduce the length of the input or of max_output_tokens{advice}."
        )
    else:
        msg = (
            f"This model's maximum context length is {window} tokens. However, your input has {tokens} "
            f"tokens. Please reduce the length of the input{advice}."
        )
    return WindowExceeded(msg, param="input")


def _scan(items: list[Item], seed: DroppedCalls | None = None) -> tuple[list[list[Any]], dict[str, list[Any]]]:
    """The call groups of ``items``, each ``[first, last, answered, call id, owed]`` (owed: its
    calls less its outputs), in order, and each call id's latest group. ``seed``: the calls an
    earlier truncation dropped (:class:`DroppedCalls`), as groups before ``items`` (first and
    last -1) that the items continue as they would in the whole history.

    An output belongs to the latest call before it with its call id: a conversation that reuses
    a call id (a client numbering its calls per turn, a backend that does) pairs each call with
    the outputs that follow it, up to the next call with that id once it was answered. Calls
    with one id not yet answered, and the outputs of one call, form one group."""
    spans: list[list[Any]] = []
    open_: dict[str, list[Any]] = {}  # call id -> its latest group
    if seed:
        for cid, answered in seed.calls.items():
            spans.append(open_.setdefault(cid, [-1, -1, int(answered), cid, seed.owing(cid)]))
    for i, it in enumerate(items):
        t = type(it)
        if t is FunctionCall:
            cid, output = it.call_id, False  # type: ignore[union-attr]
        elif t is FunctionCallOutput:
            cid, output = it.call_id, True  # type: ignore[union-attr]
        elif t is OtherItem:
            key = pairing(it)
            if key is None:
                continue
            cid, output = key
        else:
            continue
        group = open_.get(cid)
        if group is None or (not output and group[2]):  # a new call (the last one was answered)
            group = open_[cid] = [i, i, int(output), cid, -1 if output else 1]
            spans.append(group)
        else:
            group[1] = i
            if output:
                group[2] = 1
                group[4] -= 1
            else:
                group[4] += 1
    return spans, open_


def _forbidden_cuts(items: list[Item], spans: list[list[Any]] | None = None) -> set[int]:
    """Cut positions ``k`` (keep ``items[k:]``) that would separate a call from its output:
    function calls and their outputs, and the calls and outputs of item types kept verbatim
    (:func:`hotloop.state.context.pairing`); see :func:`_scan` (``spans``: its groups)."""
    if spans is None:
        spans = _scan(items)[0]
    forbidden: set[int] = set()
    for g in spans:
        forbidden.update(range(g[0] + 1, g[1] + 1))
    return forbidden


def _floor(spans: list[list[Any]]) -> tuple[int, str | None]:
    """The least cut past every item that continues a dropped call's group, and that call's id
    (``0, None``: no item does)."""
    floor, cid = 0, None
    for lo, hi, _, c, _ in spans:
        if lo < 0 <= hi and hi >= floor:
            floor, cid = hi + 1, c
    return floor, cid


def _remembered(latest: dict[str, list[Any]], cut: int) -> DroppedCalls | None:
    """The calls dropped with ``items[:cut]`` (and before) that still await an output: every
    call id whose latest group ends before the cut with more calls than outputs, in the order
    dropped. A group with all its outputs is forgotten: only a duplicate output could continue it
    (then taken as before any truncation: see the module's doc), and a call with its id is a
    new call, with or without the memory; so in an agent session that answers each call in the
    next turn the memory stays empty (``None``), and nothing is stored."""
    gone = sorted((g for g in latest.values() if g[1] < cut and g[4] > 0), key=lambda g: g[1])  # (stable: seed first)
    return DroppedCalls.bounded([(g[3], bool(g[2]), g[4]) for g in gone])


def _kept(it: Item) -> bool:
    return type(it) is Message and it.role in _KEPT_ROLES  # type: ignore[union-attr]


def pending_cut(plan: "Plan") -> bool:
    """Whether the plan's input holds an item of a call that an earlier truncation of its
    conversation dropped (:class:`DroppedCalls`): :func:`fit` must see it whatever the input's
    size. O(new input), and only after a truncation."""
    if plan.settled:
        memory = plan.context.dropped
        return memory is not None and memory.forced
    parent = plan.parent
    memory = parent.context.dropped if parent is not None else None
    return memory is not None and (memory.forced or memory.hits(plan.new_items))


def orphaned_output(call_id: str, index: int) -> WindowExceeded:
    """The 400 of an output whose call truncation dropped from the conversation, sent without
    ``truncation: "auto"`` (which would drop the output with it): a request holding the whole
    history would hold the call, but that history did not fit the window."""
    return WindowExceeded(
        f"No tool call found for function call output with call_id {errors.clip(call_id)}: truncation dropped "
        "that call from this conversation in an earlier response, because the conversation did not fit "
        "the model's context window. Set truncation to 'auto' to drop the output with it, or leave it out.",
        param=f"input[{index}].call_id",
    )


def _uncuttable(call_id: str | None, limits: ModelLimits) -> WindowExceeded:
    """The 400 of an input that holds an item of a call an earlier truncation dropped (see
    :func:`truncate`) when no cut can drop it: from scratch, no cut keeps that call with it."""
    window = limits.context_window
    lead = f"This model's maximum context length is {window} tokens, and t" if window is not None else "T"
    return WindowExceeded(
        f"{lead}runcation dropped the call with call_id {errors.clip(call_id or '')} from this conversation in "
        "an earlier response. The input holds an item of that call (its output, or a call with its id), "
        "which must be dropped with it, but the items up to it cannot be (the input's last item, or one "
        "item of another call, is among them). Please start again from a shorter conversation.",
        param="input",
    )


def truncate(plan: "Plan", allowed: int | None) -> int:
    """Drop whole items from the front of a settled plan's input until its input tokens fit in
    ``allowed`` (``None``: no bound); the number dropped (0 when nothing could be dropped or
    nothing needed to be).

    After an earlier truncation (:attr:`Context.dropped`), an item of a call it dropped (an
    output that came since) is dropped too, with everything before it, as a request holding the
    whole history would have to: the cut that dropped the call no longer keeps it with its
    outputs. When no cut can do that, the context keeps ``dropped.forced`` (see :func:`fit`)."""
    ctx = plan.context
    items = ctx.items
    n = len(items)
    memory = ctx.dropped
    excess = plan.input_tokens - allowed if allowed is not None else 0
    forced = memory is not None and memory.forced
    if not forced and (excess <= 0 or n < 2):
        return 0
    spans, latest = _scan(items, memory)
    floor, _ = _floor(spans)
    if forced and floor == 0:
        # no item continues a dropped call after all (its id was used again for a new call once
        # it was answered): such ids are forgotten, and the flag with them
        ctx.dropped = _remembered(latest, 0)
        forced = False
        if excess <= 0 or n < 2:
            return 0
    upto = [int(ctx.chain.tokens_upto(i)) for i in range(n + 1)]
    forbidden = _forbidden_cuts(items, spans)  # (with the dropped calls' groups: below the floor)
    # Cut at k: drop items[:k] except the kept ones; never the last item (k <= n - 1).
    cut = 0
    freed = 0
    for k in range(1, n):
        it = items[k - 1]
        if not _kept(it):
            freed += upto[k] - upto[k - 1]
        if k not in forbidden and freed > 0:
            cut = k
            if freed >= excess:
                break
    if cut == 0:
        return 0
    keep = [i for i in range(cut) if _kept(items[i])] + list(range(cut, n))
    dropped = n - len(keep)
    if dropped == 0:
        return 0
    chain = ctx.chain
    fps = chain.fingerprints()
    new_items = [items[i] for i in keep]
    new_ctx = Context()
    new_ctx.extend(new_items, [fps[i] for i in keep], [upto[i + 1] - upto[i] for i in keep])
    new_ctx.dropped = remembered = _remembered(latest, cut)
    if remembered is not None:
        new_ctx.nbytes += remembered.nbytes
    base_len = len(plan.parent.context) if plan.parent is not None else 0
    plan.base_kept = sum(1 for i in keep if i < base_len)
    plan.items = new_items
    plan._context = new_ctx
    plan.truncated = dropped
    plan.cached_tokens = 0  # the prefix a prompt cache holds changed
    return dropped


def fit(plan: "Plan", limits: ModelLimits, max_output_tokens: int | None, truncation: str | None) -> int:
    """Check a settled plan against ``limits``; with ``truncation == "auto"`` truncate it first.
    The number of items dropped; raises :class:`hotloop.errors.ContextLengthExceeded`."""
    allowed = budget(limits, max_output_tokens)
    memory = plan.context.dropped
    if memory is not None and memory.forced:
        return _fit_dropped(plan, allowed, limits, max_output_tokens, truncation)
    if allowed is None:
        return 0
    tokens = plan.input_tokens
    if tokens <= allowed:
        return 0
    dropped = truncate(plan, allowed) if truncation == "auto" else 0
    if plan.input_tokens > allowed:
        # the same 400 as with "disabled": the input as sent, not what dropping left of it
        raise exceeded(tokens, allowed, limits, max_output_tokens, truncation)
    return dropped


def _fit_dropped(
    plan: "Plan", allowed: int | None, limits: ModelLimits, max_output_tokens: int | None, truncation: str | None
) -> int:
    """:func:`fit` of an input that holds an item with the id of a call an earlier truncation
    dropped (O(history); the flag goes with the cut, or with a look that finds the id was used
    again for a new call). With ``"auto"`` the cut passes that item whatever the input's size;
    else the input stays as the chain holds it (a call joining the dropped one: the next "auto"
    turn cuts past it; an output whose call is gone was refused by
    :func:`hotloop.pipeline.prepare.prepare`, see :func:`orphaned_output`)."""
    tokens = plan.input_tokens
    if truncation == "auto":
        dropped = truncate(plan, allowed)
        memory = plan.context.dropped
        if memory is not None and memory.forced and (allowed is None or tokens <= allowed):
            raise _uncuttable(_floor(_scan(plan.context.items, memory)[0])[1], limits)
    else:
        dropped = 0
        ctx = plan.context
        memory = ctx.dropped
        assert memory is not None
        spans, latest = _scan(ctx.items, memory)
        if _floor(spans)[0] == 0:
            ctx.dropped = _remembered(latest, 0)
    if allowed is not None and plan.input_tokens > allowed:
        raise exceeded(tokens, allowed, limits, max_output_tokens, truncation)
    return dropped
