"""Tensor parallelism (`model_worker/engine/sharding.py`, `EngineConfig.tensor_parallel`) on 4 simulated CPU devices.

The device count is an XLA flag read when jax is imported, so the work runs in subprocesses (tests/tp_check.py,
one for the tiny random Gemma 4s, one for the embedded Gemma 3) that print their measurements as JSON; the tests
assert on them. Every comparison is against the same engine on one device (tensor_parallel 1, today's programs).

Tolerance: everything runs in float32. A split matmul sums its partial products in another order (a projection
split by input rows adds the devices' partial sums once per layer, the LM head's logits come from separate
devices' rows), so logits differ from one device's by float32 rounding, ~1e-6 relative (observed: < 5e-5 on the
embedded model's logits of magnitude ~20). ATOL + RTOL x the largest logit bounds it with a wide margin while
any real error (a head, group or vocabulary part in the wrong place) moves logits by O(0.1). The argmax must be
the same wherever the one-device top-2 gap is clear (> 1e-3).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from families.gemma4.worker import config_from_hf
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.engine.programs import ProgramKey
from model_worker.modeling.params import random_flat, to_device
from tests.gemma4_tiny import SHARED

REPO = pathlib.Path(__file__).resolve().parents[2]
ATOL, RTOL = 1e-4, 1e-4
LOGPROB_TOL = 1e-4  # log-softmax of the logits above: the same rounding, no amplification


def _run(*args: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip())
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tp_check.py"), *args], check=False, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.slow  # compiles model programs on simulated devices in a subprocess: outside `make test-fast`

@pytest.fixture(scope="module")
def tiny() -> dict:
    return _run()


@pytest.fixture(scope="module")
def gemma3(prepared) -> dict:
    return _run("--gemma3", str(prepared.dir))["gemma3"]


def _assert_logits_agree(label: str, r: dict) -> None:
    bound = ATOL + RTOL * r["scale"]
    assert r["compute"] <= bound and r["decode"] <= bound, (label, r, bound)
    assert r["argmax_same"] and r["argmax_checked"] > 0, (label, r)


def test_the_checks_ran_on_four_devices(tiny):
    assert tiny["devices"] == 4
    assert set(tiny["logits"]) == {"ple/tp2", "ple/tp4", "int4/tp2", "int4/tp4", "ple-mixed/tp2"}


def test_prompt_chunk_and_decode_logits_agree_with_one_device(tiny):
    for label, r in tiny["logits"].items():
        _assert_logits_agree(label, r)


def test_sampling_on_split_logits_matches_one_device(tiny):
    one, two = tiny["sampling"]["1"], tiny["sampling"]["2"]
    assert set(one) == {"greedy", "greedy-mask", "top-p", "top-k", "penalties", "bias-mask-logprobs"}
    for name in one:
        a, b = one[name], two[name]
        assert a["tokens"] == b["tokens"], name
        assert a["top_ids"] == b["top_ids"], name
        np.testing.assert_allclose(b["logprobs"], a["logprobs"], atol=LOGPROB_TOL, err_msg=name)
        np.testing.assert_allclose(b["top_logprobs"], a["top_logprobs"], atol=LOGPROB_TOL, err_msg=name)
    assert one["bias-mask-logprobs"]["top_ids"][0][19] >= 0  # 20 alternatives really compared
    assert len({tuple(r["tokens"]) for r in one.values()}) > 2  # the settings choose different tokens


def test_every_weight_and_state_array_is_split_as_the_table_says(tiny):
    for label, r in tiny["shards"].items():
        assert r["mismatches"] == [], label
        assert r["split"] > 0, label
    # ple: per layer q, o, gate, up, down split (k/v: one KV head), plus embed and ple_embed; the bf16 copy adds
    # the LM head
    assert tiny["shards"]["ple/tp2"]["split"] == 4 * 5 + 2
    assert tiny["shards"]["ple-bf16/tp2"]["split"] == tiny["shards"]["ple/tp2"]["split"] + 1
    for label, bad in tiny["state"].items():
        assert bad == [], label
    # a KV head count the devices do not divide is replicated, and said so
    assert any("kv_heads 2 not divisible by 4" in n for n in tiny["notes"]["int4/tp4"])
    assert not any("layers.0.k" in n for n in tiny["notes"]["int4/tp2"])  # 2 KV heads over 2 devices: split


def test_no_step_gathers_a_split_weight(tiny):
    control = tiny["gather_control"]
    for kind in ("int4", "int8"):
        assert control[f"{kind}/row_shards=1"], "the checker must see the gather a whole-axis row loop makes"
        assert control[f"{kind}/row_shards=2"] == []
        assert control[f"{kind}/max_diff"] == 0.0 and control[f"{kind}/ref_diff"] < 1e-4
    for label, programs in tiny["gathers"].items():
        assert set(programs) == {"compute", "decode"}
        for kind, r in programs.items():
            assert r["hidden"] == [], (label, kind)
            assert r["temp"] < r["limit"], (label, kind, r)
            # Nor any activation, but one: where a layer's 2 KV heads stay whole on 4 devices while its query
            # heads are split, XLA computes the K/V entries a step writes into the whole cache split, then gathers
            # them (int8 [1 row, n positions, K 2, D 16] and their [1, n, 2] scales: sharding.py's docstring).
            entries = lambda g: g[:1] == [1] and g[1] <= 8 and g[2:] in ([2, 16], [2])
            allowed = entries if label == "int4/tp4" else (lambda g: False)
            assert all(allowed(g) for g in r["all_gathers"]), (label, kind, r["all_gathers"])


def test_per_device_bytes_from_abstract_shapes_equal_the_placed_arrays(tiny):
    """`model_worker.engine.memory` computes per-device bytes from shapes and shardings alone (the figures of
    benchmarks/tp_memory.py for models too big to load here); every engine's placed weights, KV cache and
    penalty state measure the same on every device, at TP 1, 2 and 4, from a config alone for the dense "ple"
    model and the qat-w4a16-ct checkpoint (its int4 weights packed, int8 KV)."""
    memory = tiny["memory"]
    assert set(memory) == {f"{m}/tp{n}" for m in ("ple", "int4") for n in (1, 2, 4)} | {"ct/tp1", "ct/tp2"}
    for label, r in memory.items():
        tp = int(label[-1])
        assert r["abstract"] == r["placed"], label
        assert all(len(devices) == tp for devices in r["placed"]), label
        assert r["footprint"] == r["fullest"], label
    assert memory["ct/tp1"]["int4_leaves"] > 0
    # split weights shrink per device; the 1-KV-head caches do not (replicated), nor does the penalty state (a few
    # token ids a slot, kept whole)
    for model in ("ple", "ct"):
        one, two = memory[f"{model}/tp1"]["fullest"], memory[f"{model}/tp2"]["fullest"]
        assert one[0] * 0.4 < two[0] < one[0] * 0.6 and two[1] == one[1] and two[2] == one[2], (model, one, two)


def test_the_estimated_temporaries_bound_the_compiled_programs(tiny):
    """`memory.estimate_temporaries`, which sizes `--num-slots auto` before any program exists, is at least the
    largest temporaries XLA reports for the programs compiled (a prompt chunk, decode; sampling for "ple")."""
    for label, r in tiny["memory"].items():
        if r["temp"] is not None:
            measured, estimated = r["temp"]
            assert 0 < measured <= estimated, (label, r["temp"])


def test_slot_copy_on_a_split_cache(tiny):
    copy = tiny["copy"]
    assert copy["layer0_k_shards"] == [[2, 8, 1, 16]]  # [slots, ring, KV heads / 2, head dim]
    assert copy["shards_kept"] and copy["max_diff"] == 0.0


def test_a_split_that_cuts_an_int4_group_names_the_layer(tiny):
    message = tiny["errors"]["int4_group"]
    assert message and message.startswith("layers.0.o:"), message
    assert "64 input features" in message and "parts of 16" in message and "groups of 32" in message


def test_devices_beyond_those_available_are_refused(tiny):
    assert tiny["errors"]["too_many"] == "tensor_parallel 8 needs 8 devices, but only 4 cpu device(s) are available"
    assert tiny["errors"]["placed_on_given_device"]


def _tiny_engine(**kw) -> Engine:
    cfg = config_from_hf({**SHARED, "model_type": "gemma4_text"}, "tiny")
    params = to_device(cfg, random_flat(cfg), jnp.float32)
    return Engine(cfg, params, EngineConfig(num_slots=1, max_model_len=16, prefill_chunks=(16,), **kw))


def test_more_devices_than_this_process_has_is_a_value_error():
    n = len(jax.devices()) + 1
    with pytest.raises(ValueError, match=f"tensor_parallel {n} needs {n} devices, but only {n - 1}"):
        _tiny_engine(tensor_parallel=n)


def test_one_device_has_no_mesh_and_unsharded_programs():
    engine = _tiny_engine()
    assert engine.mesh is None and engine.layout is None
    assert "sharding" not in engine._lower(ProgramKey("decode", 1, 1, 16)).as_text()


@pytest.mark.slow
def test_embedded_gemma3_split_over_two_devices(gemma3):
    _assert_logits_agree("gemma3/tp2", gemma3["logits"])
    assert gemma3["shards"]["mismatches"] == [] and gemma3["state"] == []
    for kind, r in gemma3["gathers"].items():
        assert r["hidden"] == [] and r["all_gathers"] == [] and r["temp"] < r["limit"], (kind, r)
    # 1 KV head: K/V and the cache stay whole on each device; everything else that is split halves
    assert any("cache layer 0: kv_heads 1 not divisible by 2" in n for n in gemma3["notes"])
    assert gemma3["per_device_weight_bytes"] < 0.6 * gemma3["weight_bytes"]
