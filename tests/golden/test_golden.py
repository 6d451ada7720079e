"""The wire output of every event sequence equals its golden transcript, byte for byte."""

from __future__ import annotations

import json

import pytest

from tests.golden.transcripts import CASES, path, render


@pytest.mark.parametrize("transport", ["sse", "ws"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_transcript_matches(name: str, transport: str) -> None:
    expected = path(name, transport).read_bytes()
    assert render(name, transport) == expected, f"regenerate with tests/golden/regenerate.py if intended ({name}.{transport})"


@pytest.mark.parametrize("name", sorted(CASES))
def test_transcripts_are_well_formed(name: str) -> None:
    """Independent of the bytes: the invariants every client relies on hold in the files."""
    ws = [json.loads(line) for line in path(name, "ws").read_text().splitlines()]
    sse_blocks = [b for b in path(name, "sse").read_text().split("\n\n") if b]
    if name.startswith("rejected_"):
        assert len(ws) == 1 and ws[0]["type"] == "error" and ws[0]["status"] >= 400
        assert path(name, "sse").read_text().startswith("HTTP 4")
        return
    sse = []
    for block in sse_blocks:
        head, data = block.split("\n")
        obj = json.loads(data[len("data: "):])
        assert head == "event: " + obj["type"]
        sse.append(obj)
    for events in (sse, ws):
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["type"] == "response.created"
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
        added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
        done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
        assert added == done
        assert [o["id"] for o in events[-1]["response"]["output"]] == done
    # the two transports carry the same events; SSE adds the nested error event on backend errors
    if name == "backend_error":
        assert [e["type"] for e in sse if e["type"] != "error"] == [e["type"] for e in ws]
        assert [e["type"] for e in sse][-2:] == ["error", "response.failed"]
    else:
        assert sse == ws
