"""Weights that stay quantized on the device, and the one `linear` every projection goes through.

compressed-tensors `pack-quantized` W4A16 (docs/formats.md §1; compressed-tensors
`compressors/pack_quantized/{base.py,helpers.py}`): a Linear weight W [N_out, K_in] is stored as int32 words packing
8 signed 4-bit values along the input axis (value k of a row lives in word k // 8, bits 4*(k % 8)..4*(k % 8)+3,
stored as q + 8), with one scale (and, when asymmetric, one zero point) per group of G input columns:
W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]. The packed words are what stays resident; `linear` unpacks and
scales them inside the jitted step, so no dequantized copy of a weight outlives its matmul.

How `linear` computes x Wᵀ for an `Int4Weight` (figures: docs/performance.md):
  * CPU: the weight is dequantized one block of rows at a time inside a `lax.map` loop (block ≈ 4 MiB of
    dequantized values, so it stays in cache), with the nibbles unpacked by bitcasting `packed ^ 0x88888888` to
    int4 (each nibble becomes its signed q directly). This runs at about the speed of a dense float32 matmul; a
    whole-matrix dequantize-then-dot is several times slower once the dequantized temporary outgrows the cache.
  * Other platforms: whole-matrix shift/mask dequantize then one dot (the portable path; docs/formats.md §1.5 reports
    int4 bitcasts failing in TPU Mosaic kernels, and a GPU compiler may fuse the dequantization into its GEMM).
    Not benchmarked here: no accelerator was available.

`Int8Weight` holds a GGUF block-quantized tensor (docs/formats.md §3) exactly: W[n, k] = q[n, k] * s[n, k // G]
(+ o[n, k // G] for the asymmetric K-quants), with the integers q in int8 and one float32 scale (and offset) per
group (`model_worker.checkpoints.gguf_int8` builds it from Q8_0, Q5_0, Q6_K and Q4_K blocks and checks the values bit for
bit). The embedded Gemma 3's weights are all of these types: held as int8 they take under a third of their float32
size, with the same values. `int8_linear` dequantizes row blocks on CPU like int4, and the embedding lookup
dequantizes only the looked-up rows.

`Bf16Weight` is a projection rounded once to bfloat16, for the worker's opt-in bfloat16 matmul precision
(`--matmul-precision bfloat16`, `bf16_linear`): on CPU a bfloat16 GEMM with float32 sums is faster than the
float32 GEMM after int8 dequantization once a matmul has more than a few rows (prompt chunks).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model_worker.numerics import int8_matmul
from model_worker.numerics.q8 import Q8Weight, q8_linear

# Target size of one dequantized row block on CPU (bytes of the activation dtype): the middle of a range of sizes
# that fit in cache and are equally fast (figures: docs/performance.md).
CPU_BLOCK_BYTES = 4 << 20


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int4Weight:
    """A group-quantized int4 Linear weight in compressed-tensors `pack-quantized` layout (docs/formats.md §1.2–1.4).

    Stored in the Hugging Face orientation [out, in] = [N, K] (dense weights in this project are [in, out]).

    Attributes:
      packed: int32 [N, ceil(K/8)], 8 nibbles per word, natural (sequential) column order, nibble = q + 8
        (compressed-tensors `weight_packed`).
      scale: float [N, K/G] (`weight_scale`; any float dtype, normally the checkpoint's own, bf16 for Google's QAT
        export). Dequantization computes (q - z) * s in float32 and rounds once to the activation dtype.
      zero: int8 [N, K/G] signed zero point in [-8, 7] (the unpacked `weight_zero_point`), or None when symmetric.
      in_features: K (static). K need not be a multiple of 8: the last word's extra nibbles are ignored.
      group_size: G (static); K % G == 0. Channel-wise quantization is G = K.
      row_shards: static; the number of equal contiguous parts the rows (N) are split into across devices under
        tensor parallelism (`model_worker.engine.sharding`), 1 otherwise: the CPU row blocks then stay within a part
        (`_blocked`), so no device needs another's rows.
      col_shards: static; the same for the input columns (K), whose split splits x along its last axis: the
        dependency on x (`_zero_after`) then reads a sum over x's first row, not one element of it.
    """

    packed: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    in_features: int = dataclasses.field(metadata={"static": True})
    group_size: int = dataclasses.field(metadata={"static": True})
    row_shards: int = dataclasses.field(default=1, metadata={"static": True})
    col_shards: int = dataclasses.field(default=1, metadata={"static": True})

    @property
    def out_features(self) -> int:
        """N."""
        return self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        """Resident bytes: packed words (N * ceil(K/8) * 4) + scales (N * K/G * itemsize) + zero points (N * K/G)."""
        return int(sum(x.nbytes for x in (self.packed, self.scale, self.zero) if x is not None))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight:
    """A group-quantized int8 weight [N, K] (Hugging Face [out, in] orientation, like `Int4Weight`).

    W[n, k] = q[n, k] * scale[n, k // G] + offset[n, k // G] (no offset term when offset is None), computed in
    float32 and rounded once to the activation dtype. For GGUF blocks (see `model_worker.checkpoints.gguf_int8`) q * scale is
    exact in float32, so the values equal `gguf.quants.dequantize` bit for bit.

    Attributes:
      q: int8 [N, K].
      scale: float32 [N, K/G].
      offset: float32 [N, K/G], or None (symmetric).
      group_size: G (static); K % G == 0.
      row_shards, col_shards: static; rows / input columns split into this many parts across devices (tensor
        parallelism), as `Int4Weight`'s.
      kernel: static; "xla" (XLA's product), or for a per-row weight (`int8_per_channel`) "pallas": its products of
        at most `int8_matmul.MAX_ROWS` rows through the Pallas kernel `numerics.int8_matmul` on a TPU (other
        backends keep XLA's), "pallas-interpret": that kernel in Pallas's interpreter on any backend (tests).
    """

    q: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    group_size: int = dataclasses.field(metadata={"static": True})
    row_shards: int = dataclasses.field(default=1, metadata={"static": True})
    col_shards: int = dataclasses.field(default=1, metadata={"static": True})
    kernel: str = dataclasses.field(default="xla", metadata={"static": True})

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), the shape of the dense weight."""
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        """Resident bytes: N * K int8 + N * K/G float32 scales (+ as many offsets)."""
        return int(sum(a.nbytes for a in (self.q, self.scale, self.offset) if a is not None))

    def values(self) -> jax.Array:
        """The exact values W as float32 [N, K] (a full dense copy: for preparation and tests)."""
        return _dequant_int8(self.q, self.scale, self.offset, self.group_size, jnp.float32)

    def rows(self, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """Dequantized rows (an embedding lookup): ids int32 [...] -> [..., K] in `dtype`.

        Ids must be in [0, N) (out-of-range ids behave as in `jnp.take`'s default mode).
        """
        take = lambda a: None if a is None else jnp.take(a, ids, axis=0)
        return _dequant_int8(take(self.q), take(self.scale), take(self.offset), self.group_size, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Bf16Weight:
    """A Linear weight rounded once to bfloat16, for bfloat16 matmul precision (see `bf16_linear`;
    `params.with_bf16_matmuls` makes them for the worker's `--matmul-precision bfloat16`).

    Attributes:
      w: bfloat16 [N, K], Hugging Face [out, in] orientation like `Int8Weight` (each value the float32 weight
        rounded to nearest-even bfloat16).
      row_invariant: static; every product on the GEMM, its rows padded to a multiple of `GEMM_ROW_MULTIPLE`
        (`bf16_linear`), for the batch-invariant mode.
    """

    w: jax.Array
    row_invariant: bool = dataclasses.field(default=False, metadata={"static": True})

    @staticmethod
    def of(weight: jax.Array | Int8Weight) -> Bf16Weight:
        """Round a dense [K, N] ([in, out]) float weight or an `Int8Weight` [N, K] (its exact float32 values) to
        bfloat16 [N, K].

        Raises:
          TypeError: any other weight type (an Int4Weight, a Bf16Weight), or a dense weight that is not 2-D.
        """
        if isinstance(weight, Int8Weight):
            return Bf16Weight(_dequant_int8(weight.q, weight.scale, weight.offset, weight.group_size, jnp.bfloat16))
        if not isinstance(weight, (jax.Array, np.ndarray)) or weight.ndim != 2:
            raise TypeError(f"Bf16Weight.of: expected a 2-D dense weight or an Int8Weight, got {type(weight).__name__}"
                            f"{'' if not hasattr(weight, 'shape') else ' of shape ' + str(tuple(weight.shape))}")
        return Bf16Weight(jnp.asarray(weight).T.astype(jnp.bfloat16))

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K)."""
        return tuple(self.w.shape)

    @property
    def nbytes(self) -> int:
        """Resident bytes: 2 N K."""
        return int(self.w.nbytes)


def _dequant_int8(q: jax.Array, scale: jax.Array, offset: jax.Array | None, group_size: int, dtype) -> jax.Array:
    """int8 [..., K], float32 [..., K/G] (x2) -> [..., K] q * s (+ o) in `dtype` (q * s exact, one rounding)."""
    groups = q.reshape(*q.shape[:-1], -1, group_size).astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
    if offset is not None:
        groups = groups + offset.astype(jnp.float32)[..., None]
    return groups.reshape(q.shape).astype(dtype)


# How an Int8Weight named NAME is saved in a flat safetensors dict (the prepared GGUF files): NAME + suffix.
INT8_Q, INT8_SCALE, INT8_OFFSET = ".q8", ".q8_scale", ".q8_offset"


def int8_to_flat(flat: dict) -> dict:
    """Copy of a flat weight dict with every Int8Weight NAME split into NAME.q8 (int8), NAME.q8_scale (f32) and,
    when it has offsets, NAME.q8_offset (f32)."""
    out = {}
    for name, value in flat.items():
        if isinstance(value, Int8Weight):
            out[name + INT8_Q], out[name + INT8_SCALE] = np.asarray(value.q), np.asarray(value.scale)
            if value.offset is not None:
                out[name + INT8_OFFSET] = np.asarray(value.offset)
        else:
            out[name] = value
    return out


def int8_from_flat(flat: dict) -> dict:
    """Inverse of `int8_to_flat`: NAME.q8 + NAME.q8_scale (+ NAME.q8_offset) become Int8Weight NAME
    (G = K / scale columns).

    Raises:
      ValueError: a NAME.q8 without its NAME.q8_scale (or the reverse), or scales/offsets that do not fit q.
    """
    suffixes = (INT8_Q, INT8_SCALE, INT8_OFFSET)
    out = {k: v for k, v in flat.items() if not k.endswith(suffixes)}
    names = {k[: -len(sfx)] for k in flat for sfx in suffixes if k.endswith(sfx)}
    for name in sorted(names):
        q, scale, offset = (flat.get(name + sfx) for sfx in suffixes)
        if q is None or scale is None:
            raise ValueError(f"{name}: int8 weight needs both {name}{INT8_Q} and {name}{INT8_SCALE}")
        fits = lambda a: a.ndim == 2 and a.shape[0] == q.shape[0] and q.shape[1] % a.shape[1] == 0
        if q.ndim != 2 or not fits(scale) or (offset is not None and offset.shape != scale.shape):
            raise ValueError(f"{name}: int8 values {list(q.shape)} do not match scales {list(scale.shape)}"
                             + ("" if offset is None else f" / offsets {list(offset.shape)}"))
        out[name] = Int8Weight(q=q, scale=scale, offset=offset, group_size=q.shape[1] // scale.shape[1])
    return out


def unpack_int4(packed: jax.Array, in_features: int) -> jax.Array:
    """int32 [N, ceil(K/8)] -> int8 [N, K] signed values q in [-8, 7], columns in natural order.

    Nibble j of word w is column 8w + j: stacking the 8 shifted planes on a new last axis and flattening keeps that
    order (concatenating the planes instead would give the plane-major order [0, 8, 16, ..., 1, 9, ...], the
    silent-corruption bug of docs/formats.md §1.5). Matches compressed-tensors `unpack_from_int32(value, 4, shape)`.
    """
    shifts = jnp.arange(8, dtype=jnp.int32) * 4
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [N, K/8, 8]
    q = nibbles.reshape(packed.shape[0], -1)[:, :in_features]
    return (q - 8).astype(jnp.int8)


def dequantize(w: Int4Weight, dtype: jnp.dtype) -> jax.Array:
    """Int4Weight -> dense [N, K] in `dtype`: (q - z) * s computed exactly in float32, rounded once to `dtype`.

    With a bf16 scale and dtype bf16 this equals compressed-tensors' own decompression bit for bit (its
    `dequantize` computes in the scale's dtype, i.e. one bf16 rounding of the same exact product). Inside a jitted
    function the result is a temporary; outside it is a full dense copy (use it for tests and debugging only).
    """
    q = unpack_int4(w.packed, w.in_features).astype(jnp.float32)
    groups = q.reshape(q.shape[0], -1, w.group_size)
    if w.zero is not None:
        groups = groups - w.zero.astype(jnp.float32)[:, :, None]
    dense = groups * w.scale.astype(jnp.float32)[:, :, None]
    return dense.reshape(q.shape).astype(dtype)


def _dequant_bitcast(packed, scale, zero, in_features: int, group_size: int, dtype) -> jax.Array:
    """Rows of an Int4Weight -> dense [n, K] in `dtype`, unpacking with an int4 bitcast (natural order).

    `u ^ 8` is the two's-complement int4 of q = u - 8, so XOR-ing every nibble with 8 and bitcasting int32 -> 8 x
    int4 (lowest nibble first, XLA's little-endian element order) yields q in column order 8w + j.
    """
    n = packed.shape[0]
    q4 = lax.bitcast_convert_type(
        packed ^ jnp.int32(-0x77777778), jnp.int4
    )  # -0x77777778 == 0x88888888 as int32
    q = q4.reshape(n, -1)[:, :in_features].astype(jnp.float32).reshape(n, -1, group_size)
    if zero is not None:
        q = q - zero.astype(jnp.float32)[:, :, None]
    return (q * scale.astype(jnp.float32)[:, :, None]).reshape(n, in_features).astype(dtype)


def _dot_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] · w [n, K]ᵀ -> [..., n]."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def _row_blocks(n: int, k: int, itemsize: int, block_bytes: int) -> tuple[int, int]:
    """(number of blocks, rows per block) so that one dequantized block is about `block_bytes`.

    Prefers an exact divisor of n (no padding) between half and all of the target row count; otherwise pads n up
    to blocks * rows with rows a multiple of 8.
    """
    target = max(8, block_bytes // (k * itemsize))
    if n <= 2 * target:
        return 1, n
    for rows in range(target, target // 2, -1):
        if n % rows == 0:
            return n // rows, rows
    blocks = math.ceil(n / target)
    rows = math.ceil(math.ceil(n / blocks) / 8) * 8
    return math.ceil(n / rows), rows


def _blocked(x: jax.Array, tensors: list, n: int, k: int, dequant, dot, block_bytes: int,
             shards: int = 1) -> jax.Array:
    """x Wᵀ for W [n, k] given as row-aligned `tensors` (None allowed), dequantizing one row block at a time
    inside `lax.map` (the CPU path); `dequant(*block_tensors) -> [rows, k]`, `dot(x, w_block) -> [..., rows]`.
    `shards` > 1: the rows are split into that many equal parts across devices (`Int4Weight.row_shards`); see
    `_blocked_parts`."""
    if shards > 1:
        return _blocked_parts(x, tensors, n, k, dequant, dot, block_bytes, shards)
    blocks, rows = _row_blocks(n, k, jnp.dtype(x.dtype).itemsize, block_bytes)
    if blocks == 1:
        return dot(x, dequant(*tensors))
    pad = blocks * rows - n
    if pad:
        tensors = [None if t is None else jnp.pad(t, ((0, pad), (0, 0))) for t in tensors]
    tensors = [None if t is None else t.reshape(blocks, rows, t.shape[1]) for t in tensors]
    ys = lax.map(lambda ts: dot(x, dequant(*ts)), tensors)  # [blocks, ..., rows]
    y = jnp.moveaxis(ys, 0, -2).reshape(*x.shape[:-1], blocks * rows)
    return y[..., :n] if pad else y


def _blocked_parts(x: jax.Array, tensors: list, n: int, k: int, dequant, dot, block_bytes: int,
                   shards: int) -> jax.Array:
    """`_blocked` for rows split into `shards` equal contiguous parts across devices (tensor parallelism).

    Iteration i of the loop takes row block i of every part at once ([shards, rows, ...], a slice along the
    unsplit axis), so each device reads only its own rows: a loop over blocks of the whole [n, ...] would slice
    along the split axis, which XLA's SPMD partitioner can only do by gathering the whole weight onto every
    device first. The blocks are sized for one part (n / shards rows), and the outputs are put back in row order.
    """
    part = n // shards
    blocks, rows = _row_blocks(part, k, jnp.dtype(x.dtype).itemsize, block_bytes)
    if blocks == 1:  # each device's part is one block: an elementwise dequantization of its own rows
        return dot(x, dequant(*tensors))
    pad = blocks * rows - part
    parts = [None if t is None else t.reshape(shards, part, t.shape[1]) for t in tensors]
    if pad:
        parts = [None if t is None else jnp.pad(t, ((0, 0), (0, pad), (0, 0))) for t in parts]

    def block(i):
        ts = [None if t is None else lax.dynamic_slice_in_dim(t, i * rows, rows, axis=1) for t in parts]
        return dot(x, dequant(*(None if t is None else t.reshape(shards * rows, t.shape[2]) for t in ts)))

    ys = lax.map(block, jnp.arange(blocks, dtype=jnp.int32))  # [blocks, ..., shards * rows]
    ys = ys.reshape(ys.shape[:-1] + (shards, rows))
    y = jnp.moveaxis(ys, 0, -2).reshape(*x.shape[:-1], shards, blocks * rows)  # each part's rows in order
    return (y[..., :part] if pad else y).reshape(*x.shape[:-1], n)


def _linear_blocked(x: jax.Array, w: Int4Weight, block_bytes: int = CPU_BLOCK_BYTES) -> jax.Array:
    """x Wᵀ, dequantizing one row block of W at a time inside `lax.map` (the CPU path)."""
    k, g = w.in_features, w.group_size
    return _blocked(x, [w.packed, w.scale, w.zero], w.out_features, k,
                    lambda p, s, z: _dequant_bitcast(p, s, z, k, g, x.dtype), _dot_nt, block_bytes, w.row_shards)


def _linear_plain(x: jax.Array, w: Int4Weight) -> jax.Array:
    """x Wᵀ with one whole-matrix shift/mask dequantization (the portable path)."""
    return _dot_nt(x, dequantize(w, x.dtype))


def zero_from(x: jax.Array, dtype) -> jax.Array:
    """A scalar 0 of `dtype` computed from x's first element in a way XLA cannot fold (for v = its bits,
    min(v, 0) & max(v, 0) is 0 for every bit pattern, NaN included): adding it to an array makes that array's
    consumers wait for x without changing a bit (see `_after`)."""
    v = lax.bitcast_convert_type(x.reshape(-1)[0].astype(jnp.float32), jnp.int32)
    return (jnp.minimum(v, 0) & jnp.maximum(v, 0)).astype(dtype)


def _zero_after(x: jax.Array, w: Int4Weight | Int8Weight, dtype) -> jax.Array:
    """`zero_from(x)`, for the dependencies of `_after` and `int8_linear`. A weight split by input columns across
    devices (`col_shards` > 1) has x split along its last axis, and reading one element of it made XLA gather all
    of x onto every device (seen on CPU, once per such projection and step); the sum of x's first row is one
    all-reduced scalar instead, and is as unfoldable."""
    if w.col_shards == 1:
        return zero_from(x, dtype)
    return zero_from(jnp.sum(x.reshape(-1, x.shape[-1])[:1], axis=-1), dtype)


def _after(x: jax.Array, w: Int4Weight) -> Int4Weight:
    """Make W's unpacking data-dependent on x, so XLA cannot schedule it before the layer runs.

    Without this, XLA (seen on CPU) computes every layer's dequantization up front — they depend only on the
    parameters — and keeps all of them alive: the temporaries equal a full dense copy of the weights, the very
    thing int4 storage avoids (tests/model_worker/test_resident_bytes.py catches it). For v = the bits of one
    activation, min(v, 0) & max(v, 0) is 0 for every bit pattern (one operand is 0), NaN included, but XLA does
    not prove it, so `scale + dep` is the scale itself (a zero scale may lose its sign, which changes no sum), and
    every dequantization needs it, so none can run before x exists. (An `optimization_barrier` is expanded before
    scheduling on CPU and does not help.) The dependency goes on the scales, not on `packed`: `packed | dep`
    copied the whole packed weight on every call, which made weights larger than the cache much slower
    (figures: docs/performance.md).
    """
    return dataclasses.replace(w, scale=w.scale + _zero_after(x, w, w.scale.dtype))


def int4_linear(
    x: jax.Array,
    w: Int4Weight,
    impl: Literal["auto", "blocked", "plain"] = "auto",
    block_bytes: int = CPU_BLOCK_BYTES,
) -> jax.Array:
    """y = x Wᵀ for an Int4Weight W [N, K] (compressed-tensors layout) without a resident dequantized copy.

    Args:
      x: [..., K] activations (float32 or bfloat16).
      w: Int4Weight with in_features K.
      impl: "auto" = "blocked" when lowered for CPU, "plain" elsewhere (chosen at lowering time with
        `lax.platform_dependent`); "blocked" = row blocks of about `block_bytes` dequantized with an int4 bitcast
        inside `lax.map`; "plain" = whole-matrix shift/mask dequantization then one dot.
      block_bytes: dequantized bytes per row block for "blocked".
    Returns:
      [..., N] in x.dtype. Every impl dequantizes the same exact (q - z) * s (float32, rounded once to x.dtype),
      so they differ only by matmul summation order.
    Raises:
      ValueError: x's last axis is not K, or an unknown impl.

    On CPU "blocked" stays close to a dense matmul where "plain" falls far behind once the weight outgrows the
    cache, at a few times plain's compile cost per call site. Rejected variants, slower than these overall: applying
    scales after a per-group einsum ([..., N, K/G] partial sums), shift/mask unpacking inside the row blocks, a
    fused multiply-reduce (no dot), a plane-major dot (activations permuted instead of nibbles interleaved)
    (figures: docs/performance.md).
    """
    if x.shape[-1] != w.in_features:
        raise ValueError(f"int4_linear: x has {x.shape[-1]} features, weight expects {w.in_features}")
    w = _after(x, w)
    if impl == "blocked":
        return _linear_blocked(x, w, block_bytes)
    if impl == "plain":
        return _linear_plain(x, w)
    if impl != "auto":
        raise ValueError(f"int4_linear: unknown impl {impl!r}")
    return lax.platform_dependent(
        x, w, cpu=lambda x, w: _linear_blocked(x, w, block_bytes), default=_linear_plain
    )


def _matmul_t(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., K] @ w [n, K]ᵀ -> [..., n] (in `out_dtype`, accumulated at least at that precision; default x's
    dtype), written as a transpose then a matmul: for an int8 block XLA CPU then fuses the dequantization into its
    matrix-vector loop at one row of x (about twice as fast for the LM head; figures: docs/performance.md), where
    `_dot_nt`'s dot_general materializes the block first."""
    return jnp.matmul(x, w.T, preferred_element_type=out_dtype)


def int8_per_channel(w: jax.Array) -> Int8Weight:
    """Weight-only int8 of a dense weight [N, K] ([out, in]): one symmetric float32 scale per output row,
    scale = max|w[n]| / 127 and q = round(w / scale) (a zero row: scale 0, q 0), so |W - q scale| <= scale / 2.

    Why per row: the product then scales its output columns, y[:, n] = (x . q[n]) * scale[n]
    (`int8_row_scaled`): the int8 values convert to the activation dtype exactly inside the product (|q| <= 127
    fits bfloat16's 8 bits), with no dequantized copy of the weight (W8A16, as JetStream and AQT serve on TPU).
    """
    q, scale = int8_matmul.quantize_rows(w)  # the rounding W8A8's activations get too
    return Int8Weight(q, scale, None, group_size=w.shape[1])


def int8_row_scaled(x: jax.Array, w: Int8Weight, out_dtype=None) -> jax.Array:
    """y = x Wᵀ for a per-row `Int8Weight` (`int8_per_channel`: group_size = K, no offset) as
    (x q[n]ᵀ, summed in float32) * scale[n], rounded once to `out_dtype` (default x's): x [M, K] -> [M, N].

    It differs from dequantize-then-multiply only in where the scale's rounding falls (after the sum instead of
    on each weight), an error below the quantization step's."""
    y = _matmul_t(x, w.q.astype(x.dtype), jnp.float32) * w.scale[:, 0]
    return y.astype(out_dtype or x.dtype)


def int8_linear(x: jax.Array, w: Int8Weight, block_bytes: int = 2 * CPU_BLOCK_BYTES, out_dtype=None) -> jax.Array:
    """y = x Wᵀ for an Int8Weight W [N, K] without a resident dequantized copy.

    Args:
      x: [..., K] activations (float32 or bfloat16).
      w: Int8Weight [N, K].
      block_bytes: dequantized bytes per row block on CPU.
      out_dtype: dtype of y (and of the accumulation), default x's; the LM head asks for float32 so that bfloat16
        activations still give float32 logits.
    Returns:
      [..., N]; every path dequantizes the same exact values, so they differ only by summation order (and a
      per-row weight off the CPU by where its scale is applied: `int8_row_scaled`).
    Raises:
      ValueError: x's last axis is not K.

    CPU: row blocks of about `block_bytes` dequantized inside `lax.map`, as `int4_linear` (a weight smaller than
    that is one block); other platforms: one whole-matrix dequantization then a dot. On CPU the row blocks beat
    resident float32 at every batch size measured, and blocks that outgrow the cache lose that advantage
    (figures: docs/performance.md).
    A dequantization outside a loop (one CPU block, or the whole matrix elsewhere) gets scales that depend on x
    (see `_after`: otherwise XLA dequantizes every layer up front, slowing every step); CPU row blocks need no
    dependency (they are dequantized inside the loop) and must not get one on q (`q | dep` copies all of q on
    every call) (figures: docs/performance.md).
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"int8_linear: x has {x.shape[-1]} features, weight expects {k}")
    g = w.group_size
    blocks, _ = _row_blocks(n // w.row_shards, k, jnp.dtype(x.dtype).itemsize, block_bytes)  # per device
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    dot = lambda a, b: _matmul_t(a, b, out_dtype)

    def cpu(x, q, s, o):
        if blocks == 1:
            s = s + _zero_after(x, w, s.dtype)
        deq = lambda q, s, o: _dequant_int8(q, s, o, g, x.dtype)
        return _blocked(x, [q, s, o], n, k, deq, dot, block_bytes, w.row_shards)

    def plain(x, q, s, o):
        if g == k and o is None:  # one scale per row: scale the product's columns, no dequantized copy
            return int8_row_scaled(x, dataclasses.replace(w, q=q, scale=s + _zero_after(x, w, s.dtype)), out_dtype)
        return dot(x, _dequant_int8(q, s + _zero_after(x, w, s.dtype), o, g, x.dtype))

    if _takes_kernel(w, x2.shape[0]):
        kernel = lambda x, q, s, o: int8_matmul.int8_matmul(x, q, s, out_dtype=out_dtype,
                                                            interpret=w.kernel == "pallas-interpret")
        if w.kernel == "pallas":  # Mosaic's kernel on a TPU; XLA's product on every other backend
            y = lax.platform_dependent(x2, w.q, w.scale, w.offset, tpu=kernel, cpu=cpu, default=plain)
        else:
            y = kernel(x2, w.q, w.scale, w.offset)
        return y.reshape(*lead, n)
    y = lax.platform_dependent(x2, w.q, w.scale, w.offset, cpu=cpu, default=plain)
    return y.reshape(*lead, n)


def _takes_kernel(w: Int8Weight, rows: int) -> bool:
    """Whether `int8_linear` runs a product of `rows` rows through the Pallas kernel: the weight asks for it
    (`Int8Weight.kernel`), has one scale per row and no offset, is not split across devices, and the shapes fit
    (`int8_matmul.fits`); otherwise XLA's product."""
    n, k = w.shape
    return (w.kernel != "xla" and w.group_size == k and w.offset is None and w.row_shards == w.col_shards == 1
            and int8_matmul.fits(rows, n, k))


# The batch-invariant path runs every bfloat16 GEMM on a row count that is a multiple of this. XLA CPU's bfloat16
# GEMM computes a row independently of the other rows for such counts on every CPU checked (an AMD EPYC Zen 4:
# any count from 2; an Intel Xeon with AMX, whose kernels give rows of a count that is 1 or 2 more than a multiple
# of 4 (m = 2, 17, 18, ...) other bits); tests/model_worker/test_batch_invariance.py pins it on the machine
# running the tests, and docs/architecture.md ("bfloat16 matmul precision with batch invariance") says why.
GEMM_ROW_MULTIPLE = 4


def gemm_row_pad(rows: int) -> int:
    """How many zero rows the batch-invariant path appends to a product of `rows` rows (see
    `GEMM_ROW_MULTIPLE`)."""
    return -rows % GEMM_ROW_MULTIPLE


def bf16_linear(x: jax.Array, w: Bf16Weight, out_dtype=None) -> jax.Array:
    """y = x Wᵀ at bfloat16 matmul precision: y[n] = Σ_k bf16(x[k]) · W[n, k], products and sums in float32
    (what jax's `Precision.DEFAULT` means on TPU, and how GPU servers run bf16 checkpoints).

    Args:
      x: [..., K] activations (float32, or bfloat16).
      w: Bf16Weight [N, K].
      out_dtype: dtype of y, default x's (the LM head asks for float32).
    Returns:
      [..., N]. From 2 rows up, one bfloat16 GEMM: XLA CPU's computes each output row independently of the other
      rows and of their number (tests/model_worker/test_batch_invariance.py pins it). One row on CPU: the weight
      converted to float32 in front of a float32 product, which XLA fuses into its matrix-vector loop (its
      bfloat16 matrix-vector product is many times slower). With `w.row_invariant` the rows are padded with
      zeros to a multiple of `GEMM_ROW_MULTIPLE` and always take the GEMM, so that a row's result equals the
      same row's in any batch (`--batch-invariant`; a B=1 decode step's LM head then runs at GEMM speed;
      figures: docs/performance.md).
    Raises:
      ValueError: x's last axis is not K.
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"bf16_linear: x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    xb = x.reshape(-1, k).astype(jnp.bfloat16)
    rows = xb.shape[0]
    gemm = lambda xb, wb: lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if w.row_invariant and gemm_row_pad(rows):  # rows in a count whose GEMM kernels treat every row alike
        y = gemm(jnp.pad(xb, ((0, gemm_row_pad(rows)), (0, 0))), w.w)[:rows]
    elif rows == 1:
        one_row = lambda xb, wb: _matmul_t(xb.astype(jnp.float32), wb.astype(jnp.float32))
        # Off CPU the one row rides in a GEMM of `GEMM_ROW_MULTIPLE` rows: a v5e's 1-row product missed the float32
        # summation bound 8-200 times where 2+ rows met it (tests/model_worker/test_bf16_matmul.py, device lane).
        padded = lambda xb, wb: gemm(jnp.pad(xb, ((0, GEMM_ROW_MULTIPLE - 1), (0, 0))), wb)[:1]
        y = lax.platform_dependent(xb, w.w, cpu=one_row, default=padded)
    else:
        y = gemm(xb, w.w)
    return y.astype(out_dtype or x.dtype).reshape(*lead, n)


def linear(x: jax.Array, w: jax.Array | Int4Weight | Int8Weight | Bf16Weight | Q8Weight) -> jax.Array:
    """y = x W for a dense weight stored [in, out], or x Wᵀ for an Int4Weight / Int8Weight / Bf16Weight /
    Q8Weight stored [out, in] (HF layout).

    Args:
      x: [..., K] activations.
      w: dense [K, N] array, or Int4Weight / Int8Weight / Bf16Weight / Q8Weight with K inputs (`int4_linear` impl
        "auto", `int8_linear`, `bf16_linear`, `q8.q8_linear`).
    Returns:
      [..., N] in x.dtype.
    """
    if isinstance(w, Int4Weight):
        return int4_linear(x, w)
    if isinstance(w, Int8Weight):
        return int8_linear(x, w)
    if isinstance(w, Bf16Weight):
        return bf16_linear(x, w)
    if isinstance(w, Q8Weight):
        return q8_linear(x, w)
    return x @ w
