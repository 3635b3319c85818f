"""The engine's compiled programs: their typed inputs, their bodies, and `PROGRAMS`, the one table of program kinds
that lowering, warm-up and dispatch all read (`engine.Engine`).

A program takes some of the engine's state first (by attribute name: `params`, `cache`, `pstate`), then its
inputs, each a registered dataclass pytree (`model.Batch`, `ChunkInputs`, `SampleInputs`, `CopyInputs`), and
returns `(result, *updated state)`; the state it updates is donated, so XLA updates the KV cache and the penalty
history in place instead of copying them each step. A program's key is `ProgramKey(kind, batch, chunk, kv_len)`;
each kind's `grid` lists the shapes it is compiled for, and its `example` gives inputs of those shapes (all
padding for the forward kinds, which therefore run without writing anything: `Engine.warm_up`).

  kind     inputs                 grid (batch, chunk, kv_len)                         result
  compute  ChunkInputs            (1, C, L): C in prefill_chunks, L in kv_buckets      logits [1, V]
  decode   Batch                  (B, 1, L): B in batch_buckets                       logits [B, V]
  mixed    ChunkInputs, Batch     (B, mixed_chunk, the largest L), num_slots > 1      (logits [1, V], [B, V])
  sample   SampleInputs           (B, 0, 0): B in batch_buckets and 1                 SampleOutput [B]
  greedy   SampleInputs           as sample                                           SampleOutput [B]
  copy     CopyInputs             (1, 0, 0)                                           None
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model_worker.model import Batch, forward, forward_batches
from model_worker.sampling import PenaltyState, SamplingArrays, sample, sample_greedy


class ProgramKey(NamedTuple):
    """A compiled program: its kind (a key of `PROGRAMS`) and shapes. A tuple, so ("decode", 4, 1, 512) is one."""

    kind: str
    batch: int  # rows
    chunk: int  # tokens per row (0: no tokens, a sample or copy program)
    kv_len: int  # the KV bucket full-attention layers read up to (0: no forward pass)


@dataclasses.dataclass(frozen=True)
class GridSizes:
    """The sizes a program grid is enumerated from (`Engine.grid`).

    Attributes:
      prefill_chunks: compute chunk lengths; kv_buckets: KV lengths, ascending; batch_buckets: decode batch sizes,
      ascending; mixed_chunk: the chunk of a mixed step; num_slots: KV cache rows.
    """

    prefill_chunks: tuple[int, ...]
    kv_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...]
    mixed_chunk: int
    num_slots: int


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChunkInputs:
    """A compute chunk: C tokens of one slot (batch 1), recorded in its penalty history as it is computed.

    Attributes:
      batch: tokens, positions [1, C] int32 (-1 = padding), slots [1] int32, logit_rows [1] int32 (the last valid
        token's index).
      is_output: [1, C] bool, whether each token was generated (it counts for frequency / presence penalties).
      clear_penalties: [1] bool, clear the slot's penalty history first (a fresh sequence).
    """

    batch: Batch
    is_output: np.ndarray
    clear_penalties: np.ndarray

    @staticmethod
    def make(chunk: int, slot: int, token_ids: list[int], start: int, is_output: list[bool],
             clear_penalties: bool) -> tuple[ChunkInputs, int]:
        """The first n = min(chunk, len(token_ids)) tokens at positions start.., padded to `chunk`; returns the
        host arrays and n."""
        n = min(chunk, len(token_ids))
        inputs = ChunkInputs.idle(chunk, slot)
        inputs.batch.tokens[0, :n] = token_ids[:n]
        inputs.batch.positions[0, :n] = np.arange(start, start + n)
        inputs.batch.logit_rows[0] = n - 1
        inputs.is_output[0, :n] = is_output[:n]
        inputs.clear_penalties[0] = clear_penalties
        return inputs, n

    @staticmethod
    def idle(chunk: int, slot: int = 0) -> ChunkInputs:
        """An all-padding chunk of `chunk` tokens in `slot` (writable numpy arrays): it writes nothing."""
        return ChunkInputs(idle_batch(1, chunk, np.array([slot], np.int32)), np.zeros((1, chunk), bool),
                           np.zeros(1, bool))


def idle_batch(batch: int, chunk: int, slots: np.ndarray | None = None) -> Batch:
    """A Batch of `batch` all-padding rows of `chunk` tokens (writable numpy arrays; slots 0..batch-1 unless
    given, logit row 0): it writes nothing to the cache."""
    return Batch(np.zeros((batch, chunk), np.int32), np.full((batch, chunk), -1, np.int32),
                 np.arange(batch, dtype=np.int32) if slots is None else slots, np.zeros(batch, np.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleInputs:
    """A sample program's inputs: B rows of logits and what each row commits to its slot's penalty history.

    Attributes:
      logits: [B, V] float32.
      tokens, positions, is_output: [B, 1] int32 / int32 / bool, the row's input token, recorded in the history
        when its position is >= 0 (a compute chunk recorded its own: position -1).
      slots: [B] int32, the row's slot (the history row).
      clear_penalties: [B] bool, clear the history first (the greedy program has all False and ignores it).
      active: [B] bool; False: the row is sampled but commits nothing (its mask did not arrive).
      sampling: the rows' settings.
    """

    logits: jax.Array
    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    is_output: np.ndarray
    clear_penalties: np.ndarray
    active: np.ndarray
    sampling: SamplingArrays

    @staticmethod
    def example(batch: int, vocab: int) -> SampleInputs:
        """Inputs of the compiled shapes (the logits only as a shape: for lowering, not for running)."""
        return SampleInputs(jax.ShapeDtypeStruct((batch, vocab), jnp.float32), np.zeros((batch, 1), np.int32),
                            np.full((batch, 1), -1, np.int32), np.arange(batch, dtype=np.int32),
                            np.zeros((batch, 1), bool), np.zeros(batch, bool), np.zeros(batch, bool),
                            SamplingArrays.defaults(batch, vocab))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CopyInputs:
    """A slot copy: src, dst int32 scalars (cache rows)."""

    src: np.ndarray
    dst: np.ndarray


# ----- program bodies -------------------------------------------------------------------------------------------
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


def _record_chunk(pstate: PenaltyState, chunk: ChunkInputs) -> PenaltyState:
    """A chunk's tokens recorded in its rows' penalty history (cleared first where `clear_penalties`)."""
    b = chunk.batch
    rows = jax.tree_util.tree_map(lambda a: jnp.take(a, b.slots, axis=0), pstate)
    rows = jax.tree_util.tree_map(
        lambda a: jnp.where(chunk.clear_penalties.reshape((-1,) + (1,) * (a.ndim - 1)), 0, a).astype(a.dtype), rows)
    rows = _record_inputs(rows, b.tokens, b.positions, chunk.is_output)
    return jax.tree_util.tree_map(lambda a, r: a.at[b.slots].set(r), pstate, rows)


def decode_program(params, cache, decode: Batch, *, cfg, kv_len):
    """The model on a decode batch; returns (logits [B, V] float32, cache). No sampling: the logits stay on the
    device until a sample program runs, so token masks only need to exist by then."""
    return forward(params, decode.tokens, decode.positions, cache, decode.slots, cfg, kv_len, decode.logit_rows)


def compute_program(params, cache, pstate, chunk: ChunkInputs, *, cfg, kv_len):
    """A compute chunk, which also records its input tokens in the row's penalty history (cleared first when
    `clear_penalties`): a chunk's tokens are committed whatever happens to the sample after it. Returns (logits
    [1, V] float32, cache, pstate)."""
    b = chunk.batch
    logits, cache = forward(params, b.tokens, b.positions, cache, b.slots, cfg, kv_len, b.logit_rows)
    return logits, cache, _record_chunk(pstate, chunk)


def mixed_program(params, cache, pstate, chunk: ChunkInputs, decode: Batch, *, cfg, kv_len):
    """A compute chunk (as `compute_program`) and a decode batch (as `decode_program`) in one forward pass
    (`forward_batches`). Returns ((chunk logits [1, V], decode logits [B, V]) float32, cache, pstate)."""
    (logits, d_logits), cache = forward_batches(params, (chunk.batch, decode), cache, cfg, kv_len)
    return (logits, d_logits), cache, _record_chunk(pstate, chunk)


def greedy_program(pstate, inputs: SampleInputs, *, vocab_parts: int = 1):
    """`sample_program` for a batch that passes `is_plain_greedy` and clears no row's penalties:
    `sample_greedy`, and each active row's input token recorded in its penalty history by point updates (no
    [B, V] row copies), which leaves the history exactly as `sample_program` would. `vocab_parts` (static): the
    vocabulary's split across devices (`sampling.sample_greedy`). Returns (SampleOutput [B], pstate)."""
    committed = jnp.where(inputs.active[:, None], inputs.positions, -1)  # an inactive row records nothing
    return (sample_greedy(inputs.logits, inputs.sampling, vocab_parts),
            _record_inputs(pstate, inputs.tokens, committed, inputs.is_output, rows=inputs.slots))


def sample_program(pstate, inputs: SampleInputs, *, vocab_parts: int = 1):
    """Penalty bookkeeping + sampling for the batch rows `inputs.slots`: records each row's input token (positions
    -1: none, e.g. a compute chunk, which recorded its own), then samples (`vocab_parts`, static: the
    vocabulary's split across devices, `sampling.sample`).

    Rows with `active` False are sampled but commit nothing (their penalty history is left untouched): a row
    whose token mask did not arrive in time is recomputed at a later step.
    Returns:
      (SampleOutput [B], pstate).
    """
    slots = inputs.slots
    old = jax.tree_util.tree_map(lambda a: jnp.take(a, slots, axis=0), pstate)
    expand = lambda flag, a: flag.reshape((-1,) + (1,) * (a.ndim - 1))
    rows = jax.tree_util.tree_map(lambda a: jnp.where(expand(inputs.clear_penalties, a), 0, a).astype(a.dtype), old)
    rows = _record_inputs(rows, inputs.tokens, inputs.positions, inputs.is_output)
    out = sample(inputs.logits, inputs.sampling, rows, vocab_parts)
    kept = jax.tree_util.tree_map(lambda new, prev: jnp.where(expand(inputs.active, new), new, prev), rows, old)
    pstate = jax.tree_util.tree_map(lambda a, r: a.at[slots].set(r), pstate, kept)
    return out, pstate


def copy_program(cache, pstate, inputs: CopyInputs):
    """Copy slot src's KV rows and penalty rows to slot dst. Returns (None, cache, pstate)."""
    move = lambda a: None if a is None else a.at[inputs.dst].set(a[inputs.src])
    return None, jax.tree_util.tree_map(move, cache), jax.tree_util.tree_map(move, pstate)


# ----- the table ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ProgramKind:
    """How one kind of program is built, compiled and run.

    Attributes:
      fn: the body: fn(*state, *inputs) -> (result, *donated state), plus the static `cfg` and `kv_len` keywords
        when `model` is set.
      state: the engine attributes passed first, in order (they name fn's first parameters).
      donated: the state the program updates: donated (updated in place) and returned after the result.
      model: fn runs the model (takes `cfg` and `kv_len`).
      grid: the (batch, chunk, kv_len) shapes compiled for these sizes, in compilation order.
      example: inputs after the state for a key and the vocabulary size: their shapes lower the program; for a
        `warm` kind they are all padding and run without changing any state.
      warm: `Engine.warm_up` runs it once (the forward kinds).
      samples: fn samples logits and takes the static `vocab_parts` keyword (tensor parallelism).
    """

    fn: Callable
    state: tuple[str, ...]
    donated: tuple[str, ...]
    model: bool
    grid: Callable[[GridSizes], list[tuple[int, int, int]]]
    example: Callable[[ProgramKey, int], tuple[Any, ...]]
    warm: bool = False
    samples: bool = False


def _mixed_grid(g: GridSizes) -> list[tuple[int, int, int]]:
    """A mixed step reads only the key blocks each row's position needs (`attention._attend_blocks`), so the KV
    bucket is just the bound of that loop: it costs about the same in the largest bucket as in a small one.
    Mixed programs, the slowest to compile, therefore exist for the largest bucket only (figures:
    docs/performance.md); none with one slot (a mixed step needs a decoding slot besides the chunk's)."""
    if g.num_slots <= 1:
        return []
    return [(b, g.mixed_chunk, g.kv_buckets[-1]) for b in g.batch_buckets]


def _sample_grid(g: GridSizes) -> list[tuple[int, int, int]]:
    """Sampling runs for every decode batch bucket and for a compute chunk's single row."""
    return [(b, 0, 0) for b in sorted(set(g.batch_buckets) | {1})]


_FORWARD = ("params", "cache")
_CHUNK = ("params", "cache", "pstate")

#: Every kind of program, in compilation order.
PROGRAMS: dict[str, ProgramKind] = {
    "compute": ProgramKind(
        compute_program, _CHUNK, ("cache", "pstate"), model=True, warm=True,
        grid=lambda g: [(1, c, L) for c in g.prefill_chunks for L in g.kv_buckets],
        example=lambda key, vocab: (ChunkInputs.idle(key.chunk),)),
    "decode": ProgramKind(
        decode_program, _FORWARD, ("cache",), model=True, warm=True,
        grid=lambda g: [(b, 1, L) for b in g.batch_buckets for L in g.kv_buckets],
        example=lambda key, vocab: (idle_batch(key.batch, 1),)),
    "mixed": ProgramKind(
        mixed_program, _CHUNK, ("cache", "pstate"), model=True, warm=True, grid=_mixed_grid,
        example=lambda key, vocab: (ChunkInputs.idle(key.chunk), idle_batch(key.batch, 1))),
    "sample": ProgramKind(
        sample_program, ("pstate",), ("pstate",), model=False, grid=_sample_grid, samples=True,
        example=lambda key, vocab: (SampleInputs.example(key.batch, vocab),)),
    "greedy": ProgramKind(
        greedy_program, ("pstate",), ("pstate",), model=False, grid=_sample_grid, samples=True,
        example=lambda key, vocab: (SampleInputs.example(key.batch, vocab),)),
    "copy": ProgramKind(
        copy_program, ("cache", "pstate"), ("cache", "pstate"), model=False, grid=lambda g: [(1, 0, 0)],
        example=lambda key, vocab: (CopyInputs(np.int32(0), np.int32(0)),)),
}


def program_keys(sizes: GridSizes) -> list[ProgramKey]:
    """Every program key of the grid, kind by kind in `PROGRAMS` order."""
    return [ProgramKey(name, *shape) for name, kind in PROGRAMS.items() for shape in kind.grid(sizes)]
