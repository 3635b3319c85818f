"""Two model workers behind one gateway (`gemma-serve up --workers 2`): conversations keep landing on the worker that
holds their KV (by session key, or by prompt prefix without one), and a killed worker's requests end cleanly while
its sessions continue on the other worker, until the launcher's restart brings it back into the ring.

The stack starts after the embedded stack is healthy, with the embedded stack's engine flags, so its two workers
load their programs from the session's compilation cache instead of compiling them again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.e2e.stacks import MAX_MODEL_LEN, free_ports, pki, start_stack

pytestmark = pytest.mark.slow
CHUNK = 64  # the stack's --prefill-chunks: a later turn may recompute at most one chunk of its history
SYSTEM = "You are a build agent. Answer with one short tool call. " * 4


@pytest.fixture(scope="module")
def two_workers(stack, cache_dir, tmp_path_factory):
    """`up --workers 2` with the embedded stack's engine flags (its compiled programs are in the cache by now)."""
    worker, metrics = _consecutive_free_port(), _consecutive_free_port()  # worker i listens on --worker-port + i
    tmp = lambda prefix: tmp_path_factory.mktemp(prefix)
    s = start_stack(cache_dir, tmp("two") / "stack.log",
                    ["--workers", "2", "--worker-port", str(worker), "--worker-metrics-port", str(metrics),
                     "--max-model-len", str(MAX_MODEL_LEN), "--num-slots", "4", "--prefill-chunks", str(CHUNK),
                     "--drain-timeout", "30", *pki(tmp).internal_flags()])
    s.ports.update(worker=worker, worker1=worker + 1)
    yield s.wait_healthy()
    s.stop()


def _consecutive_free_port() -> int:
    """A port p such that p and p + 1 are both free on 127.0.0.1 now."""
    for _ in range(100):
        [p] = free_ports(1)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _chat(base: str, messages: list[dict], session: str | None, max_tokens: int = 6) -> dict:
    headers = {"x-session-id": session} if session else {}
    r = httpx.post(base + "/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": "gemma-3-270m", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _routed(base: str) -> dict[tuple[str, str], float]:
    """The gateway's routed-request counter by (worker, reason)."""
    out = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith("gemma_serve:gateway_routed_requests_total{"):
            labels = dict(p.split("=") for p in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["worker"].strip('"'), labels["reason"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def test_conversations_stay_on_the_worker_that_holds_their_kv(two_workers):
    """8 conversations of 4 turns at once, half with a session key and half without: every later turn reuses the
    whole previous turn (prompt + answer, less at most one chunk), which only the worker that computed it can
    do; both workers serve some of them."""
    base = two_workers.base_url
    failures: list[str] = []

    def conversation(i: int) -> None:
        session = f"agent-{i}" if i % 2 == 0 else None
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Task {i}: list the files of project number {i * 7919}."}]
        previous = 0
        for turn in range(4):
            reply = _chat(base, messages, session)
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
    assert not failures, failures
    routed = _routed(base)
    workers = {w for w, _ in routed}
    assert len(workers) == 2, routed
    assert sum(n for (_, reason), n in routed.items() if reason.startswith("session")) >= 16, routed
    assert sum(n for (_, reason), n in routed.items() if reason == "prefix") >= 8, routed  # turns 2-4 unkeyed


def _worker_pid(stack, port: int) -> int:
    import psutil

    for child in psutil.Process(stack.proc.pid).children():
        cmd = child.cmdline()
        if "worker" in cmd and "--worker-port" in cmd and cmd[cmd.index("--worker-port") + 1] == str(port):
            return child.pid
    raise LookupError(port)


def test_a_killed_worker_ends_its_requests_and_its_sessions_move(two_workers):
    """kill -9 of the worker serving a stream: the stream ends with an SSE error event within a second, a new
    request of its session is served by the other worker, and the restarted worker rejoins the ring."""
    base = two_workers.base_url
    key = "doomed-session"
    before = _routed(base)
    events: list[tuple[float, str]] = []

    def stream() -> None:
        body = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "Count to one hundred."}],
                "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60,
                          headers={"x-session-id": key}) as r:
            for line in r.iter_lines():
                if line.startswith(("data: ", "event: ")):
                    events.append((time.monotonic(), line))

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while sum(1 for _, e in events if '"content"' in e) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert events, "the stream produced no tokens"
    grew = [w for w, n in _routed(base).items() if n > before.get(w, 0)]
    assert len(grew) == 1 and grew[0][1] == "session", (before, _routed(base))
    victim = int(grew[0][0].rsplit(":", 1)[1])
    killed_at = time.monotonic()
    os.kill(_worker_pid(two_workers, victim), signal.SIGKILL)
    reader.join(30)
    assert not reader.is_alive(), "the stream did not end after its worker was killed"
    errors = [(t, e) for t, e in events if "error" in e]
    assert errors, events[-3:]
    assert errors[0][0] - killed_at < 1.0, errors[0][0] - killed_at
    assert json.loads(next(e for _, e in events if e.startswith("data: {") and "error" in e)[6:])["error"]["message"]

    again = _chat(base, [{"role": "user", "content": "hi again"}], key, max_tokens=2)  # served by the survivor
    assert again["choices"][0]["message"]["content"] is not None
    deadline = time.monotonic() + 240  # the launcher restarts the worker; it loads its programs from the cache
    while time.monotonic() < deadline:
        workers = httpx.get(base + "/health").json().get("workers", {})
        if len(workers) == 2 and all(s == "SERVING" for s in workers.values()):
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed worker did not rejoin: {workers}")


def test_a_session_lease_keeps_its_kv_through_a_burst_that_evicts_it_otherwise(stack):
    """The embedded stack has 4 slots: an agent's turn, then 4 other prompts, then its next turn. With
    `x-session-ttl` the next turn reuses the whole previous one (the lease kept the slot out of LRU eviction);
    without, the burst took the slot. `x-session-release` ends the lease (the shared stack gets its slot back)."""
    base = stack.base_url

    def run(session: str, ttl: str | None) -> int:
        headers = {"x-session-id": session, **({"x-session-ttl": ttl} if ttl else {})}
        messages = [{"role": "user", "content": f"Plan the release of service {session}, step by step."}]
        first = httpx.post(base + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "gemma-3-270m", "messages": messages, "max_tokens": 8, "temperature": 0}).json()
        for i in range(4):  # another client's burst, one prompt after another (each its own salt: no reuse)
            r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
                "model": "gemma-3-270m", "messages": [{"role": "user", "content": f"Unrelated question {i}."}],
                "max_tokens": 2, "temperature": 0, "cache_salt": f"burst-{session}-{i}"})
            assert r.status_code == 200, r.text
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Continue."}]
        headers["x-session-release"] = "true"
        second = httpx.post(base + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "gemma-3-270m", "messages": messages, "max_tokens": 2, "temperature": 0}).json()
        previous = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
        return second["usage"]["prompt_tokens_details"]["cached_tokens"], previous

    leased, previous = run("leased-agent", "60")
    assert leased >= previous - 1, (leased, previous)
    unleased, _ = run("plain-agent", None)
    assert unleased < previous // 2, unleased
    metrics = httpx.get(f"http://127.0.0.1:{stack.ports['metrics']}/metrics").text
    assert "gemma_serve:leased_slots 0.0" in metrics  # released by the second turn
