"""The embedded Gemma 3 270M against an independent reference (transformers, torch CPU), and cached decode
against a full re-forward.

Tolerance: both sides run float32 on the same dequantized GGUF weights, so they differ only by summation order
(matmuls over 640..2048 terms, softmax over up to 1024 keys, 18 layers). Measured: max |Δlogit| ≈ 3.4e-4 on
logits up to ~115 in magnitude, i.e. a relative error ≈ 3e-6 (~25 float32 ulps after 18 layers). TOL = 2e-3
leaves ~6x headroom for BLAS/XLA version changes while still catching any real math error (a wrong RoPE base,
norm offset or mask changes logits by O(1)). Greedy tokens are compared only where the reference's top-2 gap
exceeds 2·TOL, since below that either choice is within numerical noise.

Off CPU (the device lane on a TPU, float32 at 'highest' precision): TOL = 4e-3. A TPU multiplies float32 operands
in several bfloat16 passes and computes exp, log and rsqrt by approximations a few ulps looser than the CPU's;
a v5e measured max |Δlogit| 2.05e-3 on the long prompt (6x the CPU's), still three orders of magnitude below
what a real math error changes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.modeling.kv_cache import KVCache
from model_worker.modeling.model import forward_jit
from model_worker.modeling.params import for_matmul_precision

pytestmark = pytest.mark.slow
TOL = 2e-3 if jax.default_backend() == "cpu" else 4e-3
CHUNK = 256
MAX_LEN = 1024
FULL_LEN = 768  # the padded shape of the from-scratch re-forward of sequences longer than a chunk (> 700 + 8)

SHORT = "The capital of France is"
LONG = (
    "Gemma is a family of lightweight, open models built from the same research and technology used to create "
    "the Gemini models. In the quiet valley the river bends twice before it reaches the old mill, where the "
    "miller's daughter counts sacks of grain each morning: seventeen, eighteen, nineteen. def fib(n):\n    "
    "return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nPrices rose 3.5% in March; analysts expected 2.9%. "
) * 9


def _ids(text_tokenizer, text: str) -> np.ndarray:
    return np.asarray(text_tokenizer.encode(text, add_bos=True), np.int32)


def chunked_logits(cfg, params, ids: np.ndarray, last_only: bool = False) -> tuple[np.ndarray, KVCache]:
    """Logits computed chunk by chunk through the cache (slot 0 of a 1-slot cache): every position's [T, V], or
    with `last_only` the last position's [1, V] only (the LM head then runs on one row of each chunk, as the
    engine's prefill does: ~1 s less per chunk for tests that read nothing else)."""
    cache = KVCache.zeros(cfg, 1, MAX_LEN, jnp.float32)
    out = []
    for start in range(0, len(ids), CHUNK):
        piece = ids[start : start + CHUNK]
        tokens = np.zeros((1, CHUNK), np.int32)
        positions = np.full((1, CHUNK), -1, np.int32)
        tokens[0, : len(piece)] = piece
        positions[0, : len(piece)] = np.arange(start, start + len(piece))
        rows = np.array([len(piece) - 1], np.int32) if last_only else None
        logits, cache = forward_jit(params, tokens, positions, cache, None, cfg=cfg, kv_len=MAX_LEN,
                                    logit_rows=rows)
        out.append(logits if last_only else np.asarray(logits[0, : len(piece)]))
    return (np.asarray(out[-1]) if last_only else np.concatenate(out)), cache


_HF_LOGITS: dict[bytes, np.ndarray] = {}  # LONG's reference logits (~1 GB), shared by the two prompt tests


@pytest.fixture(scope="module", autouse=True)
def _free_reference_logits():
    yield
    _HF_LOGITS.clear()


def hf_logits(hf_model, ids: np.ndarray, keep: bool = False, last: int = 0) -> np.ndarray:
    """transformers' logits [T, V] float32 for `ids` (with `last` > 0, only the last `last` positions': its LM head
    runs on those rows alone); with `keep`, computed once per sequence in this module (the float32 and bfloat16
    prompt tests share LONG's, ~15 s)."""
    import torch

    key = np.asarray(ids, np.int64).tobytes()
    if key in _HF_LOGITS:
        return _HF_LOGITS[key]
    with torch.no_grad():
        logits = hf_model(torch.tensor(ids[None].astype(np.int64)), logits_to_keep=last).logits[0].float().numpy()
    if keep:
        _HF_LOGITS[key] = logits
    return logits


# First in the module: it needs neither transformers nor its ~1 GB of kept reference logits, so its own peak
# (a whole-sequence forward) does not add to theirs.
@pytest.mark.parametrize("prompt_len,steps", [(7, 4), (505, 8), (700, 4)],
                         ids=["short", "crosses-window-in-decode", "past-window"])
def test_cached_decode_equals_full_reforward(gemma3, text_tokenizer, prompt_len, steps):
    """Each decode step's logits equal a from-scratch forward of the whole sequence in one call (padded to one
    chunk, the prompt tests' program, when it fits, else to FULL_LEN); 8 steps from position 505 cross the
    512-token window. (One from-scratch forward of the final sequence serves every step: attention is causal, so
    its logits at a step's position are those of the sequence up to that step.)"""
    cfg, params = gemma3
    ids = _ids(text_tokenizer, LONG)[:prompt_len]
    logits, cache = chunked_logits(cfg, params, ids, last_only=True)
    seq = list(ids) + [int(logits[-1].argmax())]
    decoded = []
    for _ in range(steps):
        pos = len(seq) - 1
        step, cache = forward_jit(params, np.array([[seq[-1]]], np.int32), np.array([[pos]], np.int32), cache, None,
                                  cfg=cfg, kv_len=MAX_LEN)
        decoded.append((pos, np.asarray(step)[0, 0]))
        seq.append(int(decoded[-1][1].argmax()))
    width, kv_len = (CHUNK, MAX_LEN) if len(seq) <= CHUNK else (FULL_LEN, FULL_LEN)
    tokens = np.zeros((1, width), np.int32)
    positions = np.full((1, width), -1, np.int32)
    tokens[0, : len(seq)] = seq
    positions[0, : len(seq)] = np.arange(len(seq))
    fresh = KVCache.zeros(cfg, 1, kv_len, jnp.float32)
    full, _ = forward_jit(params, tokens, positions, fresh, None, cfg=cfg, kv_len=kv_len)  # every position
    refs = np.asarray(full[0, np.array([pos for pos, _ in decoded])])
    del full
    for (pos, step), ref in zip(decoded, refs):
        diff = np.abs(step - ref).max()
        assert diff < TOL, f"step at position {pos}: max |Δlogit| {diff:.2e}"


@pytest.mark.parametrize("text", [SHORT, LONG], ids=["short", "longer-than-window"])
def test_prompt_logits_match_transformers(gemma3, hf_gemma3, text_tokenizer, text):
    cfg, params = gemma3
    ids = _ids(text_tokenizer, text)
    if text is LONG:
        assert len(ids) > cfg.sliding_window + CHUNK // 2, "the long prompt must exceed the sliding window"
    ours, _ = chunked_logits(cfg, params, ids)
    ref = hf_logits(hf_gemma3, ids, keep=text is LONG)
    diff = max(float(np.abs(a - b).max()) for a, b in _row_blocks(ours, ref))
    assert diff < TOL, f"max |Δlogit| {diff:.2e} over {len(ids)} positions"
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1)) or _ties_only(ours, ref)


def _ties_only(ours: np.ndarray, ref: np.ndarray) -> bool:
    """Argmax differs only at positions where the reference's top-2 gap is below 2·TOL."""
    top2 = _top2(ref)
    clear = (top2[:, 1] - top2[:, 0]) > 2 * TOL
    return bool(np.array_equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear]))


def test_greedy_continuation_matches_transformers(gemma3, hf_gemma3, text_tokenizer):
    """Our cached greedy decode picks the reference's argmax at every step with a clear top-2 gap."""
    cfg, params = gemma3
    prompt = _ids(text_tokenizer, LONG)[: cfg.sliding_window - 6]  # decoding crosses the window boundary
    prompt_logits, cache = chunked_logits(cfg, params, prompt, last_only=True)
    tokens = [int(prompt_logits[-1].argmax())]
    for step in range(15):
        pos = len(prompt) + step
        logits, cache = forward_jit(params, np.array([[tokens[-1]]], np.int32), np.array([[pos]], np.int32), cache,
                                    None, cfg=cfg, kv_len=MAX_LEN)
        tokens.append(int(np.asarray(logits)[0, 0].argmax()))
    # the reference's rows from the prompt's last position on, one per sampled token
    ref = hf_logits(hf_gemma3, np.concatenate([prompt, tokens[:-1]]).astype(np.int32), last=len(tokens))
    top2 = _top2(ref)
    clear = (top2[:, 1] - top2[:, 0]) > 2 * TOL
    assert clear.sum() >= len(tokens) // 2, "too few steps with a clear reference choice to test anything"
    assert np.array_equal(np.asarray(tokens)[clear], ref.argmax(-1)[clear]), (tokens, ref.argmax(-1).tolist())


@pytest.fixture  # one test uses it: released after it (a model-sized copy)
def gemma3_bf16(gemma3):
    """The embedded model at bfloat16 matmul precision (`--matmul-precision bfloat16`: bfloat16 products with
    float32 sums everywhere, attention included, batch-invariant)."""
    return for_matmul_precision(*gemma3, "bfloat16", batch_invariant=True)


# bfloat16 matmul precision against the float32 reference. Rounding each product's operands to bfloat16 (relative
# error 2^-9 each: 126 projections, the LM head, and attention's scores and P·V) moves logits by much more than
# summation order. Measured against transformers on LONG (948 positions, logits up to ~115), 940 prompt positions
# in chunks then 8 cached decode steps: max |Δlogit| 0.55 and mean 0.042 over the prompt, 0.32 and 0.040 over the
# decode steps, mean KL divergence of the next-token distributions 2.2e-5, same argmax wherever the top-2 gap
# exceeds 0.5 (with float32 attention, before the batch-invariant path: 0.48 / 0.036, 0.25 / 0.036, KL 1.9e-5).
# Scores from split-bfloat16 operands (~16 bits) measured KL 1.9e-5, too small a gain for 1.3x slower decode steps.
# The bounds leave ~3-4x headroom; a real error (a wrong weight, orientation, scale or accumulation dtype) moves logits by
# O(1) or more. (The unit tests in test_bf16_matmul.py pin the rounding itself, with a bound that fails when it is
# skipped.)
BF16_MAX, BF16_MEAN, BF16_KL, BF16_GAP = 2.0, 0.1, 1e-4, 0.5


def prompt_then_decode_logits(cfg, params, ids: np.ndarray, decode: int = 8) -> np.ndarray:
    """Logits [T, V] of `ids`: the first T - `decode` positions as prompt chunks, the last `decode` as cached
    one-row decode steps."""
    split = len(ids) - decode
    prompt, cache = chunked_logits(cfg, params, ids[:split])
    steps = []
    for pos in range(split, len(ids)):
        step, cache = forward_jit(params, ids[None, pos:pos + 1], np.array([[pos]], np.int32), cache, None, cfg=cfg,
                                  kv_len=MAX_LEN)
        steps.append(np.asarray(step)[0, 0])
    return np.concatenate([prompt, np.stack(steps)])


def divergence(ours: np.ndarray, ref: np.ndarray) -> dict:
    """max and mean |Δlogit|, the mean KL(ref || ours) of the next-token distributions, and whether the argmax
    agrees wherever the reference's top-2 gap exceeds `gap` (as a function)."""
    blocks = list(_row_blocks(ours, ref))
    kl = 0.0
    for q_rows, p_rows in blocks:
        log_p, log_q = _log_softmax(p_rows), _log_softmax(q_rows)
        kl += float(np.sum(np.exp(log_p) * (log_p - log_q)))
    return {"max": max(float(np.abs(a - b).max()) for a, b in blocks),
            "mean": sum(float(np.abs(a - b).sum(dtype=np.float64)) for a, b in blocks) / ours.size,
            "kl": kl / len(ref)}


def test_bf16_matmul_logits_stay_close_to_transformers(gemma3_bf16, hf_gemma3, text_tokenizer):
    """At bfloat16 precision, LONG's first 940 tokens as prompt chunks (bfloat16 GEMMs) and its last 8 as cached
    decode steps (one-row products, `bf16_linear`'s other path) give logits close to transformers' for the same
    positions (the reference is shared with the float32 prompt test)."""
    cfg, params = gemma3_bf16
    ids = _ids(text_tokenizer, LONG)
    split = len(ids) - 8
    ours = prompt_then_decode_logits(cfg, params, ids)
    ref = hf_logits(hf_gemma3, ids, keep=True)
    for part in (slice(0, split), slice(split, None)):
        d = divergence(ours[part], ref[part])
        assert d["max"] < BF16_MAX and d["mean"] < BF16_MEAN, (part, d)
    kl = divergence(ours, ref)["kl"]
    assert kl < BF16_KL, kl
    top2 = _top2(ref)
    clear = (top2[:, 1] - top2[:, 0]) > BF16_GAP
    assert clear[split:].sum() >= 4 and np.array_equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


# Block-int8 matmul precision (`--matmul-precision int8`) against the float32 reference: every projection's and
# the LM head's input rounded to Q8_0 blocks (relative error up to 2^-8 of each block's largest value), the
# GGUF's own Q8_0/Q5_0 integers, its Q4_K/Q6_K blocks requantized to Q8_0. The bound is the one llama.cpp's own
# way of computing (the same activation quantization) is judged by: mean KL <= 1e-3 over LONG's prompt chunks and
# cached decode steps, the same argmax wherever the top-2 gap exceeds 0.5 (measured: docs/performance.md).
Q8_KL, Q8_GAP = 1e-3, 0.5


@pytest.fixture  # one test uses it: released after it (a model-sized copy)
def gemma3_q8(gemma3):
    """The embedded model at block-int8 matmul precision, batch-invariant (the kernel where it builds)."""
    return for_matmul_precision(*gemma3, "int8", batch_invariant=True)


def test_int8_matmul_logits_stay_within_the_bound(gemma3_q8, hf_gemma3, text_tokenizer):
    """At block-int8 precision, LONG's prompt chunks and cached decode steps keep mean KL <= 1e-3 from
    transformers' float32 logits and its argmax wherever the top-2 gap exceeds 0.5."""
    _assert_within_the_int8_bound("block-int8", *gemma3_q8, hf_gemma3, text_tokenizer)


def _assert_within_the_int8_bound(label: str, cfg, params, hf_gemma3, text_tokenizer) -> None:
    """LONG's prompt chunks then cached decode steps: mean KL <= Q8_KL from transformers' float32 logits, the same
    argmax wherever its top-2 gap exceeds Q8_GAP (at least 4 of the 8 decode steps so checked)."""
    ids = _ids(text_tokenizer, LONG)
    ours = prompt_then_decode_logits(cfg, params, ids)
    ref = hf_logits(hf_gemma3, ids, keep=True)
    d = divergence(ours, ref)
    top2 = _top2(ref)
    clear = (top2[:, 1] - top2[:, 0]) > Q8_GAP
    agree = ours.argmax(-1)[clear] == ref.argmax(-1)[clear]
    print(f"{label} vs transformers: {d}, argmax {int(agree.sum())}/{int(clear.sum())}")
    assert d["kl"] <= Q8_KL, d
    assert clear[-8:].sum() >= 4 and agree.all(), np.flatnonzero(clear)[~agree]


# Weight-only int8 (`--matmul-precision int8` with bfloat16 activations, a TPU's or GPU's W8A16): every projection
# and the LM head stored as int8 with one scale per output row. Judged by the same bound as the block-int8 products
# above, with float32 activations so that only the weights' rounding is measured.
@pytest.fixture  # one test uses it: released after it (a model-sized copy)
def gemma3_w8(gemma3):
    """The embedded model's exact float32 weight values stored again as per-row int8 (`with_int8_weights`)."""
    import dataclasses

    from model_worker.modeling.params import with_int8_weights
    from model_worker.numerics.quant import Int8Weight

    cfg, params = gemma3
    dense = lambda w: w.values().T if isinstance(w, Int8Weight) else w  # [out, in] -> a projection's [in, out]
    names = ("q", "k", "v", "o", "gate", "up", "down")
    layers = [dataclasses.replace(lp, **{n: dense(getattr(lp, n)) for n in names}) for lp in params.layers]
    embed = params.embed.values() if isinstance(params.embed, Int8Weight) else params.embed
    return cfg, with_int8_weights(dataclasses.replace(params, layers=layers, embed=embed, lm_head=None))


def test_int8_weights_stay_within_the_bound(gemma3_w8, hf_gemma3, text_tokenizer):
    """Per-row int8 weights: LONG's prompt chunks and cached decode steps keep mean KL <= 1e-3 from transformers'
    float32 logits and its argmax wherever the top-2 gap exceeds 0.5."""
    from model_worker.numerics.quant import Int8Weight

    cfg, params = gemma3_w8
    assert isinstance(params.lm_head, Int8Weight) and params.lm_head.group_size == cfg.hidden_size
    assert all(isinstance(lp.down, Int8Weight) for lp in params.layers)
    _assert_within_the_int8_bound("per-row int8 weights", cfg, params, hf_gemma3, text_tokenizer)


def _row_blocks(*arrays: np.ndarray, rows: int = 64):
    """The arrays' rows in blocks of `rows` (zipped): statistics over [T, 262144] logits taken block by block, so
    float64 temporaries stay ~130 MB instead of 2 GB each (the session also runs three stacks)."""
    for start in range(0, len(arrays[0]), rows):
        yield tuple(a[start:start + rows] for a in arrays)


def _top2(ref: np.ndarray) -> np.ndarray:
    """[T, 2]: each row's two largest values, ascending (np.sort(ref)[:, -2:], block by block)."""
    return np.concatenate([np.sort(np.partition(b, -2, axis=-1)[:, -2:], axis=-1) for (b,) in _row_blocks(ref)])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
