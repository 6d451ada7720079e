"""``/hotloop/stats`` is the operators' view: the admin key, and every caller in open mode, see it
all (the per-response ring, cache sizes and hit counts); a tenant's key sees only counts of the
server's activity (no per-response figures, no cache sizes or hits: those move with each of
another tenant's responses, a side channel between tenants); ``/metrics`` is the admin key's
alone; and one key holds at most ``ws_max_connections_per_key`` WebSocket connections. Real
server processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.conftest import Server, run_server
from tests.integration.test_tenants import ADMIN_KEY, create_key, send_create
from websockets.sync.client import connect as ws_connect

# What a tenant's key sees: which process answered, and counts of what it is doing
TENANT_VIEW = {"pid", "view", "active_responses", "completed_responses", "store", "gc", "native"}
# Fields that must never reach a tenant's key (per response, or moving with each response's size/reuse)
PRIVATE = {"turns", "token_cache", "response_cache", "prefix_cache", "tools_cache", "ws_connection_caches"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("stats")
    data = tmp / "data"
    keys = {name: create_key(data, name) for name in ("alice", "bob")}
    keys["admin"] = ADMIN_KEY
    env = {"HOTLOOP_DATA_DIR": str(data), "HOTLOOP_API_KEY": ADMIN_KEY}
    with run_server(tmp, "--sim-rate", "0", env=env) as srv:
        yield srv, keys


def stats(s: Server, secret: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.get(s.base + "/hotloop/stats", headers=headers, timeout=10)


def test_a_tenants_key_sees_counts_and_no_other_tenants_turns(keyed: tuple[Server, dict[str, str]]) -> None:
    s, keys = keyed
    # alice works: over HTTP and over WebSocket
    r = httpx.post(
        s.v1 + "/responses", json={"model": "hotloop-sim", "input": "alice's long conversation " * 50},
        headers={"Authorization": f"Bearer {keys['alice']}"}, timeout=30,
    )
    assert r.status_code == 200, r.text
    with ws_connect(s.ws + "/responses", open_timeout=10, additional_headers={"Authorization": f"Bearer {keys['alice']}"}) as ws:
        assert send_create(ws, input="and more")[-1]["type"] == "response.completed"
    for name in ("bob", "alice"):  # bob's view, and alice's own: the same reduced one
        resp = stats(s, keys[name])
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert set(body) == TENANT_VIEW, sorted(body)
        assert not PRIVATE & set(body)
        assert body["view"] == "key"
        assert body["completed_responses"] >= 2 and body["active_responses"] >= 0
        assert set(body["store"]) == {"pending", "written", "failed", "usage_written", "usage_failed"}
        assert "context_items" not in resp.text and "cpu_us" not in resp.text and "hits" not in resp.text
    # the operator sees it all, alice's turns included
    full = stats(s, keys["admin"])
    assert full.status_code == 200
    body = full.json()
    assert PRIVATE <= set(body) and body["view"] == "all"
    transports = [t["transport"] for t in body["turns"]]
    assert len(transports) >= 2 and {"json", "ws"} <= set(transports), transports


def test_metrics_are_the_operators_not_a_tenants(keyed: tuple[Server, dict[str, str]]) -> None:
    """/metrics is the whole server's activity (every tenant's tokens, the kinds of secrets they
    sent): a tenant's key gets a 403, as it gets the reduced /hotloop/stats; the admin key all."""
    s, keys = keyed
    r = httpx.post(
        s.v1 + "/responses", json={"model": "hotloop-sim", "input": "bob's token ghp_" + "a1B2c3D4e5" * 4},
        headers={"Authorization": f"Bearer {keys['bob']}"}, timeout=30,
    )
    assert r.status_code == 200, r.text
    as_alice = httpx.get(s.base + "/metrics", headers={"Authorization": f"Bearer {keys['alice']}"}, timeout=10)
    assert as_alice.status_code == 403 and "hotloop_tokens_total" not in as_alice.text
    err = as_alice.json()["error"]
    assert err["type"] == "invalid_request_error" and "admin" in err["message"]
    admin = httpx.get(s.base + "/metrics", headers={"Authorization": f"Bearer {keys['admin']}"}, timeout=10)
    assert admin.status_code == 200 and "hotloop_tokens_total" in admin.text


def test_bad_keys_are_still_refused(keyed: tuple[Server, dict[str, str]]) -> None:
    s, _ = keyed
    for secret in (None, "hl-" + "x" * 43, "sk-nope"):
        r = stats(s, secret)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and "Traceback" not in r.text


def test_open_mode_sees_everything_without_a_key(tmp_path: Path) -> None:
    with run_server(tmp_path, "--sim-rate", "0", env={"HOTLOOP_DATA_DIR": str(tmp_path / "open")}) as s:
        r = httpx.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi"}, timeout=30)
        assert r.status_code == 200, r.text
        for secret in (None, "sk-anything", "hl-" + "z" * 43):  # open mode: everyone is anonymous
            body = stats(s, secret).json()
            assert PRIVATE <= set(body) and body["view"] == "all", sorted(body)
            assert len(body["turns"]) >= 1 and body["token_cache"]["misses"] >= 1


def test_one_key_cannot_take_every_websocket_connection(tmp_path: Path) -> None:
    """``ws_max_connections_per_key``: a tenant's key holding that many WebSocket connections
    gets a 429 at the next handshake (OpenAI's error shape), while another key connects; a
    closed connection gives its place back. The admin key is not counted."""
    import time

    from websockets.exceptions import InvalidStatus

    data = tmp_path / "data"
    keys = {name: create_key(data, name) for name in ("alice", "bob")}
    env = {"HOTLOOP_DATA_DIR": str(data), "HOTLOOP_API_KEY": ADMIN_KEY, "HOTLOOP_WS_MAX_CONNECTIONS_PER_KEY": "2"}

    def connect(secret: str):  # type: ignore[no-untyped-def]
        return ws_connect(s.ws + "/responses", open_timeout=10, additional_headers={"Authorization": f"Bearer {secret}"})

    with run_server(tmp_path, "--sim-rate", "0", env=env) as s:
        first, second = connect(keys["alice"]), connect(keys["alice"])
        with pytest.raises(InvalidStatus) as info:
            connect(keys["alice"])
        refused = info.value.response
        assert refused.status_code == 429
        err = json.loads(refused.body)["error"]
        assert (err["type"], err["code"]) == ("rate_limit_exceeded", "websocket_connection_limit_reached")
        assert "(2)" in err["message"]
        with connect(keys["bob"]) as bob, connect(ADMIN_KEY), connect(ADMIN_KEY), connect(ADMIN_KEY):
            assert send_create(bob, input="hi")[-1]["type"] == "response.completed"
        assert send_create(first, input="still here")[-1]["type"] == "response.completed"
        second.close()
        deadline = time.monotonic() + 10
        while True:  # (the server sees the close a moment later)
            try:
                third = connect(keys["alice"])
                break
            except InvalidStatus:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert send_create(third, input="again")[-1]["type"] == "response.completed"
        third.close()
        first.close()
