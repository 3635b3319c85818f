"""`/tokenize` and `/detokenize` (vLLM's shapes) and the chat fields agents send (`continue_final_message`,
`add_generation_prompt`, `tools[].function.strict`), against a recording tokenizer service: the chat form of
/tokenize asks the tokenizer exactly what a chat completion asks, bad input is a 4xx naming the field, and with
API keys both endpoints need one. (The real services: tests/e2e/test_agent_fields.py.)"""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from gateway.api.app import create_app
from gateway.api.auth import ApiKeys
from gateway.backends.clients import Backends
from gateway.backends.history import answer_key, history_scope
from gateway.backends.model_facts import ModelFacts
from gateway.core.limits import Limits
from gateway.core.openai_types import ChatCompletionRequest, TokenizeChatRequest
from gateway.planning.context import RequestContext
from gateway.planning.planner import plan_chat_completion, tokenize
from protos import tokenizer_pb2
from tests.e2e.stacks import free_ports
from tests.gateway.test_http_guard import _error

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = {"role": "user", "content": "Capital of France?"}
PREFILL = {"role": "assistant", "content": "The capital is "}


class _RecordingTokenizer:
    """The tokenizer service's RPCs, recording each request: a chat prompt is [2, 7, 8], a text's ids are [5, 6]
    (after BOS 2 when asked), a token's piece is `t<id>`."""

    def __init__(self):
        self.requests: list = []

    async def ApplyChatTemplate(self, request):
        self.requests.append(request)
        return tokenizer_pb2.ChatTemplateResponse(token_ids=[2, 7, 8])

    async def Encode(self, request):
        self.requests.append(request)
        return tokenizer_pb2.EncodeResponse(token_ids=([2] if request.add_bos else []) + [5, 6])

    async def Decode(self, request):
        self.requests.append(request)
        return tokenizer_pb2.DecodeTokensResponse(
            text="text", token_strs=[f"t{i}" for i in request.token_ids] if request.return_token_strs else [])


class _Backends(Backends):
    tokenizer = None  # an instance attribute here, not the gRPC stub property


def _backends() -> _Backends:
    backends = _Backends(*(f"127.0.0.1:{port}" for port in free_ports(2)))  # no worker: generation would 503
    # Token 9 is Gemma 3's end of turn (a chat with tools plans its tool grammar, which ends with it).
    backends.facts = ModelFacts(name="m", max_model_len=100, vocab_size=10,
                                token_bytes=[b"ab"] * 9 + [b"<end_of_turn>"], special_ids={9}, bos_id=2,
                                stop_ids=[1], architecture="gemma3")
    backends.tokenizer = _RecordingTokenizer()
    return backends


@pytest.fixture
def client():
    backends = _backends()
    with TestClient(create_app(backends, Limits(max_messages=4, max_tools=2))) as c:
        c.backends = backends
        yield c


def _chat_template_request(backends, body: dict, tokenize_it: bool) -> tokenizer_pb2.ChatTemplateRequest:
    backends.tokenizer.requests.clear()
    if tokenize_it:
        asyncio.run(tokenize(RequestContext(backends, Limits(), "t"), TokenizeChatRequest.model_validate(body)))
    else:
        asyncio.run(plan_chat_completion(RequestContext(backends, Limits(), "t"),
                                         ChatCompletionRequest.model_validate(body), call_prefix="call_"))
    [request] = backends.tokenizer.requests
    return request


@pytest.mark.parametrize("body", [
    {"messages": [USER]},
    {"messages": [USER, PREFILL], "continue_final_message": True},
    {"messages": [USER], "add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [USER], "tools": [WEATHER], "tool_choice": "none"},
    {"messages": [USER, {"role": "assistant", "content": "Paris."}, USER], "cache_salt": "s"},
], ids=["plain", "continue", "no-generation-prompt", "tools-none", "remembered-answer"])
def test_the_chat_form_renders_exactly_the_chat_completion_prompt(body):
    backends = _backends()
    backends.answers.remember(history_scope("t", "s"), answer_key("Paris."), [3, 4])
    chat = _chat_template_request(backends, body, tokenize_it=False)
    assert _chat_template_request(backends, body, tokenize_it=True) == chat
    assert chat.continue_final_message == bool(body.get("continue_final_message"))
    assert chat.add_generation_prompt == (body.get("add_generation_prompt", True) and not chat.continue_final_message)
    assert chat.tool_choice == ("none" if body.get("tool_choice") == "none" or "tools" not in body else "auto")
    remembered = [list(m.generated_token_ids) for m in chat.messages]
    assert remembered == ([[], [3, 4], []] if "cache_salt" in body else [[]] * len(body["messages"]))


def test_tokenize_answers_in_vllm_shape(client):
    r = client.post("/tokenize", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 3, "max_model_len": 100, "tokens": [2, 5, 6], "token_strs": None}
    r = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False, "return_token_strs": True})
    assert r.json() == {"count": 2, "max_model_len": 100, "tokens": [5, 6], "token_strs": ["t5", "t6"]}
    encode = client.backends.tokenizer.requests[-2]
    assert encode.parse_special and not encode.add_bos
    r = client.post("/tokenize", json={"messages": [USER], "tools": [WEATHER], "tool_choice": "auto"})
    assert r.json()["tokens"] == [2, 7, 8]
    assert client.backends.tokenizer.requests[-1].tool_choice == "auto"  # strict: true is accepted
    r = client.post("/detokenize", json={"model": "m", "tokens": [2, 5]})
    assert r.status_code == 200 and r.json() == {"prompt": "text"}
    decode = client.backends.tokenizer.requests[-1]
    assert list(decode.token_ids) == [2, 5] and not decode.skip_special_tokens


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"messages": [USER, PREFILL], "continue_final_message": True, "add_generation_prompt": True},
     400, "continue_final_message"),
    ("/tokenize", {"messages": [USER], "continue_final_message": True}, 400, "messages"),
    ("/tokenize", {"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "get_weather", "arguments": "{}"}}]}], "continue_final_message": True},
     400, "messages.1.tool_calls"),
    ("/tokenize", {"messages": [USER], "continue_final_message": "yes"}, 400, "continue_final_message"),
    ("/tokenize", {"messages": [USER], "tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": "yes"}}]},
     400, "tools.0.function.strict"),
    ("/tokenize", {"messages": [USER] * 5}, 400, "messages"),
    ("/tokenize", {"messages": [USER], "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("/tokenize", {"prompt": "hi", "messages": [USER]}, 400, "prompt"),
    ("/tokenize", {"prompt": ["hi"]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": [USER], "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": []}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10]}, 400, "tokens.1"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens.1"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [USER, PREFILL], "continue_final_message": True,
                              "add_generation_prompt": True}, 400, "continue_final_message"),
    ("/v1/chat/completions", {"messages": [USER], "continue_final_message": True}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [USER], "tools": [
        {**WEATHER, "function": {**WEATHER["function"], "strict": 1}}]}, 400, "tools.0.function.strict"),
])
def test_bad_input_is_a_4xx_naming_the_field(client, path, body, status, param):
    err = _error(client.post(path, json=body), status, param)
    if param == "continue_final_message" and status == 400 and body.get("add_generation_prompt"):
        assert err["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    assert not any(isinstance(r, tokenizer_pb2.ChatTemplateRequest) for r in client.backends.tokenizer.requests)


def test_with_api_keys_both_routes_need_one():
    with TestClient(create_app(_backends(), keys=ApiKeys(["key-a"]))) as c:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert _error(c.post(path, json=body), 401)["code"] == "invalid_api_key"
            _error(c.post(path, json={"tokens": "not checked first"}), 401)
            _error(c.post(path, json=body, headers={"Authorization": "Bearer key-b"}), 401)
            assert c.post(path, json=body, headers={"Authorization": "Bearer key-a"}).status_code == 200
        doc = c.get("/openapi.json").json()
    for path in ("/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        assert op["security"] == [{"apiKey": []}] and {"400", "401", "404"} <= set(op["responses"])
    schemas = doc["components"]["schemas"]
    body = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {ref["$ref"].rsplit("/", 1)[1] for ref in body["oneOf"]} == {"TokenizeCompletionRequest",
                                                                         "TokenizeChatRequest"}
    chat = schemas["TokenizeChatRequest"]["properties"]
    assert chat["messages"] == schemas["ChatCompletionRequest"]["properties"]["messages"]
    assert chat["tools"]["anyOf"][0]["items"]["properties"]["function"]["properties"]["strict"] == {
        "type": ["boolean", "null"]}
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 9  # the vocabulary
    assert set(schemas["TokenizeResponse"]["properties"]) == {"count", "max_model_len", "tokens", "token_strs"}
