"""Prefix reuse survives the real round trip: an agent resending its conversation (with the model's own answers
as assistant messages) through /v1/chat/completions gets cache hits, turn after turn, and a system prompt shared
by two conversations is reused."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
SYSTEM = ("You are a careful agent. You read tool results, decide on the next step, and answer briefly. "
          "Always check the units and the dates in every result before you use them. ") * 3


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


def chat(client, messages, max_tokens=12, stream=False):
    if not stream:
        r = client.chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=max_tokens,
                                           temperature=0)
        return r.choices[0].message.content, r.usage
    chunks = list(client.chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=max_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_multi_turn_agent_gets_hits(client, stream):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {stream}: list the files in the build directory."}]
    previous_total = None
    for turn in range(4):
        answer, usage = chat(client, messages, stream=stream)
        if previous_total is not None:
            # Everything up to the previous answer (its last token was never fed to the model) is reused.
            assert usage.prompt_tokens_details.cached_tokens >= previous_total - 1, (turn, usage)
        previous_total = usage.prompt_tokens + usage.completion_tokens
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"Tool result {turn}: {{\"files\": [\"a{turn}.o\", \"b.o\"]}}"}]


def test_shared_system_prompt_across_conversations(client):
    _, first = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Conversation A."}])
    _, second = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Conversation B."}])
    _, third = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Conversation C."}])
    system_tokens = first.prompt_tokens - 10  # the system text is all but the last few prompt tokens
    assert max(second.prompt_tokens_details.cached_tokens, third.prompt_tokens_details.cached_tokens) >= system_tokens


def test_reused_and_cold_answers_are_identical(client):
    """The same conversation asked twice: the second time its prompt is cached, the answer is the same."""
    messages = [{"role": "user", "content": "Describe a quiet harbour at dawn in one sentence."}]
    cold, u1 = chat(client, messages, max_tokens=20)
    warm, u2 = chat(client, messages, max_tokens=20)
    assert u2.prompt_tokens_details.cached_tokens == u2.prompt_tokens - 1
    assert warm == cold
