"""Deadlines on backend calls (gateway/backends/clients.py `Timeouts`): a tokenizer service or model worker that never
answers costs a request a 504 after the deadline, not a hang; real gRPC servers here stall on purpose."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.backends.clients import Backends, Timeouts
from gateway.backends.model_facts import ModelFacts
from gateway.core.errors import ApiError
from gateway.generation.generate import GenParams, generate
from protos import common_pb2, model_worker_pb2, model_worker_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from tests.transport import grpc_listen


class _StalledTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    async def Encode(self, request, context):
        await asyncio.sleep(30)


class _StalledWorker(model_worker_pb2_grpc.ModelWorkerServicer):
    """Prefill answers at once for request "quick", never for others; Decode streams never send."""

    async def Prefill(self, request, context):
        if request.request_id != "quick":
            await asyncio.sleep(30)
        return model_worker_pb2.PrefillResponse(first_token=common_pb2.GeneratedToken(token_id=5),
                                                usage=common_pb2.Usage(prompt_tokens=1))

    async def Decode(self, request_iterator, context):
        await asyncio.sleep(30)
        yield model_worker_pb2.DecodeResponse()

    async def Abort(self, request, context):
        return model_worker_pb2.AbortResponse()


async def _serve():
    server = grpc.aio.server()
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(_StalledTokenizer(), server)
    tokenizer_addr = grpc_listen(server, name="tokenizer")  # a loopback port, or a unix socket without TCP
    server2 = grpc.aio.server()
    model_worker_pb2_grpc.add_ModelWorkerServicer_to_server(_StalledWorker(), server2)
    worker_addr = grpc_listen(server2, name="worker")
    await server.start()
    await server2.start()
    backends = Backends(tokenizer_addr, worker_addr, timeouts=Timeouts(tokenizer=0.5, worker=0.5))
    backends.facts = ModelFacts(name="m", max_model_len=100, vocab_size=10, token_bytes=[b"a"] * 10,
                                special_ids=set(), bos_id=2, stop_ids=[1], architecture="gemma3")
    return backends, (server, server2)


async def _timed(coro) -> tuple[ApiError, float]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ApiError) as err:
        await coro
    return err.value, loop.time() - t0


def test_stalled_backends_cost_a_504_at_the_deadline():
    async def main():
        backends, servers = await _serve()
        try:
            encode = backends.call("tokenizer service", backends.tokenizer.Encode(tokenizer_pb2.EncodeRequest(text="x")))
            err, took = await _timed(encode)
            assert err.status == 504 and err.code == "backend_timeout" and "tokenizer service" in err.message
            assert 0.4 < took < 5

            async def run(rid):
                async for _ in generate(backends, [1, 2], GenParams(sampling=common_pb2.SamplingParams(), max_tokens=4), request_id=rid):
                    pass

            for rid in ("slow", "quick"):  # Prefill never answers; then the Decode stream stays silent
                err, took = await _timed(run(rid))
                assert err.status == 504 and err.code == "backend_timeout", (rid, err.message)
                assert 0.4 < took < 5
        finally:
            await backends.close()
            for s in servers:
                await s.stop(0)

    asyncio.run(main())
