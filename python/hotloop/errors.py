"""The typed error tree.

Every error a client can see is one of these classes. Each carries its wire meaning (HTTP status,
OpenAI error ``type``, ``code`` and ``param``) and a message written for clients. Internal
exceptions never cross the wire: the server catches anything else and answers with a generic
:class:`ServerError` whose message says nothing about the cause (the cause goes to the log).

Rendering to the three wire shapes (HTTP JSON body, SSE ``error`` event, WebSocket error frame)
lives in :mod:`hotloop.protocol.events`.
"""

from __future__ import annotations

import math
from typing import Any

MAX_ECHO = 100  # characters of a client's own input that an error message repeats


def clip(text: str, limit: int = MAX_ECHO) -> str:
    """Client input as an error message may repeat it: at most ``limit`` characters, then "..."."""
    return text if len(text) <= limit else text[:limit] + "..."


class HotloopError(Exception):
    """Base of every client-visible error."""

    status: int = 500
    counted = False  # a failed response's error, already counted by the metrics (Metrics.turn)
    type: str = "server_error"
    code: str | None = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = headers or {}

    def body(self) -> dict[str, Any]:
        """The ``error`` object of the OpenAI error shape."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}


# --- 4xx: the client's request is at fault -------------------------------------------------------


class InvalidRequest(HotloopError):
    status = 400
    type = "invalid_request_error"
    code: str | None = None


class InvalidJSON(InvalidRequest):
    code = "invalid_json"


class BinaryFrame(InvalidRequest):
    """A binary WebSocket frame: the protocol's events are JSON text frames."""

    code = "unsupported_frame_type"


class UndecodableBody(InvalidRequest):
    """A request body that its ``Content-Encoding`` does not decode (corrupt, truncated)."""

    code = "invalid_encoding"


class UnsupportedEncoding(HotloopError):
    """A request body in a content coding the server does not decode (RFC 9110, 15.5.16)."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


class UnsupportedTransferCoding(HotloopError):
    """A request body in a transfer coding other than chunked (RFC 9112, 6.1: 501). Not to be
    retried (the SDKs retry a 5xx unless told not to)."""

    status = 501
    type = "invalid_request_error"
    code = "unsupported_transfer_encoding"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


class MissingParameter(InvalidRequest):
    code = "missing_required_parameter"


class InvalidType(InvalidRequest):
    code = "invalid_type"


class InvalidValue(InvalidRequest):
    code = "invalid_value"


class EmptyString(InvalidRequest):
    code = "empty_string"


class UnsupportedParameter(InvalidRequest):
    code = "unsupported_parameter"


class PreviousResponseNotFound(InvalidRequest):
    code = "previous_response_not_found"

    def __init__(self, response_id: str, message: str | None = None) -> None:
        super().__init__(
            message or f"Previous response with id '{clip(response_id)}' not found.", param="previous_response_id"
        )


class ItemNotFound(InvalidRequest):
    code = "item_not_found"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class ConnectionLimitReached(InvalidRequest):
    code = "websocket_connection_limit_reached"


class QueueFull(InvalidRequest):
    code = "websocket_queue_full"


class AuthenticationFailed(HotloopError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(HotloopError):
    """A valid key asking for what only the admin key may read (/metrics)."""

    status = 403
    type = "invalid_request_error"
    code: str | None = None


class NotFound(HotloopError):
    status = 404
    type = "invalid_request_error"
    code: str | None = None


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(HotloopError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(HotloopError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(HotloopError):
    """The request's head and body did not arrive within the read timeout."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def __init__(self, seconds: float) -> None:
        super().__init__(f"The request did not arrive within {seconds:g} seconds.")


def retry_headers(delay: float | None) -> dict[str, str]:
    """A delay as clients read it: ``retry-after`` (whole seconds, rounded up: RFC 9110's
    delta-seconds, which a fraction or ``1e+06`` is not) and ``retry-after-ms`` (the OpenAI SDKs
    read it first); none without one."""
    if delay is None or not 0 <= delay < float("inf"):
        return {}
    return {"retry-after": str(math.ceil(delay)), "retry-after-ms": str(math.ceil(delay * 1000))}


def retrieved(fut: Any) -> None:
    """A done callback: the outcome of a future nobody awaits (a call given up on, a failure
    nobody joined) is retrieved, so asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


class TooManyConnections(HotloopError):
    """A tenant's key holds as many WebSocket connections as one key may
    (``ws_max_connections_per_key``): a 429 at the handshake."""

    status = 429
    type = "rate_limit_exceeded"
    code = "websocket_connection_limit_reached"


class QuotaExhausted(HotloopError):
    """The model backend's quota for this server's account is used up (OpenAI's
    ``insufficient_quota``): retrying does not help until its operator acts, so the answer says
    ``x-should-retry: false`` (the SDKs retry a 429 otherwise) and carries OpenAI's type and code
    (Codex tells it apart from a rate limit by them)."""

    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"x-should-retry": "false"})


class RateLimited(HotloopError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        hdrs = {**retry_headers(retry_after), **(headers or {})}
        super().__init__(message, headers=hdrs)
        self.retry_after = retry_after


# --- 5xx: our side or the model's side is at fault -----------------------------------------------


class ServerError(HotloopError):
    """A generic failure. Its message never carries internal details."""

    status = 500
    type = "server_error"
    code = "server_error"

    def __init__(self, message: str = "The server had an error while processing your request.") -> None:
        super().__init__(message)


class ServerOverloaded(ServerError):
    """The server is at its connection limit."""

    status = 503
    code = "server_overloaded"


class ServerShuttingDown(ServerError):
    """A response still running when the server's shutdown grace ran out."""

    status = 503

    def __init__(self, message: str = "The server is shutting down; the response was stopped before it finished.") -> None:
        super().__init__(message)


class StoreUnavailable(ServerError):
    """The shared store (Redis) cannot be reached: 503, safe to retry."""

    status = 503

    def __init__(self, message: str = "The response store is unavailable. Please retry shortly.") -> None:
        super().__init__(message)


class BackendError(HotloopError):
    """The model backend failed (5xx, malformed stream, disconnect)."""

    status = 502
    type = "server_error"
    code = "server_error"


class BackendTimeout(BackendError):
    status = 504
    code = "server_error"


class BackendUnavailable(BackendError):
    status = 503
    code = "server_error"


class ModelError(HotloopError):
    """The model produced an unusable answer (a ``response.failed`` turn, not a transport error)."""

    status = 500
    type = "server_error"
    code = "server_error"
