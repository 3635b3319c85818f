"""The device side of the worker: weights, the KV cache, per-slot penalty state, and a fixed grid of programs.

Every model program is one jitted `step` = forward + sample, with the KV cache and the penalty state donated
(updated in place, never copied per token). The grid is enumerated and compiled ahead of time at start-up
(`Engine.compile_all`):

  * compute (batch 1, C tokens of one slot, KV bucket L) -> ("compute", 1, C, L): prompt chunks and forced-token
    runs (several tokens per slot in one step)
  * decode  (B slots, one token each, KV bucket L)        -> ("decode", B, 1, L), B in the batch buckets
  * mixed   (one slot's chunk of C tokens + a decode batch)-> ("mixed", B, C, max_model_len), C the smallest
    chunk: a prompt chunk and the running streams' next tokens in one pass over the weights
    (`model.forward_batches`); one KV bucket only, the largest (see `Engine.grid`)
  * sample  (B rows of logits)                            -> ("sample", B, 0, 0): penalties, masks, sampling
  * greedy  (B rows, all plain greedy, no reset)          -> ("greedy", B, 0, 0): mask + argmax only
  * copy    (one slot's KV and penalty rows to another)   -> ("copy", 1, 0, 0): prefix reuse, `n` > 1

The forward programs return logits that stay on the device; sampling is a separate program, dispatched once
the token masks of constrained rows have arrived, so a client builds step t's mask while step t's forward pass
runs (JAX dispatches asynchronously).

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
from model_worker.model import Batch, forward, forward_batches
from model_worker.params import Params
from model_worker.sampling import (
    PenaltyState,
    SampleOutput,
    SamplingArrays,
    is_plain_greedy,
    penalty_state_zeros,
    sample,
    sample_greedy,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes.

    Attributes:
      num_slots: sequences held at once (rows of the KV cache); the largest decode batch.
      max_model_len: context limit in tokens (prompt + generated); the full-attention cache length.
      prefill_chunks: chunk lengths of the compute program; a prompt is cut into the largest chunks that it fills,
        and only its last chunk is padded (`Engine.chunk_size`).
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


def _record_inputs(state: PenaltyState, tokens, positions, is_output, rows=None) -> PenaltyState:
    """Note the step's input tokens [B, C]: every valid one (position >= 0) is `seen` (repetition penalty), output
    ones also `counts`. `rows`: [B] state row of each batch row (default: row b is state row b)."""
    valid = positions >= 0
    vocab = state.seen.shape[1]
    rows = jnp.arange(tokens.shape[0]) if rows is None else rows
    rows = jnp.broadcast_to(rows[:, None], tokens.shape)
    ids = jnp.where(valid, tokens, vocab)  # out of range -> dropped
    seen = state.seen.at[rows, ids].set(True, mode="drop")
    counts = state.counts.at[rows, jnp.where(valid & is_output, tokens, vocab)].add(1, mode="drop")
    return PenaltyState(counts=counts, seen=seen)


def _forward(params, cache, tokens, positions, slots, logit_rows, *, cfg, kv_len):
    """The model on a batch of cache rows; returns (logits [B, V] float32, cache). No sampling: the logits stay on
    the device until `_sample` runs, so token masks only need to exist by then."""
    return forward(params, tokens, positions, cache, slots, cfg, kv_len, logit_rows)


def _forward_chunk(params, cache, pstate, tokens, positions, slots, logit_rows, is_output, reset, *, cfg, kv_len):
    """`_forward` for a compute chunk, which also records its input tokens in the row's penalty history (cleared
    first when `reset`): a chunk's tokens are committed whatever happens to the sample after it."""
    logits, cache = forward(params, tokens, positions, cache, slots, cfg, kv_len, logit_rows)
    return logits, cache, _record_chunk(pstate, tokens, positions, slots, is_output, reset)


def _forward_mixed(params, cache, pstate, tokens, positions, slots, logit_rows, is_output, reset, d_tokens,
                   d_positions, d_slots, d_logit_rows, *, cfg, kv_len):
    """A compute chunk (as `_forward_chunk`) and a decode batch (as `_forward`) in one forward pass
    (`forward_batches`).

    Args:
      tokens, positions, is_output: the chunk's [1, C] int32 / int32 (-1 = padding) / bool; slots, logit_rows,
        reset: [1] int32 / int32 / bool.
      d_tokens, d_positions: the decode batch's [B, 1] int32 (-1 = idle row); d_slots, d_logit_rows: [B] int32.
    Returns:
      (chunk logits [1, V] float32, decode logits [B, V] float32, cache, pstate).
    """
    batches = (Batch(tokens, positions, slots, logit_rows), Batch(d_tokens, d_positions, d_slots, d_logit_rows))
    (logits, d_logits), cache = forward_batches(params, batches, cache, cfg, kv_len)
    return logits, d_logits, cache, _record_chunk(pstate, tokens, positions, slots, is_output, reset)


def _record_chunk(pstate, tokens, positions, slots, is_output, reset):
    """A chunk's tokens [B, C] recorded in its rows' penalty history (cleared first where `reset` [B])."""
    rows = jax.tree_util.tree_map(lambda a: jnp.take(a, slots, axis=0), pstate)
    rows = jax.tree_util.tree_map(
        lambda a: jnp.where(reset.reshape((-1,) + (1,) * (a.ndim - 1)), 0, a).astype(a.dtype), rows)
    rows = _record_inputs(rows, tokens, positions, is_output)
    return jax.tree_util.tree_map(lambda a, r: a.at[slots].set(r), pstate, rows)


def _sample_greedy(pstate, logits, tokens, positions, slots, is_output, active, sampling):
    """`_sample` for a batch that passes `is_plain_greedy` and resets no row: `sample_greedy`, and each active
    row's input token recorded in its penalty history by point updates (no [B, V] row copies), which leaves the
    history exactly as `_sample` would. Returns (SampleOutput [B], pstate)."""
    committed = jnp.where(active[:, None], positions, -1)  # an inactive row records nothing
    return sample_greedy(logits, sampling), _record_inputs(pstate, tokens, committed, is_output, rows=slots)


def _sample(pstate, logits, tokens, positions, slots, is_output, reset, active, sampling):
    """Penalty bookkeeping + sampling for the batch rows `slots`: records each row's input token (positions -1:
    none, e.g. a compute chunk, which recorded its own), then samples.

    Rows with `active` False are sampled but commit nothing (their penalty history is left untouched): a row
    whose token mask did not arrive in time is recomputed at a later step.
    Returns:
      (SampleOutput [B], pstate).
    """
    old = jax.tree_util.tree_map(lambda a: jnp.take(a, slots, axis=0), pstate)
    expand = lambda flag, a: flag.reshape((-1,) + (1,) * (a.ndim - 1))
    rows = jax.tree_util.tree_map(lambda a: jnp.where(expand(reset, a), 0, a).astype(a.dtype), old)
    rows = _record_inputs(rows, tokens, positions, is_output)
    out = sample(logits, sampling, rows)
    kept = jax.tree_util.tree_map(lambda new, prev: jnp.where(expand(active, new), new, prev), rows, old)
    pstate = jax.tree_util.tree_map(lambda a, r: a.at[slots].set(r), pstate, kept)
    return out, pstate


@dataclasses.dataclass
class Pending:
    """A dispatched forward pass whose logits await sampling (JAX runs it asynchronously meanwhile).

    Attributes:
      logits: [B, V] float32 on the device.
      slots, tokens, positions, is_output: the batch rows' inputs, padded to B.
      rows: rows that belong to real sequences (the first `rows` of the batch).
    """

    logits: jax.Array
    slots: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    is_output: np.ndarray
    rows: int


@dataclasses.dataclass
class _ChunkInputs:
    """Host arrays of one compute chunk (batch 1, `chunk` tokens, the first `n` valid); `make` builds them."""

    chunk: int
    n: int
    tokens: np.ndarray  # [1, chunk] int32
    positions: np.ndarray  # [1, chunk] int32, -1 = padding
    slots: np.ndarray  # [1] int32
    is_output: np.ndarray  # [1, chunk] bool
    reset: bool

    @staticmethod
    def make(chunk: int, slot: int, token_ids: list[int], start: int, is_output: list[bool], reset: bool):
        """The first min(chunk, len(token_ids)) tokens at positions start.., padded to `chunk`."""
        n = min(chunk, len(token_ids))
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :n] = token_ids[:n]
        positions = np.full((1, chunk), -1, np.int32)
        positions[0, :n] = np.arange(start, start + n)
        outputs = np.zeros((1, chunk), bool)
        outputs[0, :n] = is_output[:n]
        return _ChunkInputs(chunk, n, tokens, positions, np.array([slot], np.int32), outputs, reset)

    def arrays(self) -> tuple:
        """The chunk program's inputs after (params, cache, pstate)."""
        return (self.tokens, self.positions, self.slots, np.array([self.n - 1], np.int32), self.is_output,
                np.array([self.reset]))

    def pending(self, logits: jax.Array) -> Pending:
        """The chunk's last-token logits awaiting sampling (the chunk recorded its own inputs)."""
        none = np.full((1, 1), -1, np.int32)
        return Pending(logits, self.slots, self.tokens[:, :1], none, self.is_output[:, :1], 1)


@dataclasses.dataclass
class _DecodeInputs:
    """Host arrays of one decode batch padded to its bucket (`rows` real rows first) and its KV bucket."""

    slots: np.ndarray  # [B] int32
    tokens: np.ndarray  # [B, 1] int32
    positions: np.ndarray  # [B, 1] int32, -1 = idle
    is_output: np.ndarray  # [B, 1] bool
    rows: int
    kv_len: int

    def arrays(self) -> tuple:
        """The forward inputs (tokens, positions, slots, logit_rows [B] = 0)."""
        return self.tokens, self.positions, self.slots, np.zeros(self.slots.shape[0], np.int32)

    def pending(self, logits: jax.Array) -> Pending:
        """The batch's logits [B, V] awaiting sampling."""
        return Pending(logits, self.slots, self.tokens, self.positions, self.is_output, self.rows)


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
        self._pad_only_tail = jax.default_backend() == "cpu"  # chunk_size's policy
        self.mixed_chunk = min(ecfg.prefill_chunks)  # the chunk of a mixed step (`dispatch_mixed`)

    # ----- the grid -------------------------------------------------------------------------------------------
    def grid(self) -> list[tuple[str, int, int, int]]:
        """Every program key (kind, batch, tokens per row, kv_len)."""
        keys = [("compute", 1, c, L) for c in self.ecfg.prefill_chunks for L in self.kv_buckets]
        keys += [("decode", b, 1, L) for b in self.batch_buckets for L in self.kv_buckets]
        # The full-attention layers read only the key blocks each row's position needs (`model._attend_blocks`), so
        # the KV bucket is just the bound of that loop: a mixed step costs about the same in the largest bucket as
        # in a small one. Mixed programs, the slowest to compile, therefore exist for the largest bucket only
        # (figures: docs/performance.md).
        # (None with one slot: a mixed step needs a decoding slot besides the chunk's.)
        if self.ecfg.num_slots > 1:
            keys += [("mixed", b, self.mixed_chunk, self.kv_buckets[-1]) for b in self.batch_buckets]
        keys += [(kind, b, 0, 0) for kind in ("sample", "greedy") for b in sorted(set(self.batch_buckets) | {1})]
        return keys + [("copy", 1, 0, 0)]

    def _lower(self, key):
        kind, batch, chunk, kv_len = key
        if kind == "copy":
            fn = jax.jit(_copy, donate_argnames=("cache", "pstate"))
            return fn.lower(self.cache, self.pstate, np.int32(0), np.int32(0))
        if kind in ("sample", "greedy"):
            fn = jax.jit(_sample if kind == "sample" else _sample_greedy, donate_argnames=("pstate",))
            flags = np.zeros((batch, 1), bool)
            reset = (np.zeros(batch, bool),) if kind == "sample" else ()
            return fn.lower(self.pstate, jax.ShapeDtypeStruct((batch, self.cfg.vocab_size), jnp.float32),
                            np.zeros((batch, 1), np.int32), np.full((batch, 1), -1, np.int32),
                            np.arange(batch, dtype=np.int32), flags, *reset, np.zeros(batch, bool),
                            SamplingArrays.defaults(batch, self.cfg.vocab_size))
        if kind == "compute":
            fn = jax.jit(functools.partial(_forward_chunk, cfg=self.cfg, kv_len=kv_len),
                         donate_argnames=("cache", "pstate"))
        elif kind == "mixed":
            fn = jax.jit(functools.partial(_forward_mixed, cfg=self.cfg, kv_len=kv_len),
                         donate_argnames=("cache", "pstate"))
        else:
            fn = jax.jit(functools.partial(_forward, cfg=self.cfg, kv_len=kv_len), donate_argnames=("cache",))
        return fn.lower(*self._state(kind), *_idle_args(kind, batch, chunk))

    def _state(self, kind: str) -> tuple:
        """A forward program's leading arguments: (params, cache) and, for chunk programs, the penalty state."""
        return (self.params, self.cache) + ((self.pstate,) if kind in ("compute", "mixed") else ())

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

    def warm_up(self) -> float:
        """Run every compiled forward program (compute, decode, mixed) once on all-padding inputs. Returns seconds.

        The first call of a compiled program costs much more than later ones on XLA CPU, which a fresh server would
        otherwise spend inside its first requests' steps (figures: docs/performance.md). Padding (position
        -1) writes nothing to the KV cache and records nothing in the penalty history, so the state is unchanged;
        `calls` does not count these runs.
        """
        t0 = time.perf_counter()
        for key, program in self._programs.items():
            kind, batch, chunk, _ = key
            if kind not in ("compute", "decode", "mixed"):
                continue
            out = program(*self._state(kind), *_idle_args(kind, batch, chunk))
            if kind == "decode":  # (logits, cache)
                logits, self.cache = out
            else:  # (logits, [decode logits,] cache, pstate)
                *logits, self.cache, self.pstate = out
            jax.block_until_ready(logits)
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
        """Chunk length for `remaining` tokens.

        CPU: the largest chunk they fill, else (the tail) the smallest that holds them, so only a prompt's last
        chunk is padded, by less than the smallest chunk: 600 tokens with chunks (64, 512) run as 512 + 64 + 64
        (40 pads), not 512 + 512 (424 pads). On CPU a chunk costs about the same per token at every size, so a
        padded token costs as much as a real one (figures: docs/performance.md). Other platforms: the smallest
        chunk that holds them, else the largest (an accelerator reads all weights per chunk and pads nearly for
        free, so fewer, larger chunks win; not measured here).
        """
        chunks = sorted(self.ecfg.prefill_chunks)
        filled = [c for c in chunks if c <= remaining]
        if filled and self._pad_only_tail:
            return filled[-1]
        return next((c for c in chunks if c >= remaining), chunks[-1])

    # ----- running programs -----------------------------------------------------------------------------------
    def _forward(self, key, tokens, positions, slots, logit_rows) -> jax.Array:
        self.calls[key] += 1
        logits, self.cache = self._programs[key](self.params, self.cache, tokens, positions, slots, logit_rows)
        return logits

    def dispatch_compute(
        self, slot: int, token_ids: list[int], start: int, is_output: list[bool], reset: bool = False
    ) -> tuple[Pending, int]:
        """Dispatch one chunk of a slot's pending tokens (asynchronously).

        Args:
          slot: cache row.
          token_ids: the tokens to compute, from position `start` on (only the first chunk's worth is used).
          start: position of token_ids[0]; positions < start must already be in the cache.
          is_output: per token, whether it is a generated (not prompt) token, for the penalty counts.
          reset: clear the slot's penalty history first (a fresh sequence).
        Returns:
          (the pending logits of the last token consumed, number of tokens consumed).
        """
        c = _ChunkInputs.make(self.chunk_size(len(token_ids)), slot, token_ids, start, is_output, reset)
        key = ("compute", 1, c.chunk, self.kv_bucket(start + c.n))
        self.calls[key] += 1
        logits, self.cache, self.pstate = self._programs[key](self.params, self.cache, self.pstate, *c.arrays())
        return c.pending(logits), c.n

    def dispatch_decode(self, slots: list[int], tokens: list[int], positions: list[int], is_output: list[bool]) -> Pending:
        """Dispatch one decode step for the given slots (one token each), in the smallest batch bucket.

        Args:
          slots: distinct cache rows of the sequences to advance.
          tokens, positions: each slot's input token and its position.
          is_output: whether each input token is a generated token (False for a forked sequence's last prompt
            token).
        """
        d = self._decode_inputs(slots, tokens, positions, is_output)
        return d.pending(self._forward(("decode", d.slots.shape[0], 1, d.kv_len), *d.arrays()))

    def dispatch_mixed(
        self, slot: int, token_ids: list[int], start: int, is_output: list[bool], reset: bool,
        slots: list[int], tokens: list[int], positions: list[int], decode_is_output: list[bool],
    ) -> tuple[Pending, int, Pending]:
        """One chunk of a slot's pending tokens (as `dispatch_compute`) and a decode step of other slots (as
        `dispatch_decode`) in one forward pass when the chunk is `mixed_chunk` long (a "mixed" program: the
        decode rows ride on the chunk's matrix products, the weights are read once); otherwise the two programs
        one after the other. Arguments, result and errors: `engine_api.Engine.dispatch_mixed`.
        """
        if slot in slots:
            raise ValueError(f"slot {slot} cannot take a chunk and decode in the same step")
        chunk = self.chunk_size(len(token_ids))
        if chunk != self.mixed_chunk:
            pending, n = self.dispatch_compute(slot, token_ids, start, is_output, reset)
            return pending, n, self.dispatch_decode(slots, tokens, positions, decode_is_output)
        c = _ChunkInputs.make(chunk, slot, token_ids, start, is_output, reset)
        d = self._decode_inputs(slots, tokens, positions, decode_is_output, exclude=slot)
        self.kv_bucket(start + c.n)  # raises ValueError beyond max_model_len, as dispatch_compute does
        key = ("mixed", d.slots.shape[0], chunk, self.kv_buckets[-1])
        self.calls[key] += 1
        logits, d_logits, self.cache, self.pstate = self._programs[key](
            self.params, self.cache, self.pstate, *c.arrays(), *d.arrays())
        return c.pending(logits), c.n, d.pending(d_logits)

    def _decode_inputs(self, slots, tokens, positions, is_output, exclude: int | None = None) -> _DecodeInputs:
        """A decode batch padded to its bucket with idle slots (position -1: they write nothing and their outputs
        are ignored); `exclude` (a mixed step's chunk slot) only when no other slot is left."""
        n = len(slots)
        batch = self.batch_bucket(n)
        idle = [s for s in range(self.ecfg.num_slots) if s not in set(slots) and s != exclude]
        idle = (idle + ([] if exclude is None else [exclude]))[: batch - n]
        tok = np.zeros((batch, 1), np.int32)
        tok[:n, 0] = tokens
        pos = np.full((batch, 1), -1, np.int32)
        pos[:n, 0] = positions
        outs = np.zeros((batch, 1), bool)
        outs[:n, 0] = is_output
        return _DecodeInputs(np.array(list(slots) + idle, np.int32), tok, pos, outs, n,
                             self.kv_bucket(max(positions) + 1))

    def sample(self, pending: Pending, sampling: SamplingArrays, reset: list[bool], active: list[bool]) -> HostOutput:
        """Sample the pending logits (blocks until the forward pass and the sampling are done).

        Args:
          pending: from dispatch_compute / dispatch_decode / dispatch_mixed.
          sampling: settings with `pending.rows` rows.
          reset: per row, clear its penalty history first (a fresh sequence).
          active: per row, whether to commit (False: the row's mask did not arrive; it will be recomputed).
        Returns:
          One result row per real row.
        """
        batch = pending.slots.shape[0]
        n = pending.rows
        flags = lambda values: np.array(list(values) + [False] * (batch - n), bool)
        rows = _pad_rows(sampling, batch, self.cfg.vocab_size)
        greedy = not any(reset[:n]) and is_plain_greedy(sampling, n)
        key = ("greedy" if greedy else "sample", batch, 0, 0)
        self.calls[key] += 1
        head = (self.pstate, pending.logits, pending.tokens, pending.positions, pending.slots, pending.is_output)
        tail = (flags(active), rows) if greedy else (flags(reset), flags(active), rows)
        out, self.pstate = self._programs[key](*head, *tail)
        return HostOutput.from_device(out, n)

    # Convenience for tests and benchmarks: dispatch + sample in one call.
    def compute(self, slot, token_ids, start, is_output, sampling, reset) -> tuple[HostOutput, int]:
        """dispatch_compute + sample (all rows active)."""
        pending, n = self.dispatch_compute(slot, token_ids, start, is_output, reset)
        return self.sample(pending, sampling, [False], [True]), n

    def decode(self, slots, tokens, positions, is_output, sampling, reset=None) -> HostOutput:
        """dispatch_decode + sample (all rows active)."""
        pending = self.dispatch_decode(slots, tokens, positions, is_output)
        return self.sample(pending, sampling, reset or [False] * len(slots), [True] * len(slots))

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


def _idle_args(kind: str, batch: int, chunk: int) -> tuple:
    """All-padding inputs of a forward program after its state arguments (`Engine._state`), with the runtime
    shapes and dtypes: they lower the program, and run it without writing anything (`Engine.warm_up`). A chunk
    (compute, mixed): tokens, positions [1, C], slot [1], logit row [1], is_output [1, C], reset [1]; then, for
    decode and mixed, a decode batch: tokens, positions [B, 1], slots [B], logit rows [B]."""
    def rows(b: int, c: int) -> tuple:
        return (np.zeros((b, c), np.int32), np.full((b, c), -1, np.int32), np.arange(b, dtype=np.int32),
                np.zeros(b, np.int32))

    chunk_args = rows(1, chunk) + (np.zeros((1, chunk), bool), np.zeros(1, bool))
    if kind == "compute":
        return chunk_args
    return (chunk_args if kind == "mixed" else ()) + rows(batch, 1)


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
