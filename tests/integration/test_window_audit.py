"""Audit of the context window on a real server (the simulator, a tiny window from
``--model-limits``): truncation with call ids a conversation reuses, and the 400 when truncation
cannot make the input fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import run_server
from tests.mock_chat_server import MockChatServer
from tests.integration.test_context_window import MODEL, PARAGRAPH, SIM, WINDOW, create, limits_file


def _turn(i: int, call_id: str) -> list[dict[str, Any]]:
    return [
        {"type": "message", "role": "user", "content": f"question {i}"},
        {"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": json.dumps({"q": i})},
        {"type": "function_call_output", "call_id": call_id, "output": f"{i}: {PARAGRAPH}"},
        {"type": "message", "role": "assistant", "content": f"done {i}"},
    ]


def _count(server: Any, items: list[dict[str, Any]]) -> int:
    r = httpx.post(f"{server.v1}/responses/input_tokens", json={"model": MODEL, "input": items}, timeout=10)
    assert r.status_code == 200, r.text
    return int(r.json()["input_tokens"])


def test_reused_call_ids_drop_only_what_is_needed(tmp_path: Path) -> None:
    """A client whose every turn's call is ``call_1`` (client-built histories, backends that number
    calls per turn): each output belongs to the call just before it, so truncation drops the first
    turn's question, call and output only, not the whole history between the first and the last
    ``call_1``."""
    history = [it for i in range(4) for it in _turn(i, "call_1")] + [{"type": "message", "role": "user", "content": "last"}]
    with run_server(tmp_path, "--sim-rate", "0", "--model-limits", str(limits_file(tmp_path))) as s:
        kept = _count(s, history[3:])
        assert _count(s, history) > WINDOW >= kept  # dropping the first call with its question is enough
        assert _count(s, history[1:]) > WINDOW  # the question alone is not
        r = create(s, input=history, truncation="auto")
        assert r.status_code == 200, r.text
        assert r.headers["x-hotloop-truncated-items"] == "3"
        body = r.json()
        assert body["usage"]["truncated_items"] == 3
        assert body["usage"]["input_tokens"] == kept
        listed = httpx.get(f"{s.v1}/responses/{body['id']}/input_items", params={"order": "asc"}, timeout=10).json()["data"]
        assert [it["type"] for it in listed] == [it["type"] for it in history[3:]]
        assert listed[0]["content"][0]["text"] == "done 0"


def test_failed_truncation_is_the_same_400_as_disabled(tmp_path: Path) -> None:
    """When dropping every droppable item is not enough, ``truncation: "auto"`` answers the 400
    ``"disabled"`` does: the input as sent, not what was left of it after dropping; only its
    advice to set truncation to "auto" is left out, since the request did."""
    items = [{"type": "message", "role": "user", "content": f"{i}: {PARAGRAPH}"} for i in range(3)]
    items.append({"type": "message", "role": "user", "content": PARAGRAPH * 6})  # over the window alone
    with run_server(tmp_path, "--sim-rate", "0", "--model-limits", str(limits_file(tmp_path))) as s:
        whole = _count(s, items)
        disabled = create(s, input=items)
        auto = create(s, input=items, truncation="auto")
        assert disabled.status_code == auto.status_code == 400
        error = {
            "message": f"This model's maximum context length is {WINDOW} tokens. However, your input has {whole} "
            "tokens. Please reduce the length of the input, or set truncation to 'auto'.",
            "type": "invalid_request_error",
            "param": "input",
            "code": "context_length_exceeded",
        }
        assert disabled.json()["error"] == error
        no_advice = error["message"].replace(", or set truncation to 'auto'", "")
        assert auto.json()["error"] == {**error, "message": no_advice}
        assert "x-hotloop-truncated-items" not in auto.headers
        # with max_output_tokens too
        d = create(s, input=items, max_output_tokens=20)
        a = create(s, input=items, max_output_tokens=20, truncation="auto")
        assert a.status_code == d.status_code == 400
        assert d.json()["error"]["message"].endswith("or of max_output_tokens, or set truncation to 'auto'.")
        assert a.json()["error"]["message"] == d.json()["error"]["message"].replace(", or set truncation to 'auto'", "")
        assert f"({whole} in the input, 20 in the output)" in a.json()["error"]["message"]


@pytest.mark.parametrize("backend", ["cerebras", "openai-compat"])
def test_reasoning_counts_against_the_window_only_where_the_backend_is_sent_it(
    tmp_path: Path, mock: MockChatServer, backend: str
) -> None:
    """An earlier reasoning item goes back to a Cerebras model (on its assistant message); the
    OpenAI-compatible dialect sends no reasoning history, so there it takes no room in the
    window: a short follow-up after long reasoning runs instead of a 400, and is counted as
    what the backend is sent."""
    mock.reset()
    thought = PARAGRAPH * 6  # over the window alone
    items = [
        {"type": "message", "role": "user", "content": "first"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": thought}]},
        {"type": "message", "role": "assistant", "content": "answer"},
        {"type": "message", "role": "user", "content": "and then?"},
    ]
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"mock-model": {"context_window": WINDOW}}))
    env = {"HOTLOOP_BACKEND_RETRIES": "0"}
    if backend == "cerebras":
        env.update({"CEREBRAS_API_KEY": "csk-window-0123", "CEREBRAS_BASE_URL": mock.url})
        args: tuple[str, ...] = ("--backend", "cerebras")
    else:
        env["HOTLOOP_BACKEND_API_KEY"] = "sk-window-0123"
        args = ("--backend", "openai-compat", "--base-url", mock.v1)
    with run_server(tmp_path, *args, "--model", "mock-model", "--model-limits", str(limits), "--store", "memory", env=env) as s:
        r = httpx.post(f"{s.v1}/responses/input_tokens", json={"model": "mock-model", "input": items}, timeout=10)
        assert r.status_code == 200, r.text
        counted = r.json()["input_tokens"]
        without = httpx.post(
            f"{s.v1}/responses/input_tokens", json={"model": "mock-model", "input": items[:1] + items[2:]}, timeout=10
        ).json()["input_tokens"]
        created = httpx.post(f"{s.v1}/responses", json={"model": "mock-model", "input": items}, timeout=30)
        if backend == "cerebras":
            assert counted > WINDOW > without
            assert created.status_code == 400 and created.json()["error"]["code"] == "context_length_exceeded"
            assert not mock.requests
        else:
            assert counted == without < WINDOW
            assert created.status_code == 200, created.text
            sent = mock.requests[0].json["messages"]
            assert thought.strip() not in json.dumps(sent)  # (what is counted is what is sent)
