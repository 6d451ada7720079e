"""Scale-out with real components: a ``redis-server`` and two ``hotloop serve --store redis``
replicas on free ports (state made on one is continued, retrieved and referenced on the other;
one key's limits and revocation hold across both; a replica killed mid-chain; Redis stopped and
restarted mid-run), nginx with ``deploy/nginx.conf`` in front of them (the openai SDK's HTTP and
WebSocket tool loops), and ``--workers 2``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from openai import OpenAI
from websockets.sync.client import connect as ws_connect

from hotloop.pipeline.shared import VISIBILITY_BOUND
from hotloop.state.store import SQLiteStore
from tests.conftest import Server, free_port, run_server
from tests.services import Redis, redis_server, require, stop, wait_port

ROOT = Path(__file__).resolve().parents[2]
WAIT = 8.0  # bound on every poll in these tests


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    with redis_server(tmp_path_factory.mktemp("redis")) as r:
        yield r


def replica(tmp: Path, url: str, *args: str) -> contextlib.AbstractContextManager[Server]:
    return run_server(tmp, "--store", "redis", "--redis-url", url, "--sim-rate", "0", *args)


@contextlib.contextmanager
def replicas(tmp: Path, url: str) -> Iterator[tuple[Server, Server]]:
    with replica(tmp, url) as a, replica(tmp, url) as b:
        yield a, b


def keys(url: str, *args: str) -> str:
    """``hotloop keys ...`` on the Redis store; its stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "hotloop", "keys", *args, "--store", "redis", "--redis-url", url],
        capture_output=True, text=True, timeout=30, check=True,
    )
    return proc.stdout.strip()


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def create(server: Server, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.v1 + "/responses", json={"model": "hotloop-sim", **body}, headers=headers, timeout=30)


def ws_turn(ws: Any, **body: Any) -> dict[str, Any]:
    """One response.create on a raw WebSocket; its final response object."""
    ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", **body}))
    while True:
        ev = json.loads(ws.recv(timeout=WAIT))
        if ev["type"] in ("response.completed", "response.failed", "error"):
            assert ev["type"] == "response.completed", ev
            return ev["response"]  # type: ignore[no-any-return]


def user(text: str) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


def poll(fn: Any, what: str, wait: float = WAIT) -> Any:
    deadline = time.monotonic() + wait
    while True:
        out = fn()
        if out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_state_made_on_a_is_used_on_b(redis: Redis, tmp_path: Path) -> None:
    with replicas(tmp_path, redis.url[:-1] + "1") as (a, b):
        r1 = create(a, {"input": "Remember the number 7.", "store": True})
        assert r1.status_code == 200, r1.text
        rid = r1.json()["id"]
        out_id = r1.json()["output"][0]["id"]
        # retrieve and list on B (no waiting: the read-your-writes bound is the server's job)
        got = httpx.get(f"{b.v1}/responses/{rid}", timeout=10)
        assert got.status_code == 200 and got.json()["id"] == rid
        items = httpx.get(f"{b.v1}/responses/{rid}/input_items", params={"order": "asc"}, timeout=10)
        assert items.status_code == 200
        assert [it["content"][0]["text"] for it in items.json()["data"]] == ["Remember the number 7."]
        # continue on B: the whole history comes from Redis
        r2 = create(b, {"input": user("What was it?"), "previous_response_id": rid})
        assert r2.status_code == 200, r2.text
        assert r2.json()["previous_response_id"] == rid
        assert r2.json()["usage"]["input_tokens"] > r1.json()["usage"]["total_tokens"]
        # an item_reference to A's output, resolved on B without previous_response_id
        r3 = create(b, {"input": [{"type": "item_reference", "id": out_id}, *user("And again?")]})
        assert r3.status_code == 200, r3.text
        listed = httpx.get(f"{b.v1}/responses/{r3.json()['id']}/input_items", params={"order": "asc"}, timeout=10)
        assert listed.json()["data"][0]["id"] == out_id
        # a delete through B is seen by A, which held the response in its process-wide cache
        assert httpx.get(f"{a.v1}/responses/{rid}", timeout=10).status_code == 200
        assert httpx.delete(f"{b.v1}/responses/{rid}", timeout=10).status_code == 200
        poll(lambda: httpx.get(f"{a.v1}/responses/{rid}", timeout=10).status_code == 404, "A to see the delete")
        cont = create(a, {"input": user("more"), "previous_response_id": rid})
        assert cont.status_code == 400 and cont.json()["error"]["code"] == "previous_response_not_found"
        # unknown ids are still not found, on both
        assert httpx.get(f"{b.v1}/responses/resp_nope", timeout=10).status_code == 404


def test_websocket_chain_survives_its_replica(redis: Redis, tmp_path: Path) -> None:
    url = redis.url[:-1] + "2"
    with replica(tmp_path, url) as b:
        with replica(tmp_path, url) as a:
            with ws_connect(a.ws + "/responses") as ws:
                prev = None
                for text in ("one", "two", "three"):
                    r = ws_turn(ws, input=user(text), store=True, **({"previous_response_id": prev} if prev else {}))
                    prev = r["id"]
                time.sleep(VISIBILITY_BOUND)  # the documented bound after response.completed
                a.proc.send_signal(signal.SIGKILL)  # A dies without a graceful shutdown
                a.proc.wait(timeout=10)
        with ws_connect(b.ws + "/responses") as ws:  # the client reconnects to B
            r = ws_turn(ws, input=user("four"), previous_response_id=prev, store=True)
        assert r["previous_response_id"] == prev
        items = httpx.get(f"{b.v1}/responses/{r['id']}/input_items", params={"order": "asc", "limit": 100}, timeout=10)
        texts = [it["content"][0]["text"] for it in items.json()["data"] if it["type"] == "message" and it["role"] == "user"]
        assert texts == ["one", "two", "three", "four"]


def test_a_delete_on_one_replica_reaches_the_other_s_websocket_connections(redis: Redis, tmp_path: Path) -> None:
    """A response deleted through replica A is no longer continued by the WebSocket connection
    on B that made it (from that connection's own cache), once B heard of the delete."""
    with replicas(tmp_path, redis.url[:-1] + "8") as (a, b):
        with ws_connect(b.ws + "/responses") as ws:
            r = ws_turn(ws, input=user("forget this"), store=True)
            time.sleep(VISIBILITY_BOUND)
            assert httpx.delete(f"{a.v1}/responses/{r['id']}", timeout=10).status_code == 200
            poll(lambda: httpx.get(f"{b.v1}/responses/{r['id']}", timeout=10).status_code == 404, "B to see the delete")
            ws.send(json.dumps({"type": "response.create", "model": "hotloop-sim", "input": "and now?", "previous_response_id": r["id"]}))
            while True:
                ev = json.loads(ws.recv(timeout=WAIT))
                if ev["type"] in ("response.completed", "response.failed", "error"):
                    break
            assert ev["type"] == "error" and ev["error"]["code"] == "previous_response_not_found", ev


def test_one_keys_limits_and_revocation_hold_across_replicas(redis: Redis, tmp_path: Path) -> None:
    url = redis.url[:-1] + "3"
    with replicas(tmp_path, url) as (a, b):
        limited = keys(url, "create", "limited", "--rpm", "4")
        other = keys(url, "create", "other")
        remaining = []
        for server in (a, b, a, b):
            r = create(server, {"input": "hi", "store": False}, auth(limited))
            assert r.status_code == 200, r.text
            remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert remaining == [3, 2, 1, 0]  # one bucket, whichever replica answers
        for server in (a, b):
            r = create(server, {"input": "hi", "store": False}, auth(limited))
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        # a key revoked through A (the CLI on the shared store) is refused by B
        assert create(b, {"input": "hi", "store": False}, auth(other)).status_code == 200
        keys(url, "revoke", "other")
        poll(lambda: create(b, {"input": "hi", "store": False}, auth(other)).status_code == 401, "B to refuse the key")
        poll(lambda: create(a, {"input": "hi", "store": False}, auth(other)).status_code == 401, "A to refuse the key")


def test_a_key_table_emptied_under_running_replicas_does_not_open_them(redis: Redis, tmp_path: Path) -> None:
    """A Redis restarted empty (here FLUSHDB) reads like a store that never had a key; a replica
    that has seen keys stays closed: the lost keys are refused and anonymous callers too."""
    import redis as redis_py

    url = redis.url[:-1] + "6"
    with replica(tmp_path, url) as a:
        anonymous = create(a, {"input": "hi", "store": False})
        assert anonymous.status_code == 200  # open: no key yet
        secret = keys(url, "create", "team")
        assert create(a, {"input": "hi", "store": False}, auth(secret)).status_code == 200
        poll(lambda: create(a, {"input": "hi", "store": False}).status_code == 401, "A to close")
        redis_py.Redis.from_url(url).flushdb()
        poll(lambda: create(a, {"input": "hi", "store": False}, auth(secret)).status_code == 401, "A to drop the key")
        time.sleep(2 * 1.0)  # two more key-table reads: nothing reopens it
        for headers in (None, auth("hl-made-up"), auth("anything")):
            r = create(a, {"input": "hi", "store": False}, headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert "the key table went back" in a.logs()
        # a key created on the emptied store works at once
        fresh = keys(url, "create", "again")
        assert create(a, {"input": "hi", "store": False}, auth(fresh)).status_code == 200


def test_redis_stopped_and_restarted_mid_run(tmp_path: Path) -> None:
    redis = Redis(tmp_path, persist=True)  # an append-only file, so a restart keeps what was written
    redis.start()
    try:
        with replicas(tmp_path, redis.url) as (a, b):
            free = keys(redis.url, "create", "free")
            limited = keys(redis.url, "create", "limited", "--rpm", "1000")
            for server in (a, b):  # both replicas know both keys before the outage
                for secret in (free, limited):
                    assert create(server, {"input": "warm", "store": False}, auth(secret)).status_code == 200
            r1 = create(a, {"input": "stored before", "store": True}, auth(free)).json()
            with ws_connect(a.ws + "/responses", additional_headers=auth(free)) as ws:
                w1 = ws_turn(ws, input=user("w1"), store=True)
                redis.stop()
                # the connection's cache serves continuations; their writes wait in the queue
                w2 = ws_turn(ws, input=user("w2"), store=True, previous_response_id=w1["id"])
                w3 = ws_turn(ws, input=user("w3"), store=True, previous_response_id=w2["id"])
                # requests that need Redis: a clear 503
                for resp in (
                    create(b, {"input": user("x"), "previous_response_id": r1["id"]}, auth(free)),
                    httpx.get(f"{b.v1}/responses/{r1['id']}", headers=auth(free), timeout=10),
                    create(b, {"input": "hi", "store": False}, auth(limited)),
                ):
                    assert resp.status_code == 503, resp.text
                    err = resp.json()["error"]
                    assert err["type"] == "server_error" and "unavailable" in err["message"]
                    assert "Traceback" not in resp.text and "redis" not in err["message"].lower()
                redis.start()
                poll(lambda: httpx.get(a.base + "/hotloop/stats", headers=auth(free), timeout=10).json()["store"]["pending"] == 0,
                     "A's queued writes to land")
                w4 = ws_turn(ws, input=user("w4"), store=True, previous_response_id=w3["id"])
            # the writes acknowledged during the outage landed: B continues the chain
            poll(lambda: httpx.get(f"{b.v1}/responses/{w4['id']}", headers=auth(free), timeout=10).status_code == 200,
                 "the queued writes")
            r = create(b, {"input": user("w5"), "previous_response_id": w4["id"]}, auth(free))
            assert r.status_code == 200, r.text
            items = httpx.get(
                f"{b.v1}/responses/{r.json()['id']}/input_items", params={"order": "asc", "limit": 100},
                headers=auth(free), timeout=10,
            ).json()["data"]
            assert [it["content"][0]["text"] for it in items if it.get("role") == "user"] == ["w1", "w2", "w3", "w4", "w5"]
            # and B reaches Redis again for everything else
            assert create(b, {"input": "hi", "store": False}, auth(limited)).status_code == 200
            assert httpx.get(f"{b.v1}/responses/{r1['id']}", headers=auth(free), timeout=10).status_code == 200
            assert "unavailable" in a.logs()
    finally:
        redis.stop()


# -- nginx in front of two replicas ------------------------------------------------------------


@contextlib.contextmanager
def nginx(tmp: Path, upstreams: list[int]) -> Iterator[int]:
    """nginx with deploy/nginx.conf, its upstreams and listen port substituted; the port."""
    binary = require("nginx", "nginx")
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    port = free_port()
    servers = re.findall(r"^\s*server 127\.0\.0\.1:\d+.*;$", conf, re.M)
    assert len(servers) == len(upstreams) == 2
    for line, up in zip(servers, upstreams):
        conf = conf.replace(line, re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{up}", line))
    conf, n = re.subn(r"listen 8080;", f"listen 127.0.0.1:{port};", conf)
    assert n == 1
    prefix = tmp / "nginx"
    (prefix / "logs").mkdir(parents=True)
    (prefix / "temp").mkdir()
    path = prefix / "nginx.conf"
    path.write_text(conf)
    globals_ = f"daemon off; pid {prefix}/nginx.pid; error_log {prefix}/logs/stderr.log;"
    if os.geteuid() == 0:  # workers as root too: the pytest temp directory is private
        globals_ += " user root;"
    log = prefix / "logs" / "run.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([binary, "-p", str(prefix), "-c", str(path), "-g", globals_], stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc, "nginx", log)
        yield port
    finally:
        stop(proc)


TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def test_openai_sdk_tool_loops_through_nginx(redis: Redis, tmp_path: Path) -> None:
    with replicas(tmp_path, redis.url[:-1] + "5") as (a, b), nginx(tmp_path, [a.port, b.port]) as port:
        client = OpenAI(api_key="sk-test", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=30)
        # HTTP: each call a new connection through nginx's round of the replicas
        prev = None
        for turn in range(4):
            if prev is None:
                r = client.responses.create(model="hotloop-sim", input="Weather in Paris?", tools=TOOLS)  # type: ignore[arg-type]
            else:
                call = next(o for o in prev.output if o.type == "function_call")
                r = client.responses.create(
                    model="hotloop-sim", previous_response_id=prev.id, tools=TOOLS,  # type: ignore[arg-type]
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}, *user(f"And turn {turn}?")],
                )
            assert r.status == "completed"
            assert any(o.type == "function_call" for o in r.output)
            prev = r
        # SSE through nginx (buffering off)
        events = list(client.responses.create(model="hotloop-sim", input="hi", stream=True))
        assert events[-1].type == "response.completed"
        # WebSocket mode through nginx's upgrade
        with client.responses.connect() as conn:
            prev_id = None
            for turn in range(3):
                if prev_id is None:
                    conn.response.create(model="hotloop-sim", input="Weather in Oslo?", tools=TOOLS)  # type: ignore[arg-type]
                else:
                    conn.response.create(
                        model="hotloop-sim", previous_response_id=prev_id, tools=TOOLS,  # type: ignore[arg-type]
                        input=[{"type": "function_call_output", "call_id": call_id, "output": "3C"}, *user("next?")],
                    )
                final = None
                for e in conn:
                    if e.type == "response.completed":
                        final = e.response
                        break
                    assert e.type not in ("error", "response.failed"), e
                assert final is not None and final.status == "completed"
                call_id = next(o for o in final.output if o.type == "function_call").call_id
                prev_id = final.id
        # both replicas served
        served = [httpx.get(s.base + "/hotloop/stats", timeout=10).json()["completed_responses"] for s in (a, b)]
        assert all(n > 0 for n in served) and sum(served) == 8, served


# -- --workers -----------------------------------------------------------------------------------


def test_workers_serve_http_and_websocket_from_both_processes(tmp_path: Path) -> None:
    mp = tmp_path / "metrics"
    mp.mkdir()
    n = 24
    with run_server(tmp_path, "--workers", "2", "--sim-rate", "0", env={"PROMETHEUS_MULTIPROC_DIR": str(mp)}) as s:
        for i in range(n):  # a new connection each: the kernel spreads them over the workers
            with httpx.Client(timeout=10) as c:
                assert c.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": f"h{i}"}).status_code == 200
            with ws_connect(s.ws + "/responses") as ws:
                ws_turn(ws, input=user(f"w{i}"), store=False)
        stats: dict[int, dict[str, Any]] = {}

        def both() -> bool:
            with httpx.Client(timeout=10) as c:
                st = c.get(s.base + "/hotloop/stats").json()
            stats[st["pid"]] = st
            return len(stats) == 2

        poll(both, "stats from both workers")
        assert s.proc.pid not in stats
        for st in stats.values():
            transports = {t["transport"] for t in st["turns"]}
            assert {"json", "ws"} <= transports, transports
        assert sum(st["completed_responses"] for st in stats.values()) == 2 * n
        # /metrics on any worker: the aggregate of both
        metrics = httpx.get(s.base + "/metrics", timeout=10).text
        total = sum(float(v) for v in re.findall(r'^hotloop_responses_total\{[^}]*status="completed"[^}]*\} (\S+)$', metrics, re.M))
        assert total == 2 * n

        # ... and what is read from each worker's state: counters summed over the workers, gauges
        # over the live ones (copied into the shared files once a second)
        def state() -> dict[str, float] | None:
            text = httpx.get(s.base + "/metrics", timeout=10).text
            found = {
                name: float(v)
                for name, v in re.findall(r"^(hotloop_store_written_total|hotloop_store_failed_total|hotloop_client_connections) (\S+)$", text, re.M)
            }
            return found if found.get("hotloop_store_written_total") == n else None

        found = poll(state, "the workers' store counts in /metrics")
        assert found is not None and found["hotloop_store_failed_total"] == 0 and "hotloop_client_connections" in found
        # a worker that dies is replaced, and the replacement serves
        victim = next(iter(stats))
        os.kill(victim, signal.SIGKILL)
        replacement = new_worker(s, victim)
        serving = poll(lambda: replacement in serving_pids(s), "the replacement worker to serve")
        assert serving and victim not in serving_pids(s)
        for i in range(6):
            with httpx.Client(timeout=10) as c:
                assert c.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": "again"}).status_code == 200
    assert s.proc.returncode == 0


def serving_pids(s: Server, tries: int = 16, timeout: float = 5.0) -> set[int]:
    """The pids of the workers answering /hotloop/stats over ``tries`` new connections (one the
    kernel queued on a worker's socket just before it died is reset or waits: ``timeout``)."""
    pids = set()
    for _ in range(tries):
        with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=timeout) as c:
            pids.add(c.get(s.base + "/hotloop/stats").json()["pid"])
    return pids


def new_worker(s: Server, victim: int) -> int:
    """The pid of the worker the parent started after ``victim`` exited (from its log)."""
    def started() -> int | None:
        after = s.logs().partition(f"worker {victim} exited")[2]
        found = re.findall(r"started worker (\d+)", after)
        return int(found[-1]) if found else None

    return poll(started, "a replacement worker")  # type: ignore[no-any-return]


def test_a_replacement_failing_to_start_does_not_stop_the_workers(tmp_path: Path) -> None:
    """--workers 2 --store redis: Redis goes away and a worker dies meanwhile; its replacements
    fail to start (exit 3) and are retried with a growing delay while the other worker keeps
    serving; once Redis is back a replacement starts and serves."""
    from hotloop.server.workers import RESTART_DELAY, STAYED_UP

    redis = Redis(tmp_path)
    redis.start()
    try:
        with run_server(tmp_path, "--workers", "2", "--store", "redis", "--redis-url", redis.url, "--sim-rate", "0") as s:
            pids = poll(lambda: p if len(p := serving_pids(s)) == 2 else None, "both workers")
            victim, healthy = sorted(pids)
            redis.stop()
            os.kill(victim, signal.SIGKILL)
            failed = r"worker \d+ failed to start \(index \d, exit code 3, up \S+ s\); starting another in (\S+) s"
            poll(lambda: len(re.findall(failed, s.logs())) >= 2, "two failed replacements")
            delays = [float(d) for d in re.findall(failed, s.logs())]
            # growing, from where the victim's death left its slot: killed before it stayed up
            # (STAYED_UP), it counted as a failure too
            up = float(re.findall(rf"worker {victim} exited \(index \d, signal SIGKILL, up (\S+) s\)", s.logs())[0])
            first = RESTART_DELAY if up >= STAYED_UP else 2 * RESTART_DELAY
            assert delays[:2] == [first, 2 * first], (up, delays)
            # the healthy worker was not stopped: it answers (the dead slot's socket is closed)
            poll(lambda: serving_pids(s, 1, 0.5) == {healthy}, "the healthy worker to answer")
            assert s.proc.poll() is None and "stopping" not in s.logs()
            redis.start()
            poll(lambda: len(serving_pids(s, 4, 1.0) - {healthy}) == 1, "a replacement to serve once Redis is back")
            r = httpx.post(s.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi", "store": True}, timeout=10)
            assert r.status_code == 200, r.text
        assert s.proc.returncode == 0
    finally:
        redis.stop()


def test_workers_are_killed_only_after_their_own_shutdown_bounds() -> None:
    from hotloop.pipeline.post import CLOSE_FLUSH_SECONDS
    from hotloop.server.runner import ABORT_WINDOW
    from hotloop.server.workers import kill_after

    assert kill_after(5.0) > 5.0 + ABORT_WINDOW + CLOSE_FLUSH_SECONDS


def test_workers_on_sqlite_see_a_delete_made_through_another(tmp_path: Path) -> None:
    """--workers 2 on SQLite: after a DELETE through one worker has answered, no worker serves the
    response from its process-wide cache (retrieve, input_items, previous_response_id,
    item_reference), on any new connection."""
    with run_server(tmp_path, "--workers", "2", "--sim-rate", "0") as s:
        rid, out_id = _cached_on_both_workers(s)
        assert _fresh(s, "DELETE", f"/responses/{rid}").status_code == 200
        _gone_on_every_worker(s, rid, out_id)


def test_workers_on_sqlite_drop_a_response_another_pruned(tmp_path: Path) -> None:
    """--workers 2 on SQLite with a count bound: a response one worker's writer prunes leaves
    both workers' process-wide caches (the deletions table carries prunes too)."""
    with run_server(tmp_path, "--workers", "2", "--sim-rate", "0", env={"HOTLOOP_STORE_MAX_RESPONSES": "3"}) as s:
        rid, out_id = _cached_on_both_workers(s)
        body = {"model": "hotloop-sim", "input": "filler", "store": True}
        for _ in range(2 * SQLiteStore.PRUNE_EVERY + 8):  # each worker's writer prunes every PRUNE_EVERY writes
            assert _fresh(s, "POST", "/responses", json=body).status_code == 200
        poll(lambda: _fresh(s, "GET", f"/responses/{rid}").status_code == 404, "the pruned response to be gone")
        _gone_on_every_worker(s, rid, out_id)


def _fresh(s: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    """One request on a new connection (the kernel picks the worker)."""
    with httpx.Client(timeout=10) as c:
        return c.request(method, s.v1 + path, **kw)


def _cached_on_both_workers(s: Any) -> tuple[str, str]:
    """A stored response that both workers hold in their process-wide caches: its id and its
    output message's id."""
    r = _fresh(s, "POST", "/responses", json={"model": "hotloop-sim", "input": "hi", "store": True}).json()
    rid = r["id"]
    cached: set[int] = set()

    def both_cached() -> bool:  # a continuation on each worker puts the response in its cache
        body = {"model": "hotloop-sim", "input": "more", "previous_response_id": rid, "store": False}
        assert _fresh(s, "POST", "/responses", json=body).status_code == 200
        assert _fresh(s, "GET", f"/responses/{rid}").status_code == 200
        with httpx.Client(timeout=10) as c:
            cached.add(c.get(s.base + "/hotloop/stats").json()["pid"])
        return len(cached) == 2

    poll(both_cached, "both workers to hold the response")
    return rid, r["output"][0]["id"]


def _gone_on_every_worker(s: Any, rid: str, out_id: str) -> None:
    for _ in range(4):  # 16 new connections: both workers (a miss costs VISIBILITY_BOUND)
        assert _fresh(s, "GET", f"/responses/{rid}").status_code == 404
        assert _fresh(s, "GET", f"/responses/{rid}/input_items").status_code == 404
        cont = _fresh(s, "POST", "/responses", json={"model": "hotloop-sim", "input": "x", "previous_response_id": rid})
        assert cont.status_code == 400 and cont.json()["error"]["code"] == "previous_response_not_found"
        ref = _fresh(s, "POST", "/responses", json={"model": "hotloop-sim", "input": [{"type": "item_reference", "id": out_id}]})
        assert ref.status_code == 400, ref.text
