"""One request plan behind every front door: the same request sent as a chat completion, a Responses request and
an Anthropic Messages request is planned into the same prompt ids and the same GenParams (limit, sampling, stop
strings and ids, grammar, prefix-cache scope, session) — a field's walk from each door to the worker goes through
the chat planner once — and each door's errors name its own fields. Against test_planner's fake backends."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway.api.messages import messages_api
from gateway.api.messages.messages_request import CallArguments, MessagesRequest
from gateway.api.responses import responses_api
from gateway.api.responses.response_store import ResponseStore
from gateway.api.responses.responses_request import ResponsesRequest
from gateway.core.errors import ApiError
from gateway.core.limits import Limits
from gateway.planning.context import RequestContext
from tests.gateway.test_planner import _Backends, _chat

TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"]}}


def _responses(backends, body, limits=None):
    req = ResponsesRequest.model_validate(body)
    store = ResponseStore(1 << 20, 60)
    return asyncio.run(responses_api._plan(RequestContext(backends, limits or Limits()), store, req)).plan


def _messages(backends, body, limits=None):
    req = MessagesRequest.model_validate(body)
    return asyncio.run(messages_api._plan(RequestContext(backends, limits or Limits()), CallArguments(), req)).plan


def _grpc(backends, request, limits=None):
    """A gRPC `Generate` request planned as its servicer plans it (`request_model`, then the chat or completion
    planner)."""
    from gateway.api.grpc_service import request_model
    from gateway.core.openai_types import ChatCompletionRequest
    from gateway.planning.planner import plan_chat_completion, plan_completion

    req = request_model(request)
    plan = plan_chat_completion if isinstance(req, ChatCompletionRequest) else plan_completion
    return asyncio.run(plan(RequestContext(backends, limits or Limits()), req, call_prefix="call_"))


def _comparable(plan) -> tuple:
    job = plan.jobs[0]
    params = {f.name: getattr(job.params, f.name) for f in dataclasses.fields(job.params)}
    params |= {"constraint": type(job.params.constraint).__name__, "reservation": None,
               "sampling": str(job.params.sampling)}
    return job.prompt, params


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool"])
def test_the_same_request_through_each_door_is_the_same_plan(tools):
    limit = 80 if tools else 9  # a required call's shortest answer is 69 tokens of the byte vocabulary
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
            "max_completion_tokens": limit, "temperature": 0.5, "top_p": 0.9, "stop": ["END"], "user": "agent-1"}
    responses = {"instructions": "Be brief.", "input": "Weather?", "max_output_tokens": limit, "temperature": 0.5,
                 "top_p": 0.9, "stop": ["END"], "user": "agent-1"}
    messages = {"system": "Be brief.", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": limit,
                "temperature": 0.5, "top_p": 0.9, "stop_sequences": ["END"], "metadata": {"user_id": "agent-1"}}
    if tools:
        chat |= {"tools": [{"type": "function", "function": TOOL}], "tool_choice": "required"}
        responses |= {"tools": [{"type": "function", **TOOL}], "tool_choice": "required"}
        messages |= {"tools": [{"name": TOOL["name"], "input_schema": TOOL["parameters"]}],
                     "tool_choice": {"type": "any"}}
    expected = _comparable(_chat(_Backends(), chat))
    assert _comparable(_responses(_Backends(), responses)) == expected
    assert _comparable(_messages(_Backends(), messages)) == expected
    assert expected[1]["max_tokens"] == limit and expected[1]["session"].key == "agent-1"
    assert (expected[1]["constraint"] != "NoneType") == tools


def test_each_door_names_its_own_fields():
    limits = Limits(max_tokens_cap=8)
    with pytest.raises(ApiError) as err:
        _responses(_Backends(), {"input": "x", "max_output_tokens": 9}, limits)
    assert err.value.param == "max_output_tokens" and "max_output_tokens" in err.value.message
    # Anthropic's max_tokens is lowered to what the server allows (Claude Code always asks for 32,000).
    lowered = _messages(_Backends(), {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9}, limits)
    assert lowered.jobs[0].params.max_tokens == 8
    roomy = _messages(_Backends(), {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000})
    assert roomy.jobs[0].params.max_tokens == 128 - len(roomy.jobs[0].prompt)
    with pytest.raises(ApiError) as err:
        _messages(_Backends(), {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                "stop_sequences": ["a", "b", "c", "d", "e"]})
    assert err.value.param == "stop_sequences"
    with pytest.raises(ApiError) as err:
        _responses(_Backends(), {"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                                                   "schema": {"type": "nonsense"}}}})
    assert err.value.param.startswith("text.format")


@pytest.mark.parametrize("accounting", ["inclusive", "exclusive"])
def test_messages_usage_counts_cache_reads_as_asked(accounting):
    req = MessagesRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    turn = asyncio.run(messages_api._plan(RequestContext(_Backends(), Limits(anthropic_usage=accounting)),
                                          CallArguments(), req))
    prompt = turn.plan.prompt_tokens
    usage = messages_api._usage(turn, cached=3, output_tokens=2)
    assert usage["cache_read_input_tokens"] == 3 and usage["output_tokens"] == 2
    assert usage["input_tokens"] == (prompt if accounting == "inclusive" else prompt - 3)


class _RecordingWorker:
    """A real gRPC model worker that records each Prefill's `max_tokens` and ends the answer at its first token."""

    def __init__(self):
        self.max_tokens: list[int] = []

    def servicer(self):
        from protos import common_pb2, model_worker_pb2, model_worker_pb2_grpc

        seen = self.max_tokens

        class Worker(model_worker_pb2_grpc.ModelWorkerServicer):
            async def Prefill(self, request, context):
                seen.append(request.stopping.max_tokens)
                return model_worker_pb2.PrefillResponse(
                    request_id=request.request_id, first_token=common_pb2.GeneratedToken(token_id=5),
                    finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=common_pb2.Usage(prompt_tokens=1))

            async def Abort(self, request, context):
                return model_worker_pb2.AbortResponse()

        return Worker()


@pytest.mark.parametrize("cap", [None, 8], ids=["no-cap", "cap-8"])
@pytest.mark.parametrize("sent", [None, 5, 500], ids=["no-limit", "limit-5", "limit-500"])
def test_the_answer_budget_is_decided_once_and_the_worker_receives_it(cap, sent):
    """Each front door's limit field (or none), with and without `--max-tokens-cap`: the planner decides one int
    per choice (`answer_limit.answer_budget`: as sent, the cap or the context's room when absent, a 400 past them;
    the Messages API lowers instead of refusing; gRPC's 0 is "what fits"), and `generate` hands the worker exactly
    that number: nothing between the planner and the worker derives it again."""
    import grpc

    from gateway.backends.clients import Backends
    from gateway.generation.generate import generate
    from protos import gateway_pb2, model_worker_pb2_grpc, tokenizer_pb2
    from tests.gateway.test_planner import _complete
    from tests.transport import grpc_listen

    limits = Limits(max_tokens_cap=cap)
    user = [{"role": "user", "content": "Weather?"}]
    doors = {
        "chat": lambda: _chat(_Backends(), {"messages": user} | ({} if sent is None else {"max_tokens": sent}),
                              limits),
        "chat-max-completion-tokens": lambda: _chat(
            _Backends(), {"messages": user} | ({} if sent is None else {"max_completion_tokens": sent}), limits),
        "completions": lambda: _complete(_Backends(), {"prompt": "Weather?"} | (
            {} if sent is None else {"max_tokens": sent}), limits),
        "responses": lambda: _responses(_Backends(), {"input": "Weather?"} | (
            {} if sent is None else {"max_output_tokens": sent}), limits),
        "messages": lambda: _messages(_Backends(), {"messages": user, "max_tokens": sent or 32_000}, limits),
        "grpc-text": lambda: _grpc(_Backends(), gateway_pb2.GenerateRequest(text="Weather?", max_tokens=sent or 0),
                                   limits),
        "grpc-chat": lambda: _grpc(_Backends(), gateway_pb2.GenerateRequest(
            chat=gateway_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="Weather?")]),
            max_tokens=sent or 0), limits),
    }
    planned: dict[str, int] = {}
    jobs = {}
    for door, plan in doors.items():
        try:
            p = plan()
        except ApiError as err:  # past the cap, or past the context: refused before any worker call
            assert door != "messages" and sent is not None and err.status == 400, (door, err.message)
            assert (cap is not None and sent > cap) or sent >= 128 - 8, door  # max_model_len 128, a short prompt
            continue
        job = p.jobs[0]
        budget = job.params.max_tokens
        assert type(budget) is int and budget >= 1, (door, budget)
        room = 128 - len(job.prompt)
        if door == "messages":
            expected = min(sent or 32_000, room, cap or room)
        elif sent is None:
            expected = 16 if door == "completions" else min(room, cap or room)  # OpenAI's completions default
            if door == "completions" and cap is not None:
                expected = min(16, cap)
        else:
            expected = sent
        assert budget == expected, (door, budget, expected)
        planned[door], jobs[door] = budget, job
    assert "chat" in planned or sent == 500

    async def send_all() -> list[int]:
        worker = _RecordingWorker()
        server = grpc.aio.server()
        model_worker_pb2_grpc.add_ModelWorkerServicer_to_server(worker.servicer(), server)
        addr = grpc_listen(server, name="worker")
        await server.start()
        backends = Backends("localhost:1", addr)
        backends.facts = _Backends().facts
        try:
            for job in jobs.values():
                async for _ in generate(backends, job.prompt, dataclasses.replace(job.params, worker="",
                                                                                   reservation=None)):
                    pass
        finally:
            await backends.close()
            await server.stop(0)
        return worker.max_tokens

    assert asyncio.run(send_all()) == list(planned.values())


def test_a_request_sees_one_model_facts_snapshot():
    """`Backends.for_request()`: the facts a request read first stay its facts when the shared ones are refreshed
    mid-request (a backend restarted with another context size); the next request sees the new ones; everything
    else is the shared backends'."""
    from gateway.backends.clients import Backends

    shared = Backends("localhost:1", "localhost:2")
    shared.facts = _Backends().facts
    first = shared.for_request()
    seen = first.ready_facts()
    shared.facts = dataclasses.replace(seen, max_model_len=64)
    assert first.ready_facts() is seen and first.ready_facts().max_model_len == 128
    assert shared.for_request().ready_facts().max_model_len == 64
    assert first.answers is shared.answers and first.pool is shared.pool and first.for_request() is first
