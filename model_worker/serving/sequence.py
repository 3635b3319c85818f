"""One request inside the model worker: its `Sequence` and the records that describe it (sampling settings, the
events its sink receives, why it ended).

Plain Python, no JAX. Only the scheduler (`model_worker/serving/scheduler.py`) changes a `Sequence` once it is built; the
loop, the prefix cache, the servicer and the metrics only read it (tests/model_worker/test_state_ownership.py).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable

import numpy as np


class Finish(enum.IntEnum):
    """Why a sequence ended (values match protos FinishReason)."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3


class Failure(enum.Enum):
    """Why a sequence ended with an error; the service maps each to its gRPC status (a full queue and a failed
    engine can be retried; anything else is the worker's own failure)."""

    NONE = "none"
    QUEUE_FULL = "queue_full"
    DUPLICATE_ID = "duplicate_id"
    ENGINE_FAILED = "engine_failed"
    BAD_MESSAGE = "bad_message"  # a malformed mask or forced-token message on the Decode stream
    MASK_EMPTY = "mask_empty"
    SLO_UNREACHABLE = "slo_unreachable"  # its time-to-first-token target cannot be met (model_worker/serving/slo.py)


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """Host-side sampling settings of one sequence (see sampling.py for the semantics).

    Attributes:
      temperature, top_k, top_p, min_p: token choice.
      seed: 64-bit seed of the sequence's random stream.
      presence_penalty, frequency_penalty, repetition_penalty: OpenAI / CTRL penalties.
      bias_ids, bias_vals: logit bias entries (at most sampling.MAX_LOGIT_BIAS).
      top_logprobs: alternatives to return per token (0..20).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bias_ids: tuple[int, ...] = ()
    bias_vals: tuple[float, ...] = ()
    top_logprobs: int = 0


@dataclasses.dataclass
class TokenEvent:
    """Tokens produced for a sequence since its last event; `finish` is set on the last event.

    Attributes:
      token_ids, logprobs, forced: per token.
      top: per token, (ids, logprobs) of the most likely alternatives (empty when not requested).
      cached_tokens: prompt tokens reused from the prefix cache (on the first event).
      accepted_prediction, rejected_prediction: on the last event of a sequence with a prediction, its predicted
        tokens accepted as drafts and the rest (OpenAI `accepted_prediction_tokens`, `rejected_prediction_tokens`).
      finish: why the sequence ended (NONE while live).
      error: a message when it ended because of an error.
      failure: the kind of that error (NONE without one), which decides the RPC's status.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish: Finish = Finish.NONE
    error: str | None = None
    failure: Failure = Failure.NONE
    forced: list[bool] = dataclasses.field(default_factory=list)
    top: list[tuple[list[int], list[float]]] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    accepted_prediction: int = 0
    rejected_prediction: int = 0


@dataclasses.dataclass(slots=True)
class GrammarDraft:
    """Draft tokens a constrained request's client sent with the mask of output token number `step`.

    Attributes:
      step: the output index of the first draft token.
      tokens: the draft tokens, for output indexes step, step + 1, ...
      masks: packed uint32 mask words, one per draft token: masks[i] allows output token number step + i + 1 once
        tokens[0..i] were taken (the mask of `step` itself is `Sequence.masks[step]`).
    """

    step: int
    tokens: list[int]
    masks: list[np.ndarray]


@dataclasses.dataclass(slots=True)
class Sequence:
    """One request inside the worker. Only the scheduler changes it once it is built (slotted: an undeclared
    attribute is an AttributeError).

    Attributes:
      request_id: client-chosen unique id.
      prompt: prompt token ids.
      sampling: sampling settings.
      max_tokens: generation limit.
      stop_ids: token ids that end the sequence (the stop token is kept in the output).
      sink: called (on the engine thread) with every TokenEvent; must not block.
      constrained: sample only with a mask for that step (masks[step]).
      fork_of: request id whose prompt KV this sequence shares (n > 1), or None.
      slot: cache row while admitted, else None.
      num_computed: tokens (prompt + output) whose KV is in the cache.
      output: generated token ids (sampled and forced).
      masks: step -> packed uint32 mask words for the token at output index `step`.
      forced: step -> token ids to append without sampling at output index `step`.
      allowed: packed mask words applied at every step without a per-step mask, or None.
      finish: why it ended (NONE while live).
      arrival: admission order (set by Scheduler.add).
      clear_penalties: clear the slot's penalty history at the sequence's next step (a fresh sequence: the slot
        may hold another request's history).
      cached_tokens: prompt tokens whose KV was reused from the prefix cache.
      snapshot_at: pin a copy of the slot once this many prompt tokens are computed (a shared prefix), or None.
      arrived_at, admitted_at, last_token_at: time.monotonic() stamps for the latency metrics.
      missed: the last step ran this (constrained) sequence but its mask came too late; it waits for the mask
        before it joins a step again.
      cache_salt: prefix-cache scope: the prompt reuses only KV computed under the same salt (PrefixCache).
      draft_scope: the finished answers it may draft from and that its own answer joins (drafting.Drafter);
        the gateway sends the tenant and cache_salt.
      session, lease_ttl: the session this request belongs to ("" for none) and how long its slot's KV stays
        leased to it after the request ends (seconds; 0: no lease, and a lease the session held ends).
      leader: the running sequence computing a prompt that shares `share` tokens with this one: this sequence
        waits (computing nothing) until the leader has computed them, then copies its slot; None otherwise.
      share: prompt tokens to take from the leader's slot.
      first_token_at: time.monotonic() of the first generated token (prefill / decode time metrics).
      prediction: the client's expected output tokens (OpenAI Predicted Outputs), a source of drafts.
      prediction_accepted: how many of them were accepted as drafts (set when the sequence ends).
      drafts_with_masks: the client sends draft tokens with its masks (a constrained request whose grammar the
        client holds): the loop waits briefly for a step's mask before planning the step.
      grammar_draft: the client's latest draft with its masks (`GrammarDraft`), or None.
      slo_ttft_s, slo_tpot_s: the request's time-to-first-token and time-per-output-token targets in seconds
        (None: the worker's defaults, model_worker/serving/slo.py).
      priority: admission order among waiting sequences with the same deadline (vLLM's field: lower first).
      first_arrived_at: for a retry of a request refused for its TTFT target (the same prompt in the same scope,
        `SloAdmission.first_arrival`), time.monotonic() of the first refused attempt: its place in the queue
        follows that attempt's deadline; None otherwise.
    """

    request_id: str
    prompt: list[int]
    sampling: SamplingSpec
    max_tokens: int
    stop_ids: frozenset[int]
    sink: Callable[[TokenEvent], None]
    constrained: bool = False
    fork_of: str | None = None
    slot: int | None = None
    num_computed: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    masks: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    forced: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    allowed: np.ndarray | None = None
    finish: Finish = Finish.NONE
    arrival: int = 0
    clear_penalties: bool = True
    cached_tokens: int = 0
    snapshot_at: int | None = None
    arrived_at: float = dataclasses.field(default_factory=time.monotonic)
    admitted_at: float | None = None
    last_token_at: float | None = None
    missed: bool = False
    cache_salt: str = ""
    draft_scope: str = ""
    session: str = ""
    lease_ttl: float = 0.0
    leader: Sequence | None = dataclasses.field(default=None, repr=False, compare=False)
    share: int = 0
    first_token_at: float | None = None
    prediction: list[int] = dataclasses.field(default_factory=list)
    prediction_accepted: int = 0
    drafts_with_masks: bool = False
    grammar_draft: GrammarDraft | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    priority: int = 0
    first_arrived_at: float | None = None

    @property
    def row(self) -> int:
        """The slot of an admitted sequence (the scheduler reads it only for sequences in its running set).

        Raises:
          RuntimeError: the sequence holds no slot (waiting or finished): a scheduling bug.
        """
        if self.slot is None:
            raise RuntimeError(f"sequence {self.request_id!r} holds no slot")
        return self.slot

    @property
    def tokens(self) -> list[int]:
        """prompt + output."""
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache."""
        return len(self.prompt) + len(self.output) - self.num_computed

    def ready(self) -> bool:
        """Whether the next token can be sampled now (unconstrained, or its mask has arrived)."""
        return not self.constrained or len(self.output) in self.masks

    def has_constraint(self) -> bool:
        """Whether the next step's mask or forced tokens have arrived (always True when unconstrained)."""
        return self.ready() or len(self.output) in self.forced

    def is_output(self, start: int, count: int) -> list[bool]:
        """For tokens start..start+count-1 of `tokens`: whether each is generated (not prompt)."""
        return [start + j >= len(self.prompt) for j in range(count)]
