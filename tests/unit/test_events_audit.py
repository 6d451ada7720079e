"""Audit of the turn's events and objects (wire reference §2.4-2.9), sans-I/O."""

from __future__ import annotations

import json

from hotloop.protocol.chunks import Chunk, Finish, TextDelta, ToolCallDelta, Usage
from hotloop.protocol.objects import IdGen, response_object, usage_object
from hotloop.protocol.request import decode_body, validate
from hotloop.protocol.turn import Turn


def _turn() -> Turn:
    p = validate(decode_body(json.dumps({"model": "m", "input": "hi"})))
    ids = IdGen(deterministic=True)
    return Turn(response_object(p, ids.new("resp"), 1000), ids=ids, clock=lambda: 1001.0, input_tokens=5)


def test_usage_object_has_every_field_openai_python_requires() -> None:
    assert usage_object(10, 4, cached_tokens=3, reasoning_tokens=1) == {
        "input_tokens": 10,
        "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": 3},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 1},
        "total_tokens": 14,
    }


def test_a_repeated_call_id_is_replaced_in_the_stream_and_the_response() -> None:
    turn = _turn()
    frames = turn.start()
    chunks: list[Chunk] = [
        TextDelta("Looking."),
        ToolCallDelta(0, '{"q":"a"}', "call_same", "search"),
        ToolCallDelta(1, '{"q":"b"}', "call_same", "search"),
        ToolCallDelta(2, "", None, "search"),
        ToolCallDelta(3, '{"q":"d"}', "call_same", "search"),
        Usage(output_tokens=9),
        Finish("tool_calls"),
    ]
    for c in chunks:
        frames += turn.feed(c)
    events = [json.loads(p) for _, p in frames]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e for e in events if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"]
    done = [e for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    ids = [e["item"]["call_id"] for e in added]
    assert ids[0] == "call_same" and len(set(ids)) == 4 and all(i.startswith("call_") for i in ids)
    assert [e["item"]["call_id"] for e in done] == ids
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [o["call_id"] for o in final["output"] if o["type"] == "function_call"] == ids
    assert [e["output_index"] for e in added] == [1, 2, 3, 4]
    assert [o["arguments"] for o in final["output"][1:]] == ['{"q":"a"}', '{"q":"b"}', "{}", '{"q":"d"}']
