"""compressed-tensors pack-quantized (W4A16) loading and the int4 `linear`, checked against the compressed-tensors
library itself (its quantizer, packer, ModelCompressor and decompressor; torch here only).

Exactness argument used below: with q - z an integer in [-15, 15] and s a bf16 (8 significant bits), the product
(q - z) * s has at most 12 significant bits, so it is exact in float32. Our `dequantize` computes it exactly in
float32 and rounds once to the target dtype; the library computes in the scale's dtype (torch rounds each bf16 op
once from the exact result). Hence: dequantize(w, bf16) == library bit for bit, and dequantize(w, f32) == the
library run on float32-cast scales bit for bit. Matmuls are compared with the rigorous float32 dot error bound
|y - y_exact| <= (K + 2) * 2^-24 * (|x| @ |W|ᵀ).
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open
from safetensors.torch import save_file

from model_worker.checkpoints.ct_loader import (
    CTQuantConfig,
    UnsupportedQuantizationError,
    WeightScheme,
    load_linear,
    module_names,
    open_checkpoint,
    parse_quantization_config,
    read_tensor_raw,
)
from model_worker.numerics.quant import Int4Weight, dequantize, int4_linear, linear, unpack_int4
from tests.ct_checkpoint import (
    compress_checkpoint,
    compress_weight,
    decompress_weight,
    weight_args,
    weight_scheme,
)

pytestmark = pytest.mark.slow  # compiles model programs or reads a reference: outside `make test-fast`

# ---------------------------------------------------------------------------------------------------------------
# helpers


def qconfig_dict(symmetric: bool, group_size: int | None, weights_override: dict | None = None) -> dict:
    """A config.json dict with the library's own serialization of the weight args (then `weights_override`)."""
    w = weight_args(symmetric, group_size).model_dump()
    w.update(weights_override or {})
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "format": "pack-quantized"}},
            "ignore": ["lm_head"],
        }
    }


def to_f32(a) -> np.ndarray:
    """jax/torch/numpy array (bf16 included) -> float32 numpy (exact for bf16)."""
    if isinstance(a, torch.Tensor):
        return a.detach().float().numpy()
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def assert_matmul_close(y, x, w_out_in) -> None:
    """y ≈ x @ Wᵀ within the float32 dot error bound (x, W exact float32 values; reference in float64)."""
    x64, w64 = to_f32(x).astype(np.float64), to_f32(w_out_in).astype(np.float64)
    ref = x64 @ w64.T
    bound = (x64.shape[-1] + 2) * 2.0**-24 * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    err = np.abs(to_f32(y) - ref)
    assert np.all(err <= bound), f"max err {err.max():.3g}, ratio {np.max(err / bound):.3g}"


def write_module(path, module: str, tensors: dict[str, torch.Tensor]) -> None:
    save_file({f"{module}.{k}": v.contiguous() for k, v in tensors.items()}, str(path))


def lib_scheme(symmetric: bool, group_size: int | None):
    return weight_scheme(symmetric, group_size)


# ---------------------------------------------------------------------------------------------------------------
# a tiny random Gemma 4 compressed with the library's model-level API


@pytest.fixture(scope="module")
def tiny_gemma4(tmp_path_factory):
    """A tiny random Gemma4ForCausalLM saved in bf16 (hidden 64, 4 layers, 2 KV-shared, both attention types among
    the non-shared layers, PLE width 32 so every Linear's in_features is a multiple of 32)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=32,
        vocab_size_per_layer_input=256,
        sliding_window=16,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).to(torch.bfloat16)
    src = tmp_path_factory.mktemp("g4_dense")
    model.save_pretrained(src)
    linears = {
        n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    return src, linears


CASES = {
    # Google's QAT export: symmetric, group 32 (docs/formats.md §2); everything but lm_head quantized.
    "sym_g32": {"symmetric": True, "group_size": 32, "ignore": ["lm_head", "re:.*embed.*"]},
    # Asymmetric, group 16, and one PLE projection kept dense through the ignore list.
    "asym_g16": {
        "symmetric": False,
        "group_size": 16,
        "ignore": ["lm_head", "re:.*embed.*", "re:.*per_layer_model_proj.*"],
    },
}


@pytest.fixture(scope="module", params=list(CASES))
def ct_checkpoint(request, tiny_gemma4, tmp_path_factory):
    src, linears = tiny_gemma4
    case = CASES[request.param]
    dst = tmp_path_factory.mktemp(f"g4_{request.param}")
    quantized = compress_checkpoint(src, dst, **case)
    return dst, case, quantized, linears


def test_checkpoint_modules_and_config(ct_checkpoint):
    dst, case, quantized, linears = ct_checkpoint
    config = json.loads((dst / "config.json").read_text())
    qcfg = parse_quantization_config(config)
    assert qcfg == CTQuantConfig(
        schemes=(WeightScheme(case["group_size"], case["symmetric"], ("Linear",)),),
        ignore=tuple(config["quantization_config"]["ignore"]),
    )
    assert "lm_head" in qcfg.ignore
    with open_checkpoint(dst) as reader:
        q_names, dense_names = module_names(reader)
        # Quantized = every Linear the ignore list did not exclude: q/k/v/o, gate/up/down, the PLE projections.
        assert sorted(q_names) == sorted(quantized)
        expected = {n for n in linears if n != "lm_head"}
        if not case["symmetric"]:
            expected.discard("model.per_layer_model_projection")
            assert "model.per_layer_model_projection" in dense_names
        assert set(q_names) == expected
        for suffix in (
            "self_attn.q_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "per_layer_input_gate",
            "per_layer_projection",
        ):
            assert f"model.layers.3.{suffix}" in q_names
        # KV-shared layers (2, 3) have no K/V projections at all (docs/formats.md §2).
        assert not any(
            f"layers.{i}.self_attn.{p}" in n for i in (2, 3) for p in ("k_proj", "v_proj") for n in q_names
        )
        assert {"model.embed_tokens", "model.embed_tokens_per_layer"} <= set(dense_names)
        assert "lm_head.weight" not in reader  # tied
        assert reader.dtype("model.layers.0.mlp.down_proj.weight_scale") == "BF16"
        assert reader.dtype("model.layers.0.mlp.down_proj.weight_shape") in ("I64", "I32")


def test_checkpoint_matches_library_decompression(ct_checkpoint):
    """Every quantized module: our dequantize == the library's decompress (bf16 and f32, bit-exact), linear == x Wᵀ."""
    dst, case, quantized, linears = ct_checkpoint
    config = json.loads((dst / "config.json").read_text())
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"]
    qcfg = parse_quantization_config(config)
    rng = np.random.default_rng(1)
    lin = jax.jit(linear)
    with open_checkpoint(dst) as reader, safe_open(str(dst / "model.safetensors"), framework="pt") as pt:
        pt_names = set(pt.keys())
        for m in quantized:
            w = load_linear(reader, m, qcfg, jnp.float32)
            assert isinstance(w, Int4Weight)
            n, k = linears[m].shape
            assert (w.out_features, w.in_features, w.group_size) == (n, k, case["group_size"])
            assert (w.zero is None) == case["symmetric"]
            tensors = {
                t: pt.get_tensor(f"{m}.{t}")
                for t in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
                if f"{m}.{t}" in pt_names
            }
            lib_bf16 = decompress_weight(tensors, scheme)
            assert lib_bf16.dtype == torch.bfloat16
            np.testing.assert_array_equal(to_f32(dequantize(w, jnp.bfloat16)), to_f32(lib_bf16), err_msg=m)
            lib_f32 = decompress_weight({**tensors, "weight_scale": tensors["weight_scale"].float()}, scheme)
            w_f32 = np.asarray(dequantize(w, jnp.float32))
            np.testing.assert_array_equal(w_f32, lib_f32.numpy(), err_msg=m)
            # And it is the original weight, quantized: within one step of it (half a step plus the library's
            # bf16 rounding of w / s and the clamp of +7.5 steps to +7).
            step = np.repeat(to_f32(tensors["weight_scale"]), case["group_size"], axis=1)
            assert np.all(np.abs(w_f32 - to_f32(linears[m])) <= step), m
            x = rng.standard_normal((2, 3, k)).astype(np.float32)
            assert_matmul_close(lin(x, w).reshape(6, n), x.reshape(6, k), lib_f32)
        if not case["symmetric"]:
            dense = load_linear(reader, "model.per_layer_model_projection", qcfg, jnp.float32)
            assert isinstance(dense, jax.Array) and dense.dtype == jnp.float32
            np.testing.assert_array_equal(
                np.asarray(dense), to_f32(linears["model.per_layer_model_projection"]).T
            )


def test_transformers_loads_symmetric_checkpoint(ct_checkpoint):
    """The helper's output is a real checkpoint: transformers + compressed-tensors load it and decompress to the same
    weights (symmetric only; transformers 5.24 fails on packed asymmetric zero points, see tests/ct_checkpoint.py)."""
    dst, case, quantized, _ = ct_checkpoint
    if not case["symmetric"]:
        pytest.skip("transformers cannot load asymmetric pack-quantized checkpoints (zero-point shape)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dst)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # first forward decompresses
    qcfg = parse_quantization_config(json.loads((dst / "config.json").read_text()))
    with open_checkpoint(dst) as reader:
        for m in quantized[:5]:
            hf = model.get_submodule(m).weight
            ours = dequantize(load_linear(reader, m, qcfg, jnp.float32), jnp.bfloat16)
            np.testing.assert_array_equal(to_f32(ours), to_f32(hf), err_msg=m)


# ---------------------------------------------------------------------------------------------------------------
# single modules: odd shapes, asymmetric zero points, channel strategy


@pytest.mark.parametrize(
    "n,k,group_size,symmetric,scale_dtype",
    [
        (20, 64, 16, False, torch.bfloat16),  # N not a multiple of 8: zero points packed [3, 4]
        (24, 36, None, True, torch.float32),  # channel strategy, K not a multiple of 8 (packed rows padded)
        (20, 36, None, False, torch.bfloat16),  # channel, asymmetric, both odd
        (16, 36, 4, False, torch.float32),  # group 4: 9 groups, 5 words per row
        (64, 96, 32, True, torch.bfloat16),
    ],
)
def test_single_module_roundtrip(tmp_path, n, k, group_size, symmetric, scale_dtype):
    torch.manual_seed(n * k)
    weight = (torch.randn(n, k) * torch.rand(n, 1) + 0.3 * torch.rand(n, 1)).to(
        scale_dtype
    )  # offsets: real zps
    tensors = compress_weight(weight, symmetric, group_size)
    g = k if group_size is None else group_size
    assert tensors["weight_packed"].shape == (n, math.ceil(k / 8))
    if not symmetric:
        assert tensors["weight_zero_point"].shape == (math.ceil(n / 8), k // g)
    write_module(tmp_path / "m.safetensors", "blk.proj", tensors)
    qcfg = parse_quantization_config(qconfig_dict(symmetric, group_size))
    with open_checkpoint(tmp_path) as reader:
        w = load_linear(reader, "blk.proj", qcfg, jnp.float32)
    with safe_open(str(tmp_path / "m.safetensors"), framework="numpy") as handle:  # a raw handle works too
        w2 = load_linear(handle, "blk.proj", qcfg, jnp.float32)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), w, w2))
    assert (w.out_features, w.in_features, w.group_size) == (n, k, g)
    if not symmetric:
        lib_zero = unpack_from_int32(tensors["weight_zero_point"], 4, torch.Size([n, k // g]), packed_dim=0)
        np.testing.assert_array_equal(np.asarray(w.zero), lib_zero.numpy())
        assert w.zero.dtype == jnp.int8 and np.asarray(w.zero).min() >= -8 and np.asarray(w.zero).max() <= 7
        assert np.any(np.asarray(w.zero) != 0)
    np.testing.assert_array_equal(
        np.asarray(unpack_int4(w.packed, k)),
        unpack_from_int32(tensors["weight_packed"], 4, torch.Size([n, k])).numpy(),
    )
    scheme = lib_scheme(symmetric, group_size)
    lib = decompress_weight(tensors, scheme)
    np.testing.assert_array_equal(
        to_f32(dequantize(w, lib.dtype == torch.bfloat16 and jnp.bfloat16 or jnp.float32)), to_f32(lib)
    )
    lib_f32 = decompress_weight({**tensors, "weight_scale": tensors["weight_scale"].float()}, scheme)
    np.testing.assert_array_equal(np.asarray(dequantize(w, jnp.float32)), lib_f32.numpy())
    x = np.random.default_rng(0).standard_normal((5, k)).astype(np.float32)
    for impl in ("plain", "blocked", "auto"):
        # block_bytes small enough to force several (padded, for N = 20) row blocks
        y = jax.jit(lambda x, w, impl=impl: int4_linear(x, w, impl, block_bytes=8 * k * 4))(x, w)
        assert_matmul_close(y, x, lib_f32)


# ---------------------------------------------------------------------------------------------------------------
# nibble order


def test_word_layout_is_sequential():
    """Column k is nibble k % 8 of word k // 8, stored as q + 8 (docs/formats.md §1.3), as the library packs it."""
    q = torch.arange(-8, 8, dtype=torch.int8).reshape(1, 16)  # u = 0..15
    packed = pack_to_int32(q, 4)
    assert packed.tolist() == [[0x76543210, np.int32(np.uint32(0xFEDCBA98))]]
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed.numpy()), 16)), q.numpy())


def plane_major_unpack(packed: np.ndarray, k: int) -> np.ndarray:
    """The buggy unpack of docs/formats.md §1.5: concatenating the 8 shift planes (column order 0, 8, 16, ..., 1, 9, ...)."""
    planes = [((packed >> (4 * p)) & 0xF) - 8 for p in range(8)]
    return np.concatenate(planes, axis=1)[:, :k].astype(np.int8)


def test_plane_major_order_would_be_caught():
    rng = np.random.default_rng(7)
    n, k, g = 16, 64, 32
    q = rng.integers(-8, 8, size=(n, k)).astype(np.int8)
    assert len({q[:, j].tobytes() for j in range(k)}) == k  # all columns distinct: any permutation is visible
    packed = pack_to_int32(torch.from_numpy(q), 4).numpy()
    scale = rng.uniform(0.5, 2.0, size=(n, k // g)).astype(np.float32)
    w = Int4Weight(
        packed=jnp.asarray(packed), scale=jnp.asarray(scale), zero=None, in_features=k, group_size=g
    )
    np.testing.assert_array_equal(np.asarray(unpack_int4(w.packed, k)), q)
    wrong = plane_major_unpack(packed, k)
    assert not np.array_equal(wrong, q)
    assert np.sum(wrong != q) > n * k // 2
    w_true = q.astype(np.float32) * np.repeat(scale, g, axis=1)
    w_wrong = wrong.astype(np.float32) * np.repeat(scale, g, axis=1)
    np.testing.assert_array_equal(np.asarray(dequantize(w, jnp.float32)), w_true)
    x = rng.standard_normal((3, k)).astype(np.float32)
    for impl in ("plain", "blocked", "auto"):
        y = np.asarray(int4_linear(jnp.asarray(x), w, impl, block_bytes=4 * k * 4))
        assert_matmul_close(y, x, w_true)
        assert np.max(np.abs(y - x @ w_wrong.T)) > 1.0


# ---------------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "override,message",
    [
        ({"num_bits": 8}, "num_bits"),
        ({"num_bits": 2}, "num_bits"),
        ({"strategy": "tensor", "group_size": None}, "strategy"),
        ({"strategy": "block", "group_size": None, "block_structure": [128, 128]}, "block"),
        ({"type": "float"}, "type"),
        ({"actorder": "group"}, "actorder"),
        ({"dynamic": True}, "dynamic"),
    ],
)
def test_unsupported_weight_args(override, message):
    with pytest.raises(UnsupportedQuantizationError, match=message) as err:
        parse_quantization_config(qconfig_dict(True, 32, override))
    assert isinstance(err.value, ValueError) and isinstance(err.value, NotImplementedError)


def test_unsupported_config_settings():
    def cfg(**top):
        c = qconfig_dict(True, 32)
        c["quantization_config"].update(top)
        return c

    act = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    bad_group = qconfig_dict(True, 32)
    bad_group["quantization_config"]["config_groups"]["group_0"]["input_activations"] = act
    for config, message in [
        (bad_group, "activation quantization"),
        (cfg(quant_method="gptq"), "quant_method"),
        (
            cfg(
                format="float-quantized",
                config_groups={"g": {"targets": ["Linear"], "weights": weight_args(True, 32).model_dump()}},
            ),
            "float-quantized",
        ),
        (
            cfg(
                format="naive-quantized",
                config_groups={"g": {"targets": ["Linear"], "weights": weight_args(True, 32).model_dump()}},
            ),
            "naive-quantized",
        ),
        (cfg(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
        (cfg(quantization_status="frozen"), "quantization_status"),
    ]:
        with pytest.raises(UnsupportedQuantizationError, match=message):
            parse_quantization_config(config)
    assert parse_quantization_config({"hidden_size": 64}) is None
    with pytest.raises(ValueError, match="config_groups"):
        parse_quantization_config(cfg(config_groups={}))


@pytest.fixture()
def good_module():
    torch.manual_seed(3)
    return compress_weight(torch.randn(20, 64).to(torch.bfloat16), False, 16)


@pytest.mark.parametrize(
    "mutate,tensor,exc",
    [
        (lambda t: t.update(weight_scale=t["weight_scale"][:, :3]), "m.weight_scale", ValueError),
        (lambda t: t.update(weight_scale=t["weight_scale"][:19]), "m.weight_scale", ValueError),
        (lambda t: t.update(weight_packed=t["weight_packed"][:, :7]), "m.weight_packed", ValueError),
        (lambda t: t.update(weight_packed=t["weight_packed"].long()), "m.weight_packed", ValueError),
        (lambda t: t.update(weight_zero_point=t["weight_zero_point"][:2]), "m.weight_zero_point", ValueError),
        (lambda t: t.update(weight_shape=torch.tensor([20, 64, 1])), "m.weight_shape", ValueError),
        (
            lambda t: t.update(weight_shape=torch.tensor([20, 60])),
            "m.weight_shape: K=60 is not a multiple",
            ValueError,
        ),
        (lambda t: t.pop("weight_scale"), "m.weight_scale", ValueError),
        (lambda t: t.pop("weight_zero_point"), "m.weight_zero_point", ValueError),
        (
            lambda t: t.update(weight_g_idx=torch.arange(64, dtype=torch.int32) // 16),
            "m.weight_g_idx",
            NotImplementedError,
        ),
        (lambda t: t.update(weight=torch.zeros(20, 64)), "both", ValueError),
    ],
)
def test_misshapen_tensors_name_the_tensor(tmp_path, good_module, mutate, tensor, exc):
    tensors = dict(good_module)
    mutate(tensors)
    write_module(tmp_path / "m.safetensors", "m", tensors)
    qcfg = parse_quantization_config(qconfig_dict(False, 16))
    with open_checkpoint(tmp_path) as reader, pytest.raises(exc, match=tensor.replace(".", r"\.")):
        load_linear(reader, "m", qcfg, jnp.float32)


def test_module_errors(tmp_path, good_module):
    write_module(tmp_path / "m.safetensors", "m", good_module)
    with open_checkpoint(tmp_path) as reader:
        with pytest.raises(ValueError, match="neither"):
            load_linear(reader, "other", None, jnp.float32)
        with pytest.raises(ValueError, match="no compressed-tensors quantization_config"):
            load_linear(reader, "m", None, jnp.float32)
        with pytest.raises(ValueError, match=r"m\.weight_zero_point: present"):  # config symmetric
            load_linear(reader, "m", parse_quantization_config(qconfig_dict(True, 16)), jnp.float32)
        with pytest.raises(ValueError, match=r"m\.weight_scale.*fits no config group"):  # config G = 32
            load_linear(reader, "m", parse_quantization_config(qconfig_dict(False, 32)), jnp.float32)


# ---------------------------------------------------------------------------------------------------------------
# memory


@pytest.mark.parametrize(
    "n,k,g,symmetric,scale_dtype",
    [(2048, 1536, 32, True, jnp.bfloat16), (20, 36, 4, False, jnp.float32), (24, 36, 36, True, jnp.float32)],
)
def test_nbytes_is_the_packed_arithmetic(n, k, g, symmetric, scale_dtype):
    w = Int4Weight(
        packed=jnp.zeros((n, math.ceil(k / 8)), jnp.int32),
        scale=jnp.ones((n, k // g), scale_dtype),
        zero=None if symmetric else jnp.zeros((n, k // g), jnp.int8),
        in_features=k,
        group_size=g,
    )
    expected = (
        n * math.ceil(k / 8) * 4
        + n * (k // g) * jnp.dtype(scale_dtype).itemsize
        + (0 if symmetric else n * (k // g))
    )
    assert w.nbytes == expected
    if k % 8 == 0:
        assert n * math.ceil(k / 8) * 4 == n * k // 2


@pytest.mark.cpu_backend  # the CPU path of `linear` (`lax.platform_dependent`)
def test_linear_never_materializes_the_whole_dequantized_weight_on_cpu():
    """Compiled temp memory of the CPU path stays near one row block, far below the f32 [N, K] copy (16 MiB)."""
    n, k, g = 4096, 1024, 32
    w = Int4Weight(
        packed=jnp.zeros((n, k // 8), jnp.int32),
        scale=jnp.ones((n, k // g), jnp.bfloat16),
        zero=None,
        in_features=k,
        group_size=g,
    )
    x = jnp.ones((1, k), jnp.float32)
    full = n * k * 4

    def temp(f):
        return jax.jit(f).lower(x, w).compile().memory_analysis().temp_size_in_bytes

    assert temp(linear) < full // 2
    assert (
        temp(lambda x, w: int4_linear(x, w, "plain")) >= full
    )  # the analysis does see a whole-matrix temporary


# ---------------------------------------------------------------------------------------------------------------
# reading


def test_bf16_and_sharded_reading(tmp_path):
    a = torch.randn(3, 5).to(torch.bfloat16)
    save_file(
        {"a": a, "b": torch.arange(6, dtype=torch.int32).reshape(2, 3)}, str(tmp_path / "s1.safetensors")
    )
    save_file({"c": torch.tensor([3, 5])}, str(tmp_path / "s2.safetensors"))
    weight_map = {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    with open_checkpoint(tmp_path) as reader:
        assert reader.keys() == ["a", "b", "c"]
        got = reader.get("a")
        np.testing.assert_array_equal(to_f32(got), a.float().numpy())
        raw = read_tensor_raw(tmp_path / "s1.safetensors", "a")
        assert (
            raw.dtype == got.dtype and raw.tobytes() == got.tobytes() == a.view(torch.int16).numpy().tobytes()
        )
        np.testing.assert_array_equal(read_tensor_raw(tmp_path / "s1.safetensors", "b"), reader.get("b"))
        assert reader.get("c").tolist() == [3, 5]

        class NoBF16:  # a safetensors whose numpy path cannot represent BF16
            def __init__(self, h):
                self.h = h

            def get_slice(self, name):
                return self.h.get_slice(name)

            def get_tensor(self, name):
                raise TypeError("data type 'bfloat16' not understood")

        path, handle = reader._where["a"]
        reader._where["a"] = (path, NoBF16(handle))
        assert reader.get("a").tobytes() == got.tobytes()
    with pytest.raises(KeyError):
        read_tensor_raw(tmp_path / "s1.safetensors", "zz")


def test_linear_shapes_dtypes_and_dense_path():
    rng = np.random.default_rng(5)
    n, k, g = 40, 64, 32
    q = rng.integers(-8, 8, size=(n, k)).astype(np.int8)
    scale = rng.uniform(0.5, 2.0, size=(n, k // g)).astype(np.float32)
    zero = rng.integers(-8, 8, size=(n, k // g)).astype(np.int8)
    w = Int4Weight(
        packed=jnp.asarray(pack_to_int32(torch.from_numpy(q), 4).numpy()),
        scale=jnp.asarray(scale),
        zero=jnp.asarray(zero),
        in_features=k,
        group_size=g,
    )
    dense = (q.astype(np.float32) - np.repeat(zero, g, axis=1)) * np.repeat(scale, g, axis=1)
    np.testing.assert_array_equal(np.asarray(dequantize(w, jnp.float32)), dense)
    for shape in [(k,), (2, 3, k)]:
        x = rng.standard_normal(shape).astype(np.float32)
        y = jax.jit(linear)(x, w)
        assert y.shape == shape[:-1] + (n,) and y.dtype == jnp.float32
        assert_matmul_close(y.reshape(-1, n), x.reshape(-1, k), dense)
        assert_matmul_close(
            linear(x, jnp.asarray(dense.T)).reshape(-1, n), x.reshape(-1, k), dense
        )  # [in, out]
    xb = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
    yb = linear(xb, w)
    assert yb.dtype == jnp.bfloat16
    ref = to_f32(xb) @ to_f32(dequantize(w, jnp.bfloat16)).T
    assert np.max(np.abs(to_f32(yb) - ref)) <= 2**-7 * np.max(np.abs(to_f32(xb)) @ np.abs(dense).T)
    with pytest.raises(ValueError, match="features"):
        linear(jnp.ones((2, k + 1)), w)
    with pytest.raises(ValueError, match="impl"):
        int4_linear(jnp.ones((2, k)), w, "fast")
