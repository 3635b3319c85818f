"""Tensor parallelism: one table of logical axes for every weight, cache and sampling array, resolved on a mesh.

The engine (`engine.Engine`, `EngineConfig.tensor_parallel` = N) runs every program over a one-axis mesh of N
devices, axis `model` (`make_mesh`). What is split where is declared once, as jax-llm-examples' `ShardingRules`
does it: each array names its dimensions by logical axis (`WEIGHT_AXES`, `LAYER_AXES`, `CACHE_AXES`,
`PENALTY_AXES`, `LOGITS_AXES`), and `ShardingRules` maps each logical axis to a mesh axis or None (replicated).
`Layout` resolves the table for one model config and mesh into `NamedSharding`s, places the weights, allocates the
KV cache and penalty state already split, and gives the compiled programs their in/out shardings. The model code
(`model.py` and below) never names the mesh: XLA's SPMD partitioner splits each step from the shardings of its
arguments and results.

The split (Megatron-LM's): query heads split over `model` (Wq by its output columns, Wo by its input rows, so
the attention output is summed across devices once per layer); K/V projections and the KV cache split by KV
head when the layer's KV heads divide N, else replicated (then TP frees only weight memory: every device keeps
the whole cache); the MLP's gate and up by their output columns, down by its input rows (one sum per layer); the
embedding, the tied LM head (`embed`, and `lm_head` when present) and Gemma 4's per-layer table `ple_embed` by
vocabulary rows (a lookup is a masked local lookup plus a sum; the LM head yields logits split over the
vocabulary, which stay split into the sample programs; the penalty state, a few token ids a slot, is kept whole).
Norms, the layer scalar and Gemma 4's small per-layer-input projections are replicated. A dimension whose count
(heads, KV heads, MLP width, vocabulary rows) N does not divide is replicated for that array and listed in
`Layout.notes`.

Quantized weights (`Int4Weight`, `Int8Weight`, `Bf16Weight`, stored [out, in]) split along the same logical
dimension as the dense weight they replace, every leaf alike (packed words, scales, zero points, offsets). A
split of the input dimension must keep whole quantization groups and whole packed int32 words on each device:
`Layout.place_params` raises ValueError naming the weight otherwise. Packed int4 stays packed on every device;
a quantized weight carries the number of parts of its rows and input columns (`row_shards`, `col_shards`), so
the CPU row-block loop stays within each device's rows (`quant._blocked_parts`) and its dependency on the
activations reads no single element of a split activation (`quant._zero_after`).

The forward programs gather no weight and, in the tests' models, no activation either (the split projections
end in all-reduced partial sums), with one exception: in a layer whose KV heads stay whole while its query heads
are split (KV heads that N does not divide, query heads that it does), XLA computes the K/V entries a step
writes into that layer's whole cache split, then gathers them ([rows, positions, K, D] plus int8 scales: a
decode step's one token per row, a prompt chunk's ring rows), once per such layer and step. What the sample
programs gather: `sampling`'s module docstring. `hidden_gathers` and `per_device_bytes` check and size the result
(tests, memory accounting).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model_worker.engine.programs import SampleInputs
from model_worker.modeling.config import ModelConfig
from model_worker.modeling.kv_cache import KVCache
from model_worker.modeling.params import LOOKUP_TABLES, LayerParams, Params
from model_worker.modeling.sampling import PenaltyHistory, penalty_capacity, penalty_history_zeros
from model_worker.numerics.quant import Bf16Weight, Int4Weight, Int8Weight

#: The mesh axis tensor parallelism splits over.
MODEL = "model"
_LAYER_PREFIX = re.compile(r"layers\.\d+\.")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (None: replicated), after jax-llm-examples' `ShardingRules`.

    Attributes (logical axes):
      vocab: vocabulary rows of `embed`, `lm_head`, `ple_embed`; the logits' last axis.
      embed: the residual stream H.
      q_heads: query heads (Wq's output, Wo's input).
      kv_heads: KV heads (Wk / Wv output, the KV cache's head axis and its int8 scales).
      head_dim: per-head size D.
      mlp: the MLP width F (gate / up output, down input).
      ple: Gemma 4's per-layer-input width (P, and L*P).
      batch: batch rows and cache slots.
      seq: cache positions.
    """

    vocab: str | None = MODEL
    embed: str | None = None
    q_heads: str | None = MODEL
    kv_heads: str | None = MODEL
    head_dim: str | None = None
    mlp: str | None = MODEL
    ple: str | None = None
    batch: str | None = None
    seq: str | None = None

    def mesh_axis(self, logical: str | None) -> str | None:
        """The mesh axis of a logical axis (None for None)."""
        return None if logical is None else getattr(self, logical)


#: Model-level weights: logical axes in the forward's orientation ([rows, H] for a table, [in, out] for a Linear).
WEIGHT_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "ple_embed": ("vocab", "ple"),
    "ple_proj": ("embed", "ple"),
    "ple_norm": ("ple",),
}
#: Every `LayerParams` field, as `WEIGHT_AXES`.
LAYER_AXES: dict[str, tuple[str | None, ...]] = {
    "input_norm": ("embed",),
    "q": ("embed", "q_heads"),
    "k": ("embed", "kv_heads"),
    "v": ("embed", "kv_heads"),
    "o": ("q_heads", "embed"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "post_attn_norm": ("embed",),
    "pre_ffw_norm": ("embed",),
    "gate": ("embed", "mlp"),
    "up": ("embed", "mlp"),
    "down": ("mlp", "embed"),
    "post_ffw_norm": ("embed",),
    "ple_gate": ("embed", "ple"),
    "ple_proj": ("ple", "embed"),
    "ple_post_norm": ("embed",),
    "layer_scalar": (None,),
}
#: KV cache K and V [S, T or R, K, D]; their int8 scales [S, T or R, K] take the first three.
CACHE_AXES: tuple[str, ...] = ("batch", "seq", "kv_heads", "head_dim")
#: Penalty state (`sampling.PenaltyHistory`: ids, counts) [S, M]: a few distinct tokens a slot, kept whole.
PENALTY_AXES: tuple[str | None, ...] = ("batch", None)
#: Logits [B, V] out of the forward programs and into the sample programs.
LOGITS_AXES: tuple[str, ...] = ("batch", "vocab")

def make_mesh(n: int, devices=None) -> Mesh:
    """A one-axis mesh (`MODEL`) over the first n of `devices` (default `jax.devices()`).

    Auto axes: XLA's SPMD partitioner decides the collectives from the arrays' shardings.
    Raises:
      ValueError: n < 1, or more devices asked for than there are (the message gives both numbers).
    """
    devices = list(jax.devices() if devices is None else devices)
    if n < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {n}")
    if n > len(devices):
        kind = devices[0].platform if devices else "device"
        raise ValueError(f"tensor_parallel {n} needs {n} devices, but only {len(devices)} {kind} device(s) are "
                         "available")
    return Mesh(np.array(devices[:n]), (MODEL,), axis_types=(jax.sharding.AxisType.Auto,))


class Layout:
    """The sharding table resolved for one model config on one mesh.

    Attributes:
      cfg, mesh, rules: what it was built from.
      notes: one line per array dimension that the rules split but the mesh size does not divide (replicated
        instead), e.g. "layers.0.k: kv_heads 1 not divisible by 2 devices: replicated".
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh, rules: ShardingRules = ShardingRules()):
        """Resolve nothing yet: specs are computed per array (they depend on its layer's head counts)."""
        self.cfg, self.mesh, self.rules = cfg, mesh, rules
        self.notes: list[str] = []

    # ----- resolving ------------------------------------------------------------------------------------------
    def _counts(self, name: str, layer: int | None) -> dict[str, int]:
        """How many indivisible units each logical axis of weight `name` has (a split must not cut one): heads,
        KV heads, MLP columns, vocabulary rows."""
        counts = {"q_heads": self.cfg.num_heads,
                  "vocab": self.cfg.ple_vocab if name == "ple_embed" else self.cfg.vocab_size}
        if layer is not None:
            spec = self.cfg.layers[layer]
            counts |= {"kv_heads": spec.num_kv_heads, "mlp": spec.mlp_dim}
        return counts

    def resolve(self, label: str, axes: tuple[str | None, ...], shape: tuple[int, ...],
                counts: dict[str, int] | None = None) -> tuple[str | None, ...]:
        """Mesh axis per dimension of an array with logical `axes` and `shape`: the rules' axis, or None where
        that axis's unit count (default: the dimension's size) is not a multiple of the mesh axis's size (noted
        in `notes` under `label`)."""
        out = []
        for logical, size in zip(axes, shape):
            axis = self.rules.mesh_axis(logical)
            n = 1 if axis is None else self.mesh.shape[axis]
            count = (counts or {}).get(logical, size)
            if n > 1 and count % n:
                note = f"{label}: {logical} {count} not divisible by {n} devices: replicated"
                if note not in self.notes:
                    self.notes.append(note)
                axis = None
            out.append(axis if n > 1 else None)
        return tuple(out)

    def summary(self) -> list[str]:
        """`notes` grouped by reason, one line each, for the worker's log: the reason, then the array names with
        their layer index dropped and how many arrays share it (a model with one KV head has a note per layer)."""
        groups: dict[str, list[str]] = {}
        for note in self.notes:
            label, reason = note.split(": ", 1)
            groups.setdefault(reason, []).append(label)
        out = []
        for reason, labels in groups.items():
            names = ", ".join(sorted({_LAYER_PREFIX.sub("", x) for x in labels}))
            out.append(f"{reason}: {names} ({len(labels)} arrays)")
        return out

    def named(self, spec: tuple[str | None, ...]) -> NamedSharding:
        """A NamedSharding of this mesh."""
        return NamedSharding(self.mesh, P(*spec))

    @property
    def replicated(self) -> NamedSharding:
        """Every device holds the whole array (host inputs, sample outputs)."""
        return self.named(())

    def weight_spec(self, name: str, layer: int | None, shape: tuple[int, ...]) -> tuple[str | None, ...]:
        """Mesh axes of weight `name` (a `WEIGHT_AXES` key, or a `LAYER_AXES` key with its layer index) of
        logical `shape` (the forward's orientation)."""
        axes = LAYER_AXES[name] if layer is not None else WEIGHT_AXES[name]
        label = name if layer is None else f"layers.{layer}.{name}"
        return self.resolve(label, axes, shape, self._counts(name, layer))

    # ----- weights ----------------------------------------------------------------------------------------------
    def _weight(self, name: str, layer: int | None, value):
        """(the weight ready to place, a pytree of its leaves' NamedShardings).

        Raises:
          ValueError: a quantized weight whose split input dimension would cut a quantization group or a packed
            int32 word on some device.
        """
        label = name if layer is None else f"layers.{layer}.{name}"
        table = layer is None and name in LOOKUP_TABLES
        if isinstance(value, Int4Weight):
            stored = (value.out_features, value.in_features)
        elif isinstance(value, (Int8Weight, Bf16Weight)):
            stored = tuple(value.shape)
        else:
            spec = self.weight_spec(name, layer, tuple(value.shape))
            return value, self.named(spec)
        logical = stored if table else stored[::-1]
        spec = self.weight_spec(name, layer, logical)
        rows, cols = spec if table else spec[::-1]  # the stored [out, in] (or [rows, cols]) orientation
        if isinstance(value, Bf16Weight):
            return value, dataclasses.replace(value, w=self.named((rows, cols)))
        if cols is not None:
            _check_groups(label, value, self.mesh.shape[cols])
            value = dataclasses.replace(value, col_shards=self.mesh.shape[cols])
        if rows is not None:
            value = dataclasses.replace(value, row_shards=self.mesh.shape[rows])
        s = self.named((rows, cols))
        if isinstance(value, Int4Weight):
            return value, dataclasses.replace(value, packed=s, scale=s, zero=None if value.zero is None else s)
        return value, dataclasses.replace(value, q=s, scale=s, offset=None if value.offset is None else s)

    def place_params(self, params: Params) -> Params:
        """The weights split over the mesh as the table says (quantized weights with their `row_shards` and
        `col_shards` set). `params` may be anywhere; the caller's copy stays where it is (drop it to free it).

        Raises:
          ValueError: see `_weight` (names the weight and the numbers).
        """
        values, shardings = self._split_params(params)
        return jax.device_put(values, shardings)

    def param_shardings(self, params: Params) -> Params:
        """A Params-shaped pytree of the NamedSharding of every leaf of `place_params(params)`."""
        return self._split_params(params)[1]

    def _split_params(self, params: Params) -> tuple[Params, Params]:
        top, top_sh = {}, {}
        for f in dataclasses.fields(Params):
            value = getattr(params, f.name)
            if f.name == "layers" or value is None:
                continue
            top[f.name], top_sh[f.name] = self._weight(f.name, None, value)
        layers, layers_sh = [], []
        for i, lp in enumerate(params.layers):
            fields, fields_sh = {}, {}
            for f in dataclasses.fields(LayerParams):
                value = getattr(lp, f.name)
                if value is not None:
                    fields[f.name], fields_sh[f.name] = self._weight(f.name, i, value)
            layers.append(dataclasses.replace(lp, **fields))
            layers_sh.append(dataclasses.replace(lp, **fields_sh))
        return (dataclasses.replace(params, layers=layers, **top),
                dataclasses.replace(params, layers=layers_sh, **top_sh))

    # ----- cache, penalty state, logits -------------------------------------------------------------------------
    def cache_shardings(self, shapes: list[tuple[int, ...] | None], int8: bool) -> KVCache:
        """A KVCache-shaped pytree of NamedShardings for per-layer K/V `shapes` (`KVCache.shapes`)."""
        kv, scales = [], []
        for i, shape in enumerate(shapes):
            if shape is None:
                kv.append(None)
                scales.append(None)
                continue
            spec = self.resolve(f"cache layer {i}", CACHE_AXES, shape, {"kv_heads": shape[2]})
            kv.append(self.named(spec))
            scales.append(self.named(spec[:3]) if int8 else None)
        return KVCache(k=kv, v=list(kv), k_scale=scales, v_scale=list(scales))

    def zeros_cache(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype, int8: bool,
                    slack: int, bf16_bits: bool = True) -> KVCache:
        """`KVCache.zeros` created already split (no device ever holds the whole cache)."""
        shardings = self.cache_shardings(KVCache.shapes(cfg, num_slots, max_len, slack), int8)
        make = lambda: KVCache.zeros(cfg, num_slots, max_len, dtype, int8=int8, slack=slack, bf16_bits=bf16_bits)
        return jax.jit(make, out_shardings=shardings)()

    def penalty_shardings(self, num_slots: int, max_model_len: int) -> PenaltyHistory:
        """PenaltyHistory-shaped NamedShardings ([S, M], M = `sampling.penalty_capacity`; not split: the sample
        programs gather and scatter the few columns it names in the vocabulary-split logits)."""
        shape = (num_slots, penalty_capacity(max_model_len, self.cfg.vocab_size))
        s = self.named(self.resolve("penalty state", PENALTY_AXES, shape))
        return PenaltyHistory(ids=s, counts=s)

    def zeros_penalties(self, num_slots: int, max_model_len: int) -> PenaltyHistory:
        """`sampling.penalty_history_zeros` created with its shardings."""
        capacity = penalty_capacity(max_model_len, self.cfg.vocab_size)
        return jax.jit(lambda: penalty_history_zeros(num_slots, capacity),
                       out_shardings=self.penalty_shardings(num_slots, max_model_len))()

    @property
    def vocab_parts(self) -> int:
        """Parts the vocabulary axis of the logits is split into (1: not split), for the sample programs' greedy
        argmax and inverse-CDF sums (`sampling.sample`)."""
        axis = self.logits.spec[1] if len(self.logits.spec) > 1 else None
        return 1 if axis is None else self.mesh.shape[axis]

    @property
    def logits(self) -> NamedSharding:
        """The sharding of logits [B, V] (split over the vocabulary when the LM head is)."""
        return self.named(self.resolve("logits", LOGITS_AXES, (1, self.cfg.vocab_size)))

    def input_shardings(self, inputs: tuple) -> tuple:
        """Shardings of a program's inputs after its state: host arrays replicated, except the logits a sample
        program reads (`SampleInputs.logits`), which keep the forward programs' vocabulary split."""
        def one(x):
            sh = jax.tree_util.tree_map(lambda _: self.replicated, x)
            return dataclasses.replace(sh, logits=self.logits) if isinstance(x, SampleInputs) else sh

        return tuple(one(x) for x in inputs)


def _check_groups(label: str, w: Int4Weight | Int8Weight, n: int) -> None:
    """Raise ValueError unless splitting w's input dimension n ways keeps whole quantization groups (and, for
    int4, whole packed int32 words of 8 values) on every device."""
    k = w.in_features if isinstance(w, Int4Weight) else w.shape[1]
    g = w.group_size
    word = 8 if isinstance(w, Int4Weight) else 1
    if k % n or (k // n) % g or (k // n) % word:
        what = f"groups of {g} inputs" + (" and packed words of 8" if word > 1 else "")
        raise ValueError(f"{label}: tensor parallel {n} would split its {k} input features into parts of "
                         f"{k / n:g}, which cuts its quantization {what}; choose a tensor-parallel degree that "
                         f"divides {k // np.lcm(g, word)} (whole groups per device)")


# ----- checks and sizes ----------------------------------------------------------------------------------------
_GATHER = re.compile(r"=\s*(.*?)\s+all-gather(?:-start)?\(")
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def _dims(shape) -> tuple[int, ...]:
    """A shape without its unit dimensions."""
    return tuple(int(d) for d in shape if int(d) != 1)


def all_gathers(hlo_text: str) -> list[tuple[int, ...]]:
    """The result shape of every all-gather in a compiled program's HLO text (`compiled.as_text()`; for an
    async all-gather-start, the largest array of its tuple)."""
    out = []
    for line in hlo_text.splitlines():
        m = _GATHER.search(line)
        if m:
            shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(m.group(1))]
            out.append(max(shapes, key=lambda s: int(np.prod(s)), default=()))
    return out


def hidden_gathers(compiled, params: Params) -> list[str]:
    """The all-gathers of a compiled program that gather a weight split over the mesh: a result with as many
    elements as one of its leaves or as the dense matrix it stands for, and the same first or last dimension
    (the leaf itself, its transpose, the unpacking's [N, K/8, 8], a row-block loop's [blocks, rows, K]); unit
    dimensions ignored. A split weight must stay split inside every step: what may be gathered are activations (sampling's
    top-k rows: `sampling` module docstring), which in a real model are shaped unlike any weight.

    Args:
      compiled: a `jax.stages.Compiled` program.
      params: the placed weights (their shardings say which are split).
    Returns:
      One line per offending all-gather (its shape), empty when none.
    """
    shapes = set()
    quantized = lambda x: isinstance(x, (Int4Weight, Int8Weight, Bf16Weight))
    for w in jax.tree_util.tree_leaves(params, is_leaf=quantized):
        leaves = jax.tree_util.tree_leaves(w)
        if all(x.sharding.is_fully_replicated for x in leaves):
            continue
        dense = (w.out_features, w.in_features) if isinstance(w, Int4Weight) else tuple(leaves[0].shape)
        shapes |= {_dims(x.shape) for x in leaves} | {_dims(dense), _dims(dense[::-1])}
    keys = {(int(np.prod(s)), end) for s in shapes if s for end in (("first", s[0]), ("last", s[-1]))}
    like = lambda d: bool(d) and bool({(int(np.prod(d)), ("first", d[0])), (int(np.prod(d)), ("last", d[-1]))}
                                      & keys)
    return [f"all-gather of {list(shape)}, shaped like a split weight"
            for shape in all_gathers(compiled.as_text()) if like(_dims(shape))]


def per_device_bytes(tree) -> int:
    """Bytes the arrays of `tree` take on the fullest device (`bytes_by_device`; 0 for an empty tree). For memory
    accounting (weights, KV cache) under tensor parallelism."""
    return max(bytes_by_device(tree).values(), default=0)


def bytes_by_device(tree) -> dict:
    """Bytes the arrays of `tree` take on each device that holds any: placed `jax.Array`s (their addressable
    shards), and abstract `jax.ShapeDtypeStruct`s with a `sharding` (their shard shape on each of its devices;
    without one, the whole array on one device, counted with `jax.devices()[0]`). One function for both, so that
    figures computed from abstract shapes (`model_worker.engine.memory`) are those the placed arrays would measure.

    Returns:
      {jax.Device: bytes}.
    """
    per: dict = {}
    for x in jax.tree_util.tree_leaves(tree):
        itemsize = np.dtype(x.dtype).itemsize
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                per[shard.device] = per.get(shard.device, 0) + int(np.prod(shard.data.shape)) * itemsize
        else:
            sharding = getattr(x, "sharding", None)
            shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
            devices = [jax.devices()[0]] if sharding is None else list(sharding.device_set)
            for d in devices:
                per[d] = per.get(d, 0) + int(np.prod(shape)) * itemsize
    return per
