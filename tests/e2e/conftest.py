"""Fixtures of the real stacks (tests/e2e/stacks.py): the first one starts launching every stack the session's e2e
tests use, one after another in the background (unless the session already did), then each waits until its own
stack is healthy (launching it at once if its turn has not come); all are stopped (SIGTERM) when the session
ends."""

from __future__ import annotations

import pytest

from tests.e2e import stacks
from tests.e2e.stacks import MAX_MODEL_LEN, Stack, free_ports  # noqa: F401 - re-exported for the tests


def pytest_terminal_summary(terminalreporter):
    """Report how long each stack took to become healthy (compile time on this machine is real)."""
    for name, s in stacks.launched().items():
        if s.healthy:
            terminalreporter.write_line(f"{name}: gemma-serve up became healthy {s.startup_s:.1f} s after launch")


def _ready(name: str, cache_dir, prepared, tmp_path_factory) -> Stack:
    stacks.launch_needed(cache_dir, prepared, tmp_path_factory)  # one after another, in the background
    return stacks.launch(name, cache_dir, prepared, tmp_path_factory).wait_healthy()


@pytest.fixture(scope="session")
def stack(cache_dir, prepared, tmp_path_factory) -> Stack:
    """The embedded model's three services with max_model_len 512 and 4 slots."""
    return _ready("stack", cache_dir, prepared, tmp_path_factory)


@pytest.fixture(scope="session")
def gemma4_stack(cache_dir, prepared, tmp_path_factory):
    """The tiny Gemma 4 checkpoint's stack (max_model_len 512, one slot); yields (stack, transformers model)."""
    s = _ready("gemma4_stack", cache_dir, prepared, tmp_path_factory)
    return s, s.reference


@pytest.fixture(scope="session")
def fuzz_stack(cache_dir, prepared, tmp_path_factory) -> Stack:
    """A gateway with --max-tokens-cap 4 in front of the tiny Gemma 4 stack's backends (fuzzing and hostile input)."""
    return _ready("fuzz_stack", cache_dir, prepared, tmp_path_factory)


@pytest.fixture(scope="session")
def auth_stack(cache_dir, prepared, tmp_path_factory) -> Stack:
    """A gateway with API keys (stacks.API_KEYS) and TLS on its public ports (the test CA: `auth_stack.ca`) in
    front of the embedded stack's backends."""
    return _ready("auth_stack", cache_dir, prepared, tmp_path_factory)


@pytest.fixture(scope="session")
def tp_stack(cache_dir, prepared, tmp_path_factory) -> Stack:
    """The embedded model split over 2 simulated devices (`up --tensor-parallel 2`, one slot)."""
    return _ready("tp_stack", cache_dir, prepared, tmp_path_factory)
