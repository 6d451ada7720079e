"""WebSocket session audit: the age limit reached while responses run (sans-I/O), the expiry
task's lifetime, and server-side failures closing with 1011 (driven in-process)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import weakref
from typing import Any

import pytest

from hotloop import errors
from hotloop.config import Config
from hotloop.protocol.session import Close, Ended, RunCreate, SendError, Session, SteerEvent
from hotloop.server import ws as wsmod
from hotloop.server.runner import make_app
from hotloop.server.wsproto import SEND_TEXTS, WAIT_WRITABLE

LIMIT = "websocket_connection_limit_reached"


def create(lane: str | None = None, **kw: Any) -> str:
    body = {"type": "response.create", "model": "m", "input": "x", **kw}
    if lane is not None:
        body["stream_id"] = lane
    return json.dumps(body)


def is_limit(a: Any, lane: str | None) -> bool:
    return isinstance(a, SendError) and a.error.code == LIMIT and a.error.status == 400 and a.stream_id == lane


# -- the session ------------------------------------------------------------------------------


def test_a_create_after_the_limit_is_answered_on_its_lane() -> None:
    sess = Session(opened_at=0.0, max_age=60.0)
    [a] = sess.receive(create("a"), 1)
    assert isinstance(a, RunCreate)
    # past the limit (the frame finds it before the timer did): lane b is idle, answered now
    [b] = sess.receive(create("b"), 61)
    assert is_limit(b, "b")
    # lane a is busy: its answer waits behind its response (never inside its events)
    assert sess.receive(create("a"), 62) == []
    [d] = sess.receive(create(), 62)  # the default lane is idle: answered now
    assert is_limit(d, None)
    out = sess.lane_done("a", Ended("resp_a", "completed"), a)
    assert is_limit(out[0], "a")
    assert isinstance(out[-1], Close) and out[-1].code == 1001
    assert is_limit(out[-2], None)  # why the connection closes, last
    assert sess.receive(create("c"), 63) == []  # closed: nothing more


def test_the_default_lane_is_answered_once_when_the_connection_then_closes() -> None:
    """Idle connection, a create past the limit on the default lane: its answer is the frame
    that says why the connection closes (the same frame is not sent twice)."""
    sess = Session(opened_at=0.0, max_age=60.0)
    out = sess.receive(create(), 61)
    assert [type(x) for x in out] == [SendError, Close] and is_limit(out[0], None)
    out = Session(opened_at=0.0, max_age=60.0).receive(create("n"), 61)
    assert [type(x) for x in out] == [SendError, SendError, Close]
    assert is_limit(out[0], "n") and is_limit(out[1], None)


def test_what_waits_at_the_limit_is_answered_not_dropped() -> None:
    sess = Session(opened_at=0.0, max_age=60.0, max_in_flight=2)
    [run] = sess.receive(create(), 1)
    assert isinstance(run, RunCreate)
    assert sess.receive(create(input="queued"), 1) == []
    assert sess.receive("not json", 1) == []  # an error behind the running response
    [x] = sess.receive(create("x"), 1)
    assert isinstance(x, RunCreate)
    assert sess.receive(create("y"), 1) == []  # no slot: lane y waits for one
    out = sess.expire()
    # lane y was only waiting for a slot: answered now; the busy lanes' answers wait
    assert len(out) == 1 and is_limit(out[0], "y")
    assert sess.queued == 2 and sess.queued_bytes == 0
    out = sess.lane_done(None, Ended("resp_1", "completed"), run)
    assert len(out) == 2 and is_limit(out[0], None)
    assert isinstance(out[1], SendError) and isinstance(out[1].error, errors.InvalidJSON)
    # a create arriving on the now idle default lane: answered at once
    [late] = sess.receive(create(), 70)
    assert is_limit(late, None)
    out = sess.lane_done("x", Ended("resp_x", "completed"), x)
    assert [type(a) for a in out] == [SendError, Close] and is_limit(out[0], None)
    assert sess.queued == 0 and sess.in_flight == 0 and sess.backlog == 0


def test_frames_after_the_limit_are_still_answered() -> None:
    """Malformed frames and steers after the limit get their ordinary answers; processed is
    still ignored."""
    sess = Session(opened_at=0.0, max_age=60.0)
    [run] = sess.receive(create("a"), 1)
    assert isinstance(run, RunCreate)
    sess.started("a", "resp_a", run.request)
    assert sess.expire() == []
    [bad] = sess.receive(json.dumps({"type": "nope", "stream_id": "b"}), 61)
    assert isinstance(bad, SendError) and bad.stream_id == "b" and bad.error.param == "type"
    assert sess.receive(json.dumps({"type": "response.processed", "response_id": "resp_a"}), 61) == []
    [st] = sess.receive(json.dumps({"type": "response.steer", "previous_response_id": "resp_a", "input": "x"}), 61)
    assert isinstance(st, SteerEvent) and st.kind == "response.steer.failed"


# -- the transport, in-process ------------------------------------------------------------------


class Peer:
    """An ASGI WebSocket client: frames to send, frames received, the close (code, reason)."""

    def __init__(self, frames: list[str], batch: bool = True) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.inbox.put_nowait({"type": "websocket.connect"})
        for f in frames:
            self.inbox.put_nowait({"type": "websocket.receive", "text": f})
        self.sent: list[bytes] = []
        self.closed: tuple[int, str] | None = None
        self.extensions: dict[str, Any] = {"websocket.http.response": {}}
        if batch:
            self.extensions[SEND_TEXTS] = self.send_texts
            self.extensions[WAIT_WRITABLE] = self.wait_writable

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send(self, msg: dict[str, Any]) -> None:
        assert self.closed is None, f"sent after the close: {msg}"
        if msg["type"] == "websocket.send":
            self.sent.append(msg["text"].encode())
        elif msg["type"] == "websocket.close":
            self.closed = (msg.get("code", 1000), msg.get("reason", "") or "")
            self.inbox.put_nowait({"type": "websocket.disconnect", "code": msg.get("code", 1000)})

    def send_texts(self, events: list[tuple[str, bytes]], now: bool = False, within: float = 0.0) -> bool:
        assert self.closed is None, "sent after the close"
        self.sent.extend(p for _, p in events)
        return True

    async def wait_writable(self) -> None:
        await asyncio.sleep(0)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(b) for b in self.sent]


SCOPE = {"type": "websocket", "path": "/v1/responses", "headers": [], "query_string": b"", "subprotocols": []}


def frame(**kw: Any) -> str:
    return json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi", "store": False, **kw})


async def serve(app: Any, peer: Peer, timeout: float = 10) -> None:
    await asyncio.wait_for(app({**SCOPE, "extensions": peer.extensions}, peer.receive, peer.send), timeout)


class Boom(RuntimeError):
    pass


SECRET = "secret-internal-detail /srv/hotloop"


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def assert_internal_close(peer: Peer, caplog: pytest.LogCaptureFixture) -> None:
    assert peer.closed is not None and peer.closed[0] == 1011, peer.closed
    assert SECRET not in peer.closed[1] and "Boom" not in peer.closed[1] and "Traceback" not in peer.closed[1]
    for b in peer.sent:
        assert SECRET.encode() not in b and b"Traceback" not in b
    logged = errors_logged(caplog)
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert logged[0].name == "hotloop.server"
    assert "never retrieved" not in caplog.text and "destroyed but it is pending" not in caplog.text


@pytest.mark.parametrize("batch", [True, False])
def test_a_failure_in_the_reader_closes_with_1011(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, batch: bool) -> None:
    def receive(self: Session, data: Any, now: float) -> list[Any]:
        raise Boom(SECRET)

    monkeypatch.setattr(Session, "receive", receive)

    async def main() -> Peer:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        try:
            peer = Peer([frame()], batch=batch)
            await serve(app, peer)
            return peer
        finally:
            await app.shutdown()

    with caplog.at_level(logging.INFO):
        peer = asyncio.run(main())
    assert_internal_close(peer, caplog)


@pytest.mark.parametrize("where", ["record", "lane_done"])
def test_a_failure_in_a_lane_closes_with_1011(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str) -> None:
    """A lane's unexpected exception (after its response's terminal event: the engine's
    bookkeeping, or the session's next step): close 1011, once, with the other lane's response
    cancelled and nothing sent after the close."""

    def boom(*a: Any, **kw: Any) -> Any:
        raise Boom(SECRET)

    if where == "record":
        from hotloop.server.engine import Engine

        real = Engine.record

        def record(self: Any, run: Any, mark: float) -> Any:
            if run.turn.response.get("metadata", {}).get("who") == "fails":
                raise Boom(SECRET)
            return real(self, run, mark)

        monkeypatch.setattr(Engine, "record", record)
    else:
        real_done = Session.lane_done

        def lane_done(self: Session, lane: Any, ended: Any, action: Any) -> Any:
            if lane == "fails":
                raise Boom(SECRET)
            return real_done(self, lane, ended, action)

        monkeypatch.setattr(Session, "lane_done", lane_done)

    async def main() -> Peer:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        try:
            peer = Peer([
                frame(stream_id="slow", metadata={"sim": "text,tokens:400,rate:100"}),
                frame(stream_id="fails", metadata={"who": "fails", "sim": "text,tokens:3"}),
            ])
            await serve(app, peer)
            return peer
        finally:
            await app.shutdown()

    with caplog.at_level(logging.INFO):
        peer = asyncio.run(main())
    assert_internal_close(peer, caplog)
    done = [e for e in peer.events() if e["type"] == "response.completed"]
    assert [e.get("stream_id") for e in done] == ["fails"]  # the slow one was cancelled


def test_expiry_task_is_kept_and_its_failure_logged_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``Connection.expire`` starts the task that says why the connection closes: the
    connection keeps it (a pending task only the event loop knows of can be collected mid-run),
    and its failure is one log record and a 1011 close, never a traceback to the client or an
    unretrieved task exception."""
    real = wsmod.Connection._dispatch
    mode = {"block": True}

    async def dispatch(self: Any, actions: list[Any]) -> None:
        if any(isinstance(a, Close) for a in actions):
            if mode["block"]:
                # waits on a future nothing else references (as a send waiting for the socket)
                await asyncio.get_running_loop().create_future()
            raise Boom(SECRET)
        await real(self, actions)

    monkeypatch.setattr(wsmod.Connection, "_dispatch", dispatch)

    async def kept() -> bool:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        try:
            peer = Peer([])
            task = asyncio.ensure_future(app({**SCOPE, "extensions": peer.extensions}, peer.receive, peer.send))
            await asyncio.sleep(0.01)
            [conn] = app.ws_deadlines.connections()
            before = asyncio.all_tasks()
            conn.expire()
            [fin] = asyncio.all_tasks() - before
            ref = weakref.ref(fin)
            del fin
            for _ in range(3):
                await asyncio.sleep(0)
            gc.collect()
            alive = ref() is not None
            peer.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
            await asyncio.wait_for(task, 5)
            await asyncio.sleep(0)
            return alive
        finally:
            await app.shutdown()

    with caplog.at_level(logging.INFO):
        assert asyncio.run(kept()), "the expiry task was garbage-collected while it ran"
    assert "destroyed but it is pending" not in caplog.text

    caplog.clear()
    mode["block"] = False

    async def fails() -> Peer:
        app = make_app(Config(store="memory", sim_rate=0, ws_connection_max_age=0.05))
        await app.startup()
        try:
            peer = Peer([])
            await serve(app, peer)
            await asyncio.sleep(0.01)
            gc.collect()
            return peer
        finally:
            await app.shutdown()

    with caplog.at_level(logging.INFO):
        peer = asyncio.run(fails())
    assert_internal_close(peer, caplog)


def test_what_the_limit_answers_goes_before_the_close_a_lane_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The age limit's answers (the refusals of the creates waiting for a slot) are sent by a
    task of their own. When the running response ends before that task has written them (a
    slow socket), the lane's close waits for them: it went first, the reader then cancelled
    the task, and lane ``c``'s create got no answer at all."""
    real = wsmod.Connection._dispatch
    peers: list[Peer] = []

    async def dispatch(self: Any, actions: list[Any]) -> None:
        if asyncio.current_task() is self._finisher:  # its socket is slow: it writes after the response ended
            for _ in range(400):
                if any(b'"response.completed"' in f for f in peers[0].sent):
                    break
                await asyncio.sleep(0.005)
        await real(self, actions)

    monkeypatch.setattr(wsmod.Connection, "_dispatch", dispatch)

    async def main() -> Peer:
        app = make_app(Config(store="memory", sim_rate=400, ws_max_in_flight=1))
        await app.startup()
        try:
            peer = Peer([frame(stream_id="a", metadata={"sim": "text,tokens:40"}), frame(stream_id="b"), frame(stream_id="c")])
            peers.append(peer)
            task = asyncio.ensure_future(app({**SCOPE, "extensions": peer.extensions}, peer.receive, peer.send))
            await asyncio.sleep(0.03)  # a streams; b and c wait for the one slot
            [conn] = app.ws_deadlines.connections()
            conn.expire()
            await asyncio.wait_for(task, 10)
            return peer
        finally:
            await app.shutdown()

    peer = asyncio.run(main())
    events = peer.events()
    refused = {e.get("stream_id") for e in events if e["type"] == "error" and e["error"]["code"] == LIMIT}
    assert {"b", "c"} <= refused, events
    assert any(e["type"] == "response.completed" and e.get("stream_id") == "a" for e in events)
    assert peer.closed is not None and peer.closed[0] == 1001


# -- warm-ups ---------------------------------------------------------------------------------


def test_a_warmup_may_omit_input_and_nothing_else_may() -> None:
    from hotloop.protocol.request import convert_body, validate

    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    warm = convert_body({"model": "m", "instructions": "Be brief.", "tools": tools, "generate": False})
    prepared = validate(warm, websocket=True)
    assert prepared is not None
    for body in ({"model": "m", "instructions": "Be brief."}, {"model": "m", "generate": True}):
        with pytest.raises(errors.MissingParameter) as ei:
            validate(convert_body(body), websocket=True)
        assert ei.value.param == "input"


def test_a_failure_expiring_one_connection_does_not_stop_the_timer(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The app's one age-limit timer expires every connection due: one that fails to expire
    closes with 1011, and the connections after it still expire."""
    real = Session.expire
    calls = {"n": 0}

    def expire(self: Session) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise Boom(SECRET)
        return real(self)

    monkeypatch.setattr(Session, "expire", expire)

    async def main() -> list[Peer]:
        app = make_app(Config(store="memory", sim_rate=0, ws_connection_max_age=0.1))
        await app.startup()
        try:
            peers = [Peer([]), Peer([])]
            await asyncio.gather(*(serve(app, p, 5) for p in peers))
            return peers
        finally:
            await app.shutdown()

    with caplog.at_level(logging.INFO):
        first, second = asyncio.run(main())
    assert_internal_close(first, caplog)
    assert second.closed is not None and second.closed[0] == 1001
    assert [e["error"]["code"] for e in second.events()] == [LIMIT]
