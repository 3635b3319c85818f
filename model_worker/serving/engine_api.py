"""The engine contract: exactly what the engine loop (`model_worker/serving/loop.py`) needs from an engine, and the records
that cross it.

JetStream's `engine_api.Engine` is the model: a few methods whose semantics live in their docstrings, and opaque
state. `model_worker.engine.engine.Engine` (JAX, the KV cache and the compiled grid) implements it, and so does the
test double `tests.fakes.FakeEngine`; a type checker holds both to it (`tests/model_worker/engine_conformance.py`,
run by mypy in `make test`). Everything else the real engine offers (compiling the grid, warm-up, byte counts) is
start-up business of `model_worker/server/main.py`, not part of the contract. This module imports no implementation: the
records below are plain data (numpy on the host), so the scheduler, which never imports JAX, can name them too.

Conventions. A *slot* is a row of the engine's KV cache and penalty history, in [0, num_slots). A *position* is a
token's 0-based index in its sequence (prompt then generated tokens), in [0, max_model_len). Token ids are in
[0, vocab_size). One thread drives an engine (the loop's); nothing here is thread-safe. Every method takes its
arguments by keyword, as small records, so a new field of a step cannot be passed in the wrong place.

Faults. The engine checks nothing the loop can check before dispatch; an exception from any method is fatal
for the worker (the real engine's steps donate the KV cache buffers, so no later step can be trusted):
docs/architecture.md, "Faults".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:
    from model_worker.serving.sampling_settings import SamplingArrays

#: A dispatched forward pass whose logits await sampling (the real engine's `engine.Pending`). Opaque to the loop:
#: it only hands it back to `Engine.sample`, at most once, and may drop it unsampled (a prompt chunk that is not
#: the prompt's last: its KV writes stand all the same).
Pending = Any

#: A dispatched sample program whose outputs are still on the device (the real engine's `engine.Sampled`): its
#: `result()` waits for them and returns the `HostOutput`. Handed back to `Engine.dispatch_decode_after` at most
#: once before `result()` is read.
Sampled = Any


class ProgramKey(NamedTuple):
    """A compiled program: its kind (a key of `programs.PROGRAMS`) and shapes. A tuple, so ("decode", 4, 1, 512)
    is one."""

    kind: str
    batch: int  # rows
    chunk: int  # tokens per row (0: no tokens, a sample or copy program)
    kv_len: int  # the KV bucket full-attention layers read up to (0: no forward pass)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one engine step computes, as the scheduler sees it (before the engine pads it to its programs'
    shapes: `Engine.step_programs`). For the step-time model (model_worker/serving/step_model.py).

    Attributes:
      rows: decode rows (sequences producing a token this step).
      kv_tokens: cached tokens those rows attend to, summed over rows.
      chunk_tokens: prompt tokens computed in the step's chunk (0: a decode-only step).
      draft_tokens: drafted tokens verified (speculative decoding; > 0: the decode rows run as a verify step).
      longest: the longest decode row's KV length after the step (positions), which picks its KV bucket.
      chunk_end: the chunk's KV length after the step (its start + chunk_tokens; 0: unknown, a planned chunk).
    """

    rows: int = 0
    kv_tokens: int = 0
    chunk_tokens: int = 0
    draft_tokens: int = 0
    longest: int = 0
    chunk_end: int = 0

    def features(self) -> np.ndarray:
        """[1, rows, kv_tokens, chunk_tokens, draft_tokens] as float64 (shape (5,)): the step before padding."""
        return np.array([1.0, self.rows, self.kv_tokens, self.chunk_tokens, self.draft_tokens])


@dataclasses.dataclass(frozen=True)
class PromptChunk:
    """Tokens of one slot to compute into its cache in one step: a prompt chunk, or a run of forced tokens.

    Attributes:
      slot: the cache row.
      token_ids: the tokens to compute (non-empty); the engine consumes n of them, 1 <= n <= len(token_ids), as
        its chunk sizes allow.
      start: position of token_ids[0]; positions < start must already be in the slot's cache.
      is_output: per token, whether it was generated (it counts for the frequency and presence penalties) rather
        than part of the prompt; at least as long as the tokens consumed.
      clear_penalties: clear the slot's penalty history first (a fresh sequence: the slot may hold a finished
        sequence's history).
    """

    slot: int
    token_ids: Sequence[int]
    start: int
    is_output: Sequence[bool]
    clear_penalties: bool = False


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One decode step: each slot computes one token at its position (one batched pass).

    Attributes:
      slots: distinct cache rows to advance (1 to num_slots of them).
      tokens, positions: each slot's input token and its position; positions < a row's position must already be
        in that slot's cache.
      is_output: per row, whether the input token was generated (False for a fork's last prompt token).
    """

    slots: Sequence[int]
    tokens: Sequence[int]
    positions: Sequence[int]
    is_output: Sequence[bool]


@dataclasses.dataclass(frozen=True)
class VerifyBatch:
    """A decode step whose rows may carry drafted tokens (speculative decoding): each slot computes its pending
    token and its drafts at consecutive positions, and every position's logits are sampled in order.

    Attributes:
      slots: distinct cache rows (1 to the largest verify batch).
      tokens: per row, the pending token then 0 to `EngineSizes.max_draft_tokens` drafted tokens.
      positions: each row's position of its pending token; positions below it must already be in the cache.
      is_output: per row, whether the pending token was generated (drafts always count as generated).
    """

    slots: Sequence[int]
    tokens: Sequence[Sequence[int]]
    positions: Sequence[int]
    is_output: Sequence[bool]


@dataclasses.dataclass
class VerifyOutput:
    """A verify step's sampling result on the host, one row per requested row and one column per position.

    Attributes:
      tokens: [R, T] int32, the token sampled at each position (as a decode step there would sample it);
      logprobs: [R, T] float32; top_ids, top_logprobs: [R, T, 20]; mask_empty: [R, T] bool (as `HostOutput`);
      emitted: [R] int32, how many leading tokens are the sequence's next tokens: the accepted drafts (each equal
        to the sample before it) and the first sample that differs from its draft (or follows the last draft).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    mask_empty: np.ndarray
    emitted: np.ndarray


@dataclasses.dataclass
class HostOutput:
    """A sampling result on the host (numpy), one entry per requested row: what `Engine.sample` returns.

    Attributes:
      tokens: [R] int32; logprobs: [R] float32 (natural log); top_ids: [R, 20] int32 (-1 = none); top_logprobs:
      [R, 20] float32; mask_empty: [R] bool (the row's mask allowed nothing: the constraint is unsatisfiable).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    mask_empty: np.ndarray


class EngineSizes(Protocol):
    """The engine's sizes that the loop, the scheduler and the metrics read (`engine.EngineConfig`)."""

    @property
    def num_slots(self) -> int:
        """Sequences held at once (KV cache rows); the largest decode batch."""
        ...

    @property
    def max_model_len(self) -> int:
        """Context limit in tokens (prompt + generated) of every slot."""
        ...

    @property
    def prefill_chunks(self) -> tuple[int, ...]:
        """Chunk lengths (tokens) of the compute program; the loop's default prefill budget is the smallest."""
        ...

    @property
    def reuse_slack(self) -> int:
        """How far before a slot's end a prompt may diverge from its history and still reuse the slot exactly (the
        scheduler's prefix-reuse tolerance): the sliding rings' positions kept beyond the window, less the ones a
        verify step's rejected drafts may overwrite."""
        ...

    @property
    def max_draft_tokens(self) -> int:
        """Most drafted tokens a verify step takes per row (0: the engine has no verify programs)."""
        ...

    @property
    def max_verify_batch(self) -> int:
        """Most rows of a verify step (the largest compiled verify batch)."""
        ...

    @property
    def max_waiting(self) -> int | None:
        """Bound of the loop's waiting queue (None: unbounded)."""
        ...


class ModelSizes(Protocol):
    """The model facts the loop reads (`config.ModelConfig`)."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids: the width of sampling arrays and token masks."""
        ...


class Engine(Protocol):
    """What the engine loop drives: asynchronous forward passes (compute chunks, decode steps, both in one mixed
    pass), sampling of their logits, and slot copies. Dispatching returns at once, so the loop can wait for the
    token masks of constrained rows while the forward pass runs; `sample` is where it blocks."""

    @property
    def ecfg(self) -> EngineSizes:
        """The engine's sizes."""
        ...

    @property
    def cfg(self) -> ModelSizes:
        """The model's sizes."""
        ...

    def dispatch_compute(self, *, chunk: PromptChunk) -> tuple[Pending, int]:
        """Compute the first tokens of `chunk` into its slot's cache.

        Returns:
          (the pending logits of the last token consumed, one row; n, the number of tokens consumed).
        Raises:
          ValueError: a position beyond max_model_len.
        """
        ...

    def dispatch_decode(self, *, batch: DecodeBatch) -> Pending:
        """One decode step over `batch`.

        Returns:
          The pending logits, one row per slot, in order.
        Raises:
          ValueError: a position beyond max_model_len.
        """
        ...

    def dispatch_mixed(self, *, chunk: PromptChunk, batch: DecodeBatch) -> tuple[Pending, int, Pending]:
        """A compute chunk of one slot and a decode step of others in one iteration (one forward pass when the
        engine can: the weights are read once), with the same effects as `dispatch_compute` followed by
        `dispatch_decode`.

        Returns:
          (the chunk's pending logits, tokens consumed, the decode step's pending logits).
        Raises:
          ValueError: the chunk's slot is among the batch's slots; a position beyond max_model_len.
        """
        ...

    def sample(
        self, pending: Pending, *, sampling: SamplingArrays, clear_penalties: Sequence[bool], active: Sequence[bool]
    ) -> HostOutput:
        """Sample a dispatched pass's logits (blocks until the pass and the sampling are done).

        Args:
          pending: from `dispatch_compute`, `dispatch_decode` or `dispatch_mixed`, not sampled before.
          sampling: settings (and token masks) with one row per pending row.
          clear_penalties: per row, clear the slot's penalty history first (a fresh sequence).
          active: per row, whether the row's step counts; False leaves the slot's penalty history as it was (the
            row's mask did not arrive: the loop ignores its result and computes the row again later).
        Returns:
          One result row per pending row.
        """
        ...

    def sample_async(
        self, pending: Pending, *, sampling: SamplingArrays, clear_penalties: Sequence[bool], active: Sequence[bool]
    ) -> Sampled:
        """`sample` without waiting for the results: arguments as `sample`; returns a handle whose `result()` is
        what `sample` returns, and which `dispatch_decode_after` takes its rows' next input tokens from."""
        ...

    def dispatch_decode_after(self, *, batch: DecodeBatch, previous: Sampled) -> Pending | None:
        """A decode step of `previous`'s rows (the same slots, in order) at `batch.positions`, each row's input
        token being the one `previous` sampled for it, read on the device (`batch.tokens` is ignored): dispatched
        before `previous`'s results are on the host (async scheduling). Returns None, dispatching nothing, where
        the engine cannot (no decode program ready for the rows, other slots than `previous`'s, a position beyond
        max_model_len)."""
        ...

    def dispatch_verify(self, *, batch: VerifyBatch) -> Pending:
        """A decode step with drafts: every row's pending token and drafts computed into its slot's cache (the
        positions after a rejected draft are written too; the loop counts as computed only what was accepted, and
        they are overwritten before anything attends to them).

        Returns:
          The pending logits of every position, in row order.
        Raises:
          ValueError: more rows than `max_verify_batch` or tokens than 1 + `max_draft_tokens` in a row; a
            position beyond max_model_len.
        """
        ...

    def sample_verify(
        self, pending: Pending, *, sampling: SamplingArrays, clear_penalties: Sequence[bool], active: Sequence[bool]
    ) -> VerifyOutput:
        """Sample a verify step's logits position by position, each exactly as a decode step there would (the
        same settings, the random draw of that output step, the penalty history holding the accepted tokens before
        it; the mask of each position: `sampling.mask` is a row's one mask ([n, W]) or its mask per position
        ([n, t, W], `mask_on` [n, t]: a constrained row's masks given its drafts, `GrammarDraft`); the penalty
        history keeps only the accepted positions' tokens.

        Args: as `sample`, for a pending from `dispatch_verify`.
        Returns:
          One result row per pending row.
        """
        ...

    def step_programs(self, *, shape: StepShape) -> tuple[ProgramKey, ...]:
        """The forward programs a step of this shape runs (its rows, chunk and drafts padded to the engine's
        buckets), as the dispatch methods would choose them; no sampling or copy programs. A pure function of
        the shape: the step-time model prices planned steps with it. Shapes beyond the grid are clamped to
        its largest programs, never an error."""
        ...

    def copy_slot(self, *, src: int, dst: int) -> None:
        """Copy slot `src`'s KV cache rows and penalty history over slot `dst` (prefix reuse, `n` > 1 forks);
        `src` is left as it was."""
        ...

    def can_verify(self, *, rows: int) -> bool:
        """Whether a verify step (`dispatch_verify`) of `rows` rows can run now: the engine has verify programs
        for that many rows and they are compiled (a worker that serves first compiles them in the background)."""
        ...

    def adopt_programs(self) -> list[ProgramKey]:
        """Take in the programs compiled in the background since the last call, so later steps may use them
        (they change no token: only the speed). Called by the loop between steps, on its thread. Returns their
        keys."""
        ...

    def store_deferred(self, limit: int | None = 1) -> int:
        """Store up to `limit` (None: all) programs compiled in the background into the executable cache; called
        by the loop when it has no work, and at exit. Returns how many."""
        ...
