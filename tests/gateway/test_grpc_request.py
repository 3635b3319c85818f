"""gRPC `Generate` requests become the REST request models (gateway/api/grpc_service.py `request_model`), so every
check is REST's: the same fields, bounds and 400s (INVALID_ARGUMENT), and bytes that do not parse are an
INVALID_ARGUMENT too, not gRPC's own INTERNAL."""

from __future__ import annotations

import math

import pytest

from gateway.api.grpc_service import _UNDECODABLE, _deserialize, request_model
from gateway.core.errors import ApiError
from gateway.core.limits import Limits
from gateway.core.openai_types import ChatCompletionRequest, CompletionRequest
from gateway.planning.answer_limit import read_limit
from protos import common_pb2, gateway_pb2, tokenizer_pb2


def _text(**kw) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(text="hi", **kw)


def test_text_and_tokens_are_completions_with_proto3_defaults():
    req = request_model(_text())
    assert isinstance(req, CompletionRequest) and req.prompt == "hi"
    assert req.temperature == 0.0 and req.top_p is None and req.top_k is None and req.repetition_penalty is None
    assert read_limit(req, Limits()).asked is None  # max_tokens 0: up to max_model_len, not OpenAI's 16
    sp = common_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, logit_bias={7: -2.0}, top_logprobs=3)
    req = request_model(gateway_pb2.GenerateRequest(tokens=gateway_pb2.TokenInput(token_ids=[1, 2]), sampling=sp,
                                                    max_tokens=5, n=2, stop=["x"], cache_salt="tenant-a"))
    assert req.prompt == [1, 2] and read_limit(req, Limits()).asked == 5 and req.n == 2 and req.stop == ["x"]
    assert math.isclose(req.temperature, 0.7, rel_tol=1e-6) and req.top_k == 5 and req.seed == 3
    assert req.logit_bias == {"7": -2.0} and req.logprobs == 3 and req.cache_salt == "tenant-a"


def test_chat_input_is_a_chat_completion_without_client_token_ids():
    msg = tokenizer_pb2.ChatMessage(role="assistant", content="x", generated_token_ids=[105, 106])
    call = tokenizer_pb2.ToolCall(id="c1", name="f", arguments_json='{"a": 1}')
    msg2 = tokenizer_pb2.ChatMessage(role="assistant", tool_calls=[call])
    req = request_model(gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatInput(
        messages=[tokenizer_pb2.ChatMessage(role="user", content="hi"), msg, msg2],
        tools_json='[{"type": "function", "function": {"name": "f"}}]', tool_choice_json='"auto"',
        no_parallel_tool_calls=True)))
    assert isinstance(req, ChatCompletionRequest)
    assert req.tools[0]["function"]["name"] == "f" and req.tool_choice == "auto" and req.parallel_tool_calls is False
    assert req.messages[1].content == "x" and not hasattr(req.messages[1], "generated_token_ids")
    assert req.messages[2].content is None and req.messages[2].tool_calls[0].function.arguments == '{"a": 1}'
    assert req.prediction is None
    req = request_model(gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatInput(
        messages=[tokenizer_pb2.ChatMessage(role="user", content="hi")]), prediction="def f(): pass"))
    assert req.prediction is not None and req.prediction.text() == "def f(): pass"


@pytest.mark.parametrize("request_,param", [
    (_text(sampling=common_pb2.SamplingParams(temperature=float("nan"))), "temperature"),
    (_text(sampling=common_pb2.SamplingParams(temperature=3.0)), "temperature"),
    (_text(sampling=common_pb2.SamplingParams(logit_bias={1: 1e30})), "logit_bias"),
    (_text(sampling=common_pb2.SamplingParams(top_logprobs=50)), "logprobs"),
    (_text(n=17), "n"),
    (_text(allowed_token_ids=[-1]), "allowed_token_ids"),
    (_text(response_format_json='{"type": NaN}'), "response_format_json"),
    (gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatInput(tools_json="[" * 100 + "]" * 100)), "chat.tools_json"),
    (gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatInput(template_kwargs_json='{"a": "\\ud800"}')),
     "chat.template_kwargs_json"),
    (gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="x")])),
     "messages"),
    (gateway_pb2.GenerateRequest(), "input"),
    (_text(prediction="hi there"), "prediction"),
])
def test_bad_values_are_400s_naming_the_field(request_, param):
    with pytest.raises(ApiError) as err:
        request_model(request_)
    assert err.value.status == 400 and err.value.param.startswith(param), err.value.param
    assert err.value.grpc_code().name == "INVALID_ARGUMENT"


def test_bytes_that_do_not_parse_are_a_marker_not_an_exception():
    good = _text(stop=["é"]).SerializeToString()
    assert _deserialize(good).stop == ["é"]
    bad = good.replace("é".encode(), b"\xff\xfe")
    assert _deserialize(bad) is _UNDECODABLE
    assert _deserialize(b"\xff\xff\xff") is _UNDECODABLE


def test_request_models_refuse_values_outside_their_literals():
    import pydantic

    for bad in ({"reasoning_effort": "extreme"}, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                {"stop": ["a", "b", "c", "d", "e"]}, {"stop": [""]}, {"allowed_token_ids": []}):
        with pytest.raises(pydantic.ValidationError) as err:
            ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **bad})
        assert err.value.errors()[0]["loc"][0] == next(iter(bad)), err.value


def test_latency_targets_and_priority_are_fields_that_win_over_metadata():
    from gateway.api.grpc_service import _with_targets
    from gateway.backends.workers import Session

    assert request_model(_text(priority=-3)).priority == -3 and request_model(_text()).priority == 0
    metadata = Session(key="s", ttft_s=9.0, tpot_s=0.5)
    session = _with_targets(metadata, _text(slo_ttft_ms=1500))
    assert (session.key, session.ttft_s, session.tpot_s) == ("s", 1.5, 0.5)  # the field wins, the other stays
    assert _with_targets(metadata, _text()) is metadata
    for bad in (-1.0, math.inf, math.nan, 1e12):
        with pytest.raises(ApiError) as err:
            _with_targets(Session(), _text(slo_tpot_ms=bad))
        assert err.value.status == 400 and err.value.param == "slo_tpot_ms"
