"""Block-int8 products on CPU: int8 activations times int8 weights in blocks of 32, with exact int32 block sums.

    y[m, n] = fixed_order_sum_b( float(isum[m, n, b]) * (xs[m, b] * ws[n, b]) )
    isum[m, n, b] = sum_{i < 32} xq[m, 32 b + i] * wq[n, 32 b + i]

Activations are quantized per block of 32 as llama.cpp's `Q8_0` does (scale = max|x| / 127, values rounded to
[-127, 127]; `quantize_blocks`, in JAX before any call); weights are int8 blocks of 32 with one float32 scale each
(GGUF `Q8_0` as stored). Integer sums are exact, so a row's result cannot depend on the rows computed with it, on
SIMD lanes or on threads: batch invariance by construction, on any backend. The float epilogue has one fixed order
(each block's term, then `layers.fixed_order_sum`'s tree over the blocks).

Two implementations give the same bits:
- `q8_matmul_twin`: pure JAX (an int8 x int8 -> int32 `dot_general` batched over blocks, then the epilogue). It is
  what TPU/GPU programs contain, the fallback without a C++ compiler, and the tests' reference.
- the CPU kernel `model_worker/kernels/q8_matmul.cc`, called through `jax.ffi.ffi_call`: compiled on first use with
  the system C++ compiler against `jax.ffi.include_dir()` into the serving cache (`<cache>/kernels/`), keyed by a
  hash of the source, the jaxlib version and the compiler, with run-time dispatch on the CPU's features (AVX-512
  VNNI, AVX2, scalar; no `-march=native` baked in). No compiler or a failed build: one warning and the twin.

Environment: `GEMMA_SERVE_Q8_KERNEL=off` uses the twin on CPU too (what a machine without a compiler runs);
`GEMMA_SERVE_Q8_PATH=scalar|avx2|vnni` forces a kernel path (a path the CPU lacks falls back to the best it has).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
from jax import lax

from common.preparation import default_cache_dir
from model_worker.layers import fixed_order_sum

log = logging.getLogger(__name__)

BLOCK = 32
SOURCE = pathlib.Path(__file__).parent / "kernels" / "q8_matmul.cc"
TARGET = "gemma_q8_matmul"
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


def q8_matmul_twin(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array) -> jax.Array:
    """The pure-JAX block-int8 product: xq int8 [M, K], xs float32 [M, K/32], wq int8 [N, K], ws float32
    [N, K/32] -> float32 [M, N] (the formula in the module docstring; same bits as the CPU kernel)."""
    m, k = xq.shape
    n, nb = wq.shape[0], k // BLOCK
    isum = lax.dot_general(xq.reshape(m, nb, BLOCK), wq.reshape(n, nb, BLOCK), (((2,), (2,)), ((1,), (1,))),
                           preferred_element_type=jnp.int32)  # [nb, M, N]
    # XLA fuses these products into the sums, where LLVM contracts a product and an add into one fused
    # multiply-add (one rounding instead of two) in some loops and not others. Multiplying each term by a 1.0 the
    # compilers cannot see is 1.0 (exact: x * 1 = x) leaves every product rounded on its own first, as the
    # kernel does: a contracted fma(term, 1, other) rounds once, to the same sum.
    one = xs[:1, :1].T[:, :, None] * 0.0 + 1.0  # 1.0 for any finite scale; [1, 1, 1]
    scales = xs.T[:, :, None] * ws.T[:, None, :]  # [nb, M, N]
    terms = (isum.astype(jnp.float32) * scales) * one
    return fixed_order_sum(jnp.moveaxis(terms, 0, -1))


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


def _build(cache: pathlib.Path) -> pathlib.Path | None:
    """Compile the kernel into `cache` (once per key); its path, or None (with one warning) when it cannot be."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        log.warning("q8 kernel: no C++ compiler found; block-int8 products run the pure-JAX twin")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + jaxlib.__version__.encode() + compiler.encode() + _cpu_flags().encode()).hexdigest()
    lib = cache / f"q8_matmul-{key[:16]}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = pathlib.Path(tmp) / lib.name
        cmd = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-w",
               f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            log.warning("q8 kernel: build failed (%s); block-int8 products run the pure-JAX twin",
                        detail.strip().splitlines()[-1] if detail.strip() else e)
            return None
        os.replace(out, lib)  # atomic: a concurrent builder of the same key wrote the same bytes
    return lib


@functools.cache
def kernel_available() -> bool:
    """Whether the CPU kernel is built and registered with XLA (built on the first call; False with
    `GEMMA_SERVE_Q8_KERNEL=off`, without a compiler or after a failed build)."""
    if os.environ.get("GEMMA_SERVE_Q8_KERNEL", "").lower() in ("off", "0", "false"):
        return False
    lib = _build(default_cache_dir() / "kernels")
    if lib is None:
        return False
    try:
        dll = ctypes.cdll.LoadLibrary(str(lib))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(dll.GemmaQ8Matmul), platform="cpu")
    except (OSError, AttributeError, RuntimeError) as e:
        log.warning("q8 kernel: could not load %s (%s); block-int8 products run the pure-JAX twin", lib, e)
        return False
    return True


def kernel_path() -> int:
    """The kernel path asked for by `GEMMA_SERVE_Q8_PATH` (0 = the best the CPU has).

    Raises:
      ValueError: an unknown path name.
    """
    name = os.environ.get("GEMMA_SERVE_Q8_PATH", "auto").lower()
    if name not in PATHS:
        raise ValueError(f"GEMMA_SERVE_Q8_PATH={name!r}: expected one of {', '.join(PATHS)}")
    return PATHS[name]


def q8_matmul_kernel(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array, path: int = 0) -> jax.Array:
    """The CPU kernel through `jax.ffi.ffi_call` (needs `kernel_available()`); arguments as `q8_matmul_twin`."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((xq.shape[0], wq.shape[0]), jnp.float32))
    return call(xq, xs.astype(jnp.float32), wq, ws.astype(jnp.float32), path=path)


def q8_matmul(xq: jax.Array, xs: jax.Array, wq: jax.Array, ws: jax.Array) -> jax.Array:
    """The block-int8 product: the CPU kernel where a program runs on CPU and the kernel is available, the twin
    elsewhere (`lax.platform_dependent`, so programs lowered for TPU/GPU contain no custom call)."""
    if not kernel_available():
        return q8_matmul_twin(xq, xs, wq, ws)
    path = kernel_path()
    return lax.platform_dependent(xq, xs, wq, ws, cpu=functools.partial(q8_matmul_kernel, path=path),
                                  default=q8_matmul_twin)
