"""Chat-completions backends' shared parts: a package whose I/O-free modules import no HTTP client.

* :mod:`.render` (I/O-free): a :class:`~hotloop.backends.base.BackendRequest` -> the request body,
  byte-stable across turns, with a bounded cache of rendered conversations.
* :mod:`.assemble` (I/O-free): decoded ``chat.completion.chunk`` objects -> hotloop's chunks.
* :mod:`.statuses` (I/O-free): non-2xx answers and mid-stream errors -> typed hotloop errors.
* :mod:`.backend`: the request/stream loop over any transport's streaming body.
* :mod:`.http1`: the ``lean`` transport (keep-alive HTTP/1.1 on asyncio protocols + httptools).
* :mod:`.httpx_body`: the ``sdk`` transport's glue (an httpx response as a body).

Importing this package loads only the I/O-free modules and the loop; the transports are imported
by the backends that use them.
"""

from hotloop.backends.chat.assemble import ChatChunk, ChunkAssembler, chunk_decoder
from hotloop.backends.chat.backend import Body, ChatBackend
from hotloop.backends.chat.render import CEREBRAS, OPENAI_COMPAT, Dialect, RenderCache, encode_request, encode_request_parts, render, render_messages
from hotloop.backends.chat.statuses import TransientBackendError, parse_body, retry_after, status_error

__all__ = [
    "CEREBRAS",
    "OPENAI_COMPAT",
    "Body",
    "ChatBackend",
    "ChatChunk",
    "ChunkAssembler",
    "Dialect",
    "RenderCache",
    "TransientBackendError",
    "chunk_decoder",
    "encode_request",
    "encode_request_parts",
    "parse_body",
    "render",
    "render_messages",
    "retry_after",
    "status_error",
]
