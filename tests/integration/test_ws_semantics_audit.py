"""WebSocket-mode semantics (wire reference §1.5-§1.10) a client hits: chains across failures,
pipelined continuations, ``store`` across connections, warm-ups mid-chain, a client that leaves."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from websockets.sync.client import connect as ws_connect

from tests.conftest import raw_until_terminal


def _create(ws, **kw) -> None:
    ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", **kw}))


def test_a_continuation_sent_before_its_parent_failed_is_refused_after_it(server) -> None:
    """Pipelined: the continuation is sent as soon as ``response.created`` names the parent; the
    parent then fails, so the continuation gets ``previous_response_not_found`` (nothing cached
    to continue from), in order, and the socket stays usable."""
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        _create(ws, input="a", store=False, metadata={"sim": "fail:server_error"})
        created = json.loads(ws.recv(timeout=30))
        assert created["type"] == "response.created"
        parent = created["response"]["id"]
        _create(ws, input="b", store=False, previous_response_id=parent)
        assert raw_until_terminal(ws)[-1]["type"] == "response.failed"
        [err] = raw_until_terminal(ws)
        assert err == {
            "type": "error",
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "code": "previous_response_not_found",
                "message": f"Previous response with id '{parent}' not found.",
                "param": "previous_response_id",
            },
        }
        _create(ws, input="c", store=False)
        assert raw_until_terminal(ws)[-1]["type"] == "response.completed"


def test_store_false_stays_on_its_connection_and_store_true_does_not(server) -> None:
    with ws_connect(server.ws + "/responses", open_timeout=10) as one, ws_connect(
        server.ws + "/responses", open_timeout=10
    ) as two:
        _create(one, input="private", store=False)
        private = raw_until_terminal(one)[-1]["response"]["id"]
        _create(one, input="shared")
        shared = raw_until_terminal(one)[-1]["response"]["id"]
        # the other connection, open at the same time: the unstored one is unknown there
        _create(two, input="x", store=True, previous_response_id=private)
        [err] = raw_until_terminal(two)
        assert err["status"] == 400 and err["error"]["code"] == "previous_response_not_found"
        _create(two, input="x", store=False, previous_response_id=shared)
        done = raw_until_terminal(two)[-1]
        assert done["type"] == "response.completed" and done["response"]["previous_response_id"] == shared
        # and over HTTP
        r = httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", "input": "x", "previous_response_id": private})
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
        assert httpx.get(f"{server.v1}/responses/{private}").status_code == 404


def test_a_warmup_mid_chain_keeps_the_chain(server) -> None:
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        _create(ws, input="first", store=False)
        first = raw_until_terminal(ws)[-1]["response"]
        _create(ws, input="more context", store=False, previous_response_id=first["id"], generate=False)
        evs = raw_until_terminal(ws)
        assert [e["type"] for e in evs] == ["response.created", "response.in_progress", "response.completed"]
        warm = evs[-1]["response"]
        assert warm["output"] == [] and warm["previous_response_id"] == first["id"]
        assert warm["usage"]["output_tokens"] == 0 and warm["usage"]["input_tokens"] > first["usage"]["total_tokens"]
        _create(ws, input=[], store=False, previous_response_id=warm["id"])
        done = raw_until_terminal(ws)[-1]["response"]
        assert done["status"] == "completed" and done["output"]
        assert done["usage"]["input_tokens"] >= warm["usage"]["input_tokens"]


def test_a_response_whose_client_left_is_neither_stored_nor_continuable(server) -> None:
    # close_timeout: the client leaves with a message unread (response.in_progress), which holds
    # the sync client's reader, so it would wait its default 10 s for the server's close frame
    with ws_connect(server.ws + "/responses", open_timeout=10, close_timeout=1) as ws:
        _create(ws, input="x", metadata={"sim": "stall:5"})
        created = json.loads(ws.recv(timeout=30))
        rid = created["response"]["id"]
    time.sleep(0.3)
    assert httpx.get(f"{server.v1}/responses/{rid}").status_code == 404
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        _create(ws, input="y", previous_response_id=rid)
        [err] = raw_until_terminal(ws)
        assert err["error"]["code"] == "previous_response_not_found"


def test_a_deleted_response_is_not_continued_from_the_connection_cache(server) -> None:
    """A DELETE reached only the process-wide cache: the connection that made the response went
    on continuing it from its own cache, and the new response stored the deleted input again."""
    with ws_connect(server.ws + "/responses", open_timeout=10) as ws:
        _create(ws, input="forget this")
        rid = raw_until_terminal(ws)[-1]["response"]["id"]
        assert httpx.delete(f"{server.v1}/responses/{rid}").status_code == 200
        # over HTTP and on a new connection it is gone; on this connection too
        _create(ws, input="and now?", previous_response_id=rid)
        last = raw_until_terminal(ws)[-1]
        assert last["type"] == "error" and last["error"]["code"] == "previous_response_not_found", last["type"]
