"""``<think>`` blocks at the start of a chat backend's content, end to end: ``hotloop serve``
(cerebras and openai-compat backends, lean and sdk transports) against
:mod:`tests.mock_chat_server`, with the openai SDK as the client, over HTTP SSE and over the
WebSocket mode. The block is a reasoning item, the rest the message, and the next turn sends the
reasoning back as reasoning (cerebras) or not at all (openai-compat), never as ``<think>`` text."""

from __future__ import annotations

from typing import Any

import pytest

from hotloop._accel import BACKEND_NAMES
from hotloop.protocol.chunks import ReasoningDelta, TextDelta
from tests.conftest import Server
from tests.integration.chat_backends import _fresh_mock, cerebras, client_for, compat, server, transport  # noqa: F401
from tests.integration.test_push import POLICIES, paced, run_stream
from tests.mock_chat_server import Event, MockChatServer, Reply, Sleep, chunk, usage

MODEL = "qwen-3-32b"
TERMINAL = ("response.completed", "response.failed", "response.incomplete")
# the content of `<think>plan</think>\n\nanswer`, with both tags split across chunks
PIECES = ["<th", "ink>\npl", "an\n</thi", "nk>", "\n\nans", "wer"]


def think_events(pieces: list[str] = PIECES) -> list[Event]:
    events: list[Event] = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": p}) for p in pieces]
    return events + [chunk({}, "stop"), chunk(usage=usage(12, 9), choices=False)]


def think_reply(pieces: list[str] = PIECES, pace: float = 0.005) -> Reply:
    # one chunk per read: push delivery takes part, with the lanes it offers (native build)
    return Reply.stream([e for x in think_events(pieces) for e in (Sleep(pace), x)])


def is_cerebras(server: Server) -> bool:
    return "cerebras" in " ".join(server.proc.args)  # type: ignore[arg-type]


def check_output(output: list[Any]) -> None:
    rs, msg = output
    assert rs.type == "reasoning"
    texts = [c.text for c in rs.content or []] + [s.text for s in rs.summary]
    assert texts == ["plan"]
    assert msg.type == "message" and [c.text for c in msg.content] == ["answer"]


def check_events(events: list[Any]) -> None:
    types = [e.type for e in events]
    assert types[-1] == "response.completed"
    reasoning = "".join(e.delta for e in events if e.type in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"))
    assert reasoning == "plan"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "answer"
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning", "message"]
    check_output(events[-1].response.output)


def check_history(server: Server, mock: MockChatServer, turn: int) -> None:
    """The chat request of ``turn``: the earlier answer's reasoning as reasoning, its text as text."""
    request = mock.requests[turn]
    assert b"<think>" not in request.body and b"</think>" not in request.body
    (msg,) = [m for m in request.json["messages"] if m["role"] == "assistant"]
    assert msg["content"] == "answer"
    if is_cerebras(server):
        assert msg["reasoning"] == "plan"
    else:
        assert "reasoning" not in msg  # openai-compat sends no reasoning history


def test_over_http_sse_and_the_next_turn(server: Server, mock: MockChatServer) -> None:
    mock.push(think_reply(), Reply.stream([chunk({"content": "done"}), chunk({}, "stop")]))
    client = client_for(server)
    events: list[Any] = list(client.responses.create(model=MODEL, input="Hi", stream=True))
    check_events(events)
    first = events[-1].response
    stored = client.responses.retrieve(first.id)
    check_output(stored.output)
    second = client.responses.create(model=MODEL, input="Again", previous_response_id=first.id)
    assert second.output_text == "done"
    check_history(server, mock, 1)


def ws_turn(conn: Any, **create: Any) -> list[Any]:
    """One response over the WebSocket connection: its events, up to its terminal one."""
    conn.response.create(model=MODEL, store=False, **create)
    events: list[Any] = []
    for e in conn:
        events.append(e)
        if e.type in TERMINAL:
            return events
    raise AssertionError("the connection closed before the response ended")


def test_over_websocket_and_the_next_turn(server: Server, mock: MockChatServer) -> None:
    mock.push(think_reply(), Reply.stream([chunk({"content": "done"}), chunk({}, "stop")]))
    with client_for(server).responses.connect() as conn:
        events = ws_turn(conn, input="Hi")
        check_events(events)
        final = ws_turn(conn, input="Again", previous_response_id=events[-1].response.id)[-1]
        assert final.type == "response.completed" and final.response.output_text == "done"
    check_history(server, mock, 1)


def test_content_without_a_block_is_untouched(server: Server, mock: MockChatServer) -> None:
    mock.push(think_reply(["\n", "Say <think>", " late</think>"]))
    response = client_for(server).responses.create(model=MODEL, input="Hi", store=False)
    assert [o.type for o in response.output] == ["message"]
    assert response.output_text == "\nSay <think> late</think>"


@pytest.mark.parametrize("burst_at", [1, 3, 6])  # three chunks in one read: the tags' pieces, or text
@pytest.mark.parametrize("policy", ["all", "none", "first"])
def test_pushed_through_lanes_is_the_stream(mock: MockChatServer, policy: str, burst_at: int) -> None:
    """Push delivery with the lanes a run offers for its open item (tests.integration.test_push):
    the same chunks as without; no lane takes the block's content as text, and once the block is
    closed the text goes through the text lane (native build)."""
    events = paced(think_events([*PIECES, " and", " more", " text", "."]), burst_at=burst_at)
    plain, exc0, _ = run_stream(mock, events, None)
    assert exc0 is None
    assert "".join(c.text for c in plain if isinstance(c, ReasoningDelta)) == "plan"
    assert "".join(c.text for c in plain if isinstance(c, TextDelta)) == "answer and more text."
    batches: list[int] = []
    got, exc, _ = run_stream(mock, events, POLICIES[policy], batches)
    assert exc is None and got == plain
    if BACKEND_NAMES["SseDecoder"] == "hotloop._native" and policy != "none":
        # text deltas after the block, read by the native decoder (at least one read of them:
        # on a loaded machine the paced events after the closing tag may come in fewer reads)
        assert sum(batches) >= 1
