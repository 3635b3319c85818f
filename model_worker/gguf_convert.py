"""GGUF (Gemma 3) -> our flat float32 weights and config, read with the `gguf` package (no torch).

formats.md §3: `GGUFReader` returns tensors in the Hugging Face `[out, in]` orientation; quantized blocks are
dequantized with `gguf.quants.dequantize`; every `*norm.weight` is stored as `w + 1`, which is exactly the
effective multiplier our RMSNorm uses, so norms are taken as they are. `token_embd` doubles as the LM head; when it
is Q8_0 (as in the embedded Gemma 3 270M Q4_K_M file) it is kept as an `Int8Weight`, the same values in a quarter of
the bytes (`quant.int8_from_q8_0`).
"""

from __future__ import annotations

import numpy as np

from model_worker.config import ModelConfig, gemma3_from_gguf_metadata
from model_worker.quant import Int8Weight, int8_from_q8_0

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


def convert_gguf(reader, name: str) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Dequantize every tensor of a Gemma 3 GGUF into our flat float32 weight dict (a Q8_0 embedding stays int8).

    Args:
      reader: an open `gguf.GGUFReader`.
      name: model name for the config.
    Returns:
      (config, {name: float32 array or Int8Weight}) with Linear weights as [in, out]; save it with
      `quant.int8_to_flat`.
    Raises:
      ValueError: not a gemma3 GGUF, or an unknown tensor name.
    """
    from gguf import GGMLQuantizationType, quants

    meta = read_metadata(reader)
    flat: dict[str, np.ndarray | Int8Weight] = {}
    for t in reader.tensors:
        if t.name == "token_embd.weight" and t.tensor_type == GGMLQuantizationType.Q8_0:
            flat["embed"] = int8_from_q8_0(t.data, tuple(int(d) for d in reversed(t.shape)))
            continue
        data = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name == "token_embd.weight":
            flat["embed"] = data
        elif t.name == "output_norm.weight":
            flat["final_norm"] = data
        elif t.name.startswith("blk."):
            _, idx, base, _ = t.name.split(".")
            if base not in _BLOCK_NAMES:
                raise ValueError(f"unknown GGUF tensor {t.name}")
            ours, transpose = _BLOCK_NAMES[base]
            flat[f"layers.{idx}.{ours}"] = np.ascontiguousarray(data.T) if transpose else data
        elif t.name == "output.weight":
            continue  # an untied head is not used by Gemma; the tied embedding is the head
        else:
            raise ValueError(f"unknown GGUF tensor {t.name}")
    cfg = gemma3_from_gguf_metadata(meta, vocab_size=flat["embed"].shape[0], name=name)
    return cfg, flat
