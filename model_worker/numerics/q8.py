"""Block-int8 products on CPU: int8 activations times int8 weights in blocks of 32, with exact int32 block sums.

    y[m, n] = fixed_order_sum_b( float(isum[m, n, b]) * (xs[m, b] * ws[n, b]) )
    isum[m, n, b] = sum_{i < 32} xq[m, 32 b + i] * wq[n, 32 b + i]

Activations are quantized per block of 32 as llama.cpp's `Q8_0` does (scale = max|x| / 127, values rounded to
[-127, 127]; `quantize_blocks`, in JAX before any call); weights are int8 blocks of 32 with one float16 scale each
(GGUF `Q8_0` as stored; converted to float32 exactly where used, so it only halves the scales' bytes: 5% of a
decode step's reads), held in tiles of 16 rows for the kernel (`tile_weight`). Integer sums are exact, so a
row's result cannot depend on the rows computed with it, on SIMD lanes or on threads: batch invariance by
construction, on any backend. The float epilogue has one fixed order (each block's term, then
`fixed_order.fixed_order_sum`'s tree over the blocks).

Two implementations give the same bits:
- `q8_matmul_twin`: pure JAX (an int8 x int8 -> int32 `dot_general` batched over blocks, then the epilogue). It is
  what TPU/GPU programs contain, the fallback without a C++ compiler, and the tests' reference.
- the CPU kernel `model_worker/numerics/kernels/q8_matmul.cc`, called through `jax.ffi.ffi_call`: compiled on first use with
  the system C++ compiler against `jax.ffi.include_dir()` into the serving cache (`<cache>/kernels/`), keyed by a
  hash of the source, the jaxlib version and the compiler, with run-time dispatch on the CPU's features (AVX-512
  VNNI, AVX2, scalar; no `-march=native` baked in). No compiler or a failed build: one warning and the twin.

Weights whose integers all lie in [-16, 15] (GGUF `Q5_0`'s, w = d * (u - 16) with u a 5-bit integer) are held
in 5-bit tiles where the kernel runs on AVX-512 VNNI (`tile_weight5`: 20 bytes per 32 weights instead of 32, the
GGUF's own 5 bits and float16 scale: 22 bytes per 32 as llama.cpp reads them); the block sums are the same
integers, so the results are the same bits as from their int8 tiles and from the twin.

Environment: `GEMMA_SERVE_Q8_KERNEL=off` uses the twin on CPU too (what a machine without a compiler runs);
`GEMMA_SERVE_Q8_PATH=scalar|avx2|vnni` forces a kernel path (a path the CPU lacks falls back to the best it has).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import lax

from common.preparation import default_cache_dir
from model_worker.numerics.fixed_order import fixed_order_sum

log = logging.getLogger(__name__)

BLOCK = 32
TILE = 16  # weight rows per kernel tile (kernels/q8_matmul.cc)
TWIN_BLOCK_BYTES = 32 << 20  # the twin's temporaries per block of weight rows (`q8_matmul_twin`)
KERNELS = pathlib.Path(__file__).parent / "kernels"
SOURCE = KERNELS / "q8_matmul.cc"
TARGET_ATTENTION = "gemma_block_attention"  # `block_attention`'s kernel, built into the same library
TARGET = "gemma_q8_matmul"
TARGET5 = "gemma_q5_matmul"  # the same product on 5-bit tiles (`tile_weight5`)
TILE_BLOCK5 = 320  # bytes of a 5-bit tile's block of 32 columns: 256 of nibbles + 64 of fifth bits
PATHS = {"auto": 0, "scalar": 1, "avx2": 2, "vnni": 3}


def quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations [M, K] (float) -> (xq int8 [M, K] in [-127, 127], xs float32 [M, K/32]): per block of 32,
    scale = max|x| / 127 and xq = round(x / scale) (0 for an all-zero block), as llama.cpp's `quantize_row_q8_0`.

    Raises:
      ValueError: K is not a multiple of 32.
    """
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"quantize_blocks: K={k} is not a multiple of {BLOCK}")
    xb = x.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
    scale = jnp.max(jnp.abs(xb), axis=-1) / 127.0
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    q = jnp.clip(jnp.round(xb * inv[..., None]), -127, 127).astype(jnp.int8)
    return q.reshape(m, k), scale


def q8_matmul_twin(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array,
                   block_bytes: int = TWIN_BLOCK_BYTES) -> jax.Array:
    """The pure-JAX block-int8 product: xq int8 [M, K], xs float32 [M, K/32], wq int8 [N, K], ws float16 (or
    float32) [N, K/32] -> float32 [M, N] (the formula in the module docstring; same bits as the CPU kernel).

    Its [K/32, M, N] int32 sums and float32 terms are materialized, so the weight rows are taken in blocks under
    `lax.map` whose temporaries stay near `block_bytes` (the 262144-row LM head at 64 rows would need ~11 GB at
    once); every output is computed the same way in any block, so the blocks change no bit.
    """
    m, k = xq.shape
    n, nb = wq.shape[0], k // BLOCK
    rows = max(TILE, block_bytes // (8 * max(m, 1) * max(nb, 1)) // TILE * TILE)
    if n <= rows:
        return _twin_block(xq, xs, wq, ws)
    blocks = -(-n // rows)
    pad = blocks * rows - n
    wb = jnp.pad(wq, ((0, pad), (0, 0))).reshape(blocks, rows, k)
    sb = jnp.pad(ws, ((0, pad), (0, 0))).reshape(blocks, rows, nb)
    ys = lax.map(lambda w: _twin_block(xq, xs, *w), (wb, sb))  # [blocks, M, rows]
    return jnp.moveaxis(ys, 0, 1).reshape(m, blocks * rows)[:, :n]


def _twin_block(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array) -> jax.Array:
    """`q8_matmul_twin` on one block of weight rows, all at once."""
    m, k = xq.shape
    n, nb = wq.shape[0], k // BLOCK
    isum = lax.dot_general(xq.reshape(m, nb, BLOCK), wq.reshape(n, nb, BLOCK), (((2,), (2,)), ((1,), (1,))),
                           preferred_element_type=jnp.int32)  # [nb, M, N]
    # XLA fuses these products into the sums, where LLVM contracts a product and an add into one fused
    # multiply-add (one rounding instead of two) in some loops and not others. Multiplying each term by a 1.0 the
    # compilers cannot see is 1.0 (exact: x * 1 = x) leaves every product rounded on its own first, as the
    # kernel does: a contracted fma(term, 1, other) rounds once, to the same sum.
    one = xq[:1, :1].astype(jnp.float32).T[:, :, None] * 0.0 + 1.0  # 1.0 (int8 is finite), from row 0; [1, 1, 1]
    scales = xs.T[:, :, None] * ws.astype(jnp.float32).T[:, None, :]  # [nb, M, N]; float16 -> float32 is exact
    terms = (isum.astype(jnp.float32) * scales) * one
    return fixed_order_sum(jnp.moveaxis(terms, 0, -1))


def float16_exact(ws) -> bool:
    """Whether every block scale in `ws` (any float dtype) is a float16 value, so storing it as float16 changes
    nothing (GGUF Q8_0 and Q5_0 scales are)."""
    ws = np.asarray(ws)
    return ws.dtype == np.float16 or np.array_equal(ws.astype(np.float16).astype(np.float32), ws.astype(np.float32),
                                                    equal_nan=True)


def _float16_scales(ws) -> np.ndarray:
    """Block scales as float16 (numpy), refusing any value float16 cannot hold exactly (a silent rounding would
    change the weights).

    Raises:
      ValueError: a scale that is not a float16 value.
    """
    if not float16_exact(ws):
        raise ValueError("Q8 scales must be float16 values (GGUF Q8_0's are; requantize with q8_from_values)")
    return np.asarray(ws).astype(np.float16)


def tile_weight(wq, ws) -> tuple[np.ndarray, np.ndarray]:
    """Weights in rows (int8 [N, K], float16 [N, K/32]) -> the kernel's tiles of 16 rows: (int8 [N/16, 16 K],
    float16 [N/16, K/2]), wt[t, 512 b + 64 i + 4 r + j] = wq[16 t + r, 32 b + 4 i + j] and st[t, 16 b + r] =
    ws[16 t + r, b] (one 64-byte load holds 4 values of each of 16 rows; see the kernel's header).

    Raises:
      ValueError: N is not a multiple of 16 or K of 32, or the scales do not fit or are not float16 values.
    """
    wq, ws = np.asarray(wq), _float16_scales(ws)
    n, k = wq.shape
    if n % TILE or k % BLOCK or ws.shape != (n, k // BLOCK):
        raise ValueError(f"tile_weight: need N % 16 == 0, K % 32 == 0 and scales [N, K/32]; got {wq.shape}, "
                         f"{ws.shape}")
    t, nb = n // TILE, k // BLOCK
    wt = wq.reshape(t, TILE, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(t, nb * BLOCK * TILE)
    st = ws.reshape(t, TILE, nb).transpose(0, 2, 1).reshape(t, nb * TILE)
    return np.ascontiguousarray(wt), np.ascontiguousarray(st)


def tile_weight5(wq, ws) -> tuple[np.ndarray, np.ndarray]:
    """Weights in rows whose integers lie in [-16, 15] (int8 [N, K], float16 [N, K/32]) -> 5-bit tiles (uint8
    [N/16, 10 K], float16 [N/16, K/2] as `tile_weight`). With u = wq + 16 in [0, 32) and wt8 = `tile_weight`'s
    int8 tile, each tile's block b is 320 bytes: byte 64 p + l (p < 4, l < 64) holds u of wt8[t, 512 b + 64 p + l]
    in its low nibble and u of wt8[t, 512 b + 64 (p + 4) + l] in its high nibble, and bit l of the little-endian
    64-bit word at 256 + 8 i is u's fifth bit for wt8[t, 512 b + 64 i + l] (the kernel's header has the why).

    Raises:
      ValueError: an integer outside [-16, 15], or what `tile_weight` refuses.
    """
    wq = np.asarray(wq)
    if wq.size and (wq.min() < -16 or wq.max() > 15):
        raise ValueError("tile_weight5: 5-bit tiles hold integers in [-16, 15]")
    wt, st = tile_weight(wq, ws)
    t, nb = st.shape[0], st.shape[1] // TILE
    u: np.ndarray = (wt.astype(np.int16) + 16).astype(np.uint8).reshape(t, nb, 8, 64)
    nibbles = (u[:, :, :4] & 0xF) | ((u[:, :, 4:] & 0xF) << 4)  # [t, nb, 4, 64]
    fifth = np.packbits((u >> 4) & 1, axis=-1, bitorder="little")  # [t, nb, 8, 8]
    packed = np.concatenate([nibbles.reshape(t, nb, 256), fifth.reshape(t, nb, 64)], axis=-1)
    return np.ascontiguousarray(packed.reshape(t, nb * TILE_BLOCK5)), st


def expand_weight5(w5: jax.Array) -> jax.Array:
    """Inverse of `tile_weight5`'s packing, in JAX: uint8 [N/16, 10 K] -> the int8 tiles [N/16, 16 K] of
    `tile_weight` (values u - 16)."""
    t, nb = w5.shape[0], w5.shape[1] // TILE_BLOCK5
    blocks = w5.reshape(t, nb, TILE_BLOCK5)
    nibbles = blocks[..., :256].reshape(t, nb, 4, 64)
    low4 = jnp.concatenate([nibbles & 0xF, nibbles >> 4], axis=2)  # [t, nb, 8, 64]
    bits = blocks[..., 256:].reshape(t, nb, 8, 8, 1) >> jnp.arange(8, dtype=jnp.uint8)
    fifth = (bits & 1).reshape(t, nb, 8, 64)
    u = low4 | (fifth << 4)
    return (u.astype(jnp.int8) - 16).reshape(t, nb * BLOCK * TILE)


def untile_weight(wt: jax.Array, st: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of `tile_weight`, in JAX: (int8 [N/16, 16 K], float16 [N/16, K/2]) -> (int8 [N, K], float16
    [N, K/32])."""
    t, nb = st.shape[0], st.shape[1] // TILE
    wq = wt.reshape(t, nb, 8, TILE, 4).transpose(0, 3, 1, 2, 4).reshape(t * TILE, nb * BLOCK)
    return wq, st.reshape(t, nb, TILE).transpose(0, 2, 1).reshape(t * TILE, nb)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Q8Weight:
    """A projection as symmetric int8 blocks of 32 along its input axis, one float16 scale per block (GGUF `Q8_0`
    values): W[n, k] = q[n, k] * s[n, k // 32], multiplied with Q8_0 activations by `q8_linear`.

    Attributes:
      q: int8, [N/16, 16 K] in the kernel's tiles when `tiled` (see `tile_weight`), else [N, K]; with `bits` 5,
        uint8 [N/16, 10 K] (`tile_weight5`).
      scale: float16, [N/16, K/2] when `tiled`, else [N, K/32].
      tiled: static; the CPU kernel's layout (made where the kernel is available; the twin reads either).
      bits: static; 8, or 5 for 5-bit tiles (integers in [-16, 15]; always tiled).

    Raises (`q8_weight`): ValueError for a weight value of -128.
    """

    q: jax.Array
    scale: jax.Array
    tiled: bool = dataclasses.field(default=False, metadata={"static": True})
    bits: int = dataclasses.field(default=8, metadata={"static": True})

    def __post_init__(self):
        if self.bits not in (5, 8) or (self.bits == 5 and not self.tiled):
            raise ValueError(f"Q8Weight: bits={self.bits}, tiled={self.tiled}: 8, or 5 in tiles")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), the shape of the dense weight."""
        if self.bits == 5:
            return self.q.shape[0] * TILE, self.q.shape[1] * BLOCK // TILE_BLOCK5
        if self.tiled:
            return self.q.shape[0] * TILE, self.q.shape[1] // TILE
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        """Resident bytes: N K int8 (5/8 of that in 5-bit tiles) + N K / 32 float16 scales."""
        return int(self.q.nbytes + self.scale.nbytes)

    def rows(self) -> tuple[jax.Array, jax.Array]:
        """(int8 [N, K], float16 [N, K/32]) in row layout (a transpose when tiled, an expansion of 5-bit tiles)."""
        if self.bits == 5:
            return untile_weight(expand_weight5(self.q), self.scale)
        return untile_weight(self.q, self.scale) if self.tiled else (self.q, self.scale)

    def dense(self) -> jax.Array:
        """The float32 values [N, K] (q * s, exact): for tests."""
        q, s = self.rows()
        n, k = q.shape
        return (q.reshape(n, k // BLOCK, BLOCK).astype(jnp.float32) * s.astype(jnp.float32)[..., None]).reshape(n, k)


def q8_weight(wq, ws, tile: bool | None = None, bits: int | None = None) -> Q8Weight:
    """A Q8Weight (arrays on the default device) from rows (int8 [N, K] in [-127, 127], scales [N, K/32] whose
    values are float16 values, in any float dtype); tiled for the kernel when `tile` (default: where the kernel is
    available and N is a multiple of 16), in 5-bit tiles when `bits` is 5 (default: when tiled, every integer is
    in [-16, 15] and the kernel's best path reads 5-bit tiles in registers, `five_bit_pays`).

    Raises:
      ValueError: a weight of -128, a scale that float16 cannot hold exactly (`q8_from_values` makes them), or
        5-bit tiles asked for integers outside [-16, 15] or untiled.
    """
    wq, ws = np.asarray(wq, np.int8), _float16_scales(ws)
    if wq.size and wq.min() == -128:
        raise ValueError("q8_weight: int8 weights must be in [-127, 127] (the AVX2 path negates them)")
    if tile is None:
        tile = kernel_available() and wq.shape[0] % TILE == 0
    if bits is None:
        bits = 5 if tile and five_bit_pays() and (wq.size == 0 or (wq.min() >= -16 and wq.max() <= 15)) else 8
    if bits not in (5, 8) or (bits == 5 and not tile):
        raise ValueError(f"q8_weight: bits={bits}, tile={tile}: 8, or 5 in tiles (tiles need the kernel, or "
                         "tile=True)")
    if bits == 5:
        w5, s5 = tile_weight5(wq, ws)
        return Q8Weight(jnp.asarray(w5), jnp.asarray(s5), tiled=True, bits=5)
    if tile:
        wq, ws = tile_weight(wq, ws)
    return Q8Weight(jnp.asarray(wq), jnp.asarray(ws), tiled=bool(tile))


def q8_from_values(w, group_size: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Float weights [N, K] -> Q8_0 blocks (int8 [N, K] in [-127, 127], float16 [N, K/32]): per block of 32,
    scale = max|w| / 127 rounded to float16, as llama.cpp's `quantize_row_q8_0` stores it, and q = round(w / scale)
    with that stored scale (llama.cpp divides by the unrounded one), clipped to [-127, 127] where rounding the
    scale down pushed a value past it. Numpy, at preparation (no device memory).

    Raises:
      ValueError: K is not a multiple of 32, or a block's scale is beyond float16's range.
    """
    w = np.asarray(w, np.float32)
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"q8_from_values: K={k} is not a multiple of {BLOCK}")
    wb = w.reshape(n, k // BLOCK, BLOCK)
    with np.errstate(over="ignore"):
        scale16 = (np.abs(wb).max(axis=-1) / np.float32(127)).astype(np.float16)
    if not np.isfinite(scale16).all():
        raise ValueError("q8_from_values: a block's scale is beyond float16's range (|w| > 8.3e6)")
    scale = scale16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] > 0, np.rint(wb * (np.float32(1) / scale)[..., None]), 0)
    return np.clip(q, -127, 127).astype(np.int8).reshape(n, k), scale16


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), part of the build key: a cache shared between machines keeps one build per
    kind of CPU even though the build itself bakes none of them in."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def compiler() -> str | None:
    """The C++ compiler the kernel is built with: `$CXX`, else `c++` or `g++` on the PATH; None without one."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _units() -> list[tuple[pathlib.Path, list[str]]]:
    """The library's translation units and their own flags: the block-int8 product, the block attention's
    handler, and its vector code once per instruction set (x86-64: baseline, AVX2, AVX-512; chosen at run time)."""
    simd = KERNELS / "block_attention_simd.cc"
    units = [(SOURCE, []), (KERNELS / "block_attention.cc", []), (simd, ["-DATTN_NS=attn_base"])]
    if platform.machine().lower() in ("x86_64", "amd64"):
        units += [(simd, ["-DATTN_NS=attn_avx2", "-mavx2"]), (simd, ["-DATTN_NS=attn_avx512", "-mavx512f"])]
    return units


def _build(cache: pathlib.Path, units: list[tuple[pathlib.Path, list[str]]] | None = None,
           fallback: str = "block-int8 products and block attention run the pure-JAX twins") -> pathlib.Path | None:
    """Compile `units` (default `_units()`) into one library in `cache` (once per key); its path, or None (with
    one warning, ending with `fallback`) when it cannot be."""
    cxx = compiler()
    if cxx is None:
        log.warning("q8 kernel: no C++ compiler found; %s", fallback)
        return None
    units = _units() if units is None else units
    sources = b"".join(path.read_bytes() + " ".join(flags).encode() for path, flags in units)
    sources += (KERNELS / "block_attention.h").read_bytes()
    key = hashlib.sha256(sources + jaxlib.__version__.encode() + cxx.encode() + _cpu_flags().encode()).hexdigest()
    lib = cache / f"gemma_kernels-{key[:16]}.so"
    if lib.exists():
        return lib
    common = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-w",
              f"-I{jax.ffi.include_dir()}"]
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            objects = [str(pathlib.Path(tmp) / f"{i}.o") for i in range(len(units))]
            # The units compile at once (a new machine's build is on the first answer's path: 8.2 s one after
            # another on two cores); each object is the same whichever order they finish in.
            with concurrent.futures.ThreadPoolExecutor(len(units)) as pool:
                for done in [pool.submit(subprocess.run, [cxx, *common, *flags, "-c", str(path), "-o", obj],
                                         check=True, capture_output=True, text=True, timeout=300)
                             for (path, flags), obj in zip(units, objects)]:
                    done.result()
            out = pathlib.Path(tmp) / lib.name
            subprocess.run([cxx, "-shared", *objects, "-o", str(out)], check=True, capture_output=True, text=True,
                           timeout=300)
            os.replace(out, lib)  # atomic: a concurrent builder of the same key wrote the same bytes
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("q8 kernel: build failed (%s); %s", detail.strip().splitlines()[-1] if detail.strip() else e,
                    fallback)
        return None
    return lib


_KERNEL_LOCK = threading.Lock()  # one build and one registration, whichever thread asks first


def kernel_available() -> bool:
    """Whether the CPU kernel is built and registered with XLA (built on the first call; False with
    `GEMMA_SERVE_Q8_KERNEL=off`, without a compiler or after a failed build). Safe from any thread: the worker
    builds it on a thread of its own while the model files are prepared (a new machine's build takes seconds)."""
    with _KERNEL_LOCK:
        return _kernel_available()



@functools.cache
def _kernel_available() -> bool:
    if os.environ.get("GEMMA_SERVE_Q8_KERNEL", "").lower() in ("off", "0", "false"):
        return False
    cache = default_cache_dir() / "kernels"
    lib = _build(cache, fallback="building the block-int8 product alone; block attention runs the pure-JAX twin")
    _ATTENTION[0] = lib is not None
    if lib is None:  # the block-int8 product alone (a compiler that cannot build the attention's vector code)
        lib = _build(cache, [(SOURCE, [])])
    if lib is None:
        return False
    try:
        dll = ctypes.cdll.LoadLibrary(str(lib))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(dll.GemmaQ8Matmul), platform="cpu")
        jax.ffi.register_ffi_target(TARGET5, jax.ffi.pycapsule(dll.GemmaQ5Matmul), platform="cpu")
        if _ATTENTION[0]:
            jax.ffi.register_ffi_target(TARGET_ATTENTION, jax.ffi.pycapsule(dll.GemmaBlockAttention), platform="cpu")
        _CPU_PATH[0] = int(dll.gemma_q8_cpu_path())
    except (OSError, AttributeError, RuntimeError) as e:
        log.warning("q8 kernel: could not load %s (%s); block-int8 products run the pure-JAX twin", lib, e)
        return False
    return True


_CPU_PATH = [0]  # the best kernel path this CPU has (PATHS), set when the kernel loads
_ATTENTION = [False]  # whether the loaded library has the block attention (`attention_kernel_available`)


def attention_kernel_available() -> bool:
    """Whether the block attention's CPU kernel is built and registered (with the block-int8 product's library;
    a compiler that builds the product but not the attention's vector code leaves the attention to its twin)."""
    return kernel_available() and _ATTENTION[0]


def five_bit_pays() -> bool:
    """Whether weights that fit 5 bits are worth 5-bit tiles: the kernel is available and its best path is AVX-512
    VNNI, which expands them in registers (on a decode step at one row, reading 5/8 of the bytes made the Q5_0
    projections' products ~20% faster: docs/performance.md). The scalar and AVX2 paths expand a tile to int8
    before using it, so there int8 tiles stay the format (`GEMMA_SERVE_Q8_PATH` does not change the choice: a
    path forced on a VNNI CPU reads the 5-bit tiles too, expanding them, so its timings are not those of a CPU
    that has only that path)."""
    return kernel_available() and _CPU_PATH[0] == PATHS["vnni"]


def kernel_path() -> int:
    """The kernel path asked for by `GEMMA_SERVE_Q8_PATH` (0 = the best the CPU has).

    Raises:
      ValueError: an unknown path name.
    """
    name = os.environ.get("GEMMA_SERVE_Q8_PATH", "auto").lower()
    if name not in PATHS:
        raise ValueError(f"GEMMA_SERVE_Q8_PATH={name!r}: expected one of {', '.join(PATHS)}")
    return PATHS[name]


def q8_matmul_kernel(xq: jax.Array, xs: jax.Array, wt: jax.Array, st: jax.Array, path: int = 0) -> jax.Array:
    """The CPU kernel through `jax.ffi.ffi_call` (needs `kernel_available()`): xq int8 [M, K], xs float32
    [M, K/32], weights in tiles (`tile_weight`: int8 [N/16, 16 K], or `tile_weight5`: uint8 [N/16, 10 K]; float16
    scales [N/16, K/2]) -> float32 [M, N]."""
    target = TARGET5 if wt.dtype == jnp.uint8 else TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((xq.shape[0], wt.shape[0] * TILE), jnp.float32))
    return call(xq, xs.astype(jnp.float32), wt, st.astype(jnp.float16), path=path)


def q8_matmul(xq: jax.Array, xs: jax.Array, w: Q8Weight) -> jax.Array:
    """The block-int8 product xq [M, K] (scales xs [M, K/32]) times a Q8Weight [N, K] -> float32 [M, N]: the CPU
    kernel where a program runs on CPU, the weight is tiled and the kernel is available, the twin elsewhere
    (`lax.platform_dependent`, so programs lowered for TPU/GPU contain no custom call)."""
    twin = lambda xq, xs, q, s: q8_matmul_twin(xq, xs, *Q8Weight(q, s, tiled=w.tiled, bits=w.bits).rows())
    if not (w.tiled and kernel_available()):
        return twin(xq, xs, w.q, w.scale)
    path = kernel_path()
    return lax.platform_dependent(xq, xs, w.q, w.scale, cpu=functools.partial(q8_matmul_kernel, path=path),
                                  default=twin)


def q8_linear(x: jax.Array, w: Q8Weight, out_dtype=None) -> jax.Array:
    """y = x Wᵀ with x quantized to Q8_0 blocks (`quantize_blocks`) and W a Q8Weight [N, K]: [..., K] -> [..., N]
    in `out_dtype` (default x's). A row's result depends on that row alone (integer block sums), whatever the
    rows beside it.

    Raises:
      ValueError: x's last axis is not K, or K is not a multiple of 32.
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"q8_linear: x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    xq, xs = quantize_blocks(x.reshape(-1, k))
    return q8_matmul(xq, xs, w).astype(out_dtype or x.dtype).reshape(*lead, n)
