"""Client requests while another process holds the SQLite file's write lock past the busy timeout.

A second ``sqlite3`` connection on the same file runs ``BEGIN IMMEDIATE`` (or ``BEGIN EXCLUSIVE``:
in WAL mode the same lock, readers go on) and keeps it: ``hotloop keys``, a backup, an open
``sqlite3`` shell, another worker's long write. What each request path that touches the store
answers then, over HTTP and WebSocket, on a real server (uvicorn, in process) with a real file:

* reads from the file (``GET /v1/responses/{id}`` of a response no cache holds, ``input_items``,
  ``previous_response_id``) are not blocked: WAL readers do not wait for a writer;
* ``DELETE /v1/responses/{id}`` and ``GET /hotloop/usage`` (whose move of an earlier version's
  ledger rows is a write) answer ``503`` ``server_error`` with ``retry-after``, no internals, no
  traceback in the log, within a bound (the store's writer waited for at most the busy timeout,
  then the request's own transaction at most as long), and nothing is half done: after the lock
  is released everything works and the response deleted is gone, its continuation still loads.

The busy timeout is shortened (``--store-busy-timeout``, ``hotloop.state.store.BUSY_TIMEOUT``, and
the same ``PRAGMA`` on the store's connection) so that each test takes a few seconds."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from websockets.asyncio.client import connect

from hotloop.config import Config
from hotloop.server.runner import make_app, uvicorn_config
from hotloop.state import store as store_mod

BUSY = 0.3  # the store's busy timeout in these tests (5 s by default)
# what a locked-out DELETE or usage listing may take: the writer waited for (one busy timeout),
# then the request's own transaction (another), with room for a loaded machine
BOUND = 2 * BUSY + 2.0
CLIENT_TIMEOUT = 8.0  # a request that waits for the writer's retries (60 s) gives no answer in this
INTERNALS = ("locked", "sqlite", "SQLITE", "Traceback", "OperationalError", "database")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.exc_info is not None]


class Lock:
    """Another connection holding the file's write lock until :meth:`release`."""

    def __init__(self, path: str | Path, how: str = "IMMEDIATE") -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute(f"BEGIN {how}")
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.db.execute("ROLLBACK")
            self.db.close()


class Running:
    """A server in this process (uvicorn, on a free port) and a client of it."""

    def __init__(self, app: Any, server: uvicorn.Server, serving: asyncio.Future[None], port: int, lines: _Lines) -> None:
        self.app = app
        self.server = server
        self.serving = serving
        self.port = port
        self.lines = lines
        self.base = f"http://127.0.0.1:{port}"
        self.path: str = app.persistence.store.path
        self.client = httpx.AsyncClient(base_url=self.base, timeout=CLIENT_TIMEOUT)

    async def create(self, text: str, previous: str | None = None) -> str:
        body: dict[str, Any] = {"model": "hotloop-sim", "input": text, "metadata": {"sim": "tokens:3"}}
        if previous is not None:
            body["previous_response_id"] = previous
        r = await self.client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["id"])

    async def settled(self) -> None:
        """Every write queued is in the file, and no cache of the process holds a response."""
        await self.app.persistence.flush()
        self.app.engine.responses.clear()


async def _start(tmp: Path, workers: int, monkeypatch: pytest.MonkeyPatch) -> Running:
    monkeypatch.setattr(store_mod, "BUSY_TIMEOUT", BUSY, raising=False)
    config = Config(
        store="sqlite", data_dir=str(tmp), sim_rate=0, log_level="warning", workers=workers, store_busy_timeout=BUSY
    )
    app = make_app(config)
    store = app.persistence.store
    assert isinstance(store, store_mod.SQLiteStore)
    with store._lock:
        store._db.execute(f"PRAGMA busy_timeout = {int(BUSY * 1000)}")
    server = uvicorn.Server(uvicorn_config(app, config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    for _ in range(1000):
        if server.started:
            break
        await asyncio.sleep(0.01)
    assert server.started
    lines = _Lines()
    logging.getLogger("hotloop").addHandler(lines)  # (after uvicorn configured logging)
    running = Running(app, server, serving, port, lines)
    deletions = getattr(app.persistence, "_deletions", None)  # --workers: the deletion log's connection
    if deletions is not None:
        with deletions._lock:
            deletions._db.execute(f"PRAGMA busy_timeout = {int(BUSY * 1000)}")
    return running


async def _stop(running: Running) -> None:
    await running.client.aclose()
    running.server.should_exit = True
    await asyncio.wait_for(running.serving, 30)
    logging.getLogger("hotloop").removeHandler(running.lines)


def _serve(tmp: Path, workers: int, monkeypatch: pytest.MonkeyPatch, test: Any) -> None:
    async def main() -> None:
        running = await _start(tmp, workers, monkeypatch)
        try:
            await test(running)
        finally:
            await _stop(running)
        assert not running.lines.tracebacks(), running.lines.tracebacks()

    asyncio.run(main())


def _is_busy(r: httpx.Response, took: float) -> None:
    """A precise, OpenAI-shaped 503 the client may retry, without internals, within the bound."""
    assert r.status_code == 503, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "server_error" and err["param"] is None, err
    assert err["message"] == "The response store is busy. Please retry shortly.", err
    assert not any(w in r.text for w in INTERNALS), r.text
    assert r.headers.get("retry-after") == "1" and r.headers.get("x-should-retry") == "true", dict(r.headers)
    assert took < BOUND, f"answered after {took:.2f} s (bound {BOUND:.2f} s)"


async def _timed(req: Any) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    try:
        r = await req
    except httpx.ReadTimeout:
        pytest.fail(f"no answer within {CLIENT_TIMEOUT:.0f} s (the bound is {BOUND:.2f} s)")
    return r, time.monotonic() - t0


def _inputs(page: httpx.Response) -> list[str]:
    """The texts of the user messages an ``input_items`` page lists."""
    assert page.status_code == 200, page.text
    return [d["content"][0]["text"] for d in page.json()["data"] if d.get("role") == "user"]


async def _ws_continue(running: Running, previous: str) -> dict[str, Any]:
    async with connect(f"ws://127.0.0.1:{running.port}/v1/responses", open_timeout=10) as ws:
        create = {"type": "response.create", "model": "hotloop-sim", "input": "over ws", "previous_response_id": previous}
        await ws.send(json.dumps(create))
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if event["type"] in ("response.completed", "response.failed", "error"):
                return event  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["IMMEDIATE", "EXCLUSIVE"])
def test_reads_from_the_file_go_on_while_another_process_holds_the_write_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """GET, input_items and previous_response_id (HTTP and WebSocket) of responses only the file
    holds answer at once; the continuations made meanwhile are stored once the lock is released
    (the writer retries them)."""

    async def test(s: Running) -> None:
        first = await s.create("one")
        second = await s.create("two", first)
        await s.settled()
        lock = Lock(s.path, how)
        try:
            got, took = await _timed(s.client.get(f"/v1/responses/{first}"))
            assert got.status_code == 200 and got.json()["id"] == first and took < 1.0, (got.text, took)
            s.app.engine.responses.clear()
            items, took = await _timed(s.client.get(f"/v1/responses/{second}/input_items", params={"order": "asc"}))
            assert items.status_code == 200 and took < 1.0, (items.text, took)
            assert _inputs(items) == ["one", "two"]
            s.app.engine.responses.clear()
            third = await s.create("three", second)  # the parent is read from the file
            s.app.engine.responses.clear()
            event = await _ws_continue(s, second)
            assert event["type"] == "response.completed", event
            over_ws = event["response"]["id"]
        finally:
            lock.release()
        await s.settled()
        assert s.app.persistence.failed == 0
        for rid in (first, second, third, over_ws):
            assert (await s.client.get(f"/v1/responses/{rid}")).status_code == 200, rid
        items = await s.client.get(f"/v1/responses/{over_ws}/input_items", params={"order": "asc"})
        assert _inputs(items) == ["one", "two", "over ws"]

    _serve(tmp_path, 1, monkeypatch, test)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "workers"])
def test_a_delete_locked_out_answers_503_and_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """The DELETE of a response with a stored continuation (it would become a tombstone) while the
    file is locked: a 503 to retry, and the response, its items and its continuation untouched;
    once the lock is gone the same DELETE goes through."""

    async def test(s: Running) -> None:
        first = await s.create("one")
        second = await s.create("two", first)
        await s.settled()
        lock = Lock(s.path)
        try:
            r, took = await _timed(s.client.delete(f"/v1/responses/{first}"))
            _is_busy(r, took)
            s.app.engine.responses.clear()
            assert (await s.client.get(f"/v1/responses/{first}")).status_code == 200  # from the file
        finally:
            lock.release()
        s.app.engine.responses.clear()
        assert (await s.client.get(f"/v1/responses/{first}")).status_code == 200
        r = await s.client.delete(f"/v1/responses/{first}")
        assert r.status_code == 200 and r.json() == {"id": first, "object": "response", "deleted": True}, r.text
        assert (await s.client.get(f"/v1/responses/{first}")).status_code == 404
        assert (await s.client.delete(f"/v1/responses/{first}")).status_code == 404
        s.app.engine.responses.clear()
        items = await s.client.get(f"/v1/responses/{second}/input_items", params={"order": "asc"})
        assert _inputs(items) == ["one", "two"]
        assert await s.create("three", second)  # the continuation goes on from the tombstone's items

    _serve(tmp_path, workers, monkeypatch, test)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "workers"])
def test_a_delete_behind_a_locked_out_write_answers_503_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """A DELETE first waits for the writes queued before it (so none resurrects what it deletes);
    while the writer is locked out it retries its batch for up to 60 s. The DELETE waits at most
    the busy timeout for it, then answers 503, not after the writer's retries; the write queued
    meanwhile is stored once the lock is released, and the DELETE goes through then."""

    async def test(s: Running) -> None:
        victim = await s.create("delete me")
        await s.settled()
        lock = Lock(s.path)
        try:
            queued = await s.create("written later")  # answered; its write waits for the lock
            await asyncio.sleep(2 * BUSY)  # the writer has been locked out once at least
            r, took = await _timed(s.client.delete(f"/v1/responses/{victim}"))
            _is_busy(r, took)
        finally:
            lock.release()
        await s.settled()
        assert s.app.persistence.failed == 0
        assert (await s.client.get(f"/v1/responses/{queued}")).status_code == 200
        assert (await s.client.get(f"/v1/responses/{victim}")).status_code == 200  # not half deleted
        assert (await s.client.delete(f"/v1/responses/{victim}")).status_code == 200
        assert (await s.client.get(f"/v1/responses/{victim}")).status_code == 404

    _serve(tmp_path, workers, monkeypatch, test)


def _legacy_ledger_row(path: str) -> None:
    """A usage row in the ledger kept by key name, as an earlier version's process still running
    on the file writes it (moved to the ledger by key id before every listing)."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute(
            "CREATE TABLE IF NOT EXISTS key_usage (day TEXT NOT NULL, model TEXT NOT NULL, key TEXT NOT NULL,"
            " responses INTEGER NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,"
            " cached_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL, flagged INTEGER NOT NULL DEFAULT 0,"
            " PRIMARY KEY (day, model, key))"
        )
        # open mode's tenant's row (any other name's is the admin's alone to list: legacy:NAME)
        db.execute("INSERT INTO key_usage VALUES ('2026-01-01', 'old-model', 'anonymous', 3, 30, 3, 0, 0, 0)")
    finally:
        db.close()


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "workers"])
def test_the_usage_listing_locked_out_answers_503_and_loses_no_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """``GET /hotloop/usage`` moves an earlier version's ledger rows first (``BEGIN IMMEDIATE``),
    and waits for the ledger records still buffered: locked out, a 503 within the bound; after
    the lock, every row is listed once (the moved one, and every response's)."""

    async def test(s: Running) -> None:
        await s.create("counted")
        await s.settled()
        _legacy_ledger_row(s.path)
        lock = Lock(s.path)
        try:
            r, took = await _timed(s.client.get("/hotloop/usage"))
            _is_busy(r, took)
            await s.create("counted while locked")  # its ledger record waits in the buffer
            r, took = await _timed(s.client.get("/hotloop/usage"))  # which it flushes: locked out
            _is_busy(r, took)
        finally:
            lock.release()
        r = await s.client.get("/hotloop/usage")
        assert r.status_code == 200, r.text
        rows = {(row["key_id"], row["model"]): row["responses"] for row in r.json()["data"]}
        assert rows == {("anonymous", "old-model"): 3, ("anonymous", "hotloop-sim"): 2}, rows
        assert s.app.persistence.failed == 0

    _serve(tmp_path, workers, monkeypatch, test)


def test_the_stores_busy_timeout_is_a_documented_constant(tmp_path: Path) -> None:
    """The bound above is the store's busy timeout: ``BUSY_TIMEOUT`` (5 s, sqlite3's default,
    which the store had before), set on its connection."""
    assert store_mod.BUSY_TIMEOUT == 5.0
    store = store_mod.SQLiteStore(tmp_path / "s.sqlite3")
    try:
        with store._lock:
            assert store._db.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
        assert store.busy_timeout == 5.0
    finally:
        store.close()
