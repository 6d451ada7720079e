"""A run stopped on purpose (an abort at the end of the shutdown grace) is not a backend failure,
even when the backend turns the cancellation into an error of its own."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from hotloop import errors
from hotloop.config import Config
from hotloop.protocol.chunks import Finish, TextDelta
from hotloop.protocol.request import decode_body
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
