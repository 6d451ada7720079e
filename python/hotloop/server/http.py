"""HTTP: the REST routes, ``POST /v1/responses`` as JSON or SSE, and the service endpoints.

Every response carries ``x-request-id`` and ``server-timing`` (``total``, and for
``POST /v1/responses`` ``pre``, the work before the backend call, and ``ttft``, the time to the
backend's first chunk; an SSE stream's headers go out at its first event, so they carry ``pre``
and ``ttft`` but no ``total``). Errors are rendered in the OpenAI shape; anything
unexpected is logged and answered with a generic 500 (no internals reach a client). A client that
goes away while its response is generated cancels the generation.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
import re
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import parse_qs

import msgspec

from hotloop import __version__, errors
from hotloop.pipeline import guard, reuse
from hotloop.pipeline.prepare import prepare
from hotloop.protocol import events as ev
from hotloop.protocol import sealed
from hotloop.protocol.events import Frame
from hotloop.protocol.request import ENCRYPTED_REASONING, decode_body, item_from_dict, item_to_dict, listed_item, validate
from hotloop.server.common import JSON_HEADER, Receive, Scope, Send, encode, request_id
from hotloop.server.httpproto import CORK, ON_DISCONNECT, RECEIVE, RESPOND, SEND_NOW
from hotloop.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hotloop.state.context import item_id_of
from hotloop.state.prefix import Prefix
from hotloop.state.store import UsageRow, page_items
from hotloop.tenants import Tenant

if TYPE_CHECKING:
    from hotloop.server.app import HotloopApp
    from hotloop.server.engine import Run

log = logging.getLogger("hotloop.server")

_PUBLIC = ("/healthz", "/health")  # routes that need no API key
_BOOLS = {"true": True, "1": True, "false": False, "0": False}  # a boolean in a query string

#: How long ``DELETE /v1/responses/{id}`` of a stored response still being generated waits for it
#: to end (then it deletes it); past this, a 409 ``response_in_progress`` to retry (seconds).
IN_FLIGHT_DELETE_WAIT = 10.0

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class HttpTransport:
    """The app's HTTP side (ASGI ``http`` scopes)."""

    def __init__(self, app: "HotloopApp") -> None:
        self.app = app
        # DELETEs running, by response id (one entry per DELETE request in progress: bounded by
        # the requests served at once): a second DELETE of an id waits for the first, then runs
        self._deleting: dict[str, asyncio.Future[None]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        if ON_DISCONNECT not in scope.get("extensions", {}):
            send = _Tracked(send)  # another server: see _create
        rid = request_id()
        started = False
        tenant: Tenant | None = None  # the caller, once authenticated
        timing: list[str] = []  # server-timing entries known before the response (pre, ttft)

        async def respond(
            status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None, content_type: bytes | None = None
        ) -> None:
            nonlocal started
            started = True
            total = f"total;dur={(time.perf_counter() - t0) * 1e3:.3f}"
            hdrs = [
                (b"content-type", content_type) if content_type else JSON_HEADER,
                (b"content-length", b"%d" % len(body)),  # the whole body at once: no chunked framing
                (b"x-request-id", rid.encode()),
                (b"server-timing", ", ".join(timing + [total]).encode()),
            ] + (headers or [])
            if tenant is not None:
                hdrs += self.app.tenancy.headers(tenant)  # the caller's rate limits, if any
            if respond_now is not None and respond_now(status, hdrs, body):
                return  # head and body in one write, no awaits
            if cork is not None:
                cork(True)  # head and body in one write
            try:
                await send({"type": "http.response.start", "status": status, "headers": hdrs})
                await send({"type": "http.response.body", "body": body})
            finally:
                if cork is not None:
                    cork(False)

        extensions = scope.get("extensions", {})
        cork: Callable[[bool], None] | None = extensions.get(CORK)
        respond_now: Callable[[int, list[tuple[bytes, bytes]], bytes], bool] | None = extensions.get(RESPOND)
        try:
            path = scope["path"].rstrip("/")
            # (/metrics is public only where it is served: without metrics it is an unknown route)
            public_metrics = path == "/metrics" and self.app.config.metrics_public and self.app.metrics is not None
            if path not in _PUBLIC and not public_metrics:
                # once per request: who is calling, and may it make one more request
                tenant = await self.app.tenancy.authenticate(scope)
                pending = self.app.tenancy.admit(tenant)
                if pending is not None:  # a limit shared through Redis
                    await pending
            await self._route(scope, receive, send, respond, rid, tenant, timing)
        except _ClientGone:
            # nobody to answer: one line, no traceback (leaving is normal)
            log.info("http client left before its response was complete: %s %s", scope.get("method"), scope.get("path"))
            return
        except errors.HotloopError as exc:
            if self.app.metrics is not None:
                self.app.metrics.error(exc)
            if not started:
                hdrs = [(k.encode(), v.encode()) for k, v in exc.headers.items()]
                if (exc.status == 429 or exc.status >= 500) and "x-should-retry" not in exc.headers:
                    hdrs.append((b"x-should-retry", b"true"))
                await respond(exc.status, ev.http_error_body(exc), hdrs)
        except Exception:
            log.exception("unhandled error on %s %s (request %s)", scope.get("method"), scope.get("path"), rid)
            if self.app.metrics is not None:
                self.app.metrics.error(errors.ServerError())
            if not started:
                await respond(500, ev.http_error_body(errors.ServerError()))

    async def _route(
        self, scope: Scope, receive: Receive, send: Send, respond: Any, rid: str, tenant: Tenant | None,
        timing: list[str],
    ) -> None:
        method = scope["method"]
        path: str = scope["path"].rstrip("/") or "/"
        if path == "/metrics" and self.app.metrics is not None:
            self._method(method, "GET")
            if tenant is not None and not self.app.tenancy.operator(tenant):
                # the whole server's activity (every tenant's tokens and responses, the kinds of
                # secrets they sent, cache hits), which /hotloop/stats keeps from tenants' keys
                # (Tenancy.operator); per-key series hold every key's usage and name besides
                raise errors.PermissionDenied(
                    "Metrics are served to the admin key (--api-key) only, or to anyone with --metrics-public."
                )
            return await respond(200, self.app.metrics.render(), content_type=METRICS_CONTENT_TYPE.encode())
        if path in _PUBLIC:
            body = encode(
                {
                    "status": "ok",
                    "version": __version__,
                    "backend": self.app.backend.name,
                    "active_responses": self.app.engine.active,
                    "uptime_seconds": round(time.time() - self.app.started_at, 3),
                }
            )
            return await respond(200, body)
        assert tenant is not None
        scope_ = tenant.scope  # whose stored responses this caller may see (None: everyone's)
        if path == "/hotloop/stats":
            self._method(method, "GET")
            # in full for operators (the admin key, open mode); counts only for a tenant's key
            return await respond(200, encode(self.app.stats(self.app.tenancy.operator(tenant))))
        if path == "/hotloop/usage":
            self._method(method, "GET")
            since, after, limit = _usage_query(scope)
            # (waits for the writes queued before it; a SQLite store locked out: a 503 within its
            # busy timeout, StoreBusy: hotloop.pipeline.post.Persistence)
            rows = await self.app.persistence.usage(None if tenant.admin else tenant.id, since, after, limit + 1)
            more = len(rows) > limit
            del rows[limit:]
            last = _usage_cursor(rows[-1]) if more else None
            return await respond(200, encode({"object": "list", "data": rows, "has_more": more, "next_after": last}))
        if path == "/v1/responses":
            if method != "POST":
                raise errors.MethodNotAllowed(
                    "Use POST /v1/responses, or GET with a WebSocket upgrade.", headers={"allow": "GET, POST"}
                )
            return await self._create(scope, receive, send, respond, rid, tenant, timing)
        if path == "/v1/models":
            self._method(method, "GET")
            models = await self.app.backend.list_models()
            return await respond(200, encode({"object": "list", "data": models}))
        if path.startswith("/v1/models/"):
            self._method(method, "GET")
            model_id = path[len("/v1/models/") :]
            for m in await self.app.backend.list_models():
                if m["id"] == model_id:
                    return await respond(200, encode(m))
            raise errors.ModelNotFound(f"The model '{errors.clip(model_id)}' does not exist.", param="model")
        if path == "/v1/responses/input_tokens":
            self._method(method, "POST")
            return await self._input_tokens(scope, _receiver(scope, receive), respond, tenant)
        if path == "/v1/responses/compact":
            # OpenAI's standalone compaction answers with an encrypted window of the conversation
            # that only its own models read; a chat backend has no such form. Said plainly, not
            # as a 405 for a response whose id is "compact".
            raise errors.NotFound(
                "Compaction (POST /v1/responses/compact) is not supported by this server. Compact "
                "on the client (Codex does so for a model provider other than its built-in 'openai')."
            )
        if path.startswith("/v1/responses/"):
            rest = path[len("/v1/responses/") :].split("/")
            rid_ = rest[0]
            if len(rest) == 1:
                if method == "GET" or method == "HEAD":
                    return await self._retrieve(rid_, scope, respond, scope_)
                if method == "DELETE":
                    return await self._delete(rid_, respond, scope_)
                raise errors.MethodNotAllowed(
                    "Use GET or DELETE on /v1/responses/{id}.", headers={"allow": "GET, HEAD, DELETE"}
                )
            if len(rest) == 2 and rest[1] == "input_items":
                self._method(method, "GET")
                return await self._input_items(rid_, scope, respond, scope_)
            if len(rest) == 2 and rest[1] == "cancel":
                self._method(method, "POST")
                return await self._cancel(rid_, scope_)
        raise errors.NotFound(f"Unknown route: {errors.clip(method, 20)} {errors.clip(path)}.")

    @staticmethod
    def _method(method: str, allowed: str) -> None:
        """Refuse any other method than ``allowed``; where that is GET, HEAD is GET's answer
        without its body (RFC 9110, 9.3.2: the protocol leaves the body out)."""
        if method != allowed and not (method == "HEAD" and allowed == "GET"):
            raise errors.MethodNotAllowed(
                f"Method {errors.clip(method)} is not allowed here; use {allowed}.",
                headers={"allow": "GET, HEAD" if allowed == "GET" else allowed},
            )

    async def _body(self, receive: Receive, scope: Scope) -> bytes | bytearray:
        """The request body; hotloop's HTTP protocol hands a body it read directly into its own
        buffer over as that ``bytearray`` (not copied again). A body sent compressed
        (``Content-Encoding``: :data:`_CODINGS`) is decoded, and bounded as it decodes."""
        limit = self.app.config.max_body_bytes
        codings = _codings(scope)
        if codings:
            _supported(codings)  # before the body is read
        if _declared_length(scope) > limit:
            # refused before any of it is read (and instead of a 100 Continue): the limit is on
            # the body as sent, coded or not. A client waiting for the 100 gets this instead, and
            # connection: close (httpproto); another's body is read and dropped, as after any
            # early answer on a keep-alive connection.
            raise errors.PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
        chunks: list[bytes | bytearray] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _ClientGone()
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                raise errors.PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
            chunks.append(body)
            if not msg.get("more_body"):
                raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                if not codings:
                    return raw
                try:  # inline up to DECODE_INLINE_BYTES decoded (whatever the size sent: a bomb is small)
                    return _decoded(raw, codings, min(limit, DECODE_INLINE_BYTES))
                except errors.PayloadTooLarge:
                    if limit <= DECODE_INLINE_BYTES:
                        raise
                # larger: again, in a thread of its own (zlib lets go of the GIL while it inflates,
                # so the event loop serves others meanwhile), one body at a time
                return await asyncio.get_running_loop().run_in_executor(_decoder(), _decoded, raw, codings, limit)

    async def _create(
        self, scope: Scope, receive: Receive, send: Send, respond: Any, rid: str, tenant: Tenant, timing: list[str]
    ) -> None:
        mark = time.thread_time()
        t0 = time.perf_counter()
        engine = self.app.engine
        # A full-history input is matched against the owner's cached prefixes by its raw bytes.
        req, prefix, raw = reuse.decode_create(
            await self._body(_receiver(scope, receive), scope), engine.prefixes, tenant.id, engine.tools
        )
        # A client that disconnects (an aborted stream, a timed-out JSON request) cancels the
        # generation, so the backend stops producing tokens nobody will read. hotloop's protocol
        # calls back when the connection is lost; elsewhere another task waits for the client to
        # go away while the response runs.
        extensions = scope.get("extensions", {})
        watch = extensions.get(ON_DISCONNECT)
        send_now = extensions.get(SEND_NOW)
        cork = extensions.get(CORK)
        if watch is not None:
            task = asyncio.current_task()
            assert task is not None
            left = False

            def on_gone() -> None:
                nonlocal left
                left = True
                task.cancel()

            watch(on_gone)
            try:
                return await self._run_create(req, send, respond, rid, mark, tenant, prefix, raw, t0, timing, send_now, cork)
            except asyncio.CancelledError:
                if left and task.uncancel() == 0:  # cancelled for the client alone
                    raise _ClientGone() from None
                raise
            finally:
                watch(None)
        work = asyncio.create_task(self._run_create(req, send, respond, rid, mark, tenant, prefix, raw, t0, timing, send_now, cork))
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping
            work.cancel()
            gone.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)
            raise
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        if not work.done() and not getattr(send, "complete", False):  # the client went away first
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise _ClientGone()
        await work  # its result, or the error to answer with

    async def _run_create(
        self, req: Any, send: Send, respond: Any, rid: str, mark: float, tenant: Tenant,
        prefix: Prefix | None = None, raw: reuse.RawInput | None = None, t0: float = 0.0,
        timing: list[str] | None = None, send_now: Callable[[bytes], bool] | None = None,
        cork: Callable[[bool], None] | None = None,
    ) -> None:
        timing = [] if timing is None else timing
        if not req.stream:
            run = await self.app.engine.start(
                req, transport="json", tenant=tenant, prefix=prefix, raw_input=raw, request_id=rid, received=t0
            )
            timing += _timing(run, t0)
            answered = False
            persistence = self.app.persistence
            async with contextlib.aclosing(run.frames()) as frames:
                run.emit = _discard  # chunks are taken from the backend's reads (quiet: no frames)
                async for _ in frames:
                    if run.turn.done and run.turn.response["status"] != "failed" and persistence.has_room():
                        # Answered as soon as the response is final, before its bookkeeping
                        # (caching, the store's queue, metrics), which the loop's next step runs
                        # without a suspension in between: a client that names it at once, on
                        # any connection, finds it cached. Not while the store's writer is
                        # behind: then the answer waits for the submission (Persistence.has_room).
                        answered = True
                        # its reservation corrected first: the answer's x-ratelimit-* headers say
                        # what is left now (they counted its whole reservation, max_output_tokens'
                        # worth, so a client pacing itself by them waited for nothing)
                        run.release()
                        await respond(200, encode(run.turn.response), _truncated(run.plan.truncated))
            response = run.turn.response
            self.app.engine.record(run, mark)
            if answered:
                return
            if response["status"] == "failed":
                exc = run.turn.error
                if exc is None or isinstance(exc, (errors.BackendError, errors.ModelError)):
                    # the backend or the model failed it: a bad gateway
                    err = response.get("error") or {}
                    exc = errors.BackendError(str(err.get("message") or "The response failed."), code=err.get("code"))
                # else the server stopped it (a shutdown abort: 503) or could not store it (500)
                exc.counted = True  # Metrics.turn (engine.record above) counted its failure
                raise exc
            return await respond(200, encode(response), _truncated(run.plan.truncated))
        run = await self.app.engine.start(
            req, transport="sse", tenant=tenant, prefix=prefix, raw_input=raw, request_id=rid, received=t0
        )
        # The head goes out with the first events (one write), and the stream's end with its
        # terminal event (the batch that holds it is sent as the body's last piece).
        corked = cork
        if corked is not None:
            corked(True)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": _SSE_HEADERS + [(b"x-request-id", rid.encode())]
                    + [(b"server-timing", ", ".join(_timing(run, t0)).encode())] + self.app.tenancy.headers(tenant)
                    + _truncated(run.plan.truncated),
                }
            )
        except BaseException:
            if corked is not None:
                corked(False)
            raise
        sse = ev.sse
        conns = self.app.open_connections
        conns["http"] -= 1  # while it streams, the connection counts as an SSE stream
        conns["sse"] += 1
        within = self.app.config.flush_interval_ms / 1000  # --flush-interval-ms
        held: _Held | None = None
        emit: Callable[[list[Frame]], None] | None = None
        if send_now is not None and within:
            emit = held = _Held(run, send_now, within)
        elif send_now is not None:
            emit = _emitter(run, send_now)
        ended = False
        try:
            async with contextlib.aclosing(run.frames()) as frames:
                if held is not None:
                    run.emit_deltas = held.deltas
                run.emit = emit
                async for batch in frames:
                    body = b"".join([sse(f) for f in batch])
                    if held is not None:  # what push delivery holds goes first
                        body = held.release() + body
                    # The terminal event's batch is the body's last piece, unless the store's
                    # writer is behind: then the stream ends after the response's submission, so
                    # that the client's next request waits for it (Persistence.has_room).
                    last = run.turn.done and self.app.persistence.has_room()
                    await send({"type": "http.response.body", "body": body, "more_body": not last})
                    ended = last
                    if corked is not None:
                        corked(False)
                        corked = None
                    run.emit = emit
        except (_ClientGone, asyncio.CancelledError):
            raise
        except Exception as exc:
            # The head has gone out: no other answer can be sent (a second head would be the
            # server's own error). The stream ends here, with the turn's error event and
            # response.failed where the turn can still make them; the failure is logged, once.
            if isinstance(exc, errors.HotloopError):
                log.warning("SSE stream of request %s ended early: %s", rid, type(exc).__name__)
            else:
                log.exception("SSE stream of request %s ended early", rid)
            if self.app.metrics is not None:
                self.app.metrics.error(exc if isinstance(exc, errors.HotloopError) else errors.ServerError())
            failed = b""
            with contextlib.suppress(Exception):  # (the turn's own state may be what failed)
                if not run.turn.done:
                    failed = b"".join([sse(f) for f in run.turn.fail(errors.ServerError())])
            if failed and not ended:
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": failed, "more_body": False})
                    ended = True
            return
        finally:
            run.emit = None  # no cycle through the closures
            run.emit_deltas = None
            if held is not None:
                held.release()  # nothing is written after the stream's end
            conns["sse"] -= 1
            conns["http"] += 1
            if corked is not None:
                corked(False)
            if not ended:
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.app.engine.record(run, mark)

    # The endpoints on a stored response take the caller's scope (an owner id, or None for the
    # admin key): another tenant's response answers exactly like one that does not exist.

    async def _retrieve(self, response_id: str, asgi: Scope, respond: Any, scope: str | None) -> None:
        query = parse_qs(asgi.get("query_string", b"").decode())
        stream = query.get("stream", ["false"])[0].lower()
        # include[] (openai-python and -node write the brackets), as create reads it: values
        # unknown here are ignored; one has an effect (_with_encrypted_reasoning)
        include = query.get("include[]", []) + query.get("include", [])
        if stream not in _BOOLS:
            raise errors.InvalidValue(
                f"Invalid 'stream': '{errors.clip(stream)}'. Expected 'true' or 'false'.", param="stream"
            )
        hit = self.app.engine.responses.get(response_id, scope)
        response = hit.response if hit is not None else None
        if response is None:
            # A stored response still being generated (streamed over SSE or WebSocket, or a JSON
            # request not answered yet) is the Response as it is so far, as OpenAI answers:
            # ``status: "in_progress"``, ``usage: null``, the output items begun (those finished
            # in their final form, the open one as its ``response.output_item.added`` showed it).
            # Before, it was a 404 until its end, for a response the client had seen created.
            # ``store: false`` and another tenant's stay a 404 (Engine.in_flight).
            run = self.app.engine.in_flight(response_id, scope)
            if run is not None:
                response = run.turn.response
        if response is None:
            response = await self.app.persistence.get_response(response_id, scope)
        if response is None:
            raise errors.NotFound(f"Response with id '{errors.clip(response_id)}' not found.")
        if _BOOLS[stream]:
            # ``stream=true`` (and ``starting_after``) replays the events of a *background*
            # response, which this server does not offer. Answered with the JSON object, the
            # SDKs' stream (openai-python, openai-node) parsed no SSE event from it and ended at
            # once without an error. A 400 naming ``stream`` says why (OpenAI too answers a 400
            # for a response it cannot stream); an unknown id is still a 404 first.
            raise errors.InvalidValue(
                "Only responses created with the 'background' parameter set to true can be streamed; "
                "this server does not offer background responses. Omit 'stream' to retrieve the response.",
                param="stream",
            )
        if ENCRYPTED_REASONING in include:
            response = _with_encrypted_reasoning(response)
        await respond(200, encode(response))

    async def _finished(self, run: "Run") -> None:
        """Wait for a response in flight to leave the engine's runs (by then ``Engine.complete``
        has cached it and handed it to the store, or it was cut short), at most
        ``IN_FLIGHT_DELETE_WAIT``; still running then: a 409 to retry, nothing deleted."""
        if run not in self.app.engine.runs:
            return
        if run.left is None:
            run.left = asyncio.get_running_loop().create_future()
        try:
            # shielded: a DELETE that gives up (or whose client leaves) does not cancel the
            # future other DELETEs of the same response wait on
            await asyncio.wait_for(asyncio.shield(run.left), IN_FLIGHT_DELETE_WAIT)
        except TimeoutError:
            raise _InProgress(
                f"Response with id '{errors.clip(str(run.turn.response.get('id')))}' is still being generated; "
                "it can be deleted once it has finished. Please retry shortly.",
                headers={"retry-after": "1"},
            ) from None

    async def _delete(self, response_id: str, respond: Any, scope: str | None) -> None:
        # Two DELETEs of one response at once: the second waits for the first (which deletes it,
        # and answers 200), then finds nothing (404). Both ran at once, and both answered 200: the
        # second saw the response cached before the first's delete took it out.
        while (running := self._deleting.get(response_id)) is not None:
            await asyncio.wait([running])
        done = self._deleting[response_id] = asyncio.get_running_loop().create_future()
        try:
            await self._delete_one(response_id, respond, scope)
        finally:
            del self._deleting[response_id]
            done.set_result(None)

    async def _delete_one(self, response_id: str, respond: Any, scope: str | None) -> None:
        # A stored response still being generated (GET shows it in_progress) is deleted once it
        # has ended: deleting it now would be undone by its end, which caches and stores it
        # (before, such a DELETE was a 404, and the response was stored after all). Its stream
        # is not cut short (its client may be another process); the DELETE waits for it, within
        # a bound (_finished). One that ends without being stored (its client left) is a 404.
        run = self.app.engine.in_flight(response_id, scope)
        if run is not None:
            await self._finished(run)
        # a response the store already pruned may still be cached here: it answered GET, so it
        # is deleted too (evicted), not a 404
        cached = self.app.engine.responses.get(response_id, scope) is not None
        # The persistence waits for the writes queued before the DELETE, then deletes. On a SQLite
        # store the two share one bound, the busy timeout: locked out of the file by another
        # connection (its writer retrying a batch for up to 60 s, or the delete itself), a 503
        # (StoreBusy, retry-after) with nothing deleted, the queued writes still queued
        # (hotloop.pipeline.post.Persistence). With --workers the record the other workers read
        # is written in the delete's own transaction (hotloop.pipeline.shared).
        if not await self.app.persistence.delete(response_id, scope) and not cached:
            raise errors.NotFound(f"Response with id '{errors.clip(response_id)}' not found.")
        self.app.engine.deleted(response_id)
        await respond(200, encode({"id": response_id, "object": "response", "deleted": True}))

    async def _cancel(self, response_id: str, scope: str | None) -> None:
        # (one still being generated is known too: GET shows it; it is not background either)
        known = (
            self.app.engine.responses.get(response_id, scope) is not None
            or self.app.engine.in_flight(response_id, scope) is not None
            or await self.app.persistence.get_response(response_id, scope) is not None
        )
        if not known:
            raise errors.NotFound(f"Response with id '{errors.clip(response_id)}' not found.")
        raise errors.InvalidRequest(
            "Only responses created with the 'background' parameter set to true can be cancelled."
        )

    async def _input_items(self, response_id: str, scope: Scope, respond: Any, owner: str | None) -> None:
        # a blank value is no value (``after=&limit=``: a client writing its unset parameters);
        # no item has the id "" (refused since: empty_string), which paged back to the start
        q = parse_qs(scope.get("query_string", b"").decode())
        after = q.get("after", [None])[0]
        # ``before`` (a parameter of input_items.list in earlier openai-python/openai-node
        # versions, and in clients generated from that spec): the page just before that item;
        # it used to be ignored, so such a client got the first page whatever its cursor
        before = q.get("before", [None])[0]
        order = q.get("order", ["desc"])[0]
        if order not in ("asc", "desc"):
            raise errors.InvalidValue(f"Invalid 'order': '{errors.clip(order)}'. Expected 'asc' or 'desc'.", param="order")
        try:
            limit = int(q.get("limit", ["20"])[0])
        except ValueError:
            raise errors.InvalidType("Invalid 'limit': expected an integer.", param="limit") from None
        if not 1 <= limit <= 100:
            raise errors.InvalidValue("Invalid 'limit': it must be between 1 and 100.", param="limit")
        hit = self.app.engine.responses.get(response_id, owner)
        # a stored response still being generated lists the input it will list once done (_retrieve)
        live = _live_input(self.app.engine.in_flight(response_id, owner)) if hit is None else None
        if before is not None:
            # every item (the persistence pages without ``before``), then the page from them
            if hit is not None:
                every: Any = ([item_to_dict(i) for i in hit.input_items], False)
            elif live is not None:
                every = (live, False)
            else:
                every = await self.app.persistence.input_items(response_id, None, sys.maxsize, "asc", owner)
            if every is None or every is False:
                raise errors.NotFound(f"Response with id '{errors.clip(response_id)}' not found.")
            if before not in {it.get("id") for it in every[0]}:
                raise errors.InvalidValue(f"Invalid 'before': no item with id '{errors.clip(before)}'.", param="before")
            page = page_items(every[0], after, limit, order, before)  # None: after names no item
            result: Any = False if page is None else page
        elif hit is not None or live is not None:
            every_ = [item_to_dict(i) for i in hit.input_items] if hit is not None else live
            assert every_ is not None
            page = page_items(every_, after, limit, order)
            result = False if page is None else page
        else:
            result = await self.app.persistence.input_items(response_id, after, limit, order, owner)
        if result is None:
            raise errors.NotFound(f"Response with id '{errors.clip(response_id)}' not found.")
        if result is False:
            raise errors.InvalidValue(f"Invalid 'after': no item with id '{errors.clip(str(after))}'.", param="after")
        data, has_more = result
        data = [listed_item(d) for d in data]
        body = {
            "object": "list",
            "data": data,
            "first_id": data[0].get("id") if data else None,
            "last_id": data[-1].get("id") if data else None,
            "has_more": has_more,
        }
        await respond(200, encode(body))

    async def _input_tokens(self, asgi: Scope, receive: Receive, respond: Any, tenant: Tenant) -> None:
        scope = tenant.scope
        req = decode_body(await self._body(receive, asgi))
        parent = None
        if req.model is None:
            # ``model`` is optional here (OpenAI's reference, openai-python's
            # InputTokenCountParams, openai-node's), unlike in POST /v1/responses: the count is
            # that of the previous response's model, else of the backend's default model,
            # instead of a 400 the SDKs' callers cannot expect.
            parent = await self.app.engine.resolve(req.previous_response_id, None, scope)
            model = parent.response.get("model") if parent is not None else None
            req.model = model if isinstance(model, str) and model else self.app.backend.default_model
        p = validate(req, counting=True)
        # the per-turn bound of POST /v1/responses (README, Bounds): an input that request refuses
        # is not counted either (a 30 MB one took the tokenizer thread about 10 s)
        cfg = self.app.config
        new = guard.turn_items(p.items, req.previous_response_id is not None, type(req.input) is list)
        guard.check(new, cfg.max_turn_input_items, cfg.max_turn_input_bytes)
        if parent is None:
            parent = await self.app.engine.resolve(req.previous_response_id, None, scope)
        stored = await self.app.engine.stored_items(p, parent, scope)
        plan = prepare(p, parent, self.app.engine.ids, self.app.engine.tokens.view(tenant.id), defer=True, stored=stored)
        if req.truncation == "auto":
            # what the response would be given: its input after truncation (with "disabled" an
            # input over the window is still counted, whole: the count is how a client finds out)
            await self.app.engine.fit_window(plan, req, tenant)
        n = await self.app.engine.count_input(plan)
        await respond(200, encode({"object": ev.INPUT_TOKENS_OBJECT, "input_tokens": n}))


class _ClientGone(Exception):
    """The HTTP client disconnected; there is nobody to answer."""


class _InProgress(errors.HotloopError):
    """``DELETE`` of a stored response still being generated past ``IN_FLIGHT_DELETE_WAIT``:
    nothing deleted; retry once it has finished (openai-python retries a 409 by itself)."""

    status = 409
    type = "invalid_request_error"
    code = "response_in_progress"


def _live_input(run: "Run | None") -> list[dict[str, Any]] | None:
    """The effective input of a response in flight, as ``input_items`` lists it. Its plan's
    items are its input until the response is finished (``finished()`` then appends its output
    to the same list: those items, named by the output's ids, are left out)."""
    if run is None:
        return None
    items = run.plan.items
    out_ids = {o.get("id") for o in run.turn.response.get("output") or ()}
    n = len(items)
    while n and out_ids and item_id_of(items[n - 1]) in out_ids:
        n -= 1
    return [item_to_dict(i) for i in items[:n]]


class _Tracked:
    """``send`` under a server without hotloop's protocol (no ``ON_DISCONNECT``): notes when the
    response is complete. From then on ``receive()`` reports ``http.disconnect`` (ASGI), which
    is no client leaving: the request's task still finishes the response's bookkeeping after
    its answer (caching, the store, closing the backend stream) and must not be cancelled."""

    __slots__ = ("send", "complete")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.complete = False

    async def __call__(self, message: dict[str, Any]) -> None:
        await self.send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True


def _emitter(run: Any, send_now: Callable[[bytes], bool]) -> Callable[[list[Frame]], None]:
    """Push delivery for an SSE stream (Run.emit): the events of one backend read's deltas,
    written from its read callback; pushing stops while the client is slow or gone, and the
    streaming loop (whose ``send`` waits for the client) starts it again."""
    sse = ev.sse

    def emit(batch: list[Frame]) -> None:
        if not send_now(b"".join([sse(f) for f in batch])):
            run.emit = None

    return emit


class _Held:
    """Push delivery for an SSE stream with ``--flush-interval-ms``: like :func:`_emitter`, but
    the deltas of a read that comes less than half of ``within`` seconds after the last such
    write are held, and written by the first read after that or at most ``within`` after that
    write (one write for several reads); a batch with any other event (an item's start or end)
    is written at once, after what is held. The streaming
    loop puts what is held before its own next write (:meth:`take`), so the order never changes;
    at most one interval's events are held."""

    __slots__ = ("run", "send_now", "within", "loop", "parts", "timer", "since")

    def __init__(self, run: Any, send_now: Callable[[bytes], bool], within: float) -> None:
        self.run = run
        self.send_now = send_now
        self.within = within
        self.loop = asyncio.get_running_loop()
        self.parts: list[bytes] = []
        self.timer: asyncio.TimerHandle | None = None
        self.since = 0.0  # the loop time of the last write made here

    def __call__(self, batch: list[Frame]) -> None:
        if not ev.only_deltas(batch):  # an item's start or end goes out at once, after what is held
            sse = ev.sse
            self.parts.append(b"".join([sse(f) for f in batch]))
            self._send(self.release())
            return
        self.deltas(batch)

    def deltas(self, batch: list[Frame]) -> None:
        """A batch of deltas alone (the open item's lane: Run.emit_deltas)."""
        sse = ev.sse
        self.parts.append(b"".join([sse(f) for f in batch]))
        t = self.loop.time()
        if t - self.since >= self.within * 0.5:  # as CorkedWebSocketProtocol.send_texts
            self.since = t
            self._send(self.take())
        elif self.timer is None:
            self.timer = self.loop.call_at(self.since + self.within, self._write)

    def _write(self) -> None:
        self.timer = None
        if self.parts:  # else taken since (the timer is not cancelled by a write: see take)
            self.since = self.loop.time()
            self._send(self.take())

    def _send(self, data: bytes) -> None:
        if not self.send_now(data):
            self.run.emit = None  # the client is slow or gone: the streaming loop takes over

    def take(self) -> bytes:
        """What is held. A pending timed write stays: it finds nothing, or what was held since
        (and writes that, early); cancelling and creating a timer on every held write cost more
        than the write's events."""
        data = b"".join(self.parts)
        self.parts.clear()
        return data

    def release(self) -> bytes:
        """What is held, for a write that is never held (an item's start or end, the stream's
        terminal event, the stream's end): the pending timed write, if any, is cancelled, since
        it would find nothing and wake an idle loop for nothing, once a response at least.
        Rare writes, unlike the held ones :meth:`take` leaves the timer for."""
        timer = self.timer
        if timer is not None:
            self.timer = None
            timer.cancel()
        return self.take()


def _discard(batch: list[Frame]) -> None:
    """``Run.emit`` of a JSON answer: its turn is quiet, nobody reads its frames."""


async def _disconnected(receive: Receive) -> None:
    """Return once the HTTP client has gone away (the request body was already read)."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


# Content codings a request body may be sent in (RFC 9110, 8.4.1), with zlib's window bits for
# each; another is refused with 415 and an accept-encoding header naming these. Decoded, a body
# is bounded by max_body_bytes as sent (413 past it, found as it inflates: a small body that
# inflates to gigabytes stops there). A body is decoded on the event loop while it decodes to
# DECODE_INLINE_BYTES at most (about 1 ms); a larger one is decoded again, whole, in a thread
# of its own (_decoder: one body at a time, so a few hundred bytes sent again and again cost
# that thread's time, never the event loop's).
_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_ACCEPTED = "gzip, deflate"
DECODE_INLINE_BYTES = 1024 * 1024
MAX_CODINGS = 2
_DECODER: list[ThreadPoolExecutor] = []


def _decoder() -> ThreadPoolExecutor:
    if not _DECODER:
        _DECODER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotloop-decode"))
    return _DECODER[0]


def _with_encrypted_reasoning(response: dict[str, Any]) -> dict[str, Any]:
    """``response`` with each reasoning item of its output carrying ``encrypted_content``, as a
    response created with ``include: ["reasoning.encrypted_content"]`` has it: the token
    (:func:`sealed.seal`) of the item's reasoning text (:func:`sealed.reasoning_text`, what a
    backend is sent for it). The stored response is not changed."""
    output = response.get("output")
    if not isinstance(output, list) or not any(
        isinstance(it, dict) and it.get("type") == "reasoning" and "encrypted_content" not in it for it in output
    ):
        return response
    items = []
    for it in output:
        if isinstance(it, dict) and it.get("type") == "reasoning" and "encrypted_content" not in it:
            text = sealed.reasoning_text(item_from_dict(it))  # type: ignore[arg-type]
            head = {k: it[k] for k in ("id", "type") if k in it}
            it = {**head, "encrypted_content": sealed.seal(text), **it}  # (OpenAI's order)
        items.append(it)
    return {**response, "output": items}


def _declared_length(scope: Scope) -> int:
    """The request's ``Content-Length`` (0 when it has none: chunked, or no body). The parser has
    refused a malformed or conflicting one before the request got here."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


def _codings(scope: Scope) -> list[str]:
    """The request's content codings, in the order they were applied (``identity`` left out).
    A transfer coding other than chunked (which the protocol undoes) is refused: the parser
    reads such a body as plain chunked bytes (RFC 9112, 6.1: 501)."""
    out: list[str] = []
    for name, value in scope["headers"]:
        if name == b"content-encoding":
            out += [c.strip().lower() for c in value.decode("latin-1").split(",")]
        elif name == b"transfer-encoding":
            for c in value.decode("latin-1").split(","):
                c = c.strip().lower()
                if c and c != "chunked":
                    raise errors.UnsupportedTransferCoding(
                        f"Unsupported Transfer-Encoding {errors.clip(c, 40)!r}: send the body chunked, "
                        f"or with Content-Encoding {_ACCEPTED}."
                    )
    return [c for c in out if c and c != "identity"]


def _supported(codings: list[str]) -> None:
    if len(codings) > MAX_CODINGS:  # each one inflates up to the limit: a body in layers of them
        raise errors.UnsupportedEncoding(
            f"The request body has {len(codings)} content codings; the server decodes at most {MAX_CODINGS}.",
            headers={"accept-encoding": _ACCEPTED},
        )
    for coding in codings:
        if coding not in _CODINGS:
            raise errors.UnsupportedEncoding(
                f"Unsupported Content-Encoding {errors.clip(coding, 40)!r}: send the body uncompressed, or in "
                f"{_ACCEPTED}.",
                headers={"accept-encoding": _ACCEPTED},
            )


def _decoded(body: bytes | bytearray, codings: list[str], limit: int) -> bytes:
    """``body`` with its content codings undone, last applied first; at most ``limit`` bytes."""
    data = body
    for coding in reversed(codings):
        data = _inflate(data, coding, limit)
    return data  # type: ignore[return-value]  # (bytes: codings is never empty here)


def _inflate(data: bytes | bytearray, coding: str, limit: int) -> bytes:
    """One coding undone: gzip (every member of it), or deflate (its zlib format, or the raw
    deflate some clients send under that name)."""
    wbits = _CODINGS[coding]
    out: list[bytes] = []
    size = 0
    while True:
        d = zlib.decompressobj(wbits)
        try:
            piece = d.decompress(data, limit + 1 - size)
        except zlib.error:
            if coding == "deflate" and wbits > 0:
                wbits = -zlib.MAX_WBITS
                continue
            raise errors.UndecodableBody(f"The request body is not valid {coding} data.") from None
        size += len(piece)
        out.append(piece)
        if size > limit or d.unconsumed_tail:
            raise errors.PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes once decoded.")
        if not d.eof:
            raise errors.UndecodableBody(f"The request body's {coding} data ends before its end.")
        data = d.unused_data
        if not data:
            return b"".join(out)
        if wbits != _CODINGS["gzip"]:  # (gzip members may follow one another; nothing else may)
            raise errors.UndecodableBody(f"The request body has bytes after its {coding} data.")


def _receiver(scope: Scope, receive: Receive) -> Receive:
    """What reads the request's body: hotloop's protocol's ``receive``, which hands over a body
    it read into its own buffer without copying it (:data:`RECEIVE`), or the server's."""
    fn: Receive | None = scope.get("extensions", {}).get(RECEIVE)
    return receive if fn is None else fn


def _timing(run: Any, t0: float) -> list[str]:
    """``server-timing`` entries known once the backend's first chunk is in: ``pre`` (the request
    read, validated, resolved, classified and prepared) and ``ttft``, in milliseconds."""
    m = run.marks
    return [f"pre;dur={(m[4] - t0) * 1e3:.3f}", f"ttft;dur={(m[5] - t0) * 1e3:.3f}"]


def _truncated(dropped: int) -> list[tuple[bytes, bytes]]:
    """``x-hotloop-truncated-items``: the input items ``truncation: "auto"`` dropped (when any)."""
    return [(b"x-hotloop-truncated-items", str(dropped).encode())] if dropped else []


_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


#: ``GET /hotloop/usage``: rows per page unless ``?limit=`` says otherwise, and the most it may ask.
USAGE_PAGE = 1_000
USAGE_PAGE_MAX = 10_000


def _usage_query(scope: Scope) -> tuple[str | None, UsageRow | None, int]:
    """``GET /hotloop/usage?since=YYYY-MM-DD&after=CURSOR&limit=N``: the first UTC day of the rows
    listed (None: all), the row after which the page starts (``next_after`` of the page before),
    and the page's size."""
    q = parse_qs(scope.get("query_string", b"").decode(), keep_blank_values=True)
    since = _usage_since(q.get("since"))
    after = None
    if values := q.get("after"):
        after = _usage_after(values[0])
    limit = USAGE_PAGE
    if values := q.get("limit"):
        try:
            limit = int(values[0])
        except ValueError:
            raise errors.InvalidType("Invalid 'limit': expected an integer.", param="limit") from None
        if not 1 <= limit <= USAGE_PAGE_MAX:
            raise errors.InvalidValue(f"Invalid 'limit': it must be between 1 and {USAGE_PAGE_MAX}.", param="limit")
    return since, after, limit


_CURSOR_BY_ID = 1  # a cursor's last element: it names a row by key id (earlier ones named a key name)


def _usage_cursor(row: dict[str, Any]) -> str:
    """The opaque ``after`` value that continues a listing after ``row``."""
    raw = msgspec.json.encode([row["day"], row["model"], row["key_id"], _CURSOR_BY_ID])
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _usage_after(cursor: str) -> UsageRow:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        day, model, key_id, kind = msgspec.json.decode(raw, type=tuple[str, str, str, int])
        if kind != _CURSOR_BY_ID:  # (a cursor of three, from before rows were kept per key id, names a key name)
            raise ValueError
        row = (day, model, key_id)
    except (ValueError, msgspec.DecodeError):
        raise errors.InvalidValue(
            "Invalid 'after': pass the 'next_after' of the page before, unchanged.", param="after"
        ) from None
    return row


def _usage_since(values: list[str] | None) -> str | None:
    """``since``: the first UTC day of the rows listed (None: all)."""
    if not values:
        return None
    day = values[0]
    try:
        if _DAY.fullmatch(day) is None:
            raise ValueError
        datetime.date.fromisoformat(day)
    except ValueError:
        raise errors.InvalidValue(
            f"Invalid 'since': '{errors.clip(day)}'. Expected a UTC day, YYYY-MM-DD.", param="since"
        ) from None
    return day
