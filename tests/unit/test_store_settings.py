"""The SQLite store keeps a response's large instructions and tools once, as a blob its rows name
(``SETTINGS_BLOB_MIN``): loads give back the very response, in its key order; the blob leaves
with the last response naming it (deletes, prunes, replacements, restarts)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import msgspec

from hotloop.protocol.request import CheckedTools, check_tools, share_checked
from hotloop.state.store import SETTINGS_BLOB_MIN, SQLiteStore, StoredResponse

INSTRUCTIONS = "You are a coding agent. Read, change and test the code; explain what you did. " * 40  # 3.2 KB
TOOLS = [
    {"type": "function", "name": f"tool_{i}", "description": "Runs one kind of work. " * 8, "parameters": {"type": "object"}}
    for i in range(4)
]


def _response(rid: str, instructions: Any = INSTRUCTIONS, tools: Any = TOOLS) -> dict[str, Any]:
    # the keys in the order a response object has them (instructions and tools between others)
    return {
        "id": rid, "object": "response", "created_at": 1, "status": "completed", "instructions": instructions,
        "model": "m", "output": [{"type": "message", "id": f"msg_{rid}", "role": "assistant", "content": []}],
        "tools": tools, "usage": {"input_tokens": 3},
    }


def _put(s: SQLiteStore, rid: str, parent: str | None = None, base: int = 0, response: dict[str, Any] | None = None,
         items: list[dict[str, Any]] | None = None) -> StoredResponse:
    if items is None:
        items = [{"type": "message", "id": f"in_{rid}", "role": "user", "content": [{"type": "input_text", "text": rid}]}]
    rec = StoredResponse(
        response or _response(rid), items, [bytes([len(rid)]) * 16] * len(items), [7] * len(items), base + 1, parent, base
    )
    s.put(rec)
    return rec


def _count(s: SQLiteStore, sql: str) -> int:
    (n,) = s._db.execute(sql).fetchone()
    return int(n)


def _settings_blobs(s: SQLiteStore) -> int:
    return _count(s, "SELECT COUNT(*) FROM blobs WHERE hash IN (SELECT settings_hash FROM responses)")


def test_large_settings_are_stored_once_and_load_as_they_were(tmp_path) -> None:
    s = SQLiteStore(tmp_path / "h.sqlite3")
    prev = None
    for i in range(20):
        rid = f"resp_{i:02d}"
        _put(s, rid, prev, i)
        prev = rid
    for rid in ("resp_00", "resp_13", "resp_19"):
        got = s.get_response(rid)
        assert got == _response(rid) and list(got) == list(_response(rid))  # equal, keys in their order
        assert json.dumps(got) == json.dumps(_response(rid))
        h = s.get(rid)
        assert h is not None and h.response == _response(rid) and list(h.response) == list(_response(rid))
    assert _settings_blobs(s) == 1  # one blob for twenty responses
    assert _count(s, "SELECT COUNT(DISTINCT settings_hash) FROM responses") == 1
    # the bodies hold nulls in their places, not 4 KB each
    assert _count(s, "SELECT MAX(LENGTH(body)) FROM responses") < 400
    stored = msgspec.json.decode(s._db.execute("SELECT body FROM responses WHERE id = 'resp_05'").fetchone()[0])
    assert stored["instructions"] is None and stored["tools"] is None and list(stored) == list(_response("resp_05"))
    s.close()
    s = SQLiteStore(tmp_path / "h.sqlite3")  # a restart
    assert s.get_response("resp_07") == _response("resp_07")
    s.close()


def test_small_or_absent_settings_stay_in_the_body(tmp_path) -> None:
    s = SQLiteStore(tmp_path / "h.sqlite3")
    small = _response("resp_a", instructions="Be brief.", tools=[{"type": "function", "name": "f"}])
    assert len(json.dumps({"instructions": small["instructions"], "tools": small["tools"]})) < SETTINGS_BLOB_MIN
    _put(s, "resp_a", response=small)
    _put(s, "resp_b", response=_response("resp_b", instructions=None, tools=[]))
    _put(s, "resp_c", response={"id": "resp_c", "object": "response", "output": []})  # no such keys at all
    assert _count(s, "SELECT COUNT(*) FROM responses WHERE settings_hash IS NOT NULL") == 0
    assert s.get_response("resp_a") == small
    assert s.get_response("resp_b") == _response("resp_b", instructions=None, tools=[])
    assert s.get_response("resp_c") == {"id": "resp_c", "object": "response", "output": []}
    # only one of the two large: the blob holds that one, the other stays as it is
    big_tools = _response("resp_d", instructions=None)
    _put(s, "resp_d", response=big_tools)
    assert s.get_response("resp_d") == big_tools
    assert _settings_blobs(s) == 1
    s.close()


def test_the_settings_blob_leaves_with_the_last_response_naming_it(tmp_path) -> None:
    s = SQLiteStore(tmp_path / "h.sqlite3")
    other = _response("x", instructions="Another agent. " * 100)
    _put(s, "resp_a")
    _put(s, "resp_b", "resp_a", 1)
    _put(s, "resp_c", response=dict(other, id="resp_c"))
    assert _settings_blobs(s) == 2
    assert s.delete("resp_a")  # a tombstone: its child still loads it
    assert s.get("resp_b") is not None and s.get("resp_b").response == _response("resp_b")
    assert _settings_blobs(s) == 2
    assert s.delete("resp_b")  # the chain leaves: its settings with it
    assert _settings_blobs(s) == 1 and s.get_response("resp_c") == dict(other, id="resp_c")
    assert s.delete("resp_c")
    assert _count(s, "SELECT COUNT(*) FROM blobs") == 0  # nothing left behind
    s.close()


def test_replacing_a_response_drops_settings_no_one_names(tmp_path) -> None:
    s = SQLiteStore(tmp_path / "h.sqlite3")
    _put(s, "resp_a")
    _put(s, "resp_a")  # the same again: the blob stays
    assert _settings_blobs(s) == 1 and s.get_response("resp_a") == _response("resp_a")
    changed = _response("resp_a", instructions="Changed. " * 200)
    _put(s, "resp_a", response=changed)
    assert s.get_response("resp_a") == changed
    # the first settings' blob is gone; only the item bodies and the new settings remain
    assert _count(s, "SELECT COUNT(*) FROM blobs") == 1 + 1
    _put(s, "resp_a", response=_response("resp_a", instructions="short", tools=[]))
    assert _count(s, "SELECT COUNT(*) FROM blobs") == 1
    s.close()


def test_an_item_with_the_same_bytes_does_not_take_the_settings_blob_with_it(tmp_path) -> None:
    # content addressing: an item whose JSON is byte for byte a settings blob shares its row;
    # deleting the item's response must leave it for the response that names it as settings
    s = SQLiteStore(tmp_path / "h.sqlite3")
    same = {"instructions": INSTRUCTIONS, "tools": TOOLS}
    _put(s, "resp_items", response={"id": "resp_items", "object": "response", "output": []}, items=[same])
    _put(s, "resp_settings")
    assert _count(s, "SELECT COUNT(*) FROM blobs") == 2  # the shared one and resp_settings' input
    assert s.delete("resp_items")
    assert s.get_response("resp_settings") == _response("resp_settings")
    s.close()


def test_pruning_takes_the_settings_blob_with_the_last_response(tmp_path) -> None:
    s = SQLiteStore(tmp_path / "h.sqlite3", max_responses=3)
    s.PRUNE_EVERY = 1
    for i in range(6):
        _put(s, f"resp_{i}", response=_response(f"resp_{i}", instructions=f"Agent {i}. " * 200))
    assert _count(s, "SELECT COUNT(*) FROM responses") == 3
    assert _settings_blobs(s) == 3 and _count(s, "SELECT COUNT(*) FROM blobs") == 3 + 3
    assert s.get_response("resp_5") == _response("resp_5", instructions="Agent 5. " * 200)
    s.close()


def test_a_lost_settings_blob_loads_as_not_found(tmp_path, caplog) -> None:
    s = SQLiteStore(tmp_path / "h.sqlite3")
    _put(s, "resp_a")
    s._db.execute("DELETE FROM blobs WHERE hash IN (SELECT settings_hash FROM responses)")
    assert s.get_response("resp_a") is None and s.get("resp_a") is None
    assert caplog.text.count("has lost its settings") == 2
    s.close()


def test_a_file_of_the_earlier_schema_gets_the_column_and_keeps_its_bodies(tmp_path) -> None:
    path = tmp_path / "h.sqlite3"
    s = SQLiteStore(path)
    _put(s, "resp_new")
    s.close()
    # as written before: the whole response in its body, no settings column
    db = sqlite3.connect(path)
    db.execute("DROP INDEX responses_settings")
    db.execute("ALTER TABLE responses DROP COLUMN settings_hash")
    db.execute("UPDATE responses SET body = ? WHERE id = 'resp_new'", (json.dumps(_response("resp_new")).encode(),))
    db.execute("DELETE FROM blobs WHERE body LIKE '{\"instructions\"%'")
    db.commit()
    db.close()
    s = SQLiteStore(path)
    assert s.get_response("resp_new") == _response("resp_new")
    _put(s, "resp_next", "resp_new", 1)
    assert s.get("resp_next").response == _response("resp_next") and _settings_blobs(s) == 1
    s.close()


def _shared(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], CheckedTools]:
    """``tools`` as the tools cache shares them (the caller keeps the holder alive)."""
    holder = CheckedTools(tools, check_tools(tools), b"")
    share_checked(holder)
    return tools, holder


def test_settings_encoded_lately_are_reused_only_for_the_same_settings(tmp_path) -> None:
    s = SQLiteStore(tmp_path / "h.sqlite3")
    shared, _holder = _shared([dict(t) for t in TOOLS])  # one tools object for several turns
    a = _response("resp_a", tools=shared)
    b = _response("resp_b", instructions="Other instructions. " * 80, tools=shared)  # same tools, other text
    c = _response("resp_c", instructions="".join(INSTRUCTIONS), tools=shared)  # equal text, another str
    d = _response("resp_d", tools=[dict(t, name=t["name"] + "_v2") for t in TOOLS])  # other tools, same text
    for r in (a, b, c, d):
        _put(s, r["id"], response=r)
    for r in (a, b, c, d):
        assert s.get_response(r["id"]) == r
    assert _settings_blobs(s) == 3  # a and c share theirs
    memo = s._settings._memo
    assert len(memo) == 2 and all(m[1] is shared for m in memo)  # a (c hit it) and b; d's tools are its own
    for i in range(20):  # bounded by entries...
        _put(s, f"resp_n{i}", response=_response(f"resp_n{i}", instructions=f"Agent {i}. " * 200, tools=shared))
    assert len(memo) == s._settings.KEEP
    huge = _response("resp_huge", instructions="y" * (s._settings.KEEP_BYTES + 1), tools=shared)
    _put(s, "resp_huge", response=huge)  # ... and by size: not kept
    assert all(len(m[2]) <= s._settings.KEEP_BYTES for m in memo) and s.get_response("resp_huge") == huge
    s.close()


def test_tools_that_are_not_shared_or_instructions_that_are_not_text_are_encoded_every_time(tmp_path) -> None:
    s = SQLiteStore(tmp_path / "h.sqlite3")
    own = [dict(t) for t in TOOLS]  # decoded for one request: it could change, it is not remembered
    _put(s, "resp_a", response=_response("resp_a", tools=own))
    own.append({"type": "function", "name": "added_later", "parameters": {"type": "object"}})
    _put(s, "resp_b", response=_response("resp_b", tools=own))
    assert s.get_response("resp_b")["tools"] == own and len(s.get_response("resp_a")["tools"]) == len(TOOLS)
    listed = ["Follow the rules. " * 80, 1]  # instructions as a list: 1 == 1.0 == True, not the same JSON
    _put(s, "resp_c", response=_response("resp_c", instructions=listed, tools=None))
    _put(s, "resp_d", response=_response("resp_d", instructions=["Follow the rules. " * 80, 1.0], tools=None))
    assert s.get_response("resp_d")["instructions"] == ["Follow the rules. " * 80, 1.0]
    assert type(s.get_response("resp_d")["instructions"][1]) is float
    assert s._settings._memo == []
    s.close()
