"""The block-int8 product (model_worker/numerics/q8.py) against the bfloat16 GEMM of the batch-invariant path, on the
shapes of the embedded Gemma 3's LM head and MLP, at 1-16 rows: ms per product and the bytes of weights read per
second (the kernel reads int8 values + one float32 scale per 32; the GEMM bfloat16 values). Prints ratios from
one run; not a test.

    .venv/bin/python benchmarks/q8_product.py [--rows 1 4 8 16] [--repeat 20]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model_worker.numerics import q8

SHAPES = {"lm_head": (262144, 640), "mlp_down": (640, 2048), "mlp_up": (2048, 640)}


def timed(f, *args, repeat: int) -> float:
    """Median seconds of `repeat` calls of a compiled `f` (after one warm-up call)."""
    f(*args).block_until_ready()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    """Print one line per (shape, rows): kernel, twin and bfloat16 GEMM times and the kernel's GB/s."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    print(f"kernel available: {q8.kernel_available()}")
    rng = np.random.default_rng(0)
    kernel = jax.jit(q8.q8_matmul_kernel) if q8.kernel_available() else None
    twin = jax.jit(q8.q8_matmul_twin)
    gemm = jax.jit(lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32))
    print("shape        rows  kernel_ms  twin_ms  bf16_gemm_ms  kernel/gemm  kernel_GB/s")
    for name, (n, k) in SHAPES.items():
        wq = jnp.asarray(rng.integers(-127, 128, (n, k)).astype(np.int8))
        ws = jnp.asarray(rng.uniform(1e-3, 1e-2, (n, k // 32)).astype(np.float16).astype(np.float32))  # GGUF's: float16
        wt, st = (jnp.asarray(a) for a in q8.tile_weight(wq, ws))
        wb = jnp.asarray(rng.standard_normal((n, k)).astype(np.float32)).astype(jnp.bfloat16)
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            xq, xs = q8.quantize_blocks(x)
            tk = timed(kernel, xq, xs, wt, st, repeat=args.repeat) if kernel else float("nan")
            tt = timed(twin, xq, xs, wq, ws, repeat=max(3, args.repeat // 4))
            tg = timed(gemm, x.astype(jnp.bfloat16) if m > 1 else jnp.pad(x, ((0, 3), (0, 0))).astype(jnp.bfloat16),
                       wb, repeat=args.repeat)
            gbs = (wq.nbytes + ws.nbytes) / tk / 1e9
            print(f"{name:12s} {m:4d} {tk * 1e3:10.2f} {tt * 1e3:8.2f} {tg * 1e3:13.2f} {tk / tg:12.2f} {gbs:12.1f}")


if __name__ == "__main__":
    main()
