"""Unknown secrets are remembered (a bounded negative cache in :class:`Tenancy`): a client sending
a bad key in a loop costs the key table one read, not one per request, and with Redis down such a
key is still refused with a 401 (not a 503). Keys created, rotated or restored meanwhile work at
once (new secrets were never refused) or after the next table read (the cache is dropped whenever
the key table changes). Real SQLite key stores on a file and a real ``redis-server``."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from hotloop import errors
from hotloop.tenants import ANONYMOUS, Tenancy, Tenant
from hotloop.tenants.keys import KeyRecord, KeyStore, Limits, MemoryKeyStore, SQLiteKeyStore, hash_secret
from tests.services import Redis, redis_server

N = 50  # requests with one bad key


class Counting:
    """A key store that counts the key table's reads (``version`` and ``list``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads = 0

    def version(self) -> tuple[int, int, int]:
        self.reads += 1
        return self.inner.version()  # type: ignore[no-any-return]

    def list(self) -> list[KeyRecord]:
        self.reads += 1
        return self.inner.list()  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def scope(secret: str) -> dict[str, Any]:
    return {"headers": [(b"authorization", b"Bearer " + secret.encode())]}


async def who(t: Tenancy, secret: str) -> str:
    """The tenant's name, ``401`` or ``503``."""
    try:
        tenant: Tenant = await t.authenticate(scope(secret))
    except errors.AuthenticationFailed as exc:
        assert exc.status == 401
        return "401"
    except errors.StoreUnavailable as exc:
        assert exc.status == 503
        return "503"
    return tenant.name


def bogus() -> str:
    return "hl-" + secrets.token_urlsafe(32)


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[Counting, SQLiteKeyStore]]:
    """The server's key store (counted) and the CLI's (another connection to the same file)."""
    path = tmp_path / "hotloop.sqlite3"
    server, cli = Counting(SQLiteKeyStore(path)), SQLiteKeyStore(path)
    try:
        yield server, cli
    finally:
        server.inner.close()
        cli.close()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def tenancy(store: Any, admin: str | None = None) -> Tenancy:
    return Tenancy(store, admin)


def test_a_bad_key_in_a_loop_reads_the_key_table_once(stores: tuple[Counting, SQLiteKeyStore]) -> None:
    server, cli = stores
    _, good = cli.create("alice")

    async def main() -> tuple[int, int]:
        t = tenancy(server)
        try:
            bad = bogus()
            before = server.reads
            assert [await who(t, bad) for _ in range(N)] == ["401"] * N
            bad_reads = server.reads - before
            # a valid key is not slowed down, and a second bad key costs one read of its own
            before = server.reads
            assert await who(t, good) == "alice"
            assert [await who(t, bogus()) for _ in range(3)] == ["401"] * 3
            return bad_reads, server.reads - before
        finally:
            await t.close()

    bad_reads, others = run(main())
    # before the negative cache: N reads (one version() per request)
    assert bad_reads == 1, f"{bad_reads} key-table reads for {N} requests with one bad key"
    assert others == 3


def test_a_key_created_meanwhile_works_at_once(stores: tuple[Counting, SQLiteKeyStore]) -> None:
    server, cli = stores
    cli.create("alice")

    async def main() -> None:
        t = tenancy(server)
        try:
            bad = bogus()
            assert await who(t, bad) == await who(t, bad) == "401"
            _, new = cli.create("bob")  # `hotloop keys create bob`: no background refresh in between
            assert await who(t, new) == "bob"
            assert await who(t, bad) == "401"  # the table changed: read again, still unknown
        finally:
            await t.close()

    run(main())


def test_a_revoked_key_stays_refused_and_a_rotated_keys_new_secret_works_at_once(
    stores: tuple[Counting, SQLiteKeyStore],
) -> None:
    server, cli = stores
    _, alice = cli.create("alice")
    _, bob = cli.create("bob")

    async def main() -> None:
        t = tenancy(server)
        t.NEGATIVE_SECONDS = 0.2  # type: ignore[misc]  # (the instance's: the TTL runs out within the test)
        try:
            assert await who(t, alice) == "alice" and await who(t, bob) == "bob"
            cli.revoke("alice")
            new_bob = cli.rotate("bob")
            assert new_bob is not None
            assert await who(t, new_bob) == "bob"  # the new secret at once (its miss reads the table)
            for _ in range(3):
                assert await who(t, alice) == "401"
                assert await who(t, bob) == "401"  # the old secret
            before = server.reads
            for _ in range(N):
                assert await who(t, alice) == "401"
            assert server.reads - before == 0, "the revoked secret was remembered after its first refusal"
            await asyncio.sleep(0.25)  # the entry's time is up: read again, still refused
            await t.refresh()  # the watcher's look (nothing changed)
            assert await who(t, alice) == "401" and await who(t, bob) == "401"
            assert await who(t, new_bob) == "bob"
        finally:
            await t.close()

    run(main())


def test_a_table_change_drops_what_was_remembered() -> None:
    """A secret refused while its key was missing from the table (a store restored from a backup
    after being emptied) works once the table has been read again: the watcher's next look (1 s)."""
    mem = MemoryKeyStore()
    mem.create("alice")
    secret = bogus()

    async def main() -> list[str]:
        t = tenancy(mem)
        try:
            out = [await who(t, secret)]
            # the key comes back with the restored table (a record with this secret's hash)
            mem._keys.append(KeyRecord("key_" + "0" * 16, "restored", hash_secret(secret), Limits(), time.time()))
            await t.refresh()  # the watcher's look: the version changed
            out.append(await who(t, secret))
            return out
        finally:
            await t.close()

    assert run(main()) == ["401", "restored"]


def test_open_mode_remembers_unknown_hl_secrets_and_closes_with_the_first_key() -> None:
    mem = Counting(MemoryKeyStore())

    async def main() -> None:
        t = tenancy(mem)
        try:
            secret = bogus()
            before = mem.reads
            for _ in range(N):
                assert await t.authenticate(scope(secret)) is ANONYMOUS
            assert mem.reads - before == 1
            _, first = mem.inner.create("first")
            assert await who(t, first) == "first"  # the first key closes the server at once
            assert await who(t, secret) == "401"
        finally:
            await t.close()

    run(main())


def test_the_negative_cache_is_bounded(stores: tuple[Counting, SQLiteKeyStore]) -> None:
    server, cli = stores
    cli.create("alice")

    async def main() -> None:
        t = tenancy(server)
        try:
            n = Tenancy.NEGATIVE_ENTRIES
            assert n == 1024  # the documented bound
            first = bogus()
            assert await who(t, first) == "401"
            for _ in range(n):
                assert await who(t, bogus()) == "401"
            assert len(t._unknown) == n  # the oldest was dropped for the newest
            before = server.reads
            assert await who(t, first) == "401"
            assert server.reads - before == 1  # dropped: read again (and remembered again)
        finally:
            await t.close()

    run(main())


def test_the_admin_key_is_never_remembered_as_unknown(stores: tuple[Counting, SQLiteKeyStore]) -> None:
    server, cli = stores
    admin = "sk-admin-" + "y" * 20

    async def main() -> None:
        t = tenancy(server, admin)
        try:
            before = server.reads
            for _ in range(5):
                assert (await t.authenticate(scope(admin))).admin
            assert server.reads == before and not t._unknown
        finally:
            await t.close()

    run(main())


# -- Redis ------------------------------------------------------------------------------------------


def test_a_known_bad_key_is_a_401_while_redis_is_down(tmp_path: Path) -> None:
    from hotloop.tenants.redis_keys import RedisKeyStore

    def run_with(r: Redis) -> None:
        store: KeyStore = RedisKeyStore(r.url, prefix="neg:")
        _, good = store.create("alice")

        async def main() -> None:
            t = tenancy(store)
            try:
                bad = bogus()
                assert await who(t, good) == "alice"
                assert await who(t, bad) == "401"
                r.stop()
                # before the negative cache: a 503 (the miss re-read the table, which is down)
                assert await who(t, bad) == "401"
                assert await who(t, good) == "alice"  # keys already loaded keep working
                assert await who(t, bogus()) == "503"  # never seen: it may be a key created since
                t.NEGATIVE_SECONDS = 0.0  # type: ignore[misc]  # even past its time: the read fails, the entry answers
                assert await who(t, bad) == "401"
                r.start()
                await asyncio.sleep(getattr(store, "breaker").backoff)
                assert await who(t, bad) == "401"
            finally:
                await t.close()

        run(main())

    with redis_server(tmp_path) as r:
        run_with(r)
