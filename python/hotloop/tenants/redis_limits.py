"""Per-key rate limits shared by every replica (``--store redis``): the buckets live in Redis.

The same limits as :class:`~hotloop.tenants.limits.MemoryLimiter` (token buckets refilled
continuously, a token reservation corrected when the response ends, concurrency slots), kept in
Redis and changed by Lua scripts, so a key's limit holds across all replicas: each request is one
atomic script call (one round trip) that refills, checks and takes. Bucket time is Redis's own
clock (``TIME``), so replicas' clocks do not matter.

Key layout (``P`` is ``hotloop:``)::

    P l:{key_id}:rpm        HASH  level, at (Redis time), cap: the requests bucket
    P l:{key_id}:tpm        HASH  the same for the tokens bucket
    P l:{key_id}:inflight   ZSET  grant ids of responses in flight, scored by lease expiry

A bucket's keys expire two minutes after their last use (a full bucket is the same as none). A
concurrency slot is a lease of ``LEASE_SECONDS`` (1 hour): a replica that dies with responses in
flight frees their slots when the leases run out.

This is on the request path, so it uses redis-py's asyncio client (hiredis parser) with a short
timeout (``TIMEOUT``, 500 ms). Redis unreachable: the request is refused with a 503
``server_error`` (:class:`~hotloop.errors.StoreUnavailable`) at once; after a failure, requests
fail fast for a backoff period (50 ms doubling to 2 s) and the next one after it tries to
reconnect. A finished response's correction and slot release run in the background; if Redis is
unreachable then, the lease frees the slot later and the correction is lost (logged).

The rate-limit headers are rendered from this process's last view of each bucket (the level the
last script call returned, refilled locally since): exact for the request that made the call.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable

from hotloop import errors
from hotloop.state.redis_store import PREFIX, Breaker, redis_errors
from hotloop.tenants.keys import Limits
from hotloop.tenants.limits import (
    DEFAULT_MAX_KEYS, Grant, RequestsLimited, TokensLimited, _retry_headers, duration,
)

log = logging.getLogger("hotloop.tenants")

TIMEOUT = 0.5
LEASE_SECONDS = 3600.0
BUCKET_TTL_MS = 120_000

# Refill and take: KEYS[1] the bucket; ARGV cap, n, force (1: take even below n, the correction).
# Returns {taken (1/0), level, Redis time} (numbers as strings: Lua numbers reply as integers).
_LUA_REFILL = """
local function refill(k, cap, now)
  local h = redis.call('HMGET', k, 'level', 'at', 'cap')
  local level, at = tonumber(h[1]), tonumber(h[2])
  if level == nil or tonumber(h[3]) ~= cap then return cap end
  if now > at then level = math.min(cap, level + (now - at) * cap / 60) end
  return level
end
local function save(k, level, now, cap)
  redis.call('HSET', k, 'level', tostring(level), 'at', tostring(now), 'cap', cap)
  redis.call('PEXPIRE', k, %d)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
""" % BUCKET_TTL_MS

_TAKE = _LUA_REFILL + """
local cap, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local level = refill(KEYS[1], cap, now)
local taken = 0
if level >= n then level = level - n; taken = 1 end
save(KEYS[1], level, now, cap)
return {taken, tostring(level)}
"""

# Admit a response: KEYS[1] tokens bucket, KEYS[2] in-flight set; ARGV tpm cap (0: none), tokens,
# max concurrent (0: none), grant id, lease seconds. Returns {status, level}: 1 admitted,
# -1 concurrency, -2 tokens.
_ADMIT = _LUA_REFILL + """
local cap, n, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= maxc then return {-1, '0'} end
end
local level = 0
if cap > 0 then
  level = refill(KEYS[1], cap, now)
  if level < n then save(KEYS[1], level, now, cap); return {-2, tostring(level)} end
  level = level - n
  save(KEYS[1], level, now, cap)
end
if maxc > 0 then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[4])
  redis.call('PEXPIRE', KEYS[2], math.floor(tonumber(ARGV[5]) * 1000))
end
return {1, tostring(level)}
"""

# A response ended: KEYS[1] tokens bucket, KEYS[2] in-flight set; ARGV tpm cap (0: none),
# correction (reserved - used), grant id.
_FINISH = _LUA_REFILL + """
local cap = tonumber(ARGV[1])
if cap > 0 then
  local level = math.min(cap, refill(KEYS[1], cap, now) + tonumber(ARGV[2]))
  save(KEYS[1], level, now, cap)
end
redis.call('ZREM', KEYS[2], ARGV[3])
return 1
"""


class _View:
    """This process's last view of one bucket: its level at a local monotonic time."""

    __slots__ = ("cap", "level", "at")

    def __init__(self, cap: int, level: float, at: float) -> None:
        self.cap = cap
        self.level = level
        self.at = at

    def now_level(self, now: float) -> float:
        return min(self.cap, self.level + max(0.0, now - self.at) * self.cap / 60.0)


class RedisGrant(Grant):
    """An admitted response whose release goes to Redis (in the background)."""

    __slots__ = ("limiter", "key_id", "limits", "gid")

    def __init__(self, limiter: "RedisLimiter", key_id: str, limits: Limits, reserved: int, gid: str) -> None:
        self.limiter = limiter
        self.key_id = key_id
        self.limits = limits
        self.reserved = reserved
        self.gid = gid
        self.done = False

    def finish(self, used: int | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.limiter.release(self, self.reserved - (used or 0))


class RedisLimiter:
    """:class:`~hotloop.tenants.limits.Limiter` whose buckets are in Redis (asynchronous calls)."""

    def __init__(
        self, url: str, *, prefix: str = PREFIX, max_keys: int = DEFAULT_MAX_KEYS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.max_keys = max_keys
        self.clock = clock
        self.breaker = Breaker()
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        self._views: OrderedDict[tuple[str, str], _View] = OrderedDict()  # (key id, kind), bounded by max_keys * 2
        self._tasks: set[asyncio.Task[None]] = set()

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio as aredis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self._client = aredis.Redis.from_url(
                self.url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT, retry=Retry(NoBackoff(), 0)
            )
            for name, src in (("take", _TAKE), ("admit", _ADMIT), ("finish", _FINISH)):
                self._scripts[name] = self._client.register_script(src)
        return self._client

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        if self.breaker.open:
            raise errors.StoreUnavailable("The rate-limit store is unavailable. Please retry shortly.")
        self._redis()
        try:
            out = await asyncio.wait_for(self._scripts[name](keys=keys, args=args), TIMEOUT * 2)
        except (redis_errors() + (asyncio.TimeoutError,)) as exc:
            self.breaker.failed()
            log.warning("redis unavailable for rate limits (%s); answering 503", type(exc).__name__)
            raise errors.StoreUnavailable("The rate-limit store is unavailable. Please retry shortly.") from None
        self.breaker.ok()
        return out

    def _key(self, key_id: str, kind: str) -> str:
        return f"{self.prefix}l:{key_id}:{kind}"

    def _see(self, key_id: str, kind: str, cap: int, level: float) -> None:
        views = self._views
        views[(key_id, kind)] = _View(cap, level, self.clock())
        views.move_to_end((key_id, kind))
        while len(views) > 2 * self.max_keys:
            views.popitem(last=False)

    # -- the Limiter interface -----------------------------------------------------------------

    def take_request(self, key_id: str, limits: Limits) -> Awaitable[None]:
        return self._take_request(key_id, limits)

    async def _take_request(self, key_id: str, limits: Limits) -> None:
        cap = limits.rpm
        if cap is None:
            return
        taken, level = await self._run("take", [self._key(key_id, "rpm")], [cap, 1])
        level = float(level)
        self._see(key_id, "rpm", cap, level)
        if not int(taken):
            wait = (1 - level) * 60.0 / cap
            raise RequestsLimited(
                f"Rate limit reached on requests per min (RPM): Limit {cap}, Used {cap}, "
                f"Requested 1. Please try again in {duration(wait)}.",
                headers=_retry_headers(wait),
            )

    def admit(self, key_id: str, limits: Limits, tokens: int) -> Awaitable[Grant]:
        return self._admit(key_id, limits, tokens)

    async def _admit(self, key_id: str, limits: Limits, tokens: int) -> Grant:
        cap = limits.tpm
        if cap is not None and tokens > cap:
            raise TokensLimited(
                f"Request too large on tokens per min (TPM): Limit {cap}, Requested {tokens}. "
                "The input or output tokens must be reduced in order to run successfully."
            )
        gid = secrets.token_hex(8)
        status, level = await self._run(
            "admit",
            [self._key(key_id, "tpm"), self._key(key_id, "inflight")],
            [cap or 0, tokens, limits.max_concurrent or 0, gid, LEASE_SECONDS],
        )
        status, level = int(status), float(level)
        if cap is not None and status != -1:
            self._see(key_id, "tpm", cap, level)
        if status == -1:
            raise RequestsLimited(
                f"Too many concurrent requests: Limit {limits.max_concurrent}. "
                "Please try again once a response in progress has finished.",
                headers=_retry_headers(1.0),
            )
        if status == -2:
            assert cap is not None
            wait = (tokens - level) * 60.0 / cap
            raise TokensLimited(
                f"Rate limit reached on tokens per min (TPM): Limit {cap}, Used {cap - max(0, int(level))}, "
                f"Requested {tokens}. Please try again in {duration(wait)}.",
                headers=_retry_headers(wait),
            )
        return RedisGrant(self, key_id, limits, tokens if cap is not None else 0, gid)

    def release(self, grant: RedisGrant, correction: int) -> None:
        """Correct the reservation and free the slot, in the background."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (the server is gone): the lease frees the slot
            return
        task = loop.create_task(self._release(grant, correction))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, grant: RedisGrant, correction: int) -> None:
        cap = grant.limits.tpm
        try:
            await self._run(
                "finish",
                [self._key(grant.key_id, "tpm"), self._key(grant.key_id, "inflight")],
                [cap or 0, correction, grant.gid],
            )
        except errors.StoreUnavailable:
            log.warning("could not release a rate-limit grant of key %s (its lease frees it)", grant.key_id)
            return
        view = self._views.get((grant.key_id, "tpm"))
        if view is not None and cap is not None:
            now = self.clock()
            view.level, view.at = min(cap, view.now_level(now) + correction), now

    def headers(self, key_id: str, limits: Limits) -> list[tuple[bytes, bytes]]:
        now = self.clock()
        out: list[tuple[bytes, bytes]] = []
        for kind, cap in (("requests", limits.rpm), ("tokens", limits.tpm)):
            if cap is None:
                continue
            view = self._views.get((key_id, "rpm" if kind == "requests" else "tpm"))
            level = float(cap) if view is None or view.cap != cap else view.now_level(now)
            reset = (cap - level) * 60.0 / cap
            out += [
                (b"x-ratelimit-limit-" + kind.encode(), str(cap).encode()),
                (b"x-ratelimit-remaining-" + kind.encode(), str(max(0, int(level))).encode()),
                (b"x-ratelimit-reset-" + kind.encode(), duration(reset).encode()),
            ]
        return out

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

