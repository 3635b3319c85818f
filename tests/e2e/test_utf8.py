"""End to end, UTF-8 at our boundaries (gateway/generation/detokenizer.py): a `/v1/completions` prompt given as token ids that
ends inside a character is completed by the answer (or its dangling bytes dropped); logprob token strings follow the
text; streamed equals non-streamed. Made deterministic with byte-fallback tokens: `logit_bias` forces them, or a
grammar forces a rare character that the embedded vocabulary spells with byte tokens (𓀀 = <0xF0><0x93><0x80><0x80>).
A grammar's answer is no longer cut inside a character by a client's `max_tokens`: a limit ending inside the only
answer is below the shortest valid answer, a 400 (gateway/structured/endings.py); a cut character is dropped, never U+FFFD
(tests/gateway/test_detokenizer.py)."""

from __future__ import annotations

import json
import re

import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "gemma-3-270m"
RARE = "𓀀𓀁"  # no token of its own: the model writes it in byte-fallback tokens


@pytest.fixture(scope="module")
def client(stack):
    return stack.openai()


@pytest.fixture(scope="module")
def byte_id(text_tokenizer):
    return lambda b: text_tokenizer.token_id(f"<0x{b:02X}>")


def cut_inside(token_bytes: list[list[int]]) -> int:
    """The smallest token count whose bytes end inside a character (checked with Python's strict decoder)."""
    data = b""
    for n, raw in enumerate(token_bytes, 1):
        data += bytes(raw)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            if err.reason == "unexpected end of data":
                return n
    raise AssertionError(f"no token ends inside a character: {token_bytes}")


def completion(client, stream: bool, **kw):
    """(text, finish_reason, logprob tokens, text offsets, token bytes) of choice 0, streamed or not."""
    kw = dict(model=MODEL, temperature=0.0, logprobs=1, **kw)
    if not stream:
        c = client.completions.create(**kw).choices[0]
        lp = c.logprobs
        return c.text, c.finish_reason, lp.tokens, lp.text_offset
    text, finish, tokens, offsets = "", None, [], []
    for chunk in client.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        text += c.text
        finish = c.finish_reason or finish
        if c.logprobs:
            tokens += c.logprobs.tokens
            offsets += c.logprobs.text_offset
    return text, finish, tokens, offsets


def chat(client, stream: bool, **kw):
    """(content, tool calls [(name, arguments)], finish_reason, logprobs content [(token, bytes)]) of choice 0."""
    kw = dict(model=MODEL, temperature=0.0, logprobs=True, **kw)
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return (c.message.content or "", calls, c.finish_reason,
                [(e.token, e.bytes) for e in c.logprobs.content])
    content, calls, finish, lps = "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            call = calls.setdefault(d.index, ["", ""])
            call[0] += d.function.name or ""
            call[1] += d.function.arguments or ""
        finish = c.finish_reason or finish
        lps += [(e.token, e.bytes) for e in (c.logprobs.content if c.logprobs else None) or []]
    return content, [tuple(v) for v in calls.values()], finish, lps


@pytest.mark.parametrize("stream", [False, True])
def test_completion_prompt_ending_inside_a_character(client, text_tokenizer, byte_id, stream):
    """The prompt's ids end with F0 9F (🀀 is F0 9F 80 80); the answer's two forced 0x80 tokens complete it."""
    prompt = text_tokenizer.encode("Tiles:", add_bos=True) + [byte_id(0xF0), byte_id(0x9F)]
    bias = {str(byte_id(0x80)): 100}
    assert completion(client, stream, prompt=prompt, max_tokens=2, logit_bias=bias) == \
        ("🀀", "length", ["", "🀀"], [0, 0])
    # Cut while the character is still open: the prompt's bytes and the answer's byte are dropped.
    assert completion(client, stream, prompt=prompt, max_tokens=1, logit_bias=bias) == ("", "length", [""], [0])
    # An answer that does not continue the character: the prompt's dangling bytes stay with the prompt.
    a = text_tokenizer.encode("A", parse_special=False)[0]
    assert completion(client, stream, prompt=prompt, max_tokens=2, logit_bias={str(a): 100}) == \
        ("AA", "length", ["A", "A"], [0, 1])
    if not stream:  # echo: the prompt's open character is not echoed as U+FFFD; the answer carries it whole
        echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logit_bias=bias, echo=True,
                                           temperature=0.0).choices[0].text
        assert echoed == "Tiles:🀀"


def _too_small(call, n: int, param: str = "max_tokens") -> None:
    """`call(max_tokens=n)` is refused before generation: n cuts inside the grammar's only answer, so it is below
    the shortest valid answer (gateway/structured/endings.py), a 400 naming the limit and that answer's length."""
    with pytest.raises(openai.BadRequestError) as err:
        call(max_tokens=n)
    body = err.value.body
    assert (body["param"], body["code"]) == (param, "max_tokens_too_small"), body
    assert int(re.search(r"answer that .* allows \((\d+) tokens\)", body["message"]).group(1)) > n


@pytest.mark.parametrize("stream", [False, True])
def test_completion_limit_inside_a_forced_character_is_refused(client, text_tokenizer, stream):
    """A grammar forces a rare character (byte-fallback tokens): whole within its budget; a max_tokens ending
    inside it is below the only answer (no cut: a 400 before generation)."""
    kw = dict(prompt="Hieroglyph:", extra_body={"response_format": {
        "type": "json_schema", "json_schema": {"name": "g", "schema": {"enum": [RARE]}}}})
    full = client.completions.create(model=MODEL, temperature=0.0, logprobs=1, max_tokens=40, **kw).choices[0]
    assert json.loads(full.text) == RARE
    ids = text_tokenizer.encode(full.text, parse_special=False)
    n = cut_inside([list(text_tokenizer.token_bytes[i]) for i in ids])
    _too_small(lambda **limit: completion(client, stream, **limit, **kw), n)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_limit_inside_a_forced_character_is_refused(client, stream):
    kw = dict(messages=[{"role": "user", "content": "Write an Egyptian hieroglyph."}], response_format={
        "type": "json_schema", "json_schema": {"name": "g", "schema": {"enum": [RARE]}}})
    content, _, finish, full_lps = chat(client, stream, max_tokens=40, **kw)
    assert (json.loads(content), finish) == (RARE, "stop")
    assert "".join(t for t, _ in full_lps) == content
    _too_small(lambda **limit: chat(client, stream, **limit, **kw), cut_inside([b for _, b in full_lps]))


def test_tool_arguments_limit_inside_a_forced_character_is_refused(client):
    """Gemma 3's JSON tool format, a string argument forced to a rare character: whole within its budget; a limit
    ending inside the character is below the shortest call."""
    tool = {"type": "function", "function": {"name": "draw", "parameters": {
        "type": "object", "properties": {"glyph": {"enum": [RARE]}}, "required": ["glyph"],
        "additionalProperties": False}}}
    kw = dict(messages=[{"role": "user", "content": "Draw a hieroglyph."}], tools=[tool], tool_choice="required",
              parallel_tool_calls=False)
    _, calls, finish, lps = chat(client, False, max_tokens=100, **kw)
    assert finish == "tool_calls" and json.loads(calls[0][1]) == {"glyph": RARE}
    _too_small(lambda **limit: chat(client, False, **limit, **kw), cut_inside([b for _, b in lps]))
