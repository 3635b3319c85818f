"""The device benchmark's readers: `benchmarks/trace_summary.py` on a hand-written Perfetto trace (a device line
with nested ops, a programs line, a host thread it must ignore) against times worked out by hand, and
`benchmarks/device_targets.py` on hand-written phase results (met / not met / not run, folders merged)."""

from __future__ import annotations

import gzip
import json
import pathlib

from benchmarks import device_targets, trace_summary


def _trace(tmp_path: pathlib.Path) -> pathlib.Path:
    """Two steps of a device: per step a program of 100 us holding a fusion of 60 us (a 10 us op nested in it)
    and a copy of 20 us, 20 us idle between the steps; a host thread's event that must not count."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "XLA Modules"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "python"}},
    ]
    events = []
    for start in (0.0, 120.0):
        events += [
            {"ph": "X", "pid": 1, "tid": 2, "ts": start, "dur": 100.0, "name": "jit_decode(1)"},
            {"ph": "X", "pid": 1, "tid": 1, "ts": start, "dur": 60.0, "name": "fusion.1",
             "args": {"hlo_category": "loop fusion", "bytes_accessed": "6000000"}},
            {"ph": "X", "pid": 1, "tid": 1, "ts": start + 5, "dur": 10.0, "name": "inner.2",
             "args": {"hlo_category": "convolution fusion", "bytes_accessed": 1000}},
            {"ph": "X", "pid": 1, "tid": 1, "ts": start + 70, "dur": 20.0, "name": "copy.3",
             "args": {"hlo_category": "copy-done"}},
            {"ph": "X", "pid": 2, "tid": 9, "ts": start, "dur": 500.0, "name": "PjRt::Execute"},
        ]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return tmp_path


def test_trace_summary_sums_self_times_and_the_busy_time(tmp_path, capsys):
    summary = trace_summary.summarize(_trace(tmp_path))
    assert list(summary) == ["/device:TPU:0"]  # the host's line is not a device
    device = summary["/device:TPU:0"]
    ops = {t.name: t for t in device["ops"]}
    assert [t.name for t in device["ops"]] == ["fusion.1", "copy.3", "inner.2"]  # by self time
    assert ops["fusion.1"].us == 2 * (60 - 10) and ops["fusion.1"].calls == 2  # the nested op subtracted
    assert ops["inner.2"].us == 20 and ops["copy.3"].us == 40
    assert ops["fusion.1"].bytes == 12e6 and ops["fusion.1"].category == "loop fusion"  # a number given as text
    assert device["busy_us"] == 2 * (60 + 20)  # the union of the op events, not their sum
    assert device["span_us"] == 120 + 90
    assert [(m.name, m.us, m.calls) for m in device["modules"]] == [("jit_decode(1)", 200.0, 2)]
    trace_summary.print_summary(summary, steps=2, step_ms=0.1)
    out = capsys.readouterr().out
    assert "busy 0.080 ms per step = 80% of the 0.10 ms step" in out
    assert "fusion.1" in out and "120.0" in out  # 6 MB in 50 us: 120 GB/s


def _phase(folder: pathlib.Path, name: str, payload: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(payload))


def test_device_targets_say_met_unmet_and_not_run_across_folders(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    row = lambda b, ms, bw, **kw: {"batch": b, "kv_len": 8192, "step_ms": ms, "bandwidth_fraction": bw,
                                   "tokens_per_s": b / ms * 1e3, **kw}
    _phase(first, "decode-bf16", {"rows": [row(1, 9.0, 0.86, ahead_ms=7.0, ahead_bandwidth_fraction=0.95,
                                               loop_ms=12.0, loop_ahead_ms=9.0),
                                           row(8, 13.0, 0.69), row(32, 20.0, 0.76)]})
    _phase(first, "decode-int8", {"rows": [row(1, 5.0, 0.5)]})
    _phase(second, "decode-bf16", {"rows": [row(1, 99.0, 0.01)]})  # the first folder's file wins
    _phase(second, "compile", {"programs": 43, "num_slots": 32, "max_model_len": 8192,
                               "rounds": [{"threads": 13, "compile_s": 59.0, "load_s": 11.0}]})
    rows = {r[0]: r for r in device_targets.targets(first, second)}
    met = {name.split(":")[0]: r[3] for name, r in rows.items()}
    assert met["bf16 decode step, B=1"] == "yes" and met["bf16 decode step, B=8"] == "no"
    assert met["bf16 decode step, B=32"] == "yes"
    assert rows["int8 weights / bf16, B=1 step"][1].startswith("0.56x") and met["int8 weights / bf16, B=1 step"] == "yes"
    ahead = next(r for name, r in rows.items() if name.startswith("bf16 decode step dispatched one ahead, B=1"))
    assert ahead[1] == "95% (7.00 ms)"
    loop = next(r for name, r in rows.items() if name.startswith("serving loop's step, B=1"))
    assert loop[1] == "0.75x (9.00 / 12.00 ms)"
    assert not any(name.startswith("serving loop's step, B=8") for name in rows), "not measured: no row"
    compiled = [r for name, r in rows.items() if name.startswith("program grid")]
    assert [r[3] for r in compiled] == ["yes", "no"]  # 59 s cold, 11 s warm
    assert rows["mixed step / (chunk, then decode) alone"][3] == "not run"
    assert rows["decode throughput at a 2K context"][3] == "not run"
