"""One owner per piece of engine state: the scheduler alone changes a `Sequence`, and the prefix cache knows token
ids, salts and slots only, so it never imports the scheduler (docs/architecture.md, "Continuous batching")."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import grimp
import pytest

from model_worker.serving import scheduler
from model_worker.serving.sequence import SamplingSpec, Sequence

MODEL_WORKER = pathlib.Path(scheduler.__file__).parents[1]  # model_worker/
FIELDS = frozenset(f.name for f in dataclasses.fields(Sequence))
#: Methods that change a list, dict or set in place (`seq.output.append(t)` changes the sequence).
MUTATORS = frozenset({"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault",
                      "sort", "reverse", "add", "discard"})


def _fields_of_other(node: ast.AST) -> list[str]:
    """The Sequence fields that `node` names as `<not self>.<field>`, an item of one, or either branch of a
    conditional expression (`(seq.masks if m else seq.forced)[step]`)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.IfExp):
        return _fields_of_other(node.body) + _fields_of_other(node.orelse)
    own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    return [node.attr] if isinstance(node, ast.Attribute) and node.attr in FIELDS and not own else []


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat = []
    while found:  # unpack `a.x, b.y = ...` and starred targets
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found += target.elts
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def field_writes(source: str) -> list[tuple[int, str]]:
    """(line, field) of every place in `source` that assigns, deletes or mutates in place an attribute named like
    a Sequence field on an object other than `self` (a class's own attributes are its business), or sets one with
    `setattr`."""
    writes = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            writes += [(node.lineno, name) for name in _fields_of_other(target)]
        if not isinstance(node, ast.Call):
            continue
        func, args = node.func, node.args
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
            writes += [(node.lineno, name) for name in _fields_of_other(func.value)]
        elif isinstance(func, ast.Name) and func.id == "setattr" and len(args) > 1 \
                and isinstance(args[1], ast.Constant) and args[1].value in FIELDS:
            writes.append((node.lineno, args[1].value))
    return sorted(writes)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """The worker's import graph."""
    return grimp.build_graph("model_worker", cache_dir=None)


def test_only_the_scheduler_changes_sequences(graph):
    """No module that can hold a Sequence writes one of its fields, except scheduler.py: the modules that import
    model_worker.serving.sequence (directly or through the scheduler or the loop), sequence.py itself and the prefix cache.
    (The engine's modules never see a sequence, only slots and token lists; their own arrays may share a field's
    name.)"""
    holders = set(graph.find_downstream_modules("model_worker.serving.sequence"))
    holders |= {"model_worker.serving.sequence", "model_worker.serving.prefix_cache"}
    short = {m.split(".")[-1] for m in holders}
    assert {"scheduler", "loop", "service", "sequence", "prefix_cache"} <= short
    holders.discard("model_worker.serving.scheduler")
    source = lambda module: (MODEL_WORKER.parent.joinpath(*module.split(".")).with_suffix(".py")).read_text()
    writes = {name: field_writes(source(name)) for name in sorted(holders) if name.count(".") >= 2}
    assert {name: found for name, found in writes.items() if found} == {}
    assert field_writes(source("model_worker.serving.scheduler")), "the scan sees the scheduler's own writes"


def test_the_scan_catches_each_kind_of_write():
    """Not vacuous: assignments (tuple and augmented), item writes, in-place mutators and setattr are reported;
    a class's own attributes and reads are not."""
    source = """
seq.num_computed += n
fork.num_computed, fork.clear_penalties = 3, False
(seq.masks if mask else seq.forced)[step] = value
seq.masks[step] = value
seq.output.append(token)
setattr(seq, "snapshot_at", None)
self.slot = 3
x = seq.slot + len(seq.output)
"""
    assert field_writes(source) == [(2, "num_computed"), (3, "clear_penalties"), (3, "num_computed"),
                                    (4, "forced"), (4, "masks"), (5, "masks"), (6, "output"), (7, "snapshot_at")]


def test_a_sequence_takes_no_undeclared_attribute():
    """Sequences are slotted: the loop cannot tag one with a private marker (state lives in declared fields)."""
    seq = Sequence("a", [1, 2], SamplingSpec(), 4, frozenset(), lambda ev: None)
    with pytest.raises(AttributeError):
        seq._queue_observed = True


def test_the_prefix_cache_does_not_import_the_scheduler(graph):
    """The cycle scheduler -> prefix_cache -> scheduler is gone, on every code path (grimp reads every import,
    TYPE_CHECKING ones included)."""
    assert "model_worker.serving.prefix_cache" in graph.find_modules_directly_imported_by("model_worker.serving.scheduler")
    chains = graph.find_shortest_chains(importer="model_worker.serving.prefix_cache", imported="model_worker.serving.scheduler")
    assert chains == set(), chains
