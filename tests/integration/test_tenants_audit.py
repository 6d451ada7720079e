"""Audit of the tenants layer against a real server, the CLI and the openai SDK: a key with a
small TPM can make requests without ``max_output_tokens``; a key's secret can be rotated
without the key losing what it owns (its stored responses, conversations, usage, limits), and
the old secret stops working (HTTP and an open WebSocket)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from openai import OpenAI
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, run_server
from tests.integration.test_tenants import SECRET, create_key, hotloop, send_create

pytestmark = pytest.mark.timeout(180)


class Env:
    def __init__(self, server: Server, data: Path, keys: dict[str, str]) -> None:
        self.server = server
        self.data = data
        self.keys = keys

    def sdk(self, secret: str) -> OpenAI:
        return OpenAI(api_key=secret, base_url=self.server.v1, max_retries=0, timeout=30)

    def ws(self, secret: str):  # type: ignore[no-untyped-def]
        return ws_connect(self.server.ws + "/responses", open_timeout=10, additional_headers={"Authorization": f"Bearer {secret}"})


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("tenants-audit")
    data = tmp / "data"
    keys = {
        "small-tpm": create_key(data, "small-tpm", "--tpm", "3000"),
        "rotating": create_key(data, "rotating", "--rpm", "1000", "--max-concurrent", "4"),
        "bystander": create_key(data, "bystander"),
    }
    with run_server(tmp, "--sim-rate", "0", env={"HOTLOOP_DATA_DIR": str(data)}) as srv:
        yield Env(srv, data, keys)


def test_a_key_with_a_tpm_under_the_default_reservation_can_make_requests(env: Env) -> None:
    """``hotloop keys create k --tpm 3000``: a request without ``max_output_tokens`` was refused
    with 429 "Request too large ... Requested 4100" (the server's default output reservation,
    4,096, plus the input), ``x-should-retry: false``: such a key could make no request at all
    without ``max_output_tokens``, not even a zero-output warm-up."""
    client = env.sdk(env.keys["small-tpm"])
    r = client.responses.create(model="hotloop-sim", input="hi", metadata={"sim": "text,tokens:20"})
    assert r.status in ("completed", "incomplete")
    with env.ws(env.keys["small-tpm"]) as ws:
        done = send_create(ws, input="warm", generate=False, store=False)[-1]
        assert done["type"] == "response.completed", done
    # what the client asks for is still held to the limit: too large, not retried
    with pytest.raises(openai.RateLimitError) as ei:
        client.responses.create(model="hotloop-sim", input="hi", max_output_tokens=3500)
    assert "Request too large" in ei.value.message and ei.value.response.headers["x-should-retry"] == "false"
    # the reservation is corrected to the real usage: the bucket is not drained by the estimate
    h = httpx.get(env.server.v1 + "/models", headers={"Authorization": f"Bearer {env.keys['small-tpm']}"})
    assert int(h.headers["x-ratelimit-remaining-tokens"]) > 2800


def test_rotating_a_key_keeps_its_tenant_and_retires_the_old_secret(env: Env) -> None:
    old = env.keys["rotating"]
    alice = env.sdk(old)
    first = alice.responses.create(model="hotloop-sim", input="remember the plan")
    item_id = first.output[0].id
    with env.ws(old) as ws:
        assert send_create(ws, input="before")[-1]["type"] == "response.completed"
        p = hotloop(env.data, "keys", "rotate", "rotating")
        assert p.returncode == 0, p.stderr
        new = p.stdout.strip()
        assert SECRET.fullmatch(new) and new != old and p.stdout.count("\n") == 1
        assert old not in p.stdout + p.stderr
        # the new secret works at once and is the same tenant: its responses, items, conversations
        rotated = env.sdk(new)
        assert rotated.responses.retrieve(first.id).output_text == first.output_text
        assert len(rotated.responses.input_items.list(first.id).data) == 1
        nxt = rotated.responses.create(
            model="hotloop-sim", input=[{"type": "item_reference", "id": item_id}], previous_response_id=first.id  # type: ignore[misc,list-item]
        )
        assert nxt.status == "completed"
        time.sleep(1.5)  # the server re-reads the key table every second
        # the old secret is refused: HTTP, and the open WebSocket on its next response.create
        r = httpx.get(env.server.v1 + "/models", headers={"Authorization": f"Bearer {old}"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        [e] = send_create(ws, input="after")
        assert e["status"] == 401 and e["error"]["code"] == "invalid_api_key"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 1008
    # a WebSocket opened with the new secret continues the old conversation
    with env.ws(new) as ws:
        assert send_create(ws, input="more", previous_response_id=nxt.id)[-1]["type"] == "response.completed"
    # nobody else gained anything
    with pytest.raises(openai.NotFoundError):
        env.sdk(env.keys["bystander"]).responses.retrieve(first.id)
    # one key in the list (same name, limits, still active), one tenant in the usage ledger
    rows = [ln.split() for ln in hotloop(env.data, "keys", "list").stdout.splitlines() if ln.startswith("rotating ")]
    assert len(rows) == 1 and rows[0][1:4] == ["1000", "-", "4"] and rows[0][-1] == "active"
    usage = httpx.get(env.server.base + "/hotloop/usage", headers={"Authorization": f"Bearer {new}"}).json()["data"]
    assert len({u["key_id"] for u in usage}) == 1 and sum(u["responses"] for u in usage) == 4
    # the CLI's answer for a name without an active key
    p = hotloop(env.data, "keys", "rotate", "no-such-key")
    assert p.returncode == 1 and "no active key named 'no-such-key'" in p.stderr and p.stdout == ""


def test_a_key_cannot_be_named_like_another_keys_id(env: Env) -> None:
    """``hotloop usage --key X`` lists the key whose id is X and the keys named X. A key named
    like another key's id (``key_`` + 16 hex digits) made the listing of that key's usage
    include the impostor's rows (and its totals with them): the name is refused."""
    listed = hotloop(env.data, "usage", "--key", "key_0123456789abcdef")
    assert listed.returncode == 0
    p = hotloop(env.data, "keys", "create", "key_0123456789abcdef")
    assert p.returncode == 1 and p.stdout == "" and "reserved" in p.stderr
    # names merely starting so are fine
    ok = hotloop(env.data, "keys", "create", "key_for_ci")
    assert ok.returncode == 0 and SECRET.fullmatch(ok.stdout.strip())
