"""GGUF blocks kept as int8 (`Int8Weight`, `gguf_int8`): values checked bit for bit against the `gguf` library's
own dequantizer (on random blocks of every supported type and on matrices of the embedded model), the matmul
against a float64 reference with the rigorous float32 dot error bound |y - y_exact| <= (K + 2) * 2^-24 *
(|x| @ |W|ᵀ), and the model's forward against the same weights held dense in float32.

Exactness: a block value is an integer of at most 8 bits times a float of at most 11 (f16) + 8 (the K-quants'
sub-scales) significant bits, so the product is exact in float32 and our dequantized values equal the library's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from common.preparation import open_gguf
from families.gemma3.worker import GEMMA3_270M, gemma3_layers
from model_worker.checkpoints.gguf_int8 import SUPPORTED, int8_by_rows, int8_from_gguf
from model_worker.modeling.kv_cache import KVCache
from model_worker.modeling.model import forward_jit
from model_worker.modeling.params import Params, random_flat, to_device, with_q8_matmuls
from model_worker.numerics import q8
from model_worker.numerics.quant import Int8Weight, _dequant_int8, int8_from_flat, int8_linear, int8_to_flat

BLOCK = {T.Q8_0: (34, 32, [0]), T.Q5_0: (22, 32, [0]), T.Q6_K: (210, 256, [208]), T.Q4_K: (144, 256, [0, 2])}


def random_blocks(rng: np.random.Generator, qtype, n: int, k: int, d: float = 2.0**-10) -> tuple[np.ndarray, np.ndarray]:
    """(random block bytes [n, ...], the library's dequantization float32 [n, k]). Any bytes are a valid block once
    its f16 scales are finite: those fields are set to halves in [d/2, 2d]."""
    nbytes, per, halves = BLOCK[qtype]
    raw = rng.integers(0, 256, (n, k // per, nbytes), dtype=np.uint8)
    for at in halves:
        halves = (rng.uniform(0.5, 2.0, raw.shape[:2]) * d).astype("<f2")
        raw[..., at:at + 2] = halves[..., None].view(np.uint8)
    raw = raw.reshape(n, -1)
    return raw, np.asarray(quants.dequantize(raw, qtype), np.float32)


def to_jax(w: Int8Weight) -> Int8Weight:
    return jax.tree.map(jnp.asarray, w)


def dense_of(w: Int8Weight) -> np.ndarray:
    w = to_jax(w)
    return np.asarray(_dequant_int8(w.q, w.scale, w.offset, w.group_size, jnp.float32))


@pytest.mark.parametrize("qtype", sorted(SUPPORTED, key=lambda t: t.name), ids=lambda t: t.name)
def test_blocks_become_int8_with_exactly_the_library_values(qtype):
    raw, ref = random_blocks(np.random.default_rng(int(qtype)), qtype, 6, 512)
    w = int8_from_gguf(raw, qtype, ref)
    assert w is not None and w.q.dtype == np.int8 and w.shape == (6, 512)
    assert w.group_size == (16 if qtype == T.Q6_K else 32) and (w.offset is not None) == (qtype == T.Q4_K)
    np.testing.assert_array_equal(dense_of(w), ref)  # dequantized by JAX, compared bit for bit
    assert w.nbytes < ref.nbytes / 2.5


def test_values_that_do_not_round_trip_stay_dense():
    raw, ref = random_blocks(np.random.default_rng(9), T.Q5_0, 4, 64)
    assert int8_from_gguf(raw, T.Q5_0, ref) is not None
    assert int8_from_gguf(raw, T.Q5_0, ref * 1.0001) is None, "values that are not d * q must not be packed"
    assert int8_from_gguf(raw, T.Q5_0, ref[:, :32]) is None, "a shape the bytes do not hold"
    assert int8_from_gguf(raw, T.F16, ref) is None, "an unsupported type"


@pytest.mark.parametrize("qtype", sorted(SUPPORTED, key=lambda t: t.name), ids=lambda t: t.name)
def test_a_tensor_packed_piece_by_piece_equals_it_packed_whole(qtype):
    """`int8_by_rows` (pieces of 3 rows, the last one short) gives the whole tensor's arrays, bit for bit."""
    raw, ref = random_blocks(np.random.default_rng(int(qtype) + 1), qtype, 7, 512)
    whole, pieces = int8_from_gguf(raw, qtype, ref), int8_by_rows(raw, qtype, rows=3)
    for field in ("q", "scale", "offset"):
        a, b = getattr(whole, field), getattr(pieces, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, field
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=field)
    assert pieces.group_size == whole.group_size


def test_one_piece_that_does_not_round_trip_keeps_the_tensor_dense():
    raw, _ = random_blocks(np.random.default_rng(5), T.Q8_0, 6, 64)
    assert int8_by_rows(raw, T.Q8_0, rows=2) is not None
    raw[5, 0:2] = np.array([0x00, 0x7C], np.uint8)  # the last row's first scale: f16 +inf (q * inf is not finite)
    assert int8_by_rows(raw, T.Q8_0, rows=2) is None
    assert int8_by_rows(raw, T.F16, rows=2) is None, "an unsupported type"


@pytest.mark.slow
def test_matrices_of_the_embedded_model_are_int8(gguf_path):

    reader = open_gguf(gguf_path)  # the worker's reader (gguf-py's, faster: `preparation.open_gguf`)
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    assert {t.tensor_type for t in matrices} <= SUPPORTED
    for t in matrices[:9]:  # the embedding and layer 0 (every type); the converter checks the rest at prepare
        w = int8_by_rows(t.data, t.tensor_type)  # None unless every piece round-trips gguf-py's values exactly
        assert w is not None, t.name
        rows = slice(0, 512)  # and JAX's dequantization of them is those values, bit for bit
        ref = np.asarray(quants.dequantize(t.data[rows], t.tensor_type), np.float32)
        part = Int8Weight(q=w.q[rows], scale=w.scale[rows], group_size=w.group_size,
                          offset=None if w.offset is None else w.offset[rows])
        np.testing.assert_array_equal(dense_of(part), ref, err_msg=t.name)


def dot_bound(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x Wᵀ in float64, the float32 summation error bound)."""
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    return exact, (w.shape[1] + 2) * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("lead", [(1,), (3,), (8,), (2, 5)])
@pytest.mark.parametrize("block_bytes", [1 << 30, 40 * 256 * 4, 24 * 256 * 4])  # one block; 5 blocks; 9 (padded)
def test_int8_linear_matches_float64_within_the_float32_bound(qtype, lead, block_bytes):
    rng = np.random.default_rng(1)
    raw, ref = random_blocks(rng, qtype, 200, 256)
    w = to_jax(int8_from_gguf(raw, qtype, ref))
    x = rng.standard_normal((*lead, 256)).astype(np.float32)
    y = np.asarray(jax.jit(lambda x, w: int8_linear(x, w, block_bytes=block_bytes))(jnp.asarray(x), w))
    exact, bound = dot_bound(x.reshape(-1, 256), ref)
    assert y.shape == (*lead, 200) and y.dtype == np.float32
    assert np.all(np.abs(y.reshape(-1, 200) - exact) <= bound)


def test_int8_linear_rejects_a_wrong_width():
    raw, ref = random_blocks(np.random.default_rng(2), T.Q8_0, 8, 64)
    with pytest.raises(ValueError, match="32 features"):
        int8_linear(jnp.zeros((1, 32)), to_jax(int8_from_gguf(raw, T.Q8_0, ref)))


def test_rows_are_the_dequantized_rows_and_flat_round_trip():
    raw, ref = random_blocks(np.random.default_rng(3), T.Q4_K, 40, 256)
    w = int8_from_gguf(raw, T.Q4_K, ref)
    ids = jnp.array([[0, 39, 7], [7, 7, 1]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(to_jax(w).rows(ids, jnp.float32)), ref[np.asarray(ids)])
    flat = int8_to_flat({"embed": w, "final_norm": np.ones(64, np.float32)})
    assert sorted(flat) == ["embed.q8", "embed.q8_offset", "embed.q8_scale", "final_norm"]
    back = int8_from_flat(flat)["embed"]
    assert back.group_size == 32 and all(np.array_equal(a, b) for a, b in
                                         [(back.q, w.q), (back.scale, w.scale), (back.offset, w.offset)])
    with pytest.raises(ValueError, match="needs both"):
        int8_from_flat({"embed.q8": w.q})
    with pytest.raises(ValueError, match="do not match"):
        int8_from_flat({"embed.q8": w.q, "embed.q8_scale": w.scale[:, :3]})


@pytest.mark.slow
def test_forward_with_int8_weights_equals_the_dense_weights():
    """The embedding lookup, the tied LM head and every projection through Int8Weights (all four block types)
    give the logits of the same values held dense (only summation orders differ)."""
    cfg = dataclasses.replace(GEMMA3_270M, vocab_size=512, hidden_size=256, num_heads=2, embed_scale=16.0,
                              layers=gemma3_layers(2, 128, 1, 512, 1e6, pattern=2), sliding_window=8)
    rng = np.random.default_rng(5)
    dense_flat, packed_flat = random_flat(cfg, seed=4), {}
    types = [T.Q8_0, T.Q5_0, T.Q6_K, T.Q4_K]
    for i, (name, value) in enumerate(sorted(dense_flat.items())):
        if value.ndim != 2:
            packed_flat[name] = value
            continue
        table = name == "embed"
        rows, cols = value.shape if table else value.shape[::-1]
        qtype = types[i % 4]
        raw, ref = random_blocks(rng, qtype, rows, cols, d=2.0**-15)
        packed_flat[name] = int8_from_gguf(raw, qtype, ref)
        dense_flat[name] = ref if table else np.ascontiguousarray(ref.T)
    dense = to_device(cfg, dense_flat, jnp.float32)
    quant = to_device(cfg, int8_to_flat(packed_flat), jnp.float32)
    kinds = {type(getattr(quant.layers[0], n)).__name__ for n in ("q", "k", "v", "o", "gate", "up", "down")}
    assert isinstance(quant.embed, Int8Weight) and kinds == {"Int8Weight"}
    assert {w.group_size for w in jax.tree.leaves(quant, is_leaf=lambda x: isinstance(x, Int8Weight))
            if isinstance(w, Int8Weight)} == {16, 32}
    tokens = jnp.array([[1, 5, 300, 511], [2, 9, 0, 0]], jnp.int32)
    positions = jnp.array([[0, 1, 2, 3], [0, 1, -1, -1]], jnp.int32)
    out = [np.asarray(forward_jit(p, tokens, positions, KVCache.zeros(cfg, 2, 16, jnp.float32), None, cfg, 16)[0])
           for p in (dense, quant)]
    assert np.abs(out[0]).std() > 1e-3, "the logits must not be trivially equal"
    np.testing.assert_allclose(out[1], out[0], rtol=0, atol=1e-4 * np.abs(out[0]).max())


@pytest.mark.slow
def test_embedded_model_keeps_its_matrices_as_int8(gemma3):
    cfg, params = gemma3
    assert isinstance(params, Params) and isinstance(params.embed, Int8Weight)
    assert params.embed.shape == (cfg.vocab_size, cfg.hidden_size) and params.embed.q.dtype == jnp.int8
    layer = params.layers[0]
    assert all(isinstance(getattr(layer, n), Int8Weight) for n in ("q", "k", "v", "o", "gate", "up", "down"))
    assert params.nbytes() < 0.35 * 2**30
    # At int8 matmul precision the GGUF's Q5_0 projections (q, k, gate, up) keep their 5 bits where the kernel
    # reads 5-bit tiles; Q8_0 (v, the LM head) and the requantized Q4_K / Q6_K ones are int8.
    q8p = with_q8_matmuls(params)
    five = 5 if q8.five_bit_pays() else 8
    assert {n: getattr(q8p.layers[0], n).bits for n in ("q", "k", "v", "o", "gate", "up", "down")} == {
        "q": five, "k": five, "v": 8, "o": 8, "gate": five, "up": five, "down": 8}
    assert q8p.lm_head.bits == 8


def test_bf16_activations_give_float32_logits():
    """The LM head asks for float32 output: bfloat16 activations times bfloat16-rounded weights, accumulated and
    returned in float32 (a bfloat16 result would snap logits near 17 to multiples of 0.125)."""
    rng = np.random.default_rng(6)
    raw, ref = random_blocks(rng, T.Q8_0, 300, 64)
    w = to_jax(int8_from_gguf(raw, T.Q8_0, ref))
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    for block_bytes in (1 << 30, 64 * 64 * 2):  # one block; blocked
        y = jax.jit(lambda x, w: int8_linear(x, w, block_bytes=block_bytes, out_dtype=jnp.float32))(x, w)
        assert y.dtype == jnp.float32
        w_bf16 = ref.astype(jnp.bfloat16).astype(np.float32)
        exact, bound = dot_bound(np.asarray(x, np.float32), w_bf16)
        assert np.all(np.abs(np.asarray(y) - exact) <= bound)


def test_per_row_int8_is_within_half_a_step_and_its_product_matches_float64():
    """`int8_per_channel`: |W - q scale| <= scale / 2 per element, |q| <= 127, a zero row stays zero; the
    row-scaled product (`int8_row_scaled`, the TPU/GPU path) equals x (q scale)ᵀ in float64 within the float32 dot
    bound plus the scale's one rounding, for float32 and bfloat16 activations."""
    from model_worker.numerics.quant import int8_per_channel, int8_row_scaled

    rng = np.random.default_rng(5)
    w = rng.standard_normal((48, 96)).astype(np.float32) * np.exp(rng.standard_normal((48, 1))).astype(np.float32)
    w[7] = 0.0
    q8 = int8_per_channel(jnp.asarray(w))
    q, scale = np.asarray(q8.q, np.float64), np.asarray(q8.scale, np.float64)
    assert q8.shape == (48, 96) and q8.group_size == 96 and q8.offset is None
    assert np.abs(q).max() <= 127 and not q[7].any() and scale[7, 0] == 0
    assert (np.abs(w - q * scale) <= scale / 2 * (1 + 1e-6)).all()
    exact_w = q * scale
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.standard_normal((5, 96)), dtype)
        xf = np.asarray(x, np.float64)
        y = np.asarray(int8_row_scaled(x, q8, out_dtype=jnp.float32), np.float64)
        bound = (96 + 2) * 2.0**-24 * (np.abs(xf) @ np.abs(exact_w).T) + 2.0**-23 * np.abs(xf @ exact_w.T)
        assert (np.abs(y - xf @ exact_w.T) <= bound).all()
