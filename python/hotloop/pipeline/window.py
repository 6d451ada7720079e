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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hotloop import errors, tokenizer
from hotloop.models import ModelLimits
from hotloop.protocol.request import FunctionCall, FunctionCallOutput, Item, Message, OtherItem
from hotloop.state.context import Context

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
    texts, blobs = plan.pending_texts()
    pending = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    pending += sum(len(t.encode("utf-8", "surrogatepass")) for t in blobs)
    pending += (len(texts) + len(blobs)) * tokenizer.TOKENS_PER_ITEM  # each item's overhead (count_texts)
    return plan.input_estimate() + pending  # the estimate's own share of pending text over-counts: safe


def exceeded(tokens: int, allowed: int, limits: ModelLimits, max_output_tokens: int | None) -> errors.HotloopError:
    window = limits.context_window
    if max_output_tokens is not None:
        msg = (
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{tokens + max_output_tokens} tokens ({tokens} in the input, {max_output_tokens} in the "
            "output). Please reduce the length of the input or of max_output_tokens, or set "
            "truncation to 'auto'."
        )
    else:
        msg = (
            f"This model's maximum context length is {window} tokens. However, your input has {tokens} "
            "tokens. Please reduce the length of the input, or set truncation to 'auto'."
        )
    return WindowExceeded(msg, param="input")


#: Verbatim item types that pair by another key than ``call_id``: an MCP approval request (its id)
#: and its response.
_PAIRED_BY = {"mcp_approval_request": "id", "mcp_approval_response": "approval_request_id"}


def _forbidden_cuts(items: list[Item]) -> set[int]:
    """Cut positions ``k`` (keep ``items[k:]``) that would separate a call from its output:
    function calls and their outputs, and the calls and outputs of item types kept verbatim
    (custom tools, shell, apply_patch, computer use: a ``call_id`` in their data; an MCP
    approval request's ``id`` and its response's ``approval_request_id``).

    An output belongs to the latest call before it with its call id: a conversation that reuses
    a call id (a client numbering its calls per turn, a backend that does) pairs each call with
    the outputs that follow it, up to the next call with that id once it was answered. Calls
    with one id not yet answered, and the outputs of one call, stay together."""
    spans: list[list[int]] = []
    open_: dict[str, list[int]] = {}  # call id -> [first, last, answered] of its latest group
    for i, it in enumerate(items):
        t = type(it)
        if t is FunctionCall:
            cid, output = it.call_id, False  # type: ignore[union-attr]
        elif t is FunctionCallOutput:
            cid, output = it.call_id, True  # type: ignore[union-attr]
        elif t is OtherItem:
            data = it.data  # type: ignore[union-attr]
            kind = str(data.get("type"))
            cid = data.get(_PAIRED_BY.get(kind, "call_id"))
            if type(cid) is not str:
                continue
            output = kind.endswith("_output") or kind == "mcp_approval_response"
        else:
            continue
        group = open_.get(cid)
        if group is None or (not output and group[2]):  # a new call (the last one was answered)
            group = open_[cid] = [i, i, int(output)]
            spans.append(group)
        else:
            group[1] = i
            if output:
                group[2] = 1
    forbidden: set[int] = set()
    for lo, hi, _ in spans:
        forbidden.update(range(lo + 1, hi + 1))
    return forbidden


def _kept(it: Item) -> bool:
    return type(it) is Message and it.role in _KEPT_ROLES  # type: ignore[union-attr]


def truncate(plan: "Plan", allowed: int) -> int:
    """Drop whole items from the front of a settled plan's input until its input tokens fit in
    ``allowed``; the number dropped (0 when nothing could be dropped or nothing needed to be)."""
    ctx = plan.context
    items = ctx.items
    n = len(items)
    excess = plan.input_tokens - allowed
    if excess <= 0 or n < 2:
        return 0
    chain = ctx.chain
    upto = [int(chain.tokens_upto(i)) for i in range(n + 1)]
    forbidden = _forbidden_cuts(items)
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
    fps = chain.fingerprints()
    new_items = [items[i] for i in keep]
    new_ctx = Context()
    new_ctx.extend(new_items, [fps[i] for i in keep], [upto[i + 1] - upto[i] for i in keep])
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
    if allowed is None:
        return 0
    tokens = plan.input_tokens
    if tokens <= allowed:
        return 0
    dropped = truncate(plan, allowed) if truncation == "auto" else 0
    if plan.input_tokens > allowed:
        # the same 400 as with "disabled": the input as sent, not what dropping left of it
        raise exceeded(tokens, allowed, limits, max_output_tokens)
    return dropped

