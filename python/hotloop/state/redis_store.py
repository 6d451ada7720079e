"""The Redis response store (``--store redis --redis-url redis://HOST:PORT/DB``): shared by replicas.

Same model as :mod:`hotloop.state.store` (parent pointers, own items, tombstones, ownership
scopes, minted item provenance), kept in one Redis database (a single server or a primary; not
Redis Cluster: the scripts compute key names from stored values). Redis 7.0 or later is required
(``MIN_REDIS_VERSION``: the scripts use ``PEXPIRETIME``); the version (``INFO server``) is checked
when the store opens, and an older server fails start-up (:class:`RedisVersionError`, exit 3).

Key layout (``P`` is ``hotloop:``; ``{owner}`` is the owning tenant's id, ``key_...``, ``admin``
or ``anonymous``)::

    P o:{response_id}            STRING  the response's owner (finds the record for any scope)
    P t:{owner}:r:{response_id}  HASH    one stored response: owner, parent, base, end, live,
                                         kids (stored children), at (creation, epoch seconds),
                                         input_len, resp (the Response, msgpack), own (its own
                                         items, fingerprints, token counts, minted flags; msgpack),
                                         states (classifier states, msgpack or empty),
                                         iids (JSON list of its server-minted item ids)
    P i:{item_id}                ZSET    "{owner} {response_id}" of live responses holding this
                                         minted item as their own, scored by creation time
    P ku:rows                    SET     "{day}\\t{model}\\t{key_id}" of every usage ledger row
    P ku:{day}\\t{model}\\t{key_id}
                                 HASH    responses, input_tokens, output_tokens, cached_tokens,
                                         reasoning_tokens, flagged, f:{kind} (findings), name (the
                                         key's name, shown beside its id)
    P ku:names:{day}\\t{key_id}    SET     the model names with a row of that day and key (at most
                                         MAX_LEDGER_MODELS; further names count under OTHER_MODEL),
                                         expiring two days after its last name
    P u:batch:{uuid}             STRING  a usage batch already applied (kept for twice the write
                                         retry time, at least 1 h: a retried batch is not counted
                                         twice; with --store-sync full there is one per response)
    P fpkey                      STRING  the deployment's fingerprint key (32 random bytes,
                                         made by the first replica to start)
    P callidkey                  STRING  the deployment's key of redacted call ids' tags (32
                                         random bytes, made by the first replica to start;
                                         hotloop.pipeline.classify.call_id_marker)

The usage ledger is keyed by key id (see :mod:`hotloop.state.store`). Before it was, its rows
were ``P u:rows`` / ``P u:{day}\\t{model}\\t{key name}`` (the counts and findings above, no
name) with ``P u:names:{day}\\t{key name}``; such rows (left by an earlier version, or written
by one during a rolling upgrade) are moved into the ``ku:`` rows under
:func:`~hotloop.state.store.legacy_key_id` of their name (the same rule as SQLite's migration),
their name kept as ``name``, by :meth:`RedisStore.migrate_ledger`: when a replica starts and
before every ledger listing, ``MIGRATE_BATCH`` rows per atomic script call (each row moved whole,
merged into a row of the same id that exists), so replicas migrating at once never count a row
twice.

The fingerprint key is read once, when a replica starts. If ``P fpkey`` is deleted or replaced
while replicas run (a ``FLUSHDB``, an edit by hand), replicas started afterwards make a new key
and their fingerprints no longer match those stored by the others: prefix reuse across them
silently stops matching (answers stay correct, only the reuse is lost) until every replica has
been restarted. Do not delete it while replicas run. ``P callidkey`` likewise: replaced, the
replicas started afterwards redact a secret in a call id to another marker, and a call stored
before no longer pairs with its output sent to them.

TTLs replace the SQLite pruner: a response reads as not found ``ttl_seconds`` after it was
stored (``at``), and its keys expire at that time rounded up to ``EXPIRE_GRANULARITY`` (at most
an hour, at most the TTL). Storing a child extends its ancestors' expiry to its own (a
tombstoned or expired ancestor's items stay while a descendant needs them); the walk up the
chain stops at the first ancestor that already lives long enough, so within one granularity
period a chain is walked once. The count bound (``--store`` ``max_responses``) does not apply:
Redis's ``maxmemory`` (with ``volatile-ttl`` eviction) bounds memory, and an evicted ancestor
makes its descendants load as not found (logged), as a broken chain does in SQLite. Writes,
deletes and chain loads are Lua scripts, so each is atomic and one round trip. The usage ledger
is kept forever, like SQLite's.

Why the synchronous client. :class:`~hotloop.state.store.ResponseStore` is synchronous by
design: :class:`~hotloop.pipeline.post.Persistence` runs every store call (writes and reads) in
its one writer thread, off the event loop, in order, so a read issued after a write sees it. The
Redis store keeps that contract with redis-py's synchronous client (hiredis parser) in that
thread; an asyncio client would put decoding of whole histories on the event loop. The request
path's Redis traffic, rate limits, uses the asyncio client (:mod:`hotloop.tenants.redis_limits`).

Redis unreachable. A read fails at once with :class:`~hotloop.errors.StoreUnavailable` (503
``server_error``); after a failure, reads fail fast for a backoff period (``Breaker``: 50 ms
doubling to 2 s) instead of waiting for a connect timeout each. A write (``put``,
``record_usage``) is retried with the same backoff until Redis answers again or
``write_retry_seconds`` (default 10 minutes) have passed (no attempt while the breaker is open;
once the give-up time has passed while Redis is known to be down, a write fails at once); meanwhile the writer's bounded queue
fills and then applies back-pressure, and :attr:`available` is false so new ``store: true``
requests beyond the queue are refused with a 503 (:mod:`hotloop.pipeline.shared`). A write that
still fails after ``write_retry_seconds`` (or, while the server stops, after
the shutdown flush bound, ``hotloop.pipeline.post.CLOSE_FLUSH_SECONDS``) is logged and counted as failed
(``hotloop_store_failed``: responses; ``hotloop_store_usage_failed``: ledger records), never dropped silently.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import secrets
import time
import uuid
from collections import defaultdict
from typing import Any, Callable, TypeVar

import msgspec

from hotloop import errors
from hotloop.state import fpkey
from hotloop.state.store import (
    LEGACY_KEY_PREFIX, MAX_CHAIN_DEPTH, MAX_LEDGER_MODELS, OTHER_MODEL, SELF_NAMED_TENANTS, USAGE_FIELDS, History, MissingParent,
    StoredResponse, UsageRecord, UsageRow,
)

log = logging.getLogger("hotloop.store")

PREFIX = "hotloop:"
EXPIRE_GRANULARITY = 3600.0  # seconds; expiry times are rounded up to this (capped at the TTL)
DEFAULT_WRITE_RETRY_SECONDS = 600.0
SOCKET_TIMEOUT = 5.0  # one command (a long chain's load included)
CONNECT_TIMEOUT = 1.0
USAGE_BATCH_MIN_TTL = 3600  # seconds a batch's marker outlives its last possible retry, at least
MIN_REDIS_VERSION = (7, 0)
# The channel a delete is announced on, to every process's caches (pipeline.shared), by the
# delete script itself: announced whenever it is done, also when its answer is lost on the way
DELETED_CHANNEL = "hotloop:deleted"
# A deleted response's mark (d:{id}) outlives any retry of a write of it that may still come
# (write_retry_seconds and a command's timeout on either side), at least this many seconds
DELETED_MARK_MIN_SECONDS = 60

# msgpack integers stop at 64 bits, JSON's do not: an integer beyond them (a client's
# ``max_output_tokens`` of 2**70, a number in a tool's schema or in an item kept verbatim) is
# stored as this extension type holding its decimal digits, and read back as the same integer.
# Only a record that holds one is walked for them; one that does not is encoded as it always was.
BIG_INT_EXT = 1
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def _big_ints(value: Any) -> Any:
    """``value`` with every integer beyond msgpack's range as a :data:`BIG_INT_EXT` extension."""
    t = type(value)
    if t is int:
        return msgspec.msgpack.Ext(BIG_INT_EXT, str(value).encode()) if not _INT_MIN <= value <= _INT_MAX else value
    if t is dict:
        return {k: _big_ints(v) for k, v in value.items()}
    if t is list or t is tuple:
        return [_big_ints(v) for v in value]
    return value


def _ext(code: int, data: memoryview) -> Any:
    if code == BIG_INT_EXT:
        return int(bytes(data))
    return msgspec.msgpack.Ext(code, bytes(data))


class _Encoder:
    """msgpack, with integers beyond 64 bits as :data:`BIG_INT_EXT` (see :func:`_big_ints`)."""

    __slots__ = ("_enc",)

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, value: Any) -> bytes:
        try:
            return self._enc.encode(value)
        except OverflowError:
            return self._enc.encode(_big_ints(value))


_enc = _Encoder()
_dec = msgspec.msgpack.Decoder(ext_hook=_ext)

T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def redis_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "Redis cannot be reached" (not a bug in a script), or cannot
    take writes now: out of memory (``maxmemory``), a read-only replica, a primary that lost its
    link, a server still loading its data set (``LOADING``), one that refuses writes because its
    last snapshot failed (``MISCONF``), one busy in a script (``BUSY``), a cluster slot moving
    (``TRYAGAIN``), a user whose ACL does not allow a command (``NOPERM``): a 503, and writes
    retried, as when it is down (a 500 with a traceback, and a write dropped at once, before).

    redis-py raises a plain ``ResponseError`` for ``MISCONF`` and ``BUSY``; their prefixes are
    given classes of their own here (subclasses of it, so nothing that catches it changes) in
    the error table its parsers share."""
    import redis
    from redis._parsers.base import BaseParser
    from redis.exceptions import (
        BusyLoadingError, MasterDownError, NoPermissionError, OutOfMemoryError, ReadOnlyError, ResponseError,
        TryAgainError,
    )

    class SnapshotFailedError(ResponseError):
        """``MISCONF``: the server refuses writes while its RDB snapshots fail."""

    class ScriptBusyError(ResponseError):
        """``BUSY``: the server runs a script past its time limit."""

    table: dict[str, Any] = BaseParser.EXCEPTION_CLASSES
    misconf: type[BaseException] = table.setdefault("MISCONF", SnapshotFailedError)
    busy: type[BaseException] = table.setdefault("BUSY", ScriptBusyError)
    return (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError, OSError, OutOfMemoryError,
            ReadOnlyError, MasterDownError, BusyLoadingError, TryAgainError, NoPermissionError, misconf, busy)


class RedisVersionError(errors.StoreUnavailable):
    """The Redis server is older than ``MIN_REDIS_VERSION`` (the server does not start)."""


def check_version(info: dict[str, Any]) -> None:
    """:raises RedisVersionError: ``info`` (``INFO server``) names a version below the minimum."""
    found = str(info.get("redis_version", "unknown"))
    try:
        version = tuple(int(p) for p in found.split(".")[:2])
    except ValueError:
        version = ()
    if version < MIN_REDIS_VERSION:
        want = ".".join(map(str, MIN_REDIS_VERSION))
        raise RedisVersionError(f"Redis {want} or later is required for --store redis; the server runs {found}")


class Breaker:
    """Fail fast after a failure: for a backoff period (``BASE`` doubling to ``CAP`` seconds while
    failures continue) callers are told Redis is unavailable without trying; the first success
    closes it. Thread-safe enough for its use (flags and floats; a race costs one extra try)."""

    BASE = 0.05
    CAP = 2.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.until = 0.0
        self.backoff = 0.0
        self.failures = 0

    @property
    def open(self) -> bool:
        return self.clock() < self.until

    def failed(self) -> float:
        self.failures += 1
        self.backoff = min(self.CAP, self.backoff * 2 if self.backoff else self.BASE)
        self.until = self.clock() + self.backoff
        return self.backoff

    def ok(self) -> None:
        if self.backoff:
            log.info("redis reachable again")
        self.backoff = 0.0
        self.until = 0.0


def once(breaker: Breaker, fn: Callable[[], T]) -> T:
    """One attempt at a Redis call; unreachable Redis is :class:`~hotloop.errors.StoreUnavailable`
    (at once while ``breaker`` is open)."""
    if breaker.open:
        raise errors.StoreUnavailable()
    try:
        out = fn()
    except redis_errors() as exc:
        breaker.failed()
        log.warning("redis unreachable (%s)", type(exc).__name__)
        raise errors.StoreUnavailable() from None
    breaker.ok()
    return out


def sync_client(url: str) -> Any:
    """A redis-py synchronous client for ``url`` (hiredis parser when installed), without
    redis-py's own retries: the callers decide (fail fast, or retry with backoff). ValueError
    when redis-py is not installed (an extra: ``pip install 'hotloop[redis]'``)."""
    try:
        import redis
    except ImportError:
        raise ValueError("--store redis needs the redis package: pip install 'hotloop[redis]'") from None
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    redis_errors()  # (its error classes registered before any reply is parsed)
    return redis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=CONNECT_TIMEOUT,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=30,
    )


_PUT = """
local P, rid, owner, parent = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local base, exp, maxd = tonumber(ARGV[5]), tonumber(ARGV[8]), tonumber(ARGV[14])
-- deleted since (this write's earlier try was done, its answer lost, and the retry came after a
-- DELETE): done, and not brought back
if redis.call('EXISTS', P .. 'd:' .. rid) == 1 then return 1 end
local function rkey(id)
  local o = redis.call('GET', P .. 'o:' .. id)
  if not o then return nil end
  return P .. 't:' .. o .. ':r:' .. id
end
local pk = nil
if parent ~= '' then
  pk = rkey(parent)
  if not pk then return 0 end
  local pend = redis.call('HGET', pk, 'end')
  if not pend or tonumber(pend) ~= base then return 0 end
end
local key = P .. 't:' .. owner .. ':r:' .. rid
local kids = 0
local ok = rkey(rid)
if ok then
  local old = redis.call('HMGET', ok, 'kids', 'parent', 'iids', 'owner')
  kids = tonumber(old[1]) or 0
  if old[3] then
    for _, iid in ipairs(cjson.decode(old[3])) do
      redis.call('ZREM', P .. 'i:' .. iid, tostring(old[4]) .. ' ' .. rid)
    end
  end
  if old[2] and old[2] ~= '' then
    local opk = rkey(old[2])
    if opk and redis.call('EXISTS', opk) == 1 then redis.call('HINCRBY', opk, 'kids', -1) end
  end
  redis.call('DEL', ok)
end
if pk then redis.call('HINCRBY', pk, 'kids', 1) end
redis.call('HSET', key, 'owner', owner, 'parent', parent, 'base', base, 'end', ARGV[6], 'live', 1, 'kids', kids,
  'at', ARGV[7], 'resp', ARGV[9], 'own', ARGV[10], 'iids', ARGV[11], 'states', ARGV[12], 'input_len', ARGV[13])
redis.call('PEXPIREAT', key, exp)
redis.call('SET', P .. 'o:' .. rid, owner, 'PXAT', exp)
for _, iid in ipairs(cjson.decode(ARGV[11])) do
  local ik = P .. 'i:' .. iid
  redis.call('ZADD', ik, ARGV[7], owner .. ' ' .. rid)
  if redis.call('PEXPIRETIME', ik) < exp then redis.call('PEXPIREAT', ik, exp) end
end
local cur, depth = parent, 0
while cur ~= '' and depth < maxd do
  local ck = rkey(cur)
  if not ck then break end
  if redis.call('PEXPIRETIME', ck) >= exp then break end
  redis.call('PEXPIREAT', ck, exp)
  redis.call('PEXPIREAT', P .. 'o:' .. cur, exp)
  cur = redis.call('HGET', ck, 'parent') or ''
  depth = depth + 1
end
return 1
"""

# The live, unexpired response ARGV[2] in scope ARGV[3] ('' = any owner), then its chain:
# {resp, input_len, parent, base, states, owner, complete, base_0, own_0, base_1, own_1, ...}
# from the response up to its root; complete is 0 when the chain is broken or too deep.
_LOAD = """
local P, rid, scope, min_at, maxd = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local owner = redis.call('GET', P .. 'o:' .. rid)
if not owner or (scope ~= '' and owner ~= scope) then return false end
local h = redis.call('HMGET', P .. 't:' .. owner .. ':r:' .. rid,
  'live', 'at', 'resp', 'input_len', 'parent', 'base', 'states', 'own')
if h[1] ~= '1' or tonumber(h[2]) < min_at then return false end
local out = {h[3], h[4], h[5], h[6], h[7], owner, 1, h[6], h[8]}
local parent, depth = h[5], 0
while parent ~= '' do
  local po = nil
  if depth < maxd then po = redis.call('GET', P .. 'o:' .. parent) end
  if not po then out[7] = 0; return out end
  local ph = redis.call('HMGET', P .. 't:' .. po .. ':r:' .. parent, 'parent', 'base', 'own')
  if not ph[3] then out[7] = 0; return out end
  table.insert(out, ph[2]); table.insert(out, ph[3])
  parent = ph[1]
  depth = depth + 1
end
return out
"""

_HEAD = """
local P, rid, scope, min_at = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local owner = redis.call('GET', P .. 'o:' .. rid)
if not owner or (scope ~= '' and owner ~= scope) then return false end
local h = redis.call('HMGET', P .. 't:' .. owner .. ':r:' .. rid, 'live', 'at', 'resp')
if h[1] ~= '1' or tonumber(h[2]) < min_at then return false end
return h[3]
"""

# A live response leaves: a tombstone if it has children, else removed, and then its tombstoned
# ancestors left without children.
_DELETE = """
local P, rid, scope, min_at = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local owner = redis.call('GET', P .. 'o:' .. rid)
if not owner or (scope ~= '' and owner ~= scope) then return 0 end
local ck = P .. 't:' .. owner .. ':r:' .. rid
local h = redis.call('HMGET', ck, 'live', 'iids', 'at')
if h[1] ~= '1' then return 0 end
-- past its time to live it reads as not found (GET answers 404): removed, and not found
local found = 1
if tonumber(h[3]) < min_at then found = 0 end
-- a tombstone keeps what its descendants load (its own items); not the Response object (its
-- instructions, metadata) nor its classifier states, which nothing reads once it is deleted
redis.call('HSET', ck, 'live', 0, 'resp', '', 'states', '')
-- announced with the delete itself: a reply that times out leaves no process unaware of it
redis.call('PUBLISH', ARGV[5], rid)
-- and marked for as long as a write of it may still be retried (_PUT does not bring it back)
redis.call('SET', P .. 'd:' .. rid, 1, 'EX', tonumber(ARGV[6]))
for _, iid in ipairs(cjson.decode(h[2] or '[]')) do
  redis.call('ZREM', P .. 'i:' .. iid, owner .. ' ' .. rid)
end
local cur = rid
while true do
  local n = redis.call('HMGET', ck, 'live', 'kids', 'parent')
  if n[1] ~= '0' or (tonumber(n[2]) or 0) > 0 then break end
  redis.call('DEL', ck, P .. 'o:' .. cur)
  if not n[3] or n[3] == '' then break end
  cur = n[3]
  local o = redis.call('GET', P .. 'o:' .. cur)
  if not o then break end
  ck = P .. 't:' .. o .. ':r:' .. cur
  if redis.call('EXISTS', ck) == 0 then break end  -- evicted: never recreate it without a TTL
  redis.call('HINCRBY', ck, 'kids', -1)
end
return found
"""

# ARGV: prefix, batch id, the batch marker's ttl, MAX_LEDGER_MODELS, OTHER_MODEL, then 9 per row:
# row ("{day}\t{model}\t{key_id}"), responses, input, output, cached, reasoning, flagged,
# findings (JSON), the key's name
_USAGE = """
local P = ARGV[1]
if not redis.call('SET', P .. 'u:batch:' .. ARGV[2], 1, 'NX', 'EX', tonumber(ARGV[3])) then return 0 end
local cap, other = tonumber(ARGV[4]), ARGV[5]
local i = 6
while i <= #ARGV do
  local row = ARGV[i]
  local k = P .. 'ku:' .. row
  if redis.call('EXISTS', k) == 0 then
    local day, model, key = string.match(row, '^([^\t]*)\t([^\t]*)\t(.*)$')
    if model ~= other then
      local names = P .. 'ku:names:' .. day .. '\t' .. key
      if redis.call('SCARD', names) >= cap then
        row = day .. '\t' .. other .. '\t' .. key
        k = P .. 'ku:' .. row
      else
        redis.call('SADD', names, model)
        redis.call('EXPIRE', names, 172800)
      end
    end
  end
  redis.call('SADD', P .. 'ku:rows', row)
  redis.call('HSETNX', k, 'name', ARGV[i + 8])
  redis.call('HINCRBY', k, 'responses', ARGV[i + 1])
  redis.call('HINCRBY', k, 'input_tokens', ARGV[i + 2])
  redis.call('HINCRBY', k, 'output_tokens', ARGV[i + 3])
  redis.call('HINCRBY', k, 'cached_tokens', ARGV[i + 4])
  redis.call('HINCRBY', k, 'reasoning_tokens', ARGV[i + 5])
  redis.call('HINCRBY', k, 'flagged', ARGV[i + 6])
  for kind, n in pairs(cjson.decode(ARGV[i + 7])) do
    redis.call('HINCRBY', k, 'f:' .. kind, n)
  end
  i = i + 9
end
return 1
"""

# Ledger rows keyed by key name (before key ids were recorded) moved into the ``ku:`` rows, at
# most ARGV[2] of them, each under its legacy key id: its name for the self-named tenants
# (ARGV[4] on), ARGV[3] .. name for any other. Each row's fields are added to the row of that id
# (one exists when a self-named tenant wrote since) and its name kept; a model name the key had
# counted that day (u:names, two days at most) is counted in the new names set. Returns the
# number of rows moved (0: none left).
# A row whose model the key's names set of that day does not hold, when that set is full
# (MAX_LEDGER_MODELS, ARGV[4]), is counted under OTHER_MODEL (ARGV[5]), as _USAGE counts it.
# ARGV: prefix, rows per call, LEGACY_KEY_PREFIX, MAX_LEDGER_MODELS, OTHER_MODEL, then the self-named tenants
_MIGRATE_USAGE = """
local P, legacy, cap, other = ARGV[1], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local own = {}
for j = 6, #ARGV do own[ARGV[j]] = true end
local rows = redis.call('SPOP', P .. 'u:rows', tonumber(ARGV[2]))
for _, row in ipairs(rows) do
  local src = P .. 'u:' .. row
  local day, model, name = string.match(row, '^([^\t]*)\t([^\t]*)\t(.*)$')
  local h = redis.call('HGETALL', src)
  if day and #h > 0 then
    local kid = own[name] and name or (legacy .. name)
    local names = P .. 'ku:names:' .. day .. '\t' .. kid
    if model ~= other and redis.call('EXISTS', P .. 'ku:' .. day .. '\t' .. model .. '\t' .. kid) == 0
        and redis.call('SISMEMBER', names, model) == 0 and redis.call('SCARD', names) >= cap then
      model = other
    end
    local new = day .. '\t' .. model .. '\t' .. kid
    local dst = P .. 'ku:' .. new
    for j = 1, #h, 2 do redis.call('HINCRBY', dst, h[j], h[j + 1]) end
    redis.call('HSETNX', dst, 'name', name)
    redis.call('SADD', P .. 'ku:rows', new)
    if model ~= other and redis.call('SISMEMBER', P .. 'u:names:' .. day .. '\t' .. name, model) == 1 then
      redis.call('SADD', names, model)
      redis.call('EXPIRE', names, 172800)
    end
  end
  redis.call('DEL', src)
end
return #rows
"""
MIGRATE_BATCH = 1_000  # legacy ledger rows one migration call moves (each call is atomic)

_COUNTS = USAGE_FIELDS[4:]  # responses, input_tokens, ... reasoning_tokens


def _row_name(text: str) -> str:
    return text.replace("\t", " ")


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisStore:
    """Stored responses, items and the usage ledger in Redis; see the module docstring."""

    shared = True  # other processes write here too: a miss may be a write not yet visible

    def __init__(
        self,
        url: str,
        ttl_seconds: float,
        *,
        prefix: str = PREFIX,
        write_retry_seconds: float = DEFAULT_WRITE_RETRY_SECONDS,
        client: Any = None,
    ) -> None:
        self.url = url
        self.ttl_seconds = ttl_seconds
        self.prefix = prefix
        self.write_retry_seconds = write_retry_seconds
        self.max_ledger_models = MAX_LEDGER_MODELS
        self.r = client if client is not None else sync_client(url)
        self.breaker = Breaker()
        self.available = True  # false while writes are being retried
        self._give_up_at = float("inf")
        self._put = self.r.register_script(_PUT)
        self._load = self.r.register_script(_LOAD)
        self._head = self.r.register_script(_HEAD)
        self._delete = self.r.register_script(_DELETE)
        self._usage = self.r.register_script(_USAGE)
        self._migrate_usage = self.r.register_script(_MIGRATE_USAGE)
        check_version(self._read(lambda: self.r.info("server")))
        self.fingerprint_key = self._shared_key("fpkey", "fingerprint key")
        self.call_id_key = self._shared_key("callidkey", "call id key")
        self.migrate_ledger()

    def _shared_key(self, suffix: str, what: str) -> bytes:
        """A deployment's key under ``P {suffix}``: the fingerprint key (:mod:`hotloop.state.fpkey`),
        one for every replica so that the fingerprints they store agree, and the key of redacted
        call ids' tags, so that a call stored by one replica pairs with its output redacted by
        another. Made by the first to start (``SET NX``), read by the others. It sits beside the
        responses: whoever can read it can read them anyway.

        :raises StoreUnavailable: Redis cannot be reached (the server does not start).
        :raises KeyFileError: what is stored there is not a key."""
        name = self.prefix + suffix

        def get() -> Any:
            self.r.set(name, secrets.token_bytes(fpkey.KEY_LEN), nx=True)
            return self.r.get(name)

        key = self._read(get)
        if not isinstance(key, bytes) or len(key) != fpkey.KEY_LEN:
            raise fpkey.KeyFileError(f"{name} in Redis is not a {fpkey.KEY_LEN}-byte {what}; delete it")
        return key

    # -- calling Redis -------------------------------------------------------------------------

    def _read(self, fn: Callable[[], T]) -> T:
        return once(self.breaker, fn)

    def give_up_by(self, when: float) -> None:
        """Writes retried past ``when`` (monotonic seconds) fail (the server is stopping)."""
        self._give_up_at = when

    def _write(self, fn: Callable[[], T]) -> T:
        """Retry until Redis answers or ``write_retry_seconds`` pass (then StoreUnavailable).
        No attempt is made while the breaker is open, and none once the give-up time has passed
        while Redis is known to be down: queued writes then fail at once, not a connect timeout each."""
        deadline = time.monotonic() + self.write_retry_seconds
        while True:
            deadline = min(deadline, self._give_up_at)
            now = time.monotonic()
            if not self.available or self.breaker.open:  # Redis is known to be down
                if now >= deadline:
                    log.error("a store write failed: redis unreachable (gave up retrying)")
                    raise errors.StoreUnavailable()
                if self.breaker.open:
                    time.sleep(min(self.breaker.until, deadline) - now)
                    continue
            try:
                out = fn()
            except redis_errors() as exc:
                self.breaker.failed()
                if self.available:
                    log.warning("redis unavailable (%s); retrying the store write with backoff", type(exc).__name__)
                self.available = False
                continue
            self.breaker.ok()
            self.available = True
            return out

    def _expire_at_ms(self, now: float) -> int:
        g = max(0.001, min(EXPIRE_GRANULARITY, self.ttl_seconds))
        end = now + self.ttl_seconds
        return int(-(-end // g) * g * 1000)

    def _scope(self, scope: str | None) -> str:
        return "" if scope is None else scope

    # -- ResponseStore -------------------------------------------------------------------------

    def put(self, rec: StoredResponse) -> None:
        """:raises MissingParent: the parent is not stored or its history is not ``base_len`` long."""
        rid = rec.response["id"]
        parent = rec.parent_id if rec.parent_id is not None else ""
        base = rec.base_len if rec.parent_id is not None else 0
        minted = rec.minted
        iids = [
            it["id"] for i, it in enumerate(rec.items) if minted is not None and minted[i] and isinstance(it.get("id"), str)
        ]
        now = time.time()
        args = [
            self.prefix, rid, rec.owner, parent, base, base + len(rec.items), repr(now), self._expire_at_ms(now),
            _enc.encode(rec.response), _enc.encode((rec.items, rec.fps, rec.toks, rec.minted)), json.dumps(iids),
            _enc.encode(rec.states) if rec.states else b"", rec.input_len, MAX_CHAIN_DEPTH,
        ]
        if not self._write(lambda: self._put(args=args)):
            raise MissingParent(rec.parent_id)

    def get(self, response_id: str, scope: str | None = None) -> History | None:
        args = [self.prefix, response_id, self._scope(scope), time.time() - self.ttl_seconds, MAX_CHAIN_DEPTH]
        out = self._read(lambda: self._load(args=args))
        if not out:
            return None
        resp, input_len, parent, base, states, owner, complete = out[:7]
        records = [(int(out[i]), _dec.decode(out[i + 1])) for i in range(7, len(out), 2)]
        items: list[dict[str, Any]] = []
        fps: list[Any] = []
        toks: list[int] = []
        minted: list[bool] = []
        for rbase, (its, rfps, rtoks, rminted) in reversed(records):
            if rbase != len(items):
                complete = 0
                break
            items += its
            fps += rfps
            toks += rtoks
            minted += rminted if rminted is not None else [False] * len(its)
        if not int(complete):
            log.warning("stored response %s has a broken or too deep chain; treated as not found", response_id)
            return None
        return History(
            response=_dec.decode(resp),
            items=items,
            fps=fps,
            toks=toks,
            input_len=int(input_len),
            parent_id=_str(parent) or None,
            base_len=int(base),
            owner=_str(owner),
            minted=minted if any(minted) else None,
            states=_dec.decode(states) if states else None,
        )

    def get_item(self, item_id: str, scope: str | None = None) -> dict[str, Any] | None:
        members = self._read(lambda: self.r.zrevrange(self.prefix + "i:" + item_id, 0, 63))
        holders = [(o, rid) for o, _, rid in (_str(m).partition(" ") for m in members) if scope is None or o == scope]
        if not holders:
            return None

        def fetch() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for o, rid in holders:
                pipe.hmget(f"{self.prefix}t:{o}:r:{rid}", "live", "at", "own")
            return pipe.execute()  # type: ignore[no-any-return]

        min_at = time.time() - self.ttl_seconds
        for live, at, own in self._read(fetch):
            if live != b"1" or at is None or float(at) < min_at or own is None:
                continue
            its, _, _, minted = _dec.decode(own)
            for i, it in enumerate(its):
                if it.get("id") == item_id and minted is not None and minted[i]:
                    return it  # type: ignore[no-any-return]
        return None

    def get_response(self, response_id: str, scope: str | None = None) -> dict[str, Any] | None:
        args = [self.prefix, response_id, self._scope(scope), time.time() - self.ttl_seconds]
        out = self._read(lambda: self._head(args=args))
        return _dec.decode(out) if out else None  # type: ignore[no-any-return]

    def delete(self, response_id: str, scope: str | None = None) -> bool:
        """Delete ``response_id`` (announced on ``DELETED_CHANNEL`` by the same script)."""
        marked = max(DELETED_MARK_MIN_SECONDS, math.ceil(self.write_retry_seconds + 2 * SOCKET_TIMEOUT))
        args = [self.prefix, response_id, self._scope(scope), time.time() - self.ttl_seconds, DELETED_CHANNEL, marked]
        return bool(self._read(lambda: self._delete(args=args)))

    def migrate_ledger(self) -> int:
        """Move ledger rows keyed by key name (see the module docstring) into the rows keyed by
        key id; the number moved. :raises StoreUnavailable: Redis cannot be reached."""
        args = [self.prefix, MIGRATE_BATCH, LEGACY_KEY_PREFIX, self.max_ledger_models, OTHER_MODEL, *SELF_NAMED_TENANTS]
        moved = 0
        while n := int(self._read(lambda: self._migrate_usage(args=args))):
            moved += n
        if moved:
            log.info("moved %d usage ledger rows keyed by key name to legacy key ids", moved)
        return moved

    def record_usage(self, recs: list[UsageRecord]) -> None:
        if not recs:
            return
        rows: dict[str, list[int]] = {}
        names: dict[str, str] = {}
        found: dict[str, dict[str, int]] = defaultdict(dict)
        for r in recs:
            day = time.strftime("%Y-%m-%d", time.gmtime(r.at))
            row = f"{day}\t{_row_name(r.model)}\t{_row_name(r.key)}"
            names.setdefault(row, r.name)
            acc = rows.setdefault(row, [0, 0, 0, 0, 0, 0])
            acc[0] += 1
            acc[1] += r.input_tokens
            acc[2] += r.output_tokens
            acc[3] += r.cached_tokens
            acc[4] += r.reasoning_tokens
            acc[5] += 1 if r.findings else 0
            for kind, n in (r.findings or {}).items():
                found[row][kind] = found[row].get(kind, 0) + n
        ttl = int(max(USAGE_BATCH_MIN_TTL, 2 * self.write_retry_seconds))  # retries stop before that
        args: list[Any] = [self.prefix, uuid.uuid4().hex, ttl, self.max_ledger_models, OTHER_MODEL]
        for row, acc in rows.items():
            args += [row, *acc, json.dumps(found.get(row, {})), names[row]]
        self._write(lambda: self._usage(args=args))

    def usage(
        self, key_id: str | None = None, since: str | None = None, after: UsageRow | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        self.migrate_ledger()  # rows an earlier version's replica wrote meanwhile (a rolling upgrade)
        members = sorted(_str(m) for m in self._read(lambda: self.r.smembers(self.prefix + "ku:rows")))
        wanted = []
        for name in members:
            day, model, kid = name.split("\t")
            if (key_id is None or kid == key_id) and (since is None or day >= since) and (after is None or (day, model, kid) > after):
                wanted.append((day, model, kid, name))
        wanted.sort()
        del wanted[len(wanted) if limit is None else limit :]  # only the page's rows are read

        def fetch() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for *_, name in wanted:
                pipe.hgetall(self.prefix + "ku:" + name)
            return pipe.execute()  # type: ignore[no-any-return]

        out = []
        for (day, model, kid, _), h in zip(wanted, self._read(fetch)):
            shown = h.pop(b"name", None)
            fields = {_str(k): int(v) for k, v in h.items()}
            row: dict[str, Any] = {"day": day, "model": model, "key": kid if shown is None else _str(shown), "key_id": kid}
            row.update({f: fields.get(f, 0) for f in _COUNTS})
            row["flagged"] = fields.get("flagged", 0)
            row["findings"] = dict(sorted((k[2:], n) for k, n in fields.items() if k.startswith("f:")))
            out.append(row)
        return out

    def close(self) -> None:
        self.r.close()
