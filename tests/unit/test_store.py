"""Response stores (real SQLite and memory): round trips, retention bounds, usage ledger."""

from __future__ import annotations

import time

import pytest

from hotloop.state.store import MemoryStore, SQLiteStore, StoredResponse, UsageRecord, page_items


def rec(rid: str, n: int = 3, input_len: int = 2) -> StoredResponse:
    items = [{"type": "message", "id": f"msg_{rid}_{i}", "role": "user", "content": [{"type": "input_text", "text": f"t{i}"}]} for i in range(n)]
    return StoredResponse({"id": rid, "object": "response", "output": []}, items, [bytes([255 - i]) * 16 for i in range(n)], [5 + i for i in range(n)], input_len)


@pytest.fixture(params=["sqlite", "memory"])
def store(request, tmp_path):
    s = SQLiteStore(tmp_path / "db" / "h.sqlite3") if request.param == "sqlite" else MemoryStore()
    yield s
    s.close()


def test_round_trip(store) -> None:
    r = rec("resp_a")
    store.put(r)
    got = store.get("resp_a")
    assert got == r
    assert store.get_response("resp_a") == r.response
    assert store.get("resp_b") is None
    assert store.delete("resp_a") is True
    assert store.get("resp_a") is None
    assert store.delete("resp_a") is False


def test_count_bound(tmp_path) -> None:
    s = SQLiteStore(tmp_path / "h.sqlite3", max_responses=5)
    s.PRUNE_EVERY = 1
    for i in range(12):
        s.put(rec(f"resp_{i:02d}"))
    assert s.get("resp_00") is None and s.get("resp_11") is not None
    (n,) = s._db.execute("SELECT COUNT(*) FROM responses").fetchone()
    (blobs,) = s._db.execute("SELECT COUNT(*) FROM blobs").fetchone()
    assert n == 5 and blobs == 5 * 3
    s.close()


def test_ttl(tmp_path) -> None:
    s = SQLiteStore(tmp_path / "h.sqlite3", ttl_seconds=0.05)
    s.put(rec("resp_old"))
    time.sleep(0.1)
    assert s.get("resp_old") is None
    assert s.prune() == 1
    s.close()
    m = MemoryStore(ttl_seconds=0.05)
    m.put(rec("resp_old"))
    time.sleep(0.1)
    assert m.get("resp_old") is None


def test_a_response_past_its_time_to_live_is_not_found_by_delete_either(tmp_path) -> None:
    """GET answered 404 for it, DELETE 200 (until the pruner came): now both say not found, and
    the delete still removes it."""
    for s in (SQLiteStore(tmp_path / "t.sqlite3", ttl_seconds=0.05), MemoryStore(ttl_seconds=0.05)):
        s.put(rec("resp_old"))
        s.put(rec("resp_new"))
        time.sleep(0.1)
        s.ttl_seconds = 60.0  # resp_new is young again; resp_old stays past a 50 ms limit below
        s.put(rec("resp_young"))
        s.ttl_seconds = 0.05
        assert s.get("resp_old") is None and s.delete("resp_old") is False
        assert s.delete("resp_young") is True
        s.ttl_seconds = 60.0
        assert s.get("resp_old") is None  # removed for good, not only hidden
        s.close()


def test_survives_reopen(tmp_path) -> None:
    path = tmp_path / "h.sqlite3"
    s = SQLiteStore(path)
    s.put(rec("resp_keep"))
    s.close()
    s2 = SQLiteStore(path)
    assert s2.get("resp_keep") == rec("resp_keep")
    assert s2._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    s2.close()


def test_usage_ledger(store) -> None:
    store.record_usage([UsageRecord("m", 10, 5, 2, 1, 0.0)])
    store.record_usage([UsageRecord("m", 1, 1, 0, 0, 0.0), UsageRecord("m", 0, 0, 0, 0, 0.0)])
    [row] = store.usage()
    assert row == {"day": "1970-01-01", "model": "m", "key": "anonymous", "key_id": "anonymous", "responses": 3, "input_tokens": 11,
                   "output_tokens": 6, "cached_tokens": 2, "reasoning_tokens": 1, "flagged": 0, "findings": {}}


def test_usage_ledger_counts_flagged_responses_and_findings_per_kind(store) -> None:
    store.record_usage([UsageRecord("m", 1, 1, 0, 0, 0.0, "k", {"jwt": 2, "github_token": 1})])
    store.record_usage([UsageRecord("m", 1, 1, 0, 0, 0.0, "k"), UsageRecord("m", 1, 1, 0, 0, 0.0, "k", {"jwt": 1})])
    store.record_usage([UsageRecord("m", 1, 1, 0, 0, 0.0, "other", {"npm_token": 5})])
    rows = {r["key"]: r for r in store.usage()}
    assert rows["k"]["responses"] == 3 and rows["k"]["flagged"] == 2
    assert rows["k"]["findings"] == {"github_token": 1, "jwt": 3}
    assert rows["other"]["flagged"] == 1 and rows["other"]["findings"] == {"npm_token": 5}
    [mine] = store.usage("k")
    assert mine["findings"] == {"github_token": 1, "jwt": 3}


def test_usage_ledger_pages_in_row_order(store) -> None:
    """``after`` and ``limit`` page the ledger in (day, model, key) order; the pages together
    are the whole listing, each row with its own findings, and ``key``/``since`` still apply."""
    day = 86_400.0
    store.record_usage([
        UsageRecord(m, 1, 1, 0, 0, d * day, k, {"jwt": i + 1} if i % 3 == 0 else None)
        for i, (d, m, k) in enumerate((d, m, k) for d in range(3) for m in ("a", "b") for k in ("k1", "k2"))
    ])
    whole = store.usage()
    assert len(whole) == 12 and [(r["day"], r["model"], r["key"]) for r in whole] == sorted((r["day"], r["model"], r["key"]) for r in whole)
    for limit in (1, 5, 12, 13):
        pages, after = [], None
        while True:
            page = store.usage(None, None, after, limit)
            assert len(page) <= limit
            pages += page
            if len(page) < limit:
                break
            after = (page[-1]["day"], page[-1]["model"], page[-1]["key"])
        assert pages == whole, limit
    assert store.usage("k2", "1970-01-02", ("1970-01-02", "a", "k2"), 2) == [
        r for r in whole if r["key"] == "k2" and r["day"] >= "1970-01-02" and (r["day"], r["model"]) > ("1970-01-02", "a")
    ][:2]
    assert store.usage(None, None, ("1970-01-03", "b", "k2"), 5) == []


def test_a_sqlite_ledger_page_seeks_its_cursor(tmp_path) -> None:
    """A page after a cursor is read from the ledger's (day, model, key) key at the cursor, not
    by scanning every row before it: the query SQLite plans for each page searches, never scans."""
    store = SQLiteStore(str(tmp_path / "s.db"))
    store.record_usage([UsageRecord(f"m{i}", 1, 1, 0, 0, 0.0, "k", None) for i in range(20)])
    queries: list[str] = []
    store._db.set_trace_callback(queries.append)
    for key, since in ((None, None), ("k", None), (None, "1970-01-01"), ("k", "1970-01-01")):
        assert [r["model"] for r in store.usage(key, since, ("1970-01-01", "m3", "k"), 2)] == ["m4", "m5"]
    store._db.set_trace_callback(None)
    pages = [q for q in queries if q.lstrip().startswith("SELECT") and "FROM ledger_usage" in q]
    assert len(pages) == 4
    for q in pages:
        plan = " ".join(row[-1] for row in store._db.execute("EXPLAIN QUERY PLAN " + q))
        assert "SEARCH ledger_usage" in plan and "SCAN ledger_usage" not in plan, (q, plan)
    store.close()


def test_a_keys_ledger_counts_at_most_its_model_names_a_day(store) -> None:
    """A model name is a client's string: past ``max_ledger_models`` names of one key in one
    day, further names count under "(other)"; names already counted keep their rows, other keys
    and other days count their own, and findings follow the row they are counted in."""
    from hotloop.state.store import OTHER_MODEL

    store.max_ledger_models = 3
    day = 86_400.0
    store.record_usage([UsageRecord(f"m{i}", 1, 1, 0, 0, 0.0, "k") for i in range(3)])
    # one write: two new names past the bound, an old one, and one for another key
    store.record_usage([
        UsageRecord("m3", 2, 1, 0, 0, 0.0, "k", {"jwt": 1}), UsageRecord("m4", 3, 1, 0, 0, 0.0, "k"),
        UsageRecord("m0", 5, 1, 0, 0, 0.0, "k"), UsageRecord("m4", 7, 1, 0, 0, 0.0, "k2"),
    ])
    store.record_usage([UsageRecord("m5", 10, 1, 0, 0, 0.0, "k"), UsageRecord("m6", 1, 1, 0, 0, day, "k")])
    rows = {(r["day"], r["model"], r["key"]): r for r in store.usage()}
    d0, d1 = "1970-01-01", "1970-01-02"
    assert set(rows) == {
        (d0, "m0", "k"), (d0, "m1", "k"), (d0, "m2", "k"), (d0, OTHER_MODEL, "k"), (d0, "m4", "k2"), (d1, "m6", "k"),
    }
    other = rows[d0, OTHER_MODEL, "k"]
    assert other["responses"] == 3 and other["input_tokens"] == 2 + 3 + 10
    assert other["flagged"] == 1 and other["findings"] == {"jwt": 1}
    assert rows[d0, "m0", "k"]["input_tokens"] == 1 + 5


# -- the ledger is kept per key id ------------------------------------------------------------------


def _row(model: str, key: str, key_id: str, responses: int, input_tokens: int, output_tokens: int,
         flagged: int = 0, findings: dict[str, int] | None = None, day: str = "1970-01-01") -> dict:
    return {"day": day, "model": model, "key": key, "key_id": key_id, "responses": responses, "input_tokens": input_tokens,
            "output_tokens": output_tokens, "cached_tokens": 0, "reasoning_tokens": 0, "flagged": flagged,
            "findings": findings or {}}


def test_a_key_given_a_revoked_keys_name_has_ledger_rows_of_its_own(store) -> None:
    """Rows are per key id, with the key's name shown beside it: a key given a revoked key's
    name neither sees nor adds to the revoked key's rows (its listing, its pages, its count of
    model names a day), and the name is no filter."""
    from hotloop.state.store import OTHER_MODEL

    store.max_ledger_models = 1
    store.record_usage([
        UsageRecord("m", 10, 5, 0, 0, 0.0, "key_old", {"jwt": 1}, "ci"),
        UsageRecord("m2", 1, 1, 0, 0, 0.0, "key_old", None, "ci"),  # its second name: (other)
    ])
    store.record_usage([UsageRecord("m", 1, 2, 0, 0, 0.0, "key_new", None, "ci")])  # its own first name
    store.record_usage([UsageRecord("m3", 3, 4, 0, 0, 0.0, "key_new", None, "ci")])
    new = [_row(OTHER_MODEL, "ci", "key_new", 1, 3, 4), _row("m", "ci", "key_new", 1, 1, 2)]
    old = [_row(OTHER_MODEL, "ci", "key_old", 1, 1, 1), _row("m", "ci", "key_old", 1, 10, 5, 1, {"jwt": 1})]
    assert store.usage("key_new") == new
    assert store.usage("key_old") == old
    whole = store.usage()
    assert whole == [new[0], old[0], new[1], old[1]]  # in (day, model, key id) order
    pages, after = [], None
    while page := store.usage(None, None, after, 1):
        pages += page
        after = (page[-1]["day"], page[-1]["model"], page[-1]["key_id"])
    assert pages == whole
    assert store.usage("key_new", None, ("1970-01-01", OTHER_MODEL, "key_new"), 5) == new[1:]
    assert store.usage("ci") == []


# The ledger tables as they were before they recorded key ids (keyed by key name), and the
# ledger before that (no key at all).
_LEDGER_BY_NAME = """
CREATE TABLE key_usage (day TEXT NOT NULL, model TEXT NOT NULL, key TEXT NOT NULL, responses INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL, flagged INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (day, model, key));
CREATE TABLE key_findings (day TEXT NOT NULL, model TEXT NOT NULL, key TEXT NOT NULL, kind TEXT NOT NULL,
    count INTEGER NOT NULL, PRIMARY KEY (day, model, key, kind)) WITHOUT ROWID;
CREATE INDEX key_usage_key ON key_usage(key, day);
CREATE TABLE usage (day TEXT NOT NULL, model TEXT NOT NULL, responses INTEGER NOT NULL, input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL,
    PRIMARY KEY (day, model));
INSERT INTO key_usage VALUES ('1970-01-01', 'm', 'ci', 2, 20, 10, 0, 0, 1), ('1970-01-01', 'm', 'anonymous', 1, 5, 5, 0, 0, 0),
    ('1970-01-01', 'm', 'admin', 1, 3, 3, 0, 0, 0), ('1970-01-02', 'm', 'ci', 1, 7, 7, 0, 0, 0);
INSERT INTO key_findings VALUES ('1970-01-01', 'm', 'ci', 'jwt', 2), ('1970-01-01', 'm', 'ci', 'aws_key', 1);
INSERT INTO usage VALUES ('1969-12-31', 'm', 4, 40, 40, 0, 0);
"""


def _ledger_by_name(path) -> None:
    import sqlite3

    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(_LEDGER_BY_NAME)
    db.commit()
    db.close()


def test_a_ledger_kept_by_key_name_is_migrated_to_key_ids(tmp_path) -> None:
    """A file whose ledger was kept per key name opens: its rows cannot say which key of a name
    made them, so each is kept under the legacy id of its name (seen by the admin, by no key),
    except open mode's and the admin's, whose id is their name; findings follow their rows, a
    key given the name later counts apart, and opening again changes nothing."""
    import sqlite3

    from hotloop.state.store import SELF_NAMED_TENANTS
    from hotloop.tenants import ADMIN, ANONYMOUS
    from hotloop.tenants.keys import RESERVED_NAMES

    # the names kept under their own id are exactly the tenants whose id is their name
    assert {(t.id, t.name) for t in (ADMIN, ANONYMOUS)} == {(n, n) for n in SELF_NAMED_TENANTS} and set(SELF_NAMED_TENANTS) == RESERVED_NAMES
    path = tmp_path / "h.sqlite3"
    _ledger_by_name(path)
    store = SQLiteStore(path)
    legacy = [
        _row("m", "anonymous", "anonymous", 4, 40, 40, day="1969-12-31"),  # the ledger before key names
        _row("m", "admin", "admin", 1, 3, 3),
        _row("m", "anonymous", "anonymous", 1, 5, 5),
        _row("m", "ci", "legacy:ci", 2, 20, 10, 1, {"aws_key": 1, "jwt": 2}),
        _row("m", "ci", "legacy:ci", 1, 7, 7, day="1970-01-02"),
    ]
    assert store.usage() == legacy
    assert store.usage("legacy:ci") == legacy[3:] and store.usage("ci") == []
    store.record_usage([UsageRecord("m", 1, 1, 0, 0, 0.0, "key_new", None, "ci"), UsageRecord("m", 1, 1, 0, 0, 0.0)])
    assert store.usage("key_new") == [_row("m", "ci", "key_new", 1, 1, 1)]
    assert store.usage("anonymous", "1970-01-01") == [_row("m", "anonymous", "anonymous", 2, 6, 6)]
    assert store.usage("legacy:ci") == legacy[3:]
    whole = store.usage()
    store.close()
    with sqlite3.connect(path) as db:
        assert {r[1] for r in db.execute("PRAGMA table_info(ledger_findings)")} >= {"key_id"}
        indexes = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'ledger_usage'")}
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        # the tables by name stay (a process of an earlier version may still write them), emptied
        assert db.execute("SELECT COUNT(*) FROM key_usage").fetchone()[0] == 0
    assert "ledger_usage_key_id" in indexes
    assert "usage" not in tables
    again = SQLiteStore(path)
    assert again.usage() == whole
    again.close()


def test_two_processes_opening_a_ledger_kept_by_key_name_migrate_it_once(tmp_path) -> None:
    import threading

    path = tmp_path / "h.sqlite3"
    _ledger_by_name(path)
    stores: list[SQLiteStore] = []
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            stores.append(SQLiteStore(path))
        except BaseException as exc:  # pragma: no cover - the failure is asserted below
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [(r["key_id"], r["responses"]) for r in stores[0].usage()] == [
        ("anonymous", 4), ("admin", 1), ("anonymous", 1), ("legacy:ci", 2), ("legacy:ci", 1),
    ]
    for s in stores:
        s.close()


def test_page_items() -> None:
    items = [{"id": f"i{k}"} for k in range(5)]
    assert page_items(items, None, 2, "asc") == ([{"id": "i0"}, {"id": "i1"}], True)
    assert page_items(items, "i1", 10, "asc") == ([{"id": "i2"}, {"id": "i3"}, {"id": "i4"}], False)
    assert page_items(items, None, 2, "desc") == ([{"id": "i4"}, {"id": "i3"}], True)
    assert page_items(items, "nope", 2, "asc") is None


def test_memory_store_item_bound() -> None:
    m = MemoryStore(max_items=10)
    for i in range(5):
        m.put(rec(f"resp_{i}", n=3))
    assert m.items <= 10 and m.get("resp_0") is None and m.get("resp_4") is not None
    assert m.delete("resp_4") and m.items == 3 * len(m._live)


def test_memory_item_index_survives_deleting_a_continuation() -> None:
    m = MemoryStore()
    a = rec("resp_a")
    a = a._replace(minted=[True] * len(a.items))
    b = StoredResponse(
        {"id": "resp_b", "object": "response", "output": []}, a.items + a.items[:1], a.fps + a.fps[:1], a.toks + a.toks[:1], 3,
        minted=[True] * (len(a.items) + 1),
    )
    m.put(a)
    m.put(b)
    assert m.delete("resp_b")
    assert m.get_item(a.items[0]["id"]) == a.items[0]
    assert m.delete("resp_a") and m.get_item(a.items[0]["id"]) is None


def test_two_processes_writing_one_sqlite_file_never_lose_a_batch(tmp_path) -> None:
    """Two stores on one file (two ``--workers``): a batch that has read before the other
    committed must wait for its turn to write, not fail (a deferred transaction's stale
    snapshot failed every write of the batch with "database is locked")."""
    import threading

    path = tmp_path / "shared.sqlite3"
    a, b = SQLiteStore(path), SQLiteStore(path)
    a.put(rec("resp_parent"))
    other_done = threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            b.put(rec("resp_other"))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        other_done.set()

    with a.batch():
        assert a.get_response("resp_parent") is not None  # a read inside the batch
        t = threading.Thread(target=other)
        t.start()
        other_done.wait(0.5)  # the other process commits now if nothing holds the write lock
        a.put(rec("resp_mine"))
    t.join(10)
    assert not errors
    for rid in ("resp_parent", "resp_other", "resp_mine"):
        assert a.get_response(rid) is not None and b.get_response(rid) is not None
    a.close()
    b.close()


def test_memory_ledger_keeps_at_most_its_rows_dropping_the_oldest_day() -> None:
    """A row per (day, model, key name), and the model is the client's string: the memory
    store's ledger drops its oldest day's rows at its bound instead of growing."""
    m = MemoryStore()
    m.max_ledger_rows = 10
    day = 86_400.0
    m.record_usage([UsageRecord(f"old-{i}", 1, 1, 0, 0, 0.0) for i in range(6)])  # day 1
    m.record_usage([UsageRecord(f"new-{i}", 1, 1, 0, 0, day) for i in range(4)])  # day 2: 10 rows
    assert len(m.usage()) == 10
    m.record_usage([UsageRecord("new-0", 1, 1, 0, 0, day)])  # an existing row: nothing drops
    assert len(m.usage()) == 10
    m.record_usage([UsageRecord("newer", 1, 1, 0, 0, day)])  # a new row: day 1 leaves
    rows = m.usage()
    assert len(rows) == 5 and {r["model"] for r in rows} == {"new-0", "new-1", "new-2", "new-3", "newer"}
    assert next(r for r in rows if r["model"] == "new-0")["responses"] == 2
    # all of them today's: a new model's usage is counted, under "(other)", nothing is dropped
    m.record_usage([UsageRecord(f"more-{i}", 2, 1, 0, 0, day) for i in range(8)])
    rows = {r["model"]: r for r in m.usage()}
    assert len(rows) == 11 and "new-0" in rows and rows["(other)"]["input_tokens"] == 2 * 3  # more-5..7
