"""uvicorn's h11 protocol with two guards for what happens before a request reaches the app.

- **Header deadline.** uvicorn waits forever for a request's headers once any byte arrived (its keep-alive timer
  only covers silence between requests), so a few hundred sockets that each send half a request line hold every
  connection slot ("slowloris"). Here a connection must deliver complete headers within `HEADER_TIMEOUT` seconds of
  opening, and of the first byte of each later request; otherwise it is closed.
- **Malformed HTTP** is answered as the app answers every error: an OpenAI-shaped JSON 400 with an `X-Request-Id`
  (uvicorn would send plain text), then the connection is closed, as HTTP requires after a parse error.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: Seconds a client has to send a request's complete headers (a real client sends them in one write).
HEADER_TIMEOUT = 10.0


class GuardedH11Protocol(H11Protocol):
    """`H11Protocol` with the module docstring's header deadline and JSON 400. Pass it as uvicorn's `http`."""

    header_timeout = HEADER_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers():
            self._arm_header_timer()
        super().data_received(data)
        if not self._awaiting_headers():
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_late(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        rid = f"req-{uuid.uuid4().hex}"
        body = json.dumps({"error": {"message": f"malformed HTTP request: {msg}", "type": "invalid_request_error",
                                     "param": None, "code": "invalid_http"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), (b"x-request-id", rid.encode())]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            try:
                self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # h11 refuses to answer in its state: just close
                break
        self.transport.close()
