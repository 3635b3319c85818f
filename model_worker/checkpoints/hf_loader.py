"""Hugging Face checkpoints (safetensors) -> our weight dict, read straight into JAX arrays (no torch).

The model family comes from config.json through the `families` registry (`from_hf_config`); its worker part parses
the config (`config_from_hf`) and may extend the Gemma-style decoder names below with its own (module attributes
`HF_TOP_NAMES` and `HF_LAYER_NAMES`: HF module name -> (our flat name, is_linear); `HF_SKIP_PREFIXES`: tensors
skipped without being read, such as a multimodal release's towers). Today that is Gemma 4 (tensor names:
docs/gemma4-architecture.md §8).

Handles the multimodal layout (`model.language_model.` prefix) and text-only saves (`model.`), bf16 and
`-qat-q4_0-unquantized` weights, and compressed-tensors `pack-quantized` W4A16 (int4 kept packed; see
ct_loader.py), deciding dense-or-quantized per module by the tensors present. KV-shared layers' redundant
`k_proj`/`v_proj`/`k_norm` (present in the original release, absent from QAT exports and `save_pretrained`
output) are accepted and ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pathlib
import re

import jax.numpy as jnp
import numpy as np

from common import families
from model_worker.modeling.config import ModelConfig, WorkerPart, worker_part
from model_worker.modeling.params import check_flat, param_shapes

log = logging.getLogger(__name__)

_PREFIXES = ("model.language_model.", "model.")
_SKIP_PREFIXES = ("lm_head.",)
# Gemma-style HF decoder module name (inside the text decoder) -> (our flat name, is_linear); a family's worker part
# adds its own (module docstring).
_TOP = {
    "embed_tokens": ("embed", False),
    "norm": ("final_norm", False),
}
_LAYER = {
    "input_layernorm": ("input_norm", False),
    "self_attn.q_proj": ("q", True),
    "self_attn.k_proj": ("k", True),
    "self_attn.v_proj": ("v", True),
    "self_attn.o_proj": ("o", True),
    "self_attn.q_norm": ("q_norm", False),
    "self_attn.k_norm": ("k_norm", False),
    "post_attention_layernorm": ("post_attn_norm", False),
    "pre_feedforward_layernorm": ("pre_ffw_norm", False),
    "post_feedforward_layernorm": ("post_ffw_norm", False),
    "mlp.gate_proj": ("gate", True),
    "mlp.up_proj": ("up", True),
    "mlp.down_proj": ("down", True),
}
_LINEAR_SUFFIXES = (".weight", ".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point",
                    ".weight_g_idx")


def read_config(directory: pathlib.Path) -> dict:
    """config.json of a checkpoint directory.

    Raises:
      FileNotFoundError: no config.json.
    """
    return json.loads((directory / "config.json").read_text())


def safetensors_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's safetensors shards (from model.safetensors.index.json when present).

    Raises:
      FileNotFoundError: no safetensors file.
    """
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no .safetensors files")
    return files


@dataclasses.dataclass(frozen=True)
class _Names:
    """The tensor names one family's checkpoints use: the Gemma-style ones plus its worker part's."""

    top: dict[str, tuple[str, bool]]
    layer: dict[str, tuple[str, bool]]
    skip: tuple[str, ...]

    @classmethod
    def of(cls, worker: WorkerPart) -> _Names:
        """The names for a family's worker part: the Gemma-style ones plus those the part adds."""
        return cls(top=_TOP | dict(worker.hf_top_names), layer=_LAYER | dict(worker.hf_layer_names),
                   skip=_SKIP_PREFIXES + worker.hf_skip_prefixes)


def _text_name(name: str, names: _Names) -> str | None:
    """The name inside the text decoder, or None for tensors we skip (the family's, tied lm_head)."""
    if name.startswith(names.skip):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _ours(module: str, names: _Names) -> tuple[str, bool] | None:
    """(our flat name, is_linear) for a text-decoder module name; None if unknown."""
    if module in names.top:
        return names.top[module]
    m = re.match(r"layers\.(\d+)\.(.+)$", module)
    if m and m.group(2) in names.layer:
        ours, is_linear = names.layer[m.group(2)]
        return f"layers.{m.group(1)}.{ours}", is_linear
    return None


def _module(name: str) -> str:
    for suffix in _LINEAR_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _keys(reader) -> set[str]:
    """The tensor names of an open safetensors file (cached on the reader object)."""
    cached = getattr(reader, "_gemma_keys", None)
    if cached is None:
        cached = set(reader.keys())
        try:
            reader._gemma_keys = cached
        except AttributeError:  # a C-extension object without a __dict__
            return cached
    return cached


def load_checkpoint(directory: pathlib.Path, dtype: jnp.dtype) -> tuple[ModelConfig, dict]:
    """Read a checkpoint directory of a registered family into (config, flat weights) ready for
    `params.to_device`.

    Dense Linear weights become [in, out] arrays in `dtype`; pack-quantized ones become Int4Weight.

    Raises:
      families.UnknownFamilyError: config.json names a model no registered family serves (checked before any
        tensor is read); the message lists the supported model_type values.
      NotImplementedError: the family (or this variant of it) has no checkpoint loader.
      ValueError: one message naming every missing, misshapen or unknown tensor with the expected shape, or an
        unsupported quantization config.
      FileNotFoundError: no config.json or safetensors files.
    """
    from safetensors import safe_open

    directory = pathlib.Path(directory)
    config = read_config(directory)
    worker = worker_part(families.from_hf_config(config))
    cfg = worker.config_from_hf(config, directory.name)
    names = _Names.of(worker)
    qcfg = None
    if config.get("quantization_config"):
        from model_worker.checkpoints import ct_loader

        qcfg = ct_loader.parse_quantization_config(config)
    expected = param_shapes(cfg)
    owners = {i for i in cfg.kv_layers}
    flat: dict = {}
    unknown: list[str] = []
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(safe_open(str(f), framework="numpy")) for f in safetensors_files(directory)]
        modules: dict[str, tuple[object, str, bool]] = {}
        for reader in readers:
            for name in reader.keys():
                text = _text_name(name, names)
                if text is None:
                    continue
                mapped = _ours(_module(text), names)
                if mapped is None:
                    unknown.append(name)
                    continue
                ours, is_linear = mapped
                layer = re.match(r"layers\.(\d+)\.(k|v|k_norm)$", ours)
                if layer and int(layer.group(1)) not in owners:
                    continue  # redundant K/V tensors of a KV-shared layer
                if ours not in expected:
                    unknown.append(name)
                    continue
                modules[ours] = (reader, name if not is_linear else _module(name), is_linear)
        for ours, (reader, module, is_linear) in modules.items():
            if is_linear and module + ".weight_packed" in _keys(reader):
                if qcfg is None:
                    raise ValueError(f"{module} is pack-quantized but config.json has no quantization_config")
                flat[ours] = ct_loader.load_linear(reader, module, qcfg, dtype)
            elif is_linear:
                flat[ours] = dense_linear(reader, module, dtype)
            else:
                flat[ours] = jnp.asarray(reader.get_tensor(module), dtype=dtype)
    if unknown:
        raise ValueError(f"{directory.name}: unknown tensors in the text decoder: {', '.join(sorted(unknown)[:20])}")
    check_flat(cfg, flat)
    return cfg, flat


def dense_linear(reader, module: str, dtype: jnp.dtype):
    """A dense HF Linear `<module>.weight` [out, in] as a [in, out] array in `dtype`."""
    w = reader.get_tensor(module + ".weight")
    return jnp.asarray(np.ascontiguousarray(w.T), dtype=dtype)


def stop_token_ids(directory: pathlib.Path, cfg: ModelConfig) -> tuple[int, ...]:
    """Default stop ids: config.json's eos ids plus generation_config.json's (Gemma 4 IT: 1, 106, 50)."""
    ids = list(cfg.stop_token_ids)
    gen_path = pathlib.Path(directory) / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", [])
        ids += [i for i in (eos if isinstance(eos, list) else [eos]) if i not in ids]
    return tuple(ids)
