"""The ``sdk`` transport's glue: an ``httpx.Response`` as a :class:`~hotloop.backends.chat.backend.Body`.

Used when ``--backend-transport sdk`` is chosen, and by the ``lean`` transport's fallback when a
proxy is configured for the backend's origin. Also the httpx settings both chat backends share
for their non-streaming calls (model listing).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import httpx

from hotloop import errors
from hotloop.backends.chat.statuses import TransientBackendError, parse_body

log = logging.getLogger("hotloop.backends")

MAX_ERROR_BODY_BYTES = 64 * 1024  # read of a non-2xx body
MAX_MODELS_BYTES = 4 * 1024 * 1024  # read of a model list (a few hundred bytes a model)
DRAIN_TIMEOUT = 1.0  # after [DONE], how long to wait for the body's end (keeps the connection)


class _NoUserinfo(logging.Filter):
    """httpx's request lines name the URL whole, a base URL's user and password included: shown
    without them (:func:`~hotloop.backends.chat.http1.redact_url`). Runs only for the records the
    logger's level lets through (none at the default WARNING)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any("@" in str(a) for a in args):
            from hotloop.backends.chat.http1 import redact_url

            record.args = tuple(redact_url(str(a)) if "@" in str(a) else a for a in args)
        return True


_NO_USERINFO = _NoUserinfo()


def quiet_http_logs() -> None:
    """httpx logs every request at INFO: one line per turn is noise for a server (and costs
    time on the hot path). Left alone when logging is configured for debugging or explicitly;
    either way its lines never show the URL's user and password."""
    for name in ("httpx", "httpcore"):
        logger = logging.getLogger(name)
        if _NO_USERINFO not in logger.filters:
            logger.addFilter(_NO_USERINFO)
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return
    for name in ("httpx", "httpcore"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def http_timeout(first: float, idle: float) -> httpx.Timeout:
    """The HTTP client's own limits: a backstop behind the engine's first-chunk and idle timers.

    The read timeout covers both the wait for the response head and every gap between body reads,
    so it is the larger of the two engine timeouts (which fire first, with clearer messages).
    """
    return httpx.Timeout(connect=10.0, read=max(first, idle), write=30.0, pool=10.0)


class HttpxBody:
    """A streaming ``httpx.Response`` whose failures are hotloop errors."""

    __slots__ = ("_resp", "_it", "_backend", "_released")

    def __init__(self, resp: httpx.Response, backend: str) -> None:
        self._resp = resp
        self._it = resp.aiter_bytes()
        self._backend = backend
        self._released = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._read()

    async def _read(self) -> AsyncIterator[bytes]:
        try:
            async for raw in self._it:
                yield raw
        except httpx.TimeoutException:
            raise errors.BackendTimeout("The model backend stopped sending output.") from None
        except httpx.HTTPError:
            log.warning("%s backend: the connection broke mid-stream", self._backend)
            raise TransientBackendError("The model backend closed the connection mid-stream.") from None

    async def release(self) -> None:
        """Let a finished body's connection go back to httpx's pool once the rest of the body
        (normally nothing) is read, without making the caller wait, as the lean transport's
        ``release`` does: a backend that keeps the body open after ``[DONE]`` held each response's
        end back by ``DRAIN_TIMEOUT``. The rest is read by a task of its own (``_DRAINING``:
        each ends within ``DRAIN_TIMEOUT``), then the response is closed."""
        self._released = True
        task = asyncio.ensure_future(self._drain())
        _DRAINING.add(task)
        task.add_done_callback(_DRAINING.discard)

    async def _drain(self) -> None:
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT):
                async for _ in self._it:
                    pass
        except (TimeoutError, httpx.HTTPError):
            pass  # the connection is closed instead of reused; the response itself is complete
        finally:
            await self._resp.aclose()

    async def aclose(self) -> None:
        if not self._released:  # (a released body is closed by its drain)
            await self._resp.aclose()


# The drains of released bodies (HttpxBody.release), held until they end (an event loop keeps
# only weak references to its tasks); each ends within DRAIN_TIMEOUT, so this holds at most the
# bodies released in the last DRAIN_TIMEOUT seconds.
_DRAINING: set["asyncio.Future[None]"] = set()


async def read_models_body(resp: httpx.Response, backend: str) -> bytes:
    """A model list's body, read up to ``MAX_MODELS_BYTES`` (a backend or gateway that sends
    more is refused, not read into memory)."""
    buf = bytearray()
    try:
        async for raw in resp.aiter_bytes():
            buf += raw
            if len(buf) > MAX_MODELS_BYTES:
                log.warning("%s backend: the model list is over %d MiB; not read", backend, MAX_MODELS_BYTES >> 20)
                raise errors.BackendError("The model backend's model list is too large.")
    except httpx.HTTPError:
        raise errors.BackendUnavailable("Could not read the model backend's model list.") from None
    finally:
        await resp.aclose()
    return bytes(buf)


async def read_error_body(resp: httpx.Response) -> object:
    """A non-2xx body, read up to ``MAX_ERROR_BODY_BYTES`` and decoded if it is JSON."""
    buf = bytearray()
    try:
        async for raw in resp.aiter_bytes():
            buf += raw
            if len(buf) >= MAX_ERROR_BODY_BYTES:
                break
    except httpx.HTTPError:
        pass
    finally:
        await resp.aclose()
    return parse_body(bytes(buf[:MAX_ERROR_BODY_BYTES]))
