#!/usr/bin/env python3
"""The worker's start-up compile: its program grid compiled one program after another, then several at once, then
loaded back from the executable cache one after another and several at once, all in one process. Not a test: it
prints seconds and ratios measured in one run.

  python benchmarks/compile_grid.py                                  # the embedded model, the worker's defaults
  python benchmarks/compile_grid.py --num-slots 32 --max-model-len 2048 --threads 1 13
  python benchmarks/compile_grid.py --model /path/to/ckpt --dtype bfloat16

JAX's persistent compilation cache stays off (as in the worker), so every compile is a real one; each round builds
a fresh engine (the same weights) and an empty executable cache in a temporary folder. The grid is the worker's
for the given sizes (`Engine.grid()`); `--limit N` takes its first N programs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from model_worker.numerics.xla_options import INVARIANT_CPU_FLAGS, add_xla_flags  # noqa: E402

add_xla_flags(*INVARIANT_CPU_FLAGS)  # the worker's XLA options, before jax starts

import jax  # noqa: E402
from decode_step import load  # noqa: E402

from common.preparation import default_cache_dir  # noqa: E402
from model_worker.engine.engine import Engine, EngineConfig, compile_threads  # noqa: E402
from model_worker.engine.executables import ExecutableCache  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, run the rounds, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--dtype", default=None, help="activation dtype [float32 on CPU, bfloat16 elsewhere]")
    p.add_argument("--matmul-precision", default=None, help="[int8 for a GGUF on CPU, else bfloat16]")
    p.add_argument("--num-slots", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--prefill-chunks", type=int, nargs="+", default=None)
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="thread counts to compare [1 and the worker's default, compile_threads()]")
    p.add_argument("--limit", type=int, default=None, help="compile only the grid's first N programs")
    p.add_argument("--cache-dir", default=str(default_cache_dir()))
    p.add_argument("--json", type=pathlib.Path, help="write the rounds here (programs, seconds per thread count)")
    args = p.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    on_cpu = jax.default_backend() == "cpu"
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    precision = args.matmul_precision or ("int8" if on_cpu and dtype == "float32" else "bfloat16")
    cfg, params = load(args.model, dtype, pathlib.Path(args.cache_dir), precision, precision != "float32"
                       and dtype == "float32")
    chunks = tuple(args.prefill_chunks) if args.prefill_chunks else EngineConfig.prefill_chunks
    ecfg = EngineConfig(num_slots=args.num_slots, max_model_len=args.max_model_len, prefill_chunks=chunks,
                        dtype=dtype)
    threads = args.threads or sorted({1, compile_threads()})
    keys = Engine(cfg, params, ecfg).grid()[: args.limit]
    print(f"{len(keys)} programs ({jax.devices()[0].device_kind}, {dtype} activations, {precision} products, "
          f"{args.num_slots} slots, max_model_len {args.max_model_len}); seconds, one process")
    print(f"{'threads':>7} {'compile s':>10} {'load s':>8}")
    first, rounds = {}, []
    for n in threads:
        with tempfile.TemporaryDirectory() as tmp:
            cache = ExecutableCache(tmp)
            compile_s = Engine(cfg, params, ecfg).compile_all(keys=keys, cache=cache, threads=n)
            t0 = time.perf_counter()
            Engine(cfg, params, ecfg).compile_all(keys=keys, cache=cache, threads=n)
            load_s = time.perf_counter() - t0
            assert cache.loaded == len(keys), (cache.loaded, len(keys))
        first.setdefault("compile", compile_s)
        first.setdefault("load", load_s)
        print(f"{n:>7} {compile_s:>10.1f} {load_s:>8.1f}   ({compile_s / first['compile']:.2f}x, "
              f"{load_s / first['load']:.2f}x of {threads[0]} thread(s))", flush=True)
        rounds.append(dict(threads=n, compile_s=compile_s, load_s=load_s))
    if args.json:
        args.json.write_text(json.dumps(dict(model=cfg.name, device=jax.devices()[0].device_kind, programs=len(keys),
                                             num_slots=args.num_slots, max_model_len=args.max_model_len,
                                             rounds=rounds), indent=1))


if __name__ == "__main__":
    main()
