"""The turn state machine, fed chunks directly (sans-I/O)."""

from __future__ import annotations

import json

import pytest

from hotloop import errors
from hotloop.protocol.chunks import Failure, Finish, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import decode_body, validate
from hotloop.protocol.turn import Turn, TurnStateError


def make_turn(body: dict | None = None, transport: str = "sse", **kw) -> Turn:
    body = body or {"model": "m", "input": "hi"}
    p = validate(decode_body(json.dumps(body)))
    ids = IdGen(deterministic=True)
    return Turn(response_object(p, ids.new("resp"), 1000), ids=ids, transport=transport, clock=lambda: 1001.0, **kw)


def run(turn: Turn, chunks) -> list[dict]:
    frames = turn.start()
    for c in chunks:
        frames += turn.feed(c)
    out = [json.loads(p) for _, p in frames]
    for (t, _), obj in zip(frames, out):
        assert obj["type"] == t
    return out


def check_invariants(events: list[dict]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done
    final = events[-1]["response"]
    assert [o["id"] for o in final["output"]] == done
    for e in events:
        if e["type"] == "response.output_item.done":
            assert final["output"][e["output_index"]] == e["item"]


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_text_sequence() -> None:
    ev = run(make_turn(input_tokens=7), [TextDelta("Hel"), TextDelta("lo"), Usage(output_tokens=2), Finish()])
    assert types(ev) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    check_invariants(ev)
    final = ev[-1]["response"]
    assert final["status"] == "completed" and final["completed_at"] == 1001
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 9,
    }
    assert ev[0]["response"]["status"] == "in_progress"
    assert ev[4]["logprobs"] == [] and ev[4]["content_index"] == 0


def test_function_calls_parallel_and_after_text() -> None:
    chunks = [
        TextDelta("Let me check."),
        ToolCallDelta(0, call_id="call_a", name="get_weather"),
        ToolCallDelta(0, arguments='{"city":'),
        ToolCallDelta(0, arguments='"Paris"}'),
        ToolCallDelta(1, call_id="call_b", name="get_time", arguments="{}"),
        Finish("tool_calls"),
    ]
    ev = run(make_turn(), chunks)
    check_invariants(ev)
    t = types(ev)
    assert t.count("response.function_call_arguments.delta") == 3
    done = [e for e in ev if e["type"] == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in done] == ['{"city":"Paris"}', "{}"]
    assert [d["name"] for d in done] == ["get_weather", "get_time"]
    final = ev[-1]["response"]
    assert final["status"] == "completed"
    calls = [o for o in final["output"] if o["type"] == "function_call"]
    assert [(c["call_id"], c["status"], c["output_index"] if "output_index" in c else None) for c in calls] == [
        ("call_a", "completed", None),
        ("call_b", "completed", None),
    ]
    arg_deltas = [e for e in ev if e["type"] == "response.function_call_arguments.delta"]
    assert all("content_index" not in e for e in arg_deltas)
    assert [e["output_index"] for e in arg_deltas] == [1, 1, 2]


def test_a_call_without_arguments_has_the_empty_object() -> None:
    """A backend that sends no arguments (or "") for a no-parameter function: "{}", as OpenAI
    sends, in a delta and in the done events alike (clients parse arguments as JSON)."""
    ev = run(make_turn(), [ToolCallDelta(0, call_id="call_a", name="list_files", arguments=""), Finish("tool_calls")])
    check_invariants(ev)
    deltas = [e["delta"] for e in ev if e["type"] == "response.function_call_arguments.delta"]
    done = [e["arguments"] for e in ev if e["type"] == "response.function_call_arguments.done"]
    assert deltas == ["{}"] and done == ["{}"]
    assert ev[-1]["response"]["output"][0]["arguments"] == "{}"


def test_reasoning_then_answer_counts_reasoning_tokens() -> None:
    ev = run(make_turn(), [ReasoningDelta("think"), TextDelta("ok"), Usage(output_tokens=2, reasoning_tokens=1), Finish()])
    check_invariants(ev)
    assert "response.reasoning_text.delta" in types(ev)
    final = ev[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 1


def test_incomplete_on_length() -> None:
    ev = run(make_turn({"model": "m", "input": "x", "max_output_tokens": 2}), [TextDelta("a"), TextDelta("b"), Finish("length")])
    check_invariants(ev)
    final = ev[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["completed_at"] is None  # "only present when the status is completed"
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_model_failure_is_plain_failed() -> None:
    ev = run(make_turn(), [TextDelta("a"), Failure(code="server_error", message="boom")])
    check_invariants(ev)
    assert "error" not in types(ev)
    assert ev[-1]["type"] == "response.failed"
    assert ev[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}
    assert ev[-1]["response"]["output"][0]["status"] == "incomplete"


def test_backend_error_sse_gets_nested_error_event() -> None:
    turn = make_turn()
    frames = turn.start() + turn.feed(TextDelta("a"))
    frames += turn.fail(errors.RateLimited("slow down", retry_after=1.5))
    ev = [json.loads(p) for _, p in frames]
    assert types(ev)[-2:] == ["error", "response.failed"]
    assert ev[-2]["error"]["code"] == "rate_limit_exceeded"
    assert "sequence_number" in ev[-2]
    check_invariants([e for e in ev])


def test_backend_error_ws_has_no_error_frame() -> None:
    turn = make_turn(transport="ws")
    frames = turn.start() + turn.feed(TextDelta("a")) + turn.fail(errors.BackendError("down"))
    assert [t for t, _ in frames][-1] == "response.failed"
    assert "error" not in [t for t, _ in frames]


def test_max_tool_calls_drops_extra_calls() -> None:
    chunks = [
        ToolCallDelta(0, call_id="c0", name="f", arguments="{}"),
        ToolCallDelta(1, call_id="c1", name="f", arguments="{}"),
        ToolCallDelta(1, arguments=" "),
        Finish("tool_calls"),
    ]
    ev = run(make_turn(max_tool_calls=1), chunks)
    check_invariants(ev)
    assert len(ev[-1]["response"]["output"]) == 1


def test_illegal_calls_raise() -> None:
    turn = make_turn()
    with pytest.raises(TurnStateError):
        turn.feed(TextDelta("x"))
    turn.start()
    turn.feed(Finish())
    with pytest.raises(TurnStateError):
        turn.finish()
    turn2 = make_turn()
    turn2.start()
    turn2.feed(ToolCallDelta(0, call_id="a", name="f"))
    turn2.feed(ToolCallDelta(1, call_id="b", name="f"))
    with pytest.raises(TurnStateError):
        turn2.feed(ToolCallDelta(0, arguments="late"))


def test_steered_finish_and_safe_boundaries() -> None:
    from hotloop.protocol.turn import STEERED

    turn = make_turn()
    assert not turn.steerable  # not started
    events = run(turn, [ReasoningDelta("think"), TextDelta("Hel")])
    assert turn.steerable  # between text deltas
    aside = turn.aside()  # a steering event joins the numbering
    assert aside == len(events)
    events += [json.loads(p) for _, p in turn.finish(STEERED)]
    assert events[-1]["sequence_number"] == aside + 4
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["incomplete_details"] == {"reason": "steered"}
    assert final["output"][1]["status"] == "incomplete" and final["output"][1]["content"][0]["text"] == "Hel"
    assert not turn.steerable  # done

    calls = make_turn({"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]})
    run(calls, [TextDelta("a")])
    assert calls.steerable
    calls.feed(ToolCallDelta(index=0, call_id="c", name="f", arguments='{"x":'))
    assert not calls.steerable  # inside a call's arguments
    calls.feed(TextDelta("after"))
    assert not calls.steerable  # a call was emitted: the response runs to its own end


@pytest.mark.parametrize(
    "chunks",
    [
        [TextDelta("Hel"), TextDelta("lo"), Usage(5, 2), Finish("stop")],
        [ReasoningDelta("think"), TextDelta("ok"), ToolCallDelta(0, call_id="c", name="f", arguments="{}"), Finish("tool_calls")],
        [TextDelta("cut"), Finish("length")],
        [TextDelta("partial"), Failure("server_error", "boom")],
    ],
)
def test_a_quiet_turn_builds_the_same_response_without_encoding_events(chunks) -> None:
    """A non-streaming response's turn (``quiet``) numbers the same events and ends in the same
    Response object, but encodes none of them."""
    loud, quiet = make_turn(), make_turn(quiet=True)
    frames = run(loud, chunks)
    qframes = quiet.start()
    for c in chunks:
        qframes += quiet.feed(c)
    assert quiet.events == loud.events == len(frames) == len(qframes)
    assert {f for f in qframes} == {("", b"")}
    assert quiet.response == loud.response == frames[-1]["response"]


# -- lanes: the open item's plain deltas read without the turn (SseDecoder.feed_lane) ------------


def _lane_read(lane, pieces: list[str]) -> list[tuple[str, bytes]]:
    """What a backend does with a lane: its decoder (the build's, as the turn's lane) reads
    these pieces into the item."""
    from hotloop import _accel

    def chunk(p: str) -> dict:
        if lane.kind == _accel.PLAIN_TEXT:
            return {"choices": [{"index": 0, "delta": {"content": p}}]}
        if lane.kind == _accel.PLAIN_REASONING:
            return {"choices": [{"index": 0, "delta": {"reasoning": p}}]}
        return {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": lane.call, "function": {"arguments": p}}]}}]}

    data = b"".join(b"data: " + json.dumps(chunk(p)).encode() + b"\n\n" for p in pieces)
    frames, rest = _accel.SseDecoder().feed_lane(data, lane, lane.call, None)
    assert rest == [] and len(frames) == len(pieces)
    return frames


def test_a_lane_reads_like_feeding() -> None:
    """Pieces read through the turn's lane, between chunks fed to it, give exactly the events,
    response and usage of feeding every chunk (the lane numbers its events where the turn is)."""
    fed = make_turn(transport="ws")
    want = run(fed, [TextDelta("a"), TextDelta("b"), TextDelta("c"), ToolCallDelta(0, '{"x":', "call_1", "f"),
                     ToolCallDelta(0, "1"), ToolCallDelta(0, "}"), Finish("tool_calls")])
    turn = make_turn(transport="ws")
    frames = turn.start() + turn.feed(TextDelta("a"))
    lane = turn.lane()
    assert lane is not None and lane.seq == turn._seq
    frames += _lane_read(lane, ["b", "c"])
    frames += turn.feed(ToolCallDelta(0, '{"x":', "call_1", "f"))
    lane = turn.lane()
    assert lane is not None and lane.call == 0
    frames += _lane_read(lane, ["1"])
    assert turn.lane() is lane  # handed over again: nothing changed
    frames += _lane_read(lane, ["}"])
    frames += turn.feed(Finish("tool_calls"))
    assert [json.loads(p) for _, p in frames] == want
    assert turn.response == fed.response and turn.events == fed.events


def test_an_aside_moves_the_lane_on() -> None:
    turn = make_turn(transport="ws")
    turn.start()
    turn.feed(TextDelta("a"))
    lane = turn.lane()
    _lane_read(lane, ["b"])
    seq = turn.aside()  # a steering reply between two reads
    assert seq == 6 and lane.seq == 7
    frames = _lane_read(lane, ["c"])
    assert json.loads(frames[0][1])["sequence_number"] == 7
    out = turn.finish("stop")  # directly, as a steered run ends: it takes the lane's reads back too
    events = [json.loads(p) for _, p in out]
    assert events[0]["sequence_number"] == 8 and events[-1]["response"]["output"][0]["content"][0]["text"] == "abc"
    assert events[-1]["response"]["usage"]["output_tokens"] == 3


def test_a_quiet_turn_read_through_its_lanes_builds_the_same_response() -> None:
    """A non-streaming response's run reads plain deltas through lanes too (their events are
    made and dropped): the same numbering and the same Response as feeding every chunk."""
    chunks = [TextDelta("a"), TextDelta("b"), TextDelta("c"), ToolCallDelta(0, '{"x":', "call_1", "f"),
              ToolCallDelta(0, "1"), ToolCallDelta(0, "}"), Usage(5, 6), Finish("tool_calls")]
    fed = make_turn(quiet=True)
    fed.start()
    for c in chunks:
        fed.feed(c)
    turn = make_turn(quiet=True)
    turn.start()
    turn.feed(TextDelta("a"))
    _lane_read(turn.lane(), ["b", "c"])
    turn.feed(ToolCallDelta(0, '{"x":', "call_1", "f"))
    _lane_read(turn.lane(), ["1", "}"])
    turn.feed(Usage(5, 6))
    turn.feed(Finish("tool_calls"))
    assert turn.response == fed.response and turn.events == fed.events
    assert turn.response["output"][0]["content"][0]["text"] == "abc" and turn.response["output"][1]["arguments"] == '{"x":1}'


@pytest.mark.parametrize("summary", [True, False])
@pytest.mark.parametrize("quiet", [False, True])
def test_a_reasoning_item_reads_through_its_lane_like_feeding(summary: bool, quiet: bool) -> None:
    """A reasoning item has a lane in both shapes: as its summary (``reasoning.summary`` asked
    for: ``reasoning_summary_text.delta`` events with a ``summary_index``) and raw. Pieces read
    through it give exactly the bytes, response and usage of feeding every chunk."""
    from hotloop import _accel
    from hotloop.protocol import events as ev

    body = {"model": "m", "input": "hi", **({"reasoning": {"summary": "auto"}} if summary else {})}
    thoughts = ["Let", " me", ' "think"\n', "\u00e9\U0001f600", "\u2028</s>"]
    chunks = [*(ReasoningDelta(t) for t in thoughts), TextDelta("Hi"), TextDelta("!"), Usage(5, 9, None, 5), Finish()]
    fed = make_turn(body, quiet=quiet, reasoning_summary=summary)
    want = fed.start()
    for c in chunks:
        want += fed.feed(c)
    turn = make_turn(body, quiet=quiet, reasoning_summary=summary)
    frames = turn.start() + turn.feed(chunks[0])
    lane = turn.lane()
    assert lane is not None and lane.seq == turn._seq == 5  # created, in_progress, added, part added, a delta
    assert (lane.kind, lane.call, lane.content_index, lane.logprobs, lane.summary) == (_accel.PLAIN_REASONING, 0, 0,
                                                                                       False, summary)
    assert lane.event_type == (ev.REASONING_SUMMARY_TEXT_DELTA if summary else ev.REASONING_TEXT_DELTA)
    assert lane.item_id == turn.response["output"][0]["id"] and lane.output_index == 0
    assert lane.parts == thoughts[:1]
    frames += _lane_read(lane, thoughts[1:3])
    assert turn.lane() is lane  # handed over again: nothing changed
    frames += _lane_read(lane, thoughts[3:])
    frames += turn.feed(chunks[-4])
    frames += _lane_read(turn.lane(), ["!"])
    frames += turn.feed(chunks[-2]) + turn.feed(chunks[-1])
    assert turn.response == fed.response and turn.events == fed.events == len(frames)
    if not quiet:
        assert frames == want  # the same types and bytes
        final = json.loads(frames[-1][1])["response"]["output"][0]
        assert final[("summary" if summary else "content")] == [
            {"type": "summary_text" if summary else "reasoning_text", "text": "".join(thoughts)}]
        assert sum(t == lane.event_type for t, _ in frames) == len(thoughts)


def test_no_lane_without_an_open_item() -> None:
    turn = make_turn()
    assert turn.lane() is None
    turn.start()
    assert turn.lane() is None
    turn.feed(Usage(output_tokens=1))
    assert turn.lane() is None


@pytest.mark.parametrize("lane", [False, True])
def test_reasoning_tokens_without_a_backend_count_are_the_reasoning_deltas(lane: bool) -> None:
    """A response cut short while it reasoned (no usage chunk came) was recorded with
    ``reasoning_tokens: 0`` while its reasoning deltas counted as output; read through the
    item's lane or fed, each reasoning delta counts as a reasoning token."""
    from hotloop.protocol.chunks import ReasoningDelta as R

    turn = make_turn()
    frames = turn.start() + turn.feed(R("a"))
    if lane:
        frames += _lane_read(turn.lane(), ["b", "c"])
    else:
        frames += turn.feed(R("b")) + turn.feed(R("c"))
    frames += turn.fail(errors.BackendError("The model backend closed the connection mid-stream."))
    usage = json.loads(frames[-1][1])["response"]["usage"]
    assert usage["output_tokens"] == 3 and usage["output_tokens_details"]["reasoning_tokens"] == 3


def test_a_backends_reasoning_count_is_never_above_its_output_count() -> None:
    ev = run(make_turn(), [ReasoningDelta("think"), TextDelta("ok"), Usage(output_tokens=3, reasoning_tokens=40), Finish()])
    usage = ev[-1]["response"]["usage"]
    assert usage["output_tokens"] == 3 and usage["output_tokens_details"]["reasoning_tokens"] == 3
