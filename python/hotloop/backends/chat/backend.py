"""The request and stream loop both chat backends share, over any :class:`Body` transport.

A transport opens one streaming ``POST`` and hands back a :class:`Body`: the 2xx response's bytes
as they arrive, with transport failures already mapped to typed hotloop errors. The bytes go
straight into the native SSE decoder; each event's JSON is decoded with msgspec and assembled
into the chunk vocabulary. Nothing here imports an HTTP client.

Pushed (a transport that calls back on each read, and a consumer's ``PushSlot``), the
events that only continue the item being streamed skip all of that: with the consumer's lane
for that item, the native decoder reads them into the item and makes their Responses events
(``SseDecoder.feed_lane``), and the read callback sends those.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol

import msgspec

from hotloop import errors
from hotloop._accel import BACKEND_NAMES, SseDecoder
from hotloop.backends.base import BackendRequest, model_object
from hotloop.backends.chat.assemble import ChatChunk, ChunkAssembler, SplitSurrogates, chunk_decoder
from hotloop.backends.chat.render import OPENAI_COMPAT, Dialect, RenderCache, encode_request_parts
from hotloop.backends.chat.statuses import TransientBackendError, retry_delay, status_error
from hotloop.models import reported_window
from hotloop.protocol.chunks import Chunk

if TYPE_CHECKING:
    from hotloop.backends.chat.http1 import Pool

log = logging.getLogger("hotloop.backends")

MAX_SSE_EVENT_BYTES = 4 * 1024 * 1024  # one SSE line / event from the backend
MODELS_TTL = 60.0  # seconds a backend's model list is cached
# seconds a backend's model list may take (at start-up, and for GET /v1/models): past it the
# default model is offered, as when the listing fails, and the next call asks again. Without
# it a backend that accepted the connection and never answered held start-up for the
# backend timeout (300 s by default) before the server served anything.
MODELS_TIMEOUT = 10.0
# Push delivery reads plain deltas into events with SseDecoder.feed_lane when it is native (the
# pure build pushes every chunk through the chunk sink: feed_lane's twin is slower than that).
_LANES = BACKEND_NAMES["SseDecoder"] == "hotloop._native"


class Body(Protocol):
    """A 2xx streaming response body.

    Iterating yields the body's bytes as they arrive and raises only :class:`hotloop.errors`
    (``BackendTimeout`` when the backend goes silent, ``TransientBackendError`` when the
    connection breaks). :meth:`release` says the caller has read all it needs (``[DONE]`` seen):
    the transport may keep the connection if the rest of the body follows promptly.
    :meth:`aclose` abandons the body (the connection is then never reused unless it was
    complete). Both are idempotent.
    """

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def release(self) -> None: ...

    async def aclose(self) -> None: ...


class _Models(msgspec.Struct):
    data: list[dict[str, Any]] = []


_models_decoder = msgspec.json.Decoder(_Models)
_MALFORMED = "The model backend sent a malformed stream."


class ChatBackend:
    """The request and stream loop for a chat-completions backend.

    Subclasses set ``name``, ``dialect`` and ``owned_by`` and implement :meth:`_open` (send the
    body; return the streaming :class:`Body`, or raise a typed error: :func:`status_error` for a
    non-2xx answer) and :meth:`_get_models` (the raw ``/models`` body).
    """

    name = "chat"
    dialect: Dialect = OPENAI_COMPAT
    owned_by = "backend"

    def __init__(self, *, model: str, retries: int, think_tags: str = "auto") -> None:
        self.default_model = model
        self.retries = max(0, retries)
        # a <think> block at the start of the content is reasoning (ChunkAssembler._think_content);
        # "open": the content begins inside one; "off": the content is text
        self.think_tags = think_tags != "off"
        self.think_opened = think_tags == "open"
        self._models: list[dict[str, Any]] = []
        # context windows the backend's /models reported, by model id (vLLM: max_model_len)
        self.context_windows: dict[str, int] = {}
        self._models_at = -MODELS_TTL
        self._models_fetch: asyncio.Future[list[dict[str, Any]]] | None = None  # the fetch under way
        self._renders = RenderCache(self.dialect)
        self._pool: Pool | None = None  # the lean transport's pool; None: the sdk transport

    @property
    def transport(self) -> str:
        """The transport in use: ``lean`` or ``sdk``."""
        return "lean" if self._pool is not None else "sdk"

    async def _close_pool(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None

    async def _open(self, body: list[bytes], model: str, request_id: str | None = None) -> Body:
        """``body``: the request body in pieces (:func:`encode_request_parts`)."""
        raise NotImplementedError

    async def _get_models(self) -> bytes:
        raise NotImplementedError

    # -- models --------------------------------------------------------------------------------

    async def list_models(self) -> list[dict[str, Any]]:
        """The backend's ``/models``, cached for ``MODELS_TTL`` seconds; the default model on error.
        Callers that ask while a fetch is under way share it (each started its own, and a large
        list was then read into memory once per caller)."""
        if time.monotonic() - self._models_at < MODELS_TTL:
            return self._models
        fetch = self._models_fetch
        if fetch is None or fetch.done() or fetch.get_loop() is not asyncio.get_running_loop():
            fetch = self._models_fetch = asyncio.ensure_future(self._fetch_models())
        return await asyncio.shield(fetch)  # (a caller that leaves does not cancel the others')

    async def _fetch_models(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        try:
            try:
                async with asyncio.timeout(MODELS_TIMEOUT):
                    raw = await self._get_models()
            except TimeoutError:
                log.warning("%s backend: the model list did not come within %g s", self.name, MODELS_TIMEOUT)
                return self._fallback()  # not cached: the next call asks again
            listed = _models_decoder.decode(raw).data
            windows = {str(m["id"]): w for m in listed if isinstance(m.get("id"), str) and (w := reported_window(m))}
            if windows:
                self.context_windows = windows
            models = [
                model_object(
                    str(m["id"]),
                    str(m.get("owned_by") or self.owned_by),
                    int(m["created"]) if isinstance(m.get("created"), int) else 1_700_000_000,
                )
                for m in listed
                if isinstance(m.get("id"), str)
            ]
        except (errors.HotloopError, msgspec.DecodeError, ValueError):
            log.warning("%s backend: could not list models; offering the default model", self.name)
            models = []
        if not models:
            models = self._fallback()
        self._models, self._models_at = models, now
        return models

    def _fallback(self) -> list[dict[str, Any]]:
        """The model list without the backend's: the default model, if there is one."""
        return [model_object(self.default_model, self.owned_by)] if self.default_model else []

    # -- streaming -----------------------------------------------------------------------------

    def _sent_error(self, error: Any, status: object, model: str) -> errors.HotloopError:
        """An error object a backend sent with a 2xx (in its stream, or as its whole answer),
        with the ``status_code`` beside it (when a 4xx/5xx status) or else the status it says
        (_error_status)."""
        code = status if isinstance(status, int) and 400 <= status <= 599 else _error_status(error)
        return status_error(code, {}, {"error": error}, backend=self.name, model=model)

    async def _document(self, first: bytes, it: Any, model: str) -> ChatChunk:
        """A 2xx answer that is one JSON document, not a stream (its first bytes ``first``, then
        the rest from ``it``): a server that ignores ``stream: true`` (its ``chat.completion``,
        taken as one chunk: its messages as deltas), or one that answers an error with a 200
        (raised as the error it is, as one sent in a stream is: a context refusal a 400, not a
        retried "closed the stream" 502). Anything else is a malformed stream."""
        try:
            doc = json.loads(await _whole_body(first, it))
        except (ValueError, RecursionError):  # (UnicodeDecodeError too; a document nested too deep)
            raise errors.BackendError(_MALFORMED) from None
        if not isinstance(doc, dict):
            raise errors.BackendError(_MALFORMED)
        error = doc.get("error")
        if error is not None:
            raise self._sent_error(error, doc.get("status_code"), model)
        choices = doc.get("choices")
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise errors.BackendError(_MALFORMED)
        doc["choices"] = [{k: v for k, v in c.items() if k != "message"} | {"delta": c.get("message") or {}} for c in choices]
        try:
            return chunk_decoder.decode(msgspec.json.encode(doc))
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, OverflowError, ValueError, RecursionError):
            # (a lone surrogate escape in its text: UnicodeEncodeError, a ValueError)
            raise errors.BackendError(_MALFORMED) from None

    async def stream(self, req: BackendRequest) -> AsyncIterator[Chunk]:
        """One response as chunks. The body loop is inlined (one async generator per response,
        not one per layer): each network read costs one resumption of this generator, or none
        when the consumer takes chunks by push (``req.push``, a transport with ``Body.push``)."""
        body = encode_request_parts(req, self.dialect, self._renders)
        model = req.model
        slot = req.push
        attempt = 0
        while True:
            yielded = False
            try:
                resp = await self._open(body, model, req.request_id)
                pushes = False
                try:
                    assembler = ChunkAssembler(self.think_tags, self.think_opened)
                    decoder = SseDecoder(MAX_SSE_EVENT_BYTES)
                    feed = decoder.feed
                    feed_lane = decoder.feed_lane if _LANES else None
                    loop_time = asyncio.get_running_loop().time
                    decode = chunk_decoder.decode
                    mender: SplitSurrogates | None = None  # made at the first chunk msgspec refuses
                    ordinary = _ordinary
                    done = False
                    # What push delivery decoded but did not deliver, for this loop: the
                    # assembler's chunks the sink refused, then the SSE events after them.
                    outs: list[Chunk] = []
                    carry: list[tuple[str, str]] = []
                    # the assembler's open item (ChunkAssembler.lane), kept current while pushing
                    alane = None
                    failed: list[BaseException] = []
                    # the assembler's refusal of a pushed chunk: raised after the chunks before it
                    late: list[BaseException] = []

                    def push(raw: bytes) -> bool | None:
                        """Called from the transport's read callback while this generator is
                        parked waiting for bytes: decode the read and hand its chunks to the
                        sink, up to what needs this loop ([DONE], an error event, bad JSON).
                        None: not taken (the sink is gone); False: this loop has work now."""
                        nonlocal yielded, alane
                        sink = slot.fn  # type: ignore[union-attr]
                        if sink is None:
                            return None
                        lane = alane
                        try:
                            dl = slot.lane if feed_lane is not None else None  # type: ignore[union-attr]
                            if dl is not None and lane is not None and dl.kind == lane[0] and dl.call == lane[1]:
                                # the consumer's lane for the item the assembler has open: its
                                # plain deltas become events in the native decoder, and go out
                                frames, events = feed_lane(raw, dl, lane[2], lane[3])  # type: ignore[misc]
                                slot.read_at = loop_time()  # type: ignore[union-attr]
                                if frames:
                                    yielded = True
                                    try:
                                        dl.emit(frames)
                                    except Exception as exc:  # the consumer's own failure: raised below
                                        failed.append(exc)
                                        return False
                                if not events:
                                    return True
                            else:
                                events = feed(raw)
                        except ValueError:
                            failed.append(errors.BackendError(_MALFORMED))
                            return False
                        made: list[Chunk] = []
                        refused: BaseException | None = None
                        try:
                            for i, (event, data) in enumerate(events):
                                chunk = ordinary(event, data)
                                if chunk is None:
                                    carry.extend(events[i:])
                                    break
                                made += assembler.feed(chunk)
                        except Exception as exc:  # the assembler's refusal (a malformed tool call):
                            refused = exc  # raised by this loop after the chunks before it
                        alane = assembler.lane()
                        if made:
                            try:
                                taken = sink(made)
                            except Exception as exc:  # the consumer's own failure: raised below
                                failed.append(exc)
                                return False
                            if taken:
                                yielded = True
                            if taken < len(made):
                                outs.extend(made[taken:])
                        if refused is not None:
                            late.append(refused)
                            return False
                        return not (outs or carry)

                    pushes = slot is not None and hasattr(resp, "push")
                    if pushes:
                        slot.lanes = feed_lane is not None  # type: ignore[union-attr]
                    # Until the body's first bytes are read, they are not pushed (nobody takes
                    # pushed chunks before the first one anyway): they tell a stream from a whole
                    # JSON document (_document)
                    probe = True
                    it = resp.__aiter__()
                    while True:
                        if failed:
                            raise failed[0]
                        if outs:
                            pending, outs[:] = outs[:], []
                            for out in pending:
                                yielded = True
                                yield out
                        if late:
                            raise late[0]
                        if carry:
                            events, carry[:] = carry[:], []
                        else:
                            try:
                                raw = await anext(it)
                            except StopAsyncIteration:
                                break
                            if not raw:
                                continue  # woken by push delivery: see outs, carry, failed
                            if probe:
                                probe = False
                                if raw.lstrip()[:1] == b"{":  # (an SSE stream starts with a field)
                                    for out in assembler.feed(await self._document(raw, it, model)):
                                        yielded = True
                                        yield out
                                    done = True
                                    break
                                if pushes:
                                    resp.push = push  # type: ignore[attr-defined]
                            try:
                                events = feed(raw)
                            except ValueError:
                                raise errors.BackendError(_MALFORMED) from None
                        for event, data in events:
                            chunk = ordinary(event, data)
                            if chunk is None:  # [DONE], blank or bad JSON, or an error
                                if data == "[DONE]":
                                    done = True
                                    break
                                try:
                                    chunk = decode(data)
                                except msgspec.DecodeError:
                                    if not data.strip():
                                        continue
                                    if mender is None:
                                        mender = SplitSurrogates()
                                    try:  # a lone surrogate escape (SplitSurrogates), else malformed
                                        chunk = mender.decode(data)
                                    except (ValueError, msgspec.ValidationError):
                                        raise errors.BackendError(_MALFORMED) from None
                                error = chunk.error
                                if error is not None or event == "error":
                                    if error is None:
                                        # an error event whose data is the error object itself,
                                        # with no "error" wrapper: its status and message are there
                                        error = json.loads(data)
                                    raise self._sent_error(error, chunk.status_code, model)
                            fed = assembler.feed(chunk)
                            if pushes:
                                alane = assembler.lane()
                            for out in fed:
                                yielded = True
                                yield out
                        if done:
                            break
                    if done:
                        await resp.release()
                    elif assembler.finish_reason is None:
                        raise errors.BackendError("The model backend closed the stream before finishing.")
                    for out in assembler.end():
                        yielded = True
                        yield out
                finally:
                    if pushes:
                        resp.push = None  # type: ignore[attr-defined]
                    await resp.aclose()
                return
            except errors.HotloopError as exc:
                # Retried only before anything reached the client, and only for transient errors.
                delay = None if yielded or attempt >= self.retries else retry_delay(exc, attempt)
                if delay is None:
                    raise
                attempt += 1
                log.warning(
                    "%s backend: retrying in %.3gs (%s, attempt %d)", self.name, delay, type(exc).__name__, attempt
                )
                await asyncio.sleep(delay)


def _ordinary(event: str, data: str) -> ChatChunk | None:
    """The chunk of an SSE event with nothing special about it: not ``[DONE]``, not an error
    event or error chunk, valid JSON. None for the others, which the stream loop handles (push
    delivery leaves them to it)."""
    if data == "[DONE]" or event == "error":
        return None
    try:
        chunk = chunk_decoder.decode(data)
    except msgspec.DecodeError:
        return None
    return None if chunk.error is not None else chunk


async def _whole_body(first: bytes, it: Any) -> bytes:
    """A body's bytes from ``first`` to its end, at most MAX_SSE_EVENT_BYTES."""
    body = bytearray(first)
    while len(body) <= MAX_SSE_EVENT_BYTES:
        try:
            body += await anext(it)
        except StopAsyncIteration:
            return bytes(body)
    raise errors.BackendError(_MALFORMED)


# OpenAI's error code words that say which status an error object without a number stands for
_CODE_STATUS = {"context_length_exceeded": 400, "rate_limit_exceeded": 429, "insufficient_quota": 429}


def _error_status(error: object) -> int:
    """The HTTP status an error object sent inside a 200 stream stands for: its ``status_code``,
    ``code`` or ``status`` when that is a 4xx/5xx status, as a number (vLLM, OpenRouter) or as a
    string of digits (LiteLLM's proxy: ``"code": "429"``), or an OpenAI code word that names one
    (``context_length_exceeded``: 400, not retried; ``rate_limit_exceeded`` and
    ``insufficient_quota``: 429); 500 otherwise."""
    if isinstance(error, dict):
        code = error.get("code")
        word = _CODE_STATUS.get(code) if isinstance(code, str) else None
        for key in ("status_code", "code", "status"):
            v = error.get(key)
            if isinstance(v, str) and len(v.strip()) == 3 and v.strip().isascii() and v.strip().isdigit():
                v = int(v)
            if isinstance(v, int) and not isinstance(v, bool) and 400 <= v <= 599:
                return v
        if word is not None:
            return word
    return 500


__all__ = ["Body", "ChatBackend", "TransientBackendError", "MAX_SSE_EVENT_BYTES", "MODELS_TTL"]
