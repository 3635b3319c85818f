"""The Pallas decode-attention kernel (model_worker/numerics/decode_attention.py), run in Pallas's interpreter on
the CPU, against softmax attention written out in float64 NumPy: full cache rows read at ragged positions through
a slot table, grouped query heads, a window, a sliding ring whose indices hold arbitrary positions, padding rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from model_worker.numerics.decode_attention import decode_attention

S, K, G, D = 5, 2, 2, 16
N = K * G
SCALE = 0.3


def reference(q, keys, values, rows, q_pos, k_pos=None, window=None, scale=SCALE) -> np.ndarray:
    """float64 softmax attention of each row's one query over its visible keys: [B, N, D] (head n reads KV head
    n // G, G = N / K)."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    group = q.shape[1] // keys.shape[2]
    out = np.zeros(q.shape)
    for b, (row, qp) in enumerate(zip(rows, q_pos)):
        held = np.arange(keys.shape[1]) if k_pos is None else np.asarray(k_pos[b])
        visible = (held >= 0) & (held <= qp)
        if qp < 0:  # a padding row: no visible key, its output unused
            continue
        if window is not None:
            visible &= qp - held < window
        for n in range(q.shape[1]):
            s = keys[row, visible, n // group] @ q[b, n] * scale
            p = np.exp(s - s.max())
            out[b, n] = p @ values[row, visible, n // group] / p.sum()
    return out


def _arrays(rng, L: int, dtype):
    keys = rng.standard_normal((S, L, K, D)).astype(np.float32)
    values = rng.standard_normal((S, L, K, D)).astype(np.float32)
    return (jnp.asarray(keys, dtype), jnp.asarray(values, dtype), np.asarray(jnp.asarray(keys, dtype), np.float64),
            np.asarray(jnp.asarray(values, dtype), np.float64))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 20])
def test_full_rows_at_ragged_positions_match_softmax_attention(dtype, tol, window):
    """Rows of a full layer read through a slot table at positions 0 to the end of the row, in blocks of 8; the
    rows' spans differ (a row of position 3 reads one block, one of position 63 all eight)."""
    rng = np.random.default_rng(0)
    L, block = 64, 8
    keys, values, k64, v64 = _arrays(rng, L, dtype)
    rows = np.array([3, 0, 4, 1, 2], np.int32)
    q_pos = np.array([63, 0, 3, 40, 17], np.int32)
    q = jnp.asarray(rng.standard_normal((len(rows), N, D)).astype(np.float32), dtype)
    ours = decode_attention(q, keys, values, jnp.asarray(rows), jnp.asarray(q_pos), scale=SCALE, window=window,
                            block=block, interpret=True)
    assert ours.shape == q.shape and ours.dtype == q.dtype
    ref = reference(np.asarray(q, np.float64), k64, v64, rows, q_pos, window=window)
    np.testing.assert_allclose(np.asarray(ours, np.float64), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 20])
def test_several_queries_per_row_match_softmax_attention(window):
    """A verify step's shape: 4 queries per row at consecutive positions, rows at ragged positions (one near a
    block's end, so its queries straddle two blocks; one at the start), the last query of a row padding (-1)."""
    rng = np.random.default_rng(5)
    L, block, C = 64, 8, 4
    keys, values, k64, v64 = _arrays(rng, L, jnp.float32)
    rows = np.array([3, 0, 4], np.int32)
    q_pos = np.array([[13, 14, 15, 16], [0, 1, 2, -1], [40, 41, 42, 43]], np.int32)
    q = jnp.asarray(rng.standard_normal((len(rows), C, N, D)).astype(np.float32))
    ours = decode_attention(q, keys, values, jnp.asarray(rows), jnp.asarray(q_pos), scale=SCALE, window=window,
                            block=block, interpret=True)
    assert ours.shape == q.shape
    ours = np.asarray(ours, np.float64)
    assert np.isfinite(ours).all()
    for c in range(C):  # each query position alone, as a one-query row
        ref = reference(np.asarray(q[:, c], np.float64), k64, v64, rows, q_pos[:, c], window=window)
        valid = q_pos[:, c] >= 0
        np.testing.assert_allclose(ours[valid, c], ref[valid], atol=2e-5, rtol=2e-5)


def test_a_bucket_bound_and_a_padding_row():
    """`num_blocks` bounds the blocks visited (a KV bucket shorter than the row) and a padding row (position -1)
    gets finite values without disturbing the others."""
    rng = np.random.default_rng(1)
    L, block = 64, 16
    keys, values, k64, v64 = _arrays(rng, L, jnp.float32)
    rows, q_pos = np.array([1, 2, 0], np.int32), np.array([31, -1, 5], np.int32)
    q = jnp.asarray(rng.standard_normal((3, N, D)).astype(np.float32))
    ours = np.asarray(decode_attention(q, keys, values, jnp.asarray(rows), jnp.asarray(q_pos), scale=SCALE,
                                       block=block, num_blocks=2, interpret=True), np.float64)
    ref = reference(np.asarray(q, np.float64), k64, v64, rows, q_pos)
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours[[0, 2]], ref[[0, 2]], atol=2e-5, rtol=2e-5)


def test_a_sliding_ring_reads_the_positions_its_indices_hold():
    """A ring of 24 indices (window 16 plus slack) per row, holding the positions `k_pos` says: the last 24 of a
    long row (wrapped), a short row's first positions with empty (-1) indices after them."""
    rng = np.random.default_rng(2)
    R, block, window = 24, 8, 16
    keys, values, k64, v64 = _arrays(rng, R, jnp.float32)
    rows, q_pos = np.array([2, 4], np.int32), np.array([100, 9], np.int32)
    long_row = np.array([p for p in range(77, 101)])  # positions 77..100 at index p % R
    k_pos = np.full((2, R), -1, np.int32)
    k_pos[0, long_row % R] = long_row
    k_pos[1, :10] = np.arange(10)
    q = jnp.asarray(rng.standard_normal((2, N, D)).astype(np.float32))
    ours = decode_attention(q, keys, values, jnp.asarray(rows), jnp.asarray(q_pos), jnp.asarray(k_pos),
                            scale=SCALE, window=window, block=block, interpret=True)
    ref = reference(np.asarray(q, np.float64), k64, v64, rows, q_pos, k_pos, window=window)
    np.testing.assert_allclose(np.asarray(ours, np.float64), ref, atol=2e-5, rtol=2e-5)


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="ring True"):  # a ring holds one step's keys: one query per row
        decode_attention(jnp.zeros((1, 2, N, D)), jnp.zeros((S, 16, K, D)), jnp.zeros((S, 16, K, D)),
                         jnp.zeros(1, jnp.int32), jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 16), jnp.int32),
                         scale=1.0, block=16, interpret=True)
    keys = jnp.zeros((S, 60, K, D))
    with pytest.raises(ValueError, match="decode_attention"):
        decode_attention(jnp.zeros((1, N, D)), keys, keys, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                         scale=1.0, block=16, interpret=True)


@pytest.mark.parametrize("store", ["float32", "bfloat16 bits"])
@pytest.mark.parametrize("ring,queries", [(False, 1), (True, 1), (False, 4)], ids=["full", "ring", "full-verify"])
def test_the_model_path_chooses_blocks_as_its_xla_loop(ring, queries, store):
    """`attention._attend_pallas` (the kernel as a decode or verify step calls it: blocks and KV-bucket bound
    chosen from the cache) against `attention.attend_in_place`'s XLA loop on the same cache rows, a full layer, a
    ring, and a full layer with a verify step's 4 queries per row (the last of one row padding), with float32 K/V
    and with the bfloat16 store of bfloat16 activations (uint16 bit patterns)."""
    from jax import lax

    from model_worker.modeling import attention
    from model_worker.modeling.kv_cache import BF16_BITS, KVCache

    rng = np.random.default_rng(3)
    L, window = (32, 16) if ring else (1024, None)
    keys, values, _, _ = _arrays(rng, L, jnp.float32)
    dtype, tol = jnp.float32, 2e-5
    if store != "float32":
        keys, values = (lax.bitcast_convert_type(a.astype(jnp.bfloat16), BF16_BITS) for a in (keys, values))
        dtype, tol = jnp.bfloat16, 2e-2
    cache = KVCache([keys], [values], [None], [None])
    slots, q_pos = jnp.asarray([4, 1, 2], jnp.int32), jnp.asarray([[700], [0], [513]], jnp.int32)
    k_pos = None
    if ring:  # index i holds the latest position p <= qp with p % L == i (-1: none yet)
        q_pos = jnp.asarray([[40], [0], [20]], jnp.int32)
        k_pos = jnp.asarray([[max(qp - (qp - i) % L, -1) for i in range(L)] for qp in (40, 0, 20)], jnp.int32)
    if queries > 1:  # consecutive drafted positions; the second row's last query is padding
        q_pos = jnp.asarray([[700, 701, 702, 703], [0, 1, 2, -1], [510, 511, 512, 513]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, queries, N, D)).astype(np.float32), dtype)
    xla = attention.attend_in_place(q, cache, 0, slots, q_pos, k_pos, window, SCALE, dtype, kv_len=768)
    ours = attention._attend_pallas(q, keys, values, slots, q_pos, k_pos, window, SCALE, kv_len=768,
                                    interpret=True)
    assert ours.dtype == xla.dtype and ours.shape == xla.shape
    valid = np.asarray(q_pos) >= 0
    np.testing.assert_allclose(np.asarray(ours, np.float32)[valid], np.asarray(xla, np.float32)[valid], atol=tol,
                               rtol=tol)


def test_a_ring_read_by_several_queries_keeps_the_xla_loop():
    """The kernel takes a sliding ring at one query per row only (a ring holds one step's keys): with two, the
    in-place read stays on XLA's loop, on every backend, instead of failing when the kernel's branch is traced."""
    from model_worker.modeling import attention
    from model_worker.modeling.kv_cache import KVCache

    rng = np.random.default_rng(8)
    L = 32
    keys, values, _, _ = _arrays(rng, L, jnp.float32)
    cache = KVCache([keys], [values], [None], [None])
    q_pos = jnp.asarray([[38, 39], [4, 5]], jnp.int32)
    k_pos = jnp.asarray([[max(qp - (qp - i) % L, -1) for i in range(L)] for qp in (39, 5)], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 2, N, D)).astype(np.float32))
    args = (q, cache, 0, jnp.asarray([1, 3], jnp.int32), q_pos, k_pos, 16, SCALE, jnp.float32, 768)
    xla = attention.attend_in_place(*args)
    for kernel in ("pallas", "pallas-interpret"):
        np.testing.assert_array_equal(np.asarray(attention.attend_in_place(*args, kernel=kernel)), np.asarray(xla))


def test_auto_takes_the_kernel_for_large_steps_only():
    """`--attention-kernel auto` (the worker's default on one TPU): a step of rows x KV bucket below
    `PALLAS_AUTO_KEYS` is traced without the kernel (XLA's loop only), one at or past it with the kernel's branch;
    and the flag resolves to "xla" off a single TPU, so that a CPU's programs are those of "xla". "pallas-full"
    takes the kernel for full layers only."""
    from model_worker.modeling import attention
    from model_worker.modeling.kv_cache import KVCache

    def with_kernel(rows: int, kv_len: int) -> bool:
        q = jax.ShapeDtypeStruct((rows, 1, N, D), jnp.float32)
        kv = jax.ShapeDtypeStruct((rows, kv_len, K, D), jnp.float32)
        slots, q_pos = jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows, 1), jnp.int32)
        step = lambda q, k, v, s, p: attention.attend_in_place(q, KVCache([k], [v], [None], [None]), 0, s, p, None,
                                                               None, SCALE, jnp.float32, kv_len, kernel="auto")
        return "pallas_call" in str(jax.make_jaxpr(step)(q, kv, kv, slots, q_pos))

    limit = attention.PALLAS_AUTO_KEYS
    assert not with_kernel(8, 1024) and not with_kernel(limit // 2048 - 1, 2048)
    assert with_kernel(limit // 2048, 2048) and with_kernel(32, 8192)
    # "pallas-full" (a benchmark's variant): the kernel for a full layer at any size, never for a sliding ring.
    q = jax.ShapeDtypeStruct((2, 1, N, D), jnp.float32)
    slots, q_pos = jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2, 1), jnp.int32)
    for ring, wanted in [(False, True), (True, False)]:
        L = 32 if ring else 1024  # a ring of 32 positions (window 16); a full layer of 1024, which the kernel fits
        kv = jax.ShapeDtypeStruct((2, L, K, D), jnp.float32)
        k_pos = jax.ShapeDtypeStruct((2, L), jnp.int32) if ring else None
        step = lambda q, k, v, s, p, kp, ring=ring, L=L: attention.attend_in_place(
            q, KVCache([k], [v], [None], [None]), 0, s, p, kp, 16 if ring else None, SCALE, jnp.float32, L,
            kernel="pallas-full")
        assert ("pallas_call" in str(jax.make_jaxpr(step)(q, kv, kv, slots, q_pos, k_pos))) == wanted, ring
    assert attention.resolve_attention_kernel("auto", "tpu") == "auto"
    assert [attention.resolve_attention_kernel("auto", b, tp) for b, tp in [("cpu", 1), ("gpu", 1), ("tpu", 2)]] \
        == ["xla"] * 3
    assert attention.resolve_attention_kernel("pallas", "cpu") == "pallas"
    with pytest.raises(ValueError, match="unknown attention kernel"):
        attention.resolve_attention_kernel("triton", "tpu")


def test_a_bfloat16_store_reaches_the_kernel_without_a_conversion():
    """Off CPU the engine stores bfloat16 K/V as bfloat16 (`kv_cache.storage_dtype` without `bf16_bits`): the
    kernel's step then holds no bit cast of the cache (on a v5e, XLA copied a whole full layer's cache, 537 MB, per
    layer and step to bit-cast a uint16 store into the kernel), and its outputs are those of the uint16 store, whose
    bits are the same values. CPU engines keep the uint16 store (XLA CPU's in-place writes)."""
    from model_worker.engine.engine import Engine
    from model_worker.modeling import attention
    from model_worker.modeling.kv_cache import BF16_BITS, KVCache, storage_dtype

    rng = np.random.default_rng(5)
    B, L = 2, 1024
    values = [jnp.asarray(rng.standard_normal((3, L, K, D)), jnp.bfloat16) for _ in range(2)]
    stores = {"bits": [lax.bitcast_convert_type(a, BF16_BITS) for a in values], "bfloat16": values}
    q = jnp.asarray(rng.standard_normal((B, 1, N, D)), jnp.bfloat16)
    slots, q_pos = jnp.asarray([2, 0], jnp.int32), jnp.asarray([[700], [1023]], jnp.int32)

    def step(k, v, kernel):
        return attention.attend_in_place(q, KVCache([k], [v], [None], [None]), 0, slots, q_pos, None, None, SCALE,
                                         jnp.bfloat16, L, kernel=kernel)

    casts = {name: str(jax.make_jaxpr(lambda k, v: step(k, v, "pallas"))(*kv)).count("bitcast_convert_type")
             for name, kv in stores.items()}
    assert casts["bfloat16"] == 0 and casts["bits"] > 0, casts
    for kernel in ("xla", "pallas-interpret"):
        outs = [np.asarray(step(*kv, kernel).astype(jnp.float32)) for kv in stores.values()]
        np.testing.assert_array_equal(outs[0], outs[1])
    cfg = type("Cfg", (), {"batch_invariant": False})()
    assert storage_dtype(cfg, jnp.bfloat16, False) == BF16_BITS
    assert storage_dtype(cfg, jnp.bfloat16, False, bf16_bits=False) == jnp.bfloat16
    assert storage_dtype(cfg, jnp.float32, False, bf16_bits=False) == jnp.float32
    no_mesh = type("E", (), {"mesh": None, "platform": Engine.platform})()
    assert no_mesh.platform == jax.devices()[0].platform
    assert Engine._bf16_bits(no_mesh) == (jax.devices()[0].platform == "cpu")
    with jax.default_device(jax.devices("cpu")[0]):  # a CPU-placed engine on any host keeps the bits
        assert no_mesh.platform == "cpu" and Engine._bf16_bits(no_mesh)


def test_layers_outside_the_kernel_limits_keep_the_xla_loop():
    """A full layer whose cache length has no power-of-two divisor of 128 or more (4100 = 4 * 1025), and a ring
    over 2 MiB per array, are not given to the kernel (`attention._pallas_fits`)."""
    from model_worker.modeling.attention import _pallas_fits

    full = lambda L: jnp.zeros((2, L, 1, 256), jnp.bfloat16)
    assert _pallas_fits(full(8192), None) and _pallas_fits(full(1152), None)
    assert not _pallas_fits(full(4100), None)
    assert _pallas_fits(full(576), jnp.zeros((2, 576))) and not _pallas_fits(full(4160), jnp.zeros((2, 4160)))


def test_the_kernel_lowers_for_a_tpu_v5e_at_gemma4_shapes(monkeypatch):
    """Pallas's TPU lowering (to Mosaic, on this CPU: the chip's generation is stated, not detected) accepts the
    kernel at Gemma 4 E2B's decode shapes as `attention._attend_pallas` calls it: a full layer (D 512, 8K cache,
    blocks of 512), a sliding ring (D 256, 512 + 64 positions in one block), grouped heads (K 2, D 128), a verify
    step's 4 queries per row in a full layer. Its block-shape rules are checked here; Mosaic's own compile needs
    the chip (the device lane)."""
    from jax._src.pallas.mosaic import tpu_info

    from model_worker.modeling import attention

    if not all(hasattr(tpu_info, f) for f in ("get_device_kind", "get_num_device_cores")):
        pytest.skip("this JAX's Pallas TPU lowering has no device-kind hook to state the chip on a CPU")
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    for B, C, L, K, G, Dh, ring in [(8, 1, 8192, 1, 8, 512, False), (8, 1, 576, 1, 8, 256, True),
                                    (4, 1, 1024, 2, 2, 128, False), (8, 4, 8192, 1, 8, 512, False)]:
        q = jax.ShapeDtypeStruct((B, C, K * G, Dh), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((16, L, K, Dh), jnp.bfloat16)
        rows, pos = jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, C), jnp.int32)
        k_pos = jax.ShapeDtypeStruct((B, L), jnp.int32) if ring else None
        f = lambda q, k, v, r, p, kp, w=(512 if ring else None), L=L: attention._attend_pallas(q, k, v, r, p, kp, w,
                                                                                               1.0, kv_len=L)
        text = jax.jit(f).trace(q, kv, kv, rows, pos, k_pos).lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text


def _dots(jaxpr):
    """Every dot_general equation in `jaxpr` and the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _dots(inner)


def test_16_bit_products_in_the_kernel_ask_no_float32_precision():
    """Mosaic refuses a bfloat16 product asked for at HIGHEST ("Bad lhs type", seen on a v5e), and the tests and a
    float32 worker set HIGHEST process-wide: the kernel's bfloat16 products state DEFAULT (exact for 16-bit
    operands), its float32 ones HIGHEST, whatever the process's setting."""
    for dtype, wanted in [(jnp.bfloat16, lax.Precision.DEFAULT), (jnp.float32, lax.Precision.HIGHEST)]:
        q = jax.ShapeDtypeStruct((2, 4, 8, 128), dtype)
        kv = jax.ShapeDtypeStruct((4, 1024, 1, 128), dtype)
        rows, pos = jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2, 4), jnp.int32)
        with jax.default_matmul_precision("highest"):
            jaxpr = jax.make_jaxpr(lambda q, k, v, r, p: decode_attention(q, k, v, r, p, None, scale=1.0, block=512))(
                q, kv, kv, rows, pos)
        dots = list(_dots(jaxpr.jaxpr))
        assert len(dots) >= 2, dots
        for eqn in dots:
            assert eqn.params["precision"] in (wanted, (wanted, wanted)), (dtype, eqn.params["precision"])


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="Mosaic compiles the kernel for a TPU only (the "
                    "device lane runs this; elsewhere the interpreter tests above stand for it)")
@pytest.mark.parametrize("ring", [False, True])
def test_the_compiled_kernel_on_a_tpu_matches_softmax_attention(ring):
    """Compiled for the chip (not interpreted), bfloat16 at Gemma 4 E2B's decode shapes: a full layer's rows at
    ragged positions of a 2K cache in blocks of 512, and a sliding ring of 512 + 64 positions in one block."""
    rng = np.random.default_rng(4)
    B, Kh, Gh, Dh = 6, 1, 8, (256 if ring else 512)
    L, block, window = (2048, 512, None) if not ring else (576, 576, 512)
    keys = jnp.asarray(rng.standard_normal((8, L, Kh, Dh)), jnp.bfloat16)
    values = jnp.asarray(rng.standard_normal((8, L, Kh, Dh)), jnp.bfloat16)
    rows = np.array([7, 0, 3, 5, 1, 2], np.int32)
    q_pos = np.array([2047, 0, 511, 512, 1000, 1500] if not ring else [600, 0, 100, 575, 576, 2000], np.int32)
    k_pos = None
    if ring:
        k_pos = np.array([[max(qp - (qp - i) % L, -1) for i in range(L)] for qp in q_pos], np.int32)
    q = jnp.asarray(rng.standard_normal((B, Kh * Gh, Dh)), jnp.bfloat16)
    ours = decode_attention(q, keys, values, jnp.asarray(rows), jnp.asarray(q_pos),
                            None if k_pos is None else jnp.asarray(k_pos), scale=Dh ** -0.5, window=window,
                            block=block)
    ref = reference(np.asarray(q, np.float64), np.asarray(keys, np.float64), np.asarray(values, np.float64), rows,
                    q_pos, k_pos, window, scale=Dh ** -0.5)
    np.testing.assert_allclose(np.asarray(ours, np.float64), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="Mosaic compiles the kernel for a TPU only (the "
                    "device lane runs this; elsewhere the interpreter tests above stand for it)")
def test_the_compiled_kernel_on_a_tpu_takes_a_verify_step():
    """Compiled for the chip, bfloat16: 4 consecutive drafted positions per row of a full layer (D 512, 2K cache,
    blocks of 512), one row's queries straddling a block boundary, one row's last query padding."""
    rng = np.random.default_rng(6)
    B, C, Kh, Gh, Dh, L, block = 4, 4, 1, 8, 512, 2048, 512
    keys = jnp.asarray(rng.standard_normal((8, L, Kh, Dh)), jnp.bfloat16)
    values = jnp.asarray(rng.standard_normal((8, L, Kh, Dh)), jnp.bfloat16)
    rows = np.array([7, 0, 3, 5], np.int32)
    q_pos = np.array([[2044, 2045, 2046, 2047], [0, 1, 2, -1], [510, 511, 512, 513], [900, 901, 902, 903]],
                     np.int32)
    q = jnp.asarray(rng.standard_normal((B, C, Kh * Gh, Dh)), jnp.bfloat16)
    ours = np.asarray(decode_attention(q, keys, values, jnp.asarray(rows), jnp.asarray(q_pos), scale=Dh ** -0.5,
                                       block=block), np.float64)
    for c in range(C):
        ref = reference(np.asarray(q[:, c], np.float64), np.asarray(keys, np.float64),
                        np.asarray(values, np.float64), rows, q_pos[:, c], scale=Dh ** -0.5)
        valid = q_pos[:, c] >= 0
        np.testing.assert_allclose(ours[valid, c], ref[valid], atol=3e-2, rtol=3e-2)


@pytest.mark.slow
def test_a_whole_model_through_the_kernel_gives_the_xla_loops_logits(tmp_path, monkeypatch):
    """The tiny Gemma 4 model (sliding and full layers, KV shared across both, PLE) with every in-place attention
    the kernel takes run through it (`attention_kernel="pallas-interpret"`: Pallas's interpreter, as a TPU runs
    the kernel) against XLA's loop: prompt chunks of 16 (a verify step's size: the kernel in the full layers), a
    chunk of 4 with every position's logits (a verify step's shape), then one-token decode steps beside an idle
    row (the kernel in the full layers and the sliding rings). Same logits to float32 summation order."""
    import dataclasses
    import functools

    from model_worker.checkpoints.hf_loader import load_checkpoint
    from model_worker.modeling import attention, model
    from model_worker.modeling.kv_cache import KVCache
    from model_worker.modeling.params import to_device
    from tests.gemma4_tiny import SHARED, write_checkpoint

    write_checkpoint(SHARED, tmp_path)
    cfg, flat = load_checkpoint(tmp_path, jnp.float32)
    params = to_device(cfg, flat, jnp.float32)
    prompt = np.random.default_rng(7).integers(0, 512, 40).tolist()
    taken = []  # (queries per row, ring) of each call the kernel took, as traced
    through = attention._attend_pallas

    def counted(q, keys, values, rows, q_pos, k_pos, *args, **kwargs):
        taken.append((q.shape[1], k_pos is not None))
        return through(q, keys, values, rows, q_pos, k_pos, *args, **kwargs)

    monkeypatch.setattr(attention, "_attend_pallas", counted)

    def run(kernel: str) -> np.ndarray:
        forward = jax.jit(functools.partial(model.forward, cfg=dataclasses.replace(cfg, attention_kernel=kernel),
                                            kv_len=128))
        cache = KVCache.zeros(cfg, 2, 128, jnp.float32, slack=4)
        out = []
        for start in range(0, 32, 16):  # prompt chunks of 16
            pos = np.arange(start, start + 16, dtype=np.int32)[None]
            logits, cache = forward(params, jnp.asarray([prompt[start:start + 16]]), jnp.asarray(pos), cache,
                                    jnp.asarray([1]), logit_rows=jnp.asarray([15]))
            out.append(np.asarray(logits))
        pos = np.arange(32, 36, dtype=np.int32)[None]  # 4 tokens, every position's logits: a verify step
        logits, cache = forward(params, jnp.asarray([prompt[32:36]]), jnp.asarray(pos), cache, jnp.asarray([1]))
        out.append(np.asarray(logits)[0])
        token = int(np.argmax(out[-1][-1]))
        for p in range(36, 40):  # decode beside an idle row
            logits, cache = forward(params, jnp.asarray([[token], [0]]), jnp.asarray([[p], [-1]]), cache,
                                    jnp.asarray([1, 0]), logit_rows=jnp.asarray([0, 0]))
            out.append(np.asarray(logits)[:1])
            token = int(np.argmax(out[-1][0]))
        return np.concatenate(out)

    xla = run("xla")
    assert not taken
    kernel = run("pallas-interpret")
    assert {(16, False), (4, False), (1, False), (1, True)} <= set(taken), taken  # chunk, verify, decode, ring
    assert xla.shape == kernel.shape == (2 + 4 + 4, cfg.vocab_size)
    np.testing.assert_allclose(kernel, xla, atol=2e-4, rtol=0)
