"""The Gemma text decoder as one pure function: `forward(params, tokens, positions, cache, slots, cfg, ...)`.

A call processes a chunk of C tokens for each of B cache rows (prefill: B=1, C=chunk; decode: B=slots, C=1) and
returns the logits and the updated cache; `forward_batches` runs several such batches (a prompt chunk and a decode
step) in one pass over the weights. Padding is marked by position -1: padded tokens write nothing to the
cache and their outputs are ignored. Valid tokens come first in every row, with consecutive positions.

Math (Gemma 3: transformers `models/gemma3/modeling_gemma3.py`; Gemma 4: docs/gemma4-architecture.md):
  x = embed[tokens] * sqrt(H)
  per layer: x = x + post_attn_norm(attn(input_norm(x)));  x = x + post_ffw_norm(mlp(pre_ffw_norm(x)))
  attn: q = rope(q_norm(x Wq)), k = rope(k_norm(x Wk)), v = x Wv; softmax(q kᵀ · scale + mask) v Wo
  mlp: (gelu_tanh(x Wgate) * x Wup) Wdown
  logits = final_norm(x) @ embedᵀ  (optionally soft-capped)
RoPE uses the half-split ("rotate_half", NeoX) pairing: dim j pairs with j + D/2.

The blocks live beside this module: attention and its cache reads in `attention.py`, cache layout and writes in
`kv_cache.py`, the per-token blocks (norm, MLP, per-layer inputs, embedding, LM head) in `layers.py`. Each block of
the traced program runs under a `jax.named_scope` (`layer_<i>/attention`, `layer_<i>/mlp`,
`layer_<i>/per_layer_input`, `per_layer_inputs`, `write_rings`, `lm_head`), so device profiles name them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from model_worker.modeling.attention import BatchKV, attention_block
from model_worker.modeling.config import ModelConfig
from model_worker.modeling.kv_cache import KVCache, write_rings
from model_worker.modeling.layers import (
    embed_rows,
    joint,
    lm_head,
    mlp,
    per_layer_inputs,
    ple_block,
    rms_norm,
)
from model_worker.modeling.params import Params
from model_worker.numerics import elementwise


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """One batch of a forward pass: C tokens for each of B cache rows (prefill: B=1, C=chunk; decode: C=1). A
    pytree, so a compiled program takes it as one argument.

    Attributes:
      tokens: [B, C] int32 token ids (padding ids are ignored).
      positions: [B, C] int32 logical positions; valid tokens first with consecutive positions, padding = -1.
      slots: [B] int32 cache rows (distinct), or None for "rows 0..B-1 are slots 0..B-1".
      logit_rows: [B] int32 index of the chunk position whose logits to return per row, or None for all.
    """

    tokens: jax.Array
    positions: jax.Array
    slots: jax.Array | None = None
    logit_rows: jax.Array | None = None


def forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    slots: jax.Array | None,
    cfg: ModelConfig,
    kv_len: int,
    logit_rows: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run the decoder over a chunk of tokens for a batch of cache rows (`forward_batches` with one Batch).

    Args:
      params: weights.
      tokens, positions, slots, logit_rows: as in `Batch`.
      cache: the KV cache (S rows); donated by callers.
      cfg: static model config.
      kv_len: static; full-attention layers read cache positions [0, kv_len). A full-attention layer must have
        kv_len > every valid position.
    Returns:
      logits: [B, V] float32 (or [B, C, V] when logit_rows is None); the updated cache.
    """
    logits, cache = forward_batches(params, (Batch(tokens, positions, slots, logit_rows),), cache, cfg, kv_len)
    return logits[0], cache


def forward_batches(
    params: Params, batches: tuple[Batch, ...], cache: KVCache, cfg: ModelConfig, kv_len: int
) -> tuple[list[jax.Array], KVCache]:
    """Run the decoder over several batches in one pass, e.g. a prompt chunk of one slot and a decode step of
    others (a "mixed" step, as vLLM's chunked prefill and Sarathi-Serve's stall-free batching do).

    The attention projections, the MLP and the LM head run once on the concatenated rows of all batches
    (`layers.joint`), so B decode rows ride on a C-token chunk's matrix products instead of a second pass over
    those weights; each batch attends over its own cache rows. (Gemma 4's per-layer-input branch, a small part of
    the weights, still runs per batch.) The result equals running the batches one after another, each with
    `forward` (to float32 summation order).

    Args:
      params: weights.
      batches: Batch tuples; the slots of their valid rows must be distinct across all batches (a row whose
        positions are all -1 writes nothing and may name any slot). Either every batch has logit_rows, or none
        has.
      cache: the KV cache (S rows); donated by callers.
      cfg: static model config.
      kv_len: static; full-attention layers read cache positions [0, kv_len); must exceed every valid position.
    Returns:
      per batch, logits [B, V] float32 (or [B, C, V] when logit_rows is None); the updated cache.
    Raises:
      ValueError: some batches have logit_rows and others do not.
    """
    if len({b.logit_rows is None for b in batches}) != 1:
        raise ValueError("forward_batches: either every batch has logit_rows or none has")
    dtype = params.final_norm.dtype  # the activation dtype (the embedding may be stored as Int8Weight)
    states = [BatchKV.of(b.positions, b.slots) for b in batches]
    xs = [embed_rows(params.embed, b.tokens, dtype) * jnp.asarray(cfg.embed_scale, dtype) for b in batches]
    with jax.named_scope("per_layer_inputs"):
        plis = [per_layer_inputs(params, b.tokens, x, cfg) if cfg.ple_dim else None for b, x in zip(batches, xs)]
    cache = KVCache(k=list(cache.k), v=list(cache.v), k_scale=list(cache.k_scale), v_scale=list(cache.v_scale))
    # KV-shared layers write no cache, so only the rows whose logits are wanted need to pass through them
    # (transformers Gemma4TextModel._maybe_slice_kv_shared_inputs): prefill computes them for one token.
    pick_rows = batches[0].logit_rows is not None
    cut = cfg.first_shared_layer if pick_rows else cfg.num_layers
    for i, (lp, spec) in enumerate(zip(params.layers, cfg.layers)):
        if i == cut:
            for s, (b, st) in enumerate(zip(batches, states)):
                xs[s], st.positions = _pick(xs[s], b.logit_rows), _pick(st.positions, b.logit_rows)
                plis[s] = _pick(plis[s], b.logit_rows) if plis[s] is not None else None
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("attention"):
                hs = [rms_norm(x, lp.input_norm, cfg) for x in xs]
                attn = attention_block(lp, spec, i, hs, states, cache, kv_len, cfg)
                xs = [x + rms_norm(a, lp.post_attn_norm, cfg) for x, a in zip(xs, attn)]
            with jax.named_scope("mlp"):
                ffw = joint(functools.partial(mlp, lp), [rms_norm(x, lp.pre_ffw_norm, cfg) for x in xs])
                xs = [x + rms_norm(f, lp.post_ffw_norm, cfg) for x, f in zip(xs, ffw)]
            if cfg.ple_dim:
                with jax.named_scope("per_layer_input"):
                    xs = [x + ple_block(lp, x, pli[:, :, i], cfg) for x, pli in zip(xs, plis)]
            if cfg.layer_scalar:
                xs = [x * lp.layer_scalar.astype(x.dtype) for x in xs]
    with jax.named_scope("write_rings"):
        for b, st in zip(batches, states):  # any batch's final state depends on every batch's reads (joint)
            write_rings(cache, st.deferred, xs[0], b.positions, st.start, st.n_valid, b.slots)
    if pick_rows and cut == cfg.num_layers:  # not cut yet: keep each row's logit position, [B, 1, H]
        xs = [_pick(x, b.logit_rows) for x, b in zip(xs, batches)]
    with jax.named_scope("lm_head"):
        logits = joint(lambda h: _logits(params, h, cfg), xs)
    return [lg[:, 0] if pick_rows else lg for lg in logits], cache


def _pick(a: jax.Array, rows: jax.Array) -> jax.Array:
    """Each batch row's entry at chunk index rows[b]: a [B, C, ...] -> [B, 1, ...]."""
    return jnp.take_along_axis(a, rows.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)


def _logits(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm, tied LM head and optional soft cap: x [..., H] -> logits float32 [..., V]."""
    head = params.embed if params.lm_head is None else params.lm_head
    logits = lm_head(rms_norm(x, params.final_norm, cfg), head)
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * elementwise.tanh(logits / cfg.final_logit_softcap)
    return logits


@functools.partial(jax.jit, static_argnames=("cfg", "kv_len"), donate_argnames=("cache",))
def forward_jit(params, tokens, positions, cache, slots, cfg, kv_len, logit_rows=None):
    """`forward` under `jax.jit` with the cache donated (for tests and tools; the engine compiles its own grid)."""
    return forward(params, tokens, positions, cache, slots, cfg, kv_len, logit_rows)
