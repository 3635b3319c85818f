#!/usr/bin/env python3
"""Speculative decoding by turn type: tool calls, JSON answers, code echoed from the context and plain chat, with
speculation on and off, through the REST API. Not a test: prints a table and writes JSON.

An agent's turns repeat their context: tool-call arguments quote the user's words and file paths seen before,
JSON answers restate records the conversation holds, code is echoed. Each turn type here is a conversation of
that kind (`TURNS`), sent one request at a time (a lone agent, where speculation matters most), greedy, several
variants per type; the tool-call turns of a type continue one conversation, as an agent loop does. Per type: output tokens per second of wall time, and from the worker's metrics the drafted and
accepted tokens and the decode steps (tokens per step).

    # against a running stack (speculation as it was started):
    .venv/bin/python benchmarks/speculation_turns.py --base-url http://127.0.0.1:8000 --metrics-url http://127.0.0.1:8001
    # start our stack twice, speculation auto then off, and print the ratios (on / off) of the same turns:
    .venv/bin/python benchmarks/speculation_turns.py --compare-off --ours-args "--num-slots 16"

Ratios are comparable only within one invocation (the machine's speed drifts: docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fleet_compare import REPO, _free_port, _free_run, _wait_ready

CITIES = ["Reykjavik", "Ouagadougou", "Thiruvananthapuram", "Valparaiso", "Ulaanbaatar", "Antananarivo"]
PATHS = ["src/gemma_serve/model_worker/serving/scheduler.py", "tests/e2e/test_speculation_api.py",
         "benchmarks/agent_fleet.py", "docs/architecture.md", "gateway/generation/generate.py", "common/ngram.py"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "units": {"enum": ["metric", "imperial"]}},
    "required": ["city", "days", "units"]}}}
READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
                                         "parameters": {"type": "object", "properties": {
                                             "path": {"type": "string"}, "start_line": {"type": "integer"},
                                             "end_line": {"type": "integer"}}, "required": ["path"]}}}
RECORD = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"type": "string"}, "role": {"type": "string"},
    "languages": {"type": "array", "items": {"type": "string"}}, "years": {"type": "integer"}},
    "required": ["name", "city", "role", "languages", "years"], "additionalProperties": False}
CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n\n\ndef diagonal(width, height):\n    return (width ** 2 + height ** 2) ** 0.5\n")


def _tool_turn(i: int, choice: str, before: list[dict]) -> dict:
    """An agent that read files before and is asked for the next ones (the paths are in its context). Turn i > 0
    continues turn i - 1's conversation (`before`: its messages, its answer and the tool results), as an agent
    loop resends its growing conversation (so the prefix cache holds most of the prompt)."""
    city = CITIES[i % len(CITIES)]
    ask = (f"Read {PATHS[(i + 3) % len(PATHS)]} lines 1 to 40, and get the weather in {city} for 3 days, metric. "
           f"Earlier you called get_weather with {json.dumps({'city': city, 'days': 3, 'units': 'metric'})}.")
    if before:
        return {"messages": [*before, {"role": "user", "content": ask}], "tools": [READ, WEATHER],
                "tool_choice": choice, "max_tokens": 96}
    history = []
    for j in range(3):
        path = PATHS[(i + j) % len(PATHS)]
        args = json.dumps({"path": path, "start_line": 1, "end_line": 40 + j})
        history += [{"role": "assistant", "content": None, "tool_calls": [{"id": f"c{j}", "type": "function",
                     "function": {"name": "read_file", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": f"c{j}", "content": f"(40 lines of {path})"}]
    return {"messages": [{"role": "system", "content": "You are a coding agent. Call tools."},
                         {"role": "user", "content": "Look at the repository."}, *history,
                         {"role": "user", "content": ask}],
            "tools": [READ, WEATHER], "tool_choice": choice, "max_tokens": 96}


def _continued(body: dict, reply: dict) -> list[dict]:
    """The conversation after a tool-call turn: its messages, the answer, a result per call. The calls' ids
    (random per response, and rendered into the next prompt) become `call_<turn>_<k>`, so that the runs with
    speculation on and off send the same prompts and their answers can be compared."""
    msg = reply["choices"][0]["message"]
    turn = sum(m["role"] == "user" for m in body["messages"])
    calls = [{**c, "id": f"call_{turn}_{k}"} for k, c in enumerate(msg.get("tool_calls") or [])]
    out = [*body["messages"], {"role": "assistant", "content": msg.get("content"), **({"tool_calls": calls} if calls
                                                                                      else {})}]
    return out + [{"role": "tool", "tool_call_id": c["id"], "content": f"(result of {c['function']['name']})"}
                  for c in calls]


def _json_turn(i: int, before: list[dict]) -> dict:
    """Restate a record the conversation holds (as text and as JSON) under a schema."""
    record = {"name": f"Agent {i}", "city": CITIES[i % len(CITIES)], "role": "reviewer",
              "languages": ["Python", "Rust", "Go"][: 1 + i % 3], "years": 3 + i}
    return {"messages": [{"role": "user", "content": f"The record on file: {json.dumps(record)}. It was updated. "
                          "Return the record as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}},
            "max_tokens": 96}


def _code_turn(i: int, before: list[dict]) -> dict:
    return {"messages": [{"role": "user", "content": f"Copy this code exactly (variant {i}):\n\n{CODE}"}],
            "max_tokens": 96}


def _chat_turn(i: int, before: list[dict] | None = None) -> dict:
    return {"messages": [{"role": "user", "content": f"Tell me about {CITIES[i % len(CITIES)]} in a few sentences."}],
            "max_tokens": 96}


TURNS = {"tool_call_auto": lambda i, b: _tool_turn(i, "auto", b),
         "tool_call_required": lambda i, b: _tool_turn(i, "required", b),
         "json_schema": _json_turn, "code_echo": _code_turn, "chat": _chat_turn}
#: Turn types whose turns continue one conversation (an agent loop).
CHAINED = ("tool_call_auto", "tool_call_required")


def _post(base: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _counters(metrics_url: str) -> dict[str, float]:
    """The worker's speculation and step counters now."""
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=10) as r:
        body = r.read().decode()
    out = {}
    for key, pattern in (("drafted", r"^gemma_serve:spec_decode_num_draft_tokens_total (\S+)$"),
                         ("accepted", r"^gemma_serve:spec_decode_num_accepted_tokens_total (\S+)$"),
                         ("decode_steps", r'^gemma_serve:engine_steps_total\{kind="decode"\} (\S+)$')):
        m = re.search(pattern, body, re.MULTILINE)
        out[key] = float(m.group(1)) if m else 0.0
    return out


def run_turns(base: str, metrics_url: str, model: str, variants: int, timeout: float) -> dict[str, dict]:
    """Every turn type, `variants` requests each, one at a time (one warm-up request first)."""
    _post(base, {"model": model, **_chat_turn(99), "max_tokens": 8}, timeout)  # warm-up
    results = {}
    for name, make in TURNS.items():
        before, tokens, wall, answers, conversation = _counters(metrics_url), 0, 0.0, [], []
        for i in range(variants):
            body = {"model": model, "temperature": 0, **make(i, conversation)}
            t0 = time.perf_counter()
            reply = _post(base, body, timeout)
            wall += time.perf_counter() - t0
            if name in CHAINED:
                conversation = _continued(body, reply)
            tokens += reply["usage"]["completion_tokens"]
            msg = reply["choices"][0]["message"]
            answers.append(msg.get("content") or [c["function"] for c in msg.get("tool_calls") or []])
        after = _counters(metrics_url)
        d = {k: after[k] - before[k] for k in after}
        results[name] = {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, **d,
                         "acceptance": d["accepted"] / d["drafted"] if d["drafted"] else None,
                         "tokens_per_step": tokens / d["decode_steps"] if d["decode_steps"] else None,
                         "answers": answers}
        print(f"  {name:20s} {tokens:5d} tokens {wall:6.1f} s {tokens / wall:6.1f} tok/s  drafted "
              f"{d['drafted']:.0f} accepted {d['accepted']:.0f}", flush=True)
    return results


def start_ours(ours_args: str, log_path: pathlib.Path, startup_timeout: float):
    """`gemma-serve up` on free ports; (process, base URL, worker metrics URL)."""
    http, metrics = _free_port(), _free_run(1)
    cmd = [sys.executable, "-m", "gemma_serve.cli", "up", "--http-port", str(http), "--gateway-grpc-port",
           str(_free_port()), "--tokenizer-port", str(_free_port()), "--worker-port", str(_free_run(1)),
           "--worker-metrics-port", str(metrics), *shlex.split(ours_args)]
    print(f"[speculation_turns] {' '.join(cmd)} (log: {log_path})", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{http}"
    _wait_ready(base + "/health", proc, startup_timeout)
    return proc, base, f"http://127.0.0.1:{metrics}"


def stop(proc) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running gateway (without --compare-off)")
    p.add_argument("--metrics-url", default="http://127.0.0.1:8001", help="its worker's metrics endpoint")
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--variants", type=int, default=4, help="requests per turn type")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--compare-off", action="store_true",
                   help="start our stack with speculation auto, then with --speculation off, and compare")
    p.add_argument("--ours-args", default="", help="extra `gemma-serve up` flags for --compare-off")
    p.add_argument("--startup-timeout", type=float, default=1200.0)
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if not args.compare_off:
        results = {"as started": run_turns(args.base_url, args.metrics_url, args.model, args.variants, args.timeout)}
    else:
        results = {}
        out = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
        for label, extra in (("auto", ""), ("off", " --speculation off")):
            proc, base, metrics = start_ours(args.ours_args + extra, out / f"speculation-turns-{label}.log",
                                             args.startup_timeout)
            try:
                print(f"[speculation_turns] speculation {label}", flush=True)
                results[label] = run_turns(base, metrics, args.model, args.variants, args.timeout)
            finally:
                stop(proc)
        print(f"\n{'turn type':20s} {'tok/s on':>9s} {'tok/s off':>9s} {'on/off':>7s} {'acceptance':>10s} "
              f"{'tokens/step':>11s} {'same answers':>12s}")
        for name in TURNS:
            on, off = results["auto"][name], results["off"][name]
            acc = "-" if on["acceptance"] is None else f"{on['acceptance']:.2f}"
            per = "-" if on["tokens_per_step"] is None else f"{on['tokens_per_step']:.1f}"
            print(f"{name:20s} {on['tok_s']:9.1f} {off['tok_s']:9.1f} {on['tok_s'] / off['tok_s']:6.2f}x "
                  f"{acc:>10s} {per:>11s} {'yes' if on['answers'] == off['answers'] else 'NO':>12s}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
