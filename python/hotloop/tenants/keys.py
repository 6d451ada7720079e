"""API keys: secrets, their hashes, and the stores that keep them.

A secret is ``hl-`` followed by 32 random bytes in unpadded base64url (43 characters). Only its
SHA-256 is stored; the secret is shown once, when the key is created. A key has a stable id
(``key_`` + 16 random hex digits, never reused: it is the owner of what the key stores), a name
(unique among the keys that are not revoked; a revoked key's name may be given to a new key),
optional limits, its creation time, the last time it was used (recorded at most once a minute)
and, once revoked, its revocation time. Revoked keys stay listed.

Rotating a key (:meth:`KeyStore.rotate`) gives it a new secret and retires the old one: the key
keeps its id, so it stays the same tenant (its stored responses, conversations, usage and limit
buckets), unlike a revoked key's name given to a new key.

:class:`KeyStore` is the interface; :class:`SQLiteKeyStore` keeps the keys in the server's SQLite
file (table ``api_keys``, WAL mode, so ``hotloop keys`` and a running server share it) and
:class:`MemoryKeyStore` in memory (``--store memory``: only the admin key, or open mode).
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from hotloop.state import create_private

SECRET_PREFIX = "hl-"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ID_RE = re.compile(r"key_[0-9a-f]{16}")  # a key's id (_new_id), never a key's name
RESERVED_NAMES = frozenset({"admin", "anonymous"})  # the admin key's and open mode's tenants
# How long a key store statement waits for another connection's write lock on the SQLite file (a
# server's store writer, another `hotloop keys`, a backup) before "database is locked"
BUSY_TIMEOUT = 10.0
# ... and how long the server's record of keys' last use waits for it (SQLiteKeyStore.touch): it
# holds the key store's connection meanwhile, and a key table look-up (a new key's first
# request, the revocation check) waits behind it. A touch locked out is made again later.
TOUCH_BUSY_TIMEOUT = 0.25


def new_secret() -> str:
    return SECRET_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()


def hash_secret(secret: str | bytes) -> bytes:
    """SHA-256 of a secret: what is stored and compared (the secrets have 256 bits of entropy,
    so a fast unsalted hash is enough)."""
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


@dataclass(frozen=True)
class Limits:
    """Per-key limits; ``None`` is unlimited."""

    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute (input plus output)
    max_concurrent: int | None = None  # responses in flight at once


UNLIMITED = Limits()


@dataclass(frozen=True)
class KeyRecord:
    id: str
    name: str
    hash: bytes
    limits: Limits
    created_at: float
    last_used: float | None = None
    revoked_at: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class KeyExists(ValueError):
    """A key that is not revoked already has this name."""


class InvalidKeyName(ValueError):
    pass


def check_name(name: str) -> None:
    if not NAME_RE.fullmatch(name):
        raise InvalidKeyName(f"invalid key name {name!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    if name in RESERVED_NAMES:
        raise InvalidKeyName(f"the key name {name!r} is reserved")
    if ID_RE.fullmatch(name):
        # `hotloop usage --key X` lists the key whose id is X and the keys named X: a key named
        # like another's id would have its usage listed (and summed) with that key's
        raise InvalidKeyName(f"the key name {name!r} is reserved: it has the form of a key id (key_ and 16 hex digits)")


class KeyStore(Protocol):
    """Where keys live. Implementations are synchronous (the server calls them from a thread)."""

    def create(self, name: str, limits: Limits = UNLIMITED) -> tuple[KeyRecord, str]:
        """A new key and its secret (the only time the secret exists outside the caller).
        :raises KeyExists: :raises InvalidKeyName:"""
        ...

    def revoke(self, name: str) -> bool:
        """Revoke the active key of this name; ``False`` if there is none."""
        ...

    def rotate(self, name: str) -> str | None:
        """A new secret for the active key of this name, which keeps its id (the same tenant),
        name and limits; its old secret stops working (and :meth:`version` changes). ``None``
        if there is no such key."""
        ...

    def list(self) -> list[KeyRecord]:
        """Every key, revoked ones included, oldest first."""
        ...

    def version(self) -> tuple[int, int, int]:
        """A value that changes whenever a key is created or revoked (cheap: one indexed query)."""
        ...

    def touch(self, used: dict[str, float]) -> None:
        """Record last-used times, by key id."""
        ...

    def close(self) -> None: ...


def _new_id() -> str:
    return "key_" + secrets.token_hex(8)


class MemoryKeyStore:
    """Keys in memory (nothing survives a restart)."""

    def __init__(self) -> None:
        self._keys: list[KeyRecord] = []
        self._rotated = 0
        self._lock = threading.Lock()

    def create(self, name: str, limits: Limits = UNLIMITED) -> tuple[KeyRecord, str]:
        check_name(name)
        secret = new_secret()
        with self._lock:
            if any(k.name == name and k.active for k in self._keys):
                raise KeyExists(f"a key named {name!r} exists")
            rec = KeyRecord(_new_id(), name, hash_secret(secret), limits, time.time())
            self._keys.append(rec)
        return rec, secret

    def revoke(self, name: str) -> bool:
        with self._lock:
            for i, k in enumerate(self._keys):
                if k.name == name and k.active:
                    self._keys[i] = replace(k, revoked_at=time.time())
                    return True
        return False

    def rotate(self, name: str) -> str | None:
        secret = new_secret()
        with self._lock:
            for i, k in enumerate(self._keys):
                if k.name == name and k.active:
                    self._keys[i] = replace(k, hash=hash_secret(secret))
                    self._rotated += 1
                    return secret
        return None

    def list(self) -> list[KeyRecord]:
        with self._lock:
            return list(self._keys)

    def version(self) -> tuple[int, int, int]:
        with self._lock:
            return len(self._keys), sum(not k.active for k in self._keys), len(self._keys) + self._rotated

    def touch(self, used: dict[str, float]) -> None:
        with self._lock:
            self._keys = [replace(k, last_used=used[k.id]) if k.id in used else k for k in self._keys]

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    hash BLOB NOT NULL UNIQUE,
    rpm INTEGER,
    tpm INTEGER,
    max_concurrent INTEGER,
    created_at REAL NOT NULL,
    last_used REAL,
    revoked_at REAL
);
CREATE UNIQUE INDEX IF NOT EXISTS api_keys_active_name ON api_keys(name) WHERE revoked_at IS NULL;
"""
_COLUMNS = "id, name, hash, rpm, tpm, max_concurrent, created_at, last_used, revoked_at"


def _row(r: Any) -> KeyRecord:
    return KeyRecord(r[0], r[1], bytes(r[2]), Limits(r[3], r[4], r[5]), r[6], r[7], r[8])


class SQLiteKeyStore:
    """Keys in the server's SQLite file (WAL mode): the CLI and running servers share them."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            create_private(self.path)  # the file the server stores every tenant's responses in too
        self.busy_timeout = BUSY_TIMEOUT
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=self.busy_timeout)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def create(self, name: str, limits: Limits = UNLIMITED) -> tuple[KeyRecord, str]:
        check_name(name)
        secret = new_secret()
        rec = KeyRecord(_new_id(), name, hash_secret(secret), limits, time.time())
        try:
            with self._lock:
                self._db.execute(
                    f"INSERT INTO api_keys({_COLUMNS}) VALUES (?,?,?,?,?,?,?,NULL,NULL)",
                    (rec.id, rec.name, rec.hash, limits.rpm, limits.tpm, limits.max_concurrent, rec.created_at),
                )
        except sqlite3.IntegrityError:
            raise KeyExists(f"a key named {name!r} exists") from None
        return rec, secret

    def revoke(self, name: str) -> bool:
        with self._lock:
            cur = self._db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL", (time.time(), name)
            )
        return cur.rowcount > 0

    def rotate(self, name: str) -> str | None:
        secret = new_secret()
        with self._lock:
            # a new rowid too (one past the largest): version() sees the change, as every server
            # watching the table must (their cache still holds the old hash)
            cur = self._db.execute(
                "UPDATE api_keys SET hash = ?, rowid = (SELECT MAX(rowid) + 1 FROM api_keys) "
                "WHERE name = ? AND revoked_at IS NULL",
                (hash_secret(secret), name),
            )
        return secret if cur.rowcount > 0 else None

    def list(self) -> list[KeyRecord]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at, rowid").fetchall()
        return [_row(r) for r in rows]

    def version(self) -> tuple[int, int, int]:
        with self._lock:
            row = self._db.execute("SELECT COUNT(*), COUNT(revoked_at), COALESCE(MAX(rowid), 0) FROM api_keys").fetchone()
        return int(row[0]), int(row[1]), int(row[2])

    def touch(self, used: dict[str, float]) -> None:
        """:raises sqlite3.OperationalError: locked out for ``TOUCH_BUSY_TIMEOUT`` (nothing written)."""
        from hotloop.state.store import busy_wait

        # (times written before a later statement was locked out are written again: harmless)
        with self._lock, busy_wait(self._db, TOUCH_BUSY_TIMEOUT, self.busy_timeout):
            self._db.executemany("UPDATE api_keys SET last_used = ? WHERE id = ?", [(t, k) for k, t in used.items()])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def open_key_store(store: str, db_path: str | Path, redis_url: str | None = None) -> KeyStore:
    """The key store beside the configured response store (``store``: ``sqlite``, ``memory`` or
    ``redis``, at ``redis_url``: :mod:`hotloop.tenants.redis_keys`)."""
    if store == "sqlite":
        return SQLiteKeyStore(db_path)
    if store == "memory":
        return MemoryKeyStore()
    if store == "redis" and redis_url:
        from hotloop.tenants.redis_keys import RedisKeyStore

        return RedisKeyStore(redis_url)
    raise ValueError(f"unknown store {store!r}; choose 'sqlite', 'memory' or 'redis'")
