"""Batch invariance at bfloat16 and block-int8 matmul precision (`params.for_matmul_precision(..., "bfloat16" or
"int8", batch_invariant=True)`, `--batch-invariant`): a row's logits
are bit-identical however it is computed - alone or next to other rows in a decode step, inside a prompt chunk at
any alignment (a prefix hit against a cold run), or in a mixed step - for the embedded Gemma 3 and the tiny Gemma 4
configs (sliding and full layers, KV sharing, PLE). Equality is exact (`np.array_equal`), not within a tolerance.

The kernel-level tests pin what the design relies on (docs/architecture.md, "bfloat16 matmul precision with batch
invariance"): XLA CPU's bfloat16 GEMM computes each output row independently of the other rows for row counts
that are a multiple of `quant.GEMM_ROW_MULTIPLE`, and `fixed_order.fixed_order_sum` is one order whatever the array's shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.modeling import model
from model_worker.modeling.kv_cache import KVCache
from model_worker.modeling.layers import fixed_order_sum
from model_worker.modeling.params import for_matmul_precision, matmul_mode, to_device
from model_worker.numerics import q8
from model_worker.numerics.quant import GEMM_ROW_MULTIPLE, Bf16Weight, bf16_linear
from tests.gemma4_tiny import CONFIGS, write_checkpoint

pytestmark = pytest.mark.slow  # compiles model programs or reads a reference: outside `make test-fast`

SLOTS = 4


@pytest.mark.parametrize("n,k", [(1024, 640), (640, 2048), (300, 256)])
def test_bf16_gemm_rows_do_not_depend_on_the_other_rows(n, k):
    """Row r of x Wᵀ (bfloat16 operands, float32 sums) is bit-identical for every row count that is a multiple of
    `quant.GEMM_ROW_MULTIPLE` (4 to 132), with random neighbours, at the first, last and a random row index: the
    property every product of the batch-invariant path relies on (`quant.bf16_linear` and the attention pad their
    rows to such a count). It holds on CPUs whose kernels treat other counts differently (an Intel Xeon with AMX:
    2, 17 and 18 rows each give other bits), which is why counts are padded, not taken as they come."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((n, k), np.float32)).astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, k), np.float32)).astype(jnp.bfloat16)
    dot = jax.jit(lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32))
    step = GEMM_ROW_MULTIPLE
    ref = np.asarray(dot(jnp.pad(x, ((0, step - 1), (0, 0))), w))[0]
    for m in (step, 2 * step, 3 * step, 4 * step + step, 8 * step, 33 * step):
        for r in sorted({0, m - 1, int(rng.integers(m))}):
            rows = jnp.asarray(rng.standard_normal((m, k), np.float32)).astype(jnp.bfloat16).at[r].set(x[0])
            assert np.array_equal(np.asarray(dot(rows, w))[r], ref), (m, r)


def test_bf16_linear_rows_are_invariant_for_any_count():
    """`quant.bf16_linear` with `row_invariant`: a row's result is the same alone and among 1 to 19 other rows (the
    counts a decode step, a verify step or a mixed step can have), because every count is padded."""
    rng = np.random.default_rng(2)
    w = Bf16Weight(jnp.asarray(rng.standard_normal((300, 256), np.float32)).astype(jnp.bfloat16), row_invariant=True)
    x = jnp.asarray(rng.standard_normal((20, 256), np.float32))
    f = jax.jit(bf16_linear, static_argnums=2)
    alone = np.asarray(f(x[:1], w, jnp.float32))[0]
    for m in range(2, 21):
        assert np.array_equal(np.asarray(f(x[:m], w, jnp.float32))[0], alone), m
        assert np.array_equal(np.asarray(f(jnp.roll(x[:m], -1, axis=0), w, jnp.float32))[m - 1], alone), m


def test_fixed_order_sum_is_one_order_for_every_shape():
    """The same row summed inside arrays of different shapes gives the same bits, close to float64's sum."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 64, 640), np.float32) * 3)
    f = jax.jit(fixed_order_sum)
    whole = np.asarray(f(x))
    for rows, cols in [(1, 1), (4, 1), (1, 64), (2, 7)]:
        assert np.array_equal(np.asarray(f(x[:rows, :cols])), whole[:rows, :cols])
    np.testing.assert_allclose(whole, np.asarray(x, np.float64).sum(-1), rtol=1e-5, atol=1e-4)
    for n in (1, 2, 5, 257):
        y = rng.standard_normal((3, n)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(f(jnp.asarray(y))), y.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)


class Runner:
    """Drives `model.forward_batches` on one cache: prompt chunks of one slot, decode steps, mixed steps."""

    def __init__(self, cfg, params, max_len: int, chunk: int, slack: int):
        self.cfg, self.params, self.max_len, self.chunk, self.slack = cfg, params, max_len, chunk, slack
        self.step = jax.jit(functools.partial(model.forward_batches, cfg=cfg, kv_len=max_len), donate_argnums=2)

    def cache(self, store=None) -> KVCache:
        """An empty cache (K/V stored as `kv_cache.storage_dtype`, bfloat16 here; `store` overrides it)."""
        cache = KVCache.zeros(self.cfg, SLOTS, self.max_len, jnp.float32, slack=self.slack)
        return cache if store is None else jax.tree.map(lambda a: a.astype(store), cache)

    def chunk_batch(self, ids, start: int, slot: int) -> model.Batch:
        toks = np.zeros((1, self.chunk), np.int32)
        pos = np.full((1, self.chunk), -1, np.int32)
        toks[0, :len(ids)] = ids
        pos[0, :len(ids)] = np.arange(start, start + len(ids))
        return model.Batch(jnp.asarray(toks), jnp.asarray(pos), jnp.asarray([slot], jnp.int32),
                           jnp.asarray([len(ids) - 1], jnp.int32))

    @staticmethod
    def decode_batch(tokens, positions, slots) -> model.Batch:
        col = lambda v: jnp.asarray(np.asarray(v, np.int32)[:, None])
        return model.Batch(col(tokens), col(positions), jnp.asarray(slots, jnp.int32),
                           jnp.zeros(len(slots), jnp.int32))

    def run(self, cache, *batches):
        logits, cache = self.step(self.params, batches, cache)
        return [np.asarray(lg) for lg in logits], cache

    def prefill(self, cache, ids, slot: int, start: int = 0, end: int | None = None):
        """Chunks of ids[start:end] (positions start..): the last chunk's last-token logits [V] and the cache."""
        end = len(ids) if end is None else end
        logits = None
        while start < end:
            piece = ids[start:min(start + self.chunk, end)]
            (logits,), cache = self.run(cache, self.chunk_batch(piece, start, slot))
            logits = logits[0]
            start += len(piece)
        return logits, cache


def check_invariance(runner: Runner, n: int, decode: int, split: int, seed: int = 0, full: bool = True) -> None:
    """The logits of token n-1 of one sequence, computed six ways (four without `full`: no mixed step and no
    float32 K/V storage, two more programs to compile), are bit-identical."""
    rng = np.random.default_rng(seed)
    vocab = runner.cfg.vocab_size
    ids = rng.integers(3, vocab, n).astype(np.int32)
    others = [rng.integers(3, vocab, n).astype(np.int32) for _ in range(SLOTS - 1)]
    lens = [n - decode - 3, n // 2, n - decode - 1]

    cold, _ = runner.prefill(runner.cache(), ids, 0)  # one sequence, chunks from position 0
    # K/V stored in float32 instead: attention reads them as bfloat16 either way
    stored_f32 = runner.prefill(runner.cache(jnp.float32), ids, 0)[0] if full else cold

    cache = runner.cache()  # the prompt as a prefix hit: chunks from another position (another alignment)
    _, cache = runner.prefill(cache, ids, 0, 0, split)
    hit, _ = runner.prefill(cache, ids, 0, split)

    cache = runner.cache()  # the last tokens as decode steps, alone
    _, cache = runner.prefill(cache, ids, 0, 0, n - decode)
    for pos in range(n - decode, n):
        (alone,), cache = runner.run(cache, runner.decode_batch([ids[pos]], [pos], [0]))

    cache = runner.cache()  # ... and next to three other sequences (this one in the middle of the batch)
    for slot, (other, length) in enumerate(zip(others, lens), start=1):
        _, cache = runner.prefill(cache, other, slot, 0, length)
    _, cache = runner.prefill(cache, ids, 0, 0, n - decode)
    for i, pos in enumerate(range(n - decode, n)):
        toks = [others[0][lens[0] + i], ids[pos], others[1][lens[1] + i], others[2][lens[2] + i]]
        (batched,), cache = runner.run(cache, runner.decode_batch(toks, [lens[0] + i, pos, lens[1] + i, lens[2] + i],
                                                                  [1, 0, 2, 3]))

    mixed = cold[None]
    if full:  # the last chunk in a mixed step with the others' decode tokens
        cache = runner.cache()
        for slot, (other, length) in enumerate(zip(others, lens), start=1):
            _, cache = runner.prefill(cache, other, slot, 0, length)
        last = (n - 1) // runner.chunk * runner.chunk
        _, cache = runner.prefill(cache, ids, 0, 0, last)
        toks = [o[length] for o, length in zip(others, lens)]
        (mixed, _), _ = runner.run(cache, runner.chunk_batch(ids[last:], last, 0),
                                   runner.decode_batch(toks, lens, [1, 2, 3]))

    assert np.isfinite(cold).all() and np.abs(cold).max() > 0
    for name, row in [("float32 K/V storage", stored_f32), ("prefix hit", hit), ("decode alone", alone[0]), ("decode batched", batched[1]),
                      ("mixed step", mixed[0])]:
        assert np.array_equal(row, cold), (name, float(np.abs(row - cold).max()))


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_embedded_model_rows_are_batch_invariant(gemma3, precision):
    """Gemma 3 270M at bfloat16 and block-int8 matmul precision: 560 tokens (past the 512-token sliding window),
    chunks of 64, prefix hit, decode alone and batched (the mixed step and the storage dtype: the tiny configs
    below, whose programs compile in a fraction of the time)."""
    cfg, params = for_matmul_precision(*gemma3, precision, batch_invariant=True)
    runner = Runner(cfg, params, max_len=1024, chunk=64, slack=64)
    check_invariance(runner, n=560, decode=3, split=100, full=False)


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
@pytest.mark.parametrize("name,chunk", [("kv-shared-ple", 16), ("k-eq-v", 8)])
def test_tiny_gemma4_rows_are_batch_invariant(name, chunk, precision, tmp_path):
    """The tiny Gemma 4 configs (window 8, ring 12; full and KV-shared layers, PLE, k_eq_v): 33 tokens, in chunks
    longer than the ring (16: whole-ring rewrites) or window-sized (8: ring scatters), all six ways. At int8 the
    projections mix the kernel's tiles, untiled weights (8 outputs) and bfloat16 ones (8 inputs)."""
    write_checkpoint(CONFIGS[name], tmp_path)
    cfg, flat = load_checkpoint(tmp_path, jnp.float32)
    cfg, params = for_matmul_precision(cfg, to_device(cfg, flat, jnp.float32), precision, batch_invariant=True)
    check_invariance(Runner(cfg, params, max_len=64, chunk=chunk, slack=4), n=33, decode=4, split=13)


def test_int8_without_the_kernel_gives_the_same_logits(tmp_path, monkeypatch):
    """`GEMMA_SERVE_Q8_KERNEL=off` (what a machine without a C++ compiler runs): the weights stay in rows and the
    pure-JAX twin computes every product, with the kernel's bits: the same logits for a prompt chunk and a decode
    step, so the same tokens."""
    write_checkpoint(CONFIGS["kv-shared-ple"], tmp_path)
    cfg, flat = load_checkpoint(tmp_path, jnp.float32)
    dense = to_device(cfg, flat, jnp.float32)
    ids = np.random.default_rng(4).integers(3, cfg.vocab_size, 21).astype(np.int32)
    results = []
    for kernel in ("on", "off"):
        monkeypatch.setenv("GEMMA_SERVE_Q8_KERNEL", kernel)
        q8._kernel_available.cache_clear()
        cfg8, params = for_matmul_precision(cfg, dense, "int8", batch_invariant=True)
        assert params.layers[0].q.tiled == (kernel == "on") and q8.kernel_available() == (kernel == "on")
        runner = Runner(cfg8, params, max_len=64, chunk=16, slack=4)
        last, cache = runner.prefill(runner.cache(), ids, 0, 0, 20)
        (step,), _ = runner.run(cache, runner.decode_batch([ids[20]], [20], [0]))
        results.append((last, step[0]))
    monkeypatch.undo()
    q8._kernel_available.cache_clear()
    for a, b in zip(*results):
        assert np.array_equal(a, b), float(np.abs(a - b).max())


def test_batch_invariance_needs_bfloat16_or_int8_precision():
    """float32 products are not invariant: asking for invariance there (or for an unknown precision) is refused."""
    with pytest.raises(ValueError, match="bfloat16 or int8"):
        for_matmul_precision(None, None, "float32", batch_invariant=True)
    with pytest.raises(ValueError, match="unknown matmul precision"):
        for_matmul_precision(None, None, "int4")
    with pytest.raises(ValueError, match="float32 activations"):  # invariance only with float32 activations
        matmul_mode("int8", True, "bfloat16")
    assert matmul_mode("int8", None, "bfloat16") == ("int8", False)  # int8 weights (W8A16)
    assert matmul_mode("int8", None, "float32") == ("int8", True)
