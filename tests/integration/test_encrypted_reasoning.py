"""A reasoning item's ``encrypted_content`` through a real ``hotloop serve``: returned when the
request's ``include`` asks for ``reasoning.encrypted_content`` or the request has ``store: false``
(in ``output_item.done``, the terminal event, the JSON response, the stored response and GET;
never in ``output_item.added``, and nowhere for a request that asks for neither), and read back:
an item sent back with only its encrypted content reaches the model as its reasoning (the
simulator's input token count; the cerebras backend's request, :mod:`tests.mock_chat_server`),
and a token this server did not seal is accepted and ignored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from openai import OpenAI
from websockets.sync.client import connect as ws_connect

from hotloop.bench.loop import StreamCheck
from tests.conftest import Server, raw_until_terminal, run_server
from tests.integration.chat_backends import _fresh_mock, cerebras, transport  # noqa: F401
from tests.mock_chat_server import MockChatServer, Reply, text_events, usage

INCLUDE = ["reasoning.encrypted_content"]
SIM = {"sim": "reasoning,tokens:8"}
FOREIGN = "gAAAAABpZ2Zvb2JhcmJhemZvb2JhcmJhemZvb2Jhcg=="  # the shape of OpenAI's


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "hotloop-sim", "input": "Think about the weather, then answer.", "metadata": SIM, **kw}


def sse(server: Server, b: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    with httpx.stream("POST", server.v1 + "/responses", json={**b, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    sc = StreamCheck()
    for e in events:
        sc.feed(e)
    assert sc.finish() == []
    return events, raw


def sealed_item(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The reasoning item, after checking where its encrypted content is and is not."""
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert added and all("encrypted_content" not in e["item"] for e in added)
    (done,) = [e for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "reasoning"]
    item = done["item"]
    assert item["encrypted_content"].startswith("hl1.")
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["output"][0] == item
    return item  # type: ignore[no-any-return]


def test_returned_with_include(server: Server) -> None:
    for summary in (None, {"summary": "auto"}):
        extra = {"reasoning": summary} if summary else {}
        events, _ = sse(server, body(include=INCLUDE, **extra))
        item = sealed_item(events)
        assert ("content" in item) is (summary is None) and ("summary" in item)
        final = events[-1]["response"]
        got = httpx.get(f"{server.v1}/responses/{final['id']}", timeout=10)  # stored with it
        assert got.status_code == 200 and got.json() == final
    r = httpx.post(server.v1 + "/responses", json=body(include=INCLUDE, reasoning={"summary": "auto"}), timeout=30)
    assert r.status_code == 200
    js = r.json()
    assert js["output"][0]["encrypted_content"] == item["encrypted_content"]  # the same text sealed the same
    assert httpx.get(f"{server.v1}/responses/{js['id']}", timeout=10).json() == js


def test_retrieve_with_include_returns_it(server: Server) -> None:
    """GET /v1/responses/{id} with ``include[]=reasoning.encrypted_content`` (how the SDKs write
    ``retrieve(id, include=[...])``) returns each reasoning item with the token a create asking
    for it gets; without ``include`` the stored response as it is."""
    client = OpenAI(api_key="k", base_url=server.v1, max_retries=0)
    for summary in (None, {"summary": "auto"}):
        extra: dict[str, Any] = {"reasoning": summary} if summary else {}
        sealed_js = httpx.post(server.v1 + "/responses", json=body(include=INCLUDE, **extra), timeout=30).json()
        plain = httpx.post(server.v1 + "/responses", json=body(**extra), timeout=30).json()
        assert "encrypted_content" not in json.dumps(plain)
        got = client.responses.retrieve(plain["id"], include=["reasoning.encrypted_content"])  # type: ignore[list-item]
        item = got.output[0]
        assert item.type == "reasoning" and item.encrypted_content == sealed_js["output"][0]["encrypted_content"]
        raw = httpx.get(f"{server.v1}/responses/{plain['id']}?include=reasoning.encrypted_content", timeout=10).json()
        assert list(raw["output"][0])[:3] == ["id", "type", "encrypted_content"]
        assert raw == {**plain, "output": [raw["output"][0], *plain["output"][1:]]}
        assert httpx.get(f"{server.v1}/responses/{plain['id']}", timeout=10).json() == plain  # stored unchanged
        # a value it does not know is ignored, as create ignores it
        other = httpx.get(f"{server.v1}/responses/{plain['id']}?include[]=nope", timeout=10)
        assert other.status_code == 200 and other.json() == plain


def test_returned_when_not_stored(server: Server) -> None:
    events, _ = sse(server, body(store=False, reasoning={"summary": "auto"}))
    item = sealed_item(events)
    r = httpx.post(server.v1 + "/responses", json=body(store=False, reasoning={"summary": "auto"}), timeout=30)
    assert r.status_code == 200 and r.json()["output"][0] == {**item, "id": r.json()["output"][0]["id"]}
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        ws.send(json.dumps({"type": "response.create", **body(store=False, reasoning={"summary": "auto"})}))
        ws_item = sealed_item(raw_until_terminal(ws))
    assert ws_item["encrypted_content"] == item["encrypted_content"]


def test_absent_when_not_asked(server: Server) -> None:
    for extra in ({}, {"reasoning": {"summary": "auto"}}, {"include": ["message.output_text.logprobs"]}, {"store": True}):
        _, raw = sse(server, body(**extra))
        assert "encrypted_content" not in raw
        r = httpx.post(server.v1 + "/responses", json=body(**extra), timeout=30)
        assert r.status_code == 200 and "encrypted_content" not in r.text
        assert "encrypted_content" not in httpx.get(f"{server.v1}/responses/{r.json()['id']}", timeout=10).text


def test_include_is_validated(server: Server) -> None:
    # an unknown value is accepted and ignored (protocol.request, INCLUDABLE); a known one works
    r = httpx.post(server.v1 + "/responses", json=body(include=["reasoning.encrypted_content", "nope"]), timeout=30)
    assert r.status_code == 200 and "encrypted_content" in r.text
    r = httpx.post(server.v1 + "/responses", json=body(include="reasoning.encrypted_content"), timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_type", "include")


def input_tokens(server: Server, reasoning: dict[str, Any]) -> int:
    """Input tokens of a stateless turn sending back a history with ``reasoning`` in it."""
    history = [
        {"role": "user", "content": "Think about the weather, then answer."},
        {"type": "reasoning", **reasoning},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "user", "content": "And tomorrow?"},
    ]
    r = httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", "input": history, "store": False,
                                                   "metadata": {"sim": "text,tokens:3"}}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["input_tokens"])


def test_sent_back_it_is_the_reasoning(server: Server) -> None:
    events, _ = sse(server, body(store=False, reasoning={"summary": "auto"}))
    item = sealed_item(events)
    thought = item["summary"][0]["text"]
    token = item["encrypted_content"]
    empty = input_tokens(server, {"summary": []})
    with_summary = input_tokens(server, {"summary": [{"type": "summary_text", "text": thought}]})
    assert with_summary > empty
    # only the encrypted content (and its id, as the AI SDK sends it): counted as the reasoning
    assert input_tokens(server, {"id": item["id"], "summary": [], "encrypted_content": token}) == with_summary
    # another server's token, a tampered one: accepted, ignored
    assert input_tokens(server, {"summary": [], "encrypted_content": FOREIGN}) == empty
    tampered = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    assert input_tokens(server, {"summary": [], "encrypted_content": tampered}) == empty


def test_openai_sdk_parses_it(server: Server) -> None:
    client = OpenAI(api_key="sk-test", base_url=server.v1, max_retries=0, timeout=30)
    r = client.responses.create(model="hotloop-sim", input="Reason first.", include=["reasoning.encrypted_content"],
                                reasoning={"summary": "auto"}, metadata=SIM)  # fmt: skip
    rs = r.output[0]
    assert rs.type == "reasoning" and rs.encrypted_content and rs.encrypted_content.startswith("hl1.")
    with client.responses.stream(model="hotloop-sim", input="Reason first.", store=False, reasoning={"summary": "auto"},
                                 metadata=SIM) as stream:  # fmt: skip
        done = [e for e in stream if e.type == "response.output_item.done" and e.item.type == "reasoning"]
        final = stream.get_final_response()
    assert done[0].item.encrypted_content == final.output[0].encrypted_content == rs.encrypted_content  # type: ignore[union-attr]
    # sent back through the SDK's own types (its ResponseReasoningItemParam)
    follow = client.responses.create(model="hotloop-sim", store=False, metadata={"sim": "text,tokens:3"}, input=[
        {"role": "user", "content": "Reason first."},
        {"type": "reasoning", "id": rs.id, "summary": [], "encrypted_content": rs.encrypted_content},
        {"role": "user", "content": "Go on."},
    ])  # fmt: skip
    assert follow.status == "completed"


@pytest.fixture(scope="module")
def restartable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("restart")


def test_a_sqlite_store_key_outlives_a_restart(restartable: Path) -> None:
    """The key is derived from the store's fingerprint key (kept in the data directory): a token
    sealed before a restart opens after it."""
    env = {"HOTLOOP_DATA_DIR": str(restartable / "data")}
    with run_server(restartable, "--sim-rate", "0", env=env) as s:
        item = sealed_item(sse(s, body(store=False, reasoning={"summary": "auto"}))[0])
        thought = item["summary"][0]["text"]
    with run_server(restartable, "--sim-rate", "0", env=env) as s:
        assert input_tokens(s, {"summary": [], "encrypted_content": item["encrypted_content"]}) == input_tokens(
            s, {"summary": [{"type": "summary_text", "text": thought}]}
        )


# -- a chat backend: what it receives ----------------------------------------------------------------

THOUGHT = "The user greets me; I should greet back."


def chats(mock: MockChatServer) -> list[list[dict[str, Any]]]:
    return [r.json["messages"] for r in mock.requests if r.path.endswith("/chat/completions")]


def test_the_backend_receives_the_unsealed_reasoning(cerebras: Server, mock: MockChatServer) -> None:  # noqa: F811
    reply = Reply.stream(text_events("Hello!", pieces=5, reasoning=THOUGHT, use=usage(20, 10, reasoning=5)))
    mock.push(reply, Reply.stream(text_events("Again!")), Reply.stream(text_events("Third!")))
    first, _ = sse(cerebras, {"model": "gpt-oss-120b", "input": "Hi", "store": False})  # raw reasoning_text, sealed
    rs, msg = first[-1]["response"]["output"]
    assert rs["content"] == [{"type": "reasoning_text", "text": THOUGHT}] and rs["encrypted_content"].startswith("hl1.")

    def follow(reasoning: dict[str, Any]) -> list[dict[str, Any]]:
        history = [
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "id": rs["id"], "summary": [], **reasoning},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}], "id": msg["id"]},
            {"role": "user", "content": "Again"},
        ]
        r = httpx.post(cerebras.v1 + "/responses", json={"model": "gpt-oss-120b", "input": history, "store": False}, timeout=30)
        assert r.status_code == 200, r.text
        return chats(mock)[-1]

    (assistant,) = [m for m in follow({"encrypted_content": rs["encrypted_content"]}) if m["role"] == "assistant"]
    assert assistant == {"role": "assistant", "content": "Hello!", "reasoning": THOUGHT}
    (assistant,) = [m for m in follow({"encrypted_content": FOREIGN}) if m["role"] == "assistant"]
    assert assistant == {"role": "assistant", "content": "Hello!"}  # ignored: no reasoning to send
