"""Refusals (chat ``delta.refusal``) -> the Responses ``refusal`` content part, sans-I/O: the
chunk assembler, the turn machine (streamed and quiet), the lanes of the push path, rendering a
refusal back to a chat backend, and the native/pure ``plain_delta`` twins on refusal shapes."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from hotloop import _accel
from hotloop.backends.base import BackendRequest
from hotloop.backends.chat import CEREBRAS, OPENAI_COMPAT, ChatChunk, ChunkAssembler, render
from hotloop.protocol import chunks as ck
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import decode_body, decode_items, validate
from hotloop.protocol.turn import Turn

REFUSAL = "I can't help with that."


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> ChatChunk:
    obj = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    return msgspec.json.decode(json.dumps(obj), type=ChatChunk)


def assemble(chunks: list[ChatChunk]) -> list[Any]:
    a = ChunkAssembler()
    out: list[Any] = []
    for c in chunks:
        out += a.feed(c)
    return out + a.end()


def make_turn(quiet: bool = False) -> Turn:
    p = validate(decode_body(json.dumps({"model": "m", "input": "hi"})))
    ids = IdGen(deterministic=True)
    return Turn(response_object(p, ids.new("resp"), 1000), ids=ids, clock=lambda: 1001.0, quiet=quiet)


def run(chunks: list[Any], quiet: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    turn = make_turn(quiet)
    frames = turn.start()
    for c in chunks:
        frames += turn.feed(c)
    assert turn.done
    events = [] if quiet else [json.loads(p) for _, p in frames]
    for (t, _), e in zip(frames, events):
        assert e["type"] == t
    return events, turn.response


def refusal_chunks(*pieces: str) -> list[ChatChunk]:
    return [chunk({"role": "assistant", "content": "", "refusal": None}),
            *(chunk({"content": None, "refusal": p}) for p in pieces), chunk({}, "stop")]


# -- the assembler -----------------------------------------------------------------------------


def test_assembler_gives_refusal_deltas_not_text() -> None:
    out = assemble(refusal_chunks("I can't", " help with that."))
    kinds = [type(c).__name__ for c in out]
    assert kinds == ["RefusalDelta", "RefusalDelta", "Finish"]
    assert [getattr(c, "text", None) for c in out[:2]] == ["I can't", " help with that."]


def test_assembler_refusal_has_no_plain_lane() -> None:
    a = ChunkAssembler()
    a.feed(chunk({"content": "Hm. "}))
    assert a.lane() == (_accel.PLAIN_TEXT, 0, 0, None)
    a.feed(chunk({"refusal": "No."}))
    assert a.lane() is None  # refusal deltas always take the general path
    a.feed(chunk({"content": "ok"}))
    assert a.lane() == (_accel.PLAIN_TEXT, 0, 0, None)


def test_assembler_defers_a_refusal_behind_an_unfinished_call_and_keeps_its_kind() -> None:
    out = assemble([
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"a":'}}]}),
        chunk({"refusal": "No."}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        chunk({}, "stop"),
    ])
    kinds = [type(c).__name__ for c in out]
    assert kinds == ["ToolCallDelta", "ToolCallDelta", "RefusalDelta", "Finish"]
    assert out[2].text == "No."


def test_empty_or_null_refusal_is_nothing() -> None:
    assert [type(c).__name__ for c in assemble([chunk({"content": "a", "refusal": ""}), chunk({"refusal": None})])] == [
        "TextDelta", "Finish"]


# -- the turn machine --------------------------------------------------------------------------


@pytest.mark.parametrize("quiet", [False, True])
def test_refusal_only_message(quiet: bool) -> None:
    events, response = run(assemble(refusal_chunks("I can't", " help with that.")), quiet)
    (msg,) = response["output"]
    assert msg == {"id": "msg_0002", "type": "message", "status": "completed",
                   "content": [{"type": "refusal", "refusal": REFUSAL}], "role": "assistant"}
    assert response["status"] == "completed"
    if quiet:
        return
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.refusal.delta", "response.refusal.delta", "response.refusal.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]
    assert events[3]["part"] == {"type": "refusal", "refusal": ""}
    assert events[4] == {"type": "response.refusal.delta", "sequence_number": 4, "item_id": "msg_0002",
                         "output_index": 0, "content_index": 0, "delta": "I can't"}
    assert events[6] == {"type": "response.refusal.done", "sequence_number": 6, "item_id": "msg_0002",
                         "output_index": 0, "content_index": 0, "refusal": REFUSAL}
    assert events[7]["part"] == {"type": "refusal", "refusal": REFUSAL}
    assert events[8]["item"] == msg


def test_text_refusal_text_parts_of_one_message_and_lanes() -> None:
    turn = make_turn()
    frames = turn.start()
    frames += turn.feed(ck.TextDelta("Sure"))
    lane = turn.lane()
    assert lane is not None and lane.kind == _accel.PLAIN_TEXT and lane.content_index == 0
    frames += turn.feed(ck.RefusalDelta("No"))
    assert turn.lane() is None  # a refusal part has no lane: its deltas take the general path
    frames += turn.feed(ck.TextDelta("ok"))
    lane = turn.lane()
    assert lane is not None and lane.kind == _accel.PLAIN_TEXT and lane.content_index == 2 and lane.parts == ["ok"]
    frames += turn.feed(ck.ReasoningDelta("hm"))  # another item
    frames += turn.finish()
    events = [json.loads(p) for _, p in frames]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    msg = turn.response["output"][0]
    assert msg["content"] == [
        {"type": "output_text", "annotations": [], "logprobs": [], "text": "Sure"},
        {"type": "refusal", "refusal": "No"},
        {"type": "output_text", "annotations": [], "logprobs": [], "text": "ok"},
    ]
    cis = [(e["type"], e.get("content_index")) for e in events if e.get("item_id") == msg["id"]]
    assert cis == [
        ("response.content_part.added", 0), ("response.output_text.delta", 0), ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.content_part.added", 1), ("response.refusal.delta", 1), ("response.refusal.done", 1),
        ("response.content_part.done", 1),
        ("response.content_part.added", 2), ("response.output_text.delta", 2), ("response.output_text.done", 2),
        ("response.content_part.done", 2),
    ]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done[0] == msg and [o["type"] for o in turn.response["output"]] == ["message", "reasoning"]


def test_refusal_cut_short_is_incomplete_and_failed_keeps_the_part() -> None:
    events, response = run([ck.RefusalDelta("No"), ck.Finish("length")])
    assert response["status"] == "incomplete"
    assert response["output"][0]["status"] == "incomplete"
    assert response["output"][0]["content"] == [{"type": "refusal", "refusal": "No"}]
    turn = make_turn()
    turn.start()
    turn.feed(ck.RefusalDelta("No"))
    from hotloop import errors

    frames = turn.fail(errors.BackendError("gone"))
    types = [t for t, _ in frames]
    assert types[:3] == ["response.refusal.done", "response.content_part.done", "response.output_item.done"]
    assert turn.response["output"][0]["content"] == [{"type": "refusal", "refusal": "No"}]


def test_refusal_delta_is_a_delta_for_flushing() -> None:
    from hotloop.protocol import events as ev

    assert ev.REFUSAL_DELTA == "response.refusal.delta" and ev.REFUSAL_DONE == "response.refusal.done"
    assert ev.only_deltas([ev.refusal_delta(0, "msg_1", 0, 0, "x")])


# -- rendering a refusal back to the backend ---------------------------------------------------


@pytest.mark.parametrize("dialect", [CEREBRAS, OPENAI_COMPAT], ids=lambda d: d.name)
def test_a_refusal_in_the_history_renders_as_the_assistants_content(dialect: Any) -> None:
    raw = [
        {"role": "user", "content": "lock?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "refusal", "refusal": REFUSAL}]},
        {"role": "user", "content": "why?"},
    ]
    req = BackendRequest(model="m", instructions=None, items=decode_items(raw), tools=[], tool_choice="auto",
                         parallel_tool_calls=True)
    assert render(req, dialect)["messages"] == [
        {"role": "user", "content": "lock?"},
        {"role": "assistant", "content": REFUSAL},
        {"role": "user", "content": "why?"},
    ]


# -- the native fast path and its pure twin ----------------------------------------------------

IMPLS = _accel.implementations()
REFUSAL_CASES = [
    '{"choices":[{"index":0,"delta":{"content":null,"refusal":"I can"},"finish_reason":null}]}',
    '{"choices":[{"delta":{"role":"assistant","content":"","refusal":null}}]}',
    '{"choices":[{"delta":{"content":"a","refusal":""}}]}',
    '{"choices":[{"delta":{"refusal":""}}]}',
    '{"choices":[{"delta":{"refusal":5}}]}',
    '{"choices":[{"delta":{"reasoning":"r","refusal":"x"}}]}',
    '{"choices":[{"delta":{"refusal":"x","refusal":"y"}}]}',
    '{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"x"}}],"refusal":"x"}}]}',
]


@pytest.mark.parametrize("data", REFUSAL_CASES)
def test_plain_delta_twins_agree_on_refusals(data: str) -> None:
    native, pure = IMPLS["native"]["plain_delta"], IMPLS["pure"]["plain_delta"]
    got = [pure(data), native(data)]
    assert got[0] == got[1]
    refusal = json.loads(data)["choices"][0]["delta"].get("refusal")
    if isinstance(refusal, str) and refusal:
        assert got[0] is None  # a refusal piece is never a plain delta: the general path reads it


def test_feed_lane_stops_at_a_refusal() -> None:
    events = ['{"choices":[{"delta":{"content":"a"}}]}', '{"choices":[{"delta":{"refusal":"no"}}]}',
              '{"choices":[{"delta":{"content":"b"}}]}']
    stream = "".join(f"data: {e}\n\n" for e in events).encode()
    for impl in IMPLS.values():
        lane = impl["DeltaLane"](_accel.PLAIN_TEXT, 0, "response.output_text.delta", "msg_1", 0, 0, True, [])
        frames, rest = impl["SseDecoder"]().feed_lane(stream, lane, 0, None)
        assert lane.parts == ["a"] and len(frames) == 1
        assert [d for _, d in rest] == events[1:]


def test_an_empty_piece_opens_no_empty_part() -> None:
    _, response = run([ck.RefusalDelta("No"), ck.TextDelta(""), ck.RefusalDelta("pe"), ck.Finish()])
    assert response["output"][0]["content"] == [{"type": "refusal", "refusal": "Nope"}]
