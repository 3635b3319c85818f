#!/usr/bin/env python3
"""Write a synthetic Gemma 4 checkpoint: real tensor names, shapes, dtypes and config files; random values.

For benchmarks and for loading by hand (not a test). One format per run:

  bf16                    the original release layout: multimodal prefix `model.language_model.`, bf16, and the
                          redundant k_proj/v_proj/k_norm on KV-shared layers
  qat-q4_0-unquantized    bf16, shared layers without k_proj/v_proj/k_norm (formats.md §2)
  qat-w4a16-ct            compressed-tensors pack-quantized int4 (group 32, symmetric) for every decoder Linear and
                          the three PLE projections; embeddings and norms stay bf16 (formats.md §1–2)

Usage:
  python scripts/make_synthetic_gemma4.py OUT_DIR --format qat-w4a16-ct [--variant e2b|e4b] [--layers N]
      [--hidden H] [--vocab V]

Full-size E2B is ~10 GB in bf16 (the 262144 x 8960 PLE table alone is 4.7 GB); the overrides make small
look-alikes. Shards are written one group of layers at a time, so memory stays bounded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from families.gemma4.worker import GEMMA4_E2B, GEMMA4_E4B, gemma4_layers
from model_worker.modeling.config import ModelConfig

BF16 = ml_dtypes.bfloat16
PREFIX = "model.language_model."
GROUP = 32


def scaled_config(base: ModelConfig, layers: int | None, hidden: int | None, vocab: int | None) -> ModelConfig:
    """The variant, optionally shrunk (layer pattern and KV-sharing proportion kept)."""
    n = layers or base.num_layers
    h = hidden or base.hidden_size
    v = vocab or base.vocab_size
    types = ["full_attention" if s.attention == "full" else "sliding_attention" for s in base.layers]
    types = (types * (n // len(types) + 1))[:n]
    types[-1] = "full_attention"
    shared = sum(1 for i, s in enumerate(base.layers) if s.kv_source != i) * n // base.num_layers
    double = any(s.mlp_dim != base.layers[0].mlp_dim for s in base.layers)
    layer_specs = gemma4_layers(types, 256, 512, base.layers[0].num_kv_heads, base.layers[0].num_kv_heads,
                                4 * h, shared, double, False)
    return dataclasses.replace(base, hidden_size=h, vocab_size=v, ple_vocab=v, layers=layer_specs,
                               embed_scale=float(h) ** 0.5)


def hf_config(cfg: ModelConfig, fmt: str) -> dict:
    """config.json in the released multimodal form (text_config with global_head_dim)."""
    full = next(s for s in cfg.layers if s.attention == "full")
    sliding = next(s for s in cfg.layers if s.attention == "sliding")
    shared = sum(1 for i, s in enumerate(cfg.layers) if s.kv_source != i)
    text = {
        "model_type": "gemma4_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.layers[0].mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": sliding.num_kv_heads,
        "head_dim": sliding.head_dim, "global_head_dim": full.head_dim, "num_global_key_value_heads": None,
        "attention_k_eq_v": False, "sliding_window": cfg.sliding_window,
        "layer_types": [f"{s.attention}_attention" for s in cfg.layers],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": sliding.rope_theta},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": full.rope_fraction,
                               "rope_theta": full.rope_theta},
        },
        "rms_norm_eps": cfg.rms_norm_eps, "final_logit_softcapping": cfg.final_logit_softcap,
        "hidden_size_per_layer_input": cfg.ple_dim, "vocab_size_per_layer_input": cfg.ple_vocab,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": any(s.mlp_dim != cfg.layers[0].mlp_dim for s in cfg.layers),
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_activation": "gelu_pytorch_tanh",
    }
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
              "eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": True}
    if fmt == "qat-w4a16-ct":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": GROUP, "dynamic": False,
                                                      "actorder": None}}},
            "ignore": ["lm_head", "re:.*embed_tokens.*", "re:.*vision.*", "re:.*audio.*"],
        }
    return config


class Writer:
    """Random tensors, written shard by shard with a weight_map index."""

    def __init__(self, out: pathlib.Path, fmt: str, seed: int):
        self.out, self.fmt = out, fmt
        self.rng = np.random.default_rng(seed)
        self.pending: dict[str, np.ndarray] = {}
        self.weight_map: dict[str, str] = {}
        self.shards = 0

    def norm(self, name: str, n: int) -> None:
        self.pending[name] = (1.0 + 0.1 * self.rng.standard_normal(n, dtype=np.float32)).astype(BF16)

    def dense(self, name: str, shape: tuple[int, ...], scale: float = 0.02) -> None:
        out = np.empty(shape, BF16)
        rows = max(1, (1 << 24) // int(np.prod(shape[1:], dtype=np.int64)))  # ~64 MiB of float32 at a time
        for r in range(0, shape[0], rows):
            block = self.rng.standard_normal((min(rows, shape[0] - r),) + tuple(shape[1:]), dtype=np.float32)
            out[r : r + rows] = (scale * block).astype(BF16)
        self.pending[name] = out

    def linear(self, module: str, out_f: int, in_f: int) -> None:
        if self.fmt != "qat-w4a16-ct":
            self.dense(module + ".weight", (out_f, in_f))
            return
        self.pending[module + ".weight_packed"] = self.rng.integers(
            -(2**31), 2**31, (out_f, in_f // 8), dtype=np.int64).astype(np.int32)
        self.pending[module + ".weight_scale"] = (0.002 * self.rng.random((out_f, in_f // GROUP),
                                                                          dtype=np.float32)).astype(BF16)
        self.pending[module + ".weight_shape"] = np.array([out_f, in_f], np.int64)

    def flush(self) -> None:
        if not self.pending:
            return
        self.shards += 1
        name = f"model-{self.shards:05d}.safetensors"
        save_file(self.pending, str(self.out / name), metadata={"format": "pt"})
        self.weight_map |= {k: name for k in self.pending}
        self.pending = {}


def write(out: pathlib.Path, cfg: ModelConfig, fmt: str, seed: int = 0) -> None:
    """Write the checkpoint files into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    w = Writer(out, fmt, seed)
    H, L, P = cfg.hidden_size, cfg.num_layers, cfg.ple_dim
    w.dense(PREFIX + "embed_tokens.weight", (cfg.vocab_size, H))
    w.flush()
    w.dense(PREFIX + "embed_tokens_per_layer.weight", (cfg.ple_vocab, L * P))
    w.flush()
    w.linear(PREFIX + "per_layer_model_projection", L * P, H)
    w.norm(PREFIX + "per_layer_projection_norm.weight", P)
    w.norm(PREFIX + "norm.weight", H)
    for i, spec in enumerate(cfg.layers):
        p = f"{PREFIX}layers.{i}."
        D, K, N = spec.head_dim, spec.num_kv_heads, cfg.num_heads
        w.linear(p + "self_attn.q_proj", N * D, H)
        w.linear(p + "self_attn.o_proj", H, N * D)
        w.norm(p + "self_attn.q_norm.weight", D)
        if spec.kv_source == i or fmt == "bf16":  # the original release also ships unused K/V on shared layers
            w.linear(p + "self_attn.k_proj", K * D, H)
            w.linear(p + "self_attn.v_proj", K * D, H)
            w.norm(p + "self_attn.k_norm.weight", D)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_per_layer_input_norm"):
            w.norm(p + norm + ".weight", H)
        w.linear(p + "mlp.gate_proj", spec.mlp_dim, H)
        w.linear(p + "mlp.up_proj", spec.mlp_dim, H)
        w.linear(p + "mlp.down_proj", H, spec.mlp_dim)
        w.linear(p + "per_layer_input_gate", P, H)
        w.linear(p + "per_layer_projection", H, P)
        w.pending[p + "layer_scalar"] = np.array([0.05 + 0.1 * w.rng.random()], np.float32).astype(BF16)
        if i % 4 == 3:
            w.flush()
    w.flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": w.weight_map}))
    (out / "config.json").write_text(json.dumps(hf_config(cfg, fmt), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50], "bos_token_id": 2}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--format", required=True, choices=["bf16", "qat-q4_0-unquantized", "qat-w4a16-ct"])
    parser.add_argument("--variant", default="e2b", choices=["e2b", "e4b"])
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base = GEMMA4_E2B if args.variant == "e2b" else GEMMA4_E4B
    cfg = scaled_config(base, args.layers, args.hidden, args.vocab)
    write(args.out, cfg, args.format, args.seed)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"wrote {args.out} ({args.format}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}): {size / 2**30:.2f} GiB of safetensors")


if __name__ == "__main__":
    main()
