"""Accounting audit: the usage ledger (``/hotloop/usage``, ``hotloop usage``) and the metrics
(``/metrics``) must count the same traffic the same way, per key, for every outcome a response
can have, and the ledger must survive a restart.

Real servers on 127.0.0.1 (SQLite store in a temp dir, the simulator backend), httpx and the
sync websockets client; one in-process test drives :class:`Persistence` on a real SQLite file.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, raw_until_terminal, run_server

ADMIN = "sk-admin-accounting-audit"
AUTH = {"authorization": f"Bearer {ADMIN}"}
KEYS = ("fail", "mix", "flag")


def _cli(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hotloop", *args, "--data-dir", str(data)], capture_output=True, text=True, timeout=30
    )


class Env:
    def __init__(self, server: Server, data: Path, secrets: dict[str, str]) -> None:
        self.server = server
        self.data = data
        self.secrets = secrets

    def auth(self, name: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.secrets[name]}"}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("accounting")
    data = tmp / "data"
    secrets = {}
    for name in KEYS:
        out = _cli(data, "keys", "create", name)
        assert out.returncode == 0, out.stderr
        secrets[name] = out.stdout.strip()
    with run_server(
        tmp, "--sim-rate", "0", "--api-key", ADMIN, "--metrics-per-key",
        "--classifier", "tests.classifier_examples:counting", env={"HOTLOOP_DATA_DIR": str(data)},
    ) as s:
        yield Env(s, data, secrets)


# -- what each source says, per key -----------------------------------------------------------

Totals = dict[str, float]


def ledger(server: Server, auth: dict[str, str]) -> Totals:
    """The caller's own rows of /hotloop/usage, summed."""
    r = httpx.get(server.base + "/hotloop/usage", headers=auth, timeout=10)
    assert r.status_code == 200, r.text
    out: Totals = {"responses": 0, "input": 0, "output": 0, "cached": 0}
    for row in r.json()["data"]:
        out["responses"] += row["responses"]
        out["input"] += row["input_tokens"]
        out["output"] += row["output_tokens"]
        out["cached"] += row["cached_tokens"]
    return out


def metrics(server: Server, tenant: str) -> Totals:
    """hotloop_responses_total and hotloop_tokens_total of one key (--metrics-per-key), summed."""
    r = httpx.get(server.base + "/metrics", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    out: Totals = {"responses": 0, "input": 0, "output": 0, "cached": 0}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.labels.get("tenant") != tenant:
                continue
            if s.name == "hotloop_responses_total":
                out["responses"] += s.value
            elif s.name == "hotloop_tokens_total":
                out[s.labels["kind"]] += s.value
    return out


def cli_usage(data: Path, key: str) -> Totals:
    out = _cli(data, "usage", "--key", key)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    header = lines[0].split()
    totals: Totals = {"responses": 0, "input": 0, "output": 0, "cached": 0}
    for line in lines[1:]:
        row = dict(zip(header, line.split()))
        totals["responses"] += int(row["RESPONSES"])
        totals["input"] += int(row["INPUT_TOKENS"])
        totals["output"] += int(row["OUTPUT_TOKENS"])
        totals["cached"] += int(row["CACHED_TOKENS"])
    return totals


def wait_until(check: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def post(server: Server, auth: dict[str, str], **body: Any) -> httpx.Response:
    return httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", **body}, headers=auth, timeout=10)


# -- defects ----------------------------------------------------------------------------------


def test_a_response_failed_before_any_output_counts_its_input_in_metrics_as_in_the_ledger(env: Env) -> None:
    """A response the model fails before any output (``response.failed``, ``usage: null`` on the
    wire) is charged its input in the ledger (README: a response that failed is charged its input
    and the output streamed until then); ``hotloop_tokens_total`` counted 0 input tokens for it,
    so the two disagreed for the same traffic."""
    s, auth = env.server, env.auth("fail")
    r = post(s, auth, input="hello there", metadata={"sim": "text,tokens:1,fail:server_error"})
    assert r.status_code == 502, r.text
    with ws_connect(s.ws + "/responses", additional_headers=auth, open_timeout=5) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hello there",
                            "metadata": {"sim": "text,tokens:1,fail:server_error"}}))
        last = raw_until_terminal(ws)[-1]
    assert last["type"] == "response.failed" and last["response"]["usage"] is None  # failed before output
    led = ledger(s, auth)
    assert led["responses"] == 2 and led["input"] > 0 and led["output"] == 0
    assert metrics(s, "fail") == led


def test_a_burst_of_charges_is_not_dropped_while_the_writer_is_idle(tmp_path: Path) -> None:
    """``Persistence.charge`` (responses cut short or failed) only ever armed the one-second
    timer: past ``USAGE_BUFFER`` records within that second it dropped them ("usage ledger buffer
    full"), although the writer was idle, as when a proxy restart cuts thousands of streams at
    once. ``submit`` queues a batch as soon as one is due; ``charge`` must too."""
    from hotloop.pipeline.post import Persistence, usage_record
    from hotloop.state.store import SQLiteStore

    async def main() -> tuple[int, int]:
        p = Persistence(SQLiteStore(tmp_path / "h.sqlite3"))
        p.USAGE_BATCH, p.USAGE_BUFFER = 64, 256  # (the class's 512 and 8,192, scaled down)
        usage = {"input_tokens": 5, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        try:
            for i in range(1000):
                p.charge(usage_record({"model": "m", "usage": usage}, "key_x", None, "x"))
                if i % 50 == 49:
                    await asyncio.sleep(0.005)  # the writer may run: it is never behind here
            rows = await p.usage("key_x")
            return p.usage_dropped, rows[0]["responses"]
        finally:
            await p.close()

    dropped, counted = asyncio.run(main())
    assert (dropped, counted) == (0, 1000)


@pytest.fixture(scope="module")
def slow_first_token(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("prefill")
    with run_server(tmp, "--sim-rate", "0", "--sim-ttft", "2", "--api-key", ADMIN, "--store", "memory") as s:
        yield s


def test_a_request_charged_during_prefill_is_counted_in_metrics_as_in_the_ledger(slow_first_token: Server) -> None:
    """A client that leaves while the backend works on its request (before the first chunk) is
    charged its input in the ledger, as a response (``responses`` + 1); /metrics counted neither
    the response nor its tokens (only its flags, when a classifier flagged it), so the ledger and
    hotloop_responses_total / hotloop_tokens_total disagreed for the same traffic."""
    s = slow_first_token
    with pytest.raises(httpx.TimeoutException):
        httpx.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": "hello there"}, headers=AUTH, timeout=0.3)
    with ws_connect(s.ws + "/responses", additional_headers=AUTH, open_timeout=5) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hello there"}))
        time.sleep(0.3)
    assert wait_until(lambda: ledger(s, AUTH)["responses"] == 2)
    led = ledger(s, AUTH)
    assert led["input"] > 0
    m = {"responses": 0.0, "input": 0.0, "output": 0.0, "cached": 0.0}
    for fam in text_string_to_metric_families(httpx.get(s.base + "/metrics", headers=AUTH, timeout=5).text):
        for x in fam.samples:
            if x.name == "hotloop_responses_total":
                m["responses"] += x.value
                assert x.labels["status"] == "disconnected"
            elif x.name == "hotloop_tokens_total":
                m[x.labels["kind"]] += x.value
    assert m == led


# -- what held (regression checks; each would fail if the agreement broke) -------------------


def _steer(ws: Any) -> None:
    ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x",
                        "metadata": {"sim": "text,tokens:60,rate:300"}}))
    rid, deltas = None, 0
    while True:
        m = json.loads(ws.recv(timeout=10))
        if m["type"] == "response.created" and rid is None:
            rid = m["response"]["id"]
        elif m["type"] == "response.output_text.delta":
            deltas += 1
            if deltas == 3:
                ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "stop"}))
        elif m["type"] == "response.incomplete":
            assert m["response"]["incomplete_details"] == {"reason": "steered"}
        elif m["type"] in ("response.completed", "response.failed", "error"):
            assert m["type"] == "response.completed", m
            return


def test_every_outcome_counts_the_same_in_the_ledger_the_cli_and_metrics(env: Env) -> None:
    """Completed, incomplete (max_output_tokens), store: false, a generate: false warm-up, a
    backend error mid-stream, a client that leaves mid-stream over SSE and over WebSocket, a
    steered response and its successor, and refusals (a backend 429, a bad request) that are
    not charged: /hotloop/usage, `hotloop usage --key` and /metrics agree, for this key only."""
    s, auth = env.server, env.auth("mix")
    assert post(s, auth, input="hello there").json()["status"] == "completed"
    r = post(s, auth, input="hello there", max_output_tokens=16, metadata={"sim": "text,tokens:50"})
    assert r.json()["status"] == "incomplete"
    assert post(s, auth, input="hello there", store=False).status_code == 200
    assert post(s, auth, input="hello there", metadata={"sim": "text,tokens:20,error"}).status_code == 502
    assert post(s, auth, input="x", metadata={"sim": "rate_limit"}).status_code == 429  # not charged
    assert post(s, auth, input="x", previous_response_id="resp_nope").status_code == 400  # not charged
    with httpx.stream("POST", s.v1 + "/responses", headers=auth, timeout=10,
                      json={"model": "hotloop-sim", "input": "x", "stream": True,
                            "metadata": {"sim": "text,tokens:900,rate:400"}}) as sse:
        seen = 0
        for line in sse.iter_lines():
            seen += '"response.output_text.delta"' in line
            if seen >= 10:
                break
    with ws_connect(s.ws + "/responses", additional_headers=auth, open_timeout=5) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x", "generate": False}))
        assert raw_until_terminal(ws)[-1]["type"] == "response.completed"
        _steer(ws)
        ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "x",
                            "metadata": {"sim": "text,tokens:900,rate:400"}}))
        seen = 0
        while seen < 10:
            seen += json.loads(ws.recv(timeout=10))["type"] == "response.output_text.delta"
    # 4 over HTTP (one failed), 1 SSE cut, warm-up, steered + successor, 1 WebSocket cut
    assert wait_until(lambda: metrics(s, "mix")["responses"] == 9), metrics(s, "mix")
    led = ledger(s, auth)
    assert led["responses"] == 9 and led["cached"] > 0  # (the successor reuses the steered prefix)
    assert metrics(s, "mix") == led
    assert cli_usage(env.data, "mix") == led


def _classified(server: Server) -> float:
    text = httpx.get(server.base + "/metrics", headers=AUTH, timeout=5).text
    return sum(
        x.value for fam in text_string_to_metric_families(text) for x in fam.samples
        if x.name == "hotloop_classified_responses_total"
    )


def test_flagged_and_blocked_inputs_count_the_same_in_the_ledger_and_metrics(env: Env) -> None:
    """A flagged response (completed, and one the model fails before any output) counts once in
    the ledger's ``flagged`` and in hotloop_classified_responses_total; a blocked request is an
    error, charged nowhere."""
    s, auth = env.server, env.auth("flag")
    before = _classified(s)
    assert post(s, auth, input="please flag-me").status_code == 200
    assert post(s, auth, input="flag-me too", metadata={"sim": "text,tokens:1,fail:server_error"}).status_code == 502
    assert post(s, auth, input="block-me now").status_code == 400
    rows = httpx.get(s.base + "/hotloop/usage", headers=auth, timeout=5).json()["data"]
    assert sum(r["responses"] for r in rows) == 2 and sum(r["flagged"] for r in rows) == 2
    assert _classified(s) - before == 2
    assert metrics(s, "flag") == ledger(s, auth)


def test_the_ledger_survives_a_restart_with_a_response_aborted_at_shutdown(tmp_path: Path) -> None:
    """SIGTERM with a response in flight (``--shutdown-grace 0``: it is aborted, failed, charged
    its input and the output streamed): after a restart on the same SQLite file the ledger holds
    every response, as /hotloop/usage read before the stop plus the aborted one."""
    data = tmp_path / "data"
    env = {"HOTLOOP_DATA_DIR": str(data)}
    with run_server(tmp_path, "--sim-rate", "0", "--api-key", ADMIN, "--shutdown-grace", "0", env=env) as s:
        assert post(s, AUTH, input="hello there").status_code == 200
        before = ledger(s, AUTH)
        seen: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", s.v1 + "/responses", headers=AUTH, timeout=10,
                              json={"model": "hotloop-sim", "input": "x", "stream": True,
                                    "metadata": {"sim": "text,tokens:900,rate:200"}}) as r:
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        seen.append(line[7:])
                        if seen[-1] == "response.failed":
                            break  # (the connection closes now: the server need not wait for it)

        t = threading.Thread(target=stream)
        t.start()
        assert wait_until(lambda: seen.count("response.output_text.delta") >= 5)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(10) == 0
        t.join(5)
    assert seen[-1] == "response.failed"
    with run_server(tmp_path, "--sim-rate", "0", "--api-key", ADMIN, env=env) as s:
        after = ledger(s, AUTH)
    assert after["responses"] == before["responses"] + 1
    assert after["input"] > before["input"] and after["output"] >= before["output"] + 5


def test_metrics_follow_prometheus_conventions(env: Env) -> None:
    """Every counter's samples end in ``_total`` (or ``_created``), histograms are cumulative
    with ``+Inf`` equal to ``_count``, and no client-chosen string becomes a label value: an
    unknown model is ``other``, an error code of an odd shape is ``other``."""
    s, auth = env.server, env.auth("mix")
    for i in range(3):
        post(s, auth, model=f"client-model-{i}", input="hi")
    post(s, auth, input="hi", metadata={"sim": "text,tokens:4,fail:weird code!"})
    text = httpx.get(s.base + "/metrics", headers=AUTH, timeout=5).text
    seen_models, seen_codes = set(), set()
    for fam in text_string_to_metric_families(text):
        if fam.type == "counter":
            assert all(x.name.endswith(("_total", "_created")) for x in fam.samples), fam.name
        if fam.type == "histogram":
            series: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
            counts = {}
            for x in fam.samples:
                rest = tuple(sorted((k, v) for k, v in x.labels.items() if k != "le"))
                if x.name.endswith("_bucket"):
                    series.setdefault(rest, []).append((float(x.labels["le"]), x.value))
                elif x.name.endswith("_count"):
                    counts[rest] = x.value
            for rest, buckets in series.items():
                values = [v for _, v in sorted(buckets)]
                assert values == sorted(values) and values[-1] == counts[rest], (fam.name, rest)
        for x in fam.samples:
            if "model" in x.labels:
                seen_models.add(x.labels["model"])
            if "code" in x.labels:
                seen_codes.add(x.labels["code"])
    assert not any(m.startswith("client-model-") for m in seen_models) and "other" in seen_models
    assert "weird code!" not in seen_codes
