"""Shared fixtures: the embedded model prepared once per session in a repo-local cache, and references.

The cache lives in `<repo>/.cache/test` (or $GEMMA_SERVE_TEST_CACHE): prepared weights, the tokenizer and JAX's
persistent compilation cache survive between runs on the same clone; a fresh clone (CI) builds them once.

Order. `make test` runs two pytest-xdist workers (pyproject: `-n 2 --dist loadscope`): each test module is one
scope, and the end-to-end tests (tests/e2e) are one scope (`pytest_xdist_make_scheduler` below), sent first, so one
worker launches the real stacks (tests/e2e/stacks.py) and drives them while the other runs unit modules; the
stacks' compilation overlaps the unit tests. Without xdist workers (`-n 0`) the e2e tests run last, and the
session's first test launches their stacks so that they compile while the unit tests run. Either way
tests/e2e/test_faults.py runs after every other e2e test: it kills and finally stops the embedded stack.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

# References load from local files only; never reach for the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(os.environ.get("GEMMA_SERVE_TEST_CACHE") or REPO / ".cache" / "test")
_SERIAL_EARLY_LAUNCH = pytest.StashKey[bool]()


def pytest_configure(config):
    """Share one `gguf.GGUFReader` per file in this session. gguf-py parses a GGUF's metadata in Python (the
    262,144-token vocabulary of the embedded model takes ~15 s), and the references read it again and again:
    transformers twice per model load (config, then weights), its tokenizer, our converter and the tokenizer
    tests. A reader is read-only over a memory map, so every reader of the same file gets the same object."""
    import gguf

    reader_class = gguf.GGUFReader
    if getattr(reader_class, "_shared_per_file", False):
        return
    readers: dict[str, object] = {}
    init = reader_class.__init__

    def new(cls, path, mode="r"):
        key = os.path.realpath(path)
        if mode != "r":
            return object.__new__(cls)
        if key not in readers:
            readers[key] = object.__new__(cls)
        return readers[key]

    def shared_init(self, path, mode="r"):
        if not getattr(self, "_initialized", False):
            init(self, path, mode)
            self._initialized = True

    reader_class.__new__ = new
    reader_class.__init__ = shared_init
    reader_class._shared_per_file = True


def _is_e2e(item) -> bool:
    return "e2e" in pathlib.Path(str(item.fspath)).parts


def pytest_collection_modifyitems(config, items):
    """Order the tests (see the module docstring); note which stacks the e2e tests need."""
    from tests.e2e import stacks

    stacks.NEEDED[:] = [name for name in stacks.SPECS if any(name in item.fixturenames for item in items)]
    breaks_stacks = lambda item: item.fspath.basename == "test_faults.py"  # noqa: E731 - kills and stops them
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller schedules in this (the workers') order
        items.sort(key=lambda item: (not _is_e2e(item), breaks_stacks(item)))  # stable: modules keep their order
        config.stash[_SERIAL_EARLY_LAUNCH] = False
    else:
        items.sort(key=lambda item: (_is_e2e(item), breaks_stacks(item)))
        config.stash[_SERIAL_EARLY_LAUNCH] = True


def _test_scope(nodeid: str) -> str:
    """The xdist scope of a test: its module, except that every e2e test shares one (one worker, one set of
    stacks)."""
    path = nodeid.split("::", 1)[0]
    return "tests/e2e" if path.startswith("tests/e2e/") else path


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
    """Serial runs: launch the stacks the selected e2e tests need at the session's first test (without waiting
    for them). Either way, stop every stack this process launched at the end."""
    from tests.e2e import stacks

    if request.config.stash.get(_SERIAL_EARLY_LAUNCH, False) and stacks.NEEDED:
        cache, prep = request.getfixturevalue("cache_dir"), request.getfixturevalue("prepared")
        for name in stacks.NEEDED:
            stacks.launch(name, cache, prep, tmp_path_factory)
    yield
    stacks.stop_all()


@pytest.fixture(scope="session")
def cache_dir() -> pathlib.Path:
    """The test cache directory (created)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    from model_worker.engine import enable_compilation_cache

    enable_compilation_cache(str(CACHE / "jax"))
    return CACHE


@pytest.fixture(scope="session")
def gguf_path(cache_dir) -> pathlib.Path:
    """The embedded Gemma 3 270M GGUF, assembled once."""
    from gemma_serve.models import embedded_gguf

    return embedded_gguf(cache_dir)


@pytest.fixture(scope="session")
def prepared(cache_dir, gguf_path):
    """The embedded model prepared (float32 safetensors, config, tokenizer)."""
    from gemma_serve.models import prepare

    return prepare("embedded", cache_dir)


@pytest.fixture(scope="session")
def gemma3(prepared):
    """(ModelConfig, Params) of the embedded model, float32 on the default device."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from model_worker.config import config_from_dict
    from model_worker.params import to_device

    cfg = config_from_dict(json.loads((prepared.dir / "config.json").read_text()))
    params = to_device(cfg, load_file(str(prepared.dir / "model.safetensors")), jnp.float32)
    return cfg, params


@pytest.fixture(scope="session")
def text_tokenizer(prepared):
    """The rebuilt tokenizer of the embedded model (tokenizer_svc.TextTokenizer)."""
    from tokenizer_svc.tokenizer import TextTokenizer

    return TextTokenizer.from_prepared(prepared.dir)


@pytest.fixture(scope="session")
def hf_gemma3(gguf_path):
    """transformers' Gemma3ForCausalLM loaded from the same GGUF (torch, CPU, float32, eager attention; ~40 s)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model


# The Gemma 4 test tokenizer (tests/gemma4_tokenizer.py), built once per session: writing it takes ~2 s, loading
# it ~2.5 s and llguidance's tokenizer of it ~2.5 s, and five test modules plus the Gemma 4 stack use it.


@pytest.fixture(scope="session")
def gemma4_tokenizer_dir(prepared, tmp_path_factory) -> pathlib.Path:
    """A directory with the Gemma 4 test tokenizer (tokenizer.json, tokenizer_config.json, generation_config)."""
    from tests.gemma4_tokenizer import write_gemma4_test_tokenizer

    return write_gemma4_test_tokenizer(tmp_path_factory.mktemp("gemma4-tok"), prepared.dir / "tokenizer.json")


@pytest.fixture(scope="session")
def gemma4_text_tokenizer(gemma4_tokenizer_dir):
    """tokenizer_svc.TextTokenizer of the Gemma 4 test tokenizer."""
    from tokenizer_svc.tokenizer import TextTokenizer

    return TextTokenizer.from_tokenizer_json(gemma4_tokenizer_dir)


@pytest.fixture(scope="session")
def gemma4_lltok(gemma4_tokenizer_dir):
    """llguidance's tokenizer of the Gemma 4 test tokenizer (262,144 tokens, EOS 1)."""
    import llguidance

    return llguidance.LLTokenizer((gemma4_tokenizer_dir / "tokenizer.json").read_text(), n_vocab=262_144,
                                  eos_token=1)

