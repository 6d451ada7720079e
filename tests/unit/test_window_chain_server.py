"""A call ``truncation: "auto"`` dropped, answered later, on a real server (the simulator with a
tiny window): over HTTP with ``previous_response_id``, after a restart (the store's round trip),
against the same history sent whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Server, run_server
from tests.integration.test_context_window import PARAGRAPH, WINDOW, create, limits_file


def _call(cid: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": cid, "name": "f", "arguments": json.dumps({"q": PARAGRAPH * 2})}


def _out(cid: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": cid, "output": "ok"}


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def _wire(item: dict[str, Any]) -> tuple[str, str]:
    if item["type"] == "message":
        c = item["content"]
        return item["role"], c if isinstance(c, str) else str(c[0]["text"])
    return item["type"], str(item["call_id"])


def _listed(s: Server, rid: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{s.v1}/responses/{rid}/input_items", params={"order": "asc", "limit": 100}, timeout=10)
    return r.json()["data"]  # type: ignore[no-any-return]


TURNS = [
    [_user("hi"), _call("a")],  # fits
    [_call("b"), _user(PARAGRAPH)],  # over: drops "hi" and call a (still unanswered)
]
LAST = [_out("a"), _out("b"), _user("go")]  # a's output: dropped with everything up to it


def test_output_of_a_dropped_call_over_http_after_a_restart(tmp_path: Path) -> None:
    env = {"HOTLOOP_DATA_DIR": str(tmp_path / "data")}
    args = ("--sim-rate", "0", "--model-limits", str(limits_file(tmp_path)))
    history: list[dict[str, Any]] = []
    with run_server(tmp_path, *args, env=env) as s:
        prev = None
        for j, items in enumerate(TURNS):
            r = create(s, input=items, previous_response_id=prev, truncation="auto")
            assert r.status_code == 200, r.text
            assert int(r.headers.get("x-hotloop-truncated-items", "0")) == (2 if j == 1 else 0)
            history += items + r.json()["output"]
            prev = r.json()["id"]
    with run_server(tmp_path, *args, env=env) as s:
        # without "auto": the same code as the whole history (over the window), the parent kept
        bad = create(s, input=LAST, previous_response_id=prev)
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", "input[0].call_id")
        whole = create(s, input=history + LAST)
        assert whole.status_code == 400 and whole.json()["error"]["code"] == "context_length_exceeded"
        # with "auto": a's output goes with its call, and what the model gets is what the whole
        # history sent with "auto" gets
        r = create(s, input=LAST, previous_response_id=prev, truncation="auto")
        assert r.status_code == 200, r.text
        chained = r.json()
        whole = create(s, input=history + LAST, truncation="auto")
        assert whole.status_code == 200, whole.text
        scratch = whole.json()
        assert [_wire(i) for i in _listed(s, chained["id"])] == [_wire(i) for i in _listed(s, scratch["id"])] == [
            ("user", "go")
        ]
        assert chained["usage"]["input_tokens"] == scratch["usage"]["input_tokens"] <= WINDOW
        assert 2 + chained["usage"]["truncated_items"] == scratch["usage"]["truncated_items"]


def test_without_truncation_nothing_changes(tmp_path: Path) -> None:
    """A roomy model: the same turns keep every item, and an output of an unknown call is the
    400 it always was."""
    with run_server(tmp_path, "--sim-rate", "0", "--model-limits", str(limits_file(tmp_path))) as s:
        prev = None
        for items in [*TURNS, LAST]:
            r = create(s, input=items, previous_response_id=prev, model="roomy")
            assert r.status_code == 200 and "x-hotloop-truncated-items" not in r.headers, r.text
            prev = r.json()["id"]
        bad = create(s, input=[_out("zz")], previous_response_id=prev, model="roomy")
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert err["param"] == "input[0].call_id" and err["code"] != "context_length_exceeded"
        assert err["message"] == "No tool call found for function call output with call_id zz."
