"""WebSocket load scenarios: what idle connections and concurrent streams cost the server.

* ``idle-ws``: open ``--connections`` WebSocket connections to ``/v1/responses`` that never send
  a frame; report the server's ``VmRSS`` growth per connection and its CPU while they sit idle.
* ``ws-fanout``: ``--streams`` connections each stream ``--tokens`` tokens at the server's
  ``--rate`` tokens/s at the same time, ``--rounds`` times; report the server process's CPU
  (user+system from /proc) per delta event delivered.

The client is a minimal WebSocket client on asyncio protocols (one ``data_received`` parses every
frame in the buffer; server frames are never masked, client frames use the all-zero mask, which
RFC 6455 allows), so the client's own cost stays far below the server's on a 2-vCPU machine.
It only counts frames: a delta is a text frame starting with the delta event's ``type``.

Everything runs on 127.0.0.1 with bounded loops and timeouts. ``--server-path`` puts another
source tree first on the server's ``PYTHONPATH``, to compare two versions in one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import base64
import os
import resource
import struct
import time
from typing import Any

from hotloop.bench import _proc_cpu_seconds, mock_process, server
from hotloop.protocol import events as ev

_DELTA_PREFIX = b'{"type":"' + ev.OUTPUT_TEXT_DELTA.encode() + b'"'
_DONE_PREFIXES = tuple(b'{"type":"' + t.encode() + b'"' for t in (ev.COMPLETED, ev.FAILED, ev.INCOMPLETE, ev.ERROR))
_MAX_BUFFER = 1 << 20  # bytes of one unfinished frame the client holds (deltas are ~200 B)


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _raise_nofile(need: int) -> int:
    """Raise the soft open-files limit (inherited by the server process); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return soft


def _client_frame(opcode: int, payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return head + b"\0\0\0\0" + payload  # zero mask: the payload goes as is


class _Client(asyncio.Protocol):
    """One WebSocket connection that counts what it receives."""

    def __init__(self, host: str, path: str) -> None:
        self.host = host
        self.path = path
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.open = asyncio.get_running_loop().create_future()
        self.handshaken = False
        self.deltas = 0
        self.frames = 0
        self.turn_done: asyncio.Future[bytes] | None = None
        self.closed = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        key = base64.b64encode(os.urandom(16)).decode()
        transport.write(
            (
                f"GET {self.path} HTTP/1.1\r\nHost: {self.host}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for fut in (self.open, self.turn_done):
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionError("connection lost"))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if len(buf) > _MAX_BUFFER:
            raise RuntimeError("frame too large for the bench client")
        if not self.handshaken:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            if not buf.startswith(b"HTTP/1.1 101"):
                self.open.set_exception(ConnectionError(bytes(buf[:end]).decode("latin-1")))
                return
            del buf[: end + 4]
            self.handshaken = True
            self.open.set_result(None)
        pos = 0
        n = len(buf)
        while n - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            size = b1 & 0x7F
            head = 2
            if size == 126:
                if n - pos < 4:
                    break
                size = int.from_bytes(buf[pos + 2 : pos + 4], "big")
                head = 4
            elif size == 127:
                if n - pos < 10:
                    break
                size = int.from_bytes(buf[pos + 2 : pos + 10], "big")
                head = 10
            if n - pos < head + size:
                break
            start = pos + head
            pos = start + size
            opcode = b0 & 0x0F
            if opcode == 0x1:
                self.frames += 1
                if buf.startswith(_DELTA_PREFIX, start):
                    self.deltas += 1
                elif self.turn_done is not None and any(buf.startswith(p, start) for p in _DONE_PREFIXES):
                    if not self.turn_done.done():
                        self.turn_done.set_result(bytes(buf[start : start + 40]))
            elif opcode == 0x9 and self.transport is not None:  # ping: answer with a pong
                self.transport.write(_client_frame(0xA, bytes(buf[start:pos])))
        del buf[:pos]

    def send_text(self, text: bytes) -> None:
        assert self.transport is not None
        self.transport.write(_client_frame(0x1, text))

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(_client_frame(0x8, struct.pack("!H", 1000)))
            self.transport.close()


async def _connect(port: int, count: int, batch: int = 50) -> list[_Client]:
    loop = asyncio.get_running_loop()
    clients: list[_Client] = []
    for first in range(0, count, batch):
        made = await asyncio.gather(
            *(
                loop.create_connection(lambda: _Client(f"127.0.0.1:{port}", "/v1/responses"), "127.0.0.1", port)
                for _ in range(min(batch, count - first))
            )
        )
        batch_clients = [p for _, p in made]
        await asyncio.wait_for(asyncio.gather(*(c.open for c in batch_clients)), 30)
        clients.extend(batch_clients)
    return clients


async def _close(clients: list[_Client]) -> None:
    for c in clients:
        c.close()
    await asyncio.sleep(0.2)


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


async def _stream_all(clients: list[_Client], tokens: int, timeout: float = 120.0, rate: float | None = None) -> None:
    """One response of ``tokens`` deltas on every client: from the simulator, or (``rate`` given)
    from the paced mock behind the Cerebras backend (model ``bench-<rate>-<tokens>``)."""
    if rate is None:
        frame = (
            b'{"type":"' + ev.CLIENT_CREATE.encode() + b'","model":"hotloop-sim","input":"go","store":false,'
            b'"metadata":{"sim":"text,tokens:' + str(tokens).encode() + b'"}}'
        )
    else:
        frame = (
            b'{"type":"' + ev.CLIENT_CREATE.encode() + b'","model":"bench-' + f"{rate:g}-{tokens}".encode()
            + b'","input":"go","store":false}'
        )
    loop = asyncio.get_running_loop()
    for c in clients:
        c.turn_done = loop.create_future()
    for c in clients:
        c.send_text(frame)
    ends = await asyncio.wait_for(asyncio.gather(*(c.turn_done for c in clients if c.turn_done)), timeout)
    for end in ends:
        if not end.startswith(_DONE_PREFIXES[0]):
            raise RuntimeError(f"a stream did not complete: {end!r}")


async def _idle(base: str, pid: int, connections: int, idle_seconds: float) -> dict[str, Any]:
    port = _port(base)
    warm = await _connect(port, 5)  # code paths and lazy imports, one turn on one connection
    await _stream_all(warm[:1], 8)
    await _close(warm)
    await asyncio.sleep(0.5)
    rss0 = _rss_kb(pid)
    t0 = time.perf_counter()
    clients = await _connect(port, connections)
    connect_s = time.perf_counter() - t0
    await asyncio.sleep(1.0)
    rss1 = _rss_kb(pid)
    cpu0 = _proc_cpu_seconds(pid)
    await asyncio.sleep(idle_seconds)
    idle_cpu = _proc_cpu_seconds(pid) - cpu0
    rss2 = _rss_kb(pid)
    alive = sum(1 for c in clients if not c.closed)
    await _close(clients)
    if alive != connections:
        raise RuntimeError(f"only {alive} of {connections} idle connections stayed open")
    return {
        "scenario": "idle-ws",
        "connections": connections,
        "connect_seconds": round(connect_s, 2),
        "rss_before_kb": rss0,
        "rss_after_kb": rss2,
        "rss_per_connection_kb": round((rss1 - rss0) / connections, 2),
        "rss_per_connection_after_idle_kb": round((rss2 - rss0) / connections, 2),
        "idle_cpu_ms_per_second": round(idle_cpu * 1e3 / idle_seconds, 2),
    }


async def _fanout(base: str, pid: int, streams: int, tokens: int, rounds: int, rate: float | None = None) -> dict[str, Any]:
    clients = await _connect(_port(base), streams)
    await _stream_all(clients, 16, rate=rate)  # warm-up
    for c in clients:
        c.deltas = c.frames = 0
    cpu0 = _proc_cpu_seconds(pid)
    t0 = time.perf_counter()
    for _ in range(rounds):
        await _stream_all(clients, tokens, rate=rate)
    wall = time.perf_counter() - t0
    cpu = _proc_cpu_seconds(pid) - cpu0
    deltas = sum(c.deltas for c in clients)
    frames = sum(c.frames for c in clients)
    await _close(clients)
    if deltas != streams * tokens * rounds:
        raise RuntimeError(f"expected {streams * tokens * rounds} deltas, got {deltas}")
    return {
        "scenario": "ws-fanout",
        "streams": streams,
        "tokens": tokens,
        "rounds": rounds,
        "delta_events": deltas,
        "events": frames,
        "wall_seconds": round(wall, 3),
        "delivered_rate_per_stream": round(deltas / streams / wall, 1),
        "server_core_share": round(cpu / wall, 3),
        "server_cpu_per_delta_us": round(cpu * 1e6 / deltas, 2),
        "server_cpu_per_event_us": round(cpu * 1e6 / frames, 2),
    }


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)


def bench_idle(connections: int, idle_seconds: float = 3.0, server_path: str | None = None) -> dict[str, Any]:
    limit = _raise_nofile(connections * 2 + 256)  # both ends of every connection live on this host
    if limit < connections * 2 + 64:
        raise RuntimeError(f"the open-files limit ({limit}) is too low for {connections} connections")
    with server("--sim-rate", "1000", pythonpath=server_path) as (base, pid):
        return _run(_idle(base, pid, connections, idle_seconds))


def bench_fanout(
    streams: int, tokens: int, rate: float, rounds: int = 3, server_path: str | None = None, backend: str = "simulator",
    tls: bool = False,
) -> dict[str, Any]:
    """``backend="cerebras"``: the streams come from the paced mock through the Cerebras backend
    (its HTTP transport, SSE parsing and chunk assembly are then part of the measure; ``tls``:
    the mock over TLS)."""
    _raise_nofile(streams * 4 + 256)
    with contextlib.ExitStack() as stack:
        if backend == "cerebras":
            url, _mock_pid = stack.enter_context(mock_process(tls))
            os.environ.setdefault("CEREBRAS_API_KEY", "bench")
            base, pid = stack.enter_context(server("--backend", "cerebras", "--base-url", url, pythonpath=server_path))
            r = _run(_fanout(base, pid, streams, tokens, rounds, rate))
        else:
            base, pid = stack.enter_context(server("--sim-rate", f"{rate:g}", pythonpath=server_path))
            r = _run(_fanout(base, pid, streams, tokens, rounds))
    r["backend"] = backend
    r["target_rate"] = rate
    if backend == "cerebras":
        r["mock_tls"] = tls
    return r
