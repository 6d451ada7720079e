"""The sdk transports' failures to reach a backend, typed as the lean transport types them.

The lean transport (:mod:`hotloop.backends.chat.http1`) says: could not connect, or the connect
timed out -> 503 ``BackendUnavailable`` "Could not connect to the model backend."; every
connection busy -> 503 "Too many connections to the model backend are busy."; no answer in
time -> 504 ``BackendTimeout``; the connection closed before the answer -> 502
``TransientBackendError`` "The model backend closed the connection mid-stream.". A timeout while
connecting or waiting for a pooled connection is not the backend failing to answer: over the sdk
transports both were a 504 "The model backend did not answer in time." (httpx's
``ConnectTimeout`` and ``PoolTimeout`` are ``TimeoutException``\\ s).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import httpx
import pytest
from cerebras.cloud.sdk import AsyncCerebras

from hotloop import errors
from hotloop.backends.base import BackendRequest
from hotloop.backends.cerebras import CerebrasBackend
from hotloop.backends.chat.statuses import TransientBackendError
from hotloop.backends.openai_compat import OpenAICompatBackend
from hotloop.config import Config

URL = "http://127.0.0.1:9"  # never contacted: the transport below answers (or fails) instead


def _failing(exc_type: Callable[..., Exception], message: str) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc_type(message, request=request)

    return httpx.MockTransport(handler)


def _backend(kind: str, transport: httpx.MockTransport) -> Any:
    """A backend on its sdk transport whose HTTP client is ``transport``."""
    if kind == "cerebras":
        cb = CerebrasBackend(Config(backend="cerebras", base_url=URL, model="m", backend_transport="sdk", backend_api_key="csk-unit-0123"))
        cb._client = AsyncCerebras(
            api_key="csk-unit-0123", base_url=URL, max_retries=0, warm_tcp_connection=False, http_client=httpx.AsyncClient(transport=transport)
        )
        return cb
    ob = OpenAICompatBackend(Config(backend="openai-compat", base_url=URL + "/v1", model="m", backend_transport="sdk"))
    ob._client = httpx.AsyncClient(base_url=URL + "/v1/", transport=transport)
    return ob


def _failure(kind: str, transport: httpx.MockTransport) -> errors.HotloopError:
    async def main() -> errors.HotloopError:
        backend = _backend(kind, transport)
        req = BackendRequest(model="m", instructions=None, items=[], tools=[], tool_choice="auto", parallel_tool_calls=True)
        try:
            async for _ in backend.stream(req):
                pass
        except errors.HotloopError as exc:
            return exc
        finally:
            await backend.close()
        raise AssertionError("the stream did not fail")

    return asyncio.run(asyncio.wait_for(main(), 10))


@pytest.mark.parametrize("kind", ["cerebras", "openai-compat"])
def test_a_connect_timeout_is_could_not_connect_not_a_timeout_of_the_answer(kind: str) -> None:
    exc = _failure(kind, _failing(httpx.ConnectTimeout, "timed out"))
    assert type(exc) is errors.BackendUnavailable and exc.status == 503
    assert exc.message == "Could not connect to the model backend."


@pytest.mark.parametrize("kind", ["cerebras", "openai-compat"])
def test_every_connection_busy_is_a_503_busy(kind: str) -> None:
    exc = _failure(kind, _failing(httpx.PoolTimeout, "pool"))
    assert type(exc) is errors.BackendUnavailable and exc.status == 503
    assert exc.message == "Too many connections to the model backend are busy."


@pytest.mark.parametrize("kind", ["cerebras", "openai-compat"])
def test_the_sdk_transports_other_failures_keep_their_meaning(kind: str) -> None:
    exc = _failure(kind, _failing(httpx.ReadTimeout, "read"))
    assert type(exc) is errors.BackendTimeout and exc.status == 504 and exc.message == "The model backend did not answer in time."
    exc = _failure(kind, _failing(httpx.ConnectError, "refused"))
    assert type(exc) is errors.BackendUnavailable and exc.message == "Could not connect to the model backend."
    exc = _failure(kind, _failing(httpx.RemoteProtocolError, "Server disconnected without sending a response."))
    assert type(exc) is TransientBackendError and exc.status == 502
    assert exc.message == "The model backend closed the connection mid-stream."
    exc = _failure(kind, _failing(httpx.ReadError, "connection reset"))
    assert type(exc) is TransientBackendError and exc.status == 502
    exc = _failure(kind, _failing(httpx.RemoteProtocolError, "illegal status line: bytearray(b'XTTP/1.1 200 OK')"))
    assert type(exc) is errors.BackendError and exc.message == "The model backend sent a response that is not valid HTTP."
