"""`gemma-serve up --tensor-parallel 2` on this CPU (two simulated devices: the worker sets XLA's host device
count itself): it serves chat requests, a repeated conversation is a prefix hit, and its greedy answers equal the
single-device embedded stack's up to a near tie. The split runs bfloat16 products (int8 products are not split
over devices), the single-device stack the CPU default, int8 products with Q8_0 activations: where the answers
part, the split's token must be one of the single-device stack's five best at that position, within TIE of its
best (both paths' logits sit near float32's: mean KL 2e-5 for bfloat16, 4e-4 for int8 over the long test text,
tests/model_worker/test_gemma3_numerics.py, so two tokens closer than about twice int8's logprob error may swap).
The worker splits weights and logits over both devices (its log says what it kept whole: the model has
one KV head; the penalty history, a few token ids a slot, is kept whole on each)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["Name three primary colours.", "Write a haiku about the sea.", "What is 12 times 12?"]


TIE = 0.25  # logprob gap within which int8's and bfloat16's differences from float32 may pick either token


def _chat(stack, content: str, max_tokens: int = 12) -> dict:
    with stack.http(timeout=300) as http:
        r = http.post("/v1/chat/completions", json={
            "model": "gemma-3-270m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(answer: dict) -> list[dict]:
    return answer["choices"][0]["logprobs"]["content"]


def test_a_two_device_stack_answers_like_the_single_device_one_and_reuses_prefixes(tp_stack, stack):
    for prompt in PROMPTS:
        split = _chat(tp_stack, prompt)
        whole = _chat(stack, prompt)
        a, b = _tokens(split), _tokens(whole)
        same = [x["token"] == y["token"] for x, y in zip(a, b)]
        if all(same):
            assert split["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"], prompt
            assert split["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
            continue
        at = same.index(False)  # the first token where they part: a near tie in the single-device logits
        best = {t["token"]: t["logprob"] for t in b[at]["top_logprobs"]}
        assert a[at]["token"] in best and max(best.values()) - best[a[at]["token"]] < TIE, (prompt, at, a[at], b[at])
    again = _chat(tp_stack, PROMPTS[-1])  # the same conversation: its KV is still in the slot
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["message"]["content"] == split["choices"][0]["message"]["content"]
    log = tp_stack.log()
    assert "tensor parallel 2" in log, log[-2000:]
