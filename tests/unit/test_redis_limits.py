"""The Redis rate limiter and key store against a real ``redis-server``: two limiters (two
replicas) share one key's buckets, token reservations are corrected, concurrency slots are
shared and released, an unreachable Redis is a 503; keys created and revoked are seen by all."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

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
