"""The one thread that owns the Engine (and so the KV cache): schedule -> run -> publish, forever.

Other threads talk to it only through `submit` and `abort`, which put commands in a queue; results leave
through each sequence's `sink` callback (called on this thread, must not block). When there is nothing to do
the thread sleeps on the command queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np

from model_worker.engine import Engine, default_sampling
from model_worker.sampling import SamplingArrays
from model_worker.scheduler import Finish, Scheduler, Sequence, TokenEvent

log = logging.getLogger(__name__)


def _sampling_rows(rows: list[Sequence | None]) -> SamplingArrays:
    """Per-row sampling arrays for a batch; None rows (idle slots) get greedy defaults."""
    s = default_sampling(len(rows))
    for r, seq in enumerate(rows):
        if seq is None:
            continue
        sp = seq.sampling
        s.temperature[r], s.top_k[r], s.top_p[r], s.min_p[r] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
        s.seed[r] = (sp.seed & 0xFFFFFFFF, (sp.seed >> 32) & 0xFFFFFFFF)
        s.step[r] = len(seq.output)
    return s


class EngineLoop:
    """Drives an Engine with a Scheduler on a background thread."""

    def __init__(self, engine: Engine):
        """Args: engine: a compiled Engine (the loop becomes its only user)."""
        self.engine = engine
        self.scheduler = Scheduler(engine.ecfg.num_slots, engine.ecfg.max_model_len)
        self._inbox: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = {"prefill": 0, "decode": 0}

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

    # ----- loop thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain_inbox(block=not self.scheduler.has_work())
            if self._stopped.is_set():
                break
            work = self.scheduler.schedule()
            try:
                if work.prefill is not None:
                    self._prefill(work.prefill)
                if work.decode:
                    self._decode(work.decode)
            except Exception as exc:  # noqa: BLE001 - keep serving; fail only the sequences involved
                log.exception("engine step failed")
                involved = ([work.prefill] if work.prefill else []) + work.decode
                for seq in involved:
                    self._end(seq, Finish.ABORT, error=f"engine error: {exc}")

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
                arg.sink(TokenEvent([], [], Finish.ABORT, error=f"request id {arg.request_id!r} is already live"))
        elif kind == "abort":
            seq = self.scheduler.abort(arg)
            if seq is not None:
                seq.sink(TokenEvent([], [], Finish.ABORT))

    def _end(self, seq: Sequence, finish: Finish, error: str | None = None) -> None:
        seq.finish = finish
        self.scheduler.finish(seq)
        seq.sink(TokenEvent([], [], finish, error=error))

    def _prefill(self, seq: Sequence) -> None:
        start = seq.num_computed
        token, logprob, n = self.engine.prefill(seq.slot, seq.prompt[start:], start, _sampling_rows([seq]))
        seq.num_computed += n
        self.steps["prefill"] += 1
        if seq.prefilled:
            self._publish(seq, token, logprob)

    def _decode(self, seqs: list[Sequence]) -> None:
        S = self.engine.ecfg.num_slots
        tokens = np.zeros(S, np.int32)
        positions = np.full(S, -1, np.int32)
        rows: list[Sequence | None] = [None] * S
        for seq in seqs:
            tokens[seq.slot], positions[seq.slot], rows[seq.slot] = seq.output[-1], seq.position, seq
        next_tokens, logprobs = self.engine.decode(tokens, positions, _sampling_rows(rows))
        self.steps["decode"] += 1
        for seq in seqs:
            self._publish(seq, int(next_tokens[seq.slot]), float(logprobs[seq.slot]))

    def _publish(self, seq: Sequence, token: int, logprob: float) -> None:
        finish = self.scheduler.append_token(seq, token)
        if finish != Finish.NONE:
            self.scheduler.finish(seq)
        seq.sink(TokenEvent([token], [logprob], finish))


def wait_idle(loop: EngineLoop, timeout: float = 10.0) -> bool:
    """Test helper: wait until the loop has no waiting or running sequences."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not loop.scheduler.has_work() and loop._inbox.empty():
            return True
        time.sleep(0.01)
    return False
