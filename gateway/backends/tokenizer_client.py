"""The tokenizer service's connection: its channel, made on first use inside the running event loop (grpc.aio
binds a channel to it), its stub and its health check. Owned by `Backends` (clients.py); the model facts are
fetched through it (model_facts.py)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.network import InternalTls, aio_channel
from protos import tokenizer_pb2_grpc


class TokenizerClient:
    """One channel to the tokenizer service, opened lazily."""

    def __init__(self, addr: str, tls: InternalTls | None, interceptors: list):
        """Args: addr: host:port (or unix:path) of the tokenizer service; tls: mutual TLS (None: plain text);
        interceptors: the channel's client interceptors (the default deadline of every call)."""
        self.addr, self.tls, self.interceptors = addr, tls, interceptors
        self._channel: grpc.aio.Channel | None = None
        self._stub: tokenizer_pb2_grpc.TokenizerStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    def _connect(self) -> None:
        """Create the channel and its stubs on first use, inside the running event loop."""
        if self._channel is None:
            self._channel = aio_channel(self.addr, self.tls, interceptors=self.interceptors)
            self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def stub(self) -> tokenizer_pb2_grpc.TokenizerStub:
        """The tokenizer service's stub (the channel opened on first use)."""
        self._connect()
        return self._stub

    async def health(self, timeout: float) -> str:
        """The service's health status name ("SERVING", "NOT_SERVING"), or "UNREACHABLE" when the check fails
        within `timeout` seconds."""
        self._connect()
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError:
            return "UNREACHABLE"

    async def close(self) -> None:
        """Close the channel, if it was opened."""
        if self._channel is not None:
            await self._channel.close()
