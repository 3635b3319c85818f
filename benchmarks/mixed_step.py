#!/usr/bin/env python3
"""A mixed step (one slot's prompt chunk + a decode batch in one forward pass) against the same work as two
programs, a compute chunk then a decode step (the pause a new prompt causes in running streams).

Not a test: prints a table (and writes JSON with --json) measured in one run. Per decode batch B, the rows decode
at positions around `--position` and the chunk (another slot) sits at `--position` too. Each iteration is timed
from dispatch to logits on the host, and the variants alternate so that machine noise hits them alike; medians.

  python benchmarks/mixed_step.py                           # the embedded Gemma 3 270M, B = 1 4 8, chunk 64
  python benchmarks/mixed_step.py --batches 8 --chunk 32 --position 4000
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from decode_step import load  # noqa: E402

from gemma_serve.models import default_cache_dir  # noqa: E402
from model_worker.engine import Engine, EngineConfig, enable_compilation_cache  # noqa: E402


def variants(engine: Engine, batch: int, chunk: int, position: int) -> dict:
    """Callables running one iteration each way and waiting for its logits."""
    slots = list(range(batch))
    rows = (slots, [1] * batch, [position + 7 * r for r in slots], [True] * batch)
    ids, outs, slot = list(range(100, 100 + chunk)), [False] * chunk, batch  # the chunk's slot: not decoding

    def chunk_alone():
        pending, _ = engine.dispatch_compute(slot, ids, position, outs)
        jax.block_until_ready(pending.logits)

    def decode_alone():
        jax.block_until_ready(engine.dispatch_decode(*rows).logits)

    def two_programs():
        pending, _ = engine.dispatch_compute(slot, ids, position, outs)
        jax.block_until_ready((pending.logits, engine.dispatch_decode(*rows).logits))

    def mixed():
        pending, _, decoding = engine.dispatch_mixed(slot, ids, position, outs, False, *rows)
        jax.block_until_ready((pending.logits, decoding.logits))

    return dict(chunk=chunk_alone, decode=decode_alone, chunk_then_decode=two_programs, mixed=mixed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--matmul-precision", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-invariant", action="store_true", help="with --matmul-precision bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--position", type=int, default=1500)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--cache-dir", default=str(default_cache_dir()))
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    backend = jax.default_backend()
    dtype = "float32" if backend == "cpu" else "bfloat16"
    enable_compilation_cache(str(pathlib.Path(args.cache_dir) / "jax"))
    cfg, params = load(args.model, dtype, pathlib.Path(args.cache_dir), args.matmul_precision,
                       args.batch_invariant)
    ecfg = EngineConfig(num_slots=max(args.batches) + 1, max_model_len=args.max_model_len,
                        prefill_chunks=(args.chunk,), dtype=dtype)
    engine = Engine(cfg, params, ecfg)
    engine.batch_buckets = tuple(sorted(set(args.batches)))
    L = engine.kv_bucket(args.position + 8 * max(args.batches))
    keys = [("compute", 1, args.chunk, L)] + [k for b in engine.batch_buckets
                                               for k in (("decode", b, 1, L), ("mixed", b, args.chunk,
                                                                                 engine.kv_buckets[-1]))]
    compile_s = engine.compile_all(keys=keys)
    print(f"{cfg.name} on {backend} ({dtype}, {args.matmul_precision} matmul precision); chunk {args.chunk} at "
          f"position {args.position}, KV bucket {L}; {len(keys)} programs compiled in {compile_s:.0f} s; medians of "
          f"{args.iterations}, ms")
    print(f"{'batch':>5} {'chunk':>7} {'decode':>7} {'both':>7} {'mixed':>7} {'mixed/both':>10}")
    rows = []
    for b in engine.batch_buckets:
        runs = variants(engine, b, args.chunk, args.position)
        times = {name: [] for name in runs}
        for name, fn in runs.items():  # warm-up: the first call of a program is slower
            fn(), fn()
        for _ in range(args.iterations):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        rows.append(dict(batch=b, **ms))
        print(f"{b:>5} {ms['chunk']:>7.1f} {ms['decode']:>7.1f} {ms['chunk_then_decode']:>7.1f} {ms['mixed']:>7.1f} "
              f"{ms['mixed'] / ms['chunk_then_decode']:>10.2f}")
    if args.json:
        args.json.write_text(json.dumps(dict(model=cfg.name, backend=backend, chunk=args.chunk,
                                             position=args.position, kv_len=L, rows=rows), indent=1))


if __name__ == "__main__":
    main()
