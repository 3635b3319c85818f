#!/usr/bin/env python3
"""Sampling programs over the embedded Gemma 3's vocabulary (262,144 logits a row): milliseconds per call of the
greedy program (`sampling.sample_greedy`) and of the full one (`sampling.sample`) at temperature 0, at temperature
1, at temperature 1 with top-p 0.95, and with every setting at once ("full": temperature 0.7, top-p 0.95, top-k 50,
min-p 0.05, repetition / frequency / presence penalties over a history, three logit biases, 5 top logprobs), then
each one's ratio to the greedy program. Not a test: one table per shape of logits and one line per batch size,
measured in one run (medians of interleaved rounds, jitted, dispatch included), with the worker's XLA options and
its malloc tunable (it runs itself again with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, as `gemma-serve worker`
does: each execution's [B, V] temporaries are fresh pages, and without huge pages their faults dominate).

Logits: "peaked", a language model's shape (a normal tail with spread 2 and 40 tokens at 16-22 above it: a nucleus
of a few to a few dozen tokens, as a trained model's usually is), and "flat", normal with spread 3 (at temperature 1 a 0.95-nucleus
of tens of thousands of tokens: the top-p filter's slow path, `sampling._top_p_filter`).

    .venv/bin/python benchmarks/sampling.py [--batches 1 8 16] [--rounds 15] [--vocab 262144] [--logits peaked flat]
        [--reference] [--baseline REV]

`--reference` also times the sampler as it stood before the candidates (the tests' frozen oracle), in the same rounds:
before and after from one run. `--baseline REV` also times `model_worker/modeling/sampling.py` as it stands at the git
revision REV (e.g. `main`), in the same rounds: a change's before and after from one run.

A decode step of the embedded model at batch 1 takes ~13 ms on the project's 2-vCPU machine
(benchmarks/decode_step.py): what sampling adds to it is read against that (docs/performance.md, "Sampling").
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from gemma_serve.cli import HUGE_PAGES_TUNABLE
from model_worker.numerics.xla_options import INVARIANT_CPU_FLAGS, add_xla_flags

if sys.platform == "linux" and "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", ""):
    tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES", ""), HUGE_PAGES_TUNABLE) if t)
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": tunables})

add_xla_flags(*INVARIANT_CPU_FLAGS)  # the worker's XLA options, before jax starts

import jax
import numpy as np

from model_worker.modeling import sampling

#: name -> (temperature, top_p, everything else on)
CASES = {"greedy": (0.0, 1.0, False), "sample t=0": (0.0, 1.0, False), "t=1": (1.0, 1.0, False),
         "t=1 top_p=0.95": (1.0, 0.95, False), "full": (0.7, 0.95, True)}


def settings(batch: int, vocab: int, temperature: float, top_p: float, full: bool) -> sampling.SamplingArrays:
    """Every row with the same settings, seeds and steps distinct."""
    s = sampling.SamplingArrays.defaults(batch, vocab)
    s.temperature[:], s.top_p[:] = temperature, top_p
    s.seed[:, 0], s.step[:] = np.arange(batch), np.arange(batch)
    if full:
        s.top_k[:], s.min_p[:], s.top_logprobs[:] = 50, 0.05, 5
        s.repetition_penalty[:], s.frequency_penalty[:], s.presence_penalty[:] = 1.1, 0.2, 0.1
        s.bias_ids[:, :3], s.bias_vals[:, :3] = [7, 1000, 2000], [2.0, -100.0, 1.5]
    return s


def logits_of(kind: str, batch: int, vocab: int) -> np.ndarray:
    """[batch, vocab] float32 logits of one shape (module docstring)."""
    rng = np.random.default_rng(batch)
    if kind == "flat":
        return (rng.standard_normal((batch, vocab)) * 3).astype(np.float32)
    x = (rng.standard_normal((batch, vocab)) * 2).astype(np.float32)
    for row in x:
        row[rng.choice(vocab, 40, replace=False)] = 16.0 + 6.0 * rng.random(40)
    return x


def history(batch: int, vocab: int) -> sampling.PenaltyState:
    """A prompt's and an answer's tokens: 0.2% of the vocabulary seen, 0.1% generated one to three times (~800
    distinct tokens a row), as dense [B, V] arrays (`state_for` turns them into what a sampler reads)."""
    rng = np.random.default_rng(0)
    counts = np.where(rng.random((batch, vocab)) < 0.001, rng.integers(1, 4, (batch, vocab)), 0).astype(np.int32)
    seen = (rng.random((batch, vocab)) < 0.002) | (counts > 0)
    return sampling.PenaltyState(counts=jax.numpy.asarray(counts), seen=jax.numpy.asarray(seen))


def state_for(module, dense: sampling.PenaltyState, max_model_len: int = 8192):
    """The history `module.sample` reads: the dense arrays for a sampler that takes them (a revision before the
    sparse history), else its `PenaltyHistory` with the engine's capacity for `max_model_len` (the default
    context limit)."""
    if not hasattr(module, "history_from_dense"):
        return dense
    vocab = dense.seen.shape[-1]
    return module.history_from_dense(dense, module.penalty_capacity(max_model_len, vocab))


def interleaved_ms(runs: dict, rounds: int) -> dict:
    """Median milliseconds per call of each of `runs` (key -> a function returning device arrays), after one
    warm-up call each, timed in `rounds` interleaved rounds so that the machine's noise hits them alike."""
    times: dict = {key: [] for key in runs}
    for run in runs.values():
        jax.block_until_ready(run())
    for _ in range(rounds):
        for key, run in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def table(kind: str, args, greedy, samplers: dict) -> None:
    """Print one table: per batch size and sampler, ms per call, then each case's ratio to the greedy program (all
    of a batch size's programs timed in the same interleaved rounds)."""
    print(f"\nlogits {kind}, vocab {args.vocab}, {jax.devices()[0].device_kind}; ms per call (median of {args.rounds}"
          " rounds), then / greedy")
    print(f"{'batch':>5} {'sampler':>9} " + " ".join(f"{name:>15}" for name in CASES) + "  " +
          " ".join(f"{name + ' /g':>17}" for name in list(CASES)[1:]))
    for batch in args.batches:
        logits = jax.numpy.asarray(logits_of(kind, batch, args.vocab))
        dense = history(batch, args.vocab)
        states = {label: state_for(module, dense) for label, (_, module) in samplers.items()}
        rows = {name: settings(batch, args.vocab, *case) for name, case in CASES.items()}
        runs = {(label, name): (lambda f=f, name=name, state=states[label]: greedy(logits, rows[name])
                                if name == "greedy" else f(logits, rows[name], state))
                for label, (f, _) in samplers.items() for name in CASES}
        times = interleaved_ms(runs, args.rounds)
        for label in samplers:
            ms = {name: times[label, name] for name in CASES}
            print(f"{batch:>5} {label:>9} " + " ".join(f"{ms[name]:>15.2f}" for name in CASES) + "  " +
                  " ".join(f"{ms[name] / ms['greedy']:>16.2f}x" for name in list(CASES)[1:]))


def verify_table(kind: str, args) -> None:
    """Print one table of a verify step's sampling (speculative decoding: T positions a row, the pending token and
    T - 1 drafts): per batch size, ms per call of the verify programs (`programs.verify_greedy_program` for
    "greedy", `programs.verify_sample_program` for every other case) and each case's ratio to the greedy one, then
    the greedy verify program against T decode steps' greedy programs (the drafted positions' cost against
    greedy decoding's). Drafts are the rows' own greedy tokens after the first position, so every draft is taken."""
    from model_worker.engine.engine import _per_position
    from model_worker.engine.programs import SampleInputs, verify_greedy_program, verify_sample_program

    T = args.verify
    greedy_verify, sample_verify = jax.jit(verify_greedy_program), jax.jit(verify_sample_program)
    greedy = jax.jit(sampling.sample_greedy)
    print(f"\nverify sampling, {T} positions a row, logits {kind}, vocab {args.vocab}; ms per call (median of "
          f"{args.rounds} rounds), then / the greedy verify program, and the greedy verify program / {T} greedy "
          "programs")
    print(f"{'batch':>5} " + " ".join(f"{name:>15}" for name in CASES if name != "sample t=0") + "  " +
          " ".join(f"{name + ' /g':>17}" for name in list(CASES)[2:]) + f" {'g verify / ' + str(T) + ' g':>14}")
    for batch in args.batches:
        logits = jax.numpy.asarray(np.stack([logits_of(kind, batch * T + t, args.vocab)[:batch] for t in range(T)], 1))
        drafts = np.asarray(jax.numpy.argmax(logits, -1), np.int32)
        tokens = np.concatenate([np.ones((batch, 1), np.int32), drafts[:, :-1]], axis=1)
        positions = np.tile(np.arange(100, 100 + T, dtype=np.int32), (batch, 1))
        pstate = state_for(sampling, history(batch, args.vocab))
        rows = {}
        for name, case in CASES.items():
            s = _per_position(settings(batch, args.vocab, *case), T)
            rows[name] = SampleInputs(logits, tokens, positions, np.arange(batch, dtype=np.int32),
                                      np.ones((batch, T), bool), np.zeros(batch, bool), np.ones(batch, bool), s)
        one = settings(batch, args.vocab, *CASES["greedy"])
        runs = {name: (lambda r=rows[name], name=name, p=pstate:
                       (greedy_verify if name == "greedy" else sample_verify)(p, r))
                for name in CASES if name != "sample t=0"}
        steps = [logits[:, t] for t in range(T)]
        runs["decode greedy"] = lambda steps=steps, one=one: [greedy(x, one) for x in steps]
        ms = interleaved_ms(runs, args.rounds)
        print(f"{batch:>5} " + " ".join(f"{ms[name]:>15.2f}" for name in CASES if name != "sample t=0") + "  " +
              " ".join(f"{ms[name] / ms['greedy']:>16.2f}x" for name in list(CASES)[2:]) +
              f" {ms['greedy'] / ms['decode greedy']:>13.2f}x")


def baseline_module(rev: str):
    """`model_worker/modeling/sampling.py` as at git revision `rev`, imported as a module of its own (it imports the
    rest of the tree as it is now; the settings' pytree registration, done by the current module, is left out)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{rev}:model_worker/modeling/sampling.py"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / "sampling_baseline.py"
    path.write_text(text.replace("jax.tree_util.register_dataclass(SamplingArrays)\n", "\n"))  # registered once
    spec = importlib.util.spec_from_file_location("sampling_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """Print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--logits", nargs="+", default=["peaked", "flat"], choices=["peaked", "flat"])
    ap.add_argument("--reference", action="store_true",
                    help="also time the sampler before the candidates (tests/model_worker/sampling_reference.py), "
                         "interleaved")
    ap.add_argument("--baseline", metavar="REV",
                    help="also time model_worker/modeling/sampling.py as at this git revision, interleaved")
    ap.add_argument("--verify", type=int, default=0, metavar="T",
                    help="also time a verify step's sampling at T positions a row (speculative decoding)")
    args = ap.parse_args()
    samplers = {"sample": (jax.jit(sampling.sample), sampling)}  # label -> (jitted sample, its module)
    if args.baseline:
        module = baseline_module(args.baseline)
        samplers[args.baseline] = (jax.jit(module.sample), module)
    if args.reference:
        from tests.model_worker import sampling_reference

        samplers["reference"] = (jax.jit(sampling_reference.sample), sampling_reference)
    for kind in args.logits:
        table(kind, args, jax.jit(sampling.sample_greedy), samplers)
        if args.verify:
            verify_table(kind, args)


if __name__ == "__main__":
    main()
