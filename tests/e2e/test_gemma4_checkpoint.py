"""`gemma-serve up --model DIR` serves a Gemma 4 checkpoint directory through the same three services.

The checkpoint is a tiny random Gemma 4 (KV sharing, PLE, double-wide MLP, window 8) with the full 262,144-token
vocabulary, written by transformers, plus a Gemma 4 tokenizer (tests/gemma4_tokenizer.py) and the official chat
template: so the tokenizer service renders with the checkpoint's chat_template.jinja, and the worker loads
safetensors. The served greedy tokens must be transformers' argmax at every step with a clear top-2 gap.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from protos import gateway_pb2, gateway_pb2_grpc, tokenizer_pb2
from tests.gemma4_tiny import reference_logits

pytestmark = pytest.mark.slow


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def test_chat_tokens_are_the_reference_greedy_choice(gemma4_stack):
    stack, model = gemma4_stack
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        chat = gateway_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role=m["role"], content=m["content"])
                                               for m in MESSAGES])
        request = gateway_pb2.GenerateRequest(chat=chat, max_tokens=12, include_special_tokens=True)
        replies = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120))
        with stack.internal_channel("tokenizer") as tchan:
            from protos import tokenizer_pb2_grpc

            prompt = list(tokenizer_pb2_grpc.TokenizerStub(tchan).ApplyChatTemplate(
                tokenizer_pb2.ChatTemplateRequest(messages=chat.messages, add_generation_prompt=True)).token_ids)
    out = [t.token_id for r in replies for t in r.tokens]
    assert replies[-1].usage.prompt_tokens == len(prompt) and replies[-1].usage.completion_tokens == len(out)
    assert prompt[0] == 2 and prompt[-3:-1] == [105, prompt[-2]]  # ... <|turn>model\n
    ref = reference_logits(model, prompt + out[:-1])[len(prompt) - 1:]
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    assert clear.sum() >= len(out) // 2
    assert np.array_equal(np.asarray(out)[clear], ref.argmax(-1)[clear]), (out, ref.argmax(-1).tolist())


def test_openai_chat_and_models(gemma4_stack):
    stack, _ = gemma4_stack
    client = stack.openai(timeout=120)
    model_id = client.models.list().data[0].id
    assert model_id.startswith("gemma-4-tiny")
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
