"""The Responses and Messages APIs through the official clients (`openai`, `anthropic`, `openai-agents`) against the
embedded stack: tool round trips, streams that join into the unary answer in each API's documented event order,
structured output, stored responses, token counts, prefix reuse from turn to turn, and each API's error shape.

The embedded model is a base model: tool calls come from the grammar (tool_choice required / any), and answers are
judged by their structure and ids, not their prose. Greedy decoding (temperature 0) on a batch-invariant worker
makes a streamed answer and a unary one the same tokens.
"""

from __future__ import annotations

import json
import re

import anthropic
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather of a city",
                  "parameters": WEATHER}
MESSAGES_TOOL = {"name": "get_weather", "description": "The weather of a city", "input_schema": WEATHER}
ASK = "What is the weather in Paris?"
#: One prefill chunk of the embedded stack (--prefill-chunks 64): a prefix hit may stop up to one chunk short.
CHUNK = 64


def _openai(stack) -> openai.OpenAI:
    return stack.openai(api_key="none")


def _anthropic(stack) -> anthropic.Anthropic:
    return stack.anthropic(api_key="none")


def _prompt(usage) -> int:
    """A Messages answer's whole prompt: `input_tokens` (the default `--anthropic-usage inclusive`), of which
    `cache_read_input_tokens` were reused."""
    assert usage.cache_read_input_tokens <= usage.input_tokens and usage.cache_creation_input_tokens == 0
    return usage.input_tokens


def _model(stack) -> str:
    with stack.http() as http:
        return http.get("/v1/models").json()["data"][0]["id"]


# ----------------------------------------------------------------------------------------------- Responses


def _call_turn(client, model, input=ASK):
    return client.responses.create(model=model, input=input, tools=[RESPONSES_TOOL], tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=48, temperature=0)


def test_responses_tool_round_trip_reuses_the_first_turn(stack):
    client, model = _openai(stack), _model(stack)
    first = _call_turn(client, model)
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    items = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in first.output],
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}]
    # The same tools and tool_choice as turn 1: the tools' part of the prompt renders the same.
    second = _call_turn(client, model, input=items)
    assert second.status == "completed"
    assert [item.type for item in second.output] == ["function_call"]
    reused = first.usage.input_tokens + first.usage.output_tokens - CHUNK
    assert second.usage.input_tokens_details.cached_tokens >= reused


def test_responses_stream_joins_into_the_unary_answer(stack):
    client, model = _openai(stack), _model(stack)
    unary = _call_turn(client, model)
    with client.responses.stream(model=model, input=ASK, tools=[RESPONSES_TOOL], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=48, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert events[0].response.status == "in_progress" and events[-1].response.status == "completed"
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    unary_call = next(item for item in unary.output if item.type == "function_call")
    assert fragments == unary_call.arguments == final.output[-1].arguments
    json.loads(fragments)
    assert final.usage.output_tokens == unary.usage.output_tokens


def test_responses_text_stream_and_incomplete_status(stack):
    client, model = _openai(stack), _model(stack)
    unary = client.responses.create(model=model, input="Once upon a time", max_output_tokens=6, temperature=0)
    assert unary.status == "incomplete" and unary.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(model=model, input="Once upon a time", max_output_tokens=6,
                                 temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == unary.output_text and text
    assert events[-1].response.usage.output_tokens == 6


def test_responses_limit_below_the_shortest_call_is_refused_and_a_call_ends_within_its_limit(stack):
    """max_output_tokens below the shortest call the tool grammar allows is a 400 naming it and that call's length
    (gateway/structured/endings.py): no call is cut half-written by a client's limit. At that length the call is complete,
    announced done, the response `completed`. (A call cut by a server-side cap is still `incomplete`, not announced
    done: tests/gateway/test_responses_api.py.)"""
    client, model = _openai(stack), _model(stack)
    kw = dict(model=model, input=ASK, tools=[RESPONSES_TOOL], tool_choice="required", parallel_tool_calls=False,
              temperature=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(max_output_tokens=18, **kw)
    body = err.value.body
    assert (body["param"], body["code"]) == ("max_output_tokens", "max_tokens_too_small"), body
    shortest = int(re.search(r"answer that .* allows \((\d+) tokens\)", body["message"]).group(1))
    assert shortest > 18 and body["message"].startswith("max_output_tokens is 18")
    with client.responses.stream(max_output_tokens=shortest, **kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[-1].item.type == "function_call" and done[-1].item.status == "completed"
    json.loads(done[-1].item.arguments)


def test_codex_shaped_input_is_served(stack):
    """Codex sends developer messages, then two user messages in a row (its environment context, then the
    prompt), `store: false`, `include`, `reasoning.summary`, and tools of other types next to its functions."""
    client, model = _openai(stack), _model(stack)
    r = client.responses.create(model=model, store=False, include=["reasoning.encrypted_content"],
                                reasoning={"summary": "auto"}, max_output_tokens=4, temperature=0,
                                prompt_cache_key="codex-session-1", instructions="You are a coding agent.",
                                tools=[{**RESPONSES_TOOL, "strict": False}, {"type": "web_search"},
                                       {"type": "namespace", "name": "multi_agent_v1", "tools": []}],
                                input=[{"type": "message", "role": "developer", "content": [
                                    {"type": "input_text", "text": "Sandbox: read-only."}]},
                                       {"type": "message", "role": "user", "content": [
                                           {"type": "input_text", "text": "<environment_context/>"}]},
                                       {"type": "message", "role": "user", "content": [
                                           {"type": "input_text", "text": "List the files."}]}])
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1


def test_responses_json_schema_output(stack):
    client, model = _openai(stack), _model(stack)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=model, input="A person as JSON:", max_output_tokens=48, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_responses_previous_response_id_with_store(stack):
    client, model = _openai(stack), _model(stack)
    first = client.responses.create(model=model, input="Remember the number 7.", max_output_tokens=4,
                                    temperature=0, store=True)
    # The chain's KV stays leased to it between turns; the last turn ends the lease (x-session-release).
    second = client.responses.create(model=model, input="Which number?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0, store=True,
                                     extra_headers={"x-session-release": "true"})
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - CHUNK
    assert client.responses.retrieve(first.id).id == first.id
    items = client.responses.input_items.list(first.id)
    assert [item.content[0].text for item in items.data] == ["Remember the number 7."]
    assert client.responses.delete(first.id) is None or True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id=first.id, max_output_tokens=2)
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_input_tokens_and_left_out_tools(stack):
    model = _model(stack)
    body = {"model": model, "input": ASK, "instructions": "Answer briefly.",
            "tools": [RESPONSES_TOOL, {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}]}
    with stack.http(timeout=60) as http:
        count = http.post("/v1/responses/input_tokens", json=body)
    assert count.status_code == 200, count.text
    with stack.http(timeout=120) as http:
        made = http.post("/v1/responses", json={**body, "max_output_tokens": 2})
    assert made.status_code == 200, made.text
    assert count.json() == {"object": "response.input_tokens", "input_tokens": made.json()["usage"]["input_tokens"]}
    assert "web_search" in made.headers["x-gemma-serve-warning"]


def test_responses_errors_name_the_responses_fields(stack):
    client, model = _openai(stack), _model(stack)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input="Hi", max_output_tokens=100000)
    assert err.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input=[{"type": "input_image_call", "id": "x"}], max_output_tokens=2)
    assert err.value.body["param"] == "input.0.type"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="Hi", max_output_tokens=2)


# ----------------------------------------------------------------------------------------------- Messages


def _tool_message(client, model, messages=({"role": "user", "content": ASK},)):
    return client.messages.create(model=model, max_tokens=48, messages=list(messages), tools=[MESSAGES_TOOL],
                                  extra_body={"temperature": 0},
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True})


def test_messages_tool_round_trip_reuses_the_first_turn(stack):
    client, model = _anthropic(stack), _model(stack)
    first = _tool_message(client, model)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    assert client.messages.count_tokens(model=model, messages=[{"role": "user", "content": ASK}],
                                        tools=[MESSAGES_TOOL]).input_tokens == _prompt(first.usage)
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                              "content": "Sunny, 21 C"}]}]
    second = _tool_message(client, model, messages)
    assert second.stop_reason == "tool_use"
    assert second.usage.cache_read_input_tokens >= _prompt(first.usage) + first.usage.output_tokens - CHUNK


def test_messages_stream_joins_into_the_unary_answer(stack):
    client, model = _anthropic(stack), _model(stack)
    unary = _tool_message(client, model)
    with stack.http(timeout=120) as http, http.stream("POST", "/v1/messages", json={
            "model": model, "max_tokens": 48, "messages": [{"role": "user", "content": ASK}], "stream": True,
            "tools": [MESSAGES_TOOL], "temperature": 0,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == unary.content[-1].input
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(model=model, max_tokens=6, messages=[{"role": "user", "content": "Once upon"}],
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    again = client.messages.create(model=model, max_tokens=6, messages=[{"role": "user", "content": "Once upon"}],
                                   extra_body={"temperature": 0})
    assert text == final.content[0].text == again.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


def test_both_clients_list_the_served_model(stack):
    model = _model(stack)
    assert [m.id for m in _openai(stack).models.list().data] == [model]
    listed = _anthropic(stack).models.list()
    assert [m.id for m in listed.data] == [model] and listed.data[0].type == "model"
    assert listed.data[0].display_name == model and not listed.has_more


def test_messages_stop_sequence_and_errors(stack):
    client, model = _anthropic(stack), _model(stack)
    free = client.messages.create(model=model, max_tokens=12, messages=[{"role": "user", "content": "Count: 1 2 3"}],
                                  extra_body={"temperature": 0})
    word = free.content[0].text.split()[1] if len(free.content[0].text.split()) > 1 else None
    if word:
        stopped = client.messages.create(model=model, max_tokens=12, stop_sequences=[word],
                                         messages=[{"role": "user", "content": "Count: 1 2 3"}],
                                         extra_body={"temperature": 0})
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    with stack.http(timeout=30) as http:
        bare = http.post("/v1/messages", json={"model": model, "messages": [{"role": "user", "content": "Hi"}]})
    assert bare.status_code == 400
    assert bare.json()["type"] == "error" and bare.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus-4", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])


def test_messages_billing_header_does_not_defeat_prefix_reuse(stack):
    client, model = _anthropic(stack), _model(stack)
    rules = "You are a careful assistant. " * 20

    def turn(header: str, messages):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.1; cch={header};"},
                  {"type": "text", "text": rules}]
        return client.messages.create(model=model, max_tokens=4, system=system, messages=messages,
                                      extra_body={"temperature": 0})

    first = turn("a1b2c", [{"role": "user", "content": "Hello"}])
    second = turn("f9e8d", [{"role": "user", "content": "Hello"},
                            {"role": "assistant", "content": first.content[0].text},
                            {"role": "user", "content": "And then?"}])
    assert second.usage.cache_read_input_tokens >= _prompt(first.usage) + first.usage.output_tokens - CHUNK


# ----------------------------------------------------------------------------------------------- Agents SDK


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_calls_a_function_tool(stack, api):
    agents = pytest.importorskip("agents")
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        seen.append(city)
        return f"Sunny in {city}"

    client = stack.async_openai(api_key="none")
    model_class = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                         model=model_class(model=_model(stack), openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48,
                                                             parallel_tool_calls=False),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, ASK, run_config=agents.RunConfig(tracing_disabled=True))
    assert len(seen) == 1 and result.final_output == f"Sunny in {seen[0]}"


# ----------------------------------------------------------------------------------------------- thinking (Gemma 4)

#: The tiny random Gemma 4 checkpoint opens its thought channel when nudged (+100 on `<|channel>`, id 100) and
#: closes it soon (+15 on `<channel|>`, id 101); under a tool grammar the thought is free text in which only the
#: channel's and the call's markers are masked, and the call follows. Sampled (temperature 1) with the first seed
#: that gives a thought with text (which seed does depends on the CPU's float summation order).
THOUGHT = {"logit_bias": {"100": 100, "101": 15}}
G4_TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"]}}


def _seeded(make, has_thought):
    for seed in range(40):
        answer = make(seed)
        if has_thought(answer):
            return seed, answer
    pytest.fail("no seed in 40 gave a thought with text")


def test_responses_reasoning_item_on_gemma4(gemma4_stack):
    stack = gemma4_stack[0]
    client, model = _openai(stack), _model(stack)

    def kw(seed):
        return {"model": model, "input": "Weather in Paris?", "reasoning": {"effort": "high"}, "tools": [G4_TOOL],
                "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 100,
                "temperature": 1.0, "extra_body": {**THOUGHT, "seed": seed}}

    seed, unary = _seeded(lambda seed: client.responses.create(**kw(seed)),
                          lambda r: r.output and r.output[0].type == "reasoning" and r.output[0].content[0].text)
    assert [item.type for item in unary.output] == ["reasoning", "function_call"]
    assert unary.usage.output_tokens_details.reasoning_tokens >= 3
    with client.responses.stream(**kw(seed)) as stream:
        events = list(stream)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == unary.output[0].content[0].text
    final = events[-1].response
    assert final.usage.output_tokens_details.reasoning_tokens == unary.usage.output_tokens_details.reasoning_tokens
    assert final.output[1].arguments == unary.output[1].arguments


def test_messages_thinking_block_on_gemma4(gemma4_stack):
    stack = gemma4_stack[0]
    client, model = _anthropic(stack), _model(stack)
    tool = {"name": "get_weather", "input_schema": G4_TOOL["parameters"]}

    def kw(seed):
        return {"model": model, "max_tokens": 100, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "thinking": {"type": "enabled", "budget_tokens": 1024}, "tools": [tool],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                "extra_body": {**THOUGHT, "seed": seed, "temperature": 1.0}}

    seed, unary = _seeded(lambda seed: client.messages.create(**kw(seed)),
                          lambda m: m.content and m.content[0].type == "thinking" and m.content[0].thinking)
    assert [b.type for b in unary.content] == ["thinking", "tool_use"] and unary.stop_reason == "tool_use"
    with client.messages.stream(**kw(seed)) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thought = "".join(e.delta.thinking for e in events
                      if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert thought == unary.content[0].thinking == final.content[0].thinking
    assert final.content[1].input == unary.content[1].input
    assert client.messages.count_tokens(model=model, messages=kw(0)["messages"], tools=[tool],
                                        thinking=kw(0)["thinking"]).input_tokens == _prompt(unary.usage)
