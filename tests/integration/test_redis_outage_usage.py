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
