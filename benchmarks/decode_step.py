#!/usr/bin/env python3
"""Decode step time vs batch size and KV length, with bytes moved per step and the fraction of memory bandwidth.

Not a test: prints a table (and writes JSON with --json) measured in one run. The physical floor of a decode
step is (weight bytes + KV bytes read) / memory bandwidth (a decode step reads every weight and the KV once); the "bw" column is that
fraction, with the bandwidth measured in the same run by a large on-device reduction.

  python benchmarks/decode_step.py                          # the embedded Gemma 3 270M, this machine's device
  python benchmarks/decode_step.py --model /path/to/ckpt    # a Gemma 4 checkpoint directory (e.g. synthetic E2B)
  python benchmarks/decode_step.py --batches 1 8 --kv 512 4096 --steps 20

Target (embedded model on a 2-core CPU; docs/performance.md): the B=8 step takes <= 2x the B=1 step.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from gemma_serve.models import default_cache_dir, prepare  # noqa: E402
from model_worker.engine import Engine, EngineConfig, enable_compilation_cache  # noqa: E402
from model_worker.sampling import SamplingArrays  # noqa: E402


def load(model: str, dtype: str, cache_dir: pathlib.Path, precision: str = "float32", invariant: bool = False):
    """(config, params) for the embedded model, a .gguf, or a checkpoint directory, at the worker's
    `--matmul-precision` `precision` ("float32" or "bfloat16") and `--batch-invariant` `invariant` (see
    `params.for_matmul_precision`)."""
    from model_worker.params import for_matmul_precision, to_device

    prepared = prepare(model, cache_dir)
    if prepared.kind == "checkpoint":
        from model_worker.hf_loader import load_checkpoint

        cfg, flat = load_checkpoint(prepared.dir, jnp.dtype(dtype))
    else:
        from safetensors.numpy import load_file

        from model_worker.config import config_from_dict

        cfg = config_from_dict(json.loads((prepared.dir / "config.json").read_text()))
        flat = load_file(str(prepared.dir / "model.safetensors"))
    return for_matmul_precision(cfg, to_device(cfg, flat, jnp.dtype(dtype)), precision, invariant)


def measure_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a large on-device read (sum of a float32 array)."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return nbytes / min(times)


def kv_read_bytes(engine: Engine, batch: int, kv_len: int) -> int:
    """KV bytes a decode step reads: full layers read kv_len positions, sliding layers their ring."""
    per_token, per_seq = engine.kv_bytes()
    return batch * (per_token * kv_len + per_seq)


def time_step(engine: Engine, batch: int, kv_len: int, steps: int) -> float:
    """Median seconds of one decode step of `batch` sequences at position kv_len - 1."""
    slots = list(range(batch))
    sampling = SamplingArrays.defaults(batch, engine.cfg.vocab_size)
    args = (slots, [1] * batch, [kv_len - 1] * batch, [True] * batch, sampling)
    for _ in range(3):
        engine.decode(*args)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.decode(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--matmul-precision", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-invariant", action="store_true", help="with --matmul-precision bfloat16")
    parser.add_argument("--kv-int8", action="store_true")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--kv", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--cache-dir", default=str(default_cache_dir()))
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    backend = jax.default_backend()
    dtype = args.dtype if args.dtype != "auto" else ("float32" if backend == "cpu" else "bfloat16")
    enable_compilation_cache(str(pathlib.Path(args.cache_dir) / "jax"))
    cfg, params = load(args.model, dtype, pathlib.Path(args.cache_dir), args.matmul_precision,
                       args.batch_invariant)
    slots = max(args.batches)
    kv_buckets = sorted(set(args.kv))
    ecfg = EngineConfig(num_slots=slots, max_model_len=max(kv_buckets), prefill_chunks=(min(kv_buckets),),
                        dtype=dtype, kv_int8=args.kv_int8)
    engine = Engine(cfg, params, ecfg)
    engine.kv_buckets, engine.batch_buckets = tuple(kv_buckets), tuple(sorted(set(args.batches)))
    keys = [("decode", b, 1, L) for b in engine.batch_buckets for L in engine.kv_buckets]
    keys += [("greedy", b, 0, 0) for b in engine.batch_buckets]  # a step = forward + (greedy) sampling
    compile_s = engine.compile_all(keys=keys)
    bandwidth = measure_bandwidth()
    weights = engine.weight_bytes()
    if params.lm_head is not None:  # a step reads the head copy; of the embedding only the looked-up rows
        weights -= params.embed.nbytes
    print(f"{cfg.name} on {backend} ({dtype}, {args.matmul_precision} matmul precision"
          f"{', int8 KV' if args.kv_int8 else ''}): weights read per step "
          f"{weights / 2**30:.2f} GiB; measured bandwidth {bandwidth / 1e9:.1f} GB/s; {len(keys)} programs "
          f"compiled in {compile_s:.0f} s")
    print(f"{'batch':>5} {'kv_len':>6} {'step ms':>8} {'tok/s':>8} {'MB/step':>8} {'bw':>5} {'vs B=1':>7}")
    rows = []
    for L in engine.kv_buckets:
        base = None
        for b in engine.batch_buckets:
            seconds = time_step(engine, b, L, args.steps)
            moved = weights + kv_read_bytes(engine, b, L)
            base = base or seconds
            row = dict(batch=b, kv_len=L, step_ms=seconds * 1e3, tokens_per_s=b / seconds, bytes=moved,
                       bandwidth_fraction=moved / seconds / bandwidth, vs_batch1=seconds / base)
            rows.append(row)
            print(f"{b:>5} {L:>6} {row['step_ms']:>8.1f} {row['tokens_per_s']:>8.1f} {moved / 1e6:>8.0f} "
                  f"{row['bandwidth_fraction']:>5.0%} {row['vs_batch1']:>6.2f}x")
    if args.json:
        args.json.write_text(json.dumps(dict(model=cfg.name, backend=backend, dtype=dtype, weights=weights,
                                             matmul_precision=args.matmul_precision,
                                             bandwidth=bandwidth, rows=rows), indent=1))


if __name__ == "__main__":
    main()
