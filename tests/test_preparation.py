"""`common.preparation`: each service prepares only its parts, once; a prepared directory is a model spec."""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import pytest

from common.preparation import PREPARED_VERSION, PreparedModel, prepare


@pytest.fixture
def tiny_gguf(tmp_path) -> pathlib.Path:
    """A GGUF file with one tensor (the builders below never convert it)."""
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tensor("t", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def recording(part: str, calls: list):
    """A part builder that records its call and writes one file."""

    def build(reader, out: pathlib.Path, name: str) -> None:
        calls.append((part, name, len(reader.tensors)))
        (out / f"{part}.txt").write_text(part)

    return build


def test_each_part_is_built_once_and_only_when_asked_for(tiny_gguf, tmp_path):
    calls: list = []
    cache = tmp_path / "cache"
    tok = prepare(str(tiny_gguf), cache, {"tokenizer": recording("tokenizer", calls)})
    assert calls == [("tokenizer", "tiny", 1)]
    assert tok.kind == "gguf" and tok.name == "tiny" and tok.dir.parent == cache / "prepared"
    assert not (tok.dir / "weights.txt").exists()  # the tokenizer service never builds the worker's part
    both = {"tokenizer": recording("tokenizer", calls), "weights": recording("weights", calls)}
    assert prepare(str(tiny_gguf), cache, both) == tok
    assert calls == [("tokenizer", "tiny", 1), ("weights", "tiny", 1)]
    assert prepare(str(tiny_gguf), cache, both) == tok and len(calls) == 2  # a later start only reads
    assert {p.name for p in tok.dir.glob("READY.*")} == {"READY.tokenizer", "READY.weights"}


def test_a_prepared_directory_is_a_model_spec_and_names_a_missing_part(tiny_gguf, tmp_path):
    calls: list = []
    prepared = prepare(str(tiny_gguf), tmp_path, {"weights": recording("weights", calls)})
    manifest = json.loads((prepared.dir / "prepared.json").read_text())
    assert manifest == {"version": PREPARED_VERSION, "name": "tiny", "kind": "gguf", "source": str(tiny_gguf)}
    # What `gemma-serve up` hands a service: read as it is, even with another cache directory.
    assert prepare(str(prepared.dir), tmp_path / "elsewhere", {"weights": recording("weights", calls)}) == prepared
    with pytest.raises(ValueError, match=r"lacks its tokenizer files.*gemma-serve prepare --model .*tiny\.gguf"):
        prepare(str(prepared.dir), tmp_path, {"tokenizer": recording("tokenizer", calls)})
    assert calls == [("weights", "tiny", 1)]
    # A directory prepared by an earlier release (one READY for every part) still counts as complete.
    (prepared.dir / "READY").write_text(PREPARED_VERSION)
    assert prepare(str(prepared.dir), tmp_path, {"tokenizer": recording("tokenizer", calls)}) == prepared


def test_a_checkpoint_directory_is_read_in_place_and_other_paths_are_refused(tmp_path):
    ckpt = tmp_path / "my-checkpoint"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    assert prepare(str(ckpt), tmp_path, {"weights": None}) == PreparedModel("my-checkpoint", "checkpoint", ckpt)
    with pytest.raises(FileNotFoundError):
        prepare(str(tmp_path / "absent.gguf"), tmp_path, {})
    with pytest.raises(ValueError, match="neither a .gguf file nor a checkpoint directory"):
        prepare(str(tmp_path), tmp_path, {})


def test_up_hands_every_service_the_prepared_directory():
    from gemma_serve.cli import build_parser
    from gemma_serve.launcher import service_commands

    args = build_parser().parse_args(["up"])
    cmds = service_commands(args, "/cache/prepared/model-123")
    assert all(cmd[cmd.index("--model") + 1] == "/cache/prepared/model-123" for cmd in cmds.values())
    assert all(cmd[cmd.index("--model") + 1] == "embedded" for cmd in service_commands(args).values())


def test_the_fast_gguf_reader_reads_what_the_librarys_reads(tmp_path):
    """`open_gguf` (plain ndarray views of the memory map, for speed) gives gguf's own reader's fields, their parts
    and types, and tensors, bit for bit: a string array (a vocabulary), numbers, a quantized-shaped tensor."""
    from common.preparation import open_gguf

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" if i % 7 else "▁é\u00a0" for i in range(3000)])
    writer.add_array("tokenizer.ggml.scores", [float(-i) for i in range(3000)])
    writer.add_uint32("gemma3.block_count", 2)
    writer.add_float32("gemma3.rope.freq_base", 1e4)
    writer.add_string("general.name", "tiny")
    writer.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32))
    writer.add_tensor("blk.0.ffn.weight", np.arange(96, dtype=np.float16).reshape(12, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fast, library = open_gguf(path), gguf.GGUFReader(str(path))
    assert list(fast.fields) == list(library.fields)
    for key, field in library.fields.items():
        mine = fast.fields[key]
        assert mine.types == field.types and mine.data == field.data, key
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), key
    assert [(t.name, t.tensor_type, list(t.shape)) for t in fast.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in library.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, library.tensors, strict=True))
    assert type(fast.tensors[0].data) is np.ndarray and not isinstance(fast.data, np.memmap)
