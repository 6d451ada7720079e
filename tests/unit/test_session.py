"""The WebSocket session machine, fed frames directly (sans-I/O)."""

from __future__ import annotations

import json

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


def test_expire_says_why_then_closes_once() -> None:
    s = Session(opened_at=0.0, max_age=60.0)
    actions = s.expire()
    assert [type(a) for a in actions] == [SendError, Close]
    assert actions[0].error.code == "websocket_connection_limit_reached"  # type: ignore[union-attr]
    assert actions[1].code == 1001  # type: ignore[union-attr]
    assert s.expire() == []  # decided once
    assert s.receive('{"type": "response.create", "model": "m", "input": "x"}', 1.0) == []
