"""Resident weight bytes per checkpoint format match the arithmetic, and int4 is never expanded up front.

The checkpoints are scaled-down synthetic Gemma 4 E2B look-alikes (real names, layout and config files) from
scripts/make_synthetic_gemma4.py, one per format.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from families.gemma4.worker import GEMMA4_E2B
from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.engine.programs import ProgramKey
from model_worker.modeling.params import param_shapes, to_device
from scripts.make_synthetic_gemma4 import GROUP, scaled_config, write

pytestmark = pytest.mark.slow  # compiles model programs or reads a reference: outside `make test-fast`

CFG = scaled_config(GEMMA4_E2B, layers=10, hidden=256, vocab=2048)
DENSE_ONLY = {"embed", "ple_embed"}  # tables stay bf16 in every format (docs/formats.md §2)


def _is_linear(name: str, shape) -> bool:
    return len(shape) == 2 and name not in DENSE_ONLY


@pytest.fixture(scope="module", params=["bf16", "qat-q4_0-unquantized", "qat-w4a16-ct"])
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    write(out, CFG, request.param)
    return request.param, out


def expected_bytes(fmt: str) -> int:
    """bf16 everywhere; for W4A16 every decoder Linear and PLE projection is N*K/2 bytes of int4 plus one bf16
    scale per group of 32 inputs."""
    total = 0
    for name, shape in param_shapes(CFG).items():
        n = int(np.prod(shape))
        if fmt == "qat-w4a16-ct" and _is_linear(name, shape):
            k_in, n_out = shape
            total += n_out * k_in // 2 + n_out * (k_in // GROUP) * 2
        else:
            total += 2 * n
    return total


def test_resident_bytes_match_arithmetic(checkpoint):
    fmt, path = checkpoint
    cfg, flat = load_checkpoint(path, jnp.bfloat16)
    params = to_device(cfg, flat, jnp.bfloat16)
    assert params.nbytes() == expected_bytes(fmt)
    if fmt == "qat-w4a16-ct":
        dense = expected_bytes("bf16")
        assert params.nbytes() < 0.45 * dense, (params.nbytes(), dense)


def _largest_layer_dequantized_bytes(itemsize: int) -> int:
    per_layer = {}
    for name, shape in param_shapes(CFG).items():
        if name.startswith("layers.") and _is_linear(name, shape):
            layer = int(name.split(".")[1])
            per_layer[layer] = per_layer.get(layer, 0) + int(np.prod(shape)) * itemsize
    return max(per_layer.values())


@pytest.mark.parametrize("key", [ProgramKey("decode", 2, 1, 512), ProgramKey("compute", 1, 16, 512)], ids=["decode", "compute"])
def test_int4_step_temporaries_stay_below_two_layers(tmp_path_factory, key):
    """XLA's memory analysis of the compiled step: int4 weights are unpacked layer by layer, never all up front
    (all of them dequantized would be ~10 layers' worth)."""
    out = tmp_path_factory.mktemp("w4a16")
    write(out, CFG, "qat-w4a16-ct")
    cfg, flat = load_checkpoint(out, jnp.float32)
    params = to_device(cfg, flat, jnp.float32)
    engine = Engine(cfg, params, EngineConfig(num_slots=2, max_model_len=1024, prefill_chunks=(16,), dtype="float32"))
    compiled = engine._lower(key).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    two_layers = 2 * _largest_layer_dequantized_bytes(4)
    assert temp < two_layers, f"temporaries {temp} B >= two layers of dequantized weights {two_layers} B"
