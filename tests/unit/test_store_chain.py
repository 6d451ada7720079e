"""Chained storage: parents and own items, loads equal to whole histories, tombstones, pruning,
restarts and files written by the earlier schema (real SQLite in tmp_path, and the memory store)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import sqlite3
from typing import Any

import msgspec
import pytest

from hotloop.state.store import History, MemoryStore, MissingParent, SQLiteStore, StoredResponse


def _item(rid: str, k: int, text: str) -> dict[str, Any]:
    role = "user" if k == 0 else "assistant"
    part = "input_text" if k == 0 else "output_text"
    return {"type": "message", "id": f"msg_{rid}_{k}", "role": role, "content": [{"type": part, "text": text}]}


class Chain:
    """A conversation stored turn by turn, with the whole-history model built beside it."""

    def __init__(self, store: Any, prefix: str = "resp") -> None:
        self.store = store
        self.prefix = prefix
        self.ids: list[str] = []
        self.whole: dict[str, History] = {}  # id -> the history the whole-history model stores
        self._items: list[dict[str, Any]] = []
        self._fps: list[bytes | None] = []
        self._toks: list[int] = []
        self._minted: list[bool] = []  # provenance of the history's items

    def add(self, n_own: int = 2, parent: str | None = "last") -> str:
        rid = f"{self.prefix}_{len(self.ids)}"
        pid = (self.ids[-1] if self.ids else None) if parent == "last" else parent
        if pid in self.whole:
            h = self.whole[pid]
            self._items, self._fps, self._toks = list(h.items), list(h.fps), list(h.toks)
            self._minted = list(h.minted or [False] * len(h.items))
        base = len(self._items) if pid is not None else 0
        own = [_item(rid, k, f"{rid} says {k} " + "x" * (k * 7)) for k in range(n_own)]
        fps: list[bytes | None] = [hashlib.blake2b(f"{rid}/{k}".encode(), digest_size=16).digest() for k in range(n_own)]
        fps[0] = b"\xff" * 15 + bytes([len(self.ids) % 256])  # fingerprints use all 128 bits
        toks = [3 + k + len(self.ids) for k in range(n_own)]
        response = {"id": rid, "object": "response", "output": own[1:]}
        self.store.put(StoredResponse(response, own, fps, toks, base + 1, pid, base, minted=[True] * n_own))
        self._items = self._items[:base] + own
        self._fps = self._fps[:base] + fps
        self._toks = self._toks[:base] + toks
        self._minted = self._minted[:base] + [True] * n_own
        self.whole[rid] = History(
            response, list(self._items), list(self._fps), list(self._toks), base + 1, pid, base, minted=list(self._minted)
        )
        self.ids.append(rid)
        return rid


# The items and bodies tables as earlier builds created them (WITHOUT ROWID; files this build
# creates have rowid tables): a file of theirs keeps its layout and must keep working.
_WITHOUT_ROWID_TABLES = """
CREATE TABLE response_items (response_id TEXT NOT NULL, pos INTEGER NOT NULL, hash BLOB NOT NULL, fp BLOB,
    tokens INTEGER NOT NULL, item_id TEXT, minted INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (response_id, pos)) WITHOUT ROWID;
CREATE TABLE blobs (hash BLOB PRIMARY KEY, body BLOB NOT NULL) WITHOUT ROWID;
"""


def _layout(db: sqlite3.Connection) -> dict[str, bool]:
    """Whether each of the items and bodies tables is WITHOUT ROWID."""
    return {
        name: "WITHOUT ROWID" in sql.upper()
        for name, sql in db.execute("SELECT name, sql FROM sqlite_master WHERE name IN ('response_items', 'blobs')")
    }


@pytest.fixture(params=["sqlite", "sqlite-without-rowid", "memory"])
def store(request, tmp_path):
    if request.param == "memory":
        s: Any = MemoryStore()
    else:
        path = tmp_path / "db" / "h.sqlite3"
        if request.param == "sqlite-without-rowid":
            path.parent.mkdir()
            with contextlib.closing(sqlite3.connect(path)) as db:
                db.executescript(_WITHOUT_ROWID_TABLES)
        s = SQLiteStore(path)
        expected = request.param == "sqlite-without-rowid"
        assert _layout(s._db) == {"response_items": expected, "blobs": expected}
    yield s
    s.close()


def _rows(store: Any) -> tuple[int, int]:
    """(stored responses including tombstones, stored item rows)."""
    if isinstance(store, SQLiteStore):
        (n,) = store._db.execute("SELECT COUNT(*) FROM responses").fetchone()
        (items,) = store._db.execute("SELECT COUNT(*) FROM response_items").fetchone()
        return n, items
    return len(store._nodes), store.items


def _age(store: Any, rid: str, seconds: float) -> None:
    if isinstance(store, SQLiteStore):
        store._db.execute("UPDATE responses SET created_at = created_at - ? WHERE id = ?", (seconds, rid))
    else:
        store._nodes[rid].at -= seconds


def test_a_chain_of_200_loads_its_whole_history(store) -> None:
    c = Chain(store)
    for i in range(200):
        c.add(n_own=1 + i % 3)
    for rid in c.ids:
        assert store.get(rid) == c.whole[rid]
    # storage is proportional to what is new: one item row per own item
    assert _rows(store) == (200, sum(1 + i % 3 for i in range(200)))


def test_loads_equal_the_whole_history_model(store, tmp_path) -> None:
    whole = SQLiteStore(tmp_path / "whole.sqlite3")
    c = Chain(store)
    for i in range(30):
        rid = c.add(n_own=2)
        h = c.whole[rid]
        whole.put(StoredResponse(h.response, h.items, h.fps, h.toks, h.input_len))
    for rid in c.ids:
        got, ref = store.get(rid), whole.get(rid)
        assert got is not None and ref is not None
        assert (got.response, got.items, got.fps, got.toks, got.input_len) == tuple(ref)[:5]
    whole.close()


def test_a_fork_shares_its_parents_items(store) -> None:
    c = Chain(store)
    a, b = c.add(), c.add()
    fork = Chain(store, "fork")
    fork._items, fork._fps, fork._toks = list(c.whole[a].items), list(c.whole[a].fps), list(c.whole[a].toks)
    fork._minted = list(c.whole[a].minted or [])
    f = fork.add(parent=a)
    assert store.get(f) == fork.whole[f] and store.get(b) == c.whole[b]
    assert store.delete(a)
    assert store.get(f) == fork.whole[f] and store.get(b) == c.whole[b]
    assert store.delete(b) and store.get(f) == fork.whole[f]
    assert store.delete(f) and _rows(store) == (0, 0)


def test_put_needs_its_parent(store) -> None:
    c = Chain(store)
    a = c.add()
    own = [_item("resp_x", 0, "x")]
    with pytest.raises(MissingParent):
        store.put(StoredResponse({"id": "resp_x"}, own, [bytes(16)], [1], 3, "resp_unknown", 2))
    with pytest.raises(MissingParent):  # the parent's history is 2 items long, not 5
        store.put(StoredResponse({"id": "resp_x"}, own, [bytes(16)], [1], 6, a, 5))
    assert store.get("resp_x") is None and _rows(store) == (1, 2)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_deletes_in_every_position(store, order) -> None:
    c = Chain(store)
    for _ in range(4):
        c.add()
    gone: set[str] = set()
    for k in order:
        rid = c.ids[k]
        item_id = c.whole[rid].items[-1]["id"]
        assert store.get_item(item_id) is not None
        assert store.delete(rid) is True
        assert store.delete(rid) is False
        gone.add(rid)
        assert store.get(rid) is None and store.get_response(rid) is None
        assert store.get_item(item_id) is None  # a tombstone's items are not referenceable
        for other in c.ids:
            if other not in gone:
                assert store.get(other) == c.whole[other]
        # tombstones are exactly the deleted ancestors of a live response
        live_max = max((i for i, r in enumerate(c.ids) if r not in gone), default=-1)
        assert _rows(store) == (live_max + 1, 2 * (live_max + 1))
    assert _rows(store) == (0, 0)


def test_ttl_expiry_of_a_parent(store) -> None:
    c = Chain(store)
    a, b = c.add(), c.add()
    _age(store, a, 10 * store.ttl_seconds)
    assert store.get(a) is None and store.get_response(a) is None
    assert store.get(b) == c.whole[b]
    if isinstance(store, SQLiteStore):
        assert store.prune() == 1
    else:
        c.add(parent=None)  # the memory store prunes on put
    assert store.get(b) == c.whole[b]
    assert _rows(store)[0] == (2 if isinstance(store, SQLiteStore) else 3)  # a is a tombstone
    assert store.delete(b)
    assert store.get(a) is None and store.delete(a) is False


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_count_pruning_keeps_histories_of_live_responses(kind, tmp_path) -> None:
    s: Any = SQLiteStore(tmp_path / "h.sqlite3", max_responses=3) if kind == "sqlite" else MemoryStore(max_responses=3)
    if kind == "sqlite":
        s.PRUNE_EVERY = 1
    c = Chain(s)
    for _ in range(6):
        c.add()
    other = Chain(s, "other")
    o = other.add()  # a separate conversation: prunes resp_3, a tombstone now
    assert [s.get(r) is not None for r in c.ids] == [False] * 4 + [True] * 2
    assert s.get(o) == other.whole[o]
    for rid in c.ids[4:]:
        assert s.get(rid) == c.whole[rid]
    assert _rows(s) == (7, 14)  # 4 tombstones + 3 live
    # the ids the bounds pruned, once, for the process's cache to drop
    assert s.take_pruned() == c.ids[:4] and s.take_pruned() == []
    assert s.delete(c.ids[5]) and s.get(c.ids[4]) == c.whole[c.ids[4]]
    if kind == "sqlite":  # a restart between the deletes: the bodies still leave with their rows
        s.close()
        s = SQLiteStore(tmp_path / "h.sqlite3", max_responses=3)
    assert s.delete(c.ids[4]) and _rows(s) == (1, 2)  # the tombstones went with the last child
    assert s.take_pruned() == []  # deletes are not prunes (the DELETE evicts its own)
    if kind == "sqlite":  # the item bodies left with the last rows listing them, without a prune
        (blobs,) = s._db.execute("SELECT COUNT(*) FROM blobs").fetchone()
        assert blobs == 2
    s.close()


def test_memory_item_bound_counts_tombstones() -> None:
    m = MemoryStore(max_items=7)
    c = Chain(m)
    for _ in range(3):
        c.add()  # 6 items
    assert m.delete(c.ids[0]) and m.items == 6  # a tombstone still holds its items
    c.add()  # 8 items > 7: the oldest live responses leave until the chain is freed
    assert m.items <= 7


def test_memory_bound_counts_responses_without_items_of_their_own() -> None:
    """A chain of continuations without input of their own (``generate: false``) adds no items:
    each counts as one against ``max_items``, else their tombstones grew without a bound."""
    m = MemoryStore(max_responses=10, max_items=100)
    first = [{"type": "message", "role": "user", "content": "x"}]
    m.put(StoredResponse({"id": "r0"}, first, [None], [1], 1))
    restarts = 0
    for i in range(1, 3000):
        try:
            m.put(StoredResponse({"id": f"r{i}"}, [], [], [], 1, parent_id=f"r{i - 1}", base_len=1))
        except MissingParent:  # the bound took the whole chain (its newest response included)
            restarts += 1
            m.put(StoredResponse({"id": f"r{i}"}, first, [None], [1], 1))
        assert len(m._nodes) <= 101 and m.items + m.empty <= 100 and len(m._live) <= 10
    assert restarts > 0 and m.empty == sum(1 for n in m._nodes.values() if not n.rec.items)
    assert m.get("r2999") is not None


def test_memory_store_is_bounded_by_bytes() -> None:
    """``max_bytes``: 24 responses of 24 MB of instructions each took 880 MB; what the store holds
    is now estimated (strings, and each JSON value as Python holds it) and the oldest responses
    leave past the bound, the newest one kept whatever its size; a chain's tombstones count their
    items, and what leaves is no longer counted."""
    budget = 1_000_000
    m = MemoryStore(max_bytes=budget)
    say = [{"type": "message", "role": "user", "content": "x"}]
    for i in range(20):
        m.put(StoredResponse({"id": f"r{i}", "instructions": "i" * 300_000}, say, [None], [1], 1))
        assert m.bytes <= budget
    assert m.get("r19") is not None and m.get("r0") is None
    assert 2 <= len(m._live) <= 3
    m.put(StoredResponse({"id": "huge", "instructions": "h" * 3 * budget}, say, [None], [1], 1))
    assert m.get("huge") is not None and list(m._live) == ["huge"]  # the newest, alone
    # a chain: its items stay with the tombstones while a descendant lives, and count
    many = [{"type": "x_blob", "data": [{} for _ in range(2000)]}]
    m.put(StoredResponse({"id": "c0"}, many, [None], [1], 1))
    for i in range(1, 12):
        m.put(StoredResponse({"id": f"c{i}"}, many, [None], [1], i + 1, parent_id=f"c{i - 1}", base_len=i))
        assert m.bytes <= budget or list(m._live) == [f"c{i}"]
    assert m.get("c11") is not None
    held = sum(n.response_bytes + n.item_bytes for n in m._nodes.values())
    assert m.bytes == held


def test_reload_after_restart(tmp_path) -> None:
    path = tmp_path / "h.sqlite3"
    s = SQLiteStore(path)
    c = Chain(s)
    for _ in range(10):
        c.add()
    assert s.delete(c.ids[3]) and s.delete(c.ids[9])
    s.close()
    s2 = SQLiteStore(path)
    for i, rid in enumerate(c.ids):
        assert s2.get(rid) == (None if i in (3, 9) else c.whole[rid])
    assert s2.get_response(c.ids[3]) is None
    c.store = s2
    rid = c.add(parent=c.ids[8])
    assert s2.get(rid) == c.whole[rid]
    s2.close()


def test_a_broken_chain_loads_as_not_found(store, caplog) -> None:
    c = Chain(store)
    a, b, d = c.add(), c.add(), c.add()
    if isinstance(store, SQLiteStore):
        store._db.execute("DELETE FROM responses WHERE id = ?", (b,))
    else:
        del store._nodes[b]
    assert store.get(d) is None
    assert "broken" in caplog.text
    assert store.get(a) == c.whole[a]


def test_a_cycle_is_bounded(tmp_path, monkeypatch) -> None:
    import hotloop.state.store as mod

    monkeypatch.setattr(mod, "MAX_CHAIN_DEPTH", 50)
    s = SQLiteStore(tmp_path / "h.sqlite3")
    c = Chain(s)
    a, b = c.add(), c.add()
    s._db.execute("UPDATE responses SET parent_id = ?, base_len = 2 WHERE id = ?", (b, a))
    assert s.get(b) is None and s.get(a) is None
    s.close()


def test_item_references_resolve_to_the_newest_live_response(store) -> None:
    same = "msg_shared"
    for i, text in enumerate(["old", "new"]):
        item = {"type": "message", "id": same, "role": "user", "content": [{"type": "input_text", "text": text}]}
        store.put(StoredResponse({"id": f"resp_{i}"}, [item], [i], [1], 1, minted=[True]))
        if isinstance(store, SQLiteStore):  # the same second: the later write still wins
            store._db.execute("UPDATE responses SET created_at = 1e12")
    assert store.get_item(same)["content"][0]["text"] == "new"
    assert store.delete("resp_1")
    assert store.get_item(same)["content"][0]["text"] == "old"


_OLD_SCHEMA = """
CREATE TABLE responses (id TEXT PRIMARY KEY, created_at REAL NOT NULL, body BLOB NOT NULL, input_len INTEGER NOT NULL);
CREATE INDEX responses_created ON responses(created_at);
CREATE TABLE blobs (hash BLOB PRIMARY KEY, body BLOB NOT NULL) WITHOUT ROWID;
CREATE TABLE response_items (response_id TEXT NOT NULL, pos INTEGER NOT NULL, hash BLOB NOT NULL,
    fp INTEGER NOT NULL, tokens INTEGER NOT NULL{item_id}, PRIMARY KEY (response_id, pos)) WITHOUT ROWID;
CREATE INDEX response_items_hash ON response_items(hash);
CREATE TABLE usage (day TEXT NOT NULL, model TEXT NOT NULL, responses INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL, PRIMARY KEY (day, model));
"""


@pytest.mark.parametrize("with_item_id", [True, False])
def test_files_of_the_earlier_schema_open(tmp_path, with_item_id) -> None:
    import hashlib
    import time

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(_OLD_SCHEMA.format(item_id=", item_id TEXT" if with_item_id else ""))
    items = [_item("resp_old", 0, "hello"), _item("resp_old", 1, "hi there")]
    response = {"id": "resp_old", "object": "response", "output": items[1:]}
    db.execute("INSERT INTO responses VALUES (?,?,?,?)", ("resp_old", time.time(), msgspec.json.encode(response), 1))
    for pos, it in enumerate(items):
        body = msgspec.json.encode(it)
        h = hashlib.blake2b(body, digest_size=16).digest()
        db.execute("INSERT INTO blobs VALUES (?,?)", (h, body))
        cols = "(response_id, pos, hash, fp, tokens" + (", item_id)" if with_item_id else ")")
        vals = (("resp_old", pos, h, -1 - pos, 5 + pos) + ((it["id"],) if with_item_id else ()))
        db.execute(f"INSERT INTO response_items {cols} VALUES ({','.join('?' * len(vals))})", vals)
    db.commit()
    db.close()

    s = SQLiteStore(path)
    # the items table is rebuilt (in this build's layout: a rowid table); the bodies keep theirs
    assert _layout(s._db) == {"response_items": False, "blobs": True}
    # unkeyed 64-bit fingerprints are dropped: loading recomputes them (hotloop.pipeline.post)
    expected = History(response, items, [None, None], [5, 6], 1, None, 0)
    assert s.get("resp_old") == expected
    c = Chain(s, "new")
    c._items, c._fps, c._toks = list(items), list(expected.fps), list(expected.toks)
    c._minted = [False] * len(items)  # rows of the earlier schema count as client-supplied
    child = c.add(parent="resp_old")
    assert s.get(child) == c.whole[child]
    assert s.delete("resp_old") and s.get(child) == c.whole[child]
    s.close()
    s = SQLiteStore(path)  # opens again once migrated
    assert s.get(child) == c.whole[child] and s.get("resp_old") is None
    s.close()


def test_orphan_bodies_of_earlier_versions_are_collected_once(tmp_path) -> None:
    path = tmp_path / "o.sqlite3"
    s = SQLiteStore(path)
    c = Chain(s)
    c.add()
    s._db.execute("INSERT INTO blobs VALUES (?, ?)", (b"\x01" * 16, b"{}"))  # an orphan, as they were left
    s._db.execute("DELETE FROM meta WHERE name = 'orphan_blobs_collected'")  # a file of an earlier version
    s.close()
    s = SQLiteStore(path)
    assert s._db.execute("SELECT COUNT(*) FROM blobs WHERE hash = ?", (b"\x01" * 16,)).fetchone()[0] == 0
    assert s.get(c.ids[0]) == c.whole[c.ids[0]]  # the live response's bodies stay
    s._db.execute("INSERT INTO blobs VALUES (?, ?)", (b"\x02" * 16, b"{}"))
    s.close()
    s = SQLiteStore(path)  # once per file: not swept at every open
    assert s._db.execute("SELECT COUNT(*) FROM blobs WHERE hash = ?", (b"\x02" * 16,)).fetchone()[0] == 1
    s.close()


def test_the_deletions_log_records_many_in_one_call(tmp_path) -> None:
    from hotloop.pipeline.shared import DeletionLog

    SQLiteStore(tmp_path / "d.sqlite3").close()
    log = DeletionLog(str(tmp_path / "d.sqlite3"))
    log.record("resp_a")
    log.record("resp_b", "resp_c")
    assert [r for _, r in log.since(0)] == ["resp_a", "resp_b", "resp_c"] and log.last() == 3
    log.close()


def test_a_tombstone_keeps_its_items_and_nothing_else(store) -> None:
    """A deleted response its children still need kept its whole Response object (instructions,
    metadata, user), its settings blob and its classifier states: a copy of what the user deleted,
    for as long as the conversation lived."""
    secret = "DELETED-INSTRUCTIONS-" + "q" * 1100  # large enough for the settings blob
    items = [_item("a", 0, "hello")]
    store.put(StoredResponse({"id": "a", "object": "response", "instructions": secret, "metadata": {"note": "DELETED-META"}},
                             items, [b"\1" * 16], [3], 1, minted=[True], states={"secrets": {"n": 1}}))
    child = [_item("b", 0, "again")]
    store.put(StoredResponse({"id": "b", "object": "response", "instructions": "its own"}, child, [b"\2" * 16], [4], 2, "a", 1,
                             minted=[True]))
    assert store.delete("a")
    h = store.get("b")
    assert h is not None and [it["id"] for it in h.items] == ["msg_a_0", "msg_b_0"] and h.toks == [3, 4]
    if isinstance(store, SQLiteStore):
        db = store._db
        assert db.execute("SELECT body, classifier_state, settings_hash FROM responses WHERE id = 'a'").fetchone() == (b"{}", None, None)
        everything = b"".join(bytes(r[0]) for r in db.execute("SELECT body FROM blobs")) + b"".join(
            bytes(r[0]) for r in db.execute("SELECT body FROM responses"))
        assert b"DELETED" not in everything
        assert db.execute("PRAGMA secure_delete").fetchone() == (1,)
    else:
        kept = store._nodes["a"].rec
        assert kept.response == {"id": "a"} and kept.states is None and kept.items == items
    assert store.delete("b") and store.get("b") is None



class _Between:
    """A store's connection that, once a statement reading ``table`` has run, runs ``act``
    (another process's commit) before the next statement."""

    def __init__(self, db: sqlite3.Connection, table: str, act: Any) -> None:
        self.db, self.table, self.act, self.armed, self.acted = db, table, act, False, False

    def execute(self, sql: str, *args: Any) -> Any:
        if self.armed and not self.acted:
            self.acted = True
            self.act()
        if self.table in sql:
            self.armed = True
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


def _big(store: SQLiteStore, rid: str) -> None:
    """A response whose instructions are kept in a body of their own (its settings)."""
    big = {"id": rid, "object": "response", "instructions": "i" * 5000, "output": []}
    store.put(StoredResponse(big, [_item(rid, 0, "hi")], [b"s" * 16], [1], 1, minted=[True]))
    assert store._db.execute("SELECT settings_hash FROM responses WHERE id = ?", (rid,)).fetchone()[0]


@pytest.mark.parametrize("which", ["chained", "root", "settings"])
def test_a_load_racing_another_workers_delete_reads_one_state_of_the_file(tmp_path, which: str) -> None:
    """--workers: two processes on one file. A delete the other one commits between a load's
    statements (the response's row, then its settings' body and its items) is wholly after the
    load: never a response with part of its history, or without its settings."""
    path = tmp_path / "h.sqlite3"
    here, there = SQLiteStore(path), SQLiteStore(path)
    try:
        chain = Chain(here)
        for _ in range(3):
            chain.add()
        rid = {"chained": chain.ids[-1], "root": chain.ids[0], "settings": "resp_s"}[which]
        if which == "settings":
            _big(here, rid)
        whole = here.get(rid)
        assert whole is not None and whole.items
        real = here._db
        between = _Between(real, "FROM responses", lambda: there.delete(rid))
        here._db = between  # type: ignore[assignment]
        try:
            got = here.get(rid)
        finally:
            here._db = real
        assert between.acted
        assert got is not None and got.items == whole.items and got.response == whole.response
        assert here.get(rid) is None and here.get_response(rid) is None
    finally:
        here.close()
        there.close()


def test_reading_a_response_racing_another_workers_delete_reads_one_state(tmp_path) -> None:
    path = tmp_path / "h.sqlite3"
    here, there = SQLiteStore(path), SQLiteStore(path)
    try:
        _big(here, "resp_s")
        whole = here.get_response("resp_s")
        assert whole is not None and whole["instructions"] == "i" * 5000
        real = here._db
        # the response's row read, then the other worker deletes it (and its settings' body)
        between = _Between(real, "FROM responses", lambda: there.delete("resp_s"))
        here._db = between  # type: ignore[assignment]
        try:
            got = here.get_response("resp_s")
        finally:
            here._db = real
        assert between.acted and got == whole
        assert here.get_response("resp_s") is None
    finally:
        here.close()
        there.close()
