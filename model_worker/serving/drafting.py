"""Draft tokens without a draft model: what a sequence's own context, the client's prediction and recent answers
say comes next (speculative decoding; docs/architecture.md, "Speculative decoding"). Plain Python, no JAX.

Agent turns repeat their context: tool-call arguments quote the user's words and paths, JSON repeats keys, code
is echoed and edited, and a base model loops on its own text. So the continuation of the most recent earlier
occurrence of a sequence's last few tokens is a good guess (prompt lookup / n-gram speculation, as vLLM's
`ngram` proposer and llama.cpp's lookup decoding do). Three sources, looked up the same way:

  * the sequence's own tokens (prompt and output so far);
  * the client's prediction (OpenAI's Predicted Outputs, `prediction.content`), an expected text such as a file
    being edited: also proposed from its start while the output is still empty;
  * recent finished answers of the same cache scope (`cache_salt`, which the gateway derives per tenant where
    keys are configured): another scope's answers would let a request's speed reveal what that scope was told.

The longest match wins (ties: prediction, own tokens, answers). Whether a draft is worth checking is the loop's
decision (`StepCosts`, `worth_verifying`), from each sequence's acceptance so far (`Acceptance`).

Exactness does not depend on any of this: a draft only decides which tokens a verify step checks; the tokens a
sequence gets are the sampler's (`programs.verify_sample_program`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from common.ngram import NGRAM_MAX, NGRAM_MIN, NgramIndex

#: Finished answers kept per cache scope, and scopes kept (least recently used dropped first).
ANSWERS_PER_SCOPE = 4
ANSWER_SCOPES = 16
#: Tokens of an answer kept for drafting (its tail beyond is dropped). With the bounds above the answers' indexes
#: hold at most 16 x 4 x 1024 x 3 n-grams (~0.2 M dictionary entries).
ANSWER_TOKENS = 1024


@dataclasses.dataclass
class Acceptance:
    """A sequence's recent draft acceptance: the chance that the next drafted token is accepted, estimated as
    accepted / (accepted + rejections) over exponentially decayed counts (the maximum-likelihood estimate of a
    geometric run's continuation probability), starting from a prior of one of each.

    Attributes:
      accepted, rejected: decayed counts; drafted, taken: totals since start (metrics, Predicted Outputs usage);
      passed: drafts passed over since the last verified one; it starts at `PROBE_AFTER`, so a sequence's first
        draft is verified whatever the costs say (a short answer, a constrained reply or a tool call, would
        otherwise end before its estimate was ever tested).
    """

    accepted: float = 1.0
    rejected: float = 1.0
    drafted: int = 0
    taken: int = 0
    passed: int = 16  # = PROBE_AFTER: a sequence's first draft is verified, to measure its own acceptance
    DECAY = 0.7
    #: Drafts passed over (not worth verifying) before one is verified anyway: acceptance changes along a text
    #: (a model that starts to loop), and an estimate that is never tested again could not notice.
    PROBE_AFTER = 16

    @property
    def rate(self) -> float:
        """Estimated probability that a drafted token is accepted, in (0, 1)."""
        return self.accepted / (self.accepted + self.rejected)

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verified draft of `drafted` tokens of which the first `accepted` were accepted."""
        if drafted <= 0:
            return
        self.passed = 0
        self.accepted = self.accepted * self.DECAY + accepted
        self.rejected = self.rejected * self.DECAY + (accepted < drafted)
        self.drafted += drafted
        self.taken += accepted

    @property
    def probe_due(self) -> bool:
        """Whether enough drafts were passed over that the next one is verified to refresh the estimate."""
        return self.passed >= self.PROBE_AFTER

    def expected_tokens(self, drafted: int) -> float:
        """Tokens a verify step is expected to emit for a row with `drafted` drafts: 1 + a + a^2 + ... + a^k."""
        a = self.rate
        return sum(a ** i for i in range(drafted + 1))

    def prior(self) -> Acceptance:
        """A new sequence's starting acceptance: this estimate's rate with the weight of the default prior (two
        observations), so the sequence's own first verified drafts soon outweigh it."""
        rate = self.rate
        return Acceptance(accepted=2 * rate, rejected=2 * (1 - rate))


@dataclasses.dataclass
class DraftState:
    """Drafting state of one live sequence (the scheduler's, like the sequence itself).

    Attributes:
      own: index of the sequence's tokens (prompt, then output as it grows).
      prediction: index of the client's predicted tokens, or None.
      acceptance: its acceptance so far.
      prediction_accepted: predicted tokens that the output reproduced (OpenAI `accepted_prediction_tokens`):
        while the output follows the prediction from its start, each of its tokens; after that, accepted drafts
        taken from a later match in the prediction.
      source: where the latest draft came from: "prediction" (aligned), "prediction-match", "own", "answers" or
        "".
      aligned: the output so far equals the prediction's start, so the prediction's next tokens are the draft.
      generated: output tokens so far.
    """

    own: NgramIndex
    prediction: NgramIndex | None = None
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)
    prediction_accepted: int = 0
    source: str = ""
    aligned: bool = True
    generated: int = 0


class Drafter:
    """Proposes drafts for live sequences and remembers recent answers per cache scope (bounded)."""

    #: Cache scopes whose recent acceptance is kept (least recently verified dropped first).
    MAX_SCOPES = 1024

    def __init__(self):
        self.states: dict[str, DraftState] = {}
        self._answers: collections.OrderedDict[str, collections.deque[NgramIndex]] = collections.OrderedDict()
        # Per cache scope, the acceptance of its recent verified drafts: a new sequence of the scope starts from it
        # (`Acceptance.prior`) rather than from one-in-two. At int8 on CPU a verify step of 8 positions costs ~2.4
        # plain steps, so a fresh sequence at one-in-two never looked worth verifying, and short answers (a
        # constrained JSON reply, a tool call) ended before a probe. Scoped like the answers cache, so that one
        # tenant's acceptance cannot change how fast another's requests run.
        self._recent: collections.OrderedDict[str, Acceptance] = collections.OrderedDict()

    @staticmethod
    def new_state(tokens: Sequence[int], prediction: Sequence[int] = ()) -> DraftState:
        """A sequence's drafting state, its indexes built (O(tokens); touches no shared state, so the thread that
        submits a sequence builds it, not the engine thread: ~9 ms for 8k tokens)."""
        return DraftState(NgramIndex(tokens), NgramIndex(prediction) if prediction else None)

    def start(self, request_id: str, tokens: Sequence[int], prediction: Sequence[int] = (),
              state: DraftState | None = None, scope: str | None = None) -> DraftState:
        """Begin drafting for a sequence whose tokens so far are `tokens` (`state`: already built by `new_state`);
        with its cache `scope`, its acceptance starts from the scope's recent one."""
        state = state or self.new_state(tokens, prediction)
        recent = self._recent.get(scope) if scope is not None else None
        if recent is not None and state.acceptance.drafted == 0:
            state.acceptance = recent.prior()
        self.states[request_id] = state
        return state

    def append(self, request_id: str, token: int) -> None:
        """A sequence got its next token."""
        state = self.states.get(request_id)
        if state is not None:
            state.own.extend([token])
            predicted = state.prediction.tokens if state.prediction is not None else ()
            state.aligned = state.aligned and state.generated < len(predicted) and predicted[state.generated] == token
            state.prediction_accepted += state.aligned  # the output reproduces the prediction so far
            state.generated += 1

    def propose(self, request_id: str, scope: str, k: int) -> list[int]:
        """Up to `k` draft tokens to follow a sequence's tokens (empty: no match); `scope`: its cache scope. While
        the output follows the prediction from its start, the prediction's next tokens are the draft."""
        state = self.states.get(request_id)
        if state is None or k <= 0:
            return []
        tail = state.own.tokens[-NGRAM_MAX:]
        best: tuple[int, list[int], str] = (0, [], "")
        if state.prediction is not None:
            ahead = state.prediction.tokens[state.generated:state.generated + k] if state.aligned else []
            if ahead:
                best = (NGRAM_MAX + 1, ahead, "prediction")
            else:
                n, draft = state.prediction.lookup(tail, k)
                best = (n, draft, "prediction-match") if draft else best
        n, draft = state.own.lookup(tail, k)
        if n > best[0] and draft:
            best = (n, draft, "own")
        for answer in self._answers.get(scope, ()):
            n, draft = answer.lookup(tail, k)
            if n > best[0] and draft:
                best = (n, draft, "answers")
        state.source = best[2]
        return best[1]

    def expected_tokens(self, request_id: str, drafted: int) -> float:
        """Tokens a verify step is expected to emit for a sequence with `drafted` drafts (1 without them)."""
        state = self.states.get(request_id)
        return 1.0 if state is None or not drafted else state.acceptance.expected_tokens(drafted)

    def probe_due(self, request_id: str) -> bool:
        """Whether a sequence's next draft should be verified whatever the costs say (`Acceptance.probe_due`)."""
        state = self.states.get(request_id)
        return state is not None and state.acceptance.probe_due

    def passed_over(self, request_id: str) -> None:
        """A sequence's draft was not verified (not worth it this step)."""
        state = self.states.get(request_id)
        if state is not None:
            state.acceptance.passed += 1

    def verified(self, request_id: str, drafted: int, accepted: int, scope: str | None = None) -> None:
        """Record how many of a sequence's latest draft's `drafted` tokens were accepted (also for its cache
        `scope`'s recent acceptance, when given)."""
        state = self.states.get(request_id)
        if state is None:
            return
        state.acceptance.update(drafted, accepted)
        if scope is not None:
            recent = self._recent.pop(scope, None) or Acceptance()
            recent.update(drafted, accepted)
            self._recent[scope] = recent
            while len(self._recent) > self.MAX_SCOPES:
                self._recent.popitem(last=False)
        if state.source == "prediction-match":  # aligned drafts are counted as the output reproduces them
            state.prediction_accepted += accepted

    def finish(self, request_id: str, scope: str, output: Sequence[int]) -> DraftState | None:
        """A sequence ended: keep its answer for its scope's later drafts; returns its state (None if unknown)."""
        state = self.states.pop(request_id, None)
        if state is not None and len(output) > NGRAM_MIN:
            answers = self._answers.setdefault(scope, collections.deque(maxlen=ANSWERS_PER_SCOPE))
            self._answers.move_to_end(scope)
            answers.append(NgramIndex(output[:ANSWER_TOKENS]))
            while len(self._answers) > ANSWER_SCOPES:
                self._answers.popitem(last=False)
        return state


class StepCosts:
    """Measured seconds of decode and verify steps by (kind, batch bucket), exponentially averaged, from which
    the loop decides whether checking drafts pays: a verify step runs when its expected tokens per second beat a
    plain decode step's (`worth_verifying`). Until a verify bucket has been measured, its cost is the decode
    step's times `PRIOR_RATIO`, so speculation gets tried and then judged by its own measurements.

    A decode bucket counts as measured after `FIRST_STEPS` steps, the least of them its first estimate, then the
    average moves with every step: one slow first step (a page-fault storm, another process's burst) would
    otherwise make every verify step look cheap, and a loop that then always verifies never measures a plain
    step again to correct it."""

    PRIOR_RATIO = 1.5
    WEIGHT = 0.2
    FIRST_STEPS = 3

    def __init__(self):
        self.seconds: dict[tuple[str, int], float] = {}
        self.steps: dict[tuple[str, int], int] = {}

    def observe(self, kind: str, batch: int, seconds: float) -> None:
        """One measured step (dispatch to sampled tokens on the host)."""
        key = (kind, batch)
        old = self.seconds.get(key)
        n = self.steps[key] = self.steps.get(key, 0) + 1
        if old is None:
            self.seconds[key] = seconds
        elif n <= self.FIRST_STEPS:
            self.seconds[key] = min(old, seconds)
        else:
            self.seconds[key] = (1 - self.WEIGHT) * old + self.WEIGHT * seconds

    def estimate(self, kind: str, batch: int) -> float | None:
        """The expected seconds of a step, or None when nothing is known (a decode bucket: fewer than
        `FIRST_STEPS` steps measured)."""
        decode = self.seconds.get(("decode", batch))
        if self.steps.get(("decode", batch), 0) < self.FIRST_STEPS:
            decode = None
        if kind == "decode":
            return decode
        known = self.seconds.get((kind, batch))
        if known is not None or kind != "verify":
            return known
        return None if decode is None else decode * self.PRIOR_RATIO

    def worth_verifying(self, batch: int, rows: int, expected_tokens: float, beside_chunk: bool = False) -> bool:
        """Whether a verify step expected to emit `expected_tokens` for `rows` sequences (batch bucket `batch`)
        gives more tokens per second than a plain decode step of them. A batch size whose decode step was never
        measured decodes plainly first (so there is something to compare with).

        `beside_chunk`: the iteration also computes a prompt chunk, where the rows would ride in the chunk's
        mixed pass almost for free (docs/performance.md, "Mixed step"); verifying them takes a step of its own,
        so only the tokens beyond the rows' one each count against its whole time."""
        decode, verify = self.estimate("decode", batch), self.estimate("verify", batch)
        if decode is None or verify is None:
            return False
        if beside_chunk:
            return (expected_tokens - rows) / verify > rows / decode
        return expected_tokens / verify > rows / decode
