"""A chat backend's failures as a client sees them: error objects inside a 200 stream, and the
delays a backend asks for. Both chat backends, over both transports, against the scripted mock
(tests.mock_chat_server) on a real loopback socket."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hotloop import errors
from hotloop.backends.base import BackendRequest
from hotloop.backends.cerebras import CerebrasBackend
from hotloop.backends.chat.statuses import retry_after, status_error
from hotloop.backends.openai_compat import OpenAICompatBackend
from hotloop.config import Config
from hotloop.protocol.chunks import TextDelta
from tests.mock_chat_server import MockChatServer, Reply, chunk

TIMEOUT = 10.0
BACKENDS = ["openai-compat/lean", "openai-compat/sdk", "cerebras/lean", "cerebras/sdk"]


@pytest.fixture(scope="module")
def mock() -> Any:
    with MockChatServer() as m:
        yield m


def _backend(which: str, mock: MockChatServer) -> Any:
    kind, transport = which.split("/")
    if kind == "cerebras":
        return CerebrasBackend(
            Config(backend="cerebras", base_url=mock.url, model="mock-model", backend_transport=transport, backend_api_key="csk-test-key-0123")
        )
    return OpenAICompatBackend(
        Config(backend="openai-compat", base_url=mock.v1, model="mock-model", backend_transport=transport, backend_api_key="sk-test-key-0123")
    )


def _stream(which: str, mock: MockChatServer, reply: Reply) -> tuple[list[Any], BaseException | None]:
    """The chunks the backend yields for ``reply``, and the error it ends with (if any)."""

    async def main() -> tuple[list[Any], BaseException | None]:
        backend = _backend(which, mock)
        await backend.start()
        mock.reset()
        mock.push(reply)
        got: list[Any] = []
        try:
            req = BackendRequest(model="mock-model", instructions=None, items=[], tools=[], tool_choice="auto", parallel_tool_calls=True)
            async for c in backend.stream(req):
                got.append(c)
        except errors.HotloopError as exc:
            return got, exc
        finally:
            await backend.close()
        return got, None

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT))


# LiteLLM's proxy sends a failure that comes after its 200 head as an SSE data line whose error
# object's "code" is the status as a *string* (ProxyException: ``self.code = str(code)``).
LITELLM_429 = {"error": {"message": "litellm.RateLimitError: rate limited", "type": "None", "param": "None", "code": "429"}}
LITELLM_400 = {"error": {"message": "This model's maximum context length is 8192 tokens.", "type": "None", "param": "None", "code": "400"}}


@pytest.mark.parametrize("which", BACKENDS)
def test_an_error_object_whose_status_is_a_string_keeps_its_status(which: str, mock: MockChatServer) -> None:
    """A rate limit (or a context overflow) reported inside the stream before any output reached
    the client as a 502 server_error (read as HTTP 500): a client retried at once a request the
    backend had said to slow down on, or retried for ever one that can never fit."""
    role = chunk({"role": "assistant", "content": ""})
    got, exc = _stream(which, mock, Reply.stream([role, LITELLM_429]))
    assert got == [] and isinstance(exc, errors.RateLimited) and exc.status == 429 and exc.code == "rate_limit_exceeded"
    got, exc = _stream(which, mock, Reply.stream([LITELLM_400]))
    assert got == [] and isinstance(exc, errors.ContextLengthExceeded) and exc.status == 400
    # after output: the same error ends the stream (response.failed carries its code)
    got, exc = _stream(which, mock, Reply.stream([chunk({"content": "par"}), LITELLM_429]))
    assert got == [TextDelta("par")] and isinstance(exc, errors.RateLimited)


def test_an_error_objects_status_is_read_from_its_fields() -> None:
    from hotloop.backends.chat.backend import _error_status

    assert _error_status({"code": "429"}) == 429
    assert _error_status({"code": 503}) == 503
    assert _error_status({"status": " 400 "}) == 400
    # OpenAI's code words that name a status (a number, when there is one, wins)
    assert _error_status({"code": "context_length_exceeded", "message": "too long"}) == 400
    assert _error_status({"code": "rate_limit_exceeded"}) == 429
    assert _error_status({"code": "rate_limit_exceeded", "status": 503}) == 503
    # not a status: an OpenAI-style code word, a number outside 4xx/5xx, a bool
    for error in ({"code": "server_error"}, {"code": "200"}, {"code": "42"}, {"code": True}, {"code": "4e2"}, {"code": "4\u00b2\u00b9"}, "boom", None):
        assert _error_status(error) == 500


def test_a_delay_that_is_not_finite_is_no_delay() -> None:
    """``retry-after: inf`` (or 1e999) made the 429's mapping raise OverflowError: the client got
    a generic 502 "The model backend failed." and the log a traceback, instead of the 429."""
    for headers in ({"retry-after": "inf"}, {"retry-after": "1e999"}, {"retry-after-ms": "Infinity"}, {"retry-after": "nan"},
                    {"x-ratelimit-reset-tokens-minute": "inf"}):
        assert retry_after(headers) is None
        exc = status_error(429, headers, {"message": "slow down"}, backend="b", model="m")
        assert isinstance(exc, errors.RateLimited) and exc.retry_after is None and "retry-after" not in exc.headers
    # a finite one still counts, however large
    assert retry_after({"retry-after": "1e9"}) == 86400.0  # finite: at most a day
    assert retry_after({"retry-after": "inf", "x-ratelimit-reset-tokens-minute": "2.5"}) == 2.5


@pytest.mark.parametrize("which", BACKENDS)
def test_a_backend_out_of_quota_is_said_so_and_not_retried(which: str, mock: MockChatServer) -> None:
    """OpenAI's ``insufficient_quota`` 429 (the account hotloop uses has no quota left) went on as
    a retryable rate limit: the SDKs sent it again and again, for the same answer, and Codex
    could not tell it from one. It is the same 429 with OpenAI's type and code, not retried by
    hotloop, and ``x-should-retry: false`` for the SDKs."""
    body = {"error": {"message": "You exceeded your current quota, please check your plan and billing details.",
                      "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}}
    for reply in (body, {"error": {**body["error"], "code": None}}):  # known by its type alone too
        _, exc = _stream(which, mock, Reply.error(429, reply))
        assert isinstance(exc, errors.QuotaExhausted), exc
        assert (exc.status, exc.type, exc.code) == (429, "insufficient_quota", "insufficient_quota")
        assert exc.headers == {"x-should-retry": "false"} and "quota" in exc.message
        assert len(mock.requests) == 1  # not retried
    # the same error object inside a 200 stream (as a proxy passes it on)
    _, exc = _stream(which, mock, Reply.stream([chunk({"role": "assistant", "content": ""}), body]))
    assert isinstance(exc, errors.QuotaExhausted) and exc.headers == {"x-should-retry": "false"}, exc
    assert len(mock.requests) == 1
    # a plain rate limit is still one
    _, exc = _stream(which, mock, Reply.error(429, {"error": {"message": "slow down", "type": "requests", "code": "rate_limit_exceeded"}}))
    assert type(exc) is errors.RateLimited


@pytest.mark.parametrize("which", BACKENDS)
def test_a_503_passes_on_the_delay_its_backend_asked_for(which: str, mock: MockChatServer) -> None:
    """An overloaded backend's 503 with ``retry-after`` reached the client as a 503 without it
    (HTTP headers, and a WebSocket error frame's ``error.headers``), so openai-python and Codex
    came back at their own backoff of a fraction of a second instead of when asked. Only the
    backend's explicit delay is passed on, never its x-ratelimit-* headers."""
    body = {"error": {"message": "We're experiencing high traffic right now! Please try again soon.", "type": "service_unavailable"}}
    headers = {"retry-after": "7", "x-ratelimit-reset-tokens-minute": "30", "x-ratelimit-remaining-tokens-minute": "0"}
    _, exc = _stream(which, mock, Reply.error(503, body, headers))
    assert isinstance(exc, errors.BackendUnavailable) and exc.status == 503 and exc.code == "server_error"
    assert exc.headers == {"retry-after": "7", "retry-after-ms": "7000"}
    from hotloop.protocol.events import ws_error

    assert b'"headers":{"retry-after":"7","retry-after-ms":"7000"}' in ws_error(exc)[1]
    # without a delay of its own (only the account's reset times): nothing to pass on
    _, exc = _stream(which, mock, Reply.error(503, body, {"x-ratelimit-reset-tokens-minute": "30"}))
    assert isinstance(exc, errors.BackendUnavailable) and exc.headers == {}


def test_hotloops_own_retry_of_a_503_waits_as_long_as_asked() -> None:
    from hotloop.backends.chat.statuses import MAX_RETRY_DELAY, retry_delay

    def unavailable(headers: dict[str, str]) -> errors.HotloopError:
        return status_error(503, headers, None, backend="b", model="m")

    assert retry_delay(unavailable({}), 0) == 0.25  # its own backoff
    assert retry_delay(unavailable({"retry-after-ms": "1500"}), 0) == 1.5
    assert retry_delay(unavailable({"retry-after": "0"}), 1) == 0.5  # never sooner than its backoff
    assert retry_delay(unavailable({"retry-after": str(MAX_RETRY_DELAY + 1)}), 0) is None  # surfaced at once


def test_a_delay_too_large_for_milliseconds_and_a_long_digit_code_map_without_crashing() -> None:
    """``retry-after: 1e306`` is finite, but its milliseconds overflowed (``int(inf)``) in the
    429's and the 503's headers; a code of 5,000 digits passed Python's int() digit limit."""
    from hotloop.backends.chat.backend import _error_status
    from hotloop.backends.chat.statuses import status_error

    busy = status_error(503, {"retry-after": "1e306"}, None, backend="b", model="m")
    assert isinstance(busy, errors.BackendUnavailable) and "retry-after" not in busy.headers
    limited = status_error(429, {"retry-after": "1e306"}, None, backend="b", model="m")
    assert isinstance(limited, errors.RateLimited)
    assert _error_status({"code": "4" * 5000}) == 500


@pytest.mark.parametrize("which", BACKENDS)
def test_the_model_list_is_read_once_for_concurrent_callers_and_within_a_bound(which: str, mock: MockChatServer) -> None:
    """``GET /models`` was read whole into memory (a gateway's 800 MB took the server to 1.7 GB),
    once per caller asking while the cache was stale. Callers at once share one fetch, and a
    list over MAX_MODELS_BYTES is refused unread: the default model is offered instead."""
    from hotloop.backends.chat import backend as chat_backend
    from hotloop.backends.chat.httpx_body import MAX_MODELS_BYTES

    def models_gets() -> int:
        return sum(r.method == "GET" and r.path == "/v1/models" for r in mock.other_requests)

    async def main() -> tuple[list[list[str]], int, list[str], int]:
        backend = _backend(which, mock)
        await backend.start()
        try:
            before = models_gets()
            backend._models_at = -chat_backend.MODELS_TTL  # stale
            lists = await asyncio.gather(*(backend.list_models() for _ in range(8)))
            shared = models_gets() - before
            mock.model_fields["mock-model"] = {"pad": "x" * (MAX_MODELS_BYTES + 1)}
            backend._models_at = -chat_backend.MODELS_TTL
            big = await backend.list_models()
            return [[m["id"] for m in ms] for ms in lists], shared, [m["id"] for m in big], models_gets() - before
        finally:
            mock.model_fields.clear()
            await backend.close()

    lists, shared, big, gets = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert lists == [["gpt-oss-120b", "mock-model"]] * 8 and shared == 1
    assert big == ["mock-model"] and gets == 2  # the default model: the list was not read


def test_a_password_in_a_backends_error_message_is_redacted_to_its_end() -> None:
    """A backend's message passed on to clients had its credentials redacted by the scanner's
    own span, which stops at a "$": ``DB_PASSWORD=[REDACTED:generic_secret]$wR8tY`` kept the
    password's tail."""
    exc = status_error(400, {}, {"error": {"message": "connection refused: DB_PASSWORD=Kx9mQ2vL7pZ4$wR8tY rejected"}},
                       backend="test", model="m")
    assert "wR8tY" not in exc.message and "DB_PASSWORD=[REDACTED:generic_secret] rejected" in exc.message, exc.message
