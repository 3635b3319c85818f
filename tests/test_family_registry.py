"""The model-family registry (common/families.py): lookups by the names checkpoints declare, and a clear error
naming what is supported for anything else (never a silent fallback to another family's formats)."""

from __future__ import annotations

import sys

import pytest

from common import families
from common.families import UnknownFamilyError


def test_every_registered_package_declares_its_family_once():
    found = families.families()
    assert [f.package for f in found] == list(families.REGISTERED)
    assert len({f.name for f in found}) == len(found)
    for kind in ("hf_model_types", "hf_architectures", "gguf_architectures"):
        keys = [k for f in found for k in getattr(f, kind)]
        assert len(keys) == len(set(keys)), f"two families claim the same {kind} entry"


@pytest.mark.parametrize("config,name", [
    ({"model_type": "gemma3_text"}, "gemma3"),
    ({"model_type": "gemma4", "text_config": {"model_type": "gemma4_text"}}, "gemma4"),
    ({"text_config": {"model_type": "gemma4_text"}}, "gemma4"),
    ({"architectures": ["Gemma4ForConditionalGeneration"]}, "gemma4"),
])
def test_hugging_face_configs_find_their_family(config, name):
    assert families.from_hf_config(config).name == name


def test_a_gguf_finds_its_family_by_general_architecture():
    assert families.from_gguf({"general.architecture": "gemma3"}).name == "gemma3"


@pytest.mark.parametrize("lookup,arg,names", [
    (families.from_hf_config, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
     ["'llama'", "gemma3_text", "gemma4"]),
    (families.from_hf_config, {}, ["None", "gemma4_text"]),
    (families.from_gguf, {"general.architecture": "llama"}, ["'llama'", "gemma3"]),
    (families.by_name, "mistral", ["'mistral'", "gemma3", "gemma4"]),
])
def test_an_unknown_family_is_a_clear_error_naming_the_supported_ones(lookup, arg, names):
    with pytest.raises(UnknownFamilyError) as err:
        lookup(arg)
    for name in names:
        assert name in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_a_family_part_is_imported_by_name_and_checked_for_its_type(name):
    from gateway.core.tool_format import FamilyFormat
    from tokenizer_svc.chat_template import TokenizerPart

    family = families.by_name(name)
    assert family.part("gateway", FamilyFormat) is sys.modules[f"families.{name}.gateway"].PART
    assert family.part("tokenizer", TokenizerPart) is sys.modules[f"families.{name}.tokenizer"].PART
    with pytest.raises(TypeError, match=f"families.{name}.tokenizer.PART must be a .*FamilyFormat"):
        family.part("tokenizer", FamilyFormat)
