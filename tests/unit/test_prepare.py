"""Pre-inference planning: deferred counting gives the same numbers as inline counting."""

from __future__ import annotations

import json

from hotloop.pipeline import items as itemlib
from hotloop.pipeline.prepare import finished, prepare
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import decode_body, validate

BIG_TOOL = {"type": "function", "name": "f", "description": "d " * 6000, "parameters": {"type": "object", "properties": {}}}


def plan_for(body: dict, parent=None, cache=None, defer=False):
    return prepare(validate(decode_body(json.dumps(body))), parent, IdGen(deterministic=True), cache, defer=defer)


def test_deferred_settings_keep_cached_tokens() -> None:
    body = {"model": "m", "input": "hi", "tools": [BIG_TOOL]}
    inline_first = plan_for(body, cache=itemlib.TokenCache())
    first = plan_for(body, cache=itemlib.TokenCache(), defer=True)
    assert not first.settled and first.pending_blobs  # the big tool is counted off the loop
    first.settle(itemlib.count_pending(*first.pending_texts()))
    assert first.input_tokens == inline_first.input_tokens
    response = response_object(first.prepared, "resp_1", 0)
    response["output"] = []
    parent = finished(first, response)
    # a continuation resending the same settings takes the parent's count: nothing to count
    again = {**body, "previous_response_id": "resp_1"}
    inline = plan_for(again, parent, cache=itemlib.TokenCache())
    deferred = plan_for(again, parent, cache=itemlib.TokenCache(), defer=True)
    assert not deferred.pending_blobs
    deferred.settle(itemlib.count_pending(*deferred.pending_texts()))
    # ... and the numbers of counting them from scratch
    parent.settings = None  # e.g. a parent loaded from the store
    scratch = plan_for(again, parent, cache=itemlib.TokenCache(), defer=True)
    assert scratch.pending_blobs
    scratch.settle(itemlib.count_pending(*scratch.pending_texts()))
    for plan in (inline, deferred):
        assert (plan.input_tokens, plan.cached_tokens) == (scratch.input_tokens, scratch.cached_tokens)
    assert inline.cached_tokens >= 6000


def test_a_continuation_on_another_model_reports_nothing_cached() -> None:
    """A prompt cache is per model: continued on the same model the parent's conversation is
    cached, on another one none of it (the input tokens are the same either way)."""
    first = plan_for({"model": "big", "input": "hello " * 50})
    response = response_object(first.prepared, "resp_1", 0)
    response["output"] = []
    parent = finished(first, response)
    same = plan_for({"model": "big", "input": "more", "previous_response_id": "resp_1"}, parent)
    other = plan_for({"model": "tiny", "input": "more", "previous_response_id": "resp_1"}, parent)
    assert same.cached_tokens >= 50 and other.cached_tokens == 0
    assert same.input_tokens == other.input_tokens


def test_settings_sent_differently_are_counted_again() -> None:
    """The parent's settings count is reused only for the very same instructions and tools: a
    tool with its keys in another order, or 1 where the parent had 1.0, is counted again (its
    text, and so perhaps its count, differs), and a changed instruction too."""
    tool = {"type": "function", "name": "f", "description": "run it", "parameters": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 1.0}}}}
    body = {"model": "m", "input": "hi", "instructions": "Be brief.", "tools": [tool]}
    first = plan_for(body)
    response = response_object(first.prepared, "resp_1", 0)
    response["output"] = []
    parent = finished(first, response)
    assert parent.settings is not None and parent.settings[1] == first.input_tokens - first.context.tokens
    # the kept JSON counts against the caches' byte budgets
    from hotloop.state.context import entry_nbytes, response_nbytes

    assert entry_nbytes(parent) == parent.context.nbytes + response_nbytes(response) + len(json.dumps([tool], separators=(",", ":")))
    same = plan_for({**body, "previous_response_id": "resp_1"}, parent, cache=itemlib.TokenCache(), defer=True)
    assert not same.pending_blobs and same.tools_json is parent.settings[0]  # one copy per chain
    same.settle(itemlib.count_pending(*same.pending_texts()))
    assert same.input_tokens - same.context.tokens == parent.settings[1]
    reordered = dict(reversed(list(tool.items())))
    whole = {**tool, "parameters": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 1}}}}
    for changed in ({"tools": [reordered]}, {"tools": [whole]}, {"instructions": "Be very brief."}):
        plan = plan_for({**body, **changed, "previous_response_id": "resp_1"}, parent, cache=itemlib.TokenCache(), defer=True)
        assert plan.pending_blobs, changed


def test_a_small_new_input_is_counted_and_flagged_after_the_backend_request() -> None:
    """The engine counts a small new input on the event loop once the backend has its request
    (the count is only needed for usage), and a large one in the tokenizer thread; under the
    default secrets policy (flag: nothing the backend sees can change) the scan of a small input
    runs after the request too. Usage, flags and the chain's classifier state are what running
    them first gives."""
    import asyncio
    import threading

    from hotloop.config import Config
    from hotloop.pipeline import classifiers
    from hotloop.protocol.request import CreateRequest
    from hotloop.server.runner import make_app
    from hotloop.state.context import ConnectionCache
    from tests.unit.test_secrets import POSITIVES

    secret = next(s for kind, _, s, _ in POSITIVES if kind == "github_token")
    order: list[str] = []
    real_count, real_classify = itemlib.count_pending, classifiers.classify_turn

    def counting(*texts):  # noqa: ANN002
        order.append("count" if threading.current_thread() is threading.main_thread() else "count in a thread")
        return real_count(*texts)

    def classifying(*args):  # noqa: ANN002
        order.append("classify")
        return real_classify(*args)

    from hotloop.server import engine as engine_module

    async def main() -> list[tuple[int, object, object]]:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        real_stream = app.engine.backend.stream

        async def stream(breq):  # noqa: ANN001
            order.append("backend")
            async for c in real_stream(breq):
                yield c

        app.engine.backend.stream = stream  # type: ignore[method-assign]
        itemlib.count_pending = counting  # type: ignore[assignment]
        classifiers.classify_turn = classifying  # type: ignore[assignment]
        # the thread takes inputs of 64 KB and more, as the scan's does: at 8 KB here, so that
        # one input is counted in the thread and scanned on the loop after the request
        inline, engine_module.INLINE_TOKENIZE_CHARS = engine_module.INLINE_TOKENIZE_CHARS, 8192
        try:
            out = []
            prev = None
            conn = ConnectionCache(1)  # a WebSocket connection's cache: store=False chains
            # 200 B with a secret, then 12 KB (counted in the thread, scanned on the loop)
            for text in ("a first question, long enough to count " * 5 + secret, "x " * 6000):
                body = {"model": "hotloop-sim", "input": text, "store": False, "metadata": {"sim": "text,tokens:3"}}
                if prev is not None:
                    body["previous_response_id"] = prev
                req: CreateRequest = decode_body(json.dumps(body).encode())
                run = await app.engine.start(req, transport="ws", conn=conn, websocket=True)
                resp = await run.drain()
                prev = resp["id"]
                out.append((resp["usage"]["input_tokens"], run.plan.flags, run.plan.states))
            return out
        finally:
            itemlib.count_pending = real_count  # type: ignore[assignment]
            classifiers.classify_turn = real_classify  # type: ignore[assignment]
            engine_module.INLINE_TOKENIZE_CHARS = inline
            await app.shutdown()

    (tokens1, flags1, states1), (tokens2, flags2, states2) = asyncio.run(main())
    assert order[0] == "backend" and sorted(order[1:3]) == ["classify", "count"]
    assert sorted(order[3:]) == ["backend", "classify", "count in a thread"]
    first = plan_for({"model": "hotloop-sim", "input": "a first question, long enough to count " * 5 + secret})
    assert tokens1 == first.input_tokens > 0
    assert tokens2 > tokens1 + 3000  # the chain plus ~6,000 tokens of new input
    assert flags1 == {"github_token": 1} and flags2 is None
    assert states1["secrets"].kinds_seen == frozenset({"github_token"}) and states2 == states1  # carried on


def test_a_deferred_scan_that_fails_leaves_the_response_alone(caplog) -> None:  # noqa: ANN001
    """A flag-only scan that raises (run after the backend request) is logged; the response
    completes, unflagged, with its chain's state unchanged."""
    import asyncio
    import logging

    from hotloop.config import Config
    from hotloop.pipeline import classifiers
    from hotloop.server.runner import make_app

    real = classifiers.classify_turn

    def broken(*args):  # noqa: ANN002
        raise RuntimeError("scanner exploded")

    async def main() -> tuple[str, object, object]:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        classifiers.classify_turn = broken  # type: ignore[assignment]
        try:
            req = decode_body(json.dumps({"model": "hotloop-sim", "input": "hi", "store": False,
                                          "metadata": {"sim": "text,tokens:3"}}).encode())
            run = await app.engine.start(req, transport="json")
            resp = await run.drain()
            return resp["status"], run.plan.flags, run.plan.states
        finally:
            classifiers.classify_turn = real  # type: ignore[assignment]
            await app.shutdown()

    with caplog.at_level(logging.ERROR, logger="hotloop"):
        status, flags, states = asyncio.run(main())
    assert status == "completed" and flags is None and states is None
    assert "the secrets scan failed" in caplog.text and "scanner exploded" in caplog.text


def test_a_deferred_settings_scan_in_the_tokenizer_thread_that_fails_leaves_the_response_alone(caplog) -> None:  # noqa: ANN001
    """The same for large instructions, scanned in the tokenizer thread after the backend
    request: the failure is logged, the response completes unflagged; a scan that works flags it."""
    import asyncio
    import logging

    from hotloop.config import Config
    from hotloop.pipeline.classify import SecretsClassifier
    from hotloop.server import engine as engine_mod
    from hotloop.server.runner import make_app

    real = SecretsClassifier.classify_settings
    secret = "ghp_" + "a1B2c3D4e5" * 3 + "abcdef"
    big = "x " * engine_mod.CLASSIFY_OFFLOAD_CHARS + secret

    def broken(self, p, owner=""):  # noqa: ANN001
        raise RuntimeError("settings scan exploded")

    async def main(scan: object) -> tuple[str, object]:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        SecretsClassifier.classify_settings = scan  # type: ignore[method-assign]
        try:
            req = decode_body(json.dumps({"model": "hotloop-sim", "input": "hi", "store": False, "instructions": big,
                                          "metadata": {"sim": "text,tokens:3"}}).encode())
            run = await app.engine.start(req, transport="json")
            resp = await run.drain()
            return resp["status"], run.plan.flags
        finally:
            SecretsClassifier.classify_settings = real  # type: ignore[method-assign]
            await app.shutdown()

    with caplog.at_level(logging.ERROR, logger="hotloop"):
        status, flags = asyncio.run(main(broken))
    assert status == "completed" and flags is None
    assert "the secrets scan failed" in caplog.text and "settings scan exploded" in caplog.text
    assert asyncio.run(main(real)) == ("completed", {"github_token": 1})


def test_the_opening_events_are_made_while_the_backend_works() -> None:
    """response.created and response.in_progress (and the Response object they carry) are made
    after the backend request is out and before its first chunk comes, not after it; a response
    whose backend answers at once (a warm-up, generate: false) makes them as well."""
    import asyncio
    import time

    from hotloop.config import Config
    from hotloop.protocol import events as ev
    from hotloop.server.runner import make_app

    async def main() -> tuple[list[str], float, float, list[str]]:
        app = make_app(Config(store="memory", sim_rate=0, sim_ttft=0.3))
        await app.startup()
        engine = app.engine
        real = engine._opening
        made: list[float] = []

        def spy(*args):  # noqa: ANN002
            made.append(time.perf_counter())
            return real(*args)

        engine._opening = spy  # type: ignore[method-assign]
        try:
            req = decode_body(json.dumps({"model": "hotloop-sim", "input": "hi", "store": False,
                                          "metadata": {"sim": "text,tokens:3"}}).encode())
            t0 = time.perf_counter()
            run = await engine.start(req, transport="sse")
            first_chunk = run.marks[-1]
            names = [name for batch in [b async for b in run.frames()] for name, _ in batch]
            warm = decode_body(json.dumps({"model": "hotloop-sim", "input": "hi", "store": False, "generate": False}).encode())
            wrun = await engine.start(warm, transport="sse")
            wnames = [name for batch in [b async for b in wrun.frames()] for name, _ in batch]
            return names, made[0] - t0, first_chunk - made[0], wnames
        finally:
            await app.shutdown()

    names, opened_after, chunk_after, warm = asyncio.run(main())
    assert names[:2] == [ev.CREATED, ev.IN_PROGRESS] and names[-1] == ev.COMPLETED
    assert warm == [ev.CREATED, ev.IN_PROGRESS, ev.COMPLETED]
    assert opened_after < 0.2 and chunk_after > 0.1  # made during the 0.3 s the backend took


def test_an_unknown_call_id_is_echoed_clipped() -> None:
    import pytest

    from hotloop import errors

    cid = "c" * 50_000
    with pytest.raises(errors.HotloopError) as ei:
        plan_for({"model": "m", "input": [{"type": "function_call_output", "call_id": cid, "output": "x"}]})
    e = ei.value
    assert e.status == 400 and e.param == "input[0].call_id"
    assert e.message.startswith("No tool call found for function call output with call_id ccc") and len(e.message) < 200


def test_instructions_spelled_as_an_items_json_share_no_count_with_it() -> None:
    """Items and settings share the token cache: instructions whose bytes were an item's
    fingerprinted JSON took the item's count (and gave it theirs), so one request changed the
    next ones' input_tokens (and could push them past the window)."""
    cache = itemlib.TokenCache()
    item = {"type": "message", "role": "user", "content": "hi"}
    alone = plan_for({"model": "m", "input": [item]}, cache=cache).input_tokens
    (decoded,) = validate(decode_body(json.dumps({"model": "m", "input": [item]}))).items
    data = itemlib._encode_view(itemlib.semantic_view(decoded), "input[0]")  # the bytes its count is filed under
    body = {"model": "m", "input": [item], "instructions": data.decode()}
    fresh = plan_for(body, cache=itemlib.TokenCache()).input_tokens
    for _ in range(3):
        assert plan_for(body, cache=cache).input_tokens == fresh  # the same whatever the cache held
    assert plan_for({"model": "m", "input": [item]}, cache=cache).input_tokens == alone


def test_an_item_kept_verbatim_counts_the_same_with_or_without_its_status() -> None:
    """Its count is cached under a fingerprint without id and status, but the text counted (and
    rendered) kept the status: whichever spelling was counted first stood for the other."""
    call = {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"}
    spellings = [call, {**call, "status": "completed"}]
    fresh = [plan_for({"model": "m", "input": [it]}, cache=itemlib.TokenCache()).input_tokens for it in spellings]
    assert fresh[0] == fresh[1]
    for order in (spellings, spellings[::-1]):
        cache = itemlib.TokenCache()
        assert [plan_for({"model": "m", "input": [it]}, cache=cache).input_tokens for it in order] == fresh
