"""Reasoning in ``<think>`` tags at the start of a chat backend's content (Qwen3, DeepSeek-R1 on
servers that do not split it out): :class:`hotloop.backends.chat.ChunkAssembler` streams it as
reasoning, the rest as text, whatever the chunking; and offers no native lane while a block may
be open."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotloop._accel import PLAIN_ARGUMENTS, PLAIN_REASONING, PLAIN_TEXT
from hotloop.backends.chat import ChatChunk, ChunkAssembler
from hotloop.backends.chat import assemble as assemble_module
from hotloop.protocol.chunks import Finish, ReasoningDelta, TextDelta, ToolCallDelta
from tests.unit.test_chat_mapping import through_turn

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# (content, its reasoning, its text)
SCRIPTS: list[tuple[str, str, str]] = [
    ("<think>plan</think>\n\nanswer", "plan", "answer"),
    ("\n <think>\nI should greet.\n\nThen answer.\n</think>\n\nHello <b>there</b>!\n",
     "I should greet.\n\nThen answer.", "Hello <b>there</b>!\n"),
    ("<think>\n\n</think>\n\nHi", "", "Hi"),  # the empty block of thinking turned off
    ("<think></think>", "", ""),
    ("<think>x</think>", "x", ""),
    ("<think>a < b, and </thin is not the end</think>done", "a < b, and </thin is not the end", "done"),
    ("<think>r</think>a</think>b <think>c", "r", "a</think>b <think>c"),  # only the first block
    ("<think><think>nested?</think>x", "<think>nested?", "x"),
    ("<think>é 日本 \U0001f600</think>ü", "é 日本 \U0001f600", "ü"),
    # not a block: the text as it came
    ("<thinking>x</thinking>", "", "<thinking>x</thinking>"),
    ("<th is not a tag", "", "<th is not a tag"),
    ("<", "", "<"),
    ("<think", "", "<think"),
    (" \n <thin", "", " \n <thin"),
    ("\n\n", "", "\n\n"),
    ("  \n Hello", "", "  \n Hello"),
    ("Say <think>x</think> late", "", "Say <think>x</think> late"),
    ("x<think>y</think>", "", "x<think>y</think>"),
    # a stream that ends inside the block: what came is reasoning
    ("<think>unterminated reasoning\n", "unterminated reasoning", ""),
    ("<think>ends in a tag prefix </thi", "ends in a tag prefix </thi", ""),
    ("<think>\n", "", ""),
    ("<think>", "", ""),
]


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> ChatChunk:
    obj = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    return msgspec.json.decode(json.dumps(obj), type=ChatChunk)


def content_chunks(pieces: list[str]) -> list[ChatChunk]:
    return [chunk({"role": "assistant", "content": ""})] + [chunk({"content": p}) for p in pieces] + [chunk({}, "stop")]


def run(chunks: list[ChatChunk], a: ChunkAssembler | None = None) -> list[Any]:
    a = ChunkAssembler() if a is None else a
    out: list[Any] = []
    for c in chunks:
        out += a.feed(c)
    return out + a.end()


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[i:j] for i, j in zip([0, *points], [*points, len(text)])]


def check(out: list[Any], reasoning: str, text: str) -> None:
    deltas = [c for c in out if isinstance(c, (ReasoningDelta, TextDelta))]
    assert all(c.text for c in deltas), deltas  # no empty delta
    kinds = [type(c) for c in deltas]
    # the reasoning first, then the text: one item each at most
    assert kinds == sorted(kinds, key=lambda k: k is TextDelta), kinds
    assert "".join(c.text for c in deltas if isinstance(c, ReasoningDelta)) == reasoning
    assert "".join(c.text for c in deltas if isinstance(c, TextDelta)) == text
    assert out[-1] == Finish("stop")
    output = through_turn(out)["output"]
    assert [o["type"] for o in output] == ["reasoning"] * bool(reasoning) + ["message"] * bool(text)


@pytest.mark.parametrize(("content", "reasoning", "text"), SCRIPTS)
def test_every_split_point(content: str, reasoning: str, text: str) -> None:
    check(run(content_chunks([content])), reasoning, text)
    for i in range(1, len(content)):  # one cut, anywhere (inside either tag too)
        check(run(content_chunks([content[:i], content[i:]])), reasoning, text)
    check(run(content_chunks(list(content))), reasoning, text)  # a character a chunk


@SETTINGS
@given(st.sampled_from(SCRIPTS), st.lists(st.integers(min_value=1, max_value=80), max_size=12))
def test_any_chunking(script: tuple[str, str, str], cuts: list[int]) -> None:
    content, reasoning, text = script
    check(run(content_chunks(split(content, cuts))), reasoning, text)


def test_the_chunks() -> None:
    out = run(content_chunks(["<th", "ink>\npl", "an", "</thi", "nk>", "\n\n", "ans", "wer"]))
    assert out == [ReasoningDelta("pl"), ReasoningDelta("an"), TextDelta("ans"), TextDelta("wer"), Finish("stop")]
    # a false prefix: the characters held are text, in order, before the next
    assert run(content_chunks(["\n", "<th", "at", " is all"])) == [TextDelta("\n<that"), TextDelta(" is all"), Finish("stop")]
    # the empty block: no reasoning item at all
    out = run(content_chunks(["<think>", "\n\n", "</think>", "\n\n", "Hi"]))
    assert out == [TextDelta("Hi"), Finish("stop")]
    assert through_turn(out)["output"][0]["type"] == "message"


def test_the_whitespace_inside_the_block_waits_for_what_follows_it() -> None:
    out = run(content_chunks(["<think>a ", "b\n\n", "c \n", "</think>d"]))
    assert out == [ReasoningDelta("a"), ReasoningDelta(" b"), ReasoningDelta("\n\nc"), TextDelta("d"), Finish("stop")]


def test_tool_calls_after_a_think_block() -> None:
    calls = [
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "search", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"q":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]}),
        chunk({}, "tool_calls"),
    ]
    out = run([chunk({"content": "<think>I need"}), chunk({"content": " a search</think>\n\n"}), *calls])
    assert out == [
        ReasoningDelta("I need"),
        ReasoningDelta(" a search"),
        ToolCallDelta(0, "", "call_1", "search"),
        ToolCallDelta(0, '{"q":'),
        ToolCallDelta(0, '"x"}'),
        Finish("tool_calls"),
    ]
    response = through_turn(out)
    assert [o["type"] for o in response["output"]] == ["reasoning", "function_call"]
    # a block never closed before the calls: it ends there, what it held is reasoning, before them
    out = run([chunk({"content": "<think>I need a search\n</th"}), *calls[:-1], chunk({"content": "\n\nok"}), calls[-1]])
    assert out[:2] == [ReasoningDelta("I need a search"), ReasoningDelta("\n</th")]
    assert [type(c) for c in out[2:]] == [ToolCallDelta, ToolCallDelta, ToolCallDelta, TextDelta, Finish]
    assert out[-2] == TextDelta("ok")
    assert [o["type"] for o in through_turn(out)["output"]] == ["reasoning", "function_call", "message"]
    # held content before any block: text, before the calls, and no block after them
    out = run([chunk({"content": " <thi"}), *calls[:-1], chunk({"content": "<think>x</think>"}), calls[-1]])
    assert out[0] == TextDelta(" <thi") and out[-2] == TextDelta("<think>x</think>")


def test_a_reasoning_field_and_a_block_are_both_reasoning_in_the_order_they_come() -> None:
    out = run([chunk({"reasoning": "field "}), chunk({"content": "<think>block"}), chunk({"reasoning": " again"}),
               chunk({"content": "</think>\n\nanswer"}), chunk({}, "stop")])  # fmt: skip
    assert out == [ReasoningDelta("field "), ReasoningDelta("block"), ReasoningDelta(" again"), TextDelta("answer"), Finish("stop")]


def test_switched_off_the_tags_are_text() -> None:
    a = ChunkAssembler(think_tags=False)
    out = run(content_chunks(["<think>plan</think>\n\nanswer"]), a)
    assert out == [TextDelta("<think>plan</think>\n\nanswer"), Finish("stop")]
    a = ChunkAssembler(think_tags=False)
    a.feed(chunk({"content": "<th"}))
    assert a.lane() == (PLAIN_TEXT, 0, 0, None)


def test_no_lane_while_a_block_may_be_open() -> None:
    a = ChunkAssembler()
    assert a.lane() is None
    a.feed(chunk({"role": "assistant", "content": ""}))
    assert a.lane() is None
    a.feed(chunk({"content": "\n"}))  # held: a block may follow
    assert a.lane() is None
    a.feed(chunk({"content": "<th"}))
    assert a.lane() is None
    assert a.feed(chunk({"content": "ink>"})) == []
    assert a.lane() is None
    assert a.feed(chunk({"content": "plan"})) == [ReasoningDelta("plan")]
    assert a.lane() is None  # the reasoning item is open, but so is the block
    assert a.feed(chunk({"reasoning": " more"})) == [ReasoningDelta(" more")]
    assert a.lane() is None
    assert a.feed(chunk({"content": "</thi"})) == []
    assert a.lane() is None
    assert a.feed(chunk({"content": "nk>\n"})) == []
    # closed: the reasoning item's lane, as for any reasoning (content never takes it)
    assert a.lane() == (PLAIN_REASONING, 0, 0, None)
    assert a.feed(chunk({"content": "answer"})) == [TextDelta("answer")]
    assert a.lane() == (PLAIN_TEXT, 0, 0, None)
    assert a.feed(chunk({"content": " <think>"})) == [TextDelta(" <think>")]
    assert a.lane() == (PLAIN_TEXT, 0, 0, None)


def test_lanes_without_a_block_are_as_before() -> None:
    a = ChunkAssembler()
    assert a.feed(chunk({"reasoning": "r"})) == [ReasoningDelta("r")]
    assert a.lane() == (PLAIN_REASONING, 0, 0, None)  # no content yet: nothing held
    assert a.feed(chunk({"content": "Hello"})) == [TextDelta("Hello")]
    assert a.lane() == (PLAIN_TEXT, 0, 0, None)
    a = ChunkAssembler()
    a.feed(chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}]}))
    lane = a.lane()
    assert lane is not None and lane[:3] == (PLAIN_ARGUMENTS, 0, 0)
    a = ChunkAssembler()
    assert a.feed(chunk({"content": "<b>bold</b>"})) == [TextDelta("<b>bold</b>")]
    assert a.lane() == (PLAIN_TEXT, 0, 0, None)


def test_whitespace_is_held_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assemble_module, "MAX_THINK_HELD", 10)
    # before a block: held while within the bound, then text
    assert run(content_chunks([" " * 5, "\n" * 5, "<think>x</think>y"])) == [ReasoningDelta("x"), TextDelta("y"), Finish("stop")]
    out = run(content_chunks([" " * 5, "\n" * 5, " ", "<think>x</think>"]))
    assert out == [TextDelta(" " * 5 + "\n" * 5 + " "), TextDelta("<think>x</think>"), Finish("stop")]
    # inside one: held while within the bound, then reasoning
    out = run(content_chunks(["<think>a", " " * 5, " " * 5, "b", " " * 11, "</th", "ink>c"]))
    assert out == [ReasoningDelta("a"), ReasoningDelta(" " * 10 + "b"), ReasoningDelta(" " * 11), TextDelta("c"), Finish("stop")]
    out = run(content_chunks(["<think>a", " " * 11 + "</thi", "nk>c"]))
    assert out == [ReasoningDelta("a"), ReasoningDelta(" " * 11), TextDelta("c"), Finish("stop")]


# --think-tags open: the chat template opened the block; (content, its reasoning, its text)
OPEN_SCRIPTS: list[tuple[str, str, str]] = [
    ("plan</think>\n\nanswer", "plan", "answer"),
    ("\nI should greet.\n\nThen answer.\n</think>\n\nHello <b>there</b>!\n", "I should greet.\n\nThen answer.", "Hello <b>there</b>!\n"),
    ("<think>plan</think>answer", "plan", "answer"),  # the tag sent anyway: read as the tag
    ("  <think>\nplan</think>answer", "plan", "answer"),
    ("\n\n</think>\n\nHi", "", "Hi"),  # nothing thought: no reasoning item
    ("</think>", "", ""),
    ("a < b, </thin is not the end</think>done", "a < b, </thin is not the end", "done"),
    ("<thinking>x</think>y", "<thinking>x", "y"),  # a false tag: reasoning, as it came
    ("<th", "<th", ""),
    ("r</think>a</think>b <think>c", "r", "a</think>b <think>c"),  # only the first closing tag
    # a content that never closes the block is all reasoning
    ("no closing tag here\n", "no closing tag here", ""),
    ("ends in a tag prefix </thi", "ends in a tag prefix </thi", ""),
    ("\n \n", "", ""),
    ("", "", ""),
]


def opened() -> ChunkAssembler:
    return ChunkAssembler(opened=True)


@pytest.mark.parametrize(("content", "reasoning", "text"), OPEN_SCRIPTS)
def test_opened_every_split_point(content: str, reasoning: str, text: str) -> None:
    check(run(content_chunks([content]), opened()), reasoning, text)
    for i in range(1, len(content)):
        check(run(content_chunks([content[:i], content[i:]]), opened()), reasoning, text)
    check(run(content_chunks(list(content)), opened()), reasoning, text)


@SETTINGS
@given(st.sampled_from(OPEN_SCRIPTS), st.lists(st.integers(min_value=1, max_value=80), max_size=12))
def test_opened_any_chunking(script: tuple[str, str, str], cuts: list[int]) -> None:
    content, reasoning, text = script
    check(run(content_chunks(split(content, cuts)), opened()), reasoning, text)


def test_opened_the_chunks_and_lanes() -> None:
    a = opened()
    assert a.lane() is None
    assert a.feed(chunk({"role": "assistant", "content": ""})) == []
    assert a.feed(chunk({"content": "\n"})) == []  # held: the tag may still come
    assert a.feed(chunk({"content": "Let"})) == [ReasoningDelta("Let")]
    assert a.lane() is None  # reasoning from the content: only the general path reads it
    assert a.feed(chunk({"content": " me see.\n</th"})) == [ReasoningDelta(" me see.")]
    assert a.feed(chunk({"content": "ink>\n\nDone"})) == [TextDelta("Done")]
    assert a.lane() == (PLAIN_TEXT, 0, 0, None)
    assert a.end() == [Finish("stop")]


def test_opened_a_tool_call_ends_the_block() -> None:
    call = chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "search", "arguments": "{}"}}]})
    out = run([chunk({"content": "I need a search\n"}), call, chunk({}, "tool_calls")], opened())
    assert out == [ReasoningDelta("I need a search"), ToolCallDelta(0, "{}", "call_1", "search"), Finish("tool_calls")]
    assert [o["type"] for o in through_turn(out)["output"]] == ["reasoning", "function_call"]
    # a call before any content: nothing held, no reasoning item
    out = run([call, chunk({}, "tool_calls")], opened())
    assert out == [ToolCallDelta(0, "{}", "call_1", "search"), Finish("tool_calls")]


def test_opened_a_server_that_splits_reasoning_out_keeps_its_content_as_text() -> None:
    # reasoning in its own field before any content: the server parsed the block out already,
    # so the content is the answer (read as in auto: a <think> block at its start is still one)
    out = run([chunk({"reasoning": "plan"}), chunk({"content": "\n\nanswer"}), chunk({}, "stop")], opened())
    assert out == [ReasoningDelta("plan"), TextDelta("\n\nanswer"), Finish("stop")]
    # content first: the block is open, a later reasoning field is reasoning too, in order
    out = run([chunk({"content": "a"}), chunk({"reasoning": "b"}), chunk({"content": "c</think>d"}), chunk({}, "stop")], opened())
    assert out == [ReasoningDelta("a"), ReasoningDelta("b"), ReasoningDelta("c"), TextDelta("d"), Finish("stop")]


def test_opened_is_nothing_with_the_tags_off() -> None:
    a = ChunkAssembler(think_tags=False, opened=True)
    assert run(content_chunks(["plan</think>answer"]), a) == [TextDelta("plan</think>answer"), Finish("stop")]
