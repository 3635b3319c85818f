"""The one thread that owns the Engine (and so the KV cache): schedule -> run -> postprocess -> publish, forever.

An iteration is nano-vllm's step: `work = scheduler.schedule()`, `result = self._run_work(work)` (engine calls
only, returning host results), `emissions = scheduler.postprocess(work, result)`, then each emission goes to its
sequence's sink. The scheduler is the one owner of sequence state; this module only reads sequences.

Other threads talk to it only through `submit`, `abort`, `add_mask` and `add_forced`, which put typed commands
(`Submit`, `Abort`, `AddMask`, `AddForced`) in a queue; results leave through each sequence's `sink` callback (called on this thread, must not block). When
there is nothing to do the thread sleeps on the command queue.

Faults. What can be checked before dispatch is checked by the servicer and refuses that one request. An exception
inside an iteration is fatal: the compiled steps donate the KV cache buffers, so after a failed step the cache may
be gone and no later step can be trusted. The loop then ends every sequence it holds with `ENGINE_FAILED`, stops,
and calls `on_fatal` — the worker process turns NOT_SERVING and exits non-zero for its supervisor to restart it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from model_worker.serving import engine_api
from model_worker.serving.drafting import Drafter, DraftState, StepCosts
from model_worker.serving.engine_api import DecodeBatch, VerifyBatch
from model_worker.serving.sampling_settings import MAX_LOGIT_BIAS, SamplingArrays
from model_worker.serving.scheduler import Emission, Scheduler, StepResult, Work
from model_worker.serving.sequence import Failure, Finish, GrammarDraft, SamplingSpec, Sequence, TokenEvent
from model_worker.serving.slo import SloAdmission, SloSettings
from model_worker.serving.step_model import StepShape, StepTimeModel

log = logging.getLogger(__name__)

#: The error every sequence ends with when an engine step fails (the servicer answers it as UNAVAILABLE: a retry
#: after the worker restarts can succeed).
ENGINE_FAILED = "the model worker failed and is restarting"
#: Environment variable naming a `cache_salt` whose requests fail the step that runs them (fault injection for
#: tests of the process supervision; no client sends it by chance).
FAULT_ENV = "GEMMA_SERVE_TEST_FAULT_SALT"
#: `--speculation` values: verify drafts when it pays, whenever there are any, or never.
SPECULATION_MODES = ("auto", "always", "off")
#: Decode steps dispatched ahead in a row (async scheduling) before the scheduler plans a step again: a plan looks
#: for drafts to verify, which a step dispatched ahead cannot (they follow tokens it has not seen).
AHEAD_RUN = 16


#: The settings copied one to one from a sequence's `SamplingSpec` to its row of `SamplingArrays` (same name, one
#: value per row): a new scalar sampling setting is a field of both and needs no code here.
ROW_SETTINGS = tuple(f.name for f in dataclasses.fields(SamplingSpec) if f.name not in ("seed", "bias_ids", "bias_vals"))


def sampling_rows(rows: list[Sequence], vocab: int) -> SamplingArrays:
    """Per-row sampling arrays for a batch (one row per sequence, in order): the `ROW_SETTINGS` as they are, the
    64-bit seed as two uint32 words, the logit bias padded to MAX_LOGIT_BIAS entries, the step's mask."""
    s = SamplingArrays.defaults(len(rows), vocab)
    for r, seq in enumerate(rows):
        sp = seq.sampling
        for name in ROW_SETTINGS:
            getattr(s, name)[r] = getattr(sp, name)
        s.seed[r] = (sp.seed & 0xFFFFFFFF, (sp.seed >> 32) & 0xFFFFFFFF)
        s.step[r] = len(seq.output)
        n = min(len(sp.bias_ids), MAX_LOGIT_BIAS)
        s.bias_ids[r, :n], s.bias_vals[r, :n] = sp.bias_ids[:n], sp.bias_vals[:n]
        mask = seq.masks.get(len(seq.output), seq.allowed)
        if mask is not None:
            s.mask[r], s.mask_on[r] = mask, True
    return s


def verify_sampling(rows: list[Sequence], draft_masks: list[list[np.ndarray]], vocab: int) -> SamplingArrays:
    """`sampling_rows` for a verify step, with a mask per position ([n, T, W]): a row's step mask at position 0,
    then, for a constrained row with drafts, the masks its client sent with them (`Work.draft_masks`); every
    other position repeats the row's one mask."""
    s = sampling_rows(rows, vocab)
    T = 1 + max((len(m) for m in draft_masks), default=0)
    mask, on = np.repeat(s.mask[:, None], T, axis=1), np.repeat(s.mask_on[:, None], T, axis=1)
    for r, masks in enumerate(draft_masks):
        for i, words in enumerate(masks):
            mask[r, i + 1], on[r, i + 1] = words, True
    return dataclasses.replace(s, mask=mask, mask_on=on)


@dataclasses.dataclass
class _Ahead:
    """A decode step dispatched one step ahead (async scheduling), its samples still on the device.

    Attributes:
      work: the step as the scheduler commits it (its rows, in order; no chunk, copies or drafts).
      sampled: the engine's handle of its sample program (`Engine.sample_async`).
      sampling: the settings it was sampled with (the next step ahead moves their `step` on by one).
      run: steps dispatched ahead in a row, this one included.
    """

    work: Work
    sampled: engine_api.Sampled
    sampling: SamplingArrays
    run: int


@dataclasses.dataclass(frozen=True)
class Submit:
    """Inbox command: queue a new sequence, with its drafting state when the worker speculates (built by the
    submitting thread: indexing a long prompt is not the engine thread's work)."""

    seq: Sequence
    drafting: DraftState | None = None


@dataclasses.dataclass(frozen=True)
class Abort:
    """Inbox command: end a live sequence (waiting or running); an unknown id is ignored."""

    request_id: str


@dataclasses.dataclass(frozen=True)
class AddMask:
    """Inbox command: the allowed tokens (packed uint32 words) for output token number `step` of a sequence, and
    the client's draft from that step with its masks, if any."""

    request_id: str
    step: int
    words: np.ndarray
    draft: GrammarDraft | None = None


@dataclasses.dataclass(frozen=True)
class AddForced:
    """Inbox command: tokens to append without sampling from output token number `step` of a sequence on."""

    request_id: str
    step: int
    token_ids: list[int]


@dataclasses.dataclass(frozen=True)
class Wake:
    """Inbox command: nothing to do; wakes a loop sleeping on an empty inbox (to see that it was stopped)."""


Command = Submit | Abort | AddMask | AddForced | Wake
"""What other threads send the loop thread (its only way in besides reading snapshots)."""


@dataclasses.dataclass(frozen=True)
class LoopSnapshot:
    """What the loop's metrics read after an iteration, copied on the engine thread (the metrics never reach
    into the scheduler or the prefix cache).

    Attributes:
      running, waiting: sequences in slots / queued.
      kv_usage: tokens held by running sequences / (slots x max_model_len), in [0, 1].
      cached_slots: slots holding a reusable prefix.
      prefix_queries, prefix_hits: prefix-cache lookups and hits since start.
      steps: engine steps since start by kind ("compute", "decode", "mixed", "copy"), plus "computed_tokens" and
        "prompt_tokens" (tokens run through the model).
      reused_tokens: prompt tokens reused (prefix cache or a slot copy) since start.
      leased_slots: slots leased to a session now; lease_preemptions: leases ended early since start (a request
        waited too long for a slot).
    """

    running: int
    waiting: int
    kv_usage: float
    cached_slots: int
    prefix_queries: int
    prefix_hits: int
    steps: dict
    reused_tokens: int
    leased_slots: int = 0
    lease_preemptions: int = 0


class EngineLoop:
    """Drives an engine (`engine_api.Engine`) with a Scheduler on a background thread."""

    def __init__(self, engine: engine_api.Engine, token_budget: int | None = None, metrics=None,
                 mask_wait: float = 0.2, on_fatal: Callable[[BaseException], None] | None = None,
                 fault_salt: str | None = None, lease_preempt_after: float = 10.0, speculation: str = "auto",
                 draft_wait: float = 0.01, slo: SloSettings | None = None,
                 step_clock: Callable[[], float] = time.perf_counter, async_scheduling: bool = False):
        """Args: engine: a compiled engine (`engine_api.Engine`; the loop becomes its only user); token_budget:
        most prompt tokens computed in an iteration that also decodes running streams (bounds the pause a long new
        prompt causes in them; default: the smallest chunk); a lone prompt uses the largest chunks it fills
        (`engine.Engine.chunk_size`).
        metrics: an optional WorkerMetrics to update; mask_wait: seconds a step waits, after dispatching its
        forward pass, for the token masks of its constrained rows (a row whose mask is later is recomputed at a
        later step). on_fatal: called (on this thread) after a step failed and every sequence was ended;
        fault_salt: a cache_salt whose sequences make the step running them fail (a fault-injection hook for tests
        of the process supervision; None in production); lease_preempt_after: seconds a request waits for a slot
        before it may take the oldest session lease's slot (`prefix_cache.PrefixCache`); speculation: "auto"
        verifies drafts when the engine has verify programs (`engine_api.EngineSizes.max_draft_tokens`) and it pays
        (`drafting.StepCosts`), "always" whenever there are drafts (tests and measurements), "off" never;
        draft_wait: seconds a step may wait, before it is planned, for the mask and draft of a constrained row
        whose client drafts (its round trip: the client advances its grammar along the draft); slo: default
        latency targets and policy (model_worker/serving/slo.py; None: no defaults); step_clock: the clock (seconds)
        step times are measured with, for the speculation policy and the latency model (tests pass a fake engine's
        virtual clock so that a loaded machine's scheduling cannot decide the policy); async_scheduling: dispatch a
        plain decode step's successor from its sampled tokens on the device before they reach the host, so that the
        host's work between steps (reading the tokens, publishing them, the next dispatch) overlaps the device's
        (`_may_go_ahead` says when; the same tokens as without it).

        Raises:
          ValueError: an unknown speculation mode."""
        if speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, not {speculation!r}")
        self.speculation = speculation
        self.engine = engine
        self.on_fatal = on_fatal
        self.fault_salt = fault_salt
        self.failed: BaseException | None = None
        self.mask_wait = mask_wait
        self.draft_wait = draft_wait
        self.step_clock = step_clock
        self.token_budget = token_budget or min(engine.ecfg.prefill_chunks)
        self.metrics = metrics
        self.vocab = engine.cfg.vocab_size
        drafts = engine.ecfg.max_draft_tokens if speculation != "off" else 0
        # A step dispatched ahead for a row that then ended writes one position past the slot's end, as a rejected
        # draft does: a prefix reuse must split one ring entry earlier where verify steps do not already.
        slack = engine.ecfg.reuse_slack - (async_scheduling and engine.ecfg.max_draft_tokens < 1)
        self.async_scheduling = async_scheduling and slack >= 0
        self._ahead: _Ahead | None = None  # the decode step dispatched ahead, not yet on the host
        self.scheduler = Scheduler(engine.ecfg.num_slots, engine.ecfg.max_model_len, slack=max(slack, 0),
                                   max_waiting=engine.ecfg.max_waiting, token_budget=self.token_budget,
                                   lease_preempt_after=lease_preempt_after, max_draft_tokens=drafts,
                                   max_verify_batch=engine.ecfg.max_verify_batch if drafts else 0,
                                   slo=SloAdmission(slo or SloSettings(), StepTimeModel(programs=self.step_programs),
                                                    chunks=tuple(engine.ecfg.prefill_chunks),
                                                    token_budget=self.token_budget))
        self.costs = StepCosts()
        self._inbox: queue.Queue[Command] = queue.Queue()
        self._submitted = 0  # `Submit`s in the inbox, not yet taken in (`load`); changed under `_submitted_lock`
        self._submitted_lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # compute chunks, decode steps, slot copies; "mixed": iterations with both a chunk and a decode step (one
        # pass when the chunk is the smallest, `Engine.dispatch_mixed`), also counted in "compute" and "decode";
        # tokens run through the model, and how many of them were prompt tokens
        # "verify": decode steps that verified drafts (also counted in "decode"); drafted and accepted draft tokens;
        # "ahead": decode steps dispatched before the previous step's tokens reached the host (also in "decode")
        self.steps = {"compute": 0, "decode": 0, "mixed": 0, "copy": 0, "computed_tokens": 0, "prompt_tokens": 0,
                      "verify": 0, "drafted_tokens": 0, "accepted_tokens": 0, "ahead": 0}
        # the state after the latest iteration, read by other threads (the worker's GetLoad RPC)
        self.last = LoopSnapshot(0, 0, 0.0, 0, 0, 0, dict(self.steps), 0)

    def snapshot(self) -> LoopSnapshot:
        """The loop's state for metrics (call on the engine thread, between iterations)."""
        sched, ecfg = self.scheduler, self.engine.ecfg
        held = sum(len(seq.prompt) + len(seq.output) for seq in sched.running.values())
        return LoopSnapshot(len(sched.running), len(sched.waiting), held / (ecfg.num_slots * ecfg.max_model_len),
                            sched.cache.cached_slots(), sched.cache.queries, sched.cache.hits, dict(self.steps),
                            sched.reused_tokens, sched.cache.leased_slots(), sched.cache.preempted)

    def load(self) -> tuple[int, int, float]:
        """(running, waiting, KV usage) now, for any thread (the worker's GetLoad RPC): the two counts are
        lengths of the scheduler's containers plus the submissions not yet taken in (reading a length is atomic
        under the GIL; a loop blocked on masks runs no iteration, so the last snapshot can be stale), the KV
        usage is the latest iteration's."""
        sched = self.scheduler
        return len(sched.running), len(sched.waiting) + self._submitted, self.last.kv_usage

    def headroom(self) -> int:
        """More requests the worker can take within its running requests' TPOT targets (`SloAdmission.headroom`;
        -1: unknown), for any thread: it reads a copy of the running set."""
        sched = self.scheduler
        running = list(sched.running.values())
        free = self.engine.ecfg.num_slots - len(running) - len(sched.waiting)
        return sched.slo.headroom(running, max(free, 0))

    def start(self) -> None:
        """Start the loop thread."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the loop to exit and wait for it."""
        self._stopped.set()
        self._inbox.put(Wake())
        self._thread.join(timeout)

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence (thread-safe). Its events arrive through seq.sink. With speculation its draft indexes
        are built here, on the caller's thread."""
        drafting = Drafter.new_state(seq.tokens, seq.prediction) if self.scheduler.max_draft_tokens > 0 else None
        with self._submitted_lock:
            self._submitted += 1
        self._inbox.put(Submit(seq, drafting))

    def abort(self, request_id: str) -> None:
        """Abort a sequence at the next iteration (thread-safe); unknown ids are ignored."""
        self._inbox.put(Abort(request_id))

    def add_mask(self, request_id: str, step: int, words: np.ndarray, draft: GrammarDraft | None = None) -> None:
        """Allowed tokens (packed uint32 words) for output token number `step` of a sequence, with the client's
        draft from that step if any (thread-safe)."""
        self._inbox.put(AddMask(request_id, step, words, draft))

    def draft_hint(self) -> int:
        """Most draft tokens worth sending with a constrained request's next mask, for any thread: the engine's
        `max_draft_tokens` while the running sequences fit a verify step, else 0 (a hint: lengths read without
        the loop's state, which moves on)."""
        sched = self.scheduler
        return sched.max_draft_tokens if len(sched.running) <= sched.max_verify_batch else 0

    def add_forced(self, request_id: str, step: int, token_ids: list[int]) -> None:
        """Tokens to append without sampling from output token number `step` on (thread-safe)."""
        self._inbox.put(AddForced(request_id, step, token_ids))

    # ----- loop thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            # Idle: store what the background compiled, one program at a time, while nothing waits (serializing
            # holds the GIL, which a step would otherwise wait for).
            while self._idle() and self._inbox.empty() and self.engine.store_deferred():
                pass
            self._drain_inbox(block=self._idle())
            if self._stopped.is_set():
                break
            try:
                self.engine.adopt_programs()  # compiled in the background meanwhile (a worker that serves first)
                self._iterate()
            except Exception as exc:
                log.exception("engine step failed; the worker cannot continue")
                self._fail(exc)
                return

    def _fail(self, exc: BaseException) -> None:
        """End every sequence (running and waiting) with ENGINE_FAILED, stop, and report."""
        self.failed = exc
        self._stopped.set()
        self._drain_inbox(block=False)
        for seq in list(self.scheduler.by_id.values()):
            try:
                ended = self.scheduler.end(seq, Finish.ABORT, error=ENGINE_FAILED, failure=Failure.ENGINE_FAILED)
                self._publish([ended])
            except Exception:
                log.exception("ending %s failed", seq.request_id)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _idle(self) -> bool:
        """Nothing to do: no sequence waiting or running and no step dispatched ahead."""
        return not self.scheduler.has_work() and self._ahead is None

    def _iterate(self) -> None:
        if self._ahead is not None:
            self._iterate_ahead()
            return
        if self.scheduler.max_draft_tokens and self.scheduler.awaiting_drafts():
            self._await_drafts()
        work = self.scheduler.schedule()
        self._publish(work.emissions)
        self._inject_fault([work.compute, *work.decode])
        if self.metrics is not None:
            self._observe_admissions(work.admitted)
        started = self.step_clock()
        result = self._run_work(work)
        if work.decode:  # a chunk alone is not waited for unless sampled: its time lands in a later step
            self._observe_step(work, result, self.step_clock() - started)
        self._commit(work, result)
        if work.compute is None and not work.decode and self.scheduler.has_work():
            time.sleep(0.001)  # everyone waits for a mask or a parent: don't spin

    def _commit(self, work: Work, result: StepResult) -> None:
        """Count an iteration's steps, let the scheduler move its sequences on, publish their events, and take
        the snapshot other threads read."""
        self._count(work, result)
        self._publish(self.scheduler.postprocess(work, result))
        self.last = self.snapshot()  # one reference assignment: readers on other threads see old or new
        if self.metrics is not None:
            self.metrics.observe_iteration(self.last)

    def _inject_fault(self, seqs: list[Sequence | None]) -> None:
        """Fail the step (tests of the process supervision) when one of its sequences carries `fault_salt`.

        Raises:
          RuntimeError: such a sequence is among `seqs` (None entries are skipped)."""
        if self.fault_salt and any(s is not None and s.cache_salt == self.fault_salt for s in seqs):
            raise RuntimeError(f"fault injected by {FAULT_ENV}")

    def _iterate_ahead(self) -> None:
        """An iteration whose decode step was dispatched ahead (`_go_ahead`) during the previous one: maybe dispatch
        its own successor, then read its tokens and commit them as a planned step's. A row that ended meanwhile
        (a stop token, an abort) is neither sampled nor active: its token is dropped, as a row that ends while a
        step runs always is. Its time feeds neither the step-time model nor the speculation costs (it overlapped
        the previous step's host work)."""
        ahead, self._ahead = self._ahead, None
        assert ahead is not None
        work = ahead.work
        self._inject_fault(work.decode)
        sampled, active = self.scheduler.decode_rows(work.decode)
        if self._may_go_ahead(work, sampled, ahead.run):
            self._go_ahead(work.decode, ahead.sampled, ahead.sampling, ahead.run + 1)
        self.steps["ahead"] += 1
        self._commit(work, StepResult(decode_sample=ahead.sampled.result(), sampled=sampled, active=active))

    def _may_go_ahead(self, work: Work, sampled: list[bool], run: int) -> bool:
        """Whether the step after `work`'s plain decode step (dispatched, its tokens not yet read) may be
        dispatched now from its sampled tokens on the device: async scheduling is on, fewer than `AHEAD_RUN`
        steps went ahead in a row, no draft waits to be verified, nothing in the inbox and no waiting sequence a
        planned step would admit or refuse (`Scheduler.admits_nothing`: the scheduler plans the step that admits
        it), every running sequence is one of the step's rows, each sampled,
        unconstrained with no mask or forced tokens sent for it (a mask follows the token it has not seen), and none
        ends for its length with this token."""
        if not self.async_scheduling or run >= AHEAD_RUN or not all(sampled) or any(work.drafts):
            return False
        sched = self.scheduler
        if not sched.admits_nothing() or not self._inbox.empty() or len(sched.running) != len(work.decode):
            return False
        return all(s.slot is not None and s.finish == Finish.NONE and not s.constrained and not s.forced
                   and not s.masks and len(s.output) + 1 < s.max_tokens
                   and len(s.prompt) + len(s.output) + 1 < sched.max_model_len for s in work.decode)

    def _go_ahead(self, seqs: list[Sequence], previous: engine_api.Sampled, sampling: SamplingArrays,
                  run: int) -> None:
        """Dispatch the decode step after `previous` (a plain decode step of `seqs`, sampled with `sampling`): each
        row's next position, its input token read from `previous` on the device, sampled with the next step's
        settings and nothing cleared (the step before cleared what it had to). Nothing happens when the engine
        cannot (`Engine.dispatch_decode_after`); the next iteration then plans as usual."""
        n = len(seqs)
        batch = DecodeBatch([s.row for s in seqs], [0] * n, [s.num_computed + 1 for s in seqs], [True] * n)
        pending = self.engine.dispatch_decode_after(batch=batch, previous=previous)
        if pending is None:
            return
        following = dataclasses.replace(sampling, step=sampling.step + 1)
        handle = self.engine.sample_async(pending, sampling=following, clear_penalties=[False] * n,
                                          active=[True] * n)
        self._ahead = _Ahead(Work(copies=[], decode=list(seqs)), handle, following, run)

    def seed_step_model(self, timed: list[tuple[engine_api.ProgramKey, float]]) -> None:
        """Give the step-time model its first fit from timed programs (`engine.Engine.time_programs`); call
        before `start`."""
        self.scheduler.slo.model.seed(timed)

    def step_programs(self, shape: StepShape) -> tuple[engine_api.ProgramKey, ...]:
        """The forward programs the engine runs for a step of this shape (the step-time model's features)."""
        return self.engine.step_programs(shape=shape)

    @staticmethod
    def step_shape(work: Work, result: StepResult) -> StepShape:
        """What an iteration's step computed (before `postprocess` moves its sequences on)."""
        verified = result.verify_sample is not None
        chunk = result.computed if work.chunk is not None else 0
        return StepShape(rows=len(work.decode), kv_tokens=sum(s.num_computed for s in work.decode),
                         chunk_tokens=chunk, draft_tokens=sum(len(d) for d in work.drafts) if verified else 0,
                         longest=max((s.num_computed + 1 for s in work.decode), default=0),
                         chunk_end=work.chunk.rows.start + chunk if work.chunk is not None else 0)

    def _observe_step(self, work: Work, result: StepResult, seconds: float) -> None:
        """Feed one measured step to the scheduler's step-time model (model_worker/serving/step_model.py), before
        `postprocess` moves the sequences on, and its prediction error to the metrics."""
        error = self.scheduler.slo.model.observe(self.step_shape(work, result), seconds)
        if self.metrics is not None and error is not None:
            self.metrics.step_prediction_error.observe(error)

    def _observe_admissions(self, admitted: list[Sequence]) -> None:
        """Queue-time and prompt-size metrics of the sequences admitted this iteration."""
        for seq in admitted:
            self.metrics.queue.observe((seq.admitted_at or seq.arrived_at) - seq.arrived_at)
            self.metrics.prompt_tokens.inc(len(seq.prompt))

    def _observe_token(self, emission: Emission, now: float) -> None:
        """Latency metrics for the tokens of an emission sampled at `now` (first: TTFT; later: inter-token, 0 for
        the tokens after the first of a verify step, which arrive with it; last: end to end)."""
        m, seq = self.metrics, emission.seq
        n = len(emission.event.token_ids)
        slo = self.scheduler.slo
        if emission.previous_at is None:
            m.ttft.observe(now - seq.arrived_at)
            m.prefill.observe(now - (seq.admitted_at or seq.arrived_at))
            if (target := slo.ttft(seq)) is not None:
                m.slo_attainment.labels("ttft", str(now - seq.arrived_at <= target).lower()).inc()
        else:
            m.itl.observe(now - emission.previous_at)
        for _ in range(n - 1):
            m.itl.observe(0.0)
        m.generation_tokens.inc(max(n, 1))
        if emission.event.finish != Finish.NONE:
            m.e2e.observe(now - seq.arrived_at)
            out = len(seq.output)
            if (target := slo.tpot(seq)) is not None and out > 1 and seq.first_token_at is not None:
                met = (now - seq.first_token_at) / (out - 1) <= target
                m.slo_attainment.labels("tpot", str(met).lower()).inc()
            m.decode.observe(now - (seq.first_token_at if seq.first_token_at is not None else now))

    def _publish(self, emissions: list[Emission]) -> None:
        """Hand each event to its sequence's sink (metrics first for sampled tokens)."""
        for emission in emissions:
            if self.metrics is not None and emission.sampled_at is not None:
                self._observe_token(emission, emission.sampled_at)
            if self.metrics is not None and emission.event.failure == Failure.SLO_UNREACHABLE:
                self.metrics.slo_refusals.labels("ttft_unreachable").inc()
            emission.seq.sink(emission.event)

    def _drain_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: Command) -> None:
        """Apply one inbox command (on the loop thread)."""
        match cmd:
            case Submit(seq, drafting):
                with self._submitted_lock:
                    self._submitted -= 1
                self._add(seq, drafting)
            case Abort(request_id):
                aborted = self.scheduler.abort(request_id)
                if aborted is not None:
                    aborted.sink(TokenEvent([], [], Finish.ABORT))
            case AddMask(request_id, step, words, draft):
                self.scheduler.add_mask(request_id, step, words, draft)
            case AddForced(request_id, step, token_ids):
                self.scheduler.add_forced(request_id, step, token_ids)
            case Wake():
                pass

    def _add(self, seq: Sequence, drafting: DraftState | None = None) -> None:
        """Queue a submitted sequence, or end it at once: a duplicate live id, or a full waiting queue."""
        try:
            self.scheduler.add(seq, drafting)
        except KeyError:
            seq.sink(TokenEvent([], [], Finish.ABORT, error=f"request id {seq.request_id!r} is already live",
                                failure=Failure.DUPLICATE_ID))
        except OverflowError as err:
            if self.metrics is not None:
                self.metrics.rejected.inc()
            seq.sink(TokenEvent([], [], Finish.ABORT, error=f"queue full: {err}", failure=Failure.QUEUE_FULL))

    def _run_work(self, work: Work) -> StepResult:
        """Run an iteration's work on the engine: its slot copies, then the chunk and the decode step (one mixed
        pass when both), the chunk's snapshot copy, and their sampling. Only engine calls (and, while the forward
        pass runs, the wait for late masks, whose commands go to the scheduler as always); it changes no sequence
        itself and returns what the engine produced."""
        result = StepResult()
        for src, dst in work.copies:
            self.engine.copy_slot(src=src, dst=dst)
        chunk, decode = work.chunk, work.decode
        verify = bool(decode) and self._worth_verifying(work)
        batch = DecodeBatch([s.row for s in decode], [s.tokens[-1] for s in decode], [s.num_computed for s in decode],
                            [s.num_computed >= len(s.prompt) for s in decode])
        computing, decoding = None, None
        if chunk is not None:
            if decode and not verify:  # one mixed pass: a budget-sized chunk + the decode rows
                pending, result.computed, decoding = self.engine.dispatch_mixed(chunk=chunk.rows, batch=batch)
            else:
                pending, result.computed = self.engine.dispatch_compute(chunk=chunk.rows)
            computing = pending
            if chunk.snapshot_to is not None and chunk.snapshot_due(result.computed):  # pin the shared prefix
                self.engine.copy_slot(src=chunk.rows.slot, dst=chunk.snapshot_to)
        elif decode and not verify:
            started = self.step_clock()
            decoding = self.engine.dispatch_decode(batch=batch)
        if verify:
            if chunk is not None and computing is not None:
                result.compute_sample = self._sample_chunk(chunk.seq, computing, result.computed)
            return self._run_verify(work, result, timed=chunk is None)
        if decoding is not None:
            self._await_constraints(decode)
        if chunk is not None and computing is not None:
            result.compute_sample = self._sample_chunk(chunk.seq, computing, result.computed)
        if decoding is not None:
            result.decode_sample, result.sampled, result.active = self._sample_decode(
                decode, decoding, ahead_of=work if chunk is None else None)
            if chunk is None:
                self.costs.observe("decode", len(decode), self.step_clock() - started)
        return result

    def _worth_verifying(self, work: Work) -> bool:
        """Whether this decode step verifies the scheduler's drafts: some row has one, and the expected tokens
        per second beat a plain step's (`drafting.StepCosts`, from each row's acceptance so far), or a row's draft
        is due for a probe (`drafting.Acceptance.probe_due`). Drafts not verified are noted as passed over."""
        drafted = [(s.request_id, len(d)) for s, d in zip(work.decode, work.drafts) if d]
        if not drafted:
            return False
        if not self.engine.can_verify(rows=len(work.decode)):  # its programs still compiling
            for r, _ in drafted:
                self.scheduler.drafter.passed_over(r)
            return False
        if self.speculation == "always":
            return True
        drafter = self.scheduler.drafter
        expected = len(work.decode) - len(drafted) + sum(drafter.expected_tokens(r, k) for r, k in drafted)
        if any(drafter.probe_due(r) for r, _ in drafted) or self.costs.worth_verifying(
                len(work.decode), len(work.decode), expected, beside_chunk=work.chunk is not None):
            return True
        for r, _ in drafted:
            drafter.passed_over(r)
        return False

    def _run_verify(self, work: Work, result: StepResult, timed: bool = True) -> StepResult:
        """A decode step that verifies drafts (`Engine.dispatch_verify`, `Engine.sample_verify`); its cost goes to
        `self.costs` when `timed` (not after a chunk dispatched in the same iteration, whose time it would hold)."""
        decode = work.decode
        started = self.step_clock()
        pending = self.engine.dispatch_verify(batch=VerifyBatch(
            [s.row for s in decode], [[s.tokens[-1], *d] for s, d in zip(decode, work.drafts)],
            [s.num_computed for s in decode], [s.num_computed >= len(s.prompt) for s in decode]))
        self._await_constraints(decode)
        result.sampled, result.active = self.scheduler.decode_rows(decode)
        result.verify_sample = self.engine.sample_verify(
            pending, sampling=verify_sampling(decode, work.draft_masks, self.vocab),
            clear_penalties=[s.clear_penalties for s in decode], active=result.active)
        if timed:
            self.costs.observe("verify", len(decode), self.step_clock() - started)
        return result

    def _sample_chunk(self, seq: Sequence, pending: engine_api.Pending, n: int) -> engine_api.HostOutput | None:
        """The sequence's next token, sampled when the chunk's `n` tokens were all its pending ones (else None:
        more of the prompt follows)."""
        if seq.slot is None or n != seq.pending:
            return None
        return self.engine.sample(pending, sampling=sampling_rows([seq], self.vocab), clear_penalties=[False],
                                  active=[True])

    def _sample_decode(self, seqs: list[Sequence], pending: engine_api.Pending, ahead_of: Work | None = None
                       ) -> tuple[engine_api.HostOutput, list[bool], list[bool]]:
        """Sample the decode step: (samples, sampled, active) as in `StepResult`. A row whose mask has not arrived
        is inactive: the engine keeps its penalty history and the scheduler drops its result; a row whose forced
        tokens arrived is active but not sampled (its KV stands, the forced tokens follow). `ahead_of`: the plain
        decode step's work, whose successor may be dispatched before these samples are read (`_may_go_ahead`)."""
        sampled, active = self.scheduler.decode_rows(seqs)
        sampling = sampling_rows(seqs, self.vocab)
        clear = [s.clear_penalties for s in seqs]
        if ahead_of is None or not self._may_go_ahead(ahead_of, sampled, 0):
            return self.engine.sample(pending, sampling=sampling, clear_penalties=clear, active=active), sampled, active
        handle = self.engine.sample_async(pending, sampling=sampling, clear_penalties=clear, active=active)
        self._go_ahead(seqs, handle, sampling, 1)
        return handle.result(), sampled, active

    def _count(self, work: Work, result: StepResult) -> None:
        """Add an iteration's engine steps and tokens to `self.steps` (before `postprocess` moves the sequences
        on: prompt tokens are told from the positions the step computed)."""
        self.steps["copy"] += len(work.copies)
        if work.chunk is not None:
            n = result.computed
            self.steps["compute"] += 1
            self.steps["computed_tokens"] += n
            self.steps["prompt_tokens"] += max(0, min(n, len(work.chunk.seq.prompt) - work.chunk.rows.start))
            self.steps["copy"] += work.chunk.snapshot_due(n)
            self.steps["mixed"] += bool(work.decode)
        if result.decode_sample is not None or result.verify_sample is not None:
            self.steps["decode"] += 1
            self.steps["computed_tokens"] += sum(result.active)
            self.steps["prompt_tokens"] += sum(active and seq.num_computed < len(seq.prompt)
                                               for seq, active in zip(work.decode, result.active))
        if result.verify_sample is not None:
            self.steps["verify"] += 1
            for r, draft in enumerate(work.drafts):
                if not (draft and result.sampled[r]):
                    continue
                accepted = int(result.verify_sample.emitted[r]) - 1
                self.steps["drafted_tokens"] += len(draft)
                self.steps["accepted_tokens"] += accepted
                self.steps["computed_tokens"] += accepted
                if self.metrics is not None:
                    self.metrics.accepted_length.observe(accepted)

    def _await_drafts(self) -> None:
        """Before planning a step: wait (up to draft_wait) for the masks and drafts of constrained sequences whose
        client drafts (`Scheduler.awaiting_drafts`) while the running sequences fit a verify step: their draft can
        be verified only if it is here before the step is planned."""
        if len(self.scheduler.running) <= self.scheduler.max_verify_batch:
            self._handle_until(self.scheduler.awaiting_drafts, self.draft_wait)

    def _await_constraints(self, seqs: list[Sequence]) -> None:
        """While the forward pass runs, wait (up to mask_wait) for the masks or forced runs of constrained rows."""
        self._handle_until(lambda: any(s.slot is not None and not s.has_constraint() for s in seqs), self.mask_wait)

    def _handle_until(self, waiting: Callable[[], bool], timeout: float) -> None:
        """Apply inbox commands as they come while `waiting()` holds, for at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while waiting():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                self._handle(self._inbox.get(timeout=remaining))
            except queue.Empty:
                return


def wait_idle(loop: EngineLoop, timeout: float = 10.0) -> bool:
    """Wait until the loop has no waiting or running sequences (a drain, and tests); returns whether it did
    within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not loop.scheduler.has_work() and loop._inbox.empty():
            return True
        time.sleep(0.01)
    return False
