"""``--store-sync full``: the terminal event waits for the write, and a write that fails turns the
response into ``response.failed`` (the client is never told a response completed that the server
could not keep); ``--store-sync normal`` reports completed at once."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import uvloop

from hotloop.config import Config
from hotloop.server.runner import make_app


def _events(raw: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]


async def _run(tmp: Path, sync: str, fail: bool, what: str = "put") -> tuple[list[dict[str, Any]], int, int, dict[str, Any]]:
    """A streamed response, then a GET of it and a continuation of it; with ``fail``, the
    store's ``what`` (``put``: the response's write, ``record_usage``: its ledger entry's) fails."""
    app = make_app(Config(store="sqlite", data_dir=str(tmp / sync), sim_rate=0, store_sync=sync))
    await app.startup()
    store = app.persistence.store
    put = getattr(store, what)

    def broken(rec: Any) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    if fail:
        setattr(store, what, broken)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"model": "hotloop-sim", "input": "hi", "stream": True, "metadata": {"sim": "tokens:5"}}
            r = await c.post("/v1/responses", json=body)
            events = _events(r.text)
            rid = events[-1]["response"]["id"]
            await app.persistence.flush()
            got = await c.get(f"/v1/responses/{rid}")
            cont = await c.post("/v1/responses", json={"model": "hotloop-sim", "input": "next", "previous_response_id": rid})
            setattr(store, what, put)
            return events, got.status_code, cont.status_code, cont.json()
    finally:
        await app.shutdown()


def test_a_failed_write_under_full_sync_fails_the_response(tmp_path: Path) -> None:
    events, got, cont, body = uvloop.run(_run(tmp_path, "full", fail=True))
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["error", "response.failed"], kinds
    assert "response.completed" not in kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # no gap where it was
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["error"]["message"] == "The response could not be stored."
    assert "disk" not in json.dumps(events)  # nothing internal reaches the client
    # the response is nowhere: not readable, not continuable (the caches dropped it too)
    assert got == 404
    assert cont == 400 and body["error"]["code"] == "previous_response_not_found"


def test_a_failed_ledger_write_under_full_sync_leaves_no_response_behind(tmp_path: Path) -> None:
    """The response's write succeeded, its ledger entry's failed: the client is told it failed,
    so it is not kept either (it stayed stored as completed: readable and continuable)."""
    events, got, cont, body = uvloop.run(_run(tmp_path, "full", fail=True, what="record_usage"))
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["error", "response.failed"], kinds
    assert events[-1]["response"]["error"]["message"] == "The response could not be stored."
    assert got == 404
    assert cont == 400 and body["error"]["code"] == "previous_response_not_found"


def test_full_sync_completes_when_the_write_succeeds(tmp_path: Path) -> None:
    events, got, cont, _ = uvloop.run(_run(tmp_path, "full", fail=False))
    assert events[-1]["type"] == "response.completed"
    assert got == 200 and cont == 200


def test_normal_sync_reports_completed_before_the_write(tmp_path: Path) -> None:
    events, _, _, _ = uvloop.run(_run(tmp_path, "normal", fail=True))
    assert events[-1]["type"] == "response.completed"  # sent before the write (which failed)


def test_a_failed_write_under_full_sync_answers_a_json_request_500_not_502(tmp_path: Path) -> None:
    """The server, not the backend, failed it: a server_error, not a bad gateway."""

    async def main() -> tuple[int, dict[str, Any]]:
        app = make_app(Config(store="sqlite", data_dir=str(tmp_path), sim_rate=0, store_sync="full"))
        await app.startup()

        def broken(rec: Any) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        app.persistence.store.put = broken  # type: ignore[method-assign]
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/responses", json={"model": "hotloop-sim", "input": "hi", "metadata": {"sim": "tokens:5"}})
                return r.status_code, r.json()
        finally:
            await app.shutdown()

    status, body = uvloop.run(main())
    assert status == 500
    assert body["error"]["type"] == "server_error" and body["error"]["message"] == "The response could not be stored."
    assert "disk" not in json.dumps(body)
