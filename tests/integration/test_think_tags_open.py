"""``--think-tags open`` (``HOTLOOP_THINK_TAGS=open``): a model whose chat template opens the
``<think>`` block (DeepSeek-R1-0528, Qwen3 thinking-2507) sends its reasoning, then ``</think>``,
then the answer. Served by the Cerebras backend, end to end with the openai SDK: the reasoning is
a reasoning item, the answer the message, and the next turn sends the reasoning back as
reasoning, never as text with the tag in it."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.conftest import Server, run_server
from tests.integration.chat_backends import client_for
from tests.integration.test_think_tags import check_output, ws_turn
from tests.mock_chat_server import MockChatServer, Reply, Sleep, chunk, usage

MODEL = "qwen-3-235b-a22b-thinking-2507"
# the content of `plan\n</think>\n\nanswer` (the template sent `<think>\n`), the tag split across chunks
PIECES = ["\npl", "an\n</thi", "nk>", "\n\nans", "wer"]


@pytest.fixture(scope="module")
def opened(tmp_path_factory: pytest.TempPathFactory, mock: MockChatServer) -> Iterator[Server]:
    env = {"CEREBRAS_API_KEY": "k", "HOTLOOP_BACKEND_RETRIES": "0", "HOTLOOP_THINK_TAGS": "open"}
    args = ("--backend", "cerebras", "--base-url", mock.url, "--store", "memory")
    with run_server(tmp_path_factory.mktemp("open"), *args, env=env) as s:
        yield s


def reply(pieces: list[str] = PIECES) -> Reply:
    events: list[Any] = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": p}) for p in pieces]
    events += [chunk({}, "stop"), chunk(usage=usage(12, 9), choices=False)]
    return Reply.stream([e for x in events for e in (Sleep(0.005), x)])


def test_the_content_before_the_closing_tag_is_reasoning(opened: Server, mock: MockChatServer) -> None:
    mock.reset()
    mock.push(reply(), reply(["again</think>", "done"]))  # every answer of such a model thinks first
    with client_for(opened).responses.connect() as conn:
        events = ws_turn(conn, input="Hi")
        assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning", "message"]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == "answer"
        check_output(events[-1].response.output)
        final = ws_turn(conn, input="Again", previous_response_id=events[-1].response.id)[-1]
        assert final.type == "response.completed" and final.response.output_text == "done"
    request = mock.requests[1]
    assert b"think>" not in request.body
    (msg,) = [m for m in request.json["messages"] if m["role"] == "assistant"]
    assert msg["content"] == "answer" and msg["reasoning"] == "plan"


def test_a_content_without_the_closing_tag_is_all_reasoning(opened: Server, mock: MockChatServer) -> None:
    mock.reset()
    mock.push(reply(["Still thinking", " when the tokens ran out"]))
    response = client_for(opened).responses.create(model=MODEL, input="Hi", store=False)
    assert [o.type for o in response.output] == ["reasoning"]
    assert response.output_text == ""
    assert [c.text for c in response.output[0].content or []] == ["Still thinking when the tokens ran out"]
