"""The ASGI middleware in front of every REST endpoint: what must hold for any request, whatever its endpoint.

- **Request id.** Every response carries `X-Request-Id`: the client's own when it sent a well-formed one (at most
  128 characters of `[A-Za-z0-9._:-]`), else a new one; logs of that request name it.
- **API keys.** With keys set (gateway/api/auth.py), every `/v1/...` request needs one (401 before its body is read);
  the request's tenant goes to the endpoints as `request.state.tenant`.
- **Drain.** While the gateway drains (gateway/backends/admission.py) a `/v1` request gets a 503; admitted ones are
  counted until their response ends.
- **Connections.** Beyond `Limits.max_connections` open connections a request gets an OpenAI-shaped 503 with
  `Connection: close` (uvicorn's own limit, kept far above as a backstop, would answer plain text).
- **Body.** At most `Limits.max_body_bytes`, counted on the bytes as they stream in, so a chunked body without a
  Content-Length cannot bypass it (413), and in time: a body that stalls for `BODY_IDLE_TIMEOUT` seconds or takes
  longer than `BODY_TIMEOUT` in all is a 408 (a client cannot hold a connection by dripping bytes). A non-empty body
  must be JSON that `limits.parse_json` accepts (400): UTF-8, no NaN, no overflowing number, nesting and surrogates
  checked, before any endpoint parses it.
- **Errors.** An exception escaping an endpoint is our bug: it is logged with the request id and answered with a
  generic OpenAI-shaped 500 (an SSE error event when a stream had started) and the connection stays usable —
  nothing is re-raised to the server, which would close the connection.
- **Metrics.** Requests are counted by path template (`/v1/chat/completions`, also when refused before matching;
  `unmatched` for unknown paths), so junk URLs add no time series.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from gateway.api.auth import ApiKeys
from gateway.backends.admission import Admission
from gateway.core.errors import ApiError, error_body, is_anthropic_path
from gateway.core.limits import JsonError, Limits, parse_json

log = logging.getLogger("gemma_serve.gateway")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_BODY_METHODS = {"POST", "PUT", "PATCH"}
#: Seconds a request body may stall between two chunks, and take in all (4 MiB at ~1 Mbit/s takes ~35 s).
BODY_IDLE_TIMEOUT, BODY_TIMEOUT = 10.0, 60.0


def _header(scope, name: bytes) -> str | None:
    """The first value of header `name` (lower case), or None."""
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id when well-formed, else a new `req-<hex>` id."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            text = value.decode("latin-1")
            if _REQUEST_ID.fullmatch(text):
                return text
    return f"req-{uuid.uuid4().hex}"


class RequestGuard:
    """ASGI middleware applying the module docstring's rules around an app."""

    def __init__(self, app, limits: Limits, open_connections: Callable[[], int] | None = None,
                 count: Callable[[str, int], None] | None = None, keys: ApiKeys | None = None,
                 paths: frozenset[str] = frozenset(), admission: Admission | None = None):
        """
        Args:
          app: the ASGI app (the FastAPI endpoints).
          limits: the gateway's limits.
          open_connections: the server's open connection count (None: not enforced).
          count: called with (path template, status) once per answered request, or None.
          keys: the accepted API keys (None or empty: the API is open).
          paths: the app's endpoint paths (a request refused before matching is still counted under its path).
          admission: the drain state; `/v1` requests are admitted and counted through it (None: always admitted).
        """
        self.app, self.limits = app, limits
        self.admission = admission or Admission()
        self.paths = paths
        self.keys = keys or ApiKeys()
        self.open_connections = open_connections
        self.count = count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = request_id_of(scope.get("headers", []))
        state = scope.setdefault("state", {})
        state["request_id"], state["tenant"] = rid, ""
        path = scope.get("path", "")
        response = _Response(send, rid, path)
        started = time.monotonic()
        api = path == "/v1" or path.startswith("/v1/")
        try:
            if self.keys and api:
                state["tenant"] = self.keys.tenant(_credentials(scope))
            if self.open_connections is not None and self.open_connections() > self.limits.max_connections:
                raise ApiError(503, f"the server has more than {self.limits.max_connections} open connections; "
                                    f"retry shortly", code="too_many_connections",
                               headers={"Retry-After": "1", "Connection": "close"})
            with self.admission.serving() if api else contextlib.nullcontext():
                if scope["method"] in _BODY_METHODS:
                    receive = await self._checked_body(scope, receive)
                await self.app(scope, receive, response.send)
        except ApiError as err:
            await response.error(err)
        except asyncio.CancelledError:
            if not self.admission.cutting:
                raise  # the server or the client ended it
            await response.error(ApiError(503, "the server shut down before this request finished; retry",
                                          code="shutting_down", headers={"Connection": "close"}))
        except Exception:
            log.exception("request %s (%s %s) failed", rid, scope["method"], scope.get("path"))
            await response.error(ApiError(500, f"internal server error (request id {rid})", code="internal_error"))
        if self.count is not None and response.status is not None:
            template = getattr(scope.get("route"), "path", None)  # Starlette's matched route
            self.count(template or (path if path in self.paths else "unmatched"), response.status)
        if api or path in ("/tokenize", "/detokenize"):  # one access line per API request (not probes)
            log.info("%s %s %s %.3f s (request %s)", scope["method"], path[:200], response.status,
                     time.monotonic() - started, rid)

    async def _checked_body(self, scope, receive):
        """Read the whole body under the size limit and check its JSON; returns a receive that replays it.

        Raises:
          ApiError: 413 over the limit, 408 for a body that stalls or is too slow, 400 for a body that is not
            acceptable JSON.
        """
        limit = self.limits.max_body_bytes
        for name, value in scope.get("headers", []):
            if name.lower() == b"content-length" and value.isdigit() and int(value) > limit:
                raise _too_large(limit)
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BODY_TIMEOUT
        while True:
            try:
                message = await asyncio.wait_for(receive(), min(BODY_IDLE_TIMEOUT, deadline - loop.time()))
            except TimeoutError:
                raise ApiError(408, "the request body did not arrive in time", code="request_timeout",
                               headers={"Connection": "close"}) from None
            if message["type"] == "http.disconnect":
                raise ApiError(499, "client disconnected", code="cancelled")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body.strip():
            try:
                parse_json(body)
            except JsonError as err:
                raise ApiError(400, f"the request body is not acceptable JSON: {err}", param=err.param,
                               code="invalid_json") from None
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay


def _credentials(scope) -> str | None:
    """The request's `Authorization` value, or its `x-api-key` (Anthropic's header) as a Bearer credential."""
    authorization = _header(scope, b"authorization")
    if authorization:
        return authorization
    key = _header(scope, b"x-api-key")
    return f"Bearer {key}" if key else None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large",
                    headers={"Connection": "close"})


class _Response:
    """Tracks one response on its way out: adds X-Request-Id, remembers status and content type, and can still
    answer an error (a JSON body before the response started, an SSE error event after a stream started)."""

    def __init__(self, send, rid: str, path: str = ""):
        self._send, self.rid, self.path = send, rid, path
        self.status: int | None = None
        self.streaming = False
        self.ended = False

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
            self.streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                 for k, v in headers)
            message = {**message, "headers": headers + [(b"x-request-id", self.rid.encode())]}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)

    async def error(self, err: ApiError) -> None:
        """Answer `err` if the response has not started; end a started stream with an error event."""
        if self.status is None:
            body = json.dumps(error_body(err, self.path)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
            await self.send({"type": "http.response.start", "status": err.status, "headers": headers})
            await self.send({"type": "http.response.body", "body": body, "more_body": False})
        elif not self.ended:
            if is_anthropic_path(self.path):
                tail = f"event: error\ndata: {json.dumps(error_body(err, self.path))}\n\n".encode()
            else:
                tail = f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
            tail = tail if self.streaming else b""
            await self.send({"type": "http.response.body", "body": tail, "more_body": False})
