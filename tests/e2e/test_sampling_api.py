"""Sampling features through the REST API, checked against transformers' logits (the independent reference):
logprobs and top logprobs, n > 1, logit bias, presence/frequency penalties, allowed_token_ids."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow
PROMPT = "The history of the city begins"
# |our logprob - transformers' float32 one|: the stack runs the CPU default, int8 products with activations quantized
# per block of 32 as llama.cpp's Q8_0 (batch-invariant). Their logits sit further from float32's than the bfloat16
# path's (mean KL 4e-4 against 2e-5 over the long test text, tests/model_worker/test_gemma3_numerics.py: about 4.5x
# the logit error, KL growing with its square). The bfloat16 path's largest difference over this prompt's 6 x 5
# logprobs measured 0.056 (Intel Xeon with AMX; 0.014 on an AMD EPYC Zen 4), so int8's is expected near 0.25;
# it measured 0.10 on the AMD EPYC (a rank-4 logprob; the chosen tokens' within 0.04). A wrong formula (a
# temperature applied to logprobs, a missing normalisation, an off-by-one position) moves them by more than that:
# by whole units for the last two.
LOGPROB_TOL = 0.25


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


def ref_logprobs(hf_gemma3, ids: list[int]) -> np.ndarray:
    """log_softmax of transformers' logits at every position, float64."""
    import torch

    with torch.no_grad():
        logits = hf_gemma3(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def test_logprobs_equal_log_softmax_of_reference_logits(client, text_tokenizer, hf_gemma3):
    r = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    prompt_ids = text_tokenizer.encode(PROMPT, add_bos=True)
    out_ids = [text_tokenizer.token_id(t) if False else None for t in lp.tokens]  # noqa: F841 (strings only)
    out_ids = text_tokenizer.encode(r.choices[0].text, parse_special=False)
    assert len(out_ids) == len(lp.token_logprobs) == 6
    ref = ref_logprobs(hf_gemma3, prompt_ids + out_ids)[len(prompt_ids) - 1 : -1]
    ours = np.asarray(lp.token_logprobs)
    expected = ref[np.arange(6), out_ids]
    assert np.abs(ours - expected).max() < LOGPROB_TOL, (ours, expected)
    for step, top in enumerate(lp.top_logprobs):
        assert len(top) == 5
        best = np.argsort(-ref[step])[:5]
        assert np.allclose(sorted(top.values(), reverse=True), ref[step][best], atol=LOGPROB_TOL)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model="gemma-3-270m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model="gemma-3-270m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert np.allclose([c.logprob for c in streamed], [c.logprob for c in content])


def test_n_choices_share_the_prompt_and_match_single_requests(client):
    single = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=8, temperature=0)
    multi = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=8, temperature=0, n=3)
    assert [c.text for c in multi.choices] == [single.choices[0].text] * 3
    assert multi.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert multi.usage.prompt_tokens == single.usage.prompt_tokens
    sampled = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                        n=3, seed=11)
    again = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                      n=3, seed=11)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    assert len({c.text for c in sampled.choices}) > 1, "seed + i gives each choice its own stream"


def test_logit_bias_forces_and_forbids(client, text_tokenizer):
    target = text_tokenizer.encode(" banana", parse_special=False)[0]
    r = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(target): 100})
    assert text_tokenizer.encode(r.choices[0].text, parse_special=False) == [target] * 4
    base = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=1, temperature=0)
    first = text_tokenizer.encode(base.choices[0].text, parse_special=False)[0]
    banned = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert text_tokenizer.encode(banned.choices[0].text, parse_special=False)[0] != first


def test_penalties_follow_the_openai_formula_on_reference_logits(client, text_tokenizer, hf_gemma3):
    """Greedy with presence/frequency penalties picks argmax(logits - f * count - p * [count > 0]) at every step,
    where the logits are transformers' and the counts those of the tokens generated so far."""
    presence, frequency = 0.8, 1.2
    prompt = "one one one one one one one one"  # greedy repeats " one": the penalties must change that
    r = client.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=10, temperature=0,
                                  presence_penalty=presence, frequency_penalty=frequency)
    prompt_ids = text_tokenizer.encode(prompt, add_bos=True)
    out_ids = text_tokenizer.encode(r.choices[0].text, parse_special=False)
    import torch

    with torch.no_grad():
        logits = hf_gemma3(torch.tensor([prompt_ids + out_ids])).logits[0, len(prompt_ids) - 1 :].double().numpy()
    counts = np.zeros(logits.shape[-1])
    for step, token in enumerate(out_ids):
        adjusted = logits[step] - frequency * counts - presence * (counts > 0)
        top2 = np.sort(adjusted)[-2:]
        if top2[1] - top2[0] > 0.5:  # a gap the default bfloat16 products cannot flip (test_openai_api)
            assert token == int(adjusted.argmax()), step
        counts[token] += 1
    plain = client.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=10, temperature=0)
    assert plain.choices[0].text != r.choices[0].text, "the penalties should change this continuation"


def test_allowed_token_ids_restrict_every_step(client, text_tokenizer):
    allowed = text_tokenizer.encode(" one two three four five", parse_special=False)
    r = client.completions.create(model="gemma-3-270m", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": allowed})
    assert set(text_tokenizer.encode(r.choices[0].text, parse_special=False)) <= set(allowed)
    assert r.usage.completion_tokens == 8


def test_grpc_generate_n_logprobs_and_bias(stack, text_tokenizer):
    import grpc

    from protos import common_pb2, gateway_pb2, gateway_pb2_grpc

    target = text_tokenizer.encode(" banana", parse_special=False)[0]
    request = gateway_pb2.GenerateRequest(
        text=PROMPT, max_tokens=3, n=2,
        sampling=common_pb2.SamplingParams(temperature=0.0, top_logprobs=4, logit_bias={target: 100.0}))
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        replies = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120))
    by_choice = {0: [], 1: []}
    for r in replies:
        by_choice[r.index] += list(r.tokens)
    for tokens in by_choice.values():
        assert [t.token_id for t in tokens] == [target] * 3
        assert all(len(t.top_logprobs) == 4 and t.top_logprobs[0].token_id == target for t in tokens)
    assert sum(r.usage.completion_tokens for r in replies if r.finish_reason) == 6


def test_seeded_and_greedy_requests_repeat_exactly_alone_batched_and_as_prefix_hits(client):
    """The default worker mode is batch-invariant (docs/architecture.md): one seeded sampled request gives one
    text sent alone three times (the first computes its prompt cold, the next ones hit the prefix cache) and once
    among concurrent other requests (batched with them, in mixed steps while they prefill); a greedy request
    gives the same tokens as a prefix hit and cold (another `cache_salt` shares no cached prefix)."""
    from concurrent.futures import ThreadPoolExecutor

    messages = [{"role": "system", "content": "You are a careful assistant. " * 12},
                {"role": "user", "content": "Write one sentence about the sea."}]
    seeded = dict(model="gemma-3-270m", messages=messages, max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)

    def ask(salt: str, **kw):
        r = client.chat.completions.create(**kw, extra_body={"cache_salt": salt})
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    alone = [ask("repro-seeded", **seeded) for _ in range(3)]
    assert alone[0][1] == 0 and alone[1][1] > 0, f"expected a cold run, then prefix hits: {alone}"
    others = [dict(model="gemma-3-270m", max_tokens=24, temperature=1.0, seed=i,
                   messages=[{"role": "user", "content": f"Tell a story about the number {i}. " * (1 + 3 * i)}])
              for i in range(3)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, f"repro-other-{i}", **kw) for i, kw in enumerate(others)]
        batched = pool.submit(ask, "repro-batched", **seeded)
        [f.result() for f in futures]
        batched = batched.result()
    assert {text for text, _ in alone} == {batched[0]}, (alone, batched)

    greedy = dict(model="gemma-3-270m", messages=messages, max_tokens=24, temperature=0)
    cold, hit, cold_again = ask("repro-greedy", **greedy), ask("repro-greedy", **greedy), ask("repro-cold", **greedy)
    assert hit[1] > 0 and cold_again[1] == 0
    assert cold[0] == hit[0] == cold_again[0]
