"""Who is calling: authentication, revocation, and each caller's limits.

:class:`Tenancy` is what the transports call: :meth:`Tenancy.authenticate` once per HTTP request
and once per WebSocket connection, :meth:`Tenancy.admit` per HTTP request and per
``response.create`` (the revocation check plus the requests-per-minute bucket), and
:meth:`Tenancy.admit_response` (via the engine) per response, for tokens and concurrency.

Callers are :class:`Tenant` objects:

* a key from the key store (:mod:`hotloop.tenants.keys`): it owns what it stores and sees only that;
* the admin key (``--api-key``/``HOTLOOP_API_KEY``): its own tenant (``admin``) for what it
  stores, and it may read, delete and continue every tenant's responses and see all usage
  (operations); it has no limits;
* in open mode (no admin key and no key ever created), every caller is the one ``anonymous``
  tenant, whatever it sends. Rows stored before owners were recorded belong to ``anonymous``.
  Open mode is decided when the process starts and can only end: once this process has seen a
  key, it stays closed even if the key table later reads as never used (a Redis restarted
  empty, a ``FLUSHDB``, a replaced database file). The keys it loses are then refused (401) and
  the log says why; a new process started on the empty store is open again, with its warning.

Keys are cached in memory by the SHA-256 of their secret. The key table is re-read when an
unknown secret arrives (one query, shared by concurrent misses) and checked for changes every
``REFRESH_SECONDS`` (1 s) by a background task, so a key created by ``hotloop keys create``
(or the new secret of ``hotloop keys rotate``) works at once and a revoked key (or a rotated
key's old secret) fails within about a second (``REFRESH_SECONDS`` plus one
query). In open mode only ``hl-`` secrets trigger that re-read (so a server that just got its
first key does not treat that key's caller as anonymous), other tokens are ignored.

Unknown secrets are remembered too (a negative cache, by SHA-256, per process, at most
``NEGATIVE_ENTRIES`` = 1,024 of them, the oldest dropped first): a secret the re-read did not
find is refused (401; anonymous in open mode) without another read for ``NEGATIVE_SECONDS``
(10 s), so a client sending a bad key in a loop costs the key table one query per 10 s, not
one per request. The whole cache is dropped whenever the key table changes (the background
refresh reloads it), and a new key's or a rotated key's new secret was never refused before
(32 random bytes), so it still works at once; a revoked key's secret stays refused. When the
re-read fails (Redis unreachable, the SQLite file locked), a remembered secret is still
refused with 401, however old its entry: it was unknown in the last table this process read,
and nothing changed since as far as it knows. A secret never seen gets the 503 (it may be a
key created since).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Iterable

from hotloop import errors
from hotloop.state.store import LEGACY_OWNER, StoreBusy, locked
from hotloop.tenants.keys import SECRET_PREFIX, UNLIMITED, KeyRecord, KeyStore, Limits, hash_secret
from hotloop.tenants.limits import Grant, Limiter, MemoryLimiter

log = logging.getLogger("hotloop.tenants")


class Tenant:
    """One caller's identity: ``id`` owns what it stores, ``name`` labels its usage."""

    __slots__ = ("id", "name", "admin", "limits", "key_hash")

    def __init__(self, id: str, name: str, limits: Limits = UNLIMITED, key_hash: bytes = b"", admin: bool = False) -> None:
        self.id = id
        self.name = name
        self.admin = admin
        self.limits = limits
        self.key_hash = key_hash

    @property
    def scope(self) -> str | None:
        """The owner whose content this tenant may read (``None``: every owner's)."""
        return None if self.admin else self.id

    def __repr__(self) -> str:
        return f"Tenant({self.name!r})"


ADMIN = Tenant("admin", "admin", admin=True)
ANONYMOUS = Tenant(LEGACY_OWNER, "anonymous")


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the request's one ``Authorization: Bearer`` field; ``None`` without one or
    for another scheme; ``TWO_FIELDS`` with two or more (a singleton field, RFC 9110: which one a
    front proxy checked is unknown, so neither is taken)."""
    found: bytes | None = None
    for name, value in headers:
        if name == b"authorization":
            if found is not None:
                return TWO_FIELDS
            found = value
    if found is None:
        return None
    scheme, _, token = found.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_BAD_KEY = "Incorrect API key provided."
_TWO_FIELDS = "Send one Authorization header: this request has several, and none of them is used."
# bearer()'s answer for several Authorization fields: an object of its own (compared by identity,
# so no token the client sends is ever taken for it), no key's prefix (open mode: anonymous)
TWO_FIELDS = bytes(b"\x00several Authorization fields")
_REVOKED = "The API key used for this connection has been revoked."


class Tenancy:
    REFRESH_SECONDS = 1.0
    TOUCH_SECONDS = 60.0  # last-used times are written at most this often
    # an unknown secret is refused without re-reading the key table for this long (seconds)...
    NEGATIVE_SECONDS = 10.0
    # ... and so are at most this many secrets (by hash; the oldest entry is dropped first)
    NEGATIVE_ENTRIES = 1024

    def __init__(
        self,
        keys: KeyStore,
        admin_key: str | None = None,
        limiter: Limiter | None = None,
        *,
        output_reserve: int = 4096,
    ) -> None:
        self.keys = keys
        self._admin_hash = hash_secret(admin_key) if admin_key else None
        self.limiter: Limiter = limiter if limiter is not None else MemoryLimiter()
        self.output_reserve = output_reserve
        self._by_hash: dict[bytes, Tenant] = {}
        # secrets' hashes the key table did not hold when last read -> when that was found
        # (monotonic); emptied whenever the table is reloaded (see the module docstring)
        self._unknown: dict[bytes, float] = {}
        self._version: tuple[int, int, int] | None = None
        self._closed = False  # latched once a key was seen: never back to open mode
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotloop-keys")
        self._refreshing: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._shut = False  # close() has begun: a second call does nothing
        self._used: dict[str, float] = {}  # key id -> last use not yet written
        self._touched_at = 0.0
        self._reload(keys.version(), keys.list())

    @property
    def open(self) -> bool:
        """No admin key and no key ever created: every caller is ``anonymous``."""
        return self._admin_hash is None and not self._closed

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, host: str) -> None:
        if self.open and not is_loopback(host):
            log.warning(
                "NO AUTHENTICATION: serving %s without an API key; anyone who can reach it can use it and "
                "read every stored response. Create keys with `hotloop keys create NAME` or set --api-key.",
                host,
            )
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="hotloop-keys")

    async def close(self) -> None:
        """Stop the watcher, record the last uses, close the key store and the limiter. Never
        blocks the event loop (the key store closes on its thread, after whatever the watcher left
        there): the server bounds the whole close (:meth:`HotloopApp.shutdown`). Once only."""
        if self._shut:
            return
        self._shut = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:  # the watcher's own end, unless close() is cancelled too
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    self._pool.shutdown(wait=False, cancel_futures=True)
                    raise
        try:
            with contextlib.suppress(errors.StoreUnavailable):
                await self._flush_used(force=True)
            await asyncio.get_running_loop().run_in_executor(self._pool, self.keys.close)
        except BaseException:  # cut short (cancelled): the thread ends once the store lets it go
            self._pool.shutdown(wait=False, cancel_futures=True)
            raise
        self._pool.shutdown(wait=True)  # idle: the close was its last call
        aclose = getattr(self.limiter, "aclose", None)
        if aclose is not None:
            await aclose()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.REFRESH_SECONDS)
            try:
                await self.refresh()
                await self._flush_used()
            except StoreBusy:  # SQLite locked by another connection: refresh said so
                pass
            except errors.StoreUnavailable:  # Redis is down: keys already loaded keep working
                log.warning("reading the key table failed: the store is unavailable")
            except Exception:  # a busy or broken key table must not stop the watcher
                log.exception("reading the key table failed")

    def _reload(self, version: tuple[int, int, int], records: list[KeyRecord]) -> None:
        by_hash: dict[bytes, Tenant] = {}
        for r in records:
            if r.active:
                by_hash[r.hash] = Tenant(r.id, r.name, r.limits, r.hash)
        self._by_hash = by_hash
        self._unknown = {}  # what was unknown may be in the new table (a restored backup)
        old, self._version = self._version, version
        if old is not None and version[0] < old[0]:
            log.warning(
                "the key table went back (%d keys ever created, was %d): the store was emptied or replaced; "
                "keys it no longer holds are refused%s",
                version[0], old[0], "" if self._admin_hash is not None else ", and the server stays closed",
            )
        if version[0] > 0:
            self._closed = True

    def _read(self, known: tuple[int, int, int] | None) -> tuple[tuple[int, int, int], list[KeyRecord] | None]:
        version = self.keys.version()
        return version, (None if version == known else self.keys.list())

    async def refresh(self) -> None:
        """Re-read the key table if it changed (one query; concurrent callers share it)."""
        if self._refreshing is not None:
            # a look in flight, which may have read the table before the caller's key was
            # created: joined, then one more of the caller's own (a new key works at once)
            await asyncio.shield(self._refreshing)
            if self._refreshing is not None:
                return await asyncio.shield(self._refreshing)
        loop = asyncio.get_running_loop()
        fut = self._refreshing = loop.create_future()
        fut.add_done_callback(errors.retrieved)  # a failure nobody joined is not "never retrieved"
        try:
            try:
                version, records = await loop.run_in_executor(self._pool, self._read, self._version)
            except Exception as exc:
                if not locked(exc):
                    raise
                # another connection kept the file locked past the key store's busy timeout: a
                # 503 the client may retry (not a 500, and not a 401: the key may be valid)
                log.warning("reading the key table failed: it is locked by another connection")
                raise StoreBusy() from None
            if records is not None:
                self._reload(version, records)
        except BaseException as exc:
            fut.set_exception(exc)  # those who joined fail as this caller does (503, not a 401)
            raise
        else:
            fut.set_result(None)
        finally:
            self._refreshing = None

    async def _flush_used(self, force: bool = False) -> None:
        now = time.time()
        if not self._used or (not force and now - self._touched_at < self.TOUCH_SECONDS):
            return
        used, self._used = self._used, {}
        self._touched_at = now
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.keys.touch, used)
        except Exception as exc:
            for key_id, at in used.items():  # kept for the next touch (a later use is newer)
                self._used.setdefault(key_id, at)
            if not locked(exc):
                raise
            # another connection holds the file's write lock (a backup, `hotloop keys`...): at
            # most one line per TOUCH_SECONDS, the next touch's time
            log.warning("recording keys' last use: the key table is locked by another connection; tried again later")

    # -- per request ---------------------------------------------------------------------------

    async def authenticate(self, scope: dict[str, Any]) -> Tenant:
        """The caller of an HTTP request or WebSocket handshake. :raises AuthenticationFailed:"""
        token = bearer(scope["headers"])
        if self.open and (token is None or not token.startswith(SECRET_PREFIX.encode())):
            return ANONYMOUS
        if token is TWO_FIELDS:
            raise errors.AuthenticationFailed(_TWO_FIELDS)
        if token is not None:
            h = hash_secret(token)
            admin = self._admin_hash
            if admin is not None and hmac.compare_digest(h, admin):
                return ADMIN
            t = self._by_hash.get(h)
            if t is None:
                t = await self._look_up(h)
            if t is not None and hmac.compare_digest(t.key_hash, h):
                self._used[t.id] = time.time()
                return t
            if self.open:
                return ANONYMOUS
        raise errors.AuthenticationFailed(_BAD_KEY)

    async def _look_up(self, h: bytes) -> Tenant | None:
        """The tenant of a secret's hash not among the loaded keys: re-read the key table (a key
        created since the last look) unless the secret was found unknown recently (and the table
        has not been reloaded since); ``None`` for an unknown secret, which is then remembered."""
        seen = self._unknown.get(h)
        if seen is not None and time.monotonic() - seen < self.NEGATIVE_SECONDS:
            return None
        try:
            await self.refresh()
        except errors.StoreUnavailable:  # Redis unreachable, or the SQLite file locked (StoreBusy)
            t = self._by_hash.get(h)  # (another look may have loaded it meanwhile)
            if t is None and h not in self._unknown:
                raise  # never seen: it may be a key created since; a 503 to retry, not a 401
            return t  # unknown in the last table read, and no change seen since: refused
        t = self._by_hash.get(h)
        if t is None:
            unknown = self._unknown
            unknown.pop(h, None)  # re-inserted last: the newest
            if len(unknown) >= self.NEGATIVE_ENTRIES:
                del unknown[next(iter(unknown))]
            unknown[h] = time.monotonic()
        return t

    def verify(self, tenant: Tenant) -> None:
        """The tenant's key is still valid (revocation is seen within ``REFRESH_SECONDS``)."""
        if tenant.key_hash:
            # by its secret's hash, not only its id: a rotated key (hotloop keys rotate) keeps its
            # id, and a connection opened with the old secret must not outlive it
            current = self._by_hash.get(tenant.key_hash)
            if current is None or current.id != tenant.id:
                raise errors.AuthenticationFailed(_REVOKED)
        elif tenant is ANONYMOUS and not self.open:
            raise errors.AuthenticationFailed(_BAD_KEY)

    def operator(self, tenant: Tenant) -> bool:
        """Whether this caller sees the whole server's activity (``/hotloop/stats`` in full: the
        per-response ring, cache sizes and hit counts): the admin key, and every caller in open
        mode (one tenant: nobody else to hide it from). A tenant's key gets only counts (which
        process answered, responses in flight and done, the store queue, the collector): the
        full view moves with each of another tenant's responses (its CPU, event and context
        sizes, what it reused), a side channel between tenants on a shared server; no content,
        but nothing a tenant needs either (its usage: ``/hotloop/usage``; its limits: the
        ``x-ratelimit-*`` headers). The counts kept tell how busy the server is, no more than
        ``/healthz`` tells anyone (``active_responses``); refusing the route (403) instead
        would break what tenants' clients use it for (which worker answered, ``pid``; waiting
        for the store queue to drain, ``store.pending``)."""
        return tenant.admin or (tenant is ANONYMOUS and self.open)

    def admit(self, tenant: Tenant) -> Awaitable[None] | None:
        """One request (an HTTP request or a ``response.create``): revocation and the RPM bucket.
        A shared limiter's answer is an awaitable the caller awaits (``None``: admitted)."""
        self.verify(tenant)
        if tenant.limits.rpm is not None:
            return self.limiter.take_request(tenant.id, tenant.limits)
        return None

    def admit_response(
        self, tenant: Tenant, input_tokens: int, max_output_tokens: int | None
    ) -> Grant | Awaitable[Grant] | None:
        """Reserve a response's tokens (input plus ``max_output_tokens`` or the default output
        reservation) and a concurrency slot; ``None`` for a tenant without such limits (a shared
        limiter's grant comes as an awaitable)."""
        limits = tenant.limits
        if limits.tpm is None and limits.max_concurrent is None:
            return None
        if max_output_tokens is not None:
            reserve = max_output_tokens
        else:
            # the default is the server's estimate, not what the client asked for: at most a
            # quarter of the key's TPM and what it leaves after the input, so a key whose TPM is
            # below the default is neither refused "too large" for a reservation it never made
            # nor made to wait for a full bucket for each response (the correction at the end
            # charges the real usage, here and in the ledger)
            reserve = self.output_reserve
            if limits.tpm is not None:
                reserve = max(0, min(reserve, limits.tpm // 4, limits.tpm - input_tokens))
        return self.limiter.admit(tenant.id, limits, input_tokens + reserve)

    def headers(self, tenant: Tenant) -> list[tuple[bytes, bytes]]:
        limits = tenant.limits
        if limits.rpm is None and limits.tpm is None:
            return []
        return self.limiter.headers(tenant.id, limits)
