"""Test helpers that make compressed-tensors `pack-quantized` (W4A16) checkpoints with the compressed-tensors library
itself (torch; tests only), so our loader is checked against the format's own producer and decompressor.

compressed-tensors 0.20 APIs used (read from its source, `compressed_tensors/...`):
  * `quantization.QuantizationArgs/QuantizationScheme/QuantizationConfig` and `apply_quantization_config(model, cfg)`
    (`quantization/lifecycle/apply.py`): attach schemes to the matching Linear modules (targets ["Linear"], minus
    `ignore`) and register empty `weight_scale` (+ `weight_zero_point`) parameters.
  * `quantization.utils.calculate_qparams(min, max, args)` (`quantization/utils/helpers.py`): min-max scales and
    zero points, as llm-compressor's min-max observer would produce for a fresh (non-calibrated) weight.
  * `compressors.ModelCompressor.from_pretrained_model(model, "pack-quantized")`, `.compress_model(model)`,
    `.update_config(dir)` (`compressors/model_compressors/model_compressor.py`): the same save path as
    llm-compressor (`compress_model` -> `model.save_pretrained` -> `update_config` writes `quantization_config`).
  * `compressors.pack_quantized.PackedQuantizationCompressor.compress/.decompress(state_dict, scheme)`: one module's
    tensors (`weight_packed`, `weight_scale`, `weight_shape`, `weight_zero_point`), and the library's own
    dequantization (`unpack_from_int32` + `quantization.lifecycle.forward.dequantize`).

Note: transformers 5.24 + compressed-tensors 0.20 can load a *symmetric* checkpoint written here
(`AutoModelForCausalLM.from_pretrained(dst)` decompresses on the first forward), but fail on an asymmetric one
(it initialises `weight_zero_point` unpacked [N, K/G] and rejects the packed [ceil(N/8), K/G] tensor).
"""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Iterable

import torch

# Like Google's Gemma 4 QAT W4A16 export (docs/formats.md §2): embeddings (incl. the per-layer embedding table), the tied
# lm_head, vision/audio towers and their embedders stay dense; norms are not Linear modules, so never targeted.
DEFAULT_IGNORE = ("lm_head", "re:.*embed.*", "re:.*vision.*", "re:.*audio.*")


def weight_args(symmetric: bool, group_size: int | None, num_bits: int = 4):
    """compressed-tensors `QuantizationArgs` for int weights: strategy "group" (group_size) or "channel" (None)."""
    from compressed_tensors.quantization import QuantizationArgs

    if group_size is None:
        return QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric, strategy="channel")
    return QuantizationArgs(
        num_bits=num_bits, type="int", symmetric=symmetric, strategy="group", group_size=group_size
    )


def weight_scheme(symmetric: bool, group_size: int | None):
    """A `QuantizationScheme` targeting Linear layers with `weight_args(...)`, format pack-quantized."""
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(
        targets=["Linear"], weights=weight_args(symmetric, group_size), format="pack-quantized"
    )


def min_max_qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) from the library's `calculate_qparams` over each group (or each row for channel).

    Shapes [N, K/G] (or [N, 1]); scale in weight.dtype, zero point int8 (zeros when symmetric).
    """
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.detach()
    if args.group_size is not None and args.group_size > 0:
        w = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    else:
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    return calculate_qparams(lo, hi, args)


def compress_weight(weight: torch.Tensor, symmetric: bool, group_size: int | None) -> dict[str, torch.Tensor]:
    """One Linear weight [N, K] -> its checkpoint tensors, exactly as `PackedQuantizationCompressor.compress` writes
    them: {"weight_packed", "weight_scale", "weight_shape"} (+ "weight_zero_point" when asymmetric)."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor

    scheme = weight_scheme(symmetric, group_size)
    scale, zero = min_max_qparams(weight, scheme.weights)
    state = {"weight": weight.detach(), "weight_scale": scale, "weight_zero_point": zero}
    return {k: v.contiguous() for k, v in PackedQuantizationCompressor.compress(state, scheme).items()}


def decompress_weight(tensors: dict[str, torch.Tensor], scheme) -> torch.Tensor:
    """The library's own decompression of one module's tensors -> dense [N, K] in the scale's dtype."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor

    return PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]


def compress_checkpoint(
    src_dir: str | pathlib.Path,
    dst_dir: str | pathlib.Path,
    symmetric: bool = True,
    group_size: int | None = 32,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    model_cls=None,
) -> list[str]:
    """Write a pack-quantized W4A16 copy of a Hugging Face checkpoint directory (saved with `save_pretrained`).

    Loads the model with transformers (`model_cls`, default `AutoModelForCausalLM`, dtype "auto" so the scales get
    the checkpoint's dtype), quantizes every Linear not matched by `ignore` (names or "re:" regexes, compressed-tensors
    `utils/match.py` rules) with min-max group (or channel, group_size None) int4 quantization, compresses it with
    `ModelCompressor` and saves it to `dst_dir` with config.json's `quantization_config` (whose `ignore` list is the
    library's: the Linear modules left dense, e.g. lm_head). Other files of `src_dir` (tokenizer, chat template)
    are copied.

    Returns:
      The names of the quantized modules.
    Raises:
      ValueError: a targeted Linear's in_features is not a multiple of group_size (list in the message; add those
        modules to `ignore` or pick another group_size).
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.utils.match import match_named_modules

    if model_cls is None:
        from transformers import AutoModelForCausalLM as model_cls
    src_dir, dst_dir = pathlib.Path(src_dir), pathlib.Path(dst_dir)
    ignore = list(ignore)
    model = model_cls.from_pretrained(src_dir, dtype="auto")
    model.eval()

    targeted = list(match_named_modules(model, ["Linear"], ignore))
    if group_size is not None:
        bad = [f"{n} (in_features {m.in_features})" for n, m in targeted if m.in_features % group_size]
        if bad:
            raise ValueError(f"in_features not a multiple of group_size {group_size}: {', '.join(bad)}")

    config = QuantizationConfig(
        config_groups={"group_0": weight_scheme(symmetric, group_size)}, ignore=ignore
    )
    apply_quantization_config(model, config, show_progress=False)
    quantized = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            scale, zero = min_max_qparams(module.weight, module.quantization_scheme.weights)
            update_offload_parameter(module, "weight_scale", scale.to(module.weight_scale.dtype))
            if hasattr(module, "weight_zero_point"):
                update_offload_parameter(module, "weight_zero_point", zero.to(module.weight_zero_point.dtype))
            quantized.append(name)

    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    dst_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst_dir)
    compressor.update_config(dst_dir)
    for f in src_dir.iterdir():
        if (
            f.is_file()
            and not (dst_dir / f.name).exists()
            and not f.name.endswith((".safetensors", ".index.json"))
        ):
            shutil.copy2(f, dst_dir / f.name)
    return quantized
