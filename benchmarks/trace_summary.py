#!/usr/bin/env python3
"""Where a device program's time goes: a `jax.profiler` trace summed per operation.

Not a test. Reads the Perfetto trace `jax.profiler.trace(dir, create_perfetto_trace=True)` writes
(`dir/plugins/profile/<run>/perfetto_trace.json.gz`) and sums, per device (a process named "/device:..."), the
self time of each operation on its "XLA Ops" line (an event's duration less the events nested in it on the same
line), the time of each program on its "XLA Modules" line, and the time the device was busy (the union of its op
events). Divided by the number of steps traced, these say where a step goes and how much of it the device idled
(the host dispatching, transferring or waiting). Where the trace's events carry XLA's cost statistics
(`bytes_accessed`, on TPU), each op's bytes per second is printed beside its time.

  python benchmarks/trace_summary.py TRACE_DIR --steps 20 [--top 40] [--json out.json]

`benchmarks/decode_step.py --profile DIR` traces its decode steps and prints this summary for each row.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import pathlib


@dataclasses.dataclass
class OpTime:
    """One operation's (or program's) totals over the trace: `us` microseconds of self time, `calls` events,
    `bytes` accessed as XLA's cost analysis counts them (0 when the trace does not say), `example` one event's args."""

    name: str
    us: float = 0.0
    calls: int = 0
    bytes: float = 0.0
    category: str = ""
    example: dict = dataclasses.field(default_factory=dict)


def _trace_file(path: pathlib.Path) -> pathlib.Path:
    """The newest perfetto_trace.json.gz under `path` (a file is returned as it is); FileNotFoundError if none."""
    if path.is_file():
        return path
    found = sorted(path.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {path}")
    return found[-1]


def _number(value) -> float:
    """A trace arg as a float (the converter writes numbers as strings at times); 0.0 when it is not one."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """(event, self µs) for the events of one line: each event's duration less its directly nested events'."""
    events = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    out: list[list] = []
    stack: list[list] = []  # [event, end, self]
    for e in events:
        end = e["ts"] + e.get("dur", 0.0)
        while stack and e["ts"] >= stack[-1][1] - 1e-9:
            stack.pop()
        entry = [e, end, e.get("dur", 0.0)]
        if stack:
            stack[-1][2] -= e.get("dur", 0.0)
        stack.append(entry)
        out.append(entry)
    return [(e, max(s, 0.0)) for e, _, s in out]


def _union_us(events: list[dict]) -> float:
    """Microseconds covered by at least one of `events` (the device's busy time on that line)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e.get("dur", 0.0)
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(path: pathlib.Path) -> dict:
    """{device name: {"ops": [OpTime...], "modules": [OpTime...], "busy_us": float, "span_us": float}} from the
    trace under `path`, ops and modules sorted by time, largest first. `span_us` is from the first op's start to
    the last one's end. Devices without an "XLA Ops" line (the host) are left out."""
    with gzip.open(_trace_file(path)) as f:
        data = json.loads(f.read())
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    lines = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by_line: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and str(procs.get(e.get("pid"), "")).startswith("/device:"):
            by_line[(e["pid"], lines.get((e["pid"], e.get("tid")), ""))].append(e)
    out: dict[str, dict] = {}
    for (pid, line), evs in by_line.items():
        device = out.setdefault(procs[pid], {"ops": [], "modules": [], "busy_us": 0.0, "span_us": 0.0})
        if line == "XLA Ops":
            totals: dict[str, OpTime] = {}
            for e, self_us in _self_times(evs):
                args = e.get("args", {})
                t = totals.setdefault(e["name"], OpTime(e["name"], category=str(args.get("hlo_category", "")),
                                                        example={k: str(v)[:400] for k, v in args.items()}))
                t.us += self_us
                t.calls += 1
                t.bytes += _number(args.get("bytes_accessed", args.get("raw_bytes_accessed", 0)))
            device["ops"] = sorted(totals.values(), key=lambda t: -t.us)
            device["busy_us"] = _union_us(evs)
            device["span_us"] = max(e["ts"] + e.get("dur", 0.0) for e in evs) - min(e["ts"] for e in evs)
        elif line == "XLA Modules":
            mods: dict[str, OpTime] = {}
            for e in evs:
                t = mods.setdefault(e["name"], OpTime(e["name"]))
                t.us += e.get("dur", 0.0)
                t.calls += 1
            device["modules"] = sorted(mods.values(), key=lambda t: -t.us)
    return {name: d for name, d in out.items() if d["ops"]}


def print_summary(summary: dict, steps: int, top: int = 40, step_ms: float | None = None) -> None:
    """Prints per device: busy time per step (and its share of `step_ms`, the measured step, when given), the
    programs' times, the ops by category and the `top` ops, all per step (totals / `steps`)."""
    if not summary:
        print("  no device op in the trace (a CPU backend traces its thunks on host threads: see its trace viewer)")
    for device, d in summary.items():
        busy = d["busy_us"] / steps / 1e3
        share = f" = {busy / step_ms:.0%} of the {step_ms:.2f} ms step" if step_ms else ""
        print(f"{device}: busy {busy:.3f} ms per step{share}")
        for m in d["modules"][:8]:
            print(f"  program {m.name[:70]:<70} {m.us / steps / 1e3:8.3f} ms  x{m.calls / steps:g}")
        cats: collections.Counter = collections.Counter()
        cat_bytes: collections.Counter = collections.Counter()
        for t in d["ops"]:
            cats[t.category or "?"] += t.us
            cat_bytes[t.category or "?"] += t.bytes
        for cat, us in cats.most_common():
            gbs = f" {cat_bytes[cat] / us / 1e3:7.1f} GB/s" if cat_bytes[cat] else ""
            print(f"  category {cat:<30} {us / steps / 1e3:8.3f} ms{gbs}")
        print(f"  {'op':<48} {'ms/step':>8} {'calls':>6} {'MB/step':>8} {'GB/s':>7}")
        for t in d["ops"][:top]:
            mb = t.bytes / steps / 1e6
            gbs = f"{t.bytes / t.us / 1e3:7.1f}" if t.bytes and t.us else ""
            print(f"  {t.name[:48]:<48} {t.us / steps / 1e3:8.3f} {t.calls / steps:6g} {mb:8.2f} {gbs:>7}")
        keys = sorted({k for t in d["ops"][:top] for k in t.example})
        print(f"  event args seen: {', '.join(keys)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=pathlib.Path, help="the folder given to jax.profiler.trace, or the .json.gz")
    parser.add_argument("--steps", type=int, default=1, help="how many steps the trace holds (figures are per step)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--json", type=pathlib.Path, help="write the summary (every op, one example's args) here")
    args = parser.parse_args()
    summary = summarize(args.trace)
    print_summary(summary, args.steps, args.top)
    if args.json:
        args.json.write_text(json.dumps({dev: {**d, "ops": [dataclasses.asdict(t) for t in d["ops"]],
                                               "modules": [dataclasses.asdict(t) for t in d["modules"]]}
                                         for dev, d in summary.items()}, indent=1))


if __name__ == "__main__":
    main()
