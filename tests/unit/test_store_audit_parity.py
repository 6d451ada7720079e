"""The memory, SQLite and Redis stores answer alike: the same random sequence of writes (chains,
forks, parents that do not match), deletes, loads, response reads and item look-ups, by two
owners and the admin scope, gives the same answers from each (real SQLite in tmp_path, a real
``redis-server``)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any, Iterator

import pytest

from hotloop.state.redis_store import RedisStore
from hotloop.state.store import MemoryStore, MissingParent, SQLiteStore, StoredResponse
from tests.services import Redis, redis_server

SEEDS = range(12)
STEPS = 150


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    with redis_server(tmp_path_factory.mktemp("redis")) as r:
        yield r


def _item(rid: str, k: int) -> dict[str, Any]:
    # every third item shares its id with other responses' (a client's own id, or not minted)
    iid = f"msg_{rid}_{k}" if k % 3 else f"shared_{k}"
    return {"type": "message", "id": iid, "role": "user", "content": [{"type": "input_text", "text": f"{rid}/{k}"}]}


def _history(h: Any) -> Any:
    if h is None:
        return None
    fps = [bytes(f) if f is not None else None for f in h.fps]
    return (h.response, h.items, fps, h.toks, h.input_len, h.parent_id, h.base_len, h.owner, h.minted, h.states)


def _run(stores: list[Any], seed: int) -> None:
    rnd = random.Random(seed)
    ids: list[str] = []
    lens: dict[str, int] = {}
    for step in range(STEPS):
        owner = rnd.choice(["alice", "bob"])
        scope = rnd.choice(["alice", "bob", None])
        what: tuple[Any, ...]
        if rnd.random() < 0.4 or not ids:
            rid = f"r{step}"
            parent = rnd.choice(ids) if ids and rnd.random() < 0.7 else None
            base = lens.get(parent, rnd.randint(0, 3)) if parent else 0
            if parent and rnd.random() < 0.1:
                base += 1  # not the parent's length: MissingParent
            k = rnd.randint(0, 3)
            own = [_item(rid, j) for j in range(k)]
            fps: list[bytes | None] = [hashlib.blake2b(f"{rid}{j}".encode(), digest_size=16).digest() for j in range(k)]
            states = {"s": step} if rnd.random() < 0.3 else None
            rec = StoredResponse(
                {"id": rid, "object": "response", "status": "completed", "n": step}, own, fps, [1] * k,
                base + min(k, 1), parent, base, owner, [rnd.random() < 0.8 for _ in range(k)], states,
            )
            answers: list[Any] = []
            for s in stores:
                try:
                    s.put(rec)
                    answers.append("stored")
                except MissingParent:
                    answers.append("missing parent")
            if answers[0] == "stored":
                ids.append(rid)
                lens[rid] = base + k
            what = ("put", rid, parent, base, k, owner)
        else:
            rid = rnd.choice(ids + ["resp_unknown"])
            kind = rnd.choice(["get", "get_response", "delete", "get_item"])
            if kind == "get_item":
                iid = rnd.choice([f"msg_{rid}_1", f"msg_{rid}_2", "shared_0", "shared_3"])
                answers = [s.get_item(iid, scope) for s in stores]
            elif kind == "get":
                answers = [_history(s.get(rid, scope)) for s in stores]
            else:
                answers = [getattr(s, kind)(rid, scope) for s in stores]
            what = (kind, rid, scope)
        for s, a in zip(stores[1:], answers[1:]):
            assert a == answers[0], f"seed {seed} step {step} {what}: {type(s).__name__} differs from the memory store"


@pytest.mark.parametrize("seed", SEEDS)
def test_the_stores_answer_alike(seed: int, tmp_path: Path, redis: Redis) -> None:
    stores: list[Any] = [MemoryStore(), SQLiteStore(tmp_path / "s.sqlite3"), RedisStore(redis.url, 3600, prefix=f"p{seed}:")]
    try:
        _run(stores, seed)
    finally:
        for s in stores:
            s.close()


def test_the_stores_answer_alike_after_a_reopen(tmp_path: Path) -> None:
    """The SQLite file reopened (a server restart) answers as the store that wrote it."""
    path = tmp_path / "s.sqlite3"
    mem, sql = MemoryStore(), SQLiteStore(path)
    _run([mem, sql], 99)
    sql.close()
    again = SQLiteStore(path)
    try:
        for n in range(STEPS):
            rid = f"r{n}"
            for scope in ("alice", "bob", None):
                assert _history(again.get(rid, scope)) == _history(mem.get(rid, scope))
                assert again.get_response(rid, scope) == mem.get_response(rid, scope)
    finally:
        again.close()
