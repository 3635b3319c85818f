"""End to end: the three real processes driven with the official `openai` client (and raw HTTP for bad input)."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.e2e.stacks import MAX_MODEL_LEN  # the stack fixture's --max-model-len

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id

# A top-2 gap the default bfloat16 products cannot flip: their logits differ from float32's by at most ~0.3-0.55 on
# the embedded model (tests/model_worker/test_gemma3_numerics.py), so only a gap above 0.5 must keep its argmax.
CLEAR_GAP = 0.5


def test_models_and_health(stack, client, model_id):
    assert model_id == "gemma-3-270m"
    with stack.http() as http:
        assert http.get("/health").json()["status"] == "ok"


def test_completion_is_the_model_greedy_continuation(client, model_id, text_tokenizer, hf_gemma3):
    """The REST answer is the reference model's greedy continuation wherever its top-2 gap is clear."""
    import torch

    prompt = "The capital of France is"
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, **GREEDY)
    choice = r.choices[0]
    prompt_ids = text_tokenizer.encode(prompt, add_bos=True)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 8 and choice.finish_reason == "length"
    out_ids = text_tokenizer.encode(choice.text, parse_special=False)
    with torch.no_grad():
        ref = hf_gemma3(torch.tensor([prompt_ids + out_ids])).logits[0, len(prompt_ids) - 1 : -1].numpy()
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > CLEAR_GAP
    assert np.array_equal(np.asarray(out_ids)[clear], ref.argmax(-1)[clear]), (choice.text, out_ids)


def _stream_completion(client, model_id, **kw):
    chunks = list(client.completions.create(model=model_id, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and not chunks[-1].choices, "usage must come once, in a final chunk without choices"
    return text, finish, usage[0], chunks


def test_completion_stream_equals_non_stream(client, model_id):
    kw = dict(prompt="Once upon a time", max_tokens=24, **GREEDY)
    full = client.completions.create(model=model_id, **kw)
    text, finish, usage, _ = _stream_completion(client, model_id, **kw)
    assert text == full.choices[0].text
    assert finish == [full.choices[0].finish_reason]
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_chat_stream_equals_non_stream(client, model_id):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=model_id, messages=messages, max_tokens=30, **GREEDY)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=30, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_chat_stops_at_end_of_turn(client, model_id):
    """A chat answer that ends by itself finishes with 'stop' and no control-token text leaks."""
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Say hello."}], max_tokens=60, **GREEDY
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert "<end_of_turn>" not in r.choices[0].message.content
    assert "<start_of_turn>" not in r.choices[0].message.content


def test_multibyte_stream_has_no_replacement_characters(client, model_id):
    kw = dict(prompt="日本の首都は東京です。中国の首都は北京です。韓国の首都は", max_tokens=24, **GREEDY)
    full = client.completions.create(model=model_id, **kw).choices[0].text
    text, _, _, chunks = _stream_completion(client, model_id, **kw)
    assert text == full
    assert any(ord(ch) > 0x7F for ch in text), text
    for c in chunks:
        if c.choices:
            assert "\ufffd" not in c.choices[0].text


def test_stop_string_straddling_tokens(client, model_id, text_tokenizer):
    kw = dict(prompt="The capital of France is", max_tokens=16, **GREEDY)
    base = client.completions.create(model=model_id, **kw)
    text = base.choices[0].text
    ids = text_tokenizer.encode(text, parse_special=False)
    pieces = [text_tokenizer.decode([i]) for i in ids]
    # A stop string made of the end of token 2 and the start of token 3 (both non-trivial pieces).
    k = next(k for k in range(1, len(pieces) - 1) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    stop = pieces[k][-1:] + pieces[k + 1][:1]
    start = text.find(stop)
    r = client.completions.create(model=model_id, stop=[stop], **kw)
    assert r.choices[0].text == text[:start]
    assert r.choices[0].finish_reason == "stop"
    # Every token up to the one completing the stop string is counted, none after.
    consumed, n = 0, 0
    while consumed < start + len(stop):
        consumed += len(pieces[n])
        n += 1
    assert r.usage.completion_tokens == n
    streamed, finish, usage, _ = _stream_completion(client, model_id, stop=[stop], **kw)
    assert streamed == text[:start] and finish == ["stop"] and usage.completion_tokens == n


def test_seeded_sampling_is_reproducible(client, model_id):
    kw = dict(prompt="My favourite food is", max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    a = client.completions.create(model=model_id, **kw).choices[0].text
    b = client.completions.create(model=model_id, **kw).choices[0].text
    assert a == b


def test_n_choices(client, model_id):
    r = client.completions.create(model=model_id, prompt="Hello", max_tokens=5, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == sum(5 if c.finish_reason == "length" else 0 for c in r.choices) or \
        r.usage.completion_tokens <= 15


def test_over_long_prompt_is_a_400_with_the_numbers(client, model_id):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_id, prompt="hello " * (MAX_MODEL_LEN + 10), max_tokens=5)
    assert str(MAX_MODEL_LEN) in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_id, prompt="hello", max_tokens=MAX_MODEL_LEN)
    body = err.value.body
    assert str(MAX_MODEL_LEN) in body["message"] and body["param"] == "max_tokens"
    assert body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("max_tokens", [0, -3, 1.5, "7"])
def test_bad_max_tokens_is_a_400(stack, max_tokens):
    with stack.http() as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "max_tokens" in err["message"]


def test_bad_requests_keep_the_service_running(stack, client, model_id):
    for body in [{"prompt": "hi", "temperature": 5}, {"messages": []}, {"prompt": "hi", "stop": ["a"] * 5},
                 {"prompt": "hi", "model": "gpt-4"}, {"prompt": [MAX_MODEL_LEN * 1000]}]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        with stack.http() as http:
            r = http.post(path, json=body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert "error" in r.json()
    with stack.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "hi"}]})
    assert r.status_code == 400 and "alternate" in r.json()["error"]["message"]
    with stack.http() as http:
        r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert client.completions.create(model=model_id, prompt="Still alive?", max_tokens=2).usage.completion_tokens == 2
