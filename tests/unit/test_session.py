"""The WebSocket session machine, fed frames directly (sans-I/O)."""

from __future__ import annotations

import json

import pytest

from hotloop import errors
from hotloop.protocol.session import Close, Ended, RunCreate, SendError, Session


def s(**kw) -> Session:
    return Session(opened_at=0.0, max_age=kw.pop("max_age", 3600.0), **kw)


def test_create_and_processed() -> None:
    sess = s()
    [a] = sess.receive(json.dumps({"type": "response.create", "model": "m", "input": "x", "stream": True}), 1.0)
    assert isinstance(a, RunCreate) and a.request.model == "m" and a.request.stream is True
    assert sess.queued == 1
    assert sess.receive(json.dumps({"type": "response.processed", "response_id": "resp_1"}), 1.0) == []
    assert sess.lane_done(None, Ended(), a) == []
    assert sess.queued == 0 and sess.in_flight == 0


def test_malformed_frames_are_errors_not_closes() -> None:
    sess = s()
    for frame in ["nope", "[1]", json.dumps({"type": "what"}), json.dumps({"type": "response.inject"}), b"\x00bin"]:
        [a] = sess.receive(frame, 1.0)
        assert isinstance(a, SendError) and a.error.status == 400
    [a] = sess.receive(json.dumps({"type": "response.create", "model": ["m"]}), 1.0)
    assert isinstance(a, SendError) and a.error.param == "model"
    for frame in ("[1]", '"x"', "5"):  # valid JSON, not an object
        [a] = sess.receive(frame, 1.0)
        assert isinstance(a, SendError) and a.error.code == "invalid_json", frame
    # valid JSON holding a number beyond a double: not "not valid JSON"
    [a] = sess.receive('{"type": "response.create", "model": "m", "input": "x", "temperature": 1e400}', 1.0)
    assert isinstance(a, SendError) and a.error.code == "invalid_value" and "out of range" in a.error.message
    for known in ('"metadata": {"k": -1e400}', '"input": [{"role": "user", "content": "x", "n": [1e400]}]'):
        [a] = sess.receive('{"type": "response.create", "model": "m", "input": "x", ' + known + "}", 1.0)
        assert isinstance(a, SendError) and "out of range" in a.error.message, known


def test_a_number_beyond_a_double_in_a_field_the_request_does_not_know_is_ignored() -> None:
    """Unknown top-level fields are ignored, whatever they hold, as over HTTP (whose body decoder
    skips them): a small frame with ``"x": 1e400`` runs, the field dropped."""
    sess = s()
    [a] = sess.receive('{"type": "response.create", "model": "m", "input": "x", "x": 1e400, "y": {"z": [-1e999]}}', 1.0)
    assert isinstance(a, RunCreate) and a.request.model == "m" and a.request.input == "x"


def test_a_transport_decoder_takes_large_create_frames_with_the_same_admission() -> None:
    from hotloop.protocol.request import convert_body
    from hotloop.protocol.session import FAST_DECODE_BYTES, OFFERED_BYTES

    seen: list[int] = []

    def fast(frame: str) -> tuple[object, str] | None:
        seen.append(len(frame))
        obj = json.loads(frame)
        return (convert_body(obj), "extra") if obj.get("type") == "response.create" else None

    sess = s(max_queued=2, decode_create=fast)
    small = json.dumps({"type": "response.create", "model": "m", "input": "x"})
    big = json.dumps({"type": "response.create", "model": "m", "input": "x" * FAST_DECODE_BYTES, "stream_id": "L1"})
    [a] = sess.receive(small, 1)
    assert isinstance(a, RunCreate) and a.decoded is None and seen == []  # small frames: the ordinary way
    mid = json.dumps({"type": "response.create", "model": "m", "input": "x" * OFFERED_BYTES, "stream_id": "L0"})
    [m] = sess.receive(mid, 1)  # from OFFERED_BYTES on, offered too
    assert isinstance(m, RunCreate) and m.decoded == "extra" and seen == [len(mid)]
    seen.clear()
    sess.lane_done("L0", Ended(), m)
    [b] = sess.receive(big, 1)
    assert isinstance(b, RunCreate) and b.decoded == "extra" and b.size == len(big) and seen == [len(big)]
    [c] = sess.receive(big.replace('"L1"', '"L2"'), 1)  # the queue bound holds on this path too
    assert isinstance(c, SendError) and c.error.code == "websocket_queue_full"
    assert sess.queued == 2
    other = json.dumps({"type": "response.append", "input": "y" * FAST_DECODE_BYTES, "stream_id": "L3"})
    [d] = sess.receive(other, 1)  # declined by the decoder: the ordinary dispatch and error
    assert isinstance(d, SendError) and d.error.param == "type"
    assert repr(sess.receive(big, 7200)) == repr(sess_expired_like(big))  # past the age limit: as ever


def sess_expired_like(frame: str) -> list[object]:
    """What a session without the decoder answers to ``frame`` in the same state."""
    ref = s(max_queued=2)
    ref.receive(json.dumps({"type": "response.create", "model": "m", "input": "x"}), 1)
    ref.receive(frame, 1)
    return ref.receive(frame, 7200)


def _fast(frame: str) -> tuple[object, str] | None:
    from hotloop.protocol.request import convert_body

    obj = json.loads(frame)
    return (convert_body(obj), "extra") if obj.get("type") == "response.create" else None


@pytest.mark.parametrize("decoder", [None, _fast])
def test_a_refused_create_behind_a_busy_lane_is_refused_and_never_run(decoder: object) -> None:
    """The queue bound on a busy lane: the refusal waits behind the running response, and the
    refused create is not queued as well (frames the transport's decoder takes included)."""
    from hotloop.protocol.session import OFFERED_BYTES

    sess = s(max_queued=2, decode_create=decoder)
    frame = json.dumps({"type": "response.create", "model": "m", "input": "x" * OFFERED_BYTES})
    [first] = sess.receive(frame, 1)
    assert isinstance(first, RunCreate) and first.decoded == ("extra" if decoder else None)
    assert sess.receive(frame, 1) == []  # queued behind the first
    assert sess.receive(frame, 1) == []  # refused: its error waits behind the first
    assert sess.queued == 2 and sess.queued_bytes == len(frame)
    [second] = sess.lane_done(None, Ended("resp_1", "completed"), first)
    assert isinstance(second, RunCreate)
    [err] = sess.lane_done(None, Ended("resp_2", "completed"), second)
    assert isinstance(err, SendError) and err.error.code == "websocket_queue_full"
    assert sess.queued == 0 and sess.in_flight == 0 and sess.backlog == 0


@pytest.mark.parametrize("decoder", [None, _fast])
@pytest.mark.parametrize("bad", ["", "bad 17", "lane\n", "x" * 257, "\u00e9t\u00e9", "y" * 100_000])
def test_an_invalid_stream_id_names_no_lane(decoder: object, bad: str) -> None:
    """No lane state is made for an invalid ``stream_id``, and the id is not echoed: the error
    is the default lane's (after its running response), as in the guide's example."""
    from hotloop.protocol.session import OFFERED_BYTES

    sess = s(decode_create=decoder)
    frame = {"type": "response.create", "model": "m", "input": "x" * OFFERED_BYTES}
    [run] = sess.receive(json.dumps(frame), 1)
    assert isinstance(run, RunCreate)
    assert sess.receive(json.dumps({**frame, "stream_id": bad}), 1) == []  # behind the default lane
    [named] = sess.receive(json.dumps({**frame, "stream_id": "ok"}), 1)  # a valid lane runs now
    assert isinstance(named, RunCreate) and named.lane == "ok"
    [err] = sess.lane_done(None, Ended("resp_1", "completed"), run)
    assert isinstance(err, SendError) and err.stream_id is None
    assert (err.error.code, err.error.param, err.error.status) == ("invalid_stream_id", "stream_id", 400)
    [now] = sess.receive(json.dumps({**frame, "stream_id": bad}), 1)  # the default lane is idle
    assert isinstance(now, SendError) and now.stream_id is None and now.error.code == "invalid_stream_id"
    [other] = sess.receive(json.dumps({"type": "response.append", "stream_id": bad}), 1)
    assert isinstance(other, SendError) and other.stream_id is None and other.error.param == "type"
    assert set(sess._lanes) <= {None, "ok"} and sess.lanes == {"ok"}
    assert sess.queued == 1 and sess.in_flight == 1


def test_queue_bound() -> None:
    sess = s(max_queued=2)
    frame = json.dumps({"type": "response.create", "model": "m", "input": "x"})
    [first] = sess.receive(frame, 1)
    assert isinstance(first, RunCreate)
    assert sess.receive(frame, 1) == []  # queued behind the first (same lane)
    assert sess.queued_bytes == len(frame)
    assert sess.receive(frame, 1) == []  # the error waits behind the running response, in order
    [second] = sess.lane_done(None, Ended("resp_1", "completed"), first)
    assert isinstance(second, RunCreate) and sess.queued_bytes == 0
    assert sess.receive(frame, 1) == []  # room again: queued behind the second and the error
    [a, third] = sess.lane_done(None, Ended("resp_2", "completed"), second)
    assert isinstance(a, SendError) and isinstance(a.error, errors.QueueFull)
    assert isinstance(third, RunCreate)


def test_connection_age_limit() -> None:
    sess = s(max_age=60)
    frame = json.dumps({"type": "response.create", "model": "m", "input": "x"})
    [run] = sess.receive(frame, 59.9)
    assert isinstance(run, RunCreate)
    assert sess.receive(frame, 60.0) == []  # the running response finishes first
    err, close = sess.lane_done(None, Ended("resp_1", "completed"), run)
    assert isinstance(err, SendError) and err.error.code == "websocket_connection_limit_reached"
    assert isinstance(close, Close) and close.code == 1001
    assert sess.receive(frame, 61.0) == []


def test_stream_id_lane_limit() -> None:
    sess = s(max_lanes=2)
    mk = lambda sid: json.dumps({"type": "response.create", "model": "m", "input": "x", "stream_id": sid})
    assert isinstance(sess.receive(mk("a"), 1)[0], RunCreate)
    assert isinstance(sess.receive(mk("b"), 1)[0], RunCreate)
    assert sess.receive(mk("a"), 1) == []  # lane a is busy: queued
    [a] = sess.receive(mk("c"), 1)
    assert isinstance(a, SendError) and a.error.code == "websocket_stream_limit_reached" and a.stream_id == "c"


def test_a_refused_frame_takes_no_lane() -> None:
    """Frames refused for what they hold (here: a ``model`` that is no string) on new ``stream_id``s use none of the
    connection's lane slots; the next valid request on a new lane runs."""
    sess = s(max_lanes=2)
    for i in range(5):
        frame = {"type": "response.create", "model": ["m"], "input": "x", "stream_id": f"bad{i}"}
        [a] = sess.receive(json.dumps(frame), 1)
        assert isinstance(a, SendError) and a.error.param == "model" and a.stream_id == f"bad{i}"
    assert sess.lanes == set()
    for sid in ("good", "also"):
        [a] = sess.receive(json.dumps({"type": "response.create", "model": "m", "input": "x", "stream_id": sid}), 1)
        assert isinstance(a, RunCreate) and a.lane == sid
    [a] = sess.receive(json.dumps({"type": "response.create", "model": "m", "input": "x", "stream_id": "third"}), 1)
    assert isinstance(a, SendError) and a.error.code == "websocket_stream_limit_reached"


def test_a_request_refused_before_it_starts_gives_its_new_lane_back() -> None:
    """A ``response.create`` the engine refuses (validation: ``temperature: 9``, a missing
    ``model``; a limit) before it becomes a response takes no lane slot either, unless a response
    ran on that lane before or another request waits there."""
    sess = s(max_lanes=2)
    mk = lambda sid: json.dumps({"type": "response.create", "model": "m", "input": "x", "stream_id": sid})
    for i in range(5):
        [run] = sess.receive(mk(f"bad{i}"), 1)
        assert isinstance(run, RunCreate)
        assert sess.lane_done(run.lane, Ended(), run) == []  # refused: no response id
    assert sess.lanes == set() and set(sess._lanes) <= {None}
    [a] = sess.receive(mk("a"), 1)
    sess.started("a", "resp_a", a.request)
    sess.lane_done("a", Ended("resp_a", "completed"), a)
    [again] = sess.receive(mk("a"), 1)
    sess.lane_done("a", Ended(), again)  # refused, on a lane a response ran on: kept
    [b] = sess.receive(mk("b"), 1)
    assert sess.receive(mk("b"), 1) == []  # queued behind it
    sess.lane_done("b", Ended(), b)  # refused, but another request waits on b: kept
    assert sess.lanes == {"a", "b"}
    [err] = sess.receive(mk("c"), 1)
    assert isinstance(err, SendError) and err.error.code == "websocket_stream_limit_reached"


def test_a_binary_frame_is_refused_with_a_code() -> None:
    [a] = s().receive(b'{"type": "response.create"}', 1)
    assert isinstance(a, SendError)
    assert (a.error.status, a.error.type, a.error.code) == (400, "invalid_request_error", "unsupported_frame_type")


def test_expire_says_why_then_closes_once() -> None:
    s = Session(opened_at=0.0, max_age=60.0)
    actions = s.expire()
    assert [type(a) for a in actions] == [SendError, Close]
    assert actions[0].error.code == "websocket_connection_limit_reached"  # type: ignore[union-attr]
    assert actions[1].code == 1001  # type: ignore[union-attr]
    assert s.expire() == []  # decided once
    assert s.receive('{"type": "response.create", "model": "m", "input": "x"}', 1.0) == []


# -- lanes -----------------------------------------------------------------------------------

from hotloop.protocol.session import SteerEvent, StopResponse  # noqa: E402


def create(lane: str | None = None, **kw) -> str:
    body = {"type": "response.create", "model": "m", "input": "x", **kw}
    if lane is not None:
        body["stream_id"] = lane
    return json.dumps(body)


def steer(prev: str | None, input="more", **kw) -> str:
    body = {"type": "response.steer", "input": input, **kw}
    if prev is not None:
        body["previous_response_id"] = prev
    return json.dumps(body)


def test_lanes_start_at_once_and_one_lane_is_fifo() -> None:
    sess = s()
    [a] = sess.receive(create("a"), 1)
    [b] = sess.receive(create("b"), 1)
    [d] = sess.receive(create(), 1)
    assert [x.lane for x in (a, b, d)] == ["a", "b", None] and sess.in_flight == 3
    assert sess.receive(create("a", input="second"), 1) == []  # lane a is busy
    assert sess.queued == 4 and sess.in_flight == 3
    assert sess.lane_done("b", Ended("resp_b", "completed"), b) == []
    [a2] = sess.lane_done("a", Ended("resp_a", "completed"), a)
    assert a2.lane == "a" and a2.request.input == "second"
    assert sess.lane_done("a", Ended("resp_a2", "completed"), a2) == []
    assert sess.lane_done(None, Ended("resp_d", "completed"), d) == []
    assert sess.queued == 0 and sess.in_flight == 0 and sess.backlog == 0


def test_in_flight_cap_queues_and_waiting_lanes_go_first() -> None:
    sess = s(max_in_flight=2)
    [a] = sess.receive(create("a"), 1)
    [b] = sess.receive(create("b"), 1)
    assert sess.receive(create("c"), 1) == []  # no slot: lane c waits (queued, never rejected)
    assert sess.receive(create("a", input="a2"), 1) == []  # behind a's running response
    assert sess.queued_bytes == len(create("c")) + len(create("a", input="a2"))
    [c] = sess.lane_done("a", Ended("resp_a", "completed"), a)
    assert c.lane == "c"  # lane c waited longer than a's second response: it goes first
    [a2] = sess.lane_done("b", Ended("resp_b", "completed"), b)
    assert a2.lane == "a" and sess.in_flight == 2 and sess.queued_bytes == 0


def test_errors_wait_behind_their_lane_only() -> None:
    sess = s()
    [a] = sess.receive(create("a"), 1)
    assert sess.receive(create("a", model=["bad"]), 1) == []  # behind lane a's response
    [err] = sess.receive(create("b", model=["bad"]), 1)  # lane b is idle: at once
    assert isinstance(err, SendError) and err.stream_id == "b"
    [late] = sess.lane_done("a", Ended("resp_a", "completed"), a)
    assert isinstance(late, SendError) and late.stream_id == "a" and late.error.param == "model"


def test_expiry_waits_for_every_running_lane() -> None:
    sess = s(max_age=60)
    [a] = sess.receive(create("a"), 1)
    [b] = sess.receive(create("b"), 1)
    assert sess.receive(create("a"), 2) == []
    assert sess.expire() == []
    # the waiting one will not start: its refusal waits behind lane a's running response
    assert sess.queued == 2 and sess.backlog == 1 and sess.queued_bytes == 0
    [refused] = sess.lane_done("a", Ended("resp_a", "completed"), a)
    assert isinstance(refused, SendError) and refused.stream_id == "a"
    assert refused.error.code == "websocket_connection_limit_reached"
    err, close = sess.lane_done("b", Ended("resp_b", "completed"), b)
    assert isinstance(err, SendError) and isinstance(close, Close) and close.code == 1001


# -- steering ----------------------------------------------------------------------------------


def running(sess: Session, lane: str | None = "s", rid: str = "resp_1", **kw) -> RunCreate:
    [run] = sess.receive(create(lane, **kw), 1)
    assert isinstance(run, RunCreate)
    sess.started(lane, rid, run.request)
    return run


def test_steer_accepted_stops_the_response_and_the_successor_inherits() -> None:
    sess = s()
    run = running(sess, instructions="be brief", metadata={"sim": "text"}, max_output_tokens=50)
    acc, stop = sess.receive(steer("resp_1", "first"), 2)
    assert isinstance(acc, SteerEvent) and acc.kind == "response.steer.accepted" and acc.stream_id == "s"
    assert acc.steer_id and acc.steer_id.startswith("steer_") and acc.response_id == "resp_1"
    assert isinstance(stop, StopResponse) and stop.response_id == "resp_1"
    [acc2] = sess.receive(steer("resp_1", [{"role": "user", "content": "second"}]), 2)  # one stop is enough
    sess.ending("s", "incomplete")
    [succ] = sess.lane_done("s", Ended("resp_1", "incomplete"), run)
    assert isinstance(succ, RunCreate) and succ.lane == "s" and succ.successor_of == "resp_1"
    req = succ.request
    assert req.previous_response_id == "resp_1" and req.instructions == "be brief" and req.max_output_tokens == 50
    assert req.metadata == {"sim": "text"}
    assert req.input == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first"}]},
        {"type": "message", "role": "user", "content": "second"},
    ]
    assert [x.id for x in succ.steers] == [acc.steer_id, acc2.steer_id]
    assert sess.in_flight == 1 and sess.queued == 1  # the successor holds the same slot
    sess.started("s", "resp_2", req)
    assert sess.lane_done("s", Ended("resp_2", "completed"), succ) == []
    assert sess.in_flight == 0 and sess.queued == 0


def test_successor_runs_before_what_was_queued_on_the_lane() -> None:
    sess = s(max_in_flight=1)
    run = running(sess)
    assert sess.receive(create("s", input="queued"), 1) == []
    assert sess.receive(create("t"), 1) == []
    sess.receive(steer("resp_1"), 2)
    [succ] = sess.lane_done("s", Ended("resp_1", "completed"), run)  # normal completion: successor too
    assert succ.successor_of == "resp_1"
    sess.started("s", "resp_2", succ.request)
    [nxt] = sess.lane_done("s", Ended("resp_2", "completed"), succ)
    assert nxt.lane == "t"  # lane t waited for the slot before s's queued response


def test_steer_on_a_tool_call_turn_is_pending_then_prepended() -> None:
    sess = s()
    run = running(sess)
    acc1, _ = sess.receive(steer("resp_1", "one"), 2)
    [acc2] = sess.receive(steer("resp_1", "two"), 2)
    stubs = [{"type": "function_call_output", "call_id": "call_1", "name": "f"}]
    sess.ending("s", "completed")
    p1, p2 = sess.lane_done("s", Ended("resp_1", "completed", stubs), run)
    for p, a in ((p1, acc1), (p2, acc2)):
        assert isinstance(p, SteerEvent) and p.kind == "response.steer.pending" and p.steer_id == a.steer_id
        assert p.required_input == stubs and p.stream_id == "s" and p.response_id == "resp_1"
    assert sess.in_flight == 0
    # another lane continuing from it does not take the input
    [other] = sess.receive(create("t", previous_response_id="resp_1"), 3)
    assert other.steers == []
    outputs = [{"type": "function_call_output", "call_id": "call_1", "output": "ok"}]
    [cont] = sess.receive(create("s", previous_response_id="resp_1", input=outputs, instructions="mine"), 3)
    assert [x.id for x in cont.steers] == [acc1.steer_id, acc2.steer_id]
    assert [it["content"][0]["text"] for it in cont.request.input[:2]] == ["one", "two"]
    assert cont.request.input[2:] == outputs and cont.request.instructions == "mine"  # its own settings
    # the continuation failed before response.created: the input comes back
    f1, f2 = sess.lane_done("s", Ended(), cont)
    assert [(f.kind, f.code, f.steer_id, f.input) for f in (f1, f2)] == [
        ("response.steer.failed", "successor_creation_failed", acc1.steer_id, "one"),
        ("response.steer.failed", "successor_creation_failed", acc2.steer_id, "two"),
    ]


def pending_steer() -> tuple[Session, SteerEvent]:
    """A session whose lane ``s`` completed ``resp_1`` with an open call while steering input
    ("one") was accepted: the input waits (``response.steer.pending``) for the continuation."""
    sess = s()
    run = running(sess)
    acc, _ = sess.receive(steer("resp_1", "one"), 2)
    stubs = [{"type": "function_call_output", "call_id": "c", "name": "f"}]
    [p] = sess.lane_done("s", Ended("resp_1", "completed", stubs), run)
    assert p.kind == "response.steer.pending"
    return sess, acc


def test_pending_input_comes_back_when_the_connection_reaches_its_age_limit() -> None:
    """Steering input waiting for the continuation of a tool-call turn, when the connection
    reaches its age limit: no response on it will commit the input, so it comes back
    (``response.steer.failed``) before the limit's error and the close."""
    for running_other in (False, True):
        sess, acc = pending_steer()
        other = None
        if running_other:  # another lane still running: the close waits for it, the input does not
            [other] = sess.receive(create("t"), 3)
        actions = sess.expire()
        back = actions[0]
        assert isinstance(back, SteerEvent) and back.kind == "response.steer.failed"
        assert (back.code, back.steer_id, back.input, back.stream_id) == ("successor_creation_failed", acc.steer_id, "one", "s")
        if running_other:
            assert actions[1:] == []
            assert isinstance(other, RunCreate)
            assert [type(a) for a in sess.lane_done("t", Ended("resp_2", "completed"), other)] == [SendError, Close]
        else:
            assert [type(a) for a in actions[1:]] == [SendError, Close]
        assert sess.expire() == []


def test_pending_input_comes_back_when_its_continuation_is_refused() -> None:
    """The explicit continuation after ``pending`` refused before it became a response (a
    malformed field): the refusal, then the queued input back; a corrected retry is ordinary."""
    sess, acc = pending_steer()
    err, back = sess.receive(create("s", previous_response_id="resp_1", temperature="hot"), 3)
    assert isinstance(err, SendError) and err.error.param == "temperature" and err.stream_id == "s"
    assert isinstance(back, SteerEvent) and back.kind == "response.steer.failed"
    assert (back.code, back.steer_id, back.input, back.stream_id) == ("successor_creation_failed", acc.steer_id, "one", "s")
    [retry] = sess.receive(create("s", previous_response_id="resp_1", input=[]), 3)
    assert isinstance(retry, RunCreate) and retry.steers == []



def test_a_refused_create_naming_another_response_leaves_pending_input_queued() -> None:
    sess = s()
    run = running(sess)
    acc, _ = sess.receive(steer("resp_1", "one"), 2)
    sess.lane_done("s", Ended("resp_1", "completed", [{"type": "function_call_output", "call_id": "c", "name": "f"}]), run)
    [err] = sess.receive(create("s", previous_response_id="resp_0", temperature="hot"), 3)
    assert isinstance(err, SendError)
    [err] = sess.receive(create("t", previous_response_id="resp_1", temperature="hot"), 3)  # another lane
    assert isinstance(err, SendError)
    [cont] = sess.receive(create("s", previous_response_id="resp_1", input=[]), 3)
    assert isinstance(cont, RunCreate) and [x.id for x in cont.steers] == [acc.steer_id]


def test_pending_input_comes_back_when_the_lane_moves_on() -> None:
    sess = s()
    run = running(sess)
    acc, _ = sess.receive(steer("resp_1", "one"), 2)
    [p] = sess.lane_done("s", Ended("resp_1", "completed", [{"type": "function_call_output", "call_id": "c", "name": "f"}]), run)
    failed, nxt = sess.receive(create("s", input="unrelated"), 3)
    assert isinstance(failed, SteerEvent) and failed.code == "response_not_active" and failed.steer_id == acc.steer_id
    assert isinstance(nxt, RunCreate) and nxt.steers == [] and nxt.request.input == "unrelated"


def test_steered_response_that_fails_returns_the_input() -> None:
    sess = s()
    run = running(sess)
    acc, _ = sess.receive(steer("resp_1", "one"), 2)
    [f] = sess.lane_done("s", Ended("resp_1", "failed"), run)
    assert f.kind == "response.steer.failed" and f.code == "successor_creation_failed" and f.steer_id == acc.steer_id
    assert f.input == "one" and f.previous_response_id == "resp_1"


def test_successor_that_cannot_start_returns_the_input() -> None:
    sess = s()
    run = running(sess)
    acc, _ = sess.receive(steer("resp_1", "one"), 2)
    [succ] = sess.lane_done("s", Ended("resp_1", "incomplete"), run)
    [f] = sess.lane_done("s", Ended(), succ)
    assert f.code == "successor_creation_failed" and f.steer_id == acc.steer_id and f.input == "one"
    assert sess.in_flight == 0 and sess.queued == 0


def test_steer_failure_codes() -> None:
    sess = s(max_pending_steers=2)
    [f] = sess.receive(steer("resp_x"), 1)
    assert f.code == "response_not_found" and f.stream_id is None and f.steer_id is None and f.input == "more"
    run = running(sess)
    sess.receive(steer("resp_1"), 2)
    sess.receive(steer("resp_1"), 2)
    [f] = sess.receive(steer("resp_1", "third"), 2)
    assert f.code == "too_many_pending_steers" and f.stream_id == "s" and f.input == "third" and f.response_id == "resp_1"
    sess.ending("s", "incomplete")
    [f] = sess.receive(steer("resp_1"), 2)
    assert f.code == "response_not_active"
    [succ] = sess.lane_done("s", Ended("resp_1", "incomplete"), run)
    [f] = sess.receive(steer("resp_1"), 3)
    assert f.code == "response_not_active" and f.stream_id == "s"  # it ended steered, not completed
    sess.started("s", "resp_2", succ.request)
    sess.ending("s", "completed")
    [f] = sess.receive(steer("resp_2"), 3)
    assert f.code == "response_already_completed"  # its terminal event was sent
    sess.lane_done("s", Ended("resp_2", "completed"), succ)
    [f] = sess.receive(steer("resp_2"), 3)
    assert f.code == "response_already_completed"
    running(sess, "w", "resp_w", generate=False)
    [f] = sess.receive(steer("resp_w"), 4)
    assert f.code == "steering_not_supported"


@pytest.mark.parametrize(
    "frame",
    [
        {"previous_response_id": "resp_1", "input": "x", "stream_id": "s"},
        {"previous_response_id": "resp_1", "input": "x", "model": "m"},
        {"input": "x"},
        {"previous_response_id": 3, "input": "x"},
        {"previous_response_id": "resp_1"},
        {"previous_response_id": "resp_1", "input": ""},
        {"previous_response_id": "resp_1", "input": []},
        {"previous_response_id": "resp_1", "input": ["x"]},
        {"previous_response_id": "resp_1", "input": [{"role": "assistant", "content": "x"}]},
        {"previous_response_id": "resp_1", "input": [{"role": "system", "content": "x"}]},
        {"previous_response_id": "resp_1", "input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]},
        {"previous_response_id": "resp_1", "input": [{"role": "user", "content": "x", "id": "msg_1"}]},
        {"previous_response_id": "resp_1", "input": [{"role": "user", "content": []}]},
        {"previous_response_id": "resp_1", "input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
        {"previous_response_id": "resp_1", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        # parts response.create would refuse: refused before they cut the running response
        {"previous_response_id": "resp_1", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": 5}]}]},
        {"previous_response_id": "resp_1", "input": [{"role": "user", "content": [{"type": "input_file", "file_data": []}]}]},
    ],
)
def test_steer_invalid_input(frame: dict) -> None:
    sess = s()
    run = running(sess)
    [f] = sess.receive(json.dumps({"type": "response.steer", **frame}), 2)
    assert isinstance(f, SteerEvent) and f.kind == "response.steer.failed" and f.code == "invalid_input"
    assert f.steer_id is None and f.input == frame.get("input")
    # nothing was queued: the response ends without a successor, the session stays usable
    assert sess.lane_done("s", Ended("resp_1", "completed"), run) == []
    assert isinstance(sess.receive(create("s"), 3)[0], RunCreate)


def test_a_steer_the_successor_could_not_take_is_refused_before_it_cuts_the_response() -> None:
    """A steer over the turn bounds (--max-turn-input-bytes / -items) was accepted: it cut the
    running response, and its successor then failed to start (the answer lost for nothing)."""
    from hotloop.pipeline import guard

    sess = s(check_steer=lambda items: guard.check(items, 3, 2000))
    run = running(sess)
    [f] = sess.receive(steer("resp_1", "x" * 5000), 2)
    assert isinstance(f, SteerEvent) and f.kind == "response.steer.failed" and f.code == "input_too_large"
    assert "2000 bytes" in (f.message or "")
    acc, stop = sess.receive(steer("resp_1", "x" * 900), 2)
    assert acc.kind == "response.steer.accepted" and isinstance(stop, StopResponse)
    # the pending submissions count too: the successor takes them all
    [f] = sess.receive(steer("resp_1", "y" * 1200), 2)
    assert f.kind == "response.steer.failed" and f.code == "input_too_large"
    assert sess.receive(steer("resp_1", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]), 2)[0].kind == (
        "response.steer.accepted"
    )
    [f] = sess.receive(steer("resp_1", "z"), 2)  # a fourth item
    assert f.kind == "response.steer.failed" and f.code == "input_too_large"
    sess.ending("s", "incomplete")
    [succ] = sess.lane_done("s", Ended("resp_1", "incomplete"), run)
    assert isinstance(succ, RunCreate) and len(succ.request.input) == 3  # type: ignore[arg-type]


def test_steer_accepts_images_and_files() -> None:
    sess = s()
    running(sess)
    content = [
        {"type": "input_text", "text": "look"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
        {"type": "input_file", "file_data": "data:text/plain;base64,AAAA", "filename": "a.txt"},
    ]
    acc, _ = sess.receive(steer("resp_1", [{"type": "message", "role": "user", "content": content}]), 2)
    assert acc.kind == "response.steer.accepted"


def test_steer_event_frames() -> None:
    acc = SteerEvent("response.steer.accepted", "resp_1", "s", "resp_1", "steer_1")
    assert json.loads(acc.frame(7)[1]) == {
        "type": "response.steer.accepted", "sequence_number": 7,
        "steer": {"id": "steer_1", "previous_response_id": "resp_1"},
    }
    stubs = [{"type": "function_call_output", "call_id": "c", "name": "f"}]
    pen = SteerEvent("response.steer.pending", "resp_1", None, "resp_1", "steer_1", required_input=stubs)
    assert json.loads(pen.frame(9)[1]) == {
        "type": "response.steer.pending", "sequence_number": 9,
        "steer": {"id": "steer_1", "previous_response_id": "resp_1"},
        "reason": "waiting_for_required_input", "required_input": stubs,
    }
    fail = SteerEvent("response.steer.failed", "resp_1", input=["x"], code="invalid_input", message="no")
    assert json.loads(fail.frame(0)[1]) == {
        "type": "response.steer.failed", "sequence_number": 0,
        "error": {"type": "invalid_request_error", "code": "invalid_input", "message": "no"},
        "steer": {"input": ["x"], "previous_response_id": "resp_1"},
    }
