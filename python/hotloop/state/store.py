"""Persistent storage of responses: an interface, an in-memory store and a SQLite store.

What is stored for each ``store: true`` response: the final Response object and its *effective*
input items (the parent chain's input and output plus the request's own items) followed by its
output items, each with its fingerprint and token count, so a later ``previous_response_id``
hydrates a ready :class:`~hotloop.state.context.Context` without re-tokenizing anything.

The SQLite store keeps item bodies content-addressed (``blobs``), so a long chain stores each item
once; ``response_items`` lists, per response, the positions of its items. Retention is bounded by
age (``ttl_seconds``, default 30 days) and by count (``max_responses``, default 10,000): the
oldest responses are pruned first, then unreferenced blobs. A usage ledger aggregates tokens per
model and UTC day.

Store methods are synchronous and called from one writer thread
(:class:`hotloop.pipeline.post.Persistence`); SQLite runs in WAL mode.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import msgspec

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()

DEFAULT_TTL_SECONDS = 30 * 24 * 3600
DEFAULT_MAX_RESPONSES = 10_000


class StoredResponse(NamedTuple):
    response: dict[str, Any]
    items: list[dict[str, Any]]  # effective input, then output
    fps: list[int]
    toks: list[int]
    input_len: int


class UsageRecord(NamedTuple):
    model: str
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    at: float


def page_items(
    items: list[dict[str, Any]], after: str | None, limit: int, order: str
) -> tuple[list[dict[str, Any]], bool] | None:
    """One page of ``input_items``; ``None`` when ``after`` names no item."""
    seq = items if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        for i, it in enumerate(seq):
            if it.get("id") == after:
                start = i + 1
                break
        else:
            return None
    page = seq[start : start + limit]
    return page, start + limit < len(seq)


def _item_id(item: dict[str, Any]) -> str | None:
    iid = item.get("id")
    return iid if isinstance(iid, str) else None


class ResponseStore(Protocol):
    def put(self, rec: StoredResponse) -> None: ...
    def get(self, response_id: str) -> StoredResponse | None: ...
    def get_item(self, item_id: str) -> dict[str, Any] | None: ...
    def get_response(self, response_id: str) -> dict[str, Any] | None: ...
    def delete(self, response_id: str) -> bool: ...
    def record_usage(self, recs: list[UsageRecord]) -> None: ...
    def usage(self) -> list[dict[str, Any]]: ...
    def close(self) -> None: ...


DEFAULT_MAX_ITEMS = 1_000_000


class MemoryStore:
    """Bounded in-memory store: LRU by count and by total stored items (each record holds its
    whole effective history), plus TTL. Nothing survives a restart."""

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        max_items: int = DEFAULT_MAX_ITEMS,
    ) -> None:
        self.max_responses = max_responses
        self.ttl_seconds = ttl_seconds
        self.max_items = max_items
        self.items = 0
        self._d: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()
        self._item_index: dict[str, set[str]] = {}  # item id -> ids of the stored responses holding it
        self._usage: dict[tuple[str, str], list[int]] = {}
        self._lock = threading.Lock()

    def put(self, rec: StoredResponse) -> None:
        with self._lock:
            rid = rec.response["id"]
            old = self._d.pop(rid, None)
            if old is not None:
                self._forget(old[1])
            self._d[rid] = (time.time(), rec)
            self.items += len(rec.items)
            for it in rec.items:
                iid = _item_id(it)
                if iid is not None:
                    self._item_index.setdefault(iid, set()).add(rid)
            while self._d and (len(self._d) > self.max_responses or self.items > self.max_items):
                _, (_, gone) = self._d.popitem(last=False)
                self._forget(gone)

    def _forget(self, rec: StoredResponse) -> None:
        self.items -= len(rec.items)
        rid = rec.response["id"]
        for it in rec.items:
            iid = _item_id(it)
            holders = self._item_index.get(iid) if iid is not None else None
            if holders is not None:
                holders.discard(rid)
                if not holders:
                    del self._item_index[iid]  # type: ignore[arg-type]

    def get_item(self, item_id: str) -> dict[str, Any] | None:
        with self._lock:
            holders = list(self._item_index.get(item_id, ()))
        for rid in holders:
            rec = self.get(rid)
            for it in rec.items if rec is not None else ():
                if it.get("id") == item_id:
                    return it
        return None

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            v = self._d.get(response_id)
            if v is None:
                return None
            if time.time() - v[0] > self.ttl_seconds:
                del self._d[response_id]
                self._forget(v[1])
                return None
            return v[1]

    def get_response(self, response_id: str) -> dict[str, Any] | None:
        rec = self.get(response_id)
        return None if rec is None else rec.response

    def delete(self, response_id: str) -> bool:
        with self._lock:
            v = self._d.pop(response_id, None)
            if v is None:
                return False
            self._forget(v[1])
            return True

    def record_usage(self, recs: list[UsageRecord]) -> None:
        with self._lock:
            for rec in recs:
                day = time.strftime("%Y-%m-%d", time.gmtime(rec.at))
                row = self._usage.setdefault((day, rec.model), [0, 0, 0, 0, 0])
                row[0] += 1
                row[1] += rec.input_tokens
                row[2] += rec.output_tokens
                row[3] += rec.cached_tokens
                row[4] += rec.reasoning_tokens

    def usage(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "day": day,
                    "model": model,
                    "responses": r[0],
                    "input_tokens": r[1],
                    "output_tokens": r[2],
                    "cached_tokens": r[3],
                    "reasoning_tokens": r[4],
                }
                for (day, model), r in sorted(self._usage.items())
            ]

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    body BLOB NOT NULL,
    input_len INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses(created_at);
CREATE TABLE IF NOT EXISTS blobs (
    hash BLOB PRIMARY KEY,
    body BLOB NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS response_items (
    response_id TEXT NOT NULL,
    pos INTEGER NOT NULL,
    hash BLOB NOT NULL,
    fp INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    item_id TEXT,
    PRIMARY KEY (response_id, pos)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS response_items_hash ON response_items(hash);
CREATE TABLE IF NOT EXISTS usage (
    day TEXT NOT NULL,
    model TEXT NOT NULL,
    responses INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL,
    PRIMARY KEY (day, model)
);
"""

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


def _signed(fp: int) -> int:
    return fp - _U64 if fp > _I64_MAX else fp


def _unsigned(v: int) -> int:
    return v + _U64 if v < 0 else v


class SQLiteStore:
    """The embedded default: one SQLite file in WAL mode, bounded by age and count."""

    PRUNE_EVERY = 64

    def __init__(
        self,
        path: str | Path,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
    ) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.max_responses = max_responses
        self.ttl_seconds = ttl_seconds
        # One connection used from one thread at a time (the writer thread); the lock makes
        # occasional use from another thread (tests, the CLI) safe too.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._writes = 0
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=OFF")
            self._db.executescript(_SCHEMA)
            cols = {r[1] for r in self._db.execute("PRAGMA table_info(response_items)")}
            if "item_id" not in cols:  # databases written before item references were indexed
                try:
                    self._db.execute("ALTER TABLE response_items ADD COLUMN item_id TEXT")
                except sqlite3.OperationalError:  # another process added it first
                    pass
            self._db.execute("CREATE INDEX IF NOT EXISTS response_items_item ON response_items(item_id)")

    def put(self, rec: StoredResponse) -> None:
        rid = rec.response["id"]
        bodies = [_enc.encode(it) for it in rec.items]
        hashes = [hashlib.blake2b(b, digest_size=16).digest() for b in bodies]
        with self._lock:
            db = self._db
            db.execute("BEGIN")
            try:
                db.execute("DELETE FROM response_items WHERE response_id=?", (rid,))
                db.execute(
                    "INSERT OR REPLACE INTO responses(id, created_at, body, input_len) VALUES (?,?,?,?)",
                    (rid, time.time(), _enc.encode(rec.response), rec.input_len),
                )
                db.executemany("INSERT OR IGNORE INTO blobs(hash, body) VALUES (?,?)", zip(hashes, bodies))
                db.executemany(
                    "INSERT INTO response_items(response_id, pos, hash, fp, tokens, item_id) VALUES (?,?,?,?,?,?)",
                    [
                        (rid, i, h, _signed(fp), tk, _item_id(it))
                        for i, (h, fp, tk, it) in enumerate(zip(hashes, rec.fps, rec.toks, rec.items))
                    ],
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            self._writes += 1
            if self._writes % self.PRUNE_EVERY == 0:
                self._prune_locked()

    def prune(self) -> int:
        with self._lock:
            return self._prune_locked()

    def _prune_locked(self) -> int:
        db = self._db
        cutoff = time.time() - self.ttl_seconds
        ids = [r[0] for r in db.execute("SELECT id FROM responses WHERE created_at < ?", (cutoff,))]
        (count,) = db.execute("SELECT COUNT(*) FROM responses").fetchone()
        excess = count - len(ids) - self.max_responses
        if excess > 0:
            ids += [
                r[0]
                for r in db.execute(
                    "SELECT id FROM responses WHERE created_at >= ? ORDER BY created_at LIMIT ?",
                    (cutoff, excess),
                )
            ]
        if not ids:
            return 0
        db.execute("BEGIN")
        db.executemany("DELETE FROM responses WHERE id=?", [(i,) for i in ids])
        db.executemany("DELETE FROM response_items WHERE response_id=?", [(i,) for i in ids])
        db.execute("DELETE FROM blobs WHERE NOT EXISTS (SELECT 1 FROM response_items WHERE response_items.hash = blobs.hash)")
        db.execute("COMMIT")
        return len(ids)

    def _row(self, response_id: str) -> tuple[bytes, int] | None:
        row = self._db.execute(
            "SELECT body, input_len FROM responses WHERE id=? AND created_at >= ?",
            (response_id, time.time() - self.ttl_seconds),
        ).fetchone()
        return row

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._row(response_id)
            if row is None:
                return None
            rows = self._db.execute(
                "SELECT b.body, ri.fp, ri.tokens FROM response_items ri JOIN blobs b ON b.hash = ri.hash "
                "WHERE ri.response_id=? ORDER BY ri.pos",
                (response_id,),
            ).fetchall()
        return StoredResponse(
            response=_dec.decode(row[0]),
            items=[_dec.decode(r[0]) for r in rows],
            fps=[_unsigned(r[1]) for r in rows],
            toks=[r[2] for r in rows],
            input_len=row[1],
        )

    def get_item(self, item_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT b.body FROM response_items ri JOIN blobs b ON b.hash = ri.hash "
                "JOIN responses r ON r.id = ri.response_id WHERE ri.item_id=? AND r.created_at >= ? LIMIT 1",
                (item_id, time.time() - self.ttl_seconds),
            ).fetchone()
        return None if row is None else _dec.decode(row[0])  # type: ignore[no-any-return]

    def get_response(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._row(response_id)
        return None if row is None else _dec.decode(row[0])  # type: ignore[no-any-return]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            db = self._db
            db.execute("BEGIN")
            cur = db.execute("DELETE FROM responses WHERE id=?", (response_id,))
            db.execute("DELETE FROM response_items WHERE response_id=?", (response_id,))
            db.execute("COMMIT")
            return cur.rowcount > 0

    def record_usage(self, recs: list[UsageRecord]) -> None:
        rows = [
            (time.strftime("%Y-%m-%d", time.gmtime(r.at)), r.model, r.input_tokens, r.output_tokens, r.cached_tokens, r.reasoning_tokens)
            for r in recs
        ]
        with self._lock:
            self._db.executemany(
                "INSERT INTO usage(day, model, responses, input_tokens, output_tokens, cached_tokens, reasoning_tokens) "
                "VALUES (?,?,1,?,?,?,?) ON CONFLICT(day, model) DO UPDATE SET responses=responses+1, "
                "input_tokens=input_tokens+excluded.input_tokens, output_tokens=output_tokens+excluded.output_tokens, "
                "cached_tokens=cached_tokens+excluded.cached_tokens, reasoning_tokens=reasoning_tokens+excluded.reasoning_tokens",
                rows,
            )

    def usage(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT day, model, responses, input_tokens, output_tokens, cached_tokens, reasoning_tokens "
                "FROM usage ORDER BY day, model"
            ).fetchall()
        keys = ("day", "model", "responses", "input_tokens", "output_tokens", "cached_tokens", "reasoning_tokens")
        return [dict(zip(keys, r)) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
