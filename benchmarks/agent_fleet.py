#!/usr/bin/env python3
"""Agent-fleet benchmark: N concurrent multi-turn agents against any OpenAI-compatible server.

Not a test: prints a table and writes everything (per-request records too) to --json.

Each agent runs one conversation on /v1/chat/completions with `stream: true` and
`stream_options: {include_usage: true}`, temperature 0 (or, with `--temperature T [--top-p P]`, sampled with a
seed per agent and turn, as agents' clients mostly send):
  turn 1:  [system prompt shared by all agents (~400 tokens of agent instructions),
            user: the agent's task + a first tool result]
  turn t:  ... + assistant: exactly the text the model returned in turn t-1
               + user: a "tool result" (JSON blob, log excerpt, test output, ...; 50-400 tokens)
so the prompt grows every turn (~600 tokens at turn 1, ~5-6k at turn 20 with the defaults). Each turn's
max_tokens comes from a skewed distribution (mostly 12-40 token "tool calls", some 150-300 token answers);
answers end naturally or at max_tokens (the embedded model is a base model: it rarely stops early). All
content and every max_tokens are deterministic from --seed and the agent index, so agent i does the same
work whatever N is; only the run tag at the top of the system prompt changes per N run (so each N starts
with a cold prefix cache; --no-cache-bust keeps it fixed).

Several N (--agents 1 2 4 8) run one after another in one invocation, each with a fresh fleet.
(benchmarks/llama_cpp_server.sh runs one N per invocation instead, as llama-server's slot count is fixed
at start.)

Measured per request: TTFT (to the first non-empty content chunk), inter-token intervals (between content
chunks; when a server packs several tokens into a chunk, usage.completion_tokens is spread over the chunks
by text length and a chunk carrying k tokens counts as k intervals of gap/k), end-to-end latency,
prompt/completion tokens (usage), cached prompt tokens (usage.prompt_tokens_details.cached_tokens, else
llama.cpp's timings: prompt - timings.prompt_n). TPOT = (e2e - TTFT) / (completion_tokens - 1). Goodput
counts only requests with TTFT <= --slo-ttft and TPOT <= --slo-tpot (one-token answers: TTFT alone).
Prefill "computed" = prompt - cached; "new" = prompt - (the same agent's previous prompt + completion),
turn 1: the whole prompt; computed/new = 1.00 means only the new tokens were prefilled.

Defaults: 20 turns, tool results 50-400 tokens (log-uniform), max_tokens 12-40 (p=0.8) or 150-300 (p=0.2),
N = 1 2 4 8: 300 requests, ~21k output tokens, prompts up to ~6-7k tokens. Sized for ~15 minutes against
a slow 2-core CPU server: llama.cpp's llama-server (embedded 270M Q4_K_M, 2 threads, 2-core x86) took 4.2 min
for N = 8 and 1.5-2.5 min for N = 1, so about 10-11 min for all four N. For a server much slower than that,
use fewer turns (--turns 12) or fewer fleet sizes (--agents 1 8). --quick: 5 turns, tool results 30-150
tokens, max_tokens 8-24 / 60-120: ~35 s for N = 1 and 8 against llama-server. Run on an otherwise idle
machine: each table prints this machine's load average during the run, and a server that uses every core
slows down several-fold when anything else competes for them.

  python benchmarks/agent_fleet.py --base-url http://127.0.0.1:8000/v1 --model gemma-3-270m
  python benchmarks/agent_fleet.py --agents 1 8 --quick --json /tmp/fleet.json
  benchmarks/llama_cpp_server.sh bench 1 8 -- --quick         # the same against llama.cpp
  python benchmarks/agent_fleet.py --compare --agents 1 8 --quick   # ours, then llama.cpp, and the ratios
  python benchmarks/agent_fleet.py --workers 1 2 --agents 8 --quick  # 1 worker, then 2: routing quality
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import pathlib
import random
import sys
import time
import uuid

import httpx
import numpy as np

# Characters per token of the generated tool output under the Gemma 3 tokenizer (measured with llama-server's
# /tokenize: ids, numbers and JSON indentation tokenize densely). Only used to size the tool results.
CHARS_PER_TOKEN = {"log": 2.05, "json": 2.05, "tests": 2.9}

SYSTEM_PROMPT = """\
You are Forge, an autonomous software engineering agent working in a sandboxed checkout of a \
production Python service. You complete the user's task by calling tools and reading their results.

## Tools
- `shell(cmd)`: run a shell command in the repository root; returns exit code, stdout and stderr \
(truncated to 4 KB).
- `read_file(path, start, end)`: return lines start..end of a file.
- `search(pattern, path)`: ripgrep for a regular expression; returns matching lines with file and line.
- `apply_patch(diff)`: apply a unified diff; fails if any hunk does not apply cleanly.
- `run_tests(selector)`: run pytest on the selector; returns a summary and the first failures.

## How to work
1. Restate the goal in one sentence, then plan at most five steps.
2. Read code and logs before changing anything. Never guess file contents.
3. Make the smallest change that fixes the root cause. Keep the existing style, naming and error handling.
4. After every change, run the narrowest relevant tests, then the wider suite before finishing.
5. If a tool fails twice in the same way, stop and explain what you tried instead of retrying blindly.

## Output format
To call a tool, answer with exactly one line of JSON: {"tool": "<name>", "args": {...}} and nothing else.
When you have enough information to answer or the task is done, write a short report: what was wrong, \
what you changed (files and functions), how you verified it, and any risk or follow-up for a reviewer.

## Rules
- Do not modify tests to make them pass unless the task says the test is wrong.
- Do not touch files under vendor/, migrations/ or generated/ directories.
- Do not print secrets; redact anything that looks like a token, password or key.
- Timestamps in logs are UTC; durations are in seconds unless the name ends in _ms.
- Be concise."""

TASKS = [
    "The /orders/export endpoint times out for large accounts since yesterday's deploy. Find the cause.",
    "CI is red: test_refund_partial fails intermittently with a rounding error. Make it deterministic.",
    "p99 latency of the search API doubled after the cache library upgrade. Investigate and propose a fix.",
    "Users report duplicate notification emails after retries. Find where idempotency is lost and fix it.",
    "The nightly billing job crashed with a KeyError on a new plan type. Handle unknown plans safely.",
    "Memory of the worker pods grows until OOM-kill every ~6 hours. Find the leak from metrics and logs.",
    "A migration left NULLs in invoices.currency. Make the reader tolerant and write a backfill script.",
    "The rate limiter lets bursts through when two replicas start at once. Find the race and fix it.",
]
TOOLS = ["shell", "read_file", "search", "run_tests"]
MODULES = (
    "orders",
    "billing",
    "search",
    "notify",
    "auth",
    "export",
    "ratelimit",
    "invoices",
    "worker",
    "cache",
)
LEVELS = ["INFO"] * 6 + ["DEBUG"] * 3 + ["WARN"] * 2 + ["ERROR"]
_WORDS_TEXT = (
    "request handler timeout retry batch cursor commit rollback queue consumer producer shard replica lease "
    "token session account invoice order refund currency amount page limit offset index query plan "
    "cache miss hit evict ttl latency bytes rows"
)
WORDS = _WORDS_TEXT.split()


# ----------------------------------------------------------------------------------------------- content


def _log_excerpt(rng: random.Random, chars: int) -> str:
    """Service log lines until about `chars` characters."""
    lines, t = [], rng.randint(0, 80_000)
    while sum(map(len, lines)) < chars:
        t += rng.randint(1, 900)
        mod, lvl = rng.choice(MODULES), rng.choice(LEVELS)
        msg = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        stamp = f"2025-03-{rng.randint(10, 28):02d}T{t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}"
        lines.append(
            f"{stamp}.{rng.randint(0, 999):03d}Z {lvl:<5} {mod}.{rng.choice(WORDS)} "
            f"req={rng.getrandbits(40):010x} {msg} dur_ms={rng.randint(1, 4000)}"
        )
    return "\n".join(lines)


def _json_blob(rng: random.Random, chars: int) -> str:
    """A JSON search/metrics result until about `chars` characters."""
    items: list[dict] = []
    while len(json.dumps(items, indent=1)) < chars:
        mod, fn, arg = rng.choice(MODULES), f"{rng.choice(WORDS)}_{rng.choice(WORDS)}", rng.choice(WORDS)
        items.append(
            {
                "file": f"src/{mod}/{rng.choice(WORDS)}_{rng.choice(WORDS)}.py",
                "line": rng.randint(1, 900),
                "match": f"def {fn}(self, {arg}, timeout={rng.randint(1, 60)}):",
                "p99_ms": round(rng.uniform(2, 3000), 1),
                "calls": rng.randint(1, 10**6),
            }
        )
    return json.dumps({"results": items, "truncated": False}, indent=1)


def _test_output(rng: random.Random, chars: int) -> str:
    """pytest-like output until about `chars` characters."""
    lines = [f"============ test session starts ============ collected {rng.randint(40, 900)} items"]
    while sum(map(len, lines)) < chars:
        mod = rng.choice(MODULES)
        name = f"tests/{mod}/test_{rng.choice(WORDS)}.py::test_{rng.choice(WORDS)}_{rng.choice(WORDS)}"
        if rng.random() < 0.8:
            lines.append(f"{name} PASSED")
        else:
            lines.append(f"{name} FAILED")
            lines.append(f"E   AssertionError: assert {rng.randint(0, 10**4)} == {rng.randint(0, 10**4)}")
            lines.append(f"src/{mod}/{rng.choice(WORDS)}.py:{rng.randint(1, 800)}: in {rng.choice(WORDS)}")
    return "\n".join(lines)


CONTENT_KINDS = {"log": _log_excerpt, "json": _json_blob, "tests": _test_output}


def tool_result(rng: random.Random, turn: int, target_tokens: int) -> str:
    """A user message carrying one tool result of about `target_tokens` tokens (deterministic from rng)."""
    tool, kind = rng.choice(TOOLS), rng.choice(sorted(CONTENT_KINDS))
    chars = int(target_tokens * CHARS_PER_TOKEN[kind])
    body = CONTENT_KINDS[kind](rng, chars)[:chars]  # cut to size, as tools truncate their output
    return (
        f"Tool result (call_{turn:02d}, {tool}, exit_code={rng.choice([0, 0, 0, 1])}):\n{body}\n\nContinue."
    )


def system_prompt(run_tag: str) -> str:
    """The system prompt shared by the agents of one run; `run_tag` keeps runs from sharing a prefix cache."""
    return f"Deployment: {run_tag}\n{SYSTEM_PROMPT}" if run_tag else SYSTEM_PROMPT


# ----------------------------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class Workload:
    """Sizes of one agent's conversation (in tokens; tool sizes are approximate: see CHARS_PER_TOKEN)."""

    turns: int
    tool_tokens: tuple[int, int]
    short_tokens: tuple[int, int]
    long_tokens: tuple[int, int]
    long_frac: float


@dataclasses.dataclass(frozen=True)
class TurnPlan:
    """What one turn of one agent sends: the new user message and the max_tokens."""

    user: str
    max_tokens: int


def plan_agent(seed: int, agent: int, w: Workload) -> list[TurnPlan]:
    """The deterministic turn plan of agent `agent` (independent of how many agents run)."""
    rng = random.Random(f"{seed}/{agent}")
    lo, hi = w.tool_tokens
    plans = []
    for turn in range(1, w.turns + 1):
        # log-uniform sizes: many short results, some long ones
        tokens = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        user = tool_result(rng, turn, tokens)
        if turn == 1:
            user = f"Task: {TASKS[agent % len(TASKS)]}\n\n{user}"
        a, b = w.long_tokens if rng.random() < w.long_frac else w.short_tokens
        plans.append(TurnPlan(user=user, max_tokens=rng.randint(a, b)))
    return plans


# ----------------------------------------------------------------------------------------------- requests


@dataclasses.dataclass
class RequestRecord:
    """Measurements of one streamed chat completion."""

    agent: int
    turn: int
    max_tokens: int
    start: float = 0.0  # seconds since the fleet started
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # content chunk arrivals, fleet clock
    itl: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_source: str | None = None  # "usage" | "llama.cpp timings" | None
    finish_reason: str | None = None
    timings: dict | None = None  # llama.cpp's own per-request timings, when sent
    text: str = ""
    error: str | None = None
    refused: bool = False  # answered 429 (a latency target out of reach): a miss; the agent retries the turn
    new_tokens: int | None = None  # filled in after the run

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (completion_tokens - 1); None below two tokens."""
        if self.ttft is None or self.e2e is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    @property
    def computed_tokens(self) -> int | None:
        """Prompt tokens the server actually prefilled (prompt - cached), when the cache is reported."""
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens


def _cached_from(event: dict) -> tuple[int | None, str | None]:
    """Cached prompt tokens from a final chunk: OpenAI's usage field, else llama.cpp's timings."""
    usage = event.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"]), "usage"
    timings = event.get("timings") or {}
    if "prompt_n" in timings and usage.get("prompt_tokens") is not None:
        return int(usage["prompt_tokens"]) - int(timings["prompt_n"]), "llama.cpp timings"
    return None, None


def _apply_event(rec: RequestRecord, event: dict, now: float, pieces: list[str]) -> None:
    """Fold one SSE chunk into the record."""
    for choice in event.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            rec.chunk_times.append(now)
            pieces.append(content)
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    if event.get("timings"):
        rec.timings = event["timings"]
    usage = event.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")
        rec.cached_tokens, rec.cached_source = _cached_from(event)


def inter_token_intervals(
    chunk_times: list[float], pieces: list[str], completion_tokens: int | None
) -> list[float]:
    """Intervals between tokens from content-chunk arrival times.

    One token per chunk when the counts agree; otherwise the usage's completion tokens are spread over the
    chunks in proportion to their text length (at least one each), and the gap before a chunk carrying k
    tokens counts as k intervals of gap/k.
    """
    gaps = np.diff(chunk_times)
    n = len(pieces)
    if not completion_tokens or completion_tokens <= n:
        return gaps.tolist()
    lengths = np.array([max(len(p), 1) for p in pieces], dtype=float)
    extra = completion_tokens - n
    share = lengths / lengths.sum() * extra
    k = 1 + np.floor(share).astype(int)
    for i in np.argsort(-(share - np.floor(share)))[: completion_tokens - int(k.sum())]:
        k[i] += 1
    out: list[float] = []
    for gap, ki in zip(gaps, k[1:]):
        out.extend([gap / ki] * int(ki))
    return out


class Refused(Exception):
    """A 429: the server refused the request (its queue, or a latency target out of reach); retry after
    `retry_after` seconds, as the OpenAI clients do."""

    def __init__(self, retry_after: float):
        super().__init__(f"refused; retry after {retry_after} s")
        self.retry_after = retry_after


#: The sampling fields of every request (`--temperature`, `--top-p`; greedy by default). Sampled requests also send
#: a seed per agent and turn, so a run is repeatable and both servers draw for the same requests.
SAMPLING: dict = {"temperature": 0}

#: Times an agent retries a refused turn before it gives up.
MAX_RETRIES = 8


async def stream_chat(
    client: httpx.AsyncClient, model: str, messages: list[dict], rec: RequestRecord, t0: float
) -> str:
    """Send one streaming chat completion, fill `rec`, and return the generated text."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": rec.max_tokens,
        **SAMPLING,
        **({"seed": rec.agent * 1000 + rec.turn} if SAMPLING.get("temperature") else {}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces: list[str] = []
    rec.start = time.perf_counter() - t0
    async with client.stream("POST", "/chat/completions", json=body) as resp:
        if resp.status_code == 429:
            await resp.aread()
            raise Refused(float(resp.headers.get("retry-after", "1")))
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            _apply_event(rec, event, time.perf_counter() - t0, pieces)
    end = time.perf_counter() - t0
    rec.e2e = end - rec.start
    if rec.chunk_times:
        rec.ttft = rec.chunk_times[0] - rec.start
    if rec.completion_tokens is None:
        rec.completion_tokens = len(pieces)
    rec.itl = inter_token_intervals(rec.chunk_times, pieces, rec.completion_tokens)
    rec.text = "".join(pieces)
    return rec.text


class Progress:
    """Prints a line to stderr each time every agent of the fleet is past a turn."""

    def __init__(self, agents: int, turns: int, t0: float):
        self.agents, self.turns, self.t0 = agents, turns, t0
        self.done = [0] * (turns + 1)

    def turn_done(self, turn: int, errors: bool = False) -> None:
        """Agent finished `turn` (errors: it failed and gives up its remaining turns too)."""
        for t in range(turn, self.turns + 1 if errors else turn + 1):
            self.done[t] += 1
            if self.done[t] == self.agents:
                elapsed = time.perf_counter() - self.t0
                print(
                    f"  N={self.agents}: turn {t}/{self.turns} done at {elapsed:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )


async def run_agent(
    client: httpx.AsyncClient,
    model: str,
    agent: int,
    system: str,
    plans: list[TurnPlan],
    t0: float,
    progress: Progress,
) -> list[RequestRecord]:
    """One agent's conversation; stops at the first failed request (the conversation cannot go on)."""
    messages = [{"role": "system", "content": system}]
    records = []
    for turn, plan in enumerate(plans, start=1):
        messages.append({"role": "user", "content": plan.user})
        for attempt in range(MAX_RETRIES + 1):
            rec = RequestRecord(agent=agent, turn=turn, max_tokens=plan.max_tokens)
            records.append(rec)
            try:
                answer = await stream_chat(client, model, messages, rec, t0)
                break
            except Refused as e:
                rec.refused, rec.error = True, str(e)
                if attempt == MAX_RETRIES:
                    break
                await asyncio.sleep(e.retry_after)
            except Exception as e:  # noqa: BLE001 - recorded and reported, the fleet goes on
                rec.error = f"{type(e).__name__}: {e}"
                break
        if rec.error is not None:
            progress.turn_done(turn, errors=True)
            break
        progress.turn_done(turn)
        messages.append({"role": "assistant", "content": answer})
    return records


def fill_new_tokens(records: list[RequestRecord]) -> None:
    """new_tokens = prompt - (previous turn's prompt + completion) of the same agent; turn 1: the prompt."""
    prev: dict[int, RequestRecord] = {}
    for rec in sorted(records, key=lambda r: (r.agent, r.turn)):
        p = prev.get(rec.agent)
        if rec.prompt_tokens is not None:
            if p is None:
                rec.new_tokens = rec.prompt_tokens
            elif p.prompt_tokens is not None and p.completion_tokens is not None:
                rec.new_tokens = rec.prompt_tokens - p.prompt_tokens - p.completion_tokens
        prev[rec.agent] = rec


async def sample_load(samples: list[float], period: float = 5.0) -> None:
    """Append this machine's 1-minute load average every `period` seconds until cancelled.

    With the server on the same machine, a load well above what the server itself uses means other processes
    competed for the CPU and the latencies are not the server's alone.
    """
    while True:
        samples.append(os.getloadavg()[0])
        await asyncio.sleep(period)


async def run_fleet(args: argparse.Namespace, n: int, w: Workload) -> dict:
    """Run n agents concurrently; return the raw records and the wall time."""
    run_tag = "" if args.no_cache_bust else f"fleet-N{n}-{uuid.uuid4().hex[:12]}"
    system = system_prompt(run_tag)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    # Over a unix socket (--uds: `gemma-serve up --uds DIR` serves DIR/api.sock) the transport carries the socket
    # and the connection limits; the URL's host is only the Host header.
    transport = httpx.AsyncHTTPTransport(uds=args.uds, limits=limits) if args.uds else None
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=timeout, limits=limits, transport=transport
    ) as client:
        t0 = time.perf_counter()
        progress = Progress(n, w.turns, t0)
        loads: list[float] = []
        sampler = asyncio.create_task(sample_load(loads))
        per_agent = await asyncio.gather(
            *(
                run_agent(client, args.model, a, system, plan_agent(args.seed, a, w), t0, progress)
                for a in range(n)
            )
        )
        wall = time.perf_counter() - t0
        sampler.cancel()
    records = [r for recs in per_agent for r in recs]
    fill_new_tokens(records)
    loads = loads or [os.getloadavg()[0]]
    load = {"max": max(loads), "mean": sum(loads) / len(loads), "cpus": os.cpu_count()}
    return {"agents": n, "run_tag": run_tag, "wall_s": wall, "load_avg_1m": load, "records": records}


# ----------------------------------------------------------------------------------------------- stats


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), None for no values."""
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord], wall: float | None, slo_ttft: float, slo_tpot: float) -> dict:
    """Latency percentiles, throughput, goodput and prefill work of `records` (wall: the run's wall time)."""
    ok = [r for r in records if r.error is None and r.e2e is not None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    itl = [x for r in ok for x in r.itl]
    good = [
        r for r in ok if r.ttft is not None and r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)
    ]
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    computed = [r.computed_tokens for r in ok if r.computed_tokens is not None and r.new_tokens is not None]
    new = [r.new_tokens for r in ok if r.computed_tokens is not None and r.new_tokens is not None]
    refused = sum(r.refused for r in records)
    s = {
        "requests": len(ok),
        "errors": len(records) - len(ok) - refused,
        "refused": refused,
        # DistServe's attainment: requests meeting both targets over all requests, refused ones counted as misses.
        "slo_attainment": len(good) / (len(ok) + refused) if ok or refused else None,
        "prompt_tokens_p50": pct([r.prompt_tokens for r in ok if r.prompt_tokens is not None], 50),
        "completion_tokens": out_tokens,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50),
        "tpot_p99": pct(tpot, 99),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
        "slo_met": len(good),
        "prefill_computed": sum(computed) if computed else None,
        "prefill_new": sum(new) if new else None,
        "computed_over_new": (sum(computed) / sum(new)) if computed and sum(new) > 0 else None,
        "cached_reported": sum(r.cached_tokens is not None for r in ok),
        "cached_share": (sum(r.cached_tokens or 0 for r in ok) / sum(r.prompt_tokens or 0 for r in ok))
        if any(r.prompt_tokens for r in ok) else None,
    }
    if wall:
        s.update(
            wall_s=wall,
            output_tok_s=out_tokens / wall,
            request_s=len(ok) / wall,
            goodput_req_s=len(good) / wall,
            goodput_tok_s=sum(r.completion_tokens or 0 for r in good) / wall,
        )
    return s


def summarize_run(run: dict, slo_ttft: float, slo_tpot: float) -> dict:
    """Overall and per-turn summaries of one fleet run."""
    records = run["records"]
    turns = sorted({r.turn for r in records})
    return {
        "overall": summarize(records, run["wall_s"], slo_ttft, slo_tpot),
        "per_turn": {
            t: summarize([r for r in records if r.turn == t], None, slo_ttft, slo_tpot) for t in turns
        },
    }


# ----------------------------------------------------------------------------------------------- output


def _f(v, scale: float = 1.0, digits: int = 0) -> str:
    """Format a number (scaled) or '-' for None."""
    return "-" if v is None else f"{v * scale:.{digits}f}"


TURN_COLUMNS = (
    f"{'turn':>5} {'reqs':>4} {'prompt':>6} {'ttft p50':>8} {'p99':>6} {'tpot p50':>8} {'p99':>5} "
    f"{'itl p50':>7} {'p99':>5} {'out tok':>7} {'computed':>8} {'new':>6} {'c/new':>5} {'slo ok':>6}"
)


def turn_row(label: str, s: dict) -> str:
    """One table row (times in ms)."""
    return (
        f"{label:>5} {s['requests']:>4} {_f(s['prompt_tokens_p50']):>6} {_f(s['ttft_p50'], 1e3):>8} "
        f"{_f(s['ttft_p99'], 1e3):>6} {_f(s['tpot_p50'], 1e3, 1):>8} {_f(s['tpot_p99'], 1e3):>5} "
        f"{_f(s['itl_p50'], 1e3, 1):>7} {_f(s['itl_p99'], 1e3):>5} {s['completion_tokens']:>7} "
        f"{_f(s['prefill_computed']):>8} {_f(s['prefill_new']):>6} {_f(s['computed_over_new'], 1, 2):>5} "
        f"{s['slo_met']:>3}/{s['requests']:<2}"
    )


def report_turns(n_turns: int, all_turns: bool) -> list[int]:
    """Which turns the table shows: all, or first / quartiles / middle / last."""
    if all_turns or n_turns <= 6:
        return list(range(1, n_turns + 1))
    return sorted({1, 2, round(n_turns / 4), round(n_turns / 2), round(3 * n_turns / 4), n_turns} - {0})


def print_run(run: dict, n_turns: int, all_turns: bool) -> None:
    """The per-turn table of one fleet run, with its overall row and throughput line."""
    n, o, load = run["agents"], run["summary"]["overall"], run["load_avg_1m"]
    agents = f"{n} agent{'s' * (n != 1)}"
    print(
        f"\n== {agents}: {o['requests']} requests, {o['errors']} errors, wall {o['wall_s']:.1f} s "
        f"(this machine's load avg: mean {load['mean']:.1f}, max {load['max']:.1f} on {load['cpus']} CPUs)"
    )
    print(TURN_COLUMNS)
    for t in report_turns(n_turns, all_turns):
        if t in run["summary"]["per_turn"]:
            print(turn_row(str(t), run["summary"]["per_turn"][t]))
    print(turn_row("all", o))
    print(
        f"   output {o['output_tok_s']:.1f} tok/s, {o['request_s']:.2f} req/s; "
        f"goodput {o['goodput_tok_s']:.1f} tok/s, {o['goodput_req_s']:.2f} req/s "
        f"({o['slo_met']}/{o['requests'] + o['refused']} within SLO, {o['refused']} refused and retried); "
        f"cache reported on {o['cached_reported']}/{o['requests']} requests"
    )


def print_overview(runs: list[dict], slo_ttft: float, slo_tpot: float) -> None:
    """One line per N: the numbers to compare servers by."""
    print(f"\n== overview (SLO: TTFT <= {slo_ttft:g} s, TPOT <= {slo_tpot:g} s; times in ms)")
    print(
        f"{'N':>3} {'reqs':>5} {'wall s':>7} {'out tok/s':>9} {'ttft p50':>8} {'p99':>6} "
        f"{'tpot p50':>8} {'p99':>5} {'itl p50':>7} {'p99':>5} "
        f"{'good req/s':>10} {'good tok/s':>10} {'c/new':>5}"
    )
    for run in runs:
        o = run["summary"]["overall"]
        print(
            f"{run['agents']:>3} {o['requests']:>5} {o['wall_s']:>7.1f} {o['output_tok_s']:>9.1f} "
            f"{_f(o['ttft_p50'], 1e3):>8} {_f(o['ttft_p99'], 1e3):>6} {_f(o['tpot_p50'], 1e3, 1):>8} "
            f"{_f(o['tpot_p99'], 1e3):>5} {_f(o['itl_p50'], 1e3, 1):>7} {_f(o['itl_p99'], 1e3):>5} "
            f"{o['goodput_req_s']:>10.2f} {o['goodput_tok_s']:>10.1f} {_f(o['computed_over_new'], 1, 2):>5}"
        )
    print(
        "prompt = prompt tokens p50; computed = prompt - cached (sum); new = tokens added since the agent's "
        "previous prompt+completion (sum); c/new = computed/new (1.00 = only new tokens prefilled)"
    )


def record_json(r: RequestRecord, keep_text: bool) -> dict:
    """A request record for the JSON file (times in seconds)."""
    d = dataclasses.asdict(r)
    d["tpot"] = r.tpot
    d["computed_tokens"] = r.computed_tokens
    if not keep_text:
        d["text_chars"] = len(d.pop("text"))
    return d


def write_json(path: pathlib.Path, args: argparse.Namespace, w: Workload, runs: list[dict]) -> None:
    """Everything: settings, per-N summaries (overall and per turn) and every request record."""
    doc = {
        "benchmark": "agent_fleet",
        "label": args.label,
        "base_url": args.base_url,
        "model": args.model,
        "seed": args.seed,
        "sampling": dict(SAMPLING),
        "workload": dataclasses.asdict(w),
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": [
            {
                "agents": run["agents"],
                "run_tag": run["run_tag"],
                "wall_s": run["wall_s"],
                "load_avg_1m": run["load_avg_1m"],
                "summary": run["summary"],
                "records": [record_json(r, args.keep_text) for r in run["records"]],
            }
            for run in runs
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


# ----------------------------------------------------------------------------------------------- CLI


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the docstring's layout and appends '(default: X)' to options whose default is not None."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is not None and default is not False and default != "" and default != argparse.SUPPRESS:
            text += "" if "%(default)" in text else " (default: %(default)s)"
        return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        description=__doc__,
        epilog="The default run (N = 1 2 4 8) is sized for about 15 minutes on a slow 2-core CPU server.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--base-url", default=None,
                   help="OpenAI-compatible base URL [http://127.0.0.1:8000/v1; with --uds http://localhost/v1]")
    p.add_argument("--uds", default=None, metavar="PATH",
                   help="reach the server over this unix socket (`gemma-serve up --uds DIR`: DIR/api.sock; llama.cpp's "
                   "server: a --host ending in .sock) instead of TCP")
    p.add_argument("--model", default="gemma-3-270m", help="model name sent in each request")
    p.add_argument("--api-key", default="unused", help="sent as a Bearer token")
    p.add_argument(
        "--agents", type=int, nargs="+", default=[1, 2, 4, 8], help="fleet sizes, run one after another"
    )
    p.add_argument("--turns", type=int, default=None, help="turns per agent [20; --quick: 5]")
    p.add_argument(
        "--tool-tokens",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="tool-result size, log-uniform, approx. tokens [50 400; --quick: 30 150]",
    )
    p.add_argument(
        "--short-tokens",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="max_tokens of a 'tool call' turn [12 40; --quick: 8 24]",
    )
    p.add_argument(
        "--long-tokens",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="max_tokens of an 'answer' turn [150 300; --quick: 60 120]",
    )
    p.add_argument("--long-frac", type=float, default=0.2, help="fraction of turns that are answers")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy; > 0 also sends a seed per agent and turn)")
    p.add_argument("--top-p", type=float, default=None, help="top_p of every request (with --temperature)")
    p.add_argument(
        "--quick", action="store_true", help="short preset: 5 turns, smaller tool results and answers"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of all content and max_tokens draws")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on time to first token, seconds")
    p.add_argument(
        "--slo-tpot", type=float, default=0.25, help="goodput SLO on time per output token, seconds"
    )
    p.add_argument(
        "--no-cache-bust",
        action="store_true",
        help="same system prompt for every N (by default a per-run tag makes each N start cold)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request read timeout, seconds")
    p.add_argument(
        "--json", type=pathlib.Path, default=None, help="write settings, summaries and records here"
    )
    p.add_argument("--keep-text", action="store_true", help="keep each answer's text in the JSON records")
    p.add_argument(
        "--all-turns", action="store_true", help="print every turn (default: first/quartiles/last)"
    )
    p.add_argument("--label", default="", help="free-form label stored in the JSON (e.g. the server's name)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="start our stack (gemma-serve up), run the fleet sizes, stop it; then the same against llama.cpp "
        "(benchmarks/llama_cpp_server.sh, built on first use); print ours / llama.cpp ratios "
        "(benchmarks/fleet_compare.py). --base-url is ignored",
    )
    p.add_argument(
        "--ours-args",
        default="--num-slots 16",
        help="with --compare: extra `gemma-serve up` flags (e.g. \"--num-slots 16 --matmul-precision bfloat16\")",
    )
    p.add_argument("--workers", type=int, nargs="+", default=None, metavar="W",
                   help="run our stack once per worker count (`gemma-serve up --workers W` plus --ours-args) with "
                   "the same fleet, and print throughput, prefix-cache hit share, computed/new prefill tokens and "
                   "the share of requests routed to their conversation's worker for each (e.g. --workers 1 2)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="with --compare: seconds for our stack")
    p.add_argument("--compare-dir", default=None, help="with --compare: where the JSONs and the table go "
                   "[benchmarks/.compare/<time>]")
    args = p.parse_args(argv)
    SAMPLING.clear()
    SAMPLING.update({"temperature": args.temperature}, **({"top_p": args.top_p} if args.top_p is not None else {}))
    if args.base_url is None:
        args.base_url = "http://localhost/v1" if args.uds else "http://127.0.0.1:8000/v1"
    return args


def workload(args: argparse.Namespace) -> Workload:
    """The workload from the flags, with the --quick preset or the defaults filling the gaps."""
    preset = (
        {"turns": 5, "tool_tokens": (30, 150), "short_tokens": (8, 24), "long_tokens": (60, 120)}
        if args.quick
        else {"turns": 20, "tool_tokens": (50, 400), "short_tokens": (12, 40), "long_tokens": (150, 300)}
    )
    pick = {
        k: tuple(v) if isinstance(v, list) else v
        for k, v in vars(args).items()
        if k in preset and v is not None
    }
    return Workload(**{**preset, **pick}, long_frac=args.long_frac)


async def main_async(args: argparse.Namespace) -> int:
    """Run every fleet size, print the tables, write the JSON; exit status 1 if any request failed."""
    w = workload(args)
    print(
        f"agent_fleet: {args.base_url} model={args.model} turns={w.turns} "
        f"tool~{w.tool_tokens[0]}-{w.tool_tokens[1]} tok "
        f"max_tokens {w.short_tokens[0]}-{w.short_tokens[1]} / {w.long_tokens[0]}-{w.long_tokens[1]} "
        f"(p={w.long_frac:g}) seed={args.seed}",
        flush=True,
    )
    runs = []
    for n in args.agents:
        run = await run_fleet(args, n, w)
        run["summary"] = summarize_run(run, args.slo_ttft, args.slo_tpot)
        runs.append(run)
        print_run(run, w.turns, args.all_turns)
        sys.stdout.flush()
        if args.json:  # after every N, so an interrupted run keeps what it measured
            write_json(args.json, args, w, runs)
    print_overview(runs, args.slo_ttft, args.slo_tpot)
    errors = [r.error for run in runs for r in run["records"] if r.error and not r.refused]
    for e in sorted(set(errors))[:5]:
        print(f"error: {e}", file=sys.stderr)
    if args.json:
        print(f"wrote {args.json}")
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    if args.compare or args.workers:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from fleet_compare import compare, compare_workers

        return compare_workers(args) if args.workers else compare(args)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
