"""A disk cache of the engine's compiled programs, so that a restarted worker skips tracing and lowering.

JAX's persistent compilation cache (`engine.enable_compilation_cache`) saves only XLA's compile: its key is the
lowered module, so every start still traces and lowers each program, which costs seconds per program (the mixed
programs are the dearest) and made a worker restart after a crash take tens of seconds (figures:
docs/performance.md, "Executable cache"). This cache stores each compiled program whole, serialized with
`jax.experimental.serialize_executable`, under a fingerprint of everything the program is a function of:

  * the program's key, the model and engine configurations (`repr` of the frozen dataclasses);
  * the abstract arguments: the pytree structures (static fields included) and each leaf's shape, dtype and
    sharding, for the engine state and the example inputs;
  * the code that builds programs: a digest of the code of `model_worker.engine.programs`, `model_worker.engine.engine`
    and every repository module they import, transitively (their syntax trees without docstrings: a comment, a
    docstring or a line's layout changes no program, so editing one keeps every stored program);
  * the toolchain: jax and jaxlib versions, backend, platform version and device kinds (on CPU the host's
    instruction-set flags), `XLA_FLAGS` /
    `LIBTPU_INIT_ARGS`, and every `jax.config` value but the compilation caches' own settings.

Any change to one of these misses the cache (the program is then compiled and stored again), so a stale entry is
never loaded. A program that JAX's own persistent cache served is not stored: on XLA CPU (jaxlib 0.10) such an
executable serializes without its object code, and loading it fails at its first run ("Function ... not found");
the worker therefore turns JAX's cache off and relies on this one. An entry that fails to load (truncated,
another jaxlib) is treated as a miss and replaced. Writes go through a temporary file and a rename: a crash
mid-write leaves no partial entry, and two workers storing the same program at once both leave a whole one.

Trust: loading a serialized executable can run arbitrary code (the JAX documentation says so), exactly like
JAX's own compilation cache; the directory must be writable only by the worker's user (the default cache
directory is the user's own; the container images give /cache to their unprivileged user alone).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import hashlib
import logging
import os
import pathlib
import pickle
import re
import tempfile
import threading
from collections.abc import Callable, Sequence

import jax

log = logging.getLogger(__name__)
_REPO = pathlib.Path(__file__).resolve().parents[2]
_CACHE_SETTING = re.compile(r"compilation_cache|persistent_cache")
_HITS = threading.local()  # per thread: programs JAX's persistent compilation cache served (`_count_hits`)


def _count_hits(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _HITS.n = getattr(_HITS, "n", 0) + 1


jax.monitoring.register_event_listener(_count_hits)


#: The modules whose code becomes the engine's programs: these and every repository module they import.
_PROGRAM_ROOTS = ("model_worker.engine.programs", "model_worker.engine.engine")


def _module_file(name: str) -> pathlib.Path | None:
    """The source file of repository module `name` (a package's __init__.py), or None outside the repository."""
    base = _REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(tree: ast.Module) -> set[str]:
    """The absolute module names a module's syntax tree imports (`import a.b`, `from a.b import c`: a.b and
    a.b.c)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


_DIGEST_LOCK = threading.Lock()


def code_of(source: str) -> str:
    """A module's code as one string: its syntax tree (`ast.dump`, no line numbers) without docstrings (a string
    constant opening a module, class or function body). Comments and layout are not in a tree, so editing them, or
    a docstring, leaves it unchanged; any change to what the code does changes it."""
    return _code_of_tree(ast.parse(source))


def _code_of_tree(tree: ast.Module) -> str:
    """`code_of` of a parsed module; strips the docstrings from `tree` itself (no copy: the digest parses each
    module once, reads its imports, then this)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _source_digest() -> str:
    """sha256 over the code (`code_of`) of the program modules and every repository module they import,
    transitively (name and code, sorted): a change to code that can reach a program misses; the scheduler, the
    servicer and the other host-side modules are not part of it, so editing them keeps the cache. Computed once per process,
    under a lock: `Engine.compile_all`'s threads ask at once, and CPython 3.11's `ast.parse` is not safe to run in
    two threads together (SystemError "AST constructor recursion depth mismatch", seen here)."""
    with _DIGEST_LOCK:
        return _digest_sources()


@functools.cache
def _digest_sources() -> str:
    seen: dict[str, str] = {}
    todo = list(_PROGRAM_ROOTS)
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        tree = ast.parse(path.read_text())
        todo.extend(_imports(tree))
        seen[name] = _code_of_tree(tree)
    h = hashlib.sha256()
    for name in sorted(seen):
        h.update(name.encode() + b"\0" + seen[name].encode() + b"\0")
    return h.hexdigest()


@functools.cache
def _cpu_flags() -> str:
    """This host's instruction-set flags (/proc/cpuinfo; "" where unreadable): XLA CPU compiles for them (AVX-512,
    AMX, ...). Read once per process, not once per program."""
    with contextlib.suppress(OSError):
        return next((line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")), "")
    return ""


def _toolchain() -> str:
    """The jax/jaxlib/backend/flag facts a compiled program depends on, as one string."""
    import jaxlib

    devices = jax.devices()
    cpu_flags = _cpu_flags() if jax.default_backend() == "cpu" else ""
    # Every jax.config value but those of the compilation caches themselves (where they live, when they store),
    # which change no program.
    config = sorted((k, repr(v)) for k, v in jax.config.values.items() if not _CACHE_SETTING.search(k))
    return repr((jax.__version__, jaxlib.__version__, jax.default_backend(), devices[0].client.platform_version,
                 sorted({d.device_kind for d in devices}), len(devices), os.environ.get("XLA_FLAGS", ""),
                 os.environ.get("LIBTPU_INIT_ARGS", ""), config, cpu_flags,
                 # the int8 kernel's forced path is an attribute baked into the programs (model_worker/numerics/q8.py)
                 os.environ.get("GEMMA_SERVE_Q8_PATH", ""), os.environ.get("GEMMA_SERVE_Q8_KERNEL", "")))


def _abstract(tree) -> str:
    """A pytree's structure (static fields included) and each leaf's shape, dtype and sharding, as one string."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return repr((str(treedef), [(getattr(x, "shape", ()), str(getattr(x, "dtype", type(x).__name__)),
                                 repr(getattr(x, "sharding", None))) for x in leaves]))


def fingerprint(key: Sequence, cfg, ecfg, args: Sequence) -> str:
    """The cache key of one program: sha256 hex over its key, the configs, its abstract arguments, the model
    worker's sources and the toolchain (see the module docstring)."""
    h = hashlib.sha256()
    for part in (repr(tuple(key)), repr(cfg), repr(ecfg), _abstract(tuple(args)), _source_digest(), _toolchain()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


#: Default bound of a cache directory: past it, `store` deletes the least recently used entries (stale entries
#: of older code or toolchains accumulate otherwise; the embedded model's programs take a small fraction of it,
#: figures: docs/performance.md, "Executable cache").
MAX_BYTES = 2 << 30


class ExecutableCache:
    """Compiled programs on disk, one file per fingerprint (`<directory>/<fingerprint>.xla`), least recently used
    ones deleted past `max_bytes`.

    Counters `loaded` and `stored` say what a start did (the worker logs them; tests read them). Safe to use from
    several threads at once (`Engine.compile_all` compiles in parallel).
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int = MAX_BYTES):
        """Args: directory: created if missing (its parents too); max_bytes: the bound on its entries' size."""
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.loaded = 0
        self.stored = 0
        self.unstorable = 0  # compiled programs JAX's persistent cache served (not stored: module docstring)
        self._count = threading.Lock()  # the counters, from `Engine.compile_all`'s compiling threads
        self._deferred: collections.deque = collections.deque()  # (fingerprint, compiled) awaiting `store_deferred`

    def get_or_compile(self, fp: str, lower: Callable[[], jax.stages.Lowered],
                       devices: Sequence | None = None, defer: bool = False) -> jax.stages.Compiled:
        """The program stored under `fp`, else `lower()` compiled and stored (unless JAX's persistent cache
        served it: see the module docstring).

        Args:
          fp: the program's `fingerprint`; lower: lowers it (called only on a miss); devices: `load`'s.
          defer: queue the store for `store_deferred` instead of storing now. Why: serializing an executable holds
            the GIL throughout (a compute chunk of the embedded model: 219 ms on the 2-vCPU EPYC; seconds for a
            whole model on a TPU host), which a worker serving while it compiles must not spend between its steps.
        """
        compiled = self.load(fp, devices)
        if compiled is not None:
            return compiled
        hits = getattr(_HITS, "n", 0)
        compiled = lower().compile()
        if getattr(_HITS, "n", 0) != hits:
            with self._count:
                self.unstorable += 1
        elif defer:
            self._deferred.append((fp, compiled))
        else:
            self.store(fp, compiled)
        return compiled

    def store_deferred(self, limit: int | None = 1) -> int:
        """Store up to `limit` (None: all) of the programs whose store was deferred, oldest first. Returns how
        many were stored or failed to (a failure is logged by `store`)."""
        done = 0
        while limit is None or done < limit:
            try:
                fp, compiled = self._deferred.popleft()
            except IndexError:
                break
            self.store(fp, compiled)
            done += 1
        return done

    @property
    def deferred(self) -> int:
        """Programs awaiting `store_deferred`."""
        return len(self._deferred)

    def has(self, fp: str) -> bool:
        """Whether an entry is stored under `fp` (it may still fail to load: `load`)."""
        return self._path(fp).exists()

    def _path(self, fp: str) -> pathlib.Path:
        return self.directory / f"{fp}.xla"

    def load(self, fp: str, devices: Sequence | None = None) -> jax.stages.Compiled | None:
        """The program stored under `fp`, loaded onto `devices` (default: the backend's), or None on a miss or an
        entry that does not load (logged; it is replaced by the next `store`)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(fp)
        if not path.exists():
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = deserialize_and_load(serialized, in_tree, out_tree,
                                            execution_devices=list(devices) if devices else None)
        except Exception as err:  # any failure is a miss: compile instead  # noqa: BLE001
            log.warning("compiled program %s did not load (%s: %s); compiling it again", path.name,
                        type(err).__name__, err)
            return None
        with self._count:
            self.loaded += 1
        with contextlib.suppress(OSError):  # a read-only cache, or an entry another worker just evicted
            os.utime(path)  # recently used: kept by `_evict`
        return compiled

    def store(self, fp: str, compiled: jax.stages.Compiled) -> bool:
        """Save `compiled` under `fp` (atomically). Returns False, logged, when it cannot be serialized or
        written (the cache is an optimisation: a full disk must not stop a worker)."""
        from jax.experimental.serialize_executable import serialize

        tmp = None
        try:
            blob = pickle.dumps(serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
            with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".tmp", delete=False) as f:
                tmp = f.name
                f.write(blob)
            os.replace(tmp, self._path(fp))
        except Exception as err:  # noqa: BLE001
            log.warning("could not store a compiled program in %s (%s: %s)", self.directory, type(err).__name__,
                        err)
            if tmp is not None:
                pathlib.Path(tmp).unlink(missing_ok=True)
            return False
        with self._count:
            self.stored += 1
        self._evict()
        return True

    def _evict(self) -> None:
        """Delete the least recently used entries (by modification time, which `load` refreshes) beyond
        `max_bytes`; entries another process deletes first are skipped."""
        entries = []
        for path in self.directory.glob("*.xla"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
