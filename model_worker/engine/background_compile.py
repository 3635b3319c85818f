"""Serve first, compile the rest while serving: the serving set, the order of the rest, and the threads that
compile it.

A fresh worker compiling its whole grid before it answers made a new user wait minutes (37 programs, ~12 s each on
two CPU cores: docs/performance.md, "The first minute"). The engine needs far fewer programs to serve every
request, only slower: `serving_set` is one prompt chunk at the largest KV bucket (every position fits it; a decode
step runs as one such chunk per row until a decode program arrives), its sampling, and the slot copy. The worker reports
SERVING once those are compiled (or loaded from the executable cache, with everything else it holds), and
`BackgroundCompile` compiles the rest on threads, most useful first (`background_order`), handing each program to
the engine, whose dispatch picks among the programs it has (`engine.Engine` "which programs are ready").

Why the answers cannot depend on which programs are ready: a row's logits are the same in every batch bucket, KV
bucket and chunking (batch-invariant numerics: the guarantees that prefix reuse and speculation already rest on),
and the full sampler draws what the greedy one does (`tests/model_worker/test_serve_first.py` holds the tokens of a
worker that is still compiling to those of a fully compiled one).

Imports the program keys only: no JAX here (the engine hands in its compile function).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from model_worker.serving.engine_api import ProgramKey

log = logging.getLogger(__name__)


def serving_set(kv_buckets: Sequence[int], prefill_chunks: Sequence[int], num_slots: int) -> list[ProgramKey]:
    """The fewest programs with which an engine serves every request: a compute chunk of the smallest prefill
    size at the largest KV bucket; the sample program of one row (a chunk's last token) and of the full batch (it
    also serves greedy rows: `sampling.sample_greedy` equals it bit for bit); the slot copy.

    Every prompt then runs in chunks of the smallest size, and a decode step as one such chunk per row, sampled
    together (`Engine.dispatch_decode`: slower, until the first decode programs arrive, the B=1 ones first of the
    background's). Mixed steps, speculation and the other buckets wait for the background. Why no decode program:
    the one of the full batch was over a third of the serving set's compile time (7.7 of ~22 s on two CPU cores;
    132 of 132 s, compiled beside the others, on a TPU v5e: docs/performance.md, "The first minute" and "On a TPU
    v5e")."""
    largest, chunk = kv_buckets[-1], min(prefill_chunks)
    return [ProgramKey("compute", 1, chunk, largest)] + \
        [ProgramKey("sample", b, 0, 0) for b in sorted({1, num_slots})] + [ProgramKey("copy", 1, 0, 0)]


def background_order(keys: Iterable[ProgramKey], largest_kv: int, prefill_chunks: Sequence[int]) -> list[ProgramKey]:
    """`keys` most useful first: the greedy sampling programs (cheap; most agent steps of a greedy client), a lone
    sequence's decode at every KV bucket (the one-agent case, shortest contexts first), the larger prompt chunks
    at the largest KV bucket (long prompts in fewer steps), the other batches' sampling, decode and mixed steps,
    speculation's programs, then the rest (chunks at shorter KV buckets, tail chunks); within a tier, the cheaper
    first (batch x tokens x KV length)."""
    def tier(k: ProgramKey) -> int:
        if k.kind == "greedy":
            return 0
        if k.kind == "decode" and k.batch == 1:
            return 1
        if k.kind == "compute" and k.kv_len == largest_kv and k.chunk in prefill_chunks:
            return 2
        if k.kind in ("sample", "decode", "mixed"):
            return 3
        if k.kind in ("verify", "vsample", "vgreedy"):
            return 4
        return 5

    return sorted(keys, key=lambda k: (tier(k), k.batch * max(k.chunk, 1) * max(k.kv_len, 1)))


class BackgroundCompile:
    """Compiles programs on daemon threads, in the order given, handing each to `deliver(key, compiled)`.

    A program that fails to compile is logged and left out (`failed`): the engine keeps serving with the others.
    `stop` lets no further compile start (a compile already running in C++ cannot be interrupted; the threads are
    daemons, so a process that exits does not wait for them). Counters are read from any thread.
    """

    def __init__(self, build: Callable[[ProgramKey], object], keys: Iterable[ProgramKey], threads: int,
                 deliver: Callable[[ProgramKey, object], None],
                 on_compiled: Callable[[ProgramKey, bool], None] | None = None,
                 close: Callable[[bool], None] | None = None):
        """Args: build: compiles one program (raises on failure); keys: the programs, most useful first; threads:
        compiles at once (at least 1); deliver: receives each compiled program (from a compiling thread);
        on_compiled: called after each program with (key, succeeded), from a compiling thread (progress, metrics);
        close: called once at the end with whether the job was stopped (a compile process to end: `stop` ends it
        at once, so that threads waiting on it return).
        """
        self._build, self._deliver, self._on_compiled, self._close = build, deliver, on_compiled, close
        self._queue = list(keys)
        self.total = len(self._queue)
        self.failed: list[ProgramKey] = []
        self.compiled = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.done = threading.Event()  # set when every program is compiled or failed, or after `stop`
        self._running = 0
        self._yielding = False
        self._finished = False
        self._alive = 0  # compiling threads started and not yet ended
        self._started = time.perf_counter()
        self.seconds: float | None = None  # from `start` to the last program (None until then)
        self.process = None  # the compile process building the programs, if one does (`Engine.compile_in_background`)
        self._threads = [threading.Thread(target=self._work, name=f"compile-bg-{i}", daemon=True)
                         for i in range(max(1, min(threads, self.total)))]

    def start(self) -> BackgroundCompile:
        """Start the threads (returns self); with nothing to compile, `done` is set at once."""
        self._started = time.perf_counter()
        if not self._queue:
            self.seconds = 0.0
            self.done.set()
            return self
        self._yielding = YIELD_TO_SERVING
        if self._yielding:
            _shorter_gil_turns(+1)
        self._alive = len(self._threads)
        for t in self._threads:
            try:
                t.start()
            except RuntimeError:  # no thread to be had: those that never started count as ended
                self._thread_ended()
        return self

    def _thread_ended(self) -> None:
        """A compiling thread is done (its queue empty, stopped, or failed outside a compile): the last one out
        finishes the job, whatever ended it."""
        with self._lock:
            self._alive -= 1
            last = self._alive == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        """Once: give back the GIL's switch interval (`_shorter_gil_turns`), then set `done` (so that a caller woken
        by `done` finds the process's own interval)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        if self._close is not None:
            self._close(self._stopped.is_set())
        if self._yielding:
            _shorter_gil_turns(-1)
        self.done.set()

    @property
    def pending(self) -> int:
        """Programs not yet compiled (waiting or compiling; none once stopped and idle)."""
        with self._lock:
            return len(self._queue) + self._running

    def stop(self, wait: float = 0.0) -> bool:
        """Start no further compile; wait up to `wait` seconds for those running. Returns whether none is left
        running."""
        self._stopped.set()
        with self._lock:
            self._queue.clear()
        if self._close is not None:
            self._close(True)
        deadline = time.monotonic() + wait
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
        idle = not any(t.is_alive() for t in self._threads)
        if idle:
            self._finish()
        return idle

    def _work(self) -> None:
        try:
            self._compile_queue()
        finally:
            self._thread_ended()

    def _compile_queue(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                if not self._queue:
                    break
                key = self._queue.pop(0)
                self._running += 1
            ok = cut = False
            try:
                compiled = self._build(key)
                if not self._stopped.is_set():
                    self._deliver(key, compiled)
                ok = True
            except Exception:  # a program that does not compile: serve without it
                cut = self._stopped.is_set()  # once stopped, a compile cut short is left, not failed
                if not cut:
                    log.exception("compiling %s in the background failed; serving without it", key)
            with self._lock:
                self._running -= 1
                if ok:
                    self.compiled += 1
                elif not cut:
                    self.failed.append(key)
                finished = not self._queue and self._running == 0
                if finished and self.seconds is None:
                    self.seconds = time.perf_counter() - self._started
            if self._on_compiled is not None and not cut:
                self._on_compiled(key, ok)
            if finished:
                self._finish()


# Serving first: the background must not starve the loop's thread. On a TPU host a small model's step is bound by
# its dispatch (the host's CPU and the GIL): beside 13 compiling threads the embedded model was served ~10x slower
# than alone (docs/performance.md, "Fifteenth session on the chip"; host contention the suspected cause, not yet
# isolated there). Two measures on the GIL, while the background compiles (`YIELD_TO_SERVING`; off only to measure
# them, benchmarks/compile_interference.py):
#   - one thread at a time traces and lowers (`lowering`): that part is Python holding the GIL, so more threads
#     there only add contenders for it, while XLA's compile (without the GIL) still runs on every thread;
#   - a thread waiting for the GIL asks its holder to drop it after `GIL_TURN_S` instead of 5 ms
#     (`_shorter_gil_turns`), so the loop's thread gets it back sooner after each dispatch.
# Not the threads' CPU priority: a lower one (nice 19) yields to every other process too, which on a shared host
# (CI, the test suite's workers) delays full speed for nothing the loop gains; on the chip's host the 13 compiling
# threads leave the loop's thread most of a core anyway.
YIELD_TO_SERVING = True
GIL_TURN_S = 0.0005
_LOWERING = threading.Lock()
_TURNS_LOCK = threading.Lock()
_turns = {"jobs": 0, "saved": None}


@contextlib.contextmanager
def lowering():
    """Hold while tracing and lowering a program on a background thread: one at a time (see above) while
    `YIELD_TO_SERVING`; a no-op otherwise."""
    if not YIELD_TO_SERVING:
        yield
        return
    with _LOWERING:
        yield


def _shorter_gil_turns(delta: int) -> None:
    """Count a background compile in (+1) or out (-1): the first in sets the switch interval to `GIL_TURN_S`, the
    last out restores the process's own."""
    with _TURNS_LOCK:
        _turns["jobs"] += delta
        if delta > 0 and _turns["jobs"] == 1:
            _turns["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(GIL_TURN_S, _turns["saved"]))
        elif delta < 0 and _turns["jobs"] == 0 and _turns["saved"] is not None:
            sys.setswitchinterval(_turns["saved"])
            _turns["saved"] = None
