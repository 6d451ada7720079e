"""Audit of the tenants layer: the three limiters (memory, SQLite file, Redis) give the same
answer to the same request, and a key's default output reservation never makes a request
"too large" that asked for nothing of the kind."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any, Iterator

import pytest

from hotloop.tenants import sqlite_limits
from hotloop.tenants.auth import Tenancy, Tenant
from hotloop.tenants.keys import Limits, MemoryKeyStore
from hotloop.tenants.limits import Grant, LimitExceeded, MemoryLimiter, RequestsLimited, TokensLimited
from hotloop.tenants.redis_limits import RedisLimiter
from hotloop.tenants.sqlite_limits import SQLiteLimiter
from tests.services import Redis, redis_server


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    with redis_server(tmp_path_factory.mktemp("redis")) as r:
        yield r


async def _answer(got: Any) -> Any:
    return await got if inspect.isawaitable(got) else got


async def _admit(lim: Any, key: str, limits: Limits, tokens: int) -> Grant | LimitExceeded:
    try:
        return await _answer(lim.admit(key, limits, tokens))  # type: ignore[no-any-return]
    except LimitExceeded as exc:
        return exc


def _shape(x: Grant | LimitExceeded) -> tuple[str, bool, str | None]:
    """What a client sees of an answer: admitted, or the refusal's kind and whether waiting helps."""
    if isinstance(x, Grant):
        return ("admitted", False, None)
    return (type(x).__name__, "retry-after" in x.headers, x.headers.get("x-should-retry"))


@pytest.mark.parametrize("backend", ["memory", "sqlite", "redis"])
def test_a_request_too_large_for_the_key_is_too_large_even_at_max_concurrent(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A key at its concurrency limit sends a request larger than its whole TPM. Waiting cannot
    help, so every limiter must say "too large" (no retry-after, x-should-retry false); the
    Redis limiter did, the memory and SQLite ones said "too many concurrent requests, retry in
    1 s" (the SDKs retried it, each retry a request of the RPM budget, to a certain refusal)."""

    async def run() -> list[tuple[str, bool, str | None]]:
        if backend == "memory":
            lim: Any = MemoryLimiter()
        elif backend == "sqlite":
            path = sqlite_limits.limits_path(tmp_path / "hotloop.sqlite3")
            sqlite_limits.create(path)
            lim = SQLiteLimiter(path)
        else:
            lim = RedisLimiter(request.getfixturevalue("redis").url, prefix=f"audit-{tmp_path.name}:")
        limits = Limits(tpm=1000, max_concurrent=1)
        try:
            held = await _admit(lim, "k", limits, 10)
            assert isinstance(held, Grant)
            answers = [_shape(await _admit(lim, "k", limits, 5000)), _shape(await _admit(lim, "k", limits, 10))]
            held.finish(10)
            if backend == "redis":
                await asyncio.gather(*lim._tasks)
            answers.append(_shape(await _admit(lim, "k", limits, 5000)))
            return answers
        finally:
            aclose = getattr(lim, "aclose", None)
            if aclose is not None:
                await aclose()

    too_large = ("TokensLimited", False, "false")
    assert asyncio.run(run()) == [too_large, ("RequestsLimited", True, None), too_large]


class _Recorder:
    """A limiter that records what it was asked to admit (and admits it)."""

    def __init__(self) -> None:
        self.inner = MemoryLimiter()
        self.asked: list[int] = []

    def take_request(self, key_id: str, limits: Limits) -> None:
        self.inner.take_request(key_id, limits)

    def admit(self, key_id: str, limits: Limits, tokens: int) -> Grant:
        self.asked.append(tokens)
        return self.inner.admit(key_id, limits, tokens)

    def headers(self, key_id: str, limits: Limits) -> list[tuple[bytes, bytes]]:
        return self.inner.headers(key_id, limits)


def test_the_default_output_reservation_never_exceeds_what_the_key_allows() -> None:
    """A key with ``--tpm 3000`` and a request without ``max_output_tokens``: the server's own
    default reservation (4,096 output tokens) made every such request "Request too large ...
    Requested 4100" (a 429 with x-should-retry false: never retried), so the key could not make
    a single one, not even a ``generate: false`` warm-up. The default is an estimate, not what
    the client asked for: it is capped by a quarter of the key's TPM and by what the TPM leaves
    after the input (so neither "too large" nor a full bucket needed for each response)."""
    rec = _Recorder()
    tenancy = Tenancy(MemoryKeyStore(), admin_key="sk-admin-audit", limiter=rec, output_reserve=4096)
    small = Tenant("key_small", "small", Limits(tpm=3000), key_hash=b"h")
    grant = tenancy.admit_response(small, 4, None)
    assert isinstance(grant, Grant)
    assert rec.asked == [4 + 750]  # the input plus a quarter of the TPM for the output
    grant.finish(20)
    # what the client asked for is reserved as asked: too large is still too large
    with pytest.raises(TokensLimited) as ei:
        tenancy.admit_response(small, 4, 3000)
    assert "Requested 3004" in ei.value.message and "retry-after" not in ei.value.headers
    # an input over the whole TPM is too large whatever the output
    with pytest.raises(TokensLimited):
        tenancy.admit_response(small, 3001, None)
    # an input that leaves less than the quarter: the rest
    g1 = tenancy.admit_response(Tenant("key_small2", "small2", Limits(tpm=3000), key_hash=b"i"), 2900, None)
    assert isinstance(g1, Grant) and rec.asked[-1] == 3000
    g1.finish(2900)
    # a key whose TPM leaves room keeps the whole default reservation
    big = Tenant("key_big", "big", Limits(tpm=100_000), key_hash=b"g")
    g2 = tenancy.admit_response(big, 4, None)
    assert isinstance(g2, Grant) and rec.asked[-1] == 4 + 4096
    g2.finish(10)
    # concurrency-only keys still get their slot
    conc = Tenant("key_c", "c", Limits(max_concurrent=1), key_hash=b"c")
    g3 = tenancy.admit_response(conc, 4, None)
    assert isinstance(g3, Grant)
    with pytest.raises(RequestsLimited):
        tenancy.admit_response(conc, 4, None)
    g3.finish(5)


# -- rotation ---------------------------------------------------------------------------------------


def _scope(secret: str) -> dict[str, Any]:
    return {"headers": [(b"authorization", b"Bearer " + secret.encode())]}


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
def test_a_rotated_key_is_the_same_tenant_under_a_new_secret(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """``hotloop keys rotate``: the new secret authenticates as the same key id (the owner of
    what the key stored), the old one is refused once the table is re-read, by ``authenticate``
    and by ``verify`` (a WebSocket opened with the old secret), and a second server that only
    watches the table (its version) sees the rotation too."""
    from hotloop import errors
    from hotloop.tenants.keys import SQLiteKeyStore
    from hotloop.tenants.redis_keys import RedisKeyStore

    def store() -> Any:
        if kind == "memory":
            return shared
        if kind == "sqlite":
            return SQLiteKeyStore(tmp_path / "k.sqlite3")
        return RedisKeyStore(request.getfixturevalue("redis").url, prefix=f"rot-{tmp_path.name}:")

    shared = MemoryKeyStore()
    server_side, cli_side = store(), store()

    async def main() -> None:
        t = Tenancy(server_side, admin_key="sk-admin")
        rec, old = cli_side.create("alice", Limits(rpm=10, max_concurrent=2))
        # created last: rotating the newest key must still change the version (SQLite rowids)
        alice = await t.authenticate(_scope(old))
        before = server_side.version()
        new = cli_side.rotate("alice")
        assert new is not None and new != old and new.startswith("hl-") and len(new) == 46
        assert server_side.version() != before
        assert cli_side.rotate("nobody") is None
        rotated = await t.authenticate(_scope(new))  # a miss re-reads the table
        assert rotated.id == alice.id == rec.id and rotated.limits == alice.limits and rotated.name == "alice"
        with pytest.raises(errors.AuthenticationFailed):
            await t.authenticate(_scope(old))
        with pytest.raises(errors.AuthenticationFailed) as ei:
            t.admit(alice)  # the old secret's connection, on its next response.create
        assert ei.value.status == 401 and ei.value.code == "invalid_api_key"
        t.admit(rotated)
        [listed] = [k for k in cli_side.list() if k.name == "alice"]
        assert listed.active and listed.id == rec.id and listed.limits == rec.limits and listed.created_at == rec.created_at
        # the watcher's path: a table re-read because its version changed (no miss involved)
        t2 = Tenancy(store(), admin_key="sk-admin")
        again = await t2.authenticate(_scope(new))
        newer = cli_side.rotate("alice")
        assert newer is not None
        await t2.refresh()
        with pytest.raises(errors.AuthenticationFailed):
            t2.admit(again)
        assert (await t2.authenticate(_scope(newer))).id == rec.id
        # revoking still works after a rotation, and frees the name
        assert cli_side.revoke("alice")
        await t2.refresh()
        with pytest.raises(errors.AuthenticationFailed):
            await t2.authenticate(_scope(newer))
        await t.close()
        await t2.close()

    asyncio.run(main())
    if kind != "memory":
        cli_side.close()
