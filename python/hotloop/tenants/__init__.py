"""Tenants: API keys, per-key rate limits, and who owns what.

* :mod:`hotloop.tenants.keys`: key secrets, their hashes, and the key stores (SQLite, memory);
* :mod:`hotloop.tenants.limits`: per-key request, token and concurrency limits (in-process
  buckets behind the :class:`~hotloop.tenants.limits.Limiter` interface);
* :mod:`hotloop.tenants.auth`: :class:`~hotloop.tenants.auth.Tenancy`, what the transports call:
  authenticate a caller once per HTTP request or WebSocket connection, admit each request and
  response, render the rate-limit headers.

Ownership itself is enforced where content lives (:mod:`hotloop.state`): every stored response
and cached entry carries its tenant's id, and every read passes the caller's scope.
"""

from hotloop.tenants.auth import ADMIN, ANONYMOUS, Tenancy, Tenant
from hotloop.tenants.keys import KeyRecord, KeyStore, Limits, open_key_store
from hotloop.tenants.limits import Grant, LimitExceeded, Limiter, MemoryLimiter

__all__ = [
    "ADMIN", "ANONYMOUS", "Grant", "KeyRecord", "KeyStore", "LimitExceeded", "Limiter", "Limits",
    "MemoryLimiter", "Tenancy", "Tenant", "open_key_store",
]
