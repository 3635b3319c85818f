"""Static model configuration: one frozen dataclass that drives every shape in the decoder.

The config is hashable, so it can be a static argument of `jax.jit`. One config-driven decoder serves Gemma 3
and Gemma 4: per-layer facts (attention type, head size, RoPE, which layer's KV a layer reads, MLP width) live in
`LayerSpec`, so a model variant is a new preset, not a new code path.

Sources for the values:
  * Gemma 3 270M: the Hugging Face `google/gemma-3-270m` config.json (hidden 640, 18 layers, 4 heads, 1 KV head,
    head_dim 256, intermediate 2048, query_pre_attn_scalar 256, rope_theta 1e6, rope_local_base_freq 1e4,
    sliding_window 512, full attention at layers 5, 11, 17, no logit soft-capping) and llama.cpp
    `src/llama-model.cpp` (LLM_ARCH_GEMMA3), which hard-codes the values the GGUF omits: sliding-window pattern 6,
    local RoPE base 1e4, attention scale 1/sqrt(key_length), embedding scale sqrt(embedding_length).
  * Gemma 4: ../shared/docs/gemma4-architecture.md (issue 3).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

AttentionType = Literal["sliding", "full"]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Static description of one decoder layer.

    Attributes:
      attention: "sliding" (causal, window `ModelConfig.sliding_window`) or "full" (causal).
      head_dim: per-head size D of q, k and v for this layer.
      num_kv_heads: number of K/V heads (grouped-query attention).
      rope_theta: RoPE base.
      rope_fraction: fraction of `head_dim` that is rotated (1.0 = all dims; Gemma 4 full layers use 0.25
        "proportional" RoPE).
      rope_scale: linear RoPE position scaling factor (positions are divided by it); 1.0 = none.
      kv_source: index of the layer whose K/V this layer attends to; equal to the layer's own index unless the
        layer is KV-shared (Gemma 4). Only layers with `kv_source == index` own a cache.
      mlp_dim: width of the gated MLP.
    """

    attention: AttentionType
    head_dim: int
    num_kv_heads: int
    rope_theta: float
    rope_fraction: float
    rope_scale: float
    kv_source: int
    mlp_dim: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything static about a Gemma text decoder.

    Attributes:
      name: human-readable model name.
      architecture: "gemma3" or "gemma4".
      vocab_size: number of token ids (rows of the embedding table).
      hidden_size: residual stream width H.
      num_heads: query heads per layer.
      layers: one `LayerSpec` per decoder layer.
      sliding_window: W; a sliding layer's query at position q sees keys at positions k with q - W < k <= q.
      rms_norm_eps: epsilon inside every RMSNorm.
      attn_scale: multiplier of q·k (Gemma 3: query_pre_attn_scalar**-0.5; Gemma 4: 1.0).
      embed_scale: multiplier of the token embedding (sqrt(hidden_size) for Gemma).
      final_logit_softcap: if set, logits = cap * tanh(logits / cap).
      v_norm: apply a weightless RMSNorm to V (Gemma 4).
      layer_scalar: multiply the residual stream by a learned per-layer scalar at the end of each layer (Gemma 4).
      bos_token_id: beginning-of-sequence id.
      stop_token_ids: ids that end a sequence by default (EOS, end-of-turn).
      max_position_embeddings: the longest context the model was trained for.
    """

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    layers: tuple[LayerSpec, ...]
    sliding_window: int
    rms_norm_eps: float
    attn_scale: float
    embed_scale: float
    final_logit_softcap: float | None = None
    v_norm: bool = False
    layer_scalar: bool = False
    bos_token_id: int = 2
    stop_token_ids: tuple[int, ...] = (1,)
    max_position_embeddings: int = 32768

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return len(self.layers)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Indices of the layers that own a KV cache (those not reading another layer's KV)."""
        return tuple(i for i, spec in enumerate(self.layers) if spec.kv_source == i)

    def kv_bytes(self, itemsize: int) -> tuple[int, int]:
        """KV cache bytes as (per token of context, per sequence) for an element size in bytes.

        Full-attention layers keep every position (they grow with the context); sliding layers keep a ring of
        `sliding_window` positions (a fixed per-sequence cost).
        """
        per_token = per_sequence = 0
        for i in self.kv_layers:
            spec = self.layers[i]
            row = 2 * spec.num_kv_heads * spec.head_dim * itemsize  # K and V
            if spec.attention == "full":
                per_token += row
            else:
                per_sequence += row * self.sliding_window
        return per_token, per_sequence


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
    architecture="gemma3",
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


def gemma3_from_gguf_metadata(meta: dict, vocab_size: int, name: str = "gemma-3") -> ModelConfig:
    """Build a Gemma 3 config from GGUF `gemma3.*` metadata plus the values llama.cpp hard-codes.

    Args:
      meta: GGUF key/value metadata (keys like "gemma3.embedding_length").
      vocab_size: number of tokens (rows of token_embd; formats.md §3.4: size the vocab from the token list).
      name: model name to report.

    Raises:
      ValueError: the metadata is not a gemma3 GGUF, or a required key is missing.
    """
    if meta.get("general.architecture") != "gemma3":
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
        architecture="gemma3",
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


def config_to_dict(cfg: ModelConfig) -> dict:
    """JSON-serialisable form of a config (used for the converted-weights cache)."""
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict) -> ModelConfig:
    """Inverse of `config_to_dict`."""
    data = dict(data)
    data["layers"] = tuple(LayerSpec(**layer) for layer in data["layers"])
    data["stop_token_ids"] = tuple(data["stop_token_ids"])
    return ModelConfig(**data)
