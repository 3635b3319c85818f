"""Shared fixtures: the embedded model prepared once per session in a repo-local cache, and references.

The cache lives in `<repo>/.cache/test` (or $GEMMA_SERVE_TEST_CACHE): prepared weights, the tokenizer and JAX's
persistent compilation cache survive between runs on the same clone; a fresh clone (CI) builds them once.

Order. `make test` runs two pytest-xdist workers (pyproject: `-n 2 --dist loadscope`): each test module is one
scope, and the end-to-end tests (tests/e2e) are one scope (`pytest_xdist_make_scheduler` below), sent first, so one
worker launches the real stacks (tests/e2e/stacks.py) and drives them while the other runs unit modules; the
stacks' compilation overlaps the unit tests. The unit modules follow heaviest first (`UNIT_ORDER`), so that the
last ones to finish are short and neither worker idles long at the end; the modules that read the embedded GGUF
with gguf-py share one scope (`SHARED_SCOPES`), so they parse its metadata once. Without xdist workers (`-n 0`)
the e2e tests run last, and the session's first test launches their stacks so that they compile while the unit
tests run. Either way tests/e2e/test_faults.py runs after every other e2e test: it kills and finally stops the
embedded stack.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

# References load from local files only; never reach for the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One OpenMP thread for torch (the references) and numpy's BLAS: `make test` keeps both cores busy (two xdist
# workers, the stacks), and there a second OpenMP thread only spins. Measured on this 2-core machine under that
# load: a tiny Gemma 4 linear layer 3.3 ms -> 0.016 ms, a [200, 640] x [640, 262144] LM head 1.5 -> 1.2 s. Set
# before torch is imported (OpenMP reads it when its library loads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(os.environ.get("GEMMA_SERVE_TEST_CACHE") or REPO / ".cache" / "test")
# JAX's persistent compilation cache from a process's first compile (`model_worker.engine.enable_compilation_cache`
# through JAX's environment variables, read when jax is imported), not only once a test asks for `cache_dir`: a
# program another module, process or run compiled then loads in a fraction of its compile time, whatever order
# the modules run in. The stacks the e2e tests start inherit it; they use this directory anyway (`--cache-dir`).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
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


#: xdist workers take the unit modules in this order, then the others in collection order: the heaviest first
#: (seconds in a `make test` on a fresh clone, 2 cores, both busy), so that short modules fill the end and the two
#: workers finish within seconds of each other. A module missing here only runs later; the order changes no result.
UNIT_ORDER = (
    "tests/model_worker/test_int8.py",  # 43 s; one scope with the next two (SHARED_SCOPES): 200 s together
    "tests/tokenizer_svc/test_gguf_tokenizer.py",  # 15 s
    "tests/model_worker/test_gemma3_numerics.py",  # 140 s
    "tests/model_worker/test_mixed_step.py",  # 146 s
    "tests/model_worker/test_batch_invariance.py",  # 100 s
    "tests/model_worker/test_tensor_parallel.py",  # 56 s cold, 36 s warm: two subprocesses, 4 simulated devices
    "tests/docker/test_images.py",  # 45 s, mostly waiting on the services it starts
    "tests/model_worker/test_gemma4_numerics.py",  # 37 s
    "tests/model_worker/test_engine_batching.py",  # 34 s
    "tests/model_worker/test_sampling.py",  # 22 s
    "tests/model_worker/test_gemma4_int4.py",
    "tests/gateway/test_tool_calls.py",
    "tests/model_worker/test_attention_in_place.py",
    "tests/gateway/test_constraints.py",
    "tests/model_worker/test_int4.py",  # 15 s
    "tests/model_worker/test_resident_bytes.py",
    "tests/model_worker/test_executables.py",  # 20 s
    "tests/model_worker/test_bf16_matmul.py",
    "tests/tokenizer_svc/test_gemma4_template.py",
    "tests/gateway/test_budget.py",
    "tests/tokenizer_svc/test_text_tokenizer.py",
    "tests/tokenizer_svc/test_template_facts.py",
    "tests/deploy/test_kubernetes.py",  # 7 s
    "tests/test_no_torch.py",  # 5 s
    "tests/gateway/test_routing.py",  # 2 s
)
#: Modules that run as one xdist scope (in one worker process) because they share a costly per-process object:
#: gguf-py's parse of the embedded GGUF's metadata (~15 s, shared per process by `pytest_configure`), which
#: transformers' GGUF loaders need too (the Gemma 3 reference's first build, `hf_gemma3_float32_dir`).
SHARED_SCOPES = dict.fromkeys(UNIT_ORDER[:3], "tests/gguf-readers")


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    """Order the tests (see the module docstring); note which stacks the e2e tests need."""
    from tests.e2e import stacks

    stacks.NEEDED[:] = [name for name in stacks.SPECS if any(name in item.fixturenames for item in items)]

    def breaks_stacks(item) -> bool:  # test_faults kills and finally stops the stacks
        return item.fspath.basename == "test_faults.py"

    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller schedules in this (the workers') order
        rank = {module: i for i, module in enumerate(UNIT_ORDER)}
        # stable: the tests of a module keep their order
        items.sort(key=lambda item: (not _is_e2e(item), breaks_stacks(item),
                                     rank.get(_module(item.nodeid), len(rank))))
        config.stash[_SERIAL_EARLY_LAUNCH] = False
    else:
        items.sort(key=lambda item: (_is_e2e(item), breaks_stacks(item)))
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
    from common import families
    from tokenizer_svc.chat_template import tokenizer_part
    from tokenizer_svc.tokenizer import TextTokenizer

    return TextTokenizer.from_prepared(prepared.dir, tokenizer_part(families.by_name("gemma3")).template_facts.end_of_turn)


@pytest.fixture(scope="session")
def hf_gemma3(gguf_path):
    """transformers' Gemma3ForCausalLM of the same GGUF (torch, CPU, float32, eager attention), loaded from its
    float32 copy (`hf_gemma3_float32_dir`) in ~1 s instead of ~35 s from the GGUF."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_gemma3_float32_dir(gguf_path)), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model


def hf_gemma3_float32_dir(gguf_path: pathlib.Path) -> pathlib.Path:
    """A directory with transformers' own float32 dequantization of `gguf_path` (config.json, model.safetensors),
    written once per test cache by transformers (`save_pretrained`).

    Why: transformers dequantizes a GGUF in Python (~20 s) after gguf-py parsed its 262,144-token metadata (~15
    s), and three test modules in both xdist workers use the reference, run after run. The copy is keyed by the
    GGUF (path, size, mtime) and the transformers and gguf versions, and built under a file lock, so concurrent
    workers build it once. Before it is used, a model loaded from it is checked to hold exactly (torch.equal) the
    parameters of the model loaded from the GGUF, so the reference stays transformers' reading of the GGUF.

    Raises:
      RuntimeError: transformers kept some GGUF blocks packed, or the saved copy does not load back bit for bit.
    """
    import shutil
    from importlib.metadata import version

    import torch
    import transformers

    from common.preparation import _gguf_key, _locked

    versions = f"transformers-{version('transformers')}-gguf-{version('gguf')}"
    out = CACHE / "reference" / f"{_gguf_key(gguf_path)}-{versions}"
    with _locked(out.parent / f"{out.name}.lock"):
        if (out / "READY").exists():
            return out
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        if getattr(model.hf_quantizer, "packed_modules", None):
            raise RuntimeError("transformers kept GGUF blocks packed; the reference must be its dequantization")
        # The weights are dense float32; the GGUF quantizer left on the model only refuses to save it.
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        tmp = out.parent / f"{out.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        saved = transformers.AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).state_dict()
        want = model.state_dict()
        if saved.keys() != want.keys() or not all(torch.equal(saved[k], want[k]) for k in want):
            raise RuntimeError(f"{tmp} does not load back as the model transformers read from {gguf_path}")
        (tmp / "READY").write_text("1")
        os.replace(tmp, out)
    return out


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

