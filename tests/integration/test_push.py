"""Push delivery (``hotloop.backends.base.PushSlot``): a chat backend on the lean transport hands
each network read's chunks to a synchronous sink from its read callback.

Against the scripted mock chat server on a real loopback socket: whatever the sink takes or
refuses, the chunks it took followed by the ones the stream yielded are exactly the stream
without a sink, in order, and failures surface the same way. End to end, WebSocket and SSE
responses carry the same events pushed (the lean transport) as through the response's task (the
SDK transport, which never pushes), also when their client stops reading for a while.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Iterator

import httpx
import pytest
from websockets.sync.client import connect

from hotloop import _accel, errors
from hotloop.backends import create
from hotloop.backends.base import BackendRequest, PushSlot
from hotloop.config import Config
from hotloop._accel import PLAIN_ARGUMENTS, PLAIN_REASONING, PLAIN_TEXT, DeltaLane
from hotloop.protocol.chunks import Chunk, ReasoningDelta, TextDelta, ToolCallDelta
from hotloop.protocol.request import decode_items
from tests.conftest import Server, raw_until_terminal, run_server
from tests.mock_chat_server import Event, MockChatServer, Reply, Sleep, chunk, text_events, tool_events, usage

GAP = 0.004  # between scripted events: each arrives in a read of its own while the reader waits
# ... usually: a reader descheduled for longer than GAP (tests in three processes on two CPUs)
# reads two at once. A test whose point needs the paced shape runs again, up to this many times,
# asserting the stream's correctness each time.
READ_SHAPE_TRIES = 5


@pytest.fixture(autouse=True)
def _fresh_mock(mock: MockChatServer) -> None:
    mock.reset()


def paced(events: list[Event], burst_at: int | None = None) -> list[Event]:
    """``events`` with a pause before each, except for a burst of three (in the middle, or from
    ``burst_at``) that is sent in one write (several chunks in one read)."""
    out: list[Event] = []
    start = len(events) // 2 if burst_at is None else burst_at
    for i, e in enumerate(events):
        if i == start:
            burst = events[start : start + 3]
            out += [Sleep(GAP), "".join(b if isinstance(b, str) else f"data: {json.dumps(b)}\n\n" for b in burst)]  # type: ignore[misc]
        elif not start < i < start + 3:
            out += [Sleep(GAP), e]
    return out


def answer() -> list[Event]:
    """Reasoning, text and two tool calls, then the finish and usage chunks."""
    text = text_events("the quick brown fox jumps over the lazy dog", pieces=9, reasoning="think about it", finish="tool_calls")
    calls = tool_events([("call_a", "search", '{"q":"alpha beta"}'), ("call_b", "open", '{"path":"x.py"}')], pieces=4)
    return text[:-2] + calls[1:-2] + [chunk({}, "tool_calls"), chunk(usage=usage(40, 30), choices=False)]


def request(slot: PushSlot | None) -> BackendRequest:
    return BackendRequest(
        model="mock-model", instructions=None, items=decode_items("hi"), tools=[], tool_choice="auto",
        parallel_tool_calls=True, push=slot,
    )


def run_stream(
    mock: MockChatServer, events: list[Event], take: Callable[[list[Chunk]], int] | None,
    lanes: list[int] | None = None, read_pause_ms: float = 0.0, conns: list[Any] | None = None,
    pause_streams: int = 1,
) -> tuple[list[Chunk], BaseException | None, int]:
    """One streamed answer through the openai-compat backend on the lean transport, with a sink
    that takes what ``take`` says (none: no sink). With ``lanes`` (a list for the sizes of
    the lane's batches), the consumer also offers a lane (``PushSlot.lane``) for the item its
    last chunk belongs to, as a run does for its open item. Returns every chunk in the order
    the consumer got it (taken by a sink, sent through the lane, or yielded), the exception the
    stream raised, and the sink's calls. ``read_pause_ms``, ``pause_streams``: the transport's
    read pauses (``--backend-read-pause-ms``, ``--backend-read-pause-streams``); ``conns``: filled with ``(reads, napping, reading)`` of each
    of the pool's idle connections once the stream has ended."""
    mock.push(Reply.stream(events))
    got: list[Chunk] = []
    calls = 0
    slot = PushSlot() if take is not None else None

    def relane(chunk: Chunk | None) -> None:
        """A lane for the item ``chunk`` continues, if it is a delta (None: keep the lane)."""
        assert slot is not None
        if lanes is None or chunk is None:
            return
        kind = {TextDelta: PLAIN_TEXT, ReasoningDelta: PLAIN_REASONING, ToolCallDelta: PLAIN_ARGUMENTS}.get(type(chunk))
        if kind is None:
            slot.lane = None
            return
        call = chunk.index if type(chunk) is ToolCallDelta else 0  # type: ignore[union-attr]
        lane = DeltaLane(kind, call, "delta", "item", 0, 0, False, [])
        lane.emit = lambda frames: lane_sent(kind, call, frames)
        slot.lane = lane

    def lane_sent(kind: int, call: int, frames: list[Any]) -> None:
        assert lanes is not None
        lanes.append(len(frames))
        texts = [json.loads(payload)["delta"] for _, payload in frames]
        got.extend(ToolCallDelta(call, t) if kind == PLAIN_ARGUMENTS else
                   (TextDelta(t) if kind == PLAIN_TEXT else ReasoningDelta(t)) for t in texts)

    def sink(chunks: list[Chunk]) -> int:
        nonlocal calls
        calls += 1
        n = take(chunks)  # type: ignore[misc]
        got.extend(chunks[:n])
        relane(chunks[n - 1] if n else None)
        return n

    async def main() -> BaseException | None:
        config = Config(
            backend="openai-compat", base_url=mock.v1, model="mock-model", backend_api_key="k", backend_idle_timeout=5,
            backend_read_pause_ms=read_pause_ms, backend_read_pause_streams=pause_streams,
        )
        backend = create(config)
        await backend.start()
        try:
            stream = backend.stream(request(slot))
            if slot is not None:
                slot.fn = sink  # as a run does: once the stream is under way
            try:
                async for c in stream:
                    got.append(c)
                    if slot is not None:
                        relane(c)
            except Exception as exc:  # noqa: BLE001 - compared below
                return exc
            if conns is not None:
                pool = backend._pool  # type: ignore[attr-defined]
                for _ in range(2000):  # the body's end may come after the last chunk: then it is kept
                    if pool._idle:
                        break
                    await asyncio.sleep(0.001)
                # the pool reads on while idle: a pause still running would show now
                conns.extend((c.reads, c.nap is not None or c.paused, c.transport.is_reading()) for c in pool._idle)
            return None
        finally:
            await backend.close()  # type: ignore[attr-defined]

    exc = asyncio.run(asyncio.wait_for(main(), 30))
    return got, exc, calls


POLICIES: dict[str, Callable[[list[Chunk]], int]] = {
    "all": len,
    "none": lambda chunks: 0,
    "first": lambda chunks: 1,
    "not-terminal": lambda chunks: next((i for i, c in enumerate(chunks) if type(c).__name__ in ("Finish", "Usage")), len(chunks)),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_pushed_then_yielded_is_the_stream(mock: MockChatServer, policy: str) -> None:
    events = paced(answer())
    plain, exc0, _ = run_stream(mock, events, None)
    assert exc0 is None and len(plain) > 20
    got, exc, calls = run_stream(mock, events, POLICIES[policy])
    assert exc is None
    assert got == plain
    assert calls >= 10  # the sink was offered the reads (not everything went through the iterator)


def odd_shapes() -> list[Event]:
    """Chunks that look like continuations and are not all plain: a name repeated in every
    arguments delta, content and reasoning in one chunk, a refusal, a usage chunk with content,
    a tool call without an index, one that carries its id again, empty and choice-less chunks."""
    def call(i: int | None, args: str, **extra: Any) -> dict[str, Any]:
        tc: dict[str, Any] = {"function": {"arguments": args, **extra.pop("function", {})}, **extra}
        if i is not None:
            tc["index"] = i
        return {"tool_calls": [tc]}

    return [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "let me "}), chunk({"reasoning": "", "reasoning_content": "see"}),
        chunk({"content": "Hello"}), chunk({}), chunk(choices=False),
        chunk({"content": " there", "reasoning": "hmm"}),
        chunk({"content": ","}, usage=usage(3, 3)),
        chunk({"refusal": " no"}), chunk({"content": " yes"}),
        chunk(call(0, "", id="call_a", type="function", function={"name": "f"})),
        chunk(call(0, '{"a":', function={"name": "f"})), chunk(call(0, ' 1')),
        chunk(call(0, ', "b"', id="call_a")), chunk(call(None, ': 2}')),
        chunk(call(1, "", id="call_b", function={"name": "g"})), chunk(call(1, "{}")),
        chunk({"content": "after"}), chunk({"content": " the calls"}),
        chunk({}, "tool_calls"), chunk(usage=usage(40, 30), choices=False),
    ]


@pytest.mark.parametrize("policy", ["all", "none", "first"])
@pytest.mark.parametrize("shape", ["answer", "odd"])
def test_lane_events_then_chunks_are_the_stream(mock: MockChatServer, policy: str, shape: str) -> None:
    """With a lane offered for the consumer's open item, as a run offers it: the deltas the lane
    sent (read back from its events), what the sinks took and what was yielded are, in order,
    exactly the stream without a sink."""
    events = paced(answer(), burst_at=11) if shape == "answer" else paced(odd_shapes(), burst_at=11)
    plain, exc0, _ = run_stream(mock, events, None)
    assert exc0 is None
    native = _accel.BACKEND_NAMES["SseDecoder"] == "hotloop._native"
    for _ in range(READ_SHAPE_TRIES):
        batches: list[int] = []
        got, exc, _ = run_stream(mock, events, POLICIES[policy], batches)
        assert exc is None
        assert got == plain
        # the lane was used (when the reads came as paced: see READ_SHAPE_TRIES)
        if not native or (len(batches) >= (10 if shape == "answer" else 3) and max(batches) >= 2):
            break
    else:
        pytest.fail(f"the lane was not used in {READ_SHAPE_TRIES} runs: {batches}")


@pytest.mark.parametrize("kind", ["ping", "error"])
def test_an_event_of_another_type_keeps_its_place(mock: MockChatServer, kind: str) -> None:
    """One read holding a plain delta, an event of another type, then plain deltas: the later
    deltas go after it (an ordinary chunk for the general path, or the stream's failure)."""
    head = text_events("one two three", pieces=3)[:-2]
    other = chunk({"content": " B"}) if kind == "ping" else {"error": {"message": "overloaded", "status_code": 503}}
    burst = (f"data: {json.dumps(chunk({'content': ' A'}))}\n\nevent: {kind}\ndata: {json.dumps(other)}\n\n"
             f"data: {json.dumps(chunk({'content': ' C'}))}\n\n")
    events = paced(head, burst_at=len(head)) + [Sleep(GAP), burst] + paced(text_events("x", pieces=1)[-2:], burst_at=9)
    plain, exc0, _ = run_stream(mock, events, None)
    got, exc, _ = run_stream(mock, events, POLICIES["all"], [])
    assert got == plain and type(exc) is type(exc0) and str(exc) == str(exc0)
    assert (exc0 is None) == (kind == "ping") and TextDelta(" C") not in got[: got.index(TextDelta(" A")) + 1]


def test_a_sink_that_takes_everything_gets_every_delta(mock: MockChatServer) -> None:
    events = paced(answer())
    plain, _, _ = run_stream(mock, events, None)
    taken: list[Chunk] = []

    def take(chunks: list[Chunk]) -> int:
        taken.extend(chunks)
        return len(chunks)

    got, exc, _ = run_stream(mock, events, take)
    assert exc is None and got == plain
    # everything before [DONE] was pushed; only what the stream's end makes is yielded
    assert taken == plain[: len(taken)] and len(taken) >= len(plain) - 2


@pytest.mark.parametrize(
    "bad, error",
    [
        ("data: {not json\n\n", errors.BackendError),
        ('event: error\ndata: {"error": {"message": "overloaded", "status_code": 503}}\n\n', errors.HotloopError),
        ('data: {"error": {"message": "bad things", "code": 400}}\n\n', errors.HotloopError),
    ],
)
def test_failures_mid_stream_surface_the_same_way(mock: MockChatServer, bad: str, error: type) -> None:
    head = text_events("one two three four", pieces=4)[:-2]
    events = paced(head, burst_at=1) + [Sleep(GAP), bad]
    plain, exc0, _ = run_stream(mock, events, None)
    for _ in range(READ_SHAPE_TRIES):
        got, exc, calls = run_stream(mock, events, len)
        assert isinstance(exc0, error) and type(exc) is type(exc0) and str(exc) == str(exc0)
        assert got == plain
        if calls >= 2:  # the burst and the last delta (the role chunk makes none), in reads of their own
            break
    else:
        pytest.fail(f"the reads were never apart in {READ_SHAPE_TRIES} runs")


def test_a_read_pause_takes_what_arrived_meanwhile_in_one_read(mock: MockChatServer) -> None:
    """--backend-read-pause-ms 40 from one stream on, chunks 2 ms apart: after a read the sink
    took whole, the connection is not read for 40 ms, so a read takes many chunks;
    every chunk still arrives, in order, and once the response has ended its connection is
    kept, reading again (a close by the server would be seen). Without the pause, or with pauses
    only from two streams at once: a read per chunk."""
    pieces = [f"r{i:02d} " for i in range(40)]
    events: list[Event] = [chunk({"role": "assistant", "content": ""})]
    for p in pieces:
        events += [Sleep(0.002), chunk({"content": p})]
    events += [chunk({}, "stop"), chunk(usage=usage(5, 40), choices=False)]
    reads = {}
    for pause, streams in ((0.0, 1), (40.0, 1), (40.0, 2)):
        conns: list[Any] = []
        got, exc, calls = run_stream(mock, events, len, read_pause_ms=pause, conns=conns, pause_streams=streams)
        assert exc is None and [c.text for c in got if type(c) is TextDelta] == pieces
        [(reads[pause, streams], napping, reading)] = conns
        assert not napping and reading
    # about one a chunk (a busy machine merges some: the test's loop wakes late)
    assert reads[0.0, 1] >= 15 and reads[40.0, 2] >= 15, reads
    # 80 ms of chunks (longer on a busy machine, whose mock sleeps late): about 3-8 reads
    assert reads[40.0, 1] * 2 <= reads[0.0, 1], reads


def test_a_failing_sink_fails_the_stream(mock: MockChatServer) -> None:
    class Broken(Exception):
        pass

    seen: list[int] = []

    def take(chunks: list[Chunk]) -> int:
        seen.append(len(chunks))
        if len(seen) == 3:
            raise Broken()
        return len(chunks)

    got, exc, calls = run_stream(mock, paced(answer()), take)
    assert isinstance(exc, Broken) and calls == 3


# -- end to end: a server on the lean transport ----------------------------------------------------


def _server(tmp: Any, mock: MockChatServer, transport: str, *more: str) -> Any:
    env = {"HOTLOOP_BACKEND_API_KEY": "k", "HOTLOOP_BACKEND_IDLE_TIMEOUT": "5", "HOTLOOP_BACKEND_RETRIES": "0",
           "HOTLOOP_BACKEND_TRANSPORT": transport}
    args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model", "--store", "memory", *more)
    return run_server(tmp, *args, env=env)


@pytest.fixture(scope="module")
def lean(tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer) -> Iterator[Server]:
    """The lean transport: chunks are pushed to WebSocket and SSE clients, every read's deltas
    written at once (``--flush-interval-ms 0``; the default holds them, see ``held``)."""
    with _server(tmp_path_factory.mktemp("lean"), mock, "lean", "--flush-interval-ms", "0") as s:
        yield s


@pytest.fixture(scope="module")
def paused(tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer) -> Iterator[Server]:
    """The lean transport with read pauses (--backend-read-pause-ms 20) from one stream on."""
    with _server(tmp_path_factory.mktemp("paused"), mock, "lean", "--backend-read-pause-ms", "20", "--backend-read-pause-streams", "1") as s:
        yield s


@pytest.fixture(scope="module")
def sdk(tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer) -> Iterator[Server]:
    """The SDK transport: no push delivery, every chunk goes through the response's task."""
    with _server(tmp_path_factory.mktemp("sdk"), mock, "sdk") as s:
        yield s


HELD_MS = 40  # the held server's --flush-interval-ms


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer) -> Iterator[Server]:
    """The lean transport with --flush-interval-ms: pushed deltas are held and written together."""
    with _server(tmp_path_factory.mktemp("held"), mock, "lean", "--flush-interval-ms", str(HELD_MS)) as s:
        yield s


# (encrypted_content: a store: false response's reasoning, sealed under each server's own key)
_VARYING = ("id", "item_id", "call_id", "created_at", "completed_at", "encrypted_content")


def _comparable(events: list[dict[str, Any]]) -> list[str]:
    """Events without what differs between two responses (ids, times), at any depth."""

    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in _VARYING}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v

    return [json.dumps(strip(e), sort_keys=True) for e in events]


def _over_ws(server: Server, body: dict[str, Any], pause: float = 0.0, times: list[float] | None = None) -> list[dict[str, Any]]:
    with connect(server.base.replace("http", "ws", 1) + "/v1/responses", max_size=None, compression=None) as ws:
        ws.send(json.dumps({"type": "response.create", **body}))
        if pause:
            time.sleep(pause)  # the server keeps streaming into a socket nobody reads
        if times is None:
            return raw_until_terminal(ws)
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "response.failed", "error"):
            events.append(json.loads(ws.recv(timeout=30)))
            times.append(time.perf_counter())
        return events


def _over(server: Server, client: str, body: dict[str, Any], pause: float = 0.0, times: list[float] | None = None) -> list[dict[str, Any]]:
    """The events of one streamed response; ``times``: filled with each event's arrival."""
    if client == "ws":
        return _over_ws(server, body, pause, times)
    events = []
    with httpx.stream("POST", server.v1 + "/responses", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        if pause:
            time.sleep(pause)  # the server keeps streaming into a socket nobody reads
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if times is not None:
                    times.append(time.perf_counter())
    return events


@pytest.mark.parametrize("summary", [False, True], ids=["raw", "summary"])
def test_pushed_events_match_the_task_path(
    lean: Server, sdk: Server, held: Server, paused: Server, mock: MockChatServer, summary: bool
) -> None:
    """The same answer over WebSocket and SSE, pushed (lean transport), pushed and held
    (--flush-interval-ms), pushed with read pauses (--backend-read-pause-ms) and not pushed
    (SDK transport): the same events. With ``reasoning.summary`` the reasoning is streamed as
    its summary (pushed through a summary lane)."""
    body: dict[str, Any] = {"model": "mock-model", "input": "go", "store": False}
    if summary:
        body["reasoning"] = {"summary": "auto"}
    runs = {}
    for name, server in (("lean", lean), ("sdk", sdk), ("held", held), ("paused", paused)):
        for client in ("ws", "sse"):
            mock.push(Reply.stream(paced(answer())))
            events = _over(server, client, body)
            assert events[-1]["type"] == "response.completed", (name, client)
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            runs[name, client] = _comparable(events)
    first = runs["sdk", "sse"]
    assert len(first) > 30
    assert all(r == first for r in runs.values())
    kind = "response.reasoning_summary_text.delta" if summary else "response.reasoning_text.delta"
    assert sum(f'"type": "{kind}"' in e for e in first) > 1


def test_a_json_answer_is_the_same_taken_from_the_reads(lean: Server, sdk: Server, mock: MockChatServer) -> None:
    """A non-streaming answer's run takes its chunks from the backend's reads too (its turn
    quiet: lanes read into events nobody sends): the same response as through its task."""
    body = {"model": "mock-model", "input": "go", "store": False}
    answers = []
    for server in (lean, sdk):
        mock.push(Reply.stream(paced(answer())))
        r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
        assert r.status_code == 200
        answers.append(_comparable([r.json()]))
    got = json.loads(answers[0][0])
    assert got["status"] == "completed" and [it["type"] for it in got["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert got["output"][1]["content"][0]["text"] == "the quick brown fox jumps over the lazy dog"
    assert answers[0] == answers[1]


def test_a_json_answers_run_takes_its_chunks_from_the_reads(mock: MockChatServer, tmp_path: Any, monkeypatch: Any) -> None:
    """In process, the run of a non-streaming answer: the backend's read callback hands it
    its chunks (Run._push takes them, or its lane reads their events, which it drops), not only
    its task."""
    from hotloop.server import engine, http
    from hotloop.server.runner import make_app
    from tests.unit.test_http_cork import _connection, _post, _until_written

    taken: list[int] = []
    push = engine.Run._push

    def counted(self: Any, chunks: list[Chunk]) -> int:
        taken.append(push(self, chunks))
        return taken[-1]

    dropped: list[int] = []
    monkeypatch.setattr(engine.Run, "_push", counted)
    monkeypatch.setattr(http, "_discard", lambda batch: dropped.append(len(batch)))
    mock.push(Reply.stream(paced(answer())))

    async def main() -> bytes:
        config = Config(backend="openai-compat", base_url=mock.v1, model="mock-model", backend_api_key="k",
                        backend_idle_timeout=5, store="memory", data_dir=str(tmp_path))
        app = make_app(config)
        await app.startup()
        try:
            proto, transport = _connection(app, config)
            proto.data_received(_post({"model": "mock-model", "input": "go", "store": False}))
            await _until_written(transport, b"}")
            proto.connection_lost(None)
            return b"".join(transport.writes)
        finally:
            await app.shutdown()

    written = asyncio.run(main())
    got = json.loads(written.partition(b"\r\n\r\n")[2])
    assert got["status"] == "completed" and got["output"][1]["content"][0]["text"] == "the quick brown fox jumps over the lazy dog"
    # the deltas before the finish, from the reads: taken as chunks, or read through lanes
    assert sum(taken) >= 1 and sum(taken) + sum(dropped) >= 15, (taken, dropped)


@pytest.mark.parametrize("client", ["ws", "sse"])
@pytest.mark.parametrize("which", ["lean", "held"])
def test_a_client_that_stops_reading_gets_everything_in_order(
    request: pytest.FixtureRequest, mock: MockChatServer, client: str, which: str
) -> None:
    """Deltas of 8 KB, more than the socket and the server's write buffer hold while the client
    does not read: the server stops pushing, waits for the client, and goes on (also while it
    holds deltas back, --flush-interval-ms)."""
    lean: Server = request.getfixturevalue(which)
    pieces = [f"{i:05d}" + "x" * 8187 for i in range(400)]
    events: list[Event] = [chunk({"role": "assistant", "content": ""})]
    for p in pieces:
        events += [Sleep(0.0005), chunk({"content": p})]
    events += [chunk({}, "stop"), chunk(usage=usage(5, 400), choices=False)]
    mock.push(Reply.stream(events))
    got = _over(lean, client, {"model": "mock-model", "input": "go", "store": False}, pause=1.0)
    assert got[-1]["type"] == "response.completed"
    deltas = [e["delta"] for e in got if e["type"] == "response.output_text.delta"]
    assert deltas == pieces
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == "".join(pieces)


def _bursts(times: list[float], gap: float = 0.002) -> int:
    """How many groups the arrival times form, a new group after each pause of more than ``gap``."""
    return 1 + sum(1 for a, b in zip(times, times[1:]) if b - a > gap)


@pytest.mark.parametrize("client", ["ws", "sse"])
def test_held_deltas_go_out_together(held: Server, mock: MockChatServer, client: str) -> None:
    """--flush-interval-ms 40, deltas 5 ms apart: a read's deltas are written at once only when
    the last such write is at least 20 ms old, so the client gets them in a few bursts (at most
    one per 20 ms of the stream), each delta no later than 40 ms after the write before it."""
    pieces = [f"p{i:02d} " for i in range(40)]
    events: list[Event] = [chunk({"role": "assistant", "content": ""})]
    for p in pieces:
        events += [Sleep(0.005), chunk({"content": p})]
    events += [chunk({}, "stop"), chunk(usage=usage(5, 40), choices=False)]
    mock.push(Reply.stream(events))
    times: list[float] = []
    got = _over(held, client, {"model": "mock-model", "input": "go", "store": False}, times=times)
    assert got[-1]["type"] == "response.completed"
    at = [t for e, t in zip(got, times) if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in got if e["type"] == "response.output_text.delta"] == pieces
    span = at[-1] - at[0]  # about 200 ms unless the machine is slow
    # writes at least 20 ms apart, plus the first delta's (through the response's task), the
    # last ones' (with the response's end) and some slack for a client read that pauses in a
    # burst; 40 deltas written one by one are about 40 bursts
    assert _bursts(at) <= span / (HELD_MS / 2 / 1000) + 6, (_bursts(at), span)


@pytest.fixture(scope="module")
def default(tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer) -> Iterator[Server]:
    """The lean transport with hotloop's default --flush-interval-ms."""
    with _server(tmp_path_factory.mktemp("default"), mock, "lean") as s:
        yield s


@pytest.mark.parametrize("client", ["ws", "sse"])
def test_deltas_are_held_by_default(default: Server, mock: MockChatServer, client: str) -> None:
    """Without the flag, deltas 1 ms apart (a model at 1,000 tokens/s) reach the client in
    bursts about 5 ms apart (10 ms by default), not one write per read; the first delta is not
    held."""
    pieces = [f"q{i:02d} " for i in range(60)]
    events: list[Event] = [chunk({"role": "assistant", "content": ""}), chunk({"content": pieces[0]})]
    for p in pieces[1:]:
        events += [Sleep(0.001), chunk({"content": p})]
    events += [Sleep(0.2), chunk({}, "stop"), chunk(usage=usage(5, 60), choices=False)]
    mock.push(Reply.stream(events))
    times: list[float] = []
    got = _over(default, client, {"model": "mock-model", "input": "go", "store": False}, times=times)
    assert got[-1]["type"] == "response.completed"
    at = [t for e, t in zip(got, times) if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in got if e["type"] == "response.output_text.delta"] == pieces
    added = next(t for e, t in zip(got, times) if e["type"] == "response.content_part.added")
    assert at[0] - added < 0.005  # the first delta went out with the part's start, not 10 ms later
    span = at[-1] - at[0]  # about 60 ms unless the machine is slow
    assert _bursts(at, gap=0.0005) <= span / 0.005 + 6, (_bursts(at, gap=0.0005), span)  # one by one: about 60
    assert times[-1] - at[-1] > 0.1  # the last held ones did not wait for the stream's end


@pytest.mark.parametrize("client", ["ws", "sse"])
def test_held_deltas_do_not_wait_for_the_next_read(held: Server, mock: MockChatServer, client: str) -> None:
    """A stream that pauses for 0.5 s after a few deltas: what was held is written at most
    40 ms after the previous write, not with the deltas after the pause."""
    events: list[Event] = [chunk({"role": "assistant", "content": ""})]
    for p in ("a", "b", "c", "d"):
        events += [Sleep(GAP), chunk({"content": p})]
    events += [Sleep(0.5), chunk({"content": "e"}), chunk({}, "stop"), chunk(usage=usage(5, 5), choices=False)]
    mock.push(Reply.stream(events))
    times: list[float] = []
    got = _over(held, client, {"model": "mock-model", "input": "go", "store": False}, times=times)
    at = {e["delta"]: t for e, t in zip(got, times) if e["type"] == "response.output_text.delta"}
    assert list(at) == ["a", "b", "c", "d", "e"]
    assert at["e"] - at["d"] > 0.3, at  # "d" did not wait for "e"


def test_a_responses_first_delta_and_its_items_are_never_held(held: Server, mock: MockChatServer) -> None:
    """--flush-interval-ms 40 over one WebSocket connection: the first delta of the next
    response goes out at once though the previous response wrote held deltas just before (the
    hold state belongs to the connection), and an item's start goes out at once, with what was
    held, instead of waiting for the interval. (Timed against 20-30 ms bounds: a run whose reads
    a loaded machine delayed past them runs again, up to READ_SHAPE_TRIES times.)"""
    for _ in range(READ_SHAPE_TRIES):
        late = _first_delta_and_items_unheld(held, mock)
        if late is None:
            return
    pytest.fail(late)


def _first_delta_and_items_unheld(held: Server, mock: MockChatServer) -> str | None:
    role = chunk({"role": "assistant", "content": ""})
    one: list[Event] = [role, chunk({"content": "a"}), Sleep(0.03), chunk({"content": "b"})]
    one += [chunk({}, "stop"), chunk(usage=usage(5, 2), choices=False)]
    start = chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{"}}]})
    two: list[Event] = [role, chunk({"content": "c"}), Sleep(0.002), chunk({"content": "d"}), Sleep(0.005), chunk({"content": "e"})]
    two += [Sleep(0.005), start]
    two += [Sleep(0.03), chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}), chunk({}, "tool_calls")]
    two += [chunk(usage=usage(5, 4), choices=False)]
    mock.push(Reply.stream(one))
    mock.push(Reply.stream(two))
    got: list[tuple[dict[str, Any], float]] = []
    with connect(held.base.replace("http", "ws", 1) + "/v1/responses", max_size=None, compression=None) as ws:
        for _ in range(2):
            ws.send(json.dumps({"type": "response.create", "model": "mock-model", "input": "go", "store": False}))
            while True:
                e = json.loads(ws.recv(timeout=30))
                got.append((e, time.perf_counter()))
                if e["type"] in ("response.completed", "response.failed", "error"):
                    break
    assert [e["type"] for e, _ in got].count("response.completed") == 2
    at = {e["delta"]: t for e, t in got if e["type"] == "response.output_text.delta"}
    created = [t for e, t in got if e["type"] == "response.created"][1]
    call = next(t for e, t in got if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call")
    # "b", response one's last delta, was written by the hold logic a few ms before "d", the
    # first delta pushed for response two ("c" comes with its first chunk, through the
    # response's task): held, "d" would wait until "b" is 40 ms old
    if not at["d"] - created < 0.02:
        return f"d after {at['d'] - created}"
    # "e" is held (5 ms after "d"); the call's start, 5 ms later, takes it along at once
    # instead of both waiting for the interval
    if not (call - created < 0.03 and at["e"] <= call + 0.001):
        return f"call after {call - created}, e {at['e'] - call} after the call"
    return None


def test_an_items_start_is_never_held_over_sse(held: Server, mock: MockChatServer) -> None:
    """--flush-interval-ms 40 over SSE: a held delta goes out with the next item's start, at
    once, instead of both waiting for the interval."""
    start = chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    script: list[Event] = [chunk({"role": "assistant", "content": ""}), chunk({"content": "c"}), Sleep(0.002)]
    script += [chunk({"content": "d"}), Sleep(0.005), chunk({"content": "e"}), Sleep(0.005), start, Sleep(0.03)]
    script += [chunk({}, "tool_calls"), chunk(usage=usage(5, 4), choices=False)]
    mock.push(Reply.stream(script))
    times: list[float] = []
    got = _over(held, "sse", {"model": "mock-model", "input": "go", "store": False}, times=times)
    assert got[-1]["type"] == "response.completed"
    at = {e["delta"]: t for e, t in zip(got, times) if e["type"] == "response.output_text.delta"}
    call = next(t for e, t in zip(got, times) if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call")
    # "e" is held (5 ms after "d", written at once); the call's start 5 ms later takes it along
    assert call - at["d"] < 0.025 and at["e"] <= call + 0.001, (call - at["d"], at["e"] - call)


def test_openai_python_reads_held_deltas(held: Server, mock: MockChatServer) -> None:
    """openai-python, streaming over SSE and over client.responses.connect(), from a server that
    holds deltas back (several events per write): every delta, in order, and the same text."""
    from openai import OpenAI

    from tests.integration.test_websocket import until_terminal

    client = OpenAI(api_key="k", base_url=held.v1, max_retries=0)
    pieces = [f"w{i} " for i in range(30)]

    def script() -> None:
        events: list[Event] = [chunk({"role": "assistant", "content": ""})]
        for p in pieces:
            events += [Sleep(0.002), chunk({"content": p})]
        mock.push(Reply.stream(events + [chunk({}, "stop"), chunk(usage=usage(5, 30), choices=False)]))

    script()
    with client.responses.stream(model="mock-model", input="go", store=False) as stream:
        sse = [e for e in stream]
    script()
    with client.responses.connect() as conn:
        conn.response.create(model="mock-model", input="go", store=False)
        ws = until_terminal(conn)
    for events in (sse, ws):
        assert [e.delta for e in events if e.type == "response.output_text.delta"] == pieces
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == "".join(pieces)
        assert [e.sequence_number for e in events] == list(range(len(events)))
