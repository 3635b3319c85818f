"""The narrow views of the backends (gateway/backends/views.py) hold: `Backends` and a request's view have every
member of every view; a function annotated with a view uses no member outside it (read from the source: each
`param.member` inside the function); and only the owners — the process, the app factory and the gRPC servicer,
which make each request's view and hold admission and health — take the whole `Backends`."""

from __future__ import annotations

import ast
import pathlib

from gateway.backends import views
from gateway.backends.clients import Backends, RequestBackends
from gateway.backends.model_facts import ModelFacts

ROOT = pathlib.Path(__file__).resolve().parents[2]
VIEWS = ROOT / "gateway" / "backends" / "views.py"


def view_members() -> dict[str, set[str]]:
    """Each view's members (its annotated attributes and methods, its bases' included), by class name."""
    classes = {node.name: node for node in ast.parse(VIEWS.read_text()).body if isinstance(node, ast.ClassDef)}

    def members(name: str) -> set[str]:
        node = classes[name]
        own = {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)}
        own |= {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                own |= members(base.id)
        return own

    return {name: members(name) for name in classes}


def annotated_uses(source: str, names: set[str]) -> list[tuple[str, str, str, int]]:
    """(function, view, member, line) for each `param.member` in a function whose parameter `param` is annotated
    with one of `names`."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg: a.annotation.id for a in func.args.args + func.args.kwonlyargs
                  if isinstance(a.annotation, ast.Name) and a.annotation.id in names}
        for node in ast.walk(func):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in params:
                found.append((func.name, params[node.value.id], node.attr, node.lineno))
    return found


def gateway_sources() -> list[pathlib.Path]:
    """The gateway's modules."""
    return sorted((ROOT / "gateway").rglob("*.py"))


def _facts(name: str) -> ModelFacts:
    return ModelFacts(name=name, max_model_len=100, vocab_size=10, token_bytes=[b"a"] * 10, special_ids=set(),
                      bos_id=2, stop_ids=[1], architecture="gemma3")


def test_backends_and_a_requests_view_have_every_member_of_every_view():
    backends = Backends("localhost:1", "localhost:2")
    request = RequestBackends(backends)
    for view, members in view_members().items():
        assert hasattr(views, view)
        for member in members:
            assert hasattr(Backends, member) or member in vars(backends), (view, member)
    # A request's view answers every member through `Backends` (`__getattr__`) but the facts, which it pins: its
    # own `ready_facts` keeps the first snapshot when the shared facts are replaced.
    assert "ready_facts" in vars(RequestBackends) and "__getattr__" in vars(RequestBackends)
    backends.facts = first = _facts("first")
    assert request.ready_facts() is first
    backends.facts = _facts("second")
    assert request.ready_facts() is first and backends.ready_facts().name == "second"


def test_a_function_taking_a_view_uses_only_its_members():
    members = view_members()
    uses = 0
    for path in gateway_sources():
        for func, view, member, line in annotated_uses(path.read_text(), set(members)):
            uses += 1
            assert member in members[view], f"{path.relative_to(ROOT)}:{line} {func} uses {member}, not in {view}"
    assert uses > 20  # the check sees the code


def test_the_check_catches_a_member_outside_the_view():
    source = "async def f(backends: TokenizerView):\n    return backends.answers\n"
    [(func, view, member, _)] = annotated_uses(source, set(view_members()))
    assert (func, view, member) == ("f", "TokenizerView", "answers")
    assert member not in view_members()[view]


def test_only_the_owners_take_the_whole_backends():
    takers = set()
    for path in gateway_sources():
        if path.is_relative_to(ROOT / "gateway" / "backends"):
            continue
        for func in ast.walk(ast.parse(path.read_text())):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(isinstance(a.annotation, ast.Name) and a.annotation.id == "Backends" for a in func.args.args):
                    takers.add(str(path.relative_to(ROOT)))
    assert takers == {"gateway/api/app.py", "gateway/api/grpc_service.py"}, takers
