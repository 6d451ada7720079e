"""SharedPersistence.close (``--workers``, Redis) writes out what responses ending during its flush
submit or charge (Persistence._drain), and stops an idle writer instead of cancelling it (see
Persistence.close, "Late records"). Needs /tmp/w/patches/persist-edge-shared-close-drain.patch."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from tests.unit.test_persist_edge_close import _rec
from tests.unit.test_persistence import _entry, _used


def test_what_the_writer_left_when_a_subclass_stopped_it_is_written_by_close(tmp_path: Path) -> None:
    """SharedPersistence (``--workers``, Redis) flushes and stops the writer itself, then calls
    Persistence.close: what came after its flush (submissions, a charge) is still queued then, and
    is written before the store's close, one job at a time on a store without transactions."""
    from hotloop.pipeline.shared import SharedPersistence
    from tests.unit.test_persistence import GatedStore

    store = GatedStore()
    gate = threading.Event()

    async def main() -> SharedPersistence:
        p = SharedPersistence(store, commit_delay=0.0)
        store.gates["resp_slow"] = gate
        await p.submit(_entry("resp_slow"))
        assert await asyncio.to_thread(store.entered.setdefault("resp_slow", threading.Event()).wait, 10)
        closing = asyncio.ensure_future(p.close(timeout=10))
        await asyncio.sleep(0.05)
        for i in range(3):
            await asyncio.wait_for(p.submit(_used(_entry(f"resp_during{i}")), "key_during"), 5)
        p.charge(_rec("key_during"))
        gate.set()
        await asyncio.wait_for(closing, 15)
        return p

    p = asyncio.run(main())
    stored = {f"resp_during{i}" for i in range(3) if store.get_response(f"resp_during{i}") is not None}
    assert stored == {f"resp_during{i}" for i in range(3)}, stored
    assert sum(r["responses"] for r in store.usage("key_during")) == 4
    assert p.failed == 0 and p.usage_failed == 0 and p.usage_written == 4
