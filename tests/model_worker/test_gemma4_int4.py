"""Packed-int4 Gemma 4 forward == the forward on compressed-tensors' own decompressed weights.

A tiny random Gemma 4 (KV sharing, PLE, double-wide MLPs, window 8) is written by transformers in bf16 and
compressed to W4A16 by the compressed-tensors library (group 32; symmetric and asymmetric). Our loader keeps the
int4 packed (Int4Weight, unpacked inside the jitted matmul); the reference replaces every quantized module by the
library's decompression (`PackedQuantizationCompressor.decompress`, float32 scales so the values are exact) as a
dense weight. Both run float32 through the same forward, so they differ only by matmul summation order
(TOL as in the dense Gemma 4 tests); a nibble-order, zero-point or scale-group bug moves logits by O(1).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

from model_worker.checkpoints.hf_loader import load_checkpoint  # noqa: E402
from model_worker.modeling.kv_cache import KVCache  # noqa: E402
from model_worker.modeling.model import forward_jit  # noqa: E402
from model_worker.modeling.params import to_device  # noqa: E402
from model_worker.numerics.quant import Int4Weight  # noqa: E402
from tests.ct_checkpoint import compress_checkpoint, decompress_weight  # noqa: E402
from tests.gemma4_tiny import SHARED, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow  # compiles model programs or reads a reference: outside `make test-fast`

TOL = 2e-4
TINY = {**SHARED, "hidden_size_per_layer_input": 32}  # every Linear's K is a multiple of 32


@pytest.fixture(scope="module", params=[True, False], ids=["symmetric", "asymmetric"])
def compressed(request, tmp_path_factory):
    src = tmp_path_factory.mktemp("bf16")
    write_checkpoint(TINY, src, dtype="bfloat16")
    dst = tmp_path_factory.mktemp("w4a16")
    quantized = compress_checkpoint(src, dst, symmetric=request.param, group_size=32)
    return dst, quantized


def reference_flat(dst, flat: dict) -> dict:
    """Our flat weights with every Int4Weight replaced by the library's decompression ([in, out], float32)."""
    from safetensors import safe_open

    config = json.loads((dst / "config.json").read_text())
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"]
    ref = dict(flat)
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        modules = {n.rsplit(".", 1)[0] for n in names if n.endswith(".weight_packed")}
        by_ours = {}
        for m in modules:
            text = m.removeprefix("model.")
            ours = (text.replace("layers.", "layers.", 1)
                    .replace("self_attn.q_proj", "q").replace("self_attn.k_proj", "k")
                    .replace("self_attn.v_proj", "v").replace("self_attn.o_proj", "o")
                    .replace("mlp.gate_proj", "gate").replace("mlp.up_proj", "up").replace("mlp.down_proj", "down")
                    .replace("per_layer_input_gate", "ple_gate").replace("per_layer_model_projection", "ple_proj")
                    .replace("per_layer_projection", "ple_proj"))
            tensors = {t: f.get_tensor(f"{m}.{t}") for t in ("weight_packed", "weight_scale", "weight_shape",
                                                               "weight_zero_point") if f"{m}.{t}" in names}
            tensors["weight_scale"] = tensors["weight_scale"].float()
            by_ours[ours] = decompress_weight(tensors, scheme).float().numpy().T
    for name, value in flat.items():
        if isinstance(value, Int4Weight):
            ref[name] = jnp.asarray(by_ours[name])
    assert set(by_ours) == {n for n, v in flat.items() if isinstance(v, Int4Weight)}
    return ref


def run(cfg, params, ids, steps: int = 10):
    """Chunked prefill (chunk 8) then greedy cached decode; returns the logits of every position."""
    cache = KVCache.zeros(cfg, 1, 64, jnp.float32)
    out = []
    for start in range(0, len(ids), 8):
        piece = ids[start : start + 8]
        tokens = np.zeros((1, 8), np.int32)
        positions = np.full((1, 8), -1, np.int32)
        tokens[0, : len(piece)] = piece
        positions[0, : len(piece)] = np.arange(start, start + len(piece))
        logits, cache = forward_jit(params, tokens, positions, cache, None, cfg=cfg, kv_len=64)
        out.append(np.asarray(logits[0, : len(piece)]))
    seq = list(ids)
    for _ in range(steps):
        seq.append(int(out[-1][-1].argmax()))
        logits, cache = forward_jit(params, np.array([[seq[-1]]], np.int32), np.array([[len(seq) - 1]], np.int32),
                                    cache, None, cfg=cfg, kv_len=64)
        out.append(np.asarray(logits)[0])
    return np.concatenate(out)


def test_int4_forward_matches_library_decompression(compressed):
    dst, quantized = compressed
    cfg, flat = load_checkpoint(dst, jnp.float32)
    packed = [n for n, v in flat.items() if isinstance(v, Int4Weight)]
    assert len(packed) == len(quantized) and any(n.endswith("ple_proj") for n in packed)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 20)
    ours = run(cfg, to_device(cfg, flat, jnp.float32), ids)
    ref = run(cfg, to_device(cfg, reference_flat(dst, flat), jnp.float32), ids)
    diff = np.abs(ours - ref).max()
    assert diff < TOL, f"max |Δlogit| {diff:.2e}"
