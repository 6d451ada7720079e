"""The lean transport (``hotloop.backends.chat.http1``): pool waiters served first come first
served within ``connect_timeout``, idle connections closed when they expire, identity encoding
only, transfer codings other than chunked alone refused, and no credentials echoed from the
backend URL.

Each test runs a small asyncio server on 127.0.0.1 that scripts the exact bytes it answers with;
every wait is bounded.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import time
from typing import Any, Awaitable, Callable

import pytest

from hotloop import errors
from hotloop.backends.chat import TransientBackendError
from hotloop.backends.chat.http1 import Pool, open_chat_stream, redact_url
from hotloop.backends.openai_compat import OpenAICompatBackend
from hotloop.config import Config

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUT = 10.0
OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 14\r\n\r\ndata: [DONE]\n\n"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head (its Content-Length body read and dropped)."""
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and int(value):
            await reader.readexactly(int(value))
    return head


class Served:
    """A loopback server running ``handler`` per connection; counts connections and the ones
    the client closed (the server read an end of file after its last answer)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed_by_client = 0
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

        self.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.server is not None
        self.server.close()

    def url(self, userinfo: str = "") -> str:
        assert self.server is not None
        return f"http://{userinfo}127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def until_closed(self, reader: asyncio.StreamReader) -> None:
        """Serve nothing more; count the client's close when it comes."""
        if await reader.read() == b"":
            self.closed_by_client += 1


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, TIMEOUT))  # type: ignore[arg-type]


async def collect(resp: Any) -> bytes:
    out = b""
    async for data in resp:
        out += data
    return out


async def never_ending(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A handler whose one answer's body never ends (its connection stays busy)."""
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    await writer.drain()
    await reader.read()


def held_until(go: asyncio.Event, paths: list[bytes] | None = None) -> Handler:
    """A keep-alive handler: a request for ``/hold`` gets an answer that ends once ``go`` is set
    (then cleared), any other the complete ``OK``; the paths asked are listed in ``paths``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await read_request(reader)
            if paths is not None:
                paths.append(head.split(b" ")[1])
            if b"/hold " in head:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                await writer.drain()
                await go.wait()
                go.clear()
                writer.write(b"9\r\ndata: x\n\n\r\n0\r\n\r\n")
            else:
                writer.write(OK)
            await writer.drain()

    return handler


# -- 1. requests waiting for a connection: first come first served, within connect_timeout -----


def test_a_waiter_gets_the_freed_slot_before_a_request_that_came_after_it() -> None:
    """With every connection busy, a request waits for one. Each time one was freed, a request
    that came meanwhile could take it before the woken waiter ran; the waiter then queued again
    at the back, and timed out (here at 0.5 s) while newer requests were served. A freed slot is
    now handed to the longest waiting request, and a newcomer queues behind it."""

    async def main() -> None:
        async with Served(never_ending) as srv:
            pool = Pool(srv.url(), max_connections=1, connect_timeout=0.5)
            held = await pool.stream("POST", "/chat/completions", b"{}")
            waiter = asyncio.create_task(pool.stream("POST", "/chat/completions", b"{}"))
            await asyncio.sleep(0.05)
            assert not waiter.done()
            await held.aclose()  # frees the slot and hands it to the waiter, which has not run yet
            # a request asking in the same loop iteration, before the waiter runs: it queues
            # behind the waiter (which then holds the one connection), and times out
            with pytest.raises(errors.BackendUnavailable, match="Too many connections"):
                await pool.stream("POST", "/chat/completions", b"{}")
            assert waiter.done()
            got = waiter.result()  # the waiter's request was served
            assert pool.open == 1 and srv.connections == 2
            await got.aclose()
            await (await pool.stream("POST", "/chat/completions", b"{}")).aclose()
            await pool.aclose()

    run(main())


def test_a_released_connection_goes_to_the_waiter_not_to_a_request_that_came_after_it() -> None:
    """The same for a connection whose response ended (kept alive): it went idle and the waiter
    was woken, so a request asking before the waiter ran took it from the idle list."""
    go = asyncio.Event()
    paths: list[bytes] = []

    async def main() -> None:
        async with Served(held_until(go, paths)) as srv:
            pool = Pool(srv.url(), max_connections=1, connect_timeout=2)
            first = await pool.stream("POST", "/hold", b"{}")
            waiter = asyncio.create_task(pool.stream("POST", "/waiter", b"{}"))
            await asyncio.sleep(0.05)
            go.set()
            await collect(first)  # its end hands the connection to the waiter, which has not run yet
            late = await pool.stream("POST", "/newcomer", b"{}")  # asks in the same loop iteration
            await collect(await asyncio.wait_for(waiter, 2))
            await collect(late)
            assert paths == [b"/v1/hold", b"/v1/waiter", b"/v1/newcomer"]
            assert srv.connections == 1
            await pool.aclose()

    run(main())


def test_a_waiter_never_handed_a_connection_times_out_at_connect_timeout() -> None:
    """The wait for a free connection is bounded by ``connect_timeout``, and says why it failed."""

    async def main() -> None:
        async with Served(never_ending) as srv:
            pool = Pool(srv.url(), max_connections=1, connect_timeout=0.5)
            held = await pool.stream("POST", "/chat/completions", b"{}")
            t0 = time.monotonic()
            with pytest.raises(errors.BackendUnavailable, match="Too many connections"):
                await pool.stream("POST", "/chat/completions", b"{}")
            assert 0.45 < time.monotonic() - t0 < 0.9
            assert pool.open == 1 and not pool._waiters
            await held.aclose()
            await (await pool.stream("POST", "/chat/completions", b"{}")).aclose()  # the pool still works
            await pool.aclose()

    run(main())


def test_released_connections_go_to_waiters_in_the_order_they_came() -> None:
    """A connection whose response ended goes straight to the request waiting longest: with
    one connection and four requests, they are served in the order they asked, over the one
    kept-alive connection."""
    order: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await read_request(reader)
            order.append(head.split(b" ")[1])
            await asyncio.sleep(0.02)
            writer.write(OK)
            await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), max_connections=1, connect_timeout=5)

            async def user(name: str) -> None:
                await collect(await pool.stream("POST", f"/{name}", b"{}"))

            tasks = []
            for name in ("a", "b", "c", "d"):
                tasks.append(asyncio.create_task(user(name)))
                await asyncio.sleep(0.005)
            await asyncio.gather(*tasks)
            assert order == [b"/v1/a", b"/v1/b", b"/v1/c", b"/v1/d"]
            assert srv.connections == 1 and pool.reused == 3
            await pool.aclose()

    run(main())


def test_a_waiter_handed_a_connection_and_cancelled_passes_it_on() -> None:
    """A waiter cancelled after it was handed a connection (its client left in the same loop
    iteration) gives it to the next waiter; a slot (a closed connection's) likewise."""
    go = asyncio.Event()

    async def ended(resp: Any) -> None:  # read to its end: the connection is handed over
        go.set()
        await collect(resp)

    async def dropped(resp: Any) -> None:  # not read to its end: closed, its slot handed over
        await resp.aclose()

    async def main() -> None:
        async with Served(held_until(go)) as srv:
            pool = Pool(srv.url(), max_connections=1, connect_timeout=5)
            for end in (ended, dropped):
                held = await pool.stream("POST", "/hold", b"{}")
                first = asyncio.create_task(pool.stream("POST", "/c", b"{}"))
                await asyncio.sleep(0.01)
                second = asyncio.create_task(pool.stream("POST", "/c", b"{}"))
                await asyncio.sleep(0.01)
                assert len(pool._waiters) == 2
                await end(held)  # hands the connection, or its slot, to the first waiter
                first.cancel()  # which leaves before it ran
                with pytest.raises(asyncio.CancelledError):
                    await first
                await collect(await asyncio.wait_for(second, 2))
                assert pool.open == 1
            assert srv.connections == 2  # one kept alive through the first case, one opened in the second
            await pool.aclose()
            assert pool.open == 0

    run(main())


# -- 2. idle connections closed when they expire --------------------------------------------------


def test_idle_connections_are_closed_when_they_expire_without_a_request() -> None:
    """An idle connection past its keep-alive expiry was closed only when a request took it from
    the pool: a pool nobody used kept it (and the server's socket) open for ever."""

    async def main() -> None:
        srv: Served

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(OK)
            await writer.drain()
            await srv.until_closed(reader)

        async with Served(handler) as srv:
            pool = Pool(srv.url(), keepalive_expiry=0.3)
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            assert await collect(resp) == b"data: [DONE]\n\n"
            assert pool.idle == 1 and pool.open == 1
            await asyncio.sleep(0.1)
            assert pool.idle == 1 and srv.closed_by_client == 0  # not before its time
            await asyncio.sleep(0.7)
            assert pool.idle == 0 and pool.open == 0
            assert srv.closed_by_client == 1  # the server saw it closed
            await pool.aclose()

    run(main())


def test_a_shorter_keep_alive_expiry_closes_that_connection_first() -> None:
    """The pool's one timer is due at the earliest expiry: a connection released later with a
    shorter one (the server's ``Keep-Alive: timeout``) is closed at its own time, while one with
    the default expiry stays."""

    async def main() -> None:
        srv: Served
        gates = {False: asyncio.Event(), True: asyncio.Event()}

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await read_request(reader)
            short = b"x-short: 1" in head
            await gates[short].wait()
            if short:  # expiry: 1.25 - 1 = 0.25 s
                writer.write(b"HTTP/1.1 200 OK\r\nkeep-alive: timeout=1.25\r\ncontent-length: 2\r\n\r\nok")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            await srv.until_closed(reader)

        async with Served(handler) as srv:
            pool = Pool(srv.url(), keepalive_expiry=30)
            long_task = asyncio.create_task(pool.stream("POST", "/chat/completions", b"{}"))
            short_task = asyncio.create_task(pool.stream("POST", "/chat/completions", b"{}", "x-short: 1\r\n"))
            await asyncio.sleep(0.1)
            assert pool.open == 2
            gates[False].set()
            assert await collect(await long_task) == b"ok"  # released first: the timer is due in 30 s
            assert pool.idle == 1
            gates[True].set()
            assert await collect(await short_task) == b"ok"
            assert pool.idle == 2
            await asyncio.sleep(0.8)
            assert pool.idle == 1 and pool.open == 1 and srv.closed_by_client == 1
            await pool.aclose()

    run(main())


# -- 3. identity encoding -------------------------------------------------------------------------


def test_requests_ask_for_identity_encoding_once() -> None:
    """Without ``Accept-Encoding`` a server may compress the stream (RFC 9110, 12.5.3); the
    request says ``identity``, once, whatever headers were configured."""
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await read_request(reader))
        writer.write(OK)
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), headers={"Accept": "text/event-stream", "Accept-Encoding": "gzip, br"})
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            await collect(resp)
            await pool.aclose()

    run(main())
    lines = [line.lower() for line in heads[0].split(b"\r\n")]
    assert [line for line in lines if line.startswith(b"accept-encoding")] == [b"accept-encoding: identity"]


def gzip_reply(status: bytes, body: bytes, encoding: bytes = b"gzip") -> bytes:
    packed = gzip.compress(body)
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-encoding: " + encoding
        + b"\r\ncontent-length: %d\r\n\r\n" % len(packed) + packed
    )


@pytest.mark.parametrize("encoding", [b"gzip", b"br", b"identity, gzip"])
def test_a_compressed_stream_fails_as_a_backend_error(encoding: bytes) -> None:
    """A server that compresses anyway: its body went to the SSE decoder as it came and failed
    as a malformed stream. It is a clear backend error now, and the connection is closed."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(gzip_reply(b"200 OK", b"data: [DONE]\n\n", encoding))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            t0 = time.monotonic()
            with pytest.raises(errors.BackendError) as caught:
                await open_chat_stream(pool, "/chat/completions", b"{}", backend="t", model="m")
            assert not isinstance(caught.value, TransientBackendError)  # not retried
            assert caught.value.message == (
                "The model backend sent a compressed response (content-encoding), which hotloop does not decode."
            )
            assert time.monotonic() - t0 < 2 and pool.open == 0 and pool.idle == 0
            await pool.aclose()

    run(main())


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\ncontent-encoding: identity\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding:  Chunked \r\n\r\n2\r\nok\r\n0\r\n\r\n",
    ],
    ids=["identity-content-coding", "chunked-in-any-case"],
)
def test_an_uncoded_body_is_read_and_its_connection_kept(reply: bytes) -> None:
    """Guards: ``content-encoding: identity`` and ``Chunked`` with spaces are read as before."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            resp = await pool.stream("POST", "/chat/completions", b"{}")
            assert await collect(resp) == b"ok" and pool.idle == 1
            await pool.aclose()

    run(main())


def test_a_compressed_error_answer_keeps_its_status_not_its_garbled_body() -> None:
    """A guard (it passed before too): a non-2xx answer in gzip keeps its status (a 400 stays a
    400, not the protocol error a compressed 2xx stream is), its body ignored, not read as text."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(gzip_reply(b"400 Bad Request", b'{"error":{"message":"temperature is too high"}}'))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            with pytest.raises(errors.InvalidRequest) as caught:
                await open_chat_stream(pool, "/chat/completions", b"{}", backend="t", model="m")
            assert caught.value.message == "The model backend rejected the request."
            await pool.aclose()

    run(main())


# -- 4. transfer codings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        b"transfer-encoding: chunked, gzip\r\n",
        b"transfer-encoding: gzip, chunked\r\n",
        b"transfer-encoding: gzip\r\n",
        b"transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",
        b"transfer-encoding: chunked, chunked\r\n",
    ],
    ids=["chunked-then-gzip", "gzip-then-chunked", "gzip", "two-fields", "chunked-twice"],
)
def test_transfer_codings_other_than_chunked_alone_fail_and_close(fields: bytes) -> None:
    """RFC 9112, 6.3: chunked not the final coding means a body read until the connection
    closes, in a coding hotloop cannot decode; chunked after another, a body in that coding.
    ``chunked, gzip`` was read as the raw bytes until the server closed, then failed as a broken
    connection (retried as transient); ``gzip, chunked`` fed gzip to the SSE decoder. Both are a
    clear backend error now, at once, and the connection is never reused."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        packed = gzip.compress(b"data: [DONE]\n\n")
        writer.write(b"HTTP/1.1 200 OK\r\n" + fields + b"\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed))
        await writer.drain()
        while True:  # keeps the connection open, answering whatever comes
            await read_request(reader)
            writer.write(OK)
            await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), first_byte_timeout=3, idle_timeout=3)
            t0 = time.monotonic()
            with pytest.raises(errors.BackendError) as caught:
                resp = await pool.stream("POST", "/chat/completions", b"{}")
                await collect(resp)
            assert not isinstance(caught.value, TransientBackendError)
            assert caught.value.message == (
                "The model backend sent a response in a transfer coding other than chunked, which hotloop does not decode."
            )
            assert time.monotonic() - t0 < 1.5 and pool.open == 0 and pool.idle == 0
            await pool.aclose()

    run(main())


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"chunked, gzip"])
@pytest.mark.parametrize(
    "status,expected",
    [(b"503 Service Unavailable", errors.BackendUnavailable), (b"429 Too Many Requests", errors.RateLimited)],
    ids=["503", "429"],
)
def test_a_non_2xx_answer_in_a_transfer_coding_keeps_its_status(status: bytes, expected: type, coding: bytes) -> None:
    """The refusal of transfer codings is for streams: a 503 or 429 so sent stays a 503 or 429
    (retried, or answered with its retry-after), its body not read; a body read until the
    connection closes (``chunked, gzip``) leaves its connection closed, not kept."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        packed = gzip.compress(b'{"error":{"message":"busy"}}')
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed) if coding.endswith(b"chunked") else packed
        writer.write(b"HTTP/1.1 " + status + b"\r\nretry-after: 1\r\ntransfer-encoding: " + coding + b"\r\n\r\n" + body)
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url())
            with pytest.raises(errors.HotloopError) as caught:
                await open_chat_stream(pool, "/chat/completions", b"{}", backend="t", model="m")
            assert type(caught.value) is expected, (type(caught.value), caught.value.message)
            if coding == b"chunked, gzip":
                assert pool.idle == 0
            await pool.aclose()

    run(main())


# -- 5. no credentials from the URL in messages or logs ------------------------------------------

SECRET = "hunter2pw"


@pytest.mark.parametrize(
    "url",
    [
        f"ftp://alice:{SECRET}@example.com/v1",  # not http(s)
        f"https://alice:{SECRET}@:8443/v1",  # no host
        f"https://alice:{SECRET}@example.com:99999/v1",  # port out of range
        f"https://alice:hun/{SECRET}@example.com/v1",  # an unescaped "/" ends the authority early
        # ... and after digits, which read as a port: host "alice", the rest of it in the path
        f"https://alice:8443/{SECRET}@example.com/v1",
        f"https://alice:8443?{SECRET}@example.com/v1",
        f"https://alice:8443#{SECRET}@example.com/v1",
        f"https://alice:{SECRET}x@example.com:port/v1",
        f"alice:{SECRET}@example.com:8000/v1",  # no scheme
    ],
)
def test_an_invalid_base_url_is_not_echoed_with_its_credentials(url: str) -> None:
    with pytest.raises(ValueError) as caught:
        Pool(url)
    message = str(caught.value)
    assert "URL" in message and "***@" in message
    assert SECRET not in message and "hun" not in message and "alice" not in message


def test_redact_url() -> None:
    assert redact_url("https://u:p@h:1/v1") == "https://***@h:1/v1"
    assert redact_url("https://h/v1") == "https://h/v1"
    assert redact_url("https://u:p/q@h/v1") == "https://***@h/v1"
    assert redact_url("u:p@h") == "***@h"


def test_the_openai_compat_backend_does_not_log_the_urls_credentials() -> None:
    """Its start logs the URL it sends to ("lean transport to ..."): with the user and password.
    So did httpx's line for the model list under ``--log-level debug`` (every request's, on the
    sdk transport)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            body = b'{"data":[{"id":"m"}]}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            backend = OpenAICompatBackend(Config(backend="openai-compat", base_url=srv.url(f"alice:{SECRET}@"), model="m"))
            await backend.start()
            await backend.close()

    logger = logging.getLogger()  # hotloop serve --log-level debug: httpx's request lines too
    keep, level = Keep(logging.DEBUG), logger.level
    # as in a fresh process: httpx's logger not set yet (an earlier test's backend quietened it)
    http_levels = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    for name in http_levels:
        logging.getLogger(name).setLevel(logging.NOTSET)
    logger.addHandler(keep)
    logger.setLevel(logging.DEBUG)
    try:
        run(main())
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
        for name, lvl in http_levels.items():
            logging.getLogger(name).setLevel(lvl)
    text = "\n".join(r.getMessage() for r in records)
    assert "transport to http://***@127.0.0.1:" in text
    assert "HTTP Request: GET http://***@127.0.0.1:" in text  # httpx's, for the model list
    assert SECRET not in text and "alice" not in text


def test_the_openai_compat_backend_refuses_a_malformed_url_without_its_password() -> None:
    """httpx's own error quoted the piece of the password after an unescaped "/" as the port."""
    backend = OpenAICompatBackend(Config(backend="openai-compat", base_url=f"http://alice:{SECRET}/x@example.com/v1", model="m"))
    why = backend.missing()  # said at start-up, before the server starts (hotloop.backends.create)
    assert why is not None and SECRET not in why and "alice" not in why
    with pytest.raises((ValueError, RuntimeError)) as caught:
        asyncio.run(asyncio.wait_for(backend.start(), TIMEOUT))
    assert SECRET not in str(caught.value) and "alice" not in str(caught.value)


def test_waiters_cancelled_at_random_never_leak_or_exceed_slots() -> None:
    """Requests over a small pool, some cancelled at random moments (waiting, just handed a
    connection or a slot, streaming), some abandoning their stream: the pool never opens more
    than ``max_connections``, every request not cancelled is served, and at the end every open
    connection is an idle one."""
    import random

    rng = random.Random(7)
    most = 0  # the most connections the pool counted open, seen by each request it served

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await asyncio.sleep(rng.random() * 0.004)
            writer.write(OK)
            await writer.drain()

    async def main() -> None:
        async with Served(handler) as srv:
            pool = Pool(srv.url(), max_connections=3, max_idle=2, connect_timeout=5)
            served = 0

            async def user(abandon: bool) -> None:
                nonlocal served, most
                resp = await pool.stream("POST", "/c", b"{}")
                most = max(most, pool.open)
                if abandon:
                    await resp.aclose()
                else:
                    await collect(resp)
                served += 1

            tasks = [asyncio.create_task(user(rng.random() < 0.2)) for _ in range(120)]
            cancelled = 0
            for _ in range(40):
                await asyncio.sleep(rng.random() * 0.003)
                t = rng.choice(tasks)
                if not t.done():
                    t.cancel()
                    cancelled += 1
            done = await asyncio.gather(*tasks, return_exceptions=True)
            failures = [r for r in done if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
            assert not failures
            assert served + sum(isinstance(r, asyncio.CancelledError) for r in done) == 120
            assert pool.open == pool.idle <= 2 and not pool._waiters
            assert most == 3  # the pool was used to its limit, never past it
            await pool.aclose()
            assert pool.open == 0

    run(main())


def test_a_backend_url_with_a_query_is_refused_at_start_up() -> None:
    """``?api-version=...`` (Azure's style) was accepted: the lean transport sent requests
    without it and the sdk one put the path after it. Both backends refuse it before serving."""
    from hotloop.backends.cerebras import CerebrasBackend
    from hotloop.backends.chat.http1 import url_problem
    from hotloop.backends.openai_compat import OpenAICompatBackend
    from hotloop.config import Config

    for url in ("http://h/openai/deployments/x?api-version=2024-10-21", "https://u:secret@h/v1#frag"):
        problem = url_problem(url)
        assert problem is not None and "query or a fragment" in problem and "secret" not in problem, problem
    assert url_problem("http://h/v1") is None
    url = "http://h/openai?api-version=1"
    why = OpenAICompatBackend(Config(backend="openai-compat", base_url=url, model="m")).missing()
    assert why is not None and "query" in why
    why = CerebrasBackend(Config(backend="cerebras", base_url=url, model="m", backend_api_key="csk-x")).missing()
    assert why is not None and "query" in why


def test_an_unreadable_no_proxy_entry_is_named_not_the_base_url(monkeypatch: Any) -> None:
    """``NO_PROXY=localhost,[::1]`` makes httpx refuse to build its client; start-up blamed the
    (valid) base URL. It now names the proxy environment and says how to write the entry."""
    import asyncio as aio

    from hotloop.backends.cerebras import CerebrasBackend
    from hotloop.backends.chat.http1 import PROXY_ENV_PROBLEM
    from hotloop.backends.openai_compat import OpenAICompatBackend
    from hotloop.config import Config

    monkeypatch.setenv("NO_PROXY", "localhost,[::1]")
    for backend in (
        OpenAICompatBackend(Config(backend="openai-compat", base_url="http://127.0.0.1:9/v1", model="m")),
        CerebrasBackend(Config(backend="cerebras", base_url="http://127.0.0.1:9", model="m", backend_api_key="csk-x")),
    ):
        with pytest.raises(ValueError) as ei:
            aio.run(backend.start())
        assert str(ei.value) == PROXY_ENV_PROBLEM and "NO_PROXY" in str(ei.value)
