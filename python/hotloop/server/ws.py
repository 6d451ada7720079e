"""WebSocket mode on ``/v1/responses``: one connection, ``response.create`` frames in, events out.

The sans-I/O :class:`~hotloop.protocol.session.Session` decides what each frame means and when
the connection ends; this module moves frames and runs the session's actions in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from uvicorn.protocols.utils import ClientDisconnected

from hotloop import errors
from hotloop.protocol import events as ev
from hotloop.protocol.events import Frame
from hotloop.protocol.session import Close, RunCreate, SendError, Session
from hotloop.server.common import JSON_HEADER, Receive, Scope, Send, request_id
from hotloop.server.engine import Engine, Run
from hotloop.server.wsproto import ON_CLIENT_GONE, SEND_TEXTS, WAIT_WRITABLE
from hotloop.state.context import ConnectionCache
from hotloop.tenants import ANONYMOUS, Tenant

if TYPE_CHECKING:
    from hotloop.server.app import HotloopApp

log = logging.getLogger("hotloop.server")


async def serve_websocket(app: "HotloopApp", scope: Scope, receive: Receive, send: Send) -> None:
    msg = await receive()
    if msg["type"] != "websocket.connect":
        return
    path = scope["path"].rstrip("/")
    try:
        if path != "/v1/responses":
            raise errors.NotFound(f"WebSocket mode is served on /v1/responses, not {path}.")
        tenant = await app.tenancy.authenticate(scope)  # once per connection; it belongs to this key
    except errors.HotloopError as exc:
        await _reject(scope, send, exc)
        return
    await send({"type": "websocket.accept"})
    conn = Connection(app, send, scope.get("extensions"), tenant)
    await conn.serve(receive)

async def _reject(scope: Scope, send: Send, exc: errors.HotloopError) -> None:
    if "websocket.http.response" in scope.get("extensions", {}):
        await send(
            {
                "type": "websocket.http.response.start",
                "status": exc.status,
                "headers": [JSON_HEADER, (b"x-request-id", request_id().encode())],
            }
        )
        await send({"type": "websocket.http.response.body", "body": ev.http_error_body(exc)})
    else:
        await send({"type": "websocket.close", "code": 1008})


class Connection:
    """One WebSocket connection: the ASGI task reads frames and feeds the session; a worker task
    runs the session's actions strictly in order.

    An accepted connection that has not sent a frame holds only this object and its place in the
    app's age-limit list (:class:`Deadlines`): the session, the connection cache, the action
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
        "tenant",
    )

    def __init__(
        self, app: "HotloopApp", send: Send, extensions: dict[str, Any] | None = None, tenant: Tenant = ANONYMOUS
    ) -> None:
        self.app = app
        self._send = send
        ext = extensions or {}
        self._send_texts: Callable[[list[Frame]], bool] | None = ext.get(SEND_TEXTS)
        self._wait_writable: Callable[[], Awaitable[None]] | None = ext.get(WAIT_WRITABLE)
        on_gone = ext.get(ON_CLIENT_GONE)
        if on_gone is not None:  # the server says at once when the client leaves, read or not
            on_gone(self._client_left)
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
        self.tenant = tenant

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

    def _client_left(self) -> None:
        """The client went away (close frame, FIN or reset): cancel what runs for it, now."""
        busy = self._worker is not None
        log.info("websocket client left%s", "; cancelling its response" if busy else "")
        self._stop()

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
                    # the session decides what the end of the connection's life means; queued,
                    # unstarted responses are dropped (the client reconnects with context)
                    actions.clear()
                    actions.extend(session.expire())
                    self.expired = False
                    continue
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
            # per response.create: a revoked key ends the connection, a limit answers 429
            self.app.tenancy.admit(self.tenant)
        except errors.AuthenticationFailed as exc:
            await self.send_frame(ev.ws_error(exc, stream_id)[1])
            await self._send({"type": "websocket.close", "code": 1008, "reason": "invalid_api_key"})
            raise _Disconnected() from None
        except errors.HotloopError as exc:
            await self.send_frame(ev.ws_error(exc, stream_id)[1])
            return
        try:
            run: Run = await engine.start(req, transport="ws", conn=self.cache, websocket=True, tenant=self.tenant)
        except errors.HotloopError as exc:
            await self.send_frame(ev.ws_error(exc, stream_id)[1])
            return
        except Exception:
            log.exception("unhandled error starting a websocket response")
            await self.send_frame(ev.ws_error(errors.ServerError(), stream_id)[1])
            return
        suffix = ev.stream_id_suffix(stream_id)
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


class Deadlines:
    """WebSocket connection age limits on one timer for the whole app, not one per connection.

    Every connection lives at most ``max_age`` seconds from its opening, so in opening order
    (a dict keeps it) the first deadline is the earliest: the one timer is set for it and, when
    it fires, expires every connection due and is set again for the next. Closed connections
    leave the dict at once (the dict holds only open connections).
    """

    __slots__ = ("max_age", "_conns", "_timer", "_loop")

    def __init__(self, max_age: float) -> None:
        self.max_age = max_age
        self._conns: dict[Connection, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._conns)

    def add(self, conn: Connection, opened_at: float) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (tests run the app on several)
            self._loop = loop
            self._timer = None
        deadline = opened_at + self.max_age
        self._conns[conn] = deadline
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._fire)

    def remove(self, conn: Connection) -> None:
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


class _Disconnected(Exception):
    pass
