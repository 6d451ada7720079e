"""The Backend protocol: what every model source implements.

A backend receives a :class:`BackendRequest` (the effective conversation as typed items plus the
settings that matter to a model) and yields the internal chunk vocabulary of
:mod:`hotloop.protocol.chunks`. It never sees or produces wire JSON of the Responses API. Failures
are raised as :class:`hotloop.errors.HotloopError` subclasses (``RateLimited``, ``BackendError``,
``BackendTimeout``...); a model-level failure is yielded as a ``Failure`` chunk instead.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Protocol, Union

import msgspec

from hotloop._accel import DeltaLane
from hotloop.protocol.chunks import Chunk
from hotloop.protocol.request import FunctionTool, Item, TextFormat


class PushSlot:
    """Where a consumer that can take chunks synchronously says so (push delivery).

    A backend whose transport calls back on each network read may hand that read's chunks to
    ``fn`` from the callback, without waking the task that iterates the stream. ``fn`` returns
    how many of them (a prefix) it took; the backend yields the rest, and everything after them,
    through the iterator as usual. The iterator therefore stays the complete, ordered stream for
    a consumer that never sets ``fn``, and a backend that ignores the slot is correct too.

    The backend calls ``fn`` only while the iterating task is suspended waiting for the backend's
    next bytes (every chunk before has been yielded and handled), so pushed and yielded chunks
    keep their order; an exception from ``fn`` is raised by the iterator.

    ``lane``, when not None, is the consumer's open item as a :class:`DeltaLane` (kept current
    by the consumer, None whenever it does not take chunks): a backend that reads a plain delta
    of that item may read it into the item with ``SseDecoder.feed_lane`` and send the events
    with ``lane.emit(events)``, without calling the consumer at all; it then sets ``read_at``
    to the loop's time (the consumer's idle watchdog sees the backend speak).
    """

    __slots__ = ("fn", "lane", "lanes", "read_at")

    def __init__(self) -> None:
        self.fn: Callable[[list[Chunk]], int] | None = None
        self.lane: DeltaLane | None = None
        self.lanes = False  # set by a backend that reads lanes: only then is one kept current
        self.read_at = 0.0


class BackendRequest(msgspec.Struct, kw_only=True):
    model: str
    instructions: str | None
    items: list[Item]
    tools: list[FunctionTool]
    tool_choice: Union[str, dict[str, Any]]
    parallel_tool_calls: bool
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text_format: TextFormat | None = None
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    metadata: dict[str, Any] = {}
    user: str | None = None
    request_id: str | None = None  # the id hotloop gave the client's request (x-request-id), sent on to the backend
    push: PushSlot | None = None  # the consumer's synchronous chunk sink, if it has one (PushSlot)


class Backend(Protocol):
    name: str
    default_model: str

    async def start(self) -> None:
        """Open connections, load what is needed; called once before serving."""

    async def close(self) -> None:
        """Release connections."""

    async def list_models(self) -> list[dict[str, Any]]:
        """``Model`` objects: ``{"id", "object": "model", "created", "owned_by"}``."""

    def stream(self, req: BackendRequest) -> AsyncIterator[Chunk]:
        """Generate one response as chunks, ending with ``Finish`` (or ``Failure``)."""


def model_object(model_id: str, owned_by: str, created: int = 1_700_000_000) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}
