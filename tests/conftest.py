"""Shared fixtures: the embedded model prepared once per session in the user's cache, and the references.

The cache lives in `test/` of the serving cache (`common.preparation.default_cache_dir`: `$GEMMA_SERVE_CACHE`, else
`~/.cache/gemma-serve`), or in $GEMMA_SERVE_TEST_CACHE: prepared weights, the tokenizer, the float32 reference copy,
the stacks' compiled executables and JAX's persistent compilation cache survive between runs and between clones
on one machine, as pip's wheel cache does (every entry is keyed by what it was built from: a changed program
compiles again); a new machine (CI) builds them once (figures: docs/performance.md, "Test suite"). The
order of the tests and the lanes of `make test` are the business of tests/plugins/scheduling.py; the shared gguf-py
readers, of tests/plugins/gguf_readers.py.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from common.preparation import default_cache_dir
from model_worker.numerics.xla_options import INVARIANT_CPU_FLAGS, add_xla_flags

# References load from local files only; never reach for the Hugging Face Hub.
# The worker's XLA options (model_worker/numerics/xla_options.py), for the programs the tests run in process: set before
# jax is imported.
add_xla_flags(*INVARIANT_CPU_FLAGS)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One OpenMP thread for torch (the references) and numpy's BLAS: `make test` keeps both cores busy (three xdist
# workers, the stacks), and there a second OpenMP thread only spins (figures: docs/performance.md, "Test suite").
# Set before torch is imported (OpenMP reads it when its library loads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(os.environ.get("GEMMA_SERVE_TEST_CACHE") or default_cache_dir() / "test")
# JAX's persistent compilation cache from a process's first compile (`model_worker.engine.engine.enable_compilation_cache`
# through JAX's environment variables, read when jax is imported), not only once a test asks for `cache_dir`: a
# program another module, process or run compiled then loads in a fraction of its compile time, whatever order
# the modules run in. The stacks the e2e tests start inherit it; they use this directory anyway (`--cache-dir`).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The device lane (scripts/device_check.sh, docs/architecture.md "The device lane"): on an accelerator host one
# process at a time may hold the chip. The "chip" lane's pytest process takes it here, before any test runs, and
# then pins every process a test starts (services, subprocess checks) to the host's CPU through JAX_PLATFORMS, which
# they inherit. Its numerics compare float32 values at float32 precision: a TPU multiplies float32 operands in one
# bfloat16 pass by default (relative error ~4e-3), so the session states "highest", as the worker does for
# `--matmul-precision float32` (model_worker/server/main.py). The "host" and "e2e" lanes run with JAX_PLATFORMS=cpu.
DEVICE_LANE = os.environ.get("GEMMA_SERVE_DEVICE_LANE", "")
if DEVICE_LANE == "chip":
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    _CHIP = jax.devices()  # take the chip now: no process a test starts may (they inherit the line below)
    os.environ["JAX_PLATFORMS"] = "cpu"

#: The suite's plugins: the order of the tests and the lanes of `make test` (scheduling), one gguf-py reader per
#: file (gguf_readers).
pytest_plugins = ("tests.plugins.scheduling", "tests.plugins.gguf_readers")


@pytest.fixture(scope="module", autouse=True)
def _release_memory():
    """After each test module, give back what it left: its garbage, JAX's compiled-program caches (when jax was
    imported) and the C heap's free pages (glibc's `malloc_trim`). Why: an xdist worker runs dozens of modules,
    and their models, references and programs otherwise stayed resident until the session ended — three workers
    reached 7.7, 5.1 and 4.5 GB, over 20 GB with the e2e stacks beside them (docs/performance.md, "Test suite"),
    enough to be killed for memory on a smaller machine. JAX's persistent compilation cache serves a program a
    later module compiles again."""
    yield
    import gc
    import sys

    gc.collect()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    _malloc_trim()


def _malloc_trim() -> None:
    """Return the C heap's free pages to the system (glibc only; elsewhere nothing)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@pytest.fixture(autouse=True)
def _cpu_backend(request):
    """Tests marked `cpu_backend` (the CPU kernels) run with `jax.default_device` set to the host's CPU when the
    default backend is an accelerator (the TPU host has a CPU backend beside the chip): what they test exists only
    there. Elsewhere, and for unmarked tests, nothing changes."""
    if request.node.get_closest_marker("cpu_backend") is None:
        yield
        return
    import jax

    if jax.default_backend() == "cpu":
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def pytest_report_header(config) -> list[str]:
    """The device lane's machine, so each lane's log says where it ran."""
    if DEVICE_LANE != "chip":
        return [f"device lane: {DEVICE_LANE}"] if DEVICE_LANE else []
    return [f"device lane: chip ({', '.join(str(d) for d in _CHIP)}; float32 products at 'highest' precision)"]


@pytest.fixture(scope="session")
def cache_dir() -> pathlib.Path:
    """The test cache directory (created)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    from model_worker.engine.engine import enable_compilation_cache

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


@pytest.fixture(scope="module")
def gemma3(prepared):
    """(ModelConfig, Params) of the embedded model, float32 on the default device. Per module, not per session:
    1.1 GB each, ~1 s to load, and a session-wide copy in each of the three xdist workers stayed resident to the
    end (see `_release_memory`)."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from model_worker.modeling.config import config_from_dict
    from model_worker.modeling.params import to_device

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


@pytest.fixture(scope="module")
def hf_gemma3(gguf_path):
    """transformers' Gemma3ForCausalLM of the same GGUF (torch, CPU, float32, eager attention), loaded from its
    float32 copy (`hf_gemma3_float32_dir`), a small fraction of the time a load from the GGUF takes (figures:
    docs/performance.md, "Test suite"). Per module, as `gemma3`: 1.1 GB, a few seconds to load."""
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

    Why: transformers dequantizes a GGUF in Python after gguf-py parsed its 262,144-token metadata, both slow
    (figures: docs/performance.md, "Test suite"), and several test modules in several xdist workers use the
    reference, run after run. The copy is keyed by the
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


# The Gemma 4 test tokenizer (tests/gemma4_tokenizer.py), built once per session and process: writing it,
# loading it and llguidance's tokenizer of it take seconds each, and several test modules plus the Gemma 4 stack
# use it.


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

