"""Compiling in a process of its own: the background's programs traced, lowered, compiled and stored into the
executable cache by a child process, which the serving worker then loads.

Why: a worker that serves first compiles the rest of its grid beside its serving loop (`background_compile`).
On its own threads, tracing and lowering are Python holding the GIL and storing an executable serializes it under
the GIL, so the loop's thread waits for them: on a TPU v5e the embedded model's fleet beside the background ran
at a fraction of its full speed, the gateway's health checks timed out twice (the worker seen UNREACHABLE for 2-3
s), and after full speed the deferred stores still cut seconds out of the first agents' turns (docs/performance.md,
"Seventeenth session on the chip"). A child process has a GIL of its own: the worker's part per program is one
fingerprint and one load (`ExecutableCache.load`), and its loop keeps the interpreter.

A TPU admits one process to the chip (libtpu's lock file). The child never opens it: it runs JAX on the CPU
backend and compiles for the chip's compile-only topology (`jax.experimental.topologies`, one chip of the same
kind), with libtpu told that a second process may load it (`ALLOW_MULTIPLE_LIBTPU_LOAD`). Seen on a TPU v5e: a
program compiled so while another process held the chip loaded there and gave the same bits as the holder's own.
The child traces for the chip's platform (`sampling.TRACE_PLATFORM_ENV`) and lowers with explicit single-device
shardings (`programs.lower_on_one_device`).

Protocol (pickles over the child's stdin and a pipe of their own for the answers, so that nothing the child or a
library prints can corrupt them): first a `Spec`, then one `(id, key, fingerprint)` per program; the child
answers `(id, None)` once the program is stored under its fingerprint, or `(id, "why")`. The parent sends at most
as many programs at once as the child has threads. The child exits when its stdin closes, is killed by the
kernel if the worker dies first (Linux's parent-death signal), and runs in a session of its own (a signal to the
worker's process group is the worker's to handle). Any failure of the child leaves the worker
compiling that program on its own threads (`Engine.compile_in_background`): slower, never wrong.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from typing import Any

import jax

from model_worker.engine.executables import ExecutableCache
from model_worker.engine.programs import lower_on_one_device
from model_worker.modeling.sampling import TRACE_PLATFORM_ENV
from model_worker.serving.engine_api import ProgramKey

log = logging.getLogger(__name__)

#: "0" compiles the background's programs on the worker's own threads, as before (to measure the difference, or
#: where a child cannot start).
ENV = "GEMMA_SERVE_COMPILE_PROCESS"

#: One-chip compile-only topologies by device kind (libtpu's topology names); other TPUs compile in-process.
TPU_TOPOLOGIES = {"TPU v5 lite": "v5e:1x1", "TPU v6 lite": "v6e:1x1"}


class CompileProcessError(RuntimeError):
    """The child did not deliver a program: it reported a failure, or it is gone."""


class CompileProcessClosed(CompileProcessError):
    """The worker closed the child (its background compile stopped): nothing to fall back to."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What the child compiles for: `platform` "cpu" (its own backend) or "tpu" (`topology`, compile-only)."""

    platform: str
    topology: str | None = None


@dataclasses.dataclass
class Spec:
    """Everything the child needs to lower an engine's programs, without its weights or state.

    Attributes: cfg: the engine's ModelConfig; state: engine state name -> abstract pytree (`jax.ShapeDtypeStruct`
    leaves, no shardings); target: see `Target`; cache_dir, cache_bytes: the executable cache's directory and bound
    (`ExecutableCache.max_bytes`); config: the
    worker's `jax.config` values of plain types (the child applies those that differ from its own); threads:
    programs compiled at once."""

    cfg: Any
    state: dict[str, Any]
    target: Target
    cache_dir: str
    cache_bytes: int
    config: dict[str, Any]
    threads: int


def target_of(devices: list) -> Target | None:
    """The child's target for an engine on `devices` (its mesh's, or the default device's), or None where a child
    cannot compile for them: several devices (a mesh's shardings are not lowered there), a GPU (not tried), a
    TPU without a known one-chip topology (`TPU_TOPOLOGIES`), or `ENV` set to 0."""
    if os.environ.get(ENV, "1").strip() == "0" or len(devices) != 1:
        return None
    device = devices[0]
    if device.platform == "cpu":
        return Target("cpu")
    if device.platform == "tpu" and device.device_kind in TPU_TOPOLOGIES:
        return Target("tpu", TPU_TOPOLOGIES[device.device_kind])
    return None


def _plain_config() -> dict[str, Any]:
    """The worker's jax.config values that a pickle carries as they are (devices and other objects left out), the
    calling thread's matmul precision included (a `jax.default_matmul_precision` block is thread-local, and
    `Engine._builder` compiles under the one of the thread that asked)."""
    config = {k: v for k, v in jax.config.values.items() if v is None or isinstance(v, (bool, int, float, str))}
    config["jax_default_matmul_precision"] = jax.config.jax_default_matmul_precision
    return config


def start(cfg, state: dict[str, Any], devices: list, cache: ExecutableCache, threads: int) -> CompileProcess | None:
    """A running child for an engine's programs (see `Spec` for the arguments), or None where `target_of` gives
    none or the child does not start (logged: the worker then compiles on its own threads)."""
    target = target_of(devices)
    if target is None:
        return None
    try:
        return CompileProcess(Spec(cfg, state, target, str(cache.directory), cache.max_bytes, _plain_config(),
                                   max(1, threads)))
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as err:
        log.warning("could not start a compile process (%s: %s); compiling in the worker", type(err).__name__, err)
        return None


class CompileProcess:
    """The worker's side of the child: `compile(key, fingerprint)` from any thread blocks until the child has
    stored that program (or raises `CompileProcessError`); `close` ends the child.

    Start it from a thread that outlives it (the worker's main thread): Linux sends the parent-death signal when
    the thread that started the child ends, not only the process."""

    def __init__(self, spec: Spec):
        """Start the child; `spec` goes to it from the reader thread (a large one must not block the caller while
        the child still imports JAX).

        Raises: OSError: the child could not be started; pickle errors: `spec` does not pickle."""
        blob = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        env = dict(os.environ, JAX_PLATFORMS="cpu")  # the child's own backend: the CPU's, whatever the target
        if spec.target.platform == "tpu":
            # libtpu loadable beside the worker's (the chip stays the worker's), no metadata-server lookup (a TPU
            # VM's topology is named, not discovered).
            env.update(ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1")
        env[TRACE_PLATFORM_ENV] = spec.target.platform
        self.closed = False
        self._ids = itertools.count()
        self._waiting: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._gone: str | None = None
        self._sent = threading.Event()  # the spec is written (or the child is gone): requests may follow
        answers, theirs = os.pipe()  # the answers' own pipe: nothing the child prints can reach it
        try:
            # A session of its own: a signal to the worker's process group (Ctrl-C, a group kill) reaches the
            # worker, which ends the child itself; the parent-death signal covers a worker that dies.
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs)], stdin=subprocess.PIPE,
                                          pass_fds=(theirs,), env=env, start_new_session=True)
        except BaseException:
            os.close(answers)
            raise
        finally:
            os.close(theirs)
        self._answers = os.fdopen(answers, "rb")
        self.pid = self._proc.pid
        self._reader = threading.Thread(target=self._read, args=(blob,), name="compile-process-reader", daemon=True)
        self._reader.start()

    def _read(self, spec: bytes) -> None:
        """Send the spec, then hand each answer to its waiting `compile`; once the answers end (or cannot be read),
        end the child and fail every `compile` still waiting."""
        try:
            with self._lock:
                self._proc.stdin.write(spec)
                self._proc.stdin.flush()
            self._sent.set()
            while True:
                n, error = pickle.load(self._answers)
                with self._lock:
                    future = self._waiting.pop(n, None)
                if future is not None:
                    future.set_result(error)
        except EOFError:  # the child closed its end: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(30)
        except Exception as err:  # noqa: BLE001 - an unreadable answer: the child is of no further use
            if not self.closed:
                log.warning("compile process: %s: %s; ending it", type(err).__name__, err)
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.kill()
        code = self._proc.wait()
        with self._lock:
            self._gone = "closed" if self.closed else f"the compile process ended (exit code {code})"
            waiting, self._waiting = list(self._waiting.values()), {}
        self._sent.set()
        with contextlib.suppress(OSError, ValueError):
            self._answers.close()
        for future in waiting:
            future.set_exception(self._error())

    def _error(self) -> CompileProcessError:
        return (CompileProcessClosed if self.closed else CompileProcessError)(self._gone or "closed")

    def compile(self, key: ProgramKey, fingerprint: str) -> None:
        """Have the child compile `key` and store it under `fingerprint` in the executable cache; returns once it
        is stored.

        Raises: CompileProcessClosed after `close`; CompileProcessError: the child failed this program or is gone."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._sent.wait()
        with self._lock:
            if self._gone is not None or self.closed:
                raise self._error()
            n = next(self._ids)
            self._waiting[n] = future
            try:
                pickle.dump((n, tuple(key), fingerprint), self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self._proc.stdin.flush()
            except (OSError, ValueError) as err:  # the child is gone (a broken pipe) or closed
                self._waiting.pop(n, None)
                raise (CompileProcessClosed if self.closed else CompileProcessError)(str(err)) from None
        error = future.result()
        if error is not None:
            raise CompileProcessError(error)

    def close(self, kill: bool = False) -> None:
        """End the child: close its input (it exits once idle), or with `kill` at once (a compile in XLA cannot be
        interrupted otherwise; the cache's writes are atomic, so a kill leaves no partial entry). Idempotent."""
        self.closed = True
        if kill:
            with contextlib.suppress(OSError):
                self._proc.kill()
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdin.close()


# ----- the child ----------------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (PR_SET_PDEATHSIG); elsewhere the closed stdin ends it."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _apply_config(config: dict[str, Any]) -> None:
    """The worker's jax.config values where they differ from this process's, but the platform choice (the child's
    own) and the compilation cache (off: an executable JAX's cache served does not serialize whole on XLA CPU)."""
    jax.config.update("jax_enable_compilation_cache", False)
    for name, value in config.items():
        if name == "jax_platforms" or "cache" in name or jax.config.values.get(name, value) == value:
            continue
        try:
            jax.config.update(name, value)
        except Exception as err:  # noqa: BLE001 - a setting this process cannot take is logged, not fatal
            log.warning("compile process: jax.config %s=%r not applied (%s)", name, value, err)


def _target_device(target: Target):
    """The device programs are lowered for: None (this process's default) on CPU, else the first device of the
    compile-only topology."""
    if target.platform == "cpu":
        return None
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform=target.platform, topology_name=target.topology, chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1), num_slices=1, wrap=(False, False, False))
    return topology.devices[0]


def main() -> int:
    """The child: read the `Spec`, then compile and store each program asked for, answering as each is stored."""
    answers = os.fdopen(int(sys.argv[1]), "wb")  # the answers' own pipe (`CompileProcess.__init__`)
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s compile process | %(message)s", datefmt="%H:%M:%S")
    requests = sys.stdin.buffer
    spec: Spec = pickle.load(requests)
    _apply_config(spec.config)
    device = _target_device(spec.target)
    cache = ExecutableCache(spec.cache_dir, spec.cache_bytes)
    lock = threading.Lock()

    def work(n: int, key: tuple, fingerprint: str) -> None:
        error = None
        try:
            compiled = lower_on_one_device(ProgramKey(*key), spec.cfg, spec.state, device).compile()
            if not cache.store(fingerprint, compiled):
                error = f"{ProgramKey(*key)}: compiled but not stored in {cache.directory}"
        except Exception as err:
            log.exception("compiling %s failed", ProgramKey(*key))
            error = f"{ProgramKey(*key)}: {type(err).__name__}: {err}"
        with lock:
            pickle.dump((n, error), answers, protocol=pickle.HIGHEST_PROTOCOL)
            answers.flush()

    with concurrent.futures.ThreadPoolExecutor(spec.threads, thread_name_prefix="compile") as pool:
        while True:
            try:
                n, key, fingerprint = pickle.load(requests)
            except EOFError:
                break
            pool.submit(work, n, key, fingerprint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
