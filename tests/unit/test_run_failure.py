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
