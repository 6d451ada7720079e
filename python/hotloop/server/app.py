"""The ASGI application: HTTP routes, SSE streaming and WebSocket mode on ``/v1/responses``.

No protocol decisions are made here: requests are decoded by :mod:`hotloop.protocol.request`,
events come from :mod:`hotloop.protocol.turn` via the :class:`~hotloop.server.engine.Engine`, and
WebSocket frames go through the sans-I/O :class:`~hotloop.protocol.session.Session`.

Every HTTP response carries ``x-request-id``. Errors are rendered in the OpenAI shape; anything
unexpected is logged and answered with a generic 500 (no internals reach a client).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections import deque
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs

import msgspec
from uvicorn.protocols.utils import ClientDisconnected

from hotloop import __version__, errors, tokenizer
from hotloop.backends.base import Backend
from hotloop.config import Config
from hotloop.pipeline.post import Persistence
from hotloop.pipeline.prepare import prepare
from hotloop.protocol import events as ev
from hotloop.protocol.events import Frame
from hotloop.protocol.request import decode_body, item_to_dict, validate
from hotloop.protocol.session import Close, RunCreate, SendError, Session
from hotloop.server.engine import Engine, Run
from hotloop.server.wsproto import SEND_TEXTS, WAIT_WRITABLE
from hotloop.state.context import ConnectionCache

log = logging.getLogger("hotloop.server")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_encode = msgspec.json.Encoder().encode


def _request_id() -> str:
    return "req_" + secrets.token_hex(16)


class HotloopApp:
    """ASGI 3 application. Create with a config, a backend and a persistence layer."""

    def __init__(self, config: Config, backend: Backend, persistence: Persistence) -> None:
        self.config = config
        self.backend = backend
        self.persistence = persistence
        self.engine = Engine(config, backend, persistence)
        self.started_at = time.time()
        self._api_key = config.api_key.encode() if config.api_key else None
        self.ws_deadlines = _Deadlines(config.ws_connection_max_age)

    # -- ASGI entry ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except (RuntimeError, ValueError, OSError) as exc:
                    # configuration problems (a missing API key, a bad URL): say what, no traceback
                    log.error("start-up failed: %s", exc)
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                except Exception:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": "start-up failed (see log)"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, tokenizer.preload)
        await self.backend.start()
        self.persistence.start()

    async def shutdown(self) -> None:
        self.engine.close()
        await self.backend.close()
        await self.persistence.close()

    def stats(self) -> dict[str, Any]:
        """Server-side counters and the per-response CPU ring (see ``Engine.turn_stats``)."""
        eng = self.engine
        return {
            "active_responses": eng.active,
            "completed_responses": eng.completed,
            "token_cache": {"entries": len(eng.tokens), "hits": eng.tokens.hits, "misses": eng.tokens.misses},
            "response_cache": {
                "entries": len(eng.responses), "items": eng.responses.items, "bytes": eng.responses.nbytes,
                "max_bytes": eng.responses.max_bytes,
            },
            "store": {"pending": len(self.persistence.pending), "written": self.persistence.written, "failed": self.persistence.failed},
            "turns": [
                {"transport": t, "cpu_us": round(c, 1), "pre_us": round(p, 1), "events": e, "context_items": n}
                for t, c, p, e, n in eng.turn_stats
            ],
        }

    # -- auth ----------------------------------------------------------------------------------

    def _check_auth(self, scope: Scope) -> None:
        if self._api_key is None:
            return
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._api_key):
                    return
                break
        raise errors.AuthenticationFailed("Incorrect API key provided.")

    # -- HTTP ----------------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = _request_id()
        started = False

        async def respond(status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
            nonlocal started
            started = True
            hdrs = [_JSON, (b"x-request-id", rid.encode())] + (headers or [])
            await send({"type": "http.response.start", "status": status, "headers": hdrs})
            await send({"type": "http.response.body", "body": body})

        try:
            await self._route(scope, receive, send, respond, rid)
        except _ClientGone:
            return  # nobody to answer
        except errors.HotloopError as exc:
            if not started:
                hdrs = [(k.encode(), v.encode()) for k, v in exc.headers.items()]
                if exc.status == 429 or exc.status >= 500:
                    hdrs.append((b"x-should-retry", b"true"))
                await respond(exc.status, ev.http_error_body(exc), hdrs)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await respond(500, ev.http_error_body(errors.ServerError()))

    async def _route(self, scope: Scope, receive: Receive, send: Send, respond: Any, rid: str) -> None:
        method = scope["method"]
        path: str = scope["path"].rstrip("/") or "/"
        if path in ("/healthz", "/health"):
            body = _encode(
                {
                    "status": "ok",
                    "version": __version__,
                    "backend": self.backend.name,
                    "active_responses": self.engine.active,
                    "uptime_seconds": round(time.time() - self.started_at, 3),
                }
            )
            return await respond(200, body)
        self._check_auth(scope)
        if path == "/hotloop/stats":
            self._method(method, "GET")
            return await respond(200, _encode(self.stats()))
        if path == "/hotloop/usage":
            self._method(method, "GET")
            return await respond(200, _encode({"object": "list", "data": await self.persistence.usage()}))
        if path == "/v1/responses":
            if method != "POST":
                raise errors.MethodNotAllowed("Use POST /v1/responses, or GET with a WebSocket upgrade.")
            return await self._create(scope, receive, send, respond, rid)
        if path == "/v1/models":
            self._method(method, "GET")
            models = await self.backend.list_models()
            return await respond(200, _encode({"object": "list", "data": models}))
        if path.startswith("/v1/models/"):
            self._method(method, "GET")
            model_id = path[len("/v1/models/") :]
            for m in await self.backend.list_models():
                if m["id"] == model_id:
                    return await respond(200, _encode(m))
            raise errors.ModelNotFound(f"The model '{model_id}' does not exist.", param="model")
        if path == "/v1/responses/input_tokens":
            self._method(method, "POST")
            return await self._input_tokens(receive, respond)
        if path.startswith("/v1/responses/"):
            rest = path[len("/v1/responses/") :].split("/")
            rid_ = rest[0]
            if len(rest) == 1:
                if method == "GET":
                    return await self._retrieve(rid_, respond)
                if method == "DELETE":
                    return await self._delete(rid_, respond)
                raise errors.MethodNotAllowed("Use GET or DELETE on /v1/responses/{id}.")
            if len(rest) == 2 and rest[1] == "input_items":
                self._method(method, "GET")
                return await self._input_items(rid_, scope, respond)
            if len(rest) == 2 and rest[1] == "cancel":
                self._method(method, "POST")
                return await self._cancel(rid_)
        raise errors.NotFound(f"Unknown route: {method} {path}.")

    @staticmethod
    def _method(method: str, allowed: str) -> None:
        if method != allowed:
            raise errors.MethodNotAllowed(f"Method {method} is not allowed here; use {allowed}.")

    async def _body(self, receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        chunks: list[bytes] = []
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
                return b"".join(chunks)

    async def _create(self, scope: Scope, receive: Receive, send: Send, respond: Any, rid: str) -> None:
        mark = time.thread_time()
        req = decode_body(await self._body(receive))
        # The response runs while another task waits for the client to go away: a client that
        # disconnects (an aborted stream, a timed-out JSON request) cancels the generation, so
        # the backend stops producing tokens nobody will read.
        work = asyncio.create_task(self._run_create(req, send, respond, rid, mark))
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
        if not work.done():  # the client went away first
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise _ClientGone()
        await work  # its result, or the error to answer with

    async def _run_create(self, req: Any, send: Send, respond: Any, rid: str, mark: float) -> None:
        if not req.stream:
            run = await self.engine.start(req, transport="json")
            response = await run.drain()
            self.engine.record(run, mark)
            if response["status"] == "failed":
                err = response.get("error") or {}
                exc = errors.BackendError(str(err.get("message") or "The response failed."), code=err.get("code"))
                raise exc
            return await respond(200, _encode(response))
        run = await self.engine.start(req, transport="sse")
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": _SSE_HEADERS + [(b"x-request-id", rid.encode())],
            }
        )
        sse = ev.sse
        try:
            async with contextlib.aclosing(run.frames()) as frames:
                async for batch in frames:
                    await send({"type": "http.response.body", "body": b"".join([sse(f) for f in batch]), "more_body": True})
        finally:
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.engine.record(run, mark)

    async def _retrieve(self, response_id: str, respond: Any) -> None:
        hit = self.engine.responses.get(response_id)
        response = hit.response if hit is not None else await self.persistence.get_response(response_id)
        if response is None:
            raise errors.NotFound(f"Response with id '{response_id}' not found.")
        await respond(200, _encode(response))

    async def _delete(self, response_id: str, respond: Any) -> None:
        self.engine.responses.evict(response_id)
        if not await self.persistence.delete(response_id):
            raise errors.NotFound(f"Response with id '{response_id}' not found.")
        await respond(200, _encode({"id": response_id, "object": "response", "deleted": True}))

    async def _cancel(self, response_id: str) -> None:
        known = self.engine.responses.get(response_id) is not None or (
            await self.persistence.get_response(response_id) is not None
        )
        if not known:
            raise errors.NotFound(f"Response with id '{response_id}' not found.")
        raise errors.InvalidRequest(
            "Only responses created with the 'background' parameter set to true can be cancelled."
        )

    async def _input_items(self, response_id: str, scope: Scope, respond: Any) -> None:
        q = parse_qs(scope.get("query_string", b"").decode())
        after = q.get("after", [None])[0]
        order = q.get("order", ["desc"])[0]
        if order not in ("asc", "desc"):
            raise errors.InvalidValue(f"Invalid 'order': '{order}'. Expected 'asc' or 'desc'.", param="order")
        try:
            limit = int(q.get("limit", ["20"])[0])
        except ValueError:
            raise errors.InvalidType("Invalid 'limit': expected an integer.", param="limit") from None
        if not 1 <= limit <= 100:
            raise errors.InvalidValue("Invalid 'limit': it must be between 1 and 100.", param="limit")
        hit = self.engine.responses.get(response_id)
        if hit is not None:
            from hotloop.state.store import page_items

            page = page_items([item_to_dict(i) for i in hit.input_items], after, limit, order)
            result: Any = False if page is None else page
        else:
            result = await self.persistence.input_items(response_id, after, limit, order)
        if result is None:
            raise errors.NotFound(f"Response with id '{response_id}' not found.")
        if result is False:
            raise errors.InvalidValue(f"Invalid 'after': no item with id '{after}'.", param="after")
        data, has_more = result
        body = {
            "object": "list",
            "data": data,
            "first_id": data[0].get("id") if data else None,
            "last_id": data[-1].get("id") if data else None,
            "has_more": has_more,
        }
        await respond(200, _encode(body))

    async def _input_tokens(self, receive: Receive, respond: Any) -> None:
        req = decode_body(await self._body(receive))
        p = validate(req)
        parent = await self.engine.resolve(req.previous_response_id, None)
        stored = await self.engine.stored_items(p, parent)
        plan = prepare(p, parent, self.engine.ids, self.engine.tokens, defer=True, stored=stored)
        n = await self.engine.count_input(plan)
        await respond(200, _encode({"object": ev.INPUT_TOKENS_OBJECT, "input_tokens": n}))

    # -- WebSocket mode ------------------------------------------------------------------------

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        msg = await receive()
        if msg["type"] != "websocket.connect":
            return
        path = scope["path"].rstrip("/")
        try:
            if path != "/v1/responses":
                raise errors.NotFound(f"WebSocket mode is served on /v1/responses, not {path}.")
            self._check_auth(scope)
        except errors.HotloopError as exc:
            await self._reject(scope, send, exc)
            return
        await send({"type": "websocket.accept"})
        conn = _Connection(self, send, scope.get("extensions"))
        await conn.serve(receive)

    async def _reject(self, scope: Scope, send: Send, exc: errors.HotloopError) -> None:
        if "websocket.http.response" in scope.get("extensions", {}):
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": exc.status,
                    "headers": [_JSON, (b"x-request-id", _request_id().encode())],
                }
            )
            await send({"type": "websocket.http.response.body", "body": ev.http_error_body(exc)})
        else:
            await send({"type": "websocket.close", "code": 1008})


class _Connection:
    """One WebSocket connection: the ASGI task reads frames and feeds the session; a worker task
    runs the session's actions strictly in order.

    An accepted connection that has not sent a frame holds only this object and its place in the
    app's age-limit list (:class:`_Deadlines`): the session, the connection cache, the action
    queue and the worker are made by the first frame (the session's clock still starts when the
    connection opened), and the worker task exists only while it has actions to run.
    """

    __slots__ = (
        "app",
        "_send",
        "_send_texts",
        "_wait_writable",
        "opened_at",
        "session",
        "cache",
        "actions",
        "queued_bytes",
        "_queued_sizes",
        "_room",
        "_worker",
        "_reader",
        "_stopping",
        "expired",
    )

    def __init__(self, app: HotloopApp, send: Send, extensions: dict[str, Any] | None = None) -> None:
        self.app = app
        self._send = send
        ext = extensions or {}
        self._send_texts: Callable[[list[Frame]], bool] | None = ext.get(SEND_TEXTS)
        self._wait_writable: Callable[[], Awaitable[None]] | None = ext.get(WAIT_WRITABLE)
        self.opened_at = asyncio.get_running_loop().time()
        self.session: Session | None = None
        self.cache: ConnectionCache | None = None
        # Actions in order. Bounded: past ws_max_queued + 8 actions the reader stops reading until
        # the worker catches up (the age limit's wake-up may add one more) ...
        self.actions: deque[Any] | None = None
        # ... and bounded by bytes: frames of queued responses hold at most ws_max_queued_bytes
        # (any one frame is accepted when nothing is queued).
        self.queued_bytes = 0
        self._queued_sizes: deque[int] | None = None  # of the queued RunCreate actions, oldest first
        self._room: asyncio.Future[None] | None = None  # the reader waits on it for the worker
        self._worker: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[Any] | None = None
        self._stopping = False
        self.expired = False

    def _open(self) -> Session:
        """The first frame: everything an idle connection did not need."""
        cfg = self.app.config
        self.session = Session(opened_at=self.opened_at, max_age=cfg.ws_connection_max_age, max_queued=cfg.ws_max_queued)
        self.cache = ConnectionCache(cfg.ws_cache_entries, max_bytes=cfg.ws_cache_bytes)
        self.actions = deque()
        self._queued_sizes = deque()
        return self.session

    async def send_frame(self, payload: bytes) -> None:
        await self._send({"type": "websocket.send", "text": payload.decode()})

    async def serve(self, receive: Receive) -> None:
        task = self._reader = asyncio.current_task()
        deadlines = self.app.ws_deadlines
        deadlines.add(self, self.opened_at)
        try:
            # the reader runs in the ASGI task itself (an idle connection has no other task)
            cfg = self.app.config
            max_actions = cfg.ws_max_queued + 8
            max_bytes = cfg.ws_max_queued_bytes
            loop = asyncio.get_running_loop()
            while True:
                msg = await receive()
                kind = msg["type"]
                if kind == "websocket.disconnect":
                    return
                if kind != "websocket.receive":
                    continue
                data = msg.get("text")
                if data is None:
                    data = msg.get("bytes", b"")
                session = self.session or self._open()
                actions = self.actions
                assert actions is not None and self._queued_sizes is not None
                size = len(data)
                while self.queued_bytes and self.queued_bytes + size > max_bytes:
                    await self._wait_room()
                mark = time.thread_time()
                for action in session.receive(data, loop.time()):
                    if isinstance(action, RunCreate):
                        action.mark = mark
                        self.queued_bytes += size
                        self._queued_sizes.append(size)
                    while len(actions) >= max_actions:
                        await self._wait_room()
                    self._dispatch(action)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            if task is not None:
                task.uncancel()  # the worker ended the connection
        except Exception as exc:
            log.error("websocket connection task failed", exc_info=exc)
        finally:
            self._stopping = True  # the reader is done: the worker must not cancel this task now
            deadlines.remove(self)
            worker = self._worker
            if worker is not None:
                worker.cancel()
                with contextlib.suppress(BaseException):
                    await worker
            if self.cache is not None:
                self.cache.clear()

    def _stop(self) -> None:
        """End the connection from the worker: the reader stops waiting for frames."""
        reader = self._reader
        if reader is not None and not self._stopping:
            self._stopping = True
            reader.cancel()

    async def _wait_room(self) -> None:
        room = self._room
        if room is None or room.done():
            room = self._room = asyncio.get_running_loop().create_future()
        await room

    def _dispatch(self, action: Any) -> None:
        assert self.actions is not None
        self.actions.append(action)
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._work())

    def expire(self) -> None:
        # The connection reached its age limit. The worker says so and closes as soon as the
        # response in flight (if any) is done; the wake-up is only needed when it is idle.
        self.expired = True
        if self.actions is None:
            self._open()
        self._dispatch(None)

    async def _work(self) -> None:
        """Run the queued actions in order; the task ends when there are none left."""
        try:
            engine = self.app.engine
            actions = self.actions
            session = self.session
            assert actions is not None and session is not None and self._queued_sizes is not None
            while actions:
                action = actions.popleft()
                if self._room is not None and not self._room.done():
                    self._room.set_result(None)
                if self.expired:
                    # queued, unstarted responses are dropped: the client reconnects with context
                    await self.send_frame(ev.ws_error(session.limit_error())[1])
                    await self._send({"type": "websocket.close", "code": 1001, "reason": "connection limit reached"})
                    raise _Disconnected()
                if isinstance(action, SendError):
                    if action.evict is not None:
                        # a continuation that failed validation evicts its parent, like any failure
                        assert self.cache is not None
                        self.cache.evict(action.evict, action.stream_id)
                    await self.send_frame(ev.ws_error(action.error, action.stream_id)[1])
                elif isinstance(action, Close):
                    await self._send({"type": "websocket.close", "code": action.code, "reason": action.reason})
                    raise _Disconnected()
                elif isinstance(action, RunCreate):
                    self.queued_bytes -= self._queued_sizes.popleft()
                    try:
                        await self._run(engine, action)
                    finally:
                        session.done()
        except (_Disconnected, ClientDisconnected):
            self._stop()
        except Exception as exc:
            log.error("websocket connection task failed", exc_info=exc)
            self._stop()
        finally:
            self._worker = None

    async def _run(self, engine: Engine, action: RunCreate) -> None:
        req = action.request
        stream_id = req.stream_id
        try:
            run: Run = await engine.start(req, transport="ws", conn=self.cache, websocket=True)
        except errors.HotloopError as exc:
            await self.send_frame(ev.ws_error(exc, stream_id)[1])
            return
        except Exception:
            log.exception("unhandled error starting a websocket response")
            await self.send_frame(ev.ws_error(errors.ServerError(), stream_id)[1])
            return
        suffix = _stream_id_suffix(stream_id)
        send_texts = self._send_texts
        wait_writable = self._wait_writable
        async with contextlib.aclosing(run.frames()) as frames:
            if send_texts is not None and wait_writable is not None:
                # The server's batch send: one call per batch, awaiting only under back-pressure.
                async for batch in frames:
                    if suffix:
                        batch = [(t, p[:-1] + suffix) for t, p in batch]
                    if not send_texts(batch):
                        await wait_writable()
            else:
                send = self._send
                async for batch in frames:
                    for _, payload in batch:
                        if suffix:
                            payload = payload[:-1] + suffix
                        await send({"type": "websocket.send", "text": payload.decode()})
        engine.record(run, action.mark)


class _Deadlines:
    """WebSocket connection age limits on one timer for the whole app, not one per connection.

    Every connection lives at most ``max_age`` seconds from its opening, so in opening order
    (a dict keeps it) the first deadline is the earliest: the one timer is set for it and, when
    it fires, expires every connection due and is set again for the next. Closed connections
    leave the dict at once (the dict holds only open connections).
    """

    __slots__ = ("max_age", "_conns", "_timer", "_loop")

    def __init__(self, max_age: float) -> None:
        self.max_age = max_age
        self._conns: dict[_Connection, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._conns)

    def add(self, conn: _Connection, opened_at: float) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (tests run the app on several)
            self._loop = loop
            self._timer = None
        deadline = opened_at + self.max_age
        self._conns[conn] = deadline
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._fire)

    def remove(self, conn: _Connection) -> None:
        self._conns.pop(conn, None)  # the timer stays: it finds the next deadline when it fires

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        conns = self._conns
        while conns:
            conn, deadline = next(iter(conns.items()))
            if deadline > now:
                self._timer = loop.call_at(deadline, self._fire)
                return
            del conns[conn]
            conn.expire()


def _stream_id_suffix(stream_id: str | None) -> bytes:
    """Named lanes echo ``stream_id`` on every event; spliced in before the closing brace."""
    if stream_id is None:
        return b""
    return b',"stream_id":' + _encode(stream_id) + b"}"


class _Disconnected(Exception):
    pass


class _ClientGone(Exception):
    """The HTTP client disconnected; there is nobody to answer."""


async def _disconnected(receive: Receive) -> None:
    """Return once the HTTP client has gone away (the request body was already read)."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            return
