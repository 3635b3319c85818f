"""The real stacks the end-to-end tests drive: `gemma-serve up` (three processes) on free ports, one per family of
e2e modules, each compiling only the programs its tests use.

A stack's worker spends most of its start-up compiling (about a minute for the embedded model on 2 cores), on one
core. So the stacks a test session needs are launched early (`launch_needed`, from the first e2e fixture, or the
session's first test in a serial run), one after another in the background while the unit tests run
(tests/plugins/scheduling.py), and each e2e fixture only waits until its own stack is healthy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.transport import tcp_available

REPO = pathlib.Path(__file__).resolve().parents[2]
GEMMA4_TEMPLATE = REPO / "tests" / "tokenizer_svc" / "data" / "gemma4_chat_template.jinja"
MAX_MODEL_LEN = 512  # the embedded stack's --max-model-len: one KV bucket (the sliding window)
FUZZ_MAX_TOKENS = 4   # the fuzz stack's --max-tokens-cap
FAULT_SALT = "test-fault-injection"  # the embedded stack's worker fails the step of requests with this cache_salt


#: The stacks that serve over unix sockets (`up --uds`) on a host with TCP: the embedded one, so that every e2e
#: test through it (streaming, cancellation, the drain, the faults) crosses the sockets, and its internal links
#: run mutual TLS over them. The other stacks keep their ports; on a host without TCP every stack uses sockets.
UDS_STACKS = ("stack",)


def uses_uds(name: str) -> bool:
    """Whether the stack `name` serves over unix sockets on this host."""
    return name in UDS_STACKS or not tcp_available()


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (n made-up numbers on a host without TCP: the port flags are then
    unused, every listener being a unix socket)."""
    if not tcp_available():
        return list(range(1, n + 1))
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@dataclasses.dataclass(frozen=True)
class Pki:
    """A throwaway CA (made with trustme) and one certificate it signed for 127.0.0.1 and localhost, as PEM files:
    every process of a TLS stack presents it and trusts the CA."""

    ca: pathlib.Path
    cert: pathlib.Path
    key: pathlib.Path

    def internal_flags(self) -> list[str]:
        """`gemma-serve` flags for mutual TLS on the internal links."""
        return ["--internal-tls-cert", str(self.cert), "--internal-tls-key", str(self.key),
                "--internal-tls-ca", str(self.ca)]

    def public_flags(self) -> list[str]:
        """`gemma-serve` flags for TLS on the gateway's public ports."""
        return ["--ssl-certfile", str(self.cert), "--ssl-keyfile", str(self.key)]

    def internal_tls(self):
        """The client side of the internal links' mutual TLS (`common.network.InternalTls`)."""
        from common.network import InternalTls

        return InternalTls(self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes())


_PKI: list[Pki] = []


def pki(tmp) -> Pki:
    """The session's test CA and certificate (made on first use)."""
    if not _PKI:
        import trustme

        d = tmp("pki")
        ca = trustme.CA()
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        ca.cert_pem.write_to_path(str(d / "ca.pem"))
        leaf.private_key_pem.write_to_path(str(d / "key.pem"))
        leaf.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
        for pem in leaf.cert_chain_pems[1:]:
            pem.write_to_path(str(d / "cert.pem"), append=True)
        _PKI.append(Pki(d / "ca.pem", d / "cert.pem", d / "key.pem"))
    return _PKI[0]


@dataclasses.dataclass
class Stack:
    """A `gemma-serve up` process (or a gateway in front of another stack's backends), its addresses and (for a
    checkpoint stack) its reference model. `ca` is set when its public ports speak TLS."""

    proc: subprocess.Popen
    ports: dict[str, int]
    log_path: pathlib.Path
    started: float
    reference: object = None
    startup_s: float = 0.0
    healthy: bool = False
    ca: pathlib.Path | None = None
    internal: Pki | None = None
    #: {listener: socket path} when the stack serves over unix sockets ("api", "generate", "tokenizer", "worker",
    #: "worker-metrics": `common.uds.socket_names`), else None (its `ports`).
    sockets: dict[str, str] | None = None

    # ----- where it listens, and clients that reach it (over its port or its unix socket alike) --------------------
    @property
    def base_url(self) -> str:
        """The REST API's base URL; over a unix socket the host is "localhost" and the clients below carry the
        socket (`http`, `openai`, ...): use them rather than a bare URL."""
        scheme = "https" if self.ca else "http"
        return f"{scheme}://localhost" if self.sockets else f"{scheme}://127.0.0.1:{self.ports['http']}"

    def ssl_context(self):
        """An SSL context trusting the stack's CA (None for a plain-HTTP stack)."""
        import ssl

        return ssl.create_default_context(cafile=str(self.ca)) if self.ca else None

    def transport(self, asynchronous: bool = False):
        """An httpx transport to the REST API's unix socket (trusting the stack's CA), or None over TCP."""
        import httpx

        if not self.sockets:
            return None
        cls = httpx.AsyncHTTPTransport if asynchronous else httpx.HTTPTransport
        return cls(uds=self.sockets["api"], verify=self.ssl_context() or True)

    def http(self, **kwargs):
        """An `httpx.Client` on the REST API (base_url set; its socket and CA when it has them)."""
        import httpx

        kwargs.setdefault("base_url", self.base_url)
        transport = self.transport()
        if transport is None:
            kwargs.setdefault("verify", self.ssl_context() or True)
        return httpx.Client(transport=transport, **kwargs)

    def async_http(self, **kwargs):
        """An `httpx.AsyncClient` on the REST API (as `http`)."""
        import httpx

        kwargs.setdefault("base_url", self.base_url)
        transport = self.transport(asynchronous=True)
        if transport is None:
            kwargs.setdefault("verify", self.ssl_context() or True)
        return httpx.AsyncClient(transport=transport, **kwargs)

    def sdk_http(self, asynchronous: bool = False, timeout: float = 300):
        """The HTTP client the official SDKs take (`http_client`), on the stack's port or socket: theirs is
        `httpx2` (anthropic refuses an `httpx` one), where installed, else `httpx`."""
        try:
            import httpx2 as hx
        except ImportError:
            import httpx as hx
        verify = self.ssl_context() or True
        if self.sockets:
            transport = (hx.AsyncHTTPTransport if asynchronous else hx.HTTPTransport)(uds=self.sockets["api"],
                                                                                      verify=verify)
            return (hx.AsyncClient if asynchronous else hx.Client)(transport=transport, timeout=timeout)
        return (hx.AsyncClient if asynchronous else hx.Client)(verify=verify, timeout=timeout)

    def openai(self, api_key: str = "unused", timeout: float = 300, **kwargs):
        """The official `openai.OpenAI` client on the stack (no retries)."""
        import openai

        kwargs.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, timeout=timeout,
                             http_client=self.sdk_http(timeout=timeout), **kwargs)

    def async_openai(self, api_key: str = "unused", timeout: float = 300, **kwargs):
        """The official `openai.AsyncOpenAI` client on the stack (no retries)."""
        import openai

        kwargs.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=api_key, timeout=timeout,
                                  http_client=self.sdk_http(asynchronous=True, timeout=timeout), **kwargs)

    def anthropic(self, api_key: str = "unused", timeout: float = 300, **kwargs):
        """The official `anthropic.Anthropic` client on the stack (no retries)."""
        import anthropic

        kwargs.setdefault("max_retries", 0)
        return anthropic.Anthropic(base_url=self.base_url, api_key=api_key, timeout=timeout,
                                   http_client=self.sdk_http(timeout=timeout), **kwargs)

    def get(self, path: str, timeout: float = 30) -> tuple[int, bytes]:
        """GET `path` from the REST API: (status, body); (0, b"") when nothing answers."""
        import httpx

        try:
            with self.http(timeout=timeout) as c:
                r = c.get(path)
                return r.status_code, r.content
        except httpx.HTTPError:
            return 0, b""

    def worker_metrics(self, timeout: float = 30) -> str:
        """The worker's Prometheus text (/metrics on its metrics port or socket)."""
        import httpx

        transport = httpx.HTTPTransport(uds=self.sockets["worker-metrics"]) if self.sockets else None
        base = "http://localhost" if self.sockets else f"http://127.0.0.1:{self.ports['metrics']}"
        with httpx.Client(transport=transport, timeout=timeout) as c:
            return c.get(base + "/metrics").text

    @property
    def grpc_addr(self) -> str:
        """The gateway's gRPC Generate address (host:port, or unix:PATH)."""
        return f"unix:{self.sockets['generate']}" if self.sockets else f"127.0.0.1:{self.ports['grpc']}"

    def address(self, service: str) -> str:
        """The gRPC address of the stack's "tokenizer" or "worker" service (host:port, or unix:PATH)."""
        return f"unix:{self.sockets[service]}" if self.sockets else f"127.0.0.1:{self.ports[service]}"

    def internal_channel(self, service: str):
        """A blocking gRPC channel to the stack's "tokenizer" or "worker" service, over its internal links' mutual
        TLS when it has them (a test then talks to it as the gateway does)."""
        from common.network import sync_channel

        return sync_channel(self.address(service), self.internal.internal_tls() if self.internal else None)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 900) -> "Stack":
        """Block until /health is 200 (fails the test on exit or timeout)."""
        if not self.poll_healthy(timeout):
            if self.proc.poll() is not None:
                pytest.fail(f"gemma-serve up exited with {self.proc.returncode}:\n{self.log()[-5000:]}")
            self.proc.kill()
            pytest.fail(f"stack not healthy in time:\n{self.log()[-5000:]}")
        return self

    def poll_healthy(self, timeout: float = 900) -> bool:
        """Wait until /health is 200 with every program of the workers' grids compiled (True: the tests see a
        worker at full speed, whose step counters and compilations do not move with its background compiles),
        the process exits or `timeout` seconds pass (False). With GEMMA_SERVE_TEST_SERVE_FIRST=1, /health's 200
        alone (the worker serving while it compiles): for a device lane that reruns a fault test whose stack
        would otherwise spend its whole time limit reaching full speed (~4-5 minutes on a TPU v5e)."""
        deadline = time.monotonic() + timeout
        serve_first = os.environ.get("GEMMA_SERVE_TEST_SERVE_FIRST") == "1"
        while not self.healthy:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            status, body = self.health()
            if status == 200 and (serve_first or body.get("programs_compiling", 0) == 0):
                self.healthy, self.startup_s = True, time.monotonic() - self.started
                break
            time.sleep(0.5)
        return True

    def service_pid(self, service: str) -> int:
        """The pid of one of this `up`'s services ("gateway", "worker", "tokenizer")."""
        import psutil

        for child in psutil.Process(self.proc.pid).children():
            cmd = child.cmdline()
            if "gemma_serve.cli" in cmd and service in cmd:
                return child.pid
        raise LookupError(f"no running {service} under pid {self.proc.pid}")

    def health_status(self) -> int:
        """The gateway's /health status code (0 when it does not answer)."""
        return self.health()[0]

    def health(self) -> tuple[int, dict]:
        """The gateway's /health: (status code, JSON body); (0, {}) when it does not answer."""
        try:
            if self.sockets:
                from common.uds import http_get

                status, body = http_get(self.sockets["api"], "/health", timeout=2, context=self.ssl_context())
            else:
                try:
                    with urllib.request.urlopen(self.base_url + "/health", timeout=2,
                                                context=self.ssl_context()) as resp:
                        status, body = resp.status, resp.read()
                except urllib.error.HTTPError as err:
                    status, body = err.code, err.read()
        except OSError:
            return 0, {}
        try:
            return status, json.loads(body)
        except ValueError:
            return status, {}

    def stop(self) -> None:
        """SIGTERM and wait; a stack that does not stop within 60 s fails the session."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail("gemma-serve up did not stop within 60 s of SIGTERM")


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, even killed (its launcher then stops the services)."""
    from gemma_serve.launcher import _die_with_parent as die

    die()


def socket_dir(log_path: pathlib.Path) -> pathlib.Path:
    """A private folder for a stack's sockets beside its log (pytest's temporary folders are short enough for
    `sun_path`)."""
    d = log_path.parent / "uds"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def start_stack(cache_dir: pathlib.Path, log_path: pathlib.Path, extra: list[str], env: dict | None = None,
                uds: bool = False) -> Stack:
    """Launch `gemma-serve up` on free ports (or, with `uds`, on unix sockets in a folder beside `log_path`: `up
    --uds`) with `extra` flags (and `env` added to the environment); returns at once (see Stack.wait_healthy)."""
    from common.uds import socket_names

    http, grpc_port, tok, worker, metrics = free_ports(5)
    cmd = [
        sys.executable, "-m", "gemma_serve.cli", "up", "--cache-dir", str(cache_dir),
        "--http-port", str(http), "--gateway-grpc-port", str(grpc_port), "--tokenizer-port", str(tok),
        "--worker-port", str(worker), "--worker-metrics-port", str(metrics), *extra,
    ]
    sockets = None
    if uds:
        folder = socket_dir(log_path)
        cmd += ["--uds", str(folder)]
        sockets = {name: str(folder / file) for name, file in socket_names().items()}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=_die_with_parent,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    ports = {"http": http, "grpc": grpc_port, "tokenizer": tok, "worker": worker, "metrics": metrics}
    return Stack(proc, ports, log_path, time.monotonic(), sockets=sockets)


def _embedded(cache_dir, prepared, tmp, factory) -> Stack:
    """The embedded Gemma 3 270M: max_model_len 512 (= the sliding window: one KV bucket), 4 slots, 64-token chunks
    only (the OpenAI API, sampling, tools, agent tests; 14 programs: the chunk-size and bucket policies, and
    conversations beyond the window, are the worker's unit tests' business; no tail chunks either). Its internal
    links use mutual TLS with the test CA, so every e2e test through it crosses them; requests with `FAULT_SALT`
    make its worker fail (tests/e2e/test_faults.py, which runs last, breaks and finally stops this stack)."""
    from model_worker.serving.loop import FAULT_ENV

    s = start_stack(cache_dir, tmp("stack") / "stack.log",
                    ["--max-model-len", str(MAX_MODEL_LEN), "--num-slots", "4", "--prefill-chunks", "64",
                     "--tail-chunks", "--drain-timeout", "120", *pki(tmp).internal_flags(), *chip_flags()],
                    env={FAULT_ENV: FAULT_SALT, **chip_env()}, uds=uses_uds("stack"))
    s.internal = pki(tmp)
    return s


def chip_env() -> dict[str, str]:
    """The environment that gives a stack's worker the accelerator in the device lane's e2e run
    (`GEMMA_SERVE_ACCELERATOR`, set by scripts/device_check.sh: the JAX platforms of the chip, e.g. "tpu,cpu"),
    where the test process and every other stack stay on the host's CPU (JAX_PLATFORMS=cpu): one process at a
    time may hold the chip. Empty elsewhere."""
    accelerator = os.environ.get("GEMMA_SERVE_ACCELERATOR")
    return {"JAX_PLATFORMS": accelerator} if accelerator else {}


def chip_flags() -> list[str]:
    """The worker flags of the embedded stack on the chip: the CPU default's numerics (float32 activations, int8
    block products, batch-invariant), which the chip runs as the kernel's pure-JAX twin, so that its e2e tests
    check the same guarantees there (seeded repeats whatever the batch, speculation on == off, prefix hit ==
    cold run). The chip's own default (bfloat16) is held to its bounds by the unit tests (README, "On a TPU")."""
    return ["--dtype", "float32", "--matmul-precision", "int8"] if chip_env() else []


def _gemma4(cache_dir, prepared, tmp, factory) -> Stack:
    """A tiny random Gemma 4 checkpoint directory (KV sharing, PLE, double-wide MLP, window 8, the full
    262,144-token vocabulary, the Gemma 4 test tokenizer and the official chat template), max_model_len 512,
    one slot (9 programs: its tests send one request at a time), internal links over mutual TLS like the
    embedded stack's (the fuzz gateway fronts it); its transformers model is the stack's `reference`."""
    from tests.gemma4_tiny import SHARED, write_checkpoint
    from tests.gemma4_tokenizer import write_gemma4_test_tokenizer

    ckpt = tmp("gemma-4-tiny")
    model = write_checkpoint({**SHARED, "vocab_size": 262_144, "vocab_size_per_layer_input": 262_144}, ckpt)
    write_gemma4_test_tokenizer(ckpt, prepared.dir / "tokenizer.json")
    shutil.copy(GEMMA4_TEMPLATE, ckpt / "chat_template.jinja")
    s = start_stack(cache_dir, tmp("g4log") / "stack.log",
                    ["--model", str(ckpt), "--max-model-len", "512", "--num-slots", "1", "--prefill-chunks", "32",
                     "--tail-chunks",
                     # exact weights: its tests compare served tokens with transformers' float32 choices and rely on
                     # what the random model writes (the embedded stack runs the default bfloat16 mode)
                     "--matmul-precision", "float32", *pki(tmp).internal_flags()], uds=uses_uds("gemma4_stack"))
    s.reference, s.internal = model, pki(tmp)
    return s


def front_gateway(backend: Stack, cache_dir, tmp, name: str, extra: list[str], env: dict | None = None,
                  ca: pathlib.Path | None = None, workers: list[str] | None = None) -> Stack:
    """Start a second gateway in front of `backend`'s tokenizer service and worker (or the `workers` addresses
    instead) over mutual TLS with the test CA (no compilation of its own), with `extra` flags; returns at once
    (see Stack.wait_healthy)."""
    http, grpc_port = free_ports(2)
    log_path = tmp(name) / "gateway.log"
    cmd = [sys.executable, "-m", "gemma_serve.cli", "gateway", "--cache-dir", str(cache_dir),
           "--http-port", str(http), "--gateway-grpc-port", str(grpc_port),
           "--tokenizer-addr", backend.address("tokenizer"),
           *(f for addr in (workers or [backend.address("worker")]) for f in ("--worker-addr", addr)),
           *pki(tmp).internal_flags(), *extra]
    sockets = None
    if not tcp_available():  # its public side on sockets too (on a host with TCP it keeps its ports)
        folder = socket_dir(log_path)
        sockets = {**(backend.sockets or {}), "api": str(folder / "api.sock"),
                   "generate": str(folder / "generate.sock")}
        cmd += ["--uds", sockets["api"], "--grpc-uds", sockets["generate"]]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=_die_with_parent,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Stack(proc, {**backend.ports, "http": http, "grpc": grpc_port}, log_path, time.monotonic(), ca=ca,
                 sockets=sockets)


def _tensor_parallel(cache_dir, prepared, tmp, factory) -> Stack:
    """The embedded model split over 2 (simulated CPU) devices: `up --tensor-parallel 2`, max_model_len 512, one
    slot and 64-token chunks only (5 programs: its tests send one request at a time), otherwise the embedded
    stack's defaults, so its greedy answers can be compared with that stack's."""
    return start_stack(cache_dir, tmp("tp") / "stack.log",
                       ["--tensor-parallel", "2", "--max-model-len", str(MAX_MODEL_LEN), "--num-slots", "1",
                        "--prefill-chunks", "64", "--tail-chunks"], uds=uses_uds("tp_stack"))


def _fuzz(cache_dir, prepared, tmp, tmp_path_factory) -> Stack:
    """A gateway with `--max-tokens-cap 4` in front of the tiny Gemma 4 stack's backends, for the fuzzer and the
    hostile-input tests: every answer is short, whatever was asked, and every prompt is cheap to compute (what
    they test is the gateway's handling of any request; a generated request may ask for dozens of choices of
    hundreds of prompt tokens, which the embedded model takes seconds to compute and the tiny one milliseconds)."""
    backend = launch("gemma4_stack", cache_dir, prepared, tmp_path_factory)
    return front_gateway(backend, cache_dir, tmp, "fuzz", ["--max-tokens-cap", str(FUZZ_MAX_TOKENS)])


#: The auth stack's API keys: one per way of giving keys (flag, file, environment).
API_KEYS = {"flag": "key-from-flag", "file": "key-from-file", "env": "key-from-env"}


def _auth(cache_dir, prepared, tmp, tmp_path_factory) -> Stack:
    """A gateway with API keys (one from each source) and TLS on its public ports, in front of the embedded stack's
    backends."""
    backend = launch("stack", cache_dir, prepared, tmp_path_factory)
    keys = tmp("keys") / "keys.txt"
    keys.write_text(f"# one key per line\n\n{API_KEYS['file']}\n")
    p = pki(tmp)
    return front_gateway(backend, cache_dir, tmp, "auth", ["--api-key", API_KEYS["flag"], "--api-key-file", str(keys),
                                                *p.public_flags()],
                         env={"GEMMA_SERVE_API_KEY": API_KEYS["env"]}, ca=p.ca)


#: Stack fixture name -> launcher(cache_dir, prepared, mktemp) -> Stack.
SPECS = {"stack": _embedded, "gemma4_stack": _gemma4, "fuzz_stack": _fuzz, "auth_stack": _auth,
         "tp_stack": _tensor_parallel}
#: The order `launch_needed` starts them in: the e2e tests' order of first use (tests/plugins/scheduling.py
#: runs the e2e modules in file order).
ORDER = ("stack", "auth_stack", "gemma4_stack", "fuzz_stack", "tp_stack")
_LAUNCHED: dict[str, Stack] = {}
_LOCK = threading.RLock()
_CHAIN: list[threading.Thread] = []
_SESSION_OVER = threading.Event()
#: The stacks the session's e2e tests use (set at collection).
NEEDED: list[str] = []


def launch_needed(cache_dir, prepared, tmp_path_factory) -> None:
    """Launch every stack the session's e2e tests use, one after another, in the background: each once the one
    before it is healthy (or gone), so that one stack compiles at a time. Three compiling at once beside the
    unit tests' own compiles oversubscribed the two cores so much that the same work cost more CPU time
    (docs/performance.md, "Test suite"). A test that needs a stack before its turn launches it at once."""
    with _LOCK:
        if _CHAIN:
            return
        names = sorted(NEEDED, key=ORDER.index)
        _CHAIN.append(threading.Thread(target=_launch_in_turn, args=(names, cache_dir, prepared, tmp_path_factory),
                                       name="stack-launcher", daemon=True))
        _CHAIN[0].start()


def _launch_in_turn(names: list[str], cache_dir, prepared, tmp_path_factory) -> None:
    for name in names:
        launch(name, cache_dir, prepared, tmp_path_factory).poll_healthy()
    # The children it started die with this thread (`_die_with_parent`: the kernel's parent-death signal follows
    # the creating thread, not the process), so it lives until the session stops them.
    _SESSION_OVER.wait()


def launch(name: str, cache_dir, prepared, tmp_path_factory) -> Stack:
    """The session's stack `name`, launched now unless already running."""
    with _LOCK:
        if name not in _LAUNCHED:
            tmp = lambda prefix: tmp_path_factory.mktemp(prefix)  # noqa: E731
            _LAUNCHED[name] = SPECS[name](cache_dir, prepared, tmp, tmp_path_factory)
        return _LAUNCHED[name]


def launched() -> dict[str, Stack]:
    """The stacks launched in this session."""
    return dict(_LAUNCHED)


def stop_all() -> None:
    """Stop every launched stack (end of session), the front gateways before the stack they front."""
    with _LOCK:
        launched_now = list(_LAUNCHED.values())
    for s in reversed(launched_now):
        s.stop()
    _SESSION_OVER.set()
