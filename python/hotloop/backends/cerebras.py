"""The Cerebras Cloud backend: ``AsyncCerebras`` from cerebras-cloud-sdk as the HTTP client.

The SDK stays the client (API key and ``CEREBRAS_*`` environment, base URL, custom headers,
connection pool, typed status errors), but hotloop uses its cheapest path: the request body is
rendered and serialised once by :mod:`hotloop.backends.chat` (byte-stable across turns) and sent
as raw content with ``client.post(..., cast_to=httpx.Response, stream=True)``, and the SSE stream
is parsed by hotloop (SseDecoder + msgspec) instead of the SDK's pydantic chunk models. Measured
against a local mock: ~2 us per chunk instead of ~10 us, and no per-request transform of the
whole message history (see the README).

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
from hotloop.backends.chat import CEREBRAS, ChatBackend, http_timeout, quiet_http_logs, status_error
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
        super().__init__(model=config.model or DEFAULT_MODEL, retries=config.backend_retries)
        # hotloop's own settings win over the SDK's environment variables.
        self._api_key = config.backend_api_key or os.environ.get("CEREBRAS_API_KEY")
        self._base_url = sdk_base_url(config.base_url or os.environ.get("CEREBRAS_BASE_URL"))
        self._timeout = http_timeout(config.backend_timeout, config.backend_idle_timeout)
        self._client: AsyncCerebras | None = None

    async def start(self) -> None:
        if not self._api_key:
            raise RuntimeError(
                "The cerebras backend needs an API key: set CEREBRAS_API_KEY (or HOTLOOP_BACKEND_API_KEY)."
            )
        quiet_http_logs()
        self._client = AsyncCerebras(
            api_key=self._api_key,
            base_url=self._base_url,
            timeout=self._timeout,
            max_retries=0,
            warm_tcp_connection=False,
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _require_client(self) -> AsyncCerebras:
        if self._client is None:
            raise errors.BackendUnavailable("The model backend is not started.")
        return self._client

    async def _open(self, body: bytes, model: str) -> httpx.Response:
        client = self._require_client()
        try:
            return await client.post(
                CHAT_PATH,
                cast_to=httpx.Response,
                content=body,
                options={"headers": _STREAM_HEADERS},
                stream=True,
            )
        except APIStatusError as exc:
            raise self._status_error(exc, model) from None
        except APITimeoutError:
            raise errors.BackendTimeout("The model backend did not answer in time.") from None
        except APIConnectionError:
            log.warning("cerebras backend: connection failed")
            raise errors.BackendUnavailable("Could not connect to the model backend.") from None

    async def _get_models(self) -> bytes:
        client = self._require_client()
        try:
            resp = await client.get(MODELS_PATH, cast_to=httpx.Response)
        except APIStatusError as exc:
            raise self._status_error(exc, self.default_model) from None
        except APIConnectionError:  # includes APITimeoutError
            raise errors.BackendUnavailable("Could not connect to the model backend.") from None
        return resp.content

    def _status_error(self, exc: APIStatusError, model: str) -> errors.HotloopError:
        return status_error(exc.status_code, exc.response.headers, exc.body, backend=self.name, model=model)
