"""Memory under large stored responses: is the server's RSS bounded by its byte budgets?

Starts ``hotloop serve`` (simulator backend, SQLite store in a fresh data directory, default
bounds unless ``HOTLOOP_*`` variables say otherwise), sends ``--count`` stored responses of
``--size`` bytes of input each over HTTP, one after another, while sampling the server's
``VmRSS``; then checks that every response is retrievable (``GET /v1/responses/{id}``) and
continuable (``previous_response_id``, ``store: false``), which for evicted ones means loading
from the store. Prints RSS at start, peak and end, and the server's cache counters.

    python -m hotloop.bench.memory --count 300 --size 4000000

A measurement, not a test: it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from typing import Any

import httpx

from hotloop.bench import server

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
    "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu function return value "
    "import class module error retry buffer token stream socket thread memory cache bound queue"
).split()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _text(rng: random.Random, size: int, tag: int) -> str:
    """``size`` characters of varied words (numbers mixed in), unique per ``tag``."""
    parts = [f"request {tag}:"]
    n = len(parts[0])
    words = _WORDS
    while n < size:
        w = rng.choice(words) if rng.random() < 0.8 else str(rng.randrange(1_000_000))
        parts.append(w)
        n += len(w) + 1
    return " ".join(parts)[:size]


class Sampler(threading.Thread):
    def __init__(self, pid: int, every: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.peak = 0.0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.peak = max(self.peak, rss_mb(self.pid))
            except OSError:
                return
            time.sleep(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--size", type=int, default=4_000_000, help="input characters per response")
    ap.add_argument("--limit-mb", type=float, default=600.0, help="fail when peak RSS exceeds this")
    args = ap.parse_args(argv)

    out: dict[str, Any] = {}
    with server("--store", "sqlite") as (base, pid):  # a fresh data directory, default bounds
        with httpx.Client(base_url=base, timeout=120.0) as c:
            out["rss_start_mb"] = round(rss_mb(pid), 1)
            sampler = Sampler(pid)
            sampler.start()
            rng = random.Random(1)
            ids: list[str] = []
            t0 = time.monotonic()
            for i in range(args.count):
                body = {
                    "model": "sim",
                    "input": [{"role": "user", "content": _text(rng, args.size, i)}],
                    "store": True,
                    "metadata": {"sim": "text,tokens:8,rate:0"},
                }
                r = c.post("/v1/responses", json=body)
                r.raise_for_status()
                ids.append(r.json()["id"])
            out["post_seconds"] = round(time.monotonic() - t0, 1)
            out["rss_after_posts_mb"] = round(rss_mb(pid), 1)
            missing = [rid for rid in ids if c.get(f"/v1/responses/{rid}").status_code != 200]
            out["retrievable"] = len(ids) - len(missing)
            failed = 0
            for rid in ids:
                r = c.post(
                    "/v1/responses",
                    json={"model": "sim", "input": "go on", "previous_response_id": rid, "store": False,
                          "metadata": {"sim": "text,tokens:4,rate:0"}},
                )
                if r.status_code != 200 or r.json().get("status") != "completed":
                    failed += 1
            out["continuable"] = len(ids) - failed
            sampler.stop()
            out["rss_peak_mb"] = round(sampler.peak, 1)
            out["rss_end_mb"] = round(rss_mb(pid), 1)
            stats = c.get("/hotloop/stats").json()
            stats.pop("turns", None)
            out["stats"] = stats
            ok = not missing and not failed and sampler.peak <= args.limit_mb
    out["count"], out["size"] = args.count, args.size
    print(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
