"""One request plan behind every front door: the same request sent as a chat completion, a Responses request and
an Anthropic Messages request is planned into the same prompt ids and the same GenParams (limit, sampling, stop
strings and ids, grammar, prefix-cache scope, session) — a field's walk from each door to the worker goes through
the chat planner once — and each door's errors name its own fields. Against test_planner's fake backends."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway import messages_api, responses_api
from gateway.errors import ApiError
from gateway.limits import Limits
from gateway.messages_request import CallArguments, MessagesRequest
from gateway.response_store import ResponseStore
from gateway.responses_request import ResponsesRequest
from gateway.workers import Session
from tests.gateway.test_planner import _Backends, _chat

TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"]}}


def _responses(backends, body, limits=None):
    req = ResponsesRequest.model_validate(body)
    store = ResponseStore(1 << 20, 60)
    return asyncio.run(responses_api._plan(backends, limits or Limits(), store, req, "", Session())).plan


def _messages(backends, body, limits=None):
    req = MessagesRequest.model_validate(body)
    return asyncio.run(messages_api._plan(backends, limits or Limits(), CallArguments(), req, "", Session())).plan


def _comparable(plan) -> tuple:
    job = plan.jobs[0]
    params = {f.name: getattr(job.params, f.name) for f in dataclasses.fields(job.params)}
    params |= {"constraint": type(job.params.constraint).__name__, "reservation": None,
               "sampling": str(job.params.sampling)}
    return job.prompt, params


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool"])
def test_the_same_request_through_each_door_is_the_same_plan(tools):
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
            "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "stop": ["END"], "user": "agent-1"}
    responses = {"instructions": "Be brief.", "input": "Weather?", "max_output_tokens": 9, "temperature": 0.5,
                 "top_p": 0.9, "stop": ["END"], "user": "agent-1"}
    messages = {"system": "Be brief.", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 9,
                "temperature": 0.5, "top_p": 0.9, "stop_sequences": ["END"], "metadata": {"user_id": "agent-1"}}
    if tools:
        chat |= {"tools": [{"type": "function", "function": TOOL}], "tool_choice": "required"}
        responses |= {"tools": [{"type": "function", **TOOL}], "tool_choice": "required"}
        messages |= {"tools": [{"name": TOOL["name"], "input_schema": TOOL["parameters"]}],
                     "tool_choice": {"type": "any"}}
    expected = _comparable(_chat(_Backends(), chat))
    assert _comparable(_responses(_Backends(), responses)) == expected
    assert _comparable(_messages(_Backends(), messages)) == expected
    assert expected[1]["max_tokens"] == 9 and expected[1]["session"].key == "agent-1"
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
    turn = asyncio.run(messages_api._plan(_Backends(), Limits(anthropic_usage=accounting), CallArguments(), req,
                                          "", Session()))
    prompt = turn.plan.prompt_tokens
    usage = messages_api._usage(turn, cached=3, output_tokens=2)
    assert usage["cache_read_input_tokens"] == 3 and usage["output_tokens"] == 2
    assert usage["input_tokens"] == (prompt if accounting == "inclusive" else prompt - 3)
