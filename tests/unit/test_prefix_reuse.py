"""Prefix reuse for clients that resend the whole history: the cache's bounds and owner scoping,
raw-bytes splitting, and (hypothesis) incremental results equal to a computation from scratch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotloop import errors
from hotloop.config import Config
from hotloop.pipeline import classifiers, reuse
from hotloop.pipeline import items as itemlib
from hotloop.pipeline.classify import SecretsClassifier, SecretsState
from hotloop.protocol.request import Message, decode_items
from hotloop.server.runner import make_app
from hotloop.state.context import CachedResponse, Context
from hotloop.state.prefix import Prefix, PrefixCache
from hotloop.tenants.keys import open_key_store
from tests.unit.test_classifiers import SECRETS


def _entry(texts: list[str], owner: str = "alice", rid: str = "resp_1") -> CachedResponse:
    items: list[Any] = [Message(role="user", content=t) for t in texts]
    ctx = Context()
    fps, toks, sizes = itemlib.analyze(items)
    ctx.extend(items, fps, toks, sizes)
    return CachedResponse({"id": rid}, ctx, len(items), False, owner=owner)


def _prefix(texts: list[str], owner: str = "alice", raw: bytes | None = None, rid: str = "resp_1") -> Prefix:
    e = _entry(texts, owner, rid)
    last = itemlib.fingerprint(e.context.items[-1])
    head = reuse.head_of(raw) if raw is not None else None
    return Prefix(e, len(texts), last, e.context.nbytes, raw if head is not None else None, head)


def _raw(texts: list[str]) -> bytes:
    return json.dumps([{"role": "user", "content": t} for t in texts]).encode()


def test_fingerprint_match_is_exact_longest_and_owner_scoped() -> None:
    cache = PrefixCache()
    cache.put(_prefix(["a", "b"], rid="r1"))
    cache.put(_prefix(["a", "b", "c"], rid="r2"))
    cache.put(_prefix(["x", "b", "c", "d"], rid="r3"))  # same last items, another start
    items = decode_items([{"role": "user", "content": t} for t in ["a", "b", "c", "d", "e"]])
    hit = reuse.match(cache, "alice", items)
    assert hit is not None and hit.n == 3 and hit.entry.id == "r2"
    # the same items spelled as parts match too (semantic fingerprints)
    parts = decode_items([{"role": "user", "content": [{"type": "input_text", "text": t}]} for t in "abq"])
    hit = reuse.match(cache, "alice", parts)
    assert hit is not None and hit.n == 2
    assert reuse.match(cache, "bob", items) is None  # another owner never hits
    assert reuse.match(cache, "alice", decode_items([{"role": "user", "content": "zz"}] * 3)) is None


def test_raw_split_needs_the_same_bytes_and_an_item_boundary() -> None:
    cache = PrefixCache()
    texts = ["x" * 300, "second"]
    cache.put(_prefix(texts, raw=reuse.open_array(_raw(texts))))
    longer = _raw(texts + ["third"])
    got = reuse.split_raw(cache, "alice", longer)
    assert got is not None
    p, rest = got
    assert p.n == 2 and json.loads(rest) == [{"role": "user", "content": "third"}]
    assert reuse.split_raw(cache, "bob", longer) is None
    assert reuse.split_raw(cache, "alice", _raw(texts)) is None  # nothing after the prefix
    assert reuse.split_raw(cache, "alice", _raw([texts[0], "second!", "third"])) is None  # not at a boundary
    spaced = longer.replace(b"}, {", b"}  ,\n {")
    assert reuse.split_raw(cache, "alice", spaced) is None or reuse.split_raw(cache, "alice", spaced)[0].n == 2  # type: ignore[index]


def _body(texts: list[str], before: str = '"model":"m"', after: str = '"metadata":{"a":"b"}') -> bytes:
    items = ",".join(json.dumps({"role": "user", "content": t}) for t in texts)
    return ("{" + before + ',"input":[' + items + "]," + after + "}").encode()


def _register(cache: PrefixCache, body: bytes, texts: list[str]) -> None:
    req, hit, raw = reuse.decode_create(body, cache, "alice")
    reg = reuse.registration(raw)
    assert reg is not None
    e = _entry(texts)
    last = itemlib.fingerprint(e.context.items[-1])
    cache.put(Prefix(e, len(texts), last, e.context.nbytes, reg.raw, reuse.head_of(reg.raw), None, reg.lead))


def test_a_raw_hit_takes_the_references_to_check_when_it_matches() -> None:
    # A registration that names stored items by reference keeps them (Prefix.refs) while it has
    # its bytes; a request that matched those bytes takes them at once (RawInput.hit_refs), so a
    # newer registration that drops the bytes (and the refs: a conversation keeps one set, not
    # one per turn) before Engine.start checks them cannot make it skip the check.
    cache = PrefixCache()
    texts = ["x" * 300, "second"]
    _, _, raw = reuse.decode_create(_body(texts), cache, "alice")
    named = {"rs_1": Message(role="user", content="what rs_1 resolved to")}
    reg = reuse.registration(raw, named, 1)  # type: ignore[arg-type]
    assert reg is not None and reg.refs == named and reg.nrefs == 1
    e = _entry(texts)
    p = Prefix(e, 2, itemlib.fingerprint(e.context.items[-1]), e.context.nbytes, reg.raw, reuse.head_of(reg.raw), None, reg.lead, refs=reg.refs, nrefs=reg.nrefs)
    assert cache.put(p) and p.refs == named and p.nrefs == 1
    _, hit, raw2 = reuse.decode_create(_body(texts + ["third"]), cache, "alice")
    assert hit is p and raw2 is not None and raw2.hit_refs is named
    before = cache.nbytes
    cache.drop_raw(p)
    assert p.refs is None and p.nrefs == 1 and raw2.hit_refs is named
    assert cache.nbytes < before


def test_the_holders_of_a_registrations_references_count_in_its_size() -> None:
    # Prefix.checked holds one id per cached response its references were found in (an AI SDK
    # history of n steps: up to n of them): the set counts in the prefix cache's byte bound,
    # and leaves it with the registration's bytes (drop_raw)
    cache = PrefixCache()
    texts = ["x" * 300, "second"]
    _, _, raw = reuse.decode_create(_body(texts), cache, "alice")
    named = {f"rs_{i}": Message(role="user", content=f"item {i}") for i in range(200)}
    reg = reuse.registration(raw, named, len(named))  # type: ignore[arg-type]
    assert reg is not None
    e = _entry(texts)
    last = itemlib.fingerprint(e.context.items[-1])

    def prefix(checked: Any) -> Prefix:
        return Prefix(
            e, 2, last, e.context.nbytes, reg.raw, reuse.head_of(reg.raw), None, reg.lead, refs=reg.refs, nrefs=reg.nrefs,
            checked=checked,
        )

    holders = frozenset(f"resp_{i:040d}" for i in range(200))
    plain, held = prefix(None), prefix((holders, 1e18, None))
    assert held.size - plain.size == holders.__sizeof__() > 200 * 8
    assert cache.put(held) and cache.nbytes == held.size
    cache.drop_raw(held)
    assert held.checked is None and cache.nbytes == held.size < plain.size


def test_a_body_repeating_the_last_one_is_decoded_without_the_prefix() -> None:
    cache = PrefixCache()
    texts = ["x" * 300, "second"]
    _register(cache, _body(texts), texts)
    # the same fields before input, the same items, one more: only the new item is decoded
    req, hit, raw = reuse.decode_create(_body(texts + ["third"], after='"metadata":{"c":"d"}'), cache, "alice")
    assert hit is not None and hit.n == 2 and cache.body_hits == 1
    assert req.input == [{"role": "user", "content": "third"}] and req.metadata == {"c": "d"} and req.model == "m"
    assert raw is not None and json.loads(bytes(raw.raw)) == [{"role": "user", "content": t} for t in texts + ["third"]]
    assert raw.lead == b'{"model":"m","input":'
    # another field before input: matched by the input's own bytes instead
    req, hit, _ = reuse.decode_create(_body(texts + ["third"], before='"model":"n"'), cache, "alice")
    assert hit is not None and hit.n == 2 and cache.body_hits == 1 and cache.raw_hits == 2 and req.model == "n"
    # a quoted "input" among the new items (a key, or a string that is exactly that word): not
    # decoded as a body repeat, still a raw hit; a quote inside a string is escaped, so no match
    req, hit, _ = reuse.decode_create(_body(texts + ["input"]), cache, "alice")
    assert hit is not None and cache.body_hits == 1 and req.input == [{"role": "user", "content": "input"}]
    req, hit, _ = reuse.decode_create(_body(texts + ['say "input"']), cache, "alice")
    assert hit is not None and cache.body_hits == 2 and req.input == [{"role": "user", "content": 'say "input"'}]
    # another owner never hits, by body or by bytes
    req, hit, _ = reuse.decode_create(_body(texts + ["third"]), cache, "bob")
    assert hit is None and len(req.input) == 3  # type: ignore[arg-type]


def _register_whole(cache: PrefixCache, body: bytes, texts: list[str]) -> None:
    """As the engine registers a finished input: with the body's bytes after the input array and
    the request decoded from it (the template of a later body with the same bytes around it)."""
    req, hit, raw = reuse.decode_create(body, cache, "alice")
    reg = reuse.registration(raw)
    assert reg is not None and reg.after is not None and reg.request is not None and reg.request.input is None
    e = _entry(texts)
    last = itemlib.fingerprint(e.context.items[-1])
    cache.put(Prefix(e, len(texts), last, e.context.nbytes, reg.raw, reuse.head_of(reg.raw), None, reg.lead, None, reg.after, reg.request))


_AROUND = '"metadata":{"a":"b"},"stream":false'


def test_a_body_with_the_same_bytes_around_its_input_is_decoded_from_its_new_items_alone() -> None:
    cache = PrefixCache()
    texts = ["x" * 300, "second"]
    _register_whole(cache, _body(texts, after=_AROUND), texts)
    # one more turn, and one after it registered from the first hit: each is the ordinary decode
    # of its body with only the new items as input (a quoted "input" among them too: the bytes
    # after the items are the registered request's, which hold no "input" key)
    for more in (["third", 'say "input"'], ["third", 'say "input"', "fourth"]):
        body = _body(texts + more, after=_AROUND)
        req, hit, raw = reuse.decode_create(body, cache, "alice")
        full = reuse.decode_body(body)
        assert hit is not None and hit.n == len(texts) and cache.body_hits == len(more) - 1
        assert req == msgspec.structs.replace(full, input=full.input[len(texts) :])  # type: ignore[index]
        assert raw is not None and json.loads(bytes(raw.raw)) == full.input and raw.after == b"," + _AROUND.encode() + b"}"
        reg = reuse.registration(raw)
        assert reg is not None and reg.request == msgspec.structs.replace(full, input=None)
        e = _entry(texts + more)
        cache.put(Prefix(e, e.input_len, itemlib.fingerprint(e.context.items[-1]), e.context.nbytes, reg.raw, reuse.head_of(reg.raw), None, reg.lead, None, reg.after, reg.request))
        texts = texts + more


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b.replace(b'"stream":false', b'"stream":true'),  # other bytes after the input
        lambda b: b.replace(b'"third"}]', b'"third"}, ]'),  # a trailing comma: no JSON
        lambda b: b.replace(b',{"role": "user", "content": "third"}]', b', ]'),  # nothing after one
        lambda b: b.replace(b'"third"}]', b'"third"}],"input":[{"role":"user","content":"other"}]'),  # a second input
        lambda b: b.replace(b'"third"}]', b'"third"}] ]'),  # a bracket too many
    ],
)
@pytest.mark.parametrize("register", [_register, _register_whole])
def test_a_body_that_only_nearly_repeats_the_bytes_around_its_input_is_decoded_the_ordinary_way(change: Any, register: Any) -> None:
    cache = PrefixCache()
    texts = ["x" * 300, "second"]
    register(cache, _body(texts, after=_AROUND), texts)
    body = change(_body(texts + ["third"], after=_AROUND))
    try:
        full = reuse.decode_body(body)
    except errors.HotloopError as exc:
        with pytest.raises(type(exc)) as got:
            reuse.decode_create(body, cache, "alice")
        assert got.value.code == exc.code and got.value.message == exc.message
        return
    req, hit, _ = reuse.decode_create(body, cache, "alice")
    whole = req.input if hit is None else [*[{"role": "user", "content": t} for t in texts], *req.input]  # type: ignore[misc]
    assert msgspec.structs.replace(req, input=whole) == full


def test_conversations_that_start_alike_are_each_found_by_their_body() -> None:
    # One agent's conversations send the same instructions and first message: their bodies share
    # far more than the index's leading bytes. Each request finds its own conversation's body,
    # the oldest of many as well as the newest, and only by bytes that are really its own.
    cache = PrefixCache()
    before = '"model":"m","instructions":"' + "You are a coding agent. " * 40 + '"'
    k = PrefixCache.MAX_HEADS  # as many conversations as one index key keeps
    convs = [["Fix the failing test.", f"conversation {i}: " + "w" * 200] for i in range(k)]
    for texts in convs:
        _register(cache, _body(texts, before=before), texts)
    for i in (0, k // 2, k - 1):
        req, hit, _ = reuse.decode_create(_body(convs[i] + ["next"], before=before), cache, "alice")
        assert hit is not None and hit.n == 2 and hit.entry.context.items[1].content == convs[i][1]  # type: ignore[union-attr]
        assert req.input == [{"role": "user", "content": "next"}]
    assert cache.body_hits == 3
    # the same last bytes after a different middle: not a repeat of that body (the tail only
    # rules candidates out; the whole prefix is compared)
    impostor = ["Fix the failing test!", convs[3][1]]
    req, hit, _ = reuse.decode_create(_body(impostor + ["next"], before=before), cache, "alice")
    assert cache.body_hits == 3 and len(req.input) == 3  # type: ignore[arg-type]
    assert hit is None or hit.n < 2


def test_the_lead_is_only_known_when_input_is_named_once() -> None:
    raw = b'[{"role":"user","content":"a"}]'
    assert reuse._lead(b'{"model":"m","input":' + raw + b"}", raw) == b'{"model":"m","input":'
    assert reuse._lead(b'{"model":"m", "input" : ' + raw + b"}", raw) == b'{"model":"m", "input" : '
    tools = b'"tools":[{"type":"function","name":"f","parameters":{"properties":{"input":{}}}}]'
    assert reuse._lead(b"{" + tools + b',"input":' + raw + b"}", raw) is None
    # "input" inside the array (a text, an escaped key) does not matter; after it, it does
    said = b'[{"role":"user","content":"input"},{"role":"user","content":"say \\"input\\": 1"}]'
    assert reuse._lead(b'{"input":' + said + b',"model":"m"}', said) == b'{"input":'
    assert reuse._lead(b'{"input":' + raw + b',"metadata":{"input":"x"}}', raw) is None
    # an earlier nested key followed by the same bytes is not taken for the top-level one
    nested = b'{"metadata":{"input":' + raw + b'},"input":' + raw + b"}"
    assert reuse._lead(nested, raw) is None


def test_bounds_by_entries_and_bytes() -> None:
    cache = PrefixCache(max_entries=2)
    for i in range(4):
        cache.put(_prefix([f"t{i}", f"u{i}"], rid=f"r{i}"))
    assert len(cache) == 2
    items = decode_items([{"role": "user", "content": t} for t in ["t0", "u0", "v"]])
    assert reuse.match(cache, "alice", items) is None  # the oldest went first
    items = decode_items([{"role": "user", "content": t} for t in ["t3", "u3", "v"]])
    assert reuse.match(cache, "alice", items) is not None
    cache.put(_prefix(["t9", "u3"], rid="r9"))  # the same key, other items: both are kept
    assert reuse.match(cache, "alice", items) is not None and len(cache) == 2
    nine = decode_items([{"role": "user", "content": t} for t in ["t9", "u3", "v"]])
    assert reuse.match(cache, "alice", nine).entry.response["id"] == "r9"  # type: ignore[union-attr]
    cache.put(_prefix(["t9", "u3"], rid="r10"))  # the same items again: it replaces their entry
    assert reuse.match(cache, "alice", nine).entry.response["id"] == "r10"  # type: ignore[union-attr]
    assert len(cache) == 2
    one = _prefix(["y" * 1000, "z"])
    cache = PrefixCache(max_entries=100, max_bytes=one.size * 3)
    for i in range(10):
        cache.put(_prefix(["y" * 1000, f"z{i}"], rid=f"r{i}"))
    assert cache.nbytes <= cache.max_bytes and len(cache) < 10
    small = PrefixCache(max_bytes=one.size * 3)  # an entry over a quarter of the bound is not kept
    small.put(one)
    assert len(small) == 0 and small.nbytes == 0
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


# -- through the engine ------------------------------------------------------------------------


def _app(data_dir: Path, **kw: Any) -> Any:
    return make_app(Config(store="sqlite", data_dir=str(data_dir), sim_rate=0, **kw))


async def _post(client: httpx.AsyncClient, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = await client.post("/v1/responses", json={"model": "hotloop-sim", "metadata": {"sim": "tokens:3"}, **body}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["input_tokens_details"]["cached_tokens"])


def test_full_history_turns_report_the_reused_prefix(tmp_path: Path) -> None:
    async def main() -> None:
        app = _app(tmp_path)
        await app.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                history: list[dict[str, Any]] = []
                previous_input = previous_whole = 0
                for i in range(6):
                    history.append({"role": "user", "content": f"turn {i} " + "words " * 50})
                    resp = await _post(client, {"input": history})
                    if i == 0:
                        assert _cached(resp) == 0
                    else:
                        # the previous turn's whole input and the output it sent back, as a
                        # previous_response_id continuation would reuse them
                        assert _cached(resp) == previous_whole > previous_input
                    previous_input = resp["usage"]["input_tokens"]
                    chain = app.engine.responses.get(resp["id"], None).context.chain  # type: ignore[union-attr]
                    n = len(history)
                    previous_whole = previous_input + chain.total_tokens - chain.tokens_upto(n)
                    history += resp["output"]
                assert app.engine.prefixes.hits == 5
                assert app.engine.prefixes.raw_hits == 5
                assert app.engine.prefixes.body_hits == 5  # the same fields before input each turn
                # a fork off an older turn reuses only what it shares, and stays independent
                fork = history[:3] + [{"role": "user", "content": "another way"}]
                resp = await _post(client, {"input": fork})
                assert 0 < _cached(resp) < previous_input
                resp2 = await _post(client, {"input": history + [{"role": "user", "content": "go on"}]})
                assert _cached(resp2) == previous_whole
        finally:
            await app.shutdown()

    uvloop.run(main())


def test_a_prefix_of_another_key_is_never_hit(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = Config(store="sqlite", data_dir=str(tmp_path), sim_rate=0, api_key="sk-admin-" + "x" * 20)
        keys = open_key_store(cfg.store, cfg.db_path)
        alice = keys.create("alice")[1]
        bob = keys.create("bob")[1]
        app = make_app(cfg)
        await app.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                history: list[dict[str, Any]] = [{"role": "user", "content": "shared start " * 40}]
                first = await _post(client, {"input": history}, alice)
                history += first["output"] + [{"role": "user", "content": "next"}]
                as_bob = await _post(client, {"input": history}, bob)
                assert _cached(as_bob) == 0
                as_alice = await _post(client, {"input": history}, alice)
                assert _cached(as_alice) > 0
        finally:
            await app.shutdown()

    uvloop.run(main())


# -- hypothesis: incremental equals from scratch -------------------------------------------------

_TEXT = st.text(alphabet="abc xyz=:\n_-", min_size=1, max_size=40)


@st.composite
def conversations(draw: Any) -> tuple[list[str], list[tuple[int, str]]]:
    n = draw(st.integers(2, 9))
    texts = []
    for _ in range(n):
        t = draw(_TEXT)
        if draw(st.booleans()):
            t += " " + draw(st.sampled_from(SECRETS))[1] + " " + draw(_TEXT)
        texts.append(t)
    cuts = sorted(set(draw(st.lists(st.integers(1, n), max_size=n))) | {n})
    # "fork": continue an earlier response of the conversation (the number picks which), not the latest
    modes = [draw(st.sampled_from(["full", "full-parts", "chain", "stored", "fork"])) for _ in cuts]
    picks = [draw(st.integers(0, 99)) for _ in cuts]
    return texts, list(zip(cuts, modes, picks))


def _spell(item: dict[str, Any], parts: bool) -> dict[str, Any]:
    if parts and item.get("role") == "user" and isinstance(item.get("content"), str):
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": item["content"]}]}
    return item


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations())
def test_incremental_paths_equal_a_computation_from_scratch(tmp_path: Path, case: Any) -> None:
    texts, turns = case

    async def main(data: Path) -> None:
        app = _app(data / "main")
        ref = _app(data / "ref", prefix_cache_entries=0)  # every turn computed from scratch
        await app.startup()
        await ref.startup()
        try:
            async with (
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client,
                httpx.AsyncClient(transport=httpx.ASGITransport(app=ref), base_url="http://t") as rclient,
            ):
                history: list[dict[str, Any]] = []  # what the model saw, as the client keeps it
                sent = 0
                prev: dict[str, Any] | None = None
                # each earlier response: (it, the history with its output, its continuation's cached tokens)
                earlier: list[tuple[dict[str, Any], list[dict[str, Any]], int]] = []
                for cut, mode, pick in turns:
                    new = [{"role": "user", "content": t} for t in texts[sent:cut]]
                    sent = cut
                    if mode == "fork" and earlier:
                        # a fork off an earlier response: it continues what that one saw, and the
                        # branch it leaves (and any later fork of it) stays as it was
                        prev, forked, prev_full_tokens = earlier[pick % len(earlier)]
                        history = list(forked)
                        mode = "chain"
                    if mode in ("chain", "stored") and prev is not None:
                        if mode == "stored":
                            await app.persistence.flush()
                            app.engine.responses = type(app.engine.responses)()
                            app.engine.prefixes.clear()
                        resp = await _post(client, {"input": new, "previous_response_id": prev["id"]})
                        expect_cached = prev_full_tokens
                    else:
                        body = [_spell(it, mode == "full-parts") for it in history + new]
                        resp = await _post(client, {"input": body})
                        # the previous input and the output it sent back, as a continuation
                        expect_cached = prev_full_tokens if prev is not None else 0
                    history += new
                    scratch = await _post(rclient, {"input": history})
                    assert _cached(scratch) == 0
                    assert resp["usage"]["input_tokens"] == scratch["usage"]["input_tokens"]
                    assert _cached(resp) == expect_cached
                    entry = app.engine.responses.get(resp["id"], None)
                    rentry = ref.engine.responses.get(scratch["id"], None)
                    assert entry is not None and rentry is not None
                    n = entry.input_len
                    assert n == rentry.input_len == len(history)
                    fps, toks, _ = itemlib.analyze(rentry.input_items, itemlib.TokenCache())
                    assert entry.context.chain.common_prefix(fps) == n
                    assert [entry.context.chain.tokens_upto(i) for i in range(n + 1)] == [
                        sum(toks[:i]) for i in range(n + 1)
                    ]
                    whole = classifiers.classify_turn([SecretsClassifier("flag")], rentry.input_items, None)
                    got = classifiers.thaw(SecretsClassifier("flag"), entry.states["secrets"]) if entry.states else SecretsState()
                    assert got == whole.states["secrets"]
                    history += resp["output"]
                    prev = resp
                    prev_input_tokens = resp["usage"]["input_tokens"]
                    # a continuation reuses the previous context with its output
                    fp2, tk2, _ = itemlib.analyze(entry.context.items, itemlib.TokenCache())
                    prev_full_tokens = sum(tk2) + (prev_input_tokens - sum(toks))
                    earlier.append((resp, list(history), prev_full_tokens))
        finally:
            await app.shutdown()
            await ref.shutdown()

    import tempfile

    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        uvloop.run(main(Path(d)))


def test_the_prefix_cache_bounds_are_configured() -> None:
    cfg = Config()
    assert cfg.prefix_cache_entries == 512 and cfg.prefix_cache_bytes == 128 * 1024 * 1024


@pytest.mark.parametrize("body", [b"[]", b" [ ] ", b"{}", b'"text"', b"[1"])
def test_open_array_rejects_what_cannot_be_extended(body: bytes) -> None:
    assert reuse.open_array(body) is None


def test_errors_after_a_prefix_name_the_place_in_the_whole_input(tmp_path: Path) -> None:
    async def main() -> None:
        app = _app(tmp_path / "a")
        ref = _app(tmp_path / "b", prefix_cache_entries=0)
        await app.startup()
        await ref.startup()
        try:
            async with (
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client,
                httpx.AsyncClient(transport=httpx.ASGITransport(app=ref), base_url="http://t") as rclient,
            ):
                history: list[dict[str, Any]] = [{"role": "user", "content": "start " * 100}]
                first = await _post(client, {"input": history})
                history += first["output"]
                bad_suffixes = [
                    [{"type": "function_call_output", "call_id": "nope", "output": "x"}],  # prepare's check
                    [{"role": "user", "content": "ok"}, {"type": "message", "role": "user", "content": 5}],  # validation
                ]
                for suffix in bad_suffixes:
                    body = {"model": "hotloop-sim", "input": history + suffix}
                    got = await client.post("/v1/responses", json=body)
                    want = await rclient.post("/v1/responses", json=body)
                    assert got.status_code == want.status_code == 400
                    assert got.json()["error"] == want.json()["error"]
                    param = got.json()["error"]["param"]
                    assert int(param.split("[")[1].split("]")[0]) >= len(history), param
                assert app.engine.prefixes.hits >= 1  # the first bad request did reuse the prefix
        finally:
            await app.shutdown()
            await ref.shutdown()

    uvloop.run(main())


def test_a_resent_output_is_reused_only_when_it_is_the_one_produced(tmp_path: Path) -> None:
    """The output a client sends back is reused (its tokens cached, not analysed again) when it
    is the output the server produced; an edited one is the client's own new input."""

    async def main() -> None:
        app = _app(tmp_path)
        await app.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                first_input = [{"role": "user", "content": "start " + "words " * 40}]
                first = await _post(client, {"input": first_input})
                out = first["output"]
                chain = app.engine.responses.get(first["id"], None).context.chain  # type: ignore[union-attr]
                output_tokens = chain.total_tokens - chain.tokens_upto(1)
                new = [{"role": "user", "content": "next"}]
                same = await _post(client, {"input": first_input + out + new})
                assert _cached(same) == first["usage"]["input_tokens"] + output_tokens
                edited = [dict(out[0], content=[{"type": "output_text", "text": "something else", "annotations": []}])]
                other = await _post(client, {"input": first_input + edited + new})
                assert _cached(other) == first["usage"]["input_tokens"]
                # only the output: nothing is left to be the request's own, so it is not reused
                alone = await _post(client, {"input": first_input + out})
                assert _cached(alone) == first["usage"]["input_tokens"]
                for r, sent in ((same, first_input + out + new), (other, first_input + edited + new), (alone, first_input + out)):
                    counted = await client.post("/v1/responses/input_tokens", json={"model": "hotloop-sim", "input": sent})
                    assert r["usage"]["input_tokens"] == counted.json()["input_tokens"]
        finally:
            await app.shutdown()

    uvloop.run(main())


def test_a_registration_without_bytes_never_replaces_one_with_them() -> None:
    cache = PrefixCache()
    texts = ["a" * 300, "b"]
    raw = _raw(texts)
    with_bytes = _prefix(texts, raw=reuse.open_array(raw), rid="r1")  # type: ignore[arg-type]
    assert with_bytes.raw is not None
    cache.put(with_bytes)
    cache.put(_prefix(texts, rid="r2"))  # the same items, chained: no bytes
    longer = _raw(texts + ["c"])
    assert reuse.split_raw(cache, "alice", longer) is not None  # still matched by its bytes
    assert len(cache) == 1
    cache.put(_prefix(texts, raw=reuse.open_array(raw), rid="r3"))  # with bytes: the newer wins
    hit = reuse.split_raw(cache, "alice", longer)
    assert hit is not None and hit[0].entry.response["id"] == "r3" and len(cache) == 1


def test_a_chained_twin_of_a_full_history_conversation_keeps_its_byte_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two conversations of one key with the same turns, one resending its history, the other
    chained over a WebSocket connection: the chained one's registrations (without bytes, under
    the same index keys) must not push the other to a full decode and fingerprint match every
    turn (it did: 5 ms instead of 0.8 ms a turn at 100 KB of history)."""
    from hotloop.protocol.request import decode_body
    from hotloop.state.context import ConnectionCache
    from hotloop.tenants.auth import ANONYMOUS

    fingerprinted: list[int] = []
    real = itemlib.fingerprint

    def counted(item: Any, where: str = "input") -> bytes:
        fingerprinted.append(id(item))
        return real(item, where)

    async def main() -> None:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        eng = app.engine
        try:
            history: list[dict[str, Any]] = []
            conn = ConnectionCache(1)
            prev: str | None = None
            for i in range(8):
                turn = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"turn {i} " + "words " * 300}]}
                history.append(turn)
                body = json.dumps({"model": "hotloop-sim", "store": False, "input": history}).encode()
                fingerprinted.clear()
                req, prefix, raw = reuse.decode_create(body, eng.prefixes, ANONYMOUS.id)
                run = await eng.start(req, transport="json", prefix=prefix, raw_input=raw, tenant=ANONYMOUS)
                # the output sent back is fingerprinted once, by the decoder (continued() takes it)
                assert len(fingerprinted) == len(set(fingerprinted)), i
                full = await run.drain()
                history += full["output"]
                frame = {"model": "hotloop-sim", "store": False, "input": [turn], "previous_response_id": prev}
                chained = await (await eng.start(decode_body(json.dumps(frame)), transport="ws", conn=conn, websocket=True)).drain()
                prev = chained["id"]
            assert eng.prefixes.body_hits == 7  # every full-history turn after the first, by its bytes
        finally:
            await app.shutdown()

    monkeypatch.setattr(itemlib, "fingerprint", counted)
    uvloop.run(main())


def test_dropping_an_entrys_bytes_keeps_its_fingerprint_match_and_the_accounting() -> None:
    cache = PrefixCache()
    texts = ["a" * 300, "b"]
    raw = _raw(texts)
    old = _prefix(texts, raw=reuse.open_array(raw), rid="r1")  # type: ignore[arg-type]
    assert cache.put(old)
    newer = _prefix(texts + ["c"], raw=reuse.open_array(_raw(texts + ["c"])), rid="r2")  # type: ignore[arg-type]
    assert cache.put(newer)
    both = cache.nbytes
    assert both == old.size + newer.size and cache.with_bytes() == 2
    cache.drop_raw(old)
    assert cache.with_bytes() == 1 and old.raw is None and old.lead is None and old.head is None
    assert cache.nbytes == both - raw.__sizeof__() == old.size + newer.size  # the view held the whole array
    # no longer matched by its bytes ("c" extends it, but "d" extends only the old one) ...
    assert reuse.split_raw(cache, "alice", _raw(texts + ["d"])) is None
    # ... but by its items
    items = decode_items([{"role": "user", "content": t} for t in texts + ["d"]])
    assert reuse.match(cache, "alice", items) is old
    cache.drop_raw(old)  # again: nothing changes
    assert cache.nbytes == old.size + newer.size
    gone = _prefix(["x" * 300, "y"], raw=reuse.open_array(_raw(["x" * 300, "y"])), rid="r3")  # type: ignore[arg-type]
    cache.drop_raw(gone)  # never registered: left alone
    assert gone.raw is not None and cache.nbytes == old.size + newer.size
    assert not PrefixCache(max_bytes=1).put(newer)  # too large to keep: not registered


def test_a_conversation_keeps_one_request_body(tmp_path: Path) -> None:
    """Each full-history turn's registration holds its request body (a view of it); the one it
    extends gives its bytes up, so a conversation of any length holds one body, not one per turn
    (each a copy of the whole history), and a fork from an earlier turn still finds its prefix."""

    async def main() -> None:
        app = _app(tmp_path)
        await app.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                history: list[dict[str, Any]] = []
                for i in range(8):
                    history.append({"role": "user", "content": f"turn {i} " + "words " * 60})
                    resp = await _post(client, {"input": history})
                    history += resp["output"]
                cache = app.engine.prefixes
                assert len(cache) == 8 and cache.with_bytes() == 1
                assert cache.body_hits == 7  # every turn after the first, by its bytes
                stats = (await client.get("/hotloop/stats")).json()["prefix_cache"]
                assert stats["entries"] == 8 and stats["with_bytes"] == 1 and stats["bytes"] == cache.nbytes
                fork = history[:5] + [{"role": "user", "content": "another way"}]
                assert _cached(await _post(client, {"input": fork})) > 0  # by its items
                assert _cached(await _post(client, {"input": history + [{"role": "user", "content": "go on"}]})) > 0
                assert cache.body_hits == 8
        finally:
            await app.shutdown()

    uvloop.run(main())


def test_a_byte_hit_is_validated_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new items of a request matched by its bytes are validated where they are decoded;
    Engine.start takes that result (the same request object) instead of validating them again."""
    from hotloop.protocol import request as requestlib
    from hotloop.server import engine as enginelib

    calls: list[int] = []

    def counted(req: Any, **kw: Any) -> Any:
        calls.append(len(req.input) if type(req.input) is list else -1)
        return requestlib.validate(req, **kw)

    monkeypatch.setattr(enginelib, "validate", counted)
    monkeypatch.setattr(reuse, "validate", counted)

    async def main() -> None:
        app = _app(tmp_path)
        await app.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                history: list[dict[str, Any]] = [{"role": "user", "content": "first " + "words " * 60}]
                history += (await _post(client, {"input": history}))["output"]
                assert calls == [1]
                history.append({"role": "user", "content": "second"})
                resp = await _post(client, {"input": history})
                assert app.engine.prefixes.body_hits == 1 and _cached(resp) > 0
                assert calls == [1, 2]  # once, for the two items after the prefix
        finally:
            await app.shutdown()

    uvloop.run(main())


def test_a_match_by_items_leaves_the_bytes_of_the_input_it_reused(tmp_path: Path) -> None:
    """Another client of the same key sends a conversation's history spelled differently (its
    own JSON spacing) plus an item of its own: it reuses the conversation's prefix by
    fingerprint, and must not take that prefix's bytes away, so the conversation's next turn
    is still matched by its bytes."""

    async def post(client: httpx.AsyncClient, items: list[dict[str, Any]], **dumps: Any) -> dict[str, Any]:
        body = json.dumps({"model": "hotloop-sim", "metadata": {"sim": "tokens:3"}, "input": items}, **dumps).encode()
        r = await client.post("/v1/responses", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    async def main() -> None:
        app = _app(tmp_path)
        await app.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                cache = app.engine.prefixes
                a: list[dict[str, Any]] = []
                for i in range(2):
                    a.append({"role": "user", "content": f"turn {i} " + "words " * 60})
                    a += (await post(client, a, separators=(",", ":")))["output"]
                raw_hits = cache.raw_hits
                side = await post(client, a + [{"role": "user", "content": "side task"}])  # spaces
                assert _cached(side) > 0 and cache.raw_hits == raw_hits  # by its items
                a.append({"role": "user", "content": "A goes on"})
                await post(client, a, separators=(",", ":"))
                assert cache.raw_hits == raw_hits + 1  # by its bytes, still
                assert cache.with_bytes() == 2  # A's newest body and the other client's
        finally:
            await app.shutdown()

    uvloop.run(main())


def test_decoding_with_the_input_left_raw_gives_the_ordinary_request() -> None:
    """Every field of a request decoded with its input left raw (then the input alone) is the
    field :func:`decode_body` gives, for each kind of input and for a continuation."""
    from hotloop.protocol.request import decode_body

    cache = PrefixCache()
    texts = ["x" * 300, "second"]
    _register(cache, _body(texts), texts)  # not empty: decode_create takes its own path
    fields = {
        "model": "m", "instructions": "be brief", "store": False, "stream": True, "stream_options": {"include_obfuscation": False},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "required",
        "parallel_tool_calls": False, "max_output_tokens": 77, "max_tool_calls": 3, "temperature": 0.5, "top_p": 0.9,
        "top_logprobs": 2, "text": {"format": {"type": "json_object"}, "verbosity": "low"}, "reasoning": {"effort": "low"},
        "metadata": {"k": "v"}, "include": ["reasoning.encrypted_content"], "truncation": "auto", "prompt_cache_key": "p",
        "prompt_cache_retention": "24h", "user": "u", "safety_identifier": "s", "service_tier": "flex", "background": False,
        "conversation": None, "prompt": None, "generate": True, "stream_id": "lane-1", "type": "response.create",
    }
    assert set(fields) | {"input", "previous_response_id"} == {f.name for f in msgspec.structs.fields(reuse.CreateRequest)}
    inputs: list[Any] = ["a string", [{"role": "user", "content": "one"}], [{"role": "user", "content": t} for t in texts + ["third"]]]
    for value in inputs:
        for prev in (None, "resp_1"):
            spelt = json.dumps(value) if isinstance(value, str) else "[" + ",".join(map(json.dumps, value)) + "]"  # as _body spells items
            head = json.dumps({**fields, **({"previous_response_id": prev} if prev else {})})
            body = (head[:-1] + ', "input": ' + spelt + "}").encode()
            req, _, _ = reuse.decode_create(body, cache, "alice")
            whole = decode_body(body)
            if isinstance(value, list) and len(value) == 3 and prev is None:
                assert req.input == [{"role": "user", "content": "third"}]  # a prefix hit: the new item only
                req = msgspec.structs.replace(req, input=whole.input)
            assert req == whole


def test_a_sent_back_output_takes_its_fingerprint_from_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """continued(): an item equal, field for field, to the entry's own at its place (the output a
    client sends back as it got it) takes the fingerprint the chain holds for it, without
    hashing; any other item is hashed and compared as before."""
    answer = Message(role="assistant", content="done " * 50)
    e = _entry(["one", "two"])
    fps, toks, sizes = itemlib.analyze([answer])
    e.context.extend([answer], fps, toks, sizes)  # the response's output, after its two inputs
    p = Prefix(e, 2, itemlib.fingerprint(e.context.items[1]), e.context.nbytes)
    real = itemlib.fingerprint
    hashed: list[Any] = []
    monkeypatch.setattr(itemlib, "fingerprint", lambda item, where="input": hashed.append(item) or real(item, where))
    sent_back = [Message(role="assistant", content="done " * 50), Message(role="user", content="three")]
    assert sent_back[0] == answer and sent_back[0] is not answer
    got, k = reuse.continued(p, sent_back)
    assert k == 1 and got.n == 3 and got.last_fp == fps[0] == real(sent_back[0]) and hashed == []
    other = [Message(role="assistant", content="not what it said"), sent_back[1]]
    got, k = reuse.continued(p, other)
    assert k == 0 and got is p and hashed == [other[0]]  # hashed, and not the entry's


_RUN_TOOL = {"type": "function", "name": "run", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}


def test_an_ai_sdk_history_looks_up_only_the_references_it_adds(tmp_path: Path) -> None:
    """An AI SDK history names every earlier reasoning item by reference at each step. Matched
    by its bytes, a step looks up only the reference its new items add (Prefix.checked), not all
    of them again, while every response they were found in is still cached and unexpired: a look-up
    would find the same items there. One of those responses expired, or let go by the cache, and
    the next step looks them all up again (the store still has it: the same answer); one deleted
    while the memo held is answered as from scratch (item_not_found)."""

    async def main() -> None:
        app = _app(tmp_path)
        await app.startup()
        responses = app.engine.responses
        found = responses.find_item_held
        lookups: list[str] = []

        def counted(item_id: str, scope: str | None = None) -> Any:
            lookups.append(item_id)
            return found(item_id, scope)

        responses.find_item_held = counted
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:

                def conversation(opening: str) -> Any:
                    history: list[dict[str, Any]] = [{"role": "user", "content": opening + " " + "words " * 60}]
                    ids: list[str] = []

                    async def step() -> httpx.Response:
                        lookups.clear()
                        body = {"model": "hotloop-sim", "metadata": {"sim": "reasoning,tools:1,tokens:3"}, "tools": [_RUN_TOOL], "input": history}
                        r = await client.post("/v1/responses", json=body)
                        if r.status_code == 200:
                            ids.append(r.json()["id"])
                            for item in r.json()["output"]:
                                if item["type"] == "reasoning":
                                    history.append({"type": "item_reference", "id": item["id"]})
                                elif item["type"] == "function_call":
                                    history.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
                                    history.append({"type": "function_call_output", "call_id": item["call_id"], "output": f"ok {len(ids)}"})
                        return r

                    return step, ids

                step, ids = conversation("fix the build")
                per_step: list[int] = []
                for _ in range(10):
                    r = await step()
                    assert r.status_code == 200, r.text
                    per_step.append(len(lookups))
                # from the third step on, the one reference each step adds (step i names i of them)
                assert per_step[2:] == [1] * 8, per_step
                assert app.engine.prefixes.raw_hits == 9
                # the clock passes the first expiry of the responses the references were found
                # in (the store's own clock keeps them): all looked up again, in the store
                now = app.engine.clock
                app.engine.clock = lambda: now() + 30 * 24 * 3600.0 + 10.0
                try:
                    assert (await step()).status_code == 200
                    assert len(lookups) >= 10, lookups
                finally:
                    app.engine.clock = now
                assert (await step()).status_code == 200 and len(lookups) >= 11  # (found in the cache: noted again)
                assert (await step()).status_code == 200 and len(lookups) == 1
                assert app.engine.prefixes.raw_hits == 12
                # a response whose reasoning the history names, deleted while the memo holds
                assert (await client.delete(f"/v1/responses/{ids[3]}")).status_code == 200
                r = await step()
                assert r.status_code == 400 and r.json()["error"]["code"] == "item_not_found", r.text

                step, ids = conversation("fix the tests")
                for _ in range(4):
                    assert (await step()).status_code == 200
                assert len(lookups) == 1
                # the cache lets the first step's response go (its bounds): the store still has it
                responses._drop(ids[0])
                assert (await step()).status_code == 200
                assert len(lookups) >= 4, lookups  # all it held, looked up again
        finally:
            await app.shutdown()

    uvloop.run(main())


def test_a_fork_through_the_prefix_cache_does_not_answer_for_ids_the_server_minted_elsewhere(tmp_path: Path) -> None:
    """A full-history request that reuses a stored response's input as a fork (not all of its
    history: stored with its whole input) holds that response's items, with the ids the server
    minted for them. Stored as this response's own minted ids, an item_reference to one still
    resolved after the response that minted it was deleted: from scratch it is not found (the
    fork would have minted ids of its own)."""

    async def main() -> None:
        app = _app(tmp_path)
        await app.startup()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                m1 = {"role": "user", "content": "the first message of a fork " * 10}
                r1 = await _post(client, {"input": [m1]})
                listed = (await client.get(f"/v1/responses/{r1['id']}/input_items")).json()["data"]
                m1_id = listed[0]["id"]
                r2 = await _post(client, {"input": [m1, {"role": "user", "content": "a different second turn"}]})
                assert _cached(r2) > 0  # the fork reused r1's input
                ref = {"input": [{"type": "item_reference", "id": m1_id}]}
                assert (await _post(client, ref))["status"] == "completed"  # r1 minted it, and is kept
                assert (await client.delete(f"/v1/responses/{r1['id']}")).status_code == 200
                await app.persistence.flush()
                for _ in ("cached", "stored"):  # the fork's cached entry, then (as after a restart) the store
                    r = await client.post("/v1/responses", json={"model": "hotloop-sim", **ref})
                    assert r.status_code == 400 and r.json()["error"]["code"] == "item_not_found", r.text
                    app.engine.responses.clear()
                # the fork itself is still whole
                assert (await client.get(f"/v1/responses/{r2['id']}/input_items")).status_code == 200
        finally:
            await app.shutdown()

    uvloop.run(main())
