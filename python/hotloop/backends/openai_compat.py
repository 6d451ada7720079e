"""OpenAI-compatible chat-completions servers (vLLM, SGLang, llama.cpp, Ollama, ...).

``--base-url`` *includes* the API prefix, as with OpenAI clients: ``http://localhost:8000/v1``
(vLLM), ``http://localhost:11434/v1`` (Ollama); hotloop appends ``/chat/completions`` and
``/models``. The streaming ``POST`` goes over the ``lean`` transport
(:mod:`hotloop.backends.chat.http1`) by default, or over the process's one ``httpx.AsyncClient``
with ``--backend-transport sdk`` (or when a proxy is configured for the server); model listing
always uses httpx. The API key is ``--backend-api-key``/``HOTLOOP_BACKEND_API_KEY``, else
``OPENAI_API_KEY``; without one no ``Authorization`` header is sent (local servers rarely need it).

The mapping and the stream parsing are shared with the Cerebras backend
(:mod:`hotloop.backends.chat`, dialect ``OPENAI_COMPAT``).

Every request asks for the usage chunk (``stream_options: {"include_usage": true}``). A server
that rejects that field (Azure OpenAI's 400 "Unrecognized request argument supplied:
stream_options", Mistral's 422 ``extra_forbidden``, Groq's and Databricks' 400s) is asked again
at once without it; once that is answered, the field is not sent again for that model. The client
never sees a 400 for a field it did not send; those answers carry no usage chunk.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import httpx

from hotloop import __version__, errors
from hotloop.backends.chat import OPENAI_COMPAT, Body, ChatBackend, status_error
from hotloop.backends.chat.http1 import PROXY_ENV_PROBLEM, lean_pool, post_chat_stream, redact_url, url_problem
from hotloop.backends.chat.httpx_body import HttpxBody, http_timeout, quiet_http_logs, read_error_body, read_models_body
from hotloop.backends.chat.statuses import transport_failure, withhold
from hotloop.config import Config

log = logging.getLogger("hotloop.backends")

_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)
_POST_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
# How every rendered body ends (render() writes stream_options last, msgspec writes no spaces).
_STREAM_OPTIONS_TAIL = b',"stream_options":{"include_usage":true}}'
# models a server rejected stream_options for, at most this many (a LiteLLM proxy may route
# models to servers that differ in this)
_MAX_BARE_MODELS = 1024


def _without_stream_options(body: list[bytes]) -> list[bytes] | None:
    """``body`` without its ``stream_options``; None when it has none."""
    if not body or not body[-1].endswith(_STREAM_OPTIONS_TAIL):
        return None
    return [*body[:-1], body[-1][: -len(_STREAM_OPTIONS_TAIL)] + b"}"]


def _rejects_stream_options(status: int, payload: object) -> bool:
    """Whether a non-2xx answer is a server refusing the ``stream_options`` field itself."""
    if status not in (400, 422):
        return False
    text = payload if isinstance(payload, str) else repr(payload)
    return "stream_options" in text or "include_usage" in text


class OpenAICompatBackend(ChatBackend):
    name = "openai-compat"
    dialect = OPENAI_COMPAT
    owned_by = "openai-compat"

    def __init__(self, config: Config) -> None:
        super().__init__(model=config.model or "", retries=config.backend_retries, think_tags=config.think_tags)
        self._base_url = config.base_url
        self._api_key = config.backend_api_key or os.environ.get("OPENAI_API_KEY")
        self._timeout = http_timeout(config.backend_timeout, config.backend_idle_timeout)
        self._config = config
        self._client: httpx.AsyncClient | None = None
        # models whose server rejected stream_options: their requests are sent without it
        self._bare: set[str] = set()

    def missing(self) -> str | None:
        """What this backend needs and was not given (said at start-up, before serving)."""
        if not self._base_url:
            return (
                "The openai-compat backend needs --base-url (or HOTLOOP_BASE_URL), including the "
                "API prefix, e.g. http://localhost:8000/v1."
            )
        problem = url_problem(self._base_url)  # said once, before the server starts
        return None if problem is None else f"--base-url (HOTLOOP_BASE_URL) is {problem}"

    async def start(self) -> None:
        why = self.missing()
        if why is not None or not self._base_url:
            raise RuntimeError(why)
        withhold(self._api_key)  # never repeated from a backend's error message
        quiet_http_logs()
        headers = {"User-Agent": f"hotloop/{__version__}"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        try:
            self._client = httpx.AsyncClient(
                # A trailing slash makes relative paths extend the prefix instead of replacing it.
                base_url=self._base_url.rstrip("/") + "/",
                headers=headers,
                timeout=self._timeout,
                limits=_LIMITS,
            )
        except httpx.InvalidURL:  # (its message may quote a piece of a password)
            # the base URL passed url_problem (missing): what httpx refused is in the environment
            raise ValueError(PROXY_ENV_PROBLEM) from None
        if self._config.backend_transport == "lean":
            lean_headers = {**headers, **_POST_HEADERS}
            self._pool = lean_pool(self._base_url, lean_headers, self._config, self.name)
        log.info("openai-compat backend: %s transport to %s", self.transport, redact_url(self._base_url))
        # The model list also carries each model's context window (vLLM: max_model_len).
        models = await self.list_models()
        if not self.default_model:
            # No --model: offer the server's first model (list_models falls back to it).
            if models:
                self.default_model = str(models[0]["id"])
                log.info("openai-compat backend: default model %s", self.default_model)

    async def close(self) -> None:
        await self._close_pool()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _require_client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise errors.BackendUnavailable("The model backend is not started.")
        return self._client

    async def _send(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._require_client().send(request, stream=True)
        except httpx.HTTPError as exc:
            # typed as the lean transport types the same failure (a connect timeout is not a
            # backend slow to answer; a connection closed before the answer is not one refused)
            if not isinstance(exc, httpx.TimeoutException):
                log.warning("openai-compat backend: request to %s failed (%s)", redact_url(str(request.url)), type(exc).__name__)
            raise transport_failure(exc) from None

    async def _open(self, body: list[bytes], model: str, request_id: str | None = None) -> Body:
        bare = _without_stream_options(body) if model in self._bare else None
        status, headers, payload, resp = await self._post(bare or body, request_id)
        if resp is None and bare is None and _rejects_stream_options(status, payload):
            bare = _without_stream_options(body)
            if bare is not None:
                # the server refuses the usage chunk's option, not the client's request: ask
                # again without it, and if that is answered, from now on for this model (a
                # validation error that only quotes the body, as FastAPI's do, changes nothing)
                status, headers, payload, resp = await self._post(bare, request_id)
                if resp is not None and len(self._bare) < _MAX_BARE_MODELS:
                    log.info("openai-compat backend: the server rejects stream_options for %s; sending none", model)
                    self._bare.add(model)
        if resp is None:
            raise status_error(status, headers, payload, backend=self.name, model=model)
        return resp

    async def _post(self, body: list[bytes], request_id: str | None) -> tuple[int, Any, object, Body | None]:
        """Send one streaming POST: ``(0, None, None, body)`` for a 2xx, else ``(status, headers,
        error body, None)``. A redirect (never followed: the request goes nowhere else) is an
        error, as its body is not a stream."""
        if self._pool is not None:
            lean, payload = await post_chat_stream(self._pool, "/chat/completions", body, request_id)
            if lean.status >= 300:
                return lean.status, lean.headers, payload, None
            return 0, None, None, lean
        client = self._require_client()
        headers = {**_POST_HEADERS, "x-request-id": request_id} if request_id else _POST_HEADERS
        resp = await self._send(client.build_request("POST", "chat/completions", content=b"".join(body), headers=headers))
        if resp.status_code >= 300:
            return resp.status_code, resp.headers, await read_error_body(resp), None
        return 0, None, None, HttpxBody(resp, self.name)

    async def _get_models(self) -> bytes:
        client = self._require_client()
        resp = await self._send(client.build_request("GET", "models"))
        if resp.status_code >= 400:
            payload = await read_error_body(resp)
            raise status_error(resp.status_code, resp.headers, payload, backend=self.name, model=self.default_model)
        return await read_models_body(resp, self.name)
