"""``hotloop bench loop`` end to end: real ``hotloop serve`` processes, the real mock model, and a
small fake Responses server whose faults the checks must catch (exit code 1) while its correct
mode passes (exit code 0)."""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import httpx
import pytest

from hotloop.bench import mock_process
from hotloop.protocol import events as ev

SMALL = ["--bytes", "512", "--output-tokens", "8", "--ttft", "5", "--rate", "2000"]


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CEREBRAS_API_KEY": "bench"}
    return subprocess.run(
        [sys.executable, "-m", "hotloop", "bench", "loop", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_loop_ten_turns_all_transports_and_direct() -> None:
    r = _bench("--turns", "10", "--json", *SMALL)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    report = json.loads(r.stdout)
    assert report["ok"] is True and report["violation_count"] == 0 and report["violations"] == []
    assert report["context_check"] == "echo"
    assert set(report["transports"]) == {"http-full", "http-prev", "ws-prev", "ws-full"}
    direct = report["direct"]
    assert direct["turns"] == 10 and direct["failed_turns"] == 0
    # the mock waits 5 ms, then streams 8 tokens at 2,000/s: a turn takes at least ~8 ms
    assert 5 <= direct["ttft_p50_ms"] < direct["turn_p50_ms"] < 2000
    for name, s in report["transports"].items():
        assert s["turns"] == 10 and s["failed_turns"] == 0, name
        assert 5 <= s["ttft_p50_ms"] <= s["ttft_p95_ms"], name
        assert s["ttft_p50_ms"] < s["turn_p50_ms"] <= s["turn_p95_ms"] < 2000, name
        assert 0.5 < s["over_direct_p50"] < 20, name
        # added time: this transport's turns against the direct floor's, turn by turn (one agent)
        diffs = [a - d for a, d in zip(s["series"]["turn_ms"], direct["series"]["turn_ms"])]
        assert s["added_mean_ms"] == pytest.approx(statistics.mean(diffs), abs=0.05), name
        assert min(diffs) <= s["added_p50_ms"] <= max(diffs), name
        assert 0 < s["server_cpu_per_turn_ms"] < 1000, name
        assert len(s["series"]["turn_ms"]) == 10 and len(s["series"]["server_cpu_ms"]) == 10, name
        assert s["wall_s"] >= sum(s["series"]["turn_ms"]) / 1e3 * 0.9, name
    # the human report names everything too
    r = _bench("--turns", "3", *SMALL, "--transports", "ws-prev")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "direct" in r.stdout and "ws-prev" in r.stdout and "violations: none" in r.stdout


def test_loop_simulator_backend_usage_check() -> None:
    r = _bench("--turns", "5", "--json", "--backend", "simulator", "--transports", "http-prev,ws-prev", *SMALL)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    report = json.loads(r.stdout)
    assert report["context_check"] == "usage" and report["ok"] is True
    assert set(report["transports"]) == {"http-prev", "ws-prev"} and report["direct"]["turns"] == 5


class _Fake(BaseHTTPRequestHandler):
    """Just enough of ``POST /v1/responses`` (SSE) in front of the mock model, with a fault:
    ``forget`` drops the history of ``previous_response_id``; ``badseq`` skips a sequence number;
    ``ok`` has none; ``plain`` answers by itself (a model that is not the mock)."""

    protocol_version = "HTTP/1.1"
    mode = "ok"
    upstream = ""
    history: dict[str, list[dict[str, Any]]] = {}
    ids = itertools.count()

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prev = [] if self.mode == "forget" else self.history.get(body.get("previous_response_id") or "", [])
        messages = prev + _messages(body["input"])
        chat = {"model": body["model"], "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "tools": [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in body["tools"]]}
        if self.mode == "plain":  # a model that is not the mock: no context echo
            raw = b'data: {"choices":[{"delta":{"tool_calls":[{"id":"call_p","function":{"arguments":"{\\"cmd\\": \\"ls\\"}"}}]}}]}\n'
        else:
            raw = httpx.post(self.upstream + "/v1/chat/completions", json=chat, timeout=30).content
        pieces, call_id = [], "call_x"
        for line in raw.split(b"\n"):
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:]).get("choices", ()):
                    for tc in (choice.get("delta") or {}).get("tool_calls") or ():
                        call_id = tc.get("id") or call_id
                        pieces.append(tc["function"].get("arguments") or "")
        rid = f"resp_{next(self.ids)}"
        call = {"type": "function_call", "id": "fc_" + rid, "call_id": call_id, "name": "run", "arguments": "", "status": "in_progress"}
        done = {**call, "arguments": "".join(pieces), "status": "completed"}
        resp = {"id": rid, "object": "response", "status": "in_progress", "model": body["model"], "output": []}
        events: list[dict[str, Any]] = [{"type": ev.CREATED, "response": resp}, {"type": ev.OUTPUT_ITEM_ADDED, "output_index": 0, "item": call}]
        events += [{"type": ev.FUNCTION_CALL_ARGUMENTS_DELTA, "output_index": 0, "item_id": call["id"], "delta": p} for p in pieces]
        events += [
            {"type": ev.FUNCTION_CALL_ARGUMENTS_DONE, "output_index": 0, "item_id": call["id"], "arguments": done["arguments"]},
            {"type": ev.OUTPUT_ITEM_DONE, "output_index": 0, "item": done},
            {"type": ev.COMPLETED, "response": {**resp, "status": "completed", "output": [done],
                                                "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}},
        ]
        out = b""
        for seq, e in enumerate(events):
            if self.mode == "badseq" and seq >= 3:
                seq += 1
            out += f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': seq})}\n\n".encode()
        self.history[rid] = messages + _messages([done])
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def _messages(items: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for it in items:
        if it.get("type") == "function_call":
            out.append({"role": "assistant", "tool_calls": [{"id": it["call_id"], "type": "function",
                                                             "function": {"name": it["name"], "arguments": it["arguments"]}}]})
        elif it.get("type") == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
        else:
            out.append({"role": it["role"], "content": it["content"]})
    return out


@contextlib.contextmanager
def _fake(mode: str) -> Iterator[tuple[str, str]]:
    """(fake server URL, mock URL)."""
    with mock_process() as (mock, _pid):
        handler = type("Handler", (_Fake,), {"mode": mode, "upstream": mock, "history": {}})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        try:
            yield f"http://127.0.0.1:{srv.server_address[1]}", mock
        finally:
            srv.shutdown()
            srv.server_close()


@pytest.mark.parametrize(
    ("mode", "transport", "expect"),
    [("ok", "http-prev", None), ("forget", "http-prev", "lost context"), ("badseq", "http-full", "sequence_number")],
)
def test_foreign_server_faults_are_violations(mode: str, transport: str, expect: str | None) -> None:
    with _fake(mode) as (url, mock):
        model = "bench-2000-8-tool"
        r = _bench("--url", url, "--model", model, "--direct-url", mock, "--turns", "4", "--transports", transport,
                   "--bytes", "256", "--json")
    report = json.loads(r.stdout)
    assert report["context_check"].startswith("echo (detected"), report["context_check"]
    assert report["direct"]["turns"] == 4 and "server_cpu_per_turn_ms" not in report["transports"][transport]
    if expect is None:
        assert r.returncode == 0 and report["ok"] and report["violations"] == [], report["violations"]
        return
    assert r.returncode == 1, r.stderr[-2000:]
    assert report["ok"] is False and report["violation_count"] >= 1
    whats = [v["what"] for v in report["violations"]]
    assert all(v["transport"] == transport for v in report["violations"])
    assert any(expect in w for w in whats), whats
    if mode == "forget":  # turn 1 is the first to continue a response
        assert min(v["turn"] for v in report["violations"]) == 1


def test_foreign_server_without_the_mock_has_no_context_check() -> None:
    with _fake("plain") as (url, _mock):
        r = _bench("--url", url, "--model", "m", "--turns", "3", "--transports", "http-full", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["context_check"] == "not available (foreign server)" and report["direct"] is None
    assert report["transports"]["http-full"]["turns"] == 3
    # nothing listening: every transport's turn fails, which is a violation too
    r = _bench("--url", "http://127.0.0.1:9", "--model", "m", "--turns", "1", "--json")
    assert r.returncode == 1
    violations = json.loads(r.stdout)["violations"]
    assert {v["transport"] for v in violations} == {"http-full", "http-prev", "ws-prev", "ws-full"}
    assert all(v["what"].startswith("turn failed") for v in violations), violations


def test_usage_errors_exit_2() -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from hotloop.bench.loop import main\n"
        "sys.exit(main(['--turns', '1', '--plot', 'x.png']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "matplotlib" in r.stderr
    r = _bench("--transports", "carrier-pigeon")
    assert r.returncode == 2 and "carrier-pigeon" in r.stderr
    r = _bench("--url", "http://127.0.0.1:9")
    assert r.returncode == 2 and "--model" in r.stderr
    r = subprocess.run([sys.executable, "-m", "hotloop", "bench", "paired", "--server-env", "NOEQUALS"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "NAME=VALUE" in r.stderr
    for gap in ("-1", "nan", "20000"):
        r = subprocess.run([sys.executable, "-m", "hotloop", "bench", "http-loop", "--gap-ms", gap], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--gap-ms" in r.stderr, gap


def test_plot(tmp_path: Any) -> None:
    """With matplotlib (hotloop[bench]) a PNG of both panels; without it, exit 2 and no file."""
    import importlib.util

    out = tmp_path / "loop.png"
    r = _bench("--turns", "3", *SMALL, "--transports", "ws-prev,http-full", "--plot", str(out))
    if importlib.util.find_spec("matplotlib") is None:
        assert r.returncode == 2 and "matplotlib" in r.stderr and not out.exists()
        return
    assert r.returncode == 0, r.stderr[-2000:]
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


@pytest.mark.parametrize("transport", ["ws-prev", "http-prev", "http-json"])
def test_paired_alternates_turns_between_two_servers(transport: str) -> None:
    """``hotloop bench paired``: two real servers on the real mock, the same conversation's turns
    alternating between them; both report CPU for every turn."""
    env = {**os.environ, "CEREBRAS_API_KEY": "bench"}
    args = ["paired", "--turns", "4", "--tool-tokens", "4", "--turn-transport", transport, "--json",
            "--server-args", "--flush-interval-ms 5", "--server-env", "HOTLOOP_TEST_MARK=b=1"]
    if transport == "ws-prev":
        args.append("--agent-settings")  # 29 KB of instructions and tools every turn
    proc = subprocess.run([sys.executable, "-m", "hotloop", "bench", *args], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["scenario"] == "paired" and out["transport"] == transport and out["turns"] == 4
    assert out["server_b_args"] == ["--flush-interval-ms", "5"] and out["server_b_env"] == {"HOTLOOP_TEST_MARK": "b=1"}
    assert out["agent_settings"] is (transport == "ws-prev")
    assert [s["server"] for s in out["servers"]] == ["A", "B"]
    assert all(s["python_path"] == "(installed)" and s["cpu_per_turn_mean_ms"] > 0 for s in out["servers"])
    # a turn streams 4 tokens at 1,000 tokens/s after 20 ms: at least 24 ms of wall time
    assert all(s["wall_per_turn_p50_ms"] > 20 for s in out["servers"])
    assert 0.2 < out["b_over_a_paired_median"] < 5
    assert 0.2 < out["b_over_a_mean"] < 5 and 0.2 < out["b_over_a_trimmed_mean"] < 5
    assert out["b_over_a_mean_ci95"] is None  # four turns: no interval (paired_summary)
    assert abs(out["b_minus_a_wall_paired_median_ms"]) < 20


@pytest.mark.parametrize(("only", "prefill"), [(None, 0), ("http-json", 0), ("http-prev", 2)])
def test_agent_turns_every_transport_or_one_alone(only: str | None, prefill: int) -> None:
    """``hotloop bench agent-turns`` on the real mock: each turn's CPU and wall time against the
    direct loop, over the three transports or the one ``--turn-transport`` names. (Without the
    naive proxy, which needs aiohttp from the ``bench`` extra.) ``--store-prefill``: a storing
    transport's server first serves that many turns of another conversation, which it stores."""
    env = {**os.environ, "CEREBRAS_API_KEY": "bench"}
    args = ["agent-turns", "--turns", "3", "--tool-tokens", "4", "--no-naive", "--json"]
    if only:
        args += ["--turn-transport", only]
    if prefill:
        args += ["--store-prefill", str(prefill)]
    proc = subprocess.run([sys.executable, "-m", "hotloop", "bench", *args], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["scenario"] == "agent-turns" and out["relay_floor_cpu_per_turn_ms"] > 0
    assert out["relay_history_floor_cpu_per_turn_ms"] > 0
    rows = out["transports"]
    assert [r["transport"] for r in rows] == ([only] if only else ["ws-prev", "http-full", "http-prev"])
    for r in rows:
        h = r["hotloop"]
        assert h["turns"] == 3 and h["cpu_per_turn_p50_ms"] > 0 and "naive" not in r
        assert h["fit_last_over_turn_10"] is None and h["growth_paired"] is None  # (fewer than 15 turns)
        assert 0 < h["main_thread_cpu_per_turn_mean_ms"] < 2 * h["cpu_per_turn_mean_ms"]
        assert r["cpu_p50_hotloop_over_history_floor"] > 0
        # a turn streams 4 tokens at 1,000 tokens/s after 20 ms: at least 24 ms of wall time
        assert h["wall_per_turn_p50_ms"] > 20
        stores = r["transport"] in ("http-prev", "http-json")
        assert r.get("store_prefill") == (prefill if stores and prefill else None)
        # every stored turn: the prefill's, the three of the warm-up and the three measured
        assert r.get("stored_responses") == (prefill + 6 if stores else None)


def test_agent_turns_growth_over_twenty_turns() -> None:
    """Growth with the history (from 15 turns on): a line fitted through the turns, and the turns
    of a second conversation paired with those of short ones on the same server."""
    env = {**os.environ, "CEREBRAS_API_KEY": "bench"}
    args = ["agent-turns", "--turns", "20", "--tool-tokens", "4", "--no-naive", "--json", "--turn-transport", "ws-prev"]
    proc = subprocess.run([sys.executable, "-m", "hotloop", "bench", *args], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])["transports"]
    h = row["hotloop"]
    assert h["turns"] == 20
    # (a turn's CPU hardly grows over 20 turns of 2 KB; bounds that only a broken measure leaves)
    assert 0.3 < h["fit_last_over_turn_10"] < 3 and 0.3 < h["growth_paired"] < 3


def test_store_prefill_is_not_negative() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hotloop", "bench", "agent-turns", "--store-prefill", "-1"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--store-prefill: 0 or more" in proc.stderr


def test_stream_cerebras_over_tls() -> None:
    """``--mock-tls``: the mock behind a throwaway CA's certificate, which the server (started by
    the bench, inheriting SSL_CERT_FILE) trusts; the stream goes through."""
    env = {**os.environ, "CEREBRAS_API_KEY": "bench"}
    env.pop("SSL_CERT_FILE", None)
    args = ["stream-cerebras", "--mock-tls", "--tokens", "200", "--json"]
    proc = subprocess.run([sys.executable, "-m", "hotloop", "bench", *args], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["scenario"] == "stream-cerebras" and out["mock_tls"] is True
    assert out["tokens"] == 200 and out["delivered_rate"] > 0 and out["cpu_per_event_unpaced_us"] > 0


def test_a_bench_server_leaves_no_data_directory_behind(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every server a benchmark starts gets its own data directory, removed when it stops (runs
    used to leave one, with its SQLite store, in the temporary directory each time)."""
    import tempfile

    from hotloop.bench import server

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with server("--store", "sqlite", env={"HOTLOOP_TEST_MARK": "b=1"}) as (base, pid):
        made = [p for p in tmp_path.iterdir() if p.name.startswith("hotloop-bench-")]
        assert len(made) == 1
        with open(f"/proc/{pid}/environ", "rb") as fh:  # `paired --server-env` reaches the server
            assert b"HOTLOOP_TEST_MARK=b=1" in fh.read().split(b"\0")
        r = httpx.post(base + "/v1/responses", json={"model": "hotloop-sim", "input": "hi", "store": True}, timeout=30)
        assert r.status_code == 200
        assert (made[0] / "hotloop.sqlite3").exists()
    assert list(tmp_path.iterdir()) == []


def test_http_loop_reports_both_conversations_from_the_marks_and_the_whole_process() -> None:
    from hotloop.bench import bench_loop

    out = bench_loop("http-loop", 6, 512)
    assert out["turns"] == 6 and out["turns_with_cached_tokens"] == 5  # every turn after the first
    for key in ("server_cpu_per_turn_p50_us", "ws_cpu_per_turn_p50_us", "process_cpu_per_turn_p50_us", "process_ws_cpu_per_turn_p50_us"):
        assert out[key] > 0, key
    # the whole process's CPU for a turn holds the turn's own (its reading, parsing and writing too)
    assert out["process_cpu_per_turn_p50_us"] > out["server_cpu_per_turn_p50_us"]
    assert out["process_http_over_ws_paired_p50"] > 0 and out["process_http_over_ws_last5"] > 0
    assert out["process_http_over_ws_last10_paired_p50"] > 0
    # each conversation pays for its own texts: none of its token counts comes from the other's;
    # the only counts found are those of answers repeating an earlier answer (a few runs in a
    # hundred: the simulator draws its answers from a corpus of a few thousand positions)
    assert out["token_cache_hits"] == out["repeated_outputs"] >= 0


def test_loop_turns_wait_for_the_gap_after_their_reading() -> None:
    import time

    from hotloop.bench import _timed

    into: list[float] = []
    t0 = time.monotonic()
    assert list(_timed(iter("abc"), os.getpid(), into, gap=0.1)) == ["a", "b", "c"]
    assert time.monotonic() - t0 >= 0.3  # the client's 0.1 s after each turn
    assert len(into) == 3 and all(us < 50_000 for us in into)  # not counted in the turns' CPU (a sleep: none)


def test_http_loop_reports_what_an_http_turn_costs_over_its_pair() -> None:
    from hotloop.bench import bench_loop

    out = bench_loop("http-loop", 4, 512, gap=0.01)
    assert out["gap_ms"] == 10 and out["turns"] == 4
    extra, http, ws = out["process_http_extra_last10_us"], out["process_cpu_per_turn_p50_us"], out["process_ws_cpu_per_turn_p50_us"]
    # a median of differences, within what the two medians allow (4 pairs: the mean of the middle two)
    assert isinstance(extra, float) and abs(extra) < max(http, ws)
    assert bench_loop("ws-loop", 2, 128)["gap_ms"] == 0


def test_http_loop_repeated_reports_the_median_of_its_runs() -> None:
    from hotloop.bench import bench_loop_repeated

    out = bench_loop_repeated("http-loop", 4, 512, 3)
    assert out["repeats"] == 3 and len(out["runs"]) == 3
    for key in ("process_http_over_ws_paired_p50", "process_http_over_ws_last10_paired_p50", "server_cpu_per_turn_p50_us"):
        runs = sorted(r[key] for r in out["runs"])
        assert runs[0] > 0 and out[key] == round(runs[1], 4), key  # each run measured; the middle one reported
    assert out["turns"] == 4 and out["turns_with_cached_tokens"] == 3  # counts: the same in every run
    assert bench_loop_repeated("ws-loop", 3, 256, 1)["turns"] == 3  # one run: its own figures, as before


def test_history_body_is_what_a_client_encoding_the_whole_history_sends() -> None:
    from hotloop.bench import HistoryBody

    def compact(obj: Any) -> bytes:  # httpx's json= (and most clients): compact, UTF-8
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()

    before, after = {"model": "hotloop-sim", "store": False}, {"metadata": {"sim": "text,tokens:16"}}
    body = HistoryBody(before, after)
    items: list[dict[str, Any]] = []
    assert body.body() == compact({**before, "input": items, **after})
    for i in range(4):
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"tür {i} \"q\""}]}
        body.add(item)
        items.append(item)
        assert body.body() == compact({**before, "input": items, **after})
    lone = HistoryBody({}, {})
    lone.add({"a": 1})
    assert lone.body() == b'{"input":[{"a":1}]}'


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs; on one it is off (split_cpus is None)")
def test_loop_benchmarks_run_the_server_and_the_client_on_cpus_of_their_own() -> None:
    from hotloop.bench import bench_loop, client_cpus, server, split_cpus

    split = split_cpus()
    assert split is not None
    mine, theirs = split[1], split[0]
    assert mine and theirs and not (mine & theirs) and mine | theirs == os.sched_getaffinity(0)
    before = os.sched_getaffinity(0)
    with server("--sim-rate", "0", cpus=theirs) as (base, pid), client_cpus(mine):
        assert os.sched_getaffinity(0) == mine
        r = httpx.post(base + "/v1/responses", json={"model": "hotloop-sim", "input": "hi"}, timeout=30)
        assert r.status_code == 200
        tids = os.listdir(f"/proc/{pid}/task")
        assert tids and all(os.sched_getaffinity(int(t)) == theirs for t in tids)  # every thread of it
    assert os.sched_getaffinity(0) == before  # given back
    assert bench_loop("ws-loop", 2, 128)["pinned"] is True
    assert bench_loop("ws-loop", 2, 128, pin=False)["pinned"] is False
