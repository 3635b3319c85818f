"""The gateway part of the model-family registry (gateway/core/tool_format.py, families/<name>/gateway.py): every
registered family's part provides the `FamilyFormat` interface, its control-token spellings resolve against the
real vocabularies to the ids the gateway used to hard-code, an unknown family or a vocabulary without a needed
token is a clear error (the facts fetch refuses it, requests get a 503 naming it), and resolving the parts never
imports JAX."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import textwrap
import types

import llguidance
import pytest

from common import families
from common.families import UnknownFamilyError
from gateway.backends.clients import Backends
from gateway.backends.model_facts import ModelFacts
from gateway.core.errors import ApiError
from gateway.core.tool_format import (
    FamilyFormat,
    ParsedOutput,
    SpecialTokens,
    ToolCallParser,
    UnknownTokenError,
    family_format,
)
from protos import model_worker_pb2, tokenizer_pb2
from tests.e2e.stacks import free_ports

NAMES = [f.name for f in families.families()]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# The ids the gateway hard-coded before formats named their tokens by spelling (the published vocabularies).
OLD_GEMMA4_IDS = {"<|tool_call>": 48, "<tool_call|>": 49, "<|tool_response>": 50, '<|"|>': 52, "<turn|>": 106,
                  "<|channel>": 100, "<channel|>": 101}
OLD_GEMMA3_IDS = {"<end_of_turn>": 106}


@pytest.mark.parametrize("name", NAMES)
def test_every_family_gateway_part_provides_the_interface(name):
    fmt = family_format(name)
    assert isinstance(fmt, FamilyFormat) and fmt.name == name and family_format(name) is fmt
    assert list(inspect.signature(fmt.tool_grammar).parameters)[:5] == [
        "tools", "tool_choice", "parallel", "max_calls", "ids"]
    assert set(fmt.end_tokens) <= set(fmt.published_ids) and set(fmt.call_markers) <= set(fmt.published_ids)
    assert fmt.thinking <= (fmt.reasoning is not None)
    ids = fmt.published_ids
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        grammar = fmt.tool_grammar([TOOL], choice, True, 2, ids=ids)
        assert not llguidance.LLMatcher.validate_grammar(grammar), (name, choice)
    auto = fmt.tool_grammar([TOOL], "auto", True, 2, ids=ids)
    assert all(f"<[{ids[s]}]>" in auto for s in fmt.end_tokens)  # an answer ends with one of them
    assert fmt.tool_grammar([TOOL], "none", True, 2, ids=ids) is None
    parser = fmt.tool_parser(ids, "call_x_", set(ids.values()), False)
    assert isinstance(parser, ToolCallParser)
    assert parser.progress() == (0, False) and parser.feed(ids[fmt.end_tokens[0]]) == []
    assert parser.result() == ParsedOutput("", [], False)
    assert fmt.budget_close(lambda text: [0] * len(text)) >= 1


def test_spellings_resolve_against_the_real_vocabularies(text_tokenizer, gemma4_text_tokenizer):
    for name, tok, old in (("gemma4", gemma4_text_tokenizer, OLD_GEMMA4_IDS),
                           ("gemma3", text_tokenizer, OLD_GEMMA3_IDS)):
        fmt = family_format(name)
        tokens = SpecialTokens(tok.token_bytes, tok.special_ids)
        resolved = fmt.resolve(tokens)
        # The tokenizer's own lookup (tokenizers' token_to_id) is the independent reference.
        assert resolved == {s: tok.token_id(s) for s in fmt.published_ids} == dict(fmt.published_ids)
        assert {s: resolved[s] for s in old} == old
        facts = ModelFacts(name="m", max_model_len=64, vocab_size=tok.vocab_size, token_bytes=tok.token_bytes,
                           special_ids=tok.special_ids, bos_id=2, stop_ids=[1], architecture=name)
        assert {s: facts.token_id(s) for s in old} == old
    gemma4 = SpecialTokens(gemma4_text_tokenizer.token_bytes, gemma4_text_tokenizer.special_ids)
    assert [gemma4[s] for s in family_format("gemma4").call_markers] == [48, 49]  # banned under "none"
    assert [gemma4[s] for s in family_format("gemma4").end_tokens] == [50, 106]
    with pytest.raises(UnknownTokenError, match="<\\|tool_call>"):  # a Gemma 3 vocabulary has no Gemma 4 tokens
        family_format("gemma4").resolve(SpecialTokens(text_tokenizer.token_bytes, text_tokenizer.special_ids))


def test_an_unknown_family_is_a_clear_error_naming_the_supported_ones():
    with pytest.raises(UnknownFamilyError) as err:
        family_format("llama")
    assert "'llama'" in str(err.value) and all(n in str(err.value) for n in NAMES)
    facts = ModelFacts(name="m", max_model_len=64, vocab_size=4, token_bytes=[b"a"] * 4, special_ids=set(),
                       bos_id=2, stop_ids=[1], architecture="llama")
    with pytest.raises(UnknownFamilyError):
        facts.output_format()


class _Stub:
    """A backend stub answering each unary call with a fixed reply."""

    def __init__(self, **replies):
        for method, reply in replies.items():
            setattr(self, method, self._answer(reply))

    @staticmethod
    def _answer(reply):
        async def call(request, timeout=None):
            return reply
        return call


@pytest.mark.parametrize("architecture, vocab, words, tokenizer_family", [
    ("llama", [b"<end_of_turn>"], ["'llama'", "gemma3", "gemma4"], ""),
    ("gemma4", [b"<end_of_turn>"], ["'gemma4'", "<|tool_call>"], ""),
    ("gemma3", [b"<end_of_turn>"], ["'gemma4'", "'gemma3'", "same model"], "gemma4"),  # backends disagree
])
def test_the_facts_fetch_refuses_a_model_the_gateway_cannot_serve(architecture, vocab, words, tokenizer_family):
    backends = Backends(*(f"127.0.0.1:{port}" for port in free_ports(2)))
    worker = _Stub(Info=model_worker_pb2.WorkerInfoResponse(
        model_name="m", max_model_len=64, vocab_size=8, default_stop_token_ids=[0], architecture=architecture))
    backends.pool.serving = lambda: [types.SimpleNamespace(addr="w:1", stub=worker)]  # one worker, serving
    tokenizer = _Stub(Info=tokenizer_pb2.TokenizerInfoResponse(bos_token_id=1, eos_token_id=0, family=tokenizer_family),
                      GetVocab=tokenizer_pb2.GetVocabResponse(token_bytes=vocab + [b"a"] * 7, special_token_ids=[0]))
    backends.served.tokenizer_service = types.SimpleNamespace(stub=tokenizer)
    assert not asyncio.run(backends.served.refresh())
    with pytest.raises(ApiError) as err:
        backends.ready_facts()
    assert err.value.status == 503 and all(w in err.value.message for w in words), err.value.message


def test_resolving_every_gateway_part_leaves_jax_out():
    script = textwrap.dedent("""
        import sys
        from common import families
        import gateway.api.app
        from gateway.core.tool_format import family_format
        for family in families.families():
            family_format(family.name)
        print(sorted(m for m in sys.modules if m == "jax" or m.startswith("jax.")))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
