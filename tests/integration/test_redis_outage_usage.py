"""``GET /hotloop/usage`` while Redis is unreachable.

README ("Redis unreachable"): "Requests that need Redis get a 503 with type server_error (...,
x-should-retry: true): ..., /hotloop/usage, ...". SharedPersistence.usage checks only
``store.available`` (false once a write has failed) and then awaits ``Persistence.flush()``: a
usage record still buffered from the last second (any response) is queued then, its write is
retried by the writer for up to ``write_retry_seconds`` (10 minutes) and the request waits for
it, answering nothing until Redis is back. The same holds for a DELETE of a response whose write
is still queued on that process (``Persistence.delete`` flushes first).

"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import run_server
from tests.services import Redis

pytestmark = pytest.mark.timeout(90)

BOUND = 5.0  # far more than a 503 takes (the store's connect timeout is 1 s)


def test_usage_answers_503_promptly_while_redis_is_down(tmp_path: Path) -> None:
    redis = Redis(tmp_path)
    redis.start()
    try:
        with run_server(tmp_path, "--store", "redis", "--redis-url", redis.url, "--sim-rate", "0") as a:
            r = httpx.post(a.v1 + "/responses", json={"model": "hotloop-sim", "input": "hi", "store": False}, timeout=10)
            assert r.status_code == 200, r.text  # its usage record waits for the ledger's next batch (1 s)
            redis.stop()
            t0 = time.monotonic()
            try:
                got = httpx.get(a.base + "/hotloop/usage", timeout=BOUND)
            except httpx.ReadTimeout:
                pytest.fail(f"/hotloop/usage gave no answer within {BOUND:.0f} s while Redis was down (documented: a 503)")
            assert got.status_code == 503, got.text
            assert got.json()["error"]["type"] == "server_error"
            assert got.headers.get("x-should-retry") == "true"
            assert time.monotonic() - t0 < BOUND
            redis.start()  # the server's queued ledger write lands before it stops
    finally:
        redis.stop()


def test_responses_running_when_redis_goes_away_are_answered_and_websocket_turns_go_on(tmp_path: Path) -> None:
    """A ``store: true`` response that started before the outage and ends after its write queue's
    lag ran out waited for room: room comes only when its write ahead succeeds or gives up (10
    minutes), so its client got no answer (JSON), or no end of the stream (SSE), until Redis came
    back, and a WebSocket's next turn, ``store: false`` too, waited behind it. While Redis is
    unreachable only the queue's count and byte bounds hold: each is answered, new ``store:
    true`` requests get the documented 503, and the queued writes land once Redis is back."""
    import threading

    from websockets.sync.client import connect as ws_connect

    redis = Redis(tmp_path)
    redis.start()
    try:
        # 20 tokens at 20 tokens/s: about a second each
        with run_server(tmp_path, "--store", "redis", "--redis-url", redis.url, "--sim-rate", "20") as a:
            body = {"model": "hotloop-sim", "input": "hi", "store": True, "metadata": {"sim": "text,tokens:20"}}
            assert httpx.post(a.v1 + "/responses", json=body, timeout=30).status_code == 200
            got: dict[int, tuple[int, float]] = {}

            def post(i: int) -> None:
                t = time.monotonic()
                try:
                    r = httpx.post(a.v1 + "/responses", json={**body, "input": f"q{i}"}, timeout=BOUND * 3)
                    got[i] = (r.status_code, time.monotonic() - t)
                except httpx.HTTPError:
                    got[i] = (0, time.monotonic() - t)

            threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
            for th in threads:
                th.start()
                time.sleep(0.3)
            redis.stop()  # while they run
            for th in threads:
                th.join()
            assert sorted(got) == [0, 1, 2] and all(code == 200 and took < BOUND * 2 for code, took in got.values()), got
            later = httpx.post(a.v1 + "/responses", json=body, timeout=BOUND * 3)
            assert later.status_code == 503, later.text  # the queue's oldest write waited past the lag
            with ws_connect(a.ws + "/responses") as ws:
                for store in (True, False):
                    ws.send(json.dumps({"type": "response.create", **body, "store": store}))
                    t = time.monotonic()
                    while True:
                        e = json.loads(ws.recv(timeout=BOUND * 2))
                        if e["type"] in ("response.completed", "response.failed", "error"):
                            break
                    assert time.monotonic() - t < BOUND * 2
                    if not store:
                        assert e["type"] == "response.completed", e
            redis.start()  # the queued writes land before the server stops
    finally:
        redis.stop()


def test_a_redis_that_refuses_writes_after_a_failed_snapshot_is_unavailable_not_a_bug(tmp_path: Path) -> None:
    """A Redis whose last RDB snapshot failed refuses writes with ``MISCONF`` (a full or
    vanished disk), which redis-py raises as a plain ``ResponseError``: every request of a key
    with rate limits was a 500 with a traceback, and a store write was dropped at once. It is
    now one of the errors that mean unavailable: a 503, and writes retried."""
    import asyncio
    import shutil

    from hotloop import errors
    from hotloop.state.redis_store import Breaker, once, redis_errors, sync_client
    from hotloop.tenants.redis_limits import RedisLimiter

    redis = Redis(tmp_path)
    redis.start()
    try:
        client = sync_client(redis.url)
        shutil.rmtree(redis.tmp)  # its working directory: where a snapshot is written
        client.config_set("save", "3600 1")  # writes refused while the last background save failed
        client.set("a", "1")
        client.bgsave()
        deadline = time.monotonic() + 10
        while client.info("persistence")["rdb_last_bgsave_status"] != "err":
            assert time.monotonic() < deadline, "the snapshot did not fail"
            time.sleep(0.05)
        with pytest.raises(redis_errors()):
            client.set("b", "1")
        with pytest.raises(errors.StoreUnavailable):
            once(Breaker(), lambda: client.set("b", "1"))
        limits = RedisLimiter(redis.url)
        with pytest.raises(errors.StoreUnavailable) as ei:
            asyncio.run(limits._call("take", ["k1"], [10, 1, 0]))
        assert ei.value.status == 503
        client.config_set("save", "")  # (else it refuses to stop without its snapshot)
    finally:
        redis.stop()
