"""pytest plugin: the order in which `make test` runs the suite, and who launches the end-to-end stacks.

Lanes. `make test` runs three pytest-xdist workers (pyproject: `-n 3 --dist loadscope`). Every end-to-end test
(tests/e2e) is one xdist scope (`pytest_xdist_make_scheduler` below), sent first: one worker launches the real
stacks (tests/e2e/stacks.py) and drives them, while the other two run the unit modules. The stacks compile while
the unit tests run, and the e2e worker mostly waits on the stacks' processes, so three workers keep the two cores
of the reference machine busy where two left one idle for minutes (docs/performance.md, "Test suite").

Order. xdist hands each worker one scope at a time, in the order of the collection, so the unit modules are sorted
heaviest first (`UNIT_SECONDS`: longest-processing-time-first scheduling), and the last ones to finish are short:
the workers end within seconds of each other. The modules that read the embedded GGUF with gguf-py share one scope
(`SHARED_SCOPES`), so one process parses its metadata once (tests/plugins/gguf_readers.py). Without xdist workers
(`-n 0`) the e2e tests run last, and the session's first test launches their stacks so that they compile while
the unit tests run. Either way tests/e2e/test_faults.py runs after every other e2e test: it kills and finally
stops the embedded stack.

Registered by tests/conftest.py (`pytest_plugins`). Nothing here changes what a test checks, only when it runs.
"""

from __future__ import annotations

import os
import pathlib

import pytest

#: Seconds each unit module took in a `make test` on a fresh clone of the reference machine (2 cores, three
#: workers; figures: docs/performance.md, "Test suite"). Only the order is read from them: a module missing here
#: runs after those listed, and a stale figure changes no result, only how evenly the workers finish.
UNIT_SECONDS = {
    "tests/model_worker/test_int8.py": 88,  # shares its scope with the next two (SHARED_SCOPES)
    "tests/tokenizer_svc/test_gguf_tokenizer.py": 49,
    "tests/model_worker/test_gemma3_numerics.py": 264,
    "tests/model_worker/test_mixed_step.py": 213,
    "tests/model_worker/test_batch_invariance.py": 155,
    "tests/model_worker/test_tensor_parallel.py": 110,
    "tests/model_worker/test_gemma4_numerics.py": 93,
    "tests/model_worker/test_engine_batching.py": 56,
    "tests/model_worker/test_speculation.py": 80,  # measured alone (-n 0): 33 s tiny + 25 s embedded, idle machine
    "tests/model_worker/test_gemma4_int4.py": 52,
    "tests/model_worker/test_sampling.py": 49,
    "tests/gateway/test_tool_calls.py": 45,
    "tests/model_worker/test_attention_in_place.py": 44,
    "tests/model_worker/test_executables.py": 33,
    "tests/docker/test_images.py": 31,
    "tests/model_worker/test_int4.py": 24,
    "tests/tokenizer_svc/test_gemma4_template.py": 22,
    "tests/model_worker/test_resident_bytes.py": 21,
    "tests/gateway/test_constraints.py": 21,
    "tests/test_no_torch.py": 13,
    "tests/model_worker/test_bf16_matmul.py": 12,
    "tests/tokenizer_svc/test_text_tokenizer.py": 8,
    "tests/tokenizer_svc/test_template_facts.py": 7,
    "tests/model_worker/test_step_bytes.py": 6,
    "tests/deploy/test_kubernetes.py": 6,
    "tests/model_worker/test_worker_service.py": 6,
    "tests/gateway/test_chat_output.py": 5,
    "tests/gateway/test_http_guard.py": 5,
}
#: Modules that run as one xdist scope (in one worker process) because they share a costly per-process object:
#: gguf-py's parse of the embedded GGUF's metadata (tests/plugins/gguf_readers.py), which transformers' GGUF
#: loaders need too (the Gemma 3 reference's first build, `tests.conftest.hf_gemma3_float32_dir`).
SHARED_SCOPES = dict.fromkeys(list(UNIT_SECONDS)[:3], "tests/gguf-readers")
_SERIAL_EARLY_LAUNCH = pytest.StashKey[bool]()


def is_e2e(item: pytest.Item) -> bool:
    """Whether a test drives the real stacks (it lives under tests/e2e)."""
    return "e2e" in pathlib.Path(str(item.fspath)).parts


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _scope_seconds(nodeid: str) -> float:
    """The measured seconds of the scope a test belongs to (a shared scope counts all its modules)."""
    scope = _test_scope(nodeid)
    return sum(s for m, s in UNIT_SECONDS.items() if SHARED_SCOPES.get(m, m) == scope)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests (module docstring); note which stacks the e2e tests need."""
    from tests.e2e import stacks

    stacks.NEEDED[:] = [name for name in stacks.SPECS if any(name in item.fixturenames for item in items)]

    def breaks_stacks(item) -> bool:  # test_faults kills and finally stops the stacks
        return item.fspath.basename == "test_faults.py"

    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller schedules in this (the workers') order
        # stable: the tests of a scope keep their order
        items.sort(key=lambda item: (not is_e2e(item), breaks_stacks(item), -_scope_seconds(item.nodeid),
                                     _test_scope(item.nodeid)))
        config.stash[_SERIAL_EARLY_LAUNCH] = False
    else:
        items.sort(key=lambda item: (is_e2e(item), breaks_stacks(item)))
        config.stash[_SERIAL_EARLY_LAUNCH] = True


def _test_scope(nodeid: str) -> str:
    """The xdist scope of a test: its module, except that every e2e test shares one (one worker, one set of
    stacks) and the modules of `SHARED_SCOPES` share theirs."""
    path = _module(nodeid)
    return "tests/e2e" if path.startswith("tests/e2e/") else SHARED_SCOPES.get(path, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load-scope scheduling with `_test_scope` as the scope. (Its `loadgroup` mode cannot serve: it tags
    node ids through an attribute pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class E2eTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _test_scope(nodeid)

    return E2eTogether(config, log)


@pytest.fixture(scope="session", autouse=True)
def _launch_stacks_early(request, tmp_path_factory):
    """Serial runs: start launching the stacks the selected e2e tests need at the session's first test (in the
    background, one after another). Either way, stop every stack this process launched at the end."""
    from tests.e2e import stacks

    if request.config.stash.get(_SERIAL_EARLY_LAUNCH, False) and stacks.NEEDED:
        cache, prep = request.getfixturevalue("cache_dir"), request.getfixturevalue("prepared")
        stacks.launch_needed(cache, prep, tmp_path_factory)
    yield
    stacks.stop_all()
