"""Whole-history requests stored as continuations: a client that resends its whole conversation
each turn with ``store: true`` (the API's default; the Vercel AI SDK does so every step) has each
response stored with only its new items, as a child of the stored response whose history it
reused (pipeline.post.stored_base), so the store grows with each turn's new items, not with the
history. Nothing a client sees changes: no ``previous_response_id``, the whole input in
``input_items``, deletes in any position, a restart."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Server, run_server
from tests.services import redis_server

OPENING = "fix the build: " + "lorem ipsum dolor " * 20  # over 256 bytes: matched by its bytes


def _idle(server: Server) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(server.base + "/hotloop/stats", timeout=10).json()["store"]["pending"]:
        assert time.monotonic() < deadline, "the store's queue did not empty"
        time.sleep(0.05)


def _rows(db: Path) -> dict[str, tuple[str | None, int, int]]:
    """Each stored response: (parent, base length, rows of its own items)."""
    with sqlite3.connect(db) as c:
        own = dict(c.execute("SELECT response_id, COUNT(*) FROM response_items GROUP BY response_id"))
        return {rid: (parent, base, own.get(rid, 0)) for rid, parent, base in c.execute("SELECT id, parent_id, base_len FROM responses")}


def _items(server: Server, rid: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{server.v1}/responses/{rid}/input_items", params={"order": "asc", "limit": 100}, timeout=30)
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def _shape(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(i["type"], i.get("role", "")) for i in items]


def test_whole_histories_are_stored_as_continuations(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {"HOTLOOP_DATA_DIR": str(data)}
    history: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": OPENING}]
    ids: list[str] = []
    sent: list[list[dict[str, Any]]] = []
    with run_server(tmp_path, "--store", "sqlite", "--sim-rate", "0", env=env) as server:
        for turn in range(5):
            body = {"model": "hotloop-sim", "input": history, "metadata": {"sim": "text,tokens:12"}}
            r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
            assert r.status_code == 200, r.text
            resp = r.json()
            assert resp["previous_response_id"] is None
            ids.append(resp["id"])
            sent.append(list(history))
            history = history + resp["output"] + [{"type": "message", "role": "user", "content": f"and then {turn}"}]
        _idle(server)
        assert httpx.get(server.base + "/hotloop/stats", timeout=10).json()["prefix_cache"]["hits"] == 4
        rows = _rows(data / "hotloop.sqlite3")
        # the first whole; each later one a child of the one before, holding its new user message
        # and its answer (before: no parent, and its whole history again: 2, 4, 6, 8, 10 rows)
        assert rows[ids[0]] == (None, 0, 2)
        for k in range(1, 5):
            assert rows[ids[k]] == (ids[k - 1], 2 * k, 2), (k, rows[ids[k]])
        for k, rid in enumerate(ids):
            got = _items(server, rid)
            assert _shape(got) == _shape(sent[k]) and got[0]["content"][0]["text"] == OPENING
        # a delete in the middle: gone for the client, its history kept for the ones after it
        assert httpx.delete(f"{server.v1}/responses/{ids[2]}", timeout=30).status_code == 200
        assert httpx.get(f"{server.v1}/responses/{ids[2]}", timeout=30).status_code == 404
        assert _shape(_items(server, ids[4])) == _shape(sent[4])
        # the next whole history extends the last response: stored as its child
        body = {"model": "hotloop-sim", "input": history, "metadata": {"sim": "text,tokens:12"}}
        r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
        assert r.status_code == 200, r.text
        last, last_output = r.json()["id"], r.json()["output"]
        _idle(server)
        assert _rows(data / "hotloop.sqlite3")[last] == (ids[4], 10, 2)
    with run_server(tmp_path, "--store", "sqlite", "--sim-rate", "0", env=env) as server:
        assert _shape(_items(server, last)) == _shape(history)
        assert httpx.get(f"{server.v1}/responses/{ids[2]}", timeout=30).status_code == 404
        for rid in (ids[0], ids[4]):  # the first (not a child) and its descendants still delete
            assert httpx.delete(f"{server.v1}/responses/{rid}", timeout=30).status_code == 200
        assert _shape(_items(server, last)) == _shape(history)
        r = httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", "input": "more", "previous_response_id": last}, timeout=30)
        assert r.status_code == 200, r.text
        assert _shape(_items(server, r.json()["id"])) == _shape(history) + _shape(last_output) + [("message", "user")]


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_every_store_answers_alike(tmp_path: Path, store: str) -> None:
    # the same conversation on the other stores (their chains as SQLite's): each response lists
    # its whole input, a delete in the middle leaves the later ones whole, and the conversation
    # goes on by previous_response_id from the last
    with contextlib.ExitStack() as stack:
        args = ["--store", store, "--sim-rate", "0"]
        if store == "redis":
            args += ["--redis-url", stack.enter_context(redis_server(tmp_path)).url]
        # no cache of stored responses: every answer below is loaded from the store
        server = stack.enter_context(run_server(tmp_path, *args, env={"HOTLOOP_RESPONSE_CACHE_ENTRIES": "0"}))
        history: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": OPENING}]
        ids, sent = [], []
        for turn in range(4):
            body = {"model": "hotloop-sim", "input": history, "metadata": {"sim": "text,tokens:12"}}
            r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
            sent.append(list(history))
            history = history + r.json()["output"] + [{"type": "message", "role": "user", "content": f"and then {turn}"}]
        _idle(server)
        if store == "redis":  # each later one stored as a child of the one before
            import redis

            db = redis.Redis.from_url(args[-1])
            for k in range(1, 4):
                (key,) = db.keys(f"hotloop:t:*:r:{ids[k]}")
                assert db.hget(key, "parent") == ids[k - 1].encode() and int(db.hget(key, "base")) == 2 * k, k
        assert httpx.delete(f"{server.v1}/responses/{ids[1]}", timeout=30).status_code == 200
        for k in (0, 2, 3):
            assert _shape(_items(server, ids[k])) == _shape(sent[k]), k
        r = httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", "input": "more", "previous_response_id": ids[3]}, timeout=30)
        assert r.status_code == 200, r.text
