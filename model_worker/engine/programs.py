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
  verify   Batch                  (B, T, the largest L): B in verify_batches           logits [B, T, V]
  vsample  SampleInputs ([B, T])  (B, T, 0): as verify                                 SampleOutput [B, T]
  vgreedy  SampleInputs ([B, T])  as vsample                                           SampleOutput [B, T]

Verify programs (exact speculative decoding, docs/architecture.md "Speculative decoding"): a decode step whose rows
carry T tokens each, the pending token and up to T - 1 drafted ones, with the logits of every position; its sample
program walks the positions in order, each sampled exactly as a decode step would sample it (the same settings,
the random draw of that output step, the penalty history with the accepted tokens before it), and commits a
position to the penalty history only while every draft before it was accepted. None exist when T <= 1.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model_worker.modeling.model import Batch, forward, forward_batches
from model_worker.modeling.sampling import (
    PenaltyHistory,
    SamplingArrays,
    clear_rows,
    record_tokens,
    sample,
    sample_greedy,
)
from model_worker.serving.engine_api import ProgramKey


@dataclasses.dataclass(frozen=True)
class GridSizes:
    """The sizes a program grid is enumerated from (`Engine.grid`).

    Attributes:
      prefill_chunks: compute chunk lengths; kv_buckets: KV lengths, ascending; batch_buckets: decode batch sizes,
      ascending; mixed_chunk: the chunk of a mixed step; num_slots: KV cache rows; verify_tokens: tokens per row of
      a verify step (1 + the most drafted tokens; <= 1: no verify programs); verify_batches: its batch buckets.
    """

    prefill_chunks: tuple[int, ...]
    kv_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...]
    mixed_chunk: int
    num_slots: int
    verify_tokens: int = 0
    verify_batches: tuple[int, ...] = ()


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
      logits: [B, V] float32 ([B, T, V] for a verify step).
      tokens, positions, is_output: [B, 1] int32 / int32 / bool, the row's input token, recorded in the history
        when its position is >= 0 (a compute chunk recorded its own: position -1). [B, T] for a verify step's
        sampling: per position the input token (the pending one, then the drafts), -1 past the row's drafts.
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
    def example(batch: int, vocab: int, tokens: int = 0) -> SampleInputs:
        """Inputs of the compiled shapes (the logits only as a shape: for lowering, not for running); `tokens` > 0:
        a verify step's, T = tokens positions per row."""
        t = max(tokens, 1)
        logits = (batch, tokens, vocab) if tokens else (batch, vocab)
        return SampleInputs(jax.ShapeDtypeStruct(logits, jnp.float32), np.zeros((batch, t), np.int32),
                            np.full((batch, t), -1, np.int32), np.arange(batch, dtype=np.int32),
                            np.zeros((batch, t), bool), np.zeros(batch, bool), np.zeros(batch, bool),
                            SamplingArrays.defaults(batch, vocab, tokens))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CopyInputs:
    """A slot copy: src, dst int32 scalars (cache rows)."""

    src: np.ndarray
    dst: np.ndarray


# ----- program bodies -------------------------------------------------------------------------------------------
def _record_inputs(state: PenaltyHistory, tokens, positions, is_output, rows=None) -> PenaltyHistory:
    """Note the step's input tokens [B, C]: every valid one (position >= 0) is seen (repetition penalty), output
    ones also counted (`sampling.record_tokens`). `rows`: [B] state row of each batch row, distinct (default: row
    b is state row b); their [B, M] rows are taken, recorded and written back (no [S, V] work)."""
    valid = positions >= 0
    if rows is None:
        return record_tokens(state, tokens, valid, valid & is_output)
    taken = jax.tree_util.tree_map(lambda a: jnp.take(a, rows, axis=0), state)
    new = record_tokens(taken, tokens, valid, valid & is_output)
    return jax.tree_util.tree_map(lambda a, r: a.at[rows].set(r), state, new)


def _record_chunk(pstate: PenaltyHistory, chunk: ChunkInputs) -> PenaltyHistory:
    """A chunk's tokens recorded in its rows' penalty history (cleared first where `clear_penalties`)."""
    b = chunk.batch
    rows = clear_rows(jax.tree_util.tree_map(lambda a: jnp.take(a, b.slots, axis=0), pstate), chunk.clear_penalties)
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
    rows = clear_rows(old, inputs.clear_penalties)
    rows = _record_inputs(rows, inputs.tokens, inputs.positions, inputs.is_output)
    out = sample(inputs.logits, inputs.sampling, rows, vocab_parts)
    kept = jax.tree_util.tree_map(lambda new, prev: jnp.where(expand(inputs.active, new), new, prev), rows, old)
    pstate = jax.tree_util.tree_map(lambda a, r: a.at[slots].set(r), pstate, kept)
    return out, pstate


def verify_program(params, cache, rows: Batch, *, cfg, kv_len):
    """The model on a verify step: B rows of T tokens (the pending token, then drafts; -1 positions past them),
    the logits of every position. Returns (logits [B, T, V] float32, cache). Every position's K/V is written;
    the loop counts as computed only the accepted ones, so a rejected position is overwritten before anything
    attends to it (a sliding ring entry it overwrites is older than the window: `EngineConfig.reuse_slack`)."""
    return forward(params, rows.tokens, rows.positions, cache, rows.slots, cfg, kv_len, None)


def _next_inputs(inputs: SampleInputs) -> tuple[jax.Array, jax.Array]:
    """Per position t of a verify step, the draft to compare its sample with (the input token at t + 1) and
    whether there is one: ([B, T] int32, [B, T] bool)."""
    pad = jnp.full((inputs.tokens.shape[0], 1), -1, jnp.int32)
    nxt = jnp.concatenate([jnp.asarray(inputs.tokens)[:, 1:], pad], axis=1)
    has = jnp.concatenate([jnp.asarray(inputs.positions)[:, 1:] >= 0, pad >= 0], axis=1)
    return nxt, has


def verify_sample_program(pstate, inputs: SampleInputs, *, vocab_parts: int = 1):
    """Sample a verify step position by position, exactly as decode steps would, one after another.

    Position t of row b: its input token is recorded in the row's penalty history (as a decode step's sample
    program records it), then it is sampled with the row's settings at output step `step + t` (the random draw
    of that token) and the row's mask of that position (`sampling.mask` [B, T, W]: a constrained row's mask holds
    only if the drafts before it are taken); the draft at t + 1 is accepted when it equals that sample. A position is
    recorded only while every draft before it was accepted, so the history ends exactly as the decode steps of
    the accepted tokens would leave it; inactive rows commit nothing. `vocab_parts`: as `sample_program`.
    Returns:
      (SampleOutput with [B, T] leading axes, pstate).
    """
    slots = inputs.slots
    old = jax.tree_util.tree_map(lambda a: jnp.take(a, slots, axis=0), pstate)
    expand = lambda flag, a: flag.reshape((-1,) + (1,) * (a.ndim - 1))
    rows = clear_rows(old, inputs.clear_penalties)
    nxt, has = _next_inputs(inputs)
    tokens, positions, is_output = (jnp.asarray(a) for a in (inputs.tokens, inputs.positions, inputs.is_output))

    def position(carry, t):
        rows, alive = carry
        col = lambda a: jax.lax.dynamic_index_in_dim(a, t, axis=1, keepdims=True)
        live = alive & (col(positions)[:, 0] >= 0)
        rows = _record_inputs(rows, col(tokens), jnp.where(live[:, None], col(positions), -1), col(is_output))
        at = lambda a: jax.lax.dynamic_index_in_dim(a, t, axis=1, keepdims=False)
        settings = dataclasses.replace(inputs.sampling, step=inputs.sampling.step + t, mask=at(inputs.sampling.mask),
                                       mask_on=at(inputs.sampling.mask_on))
        out = sample(jax.lax.dynamic_index_in_dim(inputs.logits, t, axis=1, keepdims=False), settings, rows,
                     vocab_parts)
        alive = live & col(has)[:, 0] & (out.tokens == col(nxt)[:, 0])
        return (rows, alive), out

    T = inputs.tokens.shape[1]
    (rows, _), outs = jax.lax.scan(position, (rows, jnp.ones(slots.shape[0], bool)), jnp.arange(T))
    kept = jax.tree_util.tree_map(lambda new, prev: jnp.where(expand(inputs.active, new), new, prev), rows, old)
    pstate = jax.tree_util.tree_map(lambda a, r: a.at[slots].set(r), pstate, kept)
    return jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), outs), pstate


def verify_greedy_program(pstate, inputs: SampleInputs, *, vocab_parts: int = 1):
    """`verify_sample_program` for a batch that passes `is_plain_greedy` and clears no penalties: every position
    sampled at once (`sample_greedy` reads no history), then the accepted positions' input tokens recorded by
    point updates, as `greedy_program` does. Returns (SampleOutput with [B, T] leading axes, pstate)."""
    B, T, V = inputs.logits.shape
    repeat = lambda a: jnp.repeat(jnp.asarray(a), T, axis=0)
    per_position = {"mask": inputs.sampling.mask.reshape(B * T, -1), "mask_on": inputs.sampling.mask_on.reshape(B * T)}
    settings = dataclasses.replace(jax.tree_util.tree_map(repeat, inputs.sampling), **per_position)
    out = sample_greedy(inputs.logits.reshape(B * T, V), settings, vocab_parts)
    out = jax.tree_util.tree_map(lambda a: a.reshape((B, T) + a.shape[1:]), out)
    nxt, has = _next_inputs(inputs)
    accepted = jnp.cumprod((out.tokens == nxt) & has, axis=1).astype(bool)  # drafts 1..t+1 all accepted
    alive = jnp.concatenate([jnp.ones((B, 1), bool), accepted[:, :-1]], axis=1) & inputs.active[:, None]
    committed = jnp.where(alive, jnp.asarray(inputs.positions), -1)
    return out, _record_inputs(pstate, inputs.tokens, committed, inputs.is_output, rows=inputs.slots)


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


def _verify_grid(g: GridSizes, sampling: bool = False) -> list[tuple[int, int, int]]:
    """Verify steps read only the key blocks each row's position needs (as mixed steps do), so their forward
    programs exist for the largest KV bucket only; their sample programs need no bucket."""
    if g.verify_tokens <= 1:
        return []
    return [(b, g.verify_tokens, 0 if sampling else g.kv_buckets[-1]) for b in g.verify_batches]


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
    "verify": ProgramKind(
        verify_program, _FORWARD, ("cache",), model=True, warm=True, grid=_verify_grid,
        example=lambda key, vocab: (dataclasses.replace(idle_batch(key.batch, key.chunk), logit_rows=None),)),
    "vsample": ProgramKind(
        verify_sample_program, ("pstate",), ("pstate",), model=False, samples=True,
        grid=lambda g: _verify_grid(g, sampling=True),
        example=lambda key, vocab: (SampleInputs.example(key.batch, vocab, key.chunk),)),
    "vgreedy": ProgramKind(
        verify_greedy_program, ("pstate",), ("pstate",), model=False, samples=True,
        grid=lambda g: _verify_grid(g, sampling=True),
        example=lambda key, vocab: (SampleInputs.example(key.batch, vocab, key.chunk),)),
    "copy": ProgramKind(
        copy_program, ("cache", "pstate"), ("cache", "pstate"), model=False, grid=lambda g: [(1, 0, 0)],
        example=lambda key, vocab: (CopyInputs(np.int32(0), np.int32(0)),)),
}


def program_keys(sizes: GridSizes) -> list[ProgramKey]:
    """Every program key of the grid, kind by kind in `PROGRAMS` order."""
    return [ProgramKey(name, *shape) for name, kind in PROGRAMS.items() for shape in kind.grid(sizes)]


def lower_on_one_device(key: ProgramKey, cfg, state: dict[str, Any], device: jax.Device | None = None
                        ) -> jax.stages.Lowered:
    """The program of `key` lowered for one device: `state` maps each engine state name (`ProgramKind.state`) to
    its abstract value (a pytree of `jax.ShapeDtypeStruct`s, no shardings); the inputs are the kind's `example`.

    `device` None lowers as from uncommitted arrays, for the calling thread's default device (the engine's
    programs, unchanged). A device given is named by explicit single-device shardings instead: how a process that
    does not hold the device compiles for it (a TPU's compile-only topology: `compile_process`), the same
    computation with sharding annotations only (XLA CPU's compiled module differs from the uncommitted one in
    metadata alone, checked when this was written). One function for both, so the child process and the engine
    cannot lower different programs for one key."""
    kind = PROGRAMS[key.kind]
    fn = functools.partial(kind.fn, cfg=cfg, kv_len=key.kv_len) if kind.model else kind.fn
    args = (*(state[name] for name in kind.state), *kind.example(key, cfg.vocab_size))
    if device is None:
        return jax.jit(fn, donate_argnames=kind.donated).lower(*args)
    one = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(fn, donate_argnames=kind.donated, in_shardings=one, out_shardings=one).lower(*args)
