"""The batched KV cache: a pytree with one row per decode slot.

Layout (S = slots, T = max_model_len, W = sliding window, K = KV heads, D = head dim of the layer):
  * a full-attention layer keeps every position: `[S, T, K, D]`, position p stored at index p;
  * a sliding layer keeps a ring of the last W positions: `[S, W, K, D]`, position p stored at index p % W;
  * a KV-shared layer (Gemma 4) owns nothing (None) and reads its source layer's arrays.

Positions are logical: the ring index and the masks are derived from a token's position in its sequence, never
from where it sits in a padded batch. The cache holds no lengths: the caller passes each row's positions, and the
ring's contents follow from the position of the first token of the chunk (see `model.ring_positions`).
The engine owns the one live instance and donates it to every jitted step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from model_worker.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer K and V arrays (None for layers that own no cache).

    Attributes:
      k: per layer, `[S, T, K, D]` (full) or `[S, W, K, D]` (sliding) or None.
      v: same shapes as `k`.
    """

    k: list[jax.Array | None]
    v: list[jax.Array | None]

    @staticmethod
    def shapes(cfg: ModelConfig, num_slots: int, max_len: int) -> list[tuple[int, ...] | None]:
        """Shape of each layer's K (and V) array, None for layers without their own cache."""
        out: list[tuple[int, ...] | None] = []
        for i, spec in enumerate(cfg.layers):
            if spec.kv_source != i:
                out.append(None)
            else:
                length = max_len if spec.attention == "full" else cfg.sliding_window
                out.append((num_slots, length, spec.num_kv_heads, spec.head_dim))
        return out

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_slots: int, max_len: int, dtype: jnp.dtype) -> KVCache:
        """An all-zero cache for `num_slots` sequences of up to `max_len` positions."""
        shapes = cls.shapes(cfg, num_slots, max_len)
        k = [None if s is None else jnp.zeros(s, dtype) for s in shapes]
        v = [None if s is None else jnp.zeros(s, dtype) for s in shapes]
        return cls(k=k, v=v)

    @classmethod
    def abstract(cls, cfg: ModelConfig, num_slots: int, max_len: int, dtype: jnp.dtype) -> KVCache:
        """`jax.ShapeDtypeStruct` stand-ins, for ahead-of-time compilation."""
        shapes = cls.shapes(cfg, num_slots, max_len)
        k = [None if s is None else jax.ShapeDtypeStruct(s, dtype) for s in shapes]
        v = [None if s is None else jax.ShapeDtypeStruct(s, dtype) for s in shapes]
        return cls(k=k, v=v)

    def nbytes(self) -> int:
        """Bytes held by the cache arrays."""
        return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(self)))
