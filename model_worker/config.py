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
  * Gemma 4: docs/gemma4-architecture.md.
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
      k_eq_v: V is the raw K projection (no v_proj; Gemma 4 `attention_k_eq_v` full layers).
    """

    attention: AttentionType
    head_dim: int
    num_kv_heads: int
    rope_theta: float
    rope_fraction: float
    rope_scale: float
    kv_source: int
    mlp_dim: int
    k_eq_v: bool = False


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
      ple_dim: width P of the per-layer embeddings (Gemma 4 PLE; 0 = none).
      ple_vocab: rows of the per-layer embedding table.
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
    ple_dim: int = 0
    ple_vocab: int = 0
    bos_token_id: int = 2
    stop_token_ids: tuple[int, ...] = (1,)
    max_position_embeddings: int = 32768

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return len(self.layers)

    @property
    def first_shared_layer(self) -> int:
        """Index of the first KV-shared layer (num_layers when none): later layers write no cache."""
        shared = [i for i, spec in enumerate(self.layers) if spec.kv_source != i]
        return min(shared, default=self.num_layers)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Indices of the layers that own a KV cache (those not reading another layer's KV)."""
        return tuple(i for i, spec in enumerate(self.layers) if spec.kv_source == i)

    def kv_bytes(self, itemsize: int, scale_bytes: int = 0) -> tuple[int, int]:
        """KV cache bytes as (per token of context, per sequence) for an element size in bytes (plus, for int8
        storage, `scale_bytes` per token and KV head).

        Full-attention layers keep every position (they grow with the context); sliding layers keep a ring of
        `sliding_window` positions (a fixed per-sequence cost).
        """
        per_token = per_sequence = 0
        for i in self.kv_layers:
            spec = self.layers[i]
            row = 2 * spec.num_kv_heads * (spec.head_dim * itemsize + scale_bytes)  # K and V
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
      vocab_size: number of tokens (rows of token_embd; docs/formats.md §3.4: size the vocab from the token list).
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


# ----- Gemma 4 ---------------------------------------------------------------------------------------------------
def gemma4_layers(
    layer_types: list[str],
    head_dim: int,
    global_head_dim: int,
    num_kv_heads: int,
    global_kv_heads: int,
    mlp_dim: int,
    num_kv_shared: int,
    double_wide_mlp: bool,
    k_eq_v: bool,
    local_theta: float = 10_000.0,
    global_theta: float = 1_000_000.0,
    global_rope_fraction: float = 0.25,
) -> tuple[LayerSpec, ...]:
    """Gemma 4 layer list (docs/gemma4-architecture.md §4–6; transformers `Gemma4TextConfig.kv_sharing_modes`).

    Layers >= L - num_kv_shared are KV-shared: each reads the last non-shared layer of its own attention type
    and, with `double_wide_mlp`, has a 2x wide MLP. Full layers use `global_head_dim`, proportional RoPE over
    `global_rope_fraction` of the dims, and with `k_eq_v` take V from the raw K projection with `global_kv_heads`.

    Raises:
      ValueError: an attention type used by shared layers has no non-shared layer to read from.
    """
    n = len(layer_types)
    first_shared = n - num_kv_shared
    prefix = layer_types[:first_shared]
    layers = []
    for i, kind in enumerate(layer_types):
        full = kind == "full_attention"
        source = i
        if i >= first_shared:
            if kind not in prefix:
                raise ValueError(f"no non-shared {kind} layer for KV-shared layer {i} to read from")
            source = first_shared - 1 - prefix[::-1].index(kind)
        layers.append(
            LayerSpec(
                attention="full" if full else "sliding",
                head_dim=global_head_dim if full else head_dim,
                num_kv_heads=global_kv_heads if full and k_eq_v else num_kv_heads,
                rope_theta=global_theta if full else local_theta,
                rope_fraction=global_rope_fraction if full else 1.0,
                rope_scale=1.0,
                kv_source=source,
                mlp_dim=mlp_dim * (2 if double_wide_mlp and i >= first_shared > 0 else 1),
                k_eq_v=k_eq_v and full,
            )
        )
    return tuple(layers)


def _gemma4(name: str, hidden: int, num_layers: int, pattern: list[str], kv: int, kv_shared: int, double: bool):
    return ModelConfig(
        name=name,
        architecture="gemma4",
        vocab_size=262_144,
        hidden_size=hidden,
        num_heads=8,
        layers=gemma4_layers(
            (pattern * num_layers)[:num_layers], head_dim=256, global_head_dim=512, num_kv_heads=kv,
            global_kv_heads=kv, mlp_dim=4 * hidden, num_kv_shared=kv_shared, double_wide_mlp=double, k_eq_v=False,
        ),
        sliding_window=512,
        rms_norm_eps=1e-6,
        attn_scale=1.0,
        embed_scale=math.sqrt(hidden),
        final_logit_softcap=30.0,
        v_norm=True,
        layer_scalar=True,
        ple_dim=256,
        ple_vocab=262_144,
        bos_token_id=2,
        stop_token_ids=(1, 106),
        max_position_embeddings=131_072,
    )


# transformers `convert_gemma4_weights.py` _VARIANTS (and docs/gemma4-architecture.md §1): E2B full attention at
# i % 5 == 4, 20 KV-shared layers with double-wide MLPs; E4B full at i % 6 == 5, 18 shared layers, 2 KV heads.
_S, _F = "sliding_attention", "full_attention"
GEMMA4_E2B = _gemma4("gemma-4-e2b", hidden=1536, num_layers=35, pattern=[_S] * 4 + [_F], kv=1, kv_shared=20, double=True)
GEMMA4_E4B = _gemma4("gemma-4-e4b", hidden=2560, num_layers=42, pattern=[_S] * 5 + [_F], kv=2, kv_shared=18, double=False)
PRESETS = {c.name: c for c in (GEMMA3_270M, GEMMA4_E2B, GEMMA4_E4B)}


def _per_layer_override(text: dict, index: int, key: str):
    """A transformers >= 5.2 `per_layer_config` value for one layer (keys may be zero-padded strings: "04")."""
    overrides = text.get("per_layer_config") or {}
    if not isinstance(overrides, dict):
        return None
    for k, entry in overrides.items():
        if str(k).lstrip("0") == str(index).lstrip("0") and isinstance(entry, dict):
            return entry.get(key)
    return None


def config_from_hf(config: dict, name: str) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json (Gemma 4 multimodal with `text_config`, or text-only).

    Reads both the released format (`global_head_dim`, `num_global_key_value_heads`) and transformers >= 5.2's
    `per_layer_config` overrides.

    Raises:
      NotImplementedError: MoE (26B-A4B) or bidirectional attention over all tokens.
      ValueError: not a Gemma 4 config, or inconsistent layer types.
    """
    text = config.get("text_config") or config
    model_type = text.get("model_type", config.get("model_type", ""))
    if not model_type.startswith("gemma4"):
        raise ValueError(f"{name}: unsupported model_type {model_type!r} (expected gemma4 or gemma4_text)")
    if text.get("enable_moe_block"):
        raise NotImplementedError(f"{name}: Gemma 4 MoE (26B-A4B) is not supported yet")
    if text.get("use_bidirectional_attention") == "all":
        raise NotImplementedError(f"{name}: bidirectional attention over all tokens is not supported")
    n = int(text["num_hidden_layers"])
    types = list(text.get("layer_types") or [_F if (i + 1) % 6 == 0 else _S for i in range(n)])
    types[-1] = _F  # transformers forces the last layer to full attention
    full_idx = types.index(_F)
    k_eq_v = bool(text.get("attention_k_eq_v", False))
    global_head = _per_layer_override(text, full_idx, "head_dim") or text.get("global_head_dim") or 512
    global_kv = _per_layer_override(text, full_idx, "num_key_value_heads") or (
        text.get("num_global_key_value_heads") if k_eq_v else None
    ) or text.get("num_key_value_heads", 1)
    # transformers' defaults when rope_parameters is absent (Gemma4TextConfig.__post_init__).
    rope = text.get("rope_parameters") or {}
    full_rope = rope.get(_F) or {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    local_rope = rope.get(_S) or {"rope_type": "default", "rope_theta": 1e4}
    if full_rope.get("rope_type", "proportional") not in ("proportional", "default"):
        raise NotImplementedError(f"{name}: rope_type {full_rope.get('rope_type')!r} is not supported")
    hidden = int(text["hidden_size"])
    eos = config.get("eos_token_id", text.get("eos_token_id", 1))
    return ModelConfig(
        name=name,
        architecture="gemma4",
        vocab_size=int(text.get("vocab_size", 262_144)),
        hidden_size=hidden,
        num_heads=int(text["num_attention_heads"]),
        layers=gemma4_layers(
            types,
            head_dim=int(text.get("head_dim", 256)),
            global_head_dim=int(global_head),
            num_kv_heads=int(text.get("num_key_value_heads", 1)),
            global_kv_heads=int(global_kv),
            mlp_dim=int(text["intermediate_size"]),
            num_kv_shared=int(text.get("num_kv_shared_layers", 0)),
            double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
            k_eq_v=k_eq_v,
            local_theta=float(local_rope.get("rope_theta", 10_000.0)),
            global_theta=float(full_rope.get("rope_theta", 1_000_000.0)),
            global_rope_fraction=float(full_rope.get("partial_rotary_factor", 1.0)
                                       if full_rope.get("rope_type") == "proportional" else 1.0),
        ),
        sliding_window=int(text.get("sliding_window", 512)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        attn_scale=1.0,
        embed_scale=math.sqrt(hidden),
        final_logit_softcap=float(text["final_logit_softcapping"]) if text.get("final_logit_softcapping") else None,
        v_norm=True,
        layer_scalar=True,
        ple_dim=int(text.get("hidden_size_per_layer_input") or 0),
        ple_vocab=int(text.get("vocab_size_per_layer_input") or 0) if text.get("hidden_size_per_layer_input") else 0,
        bos_token_id=int(config.get("bos_token_id", text.get("bos_token_id", 2))),
        stop_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
        max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
    )
