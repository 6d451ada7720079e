"""The Redis rate limiter and key store against a real ``redis-server``: two limiters (two
replicas) share one key's buckets, token reservations are corrected, concurrency slots are
shared and released, leased and renewed, taken back when an admission is given up; an unreachable
Redis is a 503; keys created and revoked are seen by all."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from hotloop import errors
from hotloop.tenants.keys import KeyExists, Limits
from hotloop.tenants.limits import RequestsLimited, TokensLimited
from hotloop.tenants.redis_keys import RedisKeyStore
from hotloop.tenants.redis_limits import RedisLimiter
from tests.services import Redis, redis_server


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    with redis_server(tmp_path_factory.mktemp("redis")) as r:
        yield r


def pair(redis: Redis, prefix: str) -> tuple[RedisLimiter, RedisLimiter]:
    return RedisLimiter(redis.url, prefix=prefix), RedisLimiter(redis.url, prefix=prefix)


async def close(*limiters: RedisLimiter) -> None:
    for lim in limiters:
        await lim.aclose()


def test_requests_bucket_is_shared(redis: Redis) -> None:
    async def run() -> None:
        a, b = pair(redis, "rpm:")
        limits = Limits(rpm=3)
        await a.take_request("k", limits)
        await b.take_request("k", limits)
        await a.take_request("k", limits)
        with pytest.raises(RequestsLimited) as exc:
            await b.take_request("k", limits)
        assert "retry-after" in exc.value.headers
        assert dict(b.headers("k", limits))[b"x-ratelimit-remaining-requests"] == b"0"
        await a.take_request("other", limits)  # another key has its own bucket
        await close(a, b)

    asyncio.run(run())


def test_tokens_reserved_then_corrected(redis: Redis) -> None:
    async def run() -> None:
        a, b = pair(redis, "tpm:")
        limits = Limits(tpm=1000)
        with pytest.raises(TokensLimited):
            await a.admit("k", limits, 1001)  # larger than the limit: never admitted
        g = await a.admit("k", limits, 800)
        with pytest.raises(TokensLimited):
            await b.admit("k", limits, 300)  # the other replica sees the reservation
        g.finish(100)  # only 100 were used: 700 come back
        await asyncio.gather(*a._tasks)
        g2 = await b.admit("k", limits, 800)
        g2.finish(None)
        await asyncio.gather(*b._tasks)
        await close(a, b)

    asyncio.run(run())


def test_concurrency_slots_are_shared_and_released(redis: Redis) -> None:
    async def run() -> None:
        a, b = pair(redis, "conc:")
        limits = Limits(max_concurrent=2)
        g1 = await a.admit("k", limits, 1)
        g2 = await b.admit("k", limits, 1)
        with pytest.raises(RequestsLimited):
            await a.admit("k", limits, 1)
        g1.finish(1)
        g1.finish(1)  # idempotent
        await asyncio.gather(*a._tasks)
        g3 = await b.admit("k", limits, 1)
        for g in (g2, g3):
            g.finish(1)
        await asyncio.gather(*b._tasks)
        await close(a, b)

    asyncio.run(run())


def test_unreachable_redis_is_a_503(tmp_path: Path) -> None:
    async def run(r: Redis) -> None:
        lim = RedisLimiter(r.url)
        await lim.take_request("k", Limits(rpm=10))
        r.stop()
        with pytest.raises(errors.StoreUnavailable) as exc:
            await lim.take_request("k", Limits(rpm=10))
        assert exc.value.status == 503 and exc.value.type == "server_error"
        with pytest.raises(errors.StoreUnavailable):  # fails fast while backing off
            await lim.admit("k", Limits(tpm=10), 1)
        r.start()
        await asyncio.sleep(lim.breaker.backoff)
        await lim.take_request("k", Limits(rpm=10))  # reconnected
        await lim.aclose()

    with redis_server(tmp_path) as r:
        asyncio.run(run(r))


def test_key_store_shared(redis: Redis) -> None:
    a, b = RedisKeyStore(redis.url, prefix="keys:"), RedisKeyStore(redis.url, prefix="keys:")
    try:
        v0 = b.version()
        rec, secret = a.create("alice", Limits(rpm=5))
        assert secret.startswith("hl-") and b.version() != v0
        listed = b.list()
        assert [(k.name, k.limits, k.active, k.hash) for k in listed] == [("alice", Limits(rpm=5), True, rec.hash)]
        with pytest.raises(KeyExists):
            b.create("alice")
        v1 = b.version()
        assert b.revoke("alice") and not a.revoke("alice")
        assert a.version() != v1 and not a.list()[0].active
        a.create("alice")  # a revoked key's name may be given again
        a.touch({rec.id: 123.0})
        assert b.list()[0].last_used == 123.0
    finally:
        a.close()
        b.close()


def stall(redis: Redis, seconds: float) -> threading.Thread:
    """Redis busy for ``seconds`` (a script that spins: a slow command, a fork, a failover)."""
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    spin = "local t0 = redis.call('TIME') while (redis.call('TIME')[1] - t0[1]) * 1e6 + redis.call('TIME')[2] - t0[2] < %d do end return 1"
    t = threading.Thread(target=lambda: (client.eval(spin % int(seconds * 1e6), 0), client.close()))
    t.start()
    return t


async def until(cond: Any, what: str, bound: float = 8.0) -> None:
    deadline = time.monotonic() + bound
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_a_given_up_admission_gives_its_slot_back(redis: Redis) -> None:
    """An admission that times out (Redis stalled) or is cancelled while it waits may still take
    a slot on Redis once Redis runs it; the limiter takes it back, so max_concurrent=1 is not
    refused for the lease's length."""
    import redis as redis_py

    async def run() -> None:
        lim = RedisLimiter(redis.url, prefix="given:")
        r = redis_py.Redis.from_url(redis.url)
        limits = Limits(max_concurrent=1)
        inflight = "given:l:k:inflight"
        g = await lim.admit("k", limits, 1)
        g.finish(1)
        await asyncio.gather(*lim._tasks)
        # timed out: the script runs after the stall and takes the slot; the limiter takes it back
        t = stall(redis, 1.5)
        await asyncio.sleep(0.1)
        with pytest.raises(errors.StoreUnavailable):
            await lim.admit("k", limits, 1)
        await asyncio.to_thread(t.join)
        # Redis frees the slot before the limiter has read the script's answer: wait for both
        await until(lambda: r.zcard(inflight) == 0 and not lim.abandoned, "the slot to be taken back")
        await asyncio.sleep(lim.breaker.until - time.monotonic())
        (await lim.admit("k", limits, 1)).finish(1)
        await asyncio.gather(*lim._tasks)
        # cancelled while waiting (the client went away)
        t = stall(redis, 0.6)
        await asyncio.sleep(0.1)
        task = asyncio.get_running_loop().create_task(lim.admit("k", limits, 1))  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.to_thread(t.join)
        await until(lambda: r.zcard(inflight) == 0 and not lim.abandoned, "the cancelled admission's slot")
        # given up before Redis ran it: the admission is refused there and takes nothing
        assert r.exists("given:l:k:x:gone") == 0
        await lim._call("abandon", [inflight, "given:l:k:x:gone"], [60, "gone"])
        status, _ = await lim._call("admit", ["given:l:k:tpm", inflight, "given:l:k:x:gone"], [0, 1, 1, "gone", 60])
        assert int(status) == -3 and r.zcard(inflight) == 0
        (await lim.admit("k", limits, 1)).finish(1)
        await lim.aclose()
        r.close()

    asyncio.run(run())


def test_leases_are_renewed_by_their_holder_and_lapse_without_it(redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot is a short lease its holder renews while the response runs; a holder that dies
    (its renewals stop) frees the slot when the lease runs out."""
    import hotloop.tenants.redis_limits as rl

    assert rl.LEASE_SECONDS <= 60 and rl.RENEW_SECONDS < rl.LEASE_SECONDS / 2
    monkeypatch.setattr(rl, "LEASE_SECONDS", 1.0)
    monkeypatch.setattr(rl, "RENEW_SECONDS", 0.3)

    async def run() -> None:
        a, b = pair(redis, "lease:")
        limits = Limits(max_concurrent=1)
        g = await a.admit("k", limits, 1)
        assert a.held
        await asyncio.sleep(1.6)  # longer than the lease: renewed
        with pytest.raises(RequestsLimited):
            await b.admit("k", limits, 1)
        assert a._keeper is not None
        a._keeper.cancel()  # the holder dies: no more renewals
        await asyncio.sleep(1.2)
        (await b.admit("k", limits, 1)).finish(1)
        g.finish(1)
        await close(a, b)

    asyncio.run(run())


def test_a_bucket_in_debt_outlives_its_debt(redis: Redis) -> None:
    """A response that used far more tokens than it reserved leaves the bucket below zero; it is
    kept (no time to live: an expiring or evicted bucket comes back full) until it is full again."""
    import redis as redis_py

    async def run() -> None:
        lim = RedisLimiter(redis.url, prefix="debt:")
        g = await lim.admit("k", Limits(tpm=600), 100)
        g.finish(3100)  # 3,000 over: at 600 a minute, about 300 s to fill again
        await asyncio.gather(*lim._tasks)
        ttl = redis_py.Redis.from_url(redis.url).pttl(lim._key("k", "tpm"))
        assert ttl == -1, ttl  # no time to live: never the first key volatile-ttl evicts
        with pytest.raises(TokensLimited):
            await lim.admit("k", Limits(tpm=600), 100)
        await close(lim)

    asyncio.run(run())


def test_redis_refusing_writes_is_a_503(redis: Redis) -> None:
    """Out of memory (maxmemory), or a read-only replica: the limiter's scripts failed with a
    500 and a traceback, where Redis being down is a 503."""
    import redis as redis_py

    admin = redis_py.Redis.from_url(redis.url)

    async def run() -> None:
        lim = RedisLimiter(redis.url, prefix="oom:")
        await lim.take_request("k", Limits(rpm=10))
        admin.config_set("maxmemory", "1")
        try:
            with pytest.raises(errors.StoreUnavailable):
                await lim.take_request("k", Limits(rpm=10))
        finally:
            admin.config_set("maxmemory", "0")
        await close(lim)

    asyncio.run(run())


def test_a_key_table_emptied_and_refilled_is_read_again(redis: Redis) -> None:
    """Redis restarted without its data (or a FLUSHDB) and as many keys created again: the
    counters were the same as before, so the table was never read again: the lost key worked on,
    the new one was refused."""
    import redis as redis_py

    from hotloop.tenants import Tenancy

    keys = RedisKeyStore(redis.url, prefix="aba:")
    _, old = keys.create("ci")

    async def run() -> tuple[str, str]:
        t = Tenancy(keys, None)
        assert (await t.authenticate({"headers": [(b"authorization", b"Bearer " + old.encode())]})).name == "ci"
        r = redis_py.Redis.from_url(redis.url)
        r.delete(*r.keys("aba:*"))
        _, new = keys.create("ci")
        await t.refresh()
        out = []
        for secret in (old, new):
            try:
                out.append((await t.authenticate({"headers": [(b"authorization", b"Bearer " + secret.encode())]})).name)
            except errors.AuthenticationFailed:
                out.append("401")
        t._pool.shutdown()
        return out[0], out[1]

    try:
        assert asyncio.run(run()) == ("401", "ci")
    finally:
        keys.close()
