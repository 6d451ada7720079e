"""The size guard: bounds on what one turn adds to its conversation, checked once the request is
validated and its parent or cached prefix found, before its new input is classified, tokenized
or stored.

A turn's *new* input is what the pipeline still has to validate, classify, fingerprint, tokenize
and store: for a ``previous_response_id`` continuation, its whole ``input``; for a client that
resends its history, the items after the longest cached prefix (and after the output of the
response that prefix produced, which the client sends back; :mod:`hotloop.pipeline.reuse`), and
of those (all of them with no prefix cached) the items after the last one a model produced (an
assistant message, a reasoning item, a tool call, or an ``item_reference`` to a stored item:
:func:`turn_start`), every item when there is none (a first turn); when none of the items after
a cached prefix is the model's, the prefix's items after the model's last output in it count too
(:func:`turn_start` over the prefix), so that a body is accepted or refused as from scratch, whatever the prefix
cache holds. The history before that was
the new input of earlier turns, bounded when they were sent: a server that restarted, or whose
prefix cache let the conversation go or keeps only an early prefix of it (a conversation past
the cache's per-entry byte budget stops being registered, and its last registered prefix keeps
matching), must not refuse every later turn of a client that resends its history, as counting
all of it did once it passed the limits (a permanent lock-out: a refused turn caches nothing).

So for a whole history the operator's bound on what precedes the model's last output is the
request's own (``max_body_bytes``, ``HOTLOOP_MAX_BODY_BYTES``; ``MAX_INPUT_ITEMS``), as before
the guard: a client may label its own items as the model's, and the server cannot tell them from
the model's output without a cached prefix. ``previous_response_id`` continuations count their
whole ``input``. The request-level bounds (``max_body_bytes``, ``MAX_INPUT_ITEMS``)
limit what one message may carry; these limit the work one turn may ask for, so that an operator
can cap it below them (``--max-turn-input-items``, ``--max-turn-input-bytes``).

Bytes are the JSON of the new items as the server encodes them (compact, UTF-8): what the store
writes and the caches hold for them, close to what the client sent for them. Measured item by
item and only until the limit is passed: about 0.3-0.4 us per KB on the event loop (a 2 KB
tool-call turn 1-2 us; a 200 KB history of 100 items sent without a cached prefix 67-83 us), so it
runs on every turn.

An input over either limit is refused with 400 ``invalid_request_error``, code
``input_too_large``, param ``input``, before it is classified or tokenized; like a classifier's
block it leaves the chain as it was (a WebSocket connection keeps its cached parent, so the turn
can be sent again, smaller, on the same ``previous_response_id``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from hotloop import errors
from hotloop.protocol.request import FunctionCall, Item, ItemReference, Message, OtherItem, Reasoning

__all__ = ["InputTooLarge", "check", "input_bytes", "turn_start"]

_encode = msgspec.json.Encoder().encode


class InputTooLarge(errors.InvalidRequest):
    """A turn's new input is over ``--max-turn-input-items`` or ``--max-turn-input-bytes``."""

    code: str | None = "input_too_large"


def input_bytes(items: Sequence[Item] | Sequence[dict[str, Any]], limit: int | None = None) -> int:
    """Bytes of the JSON of ``items`` (each encoded compactly, no separators counted); with
    ``limit``, counted only until the total passes it (the result is then some value above it)."""
    n = 0
    for item in items:
        try:
            n += len(_encode(item))
        except (TypeError, ValueError, OverflowError, RecursionError):
            continue  # not encodable (validation refuses such items first): its size is not known
        if limit is not None and n > limit:
            break
    return n


def _produced(item: Item | dict[str, Any]) -> bool:
    """Whether a model produced ``item`` (an assistant message, reasoning, a call of any tool:
    ``function_call``, ``custom_tool_call``, ``local_shell_call``..., not its output), or it
    names a stored item (``item_reference``: the Vercel AI SDK sends a model's earlier output so)."""
    if isinstance(item, Message):
        return item.role == "assistant"
    if isinstance(item, (FunctionCall, Reasoning, ItemReference)):
        return True
    kind = item.type if isinstance(item, OtherItem) else (item.get("type") if isinstance(item, dict) else None)
    if isinstance(kind, str):
        return (
            kind.endswith("_call") or kind in ("reasoning", "item_reference")
            or (kind == "message" and isinstance(item, dict) and item.get("role") == "assistant")
        )
    return False


def turn_start(items: Sequence[Item] | Sequence[dict[str, Any]], end: int | None = None) -> int:
    """Where the client's own turn starts in a whole history (or in what follows its cached
    prefix), or in its first ``end`` items: after the last item a model produced (0 when there
    is none: a first turn)."""
    for i in range(len(items) if end is None else end, 0, -1):
        if _produced(items[i - 1]):
            return i
    return 0


def turn_items(items: list[Item], chained: bool, whole: bool) -> list[Item]:
    """What a request's turn adds, without a cached prefix: all of ``items`` after
    ``previous_response_id`` (``chained``) or for a string input; of a whole history (``whole``:
    an input list), what follows the model's last output in it."""
    if not chained and whole and len(items) > 1:
        return items[turn_start(items) :]
    return items


def check(items: Sequence[Item] | Sequence[dict[str, Any]], max_items: int, max_bytes: int) -> None:
    """Raise :class:`InputTooLarge` if ``items`` (a turn's new input items) are more than
    ``max_items`` or their JSON more than ``max_bytes``."""
    if len(items) > max_items:
        raise InputTooLarge(
            f"Invalid 'input': this turn adds {len(items)} input items; the server accepts at most "
            f"{max_items} new items per turn (items after 'previous_response_id', after a cached "
            "prefix of the conversation, or after the model's last output in it). Send fewer items.",
            param="input",
        )
    if input_bytes(items, max_bytes) > max_bytes:
        raise InputTooLarge(
            f"Invalid 'input': this turn's new input items are larger than the {max_bytes} bytes the "
            "server accepts per turn (their JSON, counting items after 'previous_response_id', after a "
            "cached prefix of the conversation, or after the model's last output in it). Send less input.",
            param="input",
        )
