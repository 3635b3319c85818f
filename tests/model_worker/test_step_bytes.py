"""The bytes a step reads, as benchmarks/decode_step.py counts them (`step_bytes`), against independent counts:
the arrays' own nbytes, and K/V sizes from the model config.

The model is a tiny synthetic W4A16 Gemma 4 (scripts/make_synthetic_gemma4.py: packed int4 Linears with bf16
scales, the tied embedding as LM head, the per-layer table, KV-shared layers, sliding rings). Tensor parallelism
runs in a subprocess on 2 simulated CPU devices (the device count is fixed when jax is imported).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import pytest

from benchmarks.decode_step import decode_bytes, step_bytes
from families.gemma4.worker import GEMMA4_E2B
from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.modeling.params import to_device
from model_worker.numerics.quant import Int4Weight
from scripts.make_synthetic_gemma4 import scaled_config, write

pytestmark = pytest.mark.slow  # compiles model programs or reads a reference: outside `make test-fast`

REPO = pathlib.Path(__file__).resolve().parents[2]
CFG = scaled_config(GEMMA4_E2B, layers=10, hidden=256, vocab=2048)
ECFG = dict(num_slots=4, max_model_len=2048, prefill_chunks=(16,), dtype="float32")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("w4a16")
    write(out, CFG, "qat-w4a16-ct")
    return out


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    cfg, flat = load_checkpoint(checkpoint, jnp.float32)
    return Engine(cfg, to_device(cfg, flat, jnp.float32), EngineConfig(**ECFG))


def _ple_row_bytes(params) -> int:
    return params.ple_embed.nbytes // params.ple_embed.shape[0]


def _expected_kv(engine: Engine, positions: list[int], owners: bool) -> int:
    """K + V bytes from the config: per row, a full layer's positions [0, p], a sliding layer's ring."""
    cfg, ecfg = engine.cfg, engine.ecfg
    ring = min(cfg.sliding_window + ecfg.prefix_slack, ecfg.max_model_len)
    itemsize = jnp.dtype(ecfg.dtype).itemsize
    total = 0
    for i, spec in enumerate(cfg.layers):
        if (spec.kv_source == i) != owners:
            continue
        src = cfg.layers[spec.kv_source]
        per_position = 2 * src.num_kv_heads * src.head_dim * itemsize
        total += sum(per_position * (p + 1 if src.attention == "full" else ring) for p in positions)
    return total


def test_weights_are_every_array_but_the_rows_of_the_lookup_table(engine):
    p = engine.params
    assert p.lm_head is None, "the tied embedding is the LM head: read whole"
    assert sum(isinstance(w, Int4Weight) for lp in p.layers for w in (lp.q, lp.o, lp.gate, lp.up, lp.down)) == 50
    for batch in (1, 3):
        got = decode_bytes(engine, batch, 512).weights
        assert got == p.nbytes() - p.ple_embed.nbytes + batch * _ple_row_bytes(p)


def test_kv_is_each_owned_cache_up_to_the_rows_positions(engine):
    positions = [99, 1500, 7]
    got = step_bytes(engine, positions, len(positions))
    assert got.kv == _expected_kv(engine, positions, owners=True) > 0
    assert got.kv_shared == _expected_kv(engine, positions, owners=False) > 0
    assert got.total == got.weights + got.kv + got.kv_shared
    # every slot at the last position reads every owned cache array whole
    full = decode_bytes(engine, engine.ecfg.num_slots, engine.ecfg.max_model_len)
    assert full.kv == engine.cache.nbytes()
    assert decode_bytes(engine, 2, 1024).kv == 2 * decode_bytes(engine, 1, 1024).kv


TP_SCRIPT = """
import json, pathlib, sys
import jax, jax.numpy as jnp
from benchmarks.decode_step import decode_bytes
from model_worker.engine import sharding
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.modeling.params import to_device
cfg, flat = load_checkpoint(pathlib.Path(sys.argv[1]), jnp.float32)
params = to_device(cfg, flat, jnp.float32)
out = {"one": decode_bytes(Engine(cfg, params, EngineConfig(**json.loads(sys.argv[2]))), 2, 1024).__dict__}
engine = Engine(cfg, params, EngineConfig(**json.loads(sys.argv[2]), tensor_parallel=2))
p = engine.params
out["two"] = decode_bytes(engine, 2, 1024).__dict__
out["split_weights"] = sharding.per_device_bytes([p.embed, p.final_norm, p.layers, p.ple_proj, p.ple_norm])
out["ple_row"] = p.ple_embed.nbytes // p.ple_embed.shape[0]
out["devices"] = len(jax.devices())
print(json.dumps(out))
"""


def test_tensor_parallel_counts_each_devices_shards(checkpoint):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
    ecfg = {k: list(v) if isinstance(v, tuple) else v for k, v in ECFG.items()}
    proc = subprocess.run([sys.executable, "-c", TP_SCRIPT, str(checkpoint), json.dumps(ecfg)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["devices"] == 2
    # weights: the fullest device's shards of everything read whole, plus the two looked-up rows of its table part
    assert r["two"]["weights"] == r["split_weights"] + 2 * r["ple_row"]
    assert r["one"]["weights"] / 2 < r["two"]["weights"] < r["one"]["weights"]
    # one KV head: 2 devices cannot split it, so each keeps and reads the whole cache
    assert r["two"]["kv"] == r["one"]["kv"]
