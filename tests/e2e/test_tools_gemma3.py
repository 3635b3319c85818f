"""Tool calls with the embedded Gemma 3 270M, which has no native tool format: this project's JSON format
(families/gemma3/gateway.py docstring), declared in the first user turn by the built-in template and constrained by
the grammar. Judged by the official `openai` client and jsonschema, not by the prose of a base model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

pytestmark = pytest.mark.slow

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look up a word.", "parameters": {
    "type": "object",
    "properties": {"word": {"type": "string", "minLength": 1, "maxLength": 10},
                   "lang": {"enum": ["en", "fr"]},
                   "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["word", "lang"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What does 'chat' mean in French?"}]


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


@pytest.mark.parametrize("seed", range(3))
def test_required_calls_validate(client, seed):
    r = client.chat.completions.create(model="gemma-3-270m", messages=MESSAGES, tools=[LOOKUP],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                       temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.function.name == "lookup" and call.id
        jsonschema.validate(json.loads(call.function.arguments), LOOKUP["function"]["parameters"])


def test_stream_equals_non_stream_and_history_round_trip(client):
    kw = dict(model="gemma-3-270m", messages=MESSAGES, tools=[LOOKUP], tool_choice="required",
              parallel_tool_calls=False, max_tokens=100, temperature=0)
    full = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, list] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            assert not ch.delta.content  # no markup leaks into content
            for d in ch.delta.tool_calls or []:
                calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
    assert [tuple(v) for v in calls.values()] == \
        [(t.function.name, t.function.arguments) for t in full.message.tool_calls]  # ids are per response
    # Send the call back with a result: it renders (Gemma 3 has no tool role: a user turn with the result).
    call = full.message.tool_calls[0]
    follow = client.chat.completions.create(model="gemma-3-270m", max_tokens=5, temperature=0, tools=[LOOKUP],
                                            tool_choice="none", messages=MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "a cat"}])
    assert follow.choices[0].message.tool_calls is None


def test_auto_gives_text_or_valid_calls(client):
    def ask(seed: int):
        return client.chat.completions.create(model="gemma-3-270m", messages=MESSAGES, tools=[LOOKUP],
                                              max_tokens=40, temperature=1.0, seed=seed).choices[0]

    with ThreadPoolExecutor(3) as pool:  # seeded rows are batch-invariant: together they decode in shared steps
        choices = list(pool.map(ask, range(3)))
    for choice in choices:
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), LOOKUP["function"]["parameters"])
        # the lazy trigger: any `{"tool_calls"` the model writes becomes a call, never content
        assert '{"tool_calls"' not in (choice.message.content or "")


def test_a_tool_turn_sent_back_hits_the_cache(client):
    """The assistant's tool-call message sent back as returned (content null) renders from the answer's exact ids
    (remembered under its tool calls), so the next turn reuses the KV through the end of the call."""
    kw = dict(model="gemma-3-270m", tools=[LOOKUP], parallel_tool_calls=False, temperature=0)
    first = client.chat.completions.create(messages=MESSAGES, tool_choice="required", max_tokens=100, **kw)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                           {"role": "tool", "tool_call_id": call.id, "content": "a cat"}]
    second = client.chat.completions.create(messages=messages, tool_choice="auto", max_tokens=3, **kw)
    assert second.usage.prompt_tokens_details.cached_tokens >= \
        first.usage.prompt_tokens + first.usage.completion_tokens - 1, (first.usage, second.usage)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                            "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}
# An earlier turn that wrote text before its call: the greedy model does the same in the next turn.
TEXT_THEN_CALL = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking Paris.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "a", "content": "20C"},
    {"role": "user", "content": "Weather in Oslo?"},
]


def test_auto_call_after_text_is_parsed_mid_answer(client):
    """tool_choice auto, a pinned prompt whose greedy answer writes text and then `{"tool_calls"` (the lazy
    trigger) mid-answer: the call is parsed, validated and streamed as tool_calls; content is only the text
    before it; the stream equals the non-streamed answer."""
    kw = dict(model="gemma-3-270m", messages=TEXT_THEN_CALL, tools=[WEATHER], tool_choice="auto", max_tokens=60,
              temperature=0)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    content = choice.message.content or ""
    assert content.strip() and "{" not in content, "the call starts mid-answer, after text"
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    text, calls = "", {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
    assert text == content
    assert list(calls.values()) == [[c.function.name, c.function.arguments] for c in choice.message.tool_calls]


def test_budget_aware_ending_gives_complete_calls(client, stack):
    """The base model writes one call after another under `required`; with max_tokens 80 the answer ends after
    the last call that fits (finish_reason tool_calls, every call complete), and the ending is counted."""
    def endings() -> float:
        with stack.http(timeout=10) as http:
            text = http.get("/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith('gemma_serve:gateway_budget_endings_total{kind="tool_calls"}'))

    def ask(seed: int):
        return client.chat.completions.create(
            model="gemma-3-270m", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
            tool_choice="required", max_tokens=80, temperature=1.0, seed=seed)

    before = endings()
    with ThreadPoolExecutor(2) as pool:  # seeds whose answers run into the budget (others stop after one call)
        answers = list(pool.map(ask, (1, 6)))
    for r in answers:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (choice, r.usage)
        assert r.usage.completion_tokens <= 80 and len(choice.message.tool_calls) >= 2
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert endings() >= before + 1
