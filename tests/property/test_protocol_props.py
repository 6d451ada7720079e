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


# -- plain deltas: the assembler's and the turn's shortcut for chunks that continue the open item --

_piece = st.sampled_from(["", "a", "{", '"x"', "}", " 1", "ß"])
_continuing = st.one_of(  # the usual shapes: one more piece of text or of a call's arguments
    st.builds(lambda t: {"content": t}, _piece),
    st.builds(lambda i, t: {"tool_calls": [{"index": i, "function": {"arguments": t}}]}, st.integers(0, 1), _piece),
)
_chat_delta = st.one_of(
    _continuing, _continuing, _continuing,
    st.builds(lambda t: {"reasoning": t}, _piece),
    st.builds(lambda t: {"reasoning": "", "reasoning_content": t}, _piece),
    st.builds(lambda t, r: {"content": t, "reasoning": r}, _piece, _piece),
    st.builds(lambda t: {"refusal": t}, _piece),
    st.builds(
        lambda i, cid, name, args: {"tool_calls": [{k: v for k, v in (("index", i), ("id", cid)) if v is not None}
                                                   | {"function": {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}}]},
        st.one_of(st.none(), st.integers(0, 2)), st.sampled_from([None, "", "call_1", "call_2"]),
        st.sampled_from([None, "f", "g"]), st.one_of(st.none(), _piece),
    ),
    st.just({"tool_calls": []}),
    st.just({}),
)
_delta_chunk = st.builds(lambda d, f: {"choices": [{"index": 0, "delta": d, "finish_reason": f}]}, _chat_delta,
                        st.sampled_from([None, None, None, "", "length", "tool_calls"]))
_chat_chunk = st.one_of(
    _delta_chunk, _delta_chunk, _delta_chunk, _delta_chunk,
    st.builds(lambda d: {"choices": [{"index": 0, "delta": d}], "usage": {"prompt_tokens": 1}}, _chat_delta),
    st.builds(lambda d: {"choices": [{"index": 1, "delta": d}]}, _chat_delta),
    st.just({"choices": []}),
    st.just({"choices": [{"index": 0, "delta": None}]}),
    st.just({"choices": [{"index": 0, "delta": {}, "finish_reason": ""}]}),
)


def _replay(chunks: list[Any], reads: list[int] | None) -> tuple[Any, list[Any]]:
    """Assemble ``chunks`` and feed a turn: one by one through ``feed`` (``reads`` None), or as a
    pushing backend does, reads of ``reads[i]`` chunks whose leading plain pieces go to
    ``Turn.plain`` at once (the chunks they stand for when it declines). The outcome (the
    frames and the response, or the exception) and the assembler's end."""
    from hotloop.backends.base import plain_chunks
    from hotloop.backends.chat.assemble import ChatChunk, ChunkAssembler

    decoded = [msgspec.json.decode(json.dumps(c), type=ChatChunk) for c in chunks]
    p = validate(decode_body(b'{"model":"m","input":"x"}'))
    ids = IdGen(deterministic=True)
    turn = Turn(response_object(p, ids.new("resp"), 1), ids=ids, clock=lambda: 2.0, max_tool_calls=2)
    a = ChunkAssembler()
    frames = turn.start()
    try:
        if reads is None:
            for c in decoded:
                for out in a.feed(c):
                    frames += turn.feed(out)
        else:
            at = 0
            for n in reads + [len(decoded)]:
                batch, at = decoded[at : at + n], at + n
                lane, texts, rest = a.lane(), [], []
                for i, c in enumerate(batch):
                    piece = a.plain(c) if lane is not None else None
                    if piece is None:
                        rest = batch[i:]
                        break
                    if piece:
                        texts.append(piece)
                if texts:
                    assert lane is not None
                    got = turn.plain(lane[0], lane[1], texts)
                    if got is None:
                        for out in plain_chunks(lane[0], lane[1], texts):
                            frames += turn.feed(out)
                    else:
                        frames += got
                for c in rest:
                    for out in a.feed(c):
                        frames += turn.feed(out)
        for out in a.end():
            frames += turn.feed(out)
    except Exception as exc:  # noqa: BLE001 - compared
        return (type(exc).__name__, str(exc)), []
    return (frames, turn.response), []


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_chat_chunk, max_size=30), st.lists(st.integers(1, 2), max_size=30))
def test_plain_deltas_are_what_feeding_gives(chunks: list[Any], reads: list[int]) -> None:
    """Whatever the chunks and however they are grouped into reads, taking the plain ones by the
    shortcut gives the same frames, response and failures as feeding every chunk."""
    assert _replay(chunks, reads) == _replay(chunks, None)
