"""a key's shared rate limit under Redis's memory bound, as the README configures it.

README ("Replicas sharing Redis"): "bound memory with Redis's maxmemory and maxmemory-policy
volatile-ttl" and "one key's RPM, TPM and concurrency limits hold across every replica". Under
``volatile-ttl`` Redis evicts the keys with the *shortest* time to live first: the rate-limit
buckets (``hotloop:l:{key_id}:rpm``/``:tpm``, 2 min), the in-flight lease sets (60 s) and the
given-up markers are evicted before any stored response (30 days), and an evicted bucket comes
back full: under memory pressure a key gets its whole RPM again (the same for TPM and
``max_concurrent``).

"""

from __future__ import annotations

import random
import string
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import run_server
from tests.services import Redis

pytestmark = pytest.mark.timeout(120)


def keys(url: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "hotloop", "keys", *args, "--store", "redis", "--redis-url", url],
        capture_output=True, text=True, timeout=30, check=True,
    )
    return proc.stdout.strip()


def test_rpm_limit_holds_when_redis_evicts_under_the_documented_policy(tmp_path: Path) -> None:
    import redis as redis_py

    redis = Redis(tmp_path)
    redis.start()
    try:
        admin = redis_py.Redis.from_url(redis.url, socket_timeout=5)
        admin.config_set("maxmemory", "8mb")
        admin.config_set("maxmemory-policy", "volatile-ttl")  # as the README says
        # Redis approximates "shortest TTL first" from a sample of keys (5 by default: the bucket
        # is found after more evictions); the largest sample makes the order exact and the test
        # deterministic
        admin.config_set("maxmemory-samples", "64")
        common = ("--store", "redis", "--redis-url", redis.url, "--sim-rate", "0")
        with run_server(tmp_path, *common) as a, run_server(tmp_path, *common) as b:
            limited = {"Authorization": "Bearer " + keys(redis.url, "create", "limited", "--rpm", "2")}
            other = {"Authorization": "Bearer " + keys(redis.url, "create", "other")}
            body = {"model": "hotloop-sim", "input": "hi", "store": False}
            codes = [httpx.post(s.v1 + "/responses", json=body, headers=limited, timeout=10).status_code for s in (a, b, a)]
            assert codes == [200, 200, 429]  # 2 a minute: the next token comes in 30 s
            # other traffic fills Redis: stored responses (20 KB each) until Redis evicts
            n = 0
            while int(admin.info("stats")["evicted_keys"]) < 200:
                assert n < 2000, "Redis never evicted"
                text = "".join(random.choices(string.ascii_letters, k=20_000))
                r = httpx.post((a, b)[n % 2].v1 + "/responses", json={"model": "hotloop-sim", "input": text, "store": True},
                               headers=other, timeout=30)
                assert r.status_code in (200, 503), r.text
                n += 1
            # still within the minute: the limited key has no request left, on either replica
            for s in (b, a):
                r = httpx.post(s.v1 + "/responses", json=body, headers=limited, timeout=10)
                assert r.status_code == 429, (
                    f"the RPM limit came back full after Redis evicted its bucket ({r.status_code}; "
                    f"left of hotloop:l:*: {sorted(k.decode() for k in admin.keys('hotloop:l:*'))})"
                )
        admin.close()
    finally:
        redis.stop()
