"""uvicorn's websockets sans-I/O protocol with *corked* writes, a batch send and a lean idle state.

Corked writes. A streamed response sends one WebSocket message per token. uvicorn writes each
message to the socket at once, one ``send()`` syscall per event, which costs more than building
the event. This subclass appends each outgoing data frame to a buffer and flushes the buffer with
a single ``transport.write`` from a ``call_soon`` callback, i.e. as soon as the sending task
yields to the event loop. Every event produced in one loop iteration (several tokens due at once,
several SSE chunks in one network read) leaves in one write; no event waits for a later one, so
latency is unchanged. Control messages (accept, close) flush the buffer first, keeping the order.

Batch send. :meth:`CorkedWebSocketProtocol.send_texts` frames a list of events' UTF-8 payloads as text
messages without an ASGI message dict, a ``str`` round trip or an ``await`` per event; the
application finds it in ``scope["extensions"]`` under :data:`SEND_TEXTS` (other servers, and
tests driving the ASGI app directly, do not offer it and get ``websocket.send`` messages). Data
frames from the server are unmasked and never fragmented, so the frame header is two, four or ten
bytes in front of the payload: the fast path writes it itself, and leaves everything else
(extensions, debug logging, a connection that is no longer open) to ``websockets``.

Fast text frames. A read holding exactly one complete, final, masked text frame, arriving where
websockets' parser waits for a new frame (its generator parked in ``StreamReader.at_eof``, its
buffer empty) on an open connection without extensions, a fragmented message in progress or
debug logging, is unmasked here and handed to uvicorn's ``send_receive_event_to_app``; any other
read goes to websockets as before (a test feeds both paths the same reads, adversarial ones
included, and compares everything the application and the client see). Reading pauses only
when a message arrives while an earlier one still waits.

Lean idle state. An accepted connection that has not sent a frame yet should cost little: the
receive queue and the ``writable`` flag are small classes (``asyncio.Queue`` and ``asyncio.Event``
each carry deques of about 700 bytes), and the handshake's request and response headers are
dropped once the scope holds its own copy.

Bounds: the cork only holds what one loop iteration produced; senders wait on ``writable``
(cleared while the transport's own buffer is above its high-water mark), so a slow client applies
back-pressure exactly as before. The receive queue holds at most two data messages (and the
others of the read that brought the second) and a disconnect: reading stops when a message
arrives while an earlier one still waits, until the application has taken them. A closing
connection (either side's close frame, a FIN, a protocol error, the server's shutdown) whose
client does not read what is still buffered is aborted ``CLOSE_TIMEOUT`` seconds after the close
(a transport closes only once its buffer has drained, and keep-alive pings stop at the close).

Refused handshakes. A refusal (the application's 401, 404, 429 or 403, websockets' 400, a 500)
ends with a *lingering* close: the answer, then a FIN, and what the client still sends is read and
dropped until it closes its side, at most ``LINGER_SECONDS``. Closed at once, the socket still held
bytes the client had sent and the server had not read (frames sent without waiting for the 101,
held with reading paused; the rest of a large one; frames sent while the answer was on its way),
and a socket closed with unread bytes is reset: the client read ``connection reset`` where the
answer's end should be, and a reset may discard what it had not read of the answer.

Relies on ``WebSocketsSansIOProtocol`` internals (``conn``, ``transport``, ``writable``,
``queue``, ``handshake_complete``, ``close_sent``, ``initial_response``, ``request``,
``response``, ``send_receive_event_to_app``, ``read_paused``, ``close_timer``, ``send_500_response``,
and the refusals its ``handle_connect`` and ``send`` write, mirrored in ``_refuse``) and on ``websockets.protocol.Protocol``
attributes (``state``, ``extensions``, ``expect_continuation_frame``, ``debug``, ``parser``,
``reader``, ``parser_exc``, and the receiving message's size and limits, whose names changed in
websockets 17: the fast path reads both spellings and leaves a connection it cannot read to
websockets): the uvicorn version range is pinned in ``pyproject.toml``, the integration tests run
through this class, and the fast path's tests pass on websockets 15 and 17.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.utils import ClientDisconnected, get_client_addr, get_path_with_query_string
from uvicorn.protocols.websockets.websockets_sansio_impl import STATUS_PHRASES, WebSocketsSansIOProtocol
from websockets.datastructures import Headers
from websockets.exceptions import InvalidState
from websockets.frames import apply_mask
from websockets.http11 import Response
from websockets.protocol import State
from websockets.streams import StreamReader

from hotloop import errors
from hotloop.protocol import events as ev
from hotloop.server.httpproto import LINGER_SECONDS, _peer, malformed_response

log = logging.getLogger("hotloop.server")

SEND_TEXTS = "hotloop.websocket.send_texts"
"""Scope extension: ``send_texts(events: list[tuple[str, bytes]]) -> bool``; see
:meth:`CorkedWebSocketProtocol.send_texts`. With it comes :data:`WAIT_WRITABLE`."""
WAIT_WRITABLE = "hotloop.websocket.wait_writable"
"""Scope extension: ``async wait_writable()``, returns once the client may be sent more, raises
``ClientDisconnected`` if it has gone."""
ON_CLIENT_GONE = "hotloop.websocket.on_client_gone"
"""Scope extension: ``on_client_gone(callback)`` registers ``callback()``, called once, at once,
when the client goes away (its close frame, a FIN or a reset): not when the server closed first.
The application learns it even while it is not reading (e.g. while queued frames wait)."""
ON_BUSY = "hotloop.websocket.on_busy"
"""Scope extension: ``on_busy(busy)`` registers ``busy() -> bool``, true while responses run on
the connection: a server shutdown closes the connection (1001) only once it turns false (uvicorn
cancels what still runs when its graceful-shutdown timeout passes)."""
_DRAIN_POLL = 0.05  # seconds between looks at a busy connection while the server shuts down

_OPEN = State.OPEN


# Frame headers of text messages under 1 KiB (tokens, deltas, most events), made once: 1,024
# small bytes objects, about 40 kB for the process.
_HEADERS = [bytes((0x81, n)) for n in range(126)] + [bytes((0x81, 126, n >> 8, n & 0xFF)) for n in range(126, 1024)]
_NHEADERS = len(_HEADERS)


def frame_header(n: int) -> bytes:
    """The header of one unmasked, unfragmented server text frame (RFC 6455 5.2) of ``n`` bytes."""
    if n < _NHEADERS:
        return _HEADERS[n]
    if n < 0x10000:
        return bytes((0x81, 126, n >> 8, n & 0xFF))
    return b"\x81\x7f" + n.to_bytes(8, "big")


def frame_text(payload: bytes) -> bytes:
    """One unmasked, unfragmented server text frame carrying ``payload``."""
    return frame_header(len(payload)) + payload


class _Waiters:
    """Futures of the tasks waiting on a :class:`_Flag` or an :class:`_Inbox` (made on demand)."""

    __slots__ = ("_futures",)

    def __init__(self) -> None:
        self._futures: list[asyncio.Future[None]] | None = None

    def _park(self) -> asyncio.Future[None]:
        """A future for the caller to await (no coroutine of its own); :meth:`_unpark` it after."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        futures = self._futures
        if futures is None:
            futures = self._futures = []
        futures.append(fut)
        return fut

    def _unpark(self, fut: asyncio.Future[None]) -> None:
        assert self._futures is not None
        self._futures.remove(fut)

    def _wake(self) -> None:
        if self._futures:
            for fut in self._futures:
                if not fut.done():
                    fut.set_result(None)


class _Flag(_Waiters):
    """``asyncio.Event`` without its deque: ``set``, ``clear``, ``is_set``, ``wait``."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        super().__init__()
        self._set = True  # the transport starts writable

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._wake()

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> bool:
        while not self._set:
            fut = self._park()
            try:
                await fut
            finally:
                self._unpark(fut)
        return True


class _Inbox(_Waiters):
    """uvicorn's receive queue for one connection: ``put_nowait``, ``get``, ``empty``, and
    ``nbytes``, the size of the messages it holds.

    Unbounded like the ``asyncio.Queue`` it replaces, and bounded by the protocol: it pauses
    reading when a message arrives while INBOX_READ_AHEAD bytes of earlier ones still wait,
    until the application has taken them all, so the inbox holds at most that many bytes and
    one message (and the others of that read) and a disconnect.
    """

    __slots__ = ("_items", "nbytes")

    def __init__(self) -> None:
        super().__init__()
        self._items: list[Any] | None = None
        self.nbytes = 0

    def put_nowait(self, item: Any) -> None:
        if self._items is None:
            self._items = [item]
        else:
            self._items.append(item)
        self.nbytes += _message_size(item)
        self._wake()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items) if self._items else 0

    async def get(self) -> Any:
        while not self._items:
            fut = self._park()
            try:
                await fut
            finally:
                self._unpark(fut)
        item = self._items.pop(0)
        self.nbytes -= _message_size(item)
        return item


def _message_size(item: Any) -> int:
    """What a waiting message counts towards INBOX_READ_AHEAD: its length and what holding it
    costs (empty messages read ahead count too)."""
    if type(item) is not dict:
        return 0
    data = item.get("text")
    if data is None:
        data = item.get("bytes")
    return MESSAGE_OVERHEAD + (len(data) if data is not None else 0)


def _size_limit(conn: Any) -> int | None:
    """The largest payload websockets' parser accepts in a frame that starts a message:
    ``max_size`` up to websockets 16, ``max_message_size`` and ``max_fragment_size`` since 17."""
    if hasattr(conn, "max_message_size"):
        limits = [x for x in (conn.max_message_size, conn.max_fragment_size) if x is not None]
        return min(limits) if limits else None
    return conn.max_size  # type: ignore[no-any-return]


def _in_message(conn: Any) -> bool:
    """Whether a fragmented message is being received (its size so far: websockets'
    ``cur_size``, ``current_size`` since 17)."""
    size = conn.current_size if hasattr(conn, "current_size") else conn.cur_size
    return size is not None


# Where websockets' frame parser waits between frames (``Protocol.parse``: ``yield from
# self.reader.at_eof()``, its buffer empty). Anywhere else (inside a frame, or another parser
# after a close) incoming bytes go to websockets.
_BETWEEN_FRAMES = getattr(getattr(StreamReader, "at_eof", None), "__code__", None)
_PONG = b"\x8a"  # the first byte of a server's pong frame (FIN, opcode 0xA)
# Bytes of messages waiting in a connection's inbox before reading pauses (send_receive_event_to_app)
INBOX_READ_AHEAD = 64 * 1024
MESSAGE_OVERHEAD = 256  # bytes a waiting message counts besides its own (its event dict)
# Seconds a closing connection waits for its client: to answer the server's close frame (uvicorn's
# close_timeout), or to read what was still buffered when the transport was closed. A transport
# closes only once its write buffer has drained, and keep-alive pings stop once the close begins,
# so a client that stops reading then held its connection (its place under --max-connections, its
# buffered bytes; after a FIN, its running response) for good. Past this it is aborted.
CLOSE_TIMEOUT = 10.0


# What a refused handshake says (websockets' text names its own exceptions, a base64 decoder's
# message among them): the status websockets chose, with an OpenAI error body.
_REFUSALS = {
    400: ("The WebSocket handshake request is not valid.", "invalid_websocket_handshake"),
    403: ("The WebSocket handshake's origin is not allowed.", "invalid_websocket_handshake"),
    426: ("This endpoint needs a WebSocket upgrade (Upgrade: websocket).", "upgrade_required"),
}


def _buffered(transport: Any) -> int:
    """Bytes written to ``transport`` that have not left yet (0 for a transport that does not
    say, such as the recording transports of the unit tests)."""
    size = getattr(transport, "get_write_buffer_size", None)
    return size() if size is not None else 0  # type: ignore[no-any-return]


def _accept(accept: Any, request: Any) -> Any:
    """``ServerProtocol.accept``, a refusal's text body replaced by the OpenAI error shape."""
    response = accept(request)
    status = response.status_code
    if status != 101:
        message, code = _REFUSALS.get(status, ("The WebSocket handshake failed.", "websocket_handshake_failed"))
        exc = errors.HotloopError(message, code=code)
        exc.status = status
        exc.type = "invalid_request_error" if status < 500 else "server_error"
        body = ev.http_error_body(exc)
        headers = response.headers
        for name in ("Content-Type", "Content-Length"):
            del headers[name]
        headers["Content-Type"] = "application/json"
        headers["Content-Length"] = str(len(body))
        if status == 400 and request.headers.get_all("Sec-WebSocket-Version") != ["13"]:
            # RFC 6455 4.4: a version the server does not speak (or none) is answered with the
            # versions it speaks, so that a client can retry with one (websockets says nothing)
            headers["Sec-WebSocket-Version"] = "13"
        response.body = body
    return response


class _HandshakeLog:
    """uvicorn's WebSocket logger without its INFO lines, for a server whose access log is off.
    Those lines are a handshake's outcome (uvicorn's ``"WebSocket /v1/responses" [accepted]``,
    ``403``, an application's refusal status; websockets' ``connection open``, ``connection
    rejected (...)``): access-log lines, one or two per connection, that a flood
    of unauthenticated handshakes would otherwise turn into a flood of the error log. Its
    warnings, errors and trace lines pass (``level``, the other methods: the logger's own)."""

    __slots__ = ("_logger",)

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    @property
    def level(self) -> int:
        return self._logger.level

    def info(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


class CorkedWebSocketProtocol(WebSocketsSansIOProtocol):
    limits: Any = None  # the server's hotloop.server.httpproto.Limits (its connection count)
    fast_text = True  # read single-frame text messages without websockets' parser (data_received)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.config.access_log:
            self.logger = _HandshakeLog(self.logger)  # type: ignore[assignment]
            # (websockets' own: "connection open", "connection rejected (401 Unauthorized)")
            self.conn.logger = _HandshakeLog(self.conn.logger)  # type: ignore[arg-type, assignment]
        self.queue = _Inbox()  # type: ignore[assignment]
        self._writable = _Flag()
        self.writable = self._writable  # type: ignore[assignment]
        self._cork: list[bytes] = []
        self._flush_scheduled = False
        self._held: asyncio.TimerHandle | None = None  # the write of held events (send_texts' within)
        self._held_since = 0.0  # the loop time of the last write of held-back events
        self._on_gone: Any = None
        self._app_closed = False
        self._busy: Any = None
        self._pong = b""  # the pong of the latest ping, held while the client does not read (handle_ping)
        self._write_paused_at: float | None = None  # since when writes are held up (pause_writing)
        self._paused_deadline: float | None = None  # the last pong deadline passed with reading paused
        self.close_timeout = CLOSE_TIMEOUT
        self._abort_timer: asyncio.TimerHandle | None = None  # a closing transport's bound (_closing)
        self._early = b""  # bytes that came after the handshake's request, before the 101 (data_received)
        self._lingering = False  # a refused handshake's connection, closing (_linger)

    def _on_busy(self, busy: Any) -> None:
        self._busy = busy

    def handle_handshake_exception(self) -> None:
        # websockets could not parse the handshake request: uvicorn answers 400 in text (unless
        # websockets queued its own 414/431 for a limit, kept), here in the OpenAI error shape;
        # closed lingering (_linger), not at once
        self.handshake_complete = True
        self.close_sent = True
        output = b"".join(self.conn.data_to_send())  # (websockets leaves the end of its output, b"", in it)
        self.transport.write(output or malformed_response(*_REFUSALS[400]))
        self._linger()

    # -- refusing the handshake -----------------------------------------------------------------

    def _refuse(self, response: Response) -> None:
        """Write ``response``, the handshake's refusal (not a 101), and close lingering. What
        uvicorn does for each refusal (handle_connect, send), but for its ``transport.close()``."""
        self.handshake_complete = True
        self.close_sent = True
        self.conn.send_response(response)
        self.transport.write(b"".join(self.conn.data_to_send()))
        self._linger()

    def _linger(self) -> None:
        """A refused handshake's answer is written (it says ``connection: close``): a FIN
        follows it, what the client sent or still sends is read and dropped (frames held since
        the request among it), and the connection closes once the client closes its side, or
        ``LINGER_SECONDS`` from now (a lingering close, as nginx's, and the HTTP protocol's after
        a refused 100-continue). A socket closed with bytes it has not read is reset: the client
        saw ``connection reset`` instead of the end of the answer, or lost the answer.

        The timer is uvicorn's ``close_timer``: its ``run_asgi`` then leaves the transport open
        when the application returns, ``shutdown`` and ``connection_lost`` cancel it."""
        self._early = b""
        self.frames = []
        self.handshake_complete = True
        self.close_sent = True
        t = self.transport
        if t.is_closing() or self._lingering:
            return
        self._lingering = True
        can_write_eof = getattr(t, "can_write_eof", None)  # (not over TLS)
        if can_write_eof is not None and can_write_eof():
            t.write_eof()  # once what is buffered has left
        self.read_paused = False
        t.resume_reading()
        linger = LINGER_SECONDS if self.limits is None else min(LINGER_SECONDS, self.limits.read_timeout)
        if self.close_timer is not None:
            self.close_timer.cancel()
        self.close_timer = self.loop.call_later(linger, self._close_timed_out)

    def send_500_response(self) -> None:
        # the application failed (or returned) before answering the handshake: uvicorn's 500,
        # then closed lingering (its run_asgi leaves the transport to the timer)
        if self.initial_response or self.handshake_complete:
            return
        super().send_500_response()
        self._linger()

    def _refuse_for_app(self, message: Any) -> None:
        """The application's refusal (uvicorn's ``send``: a ``websocket.close`` before the
        accept, a 403; the final ``websocket.http.response.body`` of its own response), written
        and closed lingering."""
        self.queue.put_nowait({"type": "websocket.disconnect", "code": 1006})
        if message["type"] == "websocket.close":
            self.logger.info(
                '%s - "WebSocket %s" 403', get_client_addr(self.scope), get_path_with_query_string(self.scope)
            )
            self._refuse(self.conn.reject(HTTPStatus.FORBIDDEN, ""))
            return
        assert self.initial_response is not None
        status, headers, body = self.initial_response
        body += message["body"]
        self.initial_response = (status, headers, body)
        response_headers = Headers(headers)
        response_headers.setdefault("Date", email.utils.formatdate(usegmt=True))
        response_headers.setdefault("Connection", "close")
        response_headers.setdefault("Content-Length", str(len(body)))
        response_headers.setdefault("Content-Type", "text/plain; charset=utf-8")
        self._refuse(Response(status, STATUS_PHRASES[status], response_headers, body))

    # -- pings ----------------------------------------------------------------------------------

    def handle_ping(self) -> None:
        # uvicorn writes every ping's pong at once: a client that sends pings and reads nothing
        # grew the server by about 25 MB a second. While the client is not taking what is written
        # (the write buffer above its high-water mark) only the latest ping's pong is kept, and
        # written once it drains (RFC 6455 5.5.3: an endpoint MAY answer only the most recent
        # ping), so a connection holds at most one pong.
        output = self.conn.data_to_send()  # a pong per ping of the read (one frame per chunk)
        if not self._writable._set:
            pongs = [chunk for chunk in output if chunk[:1] == _PONG]
            if pongs:
                self._pong = pongs[-1]
                output = [chunk for chunk in output if chunk[:1] != _PONG]
        if output:
            self.transport.write(b"".join(output))

    def keepalive_timeout(self) -> None:
        timeout = self.ping_timeout  # (set: this deadline is only armed with one)
        if self.read_paused and timeout and not self.close_sent and self.transport is not None and not self.transport.is_closing():
            # Reading is paused by the server itself (the connection's actions wait for room,
            # ws.py, and a message for the application waits: _deliver): the pong may be among
            # the bytes not read, so its absence says nothing of the client. The deadline runs
            # again from now, and once reading resumes a pong ends it (handle_pong) or it fails
            # the connection as ever. Unless the client reads nothing either: the responses
            # that hold the queue wait to write, and would wait for good (a client that
            # pipelined its frames, then hung). When the server's writes to it have been held
            # up (the write buffer over its high-water mark) since before the previous such
            # deadline, a whole timeout without taking any, the connection fails as for a
            # missing pong; a client that stalls for less is kept.
            paused_at, last = self._write_paused_at, self._paused_deadline
            if paused_at is None or last is None or paused_at > last:
                self._paused_deadline = self.loop.time()
                self.pong_timer = self.loop.call_later(timeout, self.keepalive_timeout)
                return
        # uvicorn writes a close frame and closes the transport, which first waits for its write
        # buffer to drain: a client that reads nothing never drains it, so the connection, its
        # responses (waiting to write) and their backend connections stayed for good. What it has
        # not read is not waited for: the connection is aborted (its responses are cancelled).
        super().keepalive_timeout()
        t = self.transport
        if t is not None and t.is_closing() and t.get_write_buffer_size():
            t.abort()

    def pause_writing(self) -> None:
        self._write_paused_at = self.loop.time()
        super().pause_writing()

    def resume_writing(self) -> None:
        self._write_paused_at = None
        pong, self._pong = self._pong, b""
        if pong and not self.transport.is_closing():
            self.transport.write(pong)
        super().resume_writing()

    # -- closing --------------------------------------------------------------------------------

    def _closing(self) -> None:
        """After ``transport.close()``: what is still buffered gets ``close_timeout`` seconds to
        leave (the transport waits for it, however long a client that does not read takes), then
        the connection is aborted (``connection_lost``, its place under the connection limit freed)."""
        t = self.transport
        if self._abort_timer is None and not self.disconnected and t.is_closing() and _buffered(t):
            self._abort_timer = self.loop.call_later(self.close_timeout, self._abort)

    def _abort(self) -> None:
        self._abort_timer = None
        if not self.disconnected:
            self.transport.abort()

    def _close_timed_out(self) -> None:
        """The client did not answer the server's close frame in time (uvicorn's ``close_timer``,
        which only closed the transport): closed, and aborted if it has not read what was written."""
        self.close_timer = None
        t = self.transport
        t.close()
        if _buffered(t) and not self.disconnected:
            t.abort()

    def eof_received(self) -> None:
        # (a lingering close ends here: the client has read the refusal and closed its side)
        # A FIN (half-close): the client is gone now (ON_CLIENT_GONE), not once the transport's
        # write buffer has drained, which a client that reads no more never lets happen (its
        # response went on, waiting to write, for good); the transport closes, bounded (_closing).
        if not self._app_closed:
            self._client_gone()
        self.transport.close()
        self._closing()

    def handle_parser_exception(self) -> None:
        super().handle_parser_exception()
        self._closing()

    async def run_asgi(self) -> None:
        await super().run_asgi()
        self._closing()

    # -- receiving ------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # a refused handshake's connection: read and dropped (_linger)
        if self.handshake_initiated and not self.handshake_complete:
            # Bytes after the handshake's request and before the 101 (a client that sends its
            # first frames without waiting, or in the same write as the request): parsed then,
            # websockets would answer a ping or a close ahead of the 101 and a close would leave
            # the handshake unfinished. Held, unparsed, until the application accepts (reading
            # paused meanwhile: at most one read is held), then read as if they came after it;
            # dropped if it refuses (reading resumes then, _linger).
            self._early += data
            self.transport.pause_reading()
            return
        payload = self._text_frame(data) if self.handshake_complete and self.fast_text else None
        if payload is None:
            super().data_received(data)
            return
        # What websockets' parser (Frame.parse, Protocol.recv_frame) and uvicorn's handle_text do
        # with such a frame, without a generator resumption per header field: a client's
        # response.create is one read holding one masked, final text frame.
        self.curr_msg_data_type = "text"
        self.frames = [payload]
        self.send_receive_event_to_app()

    def send_receive_event_to_app(self) -> None:
        # uvicorn pauses reading after every message until the application has taken it: two
        # more system calls a message (the socket out of the event loop's poll set and back in).
        # Here reading pauses when a message arrives while INBOX_READ_AHEAD bytes of earlier ones
        # still wait, so an application that keeps up never pauses it, and a client that sends
        # many small messages ahead (response.create frames that wait for room) still has its
        # pings answered and its close seen meanwhile; the inbox then holds at most that many
        # bytes and one message (and those of one read).
        if self.read_paused or self.queue.nbytes >= INBOX_READ_AHEAD:  # type: ignore[attr-defined]
            self._deliver()
            return
        self.read_paused = True  # _deliver then leaves reading on
        try:
            self._deliver()
        finally:
            self.read_paused = False

    def _deliver(self) -> None:
        """uvicorn's ``send_receive_event_to_app``, but a text message that is not UTF-8 is
        one log line, not an ERROR with a traceback (any client could flood the log with them);
        the connection is closed with 1007 as before."""
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        self.frames = []
        if self.close_sent:  # past websocket.close: dropped, reads stay on for the peer's close
            return
        if self.curr_msg_data_type == "text":
            try:
                message: dict[str, Any] = {"type": "websocket.receive", "text": data.decode()}
            except UnicodeDecodeError:
                log.info("closing a WebSocket connection from %s: a text message is not UTF-8", _peer(self.client))
                self.conn.send_close(1007)
                self.handle_parser_exception()
                return
        else:
            message = {"type": "websocket.receive", "bytes": data}
        self.queue.put_nowait(message)  # type: ignore[arg-type]
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def _read_early(self) -> None:
        """The 101 is written: the bytes held since the handshake's request (if any) are read
        now, and reading resumes (unless a message they brought waits for the application)."""
        early, self._early = self._early, b""
        if not early or self.transport.is_closing():
            return
        if not self.handshake_complete or self.initial_response is not None or self.close_sent:
            return  # refused: they are nobody's
        self.data_received(early)
        if not self.read_paused and not self.transport.is_closing():
            self.transport.resume_reading()

    def _text_frame(self, data: bytes) -> bytes | None:
        """The unmasked payload if ``data`` is exactly one complete, final, masked text frame
        without reserved bits, no larger than the size limit, arriving where websockets' parser
        waits for a new frame on an open connection with no extension, no fragmented message in
        progress and no debug logging; else ``None`` (websockets parses ``data``, and reports
        whatever is wrong with it)."""
        n = len(data)
        if n < 6 or data[0] != 0x81:  # FIN, no reserved bit, opcode 1 (text)
            return None
        b1 = data[1]
        if not b1 & 0x80:  # a client's frames are masked (else websockets' protocol error)
            return None
        length = b1 & 0x7F
        if length < 126:
            start = 6
        elif length == 126:
            length = int.from_bytes(data[2:4], "big")
            start = 8
        else:
            length = int.from_bytes(data[2:10], "big")
            start = 14
        if start + length != n:  # part of a frame, or more than one
            return None
        conn = self.conn
        try:
            limit = _size_limit(conn)
            if (
                conn.state is not _OPEN
                or _in_message(conn)
                or conn.extensions
                or conn.debug
                or conn.parser_exc is not None
                or conn.reader.buffer
                or (limit is not None and length > limit)
            ):
                return None
        except AttributeError:  # a websockets release that keeps these elsewhere: its parser reads
            return None
        g = conn.parser
        while True:  # the innermost generator the parser waits in
            sub = getattr(g, "gi_yieldfrom", None)
            if sub is None:
                break
            g = sub
        if getattr(g, "gi_code", None) is not _BETWEEN_FRAMES or _BETWEEN_FRAMES is None:
            return None
        return apply_mask(data[start:], data[start - 4 : start])

    def shutdown(self) -> None:
        busy = self._busy
        closing = self.transport.is_closing()
        if busy is not None and self.handshake_complete and not self.close_sent and not closing and busy():
            # responses in flight on this connection finish first; look again shortly
            self.loop.call_later(_DRAIN_POLL, self.shutdown)
            return
        if closing:
            return
        self._flush()  # frames still corked go out before the close frame
        if self.close_sent or not self.handshake_complete:
            super().shutdown()
            self._closing()
            return
        # uvicorn's own shutdown closes with 1012 (service restart); hotloop says 1001 (going away)
        self.stop_keepalive()
        self.queue.put_nowait({"type": "websocket.disconnect", "code": 1001})
        self.conn.send_close(1001, "server shutting down")
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.transport.close()
        self._closing()

    def _on_client_gone(self, callback: Any) -> None:
        self._on_gone = callback

    def _client_gone(self) -> None:
        callback, self._on_gone = self._on_gone, None
        if callback is not None:
            callback()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._held is not None:
            self._held.cancel()
            self._held = None
        if self._abort_timer is not None:
            self._abort_timer.cancel()
            self._abort_timer = None
        if self.limits is not None:
            self.limits.release(self.transport)
        super().connection_lost(exc)
        if not self._app_closed:  # the application had not closed it: the client left
            self._client_gone()
        self._on_gone = None

    def handle_close(self, event: Any) -> None:
        gone = not self.close_sent and not self.transport.is_closing()
        super().handle_close(event)
        if gone:
            self._client_gone()
        self._closing()

    def handle_connect(self, event: Any) -> None:
        response = _accept(self.conn.accept, event)
        if response.status_code != 101:  # websockets refuses the request: uvicorn's refusal, lingering
            self.handshake_initiated = True
            self._refuse(response)
            return
        self.conn.accept = lambda request: response  # type: ignore[method-assign]  # (uvicorn's asks)
        super().handle_connect(event)
        del self.conn.accept  # (it held the response, which the accept lets go: the lean idle state)
        self.request = None  # type: ignore[assignment]
        event.headers.clear()  # the scope holds its own copy; the parser's frame keeps the request
        extensions: dict[str, Any] = self.scope["extensions"]  # type: ignore[assignment]
        extensions[SEND_TEXTS] = self.send_texts
        extensions[WAIT_WRITABLE] = self.wait_writable
        extensions[ON_CLIENT_GONE] = self._on_client_gone
        extensions[ON_BUSY] = self._on_busy

    def _flush(self) -> None:
        # Whatever was held goes with this write. The hold timer, if any, is left to fire (it
        # then finds nothing held, or what was held since, and writes that early): cancelling
        # and creating a timer on each held write cost more than the write's events.
        self._flush_scheduled = False
        if self._cork:
            data = b"".join(self._cork)
            self._cork.clear()
            if not self.transport.is_closing():
                self.transport.write(data)

    def _write_all(self) -> None:
        """Write at once everything corked, held deltas included (an event that is never held:
        an item's start or end, a response's terminal event). The hold timer, if set, is
        cancelled: it would find nothing held, and wake an idle loop for nothing once a
        response at least. Rare writes, unlike the held ones ``_flush`` leaves the timer for."""
        self._flush()
        held = self._held
        if held is not None:
            self._held = None
            held.cancel()

    def _write_held(self) -> None:
        self._held = None
        if self._cork:  # else written since
            self._held_since = self.loop.time()
            self._flush()

    def _corked(self, data: list[bytes]) -> None:
        self._cork.extend(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def send_texts(self, events: list[tuple[Any, bytes]], now: bool = False, within: float = 0.0) -> bool:
        """Send the UTF-8 payload of each ``(name, payload)`` pair (the shape of
        :data:`hotloop.protocol.events.Frame`) as one text message; whether the client can take
        more now. ``now``: write at once instead of at the end of this loop iteration (a caller
        that already sends everything it has in one call, such as a read callback).

        ``within`` (seconds, with ``now``): when events sent with ``now`` were written less than
        half of ``within`` ago (held or not: a response's first deltas, never held, count), hold these (at most until ``within`` after that write), so that
        the events of several reads go out in one write (``--flush-interval-ms``). Any other
        write sends what is held first, so the order never changes; at most one interval's
        events are held. One timer per connection at a time: a held write does not cancel it, and
        when it fires it writes whatever is held then (at most ``within`` after the write before
        it); a write of events that are never held (``now`` without ``within``) cancels it, as
        nothing is held after it.

        Raises ``ClientDisconnected`` once the connection is gone or closing. After ``False``
        the caller awaits :meth:`wait_writable` before sending again (back-pressure).
        """
        if self.disconnected or self.close_sent or not self.handshake_complete or self.initial_response is not None:
            raise ClientDisconnected()
        conn = self.conn
        if conn.state is _OPEN and not (conn.extensions or conn.debug or conn.expect_continuation_frame):
            cork = self._cork
            if conn.writes:  # keep the order of anything websockets queued itself
                cork.extend(conn.data_to_send())
            headers = _HEADERS
            for _, p in events:
                n = len(p)
                cork.append(headers[n] if n < _NHEADERS else frame_header(n))
                cork.append(p)
            if now:
                if within:
                    # Held: written now if the last such write is at least half of ``within``
                    # old, else when it is ``within`` old. Reads that keep coming write it
                    # themselves; the timer catches a stream that stops (while a stream flows it
                    # fires about once per ``within`` and writes what is held then, if anything).
                    # Inline, not a method: once per streamed token.
                    t = self.loop.time()
                    if t - self._held_since >= within * 0.5:
                        self._held_since = t
                        self._flush()
                    elif self._held is None and not self._flush_scheduled:  # else a write is coming anyway
                        self._held = self.loop.call_at(self._held_since + within, self._write_held)
                else:
                    self._held_since = self.loop.time()
                    self._write_all()
            elif not self._flush_scheduled:
                self._flush_scheduled = True
                self.loop.call_soon(self._flush)
        else:
            try:
                for _, p in events:
                    conn.send_text(p)
            except InvalidState:
                raise ClientDisconnected() from None
            self._corked(conn.data_to_send())
            if now:
                self._write_all()
        return self._writable._set

    async def wait_writable(self) -> None:
        await self.writable.wait()
        if self.disconnected:
            raise ClientDisconnected()

    async def send(self, message: Any) -> None:
        if (
            message["type"] == "websocket.send"
            and self.handshake_complete
            and not self.close_sent
            and self.initial_response is None
        ):
            await self.writable.wait()
            if self.disconnected:
                raise ClientDisconnected()
            try:
                text = message.get("text")
                if text is not None:
                    self.conn.send_text(text.encode())
                else:
                    self.conn.send_binary(message.get("bytes") or b"")
            except InvalidState:
                raise ClientDisconnected() from None
            self._corked(self.conn.data_to_send())
            return
        kind = message["type"]
        if kind == "websocket.close":
            self._app_closed = True
        if not self.close_sent and (
            (kind == "websocket.close" and not self.handshake_complete and self.initial_response is None)
            or (
                kind == "websocket.http.response.body"
                and self.initial_response is not None
                and not message.get("more_body", False)
            )
        ):  # the application refuses the handshake
            await self.writable.wait()
            if self.disconnected:
                raise ClientDisconnected()
            self._refuse_for_app(message)
            return
        self._flush()
        await super().send(message)
        if message["type"] == "websocket.accept":
            self.response = None  # type: ignore[assignment]
            self._read_early()
        elif self.close_timer is not None and message["type"] == "websocket.close":
            self.close_timer.cancel()  # uvicorn's only closes the transport: see _close_timed_out
            self.close_timer = self.loop.call_later(self.close_timeout, self._close_timed_out)

