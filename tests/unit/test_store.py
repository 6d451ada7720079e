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
    assert row == {"day": "1970-01-01", "model": "m", "key": "anonymous", "responses": 3, "input_tokens": 11,
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
    pages = [q for q in queries if q.lstrip().startswith("SELECT") and "FROM key_usage" in q]
    assert len(pages) == 4
    for q in pages:
        plan = " ".join(row[-1] for row in store._db.execute("EXPLAIN QUERY PLAN " + q))
        assert "SEARCH key_usage" in plan and "SCAN key_usage" not in plan, (q, plan)
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
