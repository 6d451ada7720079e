"""The Redis store against a real ``redis-server``: the store model (parents, tombstones,
ownership, provenance, TTL) as the SQLite store keeps it, the usage ledger, and an outage."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from hotloop import errors
from hotloop.state.redis_store import RedisStore
from hotloop.state.store import MissingParent, StoredResponse, UsageRecord
from tests.services import Redis, redis_server


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    with redis_server(tmp_path_factory.mktemp("redis")) as r:
        yield r


@pytest.fixture
def store(redis: Redis, request: pytest.FixtureRequest) -> Iterator[RedisStore]:
    s = RedisStore(redis.url, 3600, prefix=f"t{id(request)}:", write_retry_seconds=2.0)
    yield s
    s.close()


def item(iid: str, text: str = "x") -> dict[str, Any]:
    return {"type": "message", "role": "user", "id": iid, "content": [{"type": "input_text", "text": text}]}


def rec(rid: str, items: list[dict[str, Any]], parent: str | None = None, base: int = 0, owner: str = "alice",
        minted: bool = True, fps: list[Any] | None = None) -> StoredResponse:
    return StoredResponse(
        {"id": rid, "object": "response", "status": "completed"}, items,
        fps if fps is not None else [base + i + 1 for i in range(len(items))], [3] * len(items), 1, parent, base, owner,
        [minted] * len(items),
    )


def test_chain_loads_whole_history_and_checks_the_parent(store: RedisStore) -> None:
    store.put(rec("r1", [item("i1"), item("i2")]))
    store.put(rec("r2", [item("i3")], parent="r1", base=2))
    h = store.get("r2", "alice")
    assert h is not None
    assert [it["id"] for it in h.items] == ["i1", "i2", "i3"]
    assert h.fps == [1, 2, 3] and h.toks == [3, 3, 3] and h.parent_id == "r1" and h.base_len == 2
    assert h.minted == [True, True, True]
    with pytest.raises(MissingParent):
        store.put(rec("r3", [item("i4")], parent="r1", base=5))  # wrong base
    with pytest.raises(MissingParent):
        store.put(rec("r3", [item("i4")], parent="nope", base=1))


def test_integers_beyond_64_bits_are_stored_and_read_back(store: RedisStore) -> None:
    """JSON integers have no size limit and msgpack's stop at 64 bits: a response echoing a
    client's ``max_output_tokens`` of 2**70, an item kept verbatim with a huge number, and a
    classifier state with one are stored, and read back as the same integers."""
    big = {"type": "custom_thing", "id": "c1", "n": 2**70, "nested": [{"m": -(2**80)}, 2**64 - 1, -(2**63)]}
    r = rec("big1", [item("i1"), big])
    r.response["max_output_tokens"] = 2**70
    store.put(r._replace(states={"s": [2**65]}))
    h = store.get("big1", "alice")
    assert h is not None and h.items == [item("i1"), big]
    assert h.response["max_output_tokens"] == 2**70 and h.states == {"s": [2**65]}
    assert store.get_response("big1", "alice")["max_output_tokens"] == 2**70  # type: ignore[index]
    assert store.get_item("c1", "alice") == big
    store.put(rec("big2", [item("i2")], parent="big1", base=2))  # a child of it
    h2 = store.get("big2", "alice")
    assert h2 is not None and h2.items[1] == big


def test_fingerprints_are_opaque(store: RedisStore) -> None:
    fps = [b"\x01" * 16, (1 << 64) - 1]
    store.put(rec("f1", [item("a"), item("b")], fps=fps))
    h = store.get("f1")
    assert h is not None and h.fps == fps


def test_replicas_share_one_fingerprint_key(store: RedisStore, redis: Redis) -> None:
    """Every store on one Redis (every replica) fingerprints with one key, made by the first."""
    from hotloop.state import fpkey

    other = RedisStore(redis.url, 3600, prefix=store.prefix)
    elsewhere = RedisStore(redis.url, 3600, prefix=store.prefix + "x:")
    try:
        assert len(store.fingerprint_key) == fpkey.KEY_LEN
        assert other.fingerprint_key == store.fingerprint_key
        assert elsewhere.fingerprint_key != store.fingerprint_key
        assert store.fingerprint_key != fpkey.PROCESS_KEY
        store.r.set(store.prefix + "fpkey", b"short")
        with pytest.raises(fpkey.KeyFileError):
            RedisStore(redis.url, 3600, prefix=store.prefix)
    finally:
        other.close()
        elsewhere.close()


def test_replicas_share_one_call_id_key(store: RedisStore, redis: Redis) -> None:
    """Every store on one Redis redacts call ids under one key (``P callidkey``, made by the
    first): a call stored by one replica pairs with its output redacted by another."""
    from hotloop.pipeline.classify import call_id_marker
    from hotloop.state import fpkey

    other = RedisStore(redis.url, 3600, prefix=store.prefix)
    elsewhere = RedisStore(redis.url, 3600, prefix=store.prefix + "y:")
    try:
        assert len(store.call_id_key) == fpkey.KEY_LEN
        assert other.call_id_key == store.call_id_key == store.r.get(store.prefix + "callidkey")
        assert store.call_id_key not in (store.fingerprint_key, fpkey.CALL_ID_PROCESS_KEY)
        assert elsewhere.call_id_key != store.call_id_key
        secret = "gh" + "p_" + "a1" * 18
        assert call_id_marker("github_token", secret, other.call_id_key) == call_id_marker(
            "github_token", secret, store.call_id_key
        )
        store.r.set(store.prefix + "callidkey", b"short")
        with pytest.raises(fpkey.KeyFileError, match="call id key"):
            RedisStore(redis.url, 3600, prefix=store.prefix)
    finally:
        other.close()
        elsewhere.close()


def test_scope_hides_other_owners(store: RedisStore) -> None:
    store.put(rec("s1", [item("si1")], owner="alice"))
    assert store.get("s1", "bob") is None
    assert store.get_response("s1", "bob") is None
    assert store.get_item("si1", "bob") is None
    assert not store.delete("s1", "bob")
    assert store.get_response("s1", None) is not None  # the admin sees every owner
    assert store.get_item("si1", "alice") == item("si1")
    assert store.get_item("si1", None) == item("si1")


def test_only_minted_items_resolve(store: RedisStore) -> None:
    store.put(rec("m1", [item("client-id")], minted=False))
    assert store.get_item("client-id", "alice") is None


def test_a_delete_is_announced_by_the_delete_itself(store: RedisStore) -> None:
    """Other processes hear of a delete from the script that does it: announced after its
    answer, a delete whose answer timed out (Redis slow, the network stalled) was done and never
    told, and a retried DELETE found nothing to announce; other replicas served the response
    from their caches until their entries aged out."""
    from hotloop.state.redis_store import DELETED_CHANNEL

    store.put(rec("r1", [item("i1")]))
    sub = store.r.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(DELETED_CHANNEL)
    try:
        assert store.delete("r1", "alice")
        heard = None
        for _ in range(50):
            heard = sub.get_message(timeout=0.1)
            if heard is not None:
                break
        assert heard is not None and heard["data"] == b"r1"
        assert not store.delete("r1", "alice") and sub.get_message(timeout=0.3) is None  # nothing deleted: nothing told
    finally:
        sub.close()


def test_a_write_retried_after_a_delete_does_not_bring_the_response_back(store: RedisStore) -> None:
    """A write whose answer timed out was done; a DELETE came (through another replica) before
    its retry, which made the response again: deleted with a 200, then found and continued.
    A delete marks the response for as long as such a retry may come."""
    r = rec("r1", [item("i1")])
    store.put(r)
    assert store.delete("r1", "alice")
    store.put(r)  # the same write again: its retry
    assert store.get("r1", "alice") is None and store.get_response("r1", "alice") is None
    assert store.get_item("i1", "alice") is None
    ttl = store.r.ttl(store.prefix + "d:r1")
    assert 50 <= ttl <= max(60, store.write_retry_seconds + 20)


def test_delete_tombstones_a_parent_until_its_children_go(store: RedisStore) -> None:
    store.put(rec("d1", [item("di1")]))
    store.put(rec("d2", [item("di2")], parent="d1", base=1))
    assert store.delete("d1", "alice")
    assert store.get("d1", "alice") is None and store.get_response("d1") is None
    assert store.get_item("di1", "alice") is None
    h = store.get("d2", "alice")
    assert h is not None and [it["id"] for it in h.items] == ["di1", "di2"]  # the tombstone's items stay
    assert not store.delete("d1", "alice")
    assert store.delete("d2", "alice")
    assert store.r.keys(store.prefix + "t:alice:r:d*") == []  # the tombstone went with its last child
    assert store.r.keys(store.prefix + "o:d*") == []


def test_ttl_hides_and_expires(redis: Redis) -> None:
    s = RedisStore(redis.url, 1.0, prefix="ttl:")
    try:
        s.put(rec("t1", [item("ti1")]))
        assert s.get("t1") is not None
        assert 0 < s.r.pttl("ttl:t:alice:r:t1") <= 2000
        time.sleep(1.05)
        assert s.get("t1") is None and s.get_response("t1") is None and s.get_item("ti1") is None
    finally:
        s.close()


def test_a_child_keeps_its_ancestors_alive(redis: Redis) -> None:
    s = RedisStore(redis.url, 1.0, prefix="anc:")
    try:
        s.put(rec("a1", [item("ai1")]))
        time.sleep(0.6)
        s.put(rec("a2", [item("ai2")], parent="a1", base=1))
        assert s.r.pexpiretime("anc:t:alice:r:a1") >= s.r.pexpiretime("anc:t:alice:r:a2")
        time.sleep(0.6)
        h = s.get("a2")
        assert h is not None and len(h.items) == 2
        assert s.get("a1") is None  # past its own TTL: hidden, its items kept for a2
    finally:
        s.close()


def test_usage_ledger_per_day_model_key(store: RedisStore) -> None:
    now = time.time()
    store.record_usage([
        UsageRecord("m", 10, 5, 2, 1, now, "k1"),
        UsageRecord("m", 1, 1, 0, 0, now, "k1", {"aws_key": 2}),
        UsageRecord("m", 7, 7, 0, 0, now, "k2"),
    ])
    rows = store.usage("k1")
    assert len(rows) == 1
    r = rows[0]
    assert (r["responses"], r["input_tokens"], r["output_tokens"], r["cached_tokens"], r["reasoning_tokens"]) == (2, 11, 6, 2, 1)
    assert r["flagged"] == 1 and r["findings"] == {"aws_key": 2}
    assert {r["key"] for r in store.usage()} == {"k1", "k2"}
    assert store.usage(since="2999-01-01") == []
    # the batch's marker lives as long as its retries can (at least an hour), not a day
    [marker] = store.r.keys(store.prefix + "u:batch:*")
    assert 3000 < store.r.ttl(marker) <= 3600


def test_usage_ledger_pages_in_row_order(store: RedisStore) -> None:
    now = time.time()
    store.record_usage([UsageRecord(m, 1, 1, 0, 0, now, k, {"jwt": 1} if k == "k2" else None) for m in "abc" for k in ("k1", "k2")])
    whole = store.usage()
    assert [(r["model"], r["key"]) for r in whole] == [(m, k) for m in "abc" for k in ("k1", "k2")]
    first = store.usage(None, None, None, 4)
    rest = store.usage(None, None, (first[-1]["day"], first[-1]["model"], first[-1]["key"]), 4)
    assert first + rest == whole and len(rest) == 2 and rest[1]["findings"] == {"jwt": 1}
    assert store.usage("k1", None, (whole[0]["day"], "a", "k1"), 1) == [whole[2]]


def test_a_keys_ledger_counts_at_most_its_model_names_a_day(store: RedisStore) -> None:
    """As the other stores: past ``max_ledger_models`` names of one key in one day, further
    names count under "(other)" (decided in the batch's script, atomically for every replica)."""
    store.max_ledger_models = 2
    now = time.time()
    store.record_usage([UsageRecord(f"m{i}", 1, 1, 0, 0, now, "k") for i in range(4)] + [UsageRecord("m9", 1, 1, 0, 0, now, "k2")])
    store.record_usage([UsageRecord("m0", 4, 1, 0, 0, now, "k"), UsageRecord("m5", 10, 1, 0, 0, now, "k", {"jwt": 2})])
    rows = {(r["model"], r["key"]): r for r in store.usage()}
    assert set(rows) == {("m0", "k"), ("m1", "k"), ("(other)", "k"), ("m9", "k2")}
    other = rows["(other)", "k"]
    assert other["responses"] == 3 and other["input_tokens"] == 1 + 1 + 10 and other["findings"] == {"jwt": 2}
    assert rows["m0", "k"]["input_tokens"] == 1 + 4
    [names] = store.r.keys(store.prefix + "ku:names:*\tk")
    assert store.r.scard(names) == 2 and 0 < store.r.ttl(names) <= 172800


def test_a_key_given_a_revoked_keys_name_has_ledger_rows_of_its_own(store: RedisStore) -> None:
    """As the other stores: rows are per key id, the name shown beside it; a key given a revoked
    key's name neither sees nor adds to the revoked key's rows, nor shares its model names."""
    store.max_ledger_models = 1
    now = time.time()
    day = time.strftime("%Y-%m-%d", time.gmtime(now))
    store.record_usage([UsageRecord("m", 10, 5, 0, 0, now, "key_old", {"jwt": 1}, "ci"), UsageRecord("m2", 1, 1, 0, 0, now, "key_old", None, "ci")])
    store.record_usage([UsageRecord("m", 1, 2, 0, 0, now, "key_new", None, "ci")])
    store.record_usage([UsageRecord("m3", 3, 4, 0, 0, now, "key_new", None, "ci")])
    ids = [(r["model"], r["key"], r["key_id"], r["responses"], r["input_tokens"]) for r in store.usage()]
    assert ids == [("(other)", "ci", "key_new", 1, 3), ("(other)", "ci", "key_old", 1, 1), ("m", "ci", "key_new", 1, 1), ("m", "ci", "key_old", 1, 10)]
    [other, mine] = store.usage("key_new")
    assert mine == {"day": day, "model": "m", "key": "ci", "key_id": "key_new", "responses": 1, "input_tokens": 1, "output_tokens": 2,
                    "cached_tokens": 0, "reasoning_tokens": 0, "flagged": 0, "findings": {}}
    assert store.usage("key_old")[1]["findings"] == {"jwt": 1}
    assert store.usage("key_new", None, (day, "(other)", "key_new"), 5) == [mine]
    assert store.usage("ci") == []


def _row_by_name(store: RedisStore, day: str, model: str, name: str, **fields: int) -> None:
    """A ledger row as versions before key ids wrote it (keyed by the key's name)."""
    row = f"{day}\t{model}\t{name}"
    store.r.sadd(store.prefix + "u:rows", row)
    store.r.hset(store.prefix + "u:" + row, mapping=fields)
    store.r.sadd(store.prefix + f"u:names:{day}\t{name}", model)


def test_ledger_rows_kept_by_key_name_move_to_legacy_key_ids(redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows an earlier version kept per key name (left in Redis, or written by an older replica
    during a rolling upgrade) are moved, when a replica starts and before a listing, under the
    legacy id of their name (open mode's and the admin's under their own id, merged with what
    they wrote since), each once, their name and findings kept, their old keys gone."""
    from hotloop.state import redis_store

    monkeypatch.setattr(redis_store, "MIGRATE_BATCH", 2)  # several script calls
    store = RedisStore(redis.url, 3600, prefix="byname:")
    try:
        now = time.time()
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        store.record_usage([UsageRecord("m", 1, 1, 0, 0, now)])  # anonymous, already by id
        _row_by_name(store, day, "m", "anonymous", responses=2, input_tokens=5, output_tokens=5, flagged=1, **{"f:jwt": 3})
        _row_by_name(store, day, "m", "ci", responses=4, input_tokens=8, output_tokens=2, reasoning_tokens=1)
        _row_by_name(store, day, "m", "admin", responses=1, input_tokens=1, output_tokens=1)
        _row_by_name(store, "1970-01-01", "m", "ci", responses=1, input_tokens=2, output_tokens=3)
        _row_by_name(store, day, "m9", "ops", responses=1, input_tokens=2, output_tokens=3)
        store.record_usage([UsageRecord("m", 1, 1, 0, 0, now, "key_new", None, "ci")])
        rows = {(r["day"], r["model"], r["key_id"]): r for r in store.usage()}  # a listing moves them first
        assert {k: (r["key"], r["responses"], r["input_tokens"], r["flagged"], r["findings"]) for k, r in rows.items()} == {
            (day, "m", "anonymous"): ("anonymous", 3, 6, 1, {"jwt": 3}),
            (day, "m", "admin"): ("admin", 1, 1, 0, {}),
            (day, "m", "legacy:ci"): ("ci", 4, 8, 0, {}),
            ("1970-01-01", "m", "legacy:ci"): ("ci", 1, 2, 0, {}),
            (day, "m9", "legacy:ops"): ("ops", 1, 2, 0, {}),
            (day, "m", "key_new"): ("ci", 1, 1, 0, {}),
        }
        assert rows[day, "m", "legacy:ci"]["reasoning_tokens"] == 1
        assert store.usage("key_new") == [rows[day, "m", "key_new"]]
        assert store.usage("ci") == []
        left = {k[len(store.prefix) :].split(b":")[1] for k in store.r.keys(store.prefix + "u:*")}
        assert left == {b"names", b"batch"}  # the old rows went; their names sets expire on their own
        # the model names a key had counted that day still count: anonymous has "m"
        store.max_ledger_models = 1
        store.record_usage([UsageRecord("m2", 1, 1, 0, 0, now)])
        assert [r["model"] for r in store.usage("anonymous")] == ["(other)", "m"]
        # an older replica's row written meanwhile: moved by the next replica to start, once
        _row_by_name(store, day, "m", "ci", responses=1, input_tokens=1, output_tokens=1)
        RedisStore(redis.url, 3600, prefix="byname:").close()
        assert [r["responses"] for r in store.usage("legacy:ci") if r["day"] == day] == [5]
        assert [r["responses"] for r in store.usage("legacy:ci") if r["day"] == day] == [5]
    finally:
        store.close()


def test_outage_reads_503_writes_wait(tmp_path: Path) -> None:
    with redis_server(tmp_path) as r:
        s = RedisStore(r.url, 3600, write_retry_seconds=0.3)
        try:
            s.put(rec("o1", [item("oi1")]))
            r.stop()
            with pytest.raises(errors.StoreUnavailable):
                s.get("o1")
            with pytest.raises(errors.StoreUnavailable):  # the breaker answers at once
                s.get_response("o1")
            t0 = time.monotonic()
            with pytest.raises(errors.StoreUnavailable):
                s.put(rec("o2", [item("oi2")]))
            assert time.monotonic() - t0 >= 0.25 and not s.available  # retried, then gave up
            r.start()
            s.write_retry_seconds = 10.0
            time.sleep(s.breaker.backoff)
            s.put(rec("o2", [item("oi2")]))
            assert s.available and s.get("o2") is not None and s.get("o1") is None  # no persistence configured
        finally:
            s.close()


class _Reports:
    """A real client whose ``INFO server`` reports another version."""

    def __init__(self, real: Any, version: str) -> None:
        self._real = real
        self._version = version

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def info(self, section: str | None = None) -> dict[str, Any]:
        return {**self._real.info(section), "redis_version": self._version}


def test_redis_older_than_7_is_refused_at_start(redis: Redis) -> None:
    """PEXPIRETIME needs Redis 7.0: an older server fails start-up with a clear message (exit 3:
    the server catches StoreUnavailable at start-up), not every write later."""
    from hotloop.state.redis_store import RedisVersionError, sync_client

    real = sync_client(redis.url)
    try:
        with pytest.raises(RedisVersionError) as exc:
            RedisStore(redis.url, 3600, prefix="ver:", client=_Reports(real, "6.2.14"))
        assert isinstance(exc.value, errors.StoreUnavailable)
        assert "7.0 or later" in str(exc.value) and "6.2.14" in str(exc.value)
        RedisStore(redis.url, 3600, prefix="ver:", client=_Reports(real, "7.0.0")).close()
    finally:
        real.close()


def test_after_the_give_up_time_writes_fail_without_trying(tmp_path: Path) -> None:
    """While stopping (give_up_by passed) and Redis is known to be down, each queued write fails
    at once instead of making one more connect attempt (a connect timeout each)."""
    with redis_server(tmp_path) as r:
        s = RedisStore(r.url, 3600, write_retry_seconds=0.2)
        try:
            r.stop()
            with pytest.raises(errors.StoreUnavailable):
                s.put(rec("g1", [item("gi1")]))
            s.give_up_by(time.monotonic())
            attempts: list[int] = []

            def attempt() -> None:
                attempts.append(1)
                raise ConnectionError("unreachable")

            for _ in range(3):
                with pytest.raises(errors.StoreUnavailable):
                    s._write(attempt)
            assert attempts == []
        finally:
            s.close()


def test_an_evicted_parent_is_not_recreated_without_a_ttl(store: RedisStore) -> None:
    """Redis may evict a response's hash (maxmemory) while its owner key stays: replacing or
    deleting a child must not recreate the parent as a hash holding only ``kids``, forever."""
    p = store.prefix
    store.put(rec("e1", [item("ei1")]))
    store.put(rec("e2", [item("ei2")], parent="e1", base=1))
    store.put(rec("e3", [item("ei3")]))
    store.put(rec("e4", [item("ei4")], parent="e3", base=1))
    store.r.delete(p + "t:alice:r:e1", p + "t:alice:r:e3")  # evicted
    store.put(rec("e2", [item("ei2")]))  # replaced: its old parent loses a child
    assert store.delete("e4", "alice")
    assert not store.r.exists(p + "t:alice:r:e1") and not store.r.exists(p + "t:alice:r:e3")


def test_the_delete_subscriber_forgets_the_cache_after_missing_deletes(tmp_path: Path) -> None:
    """Redis does not replay what was published while nobody listened: after the subscriber
    reconnects, the process forgets its cached responses instead of serving a deleted one."""
    import asyncio

    from hotloop.pipeline.shared import SharedPersistence
    from hotloop.state.redis_store import DELETED_CHANNEL

    with redis_server(tmp_path) as r:
        store = RedisStore(r.url, 3600, write_retry_seconds=0.3)

        async def main() -> tuple[list[str], int]:
            p = SharedPersistence(store)
            evicted: list[str] = []
            forgotten = [0]
            p.evict = evicted.append
            p.forget = lambda: forgotten.__setitem__(0, forgotten[0] + 1)
            p.start()
            try:
                for _ in range(100):  # subscribed: a published delete arrives
                    store.r.publish(DELETED_CHANNEL, "resp_a")
                    await asyncio.sleep(0.05)
                    if evicted:
                        break
                assert evicted and forgotten[0] == 0  # the first subscription missed nothing
                r.stop()
                await asyncio.sleep(0.3)
                r.start()
                for _ in range(200):
                    if forgotten[0]:
                        break
                    await asyncio.sleep(0.05)
                return evicted, forgotten[0]
            finally:
                await p.close(1.0)

        try:
            evicted, forgotten = asyncio.run(main())
        finally:
            store.close()
    assert evicted[0] == "resp_a" and forgotten == 1


def test_a_tombstone_keeps_its_items_and_nothing_else(store: RedisStore) -> None:
    """A deleted response its children still need kept its Response object (instructions,
    metadata) and classifier states in Redis for as long as the conversation lived."""
    r = rec("ta", [item("ta1")])
    store.put(r._replace(response={**r.response, "instructions": "DELETED-INSTRUCTIONS", "metadata": {"n": "DELETED"}},
                         states={"secrets": {"n": 1}}))
    store.put(rec("tb", [item("tb1")], parent="ta", base=1))
    assert store.delete("ta", "alice")
    fields = store.r.hgetall(store.prefix + "t:alice:r:ta")
    assert fields[b"resp"] == b"" and fields[b"states"] == b"" and fields[b"live"] == b"0"
    assert b"DELETED" not in b"".join(fields.values())
    h = store.get("tb", "alice")
    assert h is not None and [it["id"] for it in h.items] == ["ta1", "tb1"]


def test_a_response_past_its_time_to_live_is_not_found_by_delete_either(redis: Redis) -> None:
    s = RedisStore(redis.url, 3600, prefix="ttldel:")
    try:
        s.put(rec("old", [item("o1")]))
        s.ttl_seconds = 0.05
        time.sleep(0.1)
        assert s.get("old", "alice") is None and s.delete("old", "alice") is False
        s.ttl_seconds = 3600
        assert s.get("old", "alice") is None  # removed, not only hidden
    finally:
        s.close()
