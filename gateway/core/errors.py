"""OpenAI-shaped errors and the one mapping from backend gRPC status codes to HTTP statuses."""

from __future__ import annotations

import logging
import re

import grpc

log = logging.getLogger("gemma_serve.gateway")

_HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNIMPLEMENTED: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}
_TYPE_OF_HTTP = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
    504: "timeout",
}
_GRPC_OF_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                 404: grpc.StatusCode.NOT_FOUND,
                 413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 499: grpc.StatusCode.CANCELLED, 503: grpc.StatusCode.UNAVAILABLE,
                 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class ApiError(Exception):
    """An error returned to the client as {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": _TYPE_OF_HTTP.get(self.status, "internal_error" if self.status >= 500 else "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def grpc_code(self) -> grpc.StatusCode:
        """The gRPC status for the gateway's Generate API."""
        return _GRPC_OF_HTTP.get(self.status, grpc.StatusCode.INTERNAL if self.status >= 500 else grpc.StatusCode.INVALID_ARGUMENT)


class renamed_params:
    """A context manager re-raising ApiErrors with the request field renamed by `table` (chat field -> the field
    of the API the client called, e.g. `max_completion_tokens` -> `max_output_tokens`), in `param` and in the
    message, so a front door translated into a chat request still names the client's own fields."""

    def __init__(self, table: dict[str, str]):
        self.table = table

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if isinstance(err, ApiError) and err.param:
            head, _, rest = err.param.partition(".")
            new = self.table.get(head)
            if new is not None and new != head:
                err.param = new if head == "messages" else new + ("." + rest if rest else "")
                err.message = err.message.replace(head, new, 1)
        return False


#: Anthropic's error `type` per HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                   413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
                   503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_body(err: ApiError) -> dict:
    """The Anthropic Messages API error object: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ANTHROPIC_TYPE.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def is_anthropic_path(path: str) -> bool:
    """Whether errors on `path` take the Anthropic shape (the Messages API's endpoints)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(err: ApiError, path: str) -> dict:
    """The error object for a request to `path`: Anthropic's shape on the Messages API, OpenAI's elsewhere."""
    return anthropic_body(err) if is_anthropic_path(path) else err.body()


def from_rpc_error(err: grpc.aio.AioRpcError, backend: str) -> ApiError:
    """Translate a backend's gRPC error. Unavailable backends become 503 naming the backend; a full worker queue
    429 with Retry-After; a message over gRPC's size limit 413 (no retry can fix it); a backend's own failure a
    500 that does not quote it (it is logged here)."""
    code = err.code()
    status = _HTTP_OF_GRPC.get(code, 500)
    details = err.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        # A backend's own reason ("... failed and is restarting", "... shutting down") is passed on; gRPC's
        # transport details (addresses, ports, socket errors) are not: they are logged.
        if details.startswith(("the model worker", "the tokenizer")):
            return ApiError(503, f"the {backend} is unavailable: {details}", code="backend_unavailable")
        log.warning("the %s is unavailable: %s", backend, details)
        return ApiError(503, f"the {backend} is unavailable; retry shortly", code="backend_unavailable")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return ApiError(413, f"the request is too large for the {backend}", code="request_too_large")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry = _RETRY.search(details)  # a latency target out of reach says when to come back
        if retry:
            return ApiError(429, f"the server cannot serve this request in time: {details}", code="slo_unreachable",
                            headers={"Retry-After": retry.group(1)})
        return ApiError(429, f"the server is overloaded: {details}; retry shortly", code="overloaded",
                        headers={"Retry-After": "1"})
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, f"the {backend} did not answer within its deadline", code="backend_timeout")
    if status == 500:
        log.error("the %s failed: %s %s", backend, code.name, details)
        return ApiError(500, f"the {backend} failed", code="backend_error")
    return ApiError(status, details or code.name, param=_param_of(details) if status == 400 else None)


_RETRY = re.compile(r"retry after (\d{1,6}) s")
_FIELD = re.compile(r"^((?:messages|tools)(?:\[\d+\]|\.[a-z_]+)*)[:\s(]")


def _param_of(details: str) -> str | None:
    """The request field a backend's 400 names at its start (`messages[2].tool_calls[0]: ...`, the tokenizer
    service's style), as the OpenAI `param` (`messages.2.tool_calls.0`)."""
    match = _FIELD.match(details)
    return re.sub(r"\[(\d+)\]", r".\1", match.group(1)) if match else None
