"""The WebSocket server protocol (``server/wsproto.py``) against hand-built frames on real sockets:
what a closing connection does with a client that stops reading, the handshake's refusal of a
version it does not speak, and what holds under framing abuse, pings while streaming, a slow
reader and the server's shutdown (RFC 6455; ``websockets``' own behaviour where the RFC leaves a
choice)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import uvloop
from uvicorn.config import Config as UvicornConfig
from uvicorn.server import ServerState

from hotloop.server.wsproto import SEND_TEXTS, CorkedWebSocketProtocol
from tests.conftest import Server, run_server

# The server with its close bound shortened (CLOSE_TIMEOUT, 10 s in production).
_CLOSE_BOUND = 2.0
_SHORT_CLOSE = f"""
import sys
import hotloop.server.wsproto as wsproto
wsproto.CLOSE_TIMEOUT = {_CLOSE_BOUND}
from hotloop.cli import main
sys.exit(main(sys.argv[1:]))
"""


# -- a raw client --------------------------------------------------------------------------------


def handshake(port: int, extra: bytes = b"", *, rcvbuf: int | None = None, timeout: float = 10.0) -> tuple[socket.socket, bytes]:
    s = socket.socket()
    if rcvbuf:  # before connect: the window the server sees stays small
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16))
    s.sendall(
        b"GET /v1/responses HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n" + extra + b"\r\n"
    )
    head = b""
    while b"\r\n\r\n" not in head:
        c = s.recv(1)
        if not c:
            break
        head += c
    return s, head


def frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True, rsv: int = 0, form: int = 0) -> bytes:
    """A client frame; ``form``: 126 or 127 to use that length encoding whatever the length."""
    b0 = (0x80 if fin else 0) | rsv << 4 | opcode
    n = len(payload)
    bit = 0x80 if mask else 0
    if form == 127 or (not form and n >= 65536):
        head = bytes((b0, bit | 127)) + n.to_bytes(8, "big")
    elif form == 126 or (not form and n >= 126):
        head = bytes((b0, bit | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((b0, bit | n))
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def close_frame(code: int, reason: bytes = b"") -> bytes:
    return frame(8, code.to_bytes(2, "big") + reason)


def create(**kw: Any) -> bytes:
    body = {"type": "response.create", "model": "hotloop-sim", "input": "hi", "store": False}
    body.update(kw)
    return json.dumps(body).encode()


class Reader:
    """Server frames off a raw socket."""

    def __init__(self, s: socket.socket) -> None:
        self.s = s
        self.buf = b""
        self.pos = 0  # where the next frame starts in buf

    def _need(self, n: int) -> None:
        while len(self.buf) - self.pos < n:
            c = self.s.recv(1 << 20)
            if not c:
                raise EOFError
            self.buf = self.buf[self.pos :] + c
            self.pos = 0

    def frame(self) -> tuple[int, bytes]:
        """(first byte, payload) of the next frame; server frames are never masked."""
        self._need(2)
        buf, at = self.buf, self.pos
        b0, b1 = buf[at], buf[at + 1]
        assert not b1 & 0x80, "a server frame is masked"
        n, off = b1 & 0x7F, 2
        if n == 126:
            self._need(4)
            buf, at = self.buf, self.pos
            n, off = int.from_bytes(buf[at + 2 : at + 4], "big"), 4
        elif n == 127:
            self._need(10)
            buf, at = self.buf, self.pos
            n, off = int.from_bytes(buf[at + 2 : at + 10], "big"), 10
        self._need(off + n)
        at = self.pos
        payload = self.buf[at + off : at + off + n]
        self.pos = at + off + n
        return b0, payload

    def until_close(self, limit: int = 10_000) -> tuple[list[dict[str, Any]], int | None, bytes]:
        """Text events up to the close frame, its code and reason; pongs and pings skipped."""
        events = []
        for _ in range(limit):
            b0, p = self.frame()
            op = b0 & 0x0F
            if op == 1:
                events.append(json.loads(p))
            elif op == 8:
                return events, (int.from_bytes(p[:2], "big") if len(p) >= 2 else None), p[2:]
        raise AssertionError("no close frame")

    def eof(self, timeout: float = 5.0) -> bool:
        """Whether the server closes the TCP connection (nothing more after its close frame)."""
        self.s.settimeout(timeout)
        try:
            assert self.pos == len(self.buf) and self.s.recv(1) == b"", "bytes after the close frame"
            return True
        except socket.timeout:
            return False


def opened(port: int, deadline: float, rcvbuf: int | None = None) -> socket.socket:
    """A connection accepted (101) before ``deadline`` (the connection limit may refuse it first)."""
    while True:
        s, head = handshake(port, rcvbuf=rcvbuf)
        if head.startswith(b"HTTP/1.1 101"):
            return s
        s.close()
        assert time.monotonic() < deadline, f"no connection accepted: {head[:40]!r}"
        time.sleep(0.1)


def no_traceback(srv: Server) -> None:
    logs = srv.logs()
    assert "Traceback" not in logs and " ERROR " not in logs, logs[-3000:]


# -- a closing connection and a client that reads no more ---------------------------------------


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One connection at most; a long answer (about 8 MB of events, more than the socket buffers
    of both ends hold); keep-alive pings out of the way; the close bound shortened."""
    args = ("--sim-rate", "0", "--sim-output-tokens", "40000", "--store", "memory", "--max-connections", "1",
            "--ws-ping-interval", "600", "--ws-ping-timeout", "600")
    with run_server(tmp_path_factory.mktemp("bounded"), *args, entry=("-c", _SHORT_CLOSE)) as srv:
        yield srv


@pytest.mark.parametrize("how", ["close frame", "FIN", "protocol error"])
def test_a_client_that_stops_reading_and_leaves_frees_its_place(bounded: Server, how: str) -> None:
    """A client asks for a long answer, reads none of it and goes: a close frame, a half-close, a
    frame the server refuses (1002). The transport closes only once its write buffer has drained,
    which such a client never lets happen, and keep-alive pings stop once the close begins: the
    connection held its place under --max-connections (the next upgrade got 503 for as long as
    the client kept the socket) and, after a FIN, its response ran on. Now the client has
    CLOSE_TIMEOUT to read what is buffered, then the connection is aborted; after a FIN the
    response is cancelled at once."""
    port = bounded.port
    s = opened(port, time.monotonic() + 10, rcvbuf=4096)
    other, head = handshake(port)  # the only place is taken
    other.close()
    assert head.startswith(b"HTTP/1.1 503"), head[:40]
    s.sendall(frame(1, create(input="a long answer")))
    time.sleep(1.5)  # the server writes until its buffers are full
    mark = len(bounded.logs())
    try:
        if how == "close frame":
            s.sendall(close_frame(1000))
        elif how == "FIN":
            s.shutdown(socket.SHUT_WR)
        else:
            s.sendall(frame(1, b"unmasked", mask=False))
        if how == "FIN":
            t0 = time.monotonic()
            while "cancelling its responses" not in bounded.logs()[mark:]:
                assert time.monotonic() - t0 < _CLOSE_BOUND * 0.75, "the response runs on after the client's FIN"
                time.sleep(0.05)
        deadline = time.monotonic() + _CLOSE_BOUND + 6
        again = opened(port, deadline)  # the place is free again (the client still holds its socket)
        again.close()
    finally:
        s.close()
    no_traceback(bounded)


def test_a_server_close_a_client_does_not_read_is_aborted_after_the_close_timeout() -> None:
    """The server closes (``websocket.close``: the age limit's 1001, a revoked key's 1008) while
    what it wrote waits in the transport for a client that reads no more: uvicorn's close timer
    only called ``transport.close()``, which waits for the buffer to drain, and keep-alive pings
    stop once the close is sent, so the connection stayed for good. The real protocol on a real
    socket in this process (its buffer filled by its own application, the client never reading)."""

    async def main() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        protos: list[CorkedWebSocketProtocol] = []
        closed_at: list[float] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "websocket.accept"})
            proto = protos[0]
            proto.transport.set_write_buffer_limits(high=64 << 20)  # never paused: the writes pile up
            send_texts = scope["extensions"][SEND_TEXTS]
            payload = b'"' + b"x" * 1000 + b'"'
            for _ in range(10_000):  # until the kernel's buffers are full and the transport holds more
                if proto.transport.get_write_buffer_size() > 100_000:
                    break
                send_texts([("x", payload)] * 64, True)
                await asyncio.sleep(0)
            assert proto.transport.get_write_buffer_size() > 100_000
            await send({"type": "websocket.close", "code": 1001, "reason": "connection limit reached"})
            closed_at.append(loop.time())

        cfg = UvicornConfig(app=app, ws=CorkedWebSocketProtocol, ws_per_message_deflate=False, lifespan="off", proxy_headers=False)
        cfg.load()
        state = ServerState()

        def factory() -> CorkedWebSocketProtocol:
            proto = CorkedWebSocketProtocol(config=cfg, server_state=state, app_state={})
            proto.close_timeout = 0.3
            protos.append(proto)
            return proto

        server = await loop.create_server(factory, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        try:
            await loop.sock_connect(client, ("127.0.0.1", port))
            await loop.sock_sendall(client, _UPGRADE + _KEY + b"Sec-WebSocket-Version: 13\r\n\r\n")
            for _ in range(300):  # 3 s for the application to fill the buffer and close
                await asyncio.sleep(0.01)
                if closed_at:
                    break
            assert closed_at, "the application did not close"
            for _ in range(300):  # then the close timeout (0.3 s), with room for a slow machine
                await asyncio.sleep(0.01)
                if protos[0].disconnected:
                    break
            return protos[0].disconnected, loop.time() - closed_at[0]
        finally:
            client.close()
            server.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        gone, after = runner.run(main())
    assert gone, "the connection is still open 3 s after its close timeout"
    assert after >= 0.25


def test_a_client_that_reads_on_after_its_close_frame_gets_everything_up_to_the_close(bounded: Server) -> None:
    """The close bound is for what a client does not read: one that reads slowly after its close
    frame still gets the server's close frame, after the events buffered before it."""
    port = bounded.port
    s = opened(port, time.monotonic() + 10, rcvbuf=4096)
    try:
        s.sendall(frame(1, create(input="a long answer")))
        time.sleep(1.0)
        s.sendall(close_frame(1000))
        r = Reader(s)
        s.settimeout(10)
        events, code, _ = r.until_close(limit=100_000)
        assert code == 1000
        seqs = [e["sequence_number"] for e in events]
        assert seqs == list(range(len(seqs))) and len(seqs) > 10
        assert r.eof()
    finally:
        s.close()
    no_traceback(bounded)


# -- the handshake -------------------------------------------------------------------------------


def _refusal(port: int, request: bytes) -> tuple[bytes, dict[str, str], dict[str, Any]]:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(request)
        data = b""
        while True:
            c = s.recv(65536)
            if not c:
                break
            data += c
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.decode().partition(":") for x in lines[1:])}
    return lines[0], headers, json.loads(body)


_UPGRADE = b"GET /v1/responses HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
_KEY = b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"


@pytest.mark.parametrize("version", [b"Sec-WebSocket-Version: 8\r\n", b"", b"Sec-WebSocket-Version: 13, 8\r\n"])
def test_a_version_the_server_does_not_speak_is_answered_with_the_one_it_does(bounded: Server, version: bytes) -> None:
    """RFC 6455 4.4: a handshake with another Sec-WebSocket-Version (or none) is refused with the
    versions the server speaks in Sec-WebSocket-Version (websockets refuses it without)."""
    status, headers, body = _refusal(bounded.port, _UPGRADE + _KEY + version + b"\r\n")
    assert status.startswith(b"HTTP/1.1 400"), status
    assert headers.get("sec-websocket-version") == "13", headers
    assert body["error"]["code"] == "invalid_websocket_handshake"


def test_other_refusals_keep_their_shape_and_name_no_version(bounded: Server) -> None:
    status, headers, body = _refusal(bounded.port, _UPGRADE + b"Sec-WebSocket-Key: abc\r\nSec-WebSocket-Version: 13\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400"), status
    assert "sec-websocket-version" not in headers
    assert headers["content-type"] == "application/json" and int(headers["content-length"]) > 0
    assert body["error"] == {
        "message": "The WebSocket handshake request is not valid.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_websocket_handshake",
    }


# -- what holds: framing, pings, order, shutdown -------------------------------------------------


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(tmp_path_factory.mktemp("paced"), "--sim-rate", "2000", "--sim-output-tokens", "300", "--store", "memory") as srv:
        yield srv


_BAD = {
    "unmasked": (frame(1, create(), mask=False), 1002),
    "reserved bit": (frame(1, create(), rsv=4), 1002),
    "opcode 3": (frame(3, b"x"), 1002),
    "control frame of 126 bytes": (frame(9, b"x" * 126), 1002),
    "fragmented ping": (frame(9, b"x", fin=False), 1002),
    "continuation without a start": (frame(0, b"x"), 1002),
    "text inside a fragmented message": (frame(1, b"x", fin=False) + frame(1, b"y"), 1002),
    "not UTF-8": (frame(1, b"\xff\xfe"), 1007),
    "not UTF-8, fragmented": (frame(1, b"\xce", fin=False) + frame(0, b"\xff"), 1007),
    "close code 1005": (close_frame(1005), 1002),
    "close code 999": (close_frame(999), 1002),
    "close reason not UTF-8": (close_frame(1000, b"\xff"), 1007),
    "close of one byte": (frame(8, b"\x03"), 1002),
    "over 32 MiB": (b"\x81\xff" + (40 << 20).to_bytes(8, "big") + b"mask", 1009),
    "over 32 MiB in fragments": (frame(1, b"x" * 1000, fin=False) + b"\x80\xff" + (32 << 20).to_bytes(8, "big") + b"mask", 1009),
}


@pytest.mark.parametrize("name", list(_BAD))
def test_a_bad_frame_is_closed_with_its_code_and_nothing_after(paced: Server, name: str) -> None:
    data, code = _BAD[name]
    s, head = handshake(paced.port)
    try:
        assert head.startswith(b"HTTP/1.1 101"), head
        s.sendall(data)
        r = Reader(s)
        events, got, _ = r.until_close()
        assert (events, got) == ([], code)
        assert r.eof()
    finally:
        s.close()
    no_traceback(paced)


def test_a_fragmented_create_with_a_ping_inside_runs_and_the_ping_is_answered_first(paced: Server) -> None:
    body = create(input="fragments")
    s, head = handshake(paced.port)
    try:
        s.sendall(frame(1, body[:7], fin=False) + frame(9, b"inside") + frame(0, body[7:20], fin=False) + frame(0, body[20:]))
        r = Reader(s)
        b0, p = r.frame()
        assert (b0, p) == (0x8A, b"inside")
        events: list[dict[str, Any]] = []
        while not events or events[-1]["type"] != "response.completed":
            b0, p = r.frame()
            assert b0 == 0x81
            events.append(json.loads(p))
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        # a 64-bit length for a small frame is read as websockets reads it; the close is echoed
        s.sendall(frame(1, b'{"type":"response.processed"}', form=127) + close_frame(1000, b"bye"))
        assert r.until_close() == ([], 1000, b"bye")
        assert r.eof()
    finally:
        s.close()
    no_traceback(paced)


def test_pings_are_answered_in_order_while_streaming_to_a_slow_reader(paced: Server) -> None:
    """Pings sent while a response streams are each answered with their payload, between whole
    messages; the events come in order, the terminal one last, whatever the reader's pace."""
    s, head = handshake(paced.port, rcvbuf=4096)
    try:
        s.sendall(frame(1, create(input="stream")) + frame(1, create(input="again")))
        r = Reader(s)
        pongs: list[bytes] = []
        events: list[dict[str, Any]] = []
        sent = 0
        while sum(e["type"] == "response.completed" for e in events) < 2:
            if sent < 20:
                s.sendall(frame(9, b"p%03d" % sent))
                sent += 1
            time.sleep(0.002)  # slower than the server writes
            b0, p = r.frame()
            if b0 == 0x8A:
                pongs.append(p)
            else:
                assert b0 == 0x81
                events.append(json.loads(p))
        s.settimeout(5)
        while len(pongs) < sent:
            b0, p = r.frame()
            assert b0 == 0x8A
            pongs.append(p)
        assert pongs == [b"p%03d" % i for i in range(sent)]
        first = events.index(next(e for e in events if e["type"] == "response.completed")) + 1
        for part in (events[:first], events[first:]):
            assert [e["sequence_number"] for e in part] == list(range(len(part)))
            assert part[-1]["type"] == "response.completed"
            text = "".join(e["delta"] for e in part if e["type"] == "response.output_text.delta")
            assert text == part[-1]["response"]["output"][0]["content"][0]["text"]
    finally:
        s.close()
    no_traceback(paced)


def test_permessage_deflate_and_subprotocols_are_not_negotiated(paced: Server) -> None:
    """The corked writer's own frame headers (RSV1 clear) are right only without an extension:
    per-message compression is off, so none is negotiated and no subprotocol either."""
    extra = b"Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\nSec-WebSocket-Protocol: chat\r\n"
    s, head = handshake(paced.port, extra)
    try:
        assert head.startswith(b"HTTP/1.1 101"), head
        assert b"sec-websocket-extensions" not in head.lower() and b"sec-websocket-protocol" not in head.lower()
        s.sendall(frame(1, create(input="plain")))
        r = Reader(s)
        while True:
            b0, p = r.frame()
            assert b0 == 0x81  # FIN, no reserved bit, text
            if json.loads(p)["type"] == "response.completed":
                break
    finally:
        s.close()


def test_shutdown_closes_an_idle_connection_with_1001(tmp_path: Path) -> None:
    with run_server(tmp_path, "--sim-rate", "0", "--store", "memory") as srv:
        s, head = handshake(srv.port)
        try:
            assert head.startswith(b"HTTP/1.1 101"), head
            s.sendall(frame(1, create()))
            r = Reader(s)
            while json.loads(r.frame()[1])["type"] != "response.completed":
                pass
            srv.proc.send_signal(signal.SIGTERM)
            s.settimeout(10)
            assert r.until_close() == ([], 1001, b"server shutting down")
            assert r.eof()
        finally:
            s.close()
        srv.proc.wait(timeout=20)


def test_held_deltas_of_two_lanes_arrive_in_order_and_never_after_their_terminal_event(tmp_path: Path, mock: Any) -> None:
    """Pushed deltas (a chat backend, the lean transport) held by --flush-interval-ms on two
    lanes at once, to a client that reads slowly: each lane's events in order, its text whole,
    its terminal event its last, nothing written after the client's close."""
    from tests.mock_chat_server import Reply, paced_events

    mock.reset()
    mock.default_reply = lambda: Reply.stream(paced_events(120, 0.002))
    args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model", "--store", "memory")
    with run_server(tmp_path, *args, "--flush-interval-ms", "20") as srv:
        s, head = handshake(srv.port, rcvbuf=4096)
        try:
            assert head.startswith(b"HTTP/1.1 101"), head
            s.sendall(frame(1, create(model="mock-model", stream_id="a")) + frame(1, create(model="mock-model", stream_id="b")))
            r = Reader(s)
            lanes: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
            while not all(ev and ev[-1]["type"] == "response.completed" for ev in lanes.values()):
                time.sleep(0.001)
                b0, p = r.frame()
                assert b0 == 0x81
                e = json.loads(p)
                got = lanes[e["stream_id"]]
                assert not got or got[-1]["type"] != "response.completed", "an event after the terminal one"
                got.append(e)
            for events in lanes.values():
                assert [e["sequence_number"] for e in events] == list(range(len(events)))
                text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
                assert text == "".join(f" w{i}" for i in range(120))
            s.sendall(close_frame(1000))
            assert r.until_close() == ([], 1000, b"")
            assert r.eof()
        finally:
            s.close()
    no_traceback(srv)
