"""Assistant messages carrying their generated token ids render those ids verbatim (exact history for prefix
reuse), in the built-in Gemma 3 and Gemma 4 templates and through a checkpoint Jinja template."""

from __future__ import annotations

import pathlib

import pytest

from tests.gemma4_tokenizer import write_gemma4_test_tokenizer
from tokenizer_svc.chat_template import JinjaTemplate, Message, render_gemma3, render_gemma4, tokenize_segments
from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow
TEMPLATE = pathlib.Path(__file__).parent / "data" / "gemma4_chat_template.jinja"


def _prompt_then_answer(render, tok, gen_ids):
    turn1 = [Message("user", "Say hi.")]
    prompt, _ = tokenize_segments(render(turn1, True), tok)
    # The model answered with a leading space and a trailing newline, which the template's trim would drop.
    turn2 = turn1 + [Message("assistant", tok.decode(gen_ids), generated_ids=tuple(gen_ids)),
                     Message("user", "Again.")]
    ids, _ = tokenize_segments(render(turn2, True), tok)
    return prompt, ids


def test_gemma3_renders_generated_ids(text_tokenizer):
    gen = text_tokenizer.encode(" Hi there!\n", parse_special=False)
    prompt, ids = _prompt_then_answer(render_gemma3, text_tokenizer, gen)
    assert ids[: len(prompt) + len(gen)] == prompt + gen
    assert ids[len(prompt) + len(gen)] == text_tokenizer.token_id("<end_of_turn>")


@pytest.fixture(scope="module")
def gemma4_tok(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("g4tok")
    write_gemma4_test_tokenizer(out, prepared.dir / "tokenizer.json")
    return TextTokenizer.from_tokenizer_json(out)


@pytest.mark.parametrize("kind", ["builtin", "jinja"])
def test_gemma4_renders_generated_ids(gemma4_tok, kind):
    render = render_gemma4 if kind == "builtin" else JinjaTemplate.from_file(TEMPLATE, gemma4_tok)
    gen = gemma4_tok.encode(" Hi <there>!\n\n", parse_special=False)
    prompt, ids = _prompt_then_answer(render, gemma4_tok, gen)
    assert ids[: len(prompt) + len(gen)] == prompt + gen
    assert ids[len(prompt) + len(gen)] == gemma4_tok.token_id("<turn|>")
