#!/usr/bin/env python3
"""Burst benchmark: R identical chat requests arriving together (a fan-out, a retry storm, a load test).

Not a test: prints a table and writes JSON. It starts `gemma-serve up` on free ports (the embedded model and
`make serve`'s defaults unless --up-args says otherwise) or connects to a running stack with --url (then
--metrics-url names the worker's Prometheus endpoint, `--worker-metrics-port`, 8001 by default).

The burst: --requests (16) copies of one chat request (a ~300-token system prompt, --system-repeat times, and a
question; temperature 0, `ignore_eos` so every answer is --max-tokens (200) long), every other one streamed, all
sent at once (--concurrency 16). The system prompt starts with a run tag that differs per run, so each run starts
with a cold prefix cache even against a long-running stack (--no-cache-bust keeps it fixed). The load average
printed includes the stack's own processes (about 2 on 2 cores while it decodes).

Printed: wall time from the first request to the last answer, per-request end-to-end latency p50 / max, how many
finished within --deadline (120) seconds, and from the worker's /metrics (differences over the burst): prompt tokens
received / reused from the prefix cache / computed (`gemma_serve:prompt_tokens_computed`; on a worker without that
counter, received - reused), engine steps, prefix-cache hits, and the mean queue, prefill (admission to first
token), decode, inter-token and end-to-end times the worker measured; and the load average during the burst.

  python benchmarks/burst.py                                     # start a stack: docs/performance.md, "Burst"
  python benchmarks/burst.py --max-tokens 64 --system-repeat 6 --json /tmp/burst.json   # a ~1900-token prompt
  python benchmarks/burst.py --url http://127.0.0.1:8000 --metrics-url http://127.0.0.1:8001/metrics
  python benchmarks/burst.py --in-process --prompt-tokens 415        # the worker's engine loop alone

Whether identical requests reach the worker in the same engine iteration depends on the machine: on 2 cores the
gateway and the tokenizer service get little CPU while the worker computes the first prompt, so the others often
arrive after it. --in-process takes arrival timing out: it builds the worker's engine in this process
(`model_worker.server.main.load_engine`, the worker's flags and defaults plus --up-args) and submits --requests
sequences of --prompt-tokens identical token ids to one `EngineLoop` at the same instant (greedy, ignore_eos);
e2e is then measured from submission to each sequence's last token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import statistics
import sys
import time
import uuid

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from soak import start_stack

REPO = pathlib.Path(__file__).resolve().parents[1]

SYSTEM_PROMPT = """\
You are the support assistant of a company that rents out cargo bikes in three cities. Answer in plain prose, \
in at most three short paragraphs, without lists or headings. Be concrete: name the bike model, the price and \
the place whenever the question calls for it, and say so plainly when you do not know something.

Facts you may use. The fleet has three models: the Longtail (two child seats or 80 kg of cargo, 35 euro a day), \
the Box (a front box for 100 kg or four children, 45 euro a day) and the Trike (three wheels, a covered box, \
55 euro a day). Every bike has electric assistance up to 25 km/h and a range of about 60 km on one battery. \
Rentals start at 8:00 and end at 20:00 on the same day, or run over several days at a 20 percent discount from \
the third day on. The stations are at the central railway station, at the harbour and at the university \
campus; a bike may be returned at any station. A deposit of 200 euro is held on the customer's card and \
released within two working days. Helmets, rain covers and child seats are included. Damage below 100 euro is \
covered; beyond that the customer pays the difference. Children under 12 must wear a helmet, and the rider \
must be at least 18 years old and show an identity document. Bookings can be changed free of charge until the \
day before; later changes cost 10 euro. Customers with a yearly pass (390 euro) ride 50 days a year for free.
"""
QUESTION = "We are a family of four with two small children. Which bike should we rent for a day trip to the " \
           "beach, what will it cost, and where do we pick it up and return it?"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value} (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def counter(m: dict[str, float], name: str) -> float | None:
    """A sample's value: `name` may carry labels (`steps{kind="decode"}`); a counter's `_total` suffix is
    optional. None when the worker does not export it."""
    base, brace, labels = name.partition("{")
    for key in (base + "_total" + brace + labels, name):
        if key in m:
            return m[key]
    return None


def worker_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """The worker's figures over the burst, from two /metrics scrapes."""
    p = "gemma_serve:"

    def d(name: str) -> float | None:
        a, b = counter(after, p + name), counter(before, p + name)
        return None if a is None or b is None else a - b

    received, cached, computed = d("prompt_tokens"), d("prompt_tokens_cached"), d("prompt_tokens_computed")
    if computed is None and received is not None and cached is not None:
        computed = received - cached  # a worker from before the computed-prompt counter
    steps = {k: d(f'engine_steps{{kind="{k}"}}') for k in ("compute", "decode", "mixed", "copy")}

    def mean(histogram: str) -> float | None:
        total, count = d(histogram + "_sum"), d(histogram + "_count")
        return round(total / count, 3) if total is not None and count else None

    return {"prompt_tokens": received, "prompt_tokens_cached": cached, "prompt_tokens_computed": computed,
            "steps": steps, "prefix_cache_hits": d("prefix_cache_hits"),
            "mean_s": {name: mean(f"{name}_seconds") for name in (
                "request_queue_time", "request_prefill_time", "request_decode_time", "time_to_first_token",
                "inter_token_latency", "e2e_request_latency")}}


async def sample_load(samples: list[float], period: float = 5.0) -> None:
    """Append this machine's 1-minute load average every `period` seconds (other work slows a CPU server)."""
    while True:
        samples.append(os.getloadavg()[0])
        await asyncio.sleep(period)


async def one(client: httpx.AsyncClient, body: dict, t0: float, timeout: float) -> dict:
    """Send one request; returns its record (ok, e2e seconds, completion tokens)."""
    rec = {"stream": bool(body.get("stream")), "ok": False, "e2e_s": None, "completion_tokens": None, "error": None,
           "text": ""}
    try:
        if body.get("stream"):
            async with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return rec
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        rec["ok"] = rec["error"] is None
                        break
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            rec["error"] = event["error"].get("message")
                        if event.get("usage"):
                            rec["completion_tokens"] = event["usage"]["completion_tokens"]
                        for choice in event.get("choices") or []:
                            rec["text"] += choice["delta"].get("content") or ""
        else:
            r = await client.post("/v1/chat/completions", json=body, timeout=timeout)
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                return rec
            answer = r.json()
            rec["ok"], rec["completion_tokens"] = True, answer["usage"]["completion_tokens"]
            rec["text"] = answer["choices"][0]["message"]["content"] or ""
    except httpx.HTTPError as err:
        rec["error"] = f"{type(err).__name__}: {err}"
    finally:
        rec["e2e_s"] = round(time.monotonic() - t0, 3)
    return rec


async def burst(args, base: str, metrics_url: str) -> dict:
    """Send the burst and gather the client-side and worker-side figures."""
    tag = "" if args.no_cache_bust else f"[run {uuid.uuid4().hex[:8]}] "
    async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=args.concurrency)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = parse_metrics((await client.get(metrics_url)).text)
        gate = asyncio.Semaphore(args.concurrency)
        t0 = time.monotonic()

        async def request(i: int) -> dict:
            body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "system", "content": tag + SYSTEM_PROMPT * args.system_repeat},
                                 {"role": "user", "content": QUESTION}]}
            if i % 2:
                body.update(stream=True, stream_options={"include_usage": True})
            async with gate:
                return await one(client, body, t0, args.timeout)

        loads: list[float] = []
        sampler = asyncio.create_task(sample_load(loads))
        records = await asyncio.gather(*(request(i) for i in range(args.requests)))
        wall = time.monotonic() - t0
        sampler.cancel()
        await asyncio.sleep(0.5)  # the worker refreshes its counters after each iteration
        after = parse_metrics((await client.get(metrics_url)).text)
    done = [r["e2e_s"] for r in records if r["ok"]]
    return {
        "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "cpus": os.cpu_count(), "wall_s": round(wall, 2),
        "e2e_p50_s": round(statistics.median(done), 2) if done else None,
        "e2e_max_s": round(max(done), 2) if done else None,
        "finished": len(done), f"within_{args.deadline:g}s": sum(1 for t in done if t <= args.deadline),
        "errors": [r["error"] for r in records if r["error"]],
        "distinct_answers": len({r["text"] for r in records if r["ok"]}),
        "worker": worker_delta(before, after), "records": records,
        "load_avg": round(statistics.mean(loads), 2) if loads else None,
    }


def in_process(args) -> dict:
    """The burst on the worker's EngineLoop in this process, every sequence submitted at once."""
    import threading

    import numpy as np

    sys.path.insert(0, str(REPO))  # this checkout's worker, whichever one the environment installed
    from gemma_serve.cli import build_parser
    from gemma_serve.models import prepare
    from model_worker.server.main import load_engine, prepare_async_scheduling
    from model_worker.serving.loop import EngineLoop, wait_idle
    from model_worker.serving.sequence import Finish, SamplingSpec, Sequence

    flags = ["worker", "--model", args.model, *(["--cache-dir", args.cache_dir] if args.cache_dir else []),
             *args.up_args.split()]
    wargs = build_parser().parse_args(flags)
    engine, _ = load_engine(prepare(wargs.model, pathlib.Path(wargs.cache_dir)), wargs)
    prompt = np.random.default_rng(0).integers(1000, 100_000, args.prompt_tokens).tolist()
    done_at: dict[int, float] = {}
    all_done = threading.Event()

    def sink_for(i: int):
        def sink(ev):
            if ev.finish != Finish.NONE:
                done_at[i] = time.monotonic()
                if len(done_at) == args.requests:
                    all_done.set()
        return sink

    seqs = [Sequence(f"burst-{i}", list(prompt), SamplingSpec(), args.max_tokens, frozenset(), sink_for(i))
            for i in range(args.requests)]
    loop = EngineLoop(engine, async_scheduling=prepare_async_scheduling(wargs, engine))
    t0 = time.monotonic()
    for seq in seqs:
        loop.submit(seq)
    loop.start()
    try:
        all_done.wait(args.timeout)
        wait_idle(loop)
    finally:
        loop.stop()
    e2e = sorted(done_at[i] - t0 for i in done_at)
    computed = sum(len(s.prompt) - s.cached_tokens for s in seqs)
    return {
        "requests": args.requests, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
        "cpus": os.cpu_count(), "wall_s": round(max(e2e), 2) if e2e else None,
        "e2e_p50_s": round(statistics.median(e2e), 2) if e2e else None,
        "e2e_max_s": round(max(e2e), 2) if e2e else None,
        "finished": len(e2e), f"within_{args.deadline:g}s": sum(1 for t in e2e if t <= args.deadline),
        "worker": {"prompt_tokens": args.requests * args.prompt_tokens,
                   "prompt_tokens_cached": sum(s.cached_tokens for s in seqs), "prompt_tokens_computed": computed,
                   "steps": {k: loop.steps[k] for k in ("compute", "decode", "mixed", "copy", "ahead")}},
        "load_avg": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    """Parse flags, run one burst (starting a stack unless --url), print the table, write --json."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default=None, help="base URL of a running stack (default: start one)")
    p.add_argument("--metrics-url", default="http://127.0.0.1:8001/metrics", help="worker /metrics (with --url)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--system-repeat", type=int, default=1,
                   help="repeat the system prompt (~300 tokens) this many times: a longer prefill")
    p.add_argument("--deadline", type=float, default=120.0, help="count the answers finished within this many s")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout, seconds")
    p.add_argument("--no-cache-bust", action="store_true", help="keep the system prompt identical across runs")
    p.add_argument("--model", default="embedded", help="model of the started stack")
    p.add_argument("--cache-dir", default=None, help="gemma-serve's cache for the started stack")
    p.add_argument("--up-args", default="", help="more flags for the started `gemma-serve up`")
    p.add_argument("--log", default="burst-stack.log", help="the started stack's log")
    p.add_argument("--json", default="burst.json", help="where to write the results")
    p.add_argument("--in-process", action="store_true", help="drive the worker's engine loop in this process")
    p.add_argument("--prompt-tokens", type=int, default=415, help="prompt length with --in-process")
    args = p.parse_args()
    if args.in_process:
        result = in_process(args)
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"burst in process: {args.requests} identical {args.prompt_tokens}-token prompts submitted at once "
              f"(max_tokens {args.max_tokens}, ignore_eos), {result['cpus']} CPUs")
        print_rows(args, result, [("load average (last minute)", result["load_avg"])])
        return 0 if result["finished"] == args.requests else 1
    up = None
    try:
        if args.url:
            base, metrics_url = args.url.rstrip("/"), args.metrics_url
        else:
            up, base, metrics_url = start_stack(args)
        result = asyncio.run(burst(args, base, metrics_url))
    finally:
        if up is not None:
            up.send_signal(signal.SIGTERM)
            up.wait(120)
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    w = result["worker"]
    print(f"burst: {args.requests} identical chat requests (max_tokens {args.max_tokens}, ignore_eos, half "
          f"streamed) at concurrency {args.concurrency}, {result['cpus']} CPUs")
    print_rows(args, result, [
        ("worker means (s)", json.dumps({k: v for k, v in w["mean_s"].items() if v is not None})),
        ("load average during the burst", result["load_avg"]),
        ("prefix-cache hits", w["prefix_cache_hits"]),
        ("distinct answers (greedy: 1 expected)", result["distinct_answers"])])
    for err in result["errors"][:5]:
        print(f"  error: {err}")
    return 0 if result["finished"] == args.requests else 1


def print_rows(args, result: dict, more: list[tuple[str, object]]) -> None:
    """Print the figures both modes share, then `more`."""
    w = result["worker"]
    rows = [("wall to last answer", f"{result['wall_s']} s"),
            ("e2e p50 / max", f"{result['e2e_p50_s']} s / {result['e2e_max_s']} s"),
            (f"finished within {args.deadline:g} s",
             f"{result[f'within_{args.deadline:g}s']} of {args.requests} ({result['finished']} finished in all)"),
            ("prompt tokens received / reused / computed",
             f"{w['prompt_tokens']} / {w['prompt_tokens_cached']} / {w['prompt_tokens_computed']}"),
            ("engine steps", json.dumps(w["steps"]))]
    for name, value in rows + more:
        print(f"  {name:<44} {value}")
    print(f"records: {args.json}")


if __name__ == "__main__":
    sys.exit(main())
