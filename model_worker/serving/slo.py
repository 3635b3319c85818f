"""Latency-target (SLO) admission and chunk sizing for the scheduler (plain Python), on a `StepTimeModel`.

A request may carry targets: time to first token (TTFT) and time per output token (TPOT), in seconds; the
worker's `--slo-ttft` / `--slo-tpot` give requests without their own the defaults (none: no targets, today's
first-come first-served behaviour). Goodput counts the requests that meet both (DistServe's definition).

- Order: waiting requests are admitted least slack first — deadline = arrival + TTFT target — (requests without
  a target after those with one); deadlines within the same 100 ms (`DEADLINE_TIE_S`), and all requests
  without a target, go by `priority` (vLLM's field: lower first), then by deadline and arrival.
- Early refusal (SCORPIO's idea): a waiting request whose TTFT can no longer be met is answered at once
  (`Failure.SLO_UNREACHABLE`: the gateway's 429 with Retry-After) instead of waiting in vain — when its deadline
  has passed, or when the prompt tokens ahead of it and its own uncached ones, at the modelled rate, cannot be
  computed before it. With `--slo-policy best-effort` it is served late instead.
- Admission keeps running requests on target: a new request joins only while a decode step with one more row
  is predicted within the tightest TPOT target among the running requests.
- Chunk sizing (Sarathi-Serve's idea): a step that decodes requests with a TPOT target gets the largest prompt
  chunk whose predicted step time stays within the tightest of those targets: the largest of the engine's
  compiled chunk sizes that fits, else its smallest (a shorter cut would be padded to it: no time saved); with
  no sizes known, any length down to `MIN_CHUNK` tokens. Either way prompts always progress.
Without a fitted model nothing is predicted: only passed deadlines are refused.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Iterable

from model_worker.serving.sequence import Sequence
from model_worker.serving.step_model import StepShape, StepTimeModel

#: Fewest prompt tokens a step's chunk is cut to under a TPOT target.
MIN_CHUNK = 16
#: Deadlines this close (seconds: the same step of this size) count as equal, and `priority` orders them: exact
#: float deadlines are never equal, so without it the field would order only requests without a target.
DEADLINE_TIE_S = 0.1
#: Seconds after its last refusal that a refused request's first arrival is remembered for its retries, and
#: how many are remembered.
RETRY_MEMORY_S = 60.0
RETRY_MEMORY_SIZE = 4096
#: Prompt tokens per step assumed when predicting how long a queue of prompts takes, when neither the engine's
#: chunk sizes nor the scheduler's token budget are known (a scripted scheduler in tests).
PLANNING_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class SloSettings:
    """The worker's SLO flags.

    Attributes:
      ttft_s, tpot_s: default targets (seconds) of requests without their own; None: none.
      policy: "reject" (refuse early what cannot be met) or "best-effort" (serve it late).
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    policy: str = "reject"


class SloAdmission:
    """The scheduler's latency-target decisions (see the module docstring)."""

    def __init__(self, settings: SloSettings = SloSettings(), model: StepTimeModel | None = None,
                 chunks: tuple[int, ...] = (), token_budget: int | None = None):
        """Args: settings: the worker's flags; model: the step-time model (default: learned from the steps,
        on the raw shape); chunks: the engine's compiled prompt chunk sizes (`EngineSizes.prefill_chunks`;
        empty: any length); token_budget: the most prompt tokens the scheduler computes in a step that also
        decodes (its `token_budget`; None: unbounded)."""
        self.settings = settings
        self.model = model or StepTimeModel()
        self.chunks = tuple(sorted(chunks))
        self.token_budget = token_budget
        # prompt key -> (first refused attempt's arrival, last refusal), least recently refused first
        self._refused: collections.OrderedDict[int, tuple[float, float]] = collections.OrderedDict()

    def ttft(self, seq: Sequence) -> float | None:
        """A sequence's TTFT target in seconds (its own, else the default), or None."""
        return seq.slo_ttft_s if seq.slo_ttft_s is not None else self.settings.ttft_s

    def tpot(self, seq: Sequence) -> float | None:
        """A sequence's TPOT target in seconds (its own, else the default), or None."""
        return seq.slo_tpot_s if seq.slo_tpot_s is not None else self.settings.tpot_s

    def refused(self, seq: Sequence) -> None:
        """Remember a request refused for its TTFT target, so that its retries queue by its first deadline."""
        first = seq.first_arrived_at if seq.first_arrived_at is not None else seq.arrived_at
        key = self._prompt_key(seq)
        earlier = self._refused.get(key, (first, 0.0))[0]
        self._refused[key] = (min(first, earlier), time.monotonic())
        self._refused.move_to_end(key)
        while len(self._refused) > RETRY_MEMORY_SIZE:
            self._refused.popitem(last=False)

    def first_arrival(self, seq: Sequence) -> float | None:
        """When a request with this one's prompt (and scope) was refused within the last `RETRY_MEMORY_S`
        seconds, the arrival of its first refused attempt; else None. A refused attempt comes back as a new request, so without this an
        unlucky client could be refused again and again while the queue stays full (OpenAI's clients resend the
        same body after `Retry-After`)."""
        if not self._refused:
            return None
        now = time.monotonic()
        while self._refused and now - next(iter(self._refused.values()))[1] > RETRY_MEMORY_S:
            self._refused.popitem(last=False)
        found = self._refused.get(self._prompt_key(seq))
        return None if found is None else found[0]

    @staticmethod
    def _prompt_key(seq: Sequence) -> int:
        return hash((seq.cache_salt, seq.draft_scope, tuple(seq.prompt)))

    def order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        """Waiting sequences least slack first: by TTFT deadline (a retry's: its first attempt's, `first_arrival`),
        those without a target last; ties (deadlines in the same `DEADLINE_TIE_S` step, and every sequence
        without a target) by priority, then deadline, then arrival."""
        def key(seq: Sequence) -> tuple:
            target = self.ttft(seq)
            arrived = seq.first_arrived_at if seq.first_arrived_at is not None else seq.arrived_at
            deadline = 0.0 if target is None else arrived + target
            return (target is None, math.floor(deadline / DEADLINE_TIE_S), seq.priority, deadline, seq.arrival)

        return sorted(waiting, key=key)

    def unreachable(self, seq: Sequence, now: float, tokens_ahead: int, own_tokens: int,
                    decoding: list[Sequence], lead: int | None = None) -> float | None:
        """The predicted TTFT (seconds from arrival) of a waiting sequence whose target cannot be met, or None
        when it can (or it has no target, or the policy is best-effort).

        Args:
          now: time.monotonic().
          tokens_ahead: uncached prompt tokens computed before this sequence's (running prompts, sequences
            ahead in the queue).
          own_tokens: its own uncached prompt tokens.
          decoding: the running decode rows (their steps share the engine with the prompts).
          lead: see `prompt_seconds`.
        """
        target = self.ttft(seq)
        if target is None or self.settings.policy != "reject":
            return None
        waited = now - seq.arrived_at
        if waited > target:
            return waited
        remaining = self.prompt_seconds(tokens_ahead + own_tokens, decoding, lead)
        if remaining is not None and waited + remaining > target:
            return waited + remaining
        return None

    def prompt_seconds(self, tokens: int, decoding: list[Sequence], lead: int | None = None) -> float | None:
        """Predicted seconds to compute `tokens` prompt tokens in chunks beside the running decode rows, each
        chunk as large as the scheduler makes it (`planned_chunk`).

        `lead`: when no row decodes, the tokens of the prompt computed first: they run alone, in the largest
        chunks, and the rest beside its decode row, in the chunks the scheduler cuts then (its token budget) —
        pricing a whole queue alone would be several times too optimistic. None: all of them alone."""
        if tokens <= 0:
            return 0.0
        if decoding or lead is None or lead >= tokens:
            return self._chunks_seconds(tokens, self._shape(decoding, 0), self.planned_chunk(decoding))
        alone = self.planned_chunk([])
        first = self._chunks_seconds(lead, StepShape(), alone)
        beside = StepShape(rows=1, kv_tokens=lead, longest=lead + 1)
        rest = self._chunks_seconds(tokens - lead, beside, min(alone, self.token_budget or alone))
        return None if first is None or rest is None else first + rest

    def _chunks_seconds(self, tokens: int, step: StepShape, chunk: int) -> float | None:
        """Predicted seconds of ceil(tokens / chunk) steps of `step` with a chunk each."""
        per = self.model.predict(dataclasses.replace(step, chunk_tokens=min(tokens, chunk)))
        return None if per is None else math.ceil(tokens / chunk) * per

    def planned_chunk(self, decoding: list[Sequence]) -> int:
        """The prompt tokens a step computes beside these decode rows: the largest compiled chunk, bounded by
        the token budget and the TPOT targets when rows decode (the scheduler's own rule); `PLANNING_CHUNK`
        when neither chunk sizes nor a budget are known."""
        chunk = self.chunks[-1] if self.chunks else PLANNING_CHUNK
        if decoding:
            bounds = [b for b in (self.token_budget, self.chunk_budget(decoding)) if b is not None]
            chunk = min([chunk, *bounds])
        return max(1, chunk)

    def chunk_budget(self, decoding: list[Sequence], start: int = 0, draft_tokens: int = 0) -> int | None:
        """The most prompt tokens a step with these decode rows may compute and stay within their tightest
        TPOT target (None: no bound). `start`: the chunk's first position (its KV bucket); `draft_tokens`: the
        drafts the step may verify (its rows then run as a verify pass beside the chunk: the dearer of the two
        is priced)."""
        tight = self._tightest(decoding)
        if tight is None or not self.model.fitted:
            return None
        if self.chunks:
            def seconds(c: int) -> float:
                shape = self._shape(decoding, c, start + c)
                shapes = [shape, dataclasses.replace(shape, draft_tokens=draft_tokens)] if draft_tokens else [shape]
                return max(self.model.predict(s) or 0.0 for s in shapes)

            fits = [c for c in self.chunks if seconds(c) <= tight]
            return fits[-1] if fits else self.chunks[0]
        base = self.model.predict(self._shape(decoding, 0)) or 0.0
        per_token = (self.model.predict(self._shape(decoding, 1)) or 0.0) - base
        if per_token <= 0:
            return None
        return max(MIN_CHUNK, int((tight - base) / per_token))

    def admits(self, running: list[Sequence], seq: Sequence) -> bool:
        """Whether one more row keeps the running rows (and `seq`) within their tightest TPOT target. A target
        the running rows already miss is left out: it is lost either way, and must not hold everyone back."""
        if not self.model.fitted or not running:
            return True
        now = self.model.predict(self._shape(running, 0)) or 0.0
        targets = [t for s in [*running, seq] if (t := self.tpot(s)) is not None and t >= now]
        if not targets:
            return True
        predicted = self.model.predict(self._shape([*running, seq], 0))
        return predicted is None or predicted <= min(targets)

    def headroom(self, running: list[Sequence], free_slots: int) -> int:
        """More rows the running ones can take within their tightest achievable TPOT target (at most
        `free_slots`; each new row assumed as long as the running ones on average); -1 when no running row has a
        target or the model is not fitted (unknown)."""
        if not self.model.fitted or not running:
            return -1
        shape = self._shape(running, 0)
        now = self.model.predict(shape) or 0.0
        targets = [t for s in running if (t := self.tpot(s)) is not None and t >= now]
        if not targets:
            return -1
        mean = shape.kv_tokens // len(running)
        more = 0
        while more < free_slots:
            bigger = dataclasses.replace(shape, rows=shape.rows + more + 1,
                                         kv_tokens=shape.kv_tokens + (more + 1) * mean)
            if (self.model.predict(bigger) or 0.0) > min(targets):
                break
            more += 1
        return more

    def _tightest(self, seqs: Iterable[Sequence]) -> float | None:
        targets = [t for s in seqs if (t := self.tpot(s)) is not None]
        return min(targets) if targets else None

    @staticmethod
    def _shape(decoding: list[Sequence], chunk: int, chunk_end: int = 0) -> StepShape:
        """A step of these decode rows and a `chunk`-token prompt chunk ending at `chunk_end` (0: unknown)."""
        return StepShape(rows=len(decoding), kv_tokens=sum(s.num_computed for s in decoding), chunk_tokens=chunk,
                         longest=max((s.num_computed + 1 for s in decoding), default=0), chunk_end=chunk_end)
