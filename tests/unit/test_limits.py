"""Per-key rate limits with an injected clock (no sleeps)."""

from __future__ import annotations

import pytest

from hotloop.tenants.keys import Limits
from hotloop.tenants.limits import MemoryLimiter, RequestsLimited, TokensLimited, duration


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def hdrs(lim: MemoryLimiter, key: str, limits: Limits) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in lim.headers(key, limits)}


def test_duration_format_is_openais() -> None:
    assert [duration(s) for s in (0, 0.0004, 0.25, 1, 1.5, 59.9985, 60, 360, 3723.5)] == [
        "0s", "1ms", "250ms", "1s", "1.5s", "59.999s", "1m0s", "6m0s", "1h2m3.5s",
    ]


def test_requests_bucket_bursts_then_refills() -> None:
    clock = Clock()
    lim = MemoryLimiter(clock=clock)
    limits = Limits(rpm=3)
    for _ in range(3):
        lim.take_request("k", limits)
    with pytest.raises(RequestsLimited) as ei:
        lim.take_request("k", limits)
    err = ei.value
    assert (err.status, err.type, err.code) == (429, "requests", "rate_limit_exceeded")
    assert err.headers["retry-after"] == "20" and err.headers["retry-after-ms"] == "20000"
    assert "Please try again in 20s" in err.message
    assert hdrs(lim, "k", limits) == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m0s",
    }
    clock.t += 20  # one request's worth (60 s / 3)
    lim.take_request("k", limits)
    clock.t += 10
    assert hdrs(lim, "k", limits)["x-ratelimit-reset-requests"] == "50s"
    with pytest.raises(RequestsLimited):
        lim.take_request("k", limits)
    lim.take_request("other", limits)  # keys do not share buckets


def test_tokens_are_reserved_then_corrected() -> None:
    clock = Clock()
    lim = MemoryLimiter(clock=clock)
    limits = Limits(tpm=600)  # 10 tokens a second
    g = lim.admit("k", limits, 500)
    assert hdrs(lim, "k", limits)["x-ratelimit-remaining-tokens"] == "100"
    with pytest.raises(TokensLimited) as ei:
        lim.admit("k", limits, 200)
    assert ei.value.type == "tokens" and ei.value.headers["retry-after"] == "10"
    assert "Limit 600, Used 500, Requested 200" in ei.value.message
    g.finish(120)  # the real usage: 380 tokens come back
    assert hdrs(lim, "k", limits)["x-ratelimit-remaining-tokens"] == "480"
    g.finish(0)  # idempotent
    assert hdrs(lim, "k", limits)["x-ratelimit-remaining-tokens"] == "480"
    g2 = lim.admit("k", limits, 400)
    g2.finish(900)  # used more than reserved: the bucket goes below zero
    assert hdrs(lim, "k", limits)["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(TokensLimited):
        lim.admit("k", limits, 1)
    clock.t += 120  # 420 tokens of debt and a full minute: refilled, never beyond the limit
    assert hdrs(lim, "k", limits) == {
        "x-ratelimit-limit-tokens": "600", "x-ratelimit-remaining-tokens": "600", "x-ratelimit-reset-tokens": "0s",
    }


def test_a_request_larger_than_the_limit_never_passes() -> None:
    lim = MemoryLimiter(clock=Clock())
    with pytest.raises(TokensLimited) as ei:
        lim.admit("k", Limits(tpm=100), 101)
    assert "Request too large" in ei.value.message and "retry-after" not in ei.value.headers


def test_concurrency_slots() -> None:
    lim = MemoryLimiter(clock=Clock())
    limits = Limits(max_concurrent=2)
    a, b = lim.admit("k", limits, 10), lim.admit("k", limits, 10)
    with pytest.raises(RequestsLimited) as ei:
        lim.admit("k", limits, 10)
    assert "concurrent" in ei.value.message
    a.finish(None)
    c = lim.admit("k", limits, 10)
    b.finish(5)
    c.finish(5)
    assert lim.headers("k", limits) == []  # no per-minute limits: no headers


def test_tracked_keys_are_bounded() -> None:
    clock = Clock()
    lim = MemoryLimiter(max_keys=3, clock=clock)
    limits = Limits(rpm=1)
    for k in "abcd":
        lim.take_request(k, limits)
    assert len(lim) == 3
    lim.take_request("a", limits)  # "a" was dropped first: it starts again full
    with pytest.raises(RequestsLimited):
        lim.take_request("d", limits)


def test_a_key_with_responses_in_flight_is_not_dropped_from_the_tracked_ones() -> None:
    """Dropped (least recently used), a key forgot its responses in flight, and was admitted
    again past its max_concurrent."""
    from hotloop.tenants.limits import LimitExceeded

    lim = MemoryLimiter(max_keys=2, clock=lambda: 0.0)
    one = Limits(max_concurrent=1)
    running = lim.admit("A", one, 0)
    lim.admit("B", one, 0).finish(0)  # type: ignore[union-attr]
    lim.admit("C", one, 0).finish(0)  # type: ignore[union-attr]  # B goes, not A
    with pytest.raises(LimitExceeded):
        lim.admit("A", one, 0)
    assert len(lim) == 2
    running.finish(0)  # type: ignore[union-attr]
    lim.admit("A", one, 0)
