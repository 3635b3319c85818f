"""pytest plugin: the controller of an xdist run imports the suite's heavy modules once, before its workers start,
so that Python's bytecode caches exist when they collect.

On a fresh clone nothing is byte-compiled yet (the Makefile installs with `pip --no-compile`), and three workers
collecting at once would each compile the same sources — jax, numpy, torch, transformers, hypothesis, ours —
three times over on the reference machine's two cores (the first test started ~57 s after pytest did). Importing
them once in the controller writes the caches the workers then read (`make test` lets Python write them:
Makefile). Nothing is imported when Python may not write bytecode, in a worker, without workers (`-n 0`), or
once the caches exist (transformers' is there: a later run on the same clone).
Registered by tests/conftest.py (`pytest_plugins`); it changes nothing a test checks.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

#: Imported by most test modules or their fixtures; every one that exists is imported, in this order.
MODULES = ("numpy", "jax", "jax.numpy", "torch", "transformers", "gguf", "hypothesis", "schemathesis", "fastapi",
           "grpc", "openai", "anthropic", "pydantic", "llguidance", "model_worker.engine", "gateway.app",
           "tokenizer_svc.main", "model_worker.main")


def pytest_configure(config) -> None:
    """In an xdist controller with workers to come, import `MODULES` (errors ignored: a test reports them)."""
    is_worker = hasattr(config, "workerinput")
    if sys.dont_write_bytecode or is_worker or not config.getoption("numprocesses", None) or _compiled("transformers"):
        return
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001,S112 - a missing optional module is the tests' business, not this plugin's
            continue


def _compiled(name: str) -> bool:
    """Whether the package `name` has its bytecode cache already (False when it is not installed)."""
    spec = importlib.util.find_spec(name)
    return bool(spec and spec.origin and os.path.exists(importlib.util.cache_from_source(spec.origin)))
