"""A scriptable mock of a chat-completions API on a real loopback socket.

Raw asyncio HTTP/1.1 (keep-alive, chunked streaming) in a background thread, so a test can make
it stall, fail or drop the connection mid-stream exactly where it wants. Serves:

* ``POST /v1/chat/completions``: the next scripted :class:`Reply` (or a short default answer);
* ``GET /v1/models`` and ``GET /v1/tcp_warming`` (the Cerebras SDK's warm-up).

Every chat request is recorded (:attr:`MockChatServer.requests`), raw body bytes included, so
tests can check the rendered request and its byte-stability across turns. Every streamed answer
is recorded too (:attr:`MockChatServer.streams`): whether it was written to the end or its
client went away first, and when the mock saw the client go (its socket closed or reset).

    with MockChatServer() as mock:
        mock.push(Reply.stream(text_events("Hello")))
        ...  # point a client at mock.url (Cerebras SDK) or mock.v1 (OpenAI-style base URL)
        assert mock.requests[0].json["messages"][-1]["content"] == "hi"
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Union

# -- scripting ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sleep:
    """Pause the stream (a stall when longer than the client's idle timeout)."""

    seconds: float


@dataclass(frozen=True)
class Disconnect:
    """Drop the TCP connection abruptly, mid-body."""


Event = Union[dict[str, Any], str, Sleep, Disconnect]  # a dict is sent as ``data: <json>``; str raw


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)  # SSE body (status 200)
    body: Any = None  # JSON body (errors)
    raw: bytes | None = None  # a non-2xx body sent as these bytes, not as JSON (Reply.text)
    hangup: bool = False  # close the connection without answering (Reply.hang_up)

    @classmethod
    def stream(cls, events: list[Event], *, done: bool = True, headers: dict[str, str] | None = None) -> "Reply":
        evs = list(events) + (["data: [DONE]\n\n"] if done else [])
        return cls(events=evs, headers=dict(headers or {}))

    @classmethod
    def error(cls, status: int, body: Any, headers: dict[str, str] | None = None) -> "Reply":
        return cls(status=status, body=body, headers=dict(headers or {}))

    @classmethod
    def text(cls, status: int, raw: bytes, headers: dict[str, str] | None = None) -> "Reply":
        """A non-2xx answer whose body is ``raw`` as is (an HTML error page, plain text)."""
        return cls(status=status, raw=raw, headers={"content-type": "text/plain", **(headers or {})})

    @classmethod
    def hang_up(cls) -> "Reply":
        """Read the request, then close the connection without a byte of answer."""
        return cls(hangup=True)


def chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
    *,
    choices: bool = True,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` (``choices=False``: the final usage-only chunk)."""
    out: dict[str, Any] = {
        "id": "chatcmpl-mock",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "mock-model",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if choices else [],
    }
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def text_events(
    text: str, *, pieces: int = 4, reasoning: str = "", finish: str = "stop", use: dict[str, Any] | None = None
) -> list[Event]:
    """Role chunk, optional reasoning deltas, ``text`` in ``pieces`` deltas, finish, usage chunk."""
    out: list[Event] = [chunk({"role": "assistant", "content": ""})]
    for part in _split(reasoning, pieces):
        out.append(chunk({"reasoning": part}))
    for part in _split(text, pieces):
        out.append(chunk({"content": part}))
    out.append(chunk({}, finish))
    out.append(chunk(usage=use or usage(10, max(1, pieces)), choices=False))
    return out


def tool_events(calls: list[tuple[str, str, str]], *, pieces: int = 5, use: dict[str, Any] | None = None) -> list[Event]:
    """Calls ``(call_id, name, arguments)`` one after the other, arguments split in ``pieces``."""
    out: list[Event] = [chunk({"role": "assistant"})]
    for i, (call_id, name, args) in enumerate(calls):
        out.append(chunk({"tool_calls": [{"index": i, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]}))
        for part in _split(args, pieces):
            out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": part}}]}))
    out.append(chunk({}, "tool_calls"))
    out.append(chunk(usage=use or usage(20, 12), choices=False))
    return out


def paced_events(tokens: int, interval: float, *, ttft: float = 0.0) -> list[Event]:
    """A long text answer: ``tokens`` one-word deltas ``interval`` seconds apart, after ``ttft``."""
    out: list[Event] = [Sleep(ttft)] if ttft else []
    out.append(chunk({"role": "assistant", "content": ""}))
    for i in range(tokens):
        out.append(Sleep(interval))
        out.append(chunk({"content": f" w{i}"}))
    out.append(chunk({}, "stop"))
    out.append(chunk(usage=usage(10, tokens), choices=False))
    return out


def _split(text: str, pieces: int) -> list[str]:
    if not text:
        return []
    n = max(1, min(pieces, len(text)))
    step = -(-len(text) // n)
    return [text[i : i + step] for i in range(0, len(text), step)]


# -- recording ------------------------------------------------------------------------------------


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Streamed:
    """One streamed (200) answer: ``completed`` once written to the end; ``gone_at``
    (``time.monotonic()``) when the client went away before that."""

    request: Recorded
    opened_at: float = field(default_factory=time.monotonic)  # when its request was read
    completed: bool = False
    gone_at: float | None = None


DEFAULT_REPLY_TEXT = "Hello from the mock."

# -- the server -----------------------------------------------------------------------------------

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


class MockChatServer:
    """Start with ``with MockChatServer() as mock`` (or :meth:`start` / :meth:`stop`)."""

    def __init__(self, models: tuple[str, ...] = ("gpt-oss-120b", "mock-model")) -> None:
        self.models = models
        self.model_fields: dict[str, dict[str, Any]] = {}  # extra fields of a model's /models entry
        self.requests: list[Recorded] = []
        self.other_requests: list[Recorded] = []  # models, warm-up, unknown paths
        self.connections = 0  # TCP connections accepted (since the last reset)
        self.streams: list[Streamed] = []  # streamed answers, in order
        self.default_reply: Any = None  # () -> Reply when nothing is pushed (None: a short answer)
        self._replies: deque[Reply] = deque()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mock-chat-server", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> "MockChatServer":
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(timeout=10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def _stop() -> None:
            assert self._server is not None
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "MockChatServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Base URL without ``/v1`` (what the Cerebras SDK wants)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        """Base URL with ``/v1`` (what OpenAI-style clients want)."""
        return self.url + "/v1"

    # -- scripting --------------------------------------------------------------------------------

    def push(self, *replies: Reply) -> None:
        with self._lock:
            self._replies.extend(replies)

    def reset(self) -> None:
        with self._lock:
            self._replies.clear()
            self.requests.clear()
            self.other_requests.clear()
            self.streams.clear()
            self.connections = 0
            self.default_reply = None

    def _next_reply(self) -> Reply:
        with self._lock:
            if self._replies:
                return self._replies.popleft()
            make = self.default_reply
        return make() if make is not None else Reply.stream(text_events(DEFAULT_REPLY_TEXT))

    def stream_counts(self) -> tuple[int, int, int]:
        """(written to the end, client went away, still streaming) over :attr:`streams`."""
        with self._lock:
            done = sum(1 for st in self.streams if st.completed)
            gone = sum(1 for st in self.streams if st.gone_at is not None)
            return done, gone, len(self.streams) - done - gone

    # -- HTTP ---------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                rec = Recorded(method, path, headers, body)
                if not await self._route(rec, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _route(self, rec: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; ``False`` when the connection must be closed."""
        if rec.method == "POST" and rec.path == "/v1/chat/completions":
            with self._lock:
                self.requests.append(rec)
            return await self._reply(self._next_reply(), rec, reader, writer)
        with self._lock:
            self.other_requests.append(rec)
        if rec.method == "GET" and rec.path == "/v1/models":
            data = [
                {"id": m, "object": "model", "created": 1_700_000_000, "owned_by": "mock", **self.model_fields.get(m, {})}
                for m in self.models
            ]
            await self._json(writer, 200, {"object": "list", "data": data}, {})
        elif rec.method == "GET" and rec.path == "/v1/tcp_warming":
            await self._json(writer, 200, {}, {})
        else:
            await self._json(writer, 404, {"error": {"message": "no such path", "type": "not_found", "code": None}}, {})
        return True

    async def _json(self, writer: asyncio.StreamWriter, status: int, obj: Any, headers: dict[str, str]) -> None:
        payload = json.dumps(obj).encode()
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", "content-type: application/json",
                f"content-length: {len(payload)}"] + [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()

    async def _reply(
        self, reply: Reply, rec: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        if reply.hangup:
            writer.transport.abort()
            return False
        if reply.raw is not None:
            head = [f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Status')}", f"content-length: {len(reply.raw)}"]
            head += [f"{k}: {v}" for k, v in reply.headers.items()]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + reply.raw)
            await writer.drain()
            return True
        if reply.status != 200:
            await self._json(writer, reply.status, reply.body, reply.headers)
            return True
        st = Streamed(rec)
        with self._lock:
            self.streams.append(st)
        # The client sends nothing while it reads the answer (HTTP/1.1, no pipelining): a read
        # that ends means it closed or reset the connection.
        watcher = asyncio.ensure_future(reader.read(1))

        def gone(_: object) -> None:
            if st.gone_at is None and not st.completed:
                st.gone_at = time.monotonic()

        watcher.add_done_callback(gone)
        try:
            head = ["HTTP/1.1 200 OK", "content-type: text/event-stream", "transfer-encoding: chunked"]
            head += [f"{k}: {v}" for k, v in reply.headers.items()]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
            for ev in reply.events:
                if st.gone_at is not None:
                    return False
                if isinstance(ev, Sleep):
                    await writer.drain()
                    await asyncio.wait([watcher], timeout=ev.seconds)
                    continue
                if isinstance(ev, Disconnect):
                    await writer.drain()
                    writer.transport.abort()
                    return False
                data = ev if isinstance(ev, str) else f"data: {json.dumps(ev)}\n\n"
                raw = data.encode()
                writer.write(b"%x\r\n%s\r\n" % (len(raw), raw))
                await writer.drain()
            if st.gone_at is not None:
                return False
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            st.completed = True
            return True
        finally:
            watcher.cancel()
            # let the cancellation land before the connection's next request is read: a reader
            # still waiting makes that read fail ("readuntil() called while another coroutine
            # is already waiting for incoming data")
            await asyncio.wait([watcher])
