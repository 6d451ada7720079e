"""A key's limits hold across ``--workers`` on SQLite (real server processes on 127.0.0.1): the
workers share them through the limits file, so a key whose connections land on several workers
gets its limit once, not once per worker."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx

from tests.conftest import Server, run_server
from tests.integration.test_scaleout import poll
from tests.integration.test_tenants import ADMIN_KEY, create_key

WORKERS = 2


@contextlib.contextmanager
def one_connection_per_worker(s: Server) -> Iterator[dict[int, httpx.Client]]:
    """A keep-alive client on a connection of each worker, by pid (the admin key, which has no
    limits, asks each new connection which worker accepted it)."""
    clients: dict[int, httpx.Client] = {}
    spare: list[httpx.Client] = []
    try:
        deadline = time.monotonic() + 30
        while len(clients) < WORKERS:
            assert time.monotonic() < deadline, f"connections reached only workers {sorted(clients)}"
            c = httpx.Client(base_url=s.base, timeout=10, limits=httpx.Limits(max_connections=1))
            r = c.get("/hotloop/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert r.status_code == 200, r.text
            pid = r.json()["pid"]
            if pid in clients:
                spare.append(c)
            else:
                clients[pid] = c
        yield clients
    finally:
        for c in [*clients.values(), *spare]:
            c.close()


def _capped(tmp_path: Path, *limits: str) -> tuple[Path, str]:
    """The data directory and the secret of a key ``capped`` with ``limits``."""
    data = tmp_path / "data"
    return data, create_key(data, "capped", *limits)


def test_a_keys_requests_per_minute_hold_across_workers(tmp_path: Path) -> None:
    data, key = _capped(tmp_path, "--rpm", "8")  # one request back every 7.5 s: none within the test
    env = {"HOTLOOP_DATA_DIR": str(data), "HOTLOOP_API_KEY": ADMIN_KEY}
    with run_server(tmp_path, "--workers", str(WORKERS), "--sim-rate", "0", env=env) as s:
        assert (data / "hotloop-limits.sqlite3").exists()
        with one_connection_per_worker(s) as clients:
            accepted: list[int] = []
            refused: list[httpx.Response] = []
            t0 = time.monotonic()
            for _ in range(12):  # 24 requests, alternately on each worker
                for c in clients.values():
                    r = c.get("/hotloop/stats", headers={"Authorization": f"Bearer {key}"})
                    if r.status_code == 200:
                        accepted.append(r.json()["pid"])
                    else:
                        refused.append(r)
            assert time.monotonic() - t0 < 7, "too slow for the bucket to stay unrefilled"
        assert len(accepted) == 8, f"{len(accepted)} accepted of 24 with an rpm of 8 (by worker: {accepted})"
        assert set(accepted) == set(clients)  # both workers took part
        assert len(refused) == 16
        for r in refused:
            assert r.status_code == 429
            assert r.json() == {"error": {
                "message": r.json()["error"]["message"], "type": "requests", "param": None, "code": "rate_limit_exceeded",
            }}
            assert r.json()["error"]["message"].startswith("Rate limit reached on requests per min (RPM): Limit 8, Used 8")
            assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-limit-requests"] == "8"
    assert not (data / "hotloop-limits.sqlite3").exists()  # removed once the workers are gone


def test_a_killed_workers_concurrency_slot_is_freed(tmp_path: Path) -> None:
    """A worker SIGKILLed with a response in flight: the slot it held must not stay taken."""
    data, key = _capped(tmp_path, "--max-concurrent", "1")
    env = {"HOTLOOP_DATA_DIR": str(data), "HOTLOOP_API_KEY": ADMIN_KEY}
    slow = ("--sim-rate", "10", "--sim-output-tokens", "600")  # a response of a minute
    with run_server(tmp_path, "--workers", str(WORKERS), *slow, env=env) as s:
        with one_connection_per_worker(s) as clients:
            (victim, a), (survivor, b) = clients.items()
            auth = {"Authorization": f"Bearer {key}"}
            body = {"model": "hotloop-sim", "input": "hi", "max_output_tokens": 600}
            streaming = threading.Event()

            def stream() -> None:
                with contextlib.suppress(httpx.HTTPError):
                    with a.stream("POST", "/v1/responses", json={**body, "stream": True}, headers=auth) as r:
                        for line in r.iter_lines():
                            if "response.output_text.delta" in line:
                                streaming.set()

            t = threading.Thread(target=stream, daemon=True)
            t.start()
            assert streaming.wait(15), "the stream did not start"
            r = b.post("/v1/responses", json={**body, "max_output_tokens": 1}, headers=auth)
            assert r.status_code == 429 and r.json()["error"]["message"].startswith("Too many concurrent requests: Limit 1."), r.text
            os.kill(victim, signal.SIGKILL)
            # the parent frees it as it reaps the worker (an admission at the limit would too)
            freed = f"freed the 1 rate-limit concurrency slot(s) of worker {victim}"
            poll(lambda: freed in s.logs(), "the dead worker's slot freed by the parent", wait=15)
            r = b.post("/v1/responses", json={**body, "max_output_tokens": 1}, headers=auth)
            assert r.status_code == 200, r.text
            assert survivor != victim
            t.join(15)
