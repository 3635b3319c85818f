"""OpenAI-shaped errors and the one mapping from backend gRPC status codes to HTTP statuses."""

from __future__ import annotations

import grpc

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
    404: "not_found_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
    504: "timeout",
}
_GRPC_OF_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


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


def from_rpc_error(err: grpc.aio.AioRpcError, backend: str) -> ApiError:
    """Translate a backend's gRPC error. Unavailable backends become 503 naming the backend."""
    code = err.code()
    status = _HTTP_OF_GRPC.get(code, 500)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, f"the {backend} is unavailable: {err.details()}", code="backend_unavailable")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, f"the server is overloaded: {err.details()}; retry shortly", code="overloaded",
                        headers={"Retry-After": "1"})
    if status == 500:
        return ApiError(500, f"the {backend} failed: {err.details()}", code="backend_error")
    return ApiError(status, err.details() or code.name)
