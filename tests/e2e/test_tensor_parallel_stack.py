"""`gemma-serve up --tensor-parallel 2` on this CPU (two simulated devices: the worker sets XLA's host device
count itself): it serves chat requests, a repeated conversation is a prefix hit, and its greedy answers equal the
single-device embedded stack's up to a near tie: the split sums its partial products in another order, whose
float32 last bits the bfloat16 products turn into bfloat16-sized differences (the bfloat16 path's mean |Δlogit|
against float32 is 0.04; docs/performance.md), so where the answers part, the single-device stack's two best
tokens at that position must be within TIE of each other and the split stack's token one of them. The worker splits weights, logits and penalties over both devices (its log says
what it kept whole: the model has one KV head)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["Name three primary colours.", "Write a haiku about the sea.", "What is 12 times 12?"]


TIE = 0.1  # logprob gap of the two best tokens within which the split's bfloat16-sized differences may pick either


def _chat(base: str, content: str, max_tokens: int = 12) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=300, json={
        "model": "gemma-3-270m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(answer: dict) -> list[dict]:
    return answer["choices"][0]["logprobs"]["content"]


def test_a_two_device_stack_answers_like_the_single_device_one_and_reuses_prefixes(tp_stack, stack):
    for prompt in PROMPTS:
        split = _chat(tp_stack.base_url, prompt)
        whole = _chat(stack.base_url, prompt)
        a, b = _tokens(split), _tokens(whole)
        same = [x["token"] == y["token"] for x, y in zip(a, b)]
        if all(same):
            assert split["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"], prompt
            assert split["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
            continue
        at = same.index(False)  # the first token where they part: a tie in the single-device logits
        best = b[at]["top_logprobs"]
        assert best[0]["logprob"] - best[1]["logprob"] < TIE and a[at]["token"] in {t["token"] for t in best}, \
            (prompt, at, a[at], b[at])
    again = _chat(tp_stack.base_url, PROMPTS[-1])  # the same conversation: its KV is still in the slot
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["message"]["content"] == split["choices"][0]["message"]["content"]
    log = tp_stack.log()
    assert "tensor parallel 2" in log, log[-2000:]
