"""Read compressed-tensors `pack-quantized` checkpoints (W4A16) into `Int4Weight`s, without torch.

Format source: docs/formats.md §1 (layout, exact dequantization, pitfalls) and §2 (what Gemma 4 QAT
W4A16 checkpoints contain), checked against compressed-tensors 0.20 `compressors/pack_quantized/{base.py,
helpers.py}` (`PackedQuantizationCompressor.compress/decompress`, `pack_to_int32`, `unpack_from_int32`) and
`quantization/{quant_args.py,quant_config.py}`.

Per quantized Linear `<m>` (HF weight [N_out, K_in]) a checkpoint holds:
  `<m>.weight_packed`      int32 [N, ceil(K/8)]       8 nibbles per word along K, nibble = q + 8, natural order
  `<m>.weight_scale`       float [N, K/G] ([N, 1] for channel strategy)
  `<m>.weight_shape`       int64/int32 [2] = [N, K]   (K need not be a multiple of 8; packed rows are padded)
  `<m>.weight_zero_point`  int32 [ceil(N/8), K/G]     only if asymmetric; packed along dim 0, also q + 8
  `<m>.weight_g_idx`       int32 [K]                  only for actorder "group" (not supported here)
A module is quantized iff `<m>.weight_packed` exists and dense iff `<m>.weight` exists; the config's `ignore`
list is not trusted for that decision (docs/formats.md §1.1).

Public API:
  `open_checkpoint(path) -> SafetensorsReader`      a file, or a directory with one file or an index
  `parse_quantization_config(config) -> CTQuantConfig | None`
  `load_linear(reader, module, qcfg, dtype) -> jax.Array [in, out] | Int4Weight [out, in]` (reader: a
      SafetensorsReader or a raw `safe_open(..., framework="numpy")` handle)
  `module_names(reader) -> (quantized, dense)`
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import struct
import sys
from collections.abc import Iterable, Mapping
from typing import Self

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from model_worker.numerics.quant import Int4Weight


class UnsupportedQuantizationError(NotImplementedError, ValueError):
    """A valid compressed-tensors setting this loader does not implement (catchable as either base class)."""


# ---------------------------------------------------------------------------------------------------------------
# safetensors reading (numpy only)

# safetensors dtype strings -> numpy dtypes (https://github.com/huggingface/safetensors, format spec).
_ST_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}


def read_tensor_raw(path: str | os.PathLike, name: str) -> np.ndarray:
    """Read one tensor of a safetensors file by parsing its header (no safetensors library involved).

    The file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} and the
    data; offsets are relative to the end of the header. BF16 comes back as `ml_dtypes.bfloat16`.

    Raises:
      KeyError: no tensor `name`.
      ValueError: a dtype outside `_ST_DTYPES`, or a byte range inconsistent with shape and dtype.
    """
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        if name not in header or name == "__metadata__":
            raise KeyError(f"{name} not in {path}")
        info = header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{name}: unsupported safetensors dtype {info['dtype']}")
        dtype = _ST_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{name}: {end - start} bytes for shape {shape} of {info['dtype']}")
        f.seek(8 + header_len + start)
        data = bytearray(f.read(end - start))
    if sys.byteorder != "little":  # safetensors data is little-endian
        raise ValueError("read_tensor_raw: big-endian hosts are not supported")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


class SafetensorsReader:
    """Tensors of one checkpoint (one or several safetensors files) read as numpy arrays.

    Uses `safetensors.safe_open(path, framework="numpy")`. Recent safetensors (0.8 here) returns BF16 as
    `ml_dtypes.bfloat16`; versions whose numpy path cannot represent BF16 raise instead, so a failed BF16 read falls
    back to `read_tensor_raw` (same values, tested; only possible when the file path is known).
    Use as a context manager, or call `close()`.
    """

    def __init__(self, files: Iterable[str | os.PathLike] = (), handles: Iterable[object] = ()):
        """Open every file in `files`, and/or wrap already open `safe_open(..., framework="numpy")` handles.

        Raises ValueError if two files hold the same tensor name.
        """
        self._where: dict[str, tuple[str | None, object]] = {}
        for path, handle in [(str(f), safe_open(str(f), framework="numpy")) for f in files] + [
            (None, h) for h in handles
        ]:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if name in self._where:
                    raise ValueError(f"tensor {name} is in two files ({self._where[name][0]}, {path})")
                self._where[name] = (path, handle)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._where)

    def __iter__(self):
        """Iterate over the tensor names, sorted."""
        return iter(self.keys())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string of `name` ("BF16", "I32", ...). Raises KeyError."""
        return self._where[name][1].get_slice(name).get_dtype()

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of `name` without reading it. Raises KeyError."""
        return tuple(self._where[name][1].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as a numpy array (BF16 as ml_dtypes.bfloat16). Raises KeyError."""
        path, handle = self._where[name]
        try:
            return handle.get_tensor(name)
        except (TypeError, ValueError):
            if self.dtype(name) != "BF16" or path is None:
                raise
            return read_tensor_raw(path, name)

    def close(self) -> None:
        """Drop the file handles (the files close when no other reference holds them)."""
        self._where.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def as_reader(reader: SafetensorsReader | object) -> SafetensorsReader:
    """`reader` itself, or a SafetensorsReader over one open `safe_open(path, framework="numpy")` handle."""
    if isinstance(reader, SafetensorsReader):
        return reader
    if hasattr(reader, "get_tensor") and hasattr(reader, "keys"):
        return SafetensorsReader(handles=[reader])
    raise TypeError(f"expected a SafetensorsReader or a safe_open handle, got {type(reader).__name__}")


def open_checkpoint(path: str | os.PathLike) -> SafetensorsReader:
    """A reader over a `.safetensors` file, or a directory holding `model.safetensors.index.json` (sharded: every
    file of its weight_map) or exactly one `*.safetensors` file.

    Raises:
      FileNotFoundError: no safetensors file found.
      ValueError: several safetensors files but no index.
    """
    path = pathlib.Path(path)
    if path.is_file():
        return SafetensorsReader([path])
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return SafetensorsReader([path / f for f in sorted(set(weight_map.values()))])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path}")
    if len(files) > 1:
        raise ValueError(f"{path} has {len(files)} safetensors files and no model.safetensors.index.json")
    return SafetensorsReader(files)


# ---------------------------------------------------------------------------------------------------------------
# quantization_config


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """The weight quantization of one config group (compressed-tensors `QuantizationArgs`, int4 subset).

    Attributes:
      group_size: G for strategy "group"; None for "channel" (one scale per output row, G = K).
      symmetric: False means a packed `weight_zero_point` is stored.
      targets: the group's `targets` (informational; modules are matched by their tensors, not by class names).
    """

    group_size: int | None
    symmetric: bool
    targets: tuple[str, ...] = ()

    @property
    def strategy(self) -> str:
        """The strategy name: "group" or "channel"."""
        return "channel" if self.group_size is None else "group"


@dataclasses.dataclass(frozen=True)
class CTQuantConfig:
    """A parsed, supported compressed-tensors `quantization_config` (docs/formats.md §1.1).

    Attributes:
      schemes: the weight scheme of each config group, in config order.
      ignore: the `ignore` list as written (kept for reporting; not used to decide what is quantized).
      format: "pack-quantized".
    """

    schemes: tuple[WeightScheme, ...]
    ignore: tuple[str, ...] = ()
    format: str = "pack-quantized"


_GOOD_ACTORDER = (None, False, "weight", "static")


def _check_weights(group: str, w: Mapping) -> WeightScheme:
    """Validate one group's `weights` QuantizationArgs dict; raises UnsupportedQuantizationError."""
    where = f"quantization_config.config_groups.{group}.weights"
    if w.get("type", "int") != "int":
        raise UnsupportedQuantizationError(
            f"{where}.type = {w.get('type')!r}: only integer weights are supported"
        )
    if w.get("num_bits") != 4:
        raise UnsupportedQuantizationError(
            f"{where}.num_bits = {w.get('num_bits')!r}: only 4-bit is supported"
        )
    if w.get("dynamic", False):
        raise UnsupportedQuantizationError(f"{where}.dynamic = {w.get('dynamic')!r}: weights must be static")
    actorder = w.get("actorder")
    if actorder not in _GOOD_ACTORDER:
        raise UnsupportedQuantizationError(
            f"{where}.actorder = {actorder!r}: activation-ordered groups (weight_g_idx) are not supported"
        )
    if w.get("block_structure") is not None:
        raise UnsupportedQuantizationError(f"{where}.block_structure: block quantization is not supported")
    group_size = w.get("group_size")
    strategy = w.get("strategy")
    if strategy is None:  # compressed-tensors infers it from group_size (quant_args.py validate_model_after)
        strategy = "tensor" if group_size is None else ("group" if group_size > 0 else "channel")
    if strategy == "group":
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"{where}: strategy 'group' needs a positive group_size, got {group_size!r}")
    elif strategy == "channel":
        group_size = None
    else:
        raise UnsupportedQuantizationError(
            f"{where}.strategy = {strategy!r}: only 'group' and 'channel' are supported"
        )
    return WeightScheme(group_size=group_size, symmetric=bool(w.get("symmetric", True)))


def parse_quantization_config(config: Mapping) -> CTQuantConfig | None:
    """Parse the `quantization_config` of a config.json dict (or that sub-dict itself).

    Returns None when there is no quantization_config. Supported: quant_method "compressed-tensors", format
    "pack-quantized" (top level, or "mixed-precision" with every group "pack-quantized"), status "compressed" (or
    absent), no KV-cache scheme, and per group: int weights, num_bits 4, strategy group (G > 0) or channel,
    symmetric or not, actorder None/"weight", no input/output activation quantization.

    Raises:
      UnsupportedQuantizationError (a NotImplementedError and a ValueError): any other setting, naming the key.
      ValueError: a malformed config (no config_groups, group without weights, group strategy without group_size).
    """
    qc = config.get("quantization_config", config if "quant_method" in config else None)
    if qc is None:
        return None
    if qc.get("quant_method") != "compressed-tensors":
        raise UnsupportedQuantizationError(
            f"quantization_config.quant_method = {qc.get('quant_method')!r}: only 'compressed-tensors' is supported"
        )
    status = qc.get("quantization_status")
    if status not in (None, "compressed"):
        raise UnsupportedQuantizationError(
            f"quantization_config.quantization_status = {status!r}: only saved ('compressed') checkpoints load"
        )
    if qc.get("kv_cache_scheme") is not None:
        raise UnsupportedQuantizationError(
            "quantization_config.kv_cache_scheme: KV-cache quantization is not supported"
        )
    top_format = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config has no config_groups")
    schemes = []
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise UnsupportedQuantizationError(
                f"quantization_config.config_groups.{name} = {group!r}: preset names are not supported"
            )
        fmt = group.get("format") or top_format
        if top_format not in (None, "pack-quantized", "mixed-precision") or fmt != "pack-quantized":
            raise UnsupportedQuantizationError(
                f"quantization_config format {fmt!r} (top level {top_format!r}): only 'pack-quantized' is supported"
            )
        for act in ("input_activations", "output_activations"):
            if group.get(act) is not None:
                raise UnsupportedQuantizationError(
                    f"quantization_config.config_groups.{name}.{act}: activation quantization is not supported "
                    "(W4A16 only)"
                )
        if group.get("weights") is None:
            raise ValueError(f"quantization_config.config_groups.{name} has no weights")
        scheme = _check_weights(name, group["weights"])
        schemes.append(dataclasses.replace(scheme, targets=tuple(group.get("targets") or ())))
    return CTQuantConfig(
        schemes=tuple(schemes), ignore=tuple(qc.get("ignore") or ()), format="pack-quantized"
    )


# ---------------------------------------------------------------------------------------------------------------
# tensors -> Int4Weight


def unpack_int4_np(packed: np.ndarray, count: int) -> np.ndarray:
    """Host-side unpack along the last axis: int32 [R, ceil(count/8)] -> int8 [R, count], natural order, q = u - 8.

    Same bit layout as `model_worker.numerics.quant.unpack_int4` (docs/formats.md §1.3).
    """
    shifts = np.arange(8, dtype=np.int32) * 4
    nibbles = (packed.astype(np.int32)[:, :, None] >> shifts) & 0xF
    return (nibbles.reshape(packed.shape[0], -1)[:, :count] - 8).astype(np.int8)


def module_names(reader: SafetensorsReader) -> tuple[list[str], list[str]]:
    """(quantized, dense) Linear-like module names: those with `<m>.weight_packed`, and those with a 2-D
    `<m>.weight` (which also lists embeddings; callers pick the names they need)."""
    reader = as_reader(reader)
    quantized = [k[: -len(".weight_packed")] for k in reader if k.endswith(".weight_packed")]
    dense = [k[: -len(".weight")] for k in reader if k.endswith(".weight") and len(reader.shape(k)) == 2]
    return quantized, dense


def _expect(cond: bool, tensor: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{tensor}: {msg}")


def load_int4(reader: SafetensorsReader | object, module: str, qcfg: CTQuantConfig | None) -> Int4Weight:
    """Build the Int4Weight of quantized module `module` (which has `<module>.weight_packed`).

    The scale keeps the checkpoint's float dtype (bf16 for Google's QAT export: dequantization is exact in float32,
    so no precision is gained by widening it, and it stays half the size). Zero points are unpacked along dim 0 to
    int8 [N, K/G].

    Raises:
      ValueError: naming the offending tensor, when a tensor is missing, has the wrong dtype or a shape inconsistent
        with `weight_shape` and the group size, or when K is not a multiple of the group size; when no scheme of
        `qcfg` (symmetric vs zero point present, group size) fits the tensors; when qcfg is None.
      UnsupportedQuantizationError: `<module>.weight_g_idx` is present (actorder "group").
    """
    reader = as_reader(reader)
    names = {
        t: f"{module}.{t}"
        for t in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
    }
    if qcfg is None:
        raise ValueError(
            f"{names['weight_packed']} is present but config.json has no compressed-tensors "
            "quantization_config"
        )
    if names["weight_g_idx"] in reader:
        raise UnsupportedQuantizationError(
            f"{names['weight_g_idx']}: activation-ordered groups (actorder 'group') are not supported"
        )
    for t in ("weight_scale", "weight_shape"):
        _expect(names[t] in reader, names[t], f"missing (needed with {names['weight_packed']})")

    shape = reader.get(names["weight_shape"])
    _expect(
        shape.shape == (2,) and np.issubdtype(shape.dtype, np.integer),
        names["weight_shape"],
        f"expected 2 integers [N, K], got {shape.dtype} {shape.shape}",
    )
    n, k = (int(v) for v in shape)
    _expect(n > 0 and k > 0, names["weight_shape"], f"non-positive shape {[n, k]}")

    packed = reader.get(names["weight_packed"])
    _expect(packed.dtype == np.int32, names["weight_packed"], f"dtype {packed.dtype}, expected int32")
    _expect(
        packed.shape == (n, math.ceil(k / 8)),
        names["weight_packed"],
        f"shape {packed.shape}, expected {(n, math.ceil(k / 8))} for weight_shape {[n, k]} at 4 bits",
    )

    scale = reader.get(names["weight_scale"])
    _expect(
        scale.ndim == 2 and scale.shape[0] == n,
        names["weight_scale"],
        f"shape {scale.shape}, expected [{n}, K/group_size] for weight_shape {[n, k]}",
    )
    _expect(
        np.issubdtype(scale.dtype, np.floating) or scale.dtype == ml_dtypes.bfloat16,
        names["weight_scale"],
        f"dtype {scale.dtype}, expected a float type",
    )
    has_zero = names["weight_zero_point"] in reader

    # Pick the first config scheme that fits (symmetry from the zero point's presence, G from the scale's shape).
    candidates = [s for s in qcfg.schemes if s.symmetric != has_zero]
    if not candidates:
        if has_zero:
            raise ValueError(
                f"{names['weight_zero_point']}: present (asymmetric) but every config group is symmetric"
            )
        raise ValueError(f"{names['weight_zero_point']}: missing, but every config group is asymmetric")
    sizes = [k if s.group_size is None else s.group_size for s in candidates]
    if all(k % g for g in sizes):
        raise ValueError(
            f"{names['weight_shape']}: K={k} is not a multiple of the group size "
            f"({' or '.join(map(str, sizes))})"
        )
    fits = [g for g in sizes if k % g == 0 and scale.shape == (n, k // g)]
    if not fits:
        expected = " or ".join(str((n, k // g)) for g in sizes if k % g == 0)
        raise ValueError(
            f"{names['weight_scale']}: shape {scale.shape} fits no config group for weight_shape "
            f"{[n, k]} (expected {expected})"
        )
    group_size = fits[0]
    groups = k // group_size

    zero = None
    if has_zero:
        zp = reader.get(names["weight_zero_point"])
        _expect(zp.dtype == np.int32, names["weight_zero_point"], f"dtype {zp.dtype}, expected int32")
        _expect(
            zp.shape == (math.ceil(n / 8), groups),
            names["weight_zero_point"],
            f"shape {zp.shape}, expected {(math.ceil(n / 8), groups)} (packed along dim 0)",
        )
        zero = jnp.asarray(unpack_int4_np(np.ascontiguousarray(zp.T), n).T)  # [N, K/G] int8

    scale_dtype = jnp.float32 if scale.dtype == np.float64 else scale.dtype
    return Int4Weight(
        packed=jnp.asarray(packed),
        scale=jnp.asarray(scale, dtype=scale_dtype),
        zero=zero,
        in_features=k,
        group_size=group_size,
    )


def load_linear(
    reader: SafetensorsReader | object, module: str, qcfg: CTQuantConfig | None, dtype: jnp.dtype
) -> jax.Array | Int4Weight:
    """Load Linear `module` (e.g. "model.language_model.layers.3.mlp.down_proj") as the model consumes it.

    Decides by the tensors present (docs/formats.md §1.1): `<module>.weight_packed` -> Int4Weight [out, in] (scale in
    the checkpoint's dtype, see `load_int4`); `<module>.weight` -> dense jax array transposed to [in, out] in
    `dtype`. Biases are not handled (Gemma has none).

    Args:
      reader: a SafetensorsReader, or one open `safe_open(path, framework="numpy")` handle holding the module.
      module: the module name (tensor names without the `.weight...` suffix).
      qcfg: `parse_quantization_config(config)`; None is fine for dense modules.
      dtype: the dtype of dense weights (Int4Weight scales keep the checkpoint's dtype).

    Raises:
      ValueError: both or neither of the two tensors exist, a dense weight is not 2-D, or anything `load_int4`
        rejects (naming the tensor).
      UnsupportedQuantizationError: see `load_int4`.
    """
    reader = as_reader(reader)
    packed_name, dense_name = f"{module}.weight_packed", f"{module}.weight"
    has_packed, has_dense = packed_name in reader, dense_name in reader
    if has_packed and has_dense:
        raise ValueError(f"module {module} has both {packed_name} and {dense_name}")
    if has_packed:
        return load_int4(reader, module, qcfg)
    if not has_dense:
        raise ValueError(f"module {module}: neither {dense_name} nor {packed_name} is in the checkpoint")
    w = reader.get(dense_name)
    _expect(w.ndim == 2, dense_name, f"expected a 2-D [out, in] weight, got shape {w.shape}")
    return jnp.asarray(np.ascontiguousarray(w.T)).astype(dtype)
