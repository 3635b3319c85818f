"""The engine contract (`model_worker.engine_api.Engine`): the real engine and the test double both implement every
member with the Protocol's exact signatures, and the Protocol declares exactly what the loop's side of the worker
uses of an engine."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import types
import typing

import jax.numpy as jnp
import pytest

from families.gemma3.worker import GEMMA3_270M, gemma3_layers
from model_worker import engine_api
from model_worker.engine import Engine, EngineConfig
from model_worker.params import random_flat, to_device
from tests.fakes import FakeEngine

#: The modules that drive an engine after start-up (model_worker/main.py builds the concrete one).
USERS = ("loop.py", "scheduler.py", "service.py", "metrics.py")
MODEL_WORKER = pathlib.Path(engine_api.__file__).parent


def members(proto: type) -> dict[str, object]:
    """The Protocol's own public members (properties and methods), by name."""
    return {name: value for name, value in vars(proto).items() if not name.startswith("_")}


def nested_protocol(prop: property) -> type | None:
    """The Protocol a property returns, or None when it returns a plain type."""
    hint = typing.get_type_hints(prop.fget)["return"]
    return hint if getattr(hint, "_is_protocol", False) else None


def _conforms(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return isinstance(value, hint)
    return isinstance(value, origin or hint)


def signature_of(function) -> list[tuple[str, inspect._ParameterKind, object]]:
    """(name, kind, default) of every parameter, `self` included; annotations are not compared."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def violations(obj, proto: type, path: str) -> list[str]:
    """How `obj` fails `proto`: missing members, property values of the wrong type (nested Protocols checked
    member by member), methods whose parameters differ in name, kind or default."""
    problems = []
    for name, member in members(proto).items():
        where = f"{path}.{name}"
        if not hasattr(obj, name):
            problems.append(f"{where} is missing")
        elif isinstance(member, property):
            value, inner = getattr(obj, name), nested_protocol(member)
            if inner is not None:
                problems += violations(value, inner, where)
            elif not _conforms(value, typing.get_type_hints(member.fget)["return"]):
                problems.append(f"{where} = {value!r} is not {typing.get_type_hints(member.fget)['return']}")
        elif not callable(getattr(obj, name)):
            problems.append(f"{where} is not a method")
        elif signature_of(getattr(type(obj), name)) != signature_of(member):
            problems.append(f"{where}{inspect.signature(getattr(type(obj), name))} != {inspect.signature(member)}")
    return problems


@pytest.fixture(scope="module")
def real_engine() -> Engine:
    """A real Engine on a tiny random Gemma 3 (nothing compiled: the contract is about its surface)."""
    cfg = dataclasses.replace(GEMMA3_270M, vocab_size=512, hidden_size=256, num_heads=2, embed_scale=16.0,
                              layers=gemma3_layers(2, 128, 1, 512, 1e6, pattern=2), sliding_window=8)
    return Engine(cfg, to_device(cfg, random_flat(cfg), jnp.float32),
                  EngineConfig(num_slots=2, max_model_len=64, prefill_chunks=(8, 32), prefix_slack=4, max_waiting=None))


def test_the_protocol_declares_the_loops_needs():
    """A guard that the contract is the one documented: five methods and two read-only size records."""
    assert set(members(engine_api.Engine)) == {
        "ecfg", "cfg", "dispatch_compute", "dispatch_decode", "dispatch_mixed", "sample", "copy_slot"}
    assert set(members(engine_api.EngineSizes)) == {
        "num_slots", "max_model_len", "prefill_chunks", "prefix_slack", "max_waiting"}
    assert set(members(engine_api.ModelSizes)) == {"vocab_size"}


def test_real_engine_implements_the_protocol(real_engine):
    assert violations(real_engine, engine_api.Engine, "Engine") == []


def test_fake_engine_implements_the_protocol():
    assert violations(FakeEngine(), engine_api.Engine, "FakeEngine") == []


def test_violations_catches_a_renamed_parameter_a_changed_default_and_a_missing_member():
    """The checker is not vacuous: each kind of drift is reported."""

    class Drifted(FakeEngine):
        def dispatch_compute(self, slot, token_ids, start, is_output, clear_penalties=True):  # default changed
            """A drifted double."""

        def copy_slot(self, source, dst):  # parameter renamed
            """A drifted double."""

        def sample(self, pending, sampling, clear_penalties, *, active):  # kind changed
            """A drifted double."""

    drifted = Drifted()
    drifted.cfg = types.SimpleNamespace()  # vocab_size missing
    drifted.ecfg = dataclasses.replace(drifted.ecfg, max_model_len="64")  # wrong type
    problems = violations(drifted, engine_api.Engine, "Drifted")
    flagged = sorted(p.split("(")[0].split(" ")[0] for p in problems)
    assert flagged == ["Drifted.cfg.vocab_size", "Drifted.copy_slot", "Drifted.dispatch_compute",
                       "Drifted.ecfg.max_model_len", "Drifted.sample"]


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
