"""Prefix reuse (full-history clients) against a computation from scratch: the same request sent
to a server with the prefix cache and to one without it (``HOTLOOP_PREFIX_CACHE_ENTRIES=0``), each
with its own scripted chat backend, must get the same answer: status and error (``param``
included), ``input_tokens``, the messages sent to the backend and the stored ``input_items`` (ids
the server minted aside)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import Server, run_server
from tests.mock_chat_server import MockChatServer, Reply, chunk, text_events, tool_events

ANSWER = "answer"
LONG = "lorem ipsum dolor " * 30  # a first message of more than 256 bytes: matched by its bytes
MINTED = re.compile(r"\b(msg|fc|rs|resp)_[0-9a-f]{16,}")


class Pair:
    def __init__(self, cached: Server, scratch: Server, mocks: tuple[MockChatServer, MockChatServer]) -> None:
        self.servers = (cached, scratch)
        self.mocks = mocks

    def post(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """``body`` sent to both servers: what each answered (status, JSON, the backend's request,
        the stored input items)."""
        out = []
        for server, mock in zip(self.servers, self.mocks):
            n = len(mock.requests)
            r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
            got: dict[str, Any] = {"status": r.status_code, "json": r.json()}
            got["backend"] = mock.requests[n].json if len(mock.requests) > n else None
            if r.status_code == 200 and body.get("store", True):
                url = f"{server.v1}/responses/{got['json']['id']}/input_items"
                got["items"] = httpx.get(url, params={"order": "asc", "limit": 100}, timeout=30).json()["data"]
            out.append(got)
        return out

    def hits(self) -> int:
        return self.stat("hits")

    def stat(self, name: str) -> int:
        return int(httpx.get(self.servers[0].base + "/hotloop/stats", timeout=5).json()["prefix_cache"][name])


def _norm(value: Any) -> Any:
    return json.loads(MINTED.sub(lambda m: m.group(1) + "_minted", json.dumps(value)))


def assert_same(got: list[dict[str, Any]]) -> dict[str, Any]:
    cached, scratch = got
    assert cached["status"] == scratch["status"], (cached["json"], scratch["json"])
    if cached["status"] != 200:
        assert _norm(cached["json"]["error"]) == _norm(scratch["json"]["error"])
        return cached
    assert cached["json"]["usage"]["input_tokens"] == scratch["json"]["usage"]["input_tokens"]
    assert _norm(cached["backend"]) == _norm(scratch["backend"])
    return cached


@contextlib.contextmanager
def _pair(tmp: Path, store: str = "memory", env: dict[str, str] | None = None, entry: tuple[str, ...] = ("-m", "hotloop")) -> Iterator[Pair]:
    """A server with the prefix cache (``env``: its settings besides) and one without it (both
    started by ``entry``)."""
    with MockChatServer() as m1, MockChatServer() as m2:
        for m in (m1, m2):  # no usage chunk: input_tokens is the server's own count
            m.default_reply = lambda: Reply.stream(text_events(ANSWER)[:-1])
        args = ("--backend", "openai-compat", "--model", "mock-model", "--store", store)
        with run_server(tmp, *args, "--base-url", m1.v1, env=env, entry=entry) as s, run_server(
            tmp, *args, "--base-url", m2.v1, env={"HOTLOOP_PREFIX_CACHE_ENTRIES": "0"}, entry=entry
        ) as ref:
            yield Pair(s, ref, (m1, m2))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with _pair(tmp_path_factory.mktemp("prefixaudit")) as got:
        yield got


def _user(text: str, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text, **extra}


_ASSISTANT = {"role": "assistant", "content": ANSWER}


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("spelling", ["same bytes", "as parts"])
def test_a_reference_to_an_item_of_the_reused_prefix_is_answered_as_from_scratch(pair: Pair, store: bool, spelling: str) -> None:
    # the first item carries an id of the client's; a later item_reference names it. From scratch
    # the reference resolves to that item of the input itself, which is then sent twice: 400
    # "Duplicate item found". A prefix hit resolved it from the cached prefix instead (200).
    tag = f"{int(store)}{spelling[0]}"
    first = _user("first " + LONG, id=f"msg_audit_ref{tag}")
    assert_same(pair.post({"model": "mock-model", "store": store, "input": [first]}))
    if spelling == "as parts":  # other bytes: matched by fingerprint
        first = {**first, "content": [{"type": "input_text", "text": first["content"]}]}
    hits = pair.hits()
    history = [first, _ASSISTANT, _user("again"), {"type": "item_reference", "id": first["id"]}]
    got = assert_same(pair.post({"model": "mock-model", "store": store, "input": history}))
    assert got["status"] == 400 and got["json"]["error"]["param"] == "input", got["json"]
    assert "Duplicate item found" in got["json"]["error"]["message"]
    # without the reference the same history reuses the prefix
    assert_same(pair.post({"model": "mock-model", "store": store, "input": history[:3]}))
    assert pair.hits() == hits + 1


@pytest.mark.parametrize("store", [True, False])
def test_ids_of_the_cached_twin_that_the_client_did_not_send_are_not_reused(pair: Pair, store: bool) -> None:
    # a conversation registered with a client-chosen id on its first item; then the same first
    # item sent without an id (matched by fingerprint), and that id named or carried later
    tag = str(int(store))
    first = _user("twin " + LONG, id=f"msg_audit_twin{tag}")
    assert_same(pair.post({"model": "mock-model", "store": store, "input": [first]}))
    bare = {k: v for k, v in first.items() if k != "id"}
    ref = [bare, _ASSISTANT, _user("x"), {"type": "item_reference", "id": first["id"]}]
    got = assert_same(pair.post({"model": "mock-model", "store": store, "input": ref}))
    assert got["status"] == 400 and got["json"]["error"]["param"] == "input[3]", got["json"]  # not found
    carried = [bare, _ASSISTANT, _user("y", id=first["id"])]
    got = assert_same(pair.post({"model": "mock-model", "store": store, "input": carried}))
    assert got["status"] == 200, got["json"]
    if store:
        assert [it.get("id") for it in got["items"]][2] == first["id"]


def test_an_output_sent_back_and_then_referenced_is_answered_as_from_scratch(pair: Pair) -> None:
    # a client that sends back the output it was given (with its id) and then an item_reference
    # to it: from scratch a duplicate (400); the reuse of that output (continued) resolved it
    opening = _user("output " + LONG)
    first = pair.post({"model": "mock-model", "input": [opening]})
    results = []
    for (server, mock), answer in zip(zip(pair.servers, pair.mocks), first):
        out = answer["json"]["output"][0]
        body = {"model": "mock-model", "input": [opening, out, _user("q"), {"type": "item_reference", "id": out["id"]}]}
        r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
        results.append({"status": r.status_code, "json": r.json(), "backend": None})
    got = assert_same(results)
    assert got["status"] == 400 and "Duplicate item found" in got["json"]["error"]["message"], got["json"]


def _thinking_call(step: int) -> Reply:
    """A reasoning model's tool call (no usage chunk: input_tokens is the server's own count)."""
    reasoning = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning": f"step {step}: run it " * 12})]
    return Reply.stream(reasoning + tool_events([(f"call_{step}", "run", '{"cmd": "make test"}')])[1:-1])


_RUN = {"type": "function", "name": "run", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}


def _ai_sdk_history(outputs: list[list[dict[str, Any]]], opening: dict[str, Any]) -> list[dict[str, Any]]:
    """The Vercel AI SDK's input under ``store: true`` (its default): each earlier reasoning item
    as an ``item_reference``, each call spelled out without its id, then the call's output."""
    history = [opening]
    for step, output in enumerate(outputs):
        for item in output:
            if item["type"] == "reasoning":
                history.append({"type": "item_reference", "id": item["id"]})
            elif item["type"] == "function_call":
                history.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
                history.append({"type": "function_call_output", "call_id": item["call_id"], "output": f"ok {step} " * 40})
    return history


def test_histories_that_refer_to_reasoning_items_reuse_the_prefix(pair: Pair) -> None:
    _ai_sdk_steps(pair)


def test_histories_that_refer_to_reasoning_items_of_stored_responses_not_in_memory(tmp_path: Path) -> None:
    # the referenced reasoning comes from the SQLite store each time (no cache of stored
    # responses): another object than the one the registered input resolved to, the same item
    with _pair(tmp_path, "sqlite", {"HOTLOOP_RESPONSE_CACHE_ENTRIES": "0"}) as got:
        _ai_sdk_steps(got)


def test_a_history_naming_more_items_than_a_request_may_look_up_is_refused_as_from_scratch(tmp_path: Path) -> None:
    # (the bound lowered to 3 in both servers) step 3's history names three stored reasoning
    # items, step 4's four: both servers answer step 4 with item_not_found, the cached one too,
    # whose raw hit on step 3's bytes checked only the three it had registered
    entry = (
        "-c",
        "import sys, hotloop.server.engine as e, hotloop.cli as c; e.MAX_REFERENCE_LOOKUPS = 3; sys.exit(c.main(sys.argv[1:]))",
    )
    with _pair(tmp_path, entry=entry) as pair:
        got = _ai_sdk_steps(pair, steps=5, until=4)
    assert got["status"] == 400 and got["json"]["error"]["code"] == "item_not_found", got["json"]


def _ai_sdk_steps(pair: Pair, steps: int = 4, until: int | None = None) -> dict[str, Any]:
    # Each server gets its own history (the ids are its own), in the AI SDK's shape; both answer
    # alike, and the cached one reuses the conversation so far at every step from the second on,
    # matched by the bytes of the previous step's input (its references still name the same
    # items). Deleting the response whose reasoning a history names: both answer
    # item_not_found (the input it extends by its bytes names that item: matched whole instead).
    opening = _user("fix the build " + LONG)
    outputs: list[list[list[dict[str, Any]]]] = [[], []]
    ids: list[list[str]] = [[], []]
    cached: list[tuple[int, int]] = []  # the cached server's (input_tokens, cached_tokens) a step
    for step in range(steps):
        hits, raw_hits = pair.hits(), pair.stat("raw_hits")
        results = []
        for k, (server, mock) in enumerate(zip(pair.servers, pair.mocks)):
            mock.push(_thinking_call(step))
            n = len(mock.requests)
            body = {"model": "mock-model", "store": True, "tools": [_RUN], "input": _ai_sdk_history(outputs[k], opening)}
            r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
            results.append({"status": r.status_code, "json": r.json(), "backend": mock.requests[n].json if len(mock.requests) > n else None})
            if r.status_code == 200:
                outputs[k].append(r.json()["output"])
                ids[k].append(r.json()["id"])
        got = assert_same(results)
        if step == until:
            return got
        assert got["status"] == 200, got["json"]
        assert [o["type"] for o in got["json"]["output"]] == ["reasoning", "function_call"]
        assert pair.hits() == hits + (step > 0), step
        assert pair.stat("raw_hits") == raw_hits + (step > 0), step
        # reused: the whole conversation before this step's output, not only its opening
        usage = got["json"]["usage"]
        cached.append((usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]))
        if step > 0:
            assert cached[-1][1] > cached[-2][0], cached
    for k, server in enumerate(pair.servers):
        assert httpx.delete(f"{server.v1}/responses/{ids[k][1]}", timeout=30).status_code == 200
    raw_hits = pair.stat("raw_hits")
    results = []
    for k, (server, mock) in enumerate(zip(pair.servers, pair.mocks)):
        body = {"model": "mock-model", "store": True, "tools": [_RUN], "input": _ai_sdk_history(outputs[k], opening)}
        r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
        results.append({"status": r.status_code, "json": r.json(), "backend": None})
    got = assert_same(results)
    assert got["status"] == 400 and got["json"]["error"]["code"] == "item_not_found", got["json"]
    assert got["json"]["error"]["param"] == "input[4]"
    assert outputs[0][1][0]["id"] in got["json"]["error"]["message"]
    assert pair.stat("raw_hits") == raw_hits
    # the deleted response's call, which the histories after it sent back spelled out (no id):
    # from scratch the responses after it gave it ids of their own, so its id names nothing now;
    # the cached server's later responses hold it as their parent's, not as their own
    results = []
    for k, server in enumerate(pair.servers):
        call = next(o for o in outputs[k][1] if o["type"] == "function_call")
        body = {"model": "mock-model", "store": True, "input": [opening, {"type": "item_reference", "id": call["id"]}]}
        r = httpx.post(server.v1 + "/responses", json=body, timeout=30)
        results.append({"status": r.status_code, "json": r.json(), "backend": None})
    got = assert_same(results)
    assert got["status"] == 400 and got["json"]["error"]["code"] == "item_not_found", got["json"]
    return got
