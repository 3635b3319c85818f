"""The engine contract (`model_worker.serving.engine_api.Engine`): a type checker (mypy) holds the real engine and the test
double to the Protocol's exact signatures, and the Protocol declares exactly what the loop's side of the worker
uses of an engine."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import typing

from model_worker.serving import engine_api

REPO = pathlib.Path(__file__).resolve().parents[2]

#: The modules that drive an engine after start-up (model_worker/server/main.py builds the concrete one).
USERS = ("serving/loop.py", "serving/scheduler.py", "server/service.py", "server/metrics.py")
MODEL_WORKER = pathlib.Path(engine_api.__file__).parents[1]


def members(proto: type) -> dict[str, object]:
    """The Protocol's own public members (properties and methods), by name."""
    return {name: value for name, value in vars(proto).items() if not name.startswith("_")}


def nested_protocol(prop: property) -> type | None:
    """The Protocol a property returns, or None when it returns a plain type."""
    hint = typing.get_type_hints(prop.fget)["return"]
    return hint if getattr(hint, "_is_protocol", False) else None


def mypy(*paths: pathlib.Path) -> tuple[int, list[str]]:
    """Run mypy (the project's configuration: pyproject.toml) on `paths`; (exit status, error lines)."""
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--no-error-summary",
                          *map(str, paths)], capture_output=True, text=True, cwd=REPO, timeout=600, check=False)
    return out.returncode, [line for line in out.stdout.splitlines() if ": error:" in line]


DRIFTED = '''
from __future__ import annotations

import dataclasses

from model_worker.serving import engine_api
from model_worker.serving.engine_api import PromptChunk
from tests.fakes import FakeEngine


class WrongArgumentType(FakeEngine):
    def dispatch_compute(self, *, chunk: list[int]):  # type: ignore[override]
        return super().dispatch_compute(chunk=PromptChunk(0, chunk, 0, [False] * len(chunk)))


class RenamedParameter(FakeEngine):
    def copy_slot(self, *, source: int, dst: int) -> None:  # type: ignore[override]
        pass


class MissingMember(FakeEngine):
    dispatch_mixed = None  # type: ignore[assignment]


def positional() -> engine_api.Engine:
    return WrongArgumentType()  # drift


def renamed() -> engine_api.Engine:
    return RenamedParameter()  # drift


def missing() -> engine_api.Engine:
    return MissingMember()  # drift


@dataclasses.dataclass(frozen=True)
class BadSizes:
    num_slots: int
    max_model_len: str
    prefill_chunks: tuple[int, ...]
    prefix_slack: int
    max_waiting: int | None


def bad_sizes(sizes: BadSizes) -> engine_api.EngineSizes:
    return sizes  # drift
'''


def test_the_protocol_declares_the_loops_needs():
    """A guard that the contract is the one documented: thirteen methods and two read-only size records."""
    assert set(members(engine_api.Engine)) == {
        "ecfg", "cfg", "dispatch_compute", "dispatch_decode", "dispatch_mixed", "sample", "dispatch_verify",
        "sample_verify", "copy_slot", "step_programs", "can_verify", "adopt_programs", "store_deferred",
        "sample_async", "dispatch_decode_after"}
    assert set(members(engine_api.EngineSizes)) == {
        "num_slots", "max_model_len", "prefill_chunks", "reuse_slack", "max_draft_tokens", "max_verify_batch",
        "max_waiting"}
    assert set(members(engine_api.ModelSizes)) == {"vocab_size"}


def test_the_type_checker_holds_both_engines_to_the_protocol_and_catches_drift(tmp_path):
    """mypy finds no error in the conformance module (the JAX engine and the test double are `engine_api.Engine`s)
    and one error at each drifted engine: a parameter of another type, a renamed parameter, a missing method, a
    size of the wrong type."""
    drifted = REPO / "tests" / "model_worker" / f"_drifted_{os.getpid()}.py"
    drifted.write_text(DRIFTED)
    try:
        status, errors = mypy(REPO / "tests" / "model_worker" / "engine_conformance.py", drifted)
    finally:
        drifted.unlink()
    assert status == 1, errors
    assert not [e for e in errors if "engine_conformance" in e], errors
    lines = sorted(int(e.split(":")[1]) for e in errors if drifted.name in e)
    assert lines == [n for n, line in enumerate(DRIFTED.splitlines(), 1) if line.endswith("# drift")], errors


def _engine_expr(node: ast.AST) -> bool:
    """`engine` or `<anything>.engine` (the loop's `self.engine`, the metrics' `loop.engine`)."""
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine")


def engine_uses() -> tuple[set[str], dict[str, set[str]]]:
    """What the engine's users read of it: its members, and per member the attributes read of that member's value
    (through `engine.ecfg.X` or a local alias `ecfg = loop.engine.ecfg; ecfg.X`)."""
    top: set[str] = set()
    nested: dict[str, set[str]] = {}
    for name in USERS:
        tree = ast.parse((MODEL_WORKER / name).read_text())
        aliases = {
            target.id: node.value.attr
            for node in ast.walk(tree) if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Attribute) and _engine_expr(node.value.value)
            for target in node.targets if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if _engine_expr(node.value):
                top.add(node.attr)
            inner = node.value
            if isinstance(inner, ast.Attribute) and _engine_expr(inner.value):
                nested.setdefault(inner.attr, set()).add(node.attr)
            elif isinstance(inner, ast.Name) and inner.id in aliases:
                nested.setdefault(aliases[inner.id], set()).add(node.attr)
    return top, nested


def test_the_protocol_covers_exactly_what_the_engines_users_read():
    """Every engine member the loop, scheduler, service and metrics use is declared, and nothing more; likewise
    for the attributes they read of `ecfg` and `cfg`."""
    top, nested = engine_uses()
    assert top == set(members(engine_api.Engine))
    for name, member in members(engine_api.Engine).items():
        inner = nested_protocol(member) if isinstance(member, property) else None
        if inner is not None:
            assert nested.get(name, set()) == set(members(inner)), name
    assert set(nested) <= {n for n, m in members(engine_api.Engine).items() if isinstance(m, property)}
