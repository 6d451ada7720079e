"""Per-key rate limits shared by every replica (``--store redis``): the buckets live in Redis.

The same limits as :class:`~hotloop.tenants.limits.MemoryLimiter` (token buckets refilled
continuously, a token reservation corrected when the response ends, concurrency slots), kept in
Redis and changed by Lua scripts, so a key's limit holds across all replicas: each request is one
atomic script call (one round trip) that refills, checks and takes. Bucket time is Redis's own
clock (``TIME``), so replicas' clocks do not matter.

Key layout (``P`` is ``hotloop:``)::

    P l:{key_id}:rpm        HASH  level, at (Redis time), cap: the requests bucket (no TTL)
    P l:{key_id}:tpm        HASH  the same for the tokens bucket
    P l:{key_id}:inflight   ZSET  grant ids of responses in flight, scored by lease expiry
    P l:{key_id}:x:{gid}    STRING  a grant given up before its admission answered (one lease)

None of these keys has a time to live (the given-up markers excepted): under ``maxmemory`` with a
``volatile-*`` policy Redis evicts the keys closest to expiry first, and an evicted bucket or
lease set would give a key its whole limit again. A bucket is deleted once it is full again (a
full bucket is the same as none); a lease set leaves with its last lease. A
concurrency slot is a lease of ``LEASE_SECONDS`` (60 s) that the process holding it renews while
its response runs: one renewal task per limiter renews every lease the process holds in one
script call every ``RENEW_SECONDS`` (20 s), so a replica that dies with responses in flight frees
their slots within a minute. The grants a process holds (``held``) are its responses in flight.

An admission that fails on this side (the 1 s timeout: Redis slow or unreachable, or the request
cancelled while waiting) may still have taken a slot on Redis. Its grant id is given up: a
background removal takes the slot back and leaves a marker (``x:{gid}``) so that an admission
still on its way to Redis is refused there instead of taking the slot afterwards. Grants given up
wait in ``abandoned`` (at most ``MAX_ABANDONED``; beyond that the oldest are left to their lease)
and are retried whenever Redis answers again; so are releases that failed. A given-up admission's
token reservation is not given back (the bucket refills within a minute).

This is on the request path, so it uses redis-py's asyncio client (hiredis parser) with a short
timeout (``TIMEOUT``, 500 ms). Redis unreachable: the request is refused with a 503
``server_error`` (:class:`~hotloop.errors.StoreUnavailable`) at once; after a failure, requests
fail fast for a backoff period (50 ms doubling to 2 s) and the next one after it tries to
reconnect. A finished response's correction and slot release run in the background; if Redis is
unreachable then, the slot release is retried (as a given-up grant) and the correction is lost
(logged).

The rate-limit headers are rendered from this process's last view of each bucket (the level the
last script call returned, refilled locally since): exact for the request that made the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable

from hotloop import errors
from hotloop.state.redis_store import PREFIX, Breaker, redis_errors
from hotloop.tenants.keys import Limits
from hotloop.tenants.limits import (
    DEFAULT_MAX_KEYS, Grant, RequestsLimited, SharedGrant, TokensLimited, _retry_headers, duration, too_large,
)

log = logging.getLogger("hotloop.tenants")

TIMEOUT = 0.5
LEASE_SECONDS = 60.0  # a concurrency slot's lease, renewed by its holder while the response runs
RENEW_SECONDS = 20.0  # how often a process renews the leases it holds (a third of the lease)
MAX_ABANDONED = 4096  # grant ids waiting for their removal; beyond it the oldest wait for their lease
RENEW_BATCH = 1000  # leases renewed per script call

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
  -- No time to live: under maxmemory with a volatile-* policy (the README's volatile-ttl) the
  -- keys closest to expiry go first, and an evicted bucket would come back full (the limit
  -- lifted under memory pressure). A full bucket is the same as none: it is deleted instead.
  if level >= cap then redis.call('DEL', k); return end
  redis.call('HSET', k, 'level', tostring(level), 'at', tostring(now), 'cap', cap)
  redis.call('PERSIST', k)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

_TAKE = _LUA_REFILL + """
local cap, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local level = refill(KEYS[1], cap, now)
local taken = 0
if level >= n then level = level - n; taken = 1 end
save(KEYS[1], level, now, cap)
return {taken, tostring(level)}
"""

# Admit a response: KEYS[1] tokens bucket, KEYS[2] in-flight set, KEYS[3] the grant's given-up
# marker; ARGV tpm cap (0: none), tokens, max concurrent (0: none), grant id, lease seconds.
# Returns {status, level}: 1 admitted, -1 concurrency, -2 tokens, -3 given up by its caller.
_ADMIT = _LUA_REFILL + """
local cap, n, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if maxc > 0 then
  if redis.call('EXISTS', KEYS[3]) == 1 then return {-3, '0'} end
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
  -- no time to live either (see save): expired leases leave at the next admission, and the
  -- set itself with its last member
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[4])
  redis.call('PERSIST', KEYS[2])
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

# Renew leases: KEYS[i] an in-flight set, ARGV[1] lease seconds, ARGV[i + 1] a grant id held in it.
# A lease already gone (expired, or removed) is not brought back.
_RENEW = """
local t = redis.call('TIME')
local lease = tonumber(ARGV[1])
local exp = tonumber(t[1]) + tonumber(t[2]) / 1000000 + lease
for i, k in ipairs(KEYS) do
  redis.call('ZADD', k, 'XX', 'CH', exp, ARGV[i + 1])
end
return 1
"""

# Give grants up: KEYS[2i - 1] an in-flight set, KEYS[2i] the grant's marker, ARGV[1] lease
# seconds, ARGV[i + 1] the grant id: its slot is removed and its admission, if still on its
# way, is refused.
_ABANDON = """
local ms = math.floor(tonumber(ARGV[1]) * 1000)
for i = 1, #KEYS / 2 do
  redis.call('ZREM', KEYS[2 * i - 1], ARGV[i + 1])
  redis.call('SET', KEYS[2 * i], 1, 'PX', ms)
end
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


class RedisGrant(SharedGrant):
    """An admitted response whose release goes to Redis (in the background)."""

    __slots__ = ("limits", "gid")

    def __init__(self, limiter: "RedisLimiter", key_id: str, limits: Limits, reserved: int, gid: str) -> None:
        super().__init__(limiter, key_id, reserved)
        self.limits = limits
        self.gid = gid


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
        # grant id -> its in-flight set: the leases this process renews (its responses in flight)
        self.held: dict[str, str] = {}
        # grant id -> key id: slots to take back (given-up admissions, failed releases), bounded
        self.abandoned: OrderedDict[str, str] = OrderedDict()
        self._keeper: asyncio.Task[None] | None = None  # renews ``held``, removes ``abandoned``
        self._wake: asyncio.Event | None = None

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio as aredis
            from redis.asyncio.retry import Retry  # (the synchronous one warns, converted, on an asyncio client)
            from redis.backoff import NoBackoff

            redis_errors()  # (its error classes registered before any reply is parsed)
            self._client = aredis.Redis.from_url(
                self.url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT, retry=Retry(NoBackoff(), 0)
            )
            for name, src in (
                ("take", _TAKE), ("admit", _ADMIT), ("finish", _FINISH), ("renew", _RENEW), ("abandon", _ABANDON)
            ):
                self._scripts[name] = self._client.register_script(src)
        return self._client

    def _check(self) -> None:
        """Fail fast while the breaker is open (nothing is sent)."""
        if self.breaker.open:
            raise errors.StoreUnavailable("The rate-limit store is unavailable. Please retry shortly.")

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        self._check()
        return await self._call(name, keys, args)

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
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
            raise too_large(cap, tokens)
        gid = secrets.token_hex(8)
        inflight = self._key(key_id, "inflight")
        self._check()
        try:
            status, level = await self._call(
                "admit",
                [self._key(key_id, "tpm"), inflight, self._key(key_id, "x:" + gid)],
                [cap or 0, tokens, limits.max_concurrent or 0, gid, LEASE_SECONDS],
            )
        except BaseException:  # timed out, unreachable or cancelled: the script may have taken a slot
            if limits.max_concurrent:
                self._abandon(key_id, gid)
            raise
        status, level = int(status), float(level)
        if status == -3:  # given up meanwhile (cannot happen on this path; kept for safety)
            raise errors.StoreUnavailable("The rate-limit store is unavailable. Please retry shortly.")
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
        if limits.max_concurrent:
            self.held[gid] = inflight
            self._keep()
        return RedisGrant(self, key_id, limits, tokens if cap is not None else 0, gid)

    def release(self, grant: RedisGrant, correction: int) -> None:
        """Correct the reservation and free the slot, in the background."""
        leased = self.held.pop(grant.gid, None) is not None  # no longer renewed
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (the server is gone): the lease frees the slot
            return
        task = loop.create_task(self._release(grant, correction, leased))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, grant: RedisGrant, correction: int, leased: bool) -> None:
        cap = grant.limits.tpm
        try:
            await self._run(
                "finish",
                [self._key(grant.key_id, "tpm"), self._key(grant.key_id, "inflight")],
                [cap or 0, correction, grant.gid],
            )
        except errors.StoreUnavailable:
            log.warning("could not release a rate-limit grant of key %s (retried in the background)", grant.key_id)
            if leased:
                self._abandon(grant.key_id, grant.gid)
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

    # -- leases: renewed while held, taken back when given up -------------------------------------

    def _abandon(self, key_id: str, gid: str) -> None:
        """Take the slot of grant ``gid`` back in the background (retried until Redis answers)."""
        self.held.pop(gid, None)
        self.abandoned[gid] = key_id
        while len(self.abandoned) > MAX_ABANDONED:
            self.abandoned.popitem(last=False)  # its lease frees it
        self._keep(wake=True)

    def _keep(self, wake: bool = False) -> None:
        """Start the keeper task on this loop if it is not running; ``wake``: it has slots to take back."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: leases run out on their own
            return
        if self._keeper is None or self._keeper.done() or self._keeper.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._keeper = loop.create_task(self._keeper_loop(), name="hotloop-leases")
        if wake:
            assert self._wake is not None
            self._wake.set()

    async def _keeper_loop(self) -> None:
        assert self._wake is not None
        wake = self._wake
        renew_at = time.monotonic() + RENEW_SECONDS
        while True:
            now = time.monotonic()
            wait = renew_at - now
            if self.abandoned:
                wait = min(wait, self.breaker.until - now)
            if wait > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), wait)
            wake.clear()
            if self.abandoned and not self.breaker.open:
                await self._remove_abandoned()
            now = time.monotonic()
            if now >= renew_at:
                renewed = not self.breaker.open and await self._renew()
                renew_at = now + RENEW_SECONDS if renewed else max(self.breaker.until, now + Breaker.BASE)

    async def _remove_abandoned(self) -> bool:
        batch = list(self.abandoned.items())[:RENEW_BATCH]
        keys: list[str] = []
        for gid, key_id in batch:
            keys += [self._key(key_id, "inflight"), self._key(key_id, "x:" + gid)]
        try:
            await self._call("abandon", keys, [LEASE_SECONDS, *(gid for gid, _ in batch)])
        except errors.StoreUnavailable:
            return False  # kept: retried once Redis answers
        except Exception:
            log.exception("taking back %d rate-limit slots failed (their leases free them)", len(batch))
        for gid, _ in batch:
            self.abandoned.pop(gid, None)
        return True

    async def _renew(self) -> bool:
        held = list(self.held.items())
        try:
            for i in range(0, len(held), RENEW_BATCH):
                chunk = held[i : i + RENEW_BATCH]
                await self._call("renew", [k for _, k in chunk], [LEASE_SECONDS, *(gid for gid, _ in chunk)])
        except errors.StoreUnavailable:
            return False
        except Exception:
            log.exception("renewing %d rate-limit leases failed", len(held))
        return True

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        if self.abandoned and not self.breaker.open:
            await self._remove_abandoned()  # one last try; what is left waits for its lease
        if self._client is not None:
            await self._client.aclose()
            self._client = None

