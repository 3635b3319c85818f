"""Weights as pytrees, and the one table that declares every weight's shape.

`param_shapes(cfg)` is the single declaration of the model's tensors (name -> shape). The loader checks a
checkpoint against it, tests initialise random weights from it, and `Params.from_flat` builds the pytree the
forward pass reads. Linear weights are stored as `[in, out]` so a projection is `x @ w` (Hugging Face stores
`[out, in]`; loaders transpose once at load time). Norm weights are the effective multipliers: RMSNorm computes
`x_normed * w` for every architecture (Gemma 3 checkpoints store `w - 1`; loaders add the 1 back; GGUF files
already store `w + 1`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from model_worker.modeling.config import ModelConfig
from model_worker.numerics.q8 import BLOCK, Q8Weight, float16_exact, q8_from_values, q8_weight
from model_worker.numerics.quant import Bf16Weight, Int4Weight, Int8Weight, int8_from_flat, int8_per_channel


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """One decoder layer's weights (H = hidden, D = head dim, N = heads, K = KV heads, F = MLP width).

    Attributes:
      input_norm: [H] pre-attention RMSNorm.
      q: [H, N*D] query projection.
      k: [H, K*D] key projection; None on a KV-shared layer.
      v: [H, K*D] value projection; None on a KV-shared layer.
      o: [N*D, H] output projection.
      q_norm: [D] per-head RMSNorm of q.
      k_norm: [D] per-head RMSNorm of k; None on a KV-shared layer.
      post_attn_norm: [H] RMSNorm of the attention output (before the residual add).
      pre_ffw_norm: [H] RMSNorm before the MLP.
      gate: [H, F] MLP gate projection.
      up: [H, F] MLP up projection.
      down: [F, H] MLP down projection.
      post_ffw_norm: [H] RMSNorm of the MLP output (before the residual add).
      ple_gate: [H, P] per-layer-input gate (Gemma 4 PLE), else None.
      ple_proj: [P, H] per-layer projection, else None.
      ple_post_norm: [H] RMSNorm after the per-layer projection, else None.
      layer_scalar: [1] multiplier of the residual stream at the end of the layer (Gemma 4), else None.

    Any Linear weight may instead be an `Int4Weight`, `Int8Weight` or `Bf16Weight` ([out, in]; see quant.py).
    """

    input_norm: jax.Array
    q: jax.Array
    k: jax.Array | None
    v: jax.Array | None
    o: jax.Array
    q_norm: jax.Array
    k_norm: jax.Array | None
    post_attn_norm: jax.Array
    pre_ffw_norm: jax.Array
    gate: jax.Array
    up: jax.Array
    down: jax.Array
    post_ffw_norm: jax.Array
    ple_gate: jax.Array | None = None
    ple_proj: jax.Array | None = None
    ple_post_norm: jax.Array | None = None
    layer_scalar: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    """All weights of a decoder.

    Attributes:
      embed: [V, H] token embedding, also the tied LM head (logits = h @ embed.T) unless `lm_head` is set; an
        `Int8Weight` [V, H] when a GGUF stores it block-quantized (kept exactly, about 1 byte per value).
      final_norm: [H] RMSNorm after the last layer.
      layers: one `LayerParams` per layer.
      ple_embed: [V_ple, L*P] per-layer token embeddings (Gemma 4 PLE), layer-major columns, else None.
      ple_proj: [H, L*P] per_layer_model_projection, else None.
      ple_norm: [P] per_layer_projection_norm, else None.
      lm_head: None (the head is `embed`), or a copy of the embedding for the head at another matmul precision:
        a `Bf16Weight` [V, H] (`with_bf16_matmuls`), a `Q8Weight` [V, H] (`with_q8_matmuls`) or a per-row
        `Int8Weight` [V, H] (`with_int8_weights`); lookups still read `embed`.
    """

    embed: jax.Array | Int8Weight
    final_norm: jax.Array
    layers: list[LayerParams]
    ple_embed: jax.Array | None = None
    ple_proj: jax.Array | None = None
    ple_norm: jax.Array | None = None
    lm_head: Bf16Weight | Q8Weight | Int8Weight | None = None

    @staticmethod
    def from_flat(cfg: ModelConfig, flat: dict[str, jax.Array]) -> Params:
        """Build the pytree from a flat `{name: array}` dict keyed as in `param_shapes` (missing optional = None)."""
        layers = []
        for i in range(cfg.num_layers):
            fields = {f.name: flat.get(f"layers.{i}.{f.name}") for f in dataclasses.fields(LayerParams)}
            layers.append(LayerParams(**fields))
        return Params(
            embed=flat["embed"],
            final_norm=flat["final_norm"],
            layers=layers,
            ple_embed=flat.get("ple_embed"),
            ple_proj=flat.get("ple_proj"),
            ple_norm=flat.get("ple_norm"),
        )

    def nbytes(self) -> int:
        """Bytes held by the weight arrays (packed int4 counts as packed)."""
        return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(self)))


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model as `{name: shape}`, in the `[in, out]` orientation used by the forward pass."""
    H, N = cfg.hidden_size, cfg.num_heads
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, H), "final_norm": (H,)}
    for i, spec in enumerate(cfg.layers):
        D, K, F = spec.head_dim, spec.num_kv_heads, spec.mlp_dim
        p = f"layers.{i}."
        shapes |= {p + "input_norm": (H,), p + "q": (H, N * D), p + "o": (N * D, H), p + "q_norm": (D,)}
        if spec.kv_source == i:
            shapes |= {p + "k": (H, K * D), p + "k_norm": (D,)}
            if not spec.k_eq_v:
                shapes[p + "v"] = (H, K * D)
        shapes |= {p + "post_attn_norm": (H,), p + "pre_ffw_norm": (H,), p + "post_ffw_norm": (H,)}
        shapes |= {p + "gate": (H, F), p + "up": (H, F), p + "down": (F, H)}
        if cfg.ple_dim:
            P = cfg.ple_dim
            shapes |= {p + "ple_gate": (H, P), p + "ple_proj": (P, H), p + "ple_post_norm": (H,)}
        if cfg.layer_scalar:
            shapes[p + "layer_scalar"] = (1,)
    if cfg.ple_dim:
        LP = cfg.num_layers * cfg.ple_dim
        shapes |= {"ple_embed": (cfg.ple_vocab, LP), "ple_proj": (H, LP), "ple_norm": (cfg.ple_dim,)}
    return shapes


LOOKUP_TABLES = ("embed", "ple_embed")
"""The weights looked up by token id (the embedding and Gemma 4's per-layer embedding): [rows, H] whatever their
storage, never split by their rows' quantization groups, and dense in every checkpoint format (docs/formats.md
§2); every other matrix is a Linear weight, stored [out, in] when quantized."""


def logical_shape(x, name: str = "") -> tuple[int, ...]:
    """Shape of weight `name` in the forward's orientation: [in, out] for a Linear weight (an Int4Weight or
    Int8Weight Linear is stored [out, in]), [rows, H] for a table."""
    if isinstance(x, Int8Weight):
        return x.shape if name in LOOKUP_TABLES else x.shape[::-1]
    if isinstance(x, Int4Weight):
        return (x.in_features, x.out_features)
    return tuple(x.shape)


def check_flat(cfg: ModelConfig, flat: dict[str, np.ndarray]) -> None:
    """Check a flat weight dict against `param_shapes`.

    Raises:
      ValueError: one message naming every missing, misshapen or unexpected tensor and the expected shape.
    """
    expected = param_shapes(cfg)
    problems = []
    for name, shape in expected.items():
        if name not in flat:
            problems.append(f"missing {name} (expected shape {list(shape)})")
        elif logical_shape(flat[name], name) != shape:
            problems.append(f"{name} has shape {list(logical_shape(flat[name], name))}, expected {list(shape)}")
    problems += [f"unexpected tensor {name}" for name in flat if name not in expected]
    if problems:
        raise ValueError(f"{cfg.name}: {len(problems)} weight problem(s):\n  " + "\n  ".join(problems))


def random_flat(cfg: ModelConfig, seed: int = 0, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Random float32 weights for tests: matrices ~ N(0, scale²), norm weights ~ 1 + N(0, 0.1²)."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("layer_scalar"):
            flat[name] = rng.uniform(0.2, 1.0, shape).astype(np.float32)
        elif len(shape) == 1:
            flat[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            flat[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return flat


def to_device(cfg: ModelConfig, flat: dict[str, np.ndarray], dtype: jnp.dtype) -> Params:
    """Check `flat` against the declared shapes, cast to `dtype` and place it on the default device.

    `flat` may hold Int4Weight / Int8Weight values, or an Int8Weight saved as NAME.q8 + NAME.q8_scale (see
    `quant.int8_to_flat`); quantized weights keep their storage dtypes (int8 values, float32 scales).
    Raises:
      ValueError: see `check_flat` and `quant.int8_from_flat`.
    """
    flat = int8_from_flat(flat)
    check_flat(cfg, flat)
    placed = {k: _place(v, dtype) for k, v in flat.items()}
    return Params.from_flat(cfg, placed)


def _place(v, dtype: jnp.dtype):
    if isinstance(v, Int4Weight):
        return v
    if isinstance(v, Int8Weight):
        offset = None if v.offset is None else jnp.asarray(v.offset, jnp.float32)
        return Int8Weight(q=jnp.asarray(v.q, jnp.int8), scale=jnp.asarray(v.scale, jnp.float32), offset=offset,
                          group_size=v.group_size)
    return jnp.asarray(v, dtype=dtype)


# The LayerParams fields that are Linear weights (the rest are norm vectors and scalars).
_LINEARS = ("q", "k", "v", "o", "gate", "up", "down", "ple_gate", "ple_proj")


def with_bf16_matmuls(params: Params, row_invariant: bool = False) -> Params:
    """`params` at bfloat16 matmul precision (`quant.bf16_linear`, the worker's `--matmul-precision bfloat16`).

    Each layer projection that is a dense float weight or an `Int8Weight` becomes a `Bf16Weight`, its values
    rounded once to bfloat16, and the tied LM head gets a bfloat16 copy of the embedding (`Params.lm_head`;
    lookups still read the exact `embed`). Int4Weight projections, Bf16Weights (so a second call changes nothing),
    norms and the model-level PLE tensors are left as they are. It trades over twice the weight memory (the
    bfloat16 projections and head copy) for faster prompt chunks and batched decode steps on CPU, at a slightly
    slower B=1 step (figures: docs/performance.md).

    Args:
      params: weights with float activations (the worker only calls this with float32 ones: with bfloat16
        activations every product already has bfloat16 operands).
      row_invariant: every product on the GEMM (`Bf16Weight.row_invariant`), for the batch-invariant mode.
    Returns:
      New Params sharing every untouched array with `params`.
    Raises:
      TypeError: see `Bf16Weight.of` (a projection of an unknown type).
    """
    def convert(lp: LayerParams) -> LayerParams:
        linears = {n: getattr(lp, n) for n in _LINEARS}
        return dataclasses.replace(lp, **{n: mark(Bf16Weight.of(w)) for n, w in linears.items()
                                          if w is not None and not isinstance(w, (Int4Weight, Bf16Weight))})

    mark = lambda w: w if w.row_invariant == row_invariant else dataclasses.replace(w, row_invariant=row_invariant)
    head, embed = params.lm_head, params.embed
    if head is None:  # the table [V, H] is already the head's [out, in]
        head = Bf16Weight.of(embed) if isinstance(embed, Int8Weight) else Bf16Weight(embed.astype(jnp.bfloat16))
    return dataclasses.replace(params, layers=[convert(lp) for lp in params.layers], lm_head=mark(head))



#: `Int8Weight.kernel` values (`--matmul-kernel`; "pallas-interpret" for tests).
INT8_KERNELS = ("xla", "pallas", "pallas-interpret")


def with_int8_weights(params: Params, kernel: str = "xla") -> Params:
    """`params` with weight-only int8 projections (`--matmul-precision int8` with bfloat16 activations, a TPU's or
    GPU's default): each dense layer projection ([in, out]) and the tied LM head become a per-row `Int8Weight`
    (`quant.int8_per_channel`), half the bytes a decode step reads; the embedding lookups keep the exact table.
    Int4Weight and Int8Weight projections (a quantized checkpoint's own) are left as they are.

    Args:
      params: the model's weights.
      kernel: the new weights' `Int8Weight.kernel` (`--matmul-kernel`): "xla", "pallas" (the Pallas W8A16 kernel
        on a TPU) or "pallas-interpret".
    Returns:
      New Params sharing every untouched array with `params`.
    Raises:
      ValueError: an unknown `kernel`.
    """
    if kernel not in INT8_KERNELS:
        raise ValueError(f"unknown int8 kernel {kernel!r} ({', '.join(INT8_KERNELS)})")
    quantize = jax.jit(lambda w: dataclasses.replace(int8_per_channel(w), kernel=kernel))  # compiled: only the
    # int8 result is materialized, no float32 temporaries
    transposed = jax.jit(lambda w: dataclasses.replace(int8_per_channel(w.T), kernel=kernel))

    def convert(lp: LayerParams) -> LayerParams:
        dense = {n: getattr(lp, n) for n in _LINEARS}
        return dataclasses.replace(lp, **{n: transposed(w) for n, w in dense.items() if isinstance(w, jax.Array)})

    head = params.lm_head
    if head is None and isinstance(params.embed, jax.Array):  # the table [V, H] is already the head's [out, in]
        head = quantize(params.embed)
    return dataclasses.replace(params, layers=[convert(lp) for lp in params.layers], lm_head=head)


def q8_of(weight: jax.Array | Int8Weight, dense_in_out: bool = True) -> Q8Weight | None:
    """A projection as Q8_0 blocks of 32 (`q8.Q8Weight`), or None where its input size is not a multiple of 32.

    An `Int8Weight` of symmetric blocks of 32 (GGUF Q8_0 and Q5_0) without a -128 and with float16 scales (as GGUF
    stores them) keeps its integers and scales exactly; any other weight (GGUF Q4_K with its offsets, Q6_K's
    blocks of 16, a dense float weight, an int8 block holding -128) is requantized from its exact float32 values by
    `q8.q8_from_values` (error at most half a step of max|w| / 127 per block of 32, a small fraction of a 4- or
    6-bit step).

    Args:
      weight: an `Int8Weight` [N, K], or a dense float weight, [K, N] ([in, out], a projection) when
        `dense_in_out`, else [N, K] (an embedding table used as the LM head).
    """
    if isinstance(weight, Int8Weight):
        q, scale = np.asarray(weight.q), np.asarray(weight.scale)
        if weight.shape[1] % BLOCK:
            return None
        if weight.group_size == BLOCK and weight.offset is None and (q.size == 0 or q.min() > -128) and \
                float16_exact(scale):
            return q8_weight(q, scale)
        dense = np.asarray(weight.values())
    else:
        dense = np.asarray(weight, np.float32)
        dense = dense.T if dense_in_out else dense
        if dense.ndim != 2 or dense.shape[1] % BLOCK:
            return None
    return q8_weight(*q8_from_values(dense))


def with_q8_matmuls(params: Params) -> Params:
    """`params` at block-int8 matmul precision (`q8.q8_linear`, the worker's `--matmul-precision int8`): each layer
    projection and the tied LM head as `Q8Weight` (see `q8_of`), multiplied with activations quantized to Q8_0
    blocks, as llama.cpp does. Integer block sums make every product batch-invariant by construction, and a
    decode step reads about 1.06 bytes per weight (int8 + a float16 scale per 32; 0.69 for 5-bit tiles of the
    GGUF's Q5_0 integers, `q8.tile_weight5`) instead of bfloat16's 2.

    Projections whose input size is not a multiple of 32 get a row-invariant `Bf16Weight` instead (Gemma 4's
    per-layer-input projections of some tiny test configs), Int4Weights stay as they are; norms and the
    model-level PLE tensors are untouched. Lookups keep reading the exact `embed`.
    """
    def one(w):
        if w is None or isinstance(w, (Int4Weight, Q8Weight)):
            return w
        return q8_of(w) or dataclasses.replace(Bf16Weight.of(w), row_invariant=True)

    layers = [dataclasses.replace(lp, **{n: one(getattr(lp, n)) for n in _LINEARS}) for lp in params.layers]
    head = params.lm_head if isinstance(params.lm_head, Q8Weight) else q8_of(params.embed, dense_in_out=False)
    if head is None:
        head = Bf16Weight(Bf16Weight.of(params.embed).w if isinstance(params.embed, Int8Weight)
                          else params.embed.astype(jnp.bfloat16), row_invariant=True)
    return dataclasses.replace(params, layers=layers, lm_head=head)


def for_matmul_precision(cfg: ModelConfig, params: Params, precision: str,
                         batch_invariant: bool = False) -> tuple[ModelConfig, Params]:
    """The config and weights of a worker at `--matmul-precision` `precision` (and `--batch-invariant`).

    "bfloat16": `with_bf16_matmuls` (bfloat16 products with float32 sums in the projections and the LM head).
    With `batch_invariant` also every product on the GEMM and `ModelConfig.batch_invariant` (attention in
    position-aligned key blocks with bfloat16 products, RMSNorm summed in a fixed order, K/V stored in bfloat16),
    so that every row's logits are a function of that row alone: a prefix hit equals a cold run and a seeded
    request repeats exactly, whatever it is batched with (slower: docs/performance.md).
    "int8": `with_q8_matmuls` (block-int8 products with Q8_0 activations; invariant by construction), and with
    `batch_invariant` the same `ModelConfig.batch_invariant` for attention and norms.
    "float32": unchanged (exact weights, float32 products; batch shape changes the last bits).

    Raises:
      ValueError: an unknown precision, or batch_invariant with float32 (its products are not invariant).
    """
    if precision not in ("float32", "bfloat16", "int8"):
        raise ValueError(f"unknown matmul precision {precision!r} (float32, bfloat16 or int8)")
    if batch_invariant and precision == "float32":
        raise ValueError("batch invariance needs bfloat16 or int8 matmul precision (--matmul-precision)")
    if precision == "float32":
        return cfg, params
    if precision == "int8":
        return dataclasses.replace(cfg, batch_invariant=batch_invariant), with_q8_matmuls(params)
    return dataclasses.replace(cfg, batch_invariant=batch_invariant), with_bf16_matmuls(params, batch_invariant)


def at_matmul_mode(cfg: ModelConfig, params: Params, dtype: str, precision: str,
                   batch_invariant: bool, matmul_kernel: str = "xla") -> tuple[ModelConfig, Params]:
    """The config and weights a worker runs with, from `matmul_mode`'s answer: `for_matmul_precision` with float32
    activations; with bfloat16 ones their products are bfloat16 already, and "int8" means `with_int8_weights`
    (whose products `matmul_kernel`, `--matmul-kernel`, runs: see `Int8Weight.kernel`).

    Raises:
      ValueError: a `matmul_kernel` other than "xla" where it does not apply: not int8 weights with bfloat16
        activations, or no weight the kernel takes (a GGUF's own int8 blocks, with groups and offsets, keep XLA's
        products).
    """
    if matmul_kernel != "xla" and (dtype == "float32" or precision != "int8"):
        raise ValueError(f"--matmul-kernel {matmul_kernel} needs int8 weights with bfloat16 activations "
                         f"(--matmul-precision int8 --dtype bfloat16, a TPU's default dtype): got --matmul-precision "
                         f"{precision} with {dtype} activations")
    if dtype == "float32":
        return for_matmul_precision(cfg, params, precision, batch_invariant)
    if precision != "int8":
        return cfg, params
    params = with_int8_weights(params, matmul_kernel)
    if matmul_kernel != "xla" and not any(
            isinstance(w, Int8Weight) and w.kernel == matmul_kernel
            for w in jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, Int8Weight))):
        raise ValueError(f"--matmul-kernel {matmul_kernel}: no weight of this model takes the kernel (it runs "
                         "per-row int8 weights made from bfloat16 or float32 ones; a GGUF's own int8 blocks keep "
                         "XLA's products)")
    return cfg, params


def matmul_mode(precision: str, batch_invariant: bool | None, dtype: str, *, tensor_parallel: int = 1,
                gguf: bool = True) -> tuple[str, bool]:
    """The worker's (matmul precision, batch invariance) from its flags and activation dtype.

    Args:
      precision: `--matmul-precision`: "auto", "float32", "bfloat16" or "int8". "auto" is "int8" for a GGUF model
        with float32 activations on one device (the CPU default: half the bytes of a decode step, and its error
        was measured against transformers and llama.cpp on the GGUF's own blocks: docs/performance.md), else
        "bfloat16" (a checkpoint's bfloat16 weights would be requantized to int8 blocks: opt in with "int8"; the
        int8 products are not split across devices).
      batch_invariant: `--batch-invariant` / `--no-batch-invariant`, or None (not given): on wherever it applies,
        i.e. bfloat16 or int8 products with float32 activations (CPU's default), so that the default is
        reproducible.
      dtype: the activation dtype ("float32" or "bfloat16"); with bfloat16 activations (GPU/TPU) the products
        already have bfloat16 operands, and "int8" means int8 weights (`with_int8_weights`, W8A16).
      tensor_parallel: devices the worker splits its weights over (`--tensor-parallel`).
      gguf: whether the weights come from a GGUF (int8 blocks of its own) rather than a safetensors checkpoint.
    Returns:
      (a precision, bool), for `for_matmul_precision` (which is only applied to float32 activations).
    Raises:
      ValueError: an unknown precision; --batch-invariant asked for where it does not apply.
    """
    if precision not in ("auto", "float32", "bfloat16", "int8"):
        raise ValueError(f"unknown matmul precision {precision!r} (auto, float32, bfloat16 or int8)")
    if precision == "auto":
        precision = "int8" if dtype == "float32" and tensor_parallel == 1 and gguf else "bfloat16"
    applies = precision in ("bfloat16", "int8") and dtype == "float32"
    if batch_invariant and not applies:
        raise ValueError("--batch-invariant needs bfloat16 or int8 matmul precision with float32 activations (the CPU "
                         f"default); got --matmul-precision {precision} with {dtype} activations")
    return precision, applies if batch_invariant is None else bool(batch_invariant)
