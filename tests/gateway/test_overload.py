"""A full worker queue (gRPC RESOURCE_EXHAUSTED) reaches REST clients as 429 with Retry-After."""

from __future__ import annotations

import grpc
from fastapi.testclient import TestClient

from gateway.api.app import create_app
from gateway.backends.clients import Backends
from gateway.backends.model_facts import ModelFacts
from gateway.core.errors import from_rpc_error
from tests.e2e.stacks import free_ports


def test_resource_exhausted_is_429_with_retry_after():
    tok, worker = free_ports(2)
    backends = Backends(f"127.0.0.1:{tok}", f"127.0.0.1:{worker}")
    backends.facts = ModelFacts(name="m", max_model_len=100, vocab_size=10, token_bytes=[b"a"] * 10,
                                special_ids=set(), bos_id=2, stop_ids=[1], architecture="gemma3")

    async def refuse(backend, call):
        if hasattr(call, "cancel"):
            call.cancel()
        elif hasattr(call, "close"):  # a coroutine wrapping the worker's call: closed, as it is never awaited
            call.close()
        err = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="queue full: 64 requests are already waiting")
        raise from_rpc_error(err, backend)

    backends.call = refuse
    with TestClient(create_app(backends)) as client:
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and "queue full" in err["message"]
