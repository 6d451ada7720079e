"""Scale-out benchmarks: ``hotloop bench http-throughput`` and ``hotloop bench store-cpu``.

* ``http-throughput``: HTTP turns per second of one server with ``--workers 1`` and then
  ``--workers 2`` (SQLite store, simulator unpaced, ``store: true``), driven for ``--seconds`` by
  ``--clients`` keep-alive connections from this process (a minimal HTTP/1.1 client on asyncio,
  so the load generator's own cost per request stays small; it shares the machine's cores with
  the server).
* ``store-cpu``: ``--turns`` stored HTTP turns, each continuing the previous one with
  ``previous_response_id``, against one server with ``--store sqlite`` and then with
  ``--store redis`` (a ``redis-server`` the benchmark starts on a free port); the server
  process's CPU (all threads: event loop and writer) per turn from ``/proc``, and Redis's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from typing import Any, Iterator

from hotloop.bench import _free_port, _proc_cpu_seconds, server, wait_listening

_BODY = json.dumps({"model": "hotloop-sim", "input": "One short turn.", "store": True}).encode()


def _request(port: int, body: bytes) -> bytes:
    return (
        f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes) -> bytes:
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    status = head[9:12]
    length = -1
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    if length >= 0:
        body = await reader.readexactly(length)
    else:  # chunked
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            parts.append((await reader.readexactly(size + 2))[:-2])
            if size == 0:
                break
        body = b"".join(parts)
    if status != b"200":
        raise RuntimeError(f"status {status.decode()}: {body[:200]!r}")
    return body


async def _drive(port: int, clients: int, seconds: float) -> int:
    req = _request(port, _BODY)
    done = 0
    stop = time.monotonic() + seconds

    async def client() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.monotonic() < stop:
                await _one(reader, writer, req)
                done += 1
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return done


def bench_throughput(clients: int = 16, seconds: float = 5.0, workers: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": "http-throughput", "clients": clients, "seconds": seconds}
    for n in workers:
        with server("--sim-rate", "0", "--store", "sqlite", "--workers", str(n), "--no-metrics") as (base, _pid):
            port = int(base.rsplit(":", 1)[1])
            asyncio.run(_drive(port, clients, 1.0))  # warm-up: every worker, caches, SQLite pages
            done = asyncio.run(_drive(port, clients, seconds))
        out[f"workers_{n}_turns_per_s"] = round(done / seconds, 1)
    if len(workers) == 2:
        out["speedup"] = round(out[f"workers_{workers[1]}_turns_per_s"] / out[f"workers_{workers[0]}_turns_per_s"], 2)
    return out


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, int]]:
    """A ``redis-server`` on a free port, no persistence: (URL, pid)."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = _free_port()
    tmp = tempfile.mkdtemp(prefix="hotloop-bench-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_listening(port, proc, "redis-server", 10.0)
        yield f"redis://127.0.0.1:{port}/0", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


async def _chain(port: int, turns: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        prev: str | None = None
        for i in range(turns):
            body: dict[str, Any] = {"model": "hotloop-sim", "input": f"Turn {i}: go on.", "store": True}
            if prev is not None:
                body["previous_response_id"] = prev
            prev = json.loads(await _one(reader, writer, _request(port, json.dumps(body).encode())))["id"]
    finally:
        writer.close()


def _cpu_per_turn(port: int, pid: int, turns: int) -> float:
    asyncio.run(_chain(port, 20))  # warm-up
    time.sleep(0.5)
    before = _proc_cpu_seconds(pid)
    asyncio.run(_chain(port, turns))
    time.sleep(1.5)  # the writer and the usage batch finish
    return (_proc_cpu_seconds(pid) - before) / turns * 1e6


def bench_store_cpu(turns: int = 500) -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": "store-cpu", "turns": turns}
    with server("--sim-rate", "0", "--store", "sqlite", "--no-metrics") as (base, pid):
        out["sqlite_server_cpu_per_turn_us"] = round(_cpu_per_turn(int(base.rsplit(":", 1)[1]), pid, turns), 1)
    with redis_server() as (url, rpid):
        with server("--sim-rate", "0", "--store", "redis", "--redis-url", url, "--no-metrics") as (base, pid):
            r0 = _proc_cpu_seconds(rpid)
            out["redis_server_cpu_per_turn_us"] = round(_cpu_per_turn(int(base.rsplit(":", 1)[1]), pid, turns), 1)
            out["redis_own_cpu_per_turn_us"] = round((_proc_cpu_seconds(rpid) - r0) / (turns + 20) * 1e6, 1)
    out["added_server_cpu_per_turn_us"] = round(out["redis_server_cpu_per_turn_us"] - out["sqlite_server_cpu_per_turn_us"], 1)
    return out
