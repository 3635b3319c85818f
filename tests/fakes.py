"""Test doubles whose output can be computed by hand (JetStream mock_engine style).

FakeEngine: the next token is always (previous token + 1) % vocab, so a prompt ending in t generates t+1, t+2, ...
(or, with a mask, the smallest allowed token >= that). It implements the engine contract the EngineLoop drives,
`model_worker.serving.engine_api.Engine` (a type checker holds it to the contract: tests/model_worker/engine_conformance.py), counts its calls and the
prompt tokens it was asked to compute (from the `is_output` flags the loop passes, independently of the loop's
own counters), and logs every chunk as (slot, start, tokens consumed).
"""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Sequence

import numpy as np

from model_worker.modeling.sampling import SamplingArrays, unpack_mask
from model_worker.serving.engine_api import (
    DecodeBatch,
    HostOutput,
    ProgramKey,
    PromptChunk,
    StepShape,
    VerifyBatch,
    VerifyOutput,
)


@dataclasses.dataclass(frozen=True)
class FakeEngineConfig:
    """The sizes of a FakeEngine (`engine_api.EngineSizes`); `chunk` is its only compute chunk length."""

    num_slots: int = 2
    max_model_len: int = 64
    chunk: int = 4
    prefix_slack: int = 4
    max_waiting: int | None = 64
    max_draft_tokens: int = 0
    max_verify_batch: int = 4

    @property
    def prefill_chunks(self) -> tuple[int, ...]:
        return (self.chunk,)

    @property
    def reuse_slack(self) -> int:
        return max(0, self.prefix_slack - self.max_draft_tokens)


@dataclasses.dataclass(frozen=True)
class FakeModelConfig:
    """The model sizes of a FakeEngine (`engine_api.ModelSizes`)."""

    vocab_size: int


class FakeEngine:
    """next = (last + 1) % vocab (masked: the smallest allowed token >= that, wrapping); compute consumes at most
    `chunk` tokens per call."""

    def __init__(self, ecfg: FakeEngineConfig = FakeEngineConfig(), vocab: int = 1000, step_delay: float = 0.0):
        self.ecfg, self.vocab, self.step_delay = ecfg, vocab, step_delay
        self.cfg = FakeModelConfig(vocab)
        self.calls = {"compute": 0, "decode": 0, "copy": 0}
        self.order: list[str] = []  # "compute", "decode", "verify" per dispatch, in order (a mixed call: both)
        self.verify_delay = step_delay  # seconds a verify step waits (`step_delay` unless a test sets it)
        self.virtual_seconds = 0.0  # the delays waited so far: `clock`'s reading
        self.refuse_ahead = False  # dispatch_decode_after answers None (an engine without the decode program)
        self.prompt_tokens = 0  # prompt (not generated) tokens computed, in chunks and decode rows
        self.chunks: list[tuple[int, int, int]] = []  # (slot, start position, tokens consumed) per compute call
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a compute call starts (before waiting on the gate)

    def clock(self) -> float:
        """Seconds of the step delays waited so far: a step clock (`EngineLoop(step_clock=...)`) that measures each
        step as exactly its delay, however loaded the machine."""
        return self.virtual_seconds

    def _next(self, last: int, sampling, row: int) -> int:
        token = (last + 1) % self.vocab
        if sampling.mask_on[row]:
            allowed = np.asarray(unpack_mask(sampling.mask[row], self.vocab))
            order = np.roll(np.arange(self.vocab), -token)
            token = int(order[allowed[order]][0])
        return token

    def _out(self, tokens: list[int], logprob: float) -> HostOutput:
        n = len(tokens)
        return HostOutput(np.array(tokens, np.int32), np.full(n, logprob, np.float32),
                          np.full((n, 20), -1, np.int32), np.zeros((n, 20), np.float32), np.zeros(n, bool))

    def dispatch_compute(self, *, chunk: PromptChunk) -> tuple[types.SimpleNamespace, int]:
        """Consume min(chunk, len(token_ids)) tokens (waits on `gate` first); pending = the last one consumed."""
        self.entered.set()
        self.gate.wait()
        self.calls["compute"] += 1
        self.order.append("compute")
        n = min(self.ecfg.chunk, len(chunk.token_ids))
        self.prompt_tokens += sum(not o for o in chunk.is_output[:n])
        self.chunks.append((chunk.slot, chunk.start, n))
        return types.SimpleNamespace(last=[chunk.token_ids[n - 1]], logprob=-0.5), n

    def dispatch_decode(self, *, batch: DecodeBatch) -> types.SimpleNamespace:
        """One row per slot; pending = the input tokens (waits on `gate`, then `step_delay` seconds)."""
        self.gate.wait()
        if self.step_delay:
            threading.Event().wait(self.step_delay)
        self.virtual_seconds += self.step_delay
        self.calls["decode"] += 1
        self.order.append("decode")
        self.prompt_tokens += sum(not o for o in batch.is_output)
        return types.SimpleNamespace(last=list(batch.tokens), logprob=-0.25, slots=list(batch.slots),
                                     positions=list(batch.positions))

    def dispatch_mixed(self, *, chunk: PromptChunk,
                       batch: DecodeBatch) -> tuple[types.SimpleNamespace, int, types.SimpleNamespace]:
        """`dispatch_compute` then `dispatch_decode`, counted as one mixed call."""
        if chunk.slot in batch.slots:
            raise ValueError(f"slot {chunk.slot} cannot take a chunk and decode in the same step")
        self.calls["mixed"] = self.calls.get("mixed", 0) + 1
        pending, n = self.dispatch_compute(chunk=chunk)
        return pending, n, self.dispatch_decode(batch=batch)

    def sample(self, pending: types.SimpleNamespace, *, sampling: SamplingArrays, clear_penalties: Sequence[bool],
               active: Sequence[bool]) -> HostOutput:
        """next = (last + 1) % vocab per row (masked: the smallest allowed token >= that, wrapping)."""
        return self._out([self._next(t, sampling, r) for r, t in enumerate(pending.last)], pending.logprob)

    def sample_async(self, pending: types.SimpleNamespace, *, sampling: SamplingArrays,
                     clear_penalties: Sequence[bool], active: Sequence[bool]) -> types.SimpleNamespace:
        """`sample`, its result read by `result()` (handle.out: the HostOutput; handle.slots: the rows' slots)."""
        n = len(pending.last)
        step = [int(x) for x in sampling.step[:n]]
        if getattr(pending, "after_step", None) is not None and step != [s + 1 for s in pending.after_step]:
            raise ValueError(f"a step ahead sampled at output steps {step}, not the next ones after "
                             f"{pending.after_step}")
        out = self.sample(pending, sampling=sampling, clear_penalties=clear_penalties, active=active)
        return types.SimpleNamespace(out=out, slots=list(getattr(pending, "slots", [])),
                                     positions=list(getattr(pending, "positions", [])), step=step, result=lambda: out)

    def dispatch_decode_after(self, *, batch: DecodeBatch,
                              previous: types.SimpleNamespace) -> types.SimpleNamespace | None:
        """`dispatch_decode` of `previous`'s rows with the tokens it sampled as inputs (counted in calls["ahead"]
        too); None where `batch.slots` are not `previous`'s or `refuse_ahead` is set.

        Raises:
          ValueError: a position other than the one after `previous`'s (the real engine would compute the wrong
            position); `sample_async` raises for a step ahead sampled at other output steps than the next ones.
        """
        if self.refuse_ahead or list(batch.slots) != list(previous.slots):
            return None
        if list(batch.positions) != [p + 1 for p in previous.positions]:
            raise ValueError(f"a step ahead at positions {list(batch.positions)} after {previous.positions}")
        self.calls["ahead"] = self.calls.get("ahead", 0) + 1
        tokens = [int(t) for t in previous.out.tokens[: len(batch.slots)]]
        pending = self.dispatch_decode(batch=dataclasses.replace(batch, tokens=tokens))
        pending.after_step = previous.step
        return pending

    def dispatch_verify(self, *, batch: VerifyBatch) -> types.SimpleNamespace:
        """One row per slot with its drafts; pending = each row's input tokens (waits on `gate`, `step_delay`)."""
        if len(batch.slots) > self.ecfg.max_verify_batch or any(
                not 1 <= len(t) <= self.ecfg.max_draft_tokens + 1 for t in batch.tokens):
            raise ValueError("verify step outside the compiled grid")
        self.gate.wait()
        if self.verify_delay:
            threading.Event().wait(self.verify_delay)
        self.virtual_seconds += self.verify_delay
        self.calls["verify"] = self.calls.get("verify", 0) + 1
        self.order.append("verify")
        self.prompt_tokens += sum(not o for o in batch.is_output)
        return types.SimpleNamespace(rows=[list(t) for t in batch.tokens], logprob=-0.25)

    def sample_verify(self, pending: types.SimpleNamespace, *, sampling: SamplingArrays,
                      clear_penalties: Sequence[bool], active: Sequence[bool]) -> VerifyOutput:
        """Position t of a row samples next(its input token t); drafts are accepted while they equal it."""
        n, T = len(pending.rows), self.ecfg.max_draft_tokens + 1
        tokens = np.full((n, T), -1, np.int32)
        emitted = np.ones(n, np.int32)
        for r, row in enumerate(pending.rows):
            for t, token in enumerate(row):
                tokens[r, t] = self._next(token, sampling, r)
            while emitted[r] < len(row) and row[emitted[r]] == tokens[r, emitted[r] - 1]:
                emitted[r] += 1
        return VerifyOutput(tokens, np.full((n, T), pending.logprob, np.float32), np.full((n, T, 20), -1, np.int32),
                            np.zeros((n, T, 20), np.float32), np.zeros((n, T), bool), emitted)

    def step_programs(self, *, shape: StepShape) -> tuple[ProgramKey, ...]:
        """No buckets: a compute program of the chunk as it is, then a decode (or verify) program of the rows."""
        keys = []
        if shape.chunk_tokens:
            keys.append(ProgramKey("compute", 1, min(shape.chunk_tokens, self.ecfg.chunk),
                                   max(shape.chunk_end, shape.chunk_tokens)))
        if shape.rows:
            tokens = 1 + (self.ecfg.max_draft_tokens if shape.draft_tokens else 0)
            keys.append(ProgramKey("verify" if shape.draft_tokens else "decode", shape.rows, tokens, shape.longest))
        return tuple(keys)

    def copy_slot(self, *, src: int, dst: int) -> None:
        """Count the copy (the fake keeps no per-slot state)."""
        self.calls["copy"] += 1

    def can_verify(self, *, rows: int) -> bool:
        """Verify steps of up to `max_verify_batch` rows when drafting is on (no programs to wait for)."""
        return bool(self.ecfg.max_draft_tokens) and rows <= self.ecfg.max_verify_batch

    def adopt_programs(self) -> list[ProgramKey]:
        """Nothing compiles in the background here."""
        return []

    def store_deferred(self, limit: int | None = 1) -> int:
        """Counts the calls (the loop calls it when idle); nothing to store here."""
        self.store_calls = getattr(self, "store_calls", 0) + 1
        return 0
