"""Compiling before the weights exist (`model_worker.server.early`): the preparation writes the weights' layout
first, a worker waiting for the weights finds it (`preparation.wait_for_layout`) and compiles from zero weights of
that layout, and those programs are the real engine's: the same executable-cache fingerprints."""

from __future__ import annotations

import json
import pathlib
import threading
import time

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from common import preparation
from model_worker.modeling.config import config_from_dict
from model_worker.server.early import EarlyCompile, read_layout
from model_worker.server.main import write_weights

TINY_META = {"gemma3.embedding_length": 64, "gemma3.block_count": 1, "gemma3.attention.head_count": 2,
             "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 32,
             "gemma3.feed_forward_length": 64, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
             "gemma3.rope.freq_base": 100.0, "gemma3.attention.sliding_window": 8}


def _tiny_gguf(path: pathlib.Path) -> pathlib.Path:
    """A one-layer Gemma 3 GGUF: a Q8_0 embedding (packed as int8), a Q8_0 projection, float32 norms."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in TINY_META.items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)
    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    q8 = lambda shape: gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), Q8_0)
    writer.add_tensor("token_embd.weight", q8((32, 64)), raw_dtype=Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8((64, 64)), raw_dtype=Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_layout_is_what_the_weights_files_load_as(tmp_path):
    out = tmp_path / "prepared"
    out.mkdir()
    write_weights(gguf.GGUFReader(str(_tiny_gguf(tmp_path / "tiny.gguf"))), out, "tiny")
    cfg, flat = read_layout(out / preparation.LAYOUT)
    real = load_file(str(out / "model.safetensors"))
    assert cfg == config_from_dict(json.loads((out / "config.json").read_text()))
    assert sorted(flat) == sorted(real) and "embed.q8" in real  # the Q8_0 embedding is packed: int8 + scales
    for name, array in real.items():
        assert (flat[name].shape, flat[name].dtype) == (array.shape, array.dtype), name


def _layout_files(tmp_path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """(cache dir, a .gguf spec in it, the prepared directory `prepare` would use for it)."""
    spec = _tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "cache" / "prepared" / preparation._gguf_key(spec)
    out.mkdir(parents=True)
    return tmp_path / "cache", spec, out


def test_a_waiting_worker_finds_the_layout_only_while_the_weights_are_being_written(tmp_path):
    cache, spec, out = _layout_files(tmp_path)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    assert preparation.wait_for_layout(str(spec), cache, stop, poll_s=0.01) is None  # nothing yet: waits, stops
    threading.Timer(0.2, lambda: (out / preparation.LAYOUT).write_text("{}")).start()
    assert preparation.wait_for_layout(str(spec), cache, threading.Event(), poll_s=0.01) == out / preparation.LAYOUT
    (out / "READY.weights").write_text(preparation.PREPARED_VERSION)  # prepared already: nothing to do early
    assert preparation.wait_for_layout(str(spec), cache, threading.Event()) is None
    assert preparation.wait_for_layout(str(tmp_path), cache, threading.Event()) is None  # not a GGUF


def test_the_early_compile_runs_from_the_layout_and_finish_waits_for_it(tmp_path, caplog):
    cache, spec, out = _layout_files(tmp_path)
    write_weights(gguf.GGUFReader(str(spec)), out, "tiny")
    calls, started = [], threading.Event()

    def compile(cfg, flat):
        started.set()
        time.sleep(0.3)  # finish() must wait for a compile under way
        calls.append((cfg.name, sorted(flat)))

    early = EarlyCompile(str(spec), cache, compile).watch()
    assert started.wait(30)
    early.finish()
    assert calls == [("tiny", sorted(load_file(str(out / "model.safetensors"))))]
    assert early.seconds is not None

    (out / "READY.weights").write_text(preparation.PREPARED_VERSION)
    never = EarlyCompile(str(spec), cache, lambda cfg, flat: calls.append("again")).watch()
    never.finish()
    assert calls[-1] != "again"  # the weights were prepared: no early compile

    (out / "READY.weights").unlink()
    tried = threading.Event()

    def fail(cfg, flat):
        tried.set()
        raise RuntimeError("no compiler today")

    failing = EarlyCompile(str(spec), cache, fail).watch()
    assert tried.wait(30)
    failing.finish()  # a failed early compile is logged, nothing more: the real engine compiles its programs
    assert failing.seconds is None and "the early compile failed" in caplog.text


@pytest.mark.slow
def test_zero_weights_of_the_embedded_models_layout_give_the_real_engines_programs(gguf_path, tmp_path):
    """Every program of the default grid has the same executable-cache fingerprint whether the engine holds the
    layout's zero weights or the prepared weights: the early programs are the ones the worker then loads (the
    5-bit tiles of the CPU kernel, chosen from values, included)."""
    from model_worker.engine.engine import Engine, EngineConfig
    from model_worker.modeling.params import for_matmul_precision, to_device

    write_weights(preparation.open_gguf(gguf_path), tmp_path, "gemma-3-270m")
    real = (config_from_dict(json.loads((tmp_path / "config.json").read_text())),
            load_file(str(tmp_path / "model.safetensors")))
    engines = []
    for cfg, flat in (read_layout(tmp_path / preparation.LAYOUT), real):
        cfg, params = for_matmul_precision(cfg, to_device(cfg, flat, jnp.float32), "int8", True)
        engines.append(Engine(cfg, params, EngineConfig(num_slots=4, max_model_len=1024)))
    early, loaded = engines
    assert [early._fingerprint(k) for k in early.grid()] == [loaded._fingerprint(k) for k in loaded.grid()]


_TWO_LOADS = """
import json, pathlib, sys
from common import preparation
from gemma_serve.cli import build_parser
from model_worker.server.early import read_layout
from model_worker.server.main import load_engine

tmp, prepared = pathlib.Path(sys.argv[1]), preparation.PreparedModel("m", "gguf", pathlib.Path(sys.argv[2]))
args = build_parser().parse_args(["worker", "--cache-dir", str(tmp), "--max-model-len", "512", "--num-slots", "2",
                                  "--prefill-chunks", "64", "--speculation", "off"])
assert load_engine(preparation.PreparedModel("early", "gguf", pathlib.Path()), args,
                   weights=read_layout(tmp / preparation.LAYOUT)) is None
early = sorted(p.name for p in (tmp / "executables").iterdir())
load_engine(prepared, args)
print(json.dumps([early, sorted(p.name for p in (tmp / "executables").iterdir())]))
"""


@pytest.mark.slow
def test_a_worker_loads_the_programs_it_compiled_from_the_layout(gguf_path, cache_dir, tmp_path):
    """The worker's two loads (`load_engine`), in a process of their own as in a worker (JAX's own compilation
    cache off from the start): from the layout's zeros it compiles its serving set into the executable cache and
    returns None; from the prepared weights it then stores nothing new (every program loaded)."""
    import subprocess
    import sys

    from model_worker.checkpoints.gguf_convert import convert_gguf
    from model_worker.numerics.quant import int8_to_flat
    from model_worker.server.early import write_layout
    from model_worker.server.main import PREPARE_PARTS

    prepared = preparation.prepare(str(gguf_path), cache_dir, PREPARE_PARTS)
    name = config_from_dict(json.loads((prepared.dir / "config.json").read_text())).name  # as write_weights wrote it
    cfg, layout = convert_gguf(preparation.open_gguf(gguf_path), name, values=False)
    write_layout(tmp_path / preparation.LAYOUT, cfg, int8_to_flat(layout))
    run = subprocess.run([sys.executable, "-c", _TWO_LOADS, str(tmp_path), str(prepared.dir)], capture_output=True,
                         text=True, timeout=600, cwd=pathlib.Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    early, after = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(early) == 4 and after == early  # the serving set, all loaded by the second load
