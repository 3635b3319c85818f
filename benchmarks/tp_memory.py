#!/usr/bin/env python3
"""Per-device memory of Gemma 4 E2B, E4B and a 31B-style model under tensor parallelism, from abstract shapes.

Not a test: prints a markdown table (docs/performance.md keeps one). Nothing is allocated or compiled: the weights
are `jax.ShapeDtypeStruct`s of the full-size configs as a checkpoint of each format loads them
(`memory.abstract_params`), split over 1, 2 and 4 simulated CPU devices by the engine's own `sharding.Layout`,
and sized with the code the worker uses on its placed arrays (`memory.footprint`, `sharding.per_device_bytes`),
which tests/tp_check.py checks against placed arrays on the tiny models. Runs in a few seconds on a CPU.

  python benchmarks/tp_memory.py                    # the default device limit: 60 GiB
  python benchmarks/tp_memory.py --limit-gib 15.75  # e.g. one 16 GiB TPU v5e chip

Formats: "bf16" (the bf16 release: bfloat16 weights and activations, bfloat16 KV), "w4a16" (`qat-w4a16-ct`:
every Linear packed int4 with a bfloat16 scale per 32 inputs, tables and norms bfloat16), "w4a16+int8KV" (the
same with `--kv-cache-dtype int8`). Columns, per device (the fullest): weights; KV per slot at an 8192-token
context; step temporaries as estimated for sizing on an accelerator (fixed + per slot,
`memory.estimate_temporaries`); the slots `--num-slots auto` takes on a device of `--limit-gib` (the allocator's
`bytes_limit`: on an 80 GB GPU JAX takes 75% by default, about 60 GiB) and their KV cache. The 31B-style model is the dense Gemma 4 31B as far as its
public numbers go (`gemma4_31b_style`).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import argparse
import dataclasses
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from families.gemma4.worker import GEMMA4_E2B, GEMMA4_E4B, gemma4_layers
from model_worker.engine import memory, sharding
from model_worker.engine.engine import EngineConfig
from model_worker.modeling.config import ModelConfig
from model_worker.modeling.params import param_shapes
from scripts.make_synthetic_gemma4 import GROUP, scaled_config

CONTEXT = 8192
TPS = (1, 2, 4)
FORMATS = {"bf16": (None, False), "w4a16": (GROUP, False), "w4a16+int8KV": (GROUP, True)}  # (int4 group, int8 KV)


def gemma4_31b_style() -> ModelConfig:
    """A dense Gemma 4 31B-like config: hidden 5376, 60 layers (5 sliding : 1 full), 32 query heads, 16 KV heads
    (head dim 256) on sliding layers and 4 (head dim 512, K = V) on full ones, MLP 21504, window 1024, vocabulary
    262144, no per-layer embeddings, 262144 positions.

    Sources: docs/gemma4-architecture.md §1 (hidden, layers, heads, KV heads, global KV heads, k_eq_v, window, no
    PLE, positions); the published model card figures (head dims 256 / 512, MLP 21504 as in Gemma 3 27B, the 5:1
    pattern). They reproduce the card's 30.7B parameters (`parameters`); RoPE and norms do not change any size.
    """
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 10
    return dataclasses.replace(
        GEMMA4_E2B, name="gemma-4-31b-style", hidden_size=5376, num_heads=32, sliding_window=1024,
        layers=gemma4_layers(types, head_dim=256, global_head_dim=512, num_kv_heads=16, global_kv_heads=4,
                             mlp_dim=21504, num_kv_shared=0, double_wide_mlp=False, k_eq_v=True),
        embed_scale=math.sqrt(5376), ple_dim=0, ple_vocab=0, max_position_embeddings=262_144)


def models() -> dict[str, ModelConfig]:
    """The configs measured: full-size synthetic E2B and E4B (scripts/make_synthetic_gemma4.py's shapes) and the
    31B-style one."""
    return {"E2B": scaled_config(GEMMA4_E2B, None, None, None), "E4B": scaled_config(GEMMA4_E4B, None, None, None),
            "31B-style": gemma4_31b_style()}


def parameters(cfg: ModelConfig) -> int:
    """Parameter count (every tensor of `param_shapes`)."""
    return sum(math.prod(s) for s in param_shapes(cfg).values())


def row(cfg: ModelConfig, tp: int, fmt: str, limit: int) -> list[str]:
    """One table row: per-device weights, KV per slot, estimated temporaries, auto slots and their KV."""
    group, int8 = FORMATS[fmt]
    ecfg = EngineConfig(max_model_len=CONTEXT, dtype="bfloat16", kv_int8=int8)
    layout = None if tp == 1 else sharding.Layout(cfg, sharding.make_mesh(tp))
    fp = memory.footprint(cfg, memory.abstract_params(cfg, jnp.bfloat16, group), ecfg, layout, platform="gpu")
    slots = memory.fit_slots(limit, fp)
    fits = fp.total(slots) <= limit
    size = memory.size_text
    return [fmt, str(tp), size(fp.weights), size(fp.kv_per_slot),
            f"{size(fp.temp_fixed)} + {size(fp.temp_per_slot)}/slot",
            str(slots) if fits else "does not fit", size(slots * fp.kv_per_slot) if fits else "-"]


def main() -> None:
    """Print the per-device table for each model, format and TP degree."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-gib", type=float, default=60.0, help="device memory limit (bytes_limit) in GiB")
    args = parser.parse_args()
    limit = int(args.limit_gib * 2**30)
    t0 = time.perf_counter()
    header = ["format", "TP", "weights", f"KV / slot ({CONTEXT})", "temporaries (est.)",
              f"auto slots ({args.limit_gib:g} GiB)", "KV of those slots"]
    for name, cfg in models().items():
        kv_heads = sorted({s.num_kv_heads for s in cfg.layers})
        print(f"\n**{name}** ({parameters(cfg) / 1e9:.2f}B parameters, {cfg.num_layers} layers, "
              f"{len(cfg.kv_layers)} with their own KV, KV heads {'/'.join(map(str, kv_heads))}, "
              f"vocabulary {cfg.vocab_size})\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for fmt in FORMATS:
            for tp in TPS:
                print("| " + " | ".join(row(cfg, tp, fmt, limit)) + " |")
    print(f"\n{len(jax.devices())} simulated {jax.devices()[0].platform} devices, abstract shapes only: "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
