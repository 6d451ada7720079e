"""Metrics, server-timing and logs on a real server: ``GET /metrics`` (Prometheus text format)
after turns over HTTP, SSE and WebSocket; its authorisation; the model label's bound; the
``server-timing`` header; ``--log-format json``; ``x-request-id`` sent on to the backend."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server, run_server
from tests.integration.test_websocket import raw_until_terminal
from tests.mock_chat_server import MockChatServer, Reply

ADMIN = "sk-admin-observability"
AUTH = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("observed")
    with run_server(tmp, "--sim-rate", "0", "--api-key", ADMIN, "--log-format", "json", "--access-log", "--store", "memory") as s:
        yield s


def samples(server: Server, headers: dict[str, str] = AUTH) -> dict[str, list[Any]]:
    r = httpx.get(server.base + "/metrics", headers=headers, timeout=5)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def create(server: Server, **body: Any) -> httpx.Response:
    payload = {"model": "hotloop-sim", "input": "hi", **body}
    return httpx.post(server.v1 + "/responses", json=payload, headers=AUTH, timeout=10)


def test_metrics_after_turns_over_http_sse_and_websocket(observed: Server) -> None:
    assert create(observed).status_code == 200
    with httpx.stream("POST", observed.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi", "stream": True},
                      headers=AUTH, timeout=10) as r:
        assert r.status_code == 200
        r.read()
    with ws_connect(observed.ws + "/responses", additional_headers=AUTH, open_timeout=10) as ws:
        for _ in range(2):
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "hi"}))
            assert raw_until_terminal(ws)[-1]["type"] == "response.completed"
    assert create(observed, model="no-such-model-xyz").status_code == 200  # the simulator answers any model
    m = samples(observed)
    counts = {(s.labels["stage"], s.labels["transport"]): s.value for s in m["hotloop_stage_seconds_count"]}
    for transport in ("json", "sse", "ws"):
        for stage in ("parse", "resolve", "classify", "prepare", "first_token", "generation", "persist"):
            assert counts.get((stage, transport), 0) >= 1, (stage, transport, counts)
    assert counts[("generation", "ws")] >= 2
    done = {(s.labels["transport"], s.labels["model"]): s.value for s in m["hotloop_responses_total"]
            if s.labels["status"] == "completed"}
    assert done[("json", "hotloop-sim")] >= 1 and done[("ws", "hotloop-sim")] >= 2
    models = {s.labels["model"] for s in m["hotloop_responses_total"]}
    assert "no-such-model-xyz" not in models and "other" in models  # bounded label set
    out = sum(s.value for s in m["hotloop_tokens_total"] if s.labels["kind"] == "output")
    assert out > 0
    assert sum(s.value for s in m["hotloop_output_tokens_per_second_count"]) >= 4
    assert m["hotloop_store_queue_depth"][0].value >= 0
    assert {s.labels["transport"] for s in m["hotloop_open_connections"]} == {"http", "sse", "websocket"}
    assert {s.labels["result"] for s in m["hotloop_prefix_cache_lookups_total"]} == {"hit", "miss"}


def test_errors_are_counted(observed: Server) -> None:
    r = httpx.post(observed.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi", "previous_response_id": "resp_nope"},
                   headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    m = samples(observed)
    codes = {(s.labels["status"], s.labels["code"]): s.value for s in m["hotloop_errors_total"]}
    assert codes[("400", "previous_response_not_found")] >= 1


def test_websocket_error_frames_are_counted_as_http_errors_are(observed: Server) -> None:
    """Error frames the session sends itself (a frame that is not JSON, an unknown item type,
    a wrong type) were not counted: only the errors of a response's own start were."""
    def count(code: str) -> float:
        return sum(s.value for s in samples(observed).get("hotloop_errors_total", []) if s.labels["code"] == code)

    frames = {
        "invalid_json": "{not json",
        "invalid_value": json.dumps({"type": "response.create", "model": "m", "input": [{"type": "message", "role": "nobody", "content": "x"}]}),
        "invalid_type": json.dumps({"type": "response.create", "model": "m", "input": 5}),
    }
    before = {code: count(code) for code in frames}
    with ws_connect(observed.ws + "/responses", additional_headers=AUTH, open_timeout=10) as ws:
        for code, frame in frames.items():
            ws.send(frame)
            event = json.loads(ws.recv(timeout=10))
            assert event["type"] == "error" and event["error"]["code"] == code, event
    for code in frames:
        assert count(code) == before[code] + 1, code


def test_a_backend_failure_is_counted_once(observed: Server) -> None:
    """A JSON response the backend fails mid-stream counts one backend error (not one for the
    failed response and another for the HTTP error answering it); model failures count none."""

    def backend_errors() -> float:
        return sum(x.value for x in samples(observed).get("hotloop_backend_errors_total", []))

    before = backend_errors()
    r = create(observed, metadata={"sim": "tokens:20,error"})
    assert r.status_code >= 500
    assert backend_errors() == before + 1
    r = create(observed, metadata={"sim": "fail:server_error"})  # the model's own failure
    assert r.status_code >= 500
    assert backend_errors() == before + 1


def test_a_response_its_client_left_is_counted(observed: Server) -> None:
    """A response cut short (its client hung up) counts as ``disconnected``, with the tokens it
    is charged (its input and the output streamed so far)."""

    def cut() -> dict[str, float]:
        m = samples(observed)  # (a labelled family has no samples before its first response)
        out = {s.labels["transport"]: s.value for s in m.get("hotloop_responses_total", []) if s.labels["status"] == "disconnected"}
        out["tokens"] = sum(s.value for s in m.get("hotloop_tokens_total", []) if s.labels["kind"] == "output")
        return out

    before = cut()
    body = {"model": "hotloop-sim", "input": "x", "metadata": {"sim": "text,tokens:900,rate:400"}}
    with httpx.stream("POST", observed.v1 + "/responses", json={**body, "stream": True}, headers=AUTH, timeout=10) as r:
        seen = 0
        for line in r.iter_lines():
            seen += '"response.output_text.delta"' in line
            if seen >= 50:
                break
    with ws_connect(observed.ws + "/responses", additional_headers=AUTH, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "response.create", **body}))
        seen = 0
        while seen < 50:
            seen += json.loads(ws.recv(timeout=10))["type"] == "response.output_text.delta"
    deadline = time.monotonic() + 10
    while True:
        after = cut()
        if after.get("sse", 0) >= before.get("sse", 0) + 1 and after.get("ws", 0) >= before.get("ws", 0) + 1:
            break
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.05)
    assert 100 <= after["tokens"] - before["tokens"] < 1800  # what was streamed, not the whole answers


def test_metrics_need_a_key(observed: Server) -> None:
    assert httpx.get(observed.base + "/metrics", timeout=5).status_code == 401
    bad = httpx.get(observed.base + "/metrics", headers={"authorization": "Bearer sk-wrong"}, timeout=5)
    assert bad.status_code == 401


def test_metrics_public_and_off(tmp_path: Path) -> None:
    with run_server(tmp_path, "--api-key", ADMIN, "--metrics-public", "--store", "memory") as s:
        assert httpx.get(s.base + "/metrics", timeout=5).status_code == 200
        assert httpx.get(s.v1 + "/models", timeout=5).status_code == 401  # only /metrics is open
    with run_server(tmp_path, "--no-metrics", "--store", "memory") as s:
        assert httpx.get(s.base + "/metrics", timeout=5).status_code == 404


_TIMING = re.compile(r"^[a-z]+;dur=\d+\.\d{3}$")


def timing(header: str) -> dict[str, float]:
    parts = [p.strip() for p in header.split(",")]
    assert all(_TIMING.match(p) for p in parts), header
    return {p.split(";")[0]: float(p.split("=")[1]) for p in parts}


def test_server_timing(observed: Server) -> None:
    r = create(observed)
    t = timing(r.headers["server-timing"])
    assert set(t) == {"pre", "ttft", "total"} and 0 <= t["pre"] <= t["ttft"] <= t["total"]
    with httpx.stream("POST", observed.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi", "stream": True},
                      headers=AUTH, timeout=10) as s:
        t = timing(s.headers["server-timing"])
        assert set(t) == {"pre", "ttft"} and t["pre"] <= t["ttft"]
        s.read()
    e = httpx.get(observed.v1 + "/responses/resp_nope", headers=AUTH, timeout=5)
    assert e.status_code == 404 and set(timing(e.headers["server-timing"])) == {"total"}
    assert set(timing(httpx.get(observed.base + "/healthz", timeout=5).headers["server-timing"])) == {"total"}


def test_json_logs(observed: Server) -> None:
    r = create(observed)
    rid = r.headers["x-request-id"]
    # The response's line is logged with its bookkeeping, right after the answer: wait for it.
    for _ in range(100):
        lines = [ln for ln in observed.logs().splitlines() if ln.strip()]
        objs = [json.loads(ln) for ln in lines]  # every line is one JSON object
        mine = [o for o in objs if o.get("request_id") == rid]
        if mine:
            break
        time.sleep(0.05)
    assert all(isinstance(o, dict) and {"time", "level", "logger", "message"} <= set(o) for o in objs)
    assert len(mine) == 1, mine
    o = mine[0]
    assert o["logger"] == "hotloop.response" and o["transport"] == "json" and o["status"] == "completed"
    assert o["model"] == "hotloop-sim" and o["output_tokens"] > 0 and o["key"]
    assert set(o["stages_ms"]) == {"parse", "resolve", "classify", "prepare", "first_token", "generation", "persist"}
    assert any(o["logger"].startswith("uvicorn") for o in objs)  # uvicorn's own lines, as JSON too
    access = [o for o in objs if o["logger"] == "uvicorn.access"]  # --access-log
    assert any("POST /v1/responses" in o["message"] for o in access), access[-3:]


@pytest.mark.parametrize("transport", ["lean", "sdk"])
def test_request_id_reaches_the_backend(tmp_path: Path, transport: str) -> None:
    with MockChatServer() as mock:
        env = {"HOTLOOP_BACKEND_TRANSPORT": transport, "HOTLOOP_BACKEND_API_KEY": "k", "HOTLOOP_BACKEND_RETRIES": "0"}
        args = ("--backend", "openai-compat", "--base-url", mock.v1, "--model", "mock-model", "--store", "memory")
        with run_server(tmp_path, *args, env=env) as s:
            r = httpx.post(s.v1 + "/responses", json={"model": "mock-model", "input": "hi"}, timeout=10)
            assert r.status_code == 200, r.text
            chats = [q for q in mock.requests if q.path.endswith("/chat/completions")]
            assert chats[-1].headers["x-request-id"] == r.headers["x-request-id"]
            # a backend failure: counted by kind, and its log line names the request
            mock.push(Reply.error(500, {"message": "boom"}))
            bad = httpx.post(s.v1 + "/responses", json={"model": "mock-model", "input": "hi"}, timeout=10)
            assert bad.status_code >= 500
            m = samples(s, {})
            assert sum(x.value for x in m["hotloop_backend_errors_total"]) >= 1
            assert sum(x.value for x in m["hotloop_errors_total"] if x.labels["status"] == str(bad.status_code)) >= 1


def test_multiprocess_mode(tmp_path: Path) -> None:
    mp = tmp_path / "prom"
    mp.mkdir()
    with run_server(tmp_path, "--store", "memory", "--sim-rate", "0", env={"PROMETHEUS_MULTIPROC_DIR": str(mp)}) as s:
        assert httpx.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi"}, timeout=10).status_code == 200
        m = samples(s, {})
        counts = {s_.labels["stage"]: s_.value for s_ in m["hotloop_stage_seconds_count"]}
        assert set(counts) == {"parse", "resolve", "classify", "prepare", "first_token", "generation", "persist"}
        assert any(f.name.endswith(".db") for f in mp.iterdir())  # values written to the shared directory


def test_the_server_freezes_what_start_up_loaded(server: Server) -> None:
    """``hotloop serve`` moves what start-up loaded out of the cyclic collector's sight
    (``gc.freeze``): a full collection then walks only what serving made. The stats show it."""
    r = httpx.post(server.base + "/v1/responses", json={"model": "hotloop-sim", "input": "hi"}, timeout=30)
    assert r.status_code == 200
    stats = httpx.get(server.base + "/hotloop/stats", timeout=10).json()
    gc_stats = stats["gc"]
    assert gc_stats["frozen"] > 10_000  # the modules, the vocabulary, the backend's client
    # whether the compiled modules run: as this process resolved them (the server is another)
    from hotloop import _accel

    assert stats["native"] is _accel.NATIVE
    assert len(gc_stats["collections"]) == 3 and all(isinstance(n, int) for n in gc_stats["collections"])


def _handshakes(server: Server) -> None:
    """An accepted WebSocket connection that leaves between responses, and one refused (no key)."""
    with ws_connect(server.ws + "/responses", additional_headers=AUTH, open_timeout=10):
        pass
    with pytest.raises(InvalidStatus) as refused:
        ws_connect(server.ws + "/responses", open_timeout=10)
    assert refused.value.response.status_code == 401


def test_websocket_handshakes_are_logged_only_with_the_access_log(observed: Server, tmp_path: Path) -> None:
    """A handshake's outcome is an access-log line: logged with --access-log, not without it (a
    flood of unauthenticated handshakes must not flood the log); a client that leaves between its
    responses is no news either."""
    with run_server(tmp_path, "--sim-rate", "0", "--api-key", ADMIN, "--log-format", "json", "--store", "memory") as quiet:
        httpx.get(quiet.base + "/healthz", timeout=5)
        time.sleep(0.3)
        before = len(quiet.logs().splitlines())
        _handshakes(quiet)
        _handshakes(observed)
        for _ in range(100):  # (the lines of the accepted connection's end come after the client's close)
            if '[accepted]' in observed.logs() and '\\" 401' in observed.logs():
                break
            time.sleep(0.05)
        assert "[accepted]" in observed.logs()
        assert '\\" 401' in observed.logs()
        healthy = httpx.get(quiet.base + "/healthz", timeout=5)  # (the quiet server's lines so far are flushed)
        assert healthy.status_code == 200
        time.sleep(0.3)
        lines = [json.loads(ln) for ln in quiet.logs().splitlines() if ln.strip()]
        assert len(lines) >= before > 0, "the server logged nothing at all"
        assert lines[before:] == [], lines[before:]  # not a line for the handshakes
        said = [o["message"] for o in lines]
        assert not [m for m in said if "WebSocket" in m or "websocket" in m], said


def test_every_metric_the_dashboard_plots_is_exported(observed: Server) -> None:
    """``dashboards/hotloop.json`` plots only metrics the server exports (by family: a labelled
    counter nothing has counted yet has its ``# TYPE`` line and no sample)."""
    root = Path(__file__).resolve().parents[2]
    dashboard = json.loads((root / "dashboards" / "hotloop.json").read_text())
    plotted = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", ())
        for name in re.findall(r"\bhotloop_[a-z_]+", target["expr"])
    }
    assert len(plotted) >= 15
    text = httpx.get(observed.base + "/metrics", headers=AUTH, timeout=5).text
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    exported = families | {f + "_total" for f in families} | {f + suffix for f in families for suffix in ("_bucket", "_count", "_sum")}
    assert plotted <= exported, sorted(plotted - exported)
