"""Audit of the classifier layer on real servers: a ``--classifier`` that raises or returns a
malformed verdict refuses the turn with a JSON 500 naming it (never silently allowed, never a
plain-text 500), and leaves the chain as it was, as a block does (the WebSocket connection's
cached parent survives)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect as ws_connect

from hotloop.pipeline.classify import ALLOW, Block, Flag, Redact, item_texts
from tests.conftest import Server, raw_until_terminal, run_server

ROOT = str(Path(__file__).resolve().parents[2])
ENV = {"PYTHONPATH": ROOT}
SPEC = "tests.integration.test_classifiers_audit:"


def _texts(items: Sequence[Any]) -> str:
    return " ".join(t for it in items for _, t in item_texts(it))


class Raising:
    """Raises on a turn whose text holds ``boom``."""

    name = "raising"

    def initial_state(self) -> int:
        return 0

    def classify(self, items: Sequence[Any], state: int) -> tuple[Any, int]:
        if "boom" in _texts(items):
            raise RuntimeError("lookup service unreachable")
        return ALLOW, state + 1


class Malformed:
    """Returns a malformed result for a turn naming one of ``CASES``."""

    name = "malformed"

    def initial_state(self) -> int:
        return 0

    def classify(self, items: Sequence[Any], state: int) -> Any:
        text = _texts(items)
        if "no-result" in text:
            return None
        if "bare-verdict" in text:
            return ALLOW
        if "string-verdict" in text:
            return "block", state
        if "string-labels" in text:
            return Flag(labels="pii"), state  # type: ignore[arg-type]
        if "short-redact" in text:
            return Redact(labels=("x",), findings=(), items=()), state
        if "dict-redact" in text:
            return Redact(labels=("x",), findings=(), items=tuple({"x": 1} for _ in items)), state  # type: ignore[misc]
        if "reason-none" in text:
            return Block(reason=None), state  # type: ignore[arg-type]
        if "code-int" in text:
            return Block(reason="no", code=5), state  # type: ignore[arg-type]
        if "finding-str" in text:
            return Flag(labels=("x",), findings=("here",)), state  # type: ignore[arg-type]
        return ALLOW, state + 1


raising = Raising()
malformed = Malformed()

CASES = ("no-result", "bare-verdict", "string-verdict", "string-labels", "short-redact", "dict-redact",
         "reason-none", "code-int", "finding-str")


def create(server: Server, **body: Any) -> httpx.Response:
    body.setdefault("model", "hotloop-sim")
    return httpx.post(server.v1 + "/responses", json=body, timeout=30)


def usage(server: Server) -> list[dict[str, Any]]:
    return [r for r in httpx.get(server.base + "/hotloop/usage", timeout=10).json()["data"] if r["model"] == "hotloop-sim"]


def test_a_raising_classifier_refuses_the_turn_and_keeps_the_chain(tmp_path: Path) -> None:
    with run_server(tmp_path, "--sim-rate", "0", "--classifier", SPEC + "raising", env=ENV) as s:
        r = create(s, input="boom", store=False)
        assert r.status_code == 500, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"] == {
            "message": "The input could not be classified (classifier raising failed); it was not sent to the model.",
            "type": "server_error", "param": None, "code": "classifier_error",
        }
        with ws_connect(s.ws + "/responses", open_timeout=10) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi", "store": False}))
            first = raw_until_terminal(ws)[-1]
            assert first["type"] == "response.completed"
            parent = first["response"]["id"]
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "store": False,
                                "previous_response_id": parent, "input": "boom"}))
            [frame] = raw_until_terminal(ws)
            assert frame["type"] == "error" and frame["status"] == 500
            assert frame["error"]["code"] == "classifier_error"
            # the same socket continues the same (unstored) parent: the failure did not evict it
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "store": False,
                                "previous_response_id": parent, "input": "fine"}))
            done = raw_until_terminal(ws)[-1]
            assert done["type"] == "response.completed", done
            assert done["response"]["previous_response_id"] == parent
        [row] = usage(s)
        logs = s.logs()
    assert row["responses"] == 2  # the two completed WebSocket turns; refused ones are none
    assert "classifier raising failed" in logs and "lookup service unreachable" in logs


def test_malformed_verdicts_are_refused_not_allowed(tmp_path: Path) -> None:
    with run_server(tmp_path, "--sim-rate", "0", "--classifier", SPEC + "malformed", env=ENV) as s:
        got = {}
        for case in CASES:
            r = create(s, input=f"please {case}", store=False)
            assert r.headers["content-type"].startswith("application/json"), (case, r.text)
            got[case] = (r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None)
        ok = create(s, input="all fine", store=False)
        assert ok.status_code == 200
        [row] = usage(s)
        logs = s.logs()
    assert got == {case: (500, "classifier_error") for case in CASES}
    assert row["responses"] == 1 and row["flagged"] == 0 and row["findings"] == {}
    assert "classifier malformed failed" in logs


def test_redact_drops_the_logprobs_of_a_redacted_output_text(tmp_path: Path) -> None:
    """A client resending a model's output with its logprobs (``include:
    ["message.output_text.logprobs"]``, then ``input=previous.output + [...]``): under
    ``redact`` the text was redacted but its logprobs, which spell the same text token by token
    (and byte by byte), were stored and listed as sent."""
    from tests.integration.test_classifiers import GH

    data = tmp_path / "data"
    logprobs = [{"token": t, "logprob": -0.1, "bytes": list(t.encode()), "top_logprobs": []} for t in ("key ", GH[:4], GH[4:])]
    clean = [{"token": "fine", "logprob": -0.2, "bytes": list(b"fine"), "top_logprobs": []}]
    inp = [
        {"type": "message", "role": "user", "content": "make me a token"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "key " + GH, "annotations": [], "logprobs": logprobs},
            {"type": "output_text", "text": "fine", "annotations": [], "logprobs": clean},
        ]},
        {"type": "message", "role": "user", "content": "thanks"},
    ]
    with run_server(tmp_path, "--sim-rate", "0", "--secrets", "redact", env={"HOTLOOP_DATA_DIR": str(data)}) as s:
        r = create(s, input=inp)
        assert r.status_code == 200, r.text
        items = httpx.get(f"{s.v1}/responses/{r.json()['id']}/input_items", params={"order": "asc"}, timeout=10).json()["data"]
    [redacted, kept] = items[1]["content"]
    assert redacted["text"] == "key [REDACTED:github_token]"
    assert "logprobs" not in redacted or redacted["logprobs"] == []  # they spelled the secret
    assert kept["logprobs"] == clean  # a part without findings keeps its own
    assert GH not in json.dumps(items) and GH[4:] not in json.dumps(items)
    on_disk = b"".join(p.read_bytes() for p in data.rglob("*") if p.is_file())
    assert GH[4:].encode() not in on_disk
