"""The import layers of docs/architecture.md ("Layers"), checked on the import graph grimp builds from the source.

grimp reads every import statement, those inside functions included, so a lazy import counts like any other:
"never imports" here means on no code path, not merely at start-up.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import grimp
import pytest

PACKAGES = ("gemma_serve", "model_worker", "tokenizer_svc", "gateway", "protos", "families")
LAUNCHER = ("gemma_serve.cli", "gemma_serve.launcher", "gemma_serve.models")
SERVICES = ("model_worker", "tokenizer_svc", "gateway")
# Components from the top down; an import may only point down or stay inside its component. Services may use one
# another's pure-Python parts (the gateway scans JSON prefixes with tokenizer_svc.json_prefix), never in a cycle.
RANKS = {"launcher": 0, "model_worker": 1, "tokenizer_svc": 1, "gateway": 1, "base": 2}
# A model family's package (families/<name>/) splits by part: each part belongs to the service that imports it; the
# registry and the packages' descriptors are base.
FAMILY_PARTS = {"worker": "model_worker", "tokenizer": "tokenizer_svc", "gateway": "gateway"}


def build() -> grimp.ImportGraph:
    """The import graph of our packages, with the external packages they import as leaves."""
    return grimp.build_graph(*PACKAGES, include_external_packages=True, cache_dir=None)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """The import graph, built once for the module's checks."""
    return build()


def component(module: str) -> str:
    """The layer component of one of our modules: the launcher's modules, a service package, or "base" (the rest
    of gemma_serve and protos)."""
    if any(module == m or module.startswith(m + ".") for m in LAUNCHER):
        return "launcher"
    parts = module.split(".")
    if parts[0] == "families":
        return FAMILY_PARTS.get(parts[2], "base") if len(parts) > 2 else "base"
    top = parts[0]
    return top if top in SERVICES else "base"


def component_imports(graph: grimp.ImportGraph) -> dict[tuple[str, str], list[str]]:
    """(importer component, imported component) -> example imports, over every direct import between two of our
    components."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module in graph.modules:
        if module.split(".")[0] not in PACKAGES:
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.split(".")[0] not in PACKAGES:
                continue
            a, b = component(module), component(imported)
            if a != b:
                edges.setdefault((a, b), []).append(f"{module} -> {imported}")
    return edges


@pytest.mark.parametrize("service", SERVICES + ("families",))
def test_services_never_import_the_launcher(graph, service):
    for launcher in LAUNCHER:
        chains = graph.find_shortest_chains(importer=service, imported=launcher, as_packages=True)
        assert not chains, f"{service} reaches {launcher}: {sorted(chains)}"


def _no_jax_importers(graph: grimp.ImportGraph) -> list[str]:
    """The gateway, the tokenizer service and every family's gateway and tokenizer parts (modules or packages)."""
    found = ["gateway", "tokenizer_svc"]
    for module in sorted(graph.modules):
        parts = module.split(".")
        if parts[0] == "families" and len(parts) == 3 and FAMILY_PARTS.get(parts[2]) in ("gateway", "tokenizer_svc"):
            found.append(module)
    return found


def test_gateway_and_tokenizer_never_import_jax(graph):
    importers = _no_jax_importers(graph)
    assert {"families.gemma3.gateway", "families.gemma4.tokenizer"} <= set(importers), importers
    for importer in importers:
        chains = graph.find_shortest_chains(importer=importer, imported="jax", as_packages=True)
        assert not chains, f"{importer} reaches jax: {sorted(chains)}"


def test_imports_only_point_down_and_components_form_no_cycle(graph):
    edges = component_imports(graph)
    upward = {k: v[:3] for k, v in edges.items() if RANKS[k[0]] > RANKS[k[1]]}
    assert not upward, upward
    # Within a rank (the services) there may be imports, but no cycle: a depth-first search over the components.
    successors: dict[str, set[str]] = {}
    for a, b in edges:
        successors.setdefault(a, set()).add(b)

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(successors.get(node, ())):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            found = cycle_from(nxt, path + [nxt])
            if found:
                return found
        return None

    for start in RANKS:
        cycle = cycle_from(start, [start])
        assert cycle is None, (cycle, {pair: edges[pair][:3] for pair in itertools.pairwise(cycle)})
    # The check sees the graph: the launcher does import the services, and they import the base.
    assert ("launcher", "model_worker") in edges and ("tokenizer_svc", "base") in edges


def test_the_checks_catch_a_service_importing_the_launcher():
    """The contracts are not vacuous: an added import from a service to the launcher is reported by all three."""
    graph = build()
    graph.add_import(importer="tokenizer_svc.service", imported="gemma_serve.models")
    assert graph.find_shortest_chains(importer="tokenizer_svc", imported="gemma_serve.models", as_packages=True)
    assert graph.find_shortest_chains(importer="tokenizer_svc", imported="jax", as_packages=True)  # via the models
    assert ("tokenizer_svc", "launcher") in component_imports(graph)


@pytest.mark.slow
def test_a_tokenizer_service_started_alone_prepares_and_loads_without_jax(cache_dir, prepared):
    """At run time too: the tokenizer service's own preparation and loading (the embedded model, its parts already
    built by the session fixture) leave jax out of sys.modules."""
    script = textwrap.dedent(
        f"""
        import pathlib, sys
        from tokenizer_svc.main import load_tokenizer
        tok, template, _ = load_tokenizer("embedded", pathlib.Path({str(cache_dir)!r}))
        assert tok.vocab_size > 0 and template == "gemma3", (tok.vocab_size, template)
        assert "gemma_serve.preparation" in sys.modules
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "model_worker") or m in {LAUNCHER}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
