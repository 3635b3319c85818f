"""Whatever the server returns is accepted back verbatim as the next turn, and that turn reuses the cache.

Each case sends a real answer's `message` back exactly as the official `openai` client returns it
(`model_dump()`: content null, reasoning_content, cut-off arguments and all) with the next turn — a tool result
per call, else a user message — and checks 200 and a prefix-cache hit: `cached_tokens` >= the previous prompt
plus the answer's completion tokens, minus one prefill chunk (the stack's `--prefill-chunks`). For an answer
shorter than a chunk that bound shows little beyond the previous prompt's reuse; the rendering itself is checked
token for token in tests/tokenizer_svc/test_round_trip_render.py.

Shapes covered, on the embedded Gemma 3 (JSON tool format) and the tiny Gemma 4 stack (native call syntax, its
official Jinja chat template as a checkpoint template):
- parallel calls, content null (`tool_choice: "required"`, finish_reason tool_calls);
- a budget that runs out inside a string argument: the call closed within it (gateway/structured/endings.py; a limit below
  the shortest answer is a 400 naming it, and the shortest answer's length is asked instead);
- text then calls (`tool_choice: "auto"`, content and tool_calls);
- a thought then a call (Gemma 4 thinking: reasoning_content, sent back in the tool-result turn, where the
  template writes the thought back);
- plain text cut by `max_tokens`, and (Gemma 4) cut by a stop string.

Each answer is generated under its own `cache_salt`, so its prompt is computed cold and a request repeated with
a smaller `max_tokens` reproduces the same tokens: the cut cases end a known answer's budget inside its first call's
string (a later call would not be started when it could not fit: gateway/structured/budget.py).
"""

from __future__ import annotations

import json
import pathlib
import re
import uuid

import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
CITIES = [{"role": "user", "content": "What's the weather in Paris, Lagos and Oslo?"}]


def chunk_of(stack) -> int:
    """The largest prefill chunk the stack's worker computes (its `--prefill-chunks`)."""
    args = list(stack.proc.args)
    return max(int(c) for c in args[args.index("--prefill-chunks") + 1].split(","))


def ask(client, messages, salt, **kw):
    """A chat completion under `salt` (greedy unless `temperature` is given; extra body fields merged)."""
    extra = {"cache_salt": salt, **kw.pop("extra_body", {})}
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=client.model, messages=messages, extra_body=extra, **kw)


def send_back(client, chunk, messages, response, salt, **kw):
    """Send `response`'s message back verbatim with the next turn; assert the cache hit; returns the message."""
    message = response.choices[0].message.model_dump()
    calls = message.get("tool_calls") or []
    follow = [{"role": "tool", "tool_call_id": c["id"], "content": '{"temp": 21}'} for c in calls] or \
        [{"role": "user", "content": "Go on."}]
    after = ask(client, messages + [message] + follow, salt, max_tokens=1, **kw)
    previous = response.usage.prompt_tokens + response.usage.completion_tokens
    assert after.usage.prompt_tokens_details.cached_tokens >= previous - chunk, (message, after.usage)
    return message


def fresh() -> str:
    return uuid.uuid4().hex


def cut_inside_a_string(tokens: list[str], gemma4: bool) -> int:
    """The largest token count that ends inside a string of the first call's arguments (`tokens`: the answer's
    token texts, control tokens spelled out). The first call: a budget of that many tokens runs out exactly there,
    whereas a later call is not started when the budget left could not fit it (gateway/structured/budget.py)."""
    for k in range(len(tokens) - 1, 0, -1):
        if gemma4:
            calls = [n for n in range(k) if tokens[n] == "<|tool_call>"]
            inside = len(calls) == 1 and tokens[calls[0]:k].count('<|"|>') % 2 == 1
        else:
            text = "".join(tokens[:k])
            parts = text.split('"arguments": ')
            inside = len(parts) == 2 and "}" not in parts[1] and \
                (parts[1].count('"') - parts[1].count('\\"')) % 2 == 1
        if inside and tokens[k - 1] != '<|"|>':
            return k
    raise AssertionError(f"no string to cut in {tokens}")


def check_calls_whole_and_cut(client, chunk, tools, gemma4, messages=CITIES, max_tokens=150, **kw):
    """A complete parallel-calls answer, then the same answer with a budget that runs out inside its first call's
    string argument (closed within it); both sent back with their tool results."""
    salt = fresh()
    whole = ask(client, messages, salt, tools=tools, tool_choice="required", max_tokens=max_tokens, logprobs=True,
                extra_body={"skip_special_tokens": False}, **kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) >= 2, choice
    assert choice.message.content is None
    send_back(client, chunk, messages, whole, salt, tools=tools)
    k = cut_inside_a_string([t.token for t in choice.logprobs.content], gemma4)
    salt = fresh()
    budget = k
    try:
        cut = ask(client, messages, salt, tools=tools, tool_choice="required", max_tokens=k, **kw)
    except openai.BadRequestError as err:  # k is below the shortest valid answer: refused before generation
        body = err.body
        assert (body["param"], body["code"]) == ("max_tokens", "max_tokens_too_small"), body
        budget = int(re.search(r"answer that .* allows \((\d+) tokens\)", body["message"]).group(1))
        assert budget > k
        cut = ask(client, messages, salt, tools=tools, tool_choice="required", max_tokens=budget, **kw)
    # The budget runs out inside a string argument: the call is closed within it (gateway/structured/endings.py).
    assert cut.choices[0].finish_reason == "tool_calls" and cut.usage.completion_tokens <= budget, cut.choices[0]
    last = cut.choices[0].message.tool_calls[-1].function.arguments
    json.loads(last)
    message = send_back(client, chunk, messages, cut, salt, tools=tools)
    assert message["tool_calls"][-1]["function"]["arguments"] == last


def check_text_cut_by_length_and_stop(client, chunk, max_tokens, with_stop=True, **kw):
    """A text answer cut by max_tokens, then (`with_stop`) the same answer cut by a stop string: a token of its
    last third that starts where the string first occurs (the text returned is then whole tokens, whose ids are
    kept)."""
    salt = fresh()
    long = ask(client, CITIES, salt, max_tokens=max_tokens, logprobs=True, **kw)
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == max_tokens
    send_back(client, chunk, CITIES, long, salt)
    if not with_stop:
        return
    text = long.choices[0].message.content
    tokens = [t.token for t in long.choices[0].logprobs.content]
    starts = [len("".join(tokens[:j])) for j in range(len(tokens))]
    stop = next(tokens[j] for j in range(len(tokens) * 2 // 3, len(tokens))
                if len(tokens[j].strip()) > 1 and text.index(tokens[j]) == starts[j])
    salt = fresh()
    stopped = ask(client, CITIES, salt, max_tokens=max_tokens, stop=[stop], **kw)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:text.index(stop)]
    send_back(client, chunk, CITIES, stopped, salt)


# ---------------------------------------------------------------------------------------------- Gemma 3


@pytest.fixture(scope="module")
def gemma3(stack):
    c = stack.openai()
    c.model = c.models.list().data[0].id
    return c, chunk_of(stack)


def test_gemma3_calls_whole_and_cut(gemma3):
    """The greedy model would repeat calls; within 50 tokens the budget ends the answer after two
    (gateway/structured/budget.py)."""
    check_calls_whole_and_cut(*gemma3, [WEATHER], gemma4=False, max_tokens=50,
                              messages=[{"role": "user", "content": "What's the weather in Paris and in Lagos?"}])


def test_gemma3_text_then_calls(gemma3):
    """An example turn with text before its call, and a nudge toward `{"`, make the greedy model write both."""
    client, chunk = gemma3
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": "Sure.", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "20C"},
                {"role": "user", "content": "Weather in Paris, Lagos and Oslo?"}]
    salt = fresh()
    r = ask(client, messages, salt, tools=[WEATHER], max_tokens=100, logit_bias={"14937": 4})  # 14937: '{"'
    assert r.choices[0].message.content and r.choices[0].message.tool_calls, r.choices[0]
    send_back(client, chunk, messages, r, salt, tools=[WEATHER])


def test_gemma3_text_cut_by_length(gemma3):
    """Length only: a stop-string cut runs the same gateway code, checked on the faster Gemma 4 stack."""
    check_text_cut_by_length_and_stop(*gemma3, max_tokens=70, with_stop=False)


# ---------------------------------------------------------------------------------------------- Gemma 4


@pytest.fixture(scope="module")
def gemma4(gemma4_stack):
    stack, _ = gemma4_stack
    c = stack.openai()
    c.model = c.models.list().data[0].id
    return c, chunk_of(stack)


# The random model's strings are held to an enum and a length.
G4_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lagos", "Oslo"]}, "note": {"type": "string", "maxLength": 40}},
    "required": ["city", "note"]}}}


def test_gemma4_calls_whole_and_cut(gemma4):
    """A nudge toward `<|tool_call>` (48) makes the random model write several calls."""
    check_calls_whole_and_cut(*gemma4, [G4_WEATHER], gemma4=True, logit_bias={"48": 5})


def test_gemma4_text_then_calls(gemma4):
    """A nudge toward `<|tool_call>` (48) makes the random model call after some text."""
    client, chunk = gemma4
    salt = fresh()
    r = ask(client, CITIES, salt, tools=[G4_WEATHER], max_tokens=120, logit_bias={"48": 10})
    assert r.choices[0].message.content and r.choices[0].message.tool_calls, r.choices[0]
    send_back(client, chunk, CITIES, r, salt, tools=[G4_WEATHER])


#: Control tokens the template writes for a thought then one call (the call's grammar holds its own tokens to
#: these), and the tokens that end the turn.
G4_ANSWER_CONTROLS = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>',
                      "<|tool_response>", "<turn|>", "<eos>"}


def control_spellings(stack) -> set[str]:
    """The spellings of the control tokens of a checkpoint stack's tokenizer (its `--model` directory)."""
    args = list(stack.proc.args)
    data = json.loads((pathlib.Path(args[args.index("--model") + 1]) / "tokenizer.json").read_text())
    return {t["content"] for t in data["added_tokens"] if t["special"]}


def test_gemma4_thought_then_call(gemma4, gemma4_stack):
    """Thinking on; the model is nudged to open its thought channel (+100 on `<|channel>`) and to close it soon
    (+15 on `<channel|>`); the thought comes back in the tool-result turn, where the template writes it.

    The random model may sample any of the vocabulary's reserved control tokens (`<unusedN>`, some 6,000) in its
    thought; the text leaves it out, the template renders no such token, so those ids are rightly never used
    (Segment.fallback) and the turn is re-tokenized. Which seed's answer holds one depends on the CPU (its float
    summation order), so the seed is the first whose answer's control tokens are exactly the thought channel's
    and the call's (a probe with `skip_special_tokens` off spells them; the same seed under a fresh salt gives
    the same tokens)."""
    client, chunk = gemma4
    controls = control_spellings(gemma4_stack[0])
    kw = {"tools": [G4_WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 100,
          "temperature": 1.0, "reasoning_effort": "high", "logit_bias": {"100": 100, "101": 15}}
    for seed in range(40):
        probe = ask(client, CITIES, fresh(), seed=seed, logprobs=True,
                    extra_body={"skip_special_tokens": False}, **kw)
        spelled = [t.token for t in probe.choices[0].logprobs.content if t.token in controls]
        if spelled[:2] == ["<|channel>", "<channel|>"] and set(spelled) <= G4_ANSWER_CONTROLS:
            break
    else:
        pytest.fail("no seed in 40 gave a thought without a stray control token")
    salt = fresh()
    r = ask(client, CITIES, salt, seed=seed, **kw)
    message = r.choices[0].message.model_dump()
    assert message.get("reasoning_content") and message["tool_calls"], message
    send_back(client, chunk, CITIES, r, salt, tools=[G4_WEATHER], reasoning_effort="high")


def test_gemma4_text_cut_by_length_and_by_stop(gemma4):
    """Sampled with a seed whose text holds no control token (ids with one are never used: Segment.fallback)."""
    check_text_cut_by_length_and_stop(*gemma4, max_tokens=40, temperature=1.0, seed=2)
