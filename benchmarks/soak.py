#!/usr/bin/env python3
"""Soak run: a mixed agent load with client disconnects and one worker kill, against a `gemma-serve up` this
script launches (the embedded model by default). Not a test: prints a table and writes JSON.

The load: --requests requests at --concurrency through the REST API, mixed (deterministic from --seed): streamed
chat, unary completions, chat with a JSON-schema `response_format`, chat with tools (`tool_choice: required`).
--disconnect of the clients hang up at a random moment (a stream after a few chunks, a unary request after a
random fraction of a second). When --kill-at of the requests have finished, the worker is killed with SIGKILL;
`up` restarts it.

Clients retry a 503 or a stream cut by the kill (after 1 s), as agents do. It reports: 5xx answers other than
the 503s of the kill window (from the kill until the gateway's /health is 200
again, plus 2 s), requests lost (the server accepted them — a 200 and headers — but they neither finished nor
ended with an error event), what the worker still holds afterwards (running and waiting requests, KV usage:
its /metrics after the load drains), and p50/p99 end-to-end latency of the completed requests.
Target: 0 lost, 0 held, 0 unexplained 5xx.

  python benchmarks/soak.py                       # 500 requests, concurrency 32, embedded model
  python benchmarks/soak.py --requests 100 --json /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

REPO = pathlib.Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                                    "maxLength": 16}},
                                                          "required": ["city"]}}}]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_stack(args) -> tuple[subprocess.Popen, str, str]:
    """Launch `gemma-serve up` on free ports and wait for it; returns (process, base URL, worker metrics URL)."""
    http, grpc_port, tok, worker, metrics = free_ports(5)
    cmd = [sys.executable, "-m", "gemma_serve.cli", "up", "--model", args.model, "--http-port", str(http),
           "--gateway-grpc-port", str(grpc_port), "--tokenizer-port", str(tok), "--worker-port", str(worker),
           "--worker-metrics-port", str(metrics), *args.up_args.split()]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    with open(args.log, "w") as log:  # the child keeps its own descriptor
        up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 1800
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return up, base, f"http://127.0.0.1:{metrics}/metrics"
        except httpx.HTTPError:
            pass
        if up.poll() is not None or time.monotonic() > deadline:
            up.kill()
            raise SystemExit(f"the stack did not start; see {args.log}")
        time.sleep(1)




def request_body(kind: str, i: int, model: str, rng: random.Random) -> tuple[str, dict]:
    """(path, body) of request i of the given kind."""
    max_tokens = rng.randint(8, 24)
    user = {"role": "user", "content": f"Request {i}: describe item {rng.randint(0, 10**6)} briefly."}
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": f"Item {i}:", "max_tokens": max_tokens,
                                   "temperature": 0.7, "seed": i}
    body = {"model": model, "messages": [user], "max_tokens": max_tokens, "temperature": 0.7, "seed": i}
    if kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        body["max_tokens"] = 40
    elif kind == "tool":
        body.update(tools=TOOLS, tool_choice="required", max_tokens=40)
    elif kind == "stream":
        body.update(stream=True, stream_options={"include_usage": True})
    return "/v1/chat/completions", body


async def one(client: httpx.AsyncClient, i: int, kind: str, path: str, body: dict, hangup: float | None) -> dict:
    """Run one request; returns its record (outcome: ok, http_error, disconnected, lost, transport_error)."""
    rec = {"i": i, "kind": kind, "start": time.monotonic(), "status": None, "code": None}
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body, timeout=180) as r:
                rec["status"] = r.status_code
                if r.status_code != 200:
                    rec["code"] = json.loads(await r.aread()).get("error", {}).get("code")
                    rec["outcome"] = "http_error"
                    return rec
                chunks, done, error = 0, False, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"].get("code")
                    chunks += 1
                    if hangup is not None and chunks >= 1 + int(hangup * 10):
                        rec["outcome"] = "disconnected"
                        return rec
                rec["code"] = error
                rec["outcome"] = "stream_error" if error else "ok" if done else "lost"
        else:
            timeout = hangup if hangup is not None else 180
            try:
                r = await client.post(path, json=body, timeout=timeout)
            except httpx.TimeoutException:
                rec["outcome"] = "disconnected" if hangup is not None else "lost"
                return rec
            rec["status"] = r.status_code
            rec["outcome"] = "ok" if r.status_code == 200 else "http_error"
            if r.status_code != 200:
                rec["code"] = r.json().get("error", {}).get("code")
    except httpx.TransportError as err:
        rec["outcome"], rec["code"] = "transport_error", type(err).__name__
    finally:
        rec["end"] = time.monotonic()
    return rec


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def soak(args, base: str, metrics_url: str, up: subprocess.Popen) -> dict:
    rng = random.Random(args.seed)
    kinds = rng.choices(["stream", "completion", "json", "tool"], weights=[40, 30, 15, 15], k=args.requests)
    async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=args.concurrency * 2)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        queue: asyncio.Queue = asyncio.Queue()
        for i, kind in enumerate(kinds):
            hangup = rng.random() if rng.random() < args.disconnect else None
            queue.put_nowait((i, kind, *request_body(kind, i, model, rng), hangup))
        records: list[dict] = []
        kill = {"at": None, "recovered": None}

        async def watch_recovery():
            while True:
                await asyncio.sleep(0.25)
                try:
                    if (await client.get("/health", timeout=2)).status_code == 200:
                        kill["recovered"] = time.monotonic()
                        return
                except httpx.HTTPError:
                    pass

        finals: list[dict] = []

        async def worker():
            while not queue.empty():
                item = queue.get_nowait()
                for attempt in range(60):  # as an agent would: retry what the server says to retry
                    rec = await one(client, *item)
                    rec["attempt"] = attempt
                    records.append(rec)
                    if not (rec["status"] == 503 or rec["outcome"] in ("stream_error", "transport_error")):
                        break
                    await asyncio.sleep(1.0)
                finals.append(rec)
                if kill["at"] is None and len(finals) >= args.kill_at * args.requests:
                    kill["at"] = time.monotonic()
                    os.kill(service_pid(up, "worker"), signal.SIGKILL)
                    asyncio.ensure_future(watch_recovery())

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.monotonic() - t0
        while kill["at"] is not None and kill["recovered"] is None:
            await asyncio.sleep(0.5)
    await asyncio.sleep(3)  # the worker ends disconnected requests' sequences
    held = {}
    text = httpx.get(metrics_url, timeout=5).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        held[name] = metric(text, "gemma_serve:" + name)
    gw = httpx.get(base + "/metrics", timeout=5).text
    for name in ("gateway_num_requests_running", "gateway_num_requests_waiting"):
        held[name] = metric(gw, "gemma_serve:" + name)
    window = (kill["at"], (kill["recovered"] or float("inf")) + 2.0)

    def explained(r):
        return r["status"] == 503 or r["outcome"] in ("stream_error", "transport_error")

    in_window = [r for r in records if window[0] is not None and r["end"] >= window[0] and r["start"] <= window[1]]
    unexplained = [r for r in records if (r["status"] or 0) >= 500 and not (r in in_window and explained(r))]
    unexplained += [r for r in records if r["outcome"] in ("stream_error", "transport_error") and r not in in_window]
    ok = [r["end"] - r["start"] for r in finals if r["outcome"] == "ok" and r["attempt"] == 0]
    counts: dict[str, int] = {}
    for r in finals:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return {
        "requests": len(finals), "attempts": len(records), "retried": sum(r["attempt"] > 0 for r in finals),
        "concurrency": args.concurrency, "wall_s": round(wall, 1), "outcomes": counts,
        "lost": sum(r["outcome"] == "lost" for r in records), "unexplained_5xx": len(unexplained),
        "unexplained": unexplained[:20], "kill_window_s": round(window[1] - window[0], 1) if kill["at"] else None,
        "kill_window_errors": sum(explained(r) for r in in_window), "held_after": held,
        "latency_p50_s": round(statistics.median(ok), 3) if ok else None,
        "latency_p99_s": round(statistics.quantiles(ok, n=100)[98], 3) if len(ok) >= 2 else None,
        "records": records,
    }


def service_pid(up: subprocess.Popen, name: str) -> int:
    """The pid of `up`'s child running service `name` (from /proc: no extra package)."""
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == up.pid and b"gemma_serve.cli" in cmd and name.encode() in cmd:
            return int(entry.name)
    raise LookupError(f"no {name} process under {up.pid}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect", type=float, default=0.2, help="share of clients that hang up early")
    p.add_argument("--kill-at", type=float, default=0.5, help="kill the worker when this share has finished")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="embedded")
    p.add_argument("--cache-dir", default=None, help="gemma-serve's cache (default: its own default)")
    p.add_argument("--json", default="soak.json", help="where to write the results (default: %(default)s)")
    p.add_argument("--up-args", default="--max-model-len 512 --prefill-chunks 64",
                   help="more flags for gemma-serve up (default: %(default)s)")
    args = p.parse_args()
    args.log = "soak-stack.log"
    up, base, metrics_url = start_stack(args)
    try:
        result = asyncio.run(soak(args, base, metrics_url, up))
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(120)
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"soak: {result['requests']} requests at concurrency {result['concurrency']} in {result['wall_s']} s "
          f"({os.cpu_count()} CPUs)")
    rows = [("outcomes", json.dumps(result["outcomes"])),
            ("retried", f"{result['retried']} requests ({result['attempts']} attempts in all)"),
            ("lost", result["lost"]),
            ("unexplained 5xx", result["unexplained_5xx"]),
            ("kill window", f"{result['kill_window_s']} s, {result['kill_window_errors']} errors in it"),
            ("held after", json.dumps(result["held_after"])),
            ("latency p50 / p99", f"{result['latency_p50_s']} s / {result['latency_p99_s']} s")]
    for name, value in rows:
        print(f"  {name:<18} {value}")
    print(f"records: {args.json}")
    return 0 if result["lost"] == 0 and result["unexplained_5xx"] == 0 and not any(result["held_after"].values()) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
