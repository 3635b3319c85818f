"""`agent_fleet.py --compare`: the same fleet workload against our stack and llama.cpp's llama-server, one right
after the other on this machine, then a table of ratios (ours / llama.cpp). `agent_fleet.py --workers 1 2`: the
same fleet against our stack with 1 and then 2 workers (`workers_table`).

Ours: `gemma-serve up` on the embedded model (plus `--ours-args`), started once, every fleet size run against it,
then stopped. llama.cpp: `benchmarks/llama_cpp_server.sh bench N ...` (built on first use; one server per N,
since llama-server's slot count is fixed at start). Each side runs `agent_fleet.py` as a subprocess with the same
workload flags and writes its JSON; the ratios come from those files. Not a test: nothing is asserted.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
# Workload flags passed through unchanged to both sides (agent_fleet.py's own names).
WORKLOAD_FLAGS = ("turns", "tool_tokens", "short_tokens", "long_tokens", "long_frac", "quick", "seed",
                  "slo_ttft", "slo_tpot", "no_cache_bust", "request_timeout")
# The figures the ratio table compares: (summary key, column title, higher is better).
COLUMNS = (("output_tok_s", "out tok/s", True), ("goodput_tok_s", "good tok/s", True),
           ("slo_attainment", "SLO met", True),
           ("ttft_p50", "TTFT p50", False), ("tpot_p50", "TPOT p50", False), ("itl_p99", "ITL p99", False))


def workload_argv(args) -> list[str]:
    """The workload flags of `args` (an agent_fleet.py namespace) as a command line."""
    out = []
    for name in WORKLOAD_FLAGS:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll `url` until it answers 200 at full speed (a worker that serves first answers 200 while the rest of its
    programs compile; its body's `programs_compiling` says how many: wait for 0, or a fleet measures the compile);
    raise if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200 and _compiling(r.read()) == 0:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")


def _compiling(body: bytes) -> int:
    """Programs a /health body says are still compiling (0 when it does not say: llama.cpp, an older stack)."""
    try:
        return int(json.loads(body).get("programs_compiling", 0) or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


def run_ours(args, out_dir: pathlib.Path, workers: int = 1) -> pathlib.Path:
    """Start `gemma-serve up` (free ports, `--ours-args`, `--workers`), run every fleet size against it, keep the
    gateway's routing counters (`ours-W.routed.json`) and worker 0's metrics (`ours-W.worker-metrics.txt`: the
    step-time model's error, SLO counters), stop it; returns the JSON path."""
    ports = {flag: _free_port() for flag in ("--http-port", "--gateway-grpc-port", "--tokenizer-port")}
    ports["--worker-port"], ports["--worker-metrics-port"] = _free_run(workers), _free_run(workers)
    cmd = [sys.executable, "-m", "gemma_serve.cli", "up", *(x for kv in ports.items() for x in map(str, kv)),
           "--workers", str(workers), *shlex.split(args.ours_args)]
    name = "ours" if workers == 1 and not getattr(args, "workers", None) else f"ours-{workers}w"
    log = (out_dir / f"{name}-server.log").open("w")
    print(f"[compare] ours: {' '.join(cmd)} (log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{ports['--http-port']}"
    try:
        _wait_ready(base + "/health", proc, args.startup_timeout)
        out = out_dir / f"{name}.json"
        subprocess.run([sys.executable, str(HERE / "agent_fleet.py"), "--base-url", base + "/v1", "--model",
                        args.model, "--agents", *map(str, args.agents), "--label",
                        f"gemma-serve --workers {workers} {args.ours_args}", "--json", str(out),
                        *workload_argv(args)], check=False)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            (out_dir / f"{name}.routed.json").write_text(json.dumps(routed_counts(r.read().decode())))
        worker_metrics = f"http://127.0.0.1:{ports['--worker-metrics-port']}/metrics"
        with urllib.request.urlopen(worker_metrics, timeout=10) as r:  # worker 0's (step-time model error, SLO)
            (out_dir / f"{name}.worker-metrics.txt").write_bytes(r.read())
        return out
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _free_run(n: int) -> int:
    """A port p with p .. p + n - 1 all free now (worker i of `up --workers n` listens on p + i)."""
    for _ in range(200):
        p = _free_port()
        try:
            for i in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


def routed_counts(metrics: str) -> dict[str, float]:
    """The gateway's routed requests by reason (summed over workers), from its /metrics text."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("gemma_serve:gateway_routed_requests_total{"):
            labels = line[line.index("{") + 1:line.index("}")]
            reason = next(x.split("=")[1].strip('"') for x in labels.split(",") if x.startswith("reason="))
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def workers_table(results: dict[int, tuple[dict, dict]]) -> str:
    """Per worker count (the same fleet): throughput, prefix-cache hit share, computed/new prefill tokens, and
    the share of requests routed to their conversation's worker (by session or resident prefix)."""
    head = (f"{'workers':>7} {'agents':>6} {'out tok/s':>10} {'hit share':>10} {'computed/new':>13} "
            f"{'stayed':>7}  routed by reason")
    lines = [head]
    for w, (summary, routed) in sorted(results.items()):
        total = sum(routed.values()) or 1.0
        stayed = (routed.get("session", 0) + routed.get("prefix", 0)) / total
        for n, s in sorted(summary.items()):
            hit, ratio = s.get("cached_share"), s.get("computed_over_new")
            hit_text = "-" if hit is None else f"{hit:.1%}"
            ratio_text = "-" if ratio is None else f"{ratio:.2f}"
            lines.append(f"{w:>7} {n:>6} {s.get('output_tok_s', 0):>10.1f} {hit_text:>10} {ratio_text:>13} "
                         f"{stayed:>7.1%}  {dict(sorted(routed.items()))}")
    return "\n".join(lines)


def compare_workers(args) -> int:
    """`--workers W...`: our stack once per worker count, the same fleet each time; prints `workers_table`."""
    out_dir = pathlib.Path(args.compare_dir or REPO / "benchmarks" / ".compare" / time.strftime("%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for w in args.workers:
        path = run_ours(args, out_dir, w)
        routed = out_dir / f"{path.stem}.routed.json"
        results[w] = (summaries([path]), json.loads(routed.read_text()) if routed.exists() else {})
    table = workers_table(results)
    print("\n== the same fleet against 1 and more workers (one after the other)\n" + table)
    (out_dir / "workers.txt").write_text(table + "\n")
    print(f"wrote {out_dir}")
    return 0


def run_llama(args, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """`llama_cpp_server.sh bench N... -- workload` with its results in out_dir; returns the JSON paths."""
    env = dict(os.environ, RESULTS_DIR=str(out_dir), PYTHON=sys.executable)
    cmd = [str(HERE / "llama_cpp_server.sh"), "bench", *map(str, args.agents), "--", *workload_argv(args)]
    print(f"[compare] llama.cpp: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=REPO, env=env, check=False)
    return [out_dir / f"llama_cpp_N{n}.json" for n in args.agents]


def summaries(paths: list[pathlib.Path]) -> dict[int, dict]:
    """Fleet size -> its overall summary, from agent_fleet.py JSON files (missing files are skipped)."""
    out = {}
    for path in paths:
        if path.exists():
            for run in json.loads(path.read_text())["runs"]:
                out[run["agents"]] = run["summary"]["overall"]
    return out


def _cell(value: float | None, rate: bool) -> str:
    """A rate as is, a time in ms, or '-' when missing."""
    return "-" if value is None else f"{value * (1.0 if rate else 1e3):.1f}"


def ratio_table(ours: dict[int, dict], llama: dict[int, dict]) -> str:
    """Per fleet size, each figure for both servers and ours / llama.cpp (times in ms)."""
    head = f"{'N':>3} " + " ".join(f"{title:>26}" for _, title, _ in COLUMNS)
    sub = "    " + " ".join(f"{'ours':>8} {'llama':>8} {'ratio':>8}" for _ in COLUMNS)
    lines = [head, sub]
    for n in sorted(set(ours) | set(llama)):
        cells = []
        for key, _, higher in COLUMNS:
            a, b = (ours.get(n) or {}).get(key), (llama.get(n) or {}).get(key)
            ratio = "-" if a is None or b is None or not b else f"{a / b:.2f}x"
            cells.append(f"{_cell(a, higher):>8} {_cell(b, higher):>8} {ratio:>8}")
        lines.append(f"{n:>3} " + " ".join(cells))
    lines.append("ratio = ours / llama.cpp (for tok/s higher is better, for times lower is better)")
    return "\n".join(lines)


def compare(args) -> int:
    """Run both sides (ours first), print the table, write both JSONs and the table under --compare-dir."""
    out_dir = pathlib.Path(args.compare_dir or REPO / "benchmarks" / ".compare" / time.strftime("%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ours = summaries([run_ours(args, out_dir)])
    llama = summaries(run_llama(args, out_dir))
    table = ratio_table(ours, llama)
    print("\n== ours vs llama.cpp, same workload, one after the other\n" + table)
    (out_dir / "compare.txt").write_text(table + "\n")
    print(f"wrote {out_dir}")
    return 0 if ours and llama else 1
