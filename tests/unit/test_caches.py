"""Byte bounds of the response caches and the sizes they count (Context.nbytes)."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import tracemalloc
from typing import Any

import msgspec

from hotloop.config import Config
from hotloop.pipeline import items as itemlib
from hotloop.pipeline.post import from_record, to_record
from hotloop.pipeline.prepare import finished, prepare
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import FunctionCall, Message, OutputText, decode_body, decode_items, validate
from hotloop.server.runner import make_app
from hotloop.state.context import (
    ITEM_OVERHEAD,
    CachedResponse,
    ConnectionCache,
    Context,
    ResponseCache,
    entry_nbytes,
    held_extra,
    item_id_of,
    item_nbytes,
    response_nbytes,
)

IDS = IdGen(deterministic=True)


def _plan(body: dict[str, Any], parent: CachedResponse | None = None):
    return prepare(validate(decode_body(json.dumps(body))), parent, IDS, itemlib.TokenCache())


def _entry(rid: str, text: str = "hi", parent: CachedResponse | None = None, answer: str = "ok") -> CachedResponse:
    body: dict[str, Any] = {"model": "m", "input": text}
    if parent is not None:
        body["previous_response_id"] = parent.id
    plan = _plan(body, parent)
    response = response_object(plan.prepared, rid, 0)
    response["output"] = [
        {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": answer, "annotations": []}]}
    ]
    return finished(plan, response)


# -- sizes -------------------------------------------------------------------------------------


def test_split_and_analyze_report_the_same_sizes() -> None:
    items = [
        Message(role="user", content="x" * 1000),
        Message(role="assistant", content=[OutputText(text="é" * 300)]),
        FunctionCall(call_id="c1", name="f", arguments='{"a": 1}'),
    ]
    _, _, _, split_sizes = itemlib.split(items, itemlib.TokenCache())
    _, _, analyze_sizes = itemlib.analyze(items, itemlib.TokenCache())
    assert split_sizes == analyze_sizes == [
        len(itemlib.canonical(it)) + ITEM_OVERHEAD + held_extra(it) for it in items
    ]
    assert split_sizes[0] >= 1000 + ITEM_OVERHEAD
    assert split_sizes[1] >= 600 + ITEM_OVERHEAD  # UTF-8 bytes, not characters
    # the estimate for items of unknown size (loaded from the store) is never below the exact one
    assert all(item_nbytes(it) >= n for it, n in zip(items, split_sizes))


def _held(raw_items: list[Any]) -> int:
    """Bytes the decoded items of ``raw_items`` really hold (tracemalloc, from their JSON)."""
    body = json.dumps(raw_items, separators=(",", ":")).encode()
    gc.collect()
    tracemalloc.start()
    try:
        items = decode_items(msgspec.json.decode(body))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    _HELD.append(items)  # measured after the sizes are asked: encoding caches UTF-8 copies
    return held


_HELD: list[Any] = []


def test_sizes_count_what_decoded_items_hold_not_only_their_json() -> None:
    """An item was counted as its view's JSON plus 256 bytes: an item kept verbatim with an array
    of 90,000 empty objects (270 KB of JSON) held 6.5 MB decoded (24x), a message of 90,000
    two-letter parts 9x, a reasoning summary 20x, Latin text with one emoji 4-5x; a server's
    response and prefix caches, within their 128 MiB each, held 1.35 GB after 30 such requests.
    Now every size is at least about what the decoded item holds."""
    n = 30_000
    shapes: dict[str, list[Any]] = {
        "verbatim_objects": [{"type": "custom_tool_call", "call_id": "c", "input": "y", "extra": [{} for _ in range(n)]}],
        "verbatim_arrays": [{"type": "custom_tool_call", "call_id": "c", "input": "y", "extra": [[] for _ in range(n)]}],
        "verbatim_strings": [{"type": "custom_tool_call", "call_id": "c", "extra": [f"{i % 100:02d}" for i in range(n)]}],
        "message_parts": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ab"}] * n}],
        "output_parts": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": ""}] * n}],
        "summary_parts": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "ab"}] * n}],
        "one_emoji": [{"type": "message", "role": "user", "content": "\U0001F600" + "a" * 300_000}],
        "emoji_args": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "\U0001F600" + "a" * 300_000}],
    }
    for name, raw in shapes.items():
        held = _held(raw)
        items = _HELD.pop()
        counted = sum(itemlib.split(items)[3])
        estimated = sum(map(item_nbytes, items))
        assert counted >= held * 0.8, (name, held, counted)
        assert estimated >= held * 0.8, (name, held, estimated)
        assert counted <= held * 4, (name, held, counted)  # and not wildly over
    # ordinary ASCII items: sizes as before (their JSON plus ITEM_OVERHEAD)
    plain = [Message(role="user", content="x" * 1000), FunctionCall(call_id="c1", name="f", arguments='{"a": 1}')]
    assert itemlib.split(plain)[3] == [len(itemlib.canonical(it)) + ITEM_OVERHEAD for it in plain]


def test_a_response_counts_its_output_schema_as_decoded() -> None:
    """A text.format schema of 30,000 empty objects (90 KB of JSON) held 8 times the count of the
    Response object that echoes it (its JSON weighted 3 times)."""
    schema = {"type": "object", "x": [{} for _ in range(30_000)]}
    body = json.dumps({"text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}).encode()
    gc.collect()
    tracemalloc.start()
    try:
        response = msgspec.json.decode(body)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert response_nbytes(response) >= held


def test_context_nbytes_of_a_continuation_is_parent_plus_new() -> None:
    parent = _entry("resp_a", "a" * 5000, answer="b" * 700)
    ctx = parent.context
    assert ctx.nbytes == sum(itemlib.split(ctx.items)[3])  # input and output items
    assert ctx.nbytes > 5700

    plan = _plan({"model": "m", "input": "c" * 3000, "previous_response_id": "resp_a"}, parent)
    new_sizes = itemlib.split(plan.new_items)[3]
    assert plan.context.nbytes == ctx.nbytes + sum(new_sizes)
    assert parent.context.nbytes == sum(itemlib.split(parent.context.items)[3])  # parent unchanged

    child = _entry("resp_b", "c" * 3000, parent=parent, answer="d" * 10)
    assert child.context.nbytes == sum(itemlib.split(child.context.items)[3])


def test_context_from_the_store_estimates_sizes() -> None:
    entry = _entry("resp_s", "s" * 4000)
    loaded = from_record(to_record(entry))
    assert loaded.context.nbytes == sum(item_nbytes(it) for it in loaded.context.items)
    assert loaded.context.nbytes >= entry.context.nbytes
    assert loaded.context.nbytes < entry.context.nbytes + 1000
    ctx = Context()
    ctx.extend([Message(role="user", content="q")], [bytes(16)], [2], [77])
    assert ctx.nbytes == 77


def test_entry_nbytes_counts_context_and_response() -> None:
    entry = _entry("resp_e", "e" * 2000, answer="f" * 3000)
    assert entry_nbytes(entry) > entry.context.nbytes + 3000  # the Response object holds the output too


def test_a_response_counts_its_decoded_form_and_its_tools_unless_the_tools_cache_holds_them() -> None:
    """The Response object was counted as its JSON: decoded, with 429 KB of tool definitions,
    it held about 8 times that. Now its JSON is weighted, its tools as the tools cache counts
    them; tools the tools cache holds (shared) are counted there, once."""
    from hotloop.pipeline.settings import ToolsCache
    from hotloop.state.context import RESPONSE_WEIGHT, TOOLS_WEIGHT, response_nbytes

    props = {f"p{i}": {"type": "string", "description": "x" * 20} for i in range(40)}
    tools = [{"type": "function", "name": f"f{j}", "parameters": {"type": "object", "properties": props}} for j in range(30)]
    raw = json.dumps(tools).encode()
    response = {"id": "resp_t", "object": "response", "output": [], "tools": tools}
    whole = len(json.dumps(response, separators=(",", ":")))
    assert response_nbytes(response) >= RESPONSE_WEIGHT * whole + TOOLS_WEIGHT * len(raw) * 0.9
    shared = ToolsCache().get("owner", raw)  # the tools cache's own (shared) list
    assert shared is not None
    held = {**response, "tools": shared.tools}
    assert RESPONSE_WEIGHT * whole * 0.9 <= response_nbytes(held) < TOOLS_WEIGHT * len(raw)
    # long instructions are counted by length, not encoded: about their JSON all the same
    for instructions in ("i" * 10_000, "line\n" * 2_000, "é" * 10_000):
        for r in ({**response, "instructions": instructions}, {**held, "instructions": instructions}):
            encoded = len(msgspec.json.encode({**r, "tools": tools})) * RESPONSE_WEIGHT
            extra = TOOLS_WEIGHT * len(msgspec.json.encode(tools)) if r["tools"] is tools else 0
            assert 0.8 * encoded <= response_nbytes(r) - extra <= 1.2 * encoded


def test_entry_nbytes_is_computed_once_and_counts_in_the_prefix_cache() -> None:
    from hotloop.state.prefix import Prefix

    entry = _entry("resp_p", "p" * 500)
    entry.response["instructions"] = "i" * 100_000  # echoed instructions: not in the context
    n = entry_nbytes(entry)
    assert n > entry.context.nbytes + 100_000 and entry.nbytes == n
    entry.response["instructions"] = None
    assert entry_nbytes(entry) == n  # a cached entry no longer changes: not encoded again
    p = Prefix(entry, 1, b"f" * 16, entry.context.nbytes)
    assert p.size >= n  # the prefix cache counts the Response object too (it did not)


def test_a_prefix_counts_the_whole_allocation_of_the_body_its_bytes_are_cut_from() -> None:
    """Raw bytes are a view of their request body; a body read directly is allocated in whole
    steps (``httpproto.new_body``), and the prefix cache's byte budget counts all of it."""
    from hotloop.server.httpproto import BODY_STEP, new_body
    from hotloop.state.prefix import Prefix

    entry = _entry("resp_r", "r" * 500)
    body = new_body(BODY_STEP + 10)
    body[:] = b"[" + b" " * (len(body) - 1)
    p = Prefix(entry, 1, b"f" * 16, entry.context.nbytes, memoryview(body)[:100], b"[")
    bare = Prefix(entry, 1, b"f" * 16, entry.context.nbytes)
    assert p.size - bare.size >= 2 * BODY_STEP  # not just the view's 100 bytes, nor the body's length


# -- ResponseCache -----------------------------------------------------------------------------


def test_response_cache_evicts_least_recently_used_by_bytes() -> None:
    cache = ResponseCache(max_entries=100, max_items=10_000, max_bytes=1000)
    for i in range(5):
        cache.put(_entry(f"r{i}"), nbytes=200)
    assert (len(cache), cache.nbytes) == (5, 1000)
    assert cache.get("r0") is not None  # r0 is now the most recently used
    cache.put(_entry("r5"), nbytes=250)
    assert cache.get("r1") is None and cache.get("r2") is None  # 1250 -> 850: two evicted
    assert [cache.get(f"r{i}") is not None for i in (0, 3, 4, 5)] == [True] * 4
    assert cache.nbytes == 850


def test_response_cache_refuses_entries_over_a_quarter_of_the_budget() -> None:
    cache = ResponseCache(max_bytes=1000)
    cache.put(_entry("small"), nbytes=250)
    assert cache.get("small") is not None
    cache.put(_entry("big"), nbytes=251)
    assert cache.get("big") is None
    assert (len(cache), cache.nbytes) == (1, 250)
    # replacing a cached entry by an oversize version removes it, counters follow
    cache.put(_entry("small"), nbytes=400)
    assert (len(cache), cache.nbytes, cache.items) == (0, 0, 0)


def test_response_cache_sizes_entries_itself() -> None:
    cache = ResponseCache(max_bytes=4 * 1024 * 1024)
    cache.put(_entry("x", "x" * 2_000_000))
    assert cache.get("x") is None  # ~2 MB > a quarter of 4 MiB
    e = _entry("y", "y" * 500_000)
    cache.put(e)
    assert cache.nbytes == entry_nbytes(e) > 500_000


def test_response_cache_counters_match_contents() -> None:
    rng = random.Random(7)
    entries = {f"r{i}": _entry(f"r{i}", "z" * rng.randrange(1, 50)) for i in range(12)}
    cache = ResponseCache(max_entries=6, max_items=14, max_bytes=4000)
    model: dict[str, tuple[int, int]] = {}
    for _ in range(500):
        rid = rng.choice(list(entries))
        op = rng.random()
        if op < 0.6:
            cache.put(entries[rid], nbytes=rng.randrange(1, 1200))
        elif op < 0.8:
            cache.evict(rid)
        else:
            cache.get(rid)
        held = [cache.get(k) for k in list(cache._d)]  # noqa: SLF001 - checking the invariant
        model = {e.id: (len(e.context), cache._sizes[e.id]) for e in held if e is not None}  # noqa: SLF001
        assert cache.items == sum(n for n, _ in model.values()) <= 14
        assert cache.nbytes == sum(b for _, b in model.values()) <= 4000
        assert len(cache) == len(model) <= 6


# -- ConnectionCache ---------------------------------------------------------------------------


def test_connection_cache_keeps_the_latest_per_lane_as_before() -> None:
    conn = ConnectionCache()
    a, b = _entry("a"), _entry("b")
    conn.put(a)
    conn.put(b)
    assert conn.get("a") is None and conn.get("b") is b
    conn.put(_entry("c"), "lane1")
    assert len(conn) == 2 and conn.get("b") is b
    assert conn.nbytes == entry_nbytes(b) + entry_nbytes(conn.get("c"))  # type: ignore[arg-type]


def test_connection_cache_byte_cap_evicts_oldest_entries_of_any_lane() -> None:
    conn = ConnectionCache(max_entries=2, max_bytes=1000)
    conn.put(_entry("a1"), "a", nbytes=300)
    conn.put(_entry("b1"), "b", nbytes=300)
    conn.put(_entry("a2"), "a", nbytes=300)
    assert conn.nbytes == 900
    conn.put(_entry("c1"), "c", nbytes=300)  # 1200 > 1000: the oldest (a1) goes
    assert conn.get("a1") is None
    assert all(conn.get(r) is not None for r in ("b1", "a2", "c1"))
    assert (len(conn), conn.nbytes) == (3, 900)
    conn.evict("b1", "b")
    assert (len(conn), conn.nbytes) == (2, 600)
    conn.evict("a2", "other-lane")  # not its lane: kept
    assert conn.get("a2") is not None


def test_connection_cache_does_not_keep_an_oversize_response() -> None:
    conn = ConnectionCache(max_bytes=1000)
    conn.put(_entry("a1"), None, nbytes=100)
    conn.put(_entry("b1"), "b", nbytes=100)
    conn.put(_entry("a2"), None, nbytes=1001)
    assert conn.get("a2") is None
    assert conn.get("a1") is None  # superseded in its lane all the same
    assert conn.get("b1") is not None and conn.nbytes == 100
    conn.clear()
    assert (len(conn), conn.nbytes) == (0, 0)


def test_connections_share_one_byte_budget_oldest_first() -> None:
    """Each connection under its own bound, all of them over the process's: the oldest entries
    go, whichever connection holds them; a closed connection gives its bytes back."""
    from hotloop.state.context import CacheBudget

    budget = CacheBudget(max_bytes=1000)
    one, two, three = (ConnectionCache(max_bytes=800, budget=budget) for _ in range(3))
    one.put(_entry("a"), nbytes=400)
    two.put(_entry("b"), nbytes=400)
    assert (budget.nbytes, len(budget)) == (800, 2)
    three.put(_entry("c"), nbytes=400)  # 1200 > 1000: one's "a" goes
    assert one.get("a") is None and (len(one), one.nbytes) == (0, 0)
    assert two.get("b") is not None and three.get("c") is not None
    assert (budget.nbytes, len(budget)) == (800, 2)
    two.put(_entry("b2"), nbytes=300)  # supersedes "b" on its lane: 700 in all
    assert two.get("b") is None and budget.nbytes == 700
    three.evict("c")
    assert budget.nbytes == 300
    one.put(_entry("big"), nbytes=1001)  # over the budget itself: not cached, nothing dropped
    assert one.get("big") is None and two.get("b2") is not None and budget.nbytes == 300
    two.clear()
    assert (budget.nbytes, len(budget)) == (0, 0)


def test_the_budget_makes_room_in_the_largest_owners_connections_first() -> None:
    """One tenant's connections filling the budget drop their own oldest responses, not another
    tenant's older one; once owners hold alike, the oldest of the largest goes."""
    from hotloop.state.context import CacheBudget

    budget = CacheBudget(max_bytes=1000)
    bob = ConnectionCache(max_bytes=800, budget=budget, owner="bob")
    bob.put(_entry("b1"), nbytes=200)  # the oldest of all
    alice = [ConnectionCache(max_bytes=800, budget=budget, owner="alice") for _ in range(4)]
    for i, conn in enumerate(alice):
        conn.put(_entry(f"a{i}"), nbytes=300)  # the third and the fourth pass 1000: alice's a0, a1 go
    assert bob.get("b1") is not None
    assert [c.get(f"a{i}") is not None for i, c in enumerate(alice)] == [False, False, True, True]
    assert (budget.nbytes, budget.owner_bytes("alice"), budget.owner_bytes("bob")) == (800, 600, 200)
    bob.put(_entry("b2"), "lane", nbytes=300)  # 1100: alice (600) still holds the most
    assert bob.get("b1") is not None and bob.get("b2") is not None and alice[2].get("a2") is None
    assert (budget.nbytes, budget.owner_bytes("alice"), budget.owner_bytes("bob")) == (800, 300, 500)
    bob.put(_entry("b3"), "other", nbytes=300)  # 1100: now bob holds the most: his oldest, b1
    assert bob.get("b1") is None and alice[3].get("a3") is not None
    for c in alice:
        c.clear()
    bob.clear()
    assert (budget.nbytes, len(budget), budget.owner_bytes("alice")) == (0, 0, 0)


# -- through the engine ------------------------------------------------------------------------


async def _continue_after_eviction() -> None:
    cfg = Config(store="memory", sim_rate=0, response_cache_bytes=400_000, ws_cache_bytes=200_000)
    app = make_app(cfg)
    await app.startup()
    try:
        eng = app.engine
        conn = ConnectionCache(max_bytes=cfg.ws_cache_bytes)
        big = {"model": "m", "input": "w " * 150_000, "metadata": {"sim": "text,tokens:3"}}
        run = await eng.start(decode_body(json.dumps(big)), transport="ws", conn=conn, websocket=True)
        first = await run.drain()
        assert first["status"] == "completed"
        assert conn.get(first["id"]) is None and eng.responses.get(first["id"]) is None
        assert conn.nbytes == 0 and eng.responses.nbytes == 0
        nxt = {"model": "m", "input": "more", "previous_response_id": first["id"], "metadata": {"sim": "text,tokens:3"}}
        run = await eng.start(decode_body(json.dumps(nxt)), transport="ws", conn=conn, websocket=True)
        second = await run.drain()
        assert second["status"] == "completed"
        assert second["usage"]["input_tokens"] > 150_000  # the whole history came back from the store
        assert app.stats()["response_cache"]["bytes"] == eng.responses.nbytes
    finally:
        await app.shutdown()


def test_a_response_too_large_for_the_caches_is_continued_from_the_store() -> None:
    asyncio.run(_continue_after_eviction())


def test_response_cache_knows_what_was_evicted_since_a_load_began() -> None:
    from hotloop.state.context import GONE_ENTRIES

    cache = ResponseCache()
    g = cache.generation
    assert not cache.evicted_since("a", g)
    cache.put(_entry("b"))  # puts and capacity evictions are not "gone"
    assert not cache.evicted_since("a", g)
    cache.evict("a")
    assert cache.evicted_since("a", g) and not cache.evicted_since("b", g)
    g2 = cache.generation
    assert not cache.evicted_since("a", g2)
    for i in range(GONE_ENTRIES + 1):  # more evictions than remembered: not known, so True
        cache.evict(f"x{i}")
    assert cache.evicted_since("b", g2) and not cache.evicted_since("b", cache.generation)
    g3 = cache.generation
    cache.clear()
    assert cache.evicted_since("b", g3)


async def _delete_while_loading() -> None:
    """DELETE of a stored response while a continuation loads it (shared stores read and
    delete in threads of their own): the load finished after the delete's eviction and put the
    response back in the process cache, which then served it (GET, previous_response_id) after
    its DELETE had answered 200."""
    app = make_app(Config(store="memory", sim_rate=0))
    await app.startup()
    try:
        eng = app.engine
        run = await eng.start(decode_body(json.dumps({"model": "m", "input": "hi", "metadata": {"sim": "text,tokens:2"}})),
                              transport="http")
        first = await run.drain()
        await app.persistence.flush()
        eng.responses.evict(first["id"])  # only in the store now
        loaded = asyncio.Event()
        go_on = asyncio.Event()
        real_load = app.persistence.load

        async def slow_load(rid: str, scope: Any = None) -> Any:
            hit = await real_load(rid, scope)
            loaded.set()
            await go_on.wait()  # the delete lands meanwhile
            return hit

        app.persistence.load = slow_load  # type: ignore[method-assign]
        nxt = {"model": "m", "input": "more", "previous_response_id": first["id"], "metadata": {"sim": "text,tokens:2"}}
        cont = asyncio.ensure_future(eng.start(decode_body(json.dumps(nxt)), transport="http"))
        await loaded.wait()
        app.persistence.load = real_load  # type: ignore[method-assign]
        assert await app.persistence.delete(first["id"], None)
        eng.responses.evict(first["id"])  # as DELETE /v1/responses/{id} does
        go_on.set()
        second = await (await cont).drain()  # it began before the delete: it goes on
        assert second["status"] == "completed"
        assert eng.responses.get(first["id"]) is None  # ... but the deleted response is not kept
        assert await eng.persistence.load(first["id"], None) is None
    finally:
        await app.shutdown()


def test_a_response_deleted_while_a_continuation_loads_it_is_not_cached_again() -> None:
    asyncio.run(_delete_while_loading())


# -- WebSocket frames waiting on a connection --------------------------------------------------


async def _flood(max_queued_bytes: int, frames: int, frame_chars: int) -> tuple[int, int]:
    """Frames the server had read when the first response completed, and responses completed."""
    app = make_app(Config(store="memory", sim_rate=0, ws_max_queued_bytes=max_queued_bytes))
    await app.startup()
    body = {"type": "response.create", "model": "m", "store": False, "input": "q" * frame_chars,
            "metadata": {"sim": "text,tokens:2,rate:20"}}
    pending = [json.dumps(body) for _ in range(frames)]
    read = 0
    read_at_first = -1
    completed = 0
    done = asyncio.Event()
    connected = False

    async def receive() -> dict:
        nonlocal read, connected
        if not connected:
            connected = True
            return {"type": "websocket.connect"}
        if pending:
            read += 1
            return {"type": "websocket.receive", "text": pending.pop()}
        await done.wait()
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(msg: dict) -> None:
        nonlocal completed, read_at_first
        if '"response.completed"' in msg.get("text", ""):
            completed += 1
            if read_at_first < 0:
                read_at_first = read
            if completed == frames:
                done.set()

    scope = {"type": "websocket", "path": "/v1/responses", "headers": [], "query_string": b"", "subprotocols": []}
    try:
        await asyncio.wait_for(app(scope, receive, send), 60)
    finally:
        await app.shutdown()
    return read_at_first, completed


def test_queued_websocket_frames_are_bounded_by_bytes() -> None:
    # 300,000-character frames, 1,000,000 bytes of queue: one running, three queued, one read and
    # waiting; the rest stay unread until the worker catches up
    read, completed = asyncio.run(_flood(1_000_000, 10, 300_000))
    assert completed == 10
    assert read <= 5
    read, completed = asyncio.run(_flood(64 * 1024 * 1024, 10, 300_000))
    assert completed == 10 and read == 10  # within the budget nothing waits


def test_token_cache_views_are_per_owner_and_share_the_bound_and_counters() -> None:
    cache = itemlib.TokenCache(max_entries=3)
    alice, bob = cache.view("alice"), cache.view("bob")
    assert cache.view("anonymous") is cache  # open mode: unprefixed keys
    fp = b"f" * 16
    alice.put(fp, 7)
    assert alice.get(fp) == 7 and bob.get(fp) is None and cache.get(fp) is None
    # an owner whose name extends another's cannot reach its keys either
    assert cache.view("alic").get(b"e" + fp[:15]) is None and cache.view("alice" + "\x00").get(fp) is None
    assert (cache.hits, alice.hits, bob.hits) == (1, 1, 1)  # one counter for every view
    bob.misses += 1
    assert cache.misses == 1
    for i in range(3):  # the bound is the cache's, all owners together
        bob.put(bytes([i]) * 16, i)
    assert len(cache) == 3 and alice.get(fp) is None


def test_a_size_walk_is_bounded_and_estimates_past_its_bound() -> None:
    """An item kept verbatim of millions of tiny values is not walked value by value (seconds on
    the event loop): past WALK_NODES values it counts VERBATIM_WORST times its JSON; so do
    content parts past WALK_PARTS, by the average of those seen."""
    import msgspec

    from hotloop.protocol.request import InputText, Message, OtherItem
    from hotloop.state import context

    small = {"type": "x_call", "input": [{} for _ in range(100)]}
    assert context._tree_nbytes(small) is not None
    big = {"type": "x_call", "input": [{} for _ in range(200_000)]}
    assert context._tree_nbytes(big) is None
    assert context.held_extra(OtherItem(type="x_call", data=big)) == context.VERBATIM_WORST * len(msgspec.json.encode(big))
    parts = [InputText(text="\u00e9" * 3) for _ in range(3 * context.WALK_PARTS)]
    each = context.held_extra(Message(role="user", content=parts[:10])) // 10
    assert context.held_extra(Message(role="user", content=parts)) == each * len(parts)


def test_a_connection_cache_does_not_serve_a_response_deleted_after_it_was_cached() -> None:
    from hotloop.state.context import ConnectionCache, Deletions

    deletions = Deletions(max_entries=2)
    cache = ConnectionCache(max_entries=2, deletions=deletions)
    a, b = _entry("resp_a"), _entry("resp_b")
    cache.put(a)
    cache.put(b, lane="side")
    deletions.add("resp_other")
    assert cache.get("resp_a") is a and cache.get("resp_b") is b  # another id's delete: still served
    deletions.add("resp_a")
    assert cache.get("resp_a") is None and len(cache) == 1  # dropped
    assert cache.get("resp_b") is b
    c = _entry("resp_c")
    cache.put(c)  # cached after every delete so far
    assert cache.get("resp_c") is c
    deletions.add("resp_x")
    deletions.add("resp_y")  # resp_a and resp_other let go: what was cached before them is unknown
    assert cache.get("resp_b") is None  # cached before an id let go: taken as deleted (a miss)
    assert cache.get("resp_c") is c  # cached after the ids let go were deleted
    fresh = _entry("resp_d")
    cache.put(fresh)
    assert cache.get("resp_d") is fresh


def _scan_position(items: list[Any], item_id: str) -> int | None:
    """Context.position computed the plain way: the last item carrying the id."""
    found = None
    for i, it in enumerate(items):
        if item_id_of(it) == item_id:
            found = i
    return found


def test_the_id_index_is_carried_to_continuations_and_kept_exact() -> None:
    """A context's id index is taken over by the contexts that continue it (a turn's context, a
    prefix cut of it) and extended over what they and it append; every lookup on every context
    answers as a scan of its own items does, whatever order lookups and appends come in,
    ids repeated included."""
    rng = random.Random(7)
    for _ in range(200):
        pool = [f"id_{k}" for k in range(6)]

        def item() -> Any:
            iid = rng.choice(pool + [None, None])
            if rng.random() < 0.5:
                return Message(role="assistant", content="t", id=iid)
            return FunctionCall(call_id=f"c{rng.randrange(9)}", name="f", arguments="{}", id=iid)

        root = Context([item() for _ in range(rng.randrange(5))])
        live = [root]
        for _ in range(12):
            ctx = rng.choice(live)
            step = rng.randrange(4)
            if step == 0:  # a lookup (builds or extends the index)
                pass
            elif step == 1:  # the context grows (a response's output appended)
                new = [item() for _ in range(rng.randrange(1, 3))]
                ctx.items.extend(new)
            elif step == 2:  # a continuation: its items begin with ctx's
                live.append(Context(ctx.items + [item() for _ in range(rng.randrange(3))], ids_from=ctx))
            else:  # a prefix of ctx reused
                n = rng.randrange(len(ctx.items) + 1)
                live.append(Context(ctx.items[:n], ids_from=ctx))
            for c in live:
                for iid in pool:
                    if rng.random() < 0.3:
                        assert c.position(iid) == _scan_position(c.items, iid)
        for c in live:
            for iid in pool:
                assert c.position(iid) == _scan_position(c.items, iid)
