"""Cerebras Cloud's answers (``/work/shared/reference/cerebras.md``) as hotloop maps them. I/O-free.

The SDK hotloop configures (``max_retries=0``: hotloop decides retries itself) retries 408,
409, 429 and every 5xx, honouring ``retry-after-ms`` and ``retry-after``; the docs list 402 and
503 too. Its error bodies are flat (``{"message", "type", "param", "code"}``) or OpenAI-shaped,
and its rate-limit headers are ``x-ratelimit-{limit,remaining,reset}-{requests-day,tokens-minute}``
(resets in seconds, as floats).
"""

from __future__ import annotations

import pytest

from hotloop import errors
from hotloop.backends.chat.statuses import TransientBackendError, retry_after, retry_delay, status_error

CEREBRAS_HEADERS = {
    "x-ratelimit-limit-requests-day": "14400",
    "x-ratelimit-limit-tokens-minute": "60000",
    "x-ratelimit-remaining-requests-day": "14000",
    "x-ratelimit-remaining-tokens-minute": "0",
    "x-ratelimit-reset-requests-day": "33011.4",
    "x-ratelimit-reset-tokens-minute": "11.4",
}


def _err(status: int, headers: dict[str, str] | None = None, body: object = None) -> errors.HotloopError:
    return status_error(status, headers or {}, body if body is not None else {"message": "x"}, backend="cerebras", model="gpt-oss-120b")


def test_a_409_is_retried_as_the_sdk_retries_it() -> None:
    """cerebras.md: the SDK retries 409 (Conflict) like 408, 429 and 5xx. hotloop turned it
    into a 502 with ``x-should-retry: false`` that neither it (``--backend-retries``) nor its
    client's SDK would retry: a transient conflict failed the request for good."""
    exc = _err(409, body={"message": "Conflict", "type": "conflict"})
    assert isinstance(exc, TransientBackendError), type(exc)
    assert exc.status == 502 and exc.headers.get("x-should-retry") != "false"
    assert retry_delay(exc, 0) is not None


@pytest.mark.parametrize(
    ("status", "headers", "delay"),
    [
        (500, {"retry-after": "3"}, 3.0),
        (502, {"retry-after-ms": "1500"}, 1.5),
        (504, {"retry-after": "2"}, 2.0),
        (408, {"retry-after-ms": "2500"}, 2.5),
        (409, {"retry-after": "4"}, 4.0),
        (503, {"retry-after": "2"}, 2.0),  # held before
    ],
)
def test_a_retried_failure_waits_as_long_as_the_backend_asked(status: int, headers: dict[str, str], delay: float) -> None:
    """cerebras.md: retries honour ``retry-after-ms`` and ``retry-after``. hotloop read them for
    429 and 503 only: a 500/502/504/408 asking for 3 s was retried after 0.25 s (and got the
    same answer again, spending the retry)."""
    exc = _err(status, headers)
    assert retry_delay(exc, 0) == pytest.approx(delay)


def test_a_5xx_without_a_delay_keeps_the_short_backoff() -> None:
    assert retry_delay(_err(500), 0) == pytest.approx(0.25)
    assert retry_delay(_err(500, {"retry-after": "60"}), 0) is None  # longer than hotloop waits


def test_cerebras_rate_limit_headers_give_the_exhausted_bucket_s_reset() -> None:
    assert retry_after(CEREBRAS_HEADERS) == pytest.approx(11.4)
    exc = _err(429, CEREBRAS_HEADERS, {"message": "Tokens per minute limit exceeded", "type": "too_many_requests_error"})
    assert isinstance(exc, errors.RateLimited) and exc.retry_after == pytest.approx(11.4)
    assert not any(k.startswith("x-ratelimit") for k in exc.headers)


def test_cerebras_context_wording_is_a_context_length_error() -> None:
    body = {
        "message": "Please reduce the length of the messages or completion. Current length is 42328 while limit is 40000",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "wrong_api_format",
    }
    exc = _err(400, body=body)
    assert isinstance(exc, errors.ContextLengthExceeded) and exc.param == "input"


def test_cerebras_flat_model_not_found() -> None:
    body = {"message": "Model nope does not exist or you do not have access to it.", "type": "not_found_error", "param": "model", "code": "model_not_found"}
    exc = _err(404, body=body)
    assert isinstance(exc, errors.ModelNotFound)


def test_a_402_is_not_retried() -> None:
    exc = _err(402, body={"message": "Payment required", "type": "payment_required_error"})
    assert exc.status == 502 and exc.headers.get("x-should-retry") == "false" and retry_delay(exc, 0) is None
