"""The tokenizer service finds the model family through the registry (a GGUF's `general.architecture`, a
checkpoint's config.json) and advertises it with its template's facts in `Info`; a model no family serves fails to
load with a clear error naming what is supported, never rendered with another family's template."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from common import families, preparation
from common.families import UnknownFamilyError
from gemma_serve.cli import build_parser
from protos import tokenizer_pb2
from tests.transport import socket_folder, tcp_available
from tokenizer_svc.chat_template import tokenizer_part
from tokenizer_svc.main import choose_template, load_tokenizer, run
from tokenizer_svc.service import TokenizerServicer

pytestmark = pytest.mark.slow
DATA = pathlib.Path(__file__).parent / "data"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _info(tokenizer, template, render) -> tokenizer_pb2.TokenizerInfoResponse:
    servicer = TokenizerServicer(tokenizer, template, render)
    return asyncio.run(servicer.Info(tokenizer_pb2.TokenizerInfoRequest(), None))


def _facts(info) -> tuple:
    return info.family, info.chat_template, info.supports_tools, info.supports_thinking


def test_info_reports_the_embedded_gguf_family_and_facts(cache_dir, prepared):
    tok, template, render = load_tokenizer("embedded", cache_dir)
    assert json.loads((prepared.dir / "gguf_architecture.json").read_text()) == {"general.architecture": "gemma3"}
    assert render is tokenizer_part(families.by_name("gemma3")).render
    info = _info(tok, template, render)
    assert _facts(info) == ("gemma3", "gemma3", True, False) and info.source == "gguf"


def test_info_reports_a_gemma4_checkpoint_family_and_facts(gemma4_text_tokenizer, tmp_path):
    """The built-in template, then the checkpoint's own chat_template.jinja: the family (and so the facts) stay
    Gemma 4's, and the checkpoint template splices answers in Gemma 4's syntax."""
    tok = gemma4_text_tokenizer
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma4ForConditionalGeneration"]}))
    assert _facts(_info(tok, *choose_template(tmp_path, tok))) == ("gemma4", "gemma4", True, True)
    shutil.copy(DATA / "gemma4_chat_template.jinja", tmp_path / "chat_template.jinja")
    template, render = choose_template(tmp_path, tok)
    assert _facts(_info(tok, template, render)) == ("gemma4", "checkpoint", True, True)
    assert render.answer_format is tokenizer_part(families.by_name("gemma4")).answer_format


def test_a_gemma3_checkpoint_template_keeps_gemma3_facts(text_tokenizer, tmp_path):
    from tests.tokenizer_svc.test_chat_template import GEMMA3_JINJA

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    (tmp_path / "chat_template.jinja").write_text(GEMMA3_JINJA)
    template, render = choose_template(tmp_path, text_tokenizer)
    assert _facts(_info(text_tokenizer, template, render)) == ("gemma3", "checkpoint", True, False)
    assert render.answer_format is None  # Gemma 3 has no native call syntax to splice


def test_an_unknown_model_type_fails_to_load_naming_the_supported_ones(gemma4_tokenizer_dir, tmp_path, caplog):
    """Also with a chat_template.jinja of its own: the family must be known. The service process exits 1 with the
    message."""
    ckpt = tmp_path / "llama"
    ckpt.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(gemma4_tokenizer_dir / name, ckpt / name)
    shutil.copy(DATA / "gemma4_chat_template.jinja", ckpt / "chat_template.jinja")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnknownFamilyError) as err:
        load_tokenizer(str(ckpt), tmp_path / "cache")
    for name in ("'llama'", "LlamaForCausalLM", "gemma3_text", "gemma4_text"):
        assert name in str(err.value)
    listen = ["--tokenizer-port", "0"] if tcp_available() else ["--uds", str(socket_folder() / "tok.sock")]
    args = build_parser().parse_args(["tokenizer", "--model", str(ckpt), "--cache-dir", str(tmp_path / "cache"),
                                      *listen])
    with caplog.at_level(logging.ERROR, logger="gemma_serve.tokenizer"):
        assert run(args) == 1
    assert str(err.value) in caplog.text


def test_an_unknown_gguf_architecture_fails_to_prepare(tmp_path):
    """A GGUF (written by the gguf package) whose general.architecture no family serves: preparation stops at the
    family check, before any tokenizer is built."""
    path = _tiny_gguf(tmp_path / "tiny-llama.gguf", "llama")
    with pytest.raises(UnknownFamilyError, match="general.architecture is 'llama'; supported architectures: gemma3"):
        load_tokenizer(str(path), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("prepared/*/tokenizer.json"))


def test_a_directory_prepared_by_an_earlier_release_learns_its_family_from_the_source(tmp_path):
    """Its one READY marker stands for every part, the architecture part too: the family is read from the source
    GGUF the manifest names, and recorded."""
    source = _tiny_gguf(tmp_path / "old.gguf", "llama")
    old = tmp_path / "prepared"
    old.mkdir()
    (old / "prepared.json").write_text(json.dumps({"version": preparation.PREPARED_VERSION, "name": "old",
                                                   "kind": "gguf", "source": str(source)}))
    (old / "READY").write_text(preparation.PREPARED_VERSION)
    with pytest.raises(UnknownFamilyError, match="'llama'"):
        load_tokenizer(str(old), tmp_path / "cache")
    assert json.loads((old / "gguf_architecture.json").read_text()) == {"general.architecture": "llama"}
    source.unlink()
    with pytest.raises(UnknownFamilyError, match="'llama'"):  # recorded: the source is not needed again
        load_tokenizer(str(old), tmp_path / "cache")


def test_tokenizer_parts_render_without_jax():
    """The registry imports parts by name at run time: the tokenizer service with every family's tokenizer part
    loaded and rendering (and a checkpoint template's answer format looked up over all of them) leaves jax out."""
    script = textwrap.dedent(
        """
        import sys
        import tokenizer_svc.main, tokenizer_svc.service
        from common import families
        from tokenizer_svc.chat_template import Message, tokenizer_part
        from tokenizer_svc.jinja_template import answer_format_for
        for family in families.families():
            part = tokenizer_part(family)
            assert part.render([Message("user", "Hi")], True, [], {})[0].text == "<bos>", family
            assert part.template_facts.supports_tools, family
        assert answer_format_for(["<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>"]) is not None
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "model_worker")))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def _tiny_gguf(path: pathlib.Path, arch: str) -> pathlib.Path:
    """A GGUF with metadata only, written by the gguf package."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
