#!/usr/bin/env python3
"""A mixed step (one slot's prompt chunk + a decode batch in one forward pass) against the same work as two
programs, a compute chunk then a decode step (the pause a new prompt causes in running streams).

Not a test: prints a table (and writes JSON with --json, a markdown section with --markdown) measured in one run.
Per decode batch B, the rows decode at positions around `--position` and the chunk (another slot) sits at
`--position` too. Each iteration is timed from dispatch until its logits are computed, and the variants alternate so
that machine noise hits them alike; medians. The mixed step's bytes read (weights once, the B rows' and the chunk's
KV: `decode_step.step_bytes`) and their fraction of the bandwidth measured in the same run (a device copy, bytes
read + written) close each row.

  python benchmarks/mixed_step.py                           # the embedded Gemma 3 270M, B = 1 4 8, chunk 64
  python benchmarks/mixed_step.py --batches 8 --chunk 32 --position 4000 --tensor-parallel 2
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
from decode_step import (  # noqa: E402
    add_common_args,
    append_markdown,
    device_label,
    load,
    measure_bandwidth,
    step_bytes,
)

from model_worker.engine.engine import Engine, EngineConfig, enable_compilation_cache  # noqa: E402
from model_worker.engine.programs import ProgramKey  # noqa: E402
from model_worker.serving.engine_api import DecodeBatch, PromptChunk  # noqa: E402


def variants(engine: Engine, batch: int, chunk: int, position: int) -> dict:
    """Callables running one iteration each way and waiting for its logits."""
    slots = list(range(batch))
    rows = DecodeBatch(slots, [1] * batch, [position + 7 * r for r in slots], [True] * batch)
    ids = list(range(100, 100 + chunk))
    prompt = PromptChunk(batch, ids, position, [False] * chunk)  # slot `batch`: not decoding

    def chunk_alone():
        pending, _ = engine.dispatch_compute(chunk=prompt)
        jax.block_until_ready(pending.logits)

    def decode_alone():
        jax.block_until_ready(engine.dispatch_decode(batch=rows).logits)

    def two_programs():
        pending, _ = engine.dispatch_compute(chunk=prompt)
        jax.block_until_ready((pending.logits, engine.dispatch_decode(batch=rows).logits))

    def mixed():
        pending, _, decoding = engine.dispatch_mixed(chunk=prompt, batch=rows)
        jax.block_until_ready((pending.logits, decoding.logits))

    return dict(chunk=chunk_alone, decode=decode_alone, chunk_then_decode=two_programs, mixed=mixed)


def variant_bytes(engine: Engine, batch: int, chunk: int, position: int) -> dict:
    """Bytes each of `variants` reads from device memory (`decode_step.step_bytes` totals; "chunk_then_decode"
    reads the weights twice, "mixed" once)."""
    decoding = [position + 7 * r for r in range(batch)]
    last = position + chunk - 1  # the chunk's last token attends to [0, last]
    out = dict(chunk=step_bytes(engine, [last], chunk).total, decode=step_bytes(engine, decoding, batch).total,
               mixed=step_bytes(engine, decoding + [last], batch + chunk).total)
    return dict(out, chunk_then_decode=out["chunk"] + out["decode"])


def main() -> None:
    """Measure the four variants per --batches and print (and write) the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--position", type=int, default=1500)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    backend = jax.default_backend()
    dtype = "float32" if backend == "cpu" else "bfloat16"
    enable_compilation_cache(str(pathlib.Path(args.cache_dir) / "jax"))
    cfg, params = load(args.model, dtype, pathlib.Path(args.cache_dir), args.matmul_precision,
                       args.batch_invariant, args.attention_kernel, args.matmul_kernel)
    ecfg = EngineConfig(num_slots=max(args.batches) + 1, max_model_len=args.max_model_len,
                        prefill_chunks=(args.chunk,), dtype=dtype, tensor_parallel=args.tensor_parallel)
    engine = Engine(cfg, params, ecfg)
    del params  # under tensor parallelism the engine keeps its own split copy
    engine.batch_buckets = tuple(sorted(set(args.batches)))
    # The programs the variants dispatch: the chunk's bucket holds its last token, a decode batch's its last row
    # (at position + 7 (B - 1)); a mixed program always takes the largest bucket (`Engine.dispatch_mixed`).
    chunk_key = ProgramKey("compute", 1, args.chunk, engine.kv_bucket(args.position + args.chunk))
    decode_keys = [ProgramKey("decode", b, 1, engine.kv_bucket(args.position + 7 * (b - 1) + 1)) for b in engine.batch_buckets]
    keys = [chunk_key, *decode_keys] + [ProgramKey("mixed", b, args.chunk, engine.kv_buckets[-1]) for b in engine.batch_buckets]
    L = sorted({k[3] for k in keys})
    compile_s = engine.compile_all(keys=keys)
    device = device_label(args.tensor_parallel)
    if args.compile_only:
        print(f"{cfg.name} on {device}: {len(keys)} programs compiled in {compile_s:.0f} s")
        return
    bandwidth = measure_bandwidth(args.bandwidth_mib << 20)
    per_device = " per device" if args.tensor_parallel > 1 else ""
    title = f"{cfg.name} on {device}: {dtype}, {args.matmul_precision} matmul precision"
    facts = (f"chunk {args.chunk} at position {args.position}, KV buckets {L}; bandwidth {bandwidth / 1e9:.0f} GB/s (a "
             f"device copy of {args.bandwidth_mib} MiB, bytes read + written); {len(keys)} programs compiled in "
             f"{compile_s:.0f} s; medians of {args.iterations}, ms")
    print(f"{title}; {facts}")
    print(f"{'batch':>5} {'chunk':>7} {'decode':>7} {'both':>7} {'mixed':>7} {'mixed/both':>10} {'MB mixed':>9} "
          f"{'bw mixed':>8}")
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
        moved = variant_bytes(engine, b, args.chunk, args.position)
        fraction = {name: moved[name] / (ms[name] / 1e3) / bandwidth for name in runs}
        rows.append(dict(batch=b, **ms, bytes=moved, bandwidth_fraction=fraction))
        print(f"{b:>5} {ms['chunk']:>7.2f} {ms['decode']:>7.2f} {ms['chunk_then_decode']:>7.2f} {ms['mixed']:>7.2f} "
              f"{ms['mixed'] / ms['chunk_then_decode']:>10.2f} {moved['mixed'] / 1e6:>9.0f} {fraction['mixed']:>8.0%}")
    if args.json:
        args.json.write_text(json.dumps(dict(model=cfg.name, device=device, backend=backend, chunk=args.chunk,
                                             position=args.position, kv_buckets=L, tensor_parallel=args.tensor_parallel,
                                             bandwidth=bandwidth, rows=rows), indent=1))
    if args.markdown:
        note = (f"{facts}. MB mixed: weights (once) + the decode rows' and the chunk's KV read{per_device}; bw: MB / "
                "time / bandwidth.")
        append_markdown(args.markdown, f"mixed step: {title}", note,
                        ["batch", "chunk", "decode", "both", "mixed", "mixed/both", "MB mixed", "bw mixed",
                         "bw decode"],
                        [[r["batch"], *(f"{r[k]:.2f}" for k in ("chunk", "decode", "chunk_then_decode", "mixed")),
                          f"{r['mixed'] / r['chunk_then_decode']:.2f}", f"{r['bytes']['mixed'] / 1e6:.0f}",
                          *(f"{r['bandwidth_fraction'][k]:.0%}" for k in ("mixed", "decode"))] for r in rows])


if __name__ == "__main__":
    main()
