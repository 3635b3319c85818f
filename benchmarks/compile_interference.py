"""How much programs compiling in the background slow a serving loop whose steps are bound by dispatch (the host's
CPU and the GIL), as the embedded model's steps are on a TPU (docs/performance.md, "Fifteenth session on the
chip").

The product's own pieces: an engine loop (`EngineLoop`) serves one long greedy request on a tiny Gemma 4 engine
whose whole grid is compiled (its steps take a millisecond or two here: dispatch, not arithmetic); beside it
`Engine.compile_in_background` compiles a second engine's grid (another slot count, so no program is shared) on
`--threads` threads. Modes, one after the other in one process:

  alone       the request with nothing compiling (the reference)
  contended   the background with its yielding switched off (`background_compile.YIELD_TO_SERVING = False`)
  yielding    the background as the worker runs it
  yield-5ms   yielding, but with the GIL's default 5 ms turns (the switch interval's share)
  process     a compile process of its own builds the programs (`model_worker/engine/compile_process.py`: the
              worker's default), the loop's process only loading each from an executable cache

Requests follow one another while the background runs. Prints the time between consecutive output tokens
(TPOT; the gaps of all requests pooled) p50 / p99 per mode, each mode's p50 as a
ratio of the loop alone, and how long the background took. Needs the test extra (torch writes the checkpoint).

    python benchmarks/compile_interference.py --threads 2 8
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.engine import background_compile
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.engine.executables import ExecutableCache
from model_worker.modeling.params import for_matmul_precision, to_device
from model_worker.serving.loop import EngineLoop
from model_worker.serving.sequence import Finish, SamplingSpec, Sequence
from tests.gemma4_tiny import SHARED, write_checkpoint


def _ecfg(slots: int) -> EngineConfig:
    return EngineConfig(num_slots=slots, max_model_len=1024, prefill_chunks=(8, 32), kv_bucket_factor=4)


class _Clock:
    """An engine loop's sink that stamps each output token's arrival (perf_counter seconds)."""

    def __init__(self):
        self.stamps, self.done = [], threading.Event()

    def __call__(self, ev):
        now = time.perf_counter()
        self.stamps += [now] * len(ev.token_ids)
        if ev.finish != Finish.NONE:
            self.done.set()


def _tpot(eng: Engine, tokens: int, busy: threading.Event | None) -> list[float]:
    """Milliseconds between output tokens of greedy requests of `tokens` tokens, one after another: three, or while
    `busy` is unset (the background compiling) when given."""
    loop = EngineLoop(eng, speculation="off")
    loop.start()
    gaps, n = [], 0
    try:
        while (n < 3) if busy is None else not busy.is_set():
            clock = _Clock()
            loop.submit(Sequence(f"r{n}", list(range(3, 19)), SamplingSpec(temperature=0.0), tokens, frozenset(),
                                 clock))
            assert clock.done.wait(600)
            gaps += [(b - a) * 1e3 for a, b in zip(clock.stamps, clock.stamps[1:])]
            n += 1
    finally:
        loop.stop()
    return gaps


def main() -> None:
    """Time the loop alone, then beside each mode's background compile, per thread count; print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 8], help="background compile threads")
    ap.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    ap.add_argument("--modes", nargs="+", default=["contended", "yielding"],
                    choices=["contended", "yielding", "yield-5ms", "process"],
                    help="yield-5ms: yielding but the GIL's 5 ms turns; process: a compile process of its own")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(SHARED, pathlib.Path(tmp))
        cfg, flat = load_checkpoint(pathlib.Path(tmp), jnp.float32)
    cfg, params = for_matmul_precision(cfg, to_device(cfg, flat, jnp.float32), "bfloat16", batch_invariant=True)
    server = Engine(cfg, params, _ecfg(4))
    server.compile_all()
    print(f"backend {jax.default_backend()}; serving engine: {len(server.grid())} programs; request of "
          f"{args.tokens} tokens")
    print(f"{'threads':>7} {'mode':>10} {'gaps':>5} {'TPOT p50':>9} {'p99':>7} {'p50 / alone':>11} {'bg s':>6}")
    slots, turn = 4, background_compile.GIL_TURN_S
    alone_gaps = _tpot(server, args.tokens, None)
    alone = statistics.median(alone_gaps)
    for threads in args.threads:
        print(f"{threads:>7} {'alone':>10} {len(alone_gaps):>5} {alone:>9.2f} {'':>7} {1.0:>10.2f}x {'-':>6}")
        for mode in args.modes:
            slots += 1  # a grid no earlier engine compiled
            background_compile.YIELD_TO_SERVING = mode != "contended"
            background_compile.GIL_TURN_S = 0.005 if mode == "yield-5ms" else turn
            other = Engine(cfg, params, _ecfg(slots))
            cache = ExecutableCache(tempfile.mkdtemp(prefix="interference-")) if mode == "process" else None
            job = other.compile_in_background(other.grid(), cache=cache, threads=threads, process=mode == "process")
            gaps = _tpot(server, args.tokens, job.done) or [float("nan")]  # none if it was done at once
            background_compile.YIELD_TO_SERVING, background_compile.GIL_TURN_S = True, turn
            p50, p99 = statistics.median(gaps), sorted(gaps)[int(0.99 * (len(gaps) - 1))]
            print(f"{threads:>7} {mode:>10} {len(gaps):>5} {p50:>9.2f} {p99:>7.1f} {p50 / alone:>10.2f}x "
                  f"{job.seconds:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
