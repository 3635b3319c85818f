"""The device side of the worker: weights, the KV cache, per-slot penalty state, and a fixed grid of programs.

Every model program is one jitted `step` = forward + sample, with the KV cache and the penalty state donated
(updated in place, never copied per token). The grid is enumerated and compiled ahead of time at start-up
(`Engine.compile_all`):

  * compute (batch 1, C tokens of one slot, KV bucket L) -> ("compute", 1, C, L): prompt chunks, forced-token
    runs (several tokens per slot in one step), and the first step of a forked sequence
  * decode  (B slots, one token each, KV bucket L)        -> ("decode", B, 1, L), B in the batch buckets
  * copy    (one slot's KV and penalty rows to another)   -> ("copy", 1, 0, 0): `n` > 1 shares the prompt's KV

Batch buckets are powers of two up to num_slots: a lone sequence runs the B=1 programs, and a decode batch of n
sequences runs the smallest bucket >= n, padded with idle slots (position -1: they write nothing). KV buckets
are the sliding window times powers of `kv_bucket_factor`, capped by max_model_len: full-attention layers read
only cache positions [0, L). Sampling settings, seeds, masks, positions and token ids are runtime arrays, so no
request can trigger a compilation; a shape outside the grid is a bug and raises KeyError instead of compiling
silently. Compiled programs live in JAX's persistent compilation cache (`enable_compilation_cache`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from model_worker.config import ModelConfig
from model_worker.kv_cache import KVCache
from model_worker.model import forward
from model_worker.params import Params
from model_worker.sampling import PenaltyState, SampleOutput, SamplingArrays, penalty_state_zeros, sample

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes.

    Attributes:
      num_slots: sequences held at once (rows of the KV cache); the largest decode batch.
      max_model_len: context limit in tokens (prompt + generated); the full-attention cache length.
      prefill_chunks: chunk lengths of the compute program; prompts are cut into chunks of the largest, their
        tail padded to the smallest chunk that holds it.
      dtype: weights and activations dtype ("float32" or "bfloat16").
      kv_int8: store K/V as int8 with per-token, per-head scales.
      kv_bucket_factor: ratio between consecutive KV-length buckets.
      prefix_slack: sliding-ring positions kept beyond the window, so a new prompt that diverges from a slot's
        history at most this many tokens before its end reuses the slot exactly (prefix reuse).
      max_waiting: bound of the waiting queue (requests beyond it are refused: RESOURCE_EXHAUSTED).
    """

    num_slots: int = 4
    max_model_len: int = 8192
    prefill_chunks: tuple[int, ...] = (64, 512)
    dtype: str = "float32"
    kv_int8: bool = False
    kv_bucket_factor: int = 4
    prefix_slack: int = 256
    max_waiting: int | None = 64

    def kv_buckets(self, window: int) -> tuple[int, ...]:
        """KV length buckets: window * factor**i below max_model_len, then max_model_len."""
        buckets, b = [], max(window, min(self.prefill_chunks))
        while b < self.max_model_len:
            buckets.append(b)
            b *= self.kv_bucket_factor
        return tuple(buckets) + (self.max_model_len,)

    def batch_buckets(self) -> tuple[int, ...]:
        """Decode batch sizes: powers of two below num_slots, then num_slots."""
        buckets, b = [], 1
        while b < self.num_slots:
            buckets.append(b)
            b *= 2
        return tuple(buckets) + (self.num_slots,)


@dataclasses.dataclass
class HostOutput:
    """A program's sampling result on the host (numpy), one entry per requested row.

    Attributes:
      tokens: [R] int32; logprobs: [R] float32; top_ids: [R, 20] int32 (-1 = none); top_logprobs: [R, 20];
      mask_empty: [R] bool (the row's mask allowed nothing: the constraint is unsatisfiable).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    mask_empty: np.ndarray

    @staticmethod
    def from_device(out: SampleOutput, rows: int) -> HostOutput:
        fields = jax.device_get((out.tokens, out.logprobs, out.top_ids, out.top_logprobs, out.mask_empty))
        return HostOutput(*(np.asarray(f)[:rows] for f in fields))


def _record_inputs(state: PenaltyState, tokens, positions, is_output) -> PenaltyState:
    """Note the step's input tokens: every valid one is `seen` (repetition penalty), output ones also `counts`."""
    valid = positions >= 0
    vocab = state.seen.shape[1]
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
    ids = jnp.where(valid, tokens, vocab)  # out of range -> dropped
    seen = state.seen.at[rows, ids].set(True, mode="drop")
    counts = state.counts.at[rows, jnp.where(valid & is_output, tokens, vocab)].add(1, mode="drop")
    return PenaltyState(counts=counts, seen=seen)


def _step(params, cache, pstate, tokens, positions, slots, is_output, reset, logit_rows, sampling, *, cfg, kv_len):
    """forward + penalty bookkeeping + sample, for the batch rows `slots` of the cache and penalty state.

    Args:
      tokens, positions, is_output: [B, C]; slots, reset, logit_rows: [B]; sampling: [B] rows.
    Returns:
      (SampleOutput [B], cache, pstate).
    """
    logits, cache = forward(params, tokens, positions, cache, slots, cfg, kv_len, logit_rows)
    rows = jax.tree_util.tree_map(lambda a: jnp.take(a, slots, axis=0), pstate)
    rows = jax.tree_util.tree_map(lambda a: jnp.where(reset.reshape((-1,) + (1,) * (a.ndim - 1)), 0, a).astype(a.dtype),
                                  rows)
    rows = _record_inputs(rows, tokens, positions, is_output)
    out = sample(logits, sampling, rows)
    pstate = jax.tree_util.tree_map(lambda a, r: a.at[slots].set(r), pstate, rows)
    return out, cache, pstate


def _copy(cache, pstate, src, dst):
    """Copy slot src's KV rows and penalty rows to slot dst (src, dst: int32 scalars)."""
    move = lambda a: None if a is None else a.at[dst].set(a[src])
    cache = jax.tree_util.tree_map(move, cache)
    pstate = jax.tree_util.tree_map(move, pstate)
    return cache, pstate


class Engine:
    """Owns the weights, the KV cache, the penalty state and the compiled programs. One thread drives it."""

    def __init__(self, cfg: ModelConfig, params: Params, ecfg: EngineConfig):
        """Allocate the KV cache and penalty state for `ecfg.num_slots` sequences of `ecfg.max_model_len` tokens.

        Raises:
          ValueError: max_model_len exceeds the model's max_position_embeddings, or a chunk exceeds max_model_len.
        """
        if ecfg.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {ecfg.max_model_len} exceeds the model's context of {cfg.max_position_embeddings}"
            )
        if max(ecfg.prefill_chunks) > ecfg.max_model_len:
            raise ValueError(f"prefill chunk {max(ecfg.prefill_chunks)} exceeds max_model_len {ecfg.max_model_len}")
        self.cfg, self.ecfg, self.params = cfg, ecfg, params
        self.dtype = jnp.dtype(ecfg.dtype)
        self.cache = KVCache.zeros(cfg, ecfg.num_slots, ecfg.max_model_len, self.dtype, int8=ecfg.kv_int8,
                                   slack=ecfg.prefix_slack)
        self.pstate = penalty_state_zeros(ecfg.num_slots, cfg.vocab_size)
        self.kv_buckets = ecfg.kv_buckets(cfg.sliding_window)
        self.batch_buckets = ecfg.batch_buckets()
        self._programs: dict[tuple[str, int, int, int], jax.stages.Compiled] = {}
        self.calls: collections.Counter = collections.Counter()  # program key -> times run

    # ----- the grid -------------------------------------------------------------------------------------------
    def grid(self) -> list[tuple[str, int, int, int]]:
        """Every program key (kind, batch, tokens per row, kv_len)."""
        keys = [("compute", 1, c, L) for c in self.ecfg.prefill_chunks for L in self.kv_buckets]
        keys += [("decode", b, 1, L) for b in self.batch_buckets for L in self.kv_buckets]
        return keys + [("copy", 1, 0, 0)]

    def _example_args(self, batch: int, chunk: int):
        tokens = np.zeros((batch, chunk), np.int32)
        positions = np.full((batch, chunk), -1, np.int32)
        flags = np.zeros((batch, chunk), bool)
        return (tokens, positions, np.arange(batch, dtype=np.int32), flags, np.zeros(batch, bool),
                np.zeros(batch, np.int32), SamplingArrays.defaults(batch, self.cfg.vocab_size))

    def _lower(self, key):
        kind, batch, chunk, kv_len = key
        if kind == "copy":
            fn = jax.jit(_copy, donate_argnames=("cache", "pstate"))
            return fn.lower(self.cache, self.pstate, np.int32(0), np.int32(0))
        fn = jax.jit(functools.partial(_step, cfg=self.cfg, kv_len=kv_len), donate_argnames=("cache", "pstate"))
        return fn.lower(self.params, self.cache, self.pstate, *self._example_args(batch, chunk))

    def compile_all(self, progress=None, keys=None) -> float:
        """Compile every program of the grid (or just `keys`, for benchmarks) ahead of time. Returns the seconds.

        Args:
          progress: optional callable(done, total, key) for start-up progress messages.
          keys: a subset of `grid()` to compile instead of all of it.
        """
        t0 = time.perf_counter()
        keys = self.grid() if keys is None else list(keys)
        for n, key in enumerate(keys):
            self._programs[key] = self._lower(key).compile()
            if progress:
                progress(n + 1, len(keys), key)
        return time.perf_counter() - t0

    @property
    def num_programs(self) -> int:
        """Number of compiled programs."""
        return len(self._programs)

    def kv_bucket(self, length: int) -> int:
        """Smallest KV bucket holding `length` positions.

        Raises:
          ValueError: length exceeds max_model_len.
        """
        for b in self.kv_buckets:
            if length <= b:
                return b
        raise ValueError(f"{length} positions exceed max_model_len {self.ecfg.max_model_len}")

    def batch_bucket(self, rows: int) -> int:
        """Smallest decode batch bucket holding `rows` sequences."""
        return next(b for b in self.batch_buckets if rows <= b)

    def chunk_size(self, remaining: int) -> int:
        """Chunk length for `remaining` tokens: the smallest chunk that holds them, else the largest."""
        for c in sorted(self.ecfg.prefill_chunks):
            if remaining <= c:
                return c
        return max(self.ecfg.prefill_chunks)

    # ----- running programs -----------------------------------------------------------------------------------
    def _run(self, key, *args) -> SampleOutput:
        self.calls[key] += 1
        out, self.cache, self.pstate = self._programs[key](self.params, self.cache, self.pstate, *args)
        return out

    def compute(
        self, slot: int, token_ids: list[int], start: int, is_output: list[bool], sampling: SamplingArrays,
        reset: bool,
    ) -> tuple[HostOutput, int]:
        """Compute up to one chunk of a slot's pending tokens and sample after the last one computed.

        Args:
          slot: cache row.
          token_ids: the tokens to compute, from position `start` on (only the first chunk's worth is used).
          start: position of token_ids[0]; positions < start must already be in the cache.
          is_output: per token, whether it is a generated (not prompt) token, for the penalty counts.
          sampling: 1-row settings, used if this chunk computes the last pending token.
          reset: clear the slot's penalty history first (a new sequence).
        Returns:
          (1-row sample result, number of tokens consumed). The sample is meaningful only when all of token_ids
          were consumed.
        """
        chunk = self.chunk_size(len(token_ids))
        n = min(chunk, len(token_ids))
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :n] = token_ids[:n]
        positions = np.full((1, chunk), -1, np.int32)
        positions[0, :n] = np.arange(start, start + n)
        outputs = np.zeros((1, chunk), bool)
        outputs[0, :n] = is_output[:n]
        key = ("compute", 1, chunk, self.kv_bucket(start + n))
        out = self._run(key, tokens, positions, np.array([slot], np.int32), outputs, np.array([reset]),
                        np.array([n - 1], np.int32), sampling)
        return HostOutput.from_device(out, 1), n

    def decode(
        self, slots: list[int], tokens: list[int], positions: list[int], is_output: list[bool],
        sampling: SamplingArrays, reset: list[bool] | None = None,
    ) -> HostOutput:
        """One decode step for the given slots (one token each), in the smallest batch bucket.

        Args:
          slots: distinct cache rows of the sequences to advance.
          tokens, positions: each slot's input token and its position.
          is_output: whether each input token is a generated token (False for a forked sequence's last prompt
            token).
          sampling: settings with len(slots) rows.
          reset: per slot, clear its penalty history first (a fresh sequence whose prompt is one token).
        Returns:
          The sample result, one row per given slot, in order.
        """
        n = len(slots)
        batch = self.batch_bucket(n)
        idle = [s for s in range(self.ecfg.num_slots) if s not in set(slots)][: batch - n]
        all_slots = np.array(list(slots) + idle, np.int32)
        tok = np.zeros((batch, 1), np.int32)
        tok[:n, 0] = tokens
        pos = np.full((batch, 1), -1, np.int32)
        pos[:n, 0] = positions
        outs = np.zeros((batch, 1), bool)
        outs[:n, 0] = is_output
        resets = np.zeros(batch, bool)
        resets[:n] = reset if reset is not None else False
        rows = _pad_rows(sampling, batch, self.cfg.vocab_size)
        kv_len = self.kv_bucket(max(positions) + 1)
        out = self._run(("decode", batch, 1, kv_len), tok, pos, all_slots, outs, resets,
                        np.zeros(batch, np.int32), rows)
        return HostOutput.from_device(out, n)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one slot's KV cache rows and penalty history to another slot."""
        self.calls[("copy", 1, 0, 0)] += 1
        self.cache, self.pstate = self._programs[("copy", 1, 0, 0)](self.cache, self.pstate, np.int32(src),
                                                                     np.int32(dst))

    def weight_bytes(self) -> int:
        """Bytes of weights on the device."""
        return self.params.nbytes()

    def kv_bytes(self) -> tuple[int, int]:
        """KV bytes (per token of context, per sequence), measured from the allocated arrays: full-attention
        layers grow with the context; sliding rings (window + slack) are a fixed per-sequence cost."""
        per_token = per_seq = 0
        arrays = zip(self.cache.k, self.cache.v, self.cache.k_scale, self.cache.v_scale)
        for i, group in enumerate(arrays):
            row_bytes = sum(a.nbytes for a in group if a is not None) // self.ecfg.num_slots
            if row_bytes == 0:
                continue
            if self.cfg.layers[i].attention == "full":
                per_token += row_bytes // self.ecfg.max_model_len
            else:
                per_seq += row_bytes
        return per_token, per_seq


def _pad_rows(sampling: SamplingArrays, batch: int, vocab: int) -> SamplingArrays:
    """Extend `sampling` (n rows) to `batch` rows with greedy defaults."""
    n = sampling.temperature.shape[0]
    if n == batch:
        return sampling
    pad = SamplingArrays.defaults(batch - n, vocab)
    return jax.tree_util.tree_map(lambda a, b: np.concatenate([a, b]), sampling, pad)


def enable_compilation_cache(path: str) -> None:
    """Persist compiled programs under `path` (JAX's persistent compilation cache), whatever their compile time."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
