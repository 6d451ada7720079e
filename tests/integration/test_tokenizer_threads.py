"""Large inputs are counted in threads off the event loop: one request's huge input must not hold
up another request's ordinary large one (a real server, the simulator, real HTTP clients)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.conftest import run_server

# One unbroken run of letters: the slowest text to count (about 0.4 s a million characters here),
# sent as one request; then 100 KB of prose, past the size counted on the event loop.
HUGE = "a" * 4_000_000
ORDINARY = "the loop keeps agents hot " * 4000
TERMINAL = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")


def test_a_huge_inputs_count_does_not_hold_up_another_requests(tmp_path: Path) -> None:
    with run_server(tmp_path, "--store", "memory", "--sim-rate", "0") as s:
        seen: dict[str, float] = {}
        failures: list[BaseException] = []

        def huge() -> None:
            try:
                body = {"model": "hotloop-sim", "input": HUGE, "stream": True, "max_output_tokens": 16}
                with httpx.stream("POST", s.v1 + "/responses", json=body, timeout=120) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("event: response.created"):
                            # its count went to the tokenizer thread before its first chunk
                            seen["created"] = time.monotonic()
                        if line.encode().startswith(TERMINAL):
                            seen["huge"] = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 (reported below)
                failures.append(exc)

        t = threading.Thread(target=huge)
        t.start()
        deadline = time.monotonic() + 60
        while "created" not in seen and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "created" in seen, failures
        r = httpx.post(
            s.v1 + "/responses", json={"model": "hotloop-sim", "input": ORDINARY, "max_output_tokens": 16}, timeout=120
        )
        seen["ordinary"] = time.monotonic()
        t.join(120)
        assert not failures, failures
        assert r.status_code == 200, r.text
        # its own count, exact: what the server counts for that input alone
        alone = httpx.post(s.v1 + "/responses/input_tokens", json={"model": "hotloop-sim", "input": ORDINARY}, timeout=60)
        assert r.json()["usage"]["input_tokens"] == alone.json()["input_tokens"] > 20_000
        # The ordinary request was answered while the huge one was still being counted: with one
        # tokenizer thread it waited for that count, and ended after it.
        assert seen["ordinary"] < seen["huge"], seen
