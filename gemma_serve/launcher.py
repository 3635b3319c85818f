"""`gemma-serve up`: prepare the model once, start the three services, keep them running, drain them on a signal.

The services run as child processes in their own process group (so Ctrl-C reaches only this launcher) and die
with the launcher (PR_SET_PDEATHSIG on Linux). Their logs go to this terminal, each line prefixed with the
service name. `up` is their supervisor: a service that exits is restarted with backoff (the gateway answers 503
meanwhile and recovers on its own); a crash loop stops everything with the reason. On SIGTERM or Ctrl-C it
drains: the gateway first (running requests finish, new ones get 503, up to --drain-timeout), then the worker
and the tokenizer service. `--workers N` runs N model workers (ports from --worker-port up) behind the gateway.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import pathlib
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import network, uds
from common.preparation import check_exists
from gateway.api.auth import ApiKeys, child_env
from gateway.core.limits import limit_args
from gemma_serve.models import prepare

log = logging.getLogger("gemma_serve.up")


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies (Linux only; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def connect_host(host: str) -> str:
    """The address to reach a service bound to `host` from this machine (a wildcard bind is reached on
    loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def service_commands(args: argparse.Namespace, model: str | None = None) -> dict[str, list[str]]:
    """The command line of each service, in start order. `model` is the `--model` they get (`run` passes the
    prepared directory, so they only read its files; default: `args.model`). (API keys go to the gateway through
    its environment: `child_env`.)"""
    base = [sys.executable, "-m", "gemma_serve.cli"]
    common = ["--model", model or args.model, "--cache-dir", args.cache_dir, "--log-level", args.log_level,
              "--drain-timeout", str(args.drain_timeout), *network.internal_args(args)]
    internal = ["--host", args.internal_host]
    engine = ["--max-model-len", str(args.max_model_len), "--num-slots", str(args.num_slots), "--dtype", args.dtype,
              "--matmul-precision", args.matmul_precision,
              "--kv-cache-dtype", args.kv_cache_dtype, "--max-waiting", str(args.max_waiting),
              "--prefix-slack", str(args.prefix_slack), "--max-session-ttl", str(args.max_session_ttl),
              "--lease-preempt-after", str(args.lease_preempt_after), "--slo-policy", args.slo_policy,
              *(a for flag in ("slo_ttft", "slo_tpot") if getattr(args, flag) is not None
                for a in ("--" + flag.replace("_", "-"), str(getattr(args, flag)))),
              "--speculation", args.speculation, "--async-scheduling", args.async_scheduling,
              "--tensor-parallel", str(getattr(args, "tensor_parallel", 1))]
    if args.prefill_token_budget:
        engine += ["--prefill-token-budget", str(args.prefill_token_budget)]
    if args.compile_threads:
        engine += ["--compile-threads", str(args.compile_threads)]
    if not args.serve_first:
        engine += ["--no-serve-first"]
    if args.batch_invariant is not None:
        engine += ["--batch-invariant" if args.batch_invariant else "--no-batch-invariant"]
    if getattr(args, "attention_kernel", "auto") != "auto":
        engine += ["--attention-kernel", args.attention_kernel]
    if getattr(args, "matmul_kernel", "xla") != "xla":
        engine += ["--matmul-kernel", args.matmul_kernel]
    if args.max_draft_tokens is not None:
        engine += ["--max-draft-tokens", str(args.max_draft_tokens)]
    engine += ["--prefill-chunks", *map(str, args.prefill_chunks)]
    if args.tail_chunks is not None:
        engine += ["--tail-chunks", *map(str, args.tail_chunks)]
    addrs = internal_addresses(args)
    gateway = ["--host", args.host, "--http-port", str(args.http_port), "--gateway-grpc-port",
               str(args.gateway_grpc_port), "--tokenizer-addr", addrs["tokenizer"],
               *(a for name in worker_ports(args) for a in ("--worker-addr", addrs[name])),
               "--tokenizer-timeout", str(args.tokenizer_timeout),
               "--worker-timeout", str(args.worker_timeout)]
    for flag in ("ssl_certfile", "ssl_keyfile"):
        if getattr(args, flag, None):
            gateway += ["--" + flag.replace("_", "-"), str(pathlib.Path(getattr(args, flag)).resolve())]
    if args.served_model_name:
        gateway += ["--served-model-name", args.served_model_name]
    gateway += limit_args(args)
    sockets = socket_paths(args)
    if sockets:
        gateway += ["--uds", sockets["api"], "--grpc-uds", sockets["generate"]]
    workers = {name: base + ["worker", *common, *internal, "--worker-port", str(port),
                             "--worker-metrics-port", str(metrics), *engine,
                             *(["--uds", sockets[name], "--metrics-uds", sockets[f"{name}-metrics"]] if sockets else [])]
               for name, (port, metrics) in worker_ports(args).items()}
    return {
        "tokenizer": base + ["tokenizer", *common, *internal, "--tokenizer-port", str(args.tokenizer_port),
                             *(["--uds", sockets["tokenizer"]] if sockets else [])],
        **workers,
        "gateway": base + ["gateway", *common, *gateway],
    }


def socket_paths(args: argparse.Namespace) -> dict[str, str]:
    """{listener: socket path} of `up --uds DIR` (`uds.socket_names`), or {} when the services use ports."""
    folder = getattr(args, "uds", None)
    if not folder:
        return {}
    return {name: os.path.join(os.path.abspath(folder), file)
            for name, file in uds.socket_names(getattr(args, "workers", 1)).items()}


def internal_addresses(args: argparse.Namespace) -> dict[str, str]:
    """{"tokenizer" or a worker's name: the gRPC address the gateway and the health checks reach it at}: unix
    sockets with `--uds`, else host:port on `--internal-host` (a wildcard bind reached on loopback)."""
    sockets = socket_paths(args)
    if sockets:
        return {name: uds.address_of(sockets[name]) for name in ("tokenizer", *worker_ports(args))}
    inner = connect_host(args.internal_host)
    return {"tokenizer": f"{inner}:{args.tokenizer_port}",
            **{name: f"{inner}:{port}" for name, (port, _) in worker_ports(args).items()}}


def worker_ports(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """{service name: (gRPC port, metrics port)} of the `--workers` model workers: "worker" alone, else
    "worker-0", "worker-1", ... on consecutive ports from --worker-port and --worker-metrics-port."""
    n = getattr(args, "workers", 1)
    if n == 1:
        return {"worker": (args.worker_port, args.worker_metrics_port)}
    return {f"worker-{i}": (args.worker_port + i, args.worker_metrics_port + i) for i in range(n)}


def probe_devices() -> tuple[str, int]:
    """(platform, device count) as JAX sees this host, from a short-lived subprocess: the launcher itself never
    imports JAX, which would take hold of the accelerators its workers need (the probe allocates nothing up front
    and exits).

    Raises:
      ValueError: the probe failed (its error output is in the message).
    """
    code = "import jax; print(jax.default_backend(), jax.device_count())"
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                             check=False)
    except subprocess.TimeoutExpired:
        raise ValueError("listing this host's devices took over 300 s (is an accelerator hung?)") from None
    if out.returncode != 0:
        raise ValueError(f"could not list this host's devices: {out.stderr.strip()[-800:]}")
    platform, count = out.stdout.split()[-2:]
    return platform, int(count)


def worker_devices(args: argparse.Namespace, probe=probe_devices) -> dict[str, dict[str, str]]:
    """Environment additions per worker service that give each of `--workers` W its own `--tensor-parallel` N
    devices (one worker: the first N GPUs, without a probe; it checks that it has them).

    On GPUs, worker i sees only devices i*N..i*N+N-1 of those visible to `up` (`CUDA_VISIBLE_DEVICES`, itself
    narrowed from the caller's own), so no worker initialises, or preallocates memory on, another's GPUs. On CPU
    each worker process has its own (simulated) devices: nothing to split. Several workers on one TPU host are
    refused: libtpu gives a host's chips to one process unless its topology variables are set for each, which
    this project has not verified on TPU hardware (run one worker per TPU host, with --tensor-parallel).

    Args:
      probe: () -> (platform, device count) (`probe_devices`; tests pass their own).
    Raises:
      ValueError: W x N exceeds the host's devices (both numbers given), or several workers on a TPU host.
    """
    names = list(worker_ports(args))
    n = getattr(args, "tensor_parallel", 1)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if len(names) == 1:  # its first N GPUs only, with no probe (harmless without CUDA; too few: the worker says so)
        first = (visible or list(map(str, range(n))))[:n]
        return {names[0]: {"CUDA_VISIBLE_DEVICES": ",".join(first)}} if n > 1 else {}
    platform, count = probe()
    if platform == "cpu":
        return {}
    if platform == "tpu":
        raise ValueError(f"--workers {len(names)} on a TPU host is not supported: run one worker per TPU host and "
                         "split the model over its chips with --tensor-parallel")
    if len(names) * n > count:
        raise ValueError(f"--workers {len(names)} x --tensor-parallel {n} needs {len(names) * n} devices; this "
                         f"host has {count} ({platform})")
    visible = visible or list(map(str, range(count)))
    return {name: {"CUDA_VISIBLE_DEVICES": ",".join(visible[i * n:(i + 1) * n])} for i, name in enumerate(names)}


def _grpc_serving(address: str, tls: network.InternalTls | None = None) -> bool:
    try:
        with network.sync_channel(address, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def gateway_health(args: argparse.Namespace) -> tuple[int, dict]:
    """The gateway's /health, over its port or its unix socket: (status code, JSON body); (0, {}) when it does not
    answer. A local liveness probe of our own child: its certificate may name a public host, so it is not
    verified."""
    context = ssl._create_unverified_context() if getattr(args, "ssl_certfile", None) else None
    api = socket_paths(args).get("api")
    try:
        if api:
            status, body = uds.http_get(api, "/health", timeout=2, context=context)
        else:
            try:
                with urllib.request.urlopen(f"{public_url(args)}/health", timeout=2, context=context) as resp:
                    status, body = resp.status, resp.read()
            except urllib.error.HTTPError as err:  # 503 while starting or draining: an answer all the same
                status, body = err.code, err.read()
    except (urllib.error.URLError, OSError):
        return 0, {}
    try:
        data = json.loads(body)
    except ValueError:
        data = {}
    return status, data if isinstance(data, dict) else {}


def public_url(args: argparse.Namespace) -> str:
    """The gateway's base URL as reached from this machine."""
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    host = connect_host(args.host)
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{args.http_port}"


class Launcher:
    """Owns the three child processes."""

    def __init__(self, args: argparse.Namespace):
        """
        Raises:
          ValueError: for a refused network setting or API key (the message names the flag), or workers that
            do not fit the host's devices (`worker_devices`).
        """
        self.args = args
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = False
        self.tls = network.InternalTls.from_args(args)
        if getattr(args, "uds", None):  # every service on a socket in a private folder: no port, no host to check
            args.uds = str(uds.private_dir(args.uds))
            for path in socket_paths(args).values():
                uds.check_path(path)  # a stale socket replaced, a live stack's refused: before anything starts
        else:
            network.check_internal_host(args.internal_host, self.tls, args.insecure_internal)
        network.public_server_credentials(args)  # both files given and readable
        ApiKeys.from_args(args)  # valid keys
        self.env = child_env(args, os.environ)
        self.worker_env = worker_devices(args)  # each worker's own devices

    def start(self, model: str | None = None) -> None:
        """Start every service, serving `model` (a model spec or a prepared directory; default: the `--model`
        flag, which each service prepares for itself, waiting for whoever prepares it first)."""
        self.cmds = service_commands(self.args, model)
        for name in self.cmds:
            self.spawn(name)

    def spawn(self, name: str) -> None:
        """Start (or restart) one service."""
        env = self.env if name == "gateway" else {k: v for k, v in self.env.items() if k != "GEMMA_SERVE_API_KEY"}
        env = {**env, **self.worker_env.get(name, {})}
        self.procs[name] = subprocess.Popen(self.cmds[name], start_new_session=True, preexec_fn=_die_with_parent,
                                            env=env)
        log.info("started %s (pid %d)", name, self.procs[name].pid)

    def dead(self) -> list[str]:
        """Services whose process has exited."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def health(self) -> dict[str, bool]:
        """Whether each service answers healthy."""
        status = {name: _grpc_serving(addr, self.tls) for name, addr in internal_addresses(self.args).items()}
        status["gateway"] = gateway_health(self.args)[0] == 200
        return status

    def stop(self) -> None:
        """Drain and stop: SIGTERM the gateway and wait for it (it finishes its running requests within
        --drain-timeout), then the worker and the tokenizer service; SIGKILL whatever outlives its grace."""
        grace = self.args.drain_timeout + 10
        for group in (("gateway",), (*worker_ports(self.args), "tokenizer")):
            procs = [(n, self.procs[n]) for n in group if n in self.procs and self.procs[n].poll() is None]
            for _, proc in procs:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for name, proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", name, grace)
                    proc.kill()
                    proc.wait()


class Restarts:
    """When to restart a crashed service: after 1, 2, 4, ... up to 30 s, and not at all after `MAX_CRASHES`
    crashes within `WINDOW_S` seconds (a crash loop: stop and say why)."""

    MAX_CRASHES, WINDOW_S, MAX_DELAY_S = 5, 300.0, 30.0

    def __init__(self):
        self.crashes: dict[str, list[float]] = {}

    def delay(self, name: str, now: float) -> float | None:
        """Record a crash of `name` at `now`; the seconds to wait before restarting it, or None to give up."""
        recent = [t for t in self.crashes.get(name, []) if now - t < self.WINDOW_S] + [now]
        self.crashes[name] = recent
        if len(recent) > self.MAX_CRASHES:
            return None
        return min(self.MAX_DELAY_S, 2.0 ** (len(recent) - 1))


def run(args: argparse.Namespace) -> int:
    """Entry point of `gemma-serve up`. Returns 0 after a clean stop, 1 if a service failed, 2 for refused
    flags (checked before the model is prepared) or a model spec that is no model (a missing path, a directory
    that is not one)."""
    t0 = time.perf_counter()
    try:
        launcher = Launcher(args)
        check_exists(args.model)  # a typo in the path: refused before any service starts
    except (ValueError, FileNotFoundError) as err:
        log.error("%s", err)
        return 2
    # The services start at once, on the model spec itself: each imports its libraries (JAX alone takes seconds on
    # a new machine) and then prepares the parts it reads, which waits on the prepared directory's lock while this
    # process builds them — so a first start's preparation overlaps the services' own start (docs/performance.md,
    # "The first minute").
    launcher.start()
    try:
        log.info("checking the prepared files of model %r (built on the first start only)", args.model)
        prepared = prepare(args.model, pathlib.Path(args.cache_dir))
    except (FileNotFoundError, ValueError) as err:  # a model spec this command cannot serve: one line, exit 2
        launcher.stop()
        log.error("%s", err)
        return 2
    except BaseException:
        launcher.stop()
        raise
    log.info("model files ready in %s (%.1f s)", prepared.dir, time.perf_counter() - t0)

    def on_signal(signum, frame):
        launcher.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = _supervise(launcher, args, t0)
    log.info("stopping services")
    launcher.stop()
    log.info("stopped")
    return code


def _supervise(launcher: Launcher, args: argparse.Namespace, t0: float) -> int:
    """Wait for health, then keep the services running until a signal: a service that exits is restarted with
    backoff (`Restarts`); one that refuses its flags (exit 2) or crash-loops stops everything. Returns the exit
    code of `up`."""
    ready, last, full_speed, next_check = False, {}, False, 0.0
    deadline = time.monotonic() + args.ready_timeout
    restarts, pending = Restarts(), {}
    while not launcher.stopping:
        now = time.monotonic()
        for name in launcher.dead():
            if name in pending:
                continue
            code = launcher.procs[name].returncode
            delay = None if code == 2 else restarts.delay(name, now)
            if delay is None:
                why = "refused its flags" if code == 2 else f"crashed {Restarts.MAX_CRASHES + 1} times in " \
                    f"{Restarts.WINDOW_S:.0f} s"
                log.error("%s exited (code %s) and %s; stopping", name, code, why)
                return 1
            log.error("%s exited (code %s); restarting it in %.0f s", name, code, delay)
            pending[name] = now + delay
        for name, when in list(pending.items()):
            if now >= when:
                del pending[name]
                launcher.spawn(name)
        if not ready:
            status = launcher.health()
            if status != last:
                log.info("health: %s", ", ".join(f"{k} {'ok' if v else 'starting'}" for k, v in status.items()))
                last = status
            if all(status.values()):
                ready = True
                compiling = gateway_health(args)[1].get("programs_compiling") or 0
                if compiling:
                    log.info("serving while %d programs compile in the background (the same answers; full speed "
                             "once they are done)", compiling)
                sockets = socket_paths(args)
                if sockets:
                    scheme = "https" if args.ssl_certfile else "http"
                    log.info("ready in %.1f s: OpenAI API on the unix socket %s (gRPC Generate on %s); try: curl "
                             "--unix-socket %s %s://localhost/v1/models. Ctrl-C stops.", time.perf_counter() - t0,
                             sockets["api"], sockets["generate"], sockets["api"], scheme)
                    print(f"gemma-serve is ready: unix:{sockets['api']} ({scheme}://localhost/v1)", flush=True)
                else:
                    url = public_url(args)
                    log.info("ready in %.1f s: OpenAI API at %s/v1 (gRPC Generate at %s:%d). Ctrl-C stops.",
                             time.perf_counter() - t0, url, args.host, args.gateway_grpc_port)
                    print(f"gemma-serve is ready: {url}/v1", flush=True)
            elif time.monotonic() > deadline:
                log.error("services not healthy after %.0f s", args.ready_timeout)
                return 1
        elif not full_speed and now >= next_check:  # the workers compile the rest of their grids while serving
            next_check = now + 2.0
            status, body = gateway_health(args)
            if status == 200 and body.get("programs_compiling") == 0:
                full_speed = True
                log.info("full speed in %.1f s: every worker has compiled its whole grid", time.perf_counter() - t0)
        time.sleep(0.2)
    return 0
