"""The container images (docker/Dockerfile) and the compose file (docker/compose.yaml), checked without a container
runtime (README "Running the services separately").

Statically: every image target runs as the unprivileged user the Kubernetes pods run as (uid/gid 10001, which owns
the /cache volume), has a HEALTHCHECK and runs docker/entrypoint.sh; every package pyproject.toml ships is copied
into the image; compose runs the tokenizer, two workers and a gateway that names both, restarts each, publishes only
the gateway's ports; the command lines the entrypoint builds from its variables parse with the CLI's own parser.

Then each compose service runs as a local process, as Docker would run it: the target's CMD with the environment
the image (ENV) and compose give it, the compose service names translated to 127.0.0.1 and free ports (the
containers' private network namespaces), the `cache` volume a directory owned by the image's user, and the
process under that user's uid/gid (util-linux `setpriv`). The venv's Python lives under /root on the test machines,
so the processes keep one capability, CAP_DAC_READ_SEARCH (read and traverse any file, as the image's files are
readable by its user), and no other: their writes are checked against uid 10001, as in the container. To stay
cheap, the model is the session's prepared embedded model (`gemma-serve prepare` output, which every service
accepts as GEMMA_SERVE_MODEL), the tokenizer and the gateway run until ready (the gateway's /health is 503: no
worker serves), the workers only while they load; then every service gets SIGTERM, as from `docker stop`. The
HEALTHCHECK commands run against them, and against in-process servers for the states this stack does not reach
cheaply (a 200 /health, mutual TLS).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.network import InternalTls
from tests.deploy.test_kubernetes import IMAGE_USER, exact_parser
from tests.e2e.stacks import free_ports, pki
from tests.transport import needs_tcp

pytestmark = pytest.mark.slow  # runs the services as processes: outside `make test-fast`

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
VENV_BIN = pathlib.Path(sys.executable).parent
TARGETS = ("tokenizer", "worker", "gateway")
#: The variables that set each target's listening ports -> the parsed flag they become (docker/entrypoint.sh).
PORT_VARS = {"tokenizer": {"TOKENIZER_PORT": "tokenizer_port"},
             "worker": {"WORKER_PORT": "worker_port", "WORKER_METRICS_PORT": "worker_metrics_port"},
             "gateway": {"HTTP_PORT": "http_port", "GATEWAY_GRPC_PORT": "gateway_grpc_port"}}
#: What the shell running `docker compose up` exports in the local run: the model and the gateway's API keys.
API_KEYS = "test-key-1,test-key-2"
READY_S = 180.0   # most seconds a service may take to listen / get ready here (2 loaded cores)
STOP_S = 60.0     # most seconds a service may take to exit after SIGTERM (no request is running)
WORKER_STOP_S = 10.0  # the same for a worker still loading (it has nothing to drain)


# --- the Dockerfile --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Stage:
    """One FROM stage: its base (an image or an earlier stage) and its instructions (keyword, arguments)."""

    name: str
    base: str
    instructions: list[tuple[str, str]]


def parse_dockerfile(text: str) -> dict[str, Stage]:
    """The stages of a Dockerfile by name (continuation lines joined, comments dropped)."""
    stages: dict[str, Stage] = {}
    logical = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    for line in filter(None, (ln.strip() for ln in logical.splitlines())):
        keyword, _, args = line.partition(" ")
        if keyword.upper() == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args.strip(), re.IGNORECASE)
            stage = stages[m[2] or str(len(stages))] = Stage(m[2] or str(len(stages)), m[1], [])
        else:
            stage.instructions.append((keyword.upper(), args.strip()))
    return stages


def instructions(stages: dict[str, Stage], target: str) -> list[tuple[str, str]]:
    """Every instruction that builds `target`, its base stages' first."""
    out: list[tuple[str, str]] = []
    while target in stages:
        out = stages[target].instructions + out
        target = stages[target].base
    return out


def last(instrs: list[tuple[str, str]], keyword: str) -> str | None:
    """The arguments of the last `keyword` instruction (the one in effect), or None."""
    found = [args for word, args in instrs if word == keyword]
    return found[-1] if found else None


def healthcheck_command(args: str) -> list[str]:
    """The exec-form command of a HEALTHCHECK instruction's arguments (options first, then CMD [...])."""
    _, cmd, command = args.partition("CMD ")
    assert cmd, f"HEALTHCHECK without CMD: {args}"
    return json.loads(command)


def image_files(instrs: list[tuple[str, str]]) -> dict[str, pathlib.Path]:
    """{path in the image: path in the repository} of everything the COPY instructions bring in (build context:
    the repository root), destinations resolved against WORKDIR."""
    files, workdir = {}, "/"
    for word, args in instrs:
        if word == "WORKDIR":
            workdir = os.path.join(workdir, args)
        elif word == "COPY":
            *sources, dest = [a for a in shlex.split(args) if not a.startswith("--")]
            into = dest.endswith("/") or len(sources) > 1  # a file goes into the directory `dest`
            dest = os.path.normpath(os.path.join(workdir, dest))
            for src in sources:  # a directory's contents go into `dest`
                into_dest = into and not (REPO / src).is_dir()
                files[os.path.join(dest, os.path.basename(src)) if into_dest else dest] = REPO / src
    return files


def in_repo(instrs: list[tuple[str, str]], image_path: str) -> pathlib.Path | None:
    """The repository file that lands at `image_path` in the image (None when nothing is copied there)."""
    for dest, src in image_files(instrs).items():
        if image_path == dest or image_path.startswith(dest + "/"):
            return src / os.path.relpath(image_path, dest) if image_path != dest else src
    return None


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse_dockerfile((DOCKER / "Dockerfile").read_text())


def test_targets_run_unprivileged_with_a_healthcheck(stages):
    """Each target runs as uid/gid IMAGE_USER (numeric, so Kubernetes' runAsNonRoot can check it; the pods'
    runAsUser), owns /cache before it becomes a volume, and has a HEALTHCHECK and a CMD that run the repository's
    docker/ scripts for that target."""
    assert set(TARGETS) <= set(stages), f"Dockerfile stages {sorted(stages)}"
    for target in TARGETS:
        instrs = instructions(stages, target)
        assert last(instrs, "USER") == f"{IMAGE_USER}:{IMAGE_USER}", f"{target}: USER {last(instrs, 'USER')}"
        assert last(instrs, "HEALTHCHECK"), f"{target}: no HEALTHCHECK"
        check = healthcheck_command(last(instrs, "HEALTHCHECK"))
        assert check[0] == "python" and check[2:] == [target], f"{target}: HEALTHCHECK {check}"
        assert in_repo(instrs, check[1]) == DOCKER / "healthcheck.py", f"{target}: {check[1]} not copied"
        cmd = json.loads(last(instrs, "CMD"))
        assert cmd[0] == "sh" and cmd[2:] == [target], f"{target}: CMD {cmd}"
        assert in_repo(instrs, cmd[1]) == DOCKER / "entrypoint.sh", f"{target}: {cmd[1]} not copied"
    base = instructions(stages, "tokenizer")
    # Changes to a VOLUME path after the VOLUME instruction are discarded: /cache is created and chowned first.
    assert ("VOLUME", "/cache") in base, "no VOLUME /cache"
    volume = base.index(("VOLUME", "/cache"))
    creating = [i for i, (word, args) in enumerate(base) if word == "RUN" and re.search(r"chown \S+ /cache", args)]
    assert creating and creating[0] < volume, "no RUN chowns /cache before VOLUME /cache"
    run = base[creating[0]][1]
    owner = re.search(r"chown (\S+?)(?::\S+)? /cache", run)[1]
    assert re.search(rf"useradd [^&]*--uid {IMAGE_USER} [^&]*\b{owner}\b", run), f"/cache owner {owner}: {run}"
    assert re.search(r"GEMMA_SERVE_CACHE=/cache\b", last(base, "ENV") or ""), "GEMMA_SERVE_CACHE is not /cache"


def test_image_copies_every_package(stages):
    """Every top-level package pyproject.toml's setuptools `include` lists (families/ too) is in the image before
    `pip install .`, with pyproject.toml and its readme."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {name.split(".")[0] for name in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert "families" in packages
    instrs = instructions(stages, "tokenizer")
    install = instrs.index(("RUN", "pip install ."))
    copied = image_files(instrs[:install])
    workdir = last(instrs[:install], "WORKDIR")
    for name in sorted(packages | {"pyproject.toml", project["project"]["readme"]}):
        assert copied.get(os.path.join(workdir, name)) == REPO / name, f"{name} is not copied to {workdir}/{name}"


# --- the compose file ------------------------------------------------------------------------------------------

def compose() -> dict:
    """docker/compose.yaml (anchors and merge keys resolved by the YAML loader)."""
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def compose_env(service: dict, shell: dict[str, str]) -> dict[str, str]:
    """A service's environment as compose sets it: `${VAR:-default}` interpolated from `shell` (the environment
    `docker compose` runs in), a variable without a value passed through from `shell` (left out when unset)."""
    env = {}
    for key, value in (service.get("environment") or {}).items():
        if value is None:
            if key in shell:
                env[key] = shell[key]
            continue
        env[key] = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: shell.get(m[1]) or m[2], str(value))
    return env


def addresses(value: str) -> list[str]:
    """WORKER_ADDRS as docker/entrypoint.sh splits it (commas or whitespace)."""
    return value.replace(",", " ").split()


def test_compose_two_workers_restarted_only_gateway_published(stages):
    """compose: the tokenizer, two workers of the worker target and the gateway, each restarted by Docker and
    checked by its image's HEALTHCHECK command; only the gateway publishes ports; the gateway's WORKER_ADDRS names
    both worker services and TOKENIZER_ADDR the tokenizer."""
    services = compose()["services"]
    targets = {name: s["build"]["target"] for name, s in services.items()}
    assert sorted(n for n, t in targets.items() if t == "worker") == ["worker-1", "worker-2"], targets
    assert sorted(targets.values()) == ["gateway", "tokenizer", "worker", "worker"], targets
    for name, service in services.items():
        assert service["build"]["dockerfile"] == "docker/Dockerfile" and service["build"]["context"] == ".."
        assert service.get("restart") in ("unless-stopped", "on-failure", "always"), f"{name}: no restart policy"
        check = healthcheck_command(last(instructions(stages, targets[name]), "HEALTHCHECK"))
        assert service["healthcheck"]["test"] == ["CMD", *check], f"{name}: healthcheck {service['healthcheck']}"
        assert "network_mode" not in service and "/cache" in str(service.get("volumes"))
        assert bool(service.get("ports")) == (targets[name] == "gateway"), f"{name}: ports {service.get('ports')}"
    gateway_env = compose_env(services["gateway"], {})
    worker_hosts = sorted(a.rsplit(":", 1)[0] for a in addresses(gateway_env["WORKER_ADDRS"]))
    assert worker_hosts == ["worker-1", "worker-2"], gateway_env
    assert gateway_env["TOKENIZER_ADDR"].rsplit(":", 1)[0] == "tokenizer", gateway_env


# --- the entrypoint's command lines ------------------------------------------------------------------------------

def entrypoint_argv(target: str, env: dict[str, str], tmp_path: pathlib.Path, *flags: str) -> list[str]:
    """The `gemma-serve` arguments docker/entrypoint.sh execs for `target` with `env` (a stub gemma-serve on PATH
    prints them)."""
    stub = tmp_path / "stub" / "gemma-serve"
    if not stub.exists():
        stub.parent.mkdir(parents=True)
        stub.write_text('#!/bin/sh\nprintf "%s\\0" "$@"\n')
        stub.chmod(0o755)
    out = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), target, *flags], env={**env, "PATH": f"{stub.parent}:"
                         "/usr/bin:/bin"}, capture_output=True, text=True, check=True, timeout=30).stdout
    return out.split("\0")[:-1]


def test_entrypoint_builds_the_compose_command_lines(tmp_path):
    """With compose's environment, each service's command line parses with the CLI's exact parser: the target's
    subcommand on 0.0.0.0 with --insecure-internal, and the gateway dials the tokenizer's and both workers' own
    ports by their service names."""
    services = compose()["services"]
    parsed = {name: exact_parser().parse_args(entrypoint_argv(s["build"]["target"], compose_env(s, {}), tmp_path))
              for name, s in services.items()}
    for name, ns in parsed.items():
        assert ns.command == services[name]["build"]["target"] and ns.host == "0.0.0.0" and ns.insecure_internal, ns
        assert ns.model == "embedded" and ns.internal_tls_cert is None, ns
    gateway = parsed["gateway"]
    assert gateway.worker_addr == [f"{w}:{parsed[w].worker_port}" for w in ("worker-1", "worker-2")], gateway
    assert gateway.tokenizer_addr == f"tokenizer:{parsed['tokenizer'].tokenizer_port}", gateway
    assert (gateway.http_port, gateway.gateway_grpc_port) == (8000, 50050)
    assert services["gateway"]["ports"] == ["8000:8000", "50050:50050"]


def test_entrypoint_variables_and_flags(tmp_path):
    """WORKER_ADDRS split on commas and whitespace, one --worker-addr each; TLS and port variables become their
    flags; GEMMA_SERVE_EXTRA_ARGS is split on whitespace (never globbed) and the flags given after the service name
    come last, so they win; an unknown service is a usage error."""
    env = {"WORKER_ADDRS": "w1:1, w2:2\tw3:3", "TOKENIZER_ADDR": "tok:7", "HTTP_PORT": "9000",
           "GEMMA_SERVE_MODEL": "/models/my model", "GEMMA_SERVE_HOST": "10.0.0.2",
           "INTERNAL_TLS_CERT": "/tls/c.pem", "INTERNAL_TLS_KEY": "/tls/k.pem", "INTERNAL_TLS_CA": "/tls/ca.pem",
           "SSL_CERTFILE": "/s/c.pem", "SSL_KEYFILE": "/s/k.pem", "API_KEY_FILE": "/keys.txt",
           "GEMMA_SERVE_EXTRA_ARGS": " --worker-refresh 2  --served-model-name * --cors-origins *"}
    argv = entrypoint_argv("gateway", env, tmp_path, "--served-model-name", "mine too")
    ns = exact_parser().parse_args(argv)
    assert ns.worker_addr == ["w1:1", "w2:2", "w3:3"] and ns.tokenizer_addr == "tok:7" and ns.http_port == 9000
    assert (ns.model, ns.host, ns.insecure_internal) == ("/models/my model", "10.0.0.2", False)
    assert (ns.internal_tls_cert, ns.internal_tls_key, ns.internal_tls_ca) == ("/tls/c.pem", "/tls/k.pem", "/tls/ca.pem")
    assert (ns.ssl_certfile, ns.ssl_keyfile, ns.api_key_file) == ("/s/c.pem", "/s/k.pem", "/keys.txt")
    assert ns.worker_refresh == 2.0 and ns.cors_origins == ["*"] and ns.served_model_name == "mine too"
    worker = exact_parser().parse_args(entrypoint_argv("worker", {"WORKER_PORT": "7", "WORKER_METRICS_PORT": "8",
                                                                  "INSECURE_INTERNAL": "1"}, tmp_path))
    assert (worker.worker_port, worker.worker_metrics_port, worker.insecure_internal) == (7, 8, True)
    bad = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), "up"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert bad.returncode == 2 and "usage" in bad.stderr


# --- running the targets ---------------------------------------------------------------------------------------

AS_ROOT = os.geteuid() == 0
#: Said by every assertion on the processes' user when the image's user could not be taken.
USER_NOTE = "" if AS_ROOT else (f" (tests not run as root: the services ran as the current uid {os.getuid()}, "
                                 f"not the image's {IMAGE_USER})")


def as_image_user(cmd: list[str]) -> list[str]:
    """`cmd` run as the image's user: uid/gid IMAGE_USER, no supplementary groups, CAP_DAC_READ_SEARCH only (see
    the module docstring), SIGTERM when the test process dies. Not root: `cmd` as it is (USER_NOTE says so)."""
    if not AS_ROOT:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.fail(f"running the services as the image's user {IMAGE_USER} needs util-linux's setpriv")
    return ["setpriv", f"--reuid={IMAGE_USER}", f"--regid={IMAGE_USER}", "--clear-groups",
            "--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search", "--pdeathsig=TERM", "--", *cmd]


def owned_dir(path: pathlib.Path) -> pathlib.Path:
    """`path` created, private to the image's user (as /cache in the image)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    if AS_ROOT:
        os.chown(path, IMAGE_USER, IMAGE_USER)
    return path


def run_healthcheck(target: str, env: dict[str, str], check: list[str]) -> tuple[int, str]:
    """(exit status, output) of the target's HEALTHCHECK command `check` (image paths already translated), run as
    Docker runs it: in the container's environment, as its user."""
    done = subprocess.run(as_image_user(check), env=env, capture_output=True, text=True, timeout=30, check=False)
    return done.returncode, done.stdout + done.stderr


@dataclasses.dataclass
class Service:
    """A compose service run as a local process."""

    name: str
    target: str
    env: dict[str, str]
    proc: subprocess.Popen
    log: pathlib.Path
    exit: int | None = None  # its exit status after SIGTERM; None: it had to be killed

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: str, ready, timeout: float = READY_S):
        """Poll `ready()` until it returns something true (returned); fails on exit or timeout with the log."""
        deadline = time.monotonic() + timeout
        while not (result := ready()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{self.name}: no {what} (exit status {self.proc.poll()}):\n{self.text()[-4000:]}")
            time.sleep(0.3)
        return result

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` s for its exit (after SIGTERM); kill it beyond that."""
        try:
            self.exit = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclasses.dataclass
class Run:
    """What the local run of the compose services saw."""

    services: dict[str, Service]
    ids: dict[str, list[str]]          # service -> /proc status Uid and Gid lines while it ran
    cmdlines: dict[str, list[str]]     # service -> the argv its process ended up running (after the exec)
    checks: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)  # HEALTHCHECK results
    gateway_health: tuple[int, dict] = (0, {})  # /health while the workers loaded
    models: dict[str, int] = dataclasses.field(default_factory=dict)  # /v1/models status without / with a key
    worker_addrs: list[str] = dataclasses.field(default_factory=list)


def _http(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


def _grpc_status(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _ids(pid: int) -> list[str]:
    status = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
    return [ln.split(":", 1)[1].split() for ln in status if ln.startswith(("Uid:", "Gid:"))]


@pytest.fixture(scope="module")
def run(stages, prepared, tmp_path_factory) -> Run:
    """The compose services started as local processes (module docstring), observed, then stopped with SIGTERM."""
    needs_tcp()  # the images' services listen on ports, as in their containers
    tmp = tmp_path_factory.mktemp("compose")
    volume = owned_dir(tmp / "volume-cache")  # the named volume `cache`, mounted at /cache in every service
    shell = {"GEMMA_SERVE_MODEL": str(prepared.dir), "GEMMA_SERVE_API_KEY": API_KEYS}
    specs = compose()["services"]
    # Each container has its own network namespace: here every port gets a free one, on loopback.
    local, where = {}, {}  # service -> its environment here; (service, port in its container) -> port here
    for name, spec in specs.items():
        target = spec["build"]["target"]
        instrs = instructions(stages, target)
        image_env = dict(kv.split("=", 1) for kv in shlex.split(last(instrs, "ENV")))
        env = {**image_env, **compose_env(spec, shell), "HOME": str(owned_dir(tmp / f"home-{name}")),
               "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "GEMMA_SERVE_HOST": "127.0.0.1"}
        env = {k: str(volume) + v[len("/cache"):] if v == "/cache" or v.startswith("/cache/") else v
               for k, v in env.items()}
        in_container = exact_parser().parse_args(entrypoint_argv(target, env, tmp))
        ports = dict(zip(PORT_VARS[target], free_ports(len(PORT_VARS[target]))))
        for var, attr in PORT_VARS[target].items():
            where[name, getattr(in_container, attr)] = ports[var]
        local[name] = {**env, **{var: str(port) for var, port in ports.items()}}
    translate = lambda addr: f"127.0.0.1:{where[addr.rsplit(':', 1)[0], int(addr.rsplit(':', 1)[1])]}"
    gateway_env = local["gateway"]
    worker_addrs = [translate(a) for a in addresses(gateway_env["WORKER_ADDRS"])]
    gateway_env.update(TOKENIZER_ADDR=translate(gateway_env["TOKENIZER_ADDR"]), WORKER_ADDRS=",".join(worker_addrs))

    def translated(cmd: list[str], target: str) -> list[str]:  # image paths -> the repository files copied there
        instrs = instructions(stages, target)
        return [str(in_repo(instrs, a)) if a.startswith("/") and in_repo(instrs, a) else a for a in cmd]

    services: dict[str, Service] = {}

    def start(name: str) -> Service:
        target = specs[name]["build"]["target"]
        cmd = translated(json.loads(last(instructions(stages, target), "CMD")), target)
        with open(tmp / f"{name}.log", "w") as out:
            proc = subprocess.Popen(as_image_user(cmd), env=local[name], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        services[name] = Service(name, target, local[name], proc, tmp / f"{name}.log")
        return services[name]

    def observe(s: Service) -> None:  # who it runs as, what it runs, its HEALTHCHECK's verdict
        result.ids[s.name] = _ids(s.proc.pid)
        result.cmdlines[s.name] = pathlib.Path(f"/proc/{s.proc.pid}/cmdline").read_text().split("\0")
        check = healthcheck_command(last(instructions(stages, s.target), "HEALTHCHECK"))
        result.checks[s.name] = run_healthcheck(s.target, s.env, translated(check, s.target))

    result = Run(services, {}, {}, worker_addrs=worker_addrs)
    try:
        # Compose starts the four together; nothing checked here depends on the order, so the workers (whose
        # loading is the heaviest) start once the tokenizer has loaded, to keep the two cores' load low.
        tokenizer, gateway = start("tokenizer"), start("gateway")
        tokenizer.wait_for("SERVING", lambda: _grpc_status(f"127.0.0.1:{tokenizer.env['TOKENIZER_PORT']}")
                           == "SERVING")
        workers = [start(name) for name, spec in specs.items() if spec["build"]["target"] == "worker"]
        for w in workers:
            w.wait_for("'listening' log line", lambda w=w: "model worker listening on" in w.text())
            observe(w)
        url = f"http://127.0.0.1:{gateway.env['HTTP_PORT']}"

        def gateway_sees_loading_workers():
            if dead := [w.name for w in workers if w.proc.poll() is not None]:
                pytest.fail(f"{dead} exited while loading:\n{services[dead[0]].text()[-4000:]}")
            status, body = _http(url + "/health")
            health = json.loads(body) if status else {}
            loading = sorted(health.get("workers", {}).items()) == [(a, "NOT_SERVING") for a in sorted(worker_addrs)]
            return (status, health) if loading else None

        result.gateway_health = gateway.wait_for("/health with both workers loading", gateway_sees_loading_workers)
        for w in workers:  # `docker stop`
            w.proc.send_signal(signal.SIGTERM)
        for s in (tokenizer, gateway):
            observe(s)
        result.models = {"without key": _http(url + "/v1/models")[0],
                         "with key": _http(url + "/v1/models", {"Authorization": "Bearer test-key-2"})[0]}
        for s in (gateway, tokenizer):
            s.proc.send_signal(signal.SIGTERM)
        for s in (gateway, tokenizer):
            s.stop(STOP_S)
        for w in workers:
            w.stop(WORKER_STOP_S)
        return result
    finally:
        for s in services.values():
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()


def test_services_run_as_the_image_user_through_exec(run):
    """Every service's process runs with the image's uid and gid (real, effective, saved, filesystem), and is
    `gemma-serve` itself: the entrypoint exec'd it, so `docker stop`'s SIGTERM reaches the service."""
    expected = str(IMAGE_USER) if AS_ROOT else str(os.getuid())
    for name, (uids, gids) in run.ids.items():
        assert set(uids) == {expected}, f"{name}: uids {uids}{USER_NOTE}"
        assert set(gids) == {expected if AS_ROOT else str(os.getgid())}, f"{name}: gids {gids}{USER_NOTE}"
    assert sorted(run.ids) == sorted(run.services)
    for name, argv in run.cmdlines.items():
        assert argv[1].endswith("/gemma-serve") and argv[2] == run.services[name].target, f"{name}: {argv}"


def test_healthchecks_against_the_running_services(run):
    """The tokenizer's HEALTHCHECK passes once it serves; the workers' fail while they load (NOT_SERVING); the
    gateway's fails with /health's 503 while no worker serves."""
    rc, out = run.checks["tokenizer"]
    assert rc == 0 and "SERVING" in out, out
    for worker in ("worker-1", "worker-2"):
        rc, out = run.checks[worker]
        assert rc == 1 and "NOT_SERVING" in out, f"{worker}: {rc} {out}"
    rc, out = run.checks["gateway"]
    assert rc == 1 and " 503 " in out, out


def test_gateway_routes_to_both_compose_workers(run):
    """The gateway's /health lists both workers of WORKER_ADDRS (translated to their local ports) as loading, and
    answers 503 meanwhile; the API keys compose passes through from the shell guard /v1."""
    status, health = run.gateway_health
    assert status == 503 and health["status"] == "unavailable", health
    assert sorted(health["workers"]) == sorted(run.worker_addrs) and len(set(run.worker_addrs)) == 2, health
    assert run.models == {"without key": 401, "with key": 503}, run.models


def test_sigterm_stops_the_tokenizer_and_the_gateway(run):
    """`docker stop` (SIGTERM): the tokenizer and the gateway drain and exit 0."""
    for name in ("tokenizer", "gateway"):
        assert run.services[name].exit == 0, f"{name}: exit {run.services[name].exit}\n{run.services[name].text()[-3000:]}"


def test_sigterm_reaches_the_loading_workers(run):
    """A worker still loading logs that it stops when SIGTERM arrives (the signal reached gemma-serve)."""
    for worker in ("worker-1", "worker-2"):
        assert "stopping before the engine was ready" in run.services[worker].text(), run.services[worker].text()[-3000:]


def test_sigterm_ends_a_loading_worker(run):
    """A worker still loading exits 0 soon after SIGTERM (it has nothing to drain)."""
    for worker in ("worker-1", "worker-2"):
        assert run.services[worker].exit == 0, f"{worker}: still running {WORKER_STOP_S:.0f} s after SIGTERM"


# --- the HEALTHCHECK script against in-process servers -------------------------------------------------------------

def _healthcheck(target: str, env: dict[str, str]) -> tuple[int, str]:
    check = ["python", str(DOCKER / "healthcheck.py"), target]
    return run_healthcheck(target, {"PATH": f"{VENV_BIN}:/usr/bin:/bin", **env}, check)


def test_grpc_healthcheck_over_mutual_tls(tmp_path_factory):
    """With INTERNAL_TLS_* set, the tokenizer's and worker's check speaks mutual TLS with the service's own
    certificate: SERVING passes; NOT_SERVING, a plain-text check and a server name the certificate does not
    carry fail."""
    needs_tcp()  # the HEALTHCHECK script dials the services' ports
    certs = pki(lambda prefix: tmp_path_factory.mktemp(prefix))
    tls = InternalTls(cert=certs.cert.read_bytes(), key=certs.key.read_bytes(), ca=certs.ca.read_bytes())
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    try:
        env = {"WORKER_PORT": str(port), "INTERNAL_TLS_CERT": str(certs.cert), "INTERNAL_TLS_KEY": str(certs.key),
               "INTERNAL_TLS_CA": str(certs.ca)}
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        rc, out = _healthcheck("worker", env)
        assert rc == 0 and f"worker 127.0.0.1:{port}: SERVING" in out, out
        assert _healthcheck("worker", {**env, "INTERNAL_TLS_SERVER_NAME": "worker-1"})[0] == 1
        assert _healthcheck("worker", {"WORKER_PORT": str(port)})[0] == 1
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        rc, out = _healthcheck("worker", {**env, "INTERNAL_TLS_SERVER_NAME": "localhost"})
        assert rc == 1 and "NOT_SERVING" in out, out
    finally:
        server.stop(0)
    assert _healthcheck("tokenizer", {"TOKENIZER_PORT": str(port)})[0] == 1  # nothing listens
    assert _healthcheck("proxy", {})[0] == 2


def test_gateway_healthcheck_statuses(tmp_path_factory):
    """The gateway's check passes on /health 200 only (over HTTPS, unverified, when SSL_CERTFILE is set), on the
    wildcard bind's loopback address."""
    needs_tcp()  # the HEALTHCHECK script dials the services' ports
    certs = pki(lambda prefix: tmp_path_factory.mktemp(prefix))
    answer = {"status": 200}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok" if answer["status"] == 200 else "unavailable"}).encode()
            self.send_response(answer["status"] if self.path == "/health" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    for secure in (False, True):
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
        env = {"HTTP_PORT": str(httpd.server_address[1]), "GEMMA_SERVE_HOST": "0.0.0.0"}
        if secure:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certs.cert, certs.key)
            httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
            env.update(SSL_CERTFILE=str(certs.cert), SSL_KEYFILE=str(certs.key))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        try:
            answer["status"] = 200
            rc, out = _healthcheck("gateway", env)
            assert rc == 0 and ': 200 {"status": "ok"}' in out, out
            answer["status"] = 503
            rc, out = _healthcheck("gateway", env)
            assert rc == 1 and ": 503 " in out, out
        finally:
            httpd.shutdown()
            httpd.server_close()
