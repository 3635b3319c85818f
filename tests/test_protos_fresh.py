"""The committed gRPC stubs are exactly what `make protos` generates from protos/*.proto."""

from __future__ import annotations

import pathlib
import shutil

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_generated_stubs_match_proto_sources(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    (tmp_path / "protos").mkdir()
    for src in (REPO / "protos").glob("*.proto"):
        shutil.copy(src, tmp_path / "protos" / src.name)
    args = ["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}"] + [str(p) for p in sorted((tmp_path / "protos").glob("*.proto"))]
    assert protoc.main(args) == 0
    generated = sorted(p.name for p in (tmp_path / "protos").iterdir() if p.suffix in (".py", ".pyi"))
    committed = sorted(p.name for p in (REPO / "protos").iterdir()
                       if p.suffix in (".py", ".pyi") and p.name != "__init__.py")
    assert generated == committed
    stale = [name for name in generated
             if (tmp_path / "protos" / name).read_bytes() != (REPO / "protos" / name).read_bytes()]
    assert not stale, f"stale generated stubs (run `make protos`): {stale}"
