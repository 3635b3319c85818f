"""Gemma 3's worker part: its layer pattern, presets and GGUF metadata -> `ModelConfig`.

Sources for the values:
  * Gemma 3 270M: the Hugging Face `google/gemma-3-270m` config.json (hidden 640, 18 layers, 4 heads, 1 KV head,
    head_dim 256, intermediate 2048, query_pre_attn_scalar 256, rope_theta 1e6, rope_local_base_freq 1e4,
    sliding_window 512, full attention at layers 5, 11, 17, no logit soft-capping) and llama.cpp
    `src/llama-model.cpp` (LLM_ARCH_GEMMA3), which hard-codes the values the GGUF omits: sliding-window pattern 6,
    local RoPE base 1e4, attention scale 1/sqrt(key_length), embedding scale sqrt(embedding_length).

Formats: GGUF (`config_from_gguf`; the tensors are read by `model_worker.checkpoints.gguf_convert`, whose llama.cpp names are
shared by Gemma-style GGUFs). Hugging Face checkpoints are not supported yet (`config_from_hf` says so): their
norm weights are stored as w with the multiplier 1 + w, which `model_worker.checkpoints.hf_loader` does not convert.
"""

from __future__ import annotations

import math

from families.gemma3 import FAMILY
from model_worker.modeling.config import LayerSpec, ModelConfig, WorkerPart


def gemma3_layers(
    num_layers: int,
    head_dim: int,
    num_kv_heads: int,
    mlp_dim: int,
    global_theta: float,
    local_theta: float = 10_000.0,
    pattern: int = 6,
    rope_scale: float = 1.0,
) -> tuple[LayerSpec, ...]:
    """Gemma 3 layer list: layer i is full attention when i % pattern == pattern - 1, sliding otherwise.

    Global layers use `global_theta` (and the linear `rope_scale`); local layers use `local_theta` unscaled
    (transformers Gemma3RotaryEmbedding: the local embedding has no scaling).
    """
    layers = []
    for i in range(num_layers):
        full = i % pattern == pattern - 1
        layers.append(
            LayerSpec(
                attention="full" if full else "sliding",
                head_dim=head_dim,
                num_kv_heads=num_kv_heads,
                rope_theta=global_theta if full else local_theta,
                rope_fraction=1.0,
                rope_scale=rope_scale if full else 1.0,
                kv_source=i,
                mlp_dim=mlp_dim,
            )
        )
    return tuple(layers)


GEMMA3_270M = ModelConfig(
    name="gemma-3-270m",
    architecture=FAMILY.name,
    vocab_size=262_144,
    hidden_size=640,
    num_heads=4,
    layers=gemma3_layers(num_layers=18, head_dim=256, num_kv_heads=1, mlp_dim=2048, global_theta=1_000_000.0),
    sliding_window=512,
    rms_norm_eps=1e-6,
    attn_scale=256**-0.5,  # query_pre_attn_scalar = 256
    embed_scale=math.sqrt(640),
    final_logit_softcap=None,
    bos_token_id=2,
    stop_token_ids=(1, 106),  # <eos>, <end_of_turn>
    max_position_embeddings=32_768,
)

PRESETS: dict[str, ModelConfig] = {GEMMA3_270M.name: GEMMA3_270M}
"""Gemma 3's spelled-out configs by name."""


def config_from_gguf(meta: dict, vocab_size: int, name: str = "gemma-3") -> ModelConfig:
    """Build a Gemma 3 config from GGUF `gemma3.*` metadata plus the values llama.cpp hard-codes.

    Args:
      meta: GGUF key/value metadata (keys like "gemma3.embedding_length").
      vocab_size: number of tokens (rows of token_embd; docs/formats.md §3.4: size the vocab from the token list).
      name: model name to report.

    Raises:
      ValueError: the metadata is not a gemma3 GGUF, or a required key is missing.
    """
    if meta.get("general.architecture") not in FAMILY.gguf_architectures:
        raise ValueError(f"not a gemma3 GGUF (general.architecture = {meta.get('general.architecture')!r})")
    try:
        hidden = int(meta["gemma3.embedding_length"])
        num_layers = int(meta["gemma3.block_count"])
        num_heads = int(meta["gemma3.attention.head_count"])
        num_kv = int(meta["gemma3.attention.head_count_kv"])
        head_dim = int(meta["gemma3.attention.key_length"])
        mlp = int(meta["gemma3.feed_forward_length"])
        eps = float(meta["gemma3.attention.layer_norm_rms_epsilon"])
        theta = float(meta["gemma3.rope.freq_base"])
        window = int(meta["gemma3.attention.sliding_window"])
    except KeyError as exc:
        raise ValueError(f"GGUF metadata lacks {exc.args[0]!r}") from None
    scale_type = meta.get("gemma3.rope.scaling.type")
    rope_scale = float(meta.get("gemma3.rope.scaling.factor", 1.0)) if scale_type == "linear" else 1.0
    softcap = meta.get("gemma3.final_logit_softcapping")
    return ModelConfig(
        name=name,
        architecture=FAMILY.name,
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_heads=num_heads,
        layers=gemma3_layers(num_layers, head_dim, num_kv, mlp, theta, rope_scale=rope_scale),
        sliding_window=window,
        rms_norm_eps=eps,
        # llama.cpp: kq_scale = 1/sqrt(n_embd_head_k) for every Gemma 3 size except 27B, whose
        # query_pre_attn_scalar is hidden/num_heads (HF config). Follow HF: scalar = head_dim unless 27B.
        attn_scale=(hidden // num_heads if num_layers == 62 else head_dim) ** -0.5,
        embed_scale=math.sqrt(hidden),
        final_logit_softcap=float(softcap) if softcap else None,
        bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)),
        stop_token_ids=(1, 106),
        max_position_embeddings=int(meta.get("gemma3.context_length", 32768)),
    )


def config_from_hf(config: dict, name: str) -> ModelConfig:
    """Gemma 3 from a Hugging Face checkpoint directory: not supported yet.

    Raises:
      NotImplementedError: always, naming the format and the one that works (GGUF).
    """
    raise NotImplementedError(
        f"{name}: Gemma 3 Hugging Face checkpoints (config.json + safetensors) are not supported yet; serve a "
        f"Gemma 3 GGUF instead")


PART = WorkerPart(config_from_hf=config_from_hf, config_from_gguf=config_from_gguf, presets=PRESETS)
"""Gemma 3's worker part (`common.families`)."""
