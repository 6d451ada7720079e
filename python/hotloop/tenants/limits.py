"""Per-key rate limits: requests per minute, tokens per minute, concurrent responses.

Each per-minute limit is a token bucket holding at most ``limit`` units and refilled
continuously at ``limit / 60`` per second, as OpenAI's limits behave: a full bucket allows a burst
of ``limit``, then one unit every ``60 / limit`` seconds.

* A request takes one unit of the requests bucket (every HTTP request a key makes, and every
  WebSocket ``response.create``).
* A response reserves its estimated tokens (input, plus ``max_output_tokens`` or the default
  output reservation) before it starts; when it finishes, the reservation is corrected to the
  real usage (the bucket may go below zero: later requests wait longer).
* A response holds one concurrency slot from its admission until it ends.

The rate-limit headers (OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``) say,
for each bucket, its limit, the whole units in it, and the time until it is full again in
OpenAI's duration format (``1s``, ``6m0s``, ``250ms``).

:class:`Limiter` is the interface (a shared store can implement it for several processes);
:class:`MemoryLimiter` keeps the buckets in this process, at most ``max_keys`` keys (least
recently used dropped first: a dropped key starts again with full buckets). The clock is
injected (monotonic seconds), so tests need no sleeps.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Protocol

from hotloop import errors
from hotloop.tenants.keys import Limits

DEFAULT_MAX_KEYS = 10_000


class LimitExceeded(errors.RateLimited):
    """A key's own limit (not the backend's): 429 ``rate_limit_exceeded``. It never evicts the
    response a continuation named (a retry must still find it)."""


class RequestsLimited(LimitExceeded):
    type = "requests"


class TokensLimited(LimitExceeded):
    type = "tokens"


def too_large(capacity: int, tokens: int) -> TokensLimited:
    """A request over the whole token budget: waiting cannot help, so no ``retry-after``, and
    ``x-should-retry: false`` keeps the OpenAI SDKs from retrying it (each retry would take a
    request of the RPM budget for nothing)."""
    return TokensLimited(
        f"Request too large on tokens per min (TPM): Limit {capacity}, Requested {tokens}. "
        "The input or output tokens must be reduced in order to run successfully.",
        headers={"x-should-retry": "false"},
    )


def duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format: ``0s``, ``250ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    ms = math.ceil(seconds * 1000)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if h:
        return f"{h}h{m}m{s}"
    if m:
        return f"{m}m{s}"
    return s


class Bucket:
    """``capacity`` units, refilled at ``capacity / 60`` per second; ``level`` may go negative."""

    __slots__ = ("capacity", "rate", "level", "at")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.level = float(capacity)
        self.at = now

    def refill(self, now: float) -> float:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now
        return self.level

    def wait(self, n: float, now: float) -> float:
        """Seconds until ``n`` units are available (0: now)."""
        level = self.refill(now)
        return 0.0 if level >= n else (n - level) / self.rate

    def reset(self, now: float) -> float:
        """Seconds until the bucket is full."""
        return (self.capacity - self.refill(now)) / self.rate

    def remaining(self, now: float) -> int:
        return max(0, int(self.refill(now)))


class KeyState:
    """One key's buckets and responses in flight."""

    __slots__ = ("limits", "requests", "tokens", "inflight")

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.requests = Bucket(limits.rpm, now) if limits.rpm is not None else None
        self.tokens = Bucket(limits.tpm, now) if limits.tpm is not None else None
        self.inflight = 0


class Grant:
    """An admitted response: its token reservation and concurrency slot until :meth:`finish`."""

    __slots__ = ("state", "reserved", "clock", "done")

    def __init__(self, state: KeyState, reserved: int, clock: Callable[[], float]) -> None:
        self.state = state
        self.reserved = reserved
        self.clock = clock
        self.done = False

    def finish(self, used: int | None = None) -> None:
        """The response ended: free its slot and correct the reservation to ``used`` tokens
        (``None``: nothing was generated, the reservation is returned). Idempotent."""
        if self.done:
            return
        self.done = True
        st = self.state
        st.inflight -= 1
        b = st.tokens
        if b is not None:
            b.refill(self.clock())
            b.level = min(b.capacity, b.level + self.reserved - (used or 0))


class _Releaser(Protocol):
    def release(self, grant: Any, correction: int) -> None: ...


class SharedGrant(Grant):
    """An admitted response of a limiter whose buckets live outside this process (Redis, a SQLite
    file): :meth:`finish` hands the reservation's correction to ``limiter.release``."""

    __slots__ = ("limiter", "key_id")

    def __init__(self, limiter: _Releaser, key_id: str, reserved: int) -> None:
        self.limiter = limiter
        self.key_id = key_id
        self.reserved = reserved
        self.done = False

    def finish(self, used: int | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.limiter.release(self, self.reserved - (used or 0))


class Limiter(Protocol):
    """In-process limiters answer at once; a shared one (:mod:`hotloop.tenants.redis_limits`)
    returns an awaitable that answers (or raises) when awaited."""

    def take_request(self, key_id: str, limits: Limits) -> Awaitable[None] | None:
        """Count one request. :raises RequestsLimited:"""
        ...

    def admit(self, key_id: str, limits: Limits, tokens: int) -> Grant | Awaitable[Grant]:
        """Admit a response of ``tokens`` estimated tokens. :raises LimitExceeded:"""
        ...

    def headers(self, key_id: str, limits: Limits) -> list[tuple[bytes, bytes]]:
        """The rate-limit headers for the key's limits (none without per-minute limits)."""
        ...


def _retry_headers(seconds: float) -> dict[str, str]:
    return {"retry-after": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}


class MemoryLimiter:
    """In-process buckets for at most ``max_keys`` keys (least recently used dropped first)."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_keys = max_keys
        self.clock = clock
        self._states: OrderedDict[str, KeyState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def _state(self, key_id: str, limits: Limits, now: float) -> KeyState:
        st = self._states.get(key_id)
        if st is None or st.limits != limits:
            st = self._states[key_id] = KeyState(limits, now)
            states = self._states
            while len(states) > self.max_keys:
                # the least recently used key without a response in flight: one with responses
                # running keeps its count, or it would be admitted again past max_concurrent
                victim = next((k for k, s in states.items() if s.inflight == 0 and k != key_id), None)
                if victim is None:
                    break
                del states[victim]
        else:
            self._states.move_to_end(key_id)
        return st

    def take_request(self, key_id: str, limits: Limits) -> None:
        if limits.rpm is None:
            return
        now = self.clock()
        st = self._state(key_id, limits, now)
        b = st.requests
        assert b is not None
        wait = b.wait(1, now)
        if wait > 0:
            raise RequestsLimited(
                f"Rate limit reached on requests per min (RPM): Limit {limits.rpm}, Used {limits.rpm}, "
                f"Requested 1. Please try again in {duration(wait)}.",
                headers=_retry_headers(wait),
            )
        b.level -= 1

    def admit(self, key_id: str, limits: Limits, tokens: int) -> Grant:
        if limits.tpm is not None and tokens > limits.tpm:
            # first, as the Redis limiter does: waiting cannot help (a key at its concurrency
            # limit would otherwise be told to retry in 1 s, to a certain refusal)
            raise too_large(limits.tpm, tokens)
        now = self.clock()
        st = self._state(key_id, limits, now)
        if limits.max_concurrent is not None and st.inflight >= limits.max_concurrent:
            raise RequestsLimited(
                f"Too many concurrent requests: Limit {limits.max_concurrent}. "
                "Please try again once a response in progress has finished.",
                headers=_retry_headers(1.0),
            )
        b = st.tokens
        if b is not None:
            if tokens > b.capacity:
                raise too_large(b.capacity, tokens)
            wait = b.wait(tokens, now)
            if wait > 0:
                used = b.capacity - max(0, int(b.level))
                raise TokensLimited(
                    f"Rate limit reached on tokens per min (TPM): Limit {b.capacity}, Used {used}, "
                    f"Requested {tokens}. Please try again in {duration(wait)}.",
                    headers=_retry_headers(wait),
                )
            b.level -= tokens
        st.inflight += 1
        return Grant(st, tokens if b is not None else 0, self.clock)

    def headers(self, key_id: str, limits: Limits) -> list[tuple[bytes, bytes]]:
        if limits.rpm is None and limits.tpm is None:
            return []
        now = self.clock()
        st = self._state(key_id, limits, now)
        out: list[tuple[bytes, bytes]] = []
        for kind, b in (("requests", st.requests), ("tokens", st.tokens)):
            if b is not None:
                out += [
                    (b"x-ratelimit-limit-" + kind.encode(), str(b.capacity).encode()),
                    (b"x-ratelimit-remaining-" + kind.encode(), str(b.remaining(now)).encode()),
                    (b"x-ratelimit-reset-" + kind.encode(), duration(b.reset(now)).encode()),
                ]
        return out
