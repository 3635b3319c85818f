"""Per-device memory of the worker: weights, KV cache, penalty state and step temporaries, and the slots that fit.

One measure for everything: `sharding.bytes_by_device` counts placed arrays by their shards and abstract ones
(`jax.ShapeDtypeStruct`s carrying the `sharding.Layout`'s `NamedSharding`s) by their shard shapes, so the figures
for a model too big to load here (`abstract_params`, `abstract_state`: benchmarks/tp_memory.py) come from the code
that measures a running engine (`device_usage`). tests/tp_check.py checks that both agree on the tiny models at
tensor parallel 1, 2 and 4.

Slots (`--num-slots auto`, `fit_slots`): on a device that reports its memory (`memory_stats()["bytes_limit"]` on
GPU and TPU; XLA's CPU reports none, and keeps the old default of 4), the most slots whose KV cache, penalty state
and per-slot step memory fit in `UTILISATION` of the limit after the weights and the fixed step temporaries,
between 1 and `MAX_AUTO_SLOTS`. The temporaries must be known before the programs exist (their shapes depend on
the slots), so they are estimated from the config, without compiling (`estimate_temporaries`); the worker logs
the compiled programs' own figure next to the estimate once it has compiled them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from model_worker.engine import sharding
from model_worker.modeling.attention import KEY_BLOCK
from model_worker.modeling.config import ModelConfig
from model_worker.modeling.kv_cache import KVCache
from model_worker.modeling.params import LOOKUP_TABLES, Params, param_shapes
from model_worker.modeling.sampling import penalty_capacity, penalty_history_zeros
from model_worker.numerics.q8 import TWIN_BLOCK_BYTES, Q8Weight
from model_worker.numerics.quant import CPU_BLOCK_BYTES, Int4Weight, Int8Weight

#: Share of a device's memory limit that automatic slot sizing fills (the rest: allocator fragmentation, the
#: runtime's own buffers, estimation error).
UTILISATION = 0.9
#: The most slots `--num-slots auto` chooses (every power of two below it is a batch bucket to compile).
MAX_AUTO_SLOTS = 256
#: `--num-slots auto` on a device that reports no memory limit (XLA's CPU): the old fixed default.
DEFAULT_SLOTS = 4
#: Rows of [B, V] float32 per sequence in the sampling step: the logits handed from the forward program, and the
#: sample program's temporaries (penalised logits, probabilities, the sorted copy of top-p / top-k): 5 rows
#: measured on XLA CPU (docs/performance.md, "Sampling temporaries"), one more for margin.
SAMPLING_ROWS = 6


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes an engine holds on its fullest device, as a function of its slots (all linear in them).

    Attributes:
      weights: the weights (split as the engine splits them).
      kv_per_slot: KV cache bytes per slot (full-attention rows of max_model_len plus the sliding rings).
      penalty_per_slot: penalty state bytes per slot (`sampling.PenaltyHistory`: int32 ids and counts of
        `sampling.penalty_capacity` distinct tokens, whole on every device).
      temp_fixed: step temporaries that do not grow with the slots (estimated: `estimate_temporaries`).
      temp_per_slot: step temporaries per slot (estimated: the [B, V] sampling rows and a decode row's
        activations).
    """

    weights: int
    kv_per_slot: int
    penalty_per_slot: int
    temp_fixed: int
    temp_per_slot: int

    @property
    def per_slot(self) -> int:
        """Bytes each slot adds: its KV rows, its penalty rows and its step temporaries."""
        return self.kv_per_slot + self.penalty_per_slot + self.temp_per_slot

    def temporaries(self, slots: int) -> int:
        """Estimated step temporaries with `slots` slots."""
        return self.temp_fixed + slots * self.temp_per_slot

    def total(self, slots: int) -> int:
        """Estimated bytes on the fullest device with `slots` slots."""
        return self.weights + self.temp_fixed + slots * self.per_slot


def fit_slots(capacity: int | None, fp: Footprint, utilisation: float = UTILISATION,
              max_slots: int = MAX_AUTO_SLOTS, default: int = DEFAULT_SLOTS) -> int:
    """The slots `--num-slots auto` chooses: floor((capacity x utilisation - weights - fixed temporaries) / bytes
    per slot), between 1 and `max_slots`; `default` when the device reports no capacity (None: XLA's CPU).

    At least 1 even when not one slot fits the utilised share: `check_slots` then decides against the whole
    limit, and fails with the numbers when even that is too small.
    """
    if capacity is None:
        return default
    free = capacity * utilisation - fp.weights - fp.temp_fixed
    return max(1, min(max_slots, math.floor(free / fp.per_slot)))


class SlotsDoNotFit(ValueError):
    """The slots asked for (or a single one) need more memory than the device has (`check_slots`)."""


def check_slots(slots: int, capacity: int | None, fp: Footprint, where: str = "the device") -> None:
    """Refuse `slots` slots whose estimated bytes exceed the device's limit (no check without a limit).

    Raises:
      SlotsDoNotFit: the message gives the weights, the KV cache, penalty state and temporaries per slot, the fixed
        temporaries, the total, the limit and how many slots would fit.
    """
    if capacity is None or fp.total(slots) <= capacity:
        return
    fits = math.floor((capacity - fp.weights - fp.temp_fixed) / fp.per_slot)
    size = size_text
    advice = (f"at most {fits} slot(s) fit (--num-slots auto takes {fit_slots(capacity, fp)})" if fits > 0 else
              "not one slot fits: a shorter --max-model-len, int8 KV (--kv-cache-dtype int8), more "
              "--tensor-parallel devices or a smaller model")
    raise SlotsDoNotFit(
        f"{slots} slot{'s' * (slots != 1)} do{'es' * (slots == 1)} not fit {where}: weights {size(fp.weights)} + temporaries {size(fp.temp_fixed)} + "
        f"{slots} x {size(fp.per_slot)} per slot (KV {size(fp.kv_per_slot)}, penalty state "
        f"{size(fp.penalty_per_slot)}, temporaries {size(fp.temp_per_slot)}) = {size(fp.total(slots))} > limit "
        f"{size(capacity)}; {advice}")


# ----- abstract trees ------------------------------------------------------------------------------------------
def with_shardings(tree, shardings=None):
    """`tree`'s arrays (placed or abstract) as `jax.ShapeDtypeStruct`s, each with the sharding at the same place
    in `shardings` (a tree with the same leaves in the same order, e.g. `Layout.param_shardings(tree)`, whose
    structure is kept: quantized weights then carry their `row_shards` / `col_shards`); unsharded when
    `shardings` is None (one device)."""
    if shardings is None:
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    placed, treedef = jax.tree_util.tree_flatten(shardings)
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) != len(placed):
        raise ValueError(f"{len(leaves)} arrays but {len(placed)} shardings")
    return treedef.unflatten([jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, placed)])


def abstract_params(cfg: ModelConfig, dtype, int4_group: int | None = None) -> Params:
    """The weights of `cfg` as a checkpoint loads them (`hf_loader.load_checkpoint` + `params.to_device`), as
    `jax.ShapeDtypeStruct`s: every tensor dense in `dtype` (a bf16 release at bfloat16); with `int4_group`, every
    Linear (2-D and not a table: the layers' projections and Gemma 4's PLE projections) a symmetric packed
    `Int4Weight` [out, in] with bfloat16 scales per group of `int4_group` inputs, the `qat-w4a16-ct` layout
    (docs/formats.md §1-2), tables and norms in `dtype`."""
    flat = {}
    for name, shape in param_shapes(cfg).items():
        if int4_group and len(shape) == 2 and name not in LOOKUP_TABLES:
            k, n = shape
            flat[name] = Int4Weight(jax.ShapeDtypeStruct((n, -(-k // 8)), jnp.int32),
                                    jax.ShapeDtypeStruct((n, k // int4_group), jnp.bfloat16), None, in_features=k,
                                    group_size=int4_group)
        else:
            flat[name] = jax.ShapeDtypeStruct(shape, dtype)
    return Params.from_flat(cfg, flat)


def abstract_state(cfg: ModelConfig, num_slots: int, max_len: int, dtype, kv_int8: bool, slack: int,
                   layout: sharding.Layout | None = None) -> tuple[KVCache, object]:
    """(KV cache, penalty state) as `Engine` allocates them (`KVCache.zeros`, `penalty_history_zeros`, split by
    `layout` when given), as `jax.ShapeDtypeStruct`s: nothing is allocated."""
    cache = jax.eval_shape(lambda: KVCache.zeros(cfg, num_slots, max_len, jnp.dtype(dtype), int8=kv_int8,
                                                 slack=slack))
    pstate = jax.eval_shape(lambda: penalty_history_zeros(num_slots, penalty_capacity(max_len, cfg.vocab_size)))
    if layout is None:
        return cache, pstate
    shapes = KVCache.shapes(cfg, num_slots, max_len, slack)
    return (with_shardings(cache, layout.cache_shardings(shapes, kv_int8)),
            with_shardings(pstate, layout.penalty_shardings(num_slots, max_len)))


# ----- the footprint -------------------------------------------------------------------------------------------
def _part(count: int, n: int) -> int:
    """A dimension of `count` units on one of n devices: split when n divides it, else whole (replicated), as
    `sharding.Layout.resolve` decides."""
    return count // n if count % n == 0 else count


def estimate_temporaries(cfg: ModelConfig, ecfg, weights: Params, tp: int = 1,
                         platform: str | None = None) -> tuple[int, int]:
    """(fixed, per slot) bytes of step temporaries on one device, from the config alone (no compilation): an
    upper estimate of XLA's `temp_size_in_bytes` over the program grid, plus the logits buffers.

    Every value is counted at 4 bytes (float32: scores, probabilities and sums are float32 whatever the
    activations). Per device, the heads N, MLP width F and vocabulary V are those of one part (`_part`).
      * fixed: the largest prompt chunk C: attention scores and probabilities [N, C, span] (span: a sliding
        layer's ring plus the chunk, or a full layer's key block), twice the chunk's activations
        C x (H + 2 N D_max + 2 F_max + L P) (residual, queries and attention output, gate and up, Gemma 4's
        per-layer inputs; twice: a value and the next live together), and the largest quantized projection
        (or quantized tied LM head) dequantized: whole on accelerators, which unpack one weight at a time before
        its product (`quant.int4_linear`, `int8_linear`), a row block of at most 2 x `quant.CPU_BLOCK_BYTES` on
        CPU; for block-int8 weights the twin runs (not the CPU kernel), one block of its sums
        (`q8.TWIN_BLOCK_BYTES`).
      * per slot: `SAMPLING_ROWS` rows of [V] (logits and sampling), and twice a decode row's activations.

    Against XLA CPU's figures it errs high, on an E2B look-alike with 512-token chunks and on the tiny models,
    whose compiled programs tests/tp_check.py checks it bounds (figures: docs/performance.md, "Estimated step
    temporaries against XLA CPU's"). Not measured on an accelerator: the worker logs both figures at start and
    warns when the compiled one is larger.

    Args:
      cfg, ecfg: the model and engine configs (`EngineConfig`: chunks, max_model_len, prefix_slack, dtype).
      weights: the weights as the engine holds them (placed or abstract; quantized ones with their
        `row_shards` / `col_shards`).
      tp: devices the engine splits over.
      platform: "cpu", "gpu" or "tpu" (default: `jax.default_backend()`), for the dequantization term.
    """
    chunk = max(ecfg.prefill_chunks)
    heads = _part(cfg.num_heads, tp)
    head_dim = max(s.head_dim for s in cfg.layers)
    mlp = max(_part(s.mlp_dim, tp) for s in cfg.layers)
    sliding = [s for s in cfg.layers if s.attention == "sliding"]
    ring = min(cfg.sliding_window + ecfg.prefix_slack, ecfg.max_model_len)
    span = max([min(KEY_BLOCK, ecfg.max_model_len)] + ([ring + chunk] if sliding else []))
    width = cfg.hidden_size + 2 * heads * head_dim + 2 * mlp + cfg.num_layers * cfg.ple_dim
    attention = 2 * chunk * heads * span * 4
    quantized = lambda x: isinstance(x, (Int4Weight, Int8Weight))
    linears = [weights.ple_proj, *weights.layers] + ([weights.embed] if weights.lm_head is None else [])
    linears += [weights.lm_head] if quantized(weights.lm_head) else []  # int8 weights' head (`with_int8_weights`)
    dequant = max((_dense_bytes(w, jnp.dtype(ecfg.dtype).itemsize)
                   for w in jax.tree_util.tree_leaves(linears, is_leaf=quantized) if quantized(w)), default=0)
    on_cpu = (platform or jax.default_backend()) == "cpu"
    if on_cpu:
        dequant = min(dequant, 2 * CPU_BLOCK_BYTES)
    on_twin = lambda x: isinstance(x, Q8Weight) and not (x.tiled and on_cpu)
    if any(on_twin(w) for w in jax.tree_util.tree_leaves(weights, is_leaf=lambda x: isinstance(x, Q8Weight))):
        dequant = max(dequant, TWIN_BLOCK_BYTES)  # the int8 twin's sums and terms of one block of weight rows
    fixed = attention + 2 * chunk * width * 4 + dequant
    return fixed, SAMPLING_ROWS * _part(cfg.vocab_size, tp) * 4 + 2 * width * 4


def _dense_bytes(w: Int4Weight | Int8Weight, itemsize: int) -> int:
    """Bytes of one device's part of a quantized weight, dequantized to `itemsize`-byte values."""
    n, k = (w.out_features, w.in_features) if isinstance(w, Int4Weight) else w.shape
    return n * k * itemsize // (w.row_shards * w.col_shards)


def footprint(cfg: ModelConfig, params: Params, ecfg, layout: sharding.Layout | None = None,
              platform: str | None = None) -> Footprint:
    """What an engine of `ecfg` (its `num_slots` aside) holds on its fullest device: the weights as `layout`
    splits them (None: one device), the KV cache and penalty state of one slot, and the estimated temporaries.

    Args:
      params: the weights, placed anywhere or abstract (`abstract_params`), unsplit.
      platform: where the engine runs, for the temporaries (`estimate_temporaries`; default: this process's).
    Raises:
      ValueError: from `Layout.param_shardings` (a split that cuts a quantization group).
    """
    weights = with_shardings(params, None if layout is None else layout.param_shardings(params))
    cache, pstate = abstract_state(cfg, 1, ecfg.max_model_len, ecfg.dtype, ecfg.kv_int8, ecfg.prefix_slack, layout)
    tp = 1 if layout is None else layout.mesh.size
    fixed, per_slot = estimate_temporaries(cfg, ecfg, weights, tp, platform)
    return Footprint(weights=sharding.per_device_bytes(weights), kv_per_slot=sharding.per_device_bytes(cache),
                     penalty_per_slot=sharding.per_device_bytes(pstate), temp_fixed=fixed, temp_per_slot=per_slot)


def capacity(devices) -> int | None:
    """The smallest memory limit among `devices` (`memory_stats()["bytes_limit"]`), None when one of them reports
    none (XLA's CPU)."""
    limits = [device_limit(d) for d in devices]
    return None if not limits or None in limits else min(limits)


def device_limit(device) -> int | None:
    """One device's memory limit in bytes (`memory_stats()["bytes_limit"]`), None when it reports none."""
    stats = device.memory_stats()  # None on XLA's CPU
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def size_slots(cfg: ModelConfig, params: Params, ecfg, auto: bool, devices=None):
    """The engine config with its slots decided for the devices it will run on, and the figures behind them.

    `auto`: `fit_slots` (`DEFAULT_SLOTS` without a limit); else `ecfg.num_slots` as given. Either way the result
    must fit the smallest limit of the devices (`check_slots`).

    Args:
      params: the loaded (unsplit) weights.
      devices: the devices the engine uses (default: the first `ecfg.tensor_parallel` of `jax.devices()`, as
        `Engine` takes them).
    Returns:
      (EngineConfig, Footprint, capacity in bytes or None).
    Raises:
      SlotsDoNotFit: the slots do not fit (`check_slots`).
      ValueError: a split cuts a quantization group (`sharding.Layout`).
    """
    devices = list(jax.devices() if devices is None else devices)[: ecfg.tensor_parallel]
    layout = None
    if ecfg.tensor_parallel != 1:
        layout = sharding.Layout(cfg, sharding.make_mesh(ecfg.tensor_parallel, devices))
    fp = footprint(cfg, params, ecfg, layout)
    limit = capacity(devices)
    slots = fit_slots(limit, fp) if auto else ecfg.num_slots
    where = ", ".join(f"{d.id} ({d.device_kind})" for d in devices)
    check_slots(slots, limit, fp, where=f"device{'s' if len(devices) > 1 else ''} {where}")
    return dataclasses.replace(ecfg, num_slots=slots), fp, limit


def slots_text(slots: int, auto: bool, fp: Footprint, capacity: int | None) -> str:
    """How the slots were decided, for the start log: "37 slots (auto: 0.9 x the 79 GiB limit): weights 9.5 GiB;
    per slot KV 1.2 GiB, penalty state 128 KiB, temporaries 6.1 MiB; fixed temporaries 178 MiB (estimated)"."""
    how = ("as given" if not auto else f"auto: {UTILISATION:g} x the {size_text(capacity)} limit" if capacity
           else "auto: the device reports no memory limit")
    return (f"{slots} slot{'s' * (slots != 1)} ({how}): weights {size_text(fp.weights)}; per slot KV {size_text(fp.kv_per_slot)}, "
            f"penalty state {size_text(fp.penalty_per_slot)}, temporaries {size_text(fp.temp_per_slot)}; fixed "
            f"temporaries {size_text(fp.temp_fixed)} (estimated)")


# ----- a running engine ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceUsage:
    """What one device of a running engine holds, in bytes.

    Attributes:
      device: the `jax.Device`.
      weights, kv, penalties: its shards of the weights, the KV cache and the penalty state.
      temporaries: the largest step temporaries of the compiled programs (XLA's memory analysis; the same on
        every device of a mesh).
      capacity: its memory limit, None when it reports none.
    """

    device: object
    weights: int
    kv: int
    penalties: int
    temporaries: int
    capacity: int | None

    def line(self) -> str:
        """One log line, e.g. "device 0 (cpu): weights 149 MiB, KV 18 MiB, penalty state 512 KiB, temporaries
        26 MiB"."""
        size = size_text
        limit = "" if self.capacity is None else f" (of a {size(self.capacity)} limit)"
        return (f"device {self.device.id} ({self.device.device_kind}): weights {size(self.weights)}, KV "
                f"{size(self.kv)}, penalty state {size(self.penalties)}, temporaries {size(self.temporaries)}"
                + limit)


def device_usage(engine) -> list[DeviceUsage]:
    """Per device of `engine` (every device holding any of its arrays, by id): its weight, KV cache and penalty
    state shards, measured from the placed arrays, and the compiled programs' largest temporaries."""
    weights, kv, penalties = (sharding.bytes_by_device(t) for t in (engine.params, engine.cache, engine.pstate))
    temp = engine.temp_bytes()
    devices = sorted(set(weights) | set(kv) | set(penalties), key=lambda d: d.id)
    return [DeviceUsage(d, weights.get(d, 0), kv.get(d, 0), penalties.get(d, 0), temp, device_limit(d))
            for d in devices]


def size_text(n: float) -> str:
    """Bytes for a person (logs, benchmarks): "149 MiB", "1.2 GiB", "512 KiB", "12 B"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(n)} B"
