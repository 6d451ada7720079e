"""Stored responses over their lifetime, against a real server and the openai SDK: a
``store: true`` response is retrievable while it is still being generated (``in_progress``),
a ``DELETE`` while it streams is not undone by the stream's end, and the endpoints answer a
response another tenant is streaming exactly like a missing one."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from openai import OpenAI
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, run_server
from tests.integration.test_tenants import create_key

MODEL = "hotloop-sim"
# a response that streams for about 2 s (40 tokens at 20 tokens/s)
SLOW = {"sim": "text,tokens:40,rate:20"}


class Env:
    def __init__(self, server: Server, keys: dict[str, str]) -> None:
        self.server = server
        self.keys = keys

    def client(self, name: str = "alice") -> OpenAI:
        return OpenAI(api_key=self.keys[name], base_url=self.server.v1, max_retries=0, timeout=30)

    def http(self, name: str = "alice") -> httpx.Client:
        return httpx.Client(base_url=self.server.v1, headers={"Authorization": f"Bearer {self.keys[name]}"}, timeout=30)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("store-audit")
    data = tmp / "data"
    keys = {name: create_key(data, name) for name in ("alice", "bob")}
    with run_server(tmp, "--sim-rate", "0", env={"HOTLOOP_DATA_DIR": str(data)}) as srv:
        yield Env(srv, keys)


def _missing_body(http: httpx.Client, rid: str, path: str = "", method: str = "GET") -> dict[str, Any]:
    """The 404 body for ``rid`` (the id is the only thing that differs between two missing ids)."""
    r = http.request(method, f"/responses/{rid}{path}")
    assert r.status_code == 404, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    body["error"]["message"] = body["error"]["message"].replace(rid, "<id>")
    return body  # type: ignore[no-any-return]


def test_a_streaming_stored_response_is_retrievable_in_progress(env: Env) -> None:
    """``GET /v1/responses/{id}`` of a ``store: true`` response still streaming answered 404
    (OpenAI answers the Response with ``status: "in_progress"``): a client that polls a
    response it saw created (another process, a UI) was told it did not exist. It is the
    Response as streamed so far (``in_progress``, no usage, the output items begun), its
    ``input_items`` the input it will list once done, and after the end the final object."""
    client, http = env.client(), env.http()
    seen: dict[str, Any] = {}
    seen_item: str | None = None
    with client.responses.create(model=MODEL, input="hello", stream=True, metadata=SLOW) as stream:
        deltas = 0
        for e in stream:
            if e.type == "response.created":
                rid = e.response.id
                got = client.responses.retrieve(rid)  # (before the fix: NotFoundError)
                assert got.id == rid and got.status == "in_progress" and got.usage is None
                assert got.model_dump().get("store") is True and got.metadata == SLOW
                seen["first"] = got
                items = client.responses.input_items.list(rid, order="asc")
                seen["items"] = [i.model_dump() for i in items.data]
                assert [i.type for i in items.data] == ["message"] and items.data[0].id
            elif e.type == "response.output_text.delta":
                deltas += 1
                if deltas == 5:
                    mid = client.responses.retrieve(rid)
                    assert mid.status == "in_progress"
                    assert [o.id for o in mid.output] == [seen_item]
            elif e.type == "response.output_item.added":
                seen_item = e.item.id
            elif e.type == "response.completed":
                final = e.response
    assert deltas >= 5
    done = client.responses.retrieve(rid)
    assert done.model_dump() == final.model_dump()
    assert [i.model_dump() for i in client.responses.input_items.list(rid, order="asc").data] == seen["items"]
    # raw body: the same shape as the streamed response.created object
    raw = http.get(f"/responses/{rid}").json()
    assert raw["status"] == "completed"


def test_an_in_progress_response_is_not_shown_to_others_nor_when_not_stored(env: Env) -> None:
    """Another tenant's streaming response, and a ``store: false`` one, answer exactly like
    a missing id (GET, input_items, DELETE, cancel)."""
    alice, bob = env.client("alice"), env.http("bob")
    for store, who in ((True, bob), (False, env.http("alice"))):
        with alice.responses.create(model=MODEL, input="hello", stream=True, metadata=SLOW, store=store) as stream:
            for e in stream:
                if e.type == "response.created":
                    rid = e.response.id
                    for path, method in (("", "GET"), ("/input_items", "GET"), ("", "DELETE")):
                        assert _missing_body(who, rid, path, method) == _missing_body(who, "resp_" + "0" * 48, path, method)
                    c = who.post(f"/responses/{rid}/cancel")
                    assert c.status_code == 404
                    break
    time.sleep(0.1)


def test_delete_while_streaming_is_not_undone_by_the_stream_end(env: Env) -> None:
    """A ``DELETE`` of a stored response while it streams answered 404, and once the stream
    ended the response was stored after all (GET 200, continuable): a delete that said "not
    found" and then the response appeared. The delete now waits for the response to finish
    (a bounded wait), deletes it, and answers ``deleted: true``; the stream itself ends
    normally; afterwards it is gone everywhere."""
    client, http = env.client(), env.http()
    answers: list[httpx.Response] = []
    t: threading.Thread | None = None
    with client.responses.create(model=MODEL, input="hello", stream=True, metadata=SLOW) as stream:
        for e in stream:
            if e.type == "response.created":
                rid = e.response.id
            elif e.type == "response.output_text.delta" and t is None:  # one DELETE (it answers after the end)
                t = threading.Thread(target=lambda: answers.append(env.http().delete(f"/responses/{rid}")))
                t.start()
            elif e.type == "response.completed":
                assert e.response.status == "completed"
    assert t is not None
    t.join(timeout=30)
    assert len(answers) == 1 and answers[0].status_code == 200, answers
    assert answers[0].json() == {"id": rid, "object": "response", "deleted": True}
    time.sleep(0.5)  # (past the store's write lag)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(rid)
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=MODEL, input="more", previous_response_id=rid)
    assert ei.value.code == "previous_response_not_found"
    assert http.delete(f"/responses/{rid}").status_code == 404


def test_a_delete_waiting_for_a_response_whose_client_leaves_answers_at_once(env: Env) -> None:
    """A ``DELETE`` waiting for a response in flight whose client then leaves: the response is
    cut short and never stored, so the wait ends with it (woken, not polled, nor held to its
    10 s bound) and the answer is the 404 of any unknown id; other DELETEs of it, before and
    after, answer alike."""
    client = env.client()
    answers: list[tuple[float, httpx.Response]] = []
    threads: list[threading.Thread] = []

    def delete(rid: str) -> None:
        answers.append((time.monotonic(), env.http().delete(f"/responses/{rid}")))

    with client.responses.create(model=MODEL, input="hello", stream=True, metadata=SLOW) as stream:
        for e in stream:
            if e.type == "response.created":
                rid = e.response.id
            elif e.type == "response.output_text.delta":
                threads = [threading.Thread(target=delete, args=(rid,)) for _ in range(2)]
                for t in threads:
                    t.start()
                time.sleep(0.3)  # both DELETEs wait for it
                break
        left = time.monotonic()
    for t in threads:
        t.join(timeout=30)
    assert len(answers) == 2
    for at, r in answers:
        assert r.status_code == 404, r.text
        assert at - left < 3.0  # the response's end woke them (it would have streamed ~2 s more)
    assert env.http().delete(f"/responses/{rid}").status_code == 404


def test_delete_while_streaming_over_websocket_drops_it_from_the_connection(env: Env) -> None:
    """The same over WebSocket: the connection that streamed the response does not continue
    it from its own cache after the delete."""
    url = env.server.ws + "/responses"
    with ws_connect(url, open_timeout=10, additional_headers={"Authorization": f"Bearer {env.keys['alice']}"}) as ws:
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "hi", "metadata": SLOW}))
        answers: list[httpx.Response] = []
        t: threading.Thread | None = None
        while True:
            ev = json.loads(ws.recv(timeout=30))
            if ev["type"] == "response.created":
                rid = ev["response"]["id"]
                t = threading.Thread(target=lambda: answers.append(env.http().delete(f"/responses/{rid}")))
                t.start()
            if ev["type"] in ("response.completed", "response.failed", "error"):
                assert ev["type"] == "response.completed"
                break
        assert t is not None
        t.join(timeout=30)
        assert answers and answers[0].status_code == 200, answers[0].text
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "more", "previous_response_id": rid}))
        ev = json.loads(ws.recv(timeout=30))
        assert ev["type"] == "error" and ev["error"]["code"] == "previous_response_not_found"


def test_delete_of_a_response_streaming_past_the_wait_is_a_409_and_deletes_nothing(tmp_path: Path) -> None:
    """A response that streams longer than the delete's wait: ``409`` (retry later), nothing
    deleted; the stream ends normally and the response is stored, then deletable."""
    entry = (
        "-c",
        "import sys, hotloop.server.http as h, hotloop.cli as c; h.IN_FLIGHT_DELETE_WAIT = 0.3; sys.exit(c.main(sys.argv[1:]))",
    )
    with run_server(tmp_path, "--sim-rate", "0", "--store", "memory", entry=entry) as s:
        client = OpenAI(api_key="sk-test", base_url=s.v1, max_retries=0, timeout=30)
        with client.responses.create(model=MODEL, input="hello", stream=True, metadata=SLOW) as stream:
            for e in stream:
                if e.type == "response.created":
                    rid = e.response.id
                    r = httpx.delete(f"{s.v1}/responses/{rid}", timeout=10)
                    assert r.status_code == 409, r.text
                    err = r.json()["error"]
                    assert err["type"] == "invalid_request_error" and err["code"] == "response_in_progress"
                    assert err["param"] is None and r.headers.get("retry-after")
        time.sleep(0.3)
        assert client.responses.retrieve(rid).status == "completed"
        assert httpx.delete(f"{s.v1}/responses/{rid}", timeout=10).status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)


def test_cancel_of_a_streaming_response_says_why_not_that_it_is_missing(env: Env) -> None:
    """``POST /v1/responses/{id}/cancel`` of a stored response still streaming answered 404
    (while GET showed it): it is the 400 every non-background response gets (only background
    responses can be cancelled), and the stream goes on to its end."""
    client = env.client()
    with client.responses.create(model=MODEL, input="hello", stream=True, metadata=SLOW) as stream:
        for e in stream:
            if e.type == "response.created":
                with pytest.raises(openai.BadRequestError) as ei:  # (before the fix: NotFoundError)
                    client.responses.cancel(e.response.id)
                assert "background" in ei.value.message
            elif e.type == "response.completed":
                assert e.response.status == "completed"


def test_a_websocket_response_in_flight_is_retrievable(env: Env) -> None:
    """A response streaming over WebSocket is retrievable over HTTP while it runs (the id is
    in ``response.created``), by its tenant only."""
    url = env.server.ws + "/responses"
    with ws_connect(url, open_timeout=10, additional_headers={"Authorization": f"Bearer {env.keys['alice']}"}) as ws:
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "hi", "metadata": SLOW}))
        while True:
            ev = json.loads(ws.recv(timeout=30))
            if ev["type"] == "response.created":
                rid = ev["response"]["id"]
                got = env.http().get(f"/responses/{rid}")
                assert got.status_code == 200 and got.json()["status"] == "in_progress", got.text
                assert _missing_body(env.http("bob"), rid) == _missing_body(env.http("bob"), "resp_" + "1" * 48)
            if ev["type"] in ("response.completed", "response.failed", "error"):
                assert ev["type"] == "response.completed"
                break
    assert env.client().responses.retrieve(rid).status == "completed"


def test_two_deletes_at_once_answer_one_200_and_one_404(env: Env) -> None:
    """Two DELETEs of one stored (and cached) response sent at the same moment: the store
    deleted it once, and the other answered 200 all the same (it had seen the response in the
    cache before its wait), where one sent after the first answers 404."""
    import asyncio

    async def race(c: httpx.AsyncClient) -> list[tuple[int, int]]:
        outcomes = []
        for i in range(12):
            r = await c.post("/responses", json={"model": "hotloop-sim", "input": f"twice {i}"})
            rid = r.json()["id"]
            a, b = await asyncio.gather(c.delete(f"/responses/{rid}"), c.delete(f"/responses/{rid}"))
            outcomes.append(tuple(sorted((a.status_code, b.status_code))))
        return outcomes  # type: ignore[return-value]

    async def main() -> list[tuple[int, int]]:
        headers = {"Authorization": f"Bearer {env.keys['alice']}"}
        async with httpx.AsyncClient(base_url=env.server.v1, headers=headers, timeout=30) as c:
            return await race(c)

    assert set(asyncio.run(main())) == {(200, 404)}
