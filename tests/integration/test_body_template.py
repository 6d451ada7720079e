"""A full-history body decoded from its new items alone (by a template) against the ordinary decode.

A JSON object key may be spelled with escapes: ``"\\u0069nput"`` is the key ``input``. A body that
has it after its literal ``"input"`` array has two ``input`` keys, and the ordinary decode
(:func:`decode_body`, msgspec: the last one wins) takes the second array. ``_lead`` only looks for
the literal bytes ``"input"``, so such a body is registered with its bytes after the first array
as ``after``; the next body with the same bytes around a longer first array is then decoded by
``_by_body`` (template path, and the older path without a template too) as the registered
request plus the new items of the *first* array: the backend is sent items the ordinary decode
of that very body does not have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from hotloop.pipeline import reuse
from tests.conftest import run_server
from tests.mock_chat_server import MockChatServer, Reply, text_events

A = {"role": "user", "content": "a" * 300}  # >= 256 bytes: registered by its bytes
B = {"role": "user", "content": "second"}
C = {"role": "user", "content": "third"}


def _body(items: list[dict[str, Any]], dup: list[dict[str, Any]]) -> bytes:
    return (
        '{"model":"mock-model","input":' + json.dumps(items) + ',"\\u0069nput":' + json.dumps(dup) + "}"
    ).encode()


def test_escaped_duplicate_input_key_after_the_input_is_decoded_as_the_ordinary_decode_does(tmp_path: Path) -> None:
    first = _body([A, B], [A, B])
    second = _body([A, B, C], [A, B])
    # the ordinary decode of both bodies: the second "input" wins, [A, B] each time
    assert reuse.decode_body(first).input == [A, B]
    assert reuse.decode_body(second).input == [A, B]
    with MockChatServer() as mock:
        args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model")
        with run_server(tmp_path, *args) as s, httpx.Client(base_url=s.base, timeout=30) as h:
            for body in (first, second):
                mock.push(Reply.stream(text_events("ok")))
                r = h.post("/v1/responses", content=body, headers={"Content-Type": "application/json"})
                assert r.status_code == 200, r.text
            sent = [[m["content"] for m in req.json["messages"] if m["role"] == "user"] for req in mock.requests]
    # from scratch, the second request is [A, B] again; the template path sends [A, B, C]
    assert sent[1] == [A["content"], B["content"]], sent[1]
