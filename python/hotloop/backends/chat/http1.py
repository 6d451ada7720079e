"""The ``lean`` transport: streaming HTTP/1.1 requests over a pool of keep-alive connections.

Built for one job, a chat backend's streaming ``POST``, the way uvicorn serves HTTP: an
``asyncio.Protocol`` per connection (uvloop's when installed), ``httptools`` parsing the response,
the request head and body written with one ``write``, and each network read handed to the caller
as one ``bytes`` (straight into the native SSE decoder). Measured on a 2-vCPU machine, one
streaming request costs about 0.2 ms of client CPU this way against 2.2 ms through an SDK over
httpx (see the README's performance section).

What it does, and its bounds:

* **Pool.** One :class:`Pool` per backend origin: at most ``max_connections`` open (default 100;
  further requests wait for a free one, first come first served: a freed connection, or the
  slot of a closed one, is handed to the longest waiting request, and a request that arrives
  while others wait queues behind them; the wait is bounded by ``connect_timeout``, and a
  connection opened after it has a ``connect_timeout`` of its own), at most
  ``max_idle`` kept (default 20, most recently used first), an idle connection is closed after
  ``keepalive_expiry`` seconds (default 30, or the server's ``Keep-Alive: timeout`` minus one
  second when shorter), by one timer per pool, whether or not a request comes.
* **Reuse.** A connection goes back to the pool only when its response was read to the end and
  both sides allow keep-alive (and the request was written whole: a server answering early
  leaves the rest queued), and not after an answer other than a success to a request with a
  body (the server may have answered without reading the body, whose bytes would then come
  before the next request's; nothing on this side tells, over TLS least of all). A cancelled,
  failed or abandoned stream closes its connection.
  An idle connection the server closed is noticed (the pool keeps reading idle sockets) and
  dropped before use; a request is retried on a fresh connection only when no byte of it was
  sent (the connection was found closed before the write). Once written, a request is never
  replayed by the transport.
* **Timeouts.** ``connect_timeout`` (TCP + TLS), ``first_byte_timeout`` (write to the body's
  first byte: a streaming server's head comes at once, its first token after prefill) and
  ``idle_timeout`` (silence while reading the body). One timer per request, re-armed
  lazily: a read costs one integer increment, not a timer or a clock read (so silence is
  detected between ``idle_timeout`` and twice that after the last read: a backstop behind the
  engine's own idle watchdog).
* **TLS.** ``https`` origins use certifi's CA bundle (or ``SSL_CERT_FILE``/``SSL_CERT_DIR`` when
  set, as httpx does), with SNI and hostname checks.
* **Bodies.** ``Content-Length``, chunked and read-until-close bodies (httptools decodes chunked
  framing). Requests say ``accept-encoding: identity``: a 2xx response in another content coding
  fails, and so does one whose transfer codings are anything but ``chunked`` alone (``chunked,
  gzip`` is a gzip body read until close, RFC 9112 6.3; ``gzip, chunked`` a gzip body), its
  connection closed; a non-2xx one keeps its status, its body ignored (in a transfer coding, not
  read: a body still coming closes its connection). A response
  head is at most ``MAX_HEAD_BYTES`` (64 KiB) and ``MAX_HEADERS`` (256) fields (reads without
  body bytes in a row, a trailer section's or chunk extensions', are bounded as a head's are); a
  body waiting to be read is at most ``MAX_PENDING_BYTES`` (1 MiB) before the socket stops being
  read (back-pressure); a non-2xx body is read up to ``MAX_ERROR_BODY_BYTES``.
* **Read pauses.** While the pool has at least ``pause_streams`` connections in use
  (``--backend-read-pause-streams``, 16 by default), after a read whose chunks the response took
  whole through push delivery the connection stops reading for ``read_pause`` seconds
  (``--backend-read-pause-ms``, 10 by default; 0: never), so that what the backend sends
  meanwhile is read, decoded and written to the client in one go: one wake-up of the server for
  several chunks instead of one per chunk (a model at 1,000 tokens/s sends one a millisecond).
  The kernel holds the bytes meanwhile, over TLS too: a TLS transport's pause only stops what it
  hands over, so its read buffer's limit is set to 0 for the pause, which stops its TLS layer
  reading the socket, and back to the default after it. A chunk, the response's end
  included, then reaches the client up to ``read_pause`` later; a server with fewer streams (a
  lone agent loop) is never slowed. One timer per pause; a pause never outlives its response
  (its end, a drop or a close ends it).
* **Proxies.** This transport does not speak to proxies: :func:`proxy_for` tells the backend
  when ``HTTPS_PROXY``/``HTTP_PROXY``/``ALL_PROXY`` (minus ``NO_PROXY``, read as httpx reads it)
  apply to the origin, and the backend then uses its SDK transport and logs that it does.

Failures are typed hotloop errors: could not connect -> ``BackendUnavailable``; timeouts ->
``BackendTimeout``; a connection broken mid-response -> ``TransientBackendError``; a response
that is not HTTP, or in a coding this transport does not decode -> ``BackendError``. Messages
and logs never repeat the URL's user and password (:func:`redact_url`).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import os
import re
import select
import ssl
import urllib.request
from collections import deque
from typing import Any, Callable, Mapping
from urllib.parse import SplitResult, unquote, urlsplit

import httptools

from hotloop import errors
from hotloop.backends.chat.statuses import TransientBackendError, parse_body, status_error

log = logging.getLogger("hotloop.backends")

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 256
# bytes read while the head is unfinished, at most (the fields' bound plus their framing: status
# lines, line ends, interim responses' heads)
MAX_HEAD_READ = MAX_HEAD_BYTES + 16 * 1024
MAX_PENDING_BYTES = 1024 * 1024
MAX_ERROR_BODY_BYTES = 64 * 1024
ERROR_BODY_TIMEOUT = 10.0  # seconds for a non-2xx answer's body (Pool.error_body)
Payload = bytes | list[bytes]  # a request body: bytes, or pieces sent as one vectored write
DRAIN_TIMEOUT = 1.0  # after the caller's release, how long the rest of a body may take to arrive

_UNAVAILABLE = "Could not connect to the model backend."
_SLOT = object()  # what a pool waiter is handed when a connection closed: its slot, to open one
_BROKEN = "The model backend closed the connection mid-stream."
_SILENT = "The model backend stopped sending output."
_NO_ANSWER = "The model backend did not answer in time."
_NOT_HTTP = "The model backend sent a response that is not valid HTTP."
_TOO_LARGE = "The model backend sent oversized response headers."
_FAILED_READ = "The model backend failed."
_ENCODED = "The model backend sent a compressed response (content-encoding), which hotloop does not decode."
_CODING = "The model backend sent a response in a transfer coding other than chunked, which hotloop does not decode."

# Response states
_HEAD, _BODY, _DONE, _FAILED = 0, 1, 2, 3
# request fields the transport writes itself, or that ask for what it does not do (100-continue,
# an upgrade, transfer codings): configured values of these are not sent
_OWN_FIELDS = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "expect", "upgrade", "te", "trailer", "accept-encoding",
})
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# what an interim (1xx) response's head counts towards MAX_HEAD_BYTES besides its fields, so
# that a backend sending them without end fails as one sending an oversized head
_INTERIM_HEAD_BYTES = 1024
# how much earlier than due the pool's expiry timer may close an idle connection (a timer may
# fire a little early: it then never re-arms for the same instant in a loop)
_EXPIRY_SLACK = 0.05


def ssl_context() -> ssl.SSLContext:
    """Verification against certifi's CA bundle, or ``SSL_CERT_FILE``/``SSL_CERT_DIR`` when set."""
    cafile = os.environ.get("SSL_CERT_FILE")
    capath = os.environ.get("SSL_CERT_DIR")
    if cafile or capath:
        ctx = ssl.create_default_context(cafile=cafile or None, capath=capath or None)
    else:
        import certifi

        ctx = ssl.create_default_context(cafile=certifi.where())
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


# Why the HTTP client could not be built from a base URL url_problem accepted: the proxy
# variables it reads (httpx reads NO_PROXY's "[::1]" as a host pattern, and refuses it).
PROXY_ENV_PROBLEM = (
    "the proxy environment (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY) holds an entry that cannot be "
    "read as a URL or a host; write an IPv6 address in NO_PROXY without brackets (::1, not [::1])"
)


def proxy_for(url: str) -> str | None:
    """The proxy the environment configures for ``url`` (``None``: connect directly)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy:
        return None
    if _exempt(parts.hostname or "", proxies.get("no", "")):
        return None
    return proxy


def _exempt(host: str, no_proxy: str) -> bool:
    """``NO_PROXY`` exempts ``host``, read as httpx reads it (the sdk transport, which carries the
    request when a proxy applies): ``*`` exempts all; ``.example.com`` its subdomains, not
    example.com itself (urllib and curl take it for the domain too: the lean transport then went
    directly where the sdk transport used the proxy); ``localhost`` and IP addresses themselves
    only; any other name itself and its subdomains. Entries with a port or a scheme exempt
    nothing here (the sdk transport reads them)."""
    host = host.lower()
    for name in no_proxy.split(","):
        name = name.strip().lower()
        if name == "*":
            return True
        if not name:
            continue
        if name.startswith("."):
            if host.endswith(name):
                return True
        elif host == name:
            return True
        elif name != "localhost" and not _is_ip(name) and host.endswith("." + name):
            return True
    return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def redact_url(url: str) -> str:
    """``url`` without its user and password, for messages and logs: all before the last ``@``
    (after the scheme) becomes ``***``, so a password with an unescaped ``/``, ``?`` or ``#``,
    which ends the URL's authority early, is hidden too (more may be hidden than needed)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"


# what a URL that split_url refuses is told (redact_url hides its user and password)
URL_ADVICE = "percent-encode a '/', '?', '#' or '@' in its password or path"


def split_url(url: str) -> SplitResult | None:
    """``url`` split, or ``None`` when its authority cannot be read as written: a port that is
    not a number (it may be part of a password), or an "@" after the host (a password holding
    an unescaped "/", "?" or "#" ended the authority early: "user:8443/rest@host" reads as host
    "user", port 8443, and requests would go to the wrong host with the rest of the password in
    their path). Backend and Redis URLs alike."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a ValueError when not a number
    except ValueError:
        return None
    return None if "@" in parts.path + parts.query + parts.fragment else parts


def url_problem(url: str) -> str | None:
    """Why ``url`` is no backend URL hotloop can use (``None``: it is one), without its password."""
    parts = split_url(url)
    if parts is None:
        return f"not a valid http(s) URL: {redact_url(url)!r} ({URL_ADVICE})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"not an http(s) URL: {redact_url(url)!r}"
    if parts.query or parts.fragment:
        # (Azure's ``?api-version=``): the lean transport sent its requests without it, the sdk
        # one put the path after it
        return f"a URL with a query or a fragment, which a backend URL cannot have: {redact_url(url)!r}"
    return None


class Origin:
    """Where requests go: scheme, host, port, the path prefix, and the TLS settings."""

    __slots__ = ("scheme", "host", "port", "prefix", "ssl", "host_header", "basic")

    def __init__(self, url: str, ssl_ctx: ssl.SSLContext | None = None) -> None:
        problem = url_problem(url)
        if problem is not None:
            raise ValueError(problem)
        parts = urlsplit(url)
        port = parts.port
        self.scheme = parts.scheme
        self.host: str = parts.hostname or ""  # (never empty: url_problem)
        default = 443 if parts.scheme == "https" else 80
        self.port = port or default
        self.prefix = parts.path.rstrip("/")
        self.ssl = (ssl_ctx or ssl_context()) if parts.scheme == "https" else None
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if self.port == default else f"{host}:{self.port}"
        # a user and password in the URL: Basic credentials (RFC 7617), as httpx sends them
        self.basic: str | None = None
        if parts.username is not None or parts.password is not None:
            pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
            self.basic = "Basic " + base64.b64encode(pair).decode("ascii")


class Response:
    """One response: status and headers once :meth:`Pool.stream` returns, then the body.

    Iterating yields the body as it arrives (every read since the last one, joined). Implements
    :class:`hotloop.backends.chat.backend.Body`.
    """

    __slots__ = (
        "status", "headers", "_conn", "_state", "_chunks", "_pending", "_waiter", "_error",
        "_head_bytes", "_head_read", "_quiet_at", "_released", "_loop", "push", "_kick", "_fields",
    )

    def __init__(self, conn: "_Conn") -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn: _Conn | None = conn
        self._state = _HEAD
        self._chunks: list[bytes] = []
        self._pending = 0
        self._waiter: asyncio.Future[None] | None = None
        self._loop = conn.pool.loop
        self._error: BaseException | None = None
        self._head_bytes = 0
        self._fields = 0  # the head's fields, a repeated name's included (headers joins those)
        self._head_read = 0  # bytes of reads that ended inside the head (_Conn.data_received)
        # then, in the body, of reads in a row without body bytes; ``_quiet_at``: the last one's
        # number (that of the read that ended the head, until one comes)
        self._quiet_at = -1
        self._released = False
        # Push delivery (hotloop.backends.base.PushSlot): called with each read's body bytes
        # while the reader is parked waiting for them; returns None if it did not take them
        # (they are queued for the reader as usual), True if it handled them all, False if it
        # kept some for the reader, which is then woken to see them (``__anext__`` returns b"").
        self.push: Callable[[bytes], bool | None] | None = None
        self._kick = False

    # -- parser callbacks (called by _Conn) ----------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        self._fields += 1
        if self._head_bytes > MAX_HEAD_BYTES or self._fields > MAX_HEADERS:
            raise _TooLarge()
        key = name.decode("latin-1").lower()
        prev = self.headers.get(key)
        text = value.decode("latin-1")
        self.headers[key] = text if prev is None else f"{prev}, {text}"

    def on_headers_complete(self, status: int) -> None:
        self.status = status
        self._state = _BODY
        self._wake()

    def on_message_complete(self) -> None:
        self._state = _DONE
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if self._state in (_DONE, _FAILED):
            return
        self._state = _FAILED
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- the caller's side ---------------------------------------------------------------------

    async def head(self) -> None:
        while self._state == _HEAD:
            self._waiter = w = self._loop.create_future()
            try:
                await w
            finally:
                self._waiter = None
        if self._state == _FAILED and self.status == 0:
            raise self._error  # type: ignore[misc]

    def __aiter__(self) -> "Response":
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._kick:
                self._kick = False
                return b""
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self._chunks = []
                if self._pending > MAX_PENDING_BYTES and self._conn is not None:
                    self._conn.resume()
                self._pending = 0
                return data
            state = self._state
            if state == _DONE:
                raise StopAsyncIteration
            if state == _FAILED:
                raise self._error  # type: ignore[misc]
            self._waiter = w = self._loop.create_future()  # inline: no coroutine per wait
            try:
                await w
            finally:
                self._waiter = None

    async def read(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes (the connection is dropped if it is longer)."""
        buf = bytearray()
        async for data in self:
            buf += data
            if len(buf) > limit:
                await self.aclose()
                break
        return bytes(buf[:limit])

    async def release(self) -> None:
        """The caller read what it needs: keep the connection if the body ends soon, without
        making the caller wait for it."""
        if self._released:
            return
        self._released = True
        self._chunks = []
        conn = self._conn
        if conn is None or self._state == _DONE:
            return
        if self._state == _FAILED:
            conn.drop()
            return
        conn.resume()
        conn.discard_after(DRAIN_TIMEOUT)

    async def aclose(self) -> None:
        """Abandon the response: an unfinished body closes its connection."""
        self._released = True
        self._chunks = []
        conn = self._conn
        if conn is not None and self._state != _DONE and not conn.draining:
            conn.drop()


class _TooLarge(Exception):
    pass


class _NotHttp(Exception):
    pass


class _Refused(Exception):
    """A response head this transport does not read; ``args[0]``: the client-visible message."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection. Reads stay on while idle, so a close by the server is seen."""

    __slots__ = (
        "pool", "transport", "parser", "resp", "closed", "idle_since", "paused", "timer", "reads", "mark",
        "body_seen", "keep_alive", "draining", "expiry", "counted_out", "nap", "batch", "interim", "sent_body",
    )

    def __init__(self, pool: "Pool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser: Any = None
        self.resp: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.reads = 0  # reads so far; the timer compares it with ``mark`` to see activity
        self.mark = 0
        self.body_seen = False  # a byte of the current response's body came (the idle timer runs)
        self.keep_alive = True
        self.draining = False
        self.expiry = pool.keepalive_expiry
        self.counted_out = False  # the pool no longer counts it as open
        self.nap: asyncio.TimerHandle | None = None  # a read pause's end (Pool.read_pause)
        # The body bytes of the read being parsed: a chunked body calls on_body once per chunk
        # (a streaming server sends one SSE event a chunk, several in one read when it falls
        # behind or a read pause held them), and the response gets them joined, once per read.
        self.batch: list[bytes] | None = None
        self.interim = False  # an interim (1xx) response is being parsed; the final one follows
        self.sent_body = False  # the current request has a body

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:  # bytes nobody asked for: the connection cannot be trusted any more
            self.drop()
            return
        self.reads += 1
        batch: list[bytes] = []
        self.batch = batch
        try:
            try:
                self.parser.feed_data(data)
            finally:
                self._deliver()  # what the read held before its end, an error or its last byte
        except httptools.HttpParserError as exc:  # includes errors raised by the callbacks
            cause = exc.__context__
            if isinstance(cause, _Refused):
                message = cause.args[0]
            else:
                message = _TOO_LARGE if isinstance(cause, _TooLarge) else _NOT_HTTP
            resp.fail(errors.BackendError(message))
            self.drop()
            return
        except httptools.HttpParserUpgrade:
            resp.fail(errors.BackendError(_NOT_HTTP))
            self.drop()
            return
        if resp._state == _HEAD:
            # The parser holds a field until it ends, so the head's bound (checked per field)
            # is checked here too, on the bytes of reads that all went to an unfinished head
            # (interim responses' included): one endless field fails as an oversized head.
            resp._head_read += len(data)
            if resp._head_read > MAX_HEAD_READ:
                resp.fail(errors.BackendError(_TOO_LARGE))
                self.drop()
        elif not batch and resp._state == _BODY:
            # A read with no body bytes: chunk framing, a chunk extension, the trailer section
            # (header fields, which the parser holds until each ends). Such reads in a row are
            # bounded as a head's are: an endless trailer field or chunk extension fails as an
            # oversized head instead of growing without bound (a read with body bytes ends a
            # run, so a long stream's framing-only reads never add up; the read that ended the
            # head is the head's).
            quiet = resp._quiet_at
            if quiet != self.reads:
                if quiet != self.reads - 1:
                    resp._head_read = 0
                resp._quiet_at = self.reads
                resp._head_read += len(data)
                if resp._head_read > MAX_HEAD_READ:
                    resp.fail(errors.BackendError(_TOO_LARGE))
                    self.drop()

    def eof_received(self) -> bool:
        resp = self.resp
        if resp is not None and resp._state == _BODY and not self._framed():
            self.on_message_complete()  # a body delimited by the connection's end
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self._end_nap(resume=False)
        self.pool._lost(self)
        resp = self.resp
        if resp is not None:
            self.resp = None
            resp.fail(TransientBackendError(_BROKEN))

    def pause_writing(self) -> None:  # the request body is written once; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp.on_header(name, value)  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        parser = self.parser
        resp = self.resp
        assert resp is not None
        status = parser.get_status_code()
        if status < 200:
            # An interim response (100 Continue, 102 Processing, 103 Early Hints): its head is
            # skipped and the final response read after it on the same connection (RFC 9110,
            # 15.2). Its bytes count towards the head's bound, so that endless interim heads
            # fail as an oversized one. 101 would switch protocols: not HTTP any more; below 100
            # is no status at all (RFC 9110, 15), not an interim response to wait past.
            if status == 101 or status < 100:
                raise _NotHttp()
            self.interim = True
            resp.headers = {}
            resp._fields = 0
            resp._head_bytes += _INTERIM_HEAD_BYTES
            if resp._head_bytes > MAX_HEAD_BYTES:
                raise _TooLarge()
            return
        if status < 300:  # a non-2xx answer keeps its status whatever its codings (error_body)
            headers = resp.headers
            te = headers.get("transfer-encoding")
            if te is not None and te != "chunked" and not _chunked_alone(te):
                # chunked not the last coding: read until close, in a coding we cannot decode (RFC
                # 9112, 6.3); last but after another: a body in that coding. Failed, never reused.
                log.warning("%s: response with transfer-encoding %r", self.pool.origin.host_header, te[:100])
                raise _Refused(_CODING)
            ce = headers.get("content-encoding")
            if ce is not None and not _identity(ce):
                log.warning("%s: response with content-encoding %r", self.pool.origin.host_header, ce[:100])
                raise _Refused(_ENCODED)
        # An answer other than a success to a request with a body may come before the server read
        # all of it (an early 413 or 400): what it left unread would be read as the start of the
        # next request sent here, or hold that request up behind it. Nothing on this side tells
        # (a transport's write buffer is empty once the kernel took the bytes, and a TLS
        # transport's counts only what it has not yet encrypted): such a connection is closed,
        # not reused. Error answers are rare; the next request pays one connection's set-up.
        self.keep_alive = parser.should_keep_alive() and (status < 300 or not self.sent_body)
        resp._head_read = 0  # from here, bytes of reads without body bytes (data_received)
        resp._quiet_at = self.reads
        ka = resp.headers.get("keep-alive")
        if ka:
            self.expiry = min(self.pool.keepalive_expiry, _keepalive_timeout(ka, self.pool.keepalive_expiry))
        # the first-byte timer runs on until the body's first byte: a streaming server sends its
        # head at once and its first token after prefill and queueing, which first_byte_timeout
        # (--backend-timeout) bounds, not idle_timeout
        resp.on_headers_complete(status)

    def on_body(self, body: bytes) -> None:
        if not self.body_seen:
            self.body_seen = True
            self._arm(self.pool.idle_timeout)
        batch = self.batch
        if batch is not None:
            batch.append(body)
        else:  # bytes after the body's end in the same read: nobody asked for them (_body fails)
            self._body(body)

    def _deliver(self) -> None:
        """Hand the current read's body bytes (``batch``) to the response, joined."""
        batch = self.batch
        self.batch = None
        if batch:
            self._body(batch[0] if len(batch) == 1 else b"".join(batch))

    def _body(self, body: bytes) -> None:
        resp = self.resp
        assert resp is not None
        w = resp._waiter
        waiting = w is not None and not w.done()
        push = resp.push
        if push is not None and waiting and not resp._chunks:
            # the reader is parked and has handled everything before: these bytes may go on now
            try:
                taken = push(body)
            except Exception:  # push reports its failures to the reader; this is a defect of ours
                log.exception("%s: a pushed read failed", self.pool.origin.host_header)
                resp.fail(errors.BackendError(_FAILED_READ))
                self.drop()
                return
            if taken:
                pool = self.pool
                if pool.read_pause and self.nap is None and pool._open - len(pool._idle) >= pool.pause_streams:
                    self._nap()
                return
            if taken is not None:  # partly handled: the reader takes the rest
                resp._kick = True
                w.set_result(None)  # type: ignore[union-attr]
                return
        resp._chunks.append(body)  # written here, not in a Response method: one call per read
        resp._pending += len(body)
        if waiting:
            w.set_result(None)  # type: ignore[union-attr]
        if resp._pending > MAX_PENDING_BYTES:
            self.pause()

    def on_message_complete(self) -> None:
        if self.interim:  # an interim response's end (no body): the final one follows
            self.interim = False
            return
        self._deliver()  # the body's last bytes before its end
        resp = self.resp
        self.resp = None
        self._cancel_timer()
        self._end_nap()  # read on: the connection's next response, or the server closing it
        if resp is not None:
            resp._conn = None
            resp.on_message_complete()
        # A request still being written (the server answered before reading all of it, as with an
        # early 413) keeps the connection busy: a request sent next would queue behind the rest,
        # which the server may never read. Closed, not reused; the abort discards the rest. (A
        # request with a body answered other than with a success is never reused either:
        # on_headers_complete.)
        if self.keep_alive and not self.closed and not self.transport.get_write_buffer_size():  # type: ignore[union-attr]
            self.draining = False
            self.pool._release(self)
        else:
            self.drop()

    # -- the pool's side -----------------------------------------------------------------------

    def _framed(self) -> bool:
        h = self.resp.headers if self.resp is not None else {}
        return "content-length" in h or "chunked" in h.get("transfer-encoding", "").lower()

    def usable(self, now: float) -> bool:
        t = self.transport
        if self.closed or t is None or t.is_closing() or now - self.idle_since >= self.expiry:
            return False
        # An idle connection reads on, so a close by the server is seen, but only once the loop
        # polls: one the server closed since then (or sent stray bytes on) is readable now.
        sock = t.get_extra_info("socket")
        if sock is None:
            return True
        try:
            poller = select.poll()  # (select() refuses descriptors from 1024 on: a busy server's)
            poller.register(sock.fileno(), select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def send(self, head: bytes, body: Payload | None, resp: Response) -> None:
        self.resp = resp
        self.sent_body = bool(body)
        self.parser = httptools.HttpResponseParser(self)
        self.interim = False
        self.keep_alive = True
        self.draining = False
        self.body_seen = False
        self._arm(self.pool.first_byte_timeout)
        if body:
            # head and body in one writev, without copying the body (a conversation's history)
            # into a joined buffer first
            if isinstance(body, list):
                if self.pool.origin.ssl is None:
                    self.transport.writelines([head, *body])  # type: ignore[union-attr]
                else:
                    # TLS makes a record of each piece written: one joined copy costs less (60
                    # pieces of 2 KB: 46 us written joined against 90 us piece by piece)
                    self.transport.writelines((head, b"".join(body)))  # type: ignore[union-attr]
            else:
                self.transport.writelines((head, body))  # type: ignore[union-attr]
        else:
            self.transport.write(head)  # type: ignore[union-attr]

    def _arm(self, seconds: float) -> None:
        """(Re)start the request's one timer: ``_check`` in ``seconds``."""
        if self.timer is not None:
            self.timer.cancel()
        self.mark = self.reads
        self.timer = self.pool.loop.call_later(seconds, self._check)

    def _check(self) -> None:
        """The timer: no head yet, no read since the last check, or a drain that took too long."""
        self.timer = None
        resp = self.resp
        if resp is None:
            return
        if self.draining:
            self.drop()
            return
        if resp._state != _HEAD and self.body_seen and (self.reads != self.mark or self.paused):
            # data arrived meanwhile, or reading is paused because the consumer has not taken
            # what came (back-pressure: the backend is not silent): wait another period
            self._arm(self.pool.idle_timeout)
            return
        early = not self.body_seen  # no head, or no byte of the body, within first_byte_timeout
        log.warning("%s: %s", self.pool.origin.host_header, "no response in time" if early else "silent stream")
        resp.fail(errors.BackendTimeout(_NO_ANSWER if early else _SILENT))
        self.drop()

    def discard_after(self, seconds: float) -> None:
        """Keep reading the rest of the body in the background; close if it takes longer."""
        self.draining = True
        self._arm(seconds)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
            if self.resp is not None and self.body_seen and not self.draining:
                self._arm(self.pool.idle_timeout)  # the backend's silence counts from now

    def _nap(self) -> None:
        """Stop reading for ``Pool.read_pause`` seconds (see the module's docstring)."""
        t = self.transport
        if t is None or self.closed:
            return
        t.pause_reading()
        if self.pool.origin.ssl is not None:
            # Pausing a TLS transport pauses only what it hands over: its TLS layer would read
            # and decrypt the socket on every arrival. With no room in its read buffer it stops
            # reading the socket too (asyncio's and uvloop's TLS transports alike).
            t.set_read_buffer_limits(high=0)  # type: ignore[attr-defined]
        self.nap = self.pool.loop.call_later(self.pool.read_pause, self._wake)

    def _wake(self) -> None:
        self.nap = None
        t = self.transport
        if self.closed or t is None:
            return
        if self.pool.origin.ssl is not None:
            t.set_read_buffer_limits()  # type: ignore[attr-defined]  # the defaults: reads the socket again
        if not self.paused:  # else back-pressure holds it
            t.resume_reading()

    def _end_nap(self, resume: bool = True) -> None:
        if self.nap is not None:
            self.nap.cancel()
            self.nap = None
            if resume:
                self._wake()

    def drop(self) -> None:
        """Close now; never reused."""
        self._cancel_timer()
        self._end_nap(resume=False)
        resp = self.resp
        if resp is not None:
            self.resp = None
            resp._conn = None
            resp.fail(TransientBackendError(_BROKEN))
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            self.pool._lost(self)


def _chunked_alone(transfer_encoding: str) -> bool:
    """A ``Transfer-Encoding`` value that is ``chunked`` alone (any case, any spaces around)."""
    return transfer_encoding.strip().lower() == "chunked"


def _identity(content_encoding: str) -> bool:
    """A ``Content-Encoding`` value that leaves the body as sent (empty or ``identity`` only)."""
    return all(c.strip().lower() in ("", "identity") for c in content_encoding.split(","))


def _keepalive_timeout(header: str, default: float) -> float:
    for part in header.split(","):
        k, _, v = part.strip().partition("=")
        if k.strip().lower() == "timeout":
            try:
                return max(0.0, float(v) - 1.0)
            except ValueError:
                return default
    return default


class Pool:
    """Keep-alive connections to one origin, and the requests sent over them."""

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str] = {},
        ssl_ctx: ssl.SSLContext | None = None,
        max_connections: int = 100,
        max_idle: int = 20,
        connect_timeout: float = 10.0,
        first_byte_timeout: float = 300.0,
        idle_timeout: float = 120.0,
        keepalive_expiry: float = 30.0,
        read_pause: float = 0.0,
        pause_streams: int = 1,
    ) -> None:
        self.origin = Origin(url, ssl_ctx)
        self.max_connections = max(1, max_connections)
        self.max_idle = max(0, max_idle)
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self.keepalive_expiry = keepalive_expiry
        self.read_pause = read_pause  # seconds; see "Read pauses" in the module's docstring
        self.pause_streams = max(1, pause_streams)  # responses served at once for read pauses to apply
        self._idle: list[_Conn] = []
        self._open = 0
        self._waiters: deque[asyncio.Future[object]] = deque()  # requests waiting for a connection, oldest first
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweep: asyncio.TimerHandle | None = None  # the idle connections' expiry (_expire)
        self._sweep_at = 0.0  # when it fires
        fixed = {"host": self.origin.host_header}
        for k, v in headers.items():
            if k.lower() not in _OWN_FIELDS:
                fixed[k.lower()] = v
        if self.origin.basic is not None:
            fixed["authorization"] = self.origin.basic  # as httpx does with a URL's user and password
        # no compression: a body is fed to the SSE decoder as it arrives (without the field, a
        # server may compress; the response would then fail, see on_headers_complete)
        fixed["accept-encoding"] = "identity"
        for k, v in fixed.items():
            if not _FIELD_NAME.fullmatch(k) or any(c in v for c in "\r\n\0"):
                # one line break would end the request's head early: refused at start-up (the
                # value is never repeated, it may be a key)
                raise ValueError(f"the backend request header {k!r} is not a valid HTTP field (a line break in its value?)")
        self._head_fields = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self.opened = 0  # connections opened since start (tests and stats)
        self.reused = 0  # requests sent over a kept-alive connection
        self.closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def open(self) -> int:
        return self._open

    def _head(self, method: str, path: str, length: int | None, extra: str) -> bytes:
        head = f"{method} {self.origin.prefix}{path} HTTP/1.1\r\n{self._head_fields}{extra}"
        if length is not None:
            head += f"content-length: {length}\r\n"
        return (head + "\r\n").encode("latin-1")

    async def stream(self, method: str, path: str, body: Payload | None = None, headers: str = "") -> Response:
        """Send one request; return once the response head has arrived (any status).

        ``body``: bytes, or a list of pieces written as one vectored write. ``headers`` are
        extra header lines, pre-formatted (``"name: value\\r\\n"``). Raises
        ``BackendUnavailable`` (no connection), ``BackendTimeout`` or ``TransientBackendError``.
        """
        length = None if body is None else sum(map(len, body)) if isinstance(body, list) else len(body)
        head = self._head(method, path, length, headers)
        conn = await self._acquire()
        resp = Response(conn)
        conn.send(head, body, resp)
        try:
            await resp.head()
        except BaseException:
            if resp._state != _DONE:
                conn.drop()
            raise
        return resp

    async def error_body(self, resp: Response) -> object:
        """A non-2xx body, read up to ``MAX_ERROR_BODY_BYTES`` and decoded if it is JSON; one
        that does not arrive within ``ERROR_BODY_TIMEOUT`` is taken as empty (its status still
        says what went wrong: a 429 is not a 504 because its body stalled). A body in a transfer
        coding other than chunked is not read (it may run until the connection closes, in a
        coding not decoded): taken as empty, and its connection closed unless it has ended."""
        te = resp.headers.get("transfer-encoding")
        if te is not None and not _chunked_alone(te):
            await resp.aclose()  # abandoned: its connection is dropped, never reused
            return parse_body(b"")
        try:
            async with asyncio.timeout(ERROR_BODY_TIMEOUT):
                raw = await resp.read(MAX_ERROR_BODY_BYTES)
        except (errors.HotloopError, TimeoutError):
            raw = b""
        finally:
            await resp.aclose()
        if not _identity(resp.headers.get("content-encoding", "")):
            raw = b""  # compressed though we asked not: undecodable, the status says enough
        return parse_body(raw)

    # -- connections ---------------------------------------------------------------------------

    async def _acquire(self) -> _Conn:
        if self.closed:
            raise errors.BackendUnavailable("The model backend is not started.")
        loop = self.loop
        idle = self._idle
        front = False  # handed a connection that could not be used: waits again first in line
        while True:
            if not self._waiters:  # first come first served: with requests waiting, queue behind them
                if idle:
                    now = loop.time()
                    while idle:
                        conn = idle.pop()
                        if conn.usable(now):
                            self.reused += 1
                            return conn
                        conn.drop()  # closed by the server, or idle too long: found before any byte was sent
                if self._open < self.max_connections:
                    return await self._connect()
            fut: asyncio.Future[object] = loop.create_future()
            if front:
                self._waiters.appendleft(fut)
            else:
                self._waiters.append(fut)
            try:
                async with asyncio.timeout(self.connect_timeout):
                    got = await fut
            except BaseException as exc:
                if fut.done() and not fut.cancelled():
                    # handed a connection or a slot, then cancelled or timed out before taking
                    # it: it goes to the next request waiting (or back to the pool)
                    self._hand_on(fut.result())
                if isinstance(exc, TimeoutError):
                    raise errors.BackendUnavailable("Too many connections to the model backend are busy.") from None
                raise
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
            if self.closed or got is None:  # (aclose wakes its waiters with None)
                self._hand_on(got)
                raise errors.BackendUnavailable("The model backend is not started.")
            if got is _SLOT:  # a closed connection's slot, counted as open for this request
                return await self._connect(reserved=True)
            conn = got  # type: ignore[assignment]
            if conn.usable(loop.time()):
                self.reused += 1
                return conn
            conn.drop()  # closed since it was handed over: its slot goes to whoever waits first
            front = True

    def _hand_on(self, got: object) -> None:
        """What a waiter was handed and will not use: a connection goes back (to the next
        waiter, or idle), a slot to the next waiter (or is given up)."""
        if got is _SLOT:
            self._open -= 1
            self._wake_waiter()
        elif got is not None:
            self._release(got)  # type: ignore[arg-type]

    async def _connect(self, reserved: bool = False) -> _Conn:
        """A new connection, within ``connect_timeout``. ``reserved``: its slot is already
        counted in ``_open`` (handed to a waiter by :meth:`_lost`)."""
        o = self.origin
        if not reserved:
            self._open += 1
        conn = _Conn(self)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await self.loop.create_connection(
                    lambda: conn, o.host, o.port, ssl=o.ssl, server_hostname=o.host if o.ssl else None
                )
        except TimeoutError:
            self._lost(conn)
            log.warning("%s: connect timed out", o.host_header)
            raise errors.BackendUnavailable(_UNAVAILABLE) from None
        except (OSError, ssl.SSLError) as exc:
            self._lost(conn)
            log.warning("%s: could not connect (%s)", o.host_header, type(exc).__name__)
            raise errors.BackendUnavailable(_UNAVAILABLE) from None
        except BaseException:
            self._lost(conn)
            if conn.transport is not None:
                conn.transport.abort()
            raise
        self.opened += 1
        return conn

    def _release(self, conn: _Conn) -> None:
        """A connection whose response ended cleanly: back to the pool, or closed."""
        if self.closed:
            conn.drop()
            return
        conn.idle_since = now = self.loop.time()
        conn.resume()
        waiters = self._waiters
        while waiters:  # straight to the request waiting longest, never idle in between
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        if len(self._idle) >= self.max_idle:
            conn.drop()
            return
        self._idle.append(conn)
        due = now + conn.expiry
        if self._sweep is None or due < self._sweep_at:  # else the timer fires first anyway
            self._arm_sweep(due)

    def _arm_sweep(self, due: float) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        self._sweep_at = due
        self._sweep = self.loop.call_at(due, self._expire)

    def _expire(self) -> None:
        """The pool's one expiry timer: close the idle connections due, re-arm for the next one."""
        self._sweep = None
        limit = self.loop.time() + _EXPIRY_SLACK
        for conn in [c for c in self._idle if c.idle_since + c.expiry <= limit]:
            conn.drop()  # (_lost takes it out of _idle)
        if self._idle and not self.closed:
            self._arm_sweep(min(c.idle_since + c.expiry for c in self._idle))

    def _lost(self, conn: _Conn) -> None:
        """Called once per connection when it closes (or fails to open)."""
        if conn.counted_out:
            return
        conn.counted_out = True
        self._open -= 1
        try:
            self._idle.remove(conn)
        except ValueError:
            pass
        self._wake_waiter()

    def _wake_waiter(self) -> None:
        """A slot is free (``_open`` below the limit): handed to the request waiting longest,
        counted as open for it at once, so that no request arriving meanwhile takes it."""
        while self._waiters and self._open < self.max_connections:
            fut = self._waiters.popleft()
            if not fut.done():
                self._open += 1
                fut.set_result(_SLOT)
                return

    async def aclose(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._idle):
            conn.drop()
        self._idle.clear()
        while self._waiters:  # requests waiting for a connection fail now, not at their timeout
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)




async def post_chat_stream(pool: Pool, path: str, body: Payload, request_id: str | None = None) -> tuple[Response, Any]:
    """``POST`` a streaming chat-completions body (with ``x-request-id`` when given): the
    response, and for a non-2xx answer its error body (read whole; ``None`` for a 2xx)."""
    resp = await pool.stream("POST", path, body, f"x-request-id: {request_id}\r\n" if request_id else "")
    return resp, (await pool.error_body(resp) if resp.status >= 300 else None)


async def open_chat_stream(
    pool: Pool, path: str, body: Payload, *, backend: str, model: str, request_id: str | None = None
) -> Response:
    """:func:`post_chat_stream`, a non-2xx answer raised as its typed error."""
    resp, payload = await post_chat_stream(pool, path, body, request_id)
    if resp.status >= 300:
        raise status_error(resp.status, resp.headers, payload, backend=backend, model=model)
    return resp


def lean_pool(url: str, headers: Mapping[str, str], config: Any, backend: str) -> Pool | None:
    """The lean transport's pool for ``url``, or ``None`` when a proxy applies to it (the caller
    then keeps its SDK transport; the log says why)."""
    proxy = proxy_for(url)
    if proxy is not None:
        log.info("%s backend: a proxy is configured for %s; using the sdk transport", backend, urlsplit(url).hostname)
        return None
    return Pool(
        url,
        headers=headers,
        max_connections=config.backend_max_connections,
        max_idle=config.backend_max_idle,
        first_byte_timeout=config.backend_timeout,
        idle_timeout=config.backend_idle_timeout,
        read_pause=config.backend_read_pause_ms / 1000,
        pause_streams=config.backend_read_pause_streams,
    )
