#!/usr/bin/env python3
"""The projections of one Gemma 4 E2B decode step without attention, three ways, on whatever device JAX has (the
question is a TPU's): bfloat16 weights (XLA's product), int8 weights converted inside XLA's product
(`quant.int8_row_scaled`, today's `--matmul-precision int8` off CPU) and int8 weights through the Pallas kernel
(`numerics.int8_matmul`, at a few tile sizes), and (`--w8a8`, the default) with the activations also quantized to
int8 per row, int8 x int8 on the MXU (XLA's product and the kernel's). Prints, per batch of rows, each variant's time per pass, the
weight bytes it streamed per second as a fraction of the measured copy bandwidth, and its ratio to bfloat16.
Not a test: one run, medians of timed repeats.

    python benchmarks/int8_products.py [--batches 1 8 32 128 256] [--layers 35] [--tiles 512x2048 1024x1536]

The chain is E2B's (hidden 1536; q 2048, k and v 256, o, and a gated MLP of 6144 in the first 15 layers, 12288 in
the 20 that share K/V; then the tied LM head of 262,144 x 1536), each product feeding the next as in the model, so
the device cannot overlap them. A CPU run (`--layers 2 --head 4096 --interpret`) checks the script, not speed.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from jax import lax

from model_worker.numerics.int8_matmul import int8_matmul, quantize_rows
from model_worker.numerics.quant import int8_per_channel, int8_row_scaled

HIDDEN = 1536


def shapes(layers: int, head: int) -> list[list[tuple[int, int]]]:
    """Per layer the [out, in] shapes of q, k, v, o, gate, up, down; then [[head, HIDDEN]] for the LM head."""
    out = []
    for i in range(layers):
        mlp = 6144 if i < min(15, layers) else 12288
        out.append([(2048, HIDDEN), (256, HIDDEN), (256, HIDDEN), (HIDDEN, 2048), (mlp, HIDDEN), (mlp, HIDDEN),
                     (HIDDEN, mlp)])
    return out + [[(head, HIDDEN)]]


def make_weights(plan, key):
    """bfloat16 weights [out, in] of `plan`, normal / sqrt(in)."""
    ws = []
    for layer in plan:
        row = []
        for n, k in layer:
            key, sub = jax.random.split(key)
            row.append((jax.random.normal(sub, (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16))
        ws.append(row)
    return ws


def chain(x, ws, product):
    """E2B's projections in order, each feeding the next: x [M, HIDDEN] bfloat16 -> logits [M, head] float32."""
    *layers, (head,) = ws
    for q, k, v, o, gate, up, down in layers:
        h = product(x, q) + jnp.pad(product(x, k) + product(x, v), ((0, 0), (0, 2048 - 256)))
        x = x + product(h, o) * 0.01
        g = product(x, gate)
        x = x + product((jax.nn.gelu(g) * product(x, up)).astype(x.dtype), down) * 0.01
    return product(x, head, jnp.float32)


def timed(fn, *args, repeats: int) -> float:
    """Median seconds of one call, after a warm-up call."""
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> None:
    """Parse flags, build the weights once, time every variant at every batch."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--head", type=int, default=262_144, help="rows of the LM head")
    ap.add_argument("--tiles", nargs="+", default=["512x2048", "1024x1536", "256x1536", "2048x768"],
                    help="Pallas tiles NxK (the largest divisors at most these)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--w8a8", action=argparse.BooleanOptionalAction, default=True,
                    help="also int8 activations (one scale per row) times the int8 weights, XLA's and the kernel's")
    ap.add_argument("--interpret", action="store_true", help="Pallas in its interpreter (a CPU check of the script)")
    args = ap.parse_args()

    buf = jnp.ones((256 * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1)
    bandwidth = 2 * buf.nbytes / timed(copy, buf, repeats=args.repeats)
    del buf
    plan = shapes(args.layers, args.head)
    dense = make_weights(plan, jax.random.PRNGKey(0))
    quant = jax.jit(int8_per_channel)
    qs = [[quant(w) for w in layer] for layer in dense]
    bytes_bf16 = sum(w.nbytes for layer in dense for w in layer)
    bytes_int8 = sum(w.q.nbytes + w.scale.nbytes for layer in qs for w in layer)
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; weights bf16 "
          f"{bytes_bf16 / 2**30:.2f} GiB, int8 {bytes_int8 / 2**30:.2f} GiB")

    variants = {"bf16 (XLA)": (dense, lambda x, w, out=None: jnp.matmul(
        x, w.T, preferred_element_type=jnp.float32).astype(out or x.dtype), bytes_bf16),
        "int8 (XLA)": (qs, lambda x, w, out=None: int8_row_scaled(x, w, out), bytes_int8)}
    def w8a8_xla(x, w, out=None):
        xq, xs = quantize_rows(x)
        acc = lax.dot_general(xq, w.q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        return (acc.astype(jnp.float32) * xs * w.scale[:, 0]).astype(out or x.dtype)

    def w8a8_pallas(x, w, out=None):
        xq, xs = quantize_rows(x)
        return int8_matmul(xq, w.q, w.scale, x_scale=xs, out_dtype=out or x.dtype, block_n=1024, block_k=1536,
                           interpret=args.interpret)

    if args.w8a8:
        variants["int8 x int8 (XLA)"] = (qs, w8a8_xla, bytes_int8)
        variants["int8 x int8 Pallas 1024x1536"] = (qs, w8a8_pallas, bytes_int8)
    for tile in args.tiles:
        bn, bk = (int(v) for v in tile.split("x"))
        variants[f"int8 Pallas {tile}"] = (qs, lambda x, w, out=None, bn=bn, bk=bk: int8_matmul(
            x, w.q, w.scale, out_dtype=out, block_n=bn, block_k=bk, interpret=args.interpret), bytes_int8)

    print(f"\n| rows | {' | '.join(variants)} |")
    print("|---:|" + "---:|" * len(variants))
    for m in args.batches:
        x = jax.random.normal(jax.random.PRNGKey(m), (m, HIDDEN), jnp.float32).astype(jnp.bfloat16)
        cells, base, ref = [], None, None
        for name, (ws, product, nbytes) in variants.items():
            fn = jax.jit(lambda x, ws, product=product: chain(x, ws, product))
            try:
                t = timed(fn, x, ws, repeats=args.repeats)
                y = fn(x, ws)
            except Exception as err:  # noqa: BLE001 - a variant the compiler refuses is reported, not fatal
                cells.append(f"failed: {type(err).__name__}: {str(err).splitlines()[0][:80]}")
                continue
            base = base or t
            err_note = ""
            if name.startswith("int8"):
                if ref is None:
                    ref = y
                else:
                    err_note = f", max|d| {float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))):.1e}"
            cells.append(f"{t * 1e3:.2f} ms, {t / base:.2f}x ({nbytes / t / bandwidth:.0%}{err_note})")
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)
    print("\n(ms per pass, ratio to bf16 (XLA), weight bytes per second as a fraction of the copy bandwidth; "
          "max|d|: largest difference from int8 (XLA)'s logits over their largest magnitude)")


if __name__ == "__main__":
    main()
