"""The gateway's gRPC `Generate`: the request becomes the same pydantic request model the REST endpoints validate
(`request_model`), then goes through the same planner (gateway/planning/planner.py) — so every check and limit,
template, stop string, constraint (response_format, tools) and output split (reasoning, tool calls) is REST's by
construction. Errors are gRPC statuses: INVALID_ARGUMENT for what REST answers 400, NOT_FOUND, RESOURCE_EXHAUSTED
(the worker's queue, or a message over the size limit), UNAVAILABLE, DEADLINE_EXCEEDED, and INTERNAL with a generic
message (never internals) for our own bugs.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

import grpc
import pydantic

from gateway.api.auth import ApiKeys
from gateway.backends import workers
from gateway.backends.clients import Backends
from gateway.backends.workers import Session
from gateway.core.errors import ApiError
from gateway.core.limits import Limits, json_field
from gateway.core.openai_types import ChatCompletionRequest, CompletionRequest, error_param
from gateway.generation.choice_runner import ChoiceRunner
from gateway.generation.choices import run_choices
from gateway.planning.context import RequestContext
from gateway.planning.planner import plan_chat_completion, plan_completion
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger("gemma_serve.gateway")
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT, "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS}


def _sampling_fields(sp: common_pb2.SamplingParams) -> dict:
    """SamplingParams -> OpenAI fields (proto3 zeros mean "unset": top_p 0 or 1, top_k 0, repetition 0 -> 1)."""
    out: dict = {"temperature": sp.temperature}
    if sp.top_p not in (0.0, 1.0):
        out["top_p"] = sp.top_p
    for name in ("top_k", "min_p", "presence_penalty", "frequency_penalty"):
        if getattr(sp, name):
            out[name] = getattr(sp, name)
    if sp.repetition_penalty not in (0.0, 1.0):
        out["repetition_penalty"] = sp.repetition_penalty
    if sp.HasField("seed"):
        out["seed"] = sp.seed
    if sp.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    return out


def _message(m) -> dict:
    """A tokenizer ChatMessage proto -> the OpenAI message dict (its generated_token_ids are not a client's to
    set: exact history comes only from the gateway's own answer history)."""
    msg: dict = {"role": m.role}
    if m.HasField("content"):
        msg["content"] = m.content
    elif m.content_parts:
        msg["content"] = [{"type": p.type, "text": p.text} for p in m.content_parts]
    if m.name:
        msg["name"] = m.name
    if m.tool_call_id:
        msg["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        msg["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                           "arguments": c.arguments_json}}
                             for c in m.tool_calls]
    return msg


def request_model(request: gateway_pb2.GenerateRequest) -> CompletionRequest | ChatCompletionRequest:
    """The REST request model equivalent to a GenerateRequest (text and token inputs are completions, chat input
    a chat completion). Logprobs of the chosen tokens are always returned; `sampling.top_logprobs` asks for
    alternatives.

    Raises:
      ApiError: 400 for a missing input, JSON fields that are not acceptable JSON, or values the request models
        refuse (named as REST names them).
    """
    kind = request.WhichOneof("input")
    if kind is None:
        raise ApiError(400, "one of text, chat or tokens is required", param="input")
    body: dict = {
        **_sampling_fields(request.sampling),
        "n": request.n or 1,
        "stop": list(request.stop),
        "stop_token_ids": list(request.stop_token_ids),
        "skip_special_tokens": not request.include_special_tokens,
        "response_format": json_field(request.response_format_json, "response_format_json"),
    }
    limit = {"max_tokens": request.max_tokens or None}  # 0: "up to max_model_len" (REST's null)
    if request.allowed_token_ids:
        body["allowed_token_ids"] = list(request.allowed_token_ids)
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    if request.priority:
        body["priority"] = request.priority
    if request.prediction and kind != "chat":
        raise ApiError(400, "prediction is for chat input", param="prediction")
    if kind == "chat":
        if request.prediction:
            body["prediction"] = {"type": "content", "content": request.prediction}
        chat = request.chat
        body["messages"] = [_message(m) for m in chat.messages]
        body["tools"] = json_field(chat.tools_json, "chat.tools_json")
        body["tool_choice"] = json_field(chat.tool_choice_json, "chat.tool_choice_json")
        body["parallel_tool_calls"] = not chat.no_parallel_tool_calls
        body["chat_template_kwargs"] = json_field(chat.template_kwargs_json, "chat.template_kwargs_json")
        body["reasoning_effort"] = chat.reasoning_effort or None
        body["logprobs"] = True
        body["top_logprobs"] = request.sampling.top_logprobs
        return _validated(ChatCompletionRequest, body, limit)
    body["prompt"] = request.text if kind == "text" else list(request.tokens.token_ids)
    body["logprobs"] = request.sampling.top_logprobs
    return _validated(CompletionRequest, body, limit)


def _validated(model, body: dict, explicit: dict):
    """`model` validated from `body` without its None fields, plus the `explicit` fields even when None.

    Raises:
      ApiError: 400 naming the first invalid field.
    """
    try:
        return model.model_validate({**{k: v for k, v in body.items() if v is not None}, **explicit})
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        param = error_param(tuple(first.get("loc", ())))
        raise ApiError(400, f"{param or 'request'}: {first.get('msg', 'invalid value')}", param=param,
                       code="invalid_value") from None


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate over the shared Backends."""

    def __init__(self, backends: Backends, limits: Limits | None = None, keys: ApiKeys | None = None):
        """
        Args:
          keys: the API keys a call must carry as metadata `authorization: Bearer <key>` (None or empty: open).
        """
        self.backends = backends
        self.limits = limits or Limits()
        self.keys = keys or ApiKeys()

    async def Generate(self, request, context):
        rid = request.request_id or f"gen-{uuid.uuid4().hex}"
        try:
            tenant = self.keys.tenant(_metadata(context, "authorization"))
            if request is _UNDECODABLE:
                raise ApiError(400, "the request is not a valid GenerateRequest (invalid UTF-8 in a string field, or "
                                    "malformed bytes)")
            req = request_model(request)
            prefix = f"call_{rid[-12:]}_"
            session = _with_targets(Session.from_headers(lambda name: _metadata(context, name)), request)
            backends = self.backends.for_request()  # one ModelFacts snapshot for the whole request
            ctx = RequestContext(backends, self.limits, tenant, session, rid)
            with backends.admission.serving():
                if isinstance(req, ChatCompletionRequest):
                    plan = await plan_chat_completion(ctx, req, call_prefix=prefix)
                else:
                    plan = await plan_completion(ctx, req, call_prefix=prefix)
                # chat answers are remembered, as the REST doors' are (a raw completion's text is no message)
                runner = ChoiceRunner(backends, plan, remember=isinstance(req, ChatCompletionRequest))
                async for index, delta in run_choices(backends, plan.jobs):
                    yield _reply(runner, index, delta)
        except ApiError as err:
            await context.abort(err.grpc_code(), err.message)
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("Generate %s failed", rid)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal server error (request id {rid})")


def _with_targets(session: Session, request: gateway_pb2.GenerateRequest) -> Session:
    """The session (from the metadata, as the REST headers) with the request's own latency-target fields, which
    win over the `x-slo-*-ms` metadata.

    Raises:
      ApiError: 400 naming the field for a target that is not a number of milliseconds in (0, 86,400,000].
    """
    targets = {}
    for field, attr in (("slo_ttft_ms", "ttft_s"), ("slo_tpot_ms", "tpot_s")):
        value = getattr(request, field)
        if value:
            targets[attr] = workers.latency_target(repr(value), field)
    return dataclasses.replace(session, **targets) if targets else session


def _metadata(context, key: str) -> str | None:
    """The first value of invocation metadata `key`, or None."""
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value if isinstance(value, str) else None
    return None


def _reply(runner: ChoiceRunner, index: int, delta) -> gateway_pb2.GenerateResponse:
    """One GenerateResponse from a Delta split like the REST chat deltas (text = content), through the request's
    choice runner (which also remembers a chat answer at its end)."""
    splitter = runner.plan.splitters[index]
    reply = gateway_pb2.GenerateResponse(tokens=delta.tokens, index=index)
    if not splitter.tokens_path:
        reply.text = delta.text
    out = runner.feed(index, delta)
    for d in out:
        reply.text += d.get("content", "") if splitter.tokens_path else ""
        reply.reasoning_text += d.get("reasoning_content", "")
        for call in d.get("tool_calls", []):
            fn = call.get("function", {})
            reply.tool_calls.append(gateway_pb2.ToolCallDelta(index=call["index"], id=call.get("id", ""),
                                                              name=fn.get("name", ""),
                                                              arguments=fn.get("arguments", "")))
    if delta.finish_reason:
        reply.finish_reason = _FINISH[splitter.finish_reason(delta.finish_reason)]
        reply.usage.CopyFrom(delta.usage)
    return reply


_UNDECODABLE = gateway_pb2.GenerateRequest()  # stands for a request whose bytes do not parse


def _deserialize(data: bytes) -> gateway_pb2.GenerateRequest:
    """Parse a GenerateRequest; bytes that do not parse (invalid UTF-8 in a string field) become _UNDECODABLE,
    answered INVALID_ARGUMENT by Generate instead of gRPC's own INTERNAL."""
    try:
        return gateway_pb2.GenerateRequest.FromString(data)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError, whatever the implementation
        return _UNDECODABLE


def add_to_server(servicer: GatewayServicer, server) -> None:
    """Register Generate on a grpc.aio server, parsing requests with `_deserialize`."""
    handler = grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=_deserialize,
        response_serializer=gateway_pb2.GenerateResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("gemma_serve.v1.Gateway",
                                                                          {"Generate": handler}),))
