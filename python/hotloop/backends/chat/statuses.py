"""A chat backend's non-2xx answers and mid-stream error objects -> typed hotloop errors. I/O-free.

Written for *our* client: the errors say what the client of hotloop should do, never what
hotloop's own backend account looks like (its rate-limit headers are read for the delay, not
forwarded).
"""

from __future__ import annotations

import email.utils
import logging
import math
import re
import time
from typing import Mapping

import msgspec

from hotloop import errors

log = logging.getLogger("hotloop.backends")

MAX_RETRY_DELAY = 20.0  # never wait longer than this for one retry; surface the 429 instead
MAX_UPSTREAM_MESSAGE = 300  # characters of a backend's 400 message shown to clients

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

_CONTEXT_PATTERNS = (
    "context length",
    "context_length",
    "context window",
    "maximum context",
    "too many tokens",
    "prompt is too long",
    "reduce the length",
    "context size",  # llama.cpp: "request (N tokens) exceeds the available context size (M tokens)"
    "exceed_context_size",  # llama.cpp's error type
    # vLLM's V1 engine: "The decoder prompt (length N) is longer than the maximum model length of
    # M. Make sure that `max_model_len` is no smaller than the number of text tokens."
    "maximum model length",
)
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(value: str) -> float | None:
    """``"1.5"`` (seconds), ``"6m0s"`` / ``"250ms"`` (OpenAI's durations) -> seconds; ``None``
    for anything else, a number that is not finite (``inf``, ``nan``, ``1e999``) included."""
    value = value.strip()
    try:
        v = float(value)
    except ValueError:
        pass
    else:
        # not finite, or too large to be in milliseconds (1e306 s: retry-after-ms overflowed)
        return max(0.0, v) if math.isfinite(v * 1000.0) else None
    total, pos = 0.0, 0
    for m in _DURATION_RE.finditer(value):
        if m.start() != pos:
            return None
        total += float(m.group(1)) * _DURATION_UNIT[m.group(2)]
        pos = m.end()
    return total if pos and pos == len(value) else None


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The delay a 429 asks for, in seconds (``None``: the backend did not say).

    ``retry-after-ms``, then ``retry-after`` (seconds or an HTTP date), then the
    ``x-ratelimit-reset-*`` headers (Cerebras: seconds as floats; OpenAI-style servers:
    durations). Of those, the resets whose matching ``x-ratelimit-remaining-*`` is 0 decide (the
    longest wins); without that information the shortest reset is used.
    """
    asked = _asked_delay(headers, now)
    if asked is not None:
        return asked  # (at most MAX_RETRY_AFTER_SECONDS)
    exhausted: list[float] = []
    resets: list[float] = []
    for name, value in headers.items():
        name = name.lower()
        if not name.startswith("x-ratelimit-reset-"):
            continue
        v = _seconds(value)
        if v is None:
            continue
        resets.append(v)
        remaining = headers.get("x-ratelimit-remaining-" + name[len("x-ratelimit-reset-") :])
        if remaining is not None and _seconds(remaining) == 0:
            exhausted.append(v)
    if exhausted:
        return min(max(exhausted), MAX_RETRY_AFTER_SECONDS)
    return min(min(resets), MAX_RETRY_AFTER_SECONDS) if resets else None


# The longest delay passed on to clients (a day: a daily quota's reset). A backend's
# ``retry-after-ms: 1e305`` became a 302-digit ``retry-after``, a date in the year 9999 one of
# 251,605,624,559 seconds.
MAX_RETRY_AFTER_SECONDS = 86400.0


def _asked_delay(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The delay the backend asked for in so many words: ``retry-after-ms``, then ``retry-after``
    (seconds or an HTTP date), at most ``MAX_RETRY_AFTER_SECONDS``; ``None`` without one."""
    asked = _asked(headers, now)
    return None if asked is None else min(asked, MAX_RETRY_AFTER_SECONDS)


def _asked(headers: Mapping[str, str], now: float | None = None) -> float | None:
    ms = headers.get("retry-after-ms")
    if ms is not None:
        v = _seconds(ms)
        if v is not None:
            return v / 1000.0
    ra = headers.get("retry-after")
    if ra is not None:
        v = _seconds(ra)
        if v is not None:
            return v
        try:
            when = email.utils.parsedate_to_datetime(ra)
        except (TypeError, ValueError):
            when = None
        if when is not None:
            return max(0.0, when.timestamp() - (time.time() if now is None else now))
    return None


def _plain_seconds(delay: float) -> str:
    """A delay as Codex reads "try again in Ns": a plain number (3600, 1.5, 0.25), never "3.6e+03"."""
    return f"{delay:.0f}" if delay >= 100 else f"{delay:.3f}".rstrip("0").rstrip(".")


def _error_fields(body: object) -> tuple[str, str]:
    """(message, code) of an OpenAI-style ``{"error": {...}}`` or Cerebras' flat error body."""
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict):
            body = inner
        elif isinstance(inner, str):
            return inner, ""
        msg = body.get("message")
        code = body.get("code")
        if not isinstance(code, str):  # llama.cpp: the HTTP status as "code", its kind as "type"
            code = body.get("type")
        return (msg if isinstance(msg, str) else ""), (code if isinstance(code, str) else "")
    if isinstance(body, str):
        return body, ""
    return "", ""


# The backends' own credentials, registered when a backend starts (withhold): a backend's error
# message that quotes one never repeats it, to a client or in the log. Bounded by the backends
# one process starts.
_WITHHELD: set[str] = set()
_scanner: object = None


def withhold(credential: str | None) -> None:
    """Never show ``credential`` (a backend's API key) in a message taken from a backend."""
    if credential and len(credential) >= 8:
        _WITHHELD.add(credential)


def _safe(message: str) -> str:
    """A backend's message, bounded, reduced to printable characters, with the backends' own
    credentials and anything the secret scanner knows as a credential redacted."""
    global _scanner
    for secret in _WITHHELD:
        message = message.replace(secret, "[REDACTED]")
    text = "".join(ch if ch.isprintable() else " " for ch in message).strip()
    if len(text) > MAX_UPSTREAM_MESSAGE:
        text = text[: MAX_UPSTREAM_MESSAGE - 3] + "..."
    if _scanner is None:
        from hotloop._accel import SECRET_PATTERNS, SecretScanner

        _scanner = SecretScanner(SECRET_PATTERNS)
    from hotloop._accel import redact_spans
    from hotloop.pipeline.classify import whole_values  # (a password to its value's end)

    return redact_spans(text, whole_values(text, _scanner.scan(text)))  # type: ignore[attr-defined]


# What a server's internals look like in an error message: a traceback or one of its frames, a
# source file or a path on the server, an exception's class, an attribute error's wording
_INTERNALS = re.compile(
    r"Traceback \(most recent call last\)|File \"[^\"]*\", line \d|\.(?:py|java|go|rs|js|ts|rb|cc?|cpp)[\":,)]|"
    r"site-packages|(?:^|[\s(\"'=])/(?:usr|srv|var|home|opt|app|tmp|etc|root|workspace|vllm-workspace|models|data|mnt)/|"
    r"\b[a-z]:\\|goroutine \d|(?-i:\b[A-Z][A-Za-z]*(?:Error|Exception)\b(?:\:|\s*\())|"
    r"\b(?:sqlite3|psycopg2?|asyncpg|sqlalchemy)\.|object has no attribute|NoneType|<html",
    re.IGNORECASE,
)


def _shown(body: object, message: str) -> str:
    """The part of a backend's 400 a client sees: the message of a JSON error object, unless it
    carries what a server's internals look like (a traceback, a source path, an exception's
    class, a page of HTML: ``_INTERNALS``); "" otherwise."""
    if isinstance(body, str) or _INTERNALS.search(message):
        return ""
    return _safe(message)


def parse_body(raw: bytes) -> object:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw.decode("utf-8", "replace")


class TransientBackendError(errors.BackendError):
    """A backend failure worth retrying (5xx, a broken connection); same wire meaning as its base."""


def status_error(
    status: int, headers: Mapping[str, str], body: object, *, backend: str, model: str
) -> errors.HotloopError:
    """The client-visible error for a backend's non-2xx answer (or a mid-stream error object).

    Written for *our* client: 401/403 mean the backend rejected hotloop's own credentials, which
    is a server-side fault (502), not the client's (whose key hotloop accepted). Only a 400's
    ``message`` is passed on (from a JSON error object; bounded, printable, credentials redacted),
    because it tells the client what to fix.
    """
    message, code = _error_fields(body)
    log.warning("%s backend answered HTTP %d: %s", backend, status, _safe(message) or "(no message)")
    if status == 429 and code == "insufficient_quota":  # (its type, when its code is none: _error_fields)
        # the account hotloop uses has no quota left (OpenAI's answer, and many a compatible
        # provider's): not a rate limit that passes
        return errors.QuotaExhausted(
            f"The model backend's quota for this server is exhausted (model '{errors.clip(model)}'); "
            "retrying will not help until the server's operator restores it."
        )
    if status == 429:
        # The backend's x-ratelimit-* headers describe hotloop's own account with it: they decide
        # the delay and are never passed on.
        delay = retry_after(headers)
        hint = f" Please try again in {_plain_seconds(delay)}s." if delay is not None else ""
        return errors.RateLimited(f"Rate limit reached for model '{errors.clip(model)}' on the model backend.{hint}", retry_after=delay)
    lowered = message.lower()
    if status in (400, 413, 422):
        if code == "context_length_exceeded" or any(p in lowered or p in code for p in _CONTEXT_PATTERNS):
            return errors.ContextLengthExceeded(
                "The input exceeds the context window of this model. Please shorten the input.", param="input"
            )
        detail = _shown(body, message)
        return errors.InvalidRequest(
            f"The model backend rejected the request: {detail}" if detail else "The model backend rejected the request."
        )
    if status == 404:
        if "model" in lowered or code == "model_not_found":
            return errors.ModelNotFound(
                f"The model '{errors.clip(model)}' does not exist or is not served by the model backend.", param="model"
            )
        return _not_retried("The model backend has no chat-completions endpoint at its configured URL.")
    if status in (401, 403):
        return _not_retried("The model backend rejected hotloop's credentials for it.")
    # A failure worth retrying (the statuses the backends' SDKs retry: 408, 409 and every 5xx)
    # keeps the backend's own word on when to come back: hotloop's retry waits that long, and the
    # client is told it. Its x-ratelimit-* headers describe hotloop's account, as for a 429, and
    # are not passed on.
    asked = errors.retry_headers(_asked_delay(headers))
    if status in (408, 504):
        return errors.BackendTimeout("The model backend timed out.", headers=asked)
    if status == 503:
        return errors.BackendUnavailable("The model backend is unavailable. Please try again later.", headers=asked)
    if status >= 500 or status == 409:
        # 409: a conflict the backend expects to clear (Cerebras' SDK and docs retry it)
        return TransientBackendError(f"The model backend failed (HTTP {status}).", headers=asked)
    return _not_retried(f"The model backend failed (HTTP {status}).")


def _not_retried(message: str) -> errors.BackendError:
    """A 502 for a backend answer that a retry gets again (hotloop's own configuration: its
    credentials, its URL, its account; a redirect): ``x-should-retry: false``, or the OpenAI
    SDKs, which retry every 5xx by default, send the request twice more for the same answer."""
    return errors.BackendError(message, headers={"x-should-retry": "false"})


def transport_failure(exc: BaseException | None, *, timed_out: bool = False) -> errors.HotloopError:
    """An httpx failure to send a request or to read its response head (the sdk transports), as
    the lean transport (:mod:`hotloop.backends.chat.http1`) types the same failure: not
    connected (refused, or the connect timed out) -> 503 "Could not connect"; every connection
    busy -> 503; no answer in time -> 504; the connection closed before the answer -> 502,
    retryable. ``exc``: the httpx exception (an SDK error's ``__cause__``); anything else is
    ``timed_out`` (a 504) or not connected."""
    import httpx

    from hotloop.backends.chat import http1

    if isinstance(exc, httpx.PoolTimeout):
        return errors.BackendUnavailable("Too many connections to the model backend are busy.")
    if isinstance(exc, (httpx.ConnectTimeout, httpx.ConnectError)):
        return errors.BackendUnavailable(http1._UNAVAILABLE)
    if isinstance(exc, httpx.TimeoutException):
        return errors.BackendTimeout(http1._NO_ANSWER)
    if isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.CloseError)) or (
        isinstance(exc, httpx.RemoteProtocolError) and "disconnected" in str(exc)
    ):
        return TransientBackendError(http1._BROKEN)
    if isinstance(exc, httpx.RemoteProtocolError):
        return errors.BackendError(http1._NOT_HTTP)
    return errors.BackendTimeout(http1._NO_ANSWER) if timed_out else errors.BackendUnavailable(http1._UNAVAILABLE)


def retry_delay(exc: errors.HotloopError, attempt: int) -> float | None:
    """How long to wait before retrying after ``exc`` (``None``: do not retry)."""
    if isinstance(exc, errors.RateLimited):
        delay = exc.retry_after if exc.retry_after is not None else 0.5 * 2**attempt
    elif isinstance(exc, (TransientBackendError, errors.BackendUnavailable, errors.BackendTimeout)):
        delay = min(0.25 * 2**attempt, 4.0)
        asked = exc.headers.get("retry-after-ms")  # the delay the backend asked for (status_error)
        if asked is not None:
            delay = max(delay, int(asked) / 1000.0)
    else:
        return None
    return delay if delay <= MAX_RETRY_DELAY else None

