"""The decoder's per-token building blocks: RMSNorm, the gated MLP, Gemma 4's per-layer inputs, the embedding
lookup and the tied LM head, plus `joint`, which runs a row-wise block once over several batches.

None of these mixes tokens (attention does: `model_worker/modeling/attention.py`) or touches the KV cache
(`model_worker/modeling/kv_cache.py`); `model_worker/modeling/model.py` assembles them into the decoder.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model_worker.modeling.config import ModelConfig
from model_worker.modeling.params import LayerParams, Params
from model_worker.numerics import elementwise
from model_worker.numerics.fixed_order import fixed_order_sum
from model_worker.numerics.q8 import Q8Weight, q8_linear
from model_worker.numerics.quant import Bf16Weight, Int8Weight, bf16_linear, int8_linear, linear


def rms_norm(x: jax.Array, w: jax.Array | None, cfg: ModelConfig) -> jax.Array:
    """RMSNorm over the last axis, `x / sqrt(mean(x²) + eps) * w`, computed in float32, returned in x.dtype.

    `w` is the effective multiplier (see params.py); None means no weight (Gemma 4 v_norm). eps is
    `cfg.rms_norm_eps`; with `cfg.batch_invariant` the sum of squares is `fixed_order_sum` (one order for every
    array shape), else XLA's reduction (cheaper to compile; figures: docs/performance.md,
    "`fixed_order.fixed_order_sum` in RMSNorm").
    """
    xf = x.astype(jnp.float32)
    squares = xf * xf
    total = fixed_order_sum(squares) if cfg.batch_invariant else jnp.sum(squares, axis=-1)
    y = xf * elementwise.rsqrt(total[..., None] / xf.shape[-1] + cfg.rms_norm_eps)
    if w is not None:
        y = y * w.astype(jnp.float32)
    return y.astype(x.dtype)


def joint(fn, xs: list[jax.Array]) -> list[jax.Array]:
    """fn applied once to the rows of every batch: xs are [B_s, C_s, H] arrays, fn maps [R, H] -> [R, H'] row by
    row; returns [B_s, C_s, H'] per batch. One batch passes straight through (no concatenation); several share
    one weight read, and their small batches ride on one larger matrix product."""
    if len(xs) == 1:
        return [fn(xs[0])]
    y = fn(jnp.concatenate([x.reshape(-1, x.shape[-1]) for x in xs]))
    out, at = [], 0
    for x in xs:
        n = x.shape[0] * x.shape[1]
        out.append(y[at:at + n].reshape(x.shape[:2] + y.shape[1:]))
        at += n
    return out


def mlp(lp: LayerParams, x: jax.Array) -> jax.Array:
    """Gated MLP: (gelu_tanh(x Wgate) * x Wup) Wdown; x [..., H] -> [..., H]."""
    return linear(elementwise.gelu_tanh(linear(x, lp.gate)) * linear(x, lp.up), lp.down)


def per_layer_inputs(params: Params, tokens: jax.Array, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gemma 4 per-layer embeddings (PLE), docs/gemma4-architecture.md §3.

    Args:
      tokens: [B, C] ids; x: [B, C, H] the scaled token embeddings.
    Returns:
      [B, C, L, P]: (RMSNorm_P(x W_plmp · H^-0.5) + ple_embed[tokens] · sqrt(P)) · 2^-0.5, layer-major.
    """
    B, C, H = x.shape
    L, P = cfg.num_layers, cfg.ple_dim
    ids = jnp.where(tokens < cfg.ple_vocab, tokens, 0)
    token_part = jnp.take(params.ple_embed, ids, axis=0) * jnp.asarray(P**0.5, x.dtype)
    context = linear(x, params.ple_proj) * jnp.asarray(H**-0.5, x.dtype)
    context = rms_norm(context.reshape(B, C, L, P), params.ple_norm, cfg)
    return (context + token_part.reshape(B, C, L, P)) * jnp.asarray(2**-0.5, x.dtype)


def ple_block(lp: LayerParams, x: jax.Array, pli: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The per-layer-input residual branch: post_norm(proj(gelu_tanh(gate(x)) * pli)); x [B, C, H], pli
    [B, C, P] -> [B, C, H]."""
    h = elementwise.gelu_tanh(linear(x, lp.ple_gate)) * pli
    return rms_norm(linear(h, lp.ple_proj), lp.ple_post_norm, cfg)


def embed_rows(embed: jax.Array | Int8Weight, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Embedding lookup: tokens int32 [...] -> [..., H] in `dtype` (an Int8Weight dequantizes only these rows)."""
    if isinstance(embed, Int8Weight):
        return embed.rows(tokens, dtype)
    return jnp.take(embed, tokens, axis=0).astype(dtype)


def lm_head(x: jax.Array, embed: jax.Array | Int8Weight | Bf16Weight | Q8Weight) -> jax.Array:
    """Tied LM head: x [..., H] -> logits float32 [..., V] = x · embedᵀ (Gemma ties the head to the embedding;
    a `Bf16Weight` or `Q8Weight` is its copy at another matmul precision, `Params.lm_head`)."""
    if isinstance(embed, Q8Weight):
        return q8_linear(x, embed, out_dtype=jnp.float32)
    if isinstance(embed, Bf16Weight):
        return bf16_linear(x, embed, out_dtype=jnp.float32)
    if isinstance(embed, Int8Weight):
        return int8_linear(x, embed, out_dtype=jnp.float32)
    return jnp.einsum("...h,vh->...v", x, embed, preferred_element_type=jnp.float32)
