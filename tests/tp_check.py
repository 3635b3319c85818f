"""Tensor-parallel checks on 4 simulated CPU devices, run as one subprocess by
tests/model_worker/test_tensor_parallel.py (the device count must be set before jax is imported); prints one JSON
object with the measurements, which the test asserts on.

  python tests/tp_check.py             (the tiny models)
  python tests/tp_check.py --gemma3 DIR (the embedded Gemma 3, prepared in DIR)

What it runs (the engine's own programs, `Engine.compile_all(keys=...)`, one KV bucket, batch 1):
  * tiny random Gemma 4s at tensor_parallel 1, 2 and 4: "ple" (KV sharing, PLE, 1 KV head: the cache is
    replicated; bf16-valued dense weights) and "int4" (W4A16 packed `Int4Weight`s with zero points, group 16, int8
    KV, 2 KV heads on its sliding layers: split at TP 2, replicated at TP 4): a prompt chunk (compute program)
    and cached decode steps; logits, the per-device shapes of every weight, cache and penalty-state leaf, the
    compiled programs' temporaries and all-gathers;
  * sampling (greedy, seeded top-p, top-k, penalties, bias, masks, top logprobs) on the "ple" prompt's logits
    through the engine's sample programs, at TP 1 and 2;
  * a slot copy on the split cache ("int4", TP 2): the copied slot decodes as the original;
  * a control: `sharding.hidden_gathers` reports the weight gather a row-block loop over a split axis makes;
  * memory (`model_worker.engine.memory`): every engine's per-device bytes of weights, KV cache and penalty state as
    placed against those computed from abstract shapes (the "ple" weights from its config alone), and the
    compiled programs' temporaries against the estimate; a scaled-down synthetic E2B in the qat-w4a16-ct format
    loaded at TP 1 and 2 against its config's abstract int4 weights;
  * the errors: a TP degree that cuts an int4 quantization group, and more devices than there are;
  * with --gemma3: the embedded Gemma 3 270M (Int8Weight GGUF blocks, V = 262144) at TP 1 and 2: one prompt
    chunk and three decode steps, shapes, temporaries and all-gathers at TP 2.
"""

from __future__ import annotations

import os
import sys

# 4 simulated CPU devices; LLVM's optimizations off, which cuts compile time by about a quarter and changes no
# result this script compares (every engine here compiles the same way; the HLO and its sharding are untouched).
for flag in ("--xla_force_host_platform_device_count=4", "--xla_backend_optimization_level=0"):
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

import argparse
import dataclasses
import json
import pathlib
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from families.gemma4.worker import config_from_hf
from model_worker.engine import memory, sharding
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.engine.programs import ProgramKey
from model_worker.modeling.params import Params, param_shapes, random_flat, to_device, with_bf16_matmuls
from model_worker.modeling.sampling import SamplingArrays, pack_mask
from model_worker.numerics import quant
from model_worker.numerics.quant import Bf16Weight, Int4Weight, Int8Weight
from model_worker.serving.engine_api import DecodeBatch, PromptChunk
from tests.gemma4_tiny import K_EQ_V, SHARED

S, F = "sliding_attention", "full_attention"
# Fewer layers than tests/gemma4_tiny.py's (each layer is compile time: ~0.5 s per program on this CPU), every
# feature kept: "ple": PLE, one KV head, layers 2 and 3 KV-shared (reading 0 and 1) with double-wide MLPs;
# "int4": 2 KV heads on the sliding layer, 1 on the full one (k_eq_v), an MLP width that 4 devices split into
# whole groups of 16.
PLE = {**SHARED, "num_hidden_layers": 4, "layer_types": [S, F, S, F], "num_kv_shared_layers": 2}
INT4 = {**K_EQ_V, "num_hidden_layers": 2, "layer_types": [S, F], "intermediate_size": 128}
TPS = (1, 2, 4)
PROMPT = 10  # > the sliding window (8): the rings wrap within the chunk
STEPS = 3
CHUNK = MAX_LEN = 16


def int4(dense: np.ndarray, group: int, rng) -> Int4Weight:
    """A dense [in, out] weight as an asymmetric W4A16 Int4Weight [out, in] (compressed-tensors layout)."""
    w = dense.T.astype(np.float32)
    n, k = w.shape
    groups = w.reshape(n, k // group, group)
    zero = rng.integers(-2, 3, (n, k // group)).astype(np.int8)
    scale = (np.abs(groups).max(-1) / 6.0 + 1e-3).astype(np.float32)
    q = np.clip(np.round(groups / scale[..., None]) + zero[..., None], -8, 7).astype(np.int64).reshape(n, k)
    nibbles = (q + 8).reshape(n, k // 8, 8) << (4 * np.arange(8))
    packed = nibbles.sum(-1).astype(np.uint32).view(np.int32)
    return Int4Weight(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(zero), in_features=k, group_size=group)


def tiny(name: str, group: int = 16):
    """(cfg, float32 Params, kv_int8) of a tiny config."""
    if name == "ple":
        cfg = config_from_hf({**PLE, "model_type": "gemma4_text"}, name)
        flat = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in random_flat(cfg, 1).items()}
        return cfg, to_device(cfg, flat, jnp.float32), False
    cfg = config_from_hf({**INT4, "model_type": "gemma4_text"}, name)
    flat = random_flat(cfg, 2, scale=0.1)
    rng = np.random.default_rng(3)
    linear = ("q", "k", "v", "o", "gate", "up", "down")
    flat = {k: int4(v, group, rng) if k.startswith("layers.") and k.rsplit(".", 1)[1] in linear else v
            for k, v in flat.items()}
    return cfg, to_device(cfg, flat, jnp.float32), True


def engine(cfg, params, tp: int, kv_int8: bool, slots: int = 2, **kw) -> Engine:
    """An engine of `slots` slots over `tp` devices (this script's sizes; `kw` more EngineConfig fields)."""
    return Engine(cfg, params, EngineConfig(num_slots=slots, max_model_len=MAX_LEN, prefill_chunks=(CHUNK,),
                                            kv_int8=kv_int8, prefix_slack=0, tensor_parallel=tp, **kw))


def run(eng: Engine, prompt: list[int], follow: list[int], keys: list) -> dict:
    """The prompt as one chunk into slot 0, then one decode step per `follow` token; logits as numpy."""
    eng.compile_all(keys=keys)
    pending, n = eng.dispatch_compute(chunk=PromptChunk(0, prompt, 0, [False] * len(prompt), clear_penalties=True))
    assert n == len(prompt)
    logits = {"compute": np.asarray(pending.logits)[0], "decode": []}
    for i, tok in enumerate(follow):
        logits["decode"].append(np.asarray(eng.dispatch_decode(batch=DecodeBatch([0], [tok], [len(prompt) + i], [True])).logits)[0])
    logits["pending"] = pending
    return logits


def compare(ref: dict, got: dict) -> dict:
    """Max |Δ| and max |ref| of the compute and decode logits, and whether the argmax agrees wherever the
    reference's top-2 gap is clear (> 1e-3)."""
    rows = [ref["compute"]] + ref["decode"], [got["compute"]] + got["decode"]
    same = []
    for r, g in zip(*rows):
        top2 = np.sort(r)[-2:]
        if top2[1] - top2[0] > 1e-3:
            same.append(int(r.argmax()) == int(g.argmax()))
    return {"compute": float(np.abs(ref["compute"] - got["compute"]).max()),
            "decode": float(max(np.abs(a - b).max() for a, b in zip(ref["decode"], got["decode"]))),
            "scale": float(max(np.abs(r).max() for r in rows[0])), "argmax_same": all(same),
            "argmax_checked": len(same)}


# ----- expected split, derived here from the rules as docs/architecture.md's table states them (independently of sharding.py) -----
def split_axis(name: str, cfg, layer: int | None, tp: int) -> str | None:
    """Which logical dimension of weight `name` must be split at `tp`: "in", "out", "rows" or None."""
    spec = cfg.layers[layer] if layer is not None else None
    out_split = {"q": cfg.num_heads, "k": spec and spec.num_kv_heads, "v": spec and spec.num_kv_heads,
                 "gate": spec and spec.mlp_dim, "up": spec and spec.mlp_dim}
    in_split = {"o": cfg.num_heads, "down": spec and spec.mlp_dim}
    if layer is None and name in ("embed", "lm_head", "ple_embed"):
        rows = cfg.ple_vocab if name == "ple_embed" else cfg.vocab_size
        return "rows" if rows % tp == 0 else None
    if layer is not None and name in out_split:
        return "out" if out_split[name] % tp == 0 else None
    if layer is not None and name in in_split:
        return "in" if in_split[name] % tp == 0 else None
    return None


def expected_leaf_shape(shape: tuple, how: str | None, stored_out_in: bool, tp: int) -> tuple:
    """A leaf's per-device shape: dense Linear weights are [in, out], quantized ones [out, in], tables [rows, _]."""
    if how is None:
        return shape
    axis = {"rows": 0, "out": 0 if stored_out_in else 1, "in": 1 if stored_out_in else 0}[how]
    return tuple(d // tp if i == axis else d for i, d in enumerate(shape))


def shard_report(cfg, params: Params, tp: int) -> dict:
    """Every weight leaf's per-device shape against the expected one; how many leaves are split."""
    bad, split, total = [], 0, 0
    named = [(f.name, None, getattr(params, f.name)) for f in dataclasses.fields(Params) if f.name != "layers"]
    for i, lp in enumerate(params.layers):
        named += [(f.name, i, getattr(lp, f.name)) for f in dataclasses.fields(lp)]
    for name, layer, w in named:
        if w is None:
            continue
        how = split_axis(name, cfg, layer, tp)
        quantized = isinstance(w, (Int4Weight, Int8Weight, Bf16Weight))
        for leaf in jax.tree_util.tree_leaves(w):
            shapes = {tuple(s.data.shape) for s in leaf.addressable_shards}
            want = expected_leaf_shape(tuple(leaf.shape), how, quantized, tp)
            total += 1
            split += want != tuple(leaf.shape)
            if shapes != {want}:
                bad.append(f"{name if layer is None else f'layers.{layer}.{name}'}: {sorted(shapes)} != {want}")
    return {"mismatches": bad, "split": split, "total": total}


def state_report(cfg, eng: Engine, tp: int) -> list[str]:
    """The KV cache (split by KV head where they divide tp, scales alike) and the penalty state ([S, V/tp])."""
    bad = []
    for i, (k, ks) in enumerate(zip(eng.cache.k, eng.cache.k_scale)):
        if k is None:
            continue
        heads = cfg.layers[i].num_kv_heads
        want = k.shape[:2] + (heads // tp if heads % tp == 0 else heads,) + k.shape[3:]
        for a, w in ((k, want), (ks, want[:3])):
            if a is not None and {tuple(s.data.shape) for s in a.addressable_shards} != {w}:
                bad.append(f"cache layer {i}: {a.shape} not split as {w}")
    counts = eng.pstate.counts  # a few token ids a slot: kept whole on every device
    if {tuple(s.data.shape) for s in counts.addressable_shards} != {counts.shape}:
        bad.append(f"penalty counts {counts.shape} not whole on every device")
    return bad


def largest_weight_bytes(params: Params) -> int:
    """Bytes of the largest weight matrix, whole (as if replicated)."""
    quantized = lambda x: isinstance(x, (Int4Weight, Int8Weight, Bf16Weight))
    return max(sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(w))
               for w in jax.tree_util.tree_leaves(params, is_leaf=quantized))


def gather_report(eng: Engine, keys: list) -> dict:
    """Per forward program: per-device temporaries (XLA's memory analysis), the limit, the all-gathers that look
    like a split weight (`sharding.hidden_gathers`) and every all-gather's shape."""
    limit = largest_weight_bytes(eng.params)
    out = {}
    for key in keys:
        if key[0] in ("compute", "decode"):
            compiled = eng._programs[key]
            out[key[0]] = {"temp": int(compiled.memory_analysis().temp_size_in_bytes), "limit": limit,
                           "hidden": sharding.hidden_gathers(compiled, eng.params),
                           "all_gathers": [list(s) for s in sharding.all_gathers(compiled.as_text())]}
    return out


SETTINGS = {  # name -> SamplingArrays fields (one row)
    "greedy": {},
    "greedy-mask": {"mask_on": True},
    "top-p": {"temperature": 0.9, "top_p": 0.8, "seed": (7, 1), "step": 3},
    "top-k": {"temperature": 1.3, "top_k": 5, "seed": (11, 0)},
    "penalties": {"temperature": 0.7, "repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": 0.4,
                  "seed": (5, 5), "top_logprobs": 5},
    "bias-mask-logprobs": {"bias": True, "mask_on": True, "top_logprobs": 20},
}


def sampling(eng: Engine, pending, vocab: int) -> dict:
    """Each setting sampled from the same prompt logits (inactive rows: the penalty state is not changed)."""
    allowed = np.random.default_rng(9).random(vocab) < 0.3
    out = {}
    for name, fields in SETTINGS.items():
        s = SamplingArrays.defaults(1, vocab)
        for k, v in fields.items():
            if k == "bias":
                s.bias_ids[0, :3], s.bias_vals[0, :3] = [5, 17, 300], [8.0, -3.0, 4.0]
            elif k == "mask_on":
                s.mask_on[0], s.mask[0] = True, pack_mask(allowed)
            else:
                getattr(s, k)[0] = v
        r = eng.sample(pending, sampling=s, clear_penalties=[False], active=[False])
        out[name] = {"tokens": r.tokens.tolist(), "logprobs": r.logprobs.tolist(), "top_ids": r.top_ids.tolist(),
                     "top_logprobs": r.top_logprobs.tolist()}
    return out


def tiny_checks() -> dict:
    """Every check on the tiny Gemma 4 configs at TP 1, 2 and 4 (logits, shards, gathers, sampling, copy, memory)."""
    res = {"logits": {}, "shards": {}, "state": {}, "gathers": {}, "notes": {}, "sampling": {}, "copy": {},
           "memory": {}}
    for name in ("ple", "int4"):
        cfg, params, kv_int8 = tiny(name)
        rng = np.random.default_rng(4)
        prompt = rng.integers(3, cfg.vocab_size, PROMPT).tolist()
        follow = rng.integers(3, cfg.vocab_size, STEPS).tolist()
        keys = [ProgramKey("compute", 1, CHUNK, MAX_LEN), ProgramKey("decode", 1, 1, MAX_LEN)]
        ref = None
        for tp in TPS:
            eng = engine(cfg, params, tp, kv_int8)
            copy = name == "int4" and tp == 2
            samples = name == "ple" and tp < 4  # one split suffices for sampling (each program ~2 s to compile)
            extra = ([ProgramKey("copy", 1, 0, 0)] * copy
                     + [ProgramKey("greedy", 1, 0, 0), ProgramKey("sample", 1, 0, 0)] * samples)
            got = run(eng, prompt, follow, keys + extra)
            # "ple" is dense float32 as a config gives it (memory.abstract_params); "int4" as it was loaded
            res["memory"][f"{name}/tp{tp}"] = memory_report(
                cfg, eng, memory.abstract_params(cfg, jnp.float32) if name == "ple" else params)
            if samples:
                res["sampling"][tp] = sampling(eng, got["pending"], cfg.vocab_size)
            if copy:
                res["copy"] = copy_check(eng, len(prompt) + len(follow))
            if tp == 1:
                ref = got
                continue
            key = f"{name}/tp{tp}"
            res["logits"][key] = compare(ref, got)
            res["shards"][key] = shard_report(cfg, eng.params, tp)
            res["state"][key] = state_report(cfg, eng, tp)
            res["gathers"][key] = gather_report(eng, keys)
            res["notes"][key] = eng.layout.notes
    # bfloat16 matmul precision weights (Bf16Weight projections and LM head) split like the rest
    cfg, params, _ = tiny("ple")
    layout = sharding.Layout(cfg, sharding.make_mesh(2))
    res["shards"]["ple-bf16/tp2"] = shard_report(cfg, layout.place_params(with_bf16_matmuls(params)), 2)
    return res


def mixed_check() -> dict:
    """A mixed step (slot 0's prompt chunk with slot 1's decode row in one program) at TP 1 and 2 on the "ple"
    config: both results' logits, compared as `compare` does."""
    cfg, params, kv_int8 = tiny("ple")
    rng = np.random.default_rng(5)
    first, prompt = rng.integers(3, cfg.vocab_size, PROMPT).tolist(), rng.integers(3, cfg.vocab_size, CHUNK).tolist()
    out = {}
    for tp in (1, 2):
        eng = engine(cfg, params, tp, kv_int8)
        eng.compile_all(keys=[ProgramKey("compute", 1, CHUNK, MAX_LEN), ProgramKey("mixed", 1, CHUNK, MAX_LEN)])
        eng.dispatch_compute(chunk=PromptChunk(1, first, 0, [False] * len(first), clear_penalties=True))
        chunk, _, row = eng.dispatch_mixed(chunk=PromptChunk(0, prompt, 0, [False] * CHUNK, True),
                                           batch=DecodeBatch([1], [first[-1]], [len(first)], [True]))
        assert eng.calls[("mixed", 1, CHUNK, MAX_LEN)] == 1
        out[tp] = {"compute": np.asarray(chunk.logits)[0], "decode": [np.asarray(row.logits)[0]]}
    return compare(out[1], out[2])


def memory_report(cfg, eng: Engine, weights, compiled: bool = True) -> dict:
    """The engine's weights, KV cache and penalty state per device as placed, against the same figures from
    abstract shapes (`memory.abstract_state` and `memory.with_shardings` with the engine's layout; `weights`
    unplaced or abstract), by device id; the fullest device's against `memory.footprint` (what `--num-slots
    auto` sizes with); with `compiled`, the compiled programs' largest temporaries against the estimate."""
    ecfg, layout = eng.ecfg, eng.layout
    cache, pstate = memory.abstract_state(cfg, ecfg.num_slots, ecfg.max_model_len, ecfg.dtype, ecfg.kv_int8,
                                          ecfg.prefix_slack, layout)
    abstract = memory.with_shardings(weights, None if layout is None else layout.param_shardings(weights))
    by_id = lambda tree: {d.id: n for d, n in sharding.bytes_by_device(tree).items()}
    fp = memory.footprint(cfg, weights, ecfg, layout)
    slots = ecfg.num_slots
    return {"placed": [by_id(t) for t in (eng.params, eng.cache, eng.pstate)],
            "abstract": [by_id(t) for t in (abstract, cache, pstate)],
            "fullest": [sharding.per_device_bytes(t) for t in (eng.params, eng.cache, eng.pstate)],
            "footprint": [fp.weights, fp.kv_per_slot * slots, fp.penalty_per_slot * slots],
            "temp": [eng.temp_bytes(), fp.temporaries(slots)] if compiled else None}


def checkpoint_memory(tmp: pathlib.Path) -> dict:
    """A scaled-down synthetic E2B in the qat-w4a16-ct format (scripts/make_synthetic_gemma4.py), loaded as the
    worker loads it (bfloat16, int8 KV) into engines at tensor parallel 1 and 2 (placed, not compiled): per-device
    bytes against those computed from its config alone (`memory.abstract_params` with int4 groups of 32)."""
    from families.gemma4.worker import GEMMA4_E2B
    from model_worker.checkpoints.hf_loader import load_checkpoint
    from scripts.make_synthetic_gemma4 import GROUP, scaled_config, write

    write(tmp, scaled_config(GEMMA4_E2B, layers=10, hidden=64, vocab=512), "qat-w4a16-ct")
    cfg, flat = load_checkpoint(tmp, jnp.bfloat16)
    params = to_device(cfg, flat, jnp.bfloat16)
    out = {}
    for tp in (1, 2):
        eng = engine(cfg, params, tp, True, dtype="bfloat16")
        out[f"ct/tp{tp}"] = memory_report(cfg, eng, memory.abstract_params(cfg, jnp.bfloat16, int4_group=GROUP),
                                          compiled=False)
        out[f"ct/tp{tp}"]["int4_leaves"] = sum(isinstance(w, Int4Weight) for w in jax.tree_util.tree_leaves(
            eng.params, is_leaf=lambda x: isinstance(x, Int4Weight)))
    return out


def copy_check(eng: Engine, position: int) -> dict:
    """Slot 0 (its prompt and decode steps computed) copied to slot 1 on the split cache: slot 1 then decodes
    exactly as slot 0 does, and every cache and penalty-state array keeps its split."""
    shards = lambda: [sorted({tuple(s.data.shape) for s in a.addressable_shards})
                      for a in jax.tree_util.tree_leaves((eng.cache, eng.pstate))]
    before = shards()
    eng.copy_slot(src=0, dst=1)
    a = np.asarray(eng.dispatch_decode(batch=DecodeBatch([1], [7], [position], [True])).logits)[0]
    b = np.asarray(eng.dispatch_decode(batch=DecodeBatch([0], [7], [position], [True])).logits)[0]
    return {"max_diff": float(np.abs(a - b).max()), "shards_kept": shards() == before,
            "layer0_k_shards": before[0]}


def error_checks() -> dict:
    """The refusals: a TP degree that cuts an int4 group, more devices than exist."""
    out = {}
    cfg, params, kv_int8 = tiny("int4", group=32)  # o: 64 inputs / 4 devices = 16, half a group of 32
    try:
        engine(cfg, params, 4, kv_int8)
        out["int4_group"] = None
    except ValueError as e:
        out["int4_group"] = str(e)
    cfg, params, kv_int8 = tiny("ple")
    try:
        engine(cfg, params, 8, kv_int8)
        out["too_many"] = None
    except ValueError as e:
        out["too_many"] = str(e)
    dev = jax.devices()[1]
    eng = Engine(cfg, params, EngineConfig(num_slots=1, max_model_len=MAX_LEN, prefill_chunks=(CHUNK,)),
                 devices=[dev])
    out["placed_on_given_device"] = all(x.devices() == {dev} for x in jax.tree_util.tree_leaves(eng.params))
    return out


def gemma3_checks(directory: pathlib.Path) -> dict:
    """The embedded Gemma 3 (prepared in `directory`) at TP 1 and 2: logits, shards and gathers."""
    from safetensors.numpy import load_file

    from model_worker.modeling.config import config_from_dict

    cfg = config_from_dict(json.loads((directory / "config.json").read_text()))
    params = to_device(cfg, load_file(str(directory / "model.safetensors")), jnp.float32)
    assert set(param_shapes(cfg)) <= {"embed", "final_norm"} | {f"layers.{i}.{n}" for i in range(cfg.num_layers)
                                                                for n in sharding.LAYER_AXES}
    prompt, follow = [2, 818, 5279, 529, 7001, 563], [506, 5279, 529]
    max_len = cfg.sliding_window  # one KV bucket (512)
    keys = [ProgramKey("compute", 1, 8, max_len), ProgramKey("decode", 1, 1, max_len)]
    out, ref = {}, None
    for tp in (1, 2):
        eng = Engine(cfg, params, EngineConfig(num_slots=1, max_model_len=max_len, prefill_chunks=(8,),
                                               tensor_parallel=tp))
        got = run(eng, prompt, follow, keys)
        if tp == 1:
            ref = got
            continue
        out = {"logits": compare(ref, got), "shards": shard_report(cfg, eng.params, tp),
               "state": state_report(cfg, eng, tp), "gathers": gather_report(eng, keys), "notes": eng.layout.notes,
               "per_device_weight_bytes": sharding.per_device_bytes(eng.params), "weight_bytes": params.nbytes()}
    return out


def gather_control() -> dict:
    """`sharding.hidden_gathers` must see a real hidden gather, or its empty reports above prove nothing: a
    quantized weight split by rows whose CPU row-block loop (`quant._blocked`) walks the whole split axis (as if
    `row_shards` were not set) makes XLA gather the weight onto every device; with `row_shards` the loop stays
    within each device's rows (`quant._blocked_parts`), gathers nothing and gives the same products."""
    mesh = sharding.make_mesh(2)
    layout = sharding.Layout(config_from_hf({**PLE, "model_type": "gemma4_text"}, "ple"), mesh)
    rng = np.random.default_rng(8)
    dense = rng.standard_normal((64, 4096)).astype(np.float32)  # [in, out]: 4096 rows of 64 inputs
    x = jnp.asarray(rng.standard_normal((3, 64)).astype(np.float32))
    weights = {"int4": int4(dense, 16, rng),
               "int8": Int8Weight(jnp.asarray(rng.integers(-127, 128, (4096, 64)).astype(np.int8)),
                                  jnp.asarray(rng.random((4096, 2)).astype(np.float32)), None, group_size=32)}
    out = {}
    for name, w in weights.items():
        split = layout.named(("model", None))
        ys = {}
        for shards in (1, 2):
            placed = jax.device_put(dataclasses.replace(w, row_shards=shards), split)
            fn = jax.jit(lambda x, w: quant.int4_linear(x, w, "blocked", 64 << 10) if isinstance(w, Int4Weight)
                         else quant.int8_linear(x, w, 64 << 10))  # 16 row blocks of 256 rows (8 per part)
            compiled = fn.lower(x, placed).compile()
            ys[shards] = np.asarray(compiled(x, placed))
            out[f"{name}/row_shards={shards}"] = sharding.hidden_gathers(compiled, placed)
        out[f"{name}/max_diff"] = float(np.abs(ys[1] - ys[2]).max())
        out[f"{name}/ref_diff"] = float(np.abs(ys[2] - np.asarray(jax.jit(quant.linear)(x, w))).max())
    return out


def main() -> None:
    """Run the checks and print their results as one JSON object (the pytest module asserts on it)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gemma3", type=pathlib.Path, help="run only the Gemma 3 checks on this prepared model")
    args = parser.parse_args()
    res = {"devices": len(jax.devices())}
    if args.gemma3:
        res["gemma3"] = gemma3_checks(args.gemma3)
    else:
        res |= tiny_checks()
        res["logits"]["ple-mixed/tp2"] = mixed_check()
        with tempfile.TemporaryDirectory() as tmp:
            res["memory"] |= checkpoint_memory(pathlib.Path(tmp))
        res["errors"] = error_checks()
        res["gather_control"] = gather_control()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
