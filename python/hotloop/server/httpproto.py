"""uvicorn's httptools HTTP protocol with two global bounds: open connections and request read time.

Connection limit. At most ``max_connections`` client connections are served at once (HTTP and
WebSocket together: a connection keeps its place when it upgrades, and gives it back when it
closes). A connection beyond the limit is not handed to the application: once its request head
has arrived it is answered ``503`` with the OpenAI error envelope (``type: server_error``,
``code: server_overloaded``, ``retry-after``) and closed (lingering, see below), which for a
WebSocket upgrade is the handshake's rejection. It is never counted, and it too must send its
head within the read timeout.

Read timeout. A request's head and body must arrive within ``read_timeout`` seconds of its first
byte (of the connection's opening, for the first request): then the connection is closed, with a
``408`` in the OpenAI shape if no response has started. One timer per connection, armed only
while a request is being read: the idle time of a keep-alive connection between requests is not
counted (uvicorn's keep-alive timeout closes those), nor is the time the application takes to
answer. A WebSocket handshake is a request head like any other; once upgraded, the connection
belongs to :class:`~hotloop.server.wsproto.CorkedWebSocketProtocol`.

Lingering close. An answer that ends the connection (a 400 for a malformed request or a
pipelined WebSocket handshake, a 431, a 408, the 503 beyond the limit, a final answer to
``Expect: 100-continue``, and a response on a connection that does not stay open, HTTP/1.0 or
``Connection: close``, written before its request's body was read) is followed by a FIN; what
the client still sends is read and dropped, and the connection closes when the client closes its
side, at most ``LINGER_SECONDS`` (and the read timeout) later. Closed at once, a socket holding
bytes the client sent and the server had not read (the rest of a body, frames behind a
handshake) was reset, and the client read ``connection reset`` after the answer or instead of
it. An admitted connection keeps its place under the limit while it lingers; at most
``MAX_LINGERING_REJECTED`` connections beyond the limit linger at once (the others are closed at
once, as before).

Request bodies. A Content-Length body of up to ``BODY_BUFFER`` bytes is read by the kernel straight
into the buffer the application receives (:class:`HttpReader`, ``get_buffer``); other bodies are
collected from the parser and handed over whole. Either way the application is woken once per
body, not once per read.

Relies on ``HttpToolsProtocol`` internals (``connections``, ``transport``, ``cycle``, ``parser``,
``headers``, ``server_state``, ``logger``, the parser callbacks and ``handle_websocket_upgrade``)
and, for the scope extensions below, on ``RequestResponseCycle``'s request and response state
(``body``, ``more_body``, ``message_event``, ``flow``, ``waiting_for_100_continue``) and
``STATUS_LINE``: the uvicorn version range is pinned in ``pyproject.toml`` and the integration
tests run through this class.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import urllib.parse
from typing import Any, Callable

import httptools
from uvicorn.protocols.http.flow_control import FlowControl, service_unavailable
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from hotloop import errors
from hotloop._accel import body_buffer
from hotloop.protocol import events as ev
from hotloop.server.common import request_id

log = logging.getLogger("hotloop.server")

MAX_REJECTED_HEAD = 64 * 1024  # bytes read from a connection beyond the limit before it is closed
# Seconds a connection stays open, reading and dropping, after a final answer to a request that
# asked for 100 Continue and sent no body (at most the read timeout): the client may send the body
# anyway (RFC 9110 10.1.1 lets it), and a close while it does could reset the connection before it
# read the answer (a lingering close, as nginx's). The answer says connection: close.
LINGER_SECONDS = 2.0
# Connections beyond the limit (answered 503) that may linger at once, per server: beyond it, one
# is closed at once (its client may read a reset). Such a connection is not counted under the
# limit, so its linger is bounded here: a flood of them holds at most this many sockets for at
# most LINGER_SECONDS each (a well-behaved client closes on the FIN, ending its linger at once).
MAX_LINGERING_REJECTED = 64
# Pipelined requests that may wait on one connection while the request before them runs. uvicorn
# parsed every request head of a read (a 64 KiB read holds about 1,900 small ones) and queued
# them all, each read after a response adding more, without a bound (one client pipelining
# `GET /healthz` took the server to 2.4 GB in 20 s). Now the bytes after the head that fills
# the queue wait, unparsed (at most a read's, READ_BUFFER), with reading paused (_Flow), until a
# response makes room: pipelining of any depth is answered, in order, in bounded memory.
MAX_PIPELINED = 32
ON_DISCONNECT = "hotloop.http.on_disconnect"
"""Scope extension: ``on_disconnect(callback)`` has ``callback()`` called once if the client's
connection is lost before the response is complete; ``on_disconnect(None)`` takes it back. It
spares a request a task waiting on ``receive()`` for ``http.disconnect`` (other servers, and tests
driving the ASGI app directly, do not offer it)."""

SEND_NOW = "hotloop.http.send_now"
"""Scope extension: ``send_now(body)`` writes ``body`` at once as the next piece of the request's
streaming (chunked) response, which must have started; from synchronous code, such as a backend
read callback (push delivery). Returns whether the client takes more now: false if the write
buffer is above its high-water mark (the caller's next ``send`` waits, as usual) or if the client
has gone (nothing is written)."""

CORK = "hotloop.http.cork"
"""Scope extension: ``cork(True)`` holds what the request's response writes (its head, its body
pieces, :data:`SEND_NOW` writes) and ``cork(False)`` writes what was held, in one write: the
head of a response goes out with its first piece of body, not in a write (and a loopback
delivery, a wake-up of the client) of its own. Held bytes never outlive the cork: a close of
the connection writes them first."""

RESPOND = "hotloop.http.respond"
"""Scope extension: ``respond(status, headers, body)`` writes a whole response, its head (with
the server's default headers, then ``headers``, which must include ``content-length``) and
``body``, in one write, and completes the request, as ``send`` does for ``http.response.start``
and one final ``http.response.body`` but without the two awaits or a check of each header
(the application's own). Returns false, writing nothing, when uvicorn must do it instead: its
access log is on (it writes the line), the client is not taking what was written (its ``send``
waits for it), or the response has started; then ``send`` as usual."""

RECEIVE = "hotloop.http.receive"
"""Scope extension: ``await receive()`` is the request's ``receive`` without its copy of the
body: a body this protocol read straight into its own buffer (see ``get_buffer``) arrives as that
``bytearray``, where uvicorn's ``receive`` would copy it into a new ``bytes``."""

# Request body bytes buffered before the application is woken to take them (and reading pauses
# until it has): a body up to this size reaches the application in one piece, at its end.
BODY_BUFFER = 1024 * 1024
# The bytes a read takes when it is not a body's (a request head, a chunked body): one buffer per
# server, which each read's bytes leave before the next read (the parser copies what it keeps).
READ_BUFFER = 64 * 1024
# Body buffers allocated ahead of their bytes (a body read directly is given its declared size
# when its head is complete), at most this many bytes at once per server: beyond it, a body is
# read through the parser, into memory as its bytes arrive. A client that declares a body and
# sends nothing cannot make the server hold more than this.
DIRECT_BODY_BYTES = 64 * 1024 * 1024
# A directly read body's buffer is allocated in whole steps of this many bytes (its length is the
# body's). A client resending its growing history sends each body a little longer than the one
# before, so a buffer of its exact size never fits the memory freed by an earlier one (the body
# just before is still held by the prefix cache) and lands somewhere the process has not used
# lately. Rounded up, it mostly fits the buffer of the body before last, freed by then: at 200 KB
# of history, 20-45 us less server CPU per HTTP turn (`hotloop bench http-loop`, six paired
# invocations). At most BODY_STEP - 1 bytes over a body's length, counted in DIRECT_BODY_BYTES
# and in the prefix cache's byte budget (both count what is allocated).
BODY_STEP = 64 * 1024
# A request head (request line and fields) is at most this many bytes: beyond it the request is
# answered 431 and the connection closed. The parser keeps a field, and the URL, until it ends
# (one unfinished head of 300 MB fields took 300 MB; a 64 MB URL, 12 s of CPU to join).
MAX_REQUEST_HEAD = 64 * 1024
_HEAD_END = b"\r\n\r\n"


class Limits:
    """One server's connection count and read timeout, shared by its protocol instances."""

    __slots__ = (
        "max_connections", "read_timeout", "admitted", "rejected", "timed_out", "scratch", "direct_bytes", "lingering",
    )

    def __init__(self, max_connections: int, read_timeout: float) -> None:
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.admitted: set[Any] = set()  # transports of the connections served now
        self.rejected = 0  # connections beyond the limit, not served (answered 503, or closed; since start)
        self.timed_out = 0  # connections closed by the read timeout (since start)
        # what the server's reads of request heads go into (its event loop reads one at a time)
        self.scratch = bytearray(READ_BUFFER)
        self.direct_bytes = 0  # the buffers of bodies being read directly (DIRECT_BODY_BYTES)
        self.lingering = 0  # connections beyond the limit closing lingering (MAX_LINGERING_REJECTED)

    def admit(self, transport: Any) -> bool:
        if len(self.admitted) >= self.max_connections:
            return False
        self.admitted.add(transport)
        return True

    def release(self, transport: Any) -> None:
        self.admitted.discard(transport)


def _error_response(exc: errors.HotloopError, extra: list[tuple[bytes, bytes]]) -> bytes:
    body = ev.http_error_body(exc)
    reason = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
              503: b"Service Unavailable"}.get(exc.status, b"Error")
    head = [
        b"HTTP/1.1 %d %s" % (exc.status, reason),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"connection: close",
        b"x-request-id: " + request_id().encode(),
        *(name + b": " + value for name, value in extra),
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def malformed_response(
    message: str = "The request is not a valid HTTP/1.1 request.", code: str = "invalid_http_request"
) -> bytes:
    """The 400 a request that is not HTTP/1.1 gets (a bad head, a bad chunked body; with another
    message and code, a WebSocket handshake that cannot be parsed): the OpenAI error shape, as
    every other error, not uvicorn's text."""
    return _error_response(errors.InvalidRequest(message, code=code), [])


def overloaded_response() -> bytes:
    """The 503 a connection beyond the limit gets (HTTP request or WebSocket upgrade alike)."""
    exc = errors.ServerOverloaded("The server is at its connection limit. Please retry shortly.")
    return _error_response(exc, [(b"retry-after", b"1"), (b"x-should-retry", b"true")])


def head_too_large_response() -> bytes:
    """The 431 a request whose head passes MAX_REQUEST_HEAD gets."""
    exc = errors.InvalidRequest(
        f"The request's head (its line and header fields) is larger than {MAX_REQUEST_HEAD} bytes.",
        code="request_header_fields_too_large",
    )
    exc.status = 431
    return _error_response(exc, [])


def timeout_response(seconds: float) -> bytes:
    """The 408 a request that did not arrive in time gets."""
    return _error_response(errors.RequestTimeout(seconds), [])


class _Flow(FlowControl):
    """uvicorn's flow control, but reading stays paused while the connection holds bytes that
    wait for room in its pipeline (``held``): a request's ``receive()`` resumes reading, and a
    read per request processed would let a client that pipelines on grow what is held."""

    held = False

    def resume_reading(self) -> None:
        if not self.held:
            super().resume_reading()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` under :class:`Limits` (set ``limits`` on a subclass per server)."""

    limits: Limits
    flow: _Flow

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._admitted = False
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading_since: float | None = None  # when the request being read was due from
        self._read_due = 0.0  # the time the read timer was set for
        self._rejected_head = b""
        self._gone: tuple[Any, Callable[[], None]] | None = None  # (cycle, ON_DISCONNECT callback)
        self._body_parts: list[bytes | bytearray] = []  # the request body's reads not yet handed over
        self._body_size = 0
        # A body read straight into its own buffer (see get_buffer), and how much of it has come
        self._into: bytearray | None = None
        self._filled = 0
        self._upgraded = False
        self._skip = 0  # bytes of the body being read through the parser not fed to it yet
        self._held = b""  # a read's bytes after MAX_PIPELINED waiting requests (on_response_complete)
        # between a request's first byte and its last (a body read through the parser, chunked
        # ones among them, is fed on: bytes are held only where a request would begin)
        self._in_message = False
        # Keep-alive: one timer per connection (as the read timer), not one per response
        self._idle_since: float | None = None  # when the connection last fell idle (None: busy)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_due = 0.0
        self._head_open = False  # a request's head has begun and not ended (MAX_REQUEST_HEAD)
        self._head_read = 0  # its bytes so far
        # A body read through the parser (chunked): the body bytes it has given so far, and the
        # bytes fed in a row that gave none (chunk framing and extensions, the trailer section,
        # whose fields the parser holds until each ends: bounded as a head's are)
        self._body_given = 0
        self._quiet = 0
        # the body of a request with an Upgrade this server does not speak, read here (see
        # on_headers_complete): the parser's completion of its message at its head is not one
        self._late_body = False
        # An answer that refuses the connection's next request (a malformed or oversized one, a
        # stalled one, a pipelined handshake), waiting for the responses before it to be written:
        # then it is written and the connection closed. Nothing more is read meanwhile.
        self._refusal: bytes | None = None
        self._stopped = False  # refused: nothing more of the connection's bytes is parsed
        self._at_head_end = False  # the piece being parsed ends where a request head ends
        # how many of _HEAD_END's first bytes the head bytes fed so far end with (its blank line
        # split across reads: _feed)
        self._head_tail = 0
        # a lingering close (_close_lingering): its timer, and whether it counts in Limits.lingering
        self._linger_timer: asyncio.TimerHandle | None = None
        self._lingers_rejected = False

    # -- connection limit -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _Flow(transport)  # (nothing holds uvicorn's yet: its cycles come with requests)
        self._admitted = self.limits.admit(transport)
        if not self._admitted:
            self.connections.discard(self)  # not served, not counted
            self.limits.rejected += 1
        self._arm()  # the first request's head is due within the read timeout

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm(cancel=True)
        self._stop_idle()
        self._drop_into()  # a body cut short
        self.limits.release(self.transport)
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
            if self._lingers_rejected:
                self._lingers_rejected = False
                self.limits.lingering -= 1
        if not self._admitted:
            return
        super().connection_lost(exc)
        gone, self._gone = self._gone, None
        if gone is not None and not gone[0].response_complete:
            gone[1]()

    def on_headers_complete(self) -> None:
        # uvicorn's, then the request's extensions and how its body is read. Its URL is parsed
        # only when it has a query, a fragment or an absolute form (a plain path is the path).
        parser = self.parser
        scope = self.scope
        http_version = parser.get_http_version()
        scope["method"] = parser.get_method().decode("ascii")
        self._head_open = False
        if http_version != "1.1":
            scope["http_version"] = http_version
        upgrade = parser.should_upgrade()
        if upgrade and self._should_upgrade():
            return
        late = 0
        if upgrade and scope["method"] != "CONNECT":
            # An Upgrade this server does not speak (h2c, which curl --http2 offers on every
            # request): ignored, as RFC 9110 (7.8) lets a server, and the request served as
            # HTTP/1.1. The parser (httptools) takes any upgrade request as bodiless whatever
            # its head says, and would parse its body as the next requests (a front proxy that
            # reads it as a body would then carry another client's request to it). So a
            # Content-Length body is read here, straight into its buffer; a body that cannot be
            # (chunked, with Expect, too large) is refused, 400, and the connection closed.
            late = _upgrade_body_length(self.headers)
            # (the head's end must be where this read's piece ends: the parser stops there and
            # takes nothing after it, so a head fed with the start of its body would lose those
            # bytes; _feed cuts a piece at a head's end, one split across reads too)
            if late and not self._at_head_end:
                late = -1
            if late < 0 or late > BODY_BUFFER or self.limits.direct_bytes + _body_capacity(late) > DIRECT_BODY_BYTES:
                self._refuse(malformed_response(
                    "A request with an Upgrade other than websocket may carry only a Content-Length body of at most "
                    f"{BODY_BUFFER} bytes.", code="unsupported_upgrade"
                ))
                return
        url = self.url
        if url[:1] == b"/" and b"?" not in url and b"#" not in url:
            raw_path, query = url, b""
        else:
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path, parsed.query or b""
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root = self.root_path
        scope["path"] = root + path
        scope["raw_path"] = root.encode("ascii") + raw_path if root else raw_path
        scope["query_string"] = query
        if self.limit_concurrency is not None and (
            len(self.connections) >= self.limit_concurrency or len(self.tasks) >= self.limit_concurrency
        ):
            app = service_unavailable
            self.logger.warning("Exceeded concurrency limit.")
        else:
            app = self.app
        existing = self.cycle
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        if http_version == "1.0":
            # An HTTP/1.0 request's expectation is ignored (RFC 9110, 10.1.1): its client knows
            # no interim response, and would read a 100 Continue as the answer.
            self.expect_100_continue = False
        cycle = self.cycle = RequestResponseCycle(
            scope=scope,  # type: ignore[arg-type]
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=self.expect_100_continue,
            keep_alive=keep_alive,
            on_response=self.on_response_complete,
        )
        if not keep_alive:  # (HTTP/1.0, Connection: close) its response's close may linger
            cycle.transport = _ClosesLingering(cycle, self)  # type: ignore[assignment]
        extensions: dict[str, Any] = {
            ON_DISCONNECT: functools.partial(self._on_disconnect, cycle),
            SEND_NOW: functools.partial(_send_now, cycle),
            CORK: functools.partial(_cork, cycle),
            RESPOND: functools.partial(_respond, cycle, self),
            RECEIVE: functools.partial(_receive, cycle),
        }
        scope["extensions"] = extensions  # type: ignore[typeddict-item]
        # A CONNECT or an upgrade request (an Upgrade header other than a WebSocket's, which
        # returned above) has no body for the parser, whatever its Content-Length says: its
        # message completes with its head, and a buffer allocated for the body would be handed
        # over unfilled (the memory of earlier requests).
        size = late if upgrade else _body_length(self.headers)
        if late or _reads_directly(size) and self.limits.direct_bytes + _body_capacity(size) <= DIRECT_BODY_BYTES:
            self._late_body = bool(late)
            self.limits.direct_bytes += _body_capacity(size)
            self._into = new_body(size)
            self._filled = 0
        elif size > 0:
            self._skip = size  # body bytes: no head to look for in them (_feed)
        if existing is None or existing.response_complete:
            self._start_asgi_task(cycle, app)
        else:  # a pipelined request waits for the one before it
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, app))

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to what its parser refuses (its log line says what) was text/plain,
        # written at once, inside a response still being written or ahead of one still to come
        self._refuse(malformed_response())

    def _refuse(self, answer: bytes) -> None:
        """Answer the connection's newest request with ``answer`` (an error that closes the
        connection) after the responses to the requests before it, never inside or ahead of
        one of them; parse nothing more. The first refusal stands (a read timeout does not
        replace the 400 of the request it would time out)."""
        if self._stopped:
            return
        self._stopped = True
        self._disarm()
        self._held = b""
        self.flow.held = True
        self.flow.pause_reading()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.more_body:
            # the refused bytes are the newest request's own body (a malformed chunk)
            if self.pipeline and self.pipeline[0][0] is cycle:
                self.pipeline.popleft()  # it waited for its turn: it never runs
                self._refusal = answer
                return
            # it runs, its application waiting for the body: answered now (cut if it started)
            if not cycle.response_started:
                self.transport.write(answer)
            cycle.disconnected = True
            cycle.message_event.set()
            self._close_lingering()
        elif (cycle is None or cycle.response_complete) and not self.pipeline:
            self.transport.write(answer)
            self._close_lingering()
        else:
            self._refusal = answer  # on_response_complete writes it once they are written

    def _on_disconnect(self, cycle: Any, callback: Callable[[], None] | None) -> None:
        # uvicorn runs one request of a connection at a time (pipelined ones wait), so one slot.
        # A request takes back only its own callback: its task may still be finishing (closing
        # its backend stream) after its response is complete, when the connection's next
        # request has already put its own here.
        if callback is not None:
            self._gone = (cycle, callback)
        elif self._gone is not None and self._gone[0] is cycle:
            self._gone = None

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self._feed(data, 0, len(data))
            return
        # beyond the limit: wait for the head, answer 503, close lingering (nothing reaches the app)
        if self._stopped or self.transport.is_closing():
            return
        self._rejected_head += data
        if b"\r\n\r\n" in self._rejected_head:
            self._disarm()
            self._rejected_head = b""
            self.transport.write(overloaded_response())
            self._close_lingering()
        elif len(self._rejected_head) > MAX_REJECTED_HEAD:
            self._disarm()
            self.transport.close()

    # -- reading a body straight into its buffer ---------------------------------------------------

    # A request with a Content-Length body of READ_BUFFER to BODY_BUFFER bytes (no
    # Transfer-Encoding, no Expect) gets a buffer of that size when its head is complete, and the reads after the head
    # go into it (get_buffer): the kernel copies the body where the application will read it,
    # instead of into the loop's read buffer, then a bytes object per read, then the parser's
    # bytes per piece, then a joined body. The parser sees the head alone; once the body is in,
    # the connection gets a fresh parser for its next request (the old one still counts the
    # body it never saw). Everything else (heads, chunked bodies, larger bodies) goes through
    # the parser as before, read into the server's scratch buffer.

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        into = self._into
        if into is not None:
            return memoryview(into)[self._filled :]
        return self.limits.scratch

    def buffer_updated(self, nbytes: int) -> None:
        into = self._into
        if into is not None:
            self._unset_keepalive_if_required()
            self._filled += nbytes
            if self._filled == len(into):
                self._body_read()
            return
        scratch = self.limits.scratch
        if self._admitted:
            self._feed(scratch, 0, nbytes)
        elif not self._stopped:  # (a connection beyond the limit, answered: dropped)
            self.data_received(bytes(memoryview(scratch)[:nbytes]))

    def _feed(self, data: bytes | bytearray, start: int, stop: int) -> None:
        """Hand ``data[start:stop]`` (one read) to the parser, a request head at a time, and
        what follows a head whose body is read directly to that body."""
        view = memoryview(data)
        if self._stopped:
            return
        if self._held:  # bytes wait for room in the pipeline (reading stays paused meanwhile,
            # _Flow; should a read come anyway, it goes after them, unparsed until they are)
            self._held += bytes(view[start:stop])
            self.flow.pause_reading()
            return
        while start < stop:
            into = self._into
            if into is not None:  # the rest of the read is (the start of) the body
                k = min(stop - start, len(into) - self._filled)
                # through a view: a bytearray's slice assignment copies any other object into a
                # temporary bytearray first (two copies of up to READ_BUFFER bytes, not one)
                memoryview(into)[self._filled : self._filled + k] = view[start : start + k]
                self._filled += k
                start += k
                if self._filled == len(into):
                    self._body_read()
                continue
            if self._upgraded or self._stopped or self.parser is None or self.transport.is_closing():
                if self._upgraded and start < stop and not self.transport.is_closing():
                    # What the client sent in the same write as its handshake (its first frames,
                    # ahead of the 101) belongs to the WebSocket protocol the connection now has:
                    # dropped, the client waited for an answer to a request never read.
                    ws = self.transport.get_protocol()
                    if ws is not self and isinstance(ws, asyncio.Protocol):
                        ws.data_received(bytes(view[start:stop]))
                return  # upgraded, or refused or closing: the rest is not this protocol's
            skip = self._skip
            if skip:  # the body of a request read through the parser: no head in it
                cut = start + min(stop - start, skip)
                self._skip = skip - (cut - start)
            else:
                if len(self.pipeline) >= MAX_PIPELINED and not self._in_message:  # another head, with that many waiting:
                    self._held = bytes(view[start:stop])  # parsed once a response makes room
                    self.flow.pause_reading()
                    self.flow.held = True  # and reading stays paused until then
                    return
                end = data.find(_HEAD_END, start, stop)
                ended = end >= 0
                cut = end + len(_HEAD_END) if ended else stop
                tail = self._head_tail
                if tail:  # the bytes before ended with the start of a head's end
                    self._head_tail = 0
                    if data.startswith(_HEAD_END[tail:], start, stop):
                        cut = start + len(_HEAD_END) - tail  # it ends here, ahead of any end in this read
                        ended = True
                if not ended:
                    self._head_tail = _head_end_begun(data, start, stop, tail)
                self._at_head_end = ended
                # these bytes are all head (one that goes on, or begins here): with the ones
                # before them, within the bound, whether or not the head ends in this read
                if (self._head_read if self._head_open else 0) + (cut - start) > MAX_REQUEST_HEAD:
                    self._refuse(head_too_large_response())
                    return
            in_body = self._in_message and not self._head_open
            given = self._body_given
            super().data_received(view[start:cut])  # type: ignore[arg-type]
            if self._head_open:  # all of it went to a head that has not ended
                self._head_read += cut - start
            elif in_body and self._in_message:
                if self._body_given != given:
                    self._quiet = 0
                else:
                    # bytes of a chunked body that held no body byte: an endless chunk extension
                    # or trailer section grew the parser's buffers (and, field by field, the
                    # request's headers) without bound; refused as an oversized head
                    self._quiet += cut - start
                    if self._quiet > MAX_REQUEST_HEAD:
                        self._refuse(head_too_large_response())
                        return
            start = cut

    def _drop_into(self) -> None:
        into = self._into
        if into is not None:
            self._into = None
            self.limits.direct_bytes -= _body_capacity(len(into))

    def _body_read(self) -> None:
        """The directly read body is complete: the request's message is."""
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's
        self.on_message_complete()

    # -- read timeout ---------------------------------------------------------------------------

    # One timer per connection, not one per request: a request read in time does not cancel it;
    # when it fires it finds nothing being read (and is not set again until a request begins),
    # or the request being read now, which it times out or waits for until that one is due.
    # Creating and cancelling a timer on every keep-alive request cost more than the check.

    def _arm(self) -> None:
        if self._reading_since is None:  # else the head already due (since the connection opened)
            self._reading_since = self.loop.time()
        if self._read_timer is None:
            self._set_read_timer(self._reading_since + self.limits.read_timeout)

    def _set_read_timer(self, due: float) -> None:
        self._read_due = due
        self._read_timer = self.loop.call_at(due, self._read_check)

    def _disarm(self, cancel: bool = False) -> None:
        self._reading_since = None
        if cancel and self._read_timer is not None:  # the connection is gone or upgraded
            self._read_timer.cancel()
            self._read_timer = None

    def _read_check(self) -> None:
        self._read_timer = None
        since = self._reading_since
        if since is None:
            return
        if self.pipeline or self._held:
            # reading is paused for the requests waiting their turn (not the client's doing):
            # the request being read is due a read timeout from now, again
            self._reading_since = since = self.loop.time()
        due = since + self.limits.read_timeout
        # set for an earlier request: wait for this one's own deadline
        if _later(due, self._read_due, self.loop.time()):
            self._set_read_timer(due)
        else:
            self._read_timed_out()

    def on_message_begin(self) -> None:
        self._in_message = True
        self._idle_since = None  # busy (a request began; bytes before one, such as CRLFs, do not)
        self._head_open = True
        self._head_read = 0
        self._quiet = 0
        self._body_parts = []
        self._body_size = 0
        self._skip = 0
        super().on_message_begin()
        self._arm()  # a request's first byte (keep-alive idle time before it is not counted)

    # -- keep-alive timeout -----------------------------------------------------------------------

    # uvicorn sets a timer when a response completes and cancels it when the next request's
    # first bytes arrive: a timer made and cancelled per request. Here the connection keeps one,
    # as its read timer: when it fires it closes the connection if it has been idle for the
    # keep-alive timeout, or waits for the idle time's own deadline.

    def on_response_complete(self) -> None:
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if self._in_message and not self.pipeline and self._awaits_continue(self.cycle):
            # the response (connection: close) is the newest request's, whose body the client may
            # or may not send (what it sends next would be read as it): nothing more is parsed,
            # what comes is dropped, and the connection closes lingering (no 408 for a body
            # nobody waits for; its FIN after the response: its cork's, if held)
            self._close_lingering()
            return
        started = bool(self.pipeline)
        if started:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        if self._refusal is not None:
            if not started:  # every response before the refused request is written, or held
                # by its cork until its sender takes the cork out, later in this step: after it
                self.loop.call_soon(self._write_refusal)
            return
        held = self._held
        if held:  # request bytes that waited for room in the pipeline (_feed)
            self._held = b""
            self.flow.held = False
            self._feed(held, 0, len(held))
            if self._held:
                return  # still no room: reading stays paused
        self.flow.resume_reading()
        if started or (self.cycle is not None and not self.cycle.response_complete):
            return  # a request runs (one that waited, or one the held bytes held)
        if self._in_message:
            # a request still arriving: the body of one answered early (a 401, a 413), or the
            # next one's head; its read timeout bounds it, and the connection is idle from its
            # end (on_message_complete), not from now (the keep-alive timeout cut it off, a slow
            # upload's answer unread)
            return
        self._become_idle()

    def _become_idle(self) -> None:
        self._idle_since = now = self.loop.time()
        if self._idle_timer is None:
            self._set_idle_timer(now + self.timeout_keep_alive)

    def _awaits_continue(self, cycle: Any) -> bool:
        """Whether the client of ``cycle``, answered (or being answered) before its body was
        read, waits for the ``100 Continue`` it asked for and will not send that body: what it
        sends next on the connection (a request) would be read as the body, and dropped. No
        body byte has come, and the application never asked for it (which sends the 100)."""
        return (
            cycle is self.cycle and self._in_message and not self._head_open and self.expect_100_continue
            and not getattr(cycle, "continued", False) and not self._body_parts and not cycle.body
        )

    def _write_refusal(self) -> None:
        refusal, self._refusal = self._refusal, None
        if refusal is not None and not self.transport.is_closing():
            self.transport.write(refusal)
            self._close_lingering()

    # -- lingering close --------------------------------------------------------------------------

    # An answer that ends the connection (a refusal, a 503 beyond the limit, a 408, a response on
    # a connection that does not stay open) may leave bytes the client sent unread: the rest of a
    # body, frames behind a handshake, whatever came while reading was paused, or what the client
    # sends while the answer is on its way. A socket closed with unread bytes is reset (Linux),
    # and the client reads ``connection reset`` after the answer, or instead of it. So the answer
    # is followed by a FIN, what comes is read and dropped, and the connection closes once the
    # client closes its side (eof_received: the transport closes itself) or LINGER_SECONDS later
    # (at most the read timeout), as nginx's lingering close. An admitted connection keeps its
    # place under the limit meanwhile; one beyond it lingers only while fewer than
    # MAX_LINGERING_REJECTED do (else it is closed at once).

    def _close_lingering(self) -> None:
        """Close the connection, lingering, after an answer just written (it says
        ``connection: close``): nothing more is parsed or answered."""
        t = self.transport
        if self._linger_timer is not None or t.is_closing():
            return
        limits = self.limits
        if not self._admitted:
            if limits.lingering >= MAX_LINGERING_REJECTED:
                t.close()
                return
            limits.lingering += 1
            self._lingers_rejected = True
        self._stopped = True  # what comes is read into the scratch buffer and dropped (_feed)
        self._disarm(cancel=True)
        self._stop_idle()
        self._drop_into()
        self._held = b""
        self._refusal = None
        self.pipeline.clear()  # requests that never ran
        self._linger_timer = self.loop.call_later(min(LINGER_SECONDS, limits.read_timeout), t.close)
        cycle = self.cycle
        if cycle is not None:
            cycle.waiting_for_100_continue = False  # (its receive() writes no 100 after the FIN)
            if type(cycle.transport) is _Corked:  # the response its sender has not uncorked yet
                cycle.transport.flush()  # goes first (the cork stays, empty: nothing follows)
        try:
            eof = t.can_write_eof()  # (not over TLS: then the linger alone)
        except NotImplementedError:
            eof = False
        if eof:
            t.write_eof()  # once what is buffered has been written
        self.flow.held = False
        self.flow.resume_reading()

    def _closing_response(self, cycle: Any) -> None:
        """The response of ``cycle``, on a connection that does not stay open, is complete:
        close lingering if the client sent bytes that were not read or answered (the request's
        body, which the application answered without reading; requests after it), else at
        once."""
        if self._in_message or self.pipeline or self._held:
            cycle.on_response = self._response_counted  # (nothing runs after it)
            self._close_lingering()
        else:
            self.transport.close()

    def _response_counted(self) -> None:
        self.server_state.total_requests += 1

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn calls this on every read: bytes that begin no request (an empty line, which a
        # server may ignore before a request line) had made an idle connection busy for good,
        # its keep-alive timer stopped and its read timer never armed. A request's first byte
        # makes it busy (on_message_begin).
        pass

    def _set_idle_timer(self, due: float) -> None:
        self._idle_due = due
        self._idle_timer = self.loop.call_at(due, self._idle_check)

    def _stop_idle(self) -> None:
        self._idle_since = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_check(self) -> None:
        self._idle_timer = None
        since = self._idle_since
        if since is None:
            return
        due = since + self.timeout_keep_alive
        if _later(due, self._idle_due, self.loop.time()):  # idle since after the timer was set
            self._set_idle_timer(due)
        elif not self.transport.is_closing():
            self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._head_open:
            return  # a chunked body's trailer field: not one of the request's headers (its scope is out)
        super().on_header(name, value)

    def on_message_complete(self) -> None:
        if self._stopped:
            return
        into = self._into
        if self._late_body:
            if into is not None and self._filled < len(into):
                return  # the parser's end of an upgrade request at its head: its body comes
            self._late_body = False
        self._in_message = False
        self._disarm()
        if into is not None:  # read whole, directly (a buffer the parser never filled: no body)
            filled = self._filled == len(into)
            self._drop_into()
            if filled:
                self._body_parts = [into]
        cycle = self.cycle
        if cycle is not None:
            self._hand_body(cycle)
        super().on_message_complete()
        if cycle is not None and cycle.response_complete and not self.pipeline and not self.transport.is_closing():
            self._become_idle()  # answered before its end (an early answer): idle from now

    def on_body(self, body: bytes) -> None:
        # uvicorn wakes the application on every read of a body, copies each read into a
        # bytearray and that into bytes again, and stops reading at 64 KiB until the application
        # has taken them: a 200 KB body cost four wake-ups, four pauses and three copies. Here
        # the reads are kept as they are until the body is complete (or BODY_BUFFER bytes wait)
        # and handed over joined, as bytes, which uvicorn's receive() passes on without a copy.
        into = self._into
        if into is not None:  # a head's last bytes came with the start of its body
            memoryview(into)[self._filled : self._filled + len(body)] = body  # one copy (_feed)
            self._filled += len(body)
            return
        self._body_given += len(body)
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        self._body_parts.append(body)
        self._body_size += len(body)
        if self._body_size > BODY_BUFFER:
            self._hand_body(cycle)
            self.flow.pause_reading()
            cycle.message_event.set()

    def _hand_body(self, cycle: Any) -> None:
        parts = self._body_parts
        if parts:
            joined = parts[0] if len(parts) == 1 else b"".join(parts)
            cycle.body = cycle.body + joined if cycle.body else joined
            self._body_parts = []
            self._body_size = 0

    def handle_websocket_upgrade(self) -> None:
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.pipeline:
            # a handshake pipelined behind requests still answering: switching protocols now
            # would put the 101 and the WebSocket's frames inside (or ahead of) their responses
            self._refuse(malformed_response(
                "A WebSocket handshake must not be pipelined behind other requests.", code="invalid_http_request"
            ))
            return
        self._disarm(cancel=True)  # the handshake's request arrived in time
        self._stop_idle()  # the connection is the WebSocket protocol's from here
        self._upgraded = True
        super().handle_websocket_upgrade()
        _release(self.transport)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.limits.timed_out += 1
        cycle = self.cycle
        log.info(
            "closing a connection from %s: its request did not arrive within %gs",
            _peer(self.client),
            self.limits.read_timeout,
        )
        if not self._admitted:
            transport.close()
            return
        if (cycle is not None and not cycle.response_complete and not cycle.more_body) or self.pipeline:
            # the stalled request is a later one (its head), behind responses still to be
            # written: they are written first, then its 408, and the connection closed
            self._refuse(timeout_response(self.limits.read_timeout))
            return
        # the stalled request is the newest one's own (its head, or the body its application
        # waits for): its 408, unless its response has started (then it is cut) or is complete
        # and the stalled bytes are its body, which came too late to matter (not a second answer)
        if cycle is None or not cycle.response_started or (cycle.response_complete and self._head_open):
            transport.write(timeout_response(self.limits.read_timeout))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the application sees http.disconnect; its sends are dropped
            cycle.message_event.set()
        self._close_lingering()


def _later(due: float, set_for: float, now: float) -> bool:
    """Whether a connection timer (read or keep-alive) that fired, set for ``set_for``, must be
    set again for ``due``: compared with the time it was set for (or the clock, if it fires
    late), not with the clock alone. uvloop rounds a timer's delay down to whole milliseconds,
    so a timer may fire up to 1 ms early, and setting it again for a time already this close
    would fire at once, again and again, until the clock got there."""
    return due > max(set_for, now)


def _head_end_begun(data: bytes | bytearray, start: int, stop: int, tail: int) -> int:
    """How many of _HEAD_END's first bytes the head bytes up to ``data[stop]`` end with (the ones
    before ``data[start]`` ended with ``tail``), ``data[start:stop]`` holding no whole one: for a
    head whose blank line is split across reads (only such reads pay for it). Found in each read
    alone, such a head was taken to go on: the next read, a body's first 64 KiB, was counted in
    it (a 431) and fed to the parser whole."""
    n = stop - start
    if tail and tail + n < len(_HEAD_END) and _HEAD_END.startswith(bytes(data[start:stop]), tail):
        return tail + n  # a read of a byte or two, going on with it
    for k in (3, 2, 1):
        if data.endswith(_HEAD_END[:k], start, stop):
            return k
    return 0


def _body_capacity(size: int) -> int:
    """The bytes allocated for a directly read body of ``size`` bytes: whole BODY_STEPs."""
    return -(-size // BODY_STEP) * BODY_STEP


def new_body(size: int) -> bytearray:
    """The buffer a body of ``size`` bytes is read into: ``size`` bytes long, its contents not
    set (nothing reads it before it is full), ``_body_capacity(size)`` bytes allocated. A
    ``bytearray`` shortened by less than half keeps its memory (CPython's resize), so the
    allocation stays whole and a later buffer of the same capacity can reuse it."""
    into = body_buffer(_body_capacity(size))
    del into[size:]
    return into


def _upgrade_body_length(headers: list[tuple[bytes, bytes]]) -> int:
    """The body of an upgrade request this server does not speak, as its head declares it: a
    single Content-Length (0 without one), or -1 for one that cannot be read directly (chunked,
    another transfer coding, Expect, a malformed or repeated Content-Length)."""
    size = 0
    seen = False
    for name, value in headers:
        if name == b"content-length":
            if seen or not value.isdigit():
                return -1
            seen = True
            size = int(value)
        elif name == b"transfer-encoding" or name == b"expect":
            return -1
    return size


def _reads_directly(size: int) -> bool:
    """Whether a body of ``size`` declared bytes is read straight into its own buffer."""
    return READ_BUFFER <= size <= BODY_BUFFER


def _body_length(headers: list[tuple[bytes, bytes]]) -> int:
    """The body size of a request as its head declares it when it can be relied on before the
    parser has seen the body: a single Content-Length, and neither Transfer-Encoding nor Expect
    (0 otherwise). A body of READ_BUFFER..BODY_BUFFER bytes is read directly into its buffer; a
    smaller body fits the read buffer, often in the read that brought its head, and its one copy
    by the parser costs less than a buffer and a fresh parser would."""
    size = 0
    for name, value in headers:
        if name == b"content-length":
            if size or not value.isdigit():
                return 0
            size = int(value)
        elif name == b"transfer-encoding" or name == b"expect":
            return 0
    return size


class HttpReader(asyncio.BufferedProtocol):
    """What the transport reads for: the connection's :class:`BoundedHttpToolsProtocol`
    (``protocol``, set on a subclass), created with uvicorn's arguments. uvloop reads into a
    protocol's own buffers only for a ``BufferedProtocol`` that is not a ``Protocol``, which
    uvicorn's protocol is; this forwards the transport's calls to it (its ``get_buffer`` and
    ``buffer_updated`` are the protocol's own bound methods: no call in between)."""

    __slots__ = ("http", "get_buffer", "buffer_updated")  # type: ignore[misc]
    protocol: type["BoundedHttpToolsProtocol"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        http = self.protocol(*args, **kwargs)
        self.http = http
        self.get_buffer = http.get_buffer  # type: ignore[method-assign]
        self.buffer_updated = http.buffer_updated  # type: ignore[method-assign]

    def connection_made(self, transport: Any) -> None:
        self.http.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.http.connection_lost(exc)

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()

    def eof_received(self) -> None:
        self.http.eof_received()


class _Released(asyncio.BufferedProtocol):
    """Stands in, for a moment, for the buffered protocol a connection leaves (see
    :func:`_release`); never reads."""

    def get_buffer(self, sizehint: int) -> bytearray:
        raise RuntimeError("no protocol reads into this buffer")

    def buffer_updated(self, nbytes: int) -> None:
        raise RuntimeError("no protocol reads into this buffer")


_RELEASED = _Released()


def _release(transport: Any) -> None:
    """Let the HTTP protocol of a connection that became a WebSocket go. uvloop's transport
    keeps the ``get_buffer`` and ``buffer_updated`` of a buffered protocol when it is switched
    to a plain one (the WebSocket protocol), so the HTTP protocol, its parser, the handshake's
    headers and its flow control stayed alive as long as the WebSocket did: about 5 KB per
    connection. Switching to a shared buffered protocol first replaces them; then the
    WebSocket protocol again (same protocol; nothing is read in between)."""
    if transport is None:
        return
    ws = transport.get_protocol()
    transport.set_protocol(_RELEASED)
    transport.set_protocol(ws)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def _send_now(cycle: Any, body: bytes) -> bool:
    """:data:`SEND_NOW` for one request's ``RequestResponseCycle`` (what its ``send`` does for a
    ``more_body`` piece of a chunked response, without the wait)."""
    if cycle.disconnected:
        return False
    if not cycle.response_started or cycle.response_complete or not cycle.chunked_encoding:
        raise RuntimeError("send_now needs a started streaming (chunked) response")
    if body:
        cycle.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
    return not cycle.flow.write_paused


def _respond(
    cycle: Any, http: BoundedHttpToolsProtocol, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> bool:
    """:data:`RESPOND` for one request's ``RequestResponseCycle``. Not while the client is not
    taking what was written (``write_paused``): uvicorn's ``send`` then waits for it, which also
    keeps the connection's next (pipelined) request from starting, so a client that never reads
    cannot make the server buffer answer after answer."""
    if cycle.response_started or cycle.access_log or cycle.flow.write_paused:
        if (
            not cycle.response_started and cycle.waiting_for_100_continue and cycle.keep_alive
            and http._awaits_continue(cycle) and not isinstance(cycle.transport, _ClosesLingering)
        ):
            # through uvicorn's send: a final answer instead of the 100 says connection: close
            # too (uvicorn's own header for a cycle not kept alive), and closes lingering
            cycle.keep_alive = False
            cycle.transport = _ClosesLingering(cycle, http)
        return False
    # a final answer instead of the 100, no body byte yet: it says connection: close, and the
    # connection closes after a linger (on_response_complete), not at once (through uvicorn's
    # send, with the access log on, the linger alone)
    lingers = cycle.waiting_for_100_continue and cycle.keep_alive and http._awaits_continue(cycle)
    if cycle.disconnected:  # nobody to write to: dropped, as uvicorn's send drops it
        return True
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.chunked_encoding = False
    cycle.expected_content_length = 0
    head = [STATUS_LINE[status]]
    for name, value in cycle.default_headers:
        head += (name, b": ", value, b"\r\n")
    closes = False  # the application said connection: close (uvicorn's reading of the header)
    for name, value in headers:
        if name == b"connection" and b"close" in [token.lower().strip() for token in value.split(b",")]:
            cycle.keep_alive = False
            closes = True
        head += (name, b": ", value, b"\r\n")
    if (lingers or not cycle.keep_alive) and not closes:
        head.append(b"connection: close\r\n")
    head.append(b"\r\n")
    if cycle.scope["method"] != "HEAD":
        head.append(body)
    cycle.transport.write(b"".join(head))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()  # the connection's next request: a pipelined one, or the keep-alive timer
    return True


async def _receive(cycle: Any) -> dict[str, Any]:
    """:data:`RECEIVE` for one request's ``RequestResponseCycle``: its ``receive``, but the body
    as the protocol handed it over (``BoundedHttpToolsProtocol._hand_body``)."""
    if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
        cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        cycle.waiting_for_100_continue = False
        cycle.continued = True  # (BoundedHttpToolsProtocol._awaits_continue)
    if not cycle.disconnected and not cycle.response_complete:
        cycle.flow.resume_reading()
        await cycle.message_event.wait()
        cycle.message_event.clear()
    if cycle.disconnected or cycle.response_complete:
        return {"type": "http.disconnect"}
    body = cycle.body
    cycle.body = b""
    return {"type": "http.request", "body": body, "more_body": cycle.more_body}


class _ClosesLingering:
    """The transport of a request's response on a connection that does not stay open after it
    (HTTP/1.0, ``Connection: close``): its ``close`` (uvicorn's, or :data:`RESPOND`'s, at the
    response's end) closes lingering when the client sent bytes not read
    (``BoundedHttpToolsProtocol._closing_response``); everything else is the transport's."""

    __slots__ = ("transport", "cycle", "http")

    def __init__(self, cycle: Any, http: BoundedHttpToolsProtocol) -> None:
        self.transport = cycle.transport
        self.cycle = cycle
        self.http = http

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def close(self) -> None:
        if not self.transport.is_closing():
            self.http._closing_response(self.cycle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class _Corked:
    """A response's transport while it is corked (:data:`CORK`): writes are held until the cork
    is taken out; everything else is the transport's."""

    __slots__ = ("transport", "parts")

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        parts = self.parts
        if parts:
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            parts.clear()
            if not self.transport.is_closing():
                self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def _cork(cycle: Any, on: bool) -> None:
    """:data:`CORK` for one request's ``RequestResponseCycle``."""
    transport = cycle.transport
    if on:
        if type(transport) is not _Corked:
            cycle.transport = _Corked(transport)
    elif type(transport) is _Corked:
        cycle.transport = transport.transport
        transport.flush()
