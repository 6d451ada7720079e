"""``--secrets redact`` with secrets inside call ids, on a real server and a chat backend: two
calls whose ids hold two different secrets of one kind keep two distinct tool call ids (each
``[REDACTED:<kind>:<tag>]``), each tool message names its own call, within a request and across
``previous_response_id`` (the stored calls pair with outputs redacted a turn later) and a prefix
hit of a client resending its history."""

from __future__ import annotations

import json
import re
import secrets as rnd
import string
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import Server, run_server
from tests.mock_chat_server import MockChatServer, Reply, text_events

ALNUM = string.ascii_letters + string.digits
MARKER = re.compile(r"\[REDACTED:github_token:[0-9a-f]{12}\]")


def gh() -> str:
    return "gh" + "p_" + "".join(rnd.choice(ALNUM) for _ in range(36))


def call(call_id: str, n: int) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "sh", "arguments": json.dumps({"n": n})}


def output(call_id: str, n: int) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": f"out {n}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, MockChatServer]]:
    tmp = tmp_path_factory.mktemp("redactcallids")
    with MockChatServer() as mock:
        args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model", "--secrets", "redact")
        with run_server(tmp, *args) as s:
            yield s, mock


def create(server: Server, mock: MockChatServer, **body: Any) -> dict[str, Any]:
    # no usage chunk: the usage reported is the server's own (cached_tokens: the reused prefix)
    mock.push(Reply.stream(text_events("ok")[:-1]))
    r = httpx.post(server.v1 + "/responses", json={"model": "mock-model", **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def pairs(messages: list[dict[str, Any]]) -> dict[int, tuple[str, str]]:
    """Per call (its ``n`` argument): its tool call id and the tool_call_id of the output naming
    ``out <n>``."""
    ids = {json.loads(tc["function"]["arguments"])["n"]: tc["id"]
           for m in messages if m["role"] == "assistant" for tc in m.get("tool_calls", ())}
    outs = {int(m["content"].split()[1]): m["tool_call_id"] for m in messages if m["role"] == "tool"}
    assert sorted(ids) == sorted(outs)
    return {n: (ids[n], outs[n]) for n in ids}


def check(body: bytes, messages: list[dict[str, Any]], secrets: tuple[str, ...]) -> list[str]:
    for secret in secrets:
        assert secret.encode() not in body
    found = pairs(messages)
    ids = [call_id for call_id, _ in found.values()]
    assert len(set(ids)) == len(ids) == 2, ids  # two calls, two ids
    for call_id, out_id in found.values():
        assert out_id == call_id  # each tool message references its own call
        assert MARKER.fullmatch(call_id), call_id
    return ids


def test_two_secrets_in_call_ids_keep_two_distinct_calls(served: tuple[Server, MockChatServer]) -> None:
    server, mock = served
    mock.requests.clear()
    a, b = gh(), gh()
    items = [{"role": "user", "content": "run both"}, call(a, 1), call(b, 2), output(a, 1), output(b, 2)]
    resp = create(server, mock, input=items)
    (req,) = mock.requests
    ids = check(req.body, req.json["messages"], (a, b))
    # stored as sent to the backend
    listed = httpx.get(f"{server.v1}/responses/{resp['id']}/input_items", params={"order": "asc"}, timeout=10).json()["data"]
    assert a not in str(listed) and b not in str(listed)
    assert [it["call_id"] for it in listed if it["type"] == "function_call"] == ids
    assert [it["call_id"] for it in listed if it["type"] == "function_call_output"] == ids


def test_outputs_sent_a_turn_later_pair_with_the_stored_calls(served: tuple[Server, MockChatServer]) -> None:
    server, mock = served
    mock.requests.clear()
    a, b = gh(), gh()
    first = create(server, mock, input=[{"role": "user", "content": "run both"}, call(a, 1), call(b, 2)])
    # the outputs come with the next turn (in the other order), and a third turn follows
    second = create(server, mock, previous_response_id=first["id"], input=[output(b, 2), output(a, 1)])
    third = create(server, mock, previous_response_id=second["id"], input="thanks")
    # a client resending its whole history, the secrets as it has them: the redacted prefix is
    # reused and the ids still pair
    history = [{"role": "user", "content": "run both"}, call(a, 1), call(b, 2), *first["output"],
               output(b, 2), output(a, 1), *second["output"], {"role": "user", "content": "thanks"},
               *third["output"], {"role": "user", "content": "and now?"}]
    fourth = create(server, mock, input=history)
    assert fourth["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert len(mock.requests) == 4
    ids = [check(req.body, req.json["messages"], (a, b)) for req in mock.requests[1:]]
    assert ids[0] == ids[1] == ids[2]
