"""Static model configuration: one frozen dataclass that drives every shape in the decoder.

The config is hashable, so it can be a static argument of `jax.jit`. One config-driven decoder serves every model
family: per-layer facts (attention type, head size, RoPE, which layer's KV a layer reads, MLP width) live in
`LayerSpec`, so a model variant is a new config, not a new code path.

This module is generic. Each family's layer pattern, presets and config parsing (GGUF metadata, Hugging Face
config.json), with the sources of their values, live in its worker part (`families/<name>/worker.py`, a
`WorkerPart` found through the `common.families` registry: `worker_part`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from common import families

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
      architecture: the model family's name in the `families` registry ("gemma3", "gemma4").
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
      batch_invariant: a compute choice, not a checkpoint fact (the worker sets it with its matmul precision):
        attention in position-aligned key blocks with bfloat16 products (`attention.attend_invariant`), so that a
        row's result does not depend on the rows computed with it.
      attention_kernel: a compute choice too: "pallas" runs a decode step's attention, and in full layers any
        step of at most 16 queries per row (a verify step's drafts, a short prompt chunk; K/V not int8, not
        batch-invariant), through the Pallas kernel
        `numerics.decode_attention` on a TPU; "auto" does so only for steps of at least
        `attention.PALLAS_AUTO_KEYS` rows x KV bucket (the worker's default on one TPU); "xla" (the default here)
        and every other backend keep `attention.attend_in_place`. "pallas-interpret" runs the kernel's calls in
        Pallas's interpreter on any backend (the CPU tests of whole models through it; not a serving choice).
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
    batch_invariant: bool = False
    attention_kernel: str = "xla"

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


def config_to_dict(cfg: ModelConfig) -> dict:
    """JSON-serialisable form of a config (used for the converted-weights cache)."""
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict) -> ModelConfig:
    """Inverse of `config_to_dict`.

    Raises:
      families.UnknownFamilyError: the config's `architecture` names no registered family (a prepared directory
        from a build that served another family); the message lists the supported ones.
    """
    families.by_name(data["architecture"])
    data = dict(data)
    data["layers"] = tuple(LayerSpec(**layer) for layer in data["layers"])
    data["stop_token_ids"] = tuple(data["stop_token_ids"])
    return ModelConfig(**data)


TensorNames = Mapping[str, tuple[str, bool]]
"""Checkpoint tensor name (after the model prefix) -> (our weight name, whether it is a Linear weight to transpose)."""


@dataclasses.dataclass(frozen=True)
class WorkerPart:
    """What a model family gives the model worker (`families/<name>/worker.py` defines `PART`, one of these).

    Attributes:
      config_from_hf: (config.json as a dict, model name) -> ModelConfig. Raises NotImplementedError for a
        variant or format the family does not serve, ValueError for an inconsistent config.
      config_from_gguf: (GGUF metadata, vocabulary size, model name) -> ModelConfig; raises as `config_from_hf`.
      presets: the family's spelled-out configs by name (tests and benchmarks shrink them).
      hf_top_names, hf_layer_names: tensor names the family's checkpoints add to the Gemma-style ones of
        model_worker/checkpoints/hf_loader.py (outside the layers / inside `layers.{i}.`).
      hf_skip_prefixes: checkpoint tensor prefixes the text decoder does not read (vision and audio towers).
    """

    config_from_hf: Callable[[Mapping[str, Any], str], ModelConfig]
    config_from_gguf: Callable[[Mapping[str, Any], int, str], ModelConfig]
    presets: Mapping[str, ModelConfig]
    hf_top_names: TensorNames = dataclasses.field(default_factory=dict)
    hf_layer_names: TensorNames = dataclasses.field(default_factory=dict)
    hf_skip_prefixes: tuple[str, ...] = ()


def worker_part(family: families.Family) -> WorkerPart:
    """The family's worker part, imported on first use.

    Raises:
      TypeError: the family's worker module defines no `WorkerPart` as `PART`.
    """
    return family.part("worker", WorkerPart)
