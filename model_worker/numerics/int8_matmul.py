"""Weight-only int8 products (W8A16) as one Pallas kernel for TPU: y = (x · q[n]) * scale[n] for a per-row int8
weight, the int8 blocks streamed from HBM and converted to the activation dtype in VMEM, next to the MXU.

Why a kernel: XLA's product of bfloat16 activations with an int8 weight converted inside the dot
(`quant.int8_row_scaled`) read the int8 bytes of a decode step at ~56% of the chip's copy bandwidth on one TPU v5e
(Gemma 4 E2B, B=1: 0.76x the bfloat16 step where the bytes alone promise ~0.52x; docs/performance.md, "Fifteenth
session on the chip"), while a Pallas kernel that streams its blocks reached the copy bandwidth (the decode
attention kernel, `numerics.decode_attention`). Here the grid walks the weight in [block_n, block_k] tiles, each
one DMA that Pallas double-buffers, so that a step at a few rows could be bound by the weight's bytes alone —
which on the v5e it was not (below).

What it computes (the same as `quant.int8_row_scaled` up to the order of the float32 sums):

    y[m, n] = round_to(out_dtype)( (Σ_k x[m, k] q[n, k]) * scale[n] )    q int8 [N, K] ([out, in]), scale float32

the int8 values convert to x's dtype exactly (|q| <= 127 fits bfloat16's 8 significant bits), the products sum in
float32 within a tile and across tiles, and the scale multiplies the sum once. Runs on CPU in Pallas's
interpreter (`interpret=True`), which is how the tests compare it with a float64 product.

With int8 activations (`quantize_rows`: one scale per row, W8A8) the product is int8 x int8 on the MXU with exact
int32 sums (|sum| <= K * 127^2 < 2^31 for K < 133,000) and no conversion of the weight at all:

    y[m, n] = round_to(out_dtype)( float32(Σ_k xq[m, k] q[n, k]) * x_scale[m] * scale[n] )

Measured on one TPU v5e, the W8A16 kernel streamed int8 weights no faster than XLA's product (~480 GB/s against
~626 GB/s for bfloat16 weights: docs/performance.md, "Sixteenth session on the chip"), consistent with the
conversion of the weight on the vector unit as the limit; the W8A8 form would remove that conversion (not yet
measured on the chip: `benchmarks/int8_products.py` times it), at the cost of rounding the activations (whose
error the model's bound must then admit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128  # the minor-dimension tile of a TPU array
INT8_SUBLANES = 32  # the second-minor tile of an int8 array ((32, 128) tiles)
MAX_ROWS = 256  # rows of x one kernel call takes whole (decode and verify steps, short prompt chunks); larger
# products stay with XLA
BLOCK_N = 512  # output columns per tile (rows of q)
BLOCK_K = 2048  # input features per tile: with BLOCK_N a 1 MiB int8 tile, large enough that a DMA's fixed cost is small


def fits(m: int, n: int, k: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> bool:
    """Whether `int8_matmul` takes a product of x [m, k] and q [n, k]: at most `MAX_ROWS` rows, and n and k split
    into tiles the TPU's layout allows (`_tiles`)."""
    return 0 < m <= MAX_ROWS and _tiles(n, k, block_n, block_k) is not None


def _tiles(n: int, k: int, block_n: int, block_k: int) -> tuple[int, int] | None:
    """(tn, tk): the largest multiples of 128 at most `block_n` / `block_k` dividing n / k (tn also a multiple of
    int8's 32 sublanes, which 128 is), or None where n or k is not a multiple of 128."""
    if n % LANES or k % LANES:
        return None
    tn = max(t for t in range(LANES, min(block_n, n) + 1, LANES) if n % t == 0)
    tk = max(t for t in range(LANES, min(block_k, k) + 1, LANES) if k % t == 0)
    return tn, tk


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations as int8 with one float32 scale per row (symmetric, round to nearest): x [M, K] ->
    (xq int8 [M, K], x_scale float32 [M, 1]) with |x - xq * x_scale| <= x_scale / 2, x_scale = max|x[m]| / 127
    (a zero row: scale 0, xq 0). The weights' own quantization (`quant.int8_per_channel`) is this, per output
    row."""
    x = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.0
    xq = jnp.clip(jnp.round(x / jnp.where(s > 0, s, 1.0)), -127, 127).astype(jnp.int8)
    return xq, s


def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, *, x_scale: jax.Array | None = None, out_dtype=None,
                block_n: int = BLOCK_N, block_k: int = BLOCK_K, interpret: bool = False) -> jax.Array:
    """y = (x qᵀ) * scale for a per-row int8 weight: sums in float32 (W8A16), or with int8 x and its `x_scale` in
    int32, times x_scale (W8A8).

    Args:
      x: [M, K] activations, bfloat16 or float32 (W8A16), or int8 with `x_scale` (W8A8, `quantize_rows`);
        M <= `MAX_ROWS`.
      q: int8 [N, K], the weight in [out, in] orientation (`quant.Int8Weight.q` of `quant.int8_per_channel`).
      scale: float32 [N] or [N, 1], one scale per output row.
      x_scale: float32 [M, 1] or [M], the rows' scales of an int8 x (required with one, refused without).
      out_dtype: y's dtype (default x's; bfloat16 for an int8 x); the LM head asks for float32 logits.
      block_n, block_k: the largest tile sizes to use (`_tiles` picks divisors of N and K).
      interpret: run in Pallas's interpreter (CPU tests).
    Returns:
      [M, N] in out_dtype.
    Raises:
      ValueError: shapes `fits` refuses (too many rows; N or K not a multiple of 128), mismatched K, or an int8
        x without `x_scale` (or a scale without an int8 x).
    """
    m, k = x.shape
    n, kq = q.shape
    tiles = _tiles(n, k, block_n, block_k)
    if kq != k or m > MAX_ROWS or tiles is None:
        raise ValueError(f"int8_matmul: x {x.shape} and q {q.shape} do not fit (M <= {MAX_ROWS}, N and K multiples "
                         f"of {LANES})")
    w8a8 = x.dtype == jnp.int8
    if w8a8 != (x_scale is not None):
        raise ValueError("int8_matmul: an int8 x needs its x_scale, and only an int8 x takes one")
    tn, tk = tiles
    nk = k // tk
    out_dtype = jnp.dtype(out_dtype or (jnp.bfloat16 if w8a8 else x.dtype))
    kernel = functools.partial(_kernel, steps_k=nk, w8a8=w8a8)
    in_specs = [pl.BlockSpec((m, tk), lambda j, i: (0, i)),
                pl.BlockSpec((tn, tk), lambda j, i: (j, i)),
                pl.BlockSpec((1, tn), lambda j, i: (0, j))]
    args = [x, q, scale.reshape(1, n).astype(jnp.float32)]
    if w8a8:
        in_specs.append(pl.BlockSpec((m, 1), lambda j, i: (0, 0)))
        args.append(x_scale.reshape(m, 1).astype(jnp.float32))
    call = pl.pallas_call(
        kernel,
        grid=(n // tn, nk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((m, tn), lambda j, i: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        scratch_shapes=[pltpu.VMEM((m, tn), jnp.int32 if w8a8 else jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret)
    return call(*args)


def _kernel(x_ref, q_ref, s_ref, *rest, steps_k: int, w8a8: bool):
    """One (column tile, feature tile) grid step: add x's tile times the int8 tile (converted to x's dtype, or as
    int8 x int8 with int32 sums) into the accumulator; the last feature tile scales the columns (and the rows)
    and writes them."""
    if w8a8:
        xs_ref, o_ref, acc_ref = rest
    else:
        o_ref, acc_ref = rest
    i = pl.program_id(1)
    dtype = x_ref.dtype
    if w8a8:
        part = lax.dot_general(x_ref[...], q_ref[...], (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.int32)  # [M, tn], exact
    else:
        # Stated, never read from the process's setting: Mosaic refuses a 16-bit product at HIGHEST, which tests
        # and float32 workers set process-wide; a bfloat16 product is exact at DEFAULT (as in `decode_attention`).
        precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
        part = lax.dot_general(x_ref[...], q_ref[...].astype(dtype), (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)  # [M, tn]

    @pl.when(i == 0)
    def _first():
        acc_ref[...] = part

    @pl.when(i > 0)
    def _more():
        acc_ref[...] += part

    @pl.when(i == steps_k - 1)
    def _write():
        acc = acc_ref[...].astype(jnp.float32)
        if w8a8:
            acc = acc * xs_ref[...]
        o_ref[...] = (acc * s_ref[...]).astype(o_ref.dtype)
