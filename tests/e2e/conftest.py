"""Start the real stack (`gemma-serve up`: three processes) once per test session on free ports."""

from __future__ import annotations

import os
import shutil
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

MAX_MODEL_LEN = 1024  # keep equal to test_openai_api.MAX_MODEL_LEN
STARTUP: dict[str, float] = {}


def pytest_terminal_summary(terminalreporter):
    """Report how long `gemma-serve up` took to become healthy (compile time on this machine is real)."""
    if STARTUP:
        terminalreporter.write_line(f"gemma-serve up became healthy in {STARTUP['seconds']:.1f} s")


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


class Stack:
    """A running `gemma-serve up` and its addresses."""

    def __init__(self, proc: subprocess.Popen, ports: dict[str, int], log_path: pathlib.Path, startup_s: float):
        self.proc, self.ports, self.log_path, self.startup_s = proc, ports, log_path, startup_s
        self.base_url = f"http://127.0.0.1:{ports['http']}"
        self.grpc_addr = f"127.0.0.1:{ports['grpc']}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_stack(cache_dir, log_path: pathlib.Path, extra: list[str], timeout: float = 900) -> Stack:
    """Run `gemma-serve up` on free ports with `extra` flags; wait until /health is 200."""
    http, grpc_port, tok, worker, metrics = free_ports(5)
    cmd = [
        sys.executable, "-m", "gemma_serve.cli", "up", "--cache-dir", str(cache_dir),
        "--http-port", str(http), "--gateway-grpc-port", str(grpc_port), "--tokenizer-port", str(tok),
        "--worker-port", str(worker), "--worker-metrics-port", str(metrics), *extra,
    ]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    s = Stack(proc, {"http": http, "grpc": grpc_port, "tokenizer": tok, "worker": worker, "metrics": metrics},
              log_path, 0.0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"gemma-serve up exited with {proc.returncode}:\n{s.log()[-5000:]}")
        try:
            with urllib.request.urlopen(s.base_url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        time.sleep(1)
    else:
        proc.kill()
        pytest.fail(f"stack not healthy in time:\n{s.log()[-5000:]}")
    s.startup_s = time.perf_counter() - t0
    return s


def stop_stack(s: Stack) -> None:
    """SIGTERM and wait; a stack that does not stop within 60 s fails the test session."""
    s.proc.send_signal(signal.SIGTERM)
    try:
        s.proc.wait(60)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        pytest.fail("gemma-serve up did not stop within 60 s of SIGTERM")


@pytest.fixture(scope="session")
def stack(cache_dir, prepared, tmp_path_factory):
    """The embedded model's three services with max_model_len 1024 and 4 slots; stopped (SIGTERM) at the end."""
    log_path = tmp_path_factory.mktemp("stack") / "stack.log"
    s = start_stack(cache_dir, log_path, ["--max-model-len", str(MAX_MODEL_LEN), "--num-slots", "4"])
    STARTUP["seconds"] = s.startup_s
    yield s
    stop_stack(s)


GEMMA4_TEMPLATE = pathlib.Path(__file__).parents[1] / "tokenizer_svc" / "data" / "gemma4_chat_template.jinja"


@pytest.fixture(scope="session")
def gemma4_stack(cache_dir, prepared, tmp_path_factory):
    """A tiny random Gemma 4 checkpoint directory (KV sharing, PLE, double-wide MLP, window 8, the full
    262,144-token vocabulary, the Gemma 4 test tokenizer and the official chat template) served with
    max_model_len 512 and 2 slots; yields (stack, transformers model)."""
    from tests.gemma4_tiny import SHARED, write_checkpoint
    from tests.gemma4_tokenizer import write_gemma4_test_tokenizer

    ckpt = tmp_path_factory.mktemp("gemma-4-tiny")
    model = write_checkpoint({**SHARED, "vocab_size": 262_144, "vocab_size_per_layer_input": 262_144}, ckpt)
    write_gemma4_test_tokenizer(ckpt, prepared.dir / "tokenizer.json")
    shutil.copy(GEMMA4_TEMPLATE, ckpt / "chat_template.jinja")
    s = start_stack(cache_dir, tmp_path_factory.mktemp("g4log") / "stack.log",
                    ["--model", str(ckpt), "--max-model-len", "512", "--num-slots", "2", "--prefill-chunks", "32"])
    yield s, model
    stop_stack(s)
