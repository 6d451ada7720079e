"""WebSocket mode as a production client meets it (audit): real sockets on 127.0.0.1, the real
``websockets`` client and openai-python's ``responses.connect()``."""

from __future__ import annotations

import base64
import json
import os
import socket
import time
from typing import Any

import pytest
from websockets.sync.client import connect as ws_connect

from tests.conftest import raw_until_terminal


def _mask(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    """One masked client frame (any payload size)."""
    mask = os.urandom(4)
    n = len(payload)
    if n < 126:
        head = bytes([(0x80 if fin else 0) | opcode, 0x80 | n])
    elif n < 1 << 16:
        head = bytes([(0x80 if fin else 0) | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([(0x80 if fin else 0) | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _upgrade() -> bytes:
    key = base64.b64encode(os.urandom(16))
    return (
        b"GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )


class _Frames:
    """Server frames read off a raw socket (unmasked, possibly fragmented: reassembled)."""

    def __init__(self, s: socket.socket, buf: bytes = b"") -> None:
        self.s = s
        self.buf = buf

    def _need(self, n: int, deadline: float) -> None:
        while len(self.buf) < n:
            self.s.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.s.recv(1 << 16)
            if not chunk:
                raise EOFError("connection closed")
            self.buf += chunk

    def frame(self, timeout: float = 30.0) -> tuple[int, bytes]:
        deadline = time.monotonic() + timeout
        self._need(2, deadline)
        op, n = self.buf[0] & 0x0F, self.buf[1] & 0x7F
        start = 2
        if n == 126:
            self._need(4, deadline)
            n, start = int.from_bytes(self.buf[2:4], "big"), 4
        elif n == 127:
            self._need(10, deadline)
            n, start = int.from_bytes(self.buf[2:10], "big"), 10
        self._need(start + n, deadline)
        payload, self.buf = self.buf[start : start + n], self.buf[start + n :]
        return op, payload

    def event(self, timeout: float = 30.0) -> dict[str, Any]:
        while True:
            op, payload = self.frame(timeout)
            if op == 0x1:
                return json.loads(payload)  # type: ignore[no-any-return]
            if op == 0x8:
                raise EOFError(f"closed: {payload!r}")

    def until_terminal(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        out = []
        while True:
            e = self.event(timeout)
            out.append(e)
            if e["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
                return out


def _raw(port: int, first: bytes = b"") -> _Frames:
    """A raw socket that sent the upgrade request (and ``first`` in the same write); past the 101."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(_upgrade() + first)
    head = b""
    deadline = time.monotonic() + 10
    while b"\r\n\r\n" not in head:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = s.recv(4096)
        if not chunk:
            raise EOFError(head)
        head += chunk
    status, rest = head.split(b"\r\n\r\n", 1)
    assert status.startswith(b"HTTP/1.1 101"), status
    return _Frames(s, rest)


def _create(**kw: Any) -> bytes:
    return json.dumps({"type": "response.create", "model": "hotloop-sim", "store": False, **kw}).encode()


def test_a_frame_sent_with_the_handshake_is_answered(server) -> None:
    """A client that pipelines its first response.create behind the upgrade request (one TCP
    write, before the 101) gets its response."""
    f = _raw(server.port, _mask(0x1, _create(input="hello")))
    try:
        evs = f.until_terminal(timeout=10)
        assert evs[-1]["type"] == "response.completed"
    finally:
        f.s.close()


def test_a_ping_sent_with_the_handshake_is_answered_after_the_101(server) -> None:
    """The pong of a ping that came before the 101 was written before the 101 (the client read a
    corrupt handshake), or the ping was dropped; now the 101 comes first, then the pong, then the
    response of the frame behind it."""
    f = _raw(server.port, _mask(0x9, b"early") + _mask(0x1, _create(input="hi")))
    try:
        op, payload = f.frame(timeout=10)
        assert (op, payload) == (0xA, b"early")
        assert f.until_terminal(timeout=10)[-1]["type"] == "response.completed"
    finally:
        f.s.close()


def test_a_close_sent_with_the_handshake_is_answered_after_the_101(server) -> None:
    """A close frame pipelined behind the handshake: answered with the 101 and then the close
    frame, no ERROR line (it was 'ASGI callable returned without completing handshake')."""
    before = server.logs().count("without completing handshake")
    f = _raw(server.port, _mask(0x8, (1000).to_bytes(2, "big") + b"bye"))
    try:
        op, payload = f.frame(timeout=10)
        assert op == 0x8 and payload[:2] == (1000).to_bytes(2, "big")
    finally:
        f.s.close()
    time.sleep(0.2)
    assert server.logs().count("without completing handshake") == before


def test_a_large_frame_sent_with_the_handshake_is_read_whole(server) -> None:
    """Only the start of a large first frame comes in the handshake's read; the rest follows."""
    f = _raw(server.port, _mask(0x1, _create(input="z " * 150_000)) + _mask(0x1, _create(input="after")))
    try:
        for _ in range(2):
            assert f.until_terminal(timeout=20)[-1]["type"] == "response.completed"
    finally:
        f.s.close()
