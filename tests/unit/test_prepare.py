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
    first = plan_for(body, cache=itemlib.TokenCache())
    response = response_object(first.prepared, "resp_1", 0)
    response["output"] = []
    parent = finished(first, response)
    inline = plan_for({**body, "previous_response_id": "resp_1"}, parent, cache=itemlib.TokenCache())
    deferred = plan_for({**body, "previous_response_id": "resp_1"}, parent, cache=itemlib.TokenCache(), defer=True)
    assert not deferred.settled and deferred.pending_blobs  # the big tool is counted off the loop
    deferred.settle(itemlib.count_pending(*deferred.pending_texts()))
    assert (deferred.input_tokens, deferred.cached_tokens) == (inline.input_tokens, inline.cached_tokens)
    assert inline.cached_tokens >= 6000


def test_a_small_new_input_is_counted_after_the_backend_request() -> None:
    """The engine counts a small new input on the event loop once the backend has its request
    (the count is only needed for usage), and a large one in the tokenizer thread; usage is what
    counting first gives."""
    import asyncio
    import threading

    from hotloop.config import Config
    from hotloop.protocol.request import CreateRequest
    from hotloop.server.runner import make_app
    from hotloop.state.context import ConnectionCache

    order: list[str] = []
    real_count = itemlib.count_pending

    def counting(*texts):  # noqa: ANN002
        order.append("count" if threading.current_thread() is threading.main_thread() else "count in a thread")
        return real_count(*texts)

    async def main() -> list[int]:
        app = make_app(Config(store="memory", sim_rate=0, secrets="off"))
        await app.startup()
        real_stream = app.engine.backend.stream

        async def stream(breq):  # noqa: ANN001
            order.append("backend")
            async for c in real_stream(breq):
                yield c

        app.engine.backend.stream = stream  # type: ignore[method-assign]
        itemlib.count_pending = counting  # type: ignore[assignment]
        try:
            usage = []
            prev = None
            conn = ConnectionCache(1)  # a WebSocket connection's cache: store=False chains
            for text in ("a first question, long enough to count " * 5, "x " * 6000):  # 200 B, then 12 KB
                body = {"model": "hotloop-sim", "input": text, "store": False, "metadata": {"sim": "text,tokens:3"}}
                if prev is not None:
                    body["previous_response_id"] = prev
                req: CreateRequest = decode_body(json.dumps(body).encode())
                run = await app.engine.start(req, transport="ws", conn=conn, websocket=True)
                resp = await run.drain()
                prev = resp["id"]
                usage.append(resp["usage"]["input_tokens"])
            return usage
        finally:
            itemlib.count_pending = real_count  # type: ignore[assignment]
            await app.shutdown()

    usage = asyncio.run(main())
    assert order[:2] == ["backend", "count"]
    assert sorted(order[2:]) == ["backend", "count in a thread"]
    first = plan_for({"model": "hotloop-sim", "input": "a first question, long enough to count " * 5})
    assert usage[0] == first.input_tokens > 0
    assert usage[1] > usage[0] + 3000  # the chain plus ~6,000 tokens of new input
