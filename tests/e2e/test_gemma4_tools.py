"""Gemma 4 tool calls and thinking through the real stack: a tiny random Gemma 4 checkpoint with its official chat
template (tests/e2e/conftest.py `gemma4_stack`), the official `openai` client, and jsonschema as the judge.

A random model writes whatever the grammar lets through, so these tests show the constraint and the conversion
hold on arbitrary outputs: `required` and named `tool_choice` always call, every call's arguments parse and
validate against the tool's schema, `none` never calls, streamed deltas concatenate to the non-streamed
arguments, and the tool-call turn sent back verbatim renders in the model's format.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.slow

# Bounded values: a random model inside an unbounded string or number would run to max_tokens.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                            "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lagos \"Ikeja\""]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "metric": {"type": "boolean"},
                   "note": {"type": "string", "maxLength": 6}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]},
                                     "fmt": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(gemma4_stack):
    stack, _ = gemma4_stack
    c = stack.openai()
    return c, c.models.list().data[0].id


def check_calls(choice, names=None):
    calls = choice.message.tool_calls or []
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


@pytest.mark.parametrize("seed", range(4))
def test_required_always_calls_with_valid_arguments(client, seed):
    c, model = client
    r = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(check_calls(choice)) == 1
    assert not choice.message.content


@pytest.mark.parametrize("seed", range(3))
def test_named_choice_calls_that_tool(client, seed):
    c, model = client
    r = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0,
                                  seed=seed, tool_choice={"type": "function", "function": {"name": "clock"}})
    choice = r.choices[0]
    if choice.finish_reason == "length":  # parallel calls allowed: the model may keep calling
        assert check_calls(choice, ["clock"])
    else:
        assert choice.finish_reason == "tool_calls"
        assert all(call.function.name == "clock" for call in check_calls(choice, ["clock"]))


@pytest.mark.parametrize("seed", range(3))
def test_none_never_calls(client, seed):
    c, model = client
    r = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=40,
                                  temperature=1.0, seed=seed, logit_bias={"48": 100})
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert "<|tool_call>" not in (choice.message.content or "") and "call:" not in (choice.message.content or "")


def test_auto_parses_whatever_the_model_writes(client):
    c, model = client
    for seed in range(3):
        r = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                      temperature=1.0, seed=seed)
        choice = r.choices[0]
        check_calls(choice)
        assert "<|tool_call>" not in (choice.message.content or "")
        if choice.message.tool_calls and choice.finish_reason != "length":
            assert choice.finish_reason == "tool_calls"


def test_streamed_tool_call_deltas_equal_the_non_streamed_call(client):
    c, model = client
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    full = c.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.function.name, "id, type and name come first"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == full.finish_reason
    assert [(x["name"], x["arguments"]) for x in calls.values()] == \
        [(t.function.name, t.function.arguments) for t in full.message.tool_calls or []]  # ids are per response


def test_tool_turn_sent_back_renders_in_the_model_turn(gemma4_stack, client):
    stack, _ = gemma4_stack
    c, model = client
    r = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=120, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    follow = c.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens
    from protos import tokenizer_pb2, tokenizer_pb2_grpc

    with stack.internal_channel("tokenizer") as channel:
        pb = [tokenizer_pb2.ChatMessage(role="user", content=MESSAGES[0]["content"]),
              tokenizer_pb2.ChatMessage(role="assistant", tool_calls=[tokenizer_pb2.ToolCall(
                  id=call.id, name=call.function.name, arguments_json=call.function.arguments)]),
              tokenizer_pb2.ChatMessage(role="tool", tool_call_id=call.id, content='{"temp": 21}')]
        text = tokenizer_pb2_grpc.TokenizerStub(channel).ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(
            messages=pb, add_generation_prompt=True, tools_json=json.dumps(TOOLS))).text
    model_turn = text.split("<|turn>model\n")[1]
    assert model_turn.startswith(f"<|tool_call>call:{call.function.name}{{")
    assert "<|tool_response>" in model_turn  # the result is rendered in the same model turn


def test_thinking_switch_reaches_the_template(client):
    c, model = client
    plain = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0)
    think = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    effort = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0,
                                       reasoning_effort="high")
    assert think.usage.prompt_tokens > plain.usage.prompt_tokens  # <|turn>system\n<|think|>\n<turn|>\n
    assert effort.usage.prompt_tokens == think.usage.prompt_tokens


def test_thinking_answer_under_a_schema_may_think_first(client):
    """Bias the model to open the thought channel (+100 on `<|channel>`, +30 on `<channel|>`): ThoughtFirst lets
    it (a plain JSON mask would not), the channel goes to reasoning, and the content after it validates."""
    c, model = client
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    kw = dict(model=model, messages=MESSAGES, max_tokens=60, temperature=0, reasoning_effort="high",
              logit_bias={"100": 100, "101": 30}, logprobs=True, extra_body={"skip_special_tokens": False},
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    r = c.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.logprobs.content[0].token == "<|channel>"
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)
    streamed = {"content": "", "reasoning": ""}
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed["content"] += ch.delta.content or ""
            streamed["reasoning"] += getattr(ch.delta, "reasoning_content", None) or ""
    assert streamed == {"content": choice.message.content,
                        "reasoning": getattr(choice.message, "reasoning_content", None) or ""}


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)"}}}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
])
def test_bad_tool_requests_are_400s(gemma4_stack, body, param):
    stack, _ = gemma4_stack
    with stack.http(timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    with stack.http(timeout=10) as http:
        assert http.get("/health").status_code == 200


def test_grpc_generate_tool_calls_match_rest(gemma4_stack, client):
    import grpc

    from protos import common_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2

    stack, _ = gemma4_stack
    c, model = client
    rest = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                     max_tokens=200, temperature=0).choices[0]
    chat = gateway_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content=MESSAGES[0]["content"])],
                                 tools_json=json.dumps(TOOLS), tool_choice_json='"required"')
    request = gateway_pb2.GenerateRequest(chat=chat, max_tokens=200, sampling=common_pb2.SamplingParams(temperature=0))
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        replies = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120))
        calls: dict[int, list] = {}
        for r in replies:
            for d in r.tool_calls:
                calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
        assert [tuple(v) for v in calls.values()] == \
            [(t.function.name, t.function.arguments) for t in rest.message.tool_calls]
        assert "".join(r.text for r in replies) == (rest.message.content or "")
        expected = common_pb2.FINISH_REASON_TOOL_CALLS if rest.finish_reason == "tool_calls" else \
            common_pb2.FINISH_REASON_LENGTH
        assert replies[-1].finish_reason == expected
        bad = gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatInput(
            messages=chat.messages, tools_json=json.dumps(TOOLS), tool_choice_json='{"type": "function"'))
        with pytest.raises(grpc.RpcError) as err:
            list(gateway_pb2_grpc.GatewayStub(channel).Generate(bad, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tool_choice_json" in err.value.details()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "clock"}}])
def test_thinking_then_exactly_the_forced_call(client, tool_choice):
    """Thinking on with a forced call: the thought comes first (biased open, +100 on `<|channel>`), then exactly
    the forced call. The call markers are masked inside the thought (chat_plan.constraint_factory) — even with
    +50 on `<|tool_call>` none appears there, so a call is never half reasoning text nor made twice; streamed and
    non-streamed answers agree."""
    c, model = client
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              max_tokens=80, temperature=0, reasoning_effort="high", logit_bias={"100": 100, "101": 30, "48": 50},
              logprobs=True, extra_body={"skip_special_tokens": False})
    choice = c.chat.completions.create(**kw).choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    assert tokens[0] == "<|channel>" and "<channel|>" in tokens
    close = tokens.index("<channel|>")
    assert "<|tool_call>" not in tokens[:close] and "<tool_call|>" not in tokens[:close]
    assert tokens[close + 1] == "<|tool_call>" and tokens.count("<|tool_call>") == 1
    calls = check_calls(choice, ["clock"] if isinstance(tool_choice, dict) else None)
    assert len(calls) == 1 and choice.finish_reason == "tool_calls" and not choice.message.content
    streamed = {"reasoning": "", "calls": {}}
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed["reasoning"] += getattr(ch.delta, "reasoning_content", None) or ""
            for d in ch.delta.tool_calls or []:
                streamed["calls"].setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
    assert streamed["reasoning"] == (getattr(choice.message, "reasoning_content", None) or "")
    assert list(streamed["calls"].values()) == [[calls[0].function.name, calls[0].function.arguments]]
