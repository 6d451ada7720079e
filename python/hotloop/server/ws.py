"""WebSocket mode on ``/v1/responses``: one connection, ``response.create`` frames in, events out.

The sans-I/O :class:`~hotloop.protocol.session.Session` decides what each frame means, which
response starts next on which lane, and when the connection ends; this module moves frames, runs
one task per active lane and reports back to the session when a lane's response is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from uvicorn.protocols.utils import ClientDisconnected

from hotloop import errors
from hotloop.pipeline import classifiers, guard, reuse
from hotloop.protocol import events as ev
from hotloop.protocol.events import Frame
from hotloop.protocol.request import CreateRequest, convert_body, decode_item
from hotloop.protocol.session import (
    FAST_DECODE_BYTES,
    Action,
    Close,
    Ended,
    RunCreate,
    SendError,
    Session,
    SteerEvent,
    StopResponse,
)
from hotloop.server.common import JSON_HEADER, Receive, Scope, Send, request_id
from hotloop.server.engine import Engine, Run
from hotloop.server.wsproto import ON_BUSY, ON_CLIENT_GONE, SEND_TEXTS, WAIT_WRITABLE
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
            raise errors.NotFound(f"WebSocket mode is served on /v1/responses, not {errors.clip(path)}.")
        tenant = await app.tenancy.authenticate(scope)  # once per connection; it belongs to this key
        counted = _count_connection(app, tenant)
    except errors.HotloopError as exc:
        await _reject(scope, send, exc)
        return
    try:
        await send({"type": "websocket.accept"})
        conn = Connection(app, send, scope.get("extensions"), tenant)
        await conn.serve(receive)
    finally:
        if counted:
            held = app.ws_per_key
            held[tenant.id] -= 1
            if not held[tenant.id]:
                del held[tenant.id]


def _count_connection(app: "HotloopApp", tenant: Tenant) -> bool:
    """Count one more WebSocket connection of ``tenant`` (True), or refuse it past
    ``ws_max_connections_per_key`` (:class:`errors.TooManyConnections`): one key must not take
    every connection the server has (``max_connections``) from the others. Open mode (one
    tenant) and the admin key are not counted (False)."""
    if not tenant.key_hash or tenant.admin:
        return False
    held = app.ws_per_key
    n = held.get(tenant.id, 0)
    most = app.config.ws_max_connections_per_key
    if n >= most:
        raise errors.TooManyConnections(
            f"This API key has {n} WebSocket connections open to this server, the most one key may hold "
            f"({most}). Close one, or reuse a connection: it runs many responses, one after another "
            "or on lanes (stream_id)."
        )
    held[tenant.id] = n + 1
    return True


async def _reject(scope: Scope, send: Send, exc: errors.HotloopError) -> None:
    if "websocket.http.response" in scope.get("extensions", {}):
        await send(
            {
                "type": "websocket.http.response.start",
                "status": exc.status,
                "headers": [
                    JSON_HEADER, (b"x-request-id", request_id().encode()),
                    *((k.encode(), v.encode()) for k, v in exc.headers.items()),  # a 429's or 503's retry-after
                ],
            }
        )
        await send({"type": "websocket.http.response.body", "body": ev.http_error_body(exc)})
    else:
        await send({"type": "websocket.close", "code": 1008})


class Connection:
    """One WebSocket connection: the ASGI task reads frames and feeds the session; each active lane
    runs its responses in a task of its own, and every frame goes out through the server's corked
    batch send (one socket write per loop iteration for all lanes together).

    An accepted connection that has not sent a frame holds only this object and its place in the
    app's age-limit list (:class:`Deadlines`): the session and the connection cache are made by
    the first frame (the session's clock still starts when the connection opened), and a lane's
    task exists only while the lane has a response running.
    """

    __slots__ = (
        "app",
        "_send",
        "_send_texts",
        "_wait_writable",
        "opened_at",
        "session",
        "cache",
        "_room",
        "_lane_tasks",
        "_runs",
        "_reader",
        "_stopping",
        "_finisher",
        "_failed",
        "_closed",
        "tenant",
    )

    def __init__(
        self, app: "HotloopApp", send: Send, extensions: dict[str, Any] | None = None, tenant: Tenant = ANONYMOUS
    ) -> None:
        self.app = app
        self._send = send
        ext = extensions or {}
        self._send_texts: Callable[..., bool] | None = ext.get(SEND_TEXTS)
        self._wait_writable: Callable[[], Awaitable[None]] | None = ext.get(WAIT_WRITABLE)
        on_gone = ext.get(ON_CLIENT_GONE)
        if on_gone is not None:  # the server says at once when the client leaves, read or not
            on_gone(self._client_left)
        on_busy = ext.get(ON_BUSY)
        if on_busy is not None:  # a server shutdown waits for the responses running here
            on_busy(lambda: bool(self._lane_tasks))
        self.opened_at = asyncio.get_running_loop().time()
        self.session: Session | None = None
        self.cache: ConnectionCache | None = None
        self._room: asyncio.Future[None] | None = None  # the reader waits on it for the lanes
        # One task per lane with a response running (the session allows at most one per lane and
        # ws_max_in_flight in all); the runs by response id, for steering.
        self._lane_tasks: dict[str | None, asyncio.Task[None]] = {}
        self._runs: dict[str, Run] = {}
        self._reader: asyncio.Task[Any] | None = None
        self._stopping = False
        self._finisher: asyncio.Task[None] | None = None  # Connection.expire's: kept, awaited at the end
        self._failed = False  # an internal failure: the connection closes with 1011 (serve's end)
        self._closed = False  # a websocket.close was sent
        self.tenant = tenant

    def _open(self) -> Session:
        """The first frame: everything an idle connection did not need."""
        cfg = self.app.config
        self.session = Session(
            opened_at=self.opened_at,
            max_age=cfg.ws_connection_max_age,
            max_queued=cfg.ws_max_queued,
            max_in_flight=cfg.ws_max_in_flight,
            max_pending_steers=cfg.ws_max_pending_steers,
            ids=self.app.engine.ids,
            decode_create=self._decode_create,
            convert_create=self._convert_create,
            check_steer=self._check_steer,
            finishing=self._finishing,
        )
        engine = self.app.engine
        self.cache = ConnectionCache(
            cfg.ws_cache_entries, max_bytes=cfg.ws_cache_bytes, deletions=engine.deletions,
            budget=engine.conn_cache_budget, owner=self.tenant.id,
        )
        return self.session

    def _check_steer(self, items: list[Any]) -> None:
        """What a steer's successor would refuse, refused before the steer is accepted (and the
        running response cut): the size guard, and a classifier's block (``--secrets block``:
        a secret in steering input was accepted, cut the response, then failed its successor)."""
        cfg = self.app.config
        guard.check(items, cfg.max_turn_input_items, cfg.max_turn_input_bytes)
        engine = self.app.engine
        if engine.classifiers:  # (the steering messages as the successor's input items)
            decoded = [decode_item(it, i) if isinstance(it, dict) else it for i, it in enumerate(items)]
            outcome = classifiers.classify_turn(engine.classifiers, decoded, None)
            if outcome.block is not None:
                raise classifiers.blocked_error(outcome.block[1])

    def _finishing(self, response_id: str) -> bool:
        """Whether a running response's terminal event exists (``--store-sync full`` holds it
        until the store's write is done; Session.finishing)."""
        run = self._runs.get(response_id)
        return run is not None and run.turn.done

    def _decode_create(self, frame: str) -> Any:
        """A large ``response.create`` frame (FAST_DECODE_BYTES or more), which may resend a
        history: matched against the tenant's cached prefixes by its bytes (pipeline.reuse), as
        an HTTP body is. A smaller one (OFFERED_BYTES or more) that carries tools: decoded with
        them taken from the tenant's tools cache (pipeline.settings), matched by fingerprint as
        before. The tools cache is on the prefix cache's decoding path, as over HTTP (off with
        it)."""
        engine = self.app.engine
        if len(frame) >= FAST_DECODE_BYTES:
            return reuse.decode_frame(frame, engine.prefixes, self.tenant.id, engine.tools)
        if engine.prefixes.max_entries > 0 and _TOOLS_KEY in frame:
            req = reuse.decode_settings(frame, self.tenant.id, engine.tools)
            return (req, None) if req is not None else None
        return None

    def _convert_create(self, frame: dict[str, Any]) -> CreateRequest:
        """A small ``response.create`` frame (under OFFERED_BYTES), decoded the ordinary way:
        its tools taken from the tenant's tools cache (pipeline.settings), its input matched by
        fingerprint as before. The tools cache is on the prefix cache's decoding path, as over
        HTTP (off with it)."""
        engine = self.app.engine
        if engine.prefixes.max_entries > 0:
            return reuse.convert_create(frame, self.tenant.id, engine.tools)
        return convert_body(frame)

    async def send_frame(self, payload: bytes) -> None:
        await self._emit([(ev.ERROR, payload)])

    async def _emit(self, frames: list[Frame]) -> None:
        send_texts = self._send_texts
        if send_texts is not None and self._wait_writable is not None:
            if not send_texts(frames):
                await self._wait_writable()
        else:
            for _, payload in frames:
                await self._send({"type": "websocket.send", "text": payload.decode()})

    async def serve(self, receive: Receive) -> None:
        task = self._reader = asyncio.current_task()
        deadlines = self.app.ws_deadlines
        deadlines.add(self, self.opened_at)
        try:
            # the reader runs in the ASGI task itself (an idle connection has no other task)
            cfg = self.app.config
            # Bounded: past ws_max_queued + 8 actions waiting behind running responses the reader
            # stops reading until a lane catches up, and frames of responses waiting to start hold
            # at most ws_max_queued_bytes (any one frame is accepted when nothing waits).
            max_backlog = cfg.ws_max_queued + 8
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
                size = len(data)
                while session.queued_bytes and session.queued_bytes + size > max_bytes:
                    await self._wait_room()
                while session.backlog >= max_backlog:
                    await self._wait_room()
                mark = time.thread_time()
                actions = session.receive(data, loop.time())
                for action in actions:
                    if isinstance(action, RunCreate):
                        action.mark = mark
                await self._dispatch(actions)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            if task is not None:
                task.uncancel()  # a lane ended the connection
        except (_Disconnected, ClientDisconnected):
            pass
        except Exception as exc:
            self._failure(exc, "reading frames")
        finally:
            self._stopping = True  # the reader is done: nothing new starts, lanes must not cancel it
            deadlines.remove(self)
            while self._lane_tasks:  # every lane's response (and backend stream) is cancelled
                tasks = list(self._lane_tasks.items())
                for _, t in tasks:
                    t.cancel()
                for lane, t in tasks:
                    with contextlib.suppress(BaseException):
                        await t
                    if self._lane_tasks.get(lane) is t:
                        # cancelled before its first step (made by a frame read in the same
                        # iteration as the disconnect behind it): its body, which takes it off,
                        # never ran, and awaiting it again would not suspend: the loop spun for
                        # good, holding the event loop
                        del self._lane_tasks[lane]
            finisher = self._finisher
            if finisher is not None:
                if not finisher.done():
                    finisher.cancel()
                with contextlib.suppress(BaseException):
                    await finisher  # (its outcome retrieved: _finish logs its own failures)
            if self.cache is not None:
                self.cache.clear()
            if self._failed and not self._closed:
                # Internal error, nothing more: the details are in the server's log. Sent once
                # every lane is done, so no frame follows the close.
                with contextlib.suppress(Exception):
                    await self._close(1011, "internal error")

    def _failure(self, exc: BaseException, where: str) -> None:
        """An unexpected exception ends the connection: one log record (the first failure's),
        and a 1011 close when the reader ends (never ``str(exc)`` or a traceback to the client)."""
        if not self._failed:
            self._failed = True
            log.error("websocket connection failed (%s): %s; closing it with 1011", where, type(exc).__name__, exc_info=exc)

    def _fail(self, exc: BaseException, where: str) -> None:
        """``_failure`` from a lane or the expiry task: the reader stops and closes (1011)."""
        self._failure(exc, where)
        self._stop()

    async def _close(self, code: int, reason: str = "") -> None:
        if self._closed:  # (two lanes ending the connection at once: one close, not an ASGI error)
            return
        self._closed = True
        await self._send({"type": "websocket.close", "code": code, "reason": reason})

    def _client_left(self) -> None:
        """The client went away (close frame, FIN or reset): cancel what runs for it, now."""
        if self._lane_tasks:  # (a client that leaves between its responses is no news: DEBUG)
            log.info("websocket client left; cancelling its responses")
        else:
            log.debug("websocket client left")
        self._stop()

    def _stop(self) -> None:
        """End the connection from a lane: the reader stops waiting for frames."""
        reader = self._reader
        if reader is not None and not self._stopping:
            self._stopping = True
            reader.cancel()

    async def _wait_room(self) -> None:
        room = self._room
        if room is None or room.done():
            room = self._room = asyncio.get_running_loop().create_future()
        await room

    def _wake_reader(self) -> None:
        if self._room is not None and not self._room.done():
            self._room.set_result(None)

    async def _dispatch(self, actions: list[Action]) -> None:
        """Carry out the session's actions in order (raises ``_Disconnected`` on ``Close``).

        What the age limit said (``expire``: refusals of the creates that waited, failed
        steers) goes first: a lane whose response ends meanwhile, or the reader, waits for it,
        so that a lane's close cannot overtake it and cut it off (it was then cancelled with
        the reader, and those creates went unanswered)."""
        finisher = self._finisher
        if finisher is not None and not finisher.done() and asyncio.current_task() is not finisher:
            await asyncio.wait((finisher,))
        for action in actions:
            if isinstance(action, RunCreate):
                if self._stopping:
                    continue
                if not action.mark:
                    action.mark = time.thread_time()  # an automatic successor: no frame of its own
                lane = action.lane
                assert lane not in self._lane_tasks
                self._lane_tasks[lane] = asyncio.get_running_loop().create_task(self._lane(action))
            elif isinstance(action, SendError):
                if action.evict is not None:
                    # a continuation that failed validation evicts its parent, like any failure
                    assert self.cache is not None
                    self.cache.evict(action.evict, action.stream_id)
                self._count_error(action.error)  # (hotloop_errors_total: every error frame)
                await self._emit([ev.ws_error(action.error, action.stream_id)])
            elif isinstance(action, SteerEvent):
                run = self._runs.get(action.response_id) if action.response_id is not None else None
                kind, payload = action.frame(run.turn.aside() if run is not None else 0)
                suffix = ev.stream_id_suffix(action.stream_id)
                await self._emit([(kind, payload[:-1] + suffix if suffix else payload)])
            elif isinstance(action, StopResponse):
                run = self._runs.get(action.response_id)
                if run is not None:
                    run.steer()
            elif isinstance(action, Close):
                await self._close(action.code, action.reason)
                raise _Disconnected()

    def expire(self) -> None:
        """The connection reached its age limit: the session answers what waits and says when
        to close (at once, or when the last running response is done). What it says now is sent
        by a task the connection keeps (the event loop holds only a weak reference to a task)
        and the reader awaits when it ends."""
        if self._stopping:
            return
        try:
            session = self.session or self._open()
            actions = session.expire()  # [] once it expired (the session decides once)
        except Exception as exc:  # (called from the app's one timer: other connections go on)
            self._fail(exc, "at the connection's age limit")
            return
        if actions:
            self._finisher = asyncio.get_running_loop().create_task(self._finish(actions))

    async def _finish(self, actions: list[Action]) -> None:
        try:
            await self._dispatch(actions)
        except (_Disconnected, ClientDisconnected):
            self._stop()
        except Exception as exc:
            self._fail(exc, "at the connection's age limit")

    async def _lane(self, action: RunCreate) -> None:
        """One lane's running response, then whatever the session says comes next."""
        session = self.session
        assert session is not None
        lane = action.lane
        ended = Ended()
        try:
            ended = await self._run(self.app.engine, action)
        except (_Disconnected, ClientDisconnected):
            self._lane_tasks.pop(lane, None)
            self._stop()
            return
        except asyncio.CancelledError:
            self._lane_tasks.pop(lane, None)
            raise
        except Exception as exc:
            self._lane_tasks.pop(lane, None)
            self._fail(exc, "running a response")
            return
        self._lane_tasks.pop(lane, None)
        try:
            await self._dispatch(session.lane_done(lane, ended, action))
        except (_Disconnected, ClientDisconnected):
            self._stop()
        except Exception as exc:
            self._fail(exc, "after a response")
        finally:
            if ended.response_id is not None:
                self._runs.pop(ended.response_id, None)
            self._wake_reader()

    def _count_error(self, exc: errors.HotloopError) -> None:
        if self.app.metrics is not None:
            self.app.metrics.error(exc)

    async def _refused(self, action: RunCreate, exc: errors.HotloopError) -> Ended:
        """A response that could not start: its ``error`` frame; for an automatic successor
        (a steer's), which the client never sent, none: the steers' ``response.steer.failed``
        says why (an error frame on the lane would read as the failure of the client's own
        next request there)."""
        if action.successor_of is not None:
            return Ended(refusal=exc.message)
        await self.send_frame(ev.ws_error(exc, action.request.stream_id)[1])
        return Ended()

    async def _run(self, engine: Engine, action: RunCreate) -> Ended:
        req = action.request
        stream_id = req.stream_id
        try:
            # per response.create: a revoked key ends the connection, a limit answers 429
            pending = self.app.tenancy.admit(self.tenant)
            if pending is not None:  # a limit shared through Redis
                await pending
        except errors.AuthenticationFailed as exc:
            await self.send_frame(ev.ws_error(exc, stream_id)[1])
            await self._close(1008, "invalid_api_key")
            raise _Disconnected() from None
        except errors.HotloopError as exc:
            self._count_error(exc)
            return await self._refused(action, exc)
        rid_ = request_id()  # this response's request id (logs, the backend's x-request-id)
        prev = req.previous_response_id
        session = self.session
        assert session is not None
        try:
            if prev is not None and session.in_progress(prev):
                # A fork off a response still running on another lane (one on this lane waited
                # for it): its output is not known yet. The code clients handle for a parent they
                # cannot continue, with a message that says why; the parent is not evicted (a
                # cross-lane fork's error preserves it).
                raise errors.PreviousResponseNotFound(
                    prev,
                    f"Previous response with id '{errors.clip(prev)}' is still in progress on another stream of this "
                    "connection; continue from it once it has completed.",
                )
            prefix, raw_input = action.decoded or (None, None)
            run: Run = await engine.start(
                req, transport="ws", conn=self.cache, websocket=True, tenant=self.tenant, request_id=rid_,
                prefix=prefix, raw_input=raw_input,
            )
        except errors.HotloopError as exc:
            if action.steers and action.successor_of is None:  # the client's create, steering input first
                n = sum(len(s.items) for s in action.steers)
                own_string = action.string_input and reuse.input_index(exc.param) == n
                reuse.unshift(exc, n)
                if own_string:
                    exc.param = "input"  # its string input, which became a message after them
            self._count_error(exc)
            return await self._refused(action, exc)
        except Exception:
            log.exception("unhandled error starting a websocket response (request %s)", rid_)
            self._count_error(errors.ServerError())
            return await self._refused(action, errors.ServerError())
        rid = str(run.response["id"])
        self._runs[rid] = run
        session.started(stream_id, rid, req)
        suffix = ev.stream_id_suffix(stream_id)
        send_texts = self._send_texts
        wait_writable = self._wait_writable
        within = self.app.config.flush_interval_ms / 1000  # --flush-interval-ms
        only_deltas = ev.only_deltas
        pushed = False  # a response's first pushed batch is never held
        lanes = self._lane_tasks
        async with contextlib.aclosing(run.frames()) as frames:
            if send_texts is not None and wait_writable is not None:
                # The server's batch send: one call per batch, awaiting only under back-pressure.

                def emit(batch: list[Frame]) -> None:
                    """Push delivery (Run.emit): the frames of one backend read's deltas, sent
                    from its read callback in one write; pushing stops while the client is slow
                    or gone, and the loop below (which waits for it, or fails) starts it again."""
                    nonlocal pushed
                    hold = within if pushed and only_deltas(batch) else 0.0
                    pushed = True
                    if suffix:
                        batch = [(t, p[:-1] + suffix) for t, p in batch]
                    try:
                        if send_texts(batch, True, hold):
                            return
                    except ClientDisconnected:
                        pass
                    run.emit = None

                if not suffix:

                    def emit_deltas(batch: list[Frame]) -> None:
                        """``emit`` for a read of the open item's lane (Run.emit_deltas):
                        deltas only, so nothing to check before holding them."""
                        nonlocal pushed
                        hold = within if pushed else 0.0
                        pushed = True
                        try:
                            if send_texts(batch, True, hold):
                                return
                        except ClientDisconnected:
                            pass
                        run.emit = None

                    run.emit_deltas = emit_deltas
                run.emit = emit
                n = 0
                try:
                    async for batch in frames:
                        if suffix:
                            batch = [(t, p[:-1] + suffix) for t, p in batch]
                        done = run.turn.done
                        if done:
                            session.ending(stream_id, run.turn.status)
                        n += 1
                        # The terminal event is written now, not at the end of this loop
                        # iteration: the response's bookkeeping (caching, the store's queue,
                        # metrics) runs when this loop asks for the next batch, after the write.
                        if not send_texts(batch, done):
                            run.emit = None
                            await wait_writable()
                            run.emit = emit
                            continue
                        run.emit = emit  # the client took this batch: push (again)
                        if done:
                            # No suspension between the terminal event's write and the response's
                            # bookkeeping (the next turn of the loop below): a client that names
                            # it at once, on any connection, finds it cached.
                            continue
                        if len(lanes) > 1 or not n & _ALONE_YIELD:
                            # Fair: other lanes run between this lane's batches, and even alone
                            # a backend whose chunks are always ready lets the reader in now and
                            # then (a steer, another lane's request).
                            await asyncio.sleep(0)
                finally:
                    run.emit = None  # no cycle through the closures
                    run.emit_deltas = None
            else:
                send = self._send
                async for batch in frames:
                    if run.turn.done:
                        session.ending(stream_id, run.turn.status)
                    for _, payload in batch:
                        if suffix:
                            payload = payload[:-1] + suffix
                        await send({"type": "websocket.send", "text": payload.decode()})
        engine.record(run, action.mark)
        response = run.response
        status = str(response["status"])
        calls: list[dict[str, Any]] = []
        if status in ("completed", "incomplete"):
            # the calls the client owes outputs for: every complete one, also of a response that
            # ended incomplete after them (its token limit; a steer never cuts one short), so a
            # steer waits for them (pending) instead of a successor the model would read with
            # calls and no outputs (which strict chat servers refuse)
            calls = [
                {"type": "function_call_output", "call_id": it["call_id"], "name": it["name"]}
                for it in response["output"]
                if it.get("type") == "function_call" and it.get("status", "completed") == "completed"
            ]
        return Ended(rid, status, calls)


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

    def connections(self) -> list["Connection"]:
        return list(self._conns)

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


_TOOLS_KEY = '"tools"'  # a frame that may carry tools (one without them declines in a scan)
_ALONE_YIELD = 63  # a lane running alone yields to the loop every 64 batches (see Connection._run)


class _Disconnected(Exception):
    pass
