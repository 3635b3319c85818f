"""The worker finds a model's family through the `families` registry: GGUF metadata and config.json dispatch to the
family's worker part, an unknown family stops the worker with a message naming what is supported, and every
config carries its family's registry name."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from common import families
from common.families import UnknownFamilyError
from common.preparation import prepare
from families.gemma3.worker import GEMMA3_270M
from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.modeling.config import config_from_dict, config_to_dict, worker_part
from model_worker.server.main import PREPARE_PARTS
from tests.e2e.stacks import REPO
from tests.transport import socket_folder


@pytest.mark.parametrize("family", families.families(), ids=lambda f: f.name)
def test_every_preset_carries_its_family_registry_name(family):
    presets = worker_part(family).presets
    assert presets, f"{family.name} has no preset"
    for name, cfg in presets.items():
        assert cfg.name == name and cfg.architecture == family.name
        assert families.by_name(cfg.architecture) == family
        assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


def _gguf(path, arch: str, meta: dict):
    """A GGUF file with `meta` and a 16 x 4 float32 embedding as its one tensor."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((16, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_workers_gguf_builder_dispatches_to_the_files_family(tmp_path):
    meta = {"gemma3.embedding_length": 4, "gemma3.block_count": 2, "gemma3.attention.head_count": 2,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 2, "gemma3.feed_forward_length": 8,
            "gemma3.attention.layer_norm_rms_epsilon": 0.5, "gemma3.rope.freq_base": 100.0,
            "gemma3.attention.sliding_window": 3}
    reader = gguf.GGUFReader(str(_gguf(tmp_path / "tiny.gguf", "gemma3", meta)))
    PREPARE_PARTS["weights"](reader, tmp_path, "tiny")
    cfg = config_from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert cfg.architecture == "gemma3" and cfg.name == "tiny"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.sliding_window) == (16, 4, 2, 3)
    assert [s.rope_theta for s in cfg.layers] == [1e4, 1e4]  # Gemma 3's local base for sliding layers


def _checkpoint(tmp_path, config: dict):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt  # no safetensors: reaching the tensors would be a FileNotFoundError


def test_an_unknown_checkpoint_family_is_refused_before_any_tensor_is_read(tmp_path):
    ckpt = _checkpoint(tmp_path, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert prepare(str(ckpt), tmp_path / "cache", {}).kind == "checkpoint"
    with pytest.raises(UnknownFamilyError) as err:
        load_checkpoint(ckpt, jnp.float32)
    assert "'llama'" in str(err.value) and "gemma4_text" in str(err.value) and "gemma3_text" in str(err.value)


def test_a_family_without_a_loader_for_the_format_says_so(tmp_path):
    with pytest.raises(NotImplementedError, match="Gemma 3 Hugging Face checkpoints .* not supported"):
        load_checkpoint(_checkpoint(tmp_path, {"model_type": "gemma3_text"}), jnp.float32)
    with pytest.raises(NotImplementedError, match="Gemma 4 GGUF files are not supported"):
        worker_part(families.by_name("gemma4")).config_from_gguf({}, 262_144, "x")


def test_a_prepared_config_of_an_unknown_family_is_refused():
    data = config_to_dict(GEMMA3_270M) | {"architecture": "llama"}
    with pytest.raises(UnknownFamilyError, match="'llama'.*gemma3"):
        config_from_dict(data)


def test_a_worker_given_a_gguf_of_an_unknown_family_fails_to_start_naming_the_supported_ones(tmp_path):
    path = _gguf(tmp_path / "llama-tiny.gguf", "llama", {})
    sockets = socket_folder()  # unix sockets: the test runs where no TCP socket may be opened too (a TPU host)
    proc = subprocess.run(
        [sys.executable, "-m", "gemma_serve.cli", "worker", "--model", str(path), "--cache-dir", str(tmp_path / "c"),
         "--uds", str(sockets / "w.sock"), "--metrics-uds", str(sockets / "m.sock")],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "failed to load the model: unsupported GGUF: general.architecture is 'llama'" in proc.stderr, proc.stderr
    assert "supported architectures: gemma3" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]  # a wrong model is the operator's mistake: one line
    assert not list((tmp_path / "c").glob("prepared/*/READY.weights"))
