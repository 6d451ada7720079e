"""The server's main loop (``runner._server_class``): it wakes once a second, not ten times as
uvicorn's does, still refreshes the date header at each tick, and stops at once when a signal asks
it to (``handle_exit``), not at its next tick."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import uvicorn

from hotloop.server import runner


async def _dummy_app(scope: Any, receive: Any, send: Any) -> None:  # never called
    raise AssertionError("no request expected")


def _server() -> Any:
    server = runner._server_class()(uvicorn.Config(_dummy_app, lifespan="off", log_level="warning"))
    server.config.load()
    return server


def test_the_main_loop_ticks_once_a_second_and_stops_at_once_on_a_signal() -> None:
    async def main() -> None:
        server = _server()
        ticks: list[tuple[int, float]] = []
        original = server.on_tick

        async def on_tick(counter: int) -> bool:
            ticks.append((counter, time.monotonic()))
            return await original(counter)

        server.on_tick = on_tick
        loop_task = asyncio.ensure_future(server.main_loop())
        await asyncio.sleep(runner.TICK_SECONDS * 1.5)
        assert not loop_task.done()
        # the first tick at once, the second one second later (uvicorn's loop: 15 by now)
        assert [c for c, _ in ticks] == [0, runner.TICK_COUNTS]
        assert ticks[1][1] - ticks[0][1] >= runner.TICK_SECONDS * 0.9
        # every tick refreshes the date header (on_tick does when its counter % 10 == 0)
        assert any(name == b"date" for name, _ in server.server_state.default_headers)
        asked = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        await asyncio.wait_for(loop_task, runner.TICK_SECONDS * 0.5)  # not at the next tick
        assert time.monotonic() - asked < runner.TICK_SECONDS * 0.5
        assert len(ticks) == 3 and server.should_exit

    asyncio.run(main())


def test_a_stop_asked_before_the_main_loop_ends_it_at_its_first_tick() -> None:
    async def main() -> None:
        server = _server()
        server.should_exit = True
        await asyncio.wait_for(server.main_loop(), 1.0)
        assert server._tick is None

    asyncio.run(main())
