"""The lean transport against servers that answer early, send endless trailers or status codes
below 100: loopback servers scripting the exact bytes, as in ``test_lean_transport``."""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any

import pytest
import trustme

from hotloop import errors
from hotloop.backends.chat.http1 import Pool, open_chat_stream
from tests.integration.test_lean_transport import Served, collect, read_request, run


@pytest.mark.parametrize(
    "size, tls",
    [(16 * 1024 * 1024, False), (512 * 1024, False), (16 * 1024 * 1024, True), (4096, True)],
    ids=["16MiB", "512KiB", "16MiB-tls", "4KiB-tls"],
)
def test_a_connection_answered_before_its_request_body_was_read_is_not_reused(
    size: int, tls: bool, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server answers (a 413) after the request's head, without reading its body, and
    keeps the connection open. A body larger than the kernel's socket buffers is still queued
    in the transport then; a smaller one (or any over TLS, whose transport counts only what it
    has not encrypted yet) has left it, unread by the server all the same. Put back in the pool,
    that connection made the next request queue behind the unread bytes and wait for the
    first-byte timeout for an answer that never came."""
    big = b"x" * size
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        if b"content-length: %d\r\n" % len(big) in head:
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: text/html\r\ncontent-length: 10\r\n\r\n<p>big</p>")
            await writer.drain()
            await asyncio.sleep(8)  # the rest of the body is never read
            return
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    server_ctx = None
    if tls:
        ca = trustme.CA()
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("localhost", "127.0.0.1").configure_cert(server_ctx)
        ca_file = tmp_path / "ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))

    async def main() -> None:
        async with Served(handler, server_ctx) as srv:
            host = "localhost" if tls else "127.0.0.1"
            pool = Pool(f"{'https' if tls else 'http'}://{host}:{srv.port}/v1", first_byte_timeout=2, idle_timeout=2)
            with pytest.raises(errors.InvalidRequest):
                await open_chat_stream(pool, "/chat/completions", big, backend="t", model="m")
            t0 = time.monotonic()
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            assert resp.status == 200 and await collect(resp) == b"ok"
            assert time.monotonic() - t0 < 1.5
            assert srv.connections == 2 and pool.reused == 0
            await pool.aclose()

    run(main())


@pytest.mark.parametrize(
    "tail",
    [b"0\r\nx-trailer: ", b"1;ext="],
    ids=["endless-trailer-field", "endless-chunk-extension"],
)
def test_endless_bytes_after_the_body_fail_as_an_oversized_head(tail: bytes) -> None:
    """A chunked body's trailer section is header fields, held by the parser until each ends:
    one endless trailer field grew the client's memory without bound (and, as reads came, the
    idle timer never fired), as an endless head field did before its bound. Bytes that carry no
    body (a trailer, a chunk extension) now count as a head's do."""
    sent = [0]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: x\n\n\r\n" + tail)
        piece = b"a" * 65536
        try:
            for _ in range(1024):  # 64 MiB, if the client reads on
                writer.write(piece)
                await writer.drain()
                sent[0] += len(piece)
        except ConnectionError:
            pass
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), idle_timeout=2)
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            assert await resp.__anext__() == b"data: x\n\n"
            t0 = time.monotonic()
            with pytest.raises(errors.BackendError, match="oversized response headers"):
                await collect(resp)
            assert time.monotonic() - t0 < 2
            assert pool.open == 0
            await pool.aclose()
        assert sent[0] < 32 * 1024 * 1024

    run(main())


def test_framing_only_reads_between_body_reads_are_not_an_oversized_head() -> None:
    """Reads that carry only chunk framing (a server writing each chunk's line end on its own)
    do not add up over a long stream: the bound is on such reads in a row."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        event = b"data: y\n\n"
        for _ in range(60):
            # a body read, then a read of framing alone (a long chunk-size line: 2 KiB of zeros)
            writer.write(b"%x\r\n%s" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.002)
            writer.write(b"\r\n" + b"0" * 2048)
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            body = await collect(resp)
            assert body.count(b"data: y\n\n") == 60
            await pool.aclose()

    run(main())


@pytest.mark.parametrize("status", [b"099", b"000", b"042"])
def test_a_status_below_100_is_not_http(status: bytes) -> None:
    """A status below 100 is no HTTP status (RFC 9110, 15: 100 to 599). Taken for an interim
    response, its final one was awaited until the first-byte timeout (300 s by default)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 " + status + b" Odd\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), first_byte_timeout=3)
            t0 = time.monotonic()
            with pytest.raises(errors.BackendError) as caught:
                await pool.stream("POST", "/chat/completions", b"{}")
            assert caught.value.message == "The model backend sent a response that is not valid HTTP."
            assert time.monotonic() - t0 < 1.5 and pool.open == 0
            await pool.aclose()

    run(main())
