"""Timers of the write path: held deltas (``--flush-interval-ms``) over WebSocket and SSE, and the
HTTP request read timeout. A flowing stream or a run of keep-alive requests must not create and
cancel a timer per write or per request (each cost more than the work it guarded), and no delta
may be held longer than the interval, nor a request read for longer than the timeout.

Driven through the real protocol classes with a loop whose clock the test moves: timers fire when
the clock passes them, in order, before the read that comes at the same time (libuv runs due
timers before it polls for I/O)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
from typing import Any, AsyncIterator, Callable

import pytest

from hotloop.protocol import events as ev
from hotloop.server.http import _Held
from hotloop.server.httpproto import LINGER_SECONDS
from hotloop.server.wsproto import CorkedWebSocketProtocol

from .test_http_cork import Recorder, _connection, _post
from .test_ws_fast_text import _Transport, opened

WITHIN = 0.010  # the hold interval
STEP = 0.001  # a read per millisecond (a model at 1,000 tokens/s)


class _Handle:
    def __init__(self, clock: "_Clock", when: float, fn: Callable[[], None]) -> None:
        self.clock, self.when, self.fn, self.cancelled = clock, when, fn, False

    def cancel(self) -> None:
        self.cancelled = True
        self.clock.cancels += 1


class _Clock:
    """The parts of a loop the write path uses for time, with a clock the test sets; the rest
    goes to the running loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, early: float = 0.0) -> None:
        self._loop = loop
        self.early = early  # timers fire this much before they are due (uvloop: up to 1 ms)
        self.now = 0.0
        self.created = 0
        self.cancels = 0
        self._heap: list[tuple[float, int, _Handle]] = []
        self._seq = itertools.count()

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, fn: Callable[[], None]) -> _Handle:
        self.created += 1
        h = _Handle(self, when, fn)
        heapq.heappush(self._heap, (when, next(self._seq), h))
        return h

    def call_later(self, delay: float, fn: Callable[[], None]) -> _Handle:
        return self.call_at(self.now + delay, fn)

    def advance(self, to: float) -> None:
        """Move the clock to ``to``, running each timer due by then at its own time."""
        while self._heap and self._heap[0][0] - self.early <= to:
            when, _, h = heapq.heappop(self._heap)
            assert self.created < 10_000, "timers keep setting themselves again (a spin)"
            if not h.cancelled:
                self.now = max(self.now, when - self.early)
                h.fn()
        self.now = to

    def pending(self) -> int:
        return sum(1 for _, _, h in self._heap if not h.cancelled)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


@contextlib.asynccontextmanager
async def _clocked_connection(tmp_path: Any, early: float = 0.0) -> AsyncIterator[tuple[Any, Recorder, _Clock]]:
    """hotloop's HTTP protocol for one connection of the real app, its read timer on a
    :class:`_Clock` (none set yet)."""
    from hotloop.config import Config
    from hotloop.server.runner import make_app

    config = Config(store="memory", sim_rate=0, data_dir=str(tmp_path))
    app = make_app(config)
    await app.startup()
    try:
        proto, transport = _connection(app, config)
        clock = _Clock(asyncio.get_running_loop(), early=early)
        proto.loop = clock
        proto._reading_since = None
        proto._read_timer = None
        yield proto, transport, clock
    finally:
        await app.shutdown()


def _delta(i: int) -> tuple[str, bytes]:
    return ev.OUTPUT_TEXT_DELTA, b'{"type":"response.output_text.delta","n":%d}' % i


def _stream(send: Callable[[int], None], clock: _Clock, n: int, written: Callable[[], list[bytes]]) -> dict[int, float]:
    """``n`` reads a millisecond apart, then a pause: when each delta was written (the clock's
    time at the write that carried it)."""
    seen: dict[int, float] = {}

    def note() -> None:
        for w in written():
            for part in w.split(b'"n":')[1:]:
                seen.setdefault(int(part.split(b"}")[0]), clock.now)

    for i in range(n):
        clock.advance(i * STEP)
        note()
        send(i)
        note()
    for k in range(1, 30):  # the stream pauses: what is held goes out on the timer
        clock.advance((n - 1) * STEP + k * STEP)
        note()
    return seen


def _check(seen: dict[int, float], n: int, clock: _Clock) -> None:
    assert sorted(seen) == list(range(n))  # every delta, once
    late = {i: round(t - i * STEP, 6) for i, t in seen.items() if t - i * STEP > WITHIN + 1e-9}
    assert not late, f"held longer than the interval: {late}"
    # a timer per interval at most, none cancelled, none left behind
    assert clock.created <= n * STEP / WITHIN + 2, clock.created
    assert clock.cancels == 0
    assert clock.pending() == 0


async def _ws_protocol(done: asyncio.Event) -> tuple[CorkedWebSocketProtocol, _Transport]:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        await done.wait()

    return await opened(app)


@contextlib.asynccontextmanager
async def _clocked_ws() -> AsyncIterator[tuple[CorkedWebSocketProtocol, _Transport, _Clock]]:
    """An open WebSocket connection's protocol on a :class:`_Clock`; its stream's first write
    goes out at once."""
    done = asyncio.Event()
    proto, transport = await _ws_protocol(done)
    clock = _Clock(asyncio.get_running_loop())
    proto.loop = clock  # type: ignore[assignment]
    proto._held_since = -1.0
    try:
        yield proto, transport, clock
    finally:
        done.set()
        await asyncio.gather(*proto.tasks, return_exceptions=True)
        proto.connection_lost(None)


def _sse(clock: _Clock) -> tuple[_Held, list[bytes]]:
    """SSE push delivery with held deltas on ``clock``; what it sends is appended to the list."""
    sent: list[bytes] = []

    class _Run:
        emit: Any = None

    held = _Held(_Run(), lambda data: sent.append(data) or True, WITHIN)
    held.loop = clock  # type: ignore[assignment]
    return held, sent


@pytest.mark.parametrize("n", [1, 3, 40, 200])
def test_websocket_held_deltas_use_one_timer_per_interval(n: int) -> None:
    async def main() -> None:
        async with _clocked_ws() as (proto, transport, clock):
            def send(i: int) -> None:
                assert proto.send_texts([_delta(i)], True, WITHIN)

            def written() -> list[bytes]:
                out = list(transport.written)
                transport.written.clear()
                return out

            seen = _stream(send, clock, n, written)
            _check(seen, n, clock)

    asyncio.run(main())


@pytest.mark.parametrize("n", [1, 3, 40, 200])
def test_sse_held_deltas_use_one_timer_per_interval(n: int) -> None:
    async def main() -> None:
        clock = _Clock(asyncio.get_running_loop())
        held, sent = _sse(clock)
        held.since = -1.0

        def written() -> list[bytes]:
            out = list(sent)
            sent.clear()
            return out

        seen = _stream(lambda i: held([_delta(i)]), clock, n, written)
        _check(seen, n, clock)
        assert held.take() == b""  # nothing left held

    asyncio.run(main())


def test_sse_deltas_taken_by_the_stream_are_not_written_again_by_the_timer() -> None:
    async def main() -> None:
        clock = _Clock(asyncio.get_running_loop())
        held, sent = _sse(clock)
        held([_delta(0)])  # written at once (since 0.0 is "long ago" only after WITHIN / 2)
        clock.advance(0.001)
        held([_delta(1)])  # held, with a timer
        taken = held.take()  # the streaming loop writes it before its own batch
        assert b'"n":1' in taken
        before = list(sent)
        clock.advance(0.05)  # the timer fires: nothing is held, nothing is written
        assert sent == before and clock.pending() == 0

    asyncio.run(main())


def _end(i: int) -> tuple[str, bytes]:
    return ev.COMPLETED, b'{"type":"response.completed","n":%d}' % i


def test_a_websocket_responses_end_cancels_the_hold_timer() -> None:
    """Deltas held, then the response's terminal event (never held): it goes out with them, and
    the hold timer goes, rather than waking the loop later to find nothing. Deltas held after
    that get a timer of their own and still go out within the interval."""

    async def main() -> None:
        async with _clocked_ws() as (proto, transport, clock):
            assert proto.send_texts([_delta(0)], True, WITHIN)  # written at once
            clock.advance(STEP)
            assert proto.send_texts([_delta(1)], True, WITHIN)  # held, with a timer
            assert clock.pending() == 1
            transport.written.clear()
            clock.advance(2 * STEP)
            assert proto.send_texts([_end(2)], True)  # the terminal event: never held
            out = b"".join(transport.written)
            assert out.index(b'"n":1') < out.index(b'"n":2')  # what was held goes first
            assert clock.pending() == 0 and clock.cancels == 1
            # the next response's deltas: the first at once, the next held on a new timer
            transport.written.clear()
            clock.advance(0.1)
            assert proto.send_texts([_delta(3)], True, WITHIN)
            clock.advance(0.1 + STEP)
            assert proto.send_texts([_delta(4)], True, WITHIN)
            assert clock.pending() == 1 and b'"n":4' not in b"".join(transport.written)
            clock.advance(0.1 + WITHIN)
            assert b'"n":4' in b"".join(transport.written) and clock.pending() == 0

    asyncio.run(main())


def test_a_websocket_responses_first_deltas_written_at_once_count_for_the_next_hold() -> None:
    """A response's first pushed deltas are written at once (``now`` without ``within``); the
    next read a millisecond later is held after them, as after any write, rather than making a
    write of its own (one write a response more than SSE, whose first write counts too)."""

    async def main() -> None:
        async with _clocked_ws() as (proto, transport, clock):
            clock.advance(1.0)
            transport.written.clear()
            assert proto.send_texts([_delta(0)], True)  # the response's first deltas: never held
            assert b'"n":0' in b"".join(transport.written)
            clock.advance(1.0 + STEP)
            assert proto.send_texts([_delta(1)], True, WITHIN)
            assert b'"n":1' not in b"".join(transport.written) and clock.pending() == 1  # held
            clock.advance(1.0 + WITHIN)
            assert b'"n":1' in b"".join(transport.written) and clock.pending() == 0

    asyncio.run(main())


def test_an_sse_streams_unheld_write_cancels_the_hold_timer() -> None:
    """SSE: an item's start or end (``held(batch)``) and the streaming loop's own writes
    (``release``) take what is held and cancel the timed write, which would find nothing."""

    async def main() -> None:
        clock = _Clock(asyncio.get_running_loop())
        held, sent = _sse(clock)
        held.since = -1.0
        held([_delta(0)])  # at once
        clock.advance(STEP)
        held([_delta(1)])  # held, with a timer
        assert clock.pending() == 1 and not any(b'"n":1' in x for x in sent)
        held([_delta(2), (ev.OUTPUT_ITEM_DONE, b'{"type":"response.output_item.done","n":3}')])
        assert b'"n":1' in sent[-1] and sent[-1].index(b'"n":1') < sent[-1].index(b'"n":3')
        assert clock.pending() == 0 and clock.cancels == 1
        clock.advance(2 * STEP)
        held([_delta(4)])  # held again: a new timer
        assert clock.pending() == 1
        assert b'"n":4' in held.release()  # the streaming loop's write (or the stream's end)
        assert clock.pending() == 0 and clock.cancels == 2 and held.take() == b""

    asyncio.run(main())


def test_keep_alive_requests_share_one_read_timer(tmp_path: Any) -> None:
    """Three requests on one connection, each read in time: one read-timeout timer (the
    connection's), not one created and cancelled per request."""
    from hotloop.config import Config
    from hotloop.server.runner import make_app

    async def main() -> None:
        config = Config(store="memory", sim_rate=0, data_dir=str(tmp_path))
        app = make_app(config)
        await app.startup()
        loop = asyncio.get_running_loop()
        made: list[Any] = []
        real_call_at = loop.call_at

        class _Counting:
            def call_at(self, when: float, fn: Any, *args: Any) -> Any:
                h = real_call_at(when, fn, *args)
                if getattr(fn, "__name__", "").startswith("_read_"):  # the read timeout's
                    made.append(h)
                return h

            def call_later(self, delay: float, fn: Any, *args: Any) -> Any:
                return self.call_at(loop.time() + delay, fn, *args)

            def __getattr__(self, name: str) -> Any:
                return getattr(loop, name)

        try:
            proto, transport = _connection(app, config)
            proto.loop = _Counting()
            for i in range(3):
                n = len(transport.writes)
                proto.data_received(_post({"model": "hotloop-sim", "input": f"hi {i}"}))
                for _ in range(500):
                    if len(transport.writes) > n:
                        break
                    await asyncio.sleep(0.01)
                head, _, body = transport.writes[-1].partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["status"] == "completed"
            # the connection's timer (set when it opened) served all three: none made since
            assert made == [] and proto._read_timer is not None and not proto._read_timer.cancelled()
            proto.connection_lost(None)
            assert proto._read_timer is None
        finally:
            await app.shutdown()

    asyncio.run(main())


def test_a_request_still_being_read_when_the_timer_fires_is_timed_out_at_its_own_deadline(tmp_path: Any) -> None:
    """The connection's timer was set for an earlier request; the request being read when it
    fires gets the whole timeout from its own first byte, then the 408 and the close."""

    async def main() -> None:
        async with _clocked_connection(tmp_path) as (proto, transport, clock):
            timeout = proto.limits.read_timeout
            proto.on_message_begin()  # a request's first byte at 0: the timer is due at `timeout`
            proto._disarm()  # ... read in time
            clock.advance(timeout / 2)
            proto.on_message_begin()  # the next request begins; the timer from the first stays
            assert clock.created == 1
            clock.advance(timeout)  # the timer fires: this request is due at 1.5 * timeout
            assert not transport.closed and clock.pending() == 1
            clock.advance(timeout * 1.5)
            assert transport.writes and transport.writes[-1].startswith(b"HTTP/1.1 408")
            # closed lingering: what the client still sends is dropped, the close comes after
            # the linger (at most the read timeout)
            assert not transport.closed
            clock.advance(timeout * 1.5 + min(LINGER_SECONDS, timeout))
            assert transport.closed

    asyncio.run(main())


def test_sse_deltas_is_the_call_for_a_batch_of_deltas() -> None:
    async def main() -> None:
        sent = []
        for quick in (False, True):
            clock = _Clock(asyncio.get_running_loop())
            held, out = _sse(clock)
            for i in range(40):
                clock.advance(i * STEP)
                (held.deltas if quick else held)([_delta(i)])
            clock.advance(1.0)
            sent.append(out)
        assert sent[0] == sent[1] and len(sent[0]) > 1

    asyncio.run(main())


def test_a_read_timer_that_fires_early_times_out_without_spinning(tmp_path: Any) -> None:
    """uvloop may fire a timer up to 1 ms before it is due; the read timer must then time out,
    not set itself again for a time already that close (it would fire at once, over and over)."""

    async def main() -> None:
        async with _clocked_connection(tmp_path, early=0.0009) as (proto, transport, clock):
            timeout = proto.limits.read_timeout
            proto.on_message_begin()  # a request's first byte at 0, never completed
            clock.advance(timeout - 0.0005)  # the timer fires, early
            assert clock.created == 2  # the read timer, once, and the 408's lingering close
            assert transport.writes and transport.writes[-1].startswith(b"HTTP/1.1 408")
            clock.advance(timeout + min(LINGER_SECONDS, timeout))
            assert transport.closed and clock.created == 2

    asyncio.run(main())


@pytest.mark.parametrize("early", [0.0, 0.0009])
def test_the_backend_idle_watchdog_expires_once_without_spinning(early: float) -> None:
    """The backend idle timeout (engine._Watchdog): silent for ``idle`` while the run waits on
    the backend, it expires its scope once, from one timer, even when the timer fires early; a
    chunk in the meantime puts the deadline after it."""
    from hotloop.server.engine import _Watchdog

    class _Scope:
        def __init__(self) -> None:
            self.expired: list[float] = []

        def reschedule(self, when: float) -> None:
            self.expired.append(when)

    async def main() -> None:
        clock = _Clock(asyncio.get_running_loop(), early=early)
        watch = _Watchdog(clock, 1.0)  # type: ignore[arg-type]
        scope = _Scope()
        watch.arm(scope)  # type: ignore[arg-type]
        watch.since = 0.0  # waiting on the backend from 0
        clock.advance(0.5)
        watch.since = 0.5  # a chunk at 0.5, and waiting again: due at 1.5
        clock.advance(1.2)
        assert scope.expired == []  # the timer set for 1.0 moved to 1.5
        clock.advance(1.6)
        assert len(scope.expired) == 1 and clock.created == 2
        assert scope.expired[0] >= 1.5 - early

    asyncio.run(main())


@pytest.mark.parametrize("early", [0.0, 0.0009])
def test_keep_alive_is_one_timer_per_connection_and_closes_at_the_idle_deadline(tmp_path: Any, early: float) -> None:
    """Responses completing one after another do not make and cancel a keep-alive timer each:
    the connection's one timer, when it fires, closes a connection idle for the keep-alive
    timeout, or waits for the deadline of the idle time that began since (even firing early)."""

    async def main() -> None:
        async with _clocked_connection(tmp_path, early=early) as (proto, transport, clock):
            keep = proto.timeout_keep_alive
            proto.on_response_complete()  # idle from 0: the timer is due at `keep`
            made = clock.created
            for i in range(1, 4):  # three more requests, each arriving and answered in time
                clock.advance(i * keep / 4)
                proto._unset_keepalive_if_required()  # a request's first bytes
                clock.advance(i * keep / 4 + 0.001)
                proto.on_response_complete()
            assert clock.created == made  # no timer per response
            clock.advance(keep)  # the timer fires: idle only since 0.75 * keep
            assert not transport.closed and clock.created == made + 1
            clock.advance(1.75 * keep + 0.002)
            assert transport.closed and clock.created == made + 1

    asyncio.run(main())


def test_a_busy_connection_is_not_closed_by_the_keep_alive_timer(tmp_path: Any) -> None:
    async def main() -> None:
        async with _clocked_connection(tmp_path) as (proto, transport, clock):
            keep = proto.timeout_keep_alive
            proto.on_response_complete()
            clock.advance(keep / 2)
            proto.on_message_begin()  # the next request is being read and answered
            clock.advance(keep * 3)
            assert not transport.closed and clock.pending() <= 1  # the read timer, at most
            proto.connection_lost(None)
            assert proto._idle_timer is None

    asyncio.run(main())
