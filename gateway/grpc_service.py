"""The gateway's gRPC `Generate`: the same validation, templating, stop strings and detokenization as REST."""

from __future__ import annotations

import grpc

import dataclasses
import uuid

from gateway.clients import Backends
from gateway.completions import run_choices
from gateway.errors import ApiError
from gateway.generate import GenParams
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2

_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT}


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate over the shared Backends."""

    def __init__(self, backends: Backends):
        self.backends = backends

    async def _prompt(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        b = self.backends
        kind = request.WhichOneof("input")
        if kind == "text":
            reply = await b.call("tokenizer service", b.tokenizer.Encode(
                tokenizer_pb2.EncodeRequest(text=request.text, add_bos=True, parse_special=True)))
            return list(reply.token_ids)
        if kind == "chat":
            reply = await b.call("tokenizer service", b.tokenizer.ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(
                messages=request.chat.messages, add_generation_prompt=True, tools_json=request.chat.tools_json,
                template_kwargs_json=request.chat.template_kwargs_json)))
            return list(reply.token_ids)
        if kind == "tokens":
            ids = list(request.tokens.token_ids)
            vocab = b.ready_facts().vocab_size
            if not ids or any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, f"token ids must be non-empty and in [0, {vocab})")
            return ids
        raise ApiError(400, "one of text, chat or tokens is required")

    def _params(self, request: gateway_pb2.GenerateRequest) -> GenParams:
        if request.max_tokens < 0:
            raise ApiError(400, f"max_tokens must be >= 0, got {request.max_tokens}")
        if len(request.stop) > 4 or any(not s for s in request.stop):
            raise ApiError(400, "at most 4 non-empty stop strings are allowed")
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.logprobs = True
        return GenParams(
            sampling=sampling,
            max_tokens=request.max_tokens or None,
            stop=list(request.stop),
            stop_token_ids=list(request.stop_token_ids),
            skip_special_tokens=not request.include_special_tokens,
            allowed_token_ids=list(request.allowed_token_ids) or None,
        )

    def _jobs(self, request, prompt: list[int]) -> list:
        """(index, prompt, params, request id) per choice; choices 1.. share choice 0's prompt KV."""
        n = request.n or 1
        if not 1 <= n <= 16:
            raise ApiError(400, f"n must be in [1, 16], got {n}")
        base = self._params(request)
        rid0 = request.request_id or f"gen-{uuid.uuid4().hex}"
        jobs = []
        for j in range(n):
            sampling = common_pb2.SamplingParams()
            sampling.CopyFrom(base.sampling)
            if j and sampling.HasField("seed"):
                sampling.seed = (sampling.seed + j) & 0xFFFFFFFFFFFFFFFF
            params = dataclasses.replace(base, sampling=sampling, share_prompt_with=rid0 if j else None)
            jobs.append((j, prompt, params, rid0 if j == 0 else f"{rid0}-{j}"))
        return jobs

    async def Generate(self, request, context):
        try:
            prompt = await self._prompt(request)
            async for index, delta in run_choices(self.backends, self._jobs(request, prompt)):
                reply = gateway_pb2.GenerateResponse(text=delta.text, tokens=delta.tokens, index=index)
                if delta.finish_reason:
                    reply.finish_reason = _FINISH[delta.finish_reason]
                    reply.usage.CopyFrom(delta.usage)
                yield reply
        except ApiError as err:
            await context.abort(err.grpc_code(), err.message)
