"""Prefix reuse under ``--secrets redact`` for clients that resend their whole history: the
cached items hold ``[REDACTED:<kind>]``, the client resends its original text; the prefix is
still reused (``cached_tokens``, one finding in all), the backend and the store never see the
secret, and another API key resending the same history never hits."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import Server, run_server
from tests.integration.test_tenants import ADMIN_KEY, create_key
from tests.mock_chat_server import MockChatServer, Reply, text_events
from tests.unit.test_secrets import POSITIVES

GH = next(secret for kind, _, secret, _ in POSITIVES if kind == "github_token" and secret.startswith("ghp_"))
REDACTED = "[REDACTED:github_token]"


class Setup:
    def __init__(self, server: Server, mock: MockChatServer, keys: dict[str, str]) -> None:
        self.server, self.mock, self.keys = server, mock, keys

    def http(self, name: str) -> httpx.Client:
        return httpx.Client(base_url=self.server.base, headers={"Authorization": f"Bearer {self.keys[name]}"}, timeout=30)

    def turn(self, name: str, history: list[dict[str, Any]], model: str = "mock-model") -> dict[str, Any]:
        # no usage chunk: the usage reported is the server's own (cached_tokens: the reused prefix)
        self.mock.push(Reply.stream(text_events(f"answer {len(history)}")[:-1]))
        with self.http(name) as h:
            r = h.post("/v1/responses", json={"model": model, "input": history})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def flagged(self, name: str) -> int:
        """How many requests of key ``name`` the secrets classifier redacted (the server's log)."""
        return self.server.logs().count(f"classifier secrets redacted the input of a request for key {name}:")

    def hits(self) -> int:
        with self.http("admin") as h:
            return int(h.get("/hotloop/stats").json()["prefix_cache"]["hits"])

    def assert_backend_never_saw_the_secret(self) -> None:
        bodies = [req.body for req in self.mock.requests]
        assert bodies and all(GH.encode() not in b for b in bodies)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("redactprefix")
    data = tmp / "data"
    keys = {name: create_key(data, name) for name in ("alice", "bob")}
    keys["admin"] = ADMIN_KEY
    env = {"HOTLOOP_DATA_DIR": str(data), "HOTLOOP_API_KEY": ADMIN_KEY}
    with MockChatServer() as mock:
        args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model", "--secrets", "redact")
        with run_server(tmp, *args, env=env) as s:
            yield Setup(s, mock, keys)


def _cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["input_tokens_details"]["cached_tokens"])


def _first(text: str, parts: bool = False) -> dict[str, Any]:
    # under 256 bytes: never registered by its bytes, so the next turn is matched by fingerprint
    if parts:  # the same item spelled otherwise (same fingerprint, other bytes)
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return {"role": "user", "content": text}


def _conversation(setup: Setup, name: str, text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Three full-history turns whose first message holds the secret; the history and responses."""
    history = [_first(text)]
    responses = []
    for i in range(3):
        if i == 2:  # spelled otherwise: matched by fingerprint again, not by the previous body's bytes
            history[0] = _first(text, parts=True)
        resp = setup.turn(name, history)
        assert resp["status"] == "completed", resp
        responses.append(resp)
        history = history + resp["output"] + [{"role": "user", "content": f"next step {i}"}]
    return history, responses


def test_a_resent_secret_reuses_the_redacted_prefix(setup: Setup) -> None:
    before, flagged = setup.hits(), setup.flagged("alice")
    text = f"deploy with GITHUB_TOKEN={GH} please"
    history, (r1, r2, r3) = _conversation(setup, "alice", text)
    assert _cached(r1) == 0
    assert 0 < _cached(r2) < _cached(r3) < r3["usage"]["input_tokens"]
    assert setup.hits() == before + 2
    setup.assert_backend_never_saw_the_secret()
    # stored as redacted; reused as such
    with setup.http("alice") as h:
        listed = h.get(f"/v1/responses/{r3['id']}/input_items", params={"order": "asc"}).json()["data"]
    assert listed[0]["content"][0]["text"] == text.replace(GH, REDACTED)
    assert GH not in str(listed)
    assert setup.flagged("alice") == flagged + 1  # the secret was found once, in the first turn
    # a client that sends the redacted text itself hits the same cached items
    redacted = [_first(text.replace(GH, REDACTED)), *history[1:]]
    r4 = setup.turn("alice", redacted)
    assert _cached(r4) >= _cached(r3) and setup.hits() == before + 3
    setup.assert_backend_never_saw_the_secret()


def test_another_key_resending_the_same_history_does_not_hit(setup: Setup) -> None:
    text = f"the bob test GITHUB_TOKEN={GH} please"
    history, _ = _conversation(setup, "alice", text)
    before = setup.hits()
    # with the redacted text (the cached items' own) first: that request registers bob's own entry
    # of those items, which the original text, sent next, must not match either
    resp = setup.turn("bob", [_first(text.replace(GH, REDACTED)), *history[1:]])
    assert _cached(resp) == 0 and setup.hits() == before
    resp = setup.turn("bob", history)
    assert _cached(resp) == 0 and setup.hits() == before
    setup.assert_backend_never_saw_the_secret()
    # alice still does
    assert _cached(setup.turn("alice", history)) > 0 and setup.hits() == before + 1
