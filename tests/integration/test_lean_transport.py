"""The lean HTTP/1.1 transport against real loopback servers, plain and TLS (trustme certificates).

Each test runs a small asyncio server whose handler scripts the exact bytes it answers with, so
the client's behaviour on keep-alive, closes, stalls, garbage and oversized heads is pinned.
"""

from __future__ import annotations

import asyncio
import time
import ssl
from typing import Any, Awaitable, Callable

import pytest
import trustme

from hotloop import errors
from hotloop.backends.chat import TransientBackendError
from hotloop.backends.chat.http1 import Pool, open_chat_stream, proxy_for

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUT = 10.0


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (Content-Length bodies only: what the client sends)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return head, body


def sse_reply(*events: bytes, chunked: bool = True, extra: bytes = b"") -> bytes:
    body = b"".join(b"data: " + e + b"\n\n" for e in events)
    if chunked:
        framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body,) if p) + b"0\r\n\r\n"
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" + extra + b"\r\n" + framed
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


class Served:
    """A loopback server running ``handler`` per connection; counts connections."""

    def __init__(self, handler: Handler, ssl_ctx: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.ssl_ctx = ssl_ctx
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> "Served":
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=self.ssl_ctx)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/v1"


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, TIMEOUT))  # type: ignore[arg-type]


async def collect(resp: Any) -> bytes:
    out = b""
    async for data in resp:
        out += data
    return out


async def keepalive_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        head, body = await read_request(reader)
        assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        writer.write(sse_reply(b'{"n":1}', body or b"{}", b"[DONE]"))
        await writer.drain()


def test_streams_and_reuses_one_connection() -> None:
    async def main() -> None:
        async with Served(keepalive_handler) as srv:
            pool = Pool(srv.url(), headers={"Authorization": "Bearer k", "Accept": "text/event-stream"})
            for i in range(3):
                resp = await pool.stream("POST", "/chat/completions", b'{"i":%d}' % i)
                assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
                assert await collect(resp) == b'data: {"n":1}\n\ndata: {"i":%d}\n\ndata: [DONE]\n\n' % i
                await resp.aclose()
            assert srv.connections == 1 and pool.opened == 1 and pool.reused == 2 and pool.idle == 1
            await pool.aclose()

    run(main())


def test_a_body_in_pieces_is_sent_as_their_concatenation() -> None:
    """A request body given as a list of pieces (a conversation's cached renderings) is written
    in one vectored write, with the content length of the whole."""
    pieces = [b'{"messages":[', b'{"role":"user","content":"' + b"x" * 70_000 + b'"}', *(b',{"k":%d}' % i for i in range(100)), b"]}"]
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            seen.append(head)
            writer.write(sse_reply(body, b"[DONE]"))
            await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            for body in (pieces, b"".join(pieces)):
                resp = await pool.stream("POST", "/chat/completions", body)
                assert await collect(resp) == b"data: " + b"".join(pieces) + b"\n\ndata: [DONE]\n\n"
            assert all(b"content-length: %d\r\n" % sum(map(len, pieces)) in h for h in seen) and len(seen) == 2
            await pool.aclose()

    run(main())


def test_a_body_in_pieces_is_joined_only_for_tls() -> None:
    """Plain HTTP writes the pieces as they are (one vectored write, no copy); TLS would make a
    record of each, so there they are joined first."""
    from hotloop.backends.chat.http1 import Response, _Conn

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[list[bytes]] = []

        def writelines(self, data: Any) -> None:
            self.calls.append(list(data))

    pieces = [b'{"a":', b"1", b"}"]

    async def main() -> None:
        for url, expect in (("http://127.0.0.1:9/v1", [b"HEAD", *pieces]), ("https://127.0.0.1:9/v1", [b"HEAD", b'{"a":1}'])):
            pool = Pool(url)
            conn = _Conn(pool)
            conn.transport = rec = Recorder()  # type: ignore[assignment]
            conn.send(b"HEAD", pieces, Response(conn))
            conn._cancel_timer()
            assert rec.calls == [expect], url

    run(main())


def test_release_after_done_keeps_the_connection() -> None:
    """[DONE] arrives before the chunked terminator: release() must not wait for it, and the
    connection still goes back to the pool once the terminator arrives."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            payload = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            for _ in range(2):
                resp = await pool.stream("POST", "/chat/completions", b"{}")
                first = await resp.__anext__()
                assert first == b"data: [DONE]\n\n"
                await resp.release()
                await resp.aclose()
                for _ in range(100):
                    if pool.idle:
                        break
                    await asyncio.sleep(0.01)
            assert srv.connections == 1 and pool.reused == 1
            await pool.aclose()

    run(main())


def test_content_length_and_close_delimited_bodies() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await read_request(reader)
        if body == b"cl":
            writer.write(sse_reply(b"[DONE]", chunked=False))
            _, body = await read_request(reader)
        # read-until-close body: no length, no chunking, then EOF
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\ndata: x\n\n")
        await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            resp = await pool.stream("POST", "/chat/completions", b"cl")
            assert await collect(resp) == b"data: [DONE]\n\n"
            resp = await pool.stream("POST", "/chat/completions", b"eof")
            assert await collect(resp) == b"data: x\n\n"
            await resp.aclose()
            assert pool.reused == 1
            for _ in range(100):
                if pool.open == 0:
                    break
                await asyncio.sleep(0.01)
            assert pool.open == 0 and pool.idle == 0  # connection: close is never kept
            await pool.aclose()

    run(main())


def test_server_closing_idle_connections_is_not_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(sse_reply(b"[DONE]"))
        await writer.drain()
        # then close the kept-alive connection while the client holds it idle

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            for _ in range(3):
                resp = await pool.stream("POST", "/chat/completions", b"{}")
                assert await collect(resp) == b"data: [DONE]\n\n"
                await asyncio.sleep(0.05)  # the server's close reaches the idle connection
            assert srv.connections == 3 and pool.reused == 0 and pool.open == 0
            await pool.aclose()

    run(main())


def test_dropped_connection_mid_stream() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: x\n\n\r\n")
        await writer.drain()
        writer.transport.abort()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            with pytest.raises(TransientBackendError):
                await collect(resp)
            assert pool.open == 0 and pool.idle == 0
            await pool.aclose()

    run(main())


def test_server_that_never_answers_times_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), first_byte_timeout=0.2)
            with pytest.raises(errors.BackendTimeout):
                await pool.stream("POST", "/chat/completions", b"{}")
            assert pool.open == 0
            await pool.aclose()

    run(main())


def test_the_wait_for_the_first_token_is_bounded_by_the_first_byte_timeout() -> None:
    """A streaming server sends its head at once and its first token after prefill: until the
    body's first byte the first-byte timeout applies (longer), then the idle timeout."""
    async def slow_first_token(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.6)  # longer than the idle timeout, shorter than the first-byte one
        writer.write(b"9\r\ndata: x\n\n\r\n0\r\n\r\n")
        await writer.drain()

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def main() -> None:
        async with Served(slow_first_token) as srv:
            pool = Pool(srv.url(), first_byte_timeout=3.0, idle_timeout=0.2)
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            assert await collect(resp) == b"data: x\n\n"
            await pool.aclose()
        async with Served(never) as srv:
            pool = Pool(srv.url(), first_byte_timeout=0.5, idle_timeout=0.2)
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            t0 = time.monotonic()
            with pytest.raises(errors.BackendTimeout) as ei:
                await resp.__anext__()
            assert 0.4 < time.monotonic() - t0 < 2.0 and "did not answer in time" in ei.value.message
            assert pool.open == 0
            await pool.aclose()

    run(main())


def test_silence_mid_body_times_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: x\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), idle_timeout=0.2)
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            assert await resp.__anext__() == b"data: x\n\n"
            with pytest.raises(errors.BackendTimeout):
                await resp.__anext__()
            assert pool.open == 0
            await pool.aclose()

    run(main())


@pytest.mark.parametrize(
    "answer",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (70 * 1024) + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(300)) + b"\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"a: b\r\n" * 300 + b"\r\n",  # one name repeated: as many fields
    ],
    ids=["garbage-status-line", "oversized-header", "too-many-headers", "too-many-repeated-headers"],
)
def test_invalid_answers_are_backend_errors(answer: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            with pytest.raises(errors.BackendError) as info:
                await pool.stream("POST", "/chat/completions", b"{}")
            assert type(info.value) is errors.BackendError
            assert pool.open == 0
            await pool.aclose()

    run(main())


def test_non_2xx_json_error_maps_to_typed_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            body = b'{"error": {"message": "slow down", "code": "rate_limit"}}'
            writer.write(
                b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 3\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            for _ in range(2):
                with pytest.raises(errors.RateLimited) as info:
                    await open_chat_stream(pool, "/chat/completions", b"{}", backend="test", model="m")
                assert info.value.retry_after == 3.0
            # an error answer to a request with a body closes its connection, fully read or not:
            # the server may have answered without reading the request's body (the next test file)
            assert srv.connections == 2 and pool.reused == 0
            await pool.aclose()

    run(main())


def test_cancelling_mid_stream_closes_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(200):
            writer.write(b"9\r\ndata: x\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            resp = await pool.stream("POST", "/chat/completions", b"{}")

            async def consume() -> None:
                async for _ in resp:
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await resp.aclose()
            assert pool.open == 0 and pool.idle == 0
            resp2 = await asyncio.wait_for(pool.stream("POST", "/chat/completions", b"{}"), 2)
            assert srv.connections == 2  # never reused
            await resp2.aclose()
            await pool.aclose()

    run(main())


def test_unreachable_origin_is_unavailable() -> None:
    async def main() -> None:
        async with Served(keepalive_handler) as srv:
            url = srv.url()
        pool = Pool(url, connect_timeout=2)
        with pytest.raises(errors.BackendUnavailable):
            await pool.stream("POST", "/chat/completions", b"{}")
        assert pool.open == 0

    run(main())


def test_tls_with_a_trusted_ca_and_sni(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    seen: list[str | None] = []
    server_ctx.sni_callback = lambda sock, name, ctx: seen.append(name)  # type: ignore[assignment,misc]
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))

    async def main() -> None:
        async with Served(keepalive_handler, server_ctx) as srv:
            url = f"https://localhost:{srv.port}/v1"
            # Not trusted: certifi's bundle does not hold the test CA.
            monkeypatch.delenv("SSL_CERT_FILE", raising=False)
            monkeypatch.delenv("SSL_CERT_DIR", raising=False)
            untrusted = Pool(url)
            with pytest.raises(errors.BackendUnavailable):
                await untrusted.stream("POST", "/chat/completions", b"{}")
            # Trusted through SSL_CERT_FILE, as httpx honours it.
            monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
            pool = Pool(url)
            for _ in range(2):
                resp = await pool.stream("POST", "/chat/completions", b"{}")
                assert (await collect(resp)).endswith(b"data: [DONE]\n\n")
            # a body in pieces goes through TLS as their concatenation too
            resp = await pool.stream("POST", "/chat/completions", [b'{"a":', b"1", b"}"])
            assert b'data: {"a":1}\n\n' in await collect(resp)
            assert pool.opened == 1 and pool.reused == 2
            assert "localhost" in seen
            await pool.aclose()

    run(main())


@pytest.mark.parametrize("tls", [False, True])
def test_a_read_pause_leaves_the_bytes_in_the_kernel(tls: bool, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read pause (``read_pause``) after each read the response's push took whole: the
    chunks the server sends meanwhile stay in the socket, over TLS too (a TLS transport's
    pause alone would stop only what it hands over, its TLS layer reading the socket on every
    arrival), and all arrive, in order, in few reads of the socket."""
    pieces = [b"chunk %02d" % i for i in range(30)]

    async def paced(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for p in pieces:
                event = b"data: " + p + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.002)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    ctx = None
    if tls:
        ca = trustme.CA()
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("localhost", "127.0.0.1").configure_cert(ctx)
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))

    async def main() -> None:
        async with Served(paced, ctx) as srv:
            url = f"https://localhost:{srv.port}/v1" if tls else srv.url()
            pool = Pool(url, read_pause=0.03, pause_streams=1)
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            conn = resp._conn
            socket_reads = [0]
            if tls:  # the TLS layer's reads of the socket (asyncio's TLS protocol, a Python object)
                tls_layer = conn.transport._ssl_protocol
                updated = tls_layer.buffer_updated

                def counted(nbytes: int) -> None:
                    socket_reads[0] += 1
                    updated(nbytes)

                tls_layer.buffer_updated = counted
            got: list[bytes] = []  # in arrival order, pushed or read by the reader
            pushed: list[int] = []

            def push(body: bytes) -> bool:  # taken whole: a pause follows
                got.append(body)
                pushed.append(len(body))
                return True

            resp.push = push
            async for data in resp:  # what came before the reader waited (the first chunk, with the head)
                got.append(data)
            assert b"".join(got) == b"".join(b"data: " + p + b"\n\n" for p in pieces) and len(pushed) >= 3
            # 30 chunks over about 60-90 ms: a read per pause, of the socket too
            assert conn.reads <= 12, conn.reads
            assert socket_reads[0] <= (15 if tls else 0), socket_reads
            # the connection goes back to the pool reading, its buffer limits the defaults again
            assert pool.idle == 1 and conn.nap is None and conn.transport.is_reading()
            if tls:
                assert conn.transport.get_read_buffer_limits()[1] > 0
            await pool.aclose()

    run(main())


def test_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert proxy_for("https://api.example.com") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    assert proxy_for("https://api.example.com") == "http://proxy.internal:3128"
    assert proxy_for("http://api.example.com") is None
    monkeypatch.setenv("NO_PROXY", "example.com")
    assert proxy_for("https://api.example.com") is None


def test_the_chunks_of_one_read_reach_the_response_in_one_piece() -> None:
    """A streaming server sends one SSE event per chunk of a chunked body, and several chunks
    arrive in one read when it writes them together (it fell behind, or a read pause held
    them): the parser reports each chunk on its own, and the response gets the read's chunks
    joined, once, in order, the read that ends the body included (before its end)."""
    first = [b"data: early %02d\n\n" % i for i in range(20)]
    last = [b"data: late %02d\n\n" % i for i in range(10)]

    async def batched(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        for events, end in ((first, b""), (last, b"0\r\n\r\n")):
            await asyncio.sleep(0.05)  # the client reads the head and waits for the body
            writer.write(b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + end)  # one write, one read
            await writer.drain()
        await reader.read()  # until the client closes

    async def main() -> None:
        async with Served(batched) as srv:
            pool = Pool(srv.url())
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            pushed: list[bytes] = []

            def push(body: bytes) -> bool:
                pushed.append(body)
                return True

            resp.push = push
            rest = await collect(resp)  # whatever the push did not take (nothing, here)
            assert rest == b""
            assert pushed == [b"".join(first), b"".join(last)]  # one call per read, not per chunk
            await pool.aclose()

    run(main())


@pytest.mark.parametrize("together", [True, False], ids=["one-read", "later"])
def test_an_interim_response_is_skipped_and_the_final_one_read(together: bool) -> None:
    """A 1xx (103 Early Hints, 100 Continue, 102 Processing) is not the answer: its head is
    skipped and the final response read on the same connection. Taken as the answer, the
    connection went back to the pool with the real answer still coming, and the next request
    sent over it read the previous one's answer."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        while True:
            await read_request(reader)
            n += 1
            final = sse_reply(b"answer-for-request-%d" % n)
            if n == 1:
                interim = b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n"
                if together:
                    writer.write(interim + final)
                else:
                    writer.write(interim)
                    await writer.drain()
                    await asyncio.sleep(0.2)  # the model's prefill
                    writer.write(final)
            else:
                writer.write(final)
            await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), max_connections=1)
            r1 = await open_chat_stream(pool, "/chat/completions", b"{}", backend="t", model="m")
            assert r1.status == 200 and "link" not in r1.headers
            assert await collect(r1) == b"data: answer-for-request-1\n\n"
            r2 = await open_chat_stream(pool, "/chat/completions", b"{}", backend="t", model="m")
            assert await collect(r2) == b"data: answer-for-request-2\n\n"
            assert srv.connections == 1 and pool.reused == 1
            await pool.aclose()

    run(main())


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\n" + b"link: </x>\r\n" * 200 + b"\r\n",  # then nothing
    ],
    ids=["101", "103-then-silence"],
)
def test_interim_answers_that_never_lead_to_a_final_one_fail(answer: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), first_byte_timeout=0.5)
            with pytest.raises(errors.HotloopError) as caught:
                await pool.stream("POST", "/chat/completions", b"{}")
            if answer.startswith(b"HTTP/1.1 101"):
                assert caught.value.message == "The model backend sent a response that is not valid HTTP."
            else:
                assert isinstance(caught.value, errors.BackendTimeout)
            assert pool.open == 0
            await pool.aclose()

    run(main())


def test_endless_interim_responses_fail_as_an_oversized_head() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for _ in range(200):
            writer.write(b"HTTP/1.1 102 Processing\r\n\r\n")
            await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), first_byte_timeout=5)
            with pytest.raises(errors.BackendError, match="oversized response headers"):
                await pool.stream("POST", "/chat/completions", b"{}")
            await pool.aclose()

    run(main())


def test_one_endless_header_field_fails_as_an_oversized_head() -> None:
    """The parser holds a field until it ends: the head's bound holds for an unfinished one too
    (8 MiB of one value took 17 MB and waited for the first-byte timeout)."""
    sent: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-junk: ")
        piece = b"a" * 65536
        for _ in range(128):
            writer.write(piece)
            await writer.drain()
            sent.append(len(piece))
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), first_byte_timeout=8)
            t0 = time.monotonic()
            with pytest.raises(errors.BackendError, match="oversized response headers"):
                await pool.stream("POST", "/chat/completions", b"{}")
            assert time.monotonic() - t0 < 4  # at the bound, not at the first-byte timeout
            assert pool.open == 0
            await pool.aclose()

    run(main())


def test_a_pushed_read_the_assembler_refuses_fails_as_the_same_bytes_read_otherwise() -> None:
    """A malformed tool call (arguments for a call already closed) in a read taken by push
    delivery: the stream fails with the assembler's error, after the chunks before it, as when
    the reader takes the read. It had escaped the transport's read callback: asyncio logged a
    fatal error and the stream failed as a connection the backend closed (a transient error)."""
    import json

    from hotloop.backends.base import BackendRequest, PushSlot
    from hotloop.backends.chat import ChatBackend
    from hotloop.protocol.request import decode_items

    events = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                              "function": {"name": "f", "arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {"content": "hi"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "x"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for e in events:
                await asyncio.sleep(0.03)  # a read of its own each, while the reader waits
                data = b"data: " + json.dumps(e).encode() + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
            writer.write(b"14\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            await writer.drain()

    class Backend(ChatBackend):
        name = "t"

        def __init__(self, pool: Pool) -> None:
            super().__init__(model="m", retries=0)
            self._pool = pool

        async def _open(self, body: Any, model: str, request_id: str | None = None) -> Any:
            return await open_chat_stream(self._pool, "/chat/completions", body, backend=self.name, model=model)

    async def outcome(push: bool) -> tuple[str, str, int]:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            slot = PushSlot() if push else None
            req = BackendRequest(model="m", instructions=None, items=decode_items("hi"), tools=[], tool_choice="auto",
                                 parallel_tool_calls=True, push=slot)
            got: list[Any] = []
            stream = ChatBackend.stream(Backend(pool), req)
            if slot is not None:
                slot.fn = lambda chunks: (got.extend(chunks), len(chunks))[1]
            with pytest.raises(errors.HotloopError) as caught:
                async for c in stream:
                    got.append(c)
            await pool.aclose()
            return type(caught.value).__name__, caught.value.message, len(got)

    async def main() -> None:
        pulled = await outcome(False)
        assert pulled[:2] == ("BackendError", "The model backend sent a malformed tool call.")
        assert await outcome(True) == pulled

    run(main())


def test_a_waiter_woken_then_cancelled_passes_the_wake_up_on() -> None:
    """At the pool's bound, the waiter handed a freed connection is cancelled before it runs
    (its client left): the next waiter gets the connection at once, not after its timeout."""
    go = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        while True:
            await read_request(reader)
            n += 1
            if n == 1:  # the first answer ends once two more requests wait for the connection
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                await writer.drain()
                await go.wait()
                writer.write(b"9\r\ndata: x\n\n\r\n0\r\n\r\n")
            else:
                writer.write(sse_reply(b"x"))
            await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), max_connections=1, connect_timeout=3)
            loop = asyncio.get_running_loop()
            first = await pool.stream("POST", "/c", b"{}")

            async def user() -> float:
                await collect(await pool.stream("POST", "/c", b"{}"))
                return loop.time()

            b = asyncio.create_task(user())
            await asyncio.sleep(0.01)
            c = asyncio.create_task(user())
            await asyncio.sleep(0.05)
            assert len(pool._waiters) == 2
            go.set()
            t0 = loop.time()
            await collect(first)  # its end frees the connection and wakes b
            b.cancel()  # b's client leaves in the same loop iteration
            with pytest.raises(asyncio.CancelledError):
                await b
            assert await c - t0 < 1.0
            await pool.aclose()

    run(main())


def test_a_consumer_that_takes_its_time_is_not_backend_silence() -> None:
    """More than MAX_PENDING_BYTES waiting pauses reading (back-pressure); while paused, the
    backend is not silent: the idle timer waits on (it had failed a steady stream whose
    consumer paused for longer than the idle timeout)."""
    from hotloop.backends.chat.http1 import MAX_PENDING_BYTES

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b"data: " + b"x" * 16000 + b"\n\n"
        for _ in range(2 * MAX_PENDING_BYTES // len(piece) + 1):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        for _ in range(10):
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), idle_timeout=0.4)
            resp = await pool.stream("POST", "/c", b"{}")
            it = resp.__aiter__()
            total = len(await anext(it))
            await asyncio.sleep(1.2)  # the client is slow: three idle timeouts
            async for data in it:
                total += len(data)
            assert total > 2 * MAX_PENDING_BYTES
            await pool.aclose()

    run(main())


def test_an_idle_connection_the_server_closed_meanwhile_is_not_reused() -> None:
    """The server closes an idle keep-alive connection while the loop is busy (it has not polled
    since): the next request takes a new connection instead of writing into the closed one."""
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(sse_reply(b"x"))
        await writer.drain()
        await asyncio.sleep(0.05)  # a short keep-alive timeout
        writer.close()
        closed.set()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            await collect(await pool.stream("POST", "/c", b"{}"))
            await closed.wait()
            # the close is in the kernel; the loop has not polled since (a busy loop)
            await collect(await pool.stream("POST", "/c", b"{}"))
            assert srv.connections == 2 and pool.reused == 0
            await pool.aclose()

    run(main())


def test_a_user_and_password_in_the_url_are_sent_as_basic_credentials() -> None:
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            heads.append(head)
            writer.write(sse_reply(b"x"))
            await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(f"http://us%40er:p%3Ass@127.0.0.1:{srv.port}/v1")
            await collect(await pool.stream("POST", "/c", b"{}"))
            await pool.aclose()

    run(main())
    lines = heads[0].split(b"\r\n")
    assert b"authorization: Basic dXNAZXI6cDpzcw==" in lines  # base64 of "us@er:p:ss"
    assert b"host: 127.0.0.1:%d" % int(lines[1].split(b":")[-1]) in lines and b"us%40er" not in heads[0]


@pytest.mark.parametrize("name,value", [("Authorization", "Bearer sk-abc\n"), ("x-a\r\nx-b", "1"), ("x-c", "a\rb")])
def test_a_header_that_would_break_the_request_head_is_refused_at_start(name: str, value: str) -> None:
    with pytest.raises(ValueError) as caught:
        Pool("http://127.0.0.1:9/v1", headers={name: value})
    assert "sk-abc" not in str(caught.value)


def test_configured_fields_the_transport_owns_are_not_sent() -> None:
    pool = Pool("http://127.0.0.1:9/v1", headers={"Expect": "100-continue", "Connection": "close", "X-Kept": "1"})
    head = pool._head("POST", "/c", 2, "").decode()
    assert "expect" not in head.lower() and "connection" not in head.lower() and "x-kept: 1\r\n" in head


def test_a_non_2xx_whose_body_stalls_is_still_its_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 429 whose body never came waited for the first-byte timeout (300 s) and was then a
    504: now the body has ERROR_BODY_TIMEOUT seconds, and the status decides."""
    from hotloop.backends.chat import http1

    monkeypatch.setattr(http1, "ERROR_BODY_TIMEOUT", 0.3)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"err")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), first_byte_timeout=8, idle_timeout=8)
            t0 = time.monotonic()
            with pytest.raises(errors.RateLimited):
                await open_chat_stream(pool, "/chat/completions", b"{}", backend="t", model="m")
            assert time.monotonic() - t0 < 3
            await pool.aclose()

    run(main())


def test_requests_waiting_for_a_connection_fail_when_the_pool_closes() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), max_connections=1, connect_timeout=8)
            first = await pool.stream("POST", "/c", b"{}")
            waiting = asyncio.ensure_future(pool.stream("POST", "/c", b"{}"))
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            await pool.aclose()
            with pytest.raises(errors.BackendUnavailable):
                await waiting
            assert time.monotonic() - t0 < 1
            await first.aclose()

    run(main())


def test_connections_are_reused_when_socket_numbers_pass_1023() -> None:
    """The check that an idle connection was not closed by the server used select(), which
    refuses descriptors from 1024 on: on a busy server every request then opened a new
    connection (a TLS handshake each, over https)."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1200, hard), hard))
    pad = []
    try:
        while not pad or pad[-1] < 1030:
            pad.append(os.open(os.devnull, os.O_RDONLY))

        async def main() -> None:
            async with Served(keepalive_handler) as srv:
                pool = Pool(srv.url())
                for _ in range(5):
                    await collect(await pool.stream("POST", "/chat/completions", b"{}"))
                assert (pool.opened, pool.reused) == (1, 4)
                await pool.aclose()

        run(main())
    finally:
        for fd in pad:
            os.close(fd)
