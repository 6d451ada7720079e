"""A real ``hotloop serve --secrets redact`` restarted on the same data directory keeps redacting a
secret in a call id to the same ``[REDACTED:<kind>:<tag>]``: the tag's key is the SQLite store's
(its ``meta`` table), not the process's, so a call stored before the restart still pairs with
its output sent after it with ``previous_response_id``. The key is never logged or served."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets as rnd
import sqlite3
import string
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Server, run_server
from tests.mock_chat_server import MockChatServer, Reply, text_events

ALNUM = string.ascii_letters + string.digits
MARKER = re.compile(r"\[REDACTED:github_token:[0-9a-f]{12}\]")


def gh() -> str:
    return "gh" + "p_" + "".join(rnd.choice(ALNUM) for _ in range(36))


def create(server: Server, mock: MockChatServer, **body: Any) -> dict[str, Any]:
    mock.push(Reply.stream(text_events("ok")))
    r = httpx.post(server.v1 + "/responses", json={"model": "mock-model", "store": True, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def tool_ids(messages: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The assistant tool calls' ids and the tool messages' tool_call_ids."""
    calls = [tc["id"] for m in messages if m["role"] == "assistant" for tc in m.get("tool_calls", ())]
    outs = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    return calls, outs


def test_a_call_stored_before_a_restart_pairs_with_its_output_sent_after(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {"HOTLOOP_DATA_DIR": str(data)}
    secret = gh()
    pages = ("/healthz", "/hotloop/stats", "/metrics")
    with MockChatServer() as mock:
        args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model", "--secrets", "redact")
        with run_server(tmp_path, *args, env=env) as s:
            first = create(s, mock, input=[
                {"role": "user", "content": "run it"},
                {"type": "function_call", "call_id": secret, "name": "sh", "arguments": "{}"},
            ])
            (req,) = mock.requests
            calls, outs = tool_ids(req.json["messages"])
            (marker,) = calls
            assert MARKER.fullmatch(marker) and outs == []
            served = b"".join(httpx.get(s.base + p, timeout=10).content for p in pages) + json.dumps(first).encode()
            logs = s.logs()
        mock.requests.clear()
        with run_server(tmp_path, *args, env=env) as s:  # the restart: the same data directory
            second = create(s, mock, previous_response_id=first["id"], input=[
                {"type": "function_call_output", "call_id": secret, "output": "done"},
            ])
            (req,) = mock.requests
            assert secret.encode() not in req.body
            # the stored call and the output redacted after the restart carry one marker
            assert tool_ids(req.json["messages"]) == ([marker], [marker])
            served += b"".join(httpx.get(s.base + p, timeout=10).content for p in pages) + json.dumps(second).encode()
            logs += s.logs()
    # the tag is the store's key's, kept in meta alone: never logged, served or stored with responses
    with sqlite3.connect(data / "hotloop.sqlite3") as db:
        (value,) = db.execute("SELECT value FROM meta WHERE name = 'call_id_key'").fetchone()
        cells = [c for table in ("responses", "blobs", "response_items") for row in db.execute(f"SELECT * FROM {table}")
                 for c in row if isinstance(c, (bytes, str))]
    key_hex = value if isinstance(value, str) else value.decode()
    key = bytes.fromhex(key_hex)
    assert marker == f"[REDACTED:github_token:{hmac.new(key, secret.encode(), hashlib.sha256).hexdigest()[:12]}]"
    assert key_hex not in logs and repr(key)[2:-1] not in logs
    assert key_hex.encode() not in served and key not in served
    assert len(cells) > 4
    for cell in cells:
        raw = cell if isinstance(cell, bytes) else cell.encode()
        assert key_hex.encode() not in raw and key not in raw and secret.encode() not in raw
