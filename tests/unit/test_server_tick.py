"""The server's main loop (``runner._server_class``): it wakes once per ``TICK_SECONDS`` (one
second; uvicorn's wakes every 0.1 s), refreshes the date header at every tick, and stops at once
when a signal asks it to (``handle_exit``), not at its next tick.

The tick is shortened or lengthened per test (``TICK_SECONDS`` is read at each tick), so that no
assertion depends on how busy the machine is."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest
import uvicorn

from hotloop.server import runner


async def _dummy_app(scope: Any, receive: Any, send: Any) -> None:  # never called
    raise AssertionError("no request expected")


def _server(ticks: list[tuple[int, float]]) -> Any:
    server = runner._server_class()(uvicorn.Config(_dummy_app, lifespan="off", log_level="warning"))
    server.config.load()
    original = server.on_tick

    async def on_tick(counter: int) -> bool:
        ticks.append((counter, time.monotonic()))
        return await original(counter)

    server.on_tick = on_tick
    return server


async def _until(cond: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_each_tick_is_a_whole_tick_apart_and_refreshes_the_date_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "TICK_SECONDS", 0.05)

    async def main() -> None:
        ticks: list[tuple[int, float]] = []
        server = _server(ticks)
        task = asyncio.ensure_future(server.main_loop())
        await _until(lambda: len(ticks) >= 4, 10.0)
        server.should_exit = True
        await asyncio.wait_for(task, 10.0)
        # on_tick refreshes the date header when its counter is a multiple of 10: at every tick
        assert [c for c, _ in ticks[:4]] == [0, 10, 20, 30]
        assert any(name == b"date" for name, _ in server.server_state.default_headers)
        # never sooner than a tick apart (uvloop may fire a timer up to 1 ms early)
        gaps = [b - a for (_, a), (_, b) in zip(ticks, ticks[1:])]
        assert min(gaps) >= 0.05 - 0.002, gaps

    asyncio.run(main())


def test_a_signal_stops_the_main_loop_at_once_not_at_its_next_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "TICK_SECONDS", 60.0)

    async def main() -> None:
        ticks: list[tuple[int, float]] = []
        server = _server(ticks)
        task = asyncio.ensure_future(server.main_loop())
        await _until(lambda: server._tick is not None, 10.0)  # waiting for its next tick
        server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        await asyncio.wait_for(task, 10.0)  # the next tick is a minute away
        assert server.should_exit and len(ticks) == 2 and server._tick is None

    asyncio.run(main())


def test_a_stop_asked_before_the_main_loop_ends_it_at_its_first_tick() -> None:
    async def main() -> None:
        ticks: list[tuple[int, float]] = []
        server = _server(ticks)
        server.should_exit = True
        await asyncio.wait_for(server.main_loop(), 10.0)
        assert [c for c, _ in ticks] == [0] and server._tick is None

    asyncio.run(main())
