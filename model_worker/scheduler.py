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
import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from model_worker.prefix_cache import LiveSlot, PrefixCache

if TYPE_CHECKING:
    from model_worker.engine import HostOutput


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
      session, lease_ttl: the session this request belongs to ("" for none) and how long its slot's KV stays
        leased to it after the request ends (seconds; 0: no lease, and a lease the session held ends).
      leader: the running sequence computing a prompt that shares `share` tokens with this one: this sequence
        waits (computing nothing) until the leader has computed them, then copies its slot; None otherwise.
      share: prompt tokens to take from the leader's slot.
      first_token_at: time.monotonic() of the first generated token (prefill / decode time metrics).
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
    session: str = ""
    lease_ttl: float = 0.0
    leader: Sequence | None = dataclasses.field(default=None, repr=False, compare=False)
    share: int = 0
    first_token_at: float | None = None

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
    """The compute part of an iteration: tokens of one sequence to run into its slot (`engine_api.Engine.
    dispatch_compute`'s arguments, in its order, then what to do after).

    Attributes:
      slot, tokens, start, is_output, clear_penalties: `dispatch_compute`'s five arguments, in order (the engine
        consumes the first n >= 1 tokens; clear_penalties is the sequence's flag when the chunk was planned).
      snapshot_to: when the engine consumes every token, the chunk ends exactly at the sequence's shared prefix:
        copy `slot` over this slot, which the scheduler then pins as a snapshot of that prefix; None otherwise.
    """

    slot: int
    tokens: list[int]
    start: int
    is_output: list[bool]
    clear_penalties: bool
    snapshot_to: int | None = None


@dataclasses.dataclass
class Work:
    """One engine iteration: slot copies (prefix reuse, forks) first, an optional compute chunk, then the
    sequences to decode.

    Attributes:
      copies: (source slot, destination slot) copies to run before anything else, in order.
      compute: the sequence a chunk is computed for, or None.
      chunk: that chunk (budget-sized when `decode` is not empty), or None.
      decode: the sequences that decode one token each, by slot.
      admitted: sequences admitted into a slot by this `schedule()` call, in admission order.
      emissions: events made while scheduling (forced tokens appended, sequences they ended), to publish before
        the step runs.
    """

    copies: list[tuple[int, int]]
    compute: Sequence | None
    decode: list[Sequence]
    chunk: Chunk | None = None
    admitted: list[Sequence] = dataclasses.field(default_factory=list)
    emissions: list[Emission] = dataclasses.field(default_factory=list)


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
    """

    computed: int = 0
    compute_sample: HostOutput | None = None
    decode_sample: HostOutput | None = None
    sampled: list[bool] = dataclasses.field(default_factory=list)
    active: list[bool] = dataclasses.field(default_factory=list)


class Scheduler:
    """Owns the waiting queue, the running set and every change to a sequence; slots and their contents belong to
    `self.cache`."""

    def __init__(self, num_slots: int, max_model_len: int, slack: int = 0, max_waiting: int | None = None,
                 token_budget: int | None = None, lease_preempt_after: float = 10.0):
        """Args: num_slots: cache rows; max_model_len: context limit used to finish sequences with LENGTH;
        slack: sliding-ring positions beyond the window (prefix reuse tolerance, see PrefixCache);
        max_waiting: bound of the waiting queue (None: unbounded); token_budget: most chunk tokens in an
        iteration that also decodes (None: no bound; a chunk alone is never bounded); lease_preempt_after:
        seconds a request waits for a slot before it may take the oldest session lease's slot."""
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

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence.

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
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> Work:
        """Append the forced tokens that are due, admit waiting sequences (reusing cached prefixes), copy due forks
        and shared prefixes, then pick this iteration's work and plan its chunk."""
        emissions = [e for seq in list(self.running.values()) if (e := self._force(seq)) is not None]
        copies, admitted = self._admit()
        for parent, fork in self.due_forks():
            copies.append((parent.slot, fork.slot))
            fork.num_computed, fork.clear_penalties = len(fork.prompt) - 1, False
        copies += self._take_shares()
        live = [s for s in self.running.values() if s.finish == Finish.NONE and not self._waits_for_parent(s)]
        compute = min((s for s in live if s.pending >= 2), key=lambda s: s.arrival, default=None)
        # A constrained sequence joins the decode step before its mask arrives (the mask is needed only at
        # sampling, after the forward pass), unless its mask came too late last time.
        decode = sorted((s for s in live if s.pending == 1 and (s.ready() or not s.missed)), key=lambda s: s.slot)
        chunk = None
        if compute is not None:
            chunk = self._plan_chunk(compute, self.token_budget if decode else None)
        return Work(copies=copies, compute=compute, decode=decode, chunk=chunk, admitted=admitted,
                    emissions=emissions)

    def _force(self, seq: Sequence) -> Emission | None:
        """Append the forced tokens due at `seq`'s current step; their event (None: none were due)."""
        applied = self.apply_forced(seq)
        if not applied:
            return None
        if seq.finish != Finish.NONE:
            self.finish(seq)
        return Emission(seq, TokenEvent(applied, [0.0] * len(applied), seq.finish, forced=[True] * len(applied),
                                        top=[([], [])] * len(applied)))

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
            snapshot_to = self.cache.snapshot_slot(seq.slot)
        return Chunk(seq.slot, todo, start, seq.is_output(start, len(todo)), seq.clear_penalties, snapshot_to)

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
        """Place waiting sequences in arrival order until one finds no slot; (copies to run, admitted)."""
        copies, admitted = [], []
        if not self.waiting or not self.cache.has_free():
            return copies, admitted  # nothing to place, or nowhere: skip copying the running histories
        live = self._live_slots()  # once per iteration; an admitted sequence is added below
        while self.waiting:
            seq = self.waiting[0]
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

    def _take_shares(self) -> list[tuple[int, int]]:
        """Copies for the followers whose leader has computed their shared prefix (or is gone): each takes the
        longest exactly reusable prefix there is now (normally `share` tokens of its leader's slot)."""
        copies, live = [], None
        for seq in self.running.values():
            leader = seq.leader
            if leader is None or (leader.slot is not None and leader.finish == Finish.NONE
                                  and leader.num_computed < seq.share):
                continue
            seq.leader = None
            live = self._live_slots() if live is None else live  # built at most once, and only when needed
            source, usable = self.cache.best_source(seq.prompt, seq.cache_salt, seq.slot, live)
            if usable:
                copies.append((source, seq.slot))
                seq.num_computed = seq.cached_tokens = usable
                live[seq.slot] = self._live_slot(seq)
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
            if not self._waits_for_parent(seq):
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

    def add_mask(self, request_id: str, step: int, words: np.ndarray) -> None:
        """Allowed tokens (packed uint32 words) for output token number `step` of a live sequence; ignored for an
        unknown sequence or a step it has passed."""
        seq = self._constrainable(request_id, step)
        if seq is not None:
            seq.masks[step] = words

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
        emissions = []
        seq = work.compute
        if seq is not None:
            chunk, n = work.chunk, result.computed
            seq.num_computed += n
            seq.clear_penalties = False
            if seq.snapshot_at is not None and seq.num_computed >= seq.snapshot_at:
                if chunk.snapshot_to is not None and n == len(chunk.tokens):
                    self.cache.pin(chunk.snapshot_to, seq.prompt[: seq.snapshot_at], seq.cache_salt)
                seq.snapshot_at = None
            if result.compute_sample is not None:
                emissions += self._sampled(seq, result.compute_sample, 0)
        for r, seq in enumerate(work.decode):
            seq.missed = seq.slot is not None and not result.active[r]
            if not result.active[r]:
                continue
            seq.num_computed += 1
            seq.clear_penalties = False
            if result.sampled[r]:
                emissions += self._sampled(seq, result.decode_sample, r)
        return emissions

    def _sampled(self, seq: Sequence, out: HostOutput, row: int) -> list[Emission]:
        """Record row `row` of a sample as `seq`'s next token (or end it if its mask allowed none)."""
        if seq.slot is None:  # aborted while the step ran
            return []
        if out.mask_empty[row]:
            return [self.end(seq, Finish.ABORT, error="the token mask allows no token", failure=Failure.MASK_EMPTY)]
        token = int(out.tokens[row])
        n = seq.sampling.top_logprobs
        top = (out.top_ids[row, :n].tolist(), out.top_logprobs[row, :n].tolist())
        first = not seq.output
        finish = self.append_token(seq, token)
        now, previous = time.monotonic(), seq.last_token_at
        if previous is None:
            seq.first_token_at = now
        seq.last_token_at = now
        if finish != Finish.NONE:
            self.finish(seq)
        event = TokenEvent([token], [float(out.logprobs[row])], finish, forced=[False], top=[top],
                           cached_tokens=seq.cached_tokens if first else 0)
        return [Emission(seq, event, sampled_at=now, previous_at=previous)]

    def end(self, seq: Sequence, finish: Finish, error: str | None = None,
            failure: Failure = Failure.NONE) -> Emission:
        """End a sequence now (freeing its slot); its last event, carrying `error` and its kind if any."""
        seq.finish = finish
        self.finish(seq)
        return Emission(seq, TokenEvent([], [], finish, error=error, failure=failure))

    def append_token(self, seq: Sequence, token: int) -> Finish:
        """Record a generated (or forced) token and decide whether the sequence ends here."""
        seq.output.append(token)
        seq.masks.pop(len(seq.output) - 1, None)
        if token in seq.stop_ids:
            seq.finish = Finish.STOP
        elif len(seq.output) >= seq.max_tokens or len(seq.prompt) + len(seq.output) >= self.max_model_len:
            seq.finish = Finish.LENGTH
        return seq.finish

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence's slot (free for the next iteration; its KV stays for prefix reuse)."""
        self.by_id.pop(seq.request_id, None)
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self.cache.release(seq.slot, seq.tokens[: seq.num_computed], seq.session, seq.lease_ttl)
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
