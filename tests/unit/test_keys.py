"""API keys, authentication and ownership in the stores (no server)."""

from __future__ import annotations

import asyncio
import contextlib
import base64
import hashlib

import pytest

from hotloop import errors
from hotloop.state.context import CachedResponse, Context, ResponseCache
from hotloop.state.store import LEGACY_OWNER, MemoryStore, SQLiteStore, StoredResponse
from hotloop.tenants import ADMIN, ANONYMOUS, Tenancy
from hotloop.tenants.keys import InvalidKeyName, KeyExists, Limits, MemoryKeyStore, SQLiteKeyStore, new_secret


def scope_of(token: str | None) -> dict:
    headers = [] if token is None else [(b"authorization", b"Bearer " + token.encode())]
    return {"headers": headers}


@pytest.fixture(params=["sqlite", "memory"])
def keys(request, tmp_path):
    k = SQLiteKeyStore(tmp_path / "k.sqlite3") if request.param == "sqlite" else MemoryKeyStore()
    yield k
    k.close()


def test_secrets_are_256_bits_base64url() -> None:
    s = new_secret()
    assert s.startswith("hl-") and len(s) == 46
    assert len(base64.urlsafe_b64decode(s[3:] + "=")) == 32
    assert new_secret() != s


def test_keys_are_stored_hashed_and_named_uniquely(keys) -> None:
    rec, secret = keys.create("alice", Limits(rpm=5))
    assert rec.hash == hashlib.sha256(secret.encode()).digest()
    assert rec.id.startswith("key_") and rec.limits == Limits(rpm=5)
    if isinstance(keys, SQLiteKeyStore):
        dump = "\n".join(keys._db.iterdump())
        assert secret not in dump and secret[3:] not in dump
    with pytest.raises(KeyExists):
        keys.create("alice")
    for bad in ("admin", "anonymous", "", "-x", "a b", "x" * 65):
        with pytest.raises(InvalidKeyName):
            keys.create(bad)
    v = keys.version()
    assert keys.revoke("alice") and not keys.revoke("alice") and keys.version() != v
    again, _ = keys.create("alice")  # a revoked key's name may be reused, never its id
    assert again.id != rec.id
    assert [(k.name, k.active) for k in keys.list()] == [("alice", False), ("alice", True)]
    keys.touch({again.id: 123.0})
    assert keys.list()[1].last_used == 123.0


def test_a_key_created_elsewhere_works_at_once_and_a_revoked_one_fails(tmp_path) -> None:
    path = tmp_path / "k.sqlite3"
    server_side = SQLiteKeyStore(path)
    cli_side = SQLiteKeyStore(path)  # another process's connection, as `hotloop keys` is

    async def main() -> None:
        t = Tenancy(server_side, admin_key="sk-admin")
        assert not t.open
        _, secret = cli_side.create("alice", Limits(rpm=10))
        alice = await t.authenticate(scope_of(secret))  # a cache miss re-reads the table
        assert alice.name == "alice" and alice.scope == alice.id and alice.limits.rpm == 10
        assert await t.authenticate(scope_of("sk-admin")) is ADMIN and ADMIN.scope is None
        for bad in (None, "sk-wrong", secret + "x", "hl-" + "A" * 43):
            with pytest.raises(errors.AuthenticationFailed):
                await t.authenticate(scope_of(bad))
        t.admit(alice)
        cli_side.revoke("alice")
        t.admit(alice)  # not seen yet: the watcher re-reads the table every REFRESH_SECONDS
        await t.refresh()
        with pytest.raises(errors.AuthenticationFailed) as ei:
            t.admit(alice)
        assert ei.value.status == 401 and ei.value.code == "invalid_api_key"
        with pytest.raises(errors.AuthenticationFailed):
            await t.authenticate(scope_of(secret))
        await t.close()

    asyncio.run(main())
    cli_side.close()


def test_open_mode_until_the_first_key() -> None:
    async def main() -> None:
        store = MemoryKeyStore()
        t = Tenancy(store)
        assert t.open
        assert await t.authenticate(scope_of(None)) is ANONYMOUS
        assert await t.authenticate(scope_of("sk-anything")) is ANONYMOUS
        _, secret = store.create("first")
        # the first key's own caller is never taken for anonymous (hl- secrets are looked up)
        assert (await t.authenticate(scope_of(secret))).name == "first"
        assert not t.open
        with pytest.raises(errors.AuthenticationFailed):
            await t.authenticate(scope_of(None))
        with pytest.raises(errors.AuthenticationFailed):
            t.verify(ANONYMOUS)  # an anonymous WebSocket opened before the first key
        store.revoke("first")
        await t.refresh()
        assert not t.open  # revoking every key never opens the server
        await t.close()
        await t.close()  # a second close does nothing (its thread pool is already shut down)
        assert not t.open  # nor is the server opened by it

    asyncio.run(main())


def _rec(rid: str, owner: str, ids: list[str], minted: list[bool], parent: str | None = None, base: int = 0) -> StoredResponse:
    items = [{"type": "message", "id": i, "role": "user", "content": [{"type": "input_text", "text": f"{owner}:{i}"}]} for i in ids]
    n = len(items)
    return StoredResponse({"id": rid}, items, [i.to_bytes(16, "little") for i in range(n)], [1] * n, n, parent, base, owner, minted)


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_store_reads_are_scoped_and_references_need_minted_ids(kind, tmp_path) -> None:
    s = SQLiteStore(tmp_path / "s.sqlite3") if kind == "sqlite" else MemoryStore()
    s.put(_rec("resp_a", "key_a", ["msg_real", "msg_a2"], [True, False]))
    s.put(_rec("resp_b", "key_b", ["msg_real"], [False]))  # b plants a copy of a's id
    assert s.get("resp_a", "key_a") is not None and s.get("resp_a", None) is not None
    assert s.get("resp_a", "key_b") is None and s.get_response("resp_a", "key_b") is None
    assert s.get_item("msg_real", "key_a")["content"][0]["text"] == "key_a:msg_real"
    assert s.get_item("msg_real", "key_b") is None  # b's own copy was client-supplied
    assert s.get_item("msg_a2", "key_a") is None  # so was this one
    assert s.get_item("msg_real", None)["content"][0]["text"] == "key_a:msg_real"  # admin: all, minted only
    h = s.get("resp_a", "key_a")
    assert h.owner == "key_a" and h.minted == [True, False]
    assert not s.delete("resp_a", "key_b") and s.get("resp_a", "key_a") is not None
    assert s.delete("resp_a", "key_a") and s.get_item("msg_real", "key_a") is None
    s.close()


def test_response_cache_is_scoped_and_resolves_only_own_minted_items() -> None:
    from hotloop.protocol.request import item_from_dict

    def entry(rid: str, owner: str, ids: list[str], supplied: frozenset[str]) -> CachedResponse:
        items = [item_from_dict({"type": "message", "id": i, "role": "user", "content": owner}) for i in ids]
        ctx = Context()
        ctx.extend(items, [i.to_bytes(16, "little") for i in range(len(items))], [1] * len(items))
        return CachedResponse({"id": rid}, ctx, len(items), True, owner=owner, supplied=supplied)

    c = ResponseCache()
    c.put(entry("resp_a", "key_a", ["msg_x"], frozenset()))
    c.put(entry("resp_b", "key_b", ["msg_x"], frozenset({"msg_x"})))
    assert c.get("resp_a", "key_b") is None and c.get("resp_a", "key_a") is not None and c.get("resp_b", None)
    assert c.find_item("msg_x", "key_b") is None
    assert c.find_item("msg_x", "key_a").content == "key_a"
    assert c.find_item("msg_x", None).content == "key_a"  # the newest is b's, but b's copy was supplied
    assert LEGACY_OWNER == ANONYMOUS.id


def test_response_cache_remembers_where_an_item_was_found_and_never_answers_from_a_gone_response(monkeypatch) -> None:
    from hotloop.protocol.request import item_from_dict
    from hotloop.state import context

    def entry(rid: str, owner: str, ids: list[str], created: int = 100) -> CachedResponse:
        items = [item_from_dict({"type": "message", "id": i, "role": "user", "content": rid}) for i in ids]
        ctx = Context()
        ctx.extend(items, [i.to_bytes(16, "little") for i in range(len(items))], [1] * len(items))
        return CachedResponse({"id": rid, "created_at": created}, ctx, len(items), True, owner=owner)

    now = [1000.0]
    c = ResponseCache(ttl=600, clock=lambda: now[0])
    c.put(entry("resp_a", "key_a", ["msg_1", "msg_2"], created=900))
    for i in range(20):
        c.put(entry(f"resp_n{i}", "key_a", [f"msg_n{i}"], created=950))
    calls = []
    minted = CachedResponse.minted_item
    monkeypatch.setattr(CachedResponse, "minted_item", lambda self, iid: calls.append(self.id) or minted(self, iid))
    assert c.find_item("msg_1", "key_a").content == "resp_a" and len(calls) == 21  # scanned, newest first
    calls.clear()
    assert c.find_item("msg_1", "key_a").content == "resp_a" and calls == ["resp_a"]  # remembered
    assert c.find_item("msg_1", "key_b") is None  # another key's: not through the memo either
    now[0] = 1501.0  # resp_a expired (created 900, 600 s to live); the others have not
    assert c.find_item("msg_1", "key_a") is None
    now[0] = 1000.0
    c.evict("resp_a")
    assert c.find_item("msg_1", "key_a") is None and c.find_item("msg_2", None) is None
    c.put(entry("resp_b", "key_a", ["msg_1"], created=990))  # (a store's load of another holder)
    assert c.find_item("msg_1", "key_a").content == "resp_b"
    monkeypatch.setattr(context, "HOLDER_ENTRIES", 3)
    for i in range(5):
        assert c.find_item(f"msg_n{i}", "key_a").content == f"resp_n{i}"
    assert len(c._holders) <= 3  # bounded: forgotten at once, then found by a scan again
    c.clear()
    assert c.find_item("msg_n4", "key_a") is None


def test_response_cache_says_where_an_item_was_found_and_whether_it_is_still_cached() -> None:
    """ResponseCache.find_item_held: the item, the response it was found in and when that one
    expires; holds: whether every one of a set of responses is still cached (Prefix.checked)."""
    from hotloop.protocol.request import item_from_dict

    def entry(rid: str) -> CachedResponse:
        item = item_from_dict({"type": "message", "id": f"msg_{rid}", "role": "user", "content": rid})
        ctx = Context()
        ctx.extend([item], [b"\x01" * 16], [1])
        return CachedResponse({"id": rid, "created_at": 100}, ctx, 1, True, owner="key_a")

    now = [200.0]
    c = ResponseCache(max_entries=2, ttl=600, clock=lambda: now[0])
    c.put(entry("resp_a"))
    c.put(entry("resp_b"))
    got = c.find_item_held("msg_resp_a", "key_a")
    assert got is not None and got[0].content == "resp_a" and got[1:] == ("resp_a", 700.0)  # created 100, 600 s to live
    assert c.find_item_held("msg_resp_a", "key_b") is None  # another key's
    assert c.holds(frozenset({"resp_a", "resp_b"})) and c.holds(frozenset())
    c.put(entry("resp_c"))  # the bounds let resp_a go
    assert not c.holds(frozenset({"resp_a", "resp_b"})) and c.holds(frozenset({"resp_b", "resp_c"}))
    assert c.find_item_held("msg_resp_a", "key_a") is None
    c.evict("resp_b")
    assert not c.holds(frozenset({"resp_b"}))
    now[0] = 701.0  # resp_c expired: not found, though still held until something evicts it
    assert c.find_item_held("msg_resp_c", "key_a") is None and c.holds(frozenset({"resp_c"}))


def _bearer(secret: str) -> dict:
    return {"headers": [(b"authorization", b"Bearer " + secret.encode())]}


def test_a_key_created_while_a_look_is_in_flight_works_on_its_first_request(tmp_path) -> None:
    """Its first request joined the look in flight, which had read the table before the key was
    created: 401, where a new key works at once."""
    import time as _time

    class Slow(SQLiteKeyStore):
        delay = 0.0

        def version(self):  # type: ignore[no-untyped-def]
            v = super().version()
            _time.sleep(self.delay)  # read, then a busy database
            return v

    path = tmp_path / "k.sqlite3"
    server_side, cli_side = Slow(path), SQLiteKeyStore(path)
    cli_side.create("first")

    async def main() -> str:
        t = Tenancy(server_side, None)
        server_side.delay = 0.3
        look = asyncio.ensure_future(t.refresh())  # the watcher's
        await asyncio.sleep(0.05)
        _, secret = cli_side.create("second")
        name = (await t.authenticate(_bearer(secret))).name
        await look
        t._pool.shutdown()
        return name

    assert asyncio.run(main()) == "second"


def test_a_request_that_joins_a_failing_look_gets_503_not_401() -> None:
    """The key store unreachable: a request for a key not known yet is a 503 (retried by the
    SDKs); one that joined the watcher's look in flight got a 401 (never retried)."""
    import time as _time

    class Down(MemoryKeyStore):
        down = False

        def version(self):  # type: ignore[no-untyped-def]
            if self.down:
                _time.sleep(0.2)
                raise errors.StoreUnavailable()
            return super().version()

    keys = Down()
    keys.create("a")

    async def main() -> list[str]:
        t = Tenancy(keys, None)
        keys.down = True
        out = []
        for join in (False, True):
            look = asyncio.ensure_future(t.refresh()) if join else None
            await asyncio.sleep(0.01)
            try:
                await t.authenticate(_bearer("hl-" + "n" * 43))
                out.append("ok")
            except errors.StoreUnavailable:
                out.append("503")
            except errors.AuthenticationFailed:
                out.append("401")
            if look is not None:
                with pytest.raises(errors.StoreUnavailable):
                    await look
        t._pool.shutdown()
        return out

    assert asyncio.run(main()) == ["503", "503"]


def test_key_limits_beyond_what_the_stores_hold_are_refused_by_the_cli() -> None:
    import argparse

    from hotloop.tenants.cli import _positive

    assert _positive(str(2**63 - 1)) == 2**63 - 1
    for bad in ("0", "-3", str(2**63), "99999999999999999999"):  # the last crashed SQLite with a traceback
        with pytest.raises(argparse.ArgumentTypeError):
            _positive(bad)


def test_a_cancelled_close_ends_cancelled() -> None:
    """The server gives up on a close that takes too long by cancelling it: the cancellation must
    end it, not be taken for the end of the watcher it cancelled itself (the close ran on to its
    end, the pool's shutdown blocking the event loop, after the server had given up on it)."""

    async def main() -> tuple[bool, bool]:
        tenancy = Tenancy(MemoryKeyStore())
        tenancy.start("127.0.0.1")
        await asyncio.sleep(0)
        closing = asyncio.create_task(tenancy.close())
        await asyncio.sleep(0)  # close() awaits the watcher it cancelled
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        return closing.cancelled(), tenancy._pool._shutdown

    cancelled, pool_shut = asyncio.run(main())
    assert cancelled and pool_shut  # ended, its thread pool let go without a wait
