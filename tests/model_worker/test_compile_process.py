"""The compile process's protocol and choices (model_worker/engine/compile_process.py), with a real child process
and no model: what it compiles for, a failure it reports, its end. Its programs' answers: test_serve_first.py."""

from __future__ import annotations

import jax
import pytest

from model_worker.engine import compile_process
from model_worker.engine.compile_process import (
    CompileProcess,
    CompileProcessClosed,
    CompileProcessError,
    Spec,
    Target,
)
from model_worker.modeling import sampling
from model_worker.serving.engine_api import ProgramKey


class FakeDevice:
    """What `target_of` reads of a device: its platform and kind."""

    def __init__(self, platform, kind):
        self.platform, self.device_kind = platform, kind


def test_targets(monkeypatch):
    monkeypatch.delenv(compile_process.ENV, raising=False)
    assert compile_process.target_of(jax.devices("cpu")[:1]) == Target("cpu")
    assert compile_process.target_of([FakeDevice("tpu", "TPU v5 lite")]) == Target("tpu", "v5e:1x1")
    assert compile_process.target_of([FakeDevice("tpu", "TPU v4")]) is None, "no known one-chip topology"
    assert compile_process.target_of([FakeDevice("gpu", "NVIDIA H100")]) is None
    assert compile_process.target_of([FakeDevice("cpu", "cpu")] * 2) is None, "a mesh compiles in the worker"
    monkeypatch.setenv(compile_process.ENV, "0")
    assert compile_process.target_of(jax.devices("cpu")[:1]) is None


def test_the_child_traces_for_its_target(monkeypatch):
    """The sampler's exp bound follows the platform the programs are traced for, not the tracing process's backend
    (a child on the CPU backend compiling for a TPU)."""
    monkeypatch.setenv(sampling.TRACE_PLATFORM_ENV, "tpu")
    assert sampling._exp_error() == 2.0**-14
    monkeypatch.setenv(sampling.TRACE_PLATFORM_ENV, "cpu")
    assert sampling._exp_error() == 2.0**-18


def test_a_program_the_child_cannot_build_is_reported_and_close_ends_it(tmp_path):
    child = CompileProcess(Spec(cfg=None, state={}, target=Target("cpu"), cache_dir=str(tmp_path), cache_bytes=2**20,
                                config={}, threads=1))
    try:
        with pytest.raises(CompileProcessError, match="KeyError"):
            child.compile(ProgramKey("no-such-kind", 1, 0, 0), "0" * 64)
        assert child._proc.poll() is None, "one failed program does not end the child"
    finally:
        child.close()
    assert child._proc.wait(30) == 0
    with pytest.raises(CompileProcessClosed):
        child.compile(ProgramKey("copy", 1, 0, 0), "1" * 64)
    assert not list(tmp_path.glob("*.xla"))
