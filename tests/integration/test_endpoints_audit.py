"""The endpoints on a stored response other than creating one (wire reference section 4), as the
openai SDK calls them against a real server: retrieving with ``stream``, the ``before`` cursor
of ``input_items`` (sent by SDK versions that had it), its page edges, and counting input
tokens without a ``model``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import run_server

MODEL = "hotloop-sim"


@pytest.fixture()
def client(server: Any) -> OpenAI:
    return OpenAI(api_key="sk-test", base_url=server.v1, max_retries=0, timeout=30)


def _five(client: OpenAI) -> tuple[str, list[str]]:
    """A stored response whose input is five user messages; its id and their ids, in order."""
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": f"m{i}"} for i in range(5)], max_output_tokens=5)
    ids = [i.id for i in client.responses.input_items.list(r.id, order="asc").data]
    assert len(ids) == 5
    return r.id, ids


def _page(client: OpenAI, rid: str, **query: Any) -> tuple[list[str], bool]:
    """One page through the SDK (``query`` as the query string: ``before`` is no keyword of
    the current SDK); its ids and ``has_more``."""
    page = client.responses.input_items.list(rid, extra_query=query)
    return [i.id for i in page.data], page.has_more is True


def test_retrieve_with_stream_true_is_refused_not_an_empty_stream(client: OpenAI) -> None:
    """``GET /v1/responses/{id}?stream=true`` replays the events of a *background* response;
    this server has none. Answering with the JSON object made the SDK's stream end at once
    with no event (the body is no SSE): a client waiting for ``response.completed`` saw
    nothing and no error. It is a 400 naming ``stream``; without it (or ``stream=false``) the
    Response object as before; an unknown id stays a 404."""
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=5)
    with pytest.raises(openai.BadRequestError) as ei:
        stream = client.responses.retrieve(r.id, stream=True)
        list(stream)  # (before the fix: no exception, and no event)
    assert ei.value.status_code == 400
    assert ei.value.param == "stream" and ei.value.type == "invalid_request_error"
    assert "background" in ei.value.message
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.retrieve(r.id, stream=True, starting_after=3)
    assert ei.value.param == "stream"
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    got = httpx.get(f"{str(client.base_url).rstrip('/')}/responses/{r.id}", params={"stream": "false"}, timeout=10)
    assert got.status_code == 200 and got.json()["id"] == r.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_does_not_exist", stream=True)


def test_input_items_before_pages_backwards(client: OpenAI) -> None:
    """``before`` (an item id; a parameter of ``input_items.list`` in earlier openai-python and
    openai-node versions, and in other clients) gives the page just before that item in the
    listing's order. It used to be ignored: the first page came back whatever the cursor."""
    rid, ids = _five(client)
    assert _page(client, rid, order="asc", before=ids[3], limit=2) == ([ids[1], ids[2]], True)
    assert _page(client, rid, order="asc", before=ids[3], limit=3) == ([ids[0], ids[1], ids[2]], False)
    assert _page(client, rid, order="asc", before=ids[1]) == ([ids[0]], False)
    assert _page(client, rid, order="asc", before=ids[0]) == ([], False)
    # desc (the default): newest first, so the items "before" ids[1] are the newer ones
    assert _page(client, rid, before=ids[1], limit=2) == ([ids[3], ids[2]], True)
    assert _page(client, rid, before=ids[1]) == ([ids[4], ids[3], ids[2]], False)
    # with after too: the items between the two cursors
    assert _page(client, rid, order="asc", after=ids[0], before=ids[4]) == ([ids[1], ids[2], ids[3]], False)
    assert _page(client, rid, order="asc", after=ids[0], before=ids[4], limit=2) == ([ids[2], ids[3]], True)
    with pytest.raises(openai.BadRequestError) as ei:
        _page(client, rid, before="msg_not_an_item")
    assert ei.value.param == "before" and ei.value.code == "invalid_value"
    with pytest.raises(openai.NotFoundError):
        _page(client, "resp_does_not_exist", before=ids[1])


def test_input_items_page_edges(client: OpenAI) -> None:
    """limit 1 and 100, after the last item, the first/last ids, and the SDK's auto-pager in
    both orders: every item exactly once, ``has_more`` false on the last page only."""
    rid, ids = _five(client)
    orders: list[tuple[Literal["asc", "desc"], list[str]]] = [("asc", ids), ("desc", ids[::-1])]
    for order, seq in orders:
        assert [i.id for i in client.responses.input_items.list(rid, order=order, limit=1)] == seq  # auto-pager
        for limit in (1, 4, 5, 100):
            page = client.responses.input_items.list(rid, order=order, limit=limit)
            assert [i.id for i in page.data] == seq[:limit] and page.has_more is (limit < 5)
        last = client.responses.input_items.list(rid, order=order, after=seq[-1])
        assert last.data == [] and last.has_more is False
    raw = httpx.get(f"{str(client.base_url).rstrip('/')}/responses/{rid}/input_items", params={"limit": 2}, timeout=10).json()
    assert (raw["first_id"], raw["last_id"], raw["has_more"]) == (ids[4], ids[3], True)
    for bad in (0, 101):
        with pytest.raises(openai.BadRequestError) as ei:
            client.responses.input_items.list(rid, limit=bad)
        assert ei.value.param == "limit"
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.input_items.list(rid, after="msg_not_an_item")
    assert ei.value.param == "after"


def test_input_items_before_from_the_store(tmp_path: Path) -> None:
    """The same pages from the store (a server that has only the file), and from the process."""
    env = {"HOTLOOP_DATA_DIR": str(tmp_path / "data")}
    made: tuple[str, list[str]] | None = None
    for _ in range(2):
        with run_server(tmp_path, "--sim-rate", "0", env=env) as s:
            client = OpenAI(api_key="sk-test", base_url=s.v1, max_retries=0, timeout=30)
            if made is None:
                made = _five(client)
            rid, ids = made
            assert _page(client, rid, order="asc", before=ids[3], limit=2) == ([ids[1], ids[2]], True)
            assert _page(client, rid, before=ids[1], limit=2) == ([ids[3], ids[2]], True)
            with pytest.raises(openai.BadRequestError) as ei:
                _page(client, rid, before="msg_not_an_item")
            assert ei.value.param == "before"


def test_input_tokens_without_model(client: OpenAI) -> None:
    """``model`` is optional in ``input_tokens.count`` (openai-python's ``InputTokenCountParams``,
    OpenAI's reference): without it the count is that of the previous response's model, or of
    the server's default model, not a 400 ``missing_required_parameter``."""
    with_model = client.responses.input_tokens.count(model=MODEL, input="hello there, how are you")
    without = client.responses.input_tokens.count(input="hello there, how are you")
    assert without.input_tokens == with_model.input_tokens > 0
    r = client.responses.create(model=MODEL, input="first turn", max_output_tokens=5)
    chained = client.responses.input_tokens.count(model=MODEL, input="next", previous_response_id=r.id)
    assert client.responses.input_tokens.count(input="next", previous_response_id=r.id).input_tokens == chained.input_tokens
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.input_tokens.count(input="next", previous_response_id="resp_does_not_exist")
    assert ei.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.input_tokens.count(model="", input="x")
    assert ei.value.param == "model"
