#!/usr/bin/env python3
"""Sampling programs over the embedded Gemma 3's vocabulary (262,144 logits a row): milliseconds per call of the
greedy program (`sampling.sample_greedy`), the full one (`sampling.sample`) at temperature 0, at temperature 1,
and at temperature 1 with top-p 0.95, at several batch sizes. Not a test: prints one line per batch size,
measured in one run (medians of interleaved rounds, jitted, dispatch included), with the worker's XLA options.

    .venv/bin/python benchmarks/sampling.py [--batches 1 8 16] [--rounds 15] [--vocab 262144]

A decode step of the embedded model at batch 1 takes ~13 ms on the project's 2-vCPU machine
(benchmarks/decode_step.py): what sampling adds to it is read against that (docs/performance.md, "Sampling").
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from model_worker.numerics.xla_options import INVARIANT_CPU_FLAGS, add_xla_flags

add_xla_flags(*INVARIANT_CPU_FLAGS)  # the worker's XLA options, before jax starts

import jax
import numpy as np

from model_worker.modeling import sampling


def settings(batch: int, vocab: int, temperature: float, top_p: float) -> sampling.SamplingArrays:
    """Every row with the same temperature and top-p, seeds and steps distinct."""
    s = sampling.SamplingArrays.defaults(batch, vocab)
    s.temperature[:], s.top_p[:] = temperature, top_p
    s.seed[:, 0], s.step[:] = np.arange(batch), np.arange(batch)
    return s


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=262_144)
    args = ap.parse_args()
    greedy, full = jax.jit(sampling.sample_greedy), jax.jit(sampling.sample)
    cases = {"greedy": (0.0, 1.0), "sample t=0": (0.0, 1.0), "t=1": (1.0, 1.0), "t=1 top_p=0.95": (1.0, 0.95)}
    print(f"vocab {args.vocab}, {jax.devices()[0].device_kind}; ms per call (median of {args.rounds} rounds)")
    print(f"{'batch':>5} " + " ".join(f"{name:>15}" for name in cases))
    for batch in args.batches:
        logits = jax.numpy.asarray(np.random.default_rng(batch).standard_normal((batch, args.vocab)).astype(np.float32)
                                   * 3)
        state = sampling.penalty_state_zeros(batch, args.vocab)
        rows = {name: settings(batch, args.vocab, t, p) for name, (t, p) in cases.items()}

        def run(name: str, logits=logits, state=state, rows=rows):
            """One call of case `name`, finished."""
            out = greedy(logits, rows[name]) if name == "greedy" else full(logits, rows[name], state)
            return jax.block_until_ready(out)

        times: dict[str, list[float]] = {name: [] for name in cases}
        for name in cases:
            run(name)
        for _ in range(args.rounds):
            for name in cases:
                t0 = time.perf_counter()
                run(name)
                times[name].append(time.perf_counter() - t0)
        print(f"{batch:>5} " + " ".join(f"{statistics.median(times[name]) * 1e3:>15.2f}" for name in cases))


if __name__ == "__main__":
    main()
