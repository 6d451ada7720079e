"""Reasoning streamed as a summary when the request asks for one (``reasoning.summary``), sans-I/O.

hotloop has no summarizer: with ``reasoning.summary`` set ("auto", "concise", "detailed") the
model's reasoning is streamed verbatim as the reasoning item's one ``summary_text`` part (the
events OpenAI sends for summaries, which the AI SDK, Codex, Goose and Zed read); without it the
raw ``reasoning_text`` content part, as before. A reasoning item sent back with only its summary
reaches a chat backend that takes reasoning history as that history.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from hotloop.backends.base import BackendRequest
from hotloop.backends.chat import CEREBRAS, OPENAI_COMPAT, render
from hotloop.bench.loop import StreamCheck
from hotloop.protocol import events as ev
from hotloop.protocol.chunks import Failure, Finish, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from hotloop.protocol.objects import IdGen, response_object, wants_summary
from hotloop.protocol.request import decode_body, decode_items, validate
from hotloop.protocol.turn import Turn

THOUGHTS = ["Let", " me", " think", "."]


def prepared(reasoning: dict[str, Any] | None) -> Any:
    body: dict[str, Any] = {"model": "m", "input": "hi"}
    if reasoning is not None:
        body["reasoning"] = reasoning
    return validate(decode_body(json.dumps(body)))


def make_turn(summary: bool, quiet: bool = False, transport: str = "sse") -> Turn:
    p = prepared({"summary": "auto"} if summary else None)
    ids = IdGen(deterministic=True)
    return Turn(response_object(p, ids.new("resp"), 1000), ids=ids, clock=lambda: 1001.0, quiet=quiet,
                transport=transport, reasoning_summary=summary)


def run(turn: Turn, chunks: list[Any]) -> list[dict[str, Any]]:
    frames = turn.start()
    for c in chunks:
        frames += turn.feed(c)
    if turn._ev is ev:  # (a quiet turn's frames are placeholders)
        events = [json.loads(p) for _, p in frames]
        for (t, _), e in zip(frames, events):
            assert e["type"] == t
        return events
    return []


def reasoning_then_text(*extra: Any) -> list[Any]:
    return [*(ReasoningDelta(t) for t in THOUGHTS), TextDelta("Hi"), TextDelta("!"), *extra,
            Usage(output_tokens=6, reasoning_tokens=4), Finish()]


def check(events: list[dict[str, Any]]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    for e in events:
        if e["type"] == ev.OUTPUT_ITEM_DONE:
            assert final["output"][e["output_index"]] == e["item"]
    sc = StreamCheck()
    for e in events:
        sc.feed(e)
    assert sc.finish() == []


# -- which requests ask for a summary ----------------------------------------------------------


@pytest.mark.parametrize(
    "reasoning, wanted",
    [
        (None, False),
        ({}, False),
        ({"effort": "high"}, False),
        ({"summary": None}, False),
        ({"summary": "auto"}, True),
        ({"summary": "concise"}, True),
        ({"effort": "low", "summary": "detailed"}, True),
        ({"generate_summary": "auto"}, True),  # the deprecated spelling
    ],
)
def test_wants_summary(reasoning: dict[str, Any] | None, wanted: bool) -> None:
    assert wants_summary(prepared(reasoning)) is wanted


# -- the turn's events -------------------------------------------------------------------------


def test_summary_mode_streams_the_reasoning_as_its_summary() -> None:
    events = run(make_turn(True), reasoning_then_text())
    check(events)
    types = [e["type"] for e in events]
    assert types == [
        ev.CREATED, ev.IN_PROGRESS,
        ev.OUTPUT_ITEM_ADDED,
        "response.reasoning_summary_part.added",
        *["response.reasoning_summary_text.delta"] * 4,
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        ev.OUTPUT_ITEM_DONE,
        ev.OUTPUT_ITEM_ADDED, ev.CONTENT_PART_ADDED, ev.OUTPUT_TEXT_DELTA, ev.OUTPUT_TEXT_DELTA,
        ev.OUTPUT_TEXT_DONE, ev.CONTENT_PART_DONE, ev.OUTPUT_ITEM_DONE,
        ev.COMPLETED,
    ]  # fmt: skip
    assert "reasoning_text" not in json.dumps(events)
    rid = "rs_0002"
    ids = {"item_id": rid, "output_index": 0, "summary_index": 0}
    text = "".join(THOUGHTS)
    assert events[2] == {"type": ev.OUTPUT_ITEM_ADDED, "sequence_number": 2, "output_index": 0,
                         "item": {"id": rid, "type": "reasoning", "summary": []}}  # fmt: skip
    assert events[3] == {"type": "response.reasoning_summary_part.added", "sequence_number": 3, **ids,
                         "part": {"type": "summary_text", "text": ""}}  # fmt: skip
    deltas = events[4:8]
    assert deltas == [{"type": "response.reasoning_summary_text.delta", "sequence_number": 4 + i, **ids, "delta": t}
                      for i, t in enumerate(THOUGHTS)]  # fmt: skip
    # the delta's keys in the order OpenAI sends them
    assert list(deltas[0]) == ["type", "sequence_number", "item_id", "output_index", "summary_index", "delta"]
    assert events[8] == {"type": "response.reasoning_summary_text.done", "sequence_number": 8, **ids, "text": text}
    part = {"type": "summary_text", "text": text}
    assert events[9] == {"type": "response.reasoning_summary_part.done", "sequence_number": 9, **ids, "part": part}
    item = {"id": rid, "type": "reasoning", "summary": [part]}
    assert events[10] == {"type": ev.OUTPUT_ITEM_DONE, "sequence_number": 10, "output_index": 0, "item": item}
    final = events[-1]["response"]
    assert final["output"][0] == item  # no raw content: the summary is the reasoning
    assert final["output"][1]["content"][0]["text"] == "Hi!"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
    assert final["reasoning"] == {"effort": None, "summary": "auto"}


def test_raw_mode_is_unchanged() -> None:
    events = run(make_turn(False), reasoning_then_text())
    check(events)
    types = [e["type"] for e in events]
    assert types[2:10] == [ev.OUTPUT_ITEM_ADDED, ev.CONTENT_PART_ADDED, *[ev.REASONING_TEXT_DELTA] * 4,
                           ev.REASONING_TEXT_DONE, ev.CONTENT_PART_DONE]  # fmt: skip
    assert "summary_text" not in json.dumps(events)
    assert events[4]["content_index"] == 0 and "summary_index" not in events[4]
    assert events[-1]["response"]["output"][0] == {
        "id": "rs_0002", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Let me think."}]
    }  # fmt: skip


def test_quiet_turn_builds_the_same_response() -> None:
    """A JSON (non-streaming) answer holds what the stream's terminal event holds, and the
    events are numbered the same (the metrics count them)."""
    streamed = make_turn(True)
    events = run(streamed, reasoning_then_text())
    quiet = make_turn(True, quiet=True)
    run(quiet, reasoning_then_text())
    assert quiet.response == streamed.response == events[-1]["response"]
    assert quiet.events == streamed.events == len(events)


@pytest.mark.parametrize("transport", ["sse", "ws"])
def test_summary_closed_on_a_failure_and_a_token_limit(transport: str) -> None:
    failed = run(make_turn(True, transport=transport), [ReasoningDelta("hm"), Failure(code="server_error", message="x")])
    check(failed)
    types = [e["type"] for e in failed]
    assert types[-4:] == ["response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
                          ev.OUTPUT_ITEM_DONE, ev.FAILED]  # fmt: skip
    assert failed[-1]["response"]["output"] == [{"id": "rs_0002", "type": "reasoning",
                                                  "summary": [{"type": "summary_text", "text": "hm"}]}]  # fmt: skip
    cut = run(make_turn(True, transport=transport), [ReasoningDelta("a"), ReasoningDelta("b"), Finish("length")])
    check(cut)
    assert cut[-1]["type"] == ev.INCOMPLETE
    assert cut[-1]["response"]["output"][0]["summary"] == [{"type": "summary_text", "text": "ab"}]


def test_reasoning_before_a_call_and_a_second_reasoning_item() -> None:
    chunks = [ReasoningDelta("plan"), ToolCallDelta(index=0, call_id="c1", name="f"), ToolCallDelta(index=0, arguments="{}"),
              ReasoningDelta("again"), TextDelta("ok"), Finish()]  # fmt: skip
    events = run(make_turn(True), chunks)
    check(events)
    out = events[-1]["response"]["output"]
    assert [o["type"] for o in out] == ["reasoning", "function_call", "reasoning", "message"]
    assert [o["summary"] for o in out if o["type"] == "reasoning"] == [
        [{"type": "summary_text", "text": "plan"}], [{"type": "summary_text", "text": "again"}]
    ]
    summary_events = [e for e in events if e["type"].startswith("response.reasoning_summary")]
    assert {(e["output_index"], e["summary_index"]) for e in summary_events} == {(0, 0), (2, 0)}


def test_summary_mode_has_a_summary_lane_for_reasoning() -> None:
    """A summary's deltas have a lane too, one that writes ``summary_index`` (tests/unit/test_turn.py
    reads through it)."""
    raw = make_turn(False)
    raw.start()
    raw.feed(ReasoningDelta("x"))
    lane = raw.lane()
    assert lane is not None and not lane.summary and lane.event_type == ev.REASONING_TEXT_DELTA
    summ = make_turn(True)
    summ.start()
    summ.feed(ReasoningDelta("x"))
    lane = summ.lane()
    assert lane is not None and lane.summary and lane.event_type == ev.REASONING_SUMMARY_TEXT_DELTA
    assert lane.content_index == 0 and lane.parts == ["x"]
    summ.feed(TextDelta("y"))  # the message after it has its lane as before
    lane = summ.lane()
    assert lane is not None and not lane.summary and lane.event_type == ev.OUTPUT_TEXT_DELTA


def test_summary_deltas_may_be_held_back_as_deltas() -> None:
    turn = make_turn(True)
    turn.start()
    turn.feed(ReasoningDelta("x"))
    batch = turn.feed(ReasoningDelta("y"))
    assert [t for t, _ in batch] == ["response.reasoning_summary_text.delta"]
    assert ev.only_deltas(batch)


def test_the_stream_checker_sees_a_summary_delta_outside_its_part() -> None:
    events = run(make_turn(True), reasoning_then_text())
    bad = [e for e in events if e["type"] != "response.reasoning_summary_part.added"]
    for i, e in enumerate(bad):
        e["sequence_number"] = i
    sc = StreamCheck()
    for e in bad:
        sc.feed(e)
    assert any("outside an open" in p for p in sc.finish())
    # and a summary whose final text is not what was streamed
    events = run(make_turn(True), reasoning_then_text())
    for e in events:
        if e["type"] == ev.COMPLETED:
            e["response"]["output"][0]["summary"][0]["text"] = "something else"
    sc = StreamCheck()
    for e in events:
        sc.feed(e)
    assert any("summary" in p for p in sc.finish())


# -- reasoning history ---------------------------------------------------------------------------


def backend_request(raw: list[dict[str, Any]]) -> BackendRequest:
    return BackendRequest(model="m", instructions=None, items=decode_items(raw), tools=[], tool_choice="auto",
                          parallel_tool_calls=True)  # fmt: skip


USER = {"type": "message", "role": "user", "content": "q"}
ANSWER = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}


def test_a_summary_only_reasoning_item_is_reasoning_history() -> None:
    """What Codex sends back (and a client that keeps the summary text), and what a stored or
    chained item holds: the item with its summary only."""
    item = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Let me think."}]}
    msgs = render(backend_request([USER, item, ANSWER, {**USER, "content": "next"}]), CEREBRAS)["messages"]
    assert msgs[1] == {"role": "assistant", "content": "a", "reasoning": "Let me think."}
    # an explicit null encrypted_content is the same
    msgs2 = render(backend_request([USER, {**item, "encrypted_content": None}, ANSWER]), CEREBRAS)["messages"]
    assert msgs2[1]["reasoning"] == "Let me think."
    # a dialect without reasoning history still sends none
    oc = render(backend_request([USER, item, ANSWER]), OPENAI_COMPAT)["messages"]
    assert all("reasoning" not in m for m in oc)


def test_raw_content_wins_over_the_summary_and_parts_join() -> None:
    both = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}],
            "content": [{"type": "reasoning_text", "text": "raw"}]}  # fmt: skip
    assert render(backend_request([USER, both, ANSWER]), CEREBRAS)["messages"][1]["reasoning"] == "raw"
    empty_content = {**both, "content": []}
    assert render(backend_request([USER, empty_content, ANSWER]), CEREBRAS)["messages"][1]["reasoning"] == "S"
    parts = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "**One**"}, {"type": "summary_text", "text": "**Two**"}]}
    assert render(backend_request([USER, parts, ANSWER]), CEREBRAS)["messages"][1]["reasoning"] == "**One**\n**Two**"
    nothing = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}
    assert "reasoning" not in render(backend_request([USER, nothing, ANSWER]), CEREBRAS)["messages"][1]
