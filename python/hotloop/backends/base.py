"""The Backend protocol: what every model source implements.

A backend receives a :class:`BackendRequest` (the effective conversation as typed items plus the
settings that matter to a model) and yields the internal chunk vocabulary of
:mod:`hotloop.protocol.chunks`. It never sees or produces wire JSON of the Responses API. Failures
are raised as :class:`hotloop.errors.HotloopError` subclasses (``RateLimited``, ``BackendError``,
``BackendTimeout``...); a model-level failure is yielded as a ``Failure`` chunk instead.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, Union

import msgspec

from hotloop.protocol.chunks import Chunk
from hotloop.protocol.request import FunctionTool, Item, TextFormat


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
