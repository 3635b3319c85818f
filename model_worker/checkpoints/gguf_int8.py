"""GGUF block-quantized tensors -> `Int8Weight`, value for value (docs/formats.md §3; ggml `ggml-quants.c` block
layouts, gguf-py `quants.py`).

Every block type used by the embedded Gemma 3 270M Q4_K_M file is an integer times a per-group float (plus a
per-group offset for Q4_K), where the integer fits in int8 and the float product is exact in float32:

  Q8_0  34-byte blocks of 32: f16 d, 32 x int8 q              w = d * q            -> G = 32, scale d
  Q5_0  22-byte blocks of 32: f16 d, 5-bit q in [0, 32)       w = d * (q - 16)     -> G = 32, scale d
  Q6_K  210-byte blocks of 256: ..., int8 sc[16], f16 d       w = (d * sc) * q6    -> G = 16, scale d * sc
  Q4_K  144-byte blocks of 256: f16 d, f16 dmin, 12 bytes of
        6-bit (sc, m) pairs for 8 groups, 4-bit q             w = (d*sc) * q - dmin*m -> G = 32, + offset

Only the per-group floats are read from the block bytes (the headers above); the integers are recovered from
gguf-py's own dequantized values as rint((w - offset) / scale), and the result is then checked: q * scale
(+ offset) must reproduce gguf-py's float32 values bit for bit, or the tensor stays dense (`int8_from_gguf`
returns None). So a misread header can cost memory, never correctness.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from model_worker.numerics.quant import Int8Weight

# Bytes per block and values per block of the supported types.
_BLOCK = {T.Q8_0: (34, 32), T.Q5_0: (22, 32), T.Q6_K: (210, 256), T.Q4_K: (144, 256)}
SUPPORTED = frozenset(_BLOCK)
# Values per group (one scale, and for Q4_K one offset, each) of the Int8Weight a type becomes.
_GROUP = {T.Q8_0: 32, T.Q5_0: 32, T.Q6_K: 16, T.Q4_K: 32}


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 little-endian halves -> float32 [...]."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _q4_k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K block [..., 12] -> (sc, m) uint8 [..., 8] (ggml `get_scale_min_k4`):
    groups 0-3 take the low 6 bits of bytes j and j+4; groups 4-7 take a nibble of byte j+4 plus the top 2 bits
    of bytes j-4 (scale) and j (min)."""
    s = s.astype(np.uint8)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_sc, hi_sc], -1), np.concatenate([lo_m, hi_m], -1)


def _group_floats(blocks: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Block bytes [N, nb, block_bytes] -> (scale [N, K/G], offset [N, K/G] or None, G), all float32."""
    n = blocks.shape[0]
    if qtype in (T.Q8_0, T.Q5_0):
        return _f16(blocks[..., 0:2]).reshape(n, -1), None, _GROUP[qtype]
    if qtype == T.Q6_K:
        d = _f16(blocks[..., 208:210])
        sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
        return (d[..., None] * sc).reshape(n, -1), None, _GROUP[qtype]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _q4_k_scales_mins(blocks[..., 4:16])
    scale = d[..., None] * sc.astype(np.float32)
    offset = -(dmin[..., None] * m.astype(np.float32))
    return scale.reshape(n, -1), offset.reshape(n, -1), _GROUP[qtype]


def int8_from_gguf(raw: np.ndarray, qtype, dense: np.ndarray) -> Int8Weight | None:
    """A GGUF tensor as an Int8Weight with exactly its values, or None when that is not possible.

    Args:
      raw: the tensor's block bytes as `GGUFReader` exposes them (uint8 [N, bytes per row]).
      qtype: its `GGMLQuantizationType`.
      dense: float32 [N, K], `gguf.quants.dequantize(raw, qtype)`.
    Returns:
      Int8Weight [N, K] (host numpy arrays) whose q * scale (+ offset) equals `dense` bit for bit; None for an
      unsupported type, a shape the blocks do not tile, or values that do not round-trip.
    """
    if qtype not in _BLOCK or dense.ndim != 2:
        return None
    n, k = dense.shape
    block_bytes, block_values = _BLOCK[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if k % block_values or raw.size != n * (k // block_values) * block_bytes:
        return None
    scale, offset, g = _group_floats(raw.reshape(n, k // block_values, block_bytes), qtype)
    groups = np.asarray(dense, np.float32).reshape(n, k // g, g)
    shifted = groups - offset[..., None] if offset is not None else groups
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(shifted / scale[..., None])  # float32 throughout: the embedding has 168M values
    zero = scale == 0
    if zero.any():
        # A zero scale (e.g. a Q6_K sub-scale of 0) loses q but keeps the sign of the product: q = -1 when that
        # sign differs from the scale's, else 0, so q * s is the same signed zero (with an offset: q = 0).
        flips = np.signbit(groups[zero]) != np.signbit(scale[zero])[:, None] if offset is None else False
        q[zero] = np.where(flips, -1.0, 0.0)
    if q.size and (not np.isfinite(q).all() or q.min() < -128 or q.max() > 127):  # a NaN or inf cannot round-trip
        return None
    q = q.astype(np.int8)
    recon = q.astype(np.float32) * scale[..., None]
    if offset is not None:
        recon = recon + offset[..., None]
    if not np.array_equal(recon.view(np.uint32), groups.view(np.uint32)):  # bits, so -0.0 != +0.0
        return None
    return Int8Weight(q=q.reshape(n, k), scale=scale, offset=offset, group_size=g)


#: Rows per piece in `int8_by_rows`: ~1-2 MiB of block bytes, so each piece's float32 temporaries (a few MiB) stay
#: in the cache instead of a dozen whole-tensor temporaries (the embedding: 168M values, 670 MB each), whose page
#: faults and memory traffic made the embedded model's preparation take ~20 s on two cores.
ROWS_PER_PIECE = 2048


def int8_by_rows(raw: np.ndarray, qtype, rows: int = ROWS_PER_PIECE) -> Int8Weight | None:
    """`int8_from_gguf` of a whole tensor, computed `rows` rows at a time from its block bytes (gguf-py's
    dequantization of each piece as the reference): the same result, without the tensor's dense float32 copy.

    Args:
      raw: uint8 [N, bytes per row], the tensor's block bytes (`GGUFReader`'s `data`).
      qtype: its `GGMLQuantizationType`.
      rows: rows per piece.
    Returns:
      The Int8Weight of every row, or None when `int8_from_gguf` gives None for any piece (the caller then keeps
      the tensor dense).
    """
    from gguf import quants

    if qtype not in _BLOCK or raw.ndim != 2:
        return None
    pieces = []
    for start in range(0, raw.shape[0], rows):
        piece = raw[start : start + rows]
        packed = int8_from_gguf(piece, qtype, np.asarray(quants.dequantize(piece, qtype), np.float32))
        if packed is None:
            return None
        pieces.append(packed)
    if len(pieces) == 1:
        return pieces[0]
    offsets = [p.offset for p in pieces]
    return Int8Weight(q=np.concatenate([p.q for p in pieces]), scale=np.concatenate([p.scale for p in pieces]),
                      offset=None if offsets[0] is None else np.concatenate(offsets),
                      group_size=pieces[0].group_size)


def int8_layout(raw: np.ndarray, qtype) -> Int8Weight | None:
    """The Int8Weight `int8_by_rows(raw, qtype)` is expected to return, with zeros for values (np.zeros: pages
    untouched until written; one value set, see below), read from the block type and byte shape alone; None where
    it would return None for the type or the shape. Values that fail to round-trip are not foreseen: a layout is
    a forecast (the worker compiles early from it, `model_worker.server.early`), never a substitute for the
    weights.

    Args: raw: uint8 [N, bytes per row]; qtype: its `GGMLQuantizationType`.
    """
    if qtype not in _BLOCK or raw.ndim != 2 or raw.shape[1] % _BLOCK[qtype][0]:
        return None
    block_bytes, block_values = _BLOCK[qtype]
    n, k = raw.shape[0], raw.shape[1] // block_bytes * block_values
    g = _GROUP[qtype]
    offset = np.zeros((n, k // g), np.float32) if qtype == T.Q4_K else None
    q, scale = np.zeros((n, k), np.int8), np.zeros((n, k // g), np.float32)
    if qtype != T.Q5_0 and n and k:
        # The CPU kernel's weights take 5-bit tiles when every integer fits (`q8.q8_weight`): a Q5_0 tensor's do
        # (its integers are -16..15), the others' in practice do not; one full-range value says so, where zeros
        # would say 5 bits everywhere.
        q[0, 0], scale[0, 0] = 127, 1.0
    return Int8Weight(q=q, scale=scale, offset=offset, group_size=g)
