"""Hypothesis: requests round-trip, turns keep their invariants, SSE survives any chunking."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotloop import _accel
from hotloop.protocol import events as ev
from hotloop.protocol.chunks import Finish, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from hotloop.protocol.objects import IdGen, response_object
from hotloop.protocol.request import decode_body, item_to_dict, validate
from hotloop.protocol.turn import Turn

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

text = st.text(st.characters(codec="utf-8"), max_size=30)
ident = st.from_regex(r"[A-Za-z0-9_]{1,12}", fullmatch=True)

text_part = st.builds(lambda t: {"type": "input_text", "text": t}, text)
out_part = st.builds(lambda t: {"type": "output_text", "text": t, "annotations": [], "logprobs": []}, text)
image_part = st.builds(lambda u, d: {"type": "input_image", "image_url": u, "detail": d}, text, st.sampled_from(["auto", "low", "high"]))

message = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["user", "system", "developer"]), text),
    st.builds(lambda c: {"type": "message", "role": "user", "content": c}, st.lists(st.one_of(text_part, image_part), max_size=3)),
    st.builds(lambda c, i: {"type": "message", "role": "assistant", "id": "msg_" + i, "status": "completed", "content": c},
              st.lists(out_part, min_size=1, max_size=2), ident),
)
call = st.builds(lambda c, n, a: {"type": "function_call", "call_id": "call_" + c, "name": n, "arguments": a}, ident, ident, text)
reasoning = st.builds(lambda s: {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": s}]}, text)
other = st.builds(lambda n, v: {"type": "custom_tool_call", "call_id": "c_" + n, "name": n, "input": v}, ident, text)


@st.composite
def requests(draw: Any) -> dict[str, Any]:
    items = draw(st.lists(st.one_of(message, call, reasoning, other), max_size=6))
    # outputs only for calls that exist earlier, as validation requires
    calls = [i["call_id"] for i in items if i.get("type") == "function_call"]
    if calls and draw(st.booleans()):
        items.append({"type": "function_call_output", "call_id": draw(st.sampled_from(calls)), "output": draw(text)})
    body: dict[str, Any] = {"model": draw(ident), "input": items if items else draw(text)}
    if draw(st.booleans()):
        body["temperature"] = draw(st.floats(0, 2))
    if draw(st.booleans()):
        body["metadata"] = draw(st.dictionaries(ident, text, max_size=4))
    if draw(st.booleans()):
        body["tools"] = [{"type": "function", "name": draw(ident), "parameters": {"type": "object", "properties": {}}}]
    if draw(st.booleans()):
        body["instructions"] = draw(text)
    return body


@SETTINGS
@given(requests())
def test_request_items_round_trip(body: dict[str, Any]) -> None:
    p = validate(decode_body(json.dumps(body)))
    again = {**body, "input": [item_to_dict(i) for i in p.items]}
    p2 = validate(decode_body(msgspec.json.encode(again)))
    assert p2.items == p.items
    assert p2.req == msgspec.structs.replace(p.req, input=again["input"])


chunk = st.one_of(
    st.builds(TextDelta, text),
    st.builds(ReasoningDelta, text),
    st.builds(lambda a: ("call", a), text),
)


def _chunks(spec: list[Any]) -> list[Any]:
    """Turn the drawn spec into a legal chunk stream (new call indices only move forward)."""
    out: list[Any] = []
    index = -1
    last = None
    for c in spec:
        if isinstance(c, tuple):
            if last != "call":
                index += 1
                out.append(ToolCallDelta(index, call_id=f"call_{index}", name="f", arguments=c[1]))
            else:
                out.append(ToolCallDelta(index, arguments=c[1]))
            last = "call"
        else:
            out.append(c)
            last = type(c)
    return out


@SETTINGS
@given(st.lists(chunk, max_size=25), st.sampled_from(["stop", "length", "tool_calls"]), st.data())
def test_turn_invariants_and_sse_chunking(spec: list[Any], reason: str, data: st.DataObject) -> None:
    p = validate(decode_body(b'{"model":"m","input":"x"}'))
    ids = IdGen(deterministic=True)
    turn = Turn(response_object(p, ids.new("resp"), 1), ids=ids, clock=lambda: 2.0)
    frames = turn.start()
    for c in _chunks(spec):
        frames += turn.feed(c)
    frames += turn.feed(Usage(output_tokens=len(spec)))
    frames += turn.feed(Finish(reason))
    events = [json.loads(payload) for _, payload in frames]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    # streamed deltas add up to the final items
    for idx, item in enumerate(final["output"]):
        deltas = "".join(e["delta"] for e in events if e.get("output_index") == idx and e["type"].endswith(".delta"))
        if item["type"] == "function_call":
            assert deltas == item["arguments"]
        else:
            assert deltas == item["content"][0]["text"]
    # SSE bytes split at arbitrary points decode to the same events
    stream = b"".join(ev.sse(f) for f in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    decoder = _accel.SseDecoder()
    got = []
    prev = 0
    for cut in cuts + [len(stream)]:
        got += decoder.feed(stream[prev:cut])
        prev = cut
    assert [(t, json.loads(d)) for t, d in got] == [(e["type"], e) for e in events]
