"""The WebSocket transport's small parts: frame headers, the lean queue and flag, the batch send,
lazy per-connection state and the app-wide age-limit timer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from websockets.frames import Frame, Opcode

from hotloop.config import Config
from hotloop.protocol.objects import IdGen
from hotloop.server.runner import make_app
from hotloop.server.wsproto import SEND_TEXTS, WAIT_WRITABLE, _Flag, _Inbox, frame_text


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 65535, 65536, 70000])
def test_frame_text_is_what_websockets_sends(size: int) -> None:
    payload = ("é" * size).encode()[:size]
    assert frame_text(payload) == Frame(Opcode.TEXT, payload).serialize(mask=False, extensions=[])


def test_inbox_keeps_order_and_wakes_a_waiting_getter() -> None:
    async def main() -> list[Any]:
        box = _Inbox()
        assert box.empty()
        getter = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        assert not getter.done()
        box.put_nowait(1)
        box.put_nowait(2)
        first = await getter
        second = await box.get()
        cancelled = asyncio.ensure_future(box.get())  # a cancelled getter takes nothing
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        box.put_nowait(3)
        return [first, second, await asyncio.wait_for(box.get(), 5), box.empty(), box.qsize()]

    assert asyncio.run(main()) == [1, 2, 3, True, 0]


def test_flag_wait_blocks_until_set() -> None:
    async def main() -> list[bool]:
        flag = _Flag()
        assert flag.is_set() and await flag.wait()
        flag.clear()
        waiter = asyncio.ensure_future(flag.wait())
        await asyncio.sleep(0.01)
        blocked = not waiter.done()
        flag.set()
        return [blocked, await waiter, flag.is_set()]

    assert asyncio.run(main()) == [True, True, True]


# -- the app's WebSocket connection, driven in-process ----------------------------------------


class _Client:
    """An ASGI WebSocket peer: frames to send, everything received, optional batch send."""

    def __init__(self, frames: list[str], *, batch: bool, writable_after: int = 0) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.inbox.put_nowait({"type": "websocket.connect"})
        for f in frames:
            self.inbox.put_nowait({"type": "websocket.receive", "text": f})
        self.sent: list[bytes] = []
        self.closed: int | None = None
        self.waits = 0
        self.batches = 0
        self.terminal_now: list[bool] = []  # per terminal batch: written at once (send_texts now)
        self.writable_after = writable_after
        self.extensions: dict[str, Any] = {"websocket.http.response": {}}
        if batch:
            self.extensions[SEND_TEXTS] = self.send_texts
            self.extensions[WAIT_WRITABLE] = self.wait_writable

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "websocket.send":
            self.sent.append(msg["text"].encode())
        elif msg["type"] == "websocket.close":
            self.closed = msg["code"]
            self.inbox.put_nowait({"type": "websocket.disconnect", "code": msg["code"]})

    def send_texts(self, events: list[tuple[str, bytes]], now: bool = False, within: float = 0.0) -> bool:
        self.sent.extend(p for _, p in events)
        self.batches += 1
        if any(b'"response.completed"' in p[:40] for _, p in events):
            self.terminal_now.append(now)
        return self.batches % 3 != 0 or self.writable_after == 0  # every third batch: "paused"

    async def wait_writable(self) -> None:
        self.waits += 1
        await asyncio.sleep(0)

    def leave(self) -> None:
        self.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(b) for b in self.sent]


_SCOPE = {"type": "websocket", "path": "/v1/responses", "headers": [], "query_string": b"", "subprotocols": []}


def _frame(**kw: Any) -> str:
    return json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi", "store": False, **kw})


async def _converse(client: _Client, app: Any, terminals: int) -> None:
    task = asyncio.ensure_future(app({**_SCOPE, "extensions": client.extensions}, client.receive, client.send))
    for _ in range(2000):
        if sum(1 for e in client.sent if b'"response.completed"' in e or b'"type":"error"' in e) >= terminals:
            break
        await asyncio.sleep(0.005)
    client.leave()
    await asyncio.wait_for(task, 10)


def _deterministic(app: Any) -> None:
    app.engine.ids = IdGen(deterministic=True)
    app.engine.clock = lambda: 1_700_000_000.0


def test_batch_send_writes_the_same_bytes_as_asgi_messages() -> None:
    frames = [
        _frame(metadata={"sim": "text,tokens:40"}),
        _frame(metadata={"sim": "text,tokens:7"}),  # one lane: the order is fixed (lanes interleave)
        "not json",
    ]

    async def one(batch: bool) -> _Client:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        try:
            _deterministic(app)
            client = _Client(frames, batch=batch, writable_after=1)
            await _converse(client, app, 3)
            return client
        finally:
            await app.shutdown()

    plain = asyncio.run(one(False))
    fast = asyncio.run(one(True))
    assert fast.sent == plain.sent
    assert fast.batches > 3 and fast.waits > 0  # the batch path ran and honoured back-pressure
    assert fast.terminal_now == [True, True]  # the terminal event is written at once, before the bookkeeping
    events = fast.events()
    assert [e["type"] for e in events].count("response.completed") == 2
    assert events[-2]["type"] == "response.completed" and events[-1]["type"] == "error"


def test_an_idle_connection_holds_no_session_worker_or_queue() -> None:
    async def main() -> None:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        try:
            client = _Client([], batch=True)
            task = asyncio.ensure_future(app({**_SCOPE, "extensions": client.extensions}, client.receive, client.send))
            await asyncio.sleep(0.05)
            [conn] = list(app.ws_deadlines._conns)
            assert conn.session is None and conn.cache is None and not conn._lane_tasks
            client.inbox.put_nowait({"type": "websocket.receive", "text": _frame(metadata={"sim": "tokens:3"})})
            for _ in range(400):
                if any(b'"response.completed"' in e for e in client.sent):
                    break
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.01)
            assert conn.session is not None and not conn._lane_tasks  # the lane's task left with its work
            client.leave()
            await asyncio.wait_for(task, 10)
            assert len(app.ws_deadlines) == 0
        finally:
            await app.shutdown()

    asyncio.run(main())


def test_one_timer_expires_each_connection_at_its_own_age_limit() -> None:
    async def main() -> None:
        app = make_app(Config(store="memory", sim_rate=0, ws_connection_max_age=0.3))
        await app.startup()
        loop = asyncio.get_running_loop()
        try:
            clients = [_Client([], batch=True) for _ in range(3)]
            tasks = []
            opened = []
            for c in clients:
                tasks.append(asyncio.ensure_future(app({**_SCOPE, "extensions": c.extensions}, c.receive, c.send)))
                opened.append(loop.time())
                await asyncio.sleep(0.1)
            clients[1].leave()  # closes before its deadline: never told anything
            await asyncio.wait_for(asyncio.gather(*tasks), 5)
            closed_at = loop.time()
            assert [c.closed for c in clients] == [1001, None, 1001]
            for c in (clients[0], clients[2]):
                [err] = c.events()
                assert err["error"]["code"] == "websocket_connection_limit_reached"
            assert clients[1].sent == []
            assert closed_at - opened[2] >= 0.3
            assert len(app.ws_deadlines) == 0
        finally:
            await app.shutdown()

    asyncio.run(main())
