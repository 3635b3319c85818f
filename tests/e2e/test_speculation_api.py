"""Speculative decoding through the real stack (on by default): OpenAI's Predicted Outputs field and its usage
counts with the official client, answers that are the same with or without drafts (greedy and seeded, streamed
and not), and drafts that are actually accepted (the worker's spec-decode metrics move), so these tests fail if
speculation silently never runs. Exactness against speculation off, bit for bit: tests/model_worker/
test_speculation.py."""

from __future__ import annotations

import json
import re

import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "gemma-3-270m"
TEXT = ("def area(width, height):\n    return width * height\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
MESSAGES = [{"role": "user", "content": "Copy this code exactly:\n\n" + TEXT}]


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


def accepted_drafts(stack) -> float:
    """The worker's `gemma_serve:spec_decode_num_accepted_tokens` now."""
    body = stack.worker_metrics(timeout=30)
    match = re.search(r"^gemma_serve:spec_decode_num_accepted_tokens_total (\S+)$", body, re.MULTILINE)
    assert match, "the worker exports the accepted draft tokens"
    return float(match.group(1))


def test_a_prediction_changes_nothing_but_the_usage_counts(client, stack):
    """The answer with its own text as the prediction equals the answer without one (greedy, with logprobs);
    the usage reports the prediction's tokens as accepted, and the worker accepted drafts."""
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=48, temperature=0,
                                           logprobs=True)
    answer = plain.choices[0].message.content
    before = accepted_drafts(stack)
    predicted = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=48, temperature=0,
                                               logprobs=True, prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    assert [c.logprob for c in predicted.choices[0].logprobs.content] == \
        [c.logprob for c in plain.choices[0].logprobs.content]
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= predicted.usage.completion_tokens - 1
    assert details.rejected_prediction_tokens <= 1
    assert accepted_drafts(stack) > before, "the prediction's drafts were verified and accepted"
    assert plain.usage.completion_tokens_details is None or \
        not plain.usage.completion_tokens_details.accepted_prediction_tokens


def test_a_wrong_prediction_and_seeded_sampling_change_nothing(client, stack):
    """Seeded sampling with a prediction that is wrong after its first words (list-form content, streamed with
    usage): the same text as without a prediction; accepted + rejected = the prediction's tokens."""
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0.8, top_p=0.9, seed=1234)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    prediction = {"type": "content", "content": [{"type": "text", "text": TEXT[:30]},
                                                 {"type": "text", "text": " unrelated words " * 4}]}
    chunks = list(client.chat.completions.create(**kwargs, prediction=prediction, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    details = chunks[-1].usage.completion_tokens_details
    body = json.dumps({"model": MODEL, "prompt": TEXT[:30] + " unrelated words " * 4, "add_special_tokens": False})
    with stack.http(timeout=60) as http:
        r = http.post("/tokenize", content=body.encode(), headers={"Content-Type": "application/json"})
    r.raise_for_status()
    tokens = r.json()["count"]
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == tokens


def test_a_bad_prediction_is_a_400(client):
    for bad in ({"type": "text", "content": "x"}, {"type": "content"}, {"type": "content", "content": 5}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, prediction=bad)


def test_constrained_answers_are_unchanged_by_a_prediction(client):
    """A JSON-schema answer and a required tool call (grammar-constrained: their tokens come from the grammar's
    masks and forced runs, so the worker drafts nothing for them) with a prediction of their own text: the same
    answers as without one."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["name", "count"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
    cases = [dict(response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}),
             dict(tools=tools, tool_choice="required")]
    for extra in cases:
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, **extra)
        plain = client.chat.completions.create(**kwargs).choices[0].message
        text = plain.content or plain.tool_calls[0].function.arguments
        again = client.chat.completions.create(**kwargs, prediction={"type": "content", "content": text})
        assert again.choices[0].message.content == plain.content
        assert [c.function.arguments for c in again.choices[0].message.tool_calls or []] == \
            [c.function.arguments for c in plain.tool_calls or []]


def test_constrained_answers_draft_and_match_answers_that_cannot(client, stack):
    """A JSON-schema answer and tool calls (`required` and `auto`) whose conversation holds what they will say:
    alone, the gateway drafts with the grammar's masks (forced tokens and the context's n-grams) and the worker
    accepts drafts; sent three at once (more rows than a verify step takes, so nothing is verified) each answer
    is the same, tokens and logprobs."""
    import concurrent.futures

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}]
    earlier = '{"city": "Reykjavik", "days": 3}'
    messages = [{"role": "user", "content": f"Weather for {earlier}? Answer with exactly {earlier}"}]
    cases = [dict(response_format={"type": "json_schema", "json_schema": {"name": "q", "schema": schema}}),
             dict(tools=tools, tool_choice="required"), dict(tools=tools, tool_choice="auto")]
    for extra in cases:
        kwargs = dict(model=MODEL, messages=messages, max_tokens=48, temperature=0, logprobs=True, **extra)
        before = accepted_drafts(stack)
        alone = client.chat.completions.create(**kwargs).choices[0]
        drafted = accepted_drafts(stack) - before
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            crowd = [f.result().choices[0] for f in [pool.submit(client.chat.completions.create, **kwargs)
                                                     for _ in range(3)]]
        for other in crowd:
            assert other.message.content == alone.message.content
            assert [c.function.arguments for c in other.message.tool_calls or []] == \
                [c.function.arguments for c in alone.message.tool_calls or []]
            assert [c.logprob for c in other.logprobs.content or []] == [c.logprob for c in alone.logprobs.content or []]
        assert drafted > 0, f"{extra}: drafts were accepted alone"


def test_stop_strings_n_and_penalties_match_answers_that_cannot_draft(client, stack):
    """Stop strings (one inside a drafted run), `n` = 2 with seeded sampling, and penalties with logit_bias, on a
    prompt the model echoes (so drafts are accepted): each alone, where its rows fit a verify step, and three at
    once, where they do not and nothing is verified — the same choices, text and logprobs."""
    import concurrent.futures

    cases = [dict(stop=["perimeter"], temperature=0),
             dict(n=2, temperature=0.9, top_p=0.95, seed=7),
             dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"2": -5})]
    before = accepted_drafts(stack)
    for extra in cases:
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=40, logprobs=True, **extra)
        alone = client.chat.completions.create(**kwargs).choices
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            crowd = [f.result().choices for f in [pool.submit(client.chat.completions.create, **kwargs)
                                                  for _ in range(3)]]
        for choices in crowd:
            assert [c.message.content for c in choices] == [c.message.content for c in alone], extra
            assert [[t.logprob for t in c.logprobs.content] for c in choices] == \
                [[t.logprob for t in c.logprobs.content] for c in alone], extra
        if "stop" in extra:
            assert "perimeter" not in alone[0].message.content and alone[0].finish_reason == "stop"
    assert accepted_drafts(stack) > before, "drafts were verified and accepted alone"
