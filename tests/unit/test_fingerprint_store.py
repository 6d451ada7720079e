"""The fingerprint key (hotloop.state.fpkey) and stored fingerprints: the key file's life cycle and
checks, and SQLite files whose fingerprints were made without this key (the schema before keyed
fingerprints, built here by SQL, or a replaced key file): their fingerprints are dropped once and
recomputed on load, equal to a computation from scratch."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hotloop.pipeline import items as itemlib
from hotloop.pipeline.post import from_record
from hotloop.protocol.request import item_from_dict
from hotloop.state import fpkey
from hotloop.state.store import MemoryStore, SQLiteStore, StoredResponse


@pytest.fixture(autouse=True)
def _process_key() -> Any:
    yield
    itemlib.use_key(fpkey.PROCESS_KEY)  # tests here switch keys; leave the process's in place


# -- the key file ---------------------------------------------------------------------------------


def test_key_file_is_made_once_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "sub" / fpkey.KEY_FILE
    key = fpkey.load_or_create(path)
    assert len(key) == fpkey.KEY_LEN and path.read_bytes() == key
    assert path.stat().st_mode & 0o777 == 0o600
    assert fpkey.load_or_create(path) == key
    assert [p.name for p in path.parent.iterdir()] == [fpkey.KEY_FILE]  # no temporary file left
    assert fpkey.load_or_create(tmp_path / "other.key") != key


def test_concurrent_starters_agree_on_one_key(tmp_path: Path) -> None:
    path = tmp_path / fpkey.KEY_FILE
    keys: list[bytes] = []
    start = threading.Barrier(8)

    def make() -> None:
        start.wait(5)
        keys.append(fpkey.load_or_create(path))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(keys) == 8 and set(keys) == {path.read_bytes()}


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o700 | 0o007])
def test_a_key_others_may_access_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / fpkey.KEY_FILE
    key = fpkey.load_or_create(path)
    os.chmod(path, mode)
    with pytest.raises(fpkey.KeyFileError) as err:
        fpkey.load_or_create(path)
    assert str(path) in str(err.value) and "chmod 600" in str(err.value)
    assert key.hex() not in str(err.value) and repr(key)[2:-1] not in str(err.value)
    assert path.read_bytes() == key  # never replaced or rewritten
    with pytest.raises(fpkey.KeyFileError):
        SQLiteStore(tmp_path / "hotloop.sqlite3")
    assert not (tmp_path / "hotloop.sqlite3").exists()  # refused before the database is touched


@pytest.mark.parametrize("size", [0, 16, 31, 33, 64])
def test_a_key_of_the_wrong_size_is_refused(tmp_path: Path, size: int) -> None:
    path = tmp_path / fpkey.KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"k" * size)
    os.close(fd)
    with pytest.raises(fpkey.KeyFileError, match="delete it"):
        fpkey.load_or_create(path)
    assert path.read_bytes() == b"k" * size


def test_a_key_path_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / fpkey.KEY_FILE).mkdir(mode=0o700)
    with pytest.raises(fpkey.KeyFileError, match="cannot be read"):
        fpkey.load_or_create(tmp_path / fpkey.KEY_FILE)


def test_stores_say_which_key_their_fingerprints_use(tmp_path: Path) -> None:
    assert MemoryStore().fingerprint_key == fpkey.PROCESS_KEY
    assert SQLiteStore(":memory:").fingerprint_key == fpkey.PROCESS_KEY
    s = SQLiteStore(tmp_path / "hotloop.sqlite3")
    assert s.fingerprint_key == (tmp_path / fpkey.KEY_FILE).read_bytes() != fpkey.PROCESS_KEY
    s.close()


# -- stored fingerprints --------------------------------------------------------------------------

# The SQLite schema as it was before keyed fingerprints (every column added since the first
# schema included): fingerprints are unkeyed 64-bit ints in an INTEGER column.
_SCHEMA_BEFORE = """
CREATE TABLE responses (id TEXT PRIMARY KEY, created_at REAL NOT NULL, body BLOB NOT NULL,
    input_len INTEGER NOT NULL, parent_id TEXT, base_len INTEGER NOT NULL DEFAULT 0,
    live INTEGER NOT NULL DEFAULT 1, owner TEXT NOT NULL DEFAULT 'anonymous', classifier_state BLOB);
CREATE INDEX responses_created ON responses(created_at);
CREATE TABLE blobs (hash BLOB PRIMARY KEY, body BLOB NOT NULL) WITHOUT ROWID;
CREATE TABLE response_items (response_id TEXT NOT NULL, pos INTEGER NOT NULL, hash BLOB NOT NULL,
    fp INTEGER NOT NULL, tokens INTEGER NOT NULL, item_id TEXT, minted INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (response_id, pos)) WITHOUT ROWID;
CREATE INDEX response_items_hash ON response_items(hash);
CREATE TABLE key_usage (day TEXT NOT NULL, model TEXT NOT NULL, key TEXT NOT NULL, responses INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL, flagged INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (day, model, key));
CREATE TABLE key_findings (day TEXT NOT NULL, model TEXT NOT NULL, key TEXT NOT NULL, kind TEXT NOT NULL,
    count INTEGER NOT NULL, PRIMARY KEY (day, model, key, kind)) WITHOUT ROWID;
CREATE INDEX response_items_item ON response_items(item_id);
CREATE INDEX responses_parent ON responses(parent_id);
"""


def _msg(i: int, text: str) -> dict[str, Any]:
    role = "user" if i % 2 == 0 else "assistant"
    part = "input_text" if role == "user" else "output_text"
    return {"type": "message", "id": f"msg_{i}", "role": role, "content": [{"type": part, "text": text}]}


ITEMS = [
    _msg(0, "hello"),
    _msg(1, "hi there"),
    {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "f", "arguments": '{"a": [1, 2.5e16]}'},
    {"type": "function_call_output", "id": "fco_3", "call_id": "call_2", "output": "x" * 300},
]


def _old_file(path: Path) -> None:
    """A file of the schema before keyed fingerprints, holding resp_a (items 0-1) and its child
    resp_b (items 2-3, minted)."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")  # as the store left it
    db.executescript(_SCHEMA_BEFORE)
    now = time.time()
    for rid, parent, base, own in (("resp_a", None, 0, ITEMS[:2]), ("resp_b", "resp_a", 2, ITEMS[2:])):
        body = msgspec.json.encode({"id": rid, "object": "response", "output": own[1:]})
        db.execute(
            "INSERT INTO responses(id, created_at, body, input_len, parent_id, base_len) VALUES (?,?,?,?,?,?)",
            (rid, now, body, base + 1, parent, base),
        )
        for k, it in enumerate(own):
            blob = msgspec.json.encode(it)
            h = hashlib.blake2b(blob, digest_size=16).digest()
            db.execute("INSERT OR IGNORE INTO blobs VALUES (?,?)", (h, blob))
            old_fp = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") - (1 << 63)
            db.execute(
                "INSERT INTO response_items(response_id, pos, hash, fp, tokens, item_id, minted) VALUES (?,?,?,?,?,?,?)",
                (rid, base + k, h, old_fp, 10 + base + k, it["id"], int(rid == "resp_b")),
            )
    db.commit()
    db.close()


def _columns(path: Path) -> dict[str, str]:
    with sqlite3.connect(path) as db:
        return {r[1]: r[2] for r in db.execute("PRAGMA table_info(response_items)")}


def _fp_types(path: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(path) as db:
        return [(t, n) for t, n in db.execute("SELECT typeof(fp), COUNT(*) FROM response_items GROUP BY 1 ORDER BY 1")]


def _scratch(items: list[dict[str, Any]]) -> list[bytes]:
    """Fingerprints computed from scratch, under the key in use."""
    return itemlib.analyze([item_from_dict(d) for d in items])[0]


def test_a_file_from_before_keyed_fingerprints_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "hotloop.sqlite3"
    _old_file(path)
    store = SQLiteStore(path)
    itemlib.use_key(store.fingerprint_key)  # what the engine does with its store
    assert _columns(path)["fp"] == "BLOB"
    assert _fp_types(path) == [("null", 4)]
    h = store.get("resp_b")
    assert h is not None
    assert h.items == ITEMS and h.fps == [None] * 4 and h.toks == [10, 11, 12, 13]
    assert (h.parent_id, h.base_len, h.input_len, h.minted) == ("resp_a", 2, 3, [False, False, True, True])
    assert store.get_item("fc_2") == ITEMS[2]  # the item index survived the rebuild
    loaded = from_record(h)
    assert loaded.context.chain.fingerprints() == _scratch(ITEMS)
    assert loaded.context.tokens == 46

    # A response written now keeps its fingerprints; opening again changes nothing.
    own = [_msg(4, "more")]
    fps = _scratch(own)
    store.put(StoredResponse({"id": "resp_c", "object": "response", "output": []}, own, fps, [7], 5, "resp_b", 4))
    store.close()
    store = SQLiteStore(path)
    assert _fp_types(path) == [("blob", 1), ("null", 4)]
    c = store.get("resp_c")
    assert c is not None and c.fps == [None] * 4 + fps
    assert from_record(c).context.chain.fingerprints() == _scratch(ITEMS + own)
    store.close()


def test_a_replaced_key_drops_the_stored_fingerprints(tmp_path: Path) -> None:
    path = tmp_path / "hotloop.sqlite3"
    store = SQLiteStore(path)
    itemlib.use_key(store.fingerprint_key)
    fps = _scratch(ITEMS)
    store.put(StoredResponse({"id": "resp_a", "object": "response", "output": []}, ITEMS, fps, [1, 2, 3, 4], 1))
    store.close()
    assert SQLiteStore(path).get("resp_a").fps == fps  # type: ignore[union-attr]  # same key: kept

    (tmp_path / fpkey.KEY_FILE).unlink()  # the operator deletes the key: a new one is made
    store = SQLiteStore(path)
    assert store.fingerprint_key != fpkey.PROCESS_KEY
    itemlib.use_key(store.fingerprint_key)
    h = store.get("resp_a")
    assert h is not None and h.fps == [None] * 4 and h.toks == [1, 2, 3, 4]
    fresh = _scratch(ITEMS)
    assert fresh != fps
    assert from_record(h).context.chain.fingerprints() == fresh
    store.close()


def test_the_migration_is_one_transaction(tmp_path: Path) -> None:
    path = tmp_path / "hotloop.sqlite3"
    _old_file(path)
    # Another connection holds a write lock: the migration waits its turn, then runs whole.
    other = sqlite3.connect(path, isolation_level=None, timeout=30)
    other.execute("BEGIN IMMEDIATE")
    done: list[SQLiteStore] = []
    opener = threading.Thread(target=lambda: done.append(SQLiteStore(path)))
    opener.start()
    time.sleep(0.3)
    assert _columns(path)["fp"] == "INTEGER"  # nothing half-done is visible meanwhile
    other.execute("COMMIT")
    other.close()
    opener.join(30)
    assert done and _columns(path)["fp"] == "BLOB" and _fp_types(path) == [("null", 4)]
    done[0].close()
