"""`gemma-serve up --tensor-parallel 2` on this CPU (two simulated devices: the worker sets XLA's host device
count itself): it serves chat requests, a repeated conversation is a prefix hit, and its greedy answers equal the
single-device embedded stack's (the split sums in another order, which moves logits by ~1e-5, far below the
top-2 gaps of these answers). The worker splits weights, logits and penalties over both devices (its log says
what it kept whole: the model has one KV head)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["Name three primary colours.", "Write a haiku about the sea.", "What is 12 times 12?"]


def _chat(base: str, content: str, max_tokens: int = 12) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=300, json={
        "model": "gemma-3-270m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_two_device_stack_answers_like_the_single_device_one_and_reuses_prefixes(tp_stack, stack):
    for prompt in PROMPTS:
        split = _chat(tp_stack.base_url, prompt)
        whole = _chat(stack.base_url, prompt)
        assert split["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"], prompt
        assert split["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    again = _chat(tp_stack.base_url, PROMPTS[-1])  # the same conversation: its KV is still in the slot
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["message"]["content"] == split["choices"][0]["message"]["content"]
    log = tp_stack.log()
    assert "tensor parallel 2" in log, log[-2000:]
