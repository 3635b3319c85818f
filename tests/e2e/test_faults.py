"""Faults with the real processes of the embedded stack (`gemma-serve up`, three processes), which these tests
break: kill -9 the worker mid-stream and the tokenizer service, a fault inside an engine step (requests with the
test-only fault salt), then SIGTERM during long generations. `up` restarts what died; the same gateway serves
again with no manual step. This module runs after every other e2e module (tests/conftest.py) and in file order;
its last test stops the stack.

Timing bounds here are loose (the point is "at once", not "at the 300 s deadline"); the figures are printed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.e2e.stacks import FAULT_SALT, Stack

pytestmark = pytest.mark.slow
LONG = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
RECOVERY_S = 300  # a restarted worker loads the model and its compiled programs (from the cache)


@pytest.fixture(scope="module")
def fault_stack(stack):
    return stack


@pytest.fixture(scope="module")
def model(fault_stack) -> str:
    with fault_stack.http() as http:
        return http.get("/v1/models").json()["data"][0]["id"]


def _served_again(stack: Stack, model: str) -> float:
    """Seconds until /health is 200 again and a completion succeeds (fails after RECOVERY_S)."""
    t0 = time.monotonic()
    while stack.health_status() != 200:
        assert stack.proc.poll() is None, f"gemma-serve up exited:\n{stack.log()[-3000:]}"
        assert time.monotonic() - t0 < RECOVERY_S, f"not serving again:\n{stack.log()[-3000:]}"
        time.sleep(0.25)
    with stack.http(timeout=60) as http:
        r = http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def _stream_events(stack: Stack, model: str, body: dict, first: threading.Event, out: list):
    """Run a streamed completion; append (monotonic time, event) for each SSE data line."""
    with stack.http(timeout=120) as http, \
            http.stream("POST", "/v1/completions", json={**body, "model": model, "stream": True}) as r:
        out.append((time.monotonic(), r.status_code))
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append((time.monotonic(), line[6:]))
                first.set()


def _unary(stack: Stack, model: str, body: dict, out: list):
    with stack.http(timeout=120) as http:
        r = http.post("/v1/completions", json={**body, "model": model})
    out.append((time.monotonic(), r.status_code, r.json()))


def _ended(pid: int, timeout: float = 60) -> float:
    """The monotonic time at which process `pid` has ended (a zombie, or reaped), polled every 10 ms."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return time.monotonic()
        if state in ("Z", "X"):
            return time.monotonic()
        time.sleep(0.01)
    pytest.fail(f"the killed worker (pid {pid}) had not ended {timeout} s later")


def test_kill_9_the_worker_mid_stream(fault_stack, model):
    first, streamed, unary = threading.Event(), [], []
    body = {**LONG, "max_tokens": 480}  # a looping greedy text drafts well: long enough to be running at the kill
    threads = [threading.Thread(target=_stream_events, args=(fault_stack, model, body, first, streamed)),
               threading.Thread(target=_unary, args=(fault_stack, model, body, unary))]
    for t in threads:
        t.start()
    assert first.wait(60), streamed
    time.sleep(0.5)  # the unary request is decoding too
    assert not unary and streamed[-1][1] != "[DONE]", "a request ended before the kill"
    pid = fault_stack.service_pid("worker")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    ended = _ended(pid)
    for t in threads:
        t.join(60)
    assert streamed[-1][1] == "[DONE]"
    err_time, err = streamed[-2]
    assert json.loads(err)["error"]["code"] == "backend_unavailable", err
    (unary_time, status, body), = unary
    assert status == 503 and body["error"]["code"] == "backend_unavailable", body
    assert fault_stack.health_status() == 503
    print(f"after kill -9 of the worker: its process ended {ended - killed:.2f} s later, stream error "
          f"{err_time - killed:.2f} s, unary 503 {unary_time - killed:.2f} s")
    # The gateway learns of the death when the worker's sockets close, which the kernel does as the killed
    # process ends (before it becomes a zombie): at once on most hosts, later where it must first release device
    # memory (on a TPU v5e host both errors came 6.3-6.9 s after the kill). The bound runs from the later time.
    start = max(killed, ended)
    assert err_time - start < 5 and unary_time - start < 5
    print(f"serving again {_served_again(fault_stack, model):.1f} s later")
    assert "worker exited (code -9); restarting it" in fault_stack.log()


def test_kill_9_the_tokenizer(fault_stack, model):
    os.kill(fault_stack.service_pid("tokenizer"), signal.SIGKILL)
    t0 = time.monotonic()
    with fault_stack.http(timeout=60) as http:
        r = http.post("/v1/chat/completions",
                      json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable", r.text
    print(f"after kill -9 of the tokenizer: 503 in {time.monotonic() - t0:.2f} s")
    print(f"serving again {_served_again(fault_stack, model):.1f} s later")


def test_a_fault_inside_a_step_restarts_the_worker(fault_stack, model):
    with fault_stack.http(timeout=60) as http:
        r = http.post("/v1/completions",
                      json={"model": model, "prompt": "Hi", "max_tokens": 2, "cache_salt": FAULT_SALT})
    assert r.status_code == 503 and "restarting" in r.json()["error"]["message"], r.text
    print(f"serving again {_served_again(fault_stack, model):.1f} s after a failed step")
    assert "worker exited (code 3); restarting it" in fault_stack.log()


def test_sigterm_lets_running_generations_finish(fault_stack, model):
    """Four long streams are running when `up` gets SIGTERM: all four finish whole; a request arriving during
    the drain gets a 503; `up` then exits 0."""
    body = {**LONG, "max_tokens": 200}  # long enough to outlast the start of the drain, however fast the steps
    firsts = [threading.Event() for _ in range(4)]
    outs: list[list] = [[] for _ in range(4)]
    threads = [threading.Thread(target=_stream_events, args=(fault_stack, model, body, firsts[i], outs[i]))
               for i in range(4)]
    for t in threads:
        t.start()
    assert all(f.wait(60) for f in firsts)
    fault_stack.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30  # `up` notices the signal on its next poll: wait for the drain, not a fixed time
    while time.monotonic() < deadline:
        with fault_stack.http(timeout=10) as http:
            if http.get("/health").json().get("status") == "draining":
                break
        time.sleep(0.05)
    assert not any(out and out[-1][1] == "[DONE]" for out in outs), "a stream ended before the drain began"
    with fault_stack.http(timeout=30) as http:
        late = http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
    for t in threads:
        t.join(120)
    for out in outs:
        events = [e for _, e in out[1:]]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 8
    assert fault_stack.proc.wait(60) == 0
