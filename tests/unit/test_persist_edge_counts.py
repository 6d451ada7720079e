"""``hotloop_store_written`` and ``hotloop_store_failed`` count one unit, responses (a stored
response's record); the usage ledger's records are counted apart, in records
(``hotloop_store_usage_written``, ``hotloop_store_usage_failed``), so that no ratio mixes a
response with a ledger batch of hundreds of records. ``/hotloop/stats`` says the same as
``/metrics``. Real SQLite: a connection made read-only (``PRAGMA query_only``) fails every write
with SQLITE_READONLY, as a file whose permissions changed would."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from hotloop.config import Config
from hotloop.pipeline.post import Persistence
from hotloop.server.runner import make_app
from hotloop.state.store import SQLiteStore
from tests.unit.test_persist_edge_close import _rec
from tests.unit.test_persistence import _entry, _used


def _read_only(store: SQLiteStore, on: bool) -> None:
    with store._lock:
        store._db.execute(f"PRAGMA query_only = {'ON' if on else 'OFF'}")


def test_written_and_failed_count_responses_and_the_ledger_counts_records(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "h.sqlite3")

    async def main() -> Persistence:
        p = Persistence(store, commit_delay=0.0)
        _read_only(store, True)
        for i in range(3):
            await p.submit(_used(_entry(f"resp_f{i}")), "key_a")
        p.charge(_rec("key_a"))
        p.charge(_rec("key_a"))
        await p.flush()
        # 3 responses not stored; their 3 ledger records and the 2 charges (one ledger batch) not recorded
        assert (p.written, p.failed) == (0, 3), (p.written, p.failed)
        assert (p.usage_written, p.usage_failed) == (0, 5)
        _read_only(store, False)
        for i in range(2):
            await p.submit(_used(_entry(f"resp_ok{i}")), "key_a")
        await p.flush()
        assert (p.written, p.failed) == (2, 3)
        assert (p.usage_written, p.usage_failed) == (2, 5)
        await p.close()
        return p

    asyncio.run(main())


def _samples(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("# HELP hotloop_store_"):
            name, helptext = line[len("# HELP ") :].split(" ", 1)
            out["help:" + name] = helptext
        elif line.startswith("hotloop_store_") and " " in line:
            name, value = line.split(" ", 1)
            out[name] = value
    return out


def test_metrics_and_stats_count_the_same_units(tmp_path: Path) -> None:
    app = make_app(Config(store="sqlite", data_dir=str(tmp_path), sim_rate=0))

    async def main() -> tuple[dict[str, str], dict[str, Any]]:
        await app.startup()
        try:
            store: Any = app.persistence.store
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:  # type: ignore[arg-type]
                ok = await c.post("/v1/responses", json={"model": "hotloop-sim", "input": "hi", "metadata": {"sim": "tokens:3"}})
                assert ok.status_code == 200, ok.text
                await app.persistence.flush()
                _read_only(store, True)
                for _ in range(2):
                    r = await c.post("/v1/responses", json={"model": "hotloop-sim", "input": "hi", "metadata": {"sim": "tokens:3"}})
                    assert r.status_code == 200, r.text
                await app.persistence.flush()
                _read_only(store, False)
                metrics = (await c.get("/metrics")).text
                stats = json.loads((await c.get("/hotloop/stats")).text)
            return _samples(metrics), stats
        finally:
            await app.shutdown()

    m, stats = asyncio.run(main())
    # the first response and its ledger record written; two responses and their two records not
    assert (m["hotloop_store_written_total"], m["hotloop_store_failed_total"]) == ("1.0", "2.0"), m
    assert (m["hotloop_store_usage_written_total"], m["hotloop_store_usage_failed_total"]) == ("1.0", "2.0"), m
    assert "response" in m["help:hotloop_store_written_total"].lower() and "response" in m["help:hotloop_store_failed_total"].lower(), m
    assert "record" in m["help:hotloop_store_usage_failed_total"].lower(), m
    assert (stats["store"]["written"], stats["store"]["failed"]) == (1, 2), stats["store"]
