"""The import layers of docs/architecture.md ("Layers"), checked on the import graph grimp builds from the source.

grimp reads every import statement, those inside functions and under `TYPE_CHECKING` included, so a lazy import
counts like any other: "never imports" here means on no code path, not merely at start-up. The services reach a
family's parts by name (`common.families.Family.part`, an `importlib` call), which is what lets the plug-ins sit
above the services they extend.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import grimp
import pytest
from grimp import Layer

from common.families import REGISTERED

#: Top-level packages from the top down. An import may point only down, never up or sideways within a layer: the
#: three services are independent of one another, and what they share lives below them.
LAYERS = (
    Layer("gemma_serve"),  # the launcher: the `gemma-serve` command, `up`, the launcher's model preparation
    Layer("families"),  # model-family plug-ins: each part extends one service through the part type it declares
    Layer("model_worker", "tokenizer_svc", "gateway", independent=True),  # the three services
    Layer("common", "protos", independent=True),  # shared code and the registry / the wire API
)
PACKAGES = tuple(module for layer in LAYERS for module in layer.module_tails)


def build() -> grimp.ImportGraph:
    """The import graph of our packages, with the external packages they import as leaves."""
    return grimp.build_graph(*PACKAGES, include_external_packages=True, cache_dir=None)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """The import graph, built once for the module's checks."""
    return build()


def upward_imports(graph: grimp.ImportGraph) -> list[str]:
    """Every import that breaks `LAYERS`, as "importer -> imported (line)" strings (empty when none does)."""
    found = []
    for dependency in graph.find_illegal_dependencies_for_layers(layers=LAYERS):
        for route in dependency.routes:
            for head in route.heads:
                for tail in route.tails:
                    found.append(f"{head} -> {tail} ({dependency.importer} above {dependency.imported}?)")
    return sorted(found)


def module_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one of our modules (Tarjan's algorithm): each is an import
    cycle."""
    ours = sorted(m for m in graph.modules if m.split(".")[0] in PACKAGES)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for nxt in sorted(graph.find_modules_directly_imported_by(module)):
            if nxt.split(".")[0] not in PACKAGES:
                continue
            if nxt not in index:
                visit(nxt)
                low[module] = min(low[module], low[nxt])
            elif nxt in on_stack:
                low[module] = min(low[module], index[nxt])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in ours:
        if module not in index:
            visit(module)
    return cycles


def test_packages_import_only_downward(graph):
    assert not upward_imports(graph)
    # The check sees the graph: each layer does import the one below it.
    for importer, imported in [("gemma_serve", "model_worker"), ("families", "gateway"), ("gateway", "common"),
                               ("model_worker", "protos")]:
        assert graph.chain_exists(importer=importer, imported=imported, as_packages=True), (importer, imported)


def test_no_import_cycle_between_modules(graph):
    assert module_cycles(graph) == []


#: The model worker's rooms from the top down (model_worker/__init__.py says what each holds): an import points only
#: down; the engine and the checkpoints are independent of each other.
WORKER_ROOMS = (
    Layer("server"),
    Layer("engine", "checkpoints", independent=True),
    Layer("modeling"),
    Layer("numerics"),
    Layer("serving"),  # no JAX: the contract, the scheduler, the loop, the records
)


#: The gateway's rooms from the top down (gateway/__init__.py says what each holds); `main` sits above them all.
GATEWAY_ROOMS = (
    Layer("main"),
    Layer("api"),
    Layer("planning"),
    Layer("generation"),
    Layer("backends"),  # holds the grammar tokenizer it builds from the model facts (structured)
    Layer("structured"),
    Layer("core"),  # the vocabulary every room shares
)


def upward_room_imports(graph: grimp.ImportGraph, service: str = "model_worker") -> list[str]:
    """Every import between one service's rooms (`WORKER_ROOMS` or `GATEWAY_ROOMS`) that breaks their order, as
    "importer -> imported" strings (empty when none does)."""
    rooms = WORKER_ROOMS if service == "model_worker" else GATEWAY_ROOMS
    found = []
    for dependency in graph.find_illegal_dependencies_for_layers(layers=rooms, containers={service}):
        for route in dependency.routes:
            found += [f"{head} -> {tail}" for head in route.heads for tail in route.tails]
    return sorted(found)


def test_the_workers_rooms_import_only_downward_and_serving_never_imports_jax(graph):
    rooms = {module.split(".")[1] for module in graph.modules if module.count(".") >= 2
             and module.startswith("model_worker.")}
    assert rooms == {"server", "engine", "checkpoints", "modeling", "numerics", "serving"}, rooms
    assert not upward_room_imports(graph)
    chains = graph.find_shortest_chains(importer="model_worker.serving", imported="jax", as_packages=True)
    assert not chains, f"model_worker.serving reaches jax: {sorted(chains)}"
    for importer, imported in [("model_worker.server", "model_worker.engine"),
                               ("model_worker.engine", "model_worker.modeling"),
                               ("model_worker.modeling", "model_worker.numerics"),
                               ("model_worker.engine", "model_worker.serving")]:
        assert graph.chain_exists(importer=importer, imported=imported, as_packages=True), (importer, imported)
    # not vacuous: an upward import between rooms is found, and serving importing the engine reaches jax
    graph = build()
    graph.add_import(importer="model_worker.serving.loop", imported="model_worker.engine.engine")
    assert "model_worker.serving.loop -> model_worker.engine.engine" in upward_room_imports(graph)
    assert graph.find_shortest_chains(importer="model_worker.serving", imported="jax", as_packages=True)


def test_the_gateways_rooms_import_only_downward(graph):
    rooms = {module.split(".")[1] for module in graph.modules if module.startswith("gateway.")}
    assert rooms == {"main", "api", "planning", "generation", "structured", "backends", "core"}, rooms
    assert not upward_room_imports(graph, "gateway")
    for importer, imported in [("gateway.api", "gateway.planning"), ("gateway.planning", "gateway.generation"),
                               ("gateway.generation", "gateway.backends"),
                               ("gateway.backends", "gateway.structured"), ("gateway.structured", "gateway.core")]:
        assert graph.chain_exists(importer=importer, imported=imported, as_packages=True), (importer, imported)
    # not vacuous: a room reaching up is found
    graph = build()
    graph.add_import(importer="gateway.structured.constraints", imported="gateway.backends.clients")
    assert "gateway.structured.constraints -> gateway.backends.clients" in upward_room_imports(graph, "gateway")


def test_the_api_doors_folders_import_only_downward(graph):
    """Inside `api/`: its own modules (the app, gRPC `Generate`, the guard) sit above the Messages API, which reuses
    the Responses API's parsing and rendering, which imports neither."""
    top = sorted({m.split(".")[2] for m in graph.modules if m.count(".") == 2 and m.startswith("gateway.api.")}
                 - {"messages", "responses"})
    layers = (Layer(*top, independent=False), Layer("messages"), Layer("responses"))
    found = [f"{d.importer} -> {d.imported}"
             for d in graph.find_illegal_dependencies_for_layers(layers=layers, containers={"gateway.api"})]
    assert not found, found
    assert graph.chain_exists(importer="gateway.api.messages", imported="gateway.api.responses", as_packages=True)
    graph = build()  # not vacuous
    graph.add_import(importer="gateway.api.responses.responses_api", imported="gateway.api.messages.messages_api")
    assert graph.find_illegal_dependencies_for_layers(layers=layers, containers={"gateway.api"})


def test_every_room_says_what_lives_there_and_what_it_may_import():
    """Each folder of the gateway and the worker opens with a docstring (its `__init__.py`) naming what lives
    there and what it may import."""
    root = pathlib.Path(__file__).resolve().parents[1]
    rooms = [d for service in ("gateway", "model_worker") for d in sorted((root / service).rglob("*"))
             if d.is_dir() and any(d.glob("*.py"))] + [root / "gateway", root / "model_worker"]
    assert len(rooms) >= 16, rooms
    for room in rooms:
        init = room / "__init__.py"
        assert init.exists(), init
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80 and "import" in doc.lower(), f"{init.relative_to(root)}: {doc[:80]!r}"


def no_jax_importers() -> list[str]:
    """The gateway, the tokenizer service and every registered family's gateway and tokenizer parts."""
    return ["gateway", "tokenizer_svc"] + [f"{package}.{part}" for package in REGISTERED
                                           for part in ("gateway", "tokenizer")]


def test_gateway_and_tokenizer_never_import_jax(graph):
    for importer in no_jax_importers():
        assert importer in graph.modules, importer
        chains = graph.find_shortest_chains(importer=importer, imported="jax", as_packages=True)
        assert not chains, f"{importer} reaches jax: {sorted(chains)}"


def test_the_checks_catch_an_upward_import_a_cycle_and_jax():
    """The checks are not vacuous: an added import from a service to the launcher, and one from the registry to a
    plug-in, are reported as upward; a service importing another is reported as sideways; an import back is a
    cycle; and the tokenizer service then reaches jax (through the launcher's model preparation)."""
    graph = build()
    graph.add_import(importer="tokenizer_svc.service", imported="gemma_serve.models")
    graph.add_import(importer="common.families", imported="families.gemma3")
    graph.add_import(importer="gateway.planning.planner", imported="model_worker.serving.scheduler")
    found = upward_imports(graph)
    for head in ("tokenizer_svc.service -> gemma_serve.models", "common.families -> families.gemma3",
                 "gateway.planning.planner -> model_worker.serving.scheduler"):
        assert any(line.startswith(head) for line in found), (head, found)
    assert graph.find_shortest_chains(importer="tokenizer_svc", imported="jax", as_packages=True)
    graph = build()
    graph.add_import(importer="common.network", imported="common.families")
    graph.add_import(importer="common.families", imported="common.network")
    assert module_cycles(graph) == [["common.families", "common.network"]]


@pytest.mark.slow
def test_a_tokenizer_service_started_alone_prepares_and_loads_without_jax(cache_dir, prepared):
    """At run time too: the tokenizer service's own preparation and loading (the embedded model, its parts already
    built by the session fixture) leave jax, the worker and the launcher out of sys.modules."""
    script = textwrap.dedent(
        f"""
        import pathlib, sys
        from tokenizer_svc.main import load_tokenizer
        tok, template, _ = load_tokenizer("embedded", pathlib.Path({str(cache_dir)!r}))
        assert tok.vocab_size > 0 and template == "gemma3", (tok.vocab_size, template)
        assert "common.preparation" in sys.modules
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "model_worker", "gemma_serve")))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
