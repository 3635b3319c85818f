"""The launcher's model preparation: every part at once, before `gemma-serve up` starts the services.

Above the services (it imports their part builders); the services themselves prepare through
`common.preparation`, which is below them. The spec forms, the prepared layout and the locking are described
there; the names below are re-exported for callers above the services (the CLI, tests, benchmarks).
"""

from __future__ import annotations

import pathlib

from common.preparation import EMBEDDED, PreparedModel, default_cache_dir, embedded_gguf
from common.preparation import prepare as prepare_parts

__all__ = ["EMBEDDED", "PreparedModel", "default_cache_dir", "embedded_gguf", "prepare"]


def prepare(spec: str, cache_dir: pathlib.Path | None = None) -> PreparedModel:
    """Resolve a model spec and make sure all its prepared files exist (the worker's weights and the tokenizer
    service's tokenizer), so each service then only reads them.

    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: the path is not a model spec, or is a prepared directory lacking a part
        (`common.preparation.prepare`).
    """
    from model_worker.server.main import PREPARE_PARTS as WORKER_PARTS
    from tokenizer_svc.main import PREPARE_PARTS as TOKENIZER_PARTS

    return prepare_parts(spec, cache_dir, {**WORKER_PARTS, **TOKENIZER_PARTS})
