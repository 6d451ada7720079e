"""Steering and lanes, audited against the README's contract (sans-I/O: the session fed frames)."""

from __future__ import annotations

import json
from typing import Any

from hotloop.protocol.session import Ended, RunCreate, SendError, Session, SteerEvent

STUBS = [{"type": "function_call_output", "call_id": "call_1", "name": "f"}]


def create(lane: str | None = None, **kw: Any) -> str:
    body = {"type": "response.create", "model": "m", "input": "x", **kw}
    if lane is not None:
        body["stream_id"] = lane
    return json.dumps(body)


def steer(prev: str, input: Any = "more") -> str:
    return json.dumps({"type": "response.steer", "previous_response_id": prev, "input": input})


def test_a_continuation_refused_while_its_parent_still_runs_returns_the_pending_input() -> None:
    """A client that answers the tool calls as soon as it reads ``response.completed`` sends the
    continuation before the lane's response is over (``response.steer.pending`` not yet sent);
    refused on arrival (a malformed field), its error waits behind the lane. The steering input
    queued for that continuation must come back after the refusal (``successor_creation_failed``),
    as when the lane is idle: it stayed queued and was prepended to the next continuation (a
    client that resent it, as told, got it twice)."""
    sess = Session(opened_at=0.0)
    [run] = sess.receive(create("s"), 1)
    assert isinstance(run, RunCreate)
    sess.started("s", "resp_1", run.request)
    acc, _ = sess.receive(steer("resp_1", "one"), 2)
    sess.ending("s", "completed")
    # the continuation arrives while the lane's task has not reported the end yet: refused
    assert sess.receive(create("s", previous_response_id="resp_1", temperature="hot"), 3) == []
    out = sess.lane_done("s", Ended("resp_1", "completed", STUBS), run)
    kinds = [(type(a).__name__, getattr(a, "kind", None), getattr(a, "code", None)) for a in out]
    assert kinds == [
        ("SteerEvent", "response.steer.pending", ""),
        ("SendError", None, None),
        ("SteerEvent", "response.steer.failed", "successor_creation_failed"),
    ], kinds
    back = out[2]
    assert isinstance(back, SteerEvent)
    assert (back.steer_id, back.input, back.stream_id) == (acc.steer_id, "one", "s")
    # nothing is left queued: a corrected retry commits no steering input
    [retry] = sess.receive(create("s", previous_response_id="resp_1", input=[]), 4)
    assert isinstance(retry, RunCreate) and retry.steers == []


def test_a_refused_continuation_queued_behind_the_lane_keeps_its_place() -> None:
    """The same with the refusal's cause on arrival being the lane's queue order only: a create
    naming another parent refused while the lane runs leaves the pending input alone."""
    sess = Session(opened_at=0.0)
    [run] = sess.receive(create("s"), 1)
    assert isinstance(run, RunCreate)
    sess.started("s", "resp_1", run.request)
    acc, _ = sess.receive(steer("resp_1", "one"), 2)
    assert sess.receive(create("s", previous_response_id="resp_0", temperature="hot"), 3) == []
    pending, err = sess.lane_done("s", Ended("resp_1", "completed", STUBS), run)
    assert isinstance(pending, SteerEvent) and pending.kind == "response.steer.pending"
    assert isinstance(err, SendError)
    [cont] = sess.receive(create("s", previous_response_id="resp_1", input=[]), 4)
    assert isinstance(cont, RunCreate) and [x.id for x in cont.steers] == [acc.steer_id]


def test_a_steer_that_lands_between_batches_ends_the_run_without_waiting_for_the_backend() -> None:
    """A steer that arrives while the run's consumer holds a batch (the lane task yields to other
    lanes, or waits for the client to take frames) finds the run outside its backend wait: the
    run is at a safe boundary, so it must end steered when it resumes, not go back to waiting on
    the backend (which may stay silent for a long time: a reasoning model, a stall) before
    stopping after one more delta."""
    import asyncio
    import contextlib
    from typing import AsyncIterator

    from hotloop.config import Config
    from hotloop.protocol.chunks import Finish, TextDelta
    from hotloop.protocol.request import decode_body
    from hotloop.server.runner import make_app

    async def main() -> None:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        try:
            async def stream(_req: Any) -> AsyncIterator[Any]:
                yield TextDelta("partial")
                yield TextDelta(" more")
                await asyncio.sleep(30)  # the backend goes silent
                yield TextDelta(" late")
                yield Finish("stop")

            app.engine.backend.stream = stream  # type: ignore[method-assign]
            req = decode_body(b'{"model":"hotloop-sim","input":"hi","store":false}')
            run = await app.engine.start(req, transport="ws", websocket=True)
            async with contextlib.aclosing(run.frames()) as frames:
                await asyncio.wait_for(anext(frames), 5)  # opening + "partial"
                await asyncio.wait_for(anext(frames), 5)  # " more": the consumer holds it
                run.steer()  # the run is not waiting on the backend now
                batch = await asyncio.wait_for(anext(frames), 2)
            kinds = [k for k, _ in batch]
            assert kinds[-1] == "response.incomplete" and "response.output_text.delta" not in kinds, kinds
            assert run.response["incomplete_details"] == {"reason": "steered"}
            assert run.response["output"][0]["content"][0]["text"] == "partial more"
        finally:
            await app.shutdown()

    asyncio.run(main())


def test_a_steer_after_the_age_limit_is_answered() -> None:
    """Once the connection reached its age limit it runs its responses to their end and closes;
    a steer naming one of them still running was silently dropped (no accepted, no failed: the
    client cannot tell). It is refused (``response_not_active``, the response's lane), and a
    steer naming nothing of this connection gets ``response_not_found``."""
    sess = Session(opened_at=0.0, max_age=60)
    [run] = sess.receive(create("s"), 1)
    assert isinstance(run, RunCreate)
    sess.started("s", "resp_1", run.request)
    assert sess.expire() == []  # the running response goes on; nothing new starts
    [f] = sess.receive(steer("resp_1", "late"), 61)
    assert isinstance(f, SteerEvent) and f.kind == "response.steer.failed"
    assert (f.code, f.stream_id, f.input, f.steer_id) == ("response_not_active", "s", "late", None)
    [g] = sess.receive(steer("resp_nope", "x"), 61)
    assert isinstance(g, SteerEvent) and g.code == "response_not_found"
    # a create is refused on its lane: lane s is busy, so after its running response
    assert sess.receive(create("s"), 61) == []
    refused, why, close = sess.lane_done("s", Ended("resp_1", "completed"), run)
    assert isinstance(refused, SendError) and refused.stream_id == "s"
    assert refused.error.code == "websocket_connection_limit_reached"
    assert isinstance(why, SendError) and why.stream_id is None and why.error.code == refused.error.code
    assert getattr(close, "code", None) == 1001
