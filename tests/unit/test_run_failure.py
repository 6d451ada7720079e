"""A run stopped on purpose (an abort at the end of the shutdown grace) is not a backend failure,
even when the backend turns the cancellation into an error of its own; what a response that
fails, or whose client leaves, is charged (ledger and flags)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import pytest

from hotloop import errors
from hotloop.config import Config
from hotloop.pipeline import items as itemlib
from hotloop.protocol.chunks import Finish, TextDelta
from hotloop.pipeline.prepare import prepare
from hotloop.protocol.request import decode_body, validate
from hotloop.server.runner import make_app


def test_an_abort_that_the_backend_reports_as_its_own_error_is_no_backend_failure() -> None:
    async def main() -> None:
        app = make_app(Config(store="memory", sim_rate=0))
        await app.startup()
        try:
            waiting = asyncio.Event()

            async def stream(_req: Any) -> AsyncIterator[Any]:
                yield TextDelta("partial")
                waiting.set()
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    raise errors.BackendError("The connection was reset.") from None  # not a CancelledError
                yield Finish("stop")

            app.engine.backend.stream = stream  # type: ignore[method-assign]
            run = await app.engine.start(decode_body(b'{"model":"hotloop-sim","input":"hi","store":false}'), transport="json")
            drained = asyncio.create_task(run.drain())
            await asyncio.wait_for(waiting.wait(), 5)
            await asyncio.sleep(0.01)  # the run is waiting on the backend
            run.abort(errors.ServerShuttingDown("The server is shutting down."))
            response = await asyncio.wait_for(drained, 5)
            assert response["status"] == "failed" and response["error"]["code"] == errors.ServerShuttingDown.code
            assert run.failure is None  # not counted as the backend's failure
        finally:
            await app.shutdown()

    asyncio.run(main())


def test_the_idle_watchdog_counts_lane_reads_from_their_time() -> None:
    """Chunks read through a lane (PushSlot.read_at) are the backend speaking: the idle timeout
    runs from the last of them, exactly as from a chunk the run handled itself."""
    from hotloop.server.engine import _Watchdog

    class Loop:
        def __init__(self) -> None:
            self.now = 0.0
            self.calls: list[float] = []

        def time(self) -> float:
            return self.now

        def call_at(self, when: float, fn: object) -> object:
            self.calls.append(when)
            return None

    class Scope:
        def __init__(self) -> None:
            self.expired: list[float] = []

        def reschedule(self, when: float) -> None:
            self.expired.append(when)

    loop, scope = Loop(), Scope()
    read_at = 0.0
    w = _Watchdog(loop, 10.0)  # type: ignore[arg-type]
    w.progress = lambda: read_at
    w.since = 0.0  # waiting on the backend from t=0
    w.arm(scope)  # type: ignore[arg-type]
    assert loop.calls == [10.0]
    read_at = 4.0  # a lane read at t=4
    loop.now = 10.0
    w._check()
    assert scope.expired == [] and loop.calls[-1] == 14.0  # 10 s after that read, not after the check
    loop.now = 14.0
    w._check()
    assert scope.expired == [14.0]  # silent since t=4: expired at t=14
    # a progress clock that never moves changes nothing
    loop2, scope2 = Loop(), Scope()
    w2 = _Watchdog(loop2, 10.0)  # type: ignore[arg-type]
    w2.progress = lambda: 0.0
    w2.since = 1.0
    w2.arm(scope2)  # type: ignore[arg-type]
    loop2.now = 11.0
    w2._check()
    assert scope2.expired == [11.0]


# -- what a response that fails or is cut short is charged -----------------------------------

_SECRET = "gh" + "p_" + "u8jzPde0IgxLd6GncfBAepfJBd0Kh8oOOL8d"  # the shape of a GitHub token (made up)


async def _app(**kw: Any) -> Any:
    app = make_app(Config(store="memory", sim_rate=0, **kw))
    await app.startup()
    return app


def _body(text: str, sim: str) -> Any:
    import json

    return decode_body(json.dumps({"model": "hotloop-sim", "input": text, "metadata": {"sim": sim}}))


def test_a_flagged_response_that_fails_is_counted_as_flagged() -> None:
    """Charged in the ledger when it failed, it was never counted as flagged there."""

    async def main() -> list[Any]:
        out = []
        for policy in ("flag", "redact"):
            for sim in ("tokens:6,fail:server_error", "tokens:6,error"):
                app = await _app(secrets=policy)
                try:
                    run = await app.engine.start(_body("key " + _SECRET, sim), transport="http")
                    await run.drain()
                    await app.persistence.flush()
                    [row] = await app.persistence.usage()
                    out.append((run.turn.response["status"], row["responses"], row["flagged"]))
                finally:
                    await app.shutdown()
        return out

    assert asyncio.run(asyncio.wait_for(main(), 60)) == [("failed", 1, 1)] * 4


def test_a_response_whose_store_write_fails_is_charged_once() -> None:
    """--store-sync full, the write fails: the response becomes failed after complete() had put
    it in the ledger, and the failure path charged it again."""

    async def main() -> tuple[str, Any, Any]:
        app = await _app(store_sync="full")
        store = app.persistence.store
        real_put = store.put

        def failing_put(rec: Any) -> None:
            raise OSError("disk full")

        store.put = failing_put
        try:
            run = await app.engine.start(_body("hi", "tokens:4"), transport="http")
            await run.drain()
            store.put = real_put
            await app.persistence.flush()
            return run.turn.response["status"], run.turn.response["usage"], await app.persistence.usage()
        finally:
            store.put = real_put
            await app.shutdown()

    status, usage, rows = asyncio.run(asyncio.wait_for(main(), 30))
    assert status == "failed" and rows[0]["responses"] == 1 and rows[0]["input_tokens"] == usage["input_tokens"]


def test_a_client_that_leaves_does_not_have_its_input_counted_on_the_event_loop(monkeypatch: Any) -> None:
    """Its input (1.3 MB here) had been counted in the tokenizer thread, and was counted again,
    on the event loop, when the client left (270 ms for 8 MiB, a client could repeat it)."""
    import threading

    from hotloop.pipeline import items as itemlib

    threads: list[str] = []
    real = itemlib.count_pending

    def spy(*a: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*a)

    monkeypatch.setattr(itemlib, "count_pending", spy)
    text = " ".join(f"w{i} lorem ipsum dolor" for i in range(60_000))

    async def main() -> tuple[bool, str]:
        app = make_app(Config(store="memory", sim_rate=20))
        await app.startup()
        try:
            run = await app.engine.start(_body(text, "tokens:100"), transport="sse")
            frames = run.frames()
            await frames.__anext__()
            await asyncio.sleep(0.5)
            counted = run._counts is not None and run._counts.done()
            await frames.aclose()  # the client left
            return counted, run.turn.response["status"]
        finally:
            await app.shutdown()

    counted, status = asyncio.run(asyncio.wait_for(main(), 60))
    assert counted and status != "completed"
    assert threads and "MainThread" not in threads, threads


def test_a_client_that_leaves_before_the_first_token_is_charged_its_input() -> None:
    """The backend had the request (prefill, queueing) when the client left: nothing was charged,
    in the ledger or the key's TPM budget, so large inputs could be sent for free."""

    async def main() -> list[Any]:
        app = make_app(Config(store="memory", sim_rate=0, sim_ttft=3.0))
        await app.startup()
        try:
            start = asyncio.ensure_future(app.engine.start(_body("word " * 2000, "tokens:4"), transport="sse"))
            await asyncio.sleep(0.5)  # the backend works on it
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
            await app.persistence.flush()
            return await app.persistence.usage()
        finally:
            await app.shutdown()

    [row] = asyncio.run(asyncio.wait_for(main(), 30))
    assert row["responses"] == 1 and 1500 < row["input_tokens"] < 4000 and row["output_tokens"] == 0


@pytest.mark.parametrize("text", ["word " * 2000, "中文字符" * 750])
def test_a_client_that_leaves_before_the_first_token_is_charged_its_counted_input(text: str) -> None:
    """... and charged what its input counts, once its counting (which runs while the backend
    works) has ended: it was charged one token per four characters, 24% over for English and
    half the count for CJK text."""

    async def main() -> tuple[list[Any], int]:
        app = make_app(Config(store="memory", sim_rate=0, sim_ttft=3.0))
        await app.startup()
        try:
            start = asyncio.ensure_future(app.engine.start(_body(text, "tokens:4"), transport="sse"))
            await asyncio.sleep(0.5)  # the backend works on it; the input is counted meanwhile
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
            await app.persistence.flush()
            usage = await app.persistence.usage()
            plan = prepare(validate(_body(text, "tokens:4")), None, app.engine.ids)
            plan.settle()
            return usage, plan.input_tokens
        finally:
            await app.shutdown()

    [row], counted = asyncio.run(asyncio.wait_for(main(), 30))
    assert row["responses"] == 1 and row["input_tokens"] == counted and row["output_tokens"] == 0


@contextlib.asynccontextmanager
async def _serving(stream: Any) -> AsyncIterator[Any]:
    """An app on the simulator's configuration whose backend streams ``stream``."""
    app = make_app(Config(store="memory", sim_rate=0))
    await app.startup()
    app.engine.backend.stream = stream  # type: ignore[method-assign]
    try:
        yield app
    finally:
        await app.shutdown()


async def _reset(_req: Any) -> AsyncIterator[Any]:
    yield TextDelta("partial")
    raise errors.BackendError("The connection was reset.")


@pytest.mark.parametrize("how", ["steer", "abort"])
def test_a_steer_or_abort_while_a_failed_stream_waits_for_its_counts_does_not_cancel_the_run(how: str) -> None:
    """The backend's stream fails; the run waits for its input's token counts (the tokenizer
    thread, for a large input) before its terminal event. A steer or an abort then (the
    shutdown grace's end) cancelled the run's task as if it still waited on the backend: no
    terminal event, and over WebSocket a lane that never ran another response."""

    async def main() -> None:
        async with _serving(_reset) as app:
            counted: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            plans: list[Any] = []

            def count_later(plan: Any) -> asyncio.Future[Any]:
                plans.append(plan)
                return counted  # held back until the run waits for it

            app.engine._count_later = count_later  # type: ignore[method-assign]
            run = await app.engine.start(decode_body(b'{"model":"hotloop-sim","input":"hi","store":false}'), transport="json")
            drained = asyncio.create_task(run.drain())
            await asyncio.sleep(0.05)  # the stream has failed; the run waits in _settle
            assert not drained.done() and run.turn.response["status"] == "in_progress"
            if how == "steer":
                run.steer()
            else:
                run.abort(errors.ServerShuttingDown("The server is shutting down."))
            await asyncio.sleep(0.01)
            counted.set_result(itemlib.count_pending(*plans[0].pending_texts()))
            response = await asyncio.wait_for(drained, 5)
            assert response["status"] in ("failed", "incomplete"), response["status"]

    asyncio.run(main())
