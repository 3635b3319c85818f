"""The batched KV cache: a pytree with one row per decode slot.

Layout (S = slots, T = max_model_len, W = sliding window, K = KV heads, D = head dim of the layer):
  * a full-attention layer keeps every position: `[S, T, K, D]`, position p stored at index p;
  * a sliding layer keeps a ring of the last R >= W positions: `[S, R, K, D]`, position p stored at index p % R.
    R = W + slack: the slack keeps up to `slack` positions beyond the window, so a new prompt that shares a slot's
    tokens up to a point at most `slack` + 1 positions back can reuse the slot exactly (prefix reuse);
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
      k: per layer, `[S, T, K, D]` (full) or `[S, W, K, D]` (sliding) or None; the compute dtype, or int8.
      v: same shapes as `k`.
      k_scale, v_scale: with int8 storage, float32 `[S, T, K]` / `[S, W, K]`: one scale per stored token and KV
        head (x ≈ q * scale, scale = max|x| / 127 over the head dim); otherwise None per layer.
    """

    k: list[jax.Array | None]
    v: list[jax.Array | None]
    k_scale: list[jax.Array | None]
    v_scale: list[jax.Array | None]

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored as int8 with per-token, per-head scales."""
        return any(s is not None for s in self.k_scale)

    @staticmethod
    def shapes(cfg: ModelConfig, num_slots: int, max_len: int, slack: int = 0) -> list[tuple[int, ...] | None]:
        """Shape of each layer's K (and V) array, None for layers without their own cache."""
        out: list[tuple[int, ...] | None] = []
        for i, spec in enumerate(cfg.layers):
            if spec.kv_source != i:
                out.append(None)
            else:
                length = max_len if spec.attention == "full" else min(cfg.sliding_window + slack, max_len)
                out.append((num_slots, length, spec.num_kv_heads, spec.head_dim))
        return out

    @classmethod
    def zeros(
        cls, cfg: ModelConfig, num_slots: int, max_len: int, dtype: jnp.dtype, int8: bool = False, slack: int = 0
    ) -> KVCache:
        """An all-zero cache for `num_slots` sequences of up to `max_len` positions (int8 + scales if `int8`;
        sliding rings of window + `slack` positions)."""
        shapes = cls.shapes(cfg, num_slots, max_len, slack)
        store = jnp.int8 if int8 else dtype
        k = [None if s is None else jnp.zeros(s, store) for s in shapes]
        v = [None if s is None else jnp.zeros(s, store) for s in shapes]
        k_scale = [None if s is None or not int8 else jnp.zeros(s[:-1], jnp.float32) for s in shapes]
        v_scale = [None if s is None or not int8 else jnp.zeros(s[:-1], jnp.float32) for s in shapes]
        return cls(k=k, v=v, k_scale=k_scale, v_scale=v_scale)

    def nbytes(self) -> int:
        """Bytes held by the cache arrays."""
        return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(self)))
