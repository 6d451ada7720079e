"""The negative cache end to end: a real ``hotloop serve --store redis`` and a real ``redis-server``.
A bad key refused before Redis went away is still a 401 (OpenAI's shape, nothing internal) while
it is down, over HTTP and on the WebSocket handshake; a key never seen is a 503 (it may be a key
created since); a key created while a bad one is sent in a loop works at once."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from tests.integration.test_scaleout import auth, create, keys, replica
from tests.services import Redis


def test_a_bad_key_is_a_401_while_redis_is_down_and_a_new_key_works_at_once(tmp_path: Path) -> None:
    redis = Redis(tmp_path)
    redis.start()
    try:
        with replica(tmp_path, redis.url) as s:
            good = keys(redis.url, "create", "alice")
            bad = "hl-" + secrets.token_urlsafe(32)
            assert create(s, {"input": "warm", "store": False}, auth(good)).status_code == 200
            for _ in range(20):  # a client retrying its bad key
                assert create(s, {"input": "x", "store": False}, auth(bad)).status_code == 401
            fresh = keys(redis.url, "create", "bob")  # `hotloop keys create` meanwhile: works at once
            assert create(s, {"input": "hi", "store": False}, auth(fresh)).status_code == 200
            assert create(s, {"input": "x", "store": False}, auth(bad)).status_code == 401
            redis.stop()
            # before the negative cache: 503 "The response store is unavailable"
            r = create(s, {"input": "x", "store": False}, auth(bad))
            assert r.status_code == 401, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            assert "redis" not in r.text.lower() and "Traceback" not in r.text
            with pytest.raises(InvalidStatus) as ei:
                ws_connect(s.ws + "/responses", open_timeout=10, additional_headers=auth(bad)).close()
            assert ei.value.response.status_code == 401
            never = httpx.get(s.v1 + "/models", headers=auth("hl-" + secrets.token_urlsafe(32)), timeout=10)
            assert never.status_code == 503 and never.json()["error"]["type"] == "server_error"
            assert "redis" not in never.text.lower()
    finally:
        redis.stop()
