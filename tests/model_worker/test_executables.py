"""The executable cache (`model_worker.engine.executables`): a restarted process loads its programs instead of compiling
them, and they compute exactly what the compiled ones do (the donated KV cache included); anything a program
depends on changes its fingerprint; a damaged entry is compiled again; a program JAX's own cache served is not
stored; the directory stays bounded.

The restart runs in subprocesses with JAX's persistent cache off, as the worker runs (this test process has it on:
tests/conftest.py)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.engine import executables
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.engine.executables import ExecutableCache, fingerprint
from model_worker.engine.programs import PROGRAMS, ProgramKey
from model_worker.modeling.params import to_device
from model_worker.serving.engine_api import DecodeBatch, PromptChunk
from tests.conftest import REPO
from tests.gemma4_tiny import SHARED, write_checkpoint

pytestmark = pytest.mark.slow  # compiles model programs or reads a reference: outside `make test-fast`

LEN = 64
ECFG = EngineConfig(num_slots=2, max_model_len=LEN, prefill_chunks=(8,), kv_bucket_factor=16, prefix_slack=4)
KEYS = [ProgramKey("compute", 1, 8, 8), ProgramKey("decode", 2, 1, 8)]  # a 7-token chunk and a decode at position 7: KV bucket 8

# One process's run: build the engine over the checkpoint in argv[1] with the cache in argv[2], compile KEYS
# through the cache, run a chunk and a decode step, print the counters and the results as JSON.
_PROCESS = """
import json, sys
import jax.numpy as jnp, numpy as np
from model_worker.engine.engine import Engine
from model_worker.engine.executables import ExecutableCache
from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.modeling.params import to_device
from tests.model_worker.test_executables import ECFG, KEYS, run_steps
cfg, flat = load_checkpoint(sys.argv[1], jnp.float32)
engine = Engine(cfg, to_device(cfg, flat, jnp.float32), ECFG)
cache = ExecutableCache(sys.argv[2])
engine.compile_all(keys=KEYS, cache=cache)
first_k = next(a for a in engine.cache.k if a is not None)
out = [np.asarray(x).tolist() for x in run_steps(engine)]
print(json.dumps(dict(loaded=cache.loaded, stored=cache.stored, donated=first_k.is_deleted(), out=out)))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    write_checkpoint(SHARED, out)
    return out


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_checkpoint(checkpoint, jnp.float32)


def run_steps(engine: Engine) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prompt chunk in slot 0 and a decode step of slots 0 and 1: both logits and the cache's first K array."""
    ids = list(range(3, 10))
    pending, _ = engine.dispatch_compute(chunk=PromptChunk(0, ids, 0, [False] * len(ids)))
    chunk = np.asarray(pending.logits)
    decode = np.asarray(engine.dispatch_decode(batch=DecodeBatch([0, 1], [11, 12], [7, 0], [True, True])).logits)
    k = next(a for a in engine.cache.k if a is not None)
    return chunk, decode, np.asarray(k)


def _process(checkpoint, cache_dir) -> dict:
    # the repository first, the inherited path after it (a TPU host finds its JAX through PYTHONPATH)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false", "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", _PROCESS, str(checkpoint), str(cache_dir)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_restarted_process_loads_the_programs_and_they_compute_the_same(checkpoint, tmp_path):
    """Stored by a first process, loaded by a second (a restarted worker): the same logits and KV cache, bit for
    bit, and the loaded programs still update the cache in place (its old array is donated)."""
    first = _process(checkpoint, tmp_path)
    assert (first["loaded"], first["stored"]) == (0, len(KEYS))
    second = _process(checkpoint, tmp_path)
    assert (second["loaded"], second["stored"]) == (len(KEYS), 0)
    assert second["donated"]
    for want, got in zip(first["out"], second["out"]):
        np.testing.assert_array_equal(np.asarray(want), np.asarray(got))


def _fp(engine: Engine, key=KEYS[1]) -> str:
    kind = PROGRAMS[key[0]]
    key = ProgramKey(*key)
    return fingerprint(key, engine.cfg, engine.ecfg, (*engine._state(kind), *kind.example(key, engine.cfg.vocab_size)))


def _engine(model, ecfg=ECFG, dtype=jnp.float32) -> Engine:
    cfg, flat = model
    return Engine(cfg, to_device(cfg, flat, dtype), dataclasses.replace(ecfg, dtype=jnp.dtype(dtype).name))


def test_what_a_program_depends_on_changes_its_fingerprint(model, monkeypatch):
    """The key, the engine configuration, the weights' dtypes, the program code and jax's configuration each
    change the fingerprint; another engine of the same model and configuration has the same one."""
    engine = _engine(model)
    base = _fp(engine)
    assert _fp(_engine(model)) == base
    assert _fp(engine, ("decode", 2, 1, LEN)) != base
    assert _fp(_engine(model, dataclasses.replace(ECFG, kv_int8=True))) != base
    assert _fp(_engine(model, dtype=jnp.bfloat16)) != base
    with jax.default_matmul_precision("bfloat16"):
        assert _fp(engine) != base
    params = engine.params
    engine.params = dataclasses.replace(params, final_norm=params.final_norm.astype(jnp.bfloat16))
    assert _fp(engine) != base  # the same configs, one weight's dtype changed: the abstract arguments
    engine.params = params
    assert _fp(engine) == base
    monkeypatch.setattr(executables, "_source_digest", lambda: "edited code")
    assert _fp(engine) != base


def test_flags_that_only_pick_the_grid_keep_the_fingerprints_of_the_programs_both_grids_hold(model):
    """Another chunk set, bucket factor, draft length, verify batch or queue bound leaves a program's cache key as
    it was (a restart with `--speculation off` or other chunks loads what it shares); the slots and the ring's slack
    shape the state and change it."""
    key = ProgramKey(*KEYS[1])
    base = _engine(model)._fingerprint(key)
    for change in ({"prefill_chunks": (16,)}, {"tail_chunks": (2, 4)}, {"kv_bucket_factor": 2}, {"max_waiting": 3},
                   {"max_draft_tokens": 3, "max_verify_batch": 1}):
        assert _engine(model, dataclasses.replace(ECFG, **change))._fingerprint(key) == base, change
    assert _engine(model, dataclasses.replace(ECFG, num_slots=ECFG.num_slots * 2))._fingerprint(key) != base
    assert _engine(model, dataclasses.replace(ECFG, prefix_slack=ECFG.prefix_slack + 8))._fingerprint(key) != base


def test_the_program_code_digest_covers_the_model_and_not_the_scheduler():
    """The digest follows the program modules' imports: the model's code is in it, the host-side code is not
    (editing the scheduler keeps the cache)."""
    names, todo = set(), list(executables._PROGRAM_ROOTS)
    while todo:
        name = todo.pop()
        if name not in names and executables._module_file(name) is not None:
            names.add(name)
            todo.extend(executables._imports(ast.parse(executables._module_file(name).read_text())))
    assert {"model_worker.modeling.model", "model_worker.modeling.attention", "model_worker.numerics.quant", "model_worker.modeling.sampling",
            "model_worker.modeling.kv_cache"} <= names
    assert not names & {"model_worker.serving.scheduler", "model_worker.server.service", "model_worker.serving.loop"}


def test_the_digest_reads_code_not_comments_docstrings_or_layout():
    """Editing a comment, a docstring or a line's layout in a program module keeps every stored program; any change
    to what the code does (a constant, a name, an operator) misses."""
    source = '''"""A module."""
import jax.numpy as jnp


def f(x):
    """Doubles x."""
    return x * 2  # twice
'''
    code = executables.code_of
    same = [source.replace("A module.", "Another docstring."), source.replace("# twice", "# two times"),
            source.replace("Doubles x.", "Twice x, shapes kept."), source.replace("return x * 2", "return (x\n* 2)"),
            source + "\n\n# a trailing comment\n"]
    changed = [source.replace("x * 2", "x * 3"), source.replace("x * 2", "x + x"),
               source.replace("import jax.numpy as jnp", "import numpy as jnp"),
               source.replace('"""Doubles x."""', '"""Doubles x."""\n    x = x + 0')]
    assert all(code(s) == code(source) for s in same)
    assert len({code(s) for s in changed} | {code(source)}) == len(changed) + 1
    # A function whose body is only its docstring still has a body.
    assert "Pass" in code('def g():\n    """Nothing."""\n')
    tree = ast.parse(source)
    executables._code_of_tree(tree)  # the digest's path: its tree, docstrings stripped in place
    assert executables._code_of_tree(tree) == code(source)


def test_a_damaged_entry_is_a_miss_and_is_replaced(model, tmp_path, caplog):
    engine = _engine(model)
    fp = _fp(engine)
    (tmp_path / f"{fp}.xla").write_bytes(b"\x80\x05truncated")  # as by a full disk
    cache = ExecutableCache(tmp_path)
    assert cache.load(fp) is None
    assert "did not load" in caplog.text
    compiled = engine._lower(KEYS[1]).compile()
    assert cache.store(fp, compiled)
    assert (tmp_path / f"{fp}.xla").stat().st_size > 1000
    assert not list(tmp_path.glob("*.tmp"))


def test_a_program_that_jax_cache_served_is_not_stored(model, tmp_path):
    """This process has JAX's persistent cache on (tests/conftest.py): the program compiled twice is served by it
    the second time, and such an executable is not stored (it would not load: the module docstring)."""
    engine = _engine(model)
    engine._lower(KEYS[1]).compile()  # now in JAX's persistent cache (no minimum compile time in tests)
    cache = ExecutableCache(tmp_path)
    engine.compile_all(keys=[KEYS[1]], cache=cache)
    assert (cache.loaded, cache.stored, cache.unstorable) == (0, 0, 1)
    assert not list(tmp_path.glob("*.xla"))


def test_the_directory_stays_under_its_bound(tmp_path):
    """Past `max_bytes` the least recently used entries go (a load counts as a use)."""
    cache = ExecutableCache(tmp_path, max_bytes=2500)
    for i, name in enumerate(["old", "used", "new"]):
        (tmp_path / f"{name}.xla").write_bytes(b"x" * 1000)
        os.utime(tmp_path / f"{name}.xla", (100 + i, 100 + i))
    os.utime(tmp_path / "used.xla", (200, 200))  # as `load` does
    cache._evict()
    assert sorted(p.stem for p in tmp_path.glob("*.xla")) == ["new", "used"]


def test_programs_compiled_at_once_compute_what_programs_compiled_in_turn_do(model, tmp_path, monkeypatch):
    """`compile_all` on several threads (the worker's default: one per core) keeps the grid's order, reports every
    program once, counts each in the cache once and gives programs that compute the same bits as those compiled
    one after another (the restart test above compiles its two programs at once too, and loads them back); a
    failed compile raises its own error."""
    keys = [*KEYS, ProgramKey("decode", 1, 1, 8), ProgramKey("greedy", 2, 0, 0)]
    in_turn, at_once = _engine(model), _engine(model)
    in_turn.compile_all(keys=keys, threads=1)
    seen: list[ProgramKey] = []
    cache = ExecutableCache(tmp_path)
    at_once.compile_all(lambda n, total, key: seen.append(key), keys=keys, cache=cache, threads=3)
    assert list(at_once._programs) == keys and sorted(seen) == sorted(keys)
    assert cache.stored + cache.unstorable == len(keys)  # each counted once (JAX's cache served those compiled above)
    for want, got in zip(run_steps(in_turn), run_steps(at_once)):
        np.testing.assert_array_equal(want, got)

    def broken(key, cache, defer=False):
        raise RuntimeError(f"cannot compile {key.kind}")

    monkeypatch.setattr(at_once, "_compile", broken)
    with pytest.raises(RuntimeError, match="cannot compile"):
        at_once.compile_all(keys=keys, threads=2)


def test_a_deferred_store_waits_for_store_deferred(tmp_path):
    """`defer=True` (the background compiles of a serving worker): the program is compiled and returned but
    written only by `store_deferred`, one at a time; it then loads and computes the same."""
    cache = ExecutableCache(tmp_path)
    c = float(np.random.default_rng().integers(1, 1 << 20))  # a program no earlier run compiled: JAX's cache misses
    lower = lambda: jax.jit(lambda x: x * c + 1).lower(jax.ShapeDtypeStruct((8,), jnp.float32))  # no eager op
    compiled = cache.get_or_compile("deferred", lower, defer=True)
    assert (cache.deferred, cache.stored, cache.unstorable) == (1, 0, 0) and not list(tmp_path.glob("*.xla"))
    assert cache.store_deferred() == 1 and cache.store_deferred() == 0
    assert cache.stored == 1 and cache.deferred == 0
    x = jnp.arange(8, dtype=jnp.float32)
    assert np.array_equal(np.asarray(cache.load("deferred")(x)), np.asarray(compiled(x)))
