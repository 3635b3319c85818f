#!/usr/bin/env python3
"""Constrained vs unconstrained decoding throughput, through the REST API of a running gemma-serve.

Not a test: prints a table and writes JSON. Usage (with `make serve` running):

    .venv/bin/python benchmarks/constrained.py --base-url http://127.0.0.1:8000 --concurrency 8

Each round sends `--concurrency` chat requests at once, twice: constrained by a JSON schema whose answers are
long (a list of records, ~100+ tokens), then unconstrained with `ignore_eos` and each request's max_tokens set to
the length of the matching constrained answer (same token counts, same batch-size profile over time). Rounds
alternate the two kinds so machine drift hits both. Aggregate output tok/s = completion tokens / wall time of the
round; the ratio constrained / unconstrained is over the sums of all rounds (target >= 0.9). The gateway's
/metrics give the forced-token share of the constrained tokens (tokens the grammar determined: runs of at least
gateway.generation.generate.FORCED_RUN_MIN tokens are appended in one compute step each, shorter ones go as one-token
masks in the batched decode step) and the number of runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time

import httpx

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array", "minItems": 6, "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 2, "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["engineer", "designer", "manager", "researcher"]},
                    "remote": {"type": "boolean"},
                },
                "required": ["name", "age", "role", "remote"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["people"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "List six people on the team as JSON with name, age, role and remote."}]
METRICS = ("constrained_tokens", "forced_tokens", "forced_runs", "forced_run_tokens", "generation_tokens")


async def one(client: httpx.AsyncClient, args, constrained: bool, seed: int, max_tokens: int) -> dict:
    body = {"model": args.model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 1.0,
            "seed": seed}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "team", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    out = r.json()
    return {"tokens": out["usage"]["completion_tokens"], "finish": out["choices"][0]["finish_reason"],
            "valid": _valid(out["choices"][0]["message"]["content"]) if constrained else None}


def _valid(text: str) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:  # noqa: BLE001 - a benchmark records, it does not raise
        return False


async def round_(client, args, constrained: bool, base_seed: int, lengths: list[int] | None = None) -> dict:
    """One round of `concurrency` requests; `lengths`: per-request max_tokens (default: --max-tokens)."""
    lengths = lengths or [args.max_tokens] * args.concurrency
    start = time.perf_counter()
    results = await asyncio.gather(*(one(client, args, constrained, base_seed + i, n)
                                     for i, n in enumerate(lengths)))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"constrained": constrained, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "lengths": [r["tokens"] for r in results],
            "finishes": [r["finish"] for r in results], "valid": [r["valid"] for r in results]}


async def metrics(client) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    out = {}
    for name in METRICS:
        m = re.search(rf"^gemma_serve:gateway_{name}_total (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="gateway URL (without /v1)")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--concurrency", type=int, default=8, help="requests per round (default: 8)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each kind (default: 2)")
    p.add_argument("--max-tokens", type=int, default=160, help="max_tokens of every request (default: 160)")
    p.add_argument("--json", default="constrained_benchmark.json", help="where to write the results")
    args = p.parse_args()
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/").removesuffix("/v1"), timeout=600) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await round_(client, args, True, 10_000)  # warm: grammar tokenizer, schema compile
        before = await metrics(client)
        rounds = []
        for r in range(args.rounds):
            for constrained in (True, False):
                # The unconstrained round generates exactly as many tokens per request as the constrained one
                # did (ignore_eos), so both have the same batch-size profile over time.
                lengths = None if constrained else [max(1, n) for n in rounds[-1]["lengths"]]
                rounds.append(await round_(client, args, constrained, 100 * r, lengths))
                print(f"round {r + 1} {'constrained  ' if constrained else 'unconstrained'}: "
                      f"{rounds[-1]['tokens']:5d} tokens in {rounds[-1]['wall_s']:6.1f} s = "
                      f"{rounds[-1]['tok_s']:6.1f} tok/s", flush=True)
        after = await metrics(client)
    delta = {k: after[k] - before[k] for k in METRICS}
    agg = {}
    for kind in (False, True):
        rs = [r for r in rounds if r["constrained"] == kind]
        agg[kind] = sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs)
    valid = [v for r in rounds if r["constrained"] for v, f in zip(r["valid"], r["finishes"]) if f == "stop"]
    share = delta["forced_tokens"] / delta["constrained_tokens"] if delta["constrained_tokens"] else 0.0
    summary = {
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "unconstrained_tok_s": agg[False], "constrained_tok_s": agg[True], "ratio": agg[True] / agg[False],
        "forced_share": share, "forced_tokens": delta["forced_tokens"], "constrained_tokens":
        delta["constrained_tokens"], "forced_runs": delta["forced_runs"],
        "forced_run_tokens": delta["forced_run_tokens"],
        "tokens_per_forced_run": delta["forced_run_tokens"] / delta["forced_runs"] if delta["forced_runs"] else 0.0,
        "finished_valid": f"{sum(valid)}/{len(valid)}",
    }
    print(f"\n{args.concurrency} concurrent requests, max_tokens {args.max_tokens}, {args.rounds} rounds each")
    print(f"  unconstrained {agg[False]:7.1f} tok/s")
    print(f"  constrained   {agg[True]:7.1f} tok/s   ratio {summary['ratio']:.2f} (target >= 0.9)")
    print(f"  forced tokens {share:.1%} of constrained tokens; {delta['forced_run_tokens']:.0f} of them in "
          f"{delta['forced_runs']:.0f} runs ({summary['tokens_per_forced_run']:.1f} tokens per run = per compute "
          f"step), the rest as one-token masks in the batched decode step")
    print(f"  constrained answers that finished: {summary['finished_valid']} validate")
    with open(args.json, "w") as f:
        json.dump({"summary": summary, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
