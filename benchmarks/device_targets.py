#!/usr/bin/env python3
"""The device targets against what `benchmarks/device_run.sh`'s phases measured: one markdown table.

Not a test. Reads the phases' JSON in a results folder (decode-bf16.json, decode-int8.json, mixed-bf16.json,
compile.json, throughput-int8.json: whichever exist) and prints, per target, the measured figure, the goal and
whether it is met. A target whose phase did not run says so. The goals are the chip's (one TPU v5e, synthetic
Gemma 4 E2B, docs/performance.md "On a TPU v5e"); bandwidth fractions are of the copy bandwidth each run measured.

  python benchmarks/device_targets.py /tmp/gemma-serve-device/results [MORE_FOLDERS...]
"""

from __future__ import annotations

import json
import pathlib
import sys

# (batch, least fraction of the measured copy bandwidth) for the bf16 decode step at an 8K context
BANDWIDTH_GOALS = ((1, 0.85), (8, 0.85), (32, 0.75))
INT8_STEP_GOAL = 0.6  # the int8-weights B=1 step over the bf16 one, at most
COMPILE_COLD_S, COMPILE_WARM_S = 60.0, 10.0
THROUGHPUT_GOAL = 4500.0  # output tok/s at a 2K context, the largest batch measured


def _load(folders: list[pathlib.Path], name: str) -> dict | None:
    """The phase's JSON from the first folder that has it, or None when that phase did not run (or wrote nothing)."""
    for folder in folders:
        path = folder / f"{name}.json"
        if path.is_file():
            return json.loads(path.read_text())
    return None


def _rows_by_batch(run: dict | None) -> dict[int, dict]:
    return {r["batch"]: r for r in run["rows"]} if run else {}


def targets(*folder: pathlib.Path) -> list[tuple[str, str, str, str]]:
    """(target, measured, goal, met) rows from the phases' JSON in `folder`s (the first holding a phase's file
    gives it: runs of a session's several calls); `met` is "yes", "no" or "not run"."""
    folder = list(folder)
    out = []
    bf16 = _rows_by_batch(_load(folder, "decode-bf16"))
    for batch, goal in BANDWIDTH_GOALS:
        r = bf16.get(batch)
        measured = f"{r['bandwidth_fraction']:.0%} ({r['step_ms']:.2f} ms, kv {r['kv_len']})" if r else "-"
        out.append((f"bf16 decode step, B={batch}: fraction of the copy bandwidth", measured, f">= {goal:.0%}",
                    ("yes" if r["bandwidth_fraction"] >= goal else "no") if r else "not run"))
    for batch, r in sorted(bf16.items()):
        if "ahead_ms" in r:
            out.append((f"bf16 decode step dispatched one ahead, B={batch} (what async scheduling would give)",
                        f"{r['ahead_bandwidth_fraction']:.0%} ({r['ahead_ms']:.2f} ms)", "(no goal)", "-"))
        if "loop_ms" in r:
            out.append((f"serving loop's step, B={batch}: async scheduling / planned steps",
                        f"{r['loop_ahead_ms'] / r['loop_ms']:.2f}x ({r['loop_ahead_ms']:.2f} / {r['loop_ms']:.2f} ms)",
                        "(no goal)", "-"))
    int8 = _rows_by_batch(_load(folder, "decode-int8"))
    for batch in sorted(set(bf16) & set(int8)):
        ratio = int8[batch]["step_ms"] / bf16[batch]["step_ms"]
        goal = f"<= {INT8_STEP_GOAL}x" if batch == 1 else "(no goal)"
        met = ("yes" if ratio <= INT8_STEP_GOAL else "no") if batch == 1 else "-"
        out.append((f"int8 weights / bf16, B={batch} step", f"{ratio:.2f}x ({int8[batch]['step_ms']:.2f} ms)", goal,
                    met))
    if not int8 or not bf16:
        out.append(("int8 weights / bf16, B=1 step", "-", f"<= {INT8_STEP_GOAL}x", "not run"))
    mixed = _load(folder, "mixed-bf16")
    for r in (mixed or {}).get("rows", []):
        ratio = r["mixed"] / r["chunk_then_decode"]
        out.append((f"mixed step / (chunk, then decode) alone, B={r['batch']}",
                    f"{ratio:.2f}x ({r['mixed']:.2f} / {r['chunk_then_decode']:.2f} ms)", "<= 1.00x",
                    "yes" if ratio <= 1.0 else "no"))
    if not mixed:
        out.append(("mixed step / (chunk, then decode) alone", "-", "<= 1.00x", "not run"))
    comp = _load(folder, "compile")
    if comp:
        last = comp["rounds"][-1]
        what = f"{comp['programs']} programs, {comp['num_slots']} slots x {comp['max_model_len']}, {last['threads']} threads"
        out.append((f"program grid compiled cold ({what})", f"{last['compile_s']:.1f} s", f"<= {COMPILE_COLD_S:.0f} s",
                    "yes" if last["compile_s"] <= COMPILE_COLD_S else "no"))
        out.append(("program grid loaded warm (executable cache)", f"{last['load_s']:.1f} s",
                    f"<= {COMPILE_WARM_S:.0f} s", "yes" if last["load_s"] <= COMPILE_WARM_S else "no"))
    else:
        goal = f"<= {COMPILE_COLD_S:.0f} s / {COMPILE_WARM_S:.0f} s"
        out.append(("program grid compiled cold / loaded warm", "-", goal, "not run"))
    tp = _rows_by_batch(_load(folder, "throughput-int8"))
    if tp:
        r = tp[max(tp)]
        out.append((f"decode throughput, int8 weights, {r['batch']} rows x {r['kv_len']}",
                    f"{r['tokens_per_s']:,.0f} tok/s ({r['step_ms']:.2f} ms)", f">= {THROUGHPUT_GOAL:,.0f} tok/s",
                    "yes" if r["tokens_per_s"] >= THROUGHPUT_GOAL else "no"))
    else:
        out.append(("decode throughput at a 2K context", "-", f">= {THROUGHPUT_GOAL:,.0f} tok/s", "not run"))
    return out


def main() -> None:
    folders = [pathlib.Path(a) for a in sys.argv[1:]] or [pathlib.Path("/tmp/gemma-serve-device/results")]
    rows = targets(*folders)
    print("\n## Targets\n")
    print("| target | measured | goal | met |\n|---|---:|---:|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
