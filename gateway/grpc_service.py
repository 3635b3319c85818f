"""The gateway's gRPC `Generate`: the same validation, templating, stop strings, detokenization, constraints
(response_format, tools) and output routing (reasoning, tool calls) as REST."""

from __future__ import annotations

import dataclasses
import json
import types
import uuid

from gateway.chat_output import ChatRoute
from gateway.chat_plan import ChatPlan, constraint_factory, plan_chat
from gateway.clients import Backends
from gateway.completions import run_choices
from gateway.errors import ApiError
from gateway.generate import GenParams
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2

_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT, "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS}


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate over the shared Backends."""

    def __init__(self, backends: Backends):
        self.backends = backends

    async def _prompt(self, request: gateway_pb2.GenerateRequest, template_kwargs: dict) -> list[int]:
        b = self.backends
        kind = request.WhichOneof("input")
        if kind == "text":
            reply = await b.call("tokenizer service", b.tokenizer.Encode(
                tokenizer_pb2.EncodeRequest(text=request.text, add_bos=True, parse_special=True)))
            return list(reply.token_ids)
        if kind == "chat":
            reply = await b.call("tokenizer service", b.tokenizer.ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(
                messages=request.chat.messages, add_generation_prompt=True, tools_json=request.chat.tools_json,
                template_kwargs_json=json.dumps(template_kwargs) if template_kwargs else "")))
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

    def _plan(self, request: gateway_pb2.GenerateRequest) -> ChatPlan:
        """The chat plan (response_format, tools, thinking) of a request; text and token inputs get only
        response_format.

        Raises:
          ApiError: 400 for malformed JSON fields or what plan_chat refuses.
        """
        chat = request.chat if request.WhichOneof("input") == "chat" else gateway_pb2.ChatInput()
        fields = types.SimpleNamespace(
            response_format=_json(request.response_format_json, "response_format_json"),
            tools=_json(chat.tools_json, "chat.tools_json"),
            tool_choice=_json(chat.tool_choice_json, "chat.tool_choice_json"),
            parallel_tool_calls=not chat.no_parallel_tool_calls,
            chat_template_kwargs=_json(chat.template_kwargs_json, "chat.template_kwargs_json"),
            reasoning_effort=chat.reasoning_effort or None,
        )
        if fields.tools is not None and not isinstance(fields.tools, list):
            raise ApiError(400, "chat.tools_json must be a JSON array", param="chat.tools_json")
        if fields.chat_template_kwargs is not None and not isinstance(fields.chat_template_kwargs, dict):
            raise ApiError(400, "chat.template_kwargs_json must be a JSON object", param="chat.template_kwargs_json")
        plan = plan_chat(fields, self.backends.ready_facts())
        if request.WhichOneof("input") != "chat":
            plan.channels = False  # raw prompts: text as generated
        return plan

    async def Generate(self, request, context):
        try:
            plan = self._plan(request)
            prompt = await self._prompt(request, plan.template_kwargs)
            jobs = self._jobs(request, prompt)
            factory = await constraint_factory(self.backends, plan)
            facts = self.backends.ready_facts()
            rid = jobs[0][3]
            routes = []
            for index, _, params, _ in jobs:
                params.constraint = factory() if factory is not None else None
                params.stop_token_ids = sorted(set(params.stop_token_ids) | set(plan.request_stop_ids(facts)))
                for tid in plan.banned_ids:
                    params.sampling.logit_bias[tid] = -100.0
                routes.append(plan.route(facts, params.stop, f"call_{rid[-12:]}_{index}_"))
            async for index, delta in run_choices(self.backends, jobs):
                yield _reply(routes[index], index, delta)
        except ApiError as err:
            await context.abort(err.grpc_code(), err.message)


def _reply(route: ChatRoute, index: int, delta) -> gateway_pb2.GenerateResponse:
    """One GenerateResponse from a Delta routed like the REST chat deltas (text = content)."""
    reply = gateway_pb2.GenerateResponse(tokens=delta.tokens, index=index)
    if not route.tokens_path:
        reply.text = delta.text
    out = route.feed(delta) + (route.finish() if delta.finish_reason else [])
    for d in out:
        reply.text += d.get("content", "") if route.tokens_path else ""
        reply.reasoning_text += d.get("reasoning_content", "")
        for call in d.get("tool_calls", []):
            fn = call.get("function", {})
            reply.tool_calls.append(gateway_pb2.ToolCallDelta(index=call["index"], id=call.get("id", ""),
                                                              name=fn.get("name", ""),
                                                              arguments=fn.get("arguments", "")))
    if delta.finish_reason:
        reply.finish_reason = _FINISH[route.finish_reason(delta.finish_reason)]
        reply.usage.CopyFrom(delta.usage)
    return reply


def _json(text: str, param: str):
    """Parse an optional JSON text field (empty -> None).

    Raises:
      ApiError: 400 naming the field when it is not valid JSON.
    """
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ApiError(400, f"{param} is not valid JSON: {err}", param=param) from None
