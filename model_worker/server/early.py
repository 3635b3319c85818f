"""Compiling before the weights exist: the worker's first programs from the prepared model's layout.

A new machine's first start prepares the model files (the embedded GGUF: ~10-20 s on two cores) and then compiles
the programs that serve every request (~25 s): one after the other, the two made most of the first minute. A
program depends on the weights' shapes and dtypes, not their values, and the preparation writes those first
(`common.preparation.LAYOUT`, from the GGUF's header in a fraction of a second). So while `prepare` still waits,
`EarlyCompile` builds an engine over zero-filled weights of that layout and compiles its serving set into the
executable cache; the real engine, built once the weights are there, then loads those programs in a second. A
layout that differs from the weights (a forecast that missed) only costs the early work: the real engine's
programs then miss the cache (their fingerprints cover every shape and dtype) and compile as before.
"""

from __future__ import annotations

import gc
import json
import logging
import pathlib
import threading
import time
from typing import Callable

import numpy as np

from common import preparation
from model_worker.modeling.config import ModelConfig, config_from_dict, config_to_dict

log = logging.getLogger("gemma_serve.worker")


def write_layout(path: pathlib.Path, cfg: ModelConfig, flat: dict[str, np.ndarray]) -> None:
    """Write `cfg` and each array's shape, dtype and first element (the flat dict as saved: `quant.int8_to_flat`'s
    names) to `path`, atomically (a reader never sees half a file). The first element carries what a forecast
    set there to steer value-dependent choices (`gguf_int8.int8_layout`)."""
    tensors = {name: [list(a.shape), np.dtype(a.dtype).str, a.flat[0].item() if a.size else 0]
               for name, a in flat.items()}
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps({"config": config_to_dict(cfg), "tensors": tensors}))
    tmp.replace(path)


def read_layout(path: pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, flat dict of arrays of the layout's shapes and dtypes, zero but their first element): what
    `write_weights`' files will load as, values aside. np.zeros maps pages lazily: an array costs memory once it
    is written."""
    layout = json.loads(path.read_text())
    flat = {}
    for name, (shape, dtype, first) in layout["tensors"].items():
        flat[name] = np.zeros(tuple(shape), np.dtype(dtype))
        if flat[name].size:
            flat[name].flat[0] = first
    return config_from_dict(layout["config"]), flat


class EarlyCompile:
    """Watches for a layout while `prepare` waits (`watch`), compiles from it on its own thread (`compile`: the
    callable that builds a zero-weight engine and compiles its serving set into the executable cache), and is
    stopped once the weights exist (`finish`): no new early compile starts then, one under way is waited for (the
    real engine loads what it stored)."""

    def __init__(self, spec: str, cache_dir: pathlib.Path, compile: Callable[[ModelConfig, dict], None]):
        """Args: spec and cache_dir: the worker's `--model` and `--cache-dir`; compile: see the class docstring."""
        self._spec, self._cache_dir, self._compile = spec, cache_dir, compile
        self._stop = threading.Event()
        self._lock = threading.Lock()  # `finish` and the start of a compile: one or the other comes first
        self.seconds: float | None = None  # the early compile's duration, once it ran
        self._thread = threading.Thread(target=self._run, name="early-compile", daemon=True)

    def watch(self) -> EarlyCompile:
        """Start watching (returns self)."""
        self._thread.start()
        return self

    def _run(self) -> None:
        path = preparation.wait_for_layout(self._spec, self._cache_dir, self._stop)
        with self._lock:
            if path is None or self._stop.is_set():
                return
            started = time.perf_counter()
        try:
            log.info("compiling the first programs from the weights' layout while the weights are written (%s)", path)
            self._compile(*read_layout(path))
            gc.collect()  # the zero-weight engine's arrays (device memory off CPU) go before the real weights come
            self.seconds = time.perf_counter() - started
            log.info("compiled the first programs early in %.1f s", self.seconds)
        except Exception:  # early work only: the real engine compiles whatever this did not store
            log.exception("the early compile failed (the programs compile after the weights load instead)")

    def finish(self, timeout: float | None = None) -> None:
        """The weights exist: stop watching, and wait up to `timeout` seconds for a compile under way."""
        with self._lock:
            self._stop.set()
        self._thread.join(timeout)
