"""API keys in Redis (``--store redis``): every replica, and ``hotloop keys --store redis``, share them.

Key layout (``P`` is ``hotloop:``)::

    P k:{key_id}       HASH    name, hash (SHA-256 of the secret), rpm, tpm, max_concurrent
                               (empty: unlimited), created_at, last_used, revoked_at (empty: active)
    P k:ids            ZSET    every key id, scored by creation time (listing order)
    P k:name:{name}    STRING  the id of the active key of this name (uniqueness among active keys)
    P k:version        HASH    created, revoked (counters: a rotation counts as a revocation, of
                               the old secret, so that every replica, of any version, sees it)
                               and epoch (random, set by the table's first create): what
                               :meth:`version` returns

Create, revoke and rotate are Lua scripts (atomic: a name is never given to two active keys).
Like the SQLite key store this is synchronous; :class:`~hotloop.tenants.auth.Tenancy` calls it
from its own thread, re-reading the keys when the version changes (so a key revoked or rotated
through one replica is refused by every replica within ``Tenancy.REFRESH_SECONDS`` plus one
query). Unreachable
Redis raises :class:`~hotloop.errors.StoreUnavailable` (a 503 for a request that needs a key
not yet known to this process; keys already loaded keep working).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Callable, TypeVar

from hotloop.state.redis_store import PREFIX, Breaker, once, sync_client
from hotloop.tenants.keys import UNLIMITED, KeyExists, KeyRecord, Limits, _new_id, check_name, hash_secret, new_secret

T = TypeVar("T")

_CREATE = """
local P, id, name = ARGV[1], ARGV[2], ARGV[3]
if not redis.call('SET', P .. 'k:name:' .. name, id, 'NX') then return 0 end
redis.call('HSET', P .. 'k:' .. id, 'name', name, 'hash', ARGV[4], 'rpm', ARGV[5], 'tpm', ARGV[6],
  'max_concurrent', ARGV[7], 'created_at', ARGV[8], 'last_used', '', 'revoked_at', '')
redis.call('ZADD', P .. 'k:ids', ARGV[8], id)
redis.call('HINCRBY', P .. 'k:version', 'created', 1)
redis.call('HSETNX', P .. 'k:version', 'epoch', ARGV[9])
return 1
"""

_REVOKE = """
local P, name = ARGV[1], ARGV[2]
local id = redis.call('GET', P .. 'k:name:' .. name)
if not id then return 0 end
redis.call('HSET', P .. 'k:' .. id, 'revoked_at', ARGV[3])
redis.call('DEL', P .. 'k:name:' .. name)
redis.call('HINCRBY', P .. 'k:version', 'revoked', 1)
return 1
"""


_ROTATE = """
local P, name = ARGV[1], ARGV[2]
local id = redis.call('GET', P .. 'k:name:' .. name)
if not id then return 0 end
redis.call('HSET', P .. 'k:' .. id, 'hash', ARGV[3])
redis.call('HINCRBY', P .. 'k:version', 'revoked', 1)
return 1
"""


def _opt_int(v: bytes | None) -> int | None:
    return int(v) if v else None


def _opt_float(v: bytes | None) -> float | None:
    return float(v) if v else None


def _num(n: int | None) -> str:
    return "" if n is None else str(n)


class RedisKeyStore:
    """:class:`~hotloop.tenants.keys.KeyStore` on Redis; see the module docstring."""

    def __init__(self, url: str, *, prefix: str = PREFIX, client: Any = None) -> None:
        self.prefix = prefix
        self.r = client if client is not None else sync_client(url)
        self.breaker = Breaker()
        self._create = self.r.register_script(_CREATE)
        self._revoke = self.r.register_script(_REVOKE)
        self._rotate = self.r.register_script(_ROTATE)

    def _call(self, fn: Callable[[], T]) -> T:
        return once(self.breaker, fn)

    def create(self, name: str, limits: Limits = UNLIMITED) -> tuple[KeyRecord, str]:
        check_name(name)
        secret = new_secret()
        rec = KeyRecord(_new_id(), name, hash_secret(secret), limits, time.time())
        args = [
            self.prefix, rec.id, name, rec.hash, _num(limits.rpm), _num(limits.tpm), _num(limits.max_concurrent),
            repr(rec.created_at), str(secrets.randbits(62) + 1),
        ]
        if not self._call(lambda: self._create(args=args)):
            raise KeyExists(f"a key named {name!r} exists")
        return rec, secret

    def revoke(self, name: str) -> bool:
        return bool(self._call(lambda: self._revoke(args=[self.prefix, name, repr(time.time())])))

    def rotate(self, name: str) -> str | None:
        secret = new_secret()
        done = self._call(lambda: self._rotate(args=[self.prefix, name, hash_secret(secret)]))
        return secret if done else None

    def list(self) -> list[KeyRecord]:
        def read() -> list[tuple[bytes, dict[bytes, bytes]]]:
            ids = self.r.zrange(self.prefix + "k:ids", 0, -1)
            pipe = self.r.pipeline(transaction=False)
            for i in ids:
                pipe.hgetall(self.prefix + "k:" + i.decode())
            return list(zip(ids, pipe.execute()))

        out = []
        for kid, h in self._call(read):
            if not h:
                continue
            out.append(
                KeyRecord(
                    kid.decode(), h[b"name"].decode(), bytes(h[b"hash"]),
                    Limits(_opt_int(h.get(b"rpm")), _opt_int(h.get(b"tpm")), _opt_int(h.get(b"max_concurrent"))),
                    float(h[b"created_at"]), _opt_float(h.get(b"last_used")), _opt_float(h.get(b"revoked_at")),
                )
            )
        return out

    def version(self) -> tuple[int, int, int]:
        """(keys created, secrets revoked (keys revoked and rotated), the table's epoch). The
        counters alone cannot tell a table emptied (Redis restarted without its data, a FLUSHDB)
        and refilled with as many keys from the one before: a deleted key would go on working, a
        new one be refused. The epoch, drawn by the first create of a table, can."""
        h = self._call(lambda: self.r.hmget(self.prefix + "k:version", "created", "revoked", "epoch"))
        return int(h[0] or 0), int(h[1] or 0), int(h[2] or 0)

    def touch(self, used: dict[str, float]) -> None:
        def write() -> None:
            pipe = self.r.pipeline(transaction=False)
            for kid, t in used.items():
                pipe.hset(self.prefix + "k:" + kid, "last_used", repr(t))
            pipe.execute()

        self._call(write)

    def close(self) -> None:
        self.r.close()
