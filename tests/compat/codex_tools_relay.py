"""A byte-for-byte TCP relay between Codex and ``hotloop serve`` that records both directions,
and readers that turn the recording back into HTTP requests, SSE events and WebSocket frames.

Used by ``test_codex_tools.py`` to see exactly what Codex sent (its tools, its frames, the tool
output of the next turn) and what hotloop answered, without relying on hotloop's own view of it.
Loopback only; every connection is recorded as ``[(direction, bytes), ...]`` in arrival order.
"""

from __future__ import annotations

import asyncio
import json
import threading
import zlib
from typing import Any


class Relay:
    """Listens on 127.0.0.1:<port>, forwards to ``upstream_port``; ``conns`` holds each
    connection's recorded chunks: ``("c", b"...")`` from the client, ``("s", ...)`` from the server."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.conns: list[list[tuple[str, bytes]]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def __enter__(self) -> "Relay":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("relay did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        log: list[tuple[str, bytes]] = []
        self.conns.append(log)
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            cw.close()
            return

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, tag: str) -> None:
            try:
                while data := await r.read(65536):
                    log.append((tag, data))
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                try:
                    w.close()
                except OSError:
                    pass

        try:
            await asyncio.gather(pump(cr, sw, "c"), pump(sr, cw, "s"))
        finally:
            for w in (sw, cw):
                w.close()


# -- reading a recording back ------------------------------------------------------------------


def _stream(log: list[tuple[str, bytes]], tag: str) -> bytes:
    return b"".join(d for t, d in log if t == tag)


def _head(buf: bytes, pos: int) -> tuple[str, dict[str, str], int]:
    end = buf.index(b"\r\n\r\n", pos)
    lines = buf[pos:end].decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return lines[0], headers, end + 4


def _body(buf: bytes, pos: int, headers: dict[str, str]) -> tuple[bytes, int]:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while True:
            eol = buf.index(b"\r\n", pos)
            size = int(buf[pos:eol].split(b";")[0], 16)
            pos = eol + 2
            if size == 0:
                pos = buf.index(b"\r\n", pos) + 2  # no trailers expected
                return out, pos
            out += buf[pos : pos + size]
            pos += size + 2
    n = int(headers.get("content-length", "0"))
    return buf[pos : pos + n], pos + n


def _ws_frames(buf: bytes, deflate: bool) -> list[str]:
    """Text messages of a WebSocket byte stream (masked or not; permessage-deflate if negotiated)."""
    out: list[str] = []
    pos = 0
    parts: list[bytes] = []
    compressed = False
    inflater = zlib.decompressobj(-15)
    while pos + 2 <= len(buf):
        b0, b1 = buf[pos], buf[pos + 1]
        fin, rsv1, opcode = b0 & 0x80, b0 & 0x40, b0 & 0x0F
        masked, n = b1 & 0x80, b1 & 0x7F
        p = pos + 2
        if n == 126:
            n = int.from_bytes(buf[p : p + 2], "big")
            p += 2
        elif n == 127:
            n = int.from_bytes(buf[p : p + 8], "big")
            p += 8
        mask = b""
        if masked:
            mask = buf[p : p + 4]
            p += 4
        if p + n > len(buf):
            break  # a partial frame at the end of the recording
        payload = buf[p : p + n]
        if masked:
            payload = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
        pos = p + n
        if opcode in (0x1, 0x2):
            parts, compressed = [payload], bool(rsv1)
        elif opcode == 0x0:
            parts.append(payload)
        else:
            continue  # control frames
        if fin:
            data = b"".join(parts)
            if compressed and deflate:
                data = inflater.decompress(data + b"\x00\x00\xff\xff")
            out.append(data.decode("utf-8"))
    return out


def read_conn(log: list[tuple[str, bytes]]) -> dict[str, Any]:
    """One recorded connection: ``{"kind": "ws", "path", "headers", "sent": [frame dicts],
    "received": [frame dicts]}`` or ``{"kind": "http", "exchanges": [{"path", "headers", "body",
    "status", "events"}]}``."""
    cbuf, sbuf = _stream(log, "c"), _stream(log, "s")
    if not cbuf:
        return {"kind": "empty"}
    line, headers, pos = _head(cbuf, 0)
    if headers.get("upgrade", "").lower() == "websocket":
        sline, sheaders, spos = _head(sbuf, 0)
        deflate = "permessage-deflate" in sheaders.get("sec-websocket-extensions", "")
        return {
            "kind": "ws",
            "path": line.split()[1],
            "headers": headers,
            "status": sline,
            "response_headers": sheaders,
            "sent": [json.loads(f) for f in _ws_frames(cbuf[pos:], deflate)],
            "received": [json.loads(f) for f in _ws_frames(sbuf[spos:], deflate)],
        }
    exchanges = []
    spos = 0
    while True:
        body, pos = _body(cbuf, pos, headers)
        ex: dict[str, Any] = {"path": line.split()[1], "method": line.split()[0], "headers": headers, "body": body}
        if spos < len(sbuf):
            sline, sheaders, spos = _head(sbuf, spos)
            sbody, spos = _body(sbuf, spos, sheaders)
            ex["status"] = sline
            ex["response_headers"] = sheaders
            ex["response_body"] = sbody
            ex["events"] = [
                json.loads(ln[5:].strip())
                for ln in sbody.decode("utf-8", "replace").splitlines()
                if ln.startswith("data:") and ln[5:].strip() not in ("", "[DONE]")
            ]
        exchanges.append(ex)
        if pos >= len(cbuf):
            break
        line, headers, pos = _head(cbuf, pos)
    return {"kind": "http", "exchanges": exchanges}
