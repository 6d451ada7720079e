"""A reasoning item's ``encrypted_content`` (``include: ["reasoning.encrypted_content"]``, or
``store: false``), sans-I/O: the sealing module (:mod:`hotloop.protocol.sealed`), ``include``'s
validation, the turn's reasoning item, and an item that comes back rendered and counted from
its unsealed text."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from hotloop import errors
from hotloop.backends.base import BackendRequest
from hotloop.backends.chat import CEREBRAS, render
from hotloop.pipeline import items as itemlib
from hotloop.protocol import events as ev
from hotloop.protocol import sealed
from hotloop.protocol.chunks import Failure, Finish, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from hotloop.protocol.objects import IdGen, response_object, wants_encrypted_reasoning
from hotloop.protocol.request import INCLUDABLE, Reasoning, decode_body, decode_items, validate
from hotloop.protocol.turn import Turn
from hotloop.state import fpkey
from tests.unit.test_turn import _lane_read

KEY = fpkey.derive(b"k" * 32, sealed.KEY_LABEL)
OTHER = fpkey.derive(b"o" * 32, sealed.KEY_LABEL)
THOUGHTS = ["Let", " me", " think", "."]
TEXT = "".join(THOUGHTS)


# -- the sealing module ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["Let me think.", "", "é — 漢字 🙂 \u0000 \n", "x" * 70_000, "\ud800 lone"])
def test_round_trip(text: str) -> None:
    token = sealed.seal(text, KEY)
    assert token.startswith("hl1.") and token.isascii()
    assert "=" not in token and "+" not in token and "/" not in token  # base64url, no padding
    assert sealed.unseal(token, KEY) == text
    assert sealed.seal(text, KEY) == token  # deterministic: a MAC, no nonce


def test_format() -> None:
    token = sealed.seal("hi", KEY)
    raw = base64.urlsafe_b64decode(token[4:] + "=" * (-len(token[4:]) % 4))
    assert len(raw) == sealed.TAG_LEN + 2 and raw[sealed.TAG_LEN:] == b"hi"


def test_tampered_wrong_key_and_foreign_tokens_do_not_open() -> None:
    token = sealed.seal("the plan", KEY)
    assert sealed.unseal(token, OTHER) is None  # another server's (or an old) key
    raw = bytearray(base64.urlsafe_b64decode(token[4:] + "=" * (-len(token[4:]) % 4)))
    for i in (0, sealed.TAG_LEN, len(raw) - 1):  # a bit of the tag, of the text
        bad = bytearray(raw)
        bad[i] ^= 1
        forged = "hl1." + base64.urlsafe_b64encode(bytes(bad)).rstrip(b"=").decode()
        assert sealed.unseal(forged, KEY) is None
    # the text swapped under the same tag, the text alone, truncated
    swapped = "hl1." + base64.urlsafe_b64encode(bytes(raw[: sealed.TAG_LEN]) + b"the plot").rstrip(b"=").decode()
    assert sealed.unseal(swapped, KEY) is None
    assert sealed.unseal("hl1." + base64.urlsafe_b64encode(b"the plan").rstrip(b"=").decode(), KEY) is None
    assert sealed.unseal(token[:-3], KEY) is None
    for foreign in ("gAAAAABoX2abc", "", "hl1.", "hl1.!!!!", "hl1.é", "hl1.A", "hl2." + token[4:], "hl1" + token[4:]):
        assert sealed.unseal(foreign, KEY) is None, foreign
    assert sealed.unseal(token + "==", KEY) == "the plan"  # (padding is tolerated: the bytes are what is checked)


def test_the_module_key() -> None:
    before = sealed.seal("x")
    sealed.use_key(KEY)
    try:
        assert sealed.seal("x") == sealed.seal("x", KEY) and sealed.unseal(sealed.seal("x", KEY)) == "x"
        assert sealed.unseal(before) is None  # the previous key's
    finally:
        sealed.use_key(sealed.PROCESS_KEY)


def test_derived_keys_are_separate() -> None:
    k = b"k" * 32
    assert fpkey.derive(k, sealed.KEY_LABEL) != k
    assert fpkey.derive(k, sealed.KEY_LABEL) != fpkey.derive(k, b"another purpose")
    assert len(fpkey.derive(k, sealed.KEY_LABEL)) == fpkey.KEY_LEN


# -- include ------------------------------------------------------------------------------------------


def prepared(**body: Any) -> Any:
    return validate(decode_body(json.dumps({"model": "m", "input": "hi", **body})))


def rejected(**body: Any) -> errors.HotloopError:
    with pytest.raises(errors.HotloopError) as info:
        prepared(**body)
    return info.value


def test_include_valid() -> None:
    assert prepared(include=list(INCLUDABLE)).req.include == list(INCLUDABLE)
    assert prepared(include=[]).req.include == []
    assert prepared(include=None).req.include is None
    assert "reasoning.encrypted_content" in INCLUDABLE and len(INCLUDABLE) == 8


def test_include_unknown_value_is_accepted_and_ignored() -> None:
    # (OpenAI answers 400; the set grows with the API: protocol.request, INCLUDABLE)
    p = prepared(include=["reasoning.everything", "message.output_text.logprobs"])
    assert p.req.include == ["reasoning.everything", "message.output_text.logprobs"]
    assert not wants_encrypted_reasoning(p)


@pytest.mark.parametrize(
    "value, param", [("reasoning.encrypted_content", "include"), ({"a": 1}, "include"), ([1], "include[0]"), ([None], "include[0]")]
)
def test_include_wrong_type(value: Any, param: str) -> None:
    err = rejected(include=value)
    assert (err.status, err.type, err.code, err.param) == (400, "invalid_request_error", "invalid_type", param)


@pytest.mark.parametrize(
    "body, wanted",
    [
        ({}, False),
        ({"include": []}, False),
        ({"include": ["message.output_text.logprobs"]}, False),
        ({"include": ["reasoning.encrypted_content"]}, True),
        ({"store": False}, True),
        ({"store": None}, False),  # null is the default, true
        ({"store": True, "include": ["file_search_call.results", "reasoning.encrypted_content"]}, True),
    ],
)
def test_who_gets_encrypted_content(body: dict[str, Any], wanted: bool) -> None:
    assert wants_encrypted_reasoning(prepared(**body)) is wanted


# -- the turn --------------------------------------------------------------------------------------------


def make_turn(summary: bool, seal: bool = True, quiet: bool = False, transport: str = "sse") -> Turn:
    p = prepared(**({"reasoning": {"summary": "auto"}} if summary else {}))
    ids = IdGen(deterministic=True)
    return Turn(response_object(p, ids.new("resp"), 1000), ids=ids, clock=lambda: 1001.0, quiet=quiet,
                transport=transport, reasoning_summary=summary,
                seal=(lambda text: sealed.seal(text, KEY)) if seal else None)  # fmt: skip


def run(turn: Turn, chunks: list[Any]) -> list[dict[str, Any]]:
    frames = turn.start()
    for c in chunks:
        frames += turn.feed(c)
    return [json.loads(p) for _, p in frames] if turn._ev is ev else []


def reasoning_then_text() -> list[Any]:
    return [*(ReasoningDelta(t) for t in THOUGHTS), TextDelta("Hi"), Usage(output_tokens=5, reasoning_tokens=4), Finish()]


@pytest.mark.parametrize("summary", [True, False])
def test_the_item_carries_it_when_done(summary: bool) -> None:
    events = run(make_turn(summary), reasoning_then_text())
    added = [e for e in events if e["type"] == ev.OUTPUT_ITEM_ADDED]
    assert all("encrypted_content" not in e["item"] for e in added)  # not known yet when it opens
    (done,) = [e for e in events if e["type"] == ev.OUTPUT_ITEM_DONE and e["item"]["type"] == "reasoning"]
    item = done["item"]
    assert sealed.unseal(item["encrypted_content"], KEY) == TEXT
    if summary:
        assert item == {"id": "rs_0002", "type": "reasoning", "encrypted_content": item["encrypted_content"],
                        "summary": [{"type": "summary_text", "text": TEXT}]}  # fmt: skip
    else:
        assert item["summary"] == [] and item["content"] == [{"type": "reasoning_text", "text": TEXT}]
    final = events[-1]["response"]
    assert final["output"][0] == item
    # nothing else changes: the same events as a turn that does not seal, but this field
    plain = run(make_turn(summary, seal=False), reasoning_then_text())
    for e in events:
        if e["type"] == ev.OUTPUT_ITEM_DONE:
            e["item"].pop("encrypted_content", None)
    events[-1]["response"]["output"][0].pop("encrypted_content")
    assert events == plain
    assert "encrypted_content" not in json.dumps(plain)


def test_quiet_turn_and_lanes_seal_the_same() -> None:
    streamed = make_turn(True)
    events = run(streamed, reasoning_then_text())
    quiet = make_turn(True, quiet=True)
    run(quiet, reasoning_then_text())
    assert quiet.response == streamed.response == events[-1]["response"]
    # read through the reasoning lane: the sealed text is what the lane read
    laned = make_turn(True)
    laned.start()
    laned.feed(ReasoningDelta("Let"))
    lane = laned.lane()
    assert lane is not None
    _lane_read(lane, [" me", " think", "."])
    laned.feed(TextDelta("Hi"))
    laned.feed(Usage(output_tokens=5, reasoning_tokens=4))
    laned.feed(Finish())
    assert laned.response["output"][0] == streamed.response["output"][0]


def test_sealed_on_failure_and_each_item() -> None:
    failed = run(make_turn(True), [ReasoningDelta("hm"), Failure(code="server_error", message="x")])
    assert sealed.unseal(failed[-1]["response"]["output"][0]["encrypted_content"], KEY) == "hm"
    chunks = [ReasoningDelta("plan"), ToolCallDelta(index=0, call_id="c1", name="f"), ToolCallDelta(index=0, arguments="{}"),
              ReasoningDelta("again"), TextDelta("ok"), Finish()]  # fmt: skip
    out = run(make_turn(True), chunks)[-1]["response"]["output"]
    assert [sealed.unseal(o["encrypted_content"], KEY) for o in out if o["type"] == "reasoning"] == ["plan", "again"]
    assert all("encrypted_content" not in o for o in out if o["type"] != "reasoning")


# -- coming back -------------------------------------------------------------------------------------------


USER = {"type": "message", "role": "user", "content": "q"}
ANSWER = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}


def history(items: list[dict[str, Any]]) -> Any:
    req = BackendRequest(model="m", instructions=None, items=decode_items([USER, *items, ANSWER]), tools=[],
                         tool_choice="auto", parallel_tool_calls=True)  # fmt: skip
    return render(req, CEREBRAS)["messages"][1].get("reasoning")


@pytest.fixture
def server_key() -> Any:
    sealed.use_key(KEY)
    yield
    sealed.use_key(sealed.PROCESS_KEY)


def test_rendered_from_the_unsealed_text(server_key: None) -> None:
    token = sealed.seal("The plan, in full.", KEY)
    # what the AI SDK and Codex send back: the item with its encrypted content (and no or another summary)
    assert history([{"type": "reasoning", "summary": [], "encrypted_content": token}]) == "The plan, in full."
    s = [{"type": "summary_text", "text": "A summary."}]
    assert history([{"type": "reasoning", "summary": s, "encrypted_content": token}]) == "The plan, in full."
    # raw content wins (it is the reasoning itself)
    raw = [{"type": "reasoning_text", "text": "raw"}]
    assert history([{"type": "reasoning", "summary": s, "content": raw, "encrypted_content": token}]) == "raw"
    # a token this server did not seal (another server's, OpenAI's, tampered, an old key) is ignored
    for foreign in ("gAAAAABoX2abc", sealed.seal("forged", OTHER), token[:-2], token[:4] + "A" + token[5:]):
        assert history([{"type": "reasoning", "summary": s, "encrypted_content": foreign}]) == "A summary."
        assert history([{"type": "reasoning", "summary": [], "encrypted_content": foreign}]) is None
    # an empty sealed text is no history: the summary, as for empty raw content
    assert history([{"type": "reasoning", "summary": s, "encrypted_content": sealed.seal("", KEY)}]) == "A summary."


def test_counted_as_rendered(server_key: None) -> None:
    """The token count of an input reasoning item counts the text the backend is sent (one
    function: :func:`sealed.reasoning_text`)."""
    token = sealed.seal("The plan, in full.", KEY)
    cases: list[dict[str, Any]] = [
        {"summary": [], "encrypted_content": token},
        {"summary": [{"type": "summary_text", "text": "S"}], "encrypted_content": "gAAAA"},
        {"summary": [], "content": [{"type": "reasoning_text", "text": "a"}, {"type": "reasoning_text", "text": "b"}]},
        {"summary": [{"type": "summary_text", "text": "x"}, {"type": "summary_text", "text": ""}, {"type": "summary_text", "text": "y"}]},
        {"summary": [{"type": "summary_text", "text": "S"}], "content": [{"type": "reasoning_text", "text": ""}]},
        {"summary": []},
    ]
    for case in cases:
        item = {"type": "reasoning", **case}
        (decoded,) = decode_items([item])
        assert isinstance(decoded, Reasoning)
        assert itemlib.item_text(decoded) == sealed.reasoning_text(decoded) == (history([item]) or ""), case
    (joined,) = decode_items([{"type": "reasoning", **cases[2]}])
    assert itemlib.item_text(joined) == "ab"  # raw parts join as streamed (no separator), as rendered
