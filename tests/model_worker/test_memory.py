"""Per-device memory accounting and slot sizing (`model_worker/engine/memory.py`): the pure sizing functions with
hand-computed numbers, `--num-slots` parsing, sizing against a device that reports a limit (a stand-in object:
XLA's CPU reports none), and a running engine's report against its arrays' own byte counts. Abstract figures
against placed arrays under tensor parallelism: tests/model_worker/test_tensor_parallel.py."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from families.gemma4.worker import config_from_hf
from gemma_serve.cli import build_parser
from model_worker.engine import memory
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.engine.programs import ProgramKey
from model_worker.modeling.params import random_flat, to_device
from model_worker.modeling.sampling import penalty_capacity
from tests.gemma4_tiny import SHARED

GiB = 2**30
# 10 GiB of weights, 1 GiB of fixed temporaries, 1 GiB per slot (0.75 KV + 0.125 penalties + 0.125 temporaries)
FP = memory.Footprint(weights=10 * GiB, kv_per_slot=3 * GiB // 4, penalty_per_slot=GiB // 8, temp_fixed=GiB,
                      temp_per_slot=GiB // 8)


def test_auto_slots_fill_the_utilised_limit_after_weights_and_temporaries():
    assert FP.per_slot == GiB and FP.total(3) == 14 * GiB and FP.temporaries(8) == 2 * GiB
    assert memory.fit_slots(100 * GiB, FP) == 79  # floor(90 - 10 - 1)
    assert memory.fit_slots(100 * GiB, FP, utilisation=0.5) == 39
    assert memory.fit_slots(10_000 * GiB, FP) == memory.MAX_AUTO_SLOTS == 256
    assert memory.fit_slots(11 * GiB, FP) == 1  # not one slot fits 0.9 x 11 GiB: at least 1 (check_slots decides)
    assert memory.fit_slots(None, FP) == memory.DEFAULT_SLOTS == 4  # CPU: no limit reported


def test_slots_that_do_not_fit_fail_with_the_numbers():
    memory.check_slots(89, 100 * GiB, FP)  # 10 + 1 + 89 = 100 GiB: fits the whole limit
    memory.check_slots(10_000, None, FP)  # no limit, no check
    with pytest.raises(memory.SlotsDoNotFit) as err:
        memory.check_slots(90, 100 * GiB, FP, where="device 0 (TPU v5 lite)")
    message = str(err.value)
    assert message.startswith("90 slots do not fit device 0 (TPU v5 lite): weights 10 GiB + temporaries 1.0 GiB "
                              "+ 90 x 1.0 GiB per slot (KV 768 MiB, penalty state 128 MiB, temporaries 128 MiB) "
                              "= 101 GiB > limit 100 GiB"), message
    assert "at most 89 slot(s) fit (--num-slots auto takes 79)" in message
    with pytest.raises(memory.SlotsDoNotFit, match="^1 slot does not fit the device: .* not one slot fits"):
        memory.check_slots(1, 11 * GiB, FP)


def test_num_slots_flag_takes_auto_or_a_positive_integer(capsys):
    parser = build_parser()
    assert parser.parse_args(["worker"]).num_slots == "auto"
    assert parser.parse_args(["up", "--num-slots", "8"]).num_slots == 8
    assert parser.parse_args(["worker", "--num-slots", "auto"]).num_slots == "auto"
    for bad in ("0", "eight", "-3"):
        with pytest.raises(SystemExit):
            parser.parse_args(["worker", "--num-slots", bad])
    assert "expected a positive integer or auto, got 'eight'" in capsys.readouterr().err


@dataclasses.dataclass
class _Device:
    """A stand-in for an accelerator that reports its memory limit (`jax.Device.memory_stats`)."""

    limit: int
    id: int = 0
    device_kind: str = "NVIDIA H100 80GB HBM3"

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": 123}


@pytest.fixture(scope="module")
def tiny():
    cfg = config_from_hf({**SHARED, "model_type": "gemma4_text"}, "tiny")
    return cfg, to_device(cfg, random_flat(cfg), jnp.float32)


def test_size_slots_against_a_device_limit_and_on_cpu(tiny):
    cfg, params = tiny
    ecfg = EngineConfig(num_slots=1, max_model_len=64, prefill_chunks=(16,))
    sized, fp, limit = memory.size_slots(cfg, params, ecfg, auto=True)
    if jax.default_backend() == "cpu":
        assert (sized.num_slots, limit) == (4, None)  # XLA's CPU reports no limit
    else:  # an accelerator reports its limit, and `auto` fills it
        assert limit > fp.weights and sized.num_slots == memory.fit_slots(limit, fp)
    # int32 ids and counts of min(2 * max_model_len, V) distinct tokens
    assert fp.weights == params.nbytes() and fp.penalty_per_slot == penalty_capacity(64, cfg.vocab_size) * 8
    cap = fp.weights + fp.temp_fixed + 10 * fp.per_slot
    sized, _, limit = memory.size_slots(cfg, params, ecfg, auto=True, devices=[_Device(cap)])
    assert limit == cap and sized.num_slots == memory.fit_slots(cap, fp) < 10
    assert memory.size_slots(cfg, params, dataclasses.replace(ecfg, num_slots=10), auto=False,
                             devices=[_Device(cap)])[0].num_slots == 10
    with pytest.raises(memory.SlotsDoNotFit, match=r"^11 slots do not fit device 0 \(NVIDIA H100 80GB HBM3\)"):
        memory.size_slots(cfg, params, dataclasses.replace(ecfg, num_slots=11), auto=False, devices=[_Device(cap)])


def test_a_running_engine_reports_its_arrays_and_compiled_temporaries(tiny):
    cfg, params = tiny
    engine = Engine(cfg, params, EngineConfig(num_slots=2, max_model_len=64, prefill_chunks=(16,)))
    assert engine.temp_bytes() == 0  # nothing compiled yet
    key = ProgramKey("greedy", 2, 0, 0)  # the quickest program to compile
    engine.compile_all(keys=[key])
    (usage,) = memory.device_usage(engine)
    on_cpu = jax.default_backend() == "cpu"
    assert usage.device == jax.devices()[0] and (usage.capacity is None) == on_cpu  # XLA's CPU reports no limit
    assert usage.weights == params.nbytes() and usage.kv == engine.cache.nbytes()
    assert usage.penalties == 2 * penalty_capacity(64, cfg.vocab_size) * 8  # ids and counts, int32
    temporaries = engine._lower(key).compile().memory_analysis().temp_size_in_bytes
    assert usage.temporaries == temporaries
    # XLA's CPU program of this tiny greedy step keeps a scratch buffer; the TPU compiler fuses it into no device
    # temporaries at all (0 bytes on a v5e), so only the CPU's figure is known to be positive.
    assert temporaries > 0 or not on_cpu
    assert re.fullmatch(rf"device 0 \({re.escape(usage.device.device_kind)}\): weights [\d.]+ MiB, KV [\d.]+ KiB, "
                        r"penalty state [\d.]+ KiB, temporaries [\d.]+ (B|KiB)" + ("" if on_cpu else
                                                                               r" \(of a [\d.]+ GiB limit\)"),
                        usage.line()), usage.line()


def test_sizes_read_as_a_person_writes_them():
    assert [memory.size_text(n) for n in (12, 512 * 2**10, 149 * 2**20, int(1.25 * GiB), 80 * GiB)] == [
        "12 B", "512 KiB", "149 MiB", "1.2 GiB", "80 GiB"]
