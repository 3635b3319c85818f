"""Plain-Python scheduling: sequences, the slot pool, and what to run next. No JAX here.

Each engine iteration asks `Scheduler.schedule()` for work: at most one prefill chunk (for the oldest sequence
whose prompt is not fully computed) and one decode step over every sequence that is generating. So a long new
prompt is computed chunk by chunk while the running streams keep receiving tokens. Progress is tracked as a
counter (`num_computed`), not a phase enum: a sequence decodes once its whole prompt is computed.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Callable


class Finish(enum.IntEnum):
    """Why a sequence ended (values match protos FinishReason)."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """Host-side sampling settings of one sequence (see sampling.SamplingArrays for the semantics)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


@dataclasses.dataclass
class TokenEvent:
    """Tokens produced for a sequence since its last event; `finish` is set on the last event."""

    token_ids: list[int]
    logprobs: list[float]
    finish: Finish = Finish.NONE
    error: str | None = None


@dataclasses.dataclass
class Sequence:
    """One request inside the worker.

    Attributes:
      request_id: client-chosen unique id.
      prompt: prompt token ids.
      sampling: sampling settings.
      max_tokens: generation limit.
      stop_ids: token ids that end the sequence (the stop token is kept in the output).
      sink: called (on the engine thread) with every TokenEvent; must not block.
      slot: cache row while admitted, else None.
      num_computed: prompt tokens whose KV is in the cache.
      output: generated token ids.
      finish: why it ended (NONE while live).
      arrival: admission order (set by Scheduler.add); the oldest pending prompt is prefilled first.
    """

    request_id: str
    prompt: list[int]
    sampling: SamplingSpec
    max_tokens: int
    stop_ids: frozenset[int]
    sink: Callable[[TokenEvent], None]
    slot: int | None = None
    num_computed: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    finish: Finish = Finish.NONE
    arrival: int = 0

    @property
    def prefilled(self) -> bool:
        """Whether the whole prompt is in the cache (the sequence is generating)."""
        return self.num_computed >= len(self.prompt)

    @property
    def position(self) -> int:
        """Position of the last generated token (the next decode step's input)."""
        return len(self.prompt) + len(self.output) - 1


@dataclasses.dataclass
class Work:
    """What one engine iteration runs: an optional prefill chunk and the sequences to decode."""

    prefill: Sequence | None
    decode: list[Sequence]


class Scheduler:
    """Owns the waiting queue, the running set and the free slots."""

    def __init__(self, num_slots: int, max_model_len: int):
        """Args: num_slots: cache rows; max_model_len: context limit used to finish sequences with LENGTH."""
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[int, Sequence] = {}
        self.free_slots: list[int] = list(range(num_slots))[::-1]
        self.by_id: dict[str, Sequence] = {}
        self._arrivals = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence.

        Raises:
          KeyError: a live sequence already has this request id.
        """
        if seq.request_id in self.by_id:
            raise KeyError(seq.request_id)
        self._arrivals += 1
        seq.arrival = self._arrivals
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> Work:
        """Admit waiting sequences into free slots, then pick this iteration's work."""
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            self.running[seq.slot] = seq
        pending = [s for s in self.running.values() if not s.prefilled]
        prefill = min(pending, key=lambda s: s.arrival, default=None)
        decode = [s for s in self.running.values() if s.prefilled and s.output]
        return Work(prefill=prefill, decode=decode)

    def has_work(self) -> bool:
        """Whether anything is waiting or running."""
        return bool(self.waiting or self.running)

    def append_token(self, seq: Sequence, token: int) -> Finish:
        """Record a generated token and decide whether the sequence ends here."""
        seq.output.append(token)
        if token in seq.stop_ids:
            seq.finish = Finish.STOP
        elif len(seq.output) >= seq.max_tokens or len(seq.prompt) + len(seq.output) >= self.max_model_len:
            seq.finish = Finish.LENGTH
        return seq.finish

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence's slot (it becomes free for the next iteration)."""
        self.by_id.pop(seq.request_id, None)
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self.free_slots.append(seq.slot)
        seq.slot = None

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a live sequence (waiting or running). Returns it, or None if unknown."""
        seq = self.by_id.get(request_id)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish = Finish.ABORT
        self.finish(seq)
        return seq
