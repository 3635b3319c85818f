"""GGUF -> our flat float32 weights and config, read with the `gguf` package (no torch).

The model family comes from the file's `general.architecture` through the `families` registry, and its worker
part builds the config from the metadata (`config_from_gguf`); the tensor names below are llama.cpp's, shared by
the Gemma-style architectures it converts.

docs/formats.md §3: `GGUFReader` returns tensors in the Hugging Face `[out, in]` orientation; quantized blocks are
dequantized with `gguf.quants.dequantize`; every `*norm.weight` is stored as `w + 1`, which is exactly the
effective multiplier our RMSNorm uses, so norms are taken as they are. `token_embd` doubles as the LM head.
A Linear weight or the embedding in a block type that `model_worker.checkpoints.gguf_int8` supports (Q8_0, Q5_0, Q6_K, Q4_K:
every matrix of the embedded Gemma 3 270M Q4_K_M file) is kept as an `Int8Weight` [out, in] with exactly the
dequantized values, in about a quarter of the bytes; any other tensor becomes dense float32.
"""

from __future__ import annotations

import numpy as np

from common import families
from model_worker.checkpoints.gguf_int8 import int8_by_rows, int8_layout
from model_worker.modeling.config import ModelConfig, worker_part
from model_worker.numerics.quant import Int8Weight

# GGUF tensor name (per block) -> our name, and whether it is a Linear weight to transpose to [in, out].
_BLOCK_NAMES = {
    "attn_norm": ("input_norm", False),
    "attn_q": ("q", True),
    "attn_k": ("k", True),
    "attn_v": ("v", True),
    "attn_output": ("o", True),
    "attn_q_norm": ("q_norm", False),
    "attn_k_norm": ("k_norm", False),
    "post_attention_norm": ("post_attn_norm", False),
    "ffn_norm": ("pre_ffw_norm", False),
    "ffn_gate": ("gate", True),
    "ffn_up": ("up", True),
    "ffn_down": ("down", True),
    "post_ffw_norm": ("post_ffw_norm", False),
}


def read_metadata(reader) -> dict:
    """Scalar and string metadata of an open `gguf.GGUFReader` (the big tokenizer arrays are left out)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in ("tokens", "scores", "token_type", "merges"):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - exotic field types are irrelevant to us
            continue
    return meta


def _dense_shape(t) -> tuple[int, ...]:
    """The shape `gguf.quants.dequantize(t.data, t.tensor_type)` returns, without dequantizing."""
    from gguf import quants

    if t.data.dtype == np.uint8:  # block bytes (a float tensor's data is already its values)
        return tuple(int(n) for n in quants.quant_shape_from_byte_shape(t.data.shape, t.tensor_type))
    return tuple(int(n) for n in t.data.shape)


def convert_gguf(reader, name: str, values: bool = True) -> tuple[ModelConfig, dict[str, np.ndarray | Int8Weight]]:
    """Every tensor of a GGUF of a registered family into our flat weight dict: float32, or Int8Weight for the block
    types of `gguf_int8` (the same values).

    Args:
      reader: an open `gguf.GGUFReader`.
      name: model name for the config.
      values: False: the layout only, in a fraction of a second: every array np.zeros of the shape and dtype the
        conversion is expected to give (`gguf_int8.int8_layout`), for the worker to compile its programs before
        the weights are written (`write_weights`' layout.json).
    Returns:
      (config, {name: float32 array or Int8Weight}) with dense Linear weights as [in, out] and Int8Weight ones as
      [out, in]; save it with `quant.int8_to_flat`.
    Raises:
      families.UnknownFamilyError: no registered family serves the file's `general.architecture` (checked before
        any tensor is read); the message lists the supported architectures.
      NotImplementedError: the family has no GGUF loader.
      ValueError: missing metadata, or an unknown tensor name.
    """
    from gguf import quants

    meta = read_metadata(reader)
    worker = worker_part(families.from_gguf(meta))
    flat: dict[str, np.ndarray | Int8Weight] = {}
    for t in reader.tensors:
        # A block-quantized matrix becomes an Int8Weight piece by piece (`int8_by_rows`: no dense copy); the rest,
        # and a matrix whose values do not round-trip, is dequantized whole.
        if values:
            packed = int8_by_rows(t.data, t.tensor_type) if len(t.shape) == 2 else None
            value = packed if packed is not None else np.asarray(quants.dequantize(t.data, t.tensor_type),
                                                                 np.float32)
        else:
            packed = int8_layout(t.data, t.tensor_type) if len(t.shape) == 2 else None
            value = packed if packed is not None else np.zeros(_dense_shape(t), np.float32)
        if t.name == "token_embd.weight":
            flat["embed"] = value
        elif t.name == "output_norm.weight":
            flat["final_norm"] = value
        elif t.name.startswith("blk."):
            _, idx, base, _ = t.name.split(".")
            if base not in _BLOCK_NAMES:
                raise ValueError(f"unknown GGUF tensor {t.name}")
            ours, transpose = _BLOCK_NAMES[base]
            dense_transposed = transpose and packed is None
            if dense_transposed:
                value = np.ascontiguousarray(value.T) if values else np.zeros(value.shape[::-1], value.dtype)
            flat[f"layers.{idx}.{ours}"] = value
        elif t.name == "output.weight":
            continue  # an untied head is not used by Gemma; the tied embedding is the head
        else:
            raise ValueError(f"unknown GGUF tensor {t.name}")
    cfg = worker.config_from_gguf(meta, flat["embed"].shape[0], name)
    return cfg, flat
