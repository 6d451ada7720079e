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


async def _serve(request: bytes, done: bytes | None, tmp_path: Any, access_log: bool = False) -> list[bytes]:
    """What the connection writes for ``request`` until it writes ``done`` at the end of a write
    (``None``: until it closes), and a little longer."""
    config = Config(store="memory", sim_rate=0, data_dir=str(tmp_path), access_log=access_log)
    app = make_app(config)
    await app.startup()
    try:
        proto, transport = _connection(app, config)
        assert proto.access_log is access_log
        proto.data_received(request)
        if done is not None:
            await _until_written(transport, done)
        for _ in range(500 if done is None else 0):
            if transport.closed:
                break
            await asyncio.sleep(0.01)
        assert done is not None or transport.closed, "the connection was not closed"
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


def _head(write: bytes) -> tuple[bytes, list[bytes], bytes]:
    """A response's status line, its header names in order, and its body."""
    head, _, body = write.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    return status, [line.split(b":", 1)[0] for line in lines], body


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/models/nope"])
def test_a_response_written_in_one_call_is_what_uvicorns_send_writes(tmp_path: Any, path: str, monkeypatch: Any) -> None:
    """The one-call answer (hotloop.http.respond) against uvicorn's send, which answers when
    its access log is on: the same status line, headers in the same order, the same body."""
    from hotloop.server import httpproto

    calls: list[bool] = []
    respond = httpproto._respond

    def counted(*args: Any) -> bool:
        calls.append(respond(*args))
        return calls[-1]

    monkeypatch.setattr(httpproto, "_respond", counted)
    request = (
        _post({"model": "hotloop-sim", "input": "hi", "metadata": {"sim": "text,tokens:5"}})
        if path == "/v1/responses"
        else b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path.encode()
    )

    def answer(access_log: bool) -> bytes:
        calls.clear()
        writes = asyncio.run(_serve(request, b"}", tmp_path, access_log))
        assert len(writes) == 1
        assert calls == [not access_log]  # written in one call, or left to uvicorn's send
        return writes[0]

    fast, uvicorns = answer(False), answer(True)
    (s1, h1, b1), (s2, h2, b2) = _head(fast), _head(uvicorns)
    assert s1 == s2 and h1 == h2 and b"content-length" in h1
    if path == "/v1/responses":
        r1, r2 = json.loads(b1), json.loads(b2)
        assert r1["status"] == r2["status"] == "completed" and sorted(r1) == sorted(r2)
        assert [it["type"] for it in r1["output"]] == [it["type"] for it in r2["output"]] == ["message"]
    else:
        assert b1 == b2 and json.loads(b1)["error"]["code"] == "model_not_found"


def test_a_response_written_in_one_call_closes_a_connection_that_asked_and_starts_the_next(tmp_path: Any) -> None:
    """Two pipelined requests, the second with ``connection: close``: both answered in order
    (the first's answer starts the second), the second says ``connection: close`` and closes
    the connection (which ends ``_serve``'s wait; it gives up after 5 s)."""
    two = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\nGET /v1/models/nope HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"

    writes = asyncio.run(_serve(two, None, tmp_path))
    assert len(writes) == 2
    (s1, h1, b1), (s2, h2, b2) = _head(writes[0]), _head(writes[1])
    assert s1.startswith(b"HTTP/1.1 200") and json.loads(b1)["object"] == "list" and b"connection" not in h1
    assert s2.startswith(b"HTTP/1.1 404") and h2[-1] == b"connection" and writes[1].count(b"connection: close") == 1


def test_a_client_not_taking_what_was_written_gets_its_answer_once_it_does(tmp_path: Any) -> None:
    """While the connection's writes are paused (the client does not read), an answer is not
    written in one call but through uvicorn's send, which waits for the client (and so keeps
    the next pipelined request from starting): nothing is written until writing resumes."""

    async def main() -> list[bytes]:
        config = Config(store="memory", sim_rate=0, data_dir=str(tmp_path))
        app = make_app(config)
        await app.startup()
        try:
            proto, transport = _connection(app, config)
            proto.pause_writing()
            proto.data_received(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n" * 2)
            await asyncio.sleep(0.2)
            assert transport.writes == []
            proto.resume_writing()
            for _ in range(500):
                if len(transport.writes) == 2:
                    break
                await asyncio.sleep(0.01)
            proto.connection_lost(None)
            return transport.writes
        finally:
            await app.shutdown()

    writes = asyncio.run(main())
    assert len(writes) == 2 and all(_head(w)[0].startswith(b"HTTP/1.1 200") for w in writes)


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


@pytest.mark.parametrize("access_log", [False, True])
def test_forwarded_headers_are_read_only_for_the_access_log(tmp_path: Any, access_log: bool) -> None:
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    config = Config(store="memory", sim_rate=0, data_dir=str(tmp_path), access_log=access_log)
    app = make_app(config)
    ucfg = uvicorn_config(app, config)
    ucfg.load()
    # without the access log (hotloop never reads the client's address) the app is called
    # directly: no middleware coroutine in every request's chain
    assert (type(ucfg.loaded_app) is ProxyHeadersMiddleware) is access_log
    assert (ucfg.loaded_app is app) is not access_log
