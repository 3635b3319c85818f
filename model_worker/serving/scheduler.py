"""Plain-Python scheduling: sequences, the slot pool, and what to run next. No JAX here.

A sequence's tokens are `prompt + output`; `num_computed` of them have their KV in the cache. Whatever is not
computed yet is *pending*: one pending token (the last sampled one) makes it a decode candidate; more (a prompt,
or forced tokens appended by a constrained-decoding client) make it a compute candidate. Each engine iteration
asks `Scheduler.schedule()` for work: at most one compute chunk (the oldest compute candidate) and one decode
step over every decode candidate. So a long new prompt is computed chunk by chunk while running streams keep
getting tokens, and a finished sequence's slot is free for the next iteration.

One owner: this module is the only one that changes a `Sequence` (and the prefix cache's slots, through
`PrefixCache`'s methods). An iteration is nano-vllm's step: `work = schedule()`, the loop runs the work on the
engine and hands back what it sampled (`StepResult`), `emissions = postprocess(work, result)`, and the loop
publishes the emissions to the sequences' sinks. The loop and the prefix cache only read sequences; the commands
other threads send (masks, forced tokens, aborts) reach sequences through `add_mask`, `add_forced` and `abort`.

Constrained sequences sample only with a token mask for that step (`masks[step]`); one whose mask has not
arrived is left out of the iteration without holding back the others. Forced tokens (`forced[step]`) are
appended without sampling when the sequence reaches that step, and computed together in one step.

`n` > 1: a sequence with `fork_of` shares its parent's prompt KV: when the parent's prompt has just been computed
the engine copies the parent's slot into the fork's, and the fork only recomputes its last prompt token (which
is exact for sliding-window rings: the parent's ring is then exactly one position ahead, and the one entry it
overwrote is outside the window of the recomputed position).

Slots keep their KV after a sequence finishes: `PrefixCache` (prefix_cache.py) decides which slot a new sequence
gets and how much of its prompt is already there.

Shared prompts in flight: a sequence whose prompt shares a prefix with a prompt that another running sequence (its
`leader`) is computing right now waits, in its slot, until the leader has computed that prefix (`share` tokens),
then copies the leader's slot and computes only the rest (SGLang's radix cache and vLLM's prefix caching behave
the same way). Waiting costs nothing: one prompt chunk runs per iteration, the oldest first, so the follower's own
prefill could not have started before the leader's anyway. So a burst of identical prompts costs one prefill,
and its sequences start decoding in the same iteration. The leader's chunks stop at a follower's share point when
they would otherwise run past it by more than the sliding rings' slack (the copy would not be exact).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any

import numpy as np

from model_worker.serving.drafting import Drafter, DraftState
from model_worker.serving.engine_api import HostOutput, PromptChunk, VerifyOutput
from model_worker.serving.prefix_cache import LiveSlot, PrefixCache
from model_worker.serving.sequence import Failure, Finish, GrammarDraft, Sequence, TokenEvent
from model_worker.serving.slo import SloAdmission


@dataclasses.dataclass(frozen=True)
class Emission:
    """An event for a sequence's sink, with the times the latency metrics read of a sampled token.

    Attributes:
      seq: the sequence (read only once emitted).
      event: what its sink gets.
      sampled_at: time.monotonic() when the sampled token was recorded; None for any other event (forced tokens,
        an end without a token).
      previous_at: the sequence's previous sampled token's `sampled_at`; None for its first one.
    """

    seq: Sequence
    event: TokenEvent
    sampled_at: float | None = None
    previous_at: float | None = None


@dataclasses.dataclass(frozen=True)
class Chunk:
    """The compute part of an iteration: tokens of one sequence to run into its slot, and what to do after.

    Attributes:
      seq: the sequence the chunk is computed for.
      rows: what the engine computes (`engine_api.PromptChunk`: the engine consumes its first n >= 1 tokens;
        `clear_penalties` is the sequence's flag when the chunk was planned).
      snapshot_to: when the engine consumes every token, the chunk ends exactly at the sequence's shared prefix:
        copy the chunk's slot over this slot, which the scheduler then pins as a snapshot of that prefix; None
        otherwise.
    """

    seq: Sequence
    rows: PromptChunk
    snapshot_to: int | None = None

    def snapshot_due(self, consumed: int) -> bool:
        """Whether the engine consuming `consumed` tokens of the chunk makes its snapshot copy due (it consumed
        them all, and the chunk ends at a shared prefix)."""
        return self.snapshot_to is not None and consumed == len(self.rows.token_ids)


@dataclasses.dataclass
class Work:
    """One engine iteration: slot copies (prefix reuse, forks) first, an optional compute chunk, then the
    sequences to decode.

    Attributes:
      copies: (source slot, destination slot) copies to run before anything else, in order.
      decode: the sequences that decode one token each, by slot.
      chunk: the compute chunk (of the oldest sequence with several pending tokens; budget-sized when `decode` is
        not empty), or None.
      admitted: sequences admitted into a slot by this `schedule()` call, in admission order.
      emissions: events made while scheduling (forced tokens appended, sequences they ended), to publish before
        the step runs.
      drafts: per `decode` sequence, draft tokens to verify after its pending token (speculative decoding; empty
        lists when it has none, and no entries at all when the step has too many rows); the loop decides whether
        the step verifies them (beside a chunk too: then the chunk runs alone and the rows in a verify step).
      draft_masks: per `decode` sequence with `drafts`, the masks of the positions after its drafts
        (`GrammarDraft.masks`, one per draft token) for a constrained sequence; empty for any other.
    """

    copies: list[tuple[int, int]]
    decode: list[Sequence]
    chunk: Chunk | None = None
    admitted: list[Sequence] = dataclasses.field(default_factory=list)
    emissions: list[Emission] = dataclasses.field(default_factory=list)
    drafts: list[list[int]] = dataclasses.field(default_factory=list)
    draft_masks: list[list[np.ndarray]] = dataclasses.field(default_factory=list)

    @property
    def compute(self) -> Sequence | None:
        """The sequence the chunk is computed for, or None without a chunk."""
        return None if self.chunk is None else self.chunk.seq


@dataclasses.dataclass
class StepResult:
    """What the engine did with a `Work`, on the host (the loop fills it; `Scheduler.postprocess` reads it).

    Attributes:
      computed: chunk tokens the engine consumed (0 without a chunk).
      compute_sample: the chunk's last token sampled (one row), when the chunk computed every pending token of a
        live sequence; else None.
      decode_sample: the decode step's samples (one row per `Work.decode` sequence), or None without a step.
      sampled: per decode row, whether its sample is used (its mask had arrived or it needs none).
      active: per decode row, whether its step counts (sampled, or its forced tokens arrived: its KV is kept and
        the forced tokens follow); an inactive live row missed its mask and is computed again later.
      verify_sample: when the decode step verified `Work.drafts` (a verify step), its samples instead of
        `decode_sample`: per row, the tokens it emits (`VerifyOutput.emitted`).
    """

    computed: int = 0
    compute_sample: HostOutput | None = None
    decode_sample: HostOutput | None = None
    sampled: list[bool] = dataclasses.field(default_factory=list)
    active: list[bool] = dataclasses.field(default_factory=list)
    verify_sample: VerifyOutput | None = None


class Scheduler:
    """Owns the waiting queue, the running set and every change to a sequence; slots and their contents belong to
    `self.cache`."""

    def __init__(self, num_slots: int, max_model_len: int, slack: int = 0, max_waiting: int | None = None,
                 token_budget: int | None = None, lease_preempt_after: float = 10.0, max_draft_tokens: int = 0,
                 max_verify_batch: int = 0, slo: SloAdmission | None = None):
        """Args: num_slots: cache rows; max_model_len: context limit used to finish sequences with LENGTH;
        slack: sliding-ring positions beyond the window (prefix reuse tolerance, see PrefixCache);
        max_waiting: bound of the waiting queue (None: unbounded); token_budget: most chunk tokens in an
        iteration that also decodes (None: no bound; a chunk alone is never bounded); lease_preempt_after:
        seconds a request waits for a slot before it may take the oldest session lease's slot;
        max_draft_tokens: most draft tokens proposed per decode row (0: no speculation); max_verify_batch: most
        decode rows of a step that proposes drafts; slo: latency-target admission and chunk sizing
        (model_worker/serving/slo.py; default: no targets, first-come first-served)."""
        self.slo = slo or SloAdmission()
        self.max_draft_tokens = max_draft_tokens
        self.max_verify_batch = max_verify_batch
        self.drafter = Drafter()
        self.lease_preempt_after = lease_preempt_after
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.token_budget = token_budget
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[int, Sequence] = {}
        self.cache = PrefixCache(num_slots, slack)
        self.by_id: dict[str, Sequence] = {}
        self._arrivals = 0
        self.reused_tokens = 0  # metrics: prompt tokens taken from the prefix cache or a leader's slot

    def add(self, seq: Sequence, drafting: DraftState | None = None) -> None:
        """Queue a new sequence (`drafting`: its drafting state when already built, `Drafter.new_state`).

        Raises:
          KeyError: a live sequence already has this request id.
          OverflowError: the waiting queue is full.
        """
        if seq.request_id in self.by_id:
            raise KeyError(seq.request_id)
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise OverflowError(f"{len(self.waiting)} requests are already waiting")
        self._arrivals += 1
        seq.arrival = self._arrivals
        seq.first_arrived_at = self.slo.first_arrival(seq)
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)
        if self.max_draft_tokens > 0:  # (the prompt is indexed here only when the submitter did not)
            self.drafter.start(seq.request_id, seq.tokens if drafting is None else (), seq.prediction,
                               state=drafting, scope=seq.draft_scope)

    def schedule(self) -> Work:
        """Append the forced tokens that are due, admit waiting sequences (reusing cached prefixes), copy due forks
        and shared prefixes, then pick this iteration's work and plan its chunk."""
        emissions = [e for seq in list(self.running.values()) if (e := self._force(seq)) is not None]
        emissions += self._refuse_unreachable()
        copies, admitted = self._admit()
        for parent, fork in self.due_forks():
            copies.append((parent.row, fork.row))
            fork.num_computed, fork.clear_penalties = len(fork.prompt) - 1, False
        copies += self._take_shares()
        live = [s for s in self.running.values() if s.finish == Finish.NONE and not self._waits_for_parent(s)]
        compute = min((s for s in live if s.pending >= 2), key=lambda s: s.arrival, default=None)
        # A constrained sequence joins the decode step before its mask arrives (the mask is needed only at
        # sampling, after the forward pass), unless its mask came too late last time.
        decode = sorted((s for s in live if s.pending == 1 and (s.ready() or not s.missed)), key=lambda s: s.row)
        chunk = None
        if compute is not None:
            may_draft = self.max_draft_tokens * len(decode) if len(decode) <= self.max_verify_batch else 0
            slo_budget = self.slo.chunk_budget(decode, compute.num_computed, may_draft)
            budgets = [b for b in (self.token_budget, slo_budget) if b is not None and decode]
            chunk = self._plan_chunk(compute, min(budgets) if budgets else None)
        drafts: list[list[int]] = []
        draft_masks: list[list[np.ndarray]] = []
        if decode and len(decode) <= self.max_verify_batch:
            drafts = [self._draft(seq) for seq in decode]
            draft_masks = [self._draft_masks(seq, len(d)) for seq, d in zip(decode, drafts)]
        return Work(copies=copies, decode=decode, chunk=chunk, admitted=admitted, emissions=emissions,
                    drafts=drafts, draft_masks=draft_masks)

    def _draft(self, seq: Sequence) -> list[int]:
        """Draft tokens to verify after a decode candidate's pending token, none past its token limit or the
        context: a constrained sequence's from its client (`GrammarDraft`, once the mask of its step is here),
        none while forced tokens are due, any other's from the drafter."""
        k = min(self.max_draft_tokens, seq.max_tokens - len(seq.output) - 1,
                self.max_model_len - len(seq.prompt) - len(seq.output))
        if seq.forced:
            return []
        if seq.constrained:
            g = seq.grammar_draft
            ok = g is not None and g.step == len(seq.output) and g.step in seq.masks
            return list(g.tokens[:max(k, 0)]) if ok and g is not None else []
        return self.drafter.propose(seq.request_id, seq.draft_scope, k)

    @staticmethod
    def _draft_masks(seq: Sequence, drafted: int) -> list[np.ndarray]:
        """The masks of a constrained sequence's positions after its `drafted` draft tokens (empty otherwise)."""
        g = seq.grammar_draft
        return list(g.masks[:drafted]) if seq.constrained and drafted and g is not None else []

    def awaiting_drafts(self) -> bool:
        """Whether a running sequence whose client sends drafts with its masks (`Sequence.drafts_with_masks`)
        is decoding and still lacks the mask of its next step (the loop waits briefly for it before scheduling,
        so that the step can verify its draft)."""
        return any(s.drafts_with_masks and s.finish == Finish.NONE and s.output and s.pending == 1
                   and len(s.output) not in s.masks and len(s.output) not in s.forced for s in self.running.values())

    def _force(self, seq: Sequence) -> Emission | None:
        """Append the forced tokens due at `seq`'s current step; their event (None: none were due)."""
        applied = self.apply_forced(seq)
        if not applied:
            return None
        if seq.finish != Finish.NONE:
            self.finish(seq)
        return Emission(seq, TokenEvent(applied, [0.0] * len(applied), seq.finish, forced=[True] * len(applied),
                                        top=[([], [])] * len(applied), **_prediction_usage(seq)))

    def _plan_chunk(self, seq: Sequence, budget: int | None) -> Chunk:
        """The next chunk of a compute candidate's pending tokens (at most `budget`)."""
        start = seq.num_computed
        todo = seq.tokens[start:]
        if not seq.ready():
            todo = todo[:-1]  # leave the last token until its mask arrives
        if seq.snapshot_at is not None and start < seq.snapshot_at:
            todo = todo[: seq.snapshot_at - start]  # stop exactly at the shared prefix, to pin a copy
        stop = self.share_stop(seq)
        if stop is not None and not self.cache.exact_split(start + len(todo), stop):
            todo = todo[: stop - start]  # a waiting follower copies this slot at `stop`: don't run past the ring
        if budget is not None:
            todo = todo[:budget]
        snapshot_to = None
        if seq.snapshot_at is not None and start + len(todo) == seq.snapshot_at:
            snapshot_to = self.cache.snapshot_slot(seq.row)
        return Chunk(seq, PromptChunk(seq.row, todo, start, seq.is_output(start, len(todo)), seq.clear_penalties),
                     snapshot_to)

    def _live_slots(self) -> dict[int, LiveSlot]:
        """The running slots as the prefix cache sees them (what each holds, the prompt it computes if any)."""
        return {slot: self._live_slot(seq) for slot, seq in self.running.items()}

    @staticmethod
    def _live_slot(seq: Sequence) -> LiveSlot:
        """One running slot as the prefix cache sees it: its computed tokens, and the prompt it is computing
        itself (none for a follower or a fork, which wait for a copy)."""
        return LiveSlot(seq.tokens[: seq.num_computed],
                        () if seq.leader is not None or seq.fork_of is not None else seq.prompt)

    def _admit(self) -> tuple[list[tuple[int, int]], list[Sequence]]:
        """Place waiting sequences until one finds no slot — in arrival order, or with latency targets or
        priorities waiting, least slack first (`SloAdmission.order`); (copies to run, admitted)."""
        copies: list[tuple[int, int]] = []
        admitted: list[Sequence] = []
        if not self.waiting or not self.cache.has_free():
            return copies, admitted  # nothing to place, or nowhere: skip copying the running histories
        live = self._live_slots()  # once per iteration; an admitted sequence is added below
        if self._targets_waiting() or any(s.priority for s in self.waiting):
            self.waiting = collections.deque(self.slo.order(self.waiting))
        while self.waiting:
            seq = self.waiting[0]
            if not self.slo.admits(list(self.running.values()), seq):
                break  # one more row would slow the running requests past their TPOT target
            reuse = seq.fork_of is None and seq.sampling.repetition_penalty == 1.0
            preempt = time.monotonic() - seq.arrived_at >= self.lease_preempt_after
            placement = self.cache.place(seq.prompt, seq.cache_salt, live, reuse=reuse, session=seq.session,
                                         preempt=preempt)
            if placement is None:
                break
            self.waiting.popleft()
            seq.slot, seq.num_computed, seq.cached_tokens = placement.slot, placement.cached, placement.cached
            seq.leader = self.running[placement.leader] if placement.leader is not None else None
            seq.share, seq.snapshot_at = placement.share, placement.snapshot_at
            self.reused_tokens += placement.cached
            seq.admitted_at = time.monotonic()
            if placement.copy_from is not None:
                copies.append((placement.copy_from, placement.slot))
            self.running[seq.slot] = seq
            live[seq.slot] = self._live_slot(seq)
            admitted.append(seq)
        return copies, admitted

    def admits_nothing(self) -> bool:
        """Whether planning a step now would admit or refuse no waiting sequence: none waits, or every slot holds a
        running sequence (none can be placed until one ends) and none waiting has a TTFT target (which could be
        refused as unreachable). Async scheduling goes ahead only then (`EngineLoop._may_go_ahead`)."""
        return not self.waiting or (not self.cache.has_free() and not self._targets_waiting())

    def _targets_waiting(self) -> bool:
        """Whether a waiting sequence has a TTFT target (its own or the default)."""
        return self.slo.settings.ttft_s is not None or any(s.slo_ttft_s is not None for s in self.waiting)

    def _refuse_unreachable(self) -> list[Emission]:
        """End the sequences whose TTFT target can no longer be met (`SloAdmission.unreachable`): admitted ones
        whose prompt has not started (prompts are computed oldest first, so the pending prompt tokens of older
        ones are ahead of them), then waiting ones least slack first (behind every running prompt and those
        ahead in the queue)."""
        running = list(self.running.values())
        fresh = [s for s in running if not s.output and s.num_computed == s.cached_tokens and s.leader is None
                 and s.fork_of is None and s.num_computed < len(s.prompt)]
        if not any(self.slo.ttft(s) is not None for s in [*fresh, *self.waiting]):
            return []
        now = time.monotonic()
        decoding = [s for s in running if s.num_computed >= len(s.prompt)]
        out: list[Emission] = []
        ahead = 0
        lead: int | None = None  # with nothing decoding: the first prompt's tokens, computed alone
        for seq in sorted((s for s in running if s.num_computed < len(s.prompt)), key=lambda s: s.arrival):
            own = len(seq.prompt) - seq.num_computed
            first = lead if lead is not None or decoding else own
            predicted = self.slo.unreachable(seq, now, ahead, own, decoding, first) if seq in fresh else None
            if predicted is None:
                ahead += own
                lead = first
            else:
                out.append(self._refuse(seq, predicted))
        live = self._live_slots() if self.slo.model.fitted and self.waiting else {}
        for seq in self.slo.order(self.waiting):
            cached = self.cache.best_source(seq.prompt, seq.cache_salt, -1, live)[1] if live else 0
            own = len(seq.prompt) - cached
            first = lead if lead is not None or decoding else own
            predicted = self.slo.unreachable(seq, now, ahead, own, decoding, first)
            if predicted is None:
                ahead += own
                lead = first
            else:
                out.append(self._refuse(seq, predicted))
        return out

    def _refuse(self, seq: Sequence, predicted: float) -> Emission:
        """End a sequence whose TTFT target cannot be met, saying when to retry (the predicted overshoot)."""
        target = self.slo.ttft(seq) or 0.0
        retry = max(1, math.ceil(predicted - target))
        self.slo.refused(seq)
        return self.end(seq, Finish.ABORT, failure=Failure.SLO_UNREACHABLE, error=(
            f"its time-to-first-token target of {target * 1000:.0f} ms cannot be met (predicted "
            f"{predicted * 1000:.0f} ms); retry after {retry} s"))

    def _take_shares(self) -> list[tuple[int, int]]:
        """Copies for the followers whose leader has computed their shared prefix (or is gone): each takes the
        longest exactly reusable prefix there is now (normally `share` tokens of its leader's slot)."""
        copies: list[tuple[int, int]] = []
        live: dict[int, LiveSlot] | None = None
        for seq in self.running.values():
            leader = seq.leader
            if leader is None or (leader.slot is not None and leader.finish == Finish.NONE
                                  and leader.num_computed < seq.share):
                continue
            seq.leader = None
            live = self._live_slots() if live is None else live  # built at most once, and only when needed
            source, usable = self.cache.best_source(seq.prompt, seq.cache_salt, seq.row, live)
            if source is not None and usable:
                copies.append((source, seq.row))
                seq.num_computed = seq.cached_tokens = usable
                live[seq.row] = self._live_slot(seq)
                self.reused_tokens += usable
                self.cache.hits += 1
        return copies

    def share_stop(self, seq: Sequence) -> int | None:
        """The nearest share point of `seq`'s prompt that a waiting follower has not got yet (None: none). A
        chunk must not run more than the rings' slack past it (`PrefixCache.exact_split`) before the copy."""
        points = [f.share for f in self.running.values() if f.leader is seq and f.share > seq.num_computed]
        return min(points, default=None)

    def _waits_for_parent(self, seq: Sequence) -> bool:
        return seq.leader is not None or (seq.fork_of is not None and seq.num_computed == 0)

    def due_forks(self) -> list[tuple[Sequence, Sequence]]:
        """(parent, fork) pairs to copy now: the parent's prompt is computed and it has not advanced further.
        A fork whose parent is gone or already past that point computes its prompt itself."""
        due = []
        for seq in self.running.values():
            if not self._waits_for_parent(seq) or seq.fork_of is None:
                continue
            parent = self.by_id.get(seq.fork_of)
            if parent is None or parent.slot is None or parent.num_computed > len(parent.prompt):
                seq.fork_of = None
            elif parent.num_computed == len(parent.prompt):
                due.append((parent, seq))
        return due

    def apply_forced(self, seq: Sequence) -> list[int]:
        """Append the forced tokens due at the sequence's current step (stopping early if one ends it)."""
        applied = []
        for token in seq.forced.pop(len(seq.output), []):
            applied.append(token)
            if self.append_token(seq, token) != Finish.NONE:
                break
        return applied

    def has_work(self) -> bool:
        """Whether anything is waiting or running."""
        return bool(self.waiting or self.running)

    def add_mask(self, request_id: str, step: int, words: np.ndarray, draft: GrammarDraft | None = None) -> None:
        """Allowed tokens (packed uint32 words) for output token number `step` of a live sequence, with the
        client's draft from that step if any; ignored for an unknown sequence or a step it has passed."""
        seq = self._constrainable(request_id, step)
        if seq is not None:
            seq.masks[step] = words
            if draft is not None:
                seq.grammar_draft = draft

    def add_forced(self, request_id: str, step: int, token_ids: list[int]) -> None:
        """Tokens to append without sampling from output token number `step` on; ignored like `add_mask`."""
        seq = self._constrainable(request_id, step)
        if seq is not None:
            seq.forced[step] = token_ids

    def _constrainable(self, request_id: str, step: int) -> Sequence | None:
        seq = self.by_id.get(request_id)
        return seq if seq is not None and step >= len(seq.output) else None

    def decode_rows(self, seqs: list[Sequence]) -> tuple[list[bool], list[bool]]:
        """For a decode step's rows, once their masks had their time to arrive: (sampled, active) as in
        `StepResult` (a row that ended while the step ran is neither)."""
        live = [s.slot is not None for s in seqs]
        sampled = [live[i] and s.ready() for i, s in enumerate(seqs)]
        forced = [live[i] and not sampled[i] and len(s.output) in s.forced for i, s in enumerate(seqs)]
        return sampled, [a or f for a, f in zip(sampled, forced)]

    def postprocess(self, work: Work, result: StepResult) -> list[Emission]:
        """Commit what the engine did with `work`: computed tokens, pinned snapshots, sampled tokens (a sequence
        may end here, freeing its slot). Returns the events to publish, the chunk's sequence first."""
        emissions: list[Emission] = []
        chunk = work.chunk
        if chunk is not None:
            seq, n = chunk.seq, result.computed
            seq.num_computed += n
            seq.clear_penalties = False
            if seq.snapshot_at is not None and seq.num_computed >= seq.snapshot_at:
                if chunk.snapshot_to is not None and chunk.snapshot_due(n):
                    self.cache.pin(chunk.snapshot_to, seq.prompt[: seq.snapshot_at], seq.cache_salt)
                seq.snapshot_at = None
            if result.compute_sample is not None:
                emissions += self._sampled(seq, result.compute_sample, 0)
        for r, seq in enumerate(work.decode):
            seq.missed = seq.slot is not None and not result.active[r]
            if not result.active[r]:
                continue
            seq.clear_penalties = False
            if result.verify_sample is not None:
                emissions += self._verified(seq, work.drafts[r], result.verify_sample, r, result.sampled[r])
                continue
            seq.num_computed += 1
            if result.sampled[r] and result.decode_sample is not None:
                emissions += self._sampled(seq, result.decode_sample, r)
        return emissions

    def _verified(self, seq: Sequence, draft: list[int], out: VerifyOutput, row: int, sampled: bool) -> list[Emission]:
        """Commit row `row` of a verify step: its pending token and its accepted drafts are computed, and the
        emitted tokens (the accepted drafts and the sample after them) become `seq`'s next tokens until one ends
        it, in one event (`_joined`; the sequence's first token alone, then the rest): a client sees a step's
        tokens together, as it sees a forced run, so it never answers a token the same step already ended the
        sequence after."""
        if not sampled:  # its forced tokens arrived: only the pending token counts
            seq.num_computed += 1
            return []
        emitted = int(out.emitted[row])
        if seq.slot is not None:
            self.drafter.verified(seq.request_id, len(draft), emitted - 1, seq.draft_scope)
        base, first = seq.num_computed, not seq.output
        emissions: list[Emission] = []
        for t in range(emitted):
            seq.num_computed = base + t + 1  # the input at position t (the pending token, then drafts) is in
            emissions += self._sampled(seq, out, row, t)
            if seq.finish != Finish.NONE:
                break
        # (the first token of a sequence is an event of its own: the servicer answers Prefill with it)
        return emissions[:1] + _joined(emissions[1:]) if first else _joined(emissions)

    def _sampled(self, seq: Sequence, out: HostOutput | VerifyOutput, row: int, col: int | None = None
                 ) -> list[Emission]:
        """Record row `row` (position `col` of a verify step's row) of a sample as `seq`'s next token (or end it
        if its mask allowed none)."""
        if seq.slot is None:  # aborted while the step ran
            return []
        at = (row,) if col is None else (row, col)
        if out.mask_empty[at]:
            return [self.end(seq, Finish.ABORT, error="the token mask allows no token", failure=Failure.MASK_EMPTY)]
        token = int(out.tokens[at])
        n = seq.sampling.top_logprobs
        top = (out.top_ids[at][:n].tolist(), out.top_logprobs[at][:n].tolist())
        first = not seq.output
        finish = self.append_token(seq, token)
        now, previous = time.monotonic(), seq.last_token_at
        if previous is None:
            seq.first_token_at = now
        seq.last_token_at = now
        if finish != Finish.NONE:
            self.finish(seq)
        event = TokenEvent([token], [float(out.logprobs[at])], finish, forced=[False], top=[top],
                           cached_tokens=seq.cached_tokens if first else 0, **_prediction_usage(seq))
        return [Emission(seq, event, sampled_at=now, previous_at=previous)]

    def end(self, seq: Sequence, finish: Finish, error: str | None = None,
            failure: Failure = Failure.NONE) -> Emission:
        """End a sequence now (freeing its slot); its last event, carrying `error` and its kind if any."""
        seq.finish = finish
        self.finish(seq)
        return Emission(seq, TokenEvent([], [], finish, error=error, failure=failure, **_prediction_usage(seq)))

    def append_token(self, seq: Sequence, token: int) -> Finish:
        """Record a generated (or forced) token and decide whether the sequence ends here."""
        seq.output.append(token)
        seq.masks.pop(len(seq.output) - 1, None)
        if seq.grammar_draft is not None and seq.grammar_draft.step < len(seq.output):
            seq.grammar_draft = None  # taken by this step, or for a step it has passed
        self.drafter.append(seq.request_id, token)
        if token in seq.stop_ids:
            seq.finish = Finish.STOP
        elif len(seq.output) >= seq.max_tokens or len(seq.prompt) + len(seq.output) >= self.max_model_len:
            seq.finish = Finish.LENGTH
        return seq.finish

    def finish(self, seq: Sequence) -> None:
        """Forget a finished sequence: out of the waiting queue if it never ran, else its slot released (free for
        the next iteration; its KV stays for prefix reuse)."""
        self.by_id.pop(seq.request_id, None)
        drafting = self.drafter.finish(seq.request_id, seq.draft_scope, seq.output)
        if drafting is not None:
            seq.prediction_accepted = min(drafting.prediction_accepted, len(seq.prediction))
        if seq.slot is None and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self.cache.release(seq.slot, seq.tokens[: seq.num_computed], seq.session, seq.lease_ttl)
        seq.slot = None

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a live sequence (waiting or running). Returns it, or None if unknown."""
        seq = self.by_id.get(request_id)
        if seq is None:
            return None
        seq.finish = Finish.ABORT
        self.finish(seq)
        return seq


def _joined(emissions: list[Emission]) -> list[Emission]:
    """One sequence's emissions of one step as one: tokens, logprobs and alternatives in order, the last one's
    ending, error and prediction counts, the first one's cached tokens and previous sampling time."""
    if len(emissions) <= 1:
        return emissions
    first, last = emissions[0], emissions[-1]
    ev = dataclasses.replace(
        last.event, token_ids=[t for e in emissions for t in e.event.token_ids],
        logprobs=[x for e in emissions for x in e.event.logprobs], forced=[f for e in emissions for f in e.event.forced],
        top=[x for e in emissions for x in e.event.top], cached_tokens=first.event.cached_tokens)
    sampled_at = next((e.sampled_at for e in reversed(emissions) if e.sampled_at is not None), None)
    return [Emission(first.seq, ev, sampled_at=sampled_at, previous_at=first.previous_at)]


def _prediction_usage(seq: Sequence) -> dict[str, Any]:
    """The Predicted Outputs counts of a sequence's last event (nothing before it ends, or without a prediction):
    predicted tokens accepted as drafts, and the rest (`TokenEvent` keyword arguments)."""
    if seq.finish == Finish.NONE or not seq.prediction:
        return {}
    return {"accepted_prediction": seq.prediction_accepted,
            "rejected_prediction": len(seq.prediction) - seq.prediction_accepted}
