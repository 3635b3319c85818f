"""`gemma-serve up --model DIR` serves a Gemma 4 checkpoint directory through the same three services.

The checkpoint is a tiny random Gemma 4 (KV sharing, PLE, double-wide MLP, window 8) with the full 262,144-token
vocabulary, written by transformers, plus a Gemma 4 tokenizer (tests/gemma4_tokenizer.py) and the official chat
template: so the tokenizer service renders with the checkpoint's chat_template.jinja, and the worker loads
safetensors. The served greedy tokens must be transformers' argmax at every step with a clear top-2 gap.
"""

from __future__ import annotations

import shutil

import grpc
import numpy as np
import openai
import pytest

from protos import gateway_pb2, gateway_pb2_grpc, tokenizer_pb2
from tests.e2e.conftest import start_stack, stop_stack
from tests.gemma4_tiny import SHARED, reference_logits, write_checkpoint
from tests.gemma4_tokenizer import write_gemma4_test_tokenizer

pytestmark = pytest.mark.slow
TEMPLATE = __import__("pathlib").Path(__file__).parents[1] / "tokenizer_svc" / "data" / "gemma4_chat_template.jinja"


@pytest.fixture(scope="module")
def gemma4_stack(cache_dir, prepared, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("gemma-4-tiny")
    model = write_checkpoint({**SHARED, "vocab_size": 262_144, "vocab_size_per_layer_input": 262_144}, ckpt)
    write_gemma4_test_tokenizer(ckpt, prepared.dir / "tokenizer.json")
    shutil.copy(TEMPLATE, ckpt / "chat_template.jinja")
    s = start_stack(cache_dir, tmp_path_factory.mktemp("g4log") / "stack.log",
                    ["--model", str(ckpt), "--max-model-len", "128", "--num-slots", "2", "--prefill-chunks", "32"])
    yield s, model
    stop_stack(s)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def test_chat_tokens_are_the_reference_greedy_choice(gemma4_stack):
    stack, model = gemma4_stack
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        chat = gateway_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role=m["role"], content=m["content"])
                                               for m in MESSAGES])
        request = gateway_pb2.GenerateRequest(chat=chat, max_tokens=12, include_special_tokens=True)
        replies = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120))
        with grpc.insecure_channel(f"127.0.0.1:{stack.ports['tokenizer']}") as tchan:
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
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model_id = client.models.list().data[0].id
    assert model_id.startswith("gemma-4-tiny")
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
