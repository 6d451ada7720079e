"""The HTTP protocol's cork (``hotloop.http.cork``): a JSON response is one write, head and
body; an SSE stream's head goes out with its first events and its end with its terminal event.
And the request's tail: answered before its bookkeeping, a request's task must not disturb the
connection's next request, nor be taken for a client that left.

Driven through hotloop's real protocol class, uvicorn's request cycle and the app (simulator
backend) on a transport that records each write: a write is a system call and a loopback
delivery that wakes the client, so their number is what this checks."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from hotloop.config import Config
from hotloop.server.httpproto import BoundedHttpToolsProtocol, Limits
from hotloop.server.runner import make_app, uvicorn_config


class Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _post(body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()
    return b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw)


def _connection(app: Any, config: Config) -> tuple[Any, Recorder]:
    """hotloop's HTTP protocol on a recording transport, as uvicorn makes it for a connection."""
    import uvicorn

    ucfg = uvicorn_config(app, config)
    ucfg.load()
    proto_class = type("P", (BoundedHttpToolsProtocol,), {"limits": Limits(10, 30.0)})
    proto = proto_class(ucfg, uvicorn.server.ServerState(), {}, asyncio.get_running_loop())
    transport = Recorder()
    proto.connection_made(transport)
    return proto, transport


async def _until_written(transport: Recorder, end: bytes) -> None:
    for _ in range(500):
        if transport.writes and transport.writes[-1].endswith(end):
            return
        await asyncio.sleep(0.01)


async def _serve(request: bytes, done: bytes, tmp_path: Any) -> list[bytes]:
    config = Config(store="memory", sim_rate=0, data_dir=str(tmp_path))
    app = make_app(config)
    await app.startup()
    try:
        proto, transport = _connection(app, config)
        proto.data_received(request)
        await _until_written(transport, done)
        await asyncio.sleep(0.05)  # anything written after the end would show
        proto.connection_lost(None)
        return transport.writes
    finally:
        await app.shutdown()


def test_a_json_response_is_one_write(tmp_path: Any) -> None:
    writes = asyncio.run(_serve(_post({"model": "hotloop-sim", "input": "hi"}), b"}", tmp_path))
    assert len(writes) == 1, writes
    head, _, body = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["status"] == "completed"


@pytest.mark.parametrize("error", [False, True])
def test_an_sse_stream_starts_and_ends_without_writes_of_their_own(tmp_path: Any, error: bool) -> None:
    body: dict[str, Any] = {"model": "hotloop-sim", "input": "hi", "stream": True}
    if error:
        body["metadata"] = {"sim": "fail"}  # the stream ends with response.failed
    writes = asyncio.run(_serve(_post(body), b"0\r\n\r\n", tmp_path))
    assert writes[0].startswith(b"HTTP/1.1 200") and b"event: response.created" in writes[0]
    assert writes[-1].endswith(b"0\r\n\r\n") and b"event: response." in writes[-1]
    terminal = b"response.failed" if error else b"response.completed"
    assert terminal in writes[-1]
    assert sum(w.count(b"0\r\n\r\n") for w in writes) >= 1 and not any(w == b"0\r\n\r\n" for w in writes)


# -- the request's tail: its task finishes the response's bookkeeping after the answer --------


class _SlowClose:
    """A backend stream whose close suspends (a real backend's connection being released)."""

    def __init__(self, gen: Any, delay: float) -> None:
        self.gen = gen
        self.delay = delay
        self.closed = False

    def __aiter__(self) -> "_SlowClose":
        return self

    async def __anext__(self) -> Any:
        return await self.gen.__anext__()

    async def aclose(self) -> None:
        await asyncio.sleep(self.delay)
        await self.gen.aclose()
        self.closed = True


@pytest.mark.parametrize("stream", [False, True])
def test_a_finishing_request_leaves_the_next_ones_disconnect_watch_alone(tmp_path: Any, stream: bool) -> None:
    """Request 1 is answered and its task is still closing its backend stream when request 2
    arrives on the same keep-alive connection; request 1's end must not take back request 2's
    disconnect callback, so the client's leaving still stops request 2's generation."""

    async def main() -> None:
        config = Config(store="memory", sim_rate=100, data_dir=str(tmp_path))
        app = make_app(config)
        await app.startup()
        made: list[_SlowClose] = []
        original = app.backend.stream

        def stream_(req: Any) -> _SlowClose:
            made.append(_SlowClose(original(req), 0.3 if not made else 0.0))
            return made[-1]

        app.backend.stream = stream_  # type: ignore[method-assign]
        try:
            proto, transport = _connection(app, config)
            first = {"model": "hotloop-sim", "input": "hi", "stream": stream, "metadata": {"sim": "tokens:1"}}
            proto.data_received(_post(first))
            await _until_written(transport, b"0\r\n\r\n" if stream else b"}")
            second = {"model": "hotloop-sim", "input": "again", "stream": True, "metadata": {"sim": "tokens:3000"}}
            proto.data_received(_post(second))
            await asyncio.sleep(0.5)  # request 1's stream is closed; request 2 streams
            assert made[0].closed and len(app.engine.runs) == 1
            transport.closed = True
            proto.connection_lost(None)  # the client leaves
            for _ in range(100):
                if not app.engine.runs:
                    break
                await asyncio.sleep(0.01)
            assert not app.engine.runs, "request 2 still generates for a client that left"
        finally:
            await app.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_under_another_server_the_answered_request_finishes_its_bookkeeping(tmp_path: Any, stream: bool) -> None:
    """Without hotloop's protocol (httpx's ASGI transport here; plain uvicorn alike), receive()
    reports http.disconnect once the response is complete: that is no client leaving, and the
    request's task still records the turn and closes its backend stream."""
    import httpx

    async def main() -> None:
        app = make_app(Config(store="memory", sim_rate=0, data_dir=str(tmp_path)))
        await app.startup()
        made: list[_SlowClose] = []
        original = app.backend.stream

        def stream_(req: Any) -> _SlowClose:
            made.append(_SlowClose(original(req), 0.01))
            return made[-1]

        app.backend.stream = stream_  # type: ignore[method-assign]
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                body = {"model": "hotloop-sim", "input": "hi", "stream": stream, "metadata": {"sim": "tokens:5"}}
                r = await client.post("/v1/responses", json=body)
            assert r.status_code == 200
            assert b"response.completed" in r.content if stream else r.json()["status"] == "completed"
            assert made[0].closed and len(app.engine.turn_stats) == 1 and app.engine.completed == 1
        finally:
            await app.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("behind", [False, True])
def test_the_answer_waits_for_the_submission_only_while_the_writer_is_behind(tmp_path: Any, stream: bool, behind: bool) -> None:
    """Answered before its bookkeeping while the store's writer keeps up; while it is behind
    (Persistence.has_room false), the response ends only after its submission, so that the
    client's next request on the connection waits too: the back-pressure that bounds what a
    crash can lose (README, Crash safety)."""

    async def main() -> None:
        config = Config(store="sqlite", sim_rate=0, data_dir=str(tmp_path))
        app = make_app(config)
        await app.startup()
        persistence = app.persistence
        at_submit: list[bool] = []  # per submission: was the response already complete on the wire
        submit = persistence.submit

        async def submit_(entry: Any, *args: Any, **kwargs: Any) -> None:
            at_submit.append(any(w.endswith(b"0\r\n\r\n" if stream else b"}") for w in transport.writes))
            await submit(entry, *args, **kwargs)

        persistence.submit = submit_  # type: ignore[method-assign]
        persistence.has_room = lambda: not behind  # type: ignore[method-assign]
        try:
            proto, transport = _connection(app, config)
            body = {"model": "hotloop-sim", "input": "hi", "stream": stream, "store": True}
            proto.data_received(_post(body))
            await _until_written(transport, b"0\r\n\r\n" if stream else b"}")
            await asyncio.sleep(0.05)
            assert at_submit == [not behind]
            proto.connection_lost(None)
        finally:
            await app.shutdown()

    asyncio.run(main())
