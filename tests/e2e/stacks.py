"""The real stacks the end-to-end tests drive: `gemma-serve up` (three processes) on free ports, one per family of
e2e modules, each compiling only the programs its tests use.

A stack's worker spends most of its start-up compiling (about a minute for the embedded model on 2 cores), on one
core. So the stacks a test session needs are launched early (`launch_needed`, from the first e2e fixture, or the
session's first test in a serial run), one after another in the background while the unit tests run
(tests/plugins/scheduling.py), and each e2e fixture only waits until its own stack is healthy.
"""

from __future__ import annotations

import dataclasses
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

REPO = pathlib.Path(__file__).resolve().parents[2]
GEMMA4_TEMPLATE = REPO / "tests" / "tokenizer_svc" / "data" / "gemma4_chat_template.jinja"
MAX_MODEL_LEN = 512  # the embedded stack's --max-model-len: one KV bucket (the sliding window)
FUZZ_MAX_TOKENS = 4   # the fuzz stack's --max-tokens-cap
FAULT_SALT = "test-fault-injection"  # the embedded stack's worker fails the step of requests with this cache_salt


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1."""
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

    @property
    def base_url(self) -> str:
        return f"{'https' if self.ca else 'http'}://127.0.0.1:{self.ports['http']}"

    def ssl_context(self):
        """An SSL context trusting the stack's CA (None for a plain-HTTP stack)."""
        import ssl

        return ssl.create_default_context(cafile=str(self.ca)) if self.ca else None

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def internal_channel(self, service: str):
        """A blocking gRPC channel to the stack's "tokenizer" or "worker" service, over its internal links' mutual
        TLS when it has them (a test then talks to it as the gateway does)."""
        from common.network import sync_channel

        address = f"127.0.0.1:{self.ports[service]}"
        return sync_channel(address, self.internal.internal_tls() if self.internal else None)

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
        """Wait until /health is 200 (True), the process exits or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while not self.healthy:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2, context=self.ssl_context()) as resp:
                    if resp.status == 200:
                        self.healthy, self.startup_s = True, time.monotonic() - self.started
                        break
            except OSError:
                pass
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
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2, context=self.ssl_context()) as resp:
                return resp.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return 0

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


def start_stack(cache_dir: pathlib.Path, log_path: pathlib.Path, extra: list[str], env: dict | None = None) -> Stack:
    """Launch `gemma-serve up` on free ports with `extra` flags (and `env` added to the environment); returns at
    once (see Stack.wait_healthy)."""
    http, grpc_port, tok, worker, metrics = free_ports(5)
    cmd = [
        sys.executable, "-m", "gemma_serve.cli", "up", "--cache-dir", str(cache_dir),
        "--http-port", str(http), "--gateway-grpc-port", str(grpc_port), "--tokenizer-port", str(tok),
        "--worker-port", str(worker), "--worker-metrics-port", str(metrics), *extra,
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=_die_with_parent,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    ports = {"http": http, "grpc": grpc_port, "tokenizer": tok, "worker": worker, "metrics": metrics}
    return Stack(proc, ports, log_path, time.monotonic())


def _embedded(cache_dir, prepared, tmp, factory) -> Stack:
    """The embedded Gemma 3 270M: max_model_len 512 (= the sliding window: one KV bucket), 4 slots, 64-token chunks
    only (the OpenAI API, sampling, tools, agent tests; 14 programs: the chunk-size and bucket policies, and
    conversations beyond the window, are the worker's unit tests' business; no tail chunks either). Its internal
    links use mutual TLS with the test CA, so every e2e test through it crosses them; requests with `FAULT_SALT`
    make its worker fail (tests/e2e/test_faults.py, which runs last, breaks and finally stops this stack)."""
    from model_worker.loop import FAULT_ENV

    s = start_stack(cache_dir, tmp("stack") / "stack.log",
                    ["--max-model-len", str(MAX_MODEL_LEN), "--num-slots", "4", "--prefill-chunks", "64",
                     "--tail-chunks", "--drain-timeout", "120", *pki(tmp).internal_flags()],
                    env={FAULT_ENV: FAULT_SALT})
    s.internal = pki(tmp)
    return s


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
                     "--matmul-precision", "float32", *pki(tmp).internal_flags()])
    s.reference, s.internal = model, pki(tmp)
    return s


def front_gateway(backend: Stack, cache_dir, tmp, name: str, extra: list[str], env: dict | None = None,
                  ca: pathlib.Path | None = None, workers: list[str] | None = None) -> Stack:
    """Start a second gateway in front of `backend`'s tokenizer service and worker (or the `workers` addresses
    instead) over mutual TLS with the test CA (no compilation of its own), with `extra` flags; returns at once
    (see Stack.wait_healthy)."""
    http, grpc_port = free_ports(2)
    cmd = [sys.executable, "-m", "gemma_serve.cli", "gateway", "--cache-dir", str(cache_dir),
           "--http-port", str(http), "--gateway-grpc-port", str(grpc_port),
           "--tokenizer-addr", f"127.0.0.1:{backend.ports['tokenizer']}",
           *(f for addr in (workers or [f"127.0.0.1:{backend.ports['worker']}"]) for f in ("--worker-addr", addr)),
           *pki(tmp).internal_flags(), *extra]
    log_path = tmp(name) / "gateway.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=_die_with_parent,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Stack(proc, {**backend.ports, "http": http, "grpc": grpc_port}, log_path, time.monotonic(), ca=ca)


def _tensor_parallel(cache_dir, prepared, tmp, factory) -> Stack:
    """The embedded model split over 2 (simulated CPU) devices: `up --tensor-parallel 2`, max_model_len 512, one
    slot and 64-token chunks only (5 programs: its tests send one request at a time), otherwise the embedded
    stack's defaults, so its greedy answers can be compared with that stack's."""
    return start_stack(cache_dir, tmp("tp") / "stack.log",
                       ["--tensor-parallel", "2", "--max-model-len", str(MAX_MODEL_LEN), "--num-slots", "1",
                        "--prefill-chunks", "64", "--tail-chunks"])


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
