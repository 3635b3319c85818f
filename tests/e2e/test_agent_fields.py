"""What agent frameworks send beyond OpenAI's fields, against the real processes (the embedded Gemma 3 stack):
vLLM's `/tokenize` and `/detokenize`, `continue_final_message` / `add_generation_prompt`, `tools[].function.strict`
and the Gemma 3 prompt under `tool_choice: "none"`. References: the official `openai` client (extra_body for the
vLLM fields), `tokenizers` on the served tokenizer.json, transformers' chat-template renderer with the official
Gemma 3 template, jsonschema."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings

from tests.e2e.stacks import API_KEYS, MAX_MODEL_LEN
from tests.tokenizer_svc.test_chat_template import GEMMA3_JINJA

pytestmark = pytest.mark.slow
MODEL = "gemma-3-270m"
USER = {"role": "user", "content": "What is the capital of France?"}
PREFILL = {"role": "assistant", "content": "The capital of France is"}
CITY = {"type": "function", "function": {"name": "capital", "description": "Give a country's capital.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "sure": {"type": "boolean"}},
    "required": ["city", "sure"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


@pytest.fixture(scope="module")
def http(stack):
    with stack.http(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(prepared):
    """`tokenizers` on the tokenizer.json the stack serves."""
    return tokenizers.Tokenizer.from_file(str(prepared.dir / "tokenizer.json"))


def _tokenize(http, **body) -> dict:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _official(messages: list[dict], continue_final: bool = False) -> str:
    """The official Gemma 3 template rendered by transformers (generation prompt, or the final message continued)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=GEMMA3_JINJA, bos_token="<bos>",
                                        add_generation_prompt=not continue_final,
                                        continue_final_message=continue_final)
    return rendered[0]


def test_tokenize_and_detokenize_match_the_served_tokenizer(http, client, reference):
    text = "The capital of France is <b>"
    got = _tokenize(http, model=MODEL, prompt=text, return_token_strs=True)
    ids = [2] + reference.encode(text, add_special_tokens=False).ids
    assert got == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                   "token_strs": [reference.id_to_token(i) for i in ids]}
    assert _tokenize(http, prompt=text, add_special_tokens=False)["tokens"] == ids[1:]
    assert client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens == len(ids)
    assert http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": "<bos>" + text}
    chat = _tokenize(http, messages=[{"role": "system", "content": "Be brief."}, USER])
    official = _official([{"role": "system", "content": "Be brief."}, USER])
    assert chat["tokens"] == reference.encode(official, add_special_tokens=False).ids


@pytest.mark.parametrize("extra", [
    {},
    {"tools": [CITY], "tool_choice": "none"},
    {"tools": [CITY], "tool_choice": "auto"},
    {"add_generation_prompt": False},
    {"messages": [USER, PREFILL], "continue_final_message": True},
], ids=["plain", "tools-none", "tools-auto", "no-generation-prompt", "continue"])
def test_tokenize_counts_the_chat_completion_prompt(http, client, extra):
    """`count` is the chat completion's usage.prompt_tokens for the same fields (sent by the openai client)."""
    body = {"messages": [USER], **extra}
    count = _tokenize(http, **body)["count"]
    named = {k: body.pop(k) for k in ("messages", "tools", "tool_choice") if k in body}
    r = client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, **named, extra_body=body)
    assert r.usage.prompt_tokens == count


def test_continue_final_message_continues_the_prefill(http, client, reference):
    """The prompt ends inside the assistant's open turn, exactly where transformers ends it, and the answer is
    only the continuation: what greedy decoding appends to that very prompt."""
    prompt = _tokenize(http, messages=[USER, PREFILL], continue_final_message=True)["tokens"]
    assert prompt == reference.encode(_official([USER, PREFILL], continue_final=True), add_special_tokens=False).ids
    r = client.chat.completions.create(model=MODEL, messages=[USER, PREFILL], max_tokens=6, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].text and r.usage.prompt_tokens == len(prompt)
    assert not r.choices[0].message.content.startswith(PREFILL["content"])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=1,
                                       extra_body={"continue_final_message": True})
    assert err.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[USER, PREFILL], max_tokens=1, extra_body={
            "continue_final_message": True, "add_generation_prompt": True})
    assert err.value.body["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


@pytest.mark.parametrize("strict", [True, False])
def test_strict_tools_are_accepted_and_the_schema_enforced(client, strict):
    tool = {"type": "function", "function": {**CITY["function"], "strict": strict}}
    r = client.chat.completions.create(model=MODEL, messages=[USER], tools=[tool], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=40, temperature=1.0, seed=7)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "capital"
    jsonschema.validate(json.loads(call.function.arguments), CITY["function"]["parameters"])


def test_gemma3_tool_choice_none_prompt_has_no_call_format(http):
    def prompt_text(choice: str) -> str:
        ids = _tokenize(http, messages=[USER], tools=[CITY], tool_choice=choice)["tokens"]
        return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    none, auto = prompt_text("none"), prompt_text("auto")
    declaration = json.dumps({"name": "capital", "description": "Give a country's capital.",
                              "parameters": CITY["function"]["parameters"]})
    assert declaration in none and "cannot be called" in none
    assert '{"tool_calls"' not in none and '{"tool_calls"' in auto and declaration in auto


def test_with_api_keys_tokenize_needs_a_key(auth_stack):
    with auth_stack.http(timeout=60) as http:
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [2]})):
            bare = http.post(path, json=body)
            assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
            ok = http.post(path, json=body, headers={"Authorization": f"Bearer {API_KEYS['file']}"})
            assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("operation", ["POST /tokenize", "POST /detokenize"])
def test_generated_requests_never_fail_the_server(stack, operation):
    """schemathesis from the live OpenAPI document (valid, then invalid bodies): never a 5xx, every error
    OpenAI-shaped, every answer in the documented shape, and some valid bodies answered."""
    from schemathesis import GenerationMode

    from tests.e2e.test_fuzz_api import openapi_schema, requests_session

    schema = openapi_schema(stack)
    schema.config.generation.update(deterministic=True)
    ops = {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in schema.get_all_operations())}
    answered = []
    with requests_session(stack) as session:
        for mode, examples in ((GenerationMode.POSITIVE, 15), (GenerationMode.NEGATIVE, 10)):

            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=ops[operation].as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(base_url=stack.base_url, session=session, timeout=120)
                where = (repr(case.body)[:300], response.text[:300])
                assert response.status_code < 500, where
                if response.status_code >= 400:
                    assert set(response.json()["error"]) == {"message", "type", "param", "code"}, where
                else:
                    answered.append(set(response.json()))

            run()
    assert answered and all(keys in ({"count", "max_model_len", "tokens", "token_strs"}, {"prompt"})
                            for keys in answered)
