"""Two model workers behind one gateway: conversations keep landing on the worker that holds their KV (by session
key, or by prompt prefix without one), and a killed worker's requests end cleanly while its sessions continue on
the other worker, until it is restarted and rejoins the ring. A session lease does not starve a request that
waits for a slot: past `--lease-preempt-after` it takes the leased slot.

The two workers are the embedded stack's and one more started here with the same engine flags (its programs come
from the session's compilation cache), behind a gateway of their own; only the extra worker is killed. The extra
worker listens on free ports, or on unix sockets on a host without TCP.
`gemma-serve up --workers N`'s command lines are checked in tests/gateway/test_workers.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gateway.backends.worker_choice import rendezvous_order
from tests.e2e.stacks import MAX_MODEL_LEN, REPO, free_ports, front_gateway, pki
from tests.transport import socket_folder, tcp_available

pytestmark = pytest.mark.slow
CHUNK = 64  # the stacks' --prefill-chunks: a later turn may recompute at most one chunk of its history
SYSTEM = "You are a build agent. Answer with one short tool call. " * 4


@dataclasses.dataclass
class Extra:
    """The extra worker process (restartable) and its addresses."""

    cmd: list[str]
    addr: str
    log: str
    metrics: str  # its Prometheus endpoint: "127.0.0.1:PORT", or "unix:PATH" (a socket)
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def metrics_text(self) -> str:
        """Its Prometheus text."""
        if self.metrics.startswith("unix:"):
            transport, url = httpx.HTTPTransport(uds=self.metrics[len("unix:"):]), "http://localhost/metrics"
        else:
            transport, url = None, f"http://{self.metrics}/metrics"
        with httpx.Client(transport=transport, timeout=10) as c:
            return c.get(url).text


def _workers(gateway) -> dict[str, str]:
    with gateway.http(timeout=10) as http:
        return http.get("/health").json().get("workers", {})


def _wait_serving(gateway, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = _workers(gateway)
        if len(workers) == n and all(s == "SERVING" for s in workers.values()):
            return
        time.sleep(0.5)
    pytest.fail(f"workers not serving: {_workers(gateway)}")


@pytest.fixture(scope="module")
def two_workers(stack, cache_dir, tmp_path_factory):
    """A gateway over the embedded stack's worker and an extra one: (gateway Stack, Extra)."""
    tmp = lambda prefix: tmp_path_factory.mktemp(prefix)
    folder = None
    if tcp_available():
        port, metrics = free_ports(2)
        listen = ["--worker-port", str(port), "--worker-metrics-port", str(metrics)]
        addr, metrics_at = f"127.0.0.1:{port}", f"127.0.0.1:{metrics}"
    else:  # a short folder: sun_path holds 107 bytes
        folder = socket_folder()
        listen = ["--uds", str(folder / "worker.sock"), "--metrics-uds", str(folder / "worker-metrics.sock")]
        addr, metrics_at = f"unix:{folder / 'worker.sock'}", f"unix:{folder / 'worker-metrics.sock'}"
    extra = Extra([sys.executable, "-m", "gemma_serve.cli", "worker", "--cache-dir", str(cache_dir), *listen,
                   "--max-model-len", str(MAX_MODEL_LEN), "--num-slots", "4", "--prefill-chunks", str(CHUNK),
                   "--tail-chunks", "--drain-timeout", "5", "--lease-preempt-after", "1", *pki(tmp).internal_flags()],
                  addr, str(tmp("extra") / "worker.log"), metrics_at)
    extra.start()
    gateway = front_gateway(stack, cache_dir, tmp, "two", ["--worker-addr", extra.addr])
    gateway.wait_healthy()
    _wait_serving(gateway, 2)
    yield gateway, extra
    gateway.stop()
    extra.proc.terminate()
    extra.proc.wait(60)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _chat(gateway, messages: list[dict], session: str | None, max_tokens: int = 6) -> dict:
    headers = {"x-session-id": session} if session else {}
    with gateway.http(timeout=120) as http:
        r = http.post("/v1/chat/completions", headers=headers,
                      json={"model": "gemma-3-270m", "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _routed(gateway) -> dict[tuple[str, str], float]:
    """The gateway's routed-request counter by (worker, reason)."""
    out = {}
    with gateway.http() as http:
        text = http.get("/metrics").text
    for line in text.splitlines():
        if line.startswith("gemma_serve:gateway_routed_requests_total{"):
            labels = dict(p.split("=") for p in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["worker"].strip('"'), labels["reason"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def test_conversations_stay_on_the_worker_that_holds_their_kv(two_workers):
    """8 conversations of 4 turns at once, half with a session key and half without: every later turn reuses the
    whole previous turn (prompt + answer, less at most one chunk), which only the worker that computed it can
    do, unless a spill explains it (a loaded host makes the turns overlap more); both workers serve some of
    them."""
    gateway = two_workers[0]
    failures: list[str] = []

    def conversation(i: int) -> None:
        session = f"agent-{i}" if i % 2 == 0 else None
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Task {i}: list the files of project number {i * 7919}."}]
        previous = 0
        for turn in range(4):
            reply = _chat(gateway, messages, session)
            usage = reply["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            if turn and cached < previous - CHUNK:
                failures.append(f"conversation {i} turn {turn}: cached {cached} of the previous {previous}")
            previous = usage["prompt_tokens"] + usage["completion_tokens"]
            messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"Result of step {turn}: ok, {turn * 3 + i} files."}]

    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    routed = _routed(gateway)
    # A worker at its bounded-load capacity passes a request on (a spill: by design, so that no worker takes more
    # than its share while another has room); the spilled turn, and the turn that goes back home after it, run
    # without their history. Every miss must be one of those: none when nothing spilled.
    spills = sum(n for (_, reason), n in routed.items() if reason.endswith("_spill"))
    assert len(failures) <= 2 * spills, (failures, routed)
    workers = {w for w, _ in routed}
    assert len(workers) == 2, routed
    assert sum(n for (_, reason), n in routed.items() if reason.startswith("session")) >= 16, routed
    assert sum(n for (_, reason), n in routed.items() if reason == "prefix") >= 8, routed  # turns 2-4 unkeyed


def test_a_killed_worker_ends_its_requests_and_its_sessions_move(two_workers):
    """kill -9 of the worker serving a stream: the stream ends with an SSE error event within a second, a new
    request of its session is served by the other worker, and the restarted worker rejoins the ring."""
    gateway, extra = two_workers
    workers = sorted(_workers(gateway))
    # a session key whose rendezvous choice is the extra worker (gateway/backends/worker_choice.py is deterministic)
    key = next(k for k in (f"doomed-{i}" for i in range(100)) if rendezvous_order(k, workers)[0] == extra.addr)
    before = _routed(gateway)
    events: list[tuple[float, str]] = []

    def stream() -> None:
        body = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "Count to one hundred."}],
                "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        with gateway.http(timeout=60) as http, \
                http.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": key}) as r:
            for line in r.iter_lines():
                if line.startswith(("data: ", "event: ")):
                    events.append((time.monotonic(), line))

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while sum(1 for _, e in events if '"content"' in e) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert events, "the stream produced no tokens"
    grew = [w for w, n in _routed(gateway).items() if n > before.get(w, 0)]
    assert grew == [(extra.addr, "session")], (before, _routed(gateway))
    killed_at = time.monotonic()
    os.kill(extra.proc.pid, signal.SIGKILL)
    reader.join(30)
    assert not reader.is_alive(), "the stream did not end after its worker was killed"
    errors = [(t, e) for t, e in events if "error" in e]
    assert errors, events[-3:]
    assert errors[0][0] - killed_at < 1.0, errors[0][0] - killed_at
    assert json.loads(next(e for _, e in events if e.startswith("data: {") and "error" in e)[6:])["error"]["message"]

    survivor = next(w for w in workers if w != extra.addr)
    served = sum(n for (w, _), n in _routed(gateway).items() if w == survivor)
    again = _chat(gateway, [{"role": "user", "content": "hi again"}], key, max_tokens=2)  # served by the survivor
    assert again["choices"][0]["message"]["content"] is not None
    assert sum(n for (w, _), n in _routed(gateway).items() if w == survivor) == served + 1, _routed(gateway)
    extra.proc.wait(10)
    extra.start()  # restarted, it loads its programs from the cache and rejoins the ring
    _wait_serving(gateway, 2)


def test_a_session_lease_keeps_its_kv_through_a_burst_that_evicts_it_otherwise(stack):
    """The embedded stack has 4 slots: an agent's turn, then 4 other prompts, then its next turn. With
    `x-session-ttl` the next turn reuses the whole previous one (the lease kept the slot out of LRU eviction);
    without, the burst took the slot. `x-session-release` ends the lease (the shared stack gets its slot back)."""
    def run(session: str, ttl: str | None) -> int:
        headers = {"x-session-id": session, **({"x-session-ttl": ttl} if ttl else {})}
        messages = [{"role": "user", "content": f"Plan the release of service {session}, step by step."}]
        with stack.http(timeout=120) as http:
            first = http.post("/v1/chat/completions", headers=headers, json={
                "model": "gemma-3-270m", "messages": messages, "max_tokens": 8, "temperature": 0}).json()
        for i in range(4):  # another client's burst, one prompt after another (each its own salt: no reuse)
            with stack.http(timeout=120) as http:
                r = http.post("/v1/chat/completions", json={
                    "model": "gemma-3-270m", "messages": [{"role": "user", "content": f"Unrelated question {i}."}],
                    "max_tokens": 2, "temperature": 0, "cache_salt": f"burst-{session}-{i}"})
            assert r.status_code == 200, r.text
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Continue."}]
        headers["x-session-release"] = "true"
        with stack.http(timeout=120) as http:
            second = http.post("/v1/chat/completions", headers=headers, json={
                "model": "gemma-3-270m", "messages": messages, "max_tokens": 2, "temperature": 0}).json()
        previous = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
        return second["usage"]["prompt_tokens_details"]["cached_tokens"], previous

    leased, previous = run("leased-agent", "60")
    assert leased >= previous - 1, (leased, previous)
    unleased, _ = run("plain-agent", None)
    assert unleased < previous // 2, unleased
    metrics = stack.worker_metrics()
    assert "gemma_serve:leased_slots 0.0" in metrics  # released by the second turn


def _worker_metric(extra: Extra, name: str, expect: float | None = None) -> float:
    """The extra worker's metric `name`; with `expect`, polled for a few seconds until it has that value (the
    worker refreshes its metrics after each engine iteration, just after a response leaves)."""
    deadline = time.monotonic() + 10
    while True:
        text = extra.metrics_text()
        value = float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name + " ")))
        if expect is None or value == expect or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_a_request_waiting_past_lease_preempt_after_takes_the_leased_slot(two_workers, stack, cache_dir,
                                                                         tmp_path_factory):
    """The extra worker (4 slots, so at most 1 lease; `--lease-preempt-after 1`) behind a gateway of its own: an
    agent leases its slot for 10 minutes, three long streams take the other three slots, and a fourth request,
    which finds no free slot, still gets one while the streams run: after waiting a second it ends the lease
    (`lease_preemptions` counts it), and the agent's next turn finds its KV gone."""
    _, extra = two_workers
    gateway = front_gateway(stack, cache_dir, tmp_path_factory.mktemp, "lease", [], workers=[extra.addr])
    try:
        gateway.wait_healthy()
        _wait_serving(gateway, 1)
        preempted = _worker_metric(extra, "gemma_serve:lease_preemptions_total")
        headers = {"x-session-id": "thinking-agent", "x-session-ttl": "600"}
        messages = [{"role": "user", "content": "Plan the migration of the billing database, step by step."}]
        with gateway.http(timeout=120) as http:
            first = http.post("/v1/chat/completions", headers=headers, json={
                "model": "gemma-3-270m", "messages": messages, "max_tokens": 8, "temperature": 0}).json()
        assert _worker_metric(extra, "gemma_serve:leased_slots", 1) == 1

        tokens = [0, 0, 0]
        finished: list[bool] = [False, False, False]

        def stream(i: int) -> None:
            body = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": f"Story number {i}."}],
                    "max_tokens": 250, "temperature": 0, "stream": True, "ignore_eos": True,
                    "cache_salt": f"stream-{i}"}
            with gateway.http(timeout=300) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    tokens[i] += '"content"' in line
            finished[i] = True

        streams = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in streams:
            t.start()
        deadline = time.monotonic() + 120
        while min(tokens) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert min(tokens) >= 2, tokens  # all three streams hold a slot
        with gateway.http(timeout=120) as http:
            waiter = http.post("/v1/chat/completions", json={
                "model": "gemma-3-270m", "messages": [{"role": "user", "content": "Quick question."}],
                "max_tokens": 2, "temperature": 0, "cache_salt": "waiter"})
        assert waiter.status_code == 200, waiter.text
        assert not any(finished), "a stream ended while the waiter waited: the test needs longer streams"
        for t in streams:
            t.join(300)
        assert all(finished)
        assert _worker_metric(extra, "gemma_serve:lease_preemptions_total", preempted + 1) == preempted + 1
        assert _worker_metric(extra, "gemma_serve:leased_slots", 0) == 0
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Continue."}]
        with gateway.http(timeout=120) as http:
            second = http.post("/v1/chat/completions", headers={**headers, "x-session-release": "true"},
                               json={"model": "gemma-3-270m", "messages": messages, "max_tokens": 2,
                                     "temperature": 0}).json()
        previous = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] < previous // 2, second["usage"]
    finally:
        gateway.stop()
