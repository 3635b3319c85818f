"""The one thread that owns the Engine (and so the KV cache): schedule -> run -> publish, forever.

Other threads talk to it only through `submit`, `abort`, `add_mask` and `add_forced`, which put commands in a
queue; results leave through each sequence's `sink` callback (called on this thread, must not block). When
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

from model_worker import engine_api
from model_worker.engine import HostOutput
from model_worker.sampling import MAX_LOGIT_BIAS, SamplingArrays
from model_worker.scheduler import Failure, Finish, Scheduler, Sequence, TokenEvent

log = logging.getLogger(__name__)

#: The error every sequence ends with when an engine step fails (the servicer answers it as UNAVAILABLE: a retry
#: after the worker restarts can succeed).
ENGINE_FAILED = "the model worker failed and is restarting"
#: Environment variable naming a `cache_salt` whose requests fail the step that runs them (fault injection for
#: tests of the process supervision; no client sends it by chance).
FAULT_ENV = "GEMMA_SERVE_TEST_FAULT_SALT"


def sampling_rows(rows: list[Sequence], vocab: int) -> SamplingArrays:
    """Per-row sampling arrays for a batch (one row per sequence, in order)."""
    s = SamplingArrays.defaults(len(rows), vocab)
    for r, seq in enumerate(rows):
        sp = seq.sampling
        s.temperature[r], s.top_k[r], s.top_p[r], s.min_p[r] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
        s.seed[r] = (sp.seed & 0xFFFFFFFF, (sp.seed >> 32) & 0xFFFFFFFF)
        s.step[r] = len(seq.output)
        s.presence_penalty[r], s.frequency_penalty[r] = sp.presence_penalty, sp.frequency_penalty
        s.repetition_penalty[r] = sp.repetition_penalty
        n = min(len(sp.bias_ids), MAX_LOGIT_BIAS)
        s.bias_ids[r, :n], s.bias_vals[r, :n] = sp.bias_ids[:n], sp.bias_vals[:n]
        s.top_logprobs[r] = sp.top_logprobs
        mask = seq.masks.get(len(seq.output), seq.allowed)
        if mask is not None:
            s.mask[r], s.mask_on[r] = mask, True
    return s


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
    """

    running: int
    waiting: int
    kv_usage: float
    cached_slots: int
    prefix_queries: int
    prefix_hits: int
    steps: dict
    reused_tokens: int


class EngineLoop:
    """Drives an engine (`engine_api.Engine`) with a Scheduler on a background thread."""

    def __init__(self, engine: engine_api.Engine, token_budget: int | None = None, metrics=None,
                 mask_wait: float = 0.2, on_fatal: Callable[[BaseException], None] | None = None,
                 fault_salt: str | None = None):
        """Args: engine: a compiled engine (`engine_api.Engine`; the loop becomes its only user); token_budget:
        most prompt tokens computed in an iteration that also decodes running streams (bounds the pause a long new
        prompt causes in them; default: the smallest chunk); a lone prompt uses the largest chunks it fills
        (`engine.Engine.chunk_size`).
        metrics: an optional WorkerMetrics to update; mask_wait: seconds a step waits, after dispatching its
        forward pass, for the token masks of its constrained rows (a row whose mask is later is recomputed at a
        later step). on_fatal: called (on this thread) after a step failed and every sequence was ended;
        fault_salt: a cache_salt whose sequences make the step running them fail (a fault-injection hook for tests
        of the process supervision; None in production)."""
        self.engine = engine
        self.on_fatal = on_fatal
        self.fault_salt = fault_salt
        self.failed: BaseException | None = None
        self.mask_wait = mask_wait
        self.token_budget = token_budget or min(engine.ecfg.prefill_chunks)
        self.metrics = metrics
        self.vocab = engine.cfg.vocab_size
        self.scheduler = Scheduler(engine.ecfg.num_slots, engine.ecfg.max_model_len, slack=engine.ecfg.prefix_slack,
                                   max_waiting=engine.ecfg.max_waiting)
        self._inbox: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # compute chunks, decode steps, slot copies; "mixed": iterations with both a chunk and a decode step (one
        # pass when the chunk is the smallest, `Engine.dispatch_mixed`), also counted in "compute" and "decode";
        # tokens run through the model, and how many of them were prompt tokens
        self.steps = {"compute": 0, "decode": 0, "mixed": 0, "copy": 0, "computed_tokens": 0, "prompt_tokens": 0}

    def snapshot(self) -> LoopSnapshot:
        """The loop's state for metrics (call on the engine thread, between iterations)."""
        sched, ecfg = self.scheduler, self.engine.ecfg
        held = sum(len(seq.prompt) + len(seq.output) for seq in sched.running.values())
        return LoopSnapshot(len(sched.running), len(sched.waiting), held / (ecfg.num_slots * ecfg.max_model_len),
                            sched.cache.cached_slots(), sched.cache.queries, sched.cache.hits, dict(self.steps),
                            sched.reused_tokens)

    def start(self) -> None:
        """Start the loop thread."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the loop to exit and wait for it."""
        self._stopped.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence (thread-safe). Its events arrive through seq.sink."""
        self._inbox.put(("add", seq))

    def abort(self, request_id: str) -> None:
        """Abort a sequence at the next iteration (thread-safe); unknown ids are ignored."""
        self._inbox.put(("abort", request_id))

    def add_mask(self, request_id: str, step: int, words: np.ndarray) -> None:
        """Allowed tokens (packed uint32 words) for output token number `step` of a sequence (thread-safe)."""
        self._inbox.put(("mask", (request_id, step, words)))

    def add_forced(self, request_id: str, step: int, token_ids: list[int]) -> None:
        """Tokens to append without sampling from output token number `step` on (thread-safe)."""
        self._inbox.put(("forced", (request_id, step, token_ids)))

    # ----- loop thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain_inbox(block=not self.scheduler.has_work())
            if self._stopped.is_set():
                break
            try:
                self._iterate()
            except Exception as exc:  # noqa: BLE001 - fatal: see the module docstring
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
                self._end(seq, Finish.ABORT, error=ENGINE_FAILED, failure=Failure.ENGINE_FAILED)
            except Exception:  # noqa: BLE001 - a broken sink must not keep the others from ending
                log.exception("ending %s failed", seq.request_id)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _iterate(self) -> None:
        for seq in list(self.scheduler.running.values()):
            self._apply_forced(seq)
        work = self.scheduler.schedule()
        if self.fault_salt and any(s.cache_salt == self.fault_salt for s in [work.compute, *work.decode] if s):
            raise RuntimeError(f"fault injected by {FAULT_ENV}")
        if self.metrics is not None:
            self._observe_admissions()
        for src, dst in work.copies:
            self.engine.copy_slot(src, dst)
            self.steps["copy"] += 1
        computing = decoding = None
        decode_args = ([s.slot for s in work.decode], [s.tokens[-1] for s in work.decode],
                       [s.num_computed for s in work.decode], [s.num_computed >= len(s.prompt) for s in work.decode])
        if work.compute is not None and work.decode:  # one mixed pass: a budget-sized chunk + the decode rows
            pending, n, decoding = self._dispatch_compute(work.compute, self.token_budget, decode_args)
            computing = (pending, n)
            self.steps["mixed"] += 1
        elif work.compute is not None:
            computing = self._dispatch_compute(work.compute)
        elif work.decode:
            decoding = self.engine.dispatch_decode(*decode_args)
        if decoding is not None:
            self._await_constraints(work.decode)
        if computing is not None:
            self._finish_compute(work.compute, *computing)
        if decoding is not None:
            self._finish_decode(work.decode, decoding)
        if self.metrics is not None:
            self.metrics.observe_iteration(self.snapshot())
        if work.compute is None and not work.decode and self.scheduler.has_work():
            time.sleep(0.001)  # everyone waits for a mask or a parent: don't spin

    def _observe_admissions(self) -> None:
        for seq in self.scheduler.running.values():
            if seq.admitted_at is not None and not getattr(seq, "_queue_observed", False):
                self.metrics.queue.observe(seq.admitted_at - seq.arrived_at)
                self.metrics.prompt_tokens.inc(len(seq.prompt))
                seq._queue_observed = True

    def _observe_token(self, seq: Sequence) -> None:
        """Latency metrics for a sampled token (first: TTFT; later: inter-token; last: end to end)."""
        now = time.monotonic()
        m = self.metrics
        if seq.last_token_at is None:
            m.ttft.observe(now - seq.arrived_at)
            m.prefill.observe(now - (seq.admitted_at or seq.arrived_at))
            seq.first_token_at = now
        else:
            m.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        m.generation_tokens.inc()
        if seq.finish != Finish.NONE:
            m.e2e.observe(now - seq.arrived_at)
            m.decode.observe(now - seq.first_token_at)

    def _drain_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":
            try:
                self.scheduler.add(arg)
            except KeyError:
                arg.sink(TokenEvent([], [], Finish.ABORT, error=f"request id {arg.request_id!r} is already live",
                                    failure=Failure.DUPLICATE_ID))
            except OverflowError as err:
                if self.metrics is not None:
                    self.metrics.rejected.inc()
                arg.sink(TokenEvent([], [], Finish.ABORT, error=f"queue full: {err}", failure=Failure.QUEUE_FULL))
        elif kind == "abort":
            seq = self.scheduler.abort(arg)
            if seq is not None:
                seq.sink(TokenEvent([], [], Finish.ABORT))
        elif kind in ("mask", "forced"):
            rid, step, value = arg
            seq = self.scheduler.by_id.get(rid)
            if seq is not None and step >= len(seq.output):
                (seq.masks if kind == "mask" else seq.forced)[step] = value

    def _end(self, seq: Sequence, finish: Finish, error: str | None = None,
             failure: Failure = Failure.NONE) -> None:
        seq.finish = finish
        self.scheduler.finish(seq)
        seq.sink(TokenEvent([], [], finish, error=error, failure=failure))

    def _apply_forced(self, seq: Sequence) -> None:
        applied = self.scheduler.apply_forced(seq)
        if applied:
            if seq.finish != Finish.NONE:
                self.scheduler.finish(seq)
            seq.sink(TokenEvent(applied, [0.0] * len(applied), seq.finish, forced=[True] * len(applied),
                                top=[([], [])] * len(applied)))

    def _dispatch_compute(self, seq: Sequence, budget: int | None = None, decode_args: tuple | None = None):
        """Dispatch the next chunk of a sequence's pending tokens (at most `budget`), alone or, given the decode
        step's arguments (`Engine.dispatch_decode`'s), in one mixed pass with it. Returns (pending, tokens
        consumed), plus the decode step's pending logits when mixed."""
        start = seq.num_computed
        todo = seq.tokens[start:]
        if not seq.ready():
            todo = todo[:-1]  # leave the last token until its mask arrives
        if seq.snapshot_at is not None and start < seq.snapshot_at:
            todo = todo[: seq.snapshot_at - start]  # stop exactly at the shared prefix, to pin a copy
        stop = self.scheduler.share_stop(seq)
        if stop is not None and not self.scheduler.cache.exact_split(start + len(todo), stop):
            todo = todo[: stop - start]  # a waiting follower copies this slot at `stop`: don't run past the ring
        if budget is not None:
            todo = todo[:budget]
        chunk = (seq.slot, todo, start, seq.is_output(start, len(todo)), seq.reset)
        out = self.engine.dispatch_compute(*chunk) if decode_args is None else self.engine.dispatch_mixed(
            *chunk, *decode_args)
        seq.reset = False
        return out

    def _finish_compute(self, seq: Sequence, pending, n: int) -> None:
        self.steps["prompt_tokens"] += max(0, min(n, len(seq.prompt) - seq.num_computed))
        seq.num_computed += n
        self.steps["compute"] += 1
        self.steps["computed_tokens"] += n
        if seq.snapshot_at is not None and seq.num_computed >= seq.snapshot_at:
            self._snapshot(seq)
        if seq.pending == 0 and seq.slot is not None:
            out = self.engine.sample(pending, sampling_rows([seq], self.vocab), [False], [True])
            self._publish(seq, out, 0)

    def _await_constraints(self, seqs: list[Sequence]) -> None:
        """While the forward pass runs, wait (up to mask_wait) for the masks or forced runs of constrained rows."""
        deadline = time.monotonic() + self.mask_wait
        while any(s.slot is not None and not s.has_constraint() for s in seqs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                self._handle(*self._inbox.get(timeout=remaining))
            except queue.Empty:
                return

    def _snapshot(self, seq: Sequence) -> None:
        """Pin a copy of the slot holding the shared prefix prompt[:snapshot_at] for later conversations."""
        target = self.scheduler.cache.snapshot_slot(seq.slot)
        if target is not None and seq.num_computed == seq.snapshot_at:
            self.engine.copy_slot(seq.slot, target)
            self.scheduler.cache.pin(target, seq.prompt[: seq.snapshot_at], seq.cache_salt)
            self.steps["copy"] += 1
        seq.snapshot_at = None

    def _finish_decode(self, seqs: list[Sequence], pending) -> None:
        """Sample the decode step. A row whose mask has not arrived commits nothing and is recomputed later; a row
        whose forced tokens arrived keeps its computed KV but not the sample (the forced tokens follow)."""
        live = [s.slot is not None for s in seqs]
        sampled = [live[i] and s.ready() for i, s in enumerate(seqs)]
        forced = [live[i] and not sampled[i] and len(s.output) in s.forced for i, s in enumerate(seqs)]
        active = [a or f for a, f in zip(sampled, forced)]
        out = self.engine.sample(pending, sampling_rows(seqs, self.vocab), [s.reset for s in seqs], active)
        self.steps["decode"] += 1
        self.steps["computed_tokens"] += sum(active)
        for r, seq in enumerate(seqs):
            seq.missed = live[r] and not active[r]
            if not active[r]:
                continue
            self.steps["prompt_tokens"] += seq.num_computed < len(seq.prompt)
            seq.num_computed += 1
            seq.reset = False
            if sampled[r]:
                self._publish(seq, out, r)

    def _publish(self, seq: Sequence, out: HostOutput, row: int) -> None:
        if seq.slot is None:  # aborted while the step ran
            return
        if out.mask_empty[row]:
            self._end(seq, Finish.ABORT, error="the token mask allows no token", failure=Failure.MASK_EMPTY)
            return
        token = int(out.tokens[row])
        n = seq.sampling.top_logprobs
        top = (out.top_ids[row, :n].tolist(), out.top_logprobs[row, :n].tolist())
        first = not seq.output
        finish = self.scheduler.append_token(seq, token)
        if self.metrics is not None:
            self._observe_token(seq)
        if finish != Finish.NONE:
            self.scheduler.finish(seq)
        seq.sink(TokenEvent([token], [float(out.logprobs[row])], finish, forced=[False], top=[top],
                            cached_tokens=seq.cached_tokens if first else 0))


def wait_idle(loop: EngineLoop, timeout: float = 10.0) -> bool:
    """Wait until the loop has no waiting or running sequences (a drain, and tests); returns whether it did
    within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not loop.scheduler.has_work() and loop._inbox.empty():
            return True
        time.sleep(0.01)
    return False
