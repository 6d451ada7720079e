"""Ledgers kept by key name (an earlier version's) beside the ledger kept per key id: a process
of the earlier version still running on the store, its rows moved, the model-name cap, cursors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

from hotloop.state.redis_store import RedisStore
from hotloop.state.store import OTHER_MODEL, SQLiteStore, UsageRecord
from tests.services import Redis, redis_server

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "6605ff8"  # the commit before the ledger was kept per key id


def _old_store_module(tmp_path: Path) -> ModuleType:
    """``hotloop.state.store`` as it was before the ledger was kept per key id (the code an older server runs)."""
    try:
        src = subprocess.run(["git", "show", f"{BEFORE}:python/hotloop/state/store.py"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"the repository's history (commit {BEFORE}) is not available")
    path = tmp_path / "old_store.py"
    path.write_bytes(src)
    spec = importlib.util.spec_from_file_location("hotloop.state._old_store", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_an_older_server_on_the_same_file_keeps_its_ledger_when_a_newer_process_opens_it(tmp_path: Path) -> None:
    """The SQLite file of a server of the previous version (still running: a package upgraded in
    place before the restart, or a second server on the file being replaced) is opened by this
    version (``hotloop usage``, the new server): ``_migrate_ledger`` rebuilds ``key_usage`` and
    ``key_findings`` with the primary key (day, model, key_id) and drops the ``key`` column of
    key_findings. From then on every ledger write of the older server fails ("ON CONFLICT clause
    does not match any PRIMARY KEY or UNIQUE constraint": its usage is lost, logged as a store
    write failure) and its ``GET /hotloop/usage`` fails ("no such column: key", a 500). The
    Redis store handles the same rolling upgrade (older replicas keep writing rows by name, moved
    before each listing); the SQLite one does not."""
    old = _old_store_module(tmp_path)
    path = tmp_path / "h.sqlite3"
    running = old.SQLiteStore(path)  # the older server
    try:
        running.record_usage([old.UsageRecord("m", 1, 1, 0, 0, 0.0, "ci", {"jwt": 1})])
        SQLiteStore(path).close()  # this version opens the file once
        running.record_usage([old.UsageRecord("m", 2, 2, 0, 0, 0.0, "ci")])  # (raised when the newer process rebuilt its tables)
        running.usage("ci")  # (raised when the newer process rebuilt its tables)
    finally:
        running.close()
    new = SQLiteStore(path)
    try:
        assert sum(r["responses"] for r in new.usage()) == 2
    finally:
        new.close()


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    with redis_server(tmp_path_factory.mktemp("redis")) as r:
        yield r


def test_rows_an_older_replica_writes_during_an_upgrade_keep_the_days_model_name_cap(redis: Redis) -> None:
    """MAX_LEDGER_MODELS bounds the model names one key counts apart in a day (further names go
    to OTHER_MODEL). Open mode's tenant (and the admin's) keeps its id across the change, so
    rows an older replica writes by name during a rolling upgrade are merged by
    ``migrate_ledger`` into the rows this version writes by id: the merge ignores the cap, and
    the key ends the day with up to twice as many named rows (each version capped apart)."""
    store = RedisStore(redis.url, 3600, prefix="capmerge:")
    try:
        store.max_ledger_models = 1
        now = time.time()
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        store.record_usage([UsageRecord("m-new", 1, 1, 0, 0, now)])  # anonymous, by this version
        # an older replica (same cap) writes another model by name, as its _USAGE script did
        row = f"{day}\tm-old\tanonymous"
        store.r.sadd(store.prefix + "u:rows", row)
        store.r.hset(store.prefix + "u:" + row, mapping={"responses": 1, "input_tokens": 1, "output_tokens": 1})
        store.r.sadd(store.prefix + f"u:names:{day}\tanonymous", "m-old")
        named = [r["model"] for r in store.usage("anonymous") if r["model"] != OTHER_MODEL]
        assert len(named) <= store.max_ledger_models, named
    finally:
        store.close()


def test_a_cursor_from_before_the_change_neither_repeats_nor_skips_rows() -> None:
    """``next_after`` was ``[day, model, key name]`` and is now ``[day, model, key id]``, in the
    same encoding: a client paging ``GET /hotloop/usage`` across the upgrade sends a cursor that
    is accepted and compared with key ids. A key's own listing then repeats the row the cursor
    named (its name sorts before ``key_...``), and the admin's repeats or skips the rest of that
    day and model (``legacy:<name>`` and ``key_...`` against the name). Such a cursor cannot be
    told apart, so it is taken for a row it never named."""
    import base64

    import msgspec

    from hotloop.server.http import _usage_after
    from hotloop.state.store import MemoryStore

    store = MemoryStore()
    store.record_usage([UsageRecord("m1", 1, 1, 0, 0, 0.0, "key_0123abcd", None, "ci"),
                        UsageRecord("m2", 1, 1, 0, 0, 0.0, "key_0123abcd", None, "ci")])
    # the first page (limit=1) of key "ci", served by the previous version: its cursor names "ci"
    old_cursor = base64.urlsafe_b64encode(msgspec.json.encode(["1970-01-01", "m1", "ci"])).rstrip(b"=").decode()
    from hotloop import errors

    try:
        after = _usage_after(old_cursor)
    except errors.InvalidValue:
        return  # refused (400): the client lists again from the start, nothing repeated or skipped
    rest = store.usage("key_0123abcd", None, after, 1000)
    assert [r["model"] for r in rest] == ["m2"]  # m1 was on the page before
