"""Gemma 4 configs and checkpoint loading: presets vs transformers' own configs, errors, skipped tensors."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from families.gemma4.worker import GEMMA4_E2B, GEMMA4_E4B, config_from_hf
from model_worker.checkpoints.hf_loader import load_checkpoint
from scripts.make_synthetic_gemma4 import scaled_config, write

S, F = "sliding_attention", "full_attention"
# The text configs of transformers' convert_gemma4_weights.py _VARIANTS (docs/gemma4-architecture.md §1), with the
# IT release's eos ids (its `main` sets [1, 106]).
HF_VARIANTS = {
    "e2b": dict(hidden_size=1536, hidden_size_per_layer_input=256, intermediate_size=6144, num_hidden_layers=35,
                layer_types=([S] * 4 + [F]) * 7, num_attention_heads=8, num_key_value_heads=1,
                num_kv_shared_layers=20, use_double_wide_mlp=True, final_logit_softcapping=30.0, eos_token_id=[1, 106]),
    "e4b": dict(hidden_size=2560, hidden_size_per_layer_input=256, intermediate_size=10240, num_hidden_layers=42,
                layer_types=([S] * 5 + [F]) * 7, num_attention_heads=8, num_key_value_heads=2, global_head_dim=512,
                num_kv_shared_layers=18, final_logit_softcapping=30.0, eos_token_id=[1, 106]),
}


@pytest.mark.parametrize("variant, preset", [("e2b", GEMMA4_E2B), ("e4b", GEMMA4_E4B)])
def test_presets_equal_transformers_configs(variant, preset):
    """Our spelled-out presets equal what we read from transformers' own Gemma4TextConfig for the release."""
    from transformers import Gemma4TextConfig

    hf = Gemma4TextConfig(**HF_VARIANTS[variant]).to_dict()
    ours = config_from_hf(hf, name=preset.name)
    assert ours == preset
    # And the released multimodal form (text_config, global_head_dim) reads the same.
    released = {"model_type": "gemma4", "eos_token_id": [1, 106],
                "text_config": {**HF_VARIANTS[variant], "model_type": "gemma4_text", "global_head_dim": 512,
                                "num_global_key_value_heads": None, "vocab_size": 262144,
                                "vocab_size_per_layer_input": 262144, "sliding_window": 512}}
    assert config_from_hf(released, name=preset.name) == preset


def test_e2b_facts():
    cfg = GEMMA4_E2B
    assert cfg.kv_layers == tuple(range(15))
    assert {cfg.layers[i].kv_source for i in range(15, 35) if cfg.layers[i].attention == "sliding"} == {13}
    assert {cfg.layers[i].kv_source for i in range(15, 35) if cfg.layers[i].attention == "full"} == {14}
    assert [i for i, s in enumerate(cfg.layers) if s.attention == "full"] == [4, 9, 14, 19, 24, 29, 34]
    assert all(s.mlp_dim == (12288 if i >= 15 else 6144) for i, s in enumerate(cfg.layers))
    # 18 KiB/token if all 15 KV layers kept full length; with 512-slot rings for the 12 sliding ones:
    full_len = sum(2 * s.num_kv_heads * s.head_dim * 2 for i, s in enumerate(cfg.layers) if i in cfg.kv_layers)
    assert full_len == 18 * 1024
    assert cfg.kv_bytes(2) == (6 * 1024, 12 * 512 * 2 * 256 * 2)


def test_moe_and_other_models_are_clear_errors():
    with pytest.raises(NotImplementedError, match="MoE"):
        config_from_hf({"model_type": "gemma4_text", "enable_moe_block": True, "num_hidden_layers": 2}, "x")
    with pytest.raises(ValueError, match="model_type 'llama'"):
        config_from_hf({"model_type": "llama"}, "x")


@pytest.fixture
def small_checkpoint(tmp_path):
    write(tmp_path, scaled_config(GEMMA4_E2B, layers=10, hidden=128, vocab=512), "qat-q4_0-unquantized")
    return tmp_path


def _edit(path, fn):
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard.name} | {
        k: shard.name for k in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_and_misshapen_tensors_are_one_error_naming_each(small_checkpoint):
    def damage(t):
        victim = next(k for k in t if k.endswith("mlp.up_proj.weight"))
        del t[victim]
        shaped = next(k for k in t if k.endswith("mlp.gate_proj.weight"))
        t[shaped] = t[shaped][:, :-1]

    _edit(small_checkpoint, damage)
    with pytest.raises(ValueError) as err:
        load_checkpoint(small_checkpoint, jnp.float32)
    text = str(err.value)
    assert "2 weight problem(s)" in text
    assert re.search(r"missing layers\.\d+\.up \(expected shape \[128, \d+\]\)", text), text
    assert re.search(r"layers\.\d+\.gate has shape \[127, (\d+)\], expected \[128, \1\]", text), text


def test_vision_audio_and_redundant_kv_are_skipped(small_checkpoint):
    def extra(t):
        t["model.vision_tower.encoder.weight"] = np.zeros((3, 3), np.float32)
        t["model.audio_tower.conv.weight"] = np.zeros((2,), np.float32)
        t["model.language_model.layers.9.self_attn.k_proj.weight"] = np.zeros((256, 128), np.float32)

    _edit(small_checkpoint, extra)
    cfg, flat = load_checkpoint(small_checkpoint, jnp.float32)
    assert "layers.9.k" not in flat and cfg.layers[9].kv_source != 9


def test_unknown_text_tensor_is_an_error(small_checkpoint):
    _edit(small_checkpoint, lambda t: t.__setitem__("model.language_model.layers.0.mystery.weight", np.zeros(2)))
    with pytest.raises(ValueError, match="unknown tensors.*mystery"):
        load_checkpoint(small_checkpoint, jnp.float32)
