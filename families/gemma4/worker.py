"""Gemma 4's worker part: its layer list (KV sharing, proportional RoPE), presets, Hugging Face config.json ->
`ModelConfig`, and the Hugging Face tensor names beyond the Gemma-style decoder's.

Sources for the values: docs/gemma4-architecture.md (transformers `Gemma4TextConfig`, `convert_gemma4_weights.py`).

Formats: Hugging Face checkpoints (`config_from_hf`, tensors read by `model_worker.checkpoints.hf_loader` with the
`HF_TOP_NAMES` / `HF_LAYER_NAMES` / `HF_SKIP_PREFIXES` hook below). GGUF is not supported (`config_from_gguf` says
so; the family registers no GGUF architecture).
"""

from __future__ import annotations

import math

from common import families
from families.gemma4 import FAMILY
from model_worker.modeling.config import LayerSpec, ModelConfig, WorkerPart

_S, _F = "sliding_attention", "full_attention"


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
        full = kind == _F
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
        architecture=FAMILY.name,
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
GEMMA4_E2B = _gemma4("gemma-4-e2b", hidden=1536, num_layers=35, pattern=[_S] * 4 + [_F], kv=1, kv_shared=20, double=True)
GEMMA4_E4B = _gemma4("gemma-4-e4b", hidden=2560, num_layers=42, pattern=[_S] * 5 + [_F], kv=2, kv_shared=18, double=False)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (GEMMA4_E2B, GEMMA4_E4B)}
"""Gemma 4's spelled-out configs by name."""

# The `model_worker.checkpoints.hf_loader` hook: Gemma 4's module names beyond the Gemma-style decoder's (docs/gemma4-
# architecture.md §8), as (our flat name, is_linear): the per-layer embeddings (PLE) and the layer scalar.
HF_TOP_NAMES: dict[str, tuple[str, bool]] = {
    "embed_tokens_per_layer": ("ple_embed", False),
    "per_layer_model_projection": ("ple_proj", True),
    "per_layer_projection_norm": ("ple_norm", False),
}
HF_LAYER_NAMES: dict[str, tuple[str, bool]] = {
    "per_layer_input_gate": ("ple_gate", True),
    "per_layer_projection": ("ple_proj", True),
    "post_per_layer_input_norm": ("ple_post_norm", False),
    "layer_scalar": ("layer_scalar", False),
}
# The multimodal release's towers and projections, skipped without being read.
HF_SKIP_PREFIXES: tuple[str, ...] = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                                     "model.embed_audio.", "model.multi_modal_projector.")


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
      families.UnknownFamilyError: no registered family serves the config (names its model_type).
      ValueError: another family's config, or inconsistent layer types.
    """
    family = families.from_hf_config(config)
    if family != FAMILY:
        raise ValueError(f"{name}: a {family.name} config.json, not a {FAMILY.name} one")
    text = config.get("text_config") or config
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
        architecture=FAMILY.name,
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


def config_from_gguf(meta: dict, vocab_size: int, name: str) -> ModelConfig:
    """Gemma 4 from a GGUF file: not supported.

    Raises:
      NotImplementedError: always, naming the format and the one that works (a Hugging Face checkpoint).
    """
    raise NotImplementedError(
        f"{name}: Gemma 4 GGUF files are not supported; serve a Gemma 4 Hugging Face checkpoint directory instead")


PART = WorkerPart(config_from_hf=config_from_hf, config_from_gguf=config_from_gguf, presets=PRESETS,
                  hf_top_names=HF_TOP_NAMES, hf_layer_names=HF_LAYER_NAMES, hf_skip_prefixes=HF_SKIP_PREFIXES)
"""Gemma 4's worker part (`common.families`)."""
