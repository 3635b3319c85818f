"""Serve first, compile the rest while serving (model_worker/engine/background_compile.py): a worker that has only its
serving set, or that is still compiling the rest, gives every request exactly the tokens, log-probabilities and top
log-probabilities of a fully compiled one; a program that fails to compile in the background is left out and the
worker keeps serving; SIGTERM during the background compilation drains and exits cleanly; programs built by a
compile process of their own (model_worker/engine/compile_process.py) give the same answers, and a killed one leaves
the worker compiling the rest itself.

The model is the tiny random Gemma 4 (sliding window 8, shared KV) in the batch-invariant bfloat16 mode, the mode in
which a row's logits do not depend on the program computing them (the CPU default), with speculation's programs in
its grid."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.modeling.params import for_matmul_precision, to_device
from model_worker.serving.loop import EngineLoop
from model_worker.serving.sequence import Finish, SamplingSpec, Sequence
from tests.gemma4_tiny import SHARED, write_checkpoint

pytestmark = pytest.mark.slow  # compiles model programs: outside `make test-fast`

ECFG = EngineConfig(num_slots=4, max_model_len=128, prefill_chunks=(8, 32), kv_bucket_factor=4, prefix_slack=4,
                    max_draft_tokens=3, max_verify_batch=2)
# (prompt length, max_tokens): lone and batched decode rows, prompts in one chunk, in several of both sizes, past
# the sliding window and past the first KV buckets.
REQUESTS = [(3, 12), (70, 6), (9, 20), (40, 9), (1, 15), (26, 4)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-serve-first")
    write_checkpoint(SHARED, out)
    cfg, flat = load_checkpoint(out, jnp.float32)
    cfg, params = for_matmul_precision(cfg, to_device(cfg, flat, jnp.float32), "bfloat16", batch_invariant=True)
    return out, cfg, params


def engine(model, keys="all") -> Engine:
    _, cfg, params = model
    eng = Engine(cfg, params, ECFG)
    eng.compile_all(keys=None if keys == "all" else eng.serving_set() if keys == "serving" else keys)
    return eng


class Sink:
    def __init__(self):
        self.tokens, self.logprobs, self.tops, self.done = [], [], [], threading.Event()

    def __call__(self, ev):
        self.tokens += ev.token_ids
        self.logprobs += ev.logprobs
        self.tops += [(list(ids), list(lps)) for ids, lps in ev.top]
        if ev.finish != Finish.NONE:
            self.done.set()


def run(eng: Engine, temperature: float, while_running=None) -> list[Sink]:
    """The REQUESTS, arriving a few steps apart (rows join and leave decode batches, prompts meet decode steps in
    mixed iterations), through an engine loop; returns each request's sink."""
    rng = np.random.default_rng(5)
    loop = EngineLoop(eng, speculation="auto")
    loop.start()
    sinks = []
    try:
        for i, (n, max_tokens) in enumerate(REQUESTS):
            sink = Sink()
            spec = SamplingSpec(temperature=temperature, top_p=0.9 if temperature else 1.0, seed=1000 + i,
                                top_logprobs=3)
            loop.submit(Sequence(f"r{i}", rng.integers(3, 500, n).tolist(), spec, max_tokens, frozenset(), sink))
            sinks.append(sink)
            time.sleep(0.01 * (i % 3))
        if while_running is not None:
            while_running()
        for sink in sinks:
            assert sink.done.wait(300)
    finally:
        loop.stop()
    return sinks


def same(a: list[Sink], b: list[Sink]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.tokens == y.tokens, f"request {i}: tokens differ"
        assert np.array_equal(np.asarray(x.logprobs, np.float32), np.asarray(y.logprobs, np.float32)), i
        assert x.tops == y.tops, f"request {i}: top log-probabilities differ"


@pytest.fixture(scope="module")
def compiled(model):
    """A fully compiled engine and its answers, greedy and seeded."""
    eng = engine(model)
    return eng, {t: run(eng, t) for t in (0.0, 1.0)}


def test_the_serving_set_is_few_programs_that_cover_every_shape(model):
    eng = Engine(model[1], model[2], ECFG)
    largest = eng.kv_buckets[-1]
    assert eng.serving_set() == [("compute", 1, 8, largest), ("sample", 1, 0, 0), ("sample", 4, 0, 0),
                                 ("copy", 1, 0, 0)]
    assert len(eng.grid()) > 4 * len(eng.serving_set())


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_a_worker_with_only_its_serving_set_gives_the_same_answers(model, compiled, temperature):
    full, answers = compiled
    small = engine(model, "serving")
    small_answers = run(small, temperature)
    same(answers[temperature], small_answers)
    assert set(small.calls) <= set(small.serving_set()), set(small.calls) - set(small.serving_set())
    # ... while the compiled engine ran programs the small one lacks (so the comparison means something)
    assert {k.kind for k in full.calls} >= {"mixed", "compute", "decode"}
    assert any(k.kind == "decode" and k.batch == 2 for k in full.calls)


def test_the_background_yields_to_the_serving_loop(model):
    """While the rest compiles: one program at a time is lowered (the GIL-bound part), with the GIL's switch
    interval at `GIL_TURN_S`; the switch interval is the process's own again once the background is done."""
    from model_worker.engine import background_compile

    eng = engine(model, "serving")
    lower, lock, seen = eng._lower, threading.Lock(), {"now": 0, "most": 0, "turns": set()}

    def recording(key):
        with lock:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        seen["turns"].add(sys.getswitchinterval())
        try:
            time.sleep(0.05)  # long enough for the other threads to arrive
            return lower(key)
        finally:
            with lock:
                seen["now"] -= 1

    eng._lower = recording
    before = sys.getswitchinterval()
    rest = [k for k in eng.grid() if k not in eng.ready_programs()][:6]
    job = eng.compile_in_background(rest, threads=3)
    assert job.done.wait(300) and not job.failed and job.compiled == len(rest)
    assert seen["most"] == 1, "lowered one at a time"
    assert seen["turns"] == {min(background_compile.GIL_TURN_S, before)}
    assert sys.getswitchinterval() == before


def test_a_program_that_fails_to_compile_in_the_background_is_left_out(model, compiled, caplog):
    _, answers = compiled
    eng = engine(model, "serving")
    build = eng._compile

    def failing(key, cache, defer=False):
        if key.kind == "decode" and key.batch == 2:
            raise RuntimeError("injected compile failure")
        return build(key, cache, defer)

    eng._compile = failing
    rest = [k for k in eng.grid() if k not in eng.ready_programs()]
    job = eng.compile_in_background(rest, threads=2)
    assert job.done.wait(300)
    assert sorted(job.failed) == sorted(k for k in rest if k.kind == "decode" and k.batch == 2)
    assert job.pending == 0 and job.compiled == len(rest) - len(job.failed)
    assert "injected compile failure" in caplog.text and "serving without it" in caplog.text
    eng.calls.clear()
    same(answers[0.0], run(eng, 0.0))
    assert not any(k.kind == "decode" and k.batch == 2 for k in eng.calls)
    assert any(k.kind == "decode" and k.batch == 4 for k in eng.calls), "two rows decoded in the next bucket"


def test_sigterm_during_background_compilation_drains_and_exits_cleanly(model, tmp_path):
    """A real worker process on the tiny checkpoint: SERVING after its serving set, SIGTERM while the rest compiles
    one program at a time: it stops compiling, drains and exits 0 within seconds (not after the grid)."""
    checkpoint = model[0]
    sock = tmp_path / "w.sock"
    cmd = [sys.executable, "-m", "gemma_serve.cli", "worker", "--model", str(checkpoint), "--cache-dir",
           str(tmp_path / "cache"), "--uds", str(sock), "--metrics-uds", str(tmp_path / "m.sock"),
           "--max-model-len", "128", "--num-slots", "8", "--prefill-chunks", "8", "32", "--compile-threads", "1",
           "--max-draft-tokens", "3", "--log-level", "INFO"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("compiled in the background 1/" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-40:])
            time.sleep(0.1)
        serving = next(line for line in lines if "model worker SERVING" in line)
        assert "programs compiling in the background" in serving
        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert proc.wait(60) == 0, "".join(lines[-40:])
        assert time.monotonic() - stopped < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    log = "".join(lines)
    assert "background compilation stopped" in log and "shutting down" in log, log[-3000:]
    assert "full speed" not in log
    assert "Traceback" not in log, log[-3000:]


def test_answers_while_a_compile_process_builds_the_rest_are_the_same(model, compiled, tmp_path):
    """The rest compiled in the background by a child process (model_worker/engine/compile_process.py): each program stored by the
    child and loaded here, none compiled in this process, the answers during and after bit for bit those of a
    fully compiled engine; the child exits once the grid is done."""
    from model_worker.engine.executables import ExecutableCache

    _, answers = compiled
    eng = engine(model, "serving")
    eng._lower = lambda key: pytest.fail(f"{key} lowered in the worker")  # only the child may lower
    cache = ExecutableCache(tmp_path / "executables")
    rest = [k for k in eng.grid() if k not in eng.ready_programs()]
    job = eng.compile_in_background(rest, cache=cache, threads=2, process=True)
    assert job.process is not None
    during = run(eng, 1.0)
    same(answers[1.0], during)
    assert job.done.wait(300) and not job.failed and job.compiled == len(rest)
    assert cache.loaded == len(rest) and len(list(cache.directory.glob("*.xla"))) == len(rest)
    assert cache.deferred == 0, "nothing left for the loop to store"
    assert job.process._proc.wait(30) == 0, "the child exits once its input closes"
    eng.calls.clear()
    same(answers[1.0], run(eng, 1.0))  # the loop adopts what arrived: the whole grid now
    assert eng.ready_programs() == set(eng.grid())
    assert set(eng.calls) - set(eng.serving_set()), "the adopted programs were used"


def test_a_killed_compile_process_leaves_the_worker_compiling_the_rest(model, compiled, tmp_path, caplog):
    """kill -9 of the child after its first program: the worker compiles what is left on its own threads; nothing
    fails and the answers stay the same. (A few of the rest suffice: the child's first and a handful left to the
    threads; the whole rest was built by a child in the test above.)"""
    import os

    from model_worker.engine.executables import ExecutableCache

    _, answers = compiled
    eng = engine(model, "serving")
    cache = ExecutableCache(tmp_path / "executables")
    rest = [k for k in eng.grid() if k not in eng.ready_programs() and k.kind in ("decode", "greedy")]
    assert len(rest) >= 4, rest
    first = threading.Event()
    job = eng.compile_in_background(rest, cache=cache, threads=1, process=True,
                                    on_compiled=lambda key, ok: first.set())
    assert job.process is not None and first.wait(300)
    os.kill(job.process.pid, signal.SIGKILL)
    assert job.done.wait(300) and not job.failed and job.compiled == len(rest)
    assert 1 <= cache.loaded < len(rest), "some programs came from the child, the rest from this process"
    assert "the compile process did not deliver" in caplog.text and "exit code -9" in caplog.text
    same(answers[0.0], run(eng, 0.0))
