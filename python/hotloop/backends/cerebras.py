"""The Cerebras Cloud backend, configured by cerebras-cloud-sdk.

``AsyncCerebras`` is the source of configuration (API key and ``CEREBRAS_*`` environment, base
URL, its default and custom headers) and the client for everything but the hot path (model
listing, typed errors). The request body is rendered and serialised once by
:mod:`hotloop.backends.chat` (byte-stable across turns) and its SSE stream is parsed by hotloop
(SseDecoder + msgspec), never by the SDK's pydantic chunk models.

Two transports carry the streaming ``POST``:

* ``lean`` (the default): :mod:`hotloop.backends.chat.http1`, keep-alive HTTP/1.1 on asyncio
  protocols with the SDK's URL and headers. A proxy configured for the origin makes the backend
  fall back to ``sdk`` (logged).
* ``sdk``: ``client.post(..., cast_to=httpx.Response, stream=True)`` through the SDK's httpx stack.

The client is created once, in :meth:`CerebrasBackend.start`, with ``warm_tcp_connection=False``
(the SDK's warm-up builds a *sync* client and blocks the event loop) and ``max_retries=0``
(hotloop decides retries: ``--backend-retries``/``HOTLOOP_BACKEND_RETRIES``, before the first
token only).
"""

from __future__ import annotations

import logging
import os

import httpx
from cerebras.cloud.sdk import APIConnectionError, APIStatusError, APITimeoutError, AsyncCerebras

from hotloop import errors
from hotloop.backends.chat import CEREBRAS, Body, ChatBackend, status_error
from hotloop.backends.chat.http1 import PROXY_ENV_PROBLEM, lean_pool, open_chat_stream, redact_url, url_problem
from hotloop.backends.chat.httpx_body import HttpxBody, http_timeout, quiet_http_logs, read_models_body
from hotloop.backends.chat.statuses import parse_body, transport_failure, withhold
from hotloop.config import Config

log = logging.getLogger("hotloop.backends")

DEFAULT_MODEL = "gpt-oss-120b"
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
_STREAM_HEADERS = {"Accept": "text/event-stream"}


def sdk_base_url(url: str | None) -> str | None:
    """The SDK adds ``/v1`` itself: a base URL given with it is trimmed (a common mistake)."""
    if url is None:
        return None
    trimmed = url.rstrip("/")
    if trimmed.endswith("/v1"):
        log.info("cerebras backend: dropping the trailing /v1 of the base URL (the SDK adds it)")
        trimmed = trimmed[: -len("/v1")]
    return trimmed


class CerebrasBackend(ChatBackend):
    name = "cerebras"
    dialect = CEREBRAS
    owned_by = "cerebras"

    def __init__(self, config: Config) -> None:
        super().__init__(
            model=config.model or DEFAULT_MODEL, retries=config.backend_retries, think_tags=config.think_tags
        )
        # hotloop's own settings win over the SDK's environment variables.
        self._api_key = config.backend_api_key or os.environ.get("CEREBRAS_API_KEY")
        self._base_url = sdk_base_url(config.base_url or os.environ.get("CEREBRAS_BASE_URL"))
        self._timeout = http_timeout(config.backend_timeout, config.backend_idle_timeout)
        self._config = config
        self._client: AsyncCerebras | None = None

    def missing(self) -> str | None:
        """What this backend needs and was not given (said at start-up, before serving)."""
        if not self._api_key:
            return "The cerebras backend needs an API key: set CEREBRAS_API_KEY (or HOTLOOP_BACKEND_API_KEY)."
        problem = url_problem(self._base_url) if self._base_url else None  # (none: the SDK's own)
        return None if problem is None else f"the base URL (--base-url, HOTLOOP_BASE_URL or CEREBRAS_BASE_URL) is {problem}"

    async def start(self) -> None:
        why = self.missing()
        if why is not None:
            raise RuntimeError(why)
        withhold(self._api_key)  # never repeated from a backend's error message
        quiet_http_logs()
        try:
            self._client = AsyncCerebras(
                api_key=self._api_key,
                base_url=self._base_url,
                timeout=self._timeout,
                max_retries=0,
                warm_tcp_connection=False,
            )
        except httpx.InvalidURL:  # (its message may quote a piece of a password)
            # the base URL passed url_problem (missing), or is the SDK's own: what httpx refused
            # is in the environment
            raise ValueError(PROXY_ENV_PROBLEM) from None
        if self._config.backend_transport == "lean":
            client = self._client
            headers = {k: v for k, v in client.default_headers.items() if isinstance(v, str)}
            headers["Accept"] = "text/event-stream"
            self._pool = lean_pool(str(client.base_url), headers, self._config, self.name)
        log.info("cerebras backend: %s transport to %s", self.transport, redact_url(str(self._client.base_url)))

    async def close(self) -> None:
        await self._close_pool()
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _require_client(self) -> AsyncCerebras:
        if self._client is None:
            raise errors.BackendUnavailable("The model backend is not started.")
        return self._client

    async def _open(self, body: list[bytes], model: str, request_id: str | None = None) -> Body:
        if self._pool is not None:
            return await open_chat_stream(self._pool, CHAT_PATH, body, backend=self.name, model=model, request_id=request_id)
        client = self._require_client()
        try:
            resp = await client.post(
                CHAT_PATH,
                cast_to=httpx.Response,
                content=b"".join(body),
                options={
                    "headers": {**_STREAM_HEADERS, "x-request-id": request_id} if request_id else _STREAM_HEADERS,
                    # a redirect is reported (as on the lean transport), never followed: the SDK's
                    # client would re-send the conversation to wherever Location points
                    "follow_redirects": False,
                },
                stream=True,
            )
        except APIStatusError as exc:
            raise self._status_error(exc, model) from None
        except APITimeoutError as exc:  # typed by its cause, as the lean transport types it
            raise transport_failure(exc.__cause__, timed_out=True) from None
        except APIConnectionError as exc:
            log.warning("cerebras backend: request failed (%s)", type(exc.__cause__).__name__)
            raise transport_failure(exc.__cause__) from None
        return HttpxBody(resp, self.name)

    async def _get_models(self) -> bytes:
        client = self._require_client()
        try:
            resp = await client.get(MODELS_PATH, cast_to=httpx.Response, stream=True)
        except APIStatusError as exc:
            raise self._status_error(exc, self.default_model) from None
        except APIConnectionError:  # includes APITimeoutError
            raise errors.BackendUnavailable("Could not connect to the model backend.") from None
        return await read_models_body(resp, self.name)

    def _status_error(self, exc: APIStatusError, model: str) -> errors.HotloopError:
        # The answer's own status and body, as the lean transport reads them: the SDK's
        # ``status_code`` prefers a ``status_code`` field of the body over the HTTP status (a 400
        # whose body said 429 became a rate limit), and its ``body`` is the body's ``error``
        # unwrapped (a message given as a plain string was then withheld as a non-JSON body).
        resp = exc.response
        try:
            body = parse_body(resp.content)
        except httpx.ResponseNotRead:  # (the SDK reads an error's body before raising)
            body = exc.body
        return status_error(resp.status_code, resp.headers, body, backend=self.name, model=model)
