#!/usr/bin/env python3
"""Decode step time vs batch size and KV length, with bytes read per step and the fraction of memory bandwidth.

Not a test: prints a table (and writes JSON with --json, a markdown section with --markdown) measured in one run.
The physical floor of a decode step is (weight bytes + KV bytes read) / memory bandwidth (a decode step reads every
weight and its rows' KV once); the "bw" column is that fraction, with the bandwidth measured in the same run by a
device-to-device copy of a large buffer (bytes read + written). What is counted: `step_bytes`.

  python benchmarks/decode_step.py                          # the embedded Gemma 3 270M, this machine's device
  python benchmarks/decode_step.py --model /path/to/ckpt    # a Gemma 4 checkpoint directory (e.g. synthetic E2B)
  python benchmarks/decode_step.py --batches 1 8 --kv 512 4096 --steps 20 --tensor-parallel 2

`--compile-only` compiles the programs into JAX's persistent compilation cache (under --cache-dir) and exits, so
that several compile at once before the measured runs (benchmarks/device_run.sh). A checkpoint directory is read
in place and imports no service module: jax, numpy, ml_dtypes and safetensors are all this needs then.

Target (embedded model on a 2-core CPU; docs/performance.md): the B=8 step takes <= 2x the B=1 step.

The worker runs with glibc's malloc asking for huge pages (`gemma-serve worker` re-executes itself with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`); run this script under the same variable to measure what it serves
(llama-server, started from here, inherits it too).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from model_worker.numerics.xla_options import INVARIANT_CPU_FLAGS, add_xla_flags  # noqa: E402

add_xla_flags(*INVARIANT_CPU_FLAGS)  # the worker's XLA options, before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common.preparation import default_cache_dir  # noqa: E402
from model_worker.engine import sharding  # noqa: E402
from model_worker.engine.engine import Engine, EngineConfig, enable_compilation_cache  # noqa: E402
from model_worker.engine.programs import ProgramKey  # noqa: E402
from model_worker.modeling.sampling import SamplingArrays  # noqa: E402
from model_worker.serving.engine_api import VerifyBatch  # noqa: E402


def load(model: str, dtype: str, cache_dir: pathlib.Path, precision: str = "float32", invariant: bool = False,
         attention_kernel: str = "xla", matmul_kernel: str = "xla"):
    """(config, params) for the embedded model, a .gguf, or a checkpoint directory, at the worker's
    `--matmul-precision` `precision` ("float32", "bfloat16" or "int8"), `--batch-invariant` `invariant` (see
    `params.for_matmul_precision`), `--attention-kernel` `attention_kernel` and `--matmul-kernel` `matmul_kernel`.
    A directory (checkpoint or prepared) is read as it is; a GGUF gets the worker's prepared weights (built once in `cache_dir`)."""
    from common import preparation
    from model_worker.modeling.params import at_matmul_mode, to_device

    if pathlib.Path(model).expanduser().is_dir():
        prepared = preparation.prepare(model, cache_dir, {})
    else:
        from model_worker.server.main import PREPARE_PARTS

        prepared = preparation.prepare(model, cache_dir, PREPARE_PARTS)
    if prepared.kind == "checkpoint":
        from model_worker.checkpoints.hf_loader import load_checkpoint

        cfg, flat = load_checkpoint(prepared.dir, jnp.dtype(dtype))
    else:
        from safetensors.numpy import load_file

        from model_worker.modeling.config import config_from_dict

        cfg = config_from_dict(json.loads((prepared.dir / "config.json").read_text()))
        flat = load_file(str(prepared.dir / "model.safetensors"))
    cfg, params = at_matmul_mode(cfg, to_device(cfg, flat, jnp.dtype(dtype)), dtype, precision, invariant,
                                 matmul_kernel)
    return dataclasses.replace(cfg, attention_kernel=attention_kernel), params


def measure_bandwidth(nbytes: int = 1 << 30, copies: int = 5, rounds: int = 3) -> float:
    """Memory bandwidth of the first device in bytes/s, counting bytes read + written: `copies` chained
    device-to-device copies between two `nbytes` buffers (an XLA `copy` into the donated other buffer, so nothing
    is allocated: every byte read once and written once, 2 x nbytes per copy), timed from the first dispatch to
    the last result; the best of `rounds`. On a GPU or TPU that is a device memcpy; XLA CPU copies slower than a
    step's threaded reads stream (fractions there can pass 100%: compare them only with each other)."""
    into = jax.jit(lambda src, dst: dst.at[:].set(src), donate_argnums=1)
    a, b = jnp.zeros(nbytes, jnp.uint8), jnp.ones(nbytes, jnp.uint8)
    a = into(b, a).block_until_ready()
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(copies):
            a, b = into(a, b), a
        a.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / copies)
    return 2 * nbytes / best


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Device-memory bytes one forward step reads, on the fullest device (all devices alike at tensor parallel 1).

    Attributes:
      weights: every weight read whole (int4 as its packed words + scales + zero points, the LM head: the tied
        embedding table whole), except the token tables used only for lookups (the embedding when a separate
        head exists, Gemma 4's per-layer table `ple_embed`): only the rows looked up.
      kv: K and V (and int8 scales) read from the cache of every layer that owns one: a full-attention layer's
        positions [0, p] of each row (p its last position), a sliding layer's whole ring per row.
      kv_shared: what Gemma 4's KV-shared layers read again from their source layer's cache (the same rule). It
        is in `total`: a batch's KV at 8K context (gigabytes) outgrows every on-chip cache, so each layer's read
        of it is device-memory traffic again.
    """

    weights: int
    kv: int
    kv_shared: int

    @property
    def total(self) -> int:
        """weights + kv + kv_shared."""
        return self.weights + self.kv + self.kv_shared


def _read(acc: collections.Counter, x: jax.Array, rows: int | None = None, fraction: float = 1.0) -> None:
    """Add to `acc` (device -> bytes) what reading `x` costs each device that holds a shard of it: `fraction` of
    its shard, or with `rows` at most that many of its shard's rows (axis 0)."""
    shape = x.sharding.shard_shape(x.shape)
    count = shape[0] if shape else 1
    row_bytes = np.dtype(x.dtype).itemsize * math.prod(shape[1:])
    n = count * fraction if rows is None else min(rows, count)
    for device in x.sharding.device_set:
        acc[device] += round(n * row_bytes)


def step_bytes(engine: Engine, last_positions: Sequence[int], tokens: int) -> StepBytes:
    """Bytes a forward step of `engine` reads from device memory: weights and KV, counted from the placed
    arrays' shards (under tensor parallelism each device reads its own shards; a replicated array is read whole by
    every device holding it). Activations, logits and the K/V written are not counted (MBs against GBs).

    Args:
      engine: the engine whose params and cache the step reads.
      last_positions: per batch row, the last position it attends to (a decode row at position p: p; a prompt
        chunk: its last token's): a full-attention layer reads cache positions [0, p] of the row
        (`attention.attend_in_place`), a sliding layer the row's whole ring.
      tokens: tokens the step embeds (rows x tokens per row), i.e. the rows looked up in the token tables (each
        device reads at most that many of its own rows).
    Returns:
      `StepBytes` of the fullest device.
    """
    weights, kv, shared = collections.Counter(), collections.Counter(), collections.Counter()
    p = engine.params
    lookups = {"ple_embed"} | ({"embed"} if p.lm_head is not None else set())
    for f in dataclasses.fields(p):
        value = getattr(p, f.name)
        if f.name != "layers" and value is not None:
            for x in jax.tree_util.tree_leaves(value):
                _read(weights, x, rows=tokens if f.name in lookups else None)
    for x in jax.tree_util.tree_leaves(p.layers):
        _read(weights, x)
    cache = engine.cache
    for i, spec in enumerate(engine.cfg.layers):
        src = spec.kv_source
        full = engine.cfg.layers[src].attention == "full"
        for a in (cache.k[src], cache.v[src], cache.k_scale[src], cache.v_scale[src]):
            if a is None:
                continue
            slots, length = a.shape[:2]
            read = sum(min(q + 1, length) for q in last_positions) if full else len(last_positions) * length
            _read(kv if src == i else shared, a, fraction=read / (slots * length))
    fullest = max(weights, key=lambda d: weights[d] + kv[d])
    return StepBytes(weights[fullest], kv[fullest], shared[fullest])


def decode_bytes(engine: Engine, batch: int, kv_len: int) -> StepBytes:
    """`step_bytes` of a decode step of `batch` rows at position kv_len - 1 (what `time_step` runs)."""
    return step_bytes(engine, [kv_len - 1] * batch, batch)


def decode_args(engine: Engine, batch: int, kv_len: int) -> tuple:
    """`Engine.decode`'s arguments for `batch` greedy rows (slots 0..batch-1, token 1) at position kv_len - 1."""
    sampling = SamplingArrays.defaults(batch, engine.cfg.vocab_size)
    return list(range(batch)), [1] * batch, [kv_len - 1] * batch, [True] * batch, sampling


def time_step(engine: Engine, batch: int, kv_len: int, steps: int) -> float:
    """Median seconds of one decode step (forward + greedy sampling, results on the host) of `batch` sequences at
    position kv_len - 1."""
    args = decode_args(engine, batch, kv_len)
    for _ in range(3):
        engine.decode(*args)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.decode(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_step_ahead(engine: Engine, batch: int, kv_len: int, steps: int) -> float:
    """Mean seconds of one decode step (forward + greedy sampling, results on the host) when each step
    is dispatched before the previous one's results reach the host: step n+1's forward takes step n's sampled
    tokens on the device, and the host copies step n's results while n+1 runs: what the serving loop's async
    scheduling (`--async-scheduling`, on off the CPU) gets from the device, against `time_step`'s planned steps.
    The same rows, programs and positions as `time_step`."""
    from model_worker.engine.engine import host_output
    from model_worker.serving.engine_api import DecodeBatch

    rows = engine._decode_rows(DecodeBatch(list(range(batch)), [1] * batch, [kv_len - 1] * batch, [True] * batch),
                               batch)
    sampling = SamplingArrays.defaults(batch, engine.cfg.vocab_size)
    flags = [False] * batch, [True] * batch
    keys = ProgramKey("decode", batch, 1, kv_len), ProgramKey("greedy", batch, 0, 0)

    def step(tokens):  # tokens [B, 1] int32, on the host or the device
        logits = engine._run(keys[0], dataclasses.replace(rows.batch, tokens=tokens))
        pending = dataclasses.replace(rows.pending(logits), tokens=tokens)
        return engine._run(keys[1], pending.sample_inputs(*flags, sampling, engine.cfg.vocab_size))

    out = step(rows.batch.tokens)
    for _ in range(3):
        out = step(out.tokens.reshape(batch, 1))
    host_output(out, batch)
    t0 = time.perf_counter()
    for _ in range(steps):
        ahead = step(out.tokens.reshape(batch, 1))  # dispatched before `out` is on the host
        host_output(out, batch)
        out = ahead
    host_output(out, batch)
    return (time.perf_counter() - t0) / steps


#: Prompt tokens of each row `time_loop` serves (one compute chunk of this size per row).
LOOP_PROMPT = 16


def time_loop(engine: Engine, batch: int, steps: int, async_scheduling: bool) -> float:
    """Mean seconds per decode step of the serving loop itself (`EngineLoop`, speculation off) serving `batch`
    greedy requests of `LOOP_PROMPT` random prompt tokens and `steps` + 8 output tokens each, with or without
    async scheduling: from the moment every row has its 4th token to the first row's last, over the steps the last
    admitted row took meanwhile. What the host's work between steps costs in the product (`time_step` and
    `time_step_ahead` time the engine's programs alone); the rows decode in the smallest ready KV bucket holding
    them, i.e. the run's smallest --kv, whose decode programs those columns time too."""
    import threading

    from model_worker.serving.loop import EngineLoop
    from model_worker.serving.sequence import Finish, SamplingSpec
    from model_worker.serving.sequence import Sequence as Request

    rng = np.random.default_rng(batch)
    stamps: list[list[float]] = [[] for _ in range(batch)]
    done = threading.Event()

    def sink_for(i: int):
        def sink(event) -> None:
            stamps[i] += [time.perf_counter()] * len(event.token_ids)
            if event.finish != Finish.NONE:
                done.set()
        return sink

    loop = EngineLoop(engine, speculation="off", async_scheduling=async_scheduling)
    for i in range(batch):
        prompt = rng.integers(1000, engine.cfg.vocab_size - 1, LOOP_PROMPT).tolist()
        loop.submit(Request(f"loop-{i}", prompt, SamplingSpec(), steps + 8, frozenset(), sink_for(i)))
    loop.start()
    try:
        if not done.wait(600):
            raise TimeoutError("the loop did not finish a row within 600 s")
    finally:
        loop.stop()
    start = max(s[3] for s in stamps)
    end = min(s[-1] for s in stamps)
    last = max(range(batch), key=lambda i: stamps[i][3])
    taken = sum(start < t <= end for t in stamps[last])
    return (end - start) / max(taken, 1)


def time_verify(engine: Engine, batch: int, kv_len: int, steps: int) -> float:
    """Median seconds of one verify step (speculative decoding: every row's pending token and max_draft_tokens
    drafts, forward + greedy sampling of every position, results on the host) of `batch` sequences ending at
    position kv_len - 1."""
    T = engine.ecfg.max_draft_tokens + 1
    batch_rows = VerifyBatch(list(range(batch)), [[1] * T] * batch, [kv_len - T] * batch, [True] * batch)
    sampling = SamplingArrays.defaults(batch, engine.cfg.vocab_size)
    flags = [False] * batch

    def step():
        pending = engine.dispatch_verify(batch=batch_rows)
        engine.sample_verify(pending, sampling=sampling, clear_penalties=flags, active=[True] * batch)

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_step(engine: Engine, batch: int, kv_len: int, steps: int, folder: pathlib.Path, step_ms: float) -> None:
    """Traces `steps` decode steps of `batch` rows at kv_len (as `time_step` runs them) with `jax.profiler` into
    `folder` and prints where each step's device time went (benchmarks/trace_summary.py; its JSON beside the
    trace). The trace itself slows the host's side of a step; the device's op times are what to read."""
    import trace_summary

    args = decode_args(engine, batch, kv_len)
    engine.decode(*args)
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(steps):
            engine.decode(*args)
    summary = trace_summary.summarize(folder)
    print(f"-- profile: batch {batch}, kv {kv_len}, {steps} steps (trace in {folder})")
    trace_summary.print_summary(summary, steps, step_ms=step_ms)
    (folder / "summary.json").write_text(json.dumps(
        {dev: {"busy_us": d["busy_us"] / steps, "modules": [[m.name, m.us / steps] for m in d["modules"]],
               "ops": [[t.name, t.category, t.us / steps, t.bytes / steps, t.example] for t in d["ops"]]}
         for dev, d in summary.items()}, indent=1))


def device_label(tensor_parallel: int) -> str:
    """The device kind and platform the benchmark runs on, e.g. "NVIDIA H200 (gpu) x 2"."""
    d = jax.devices()[0]
    return f"{d.device_kind} ({d.platform})" + (f" x {tensor_parallel}" if tensor_parallel > 1 else "")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The arguments both benchmarks take (model, precision, tensor parallelism, outputs)."""
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--matmul-precision", default="float32", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--batch-invariant", action="store_true", help="with --matmul-precision bfloat16 or int8")
    parser.add_argument("--attention-kernel", choices=["xla", "pallas", "auto", "pallas-full"], default="xla",
                        help="the worker's --attention-kernel (pallas: decode attention through a Pallas kernel on "
                        "a TPU; auto: the kernel for steps of at least 2^18 rows x KV positions; pallas-full: the kernel for "
                        "the full layers only, sliding rings on XLA's loop)")
    parser.add_argument("--matmul-kernel", choices=["xla", "pallas"], default="xla",
                        help="the worker's --matmul-kernel (pallas: int8 weights' products through the Pallas W8A16 "
                        "kernel on a TPU; with --matmul-precision int8)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the engine over N devices (EngineConfig.tensor_parallel); bytes per step and "
                             "the bandwidth fraction are then per device (the fullest)")
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="buffer the bandwidth copy moves")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile into the persistent compilation cache (--cache-dir) and exit")
    parser.add_argument("--cache-dir", default=str(default_cache_dir()))
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--markdown", type=pathlib.Path, help="append the table to this file as markdown")


def append_markdown(path: pathlib.Path, heading: str, note: str, columns: list[str], rows: list[list]) -> None:
    """Append a section to the markdown file `path`: a level-3 heading, a note, and a table (numbers right-aligned)."""
    lines = [f"### {heading}", "", note, "", "| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n\n")


class LlamaServer:
    """llama.cpp's llama-server (built by benchmarks/llama_cpp_server.sh) on a GGUF, one slot, `threads` threads,
    for `token_ms`; a context manager that stops it on exit.

    Raises (on enter):
      FileNotFoundError: llama-server is not built.
      RuntimeError: the server did not start or answer within 60 s.
    """

    def __init__(self, gguf: pathlib.Path, threads: int = 2, port: int = 18089, context: int = 8192):
        self.gguf, self.threads, self.port, self.context = gguf, threads, port, context

    def __enter__(self) -> LlamaServer:
        import subprocess

        binary = next((pathlib.Path(__file__).parent / ".llama.cpp").glob("build-*/bin/llama-server"), None)
        if binary is None:
            raise FileNotFoundError("llama-server is not built: benchmarks/llama_cpp_server.sh build")
        self.proc = subprocess.Popen([str(binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port",
                                      str(self.port), "-np", "1", "-c", str(self.context), "-t", str(self.threads),
                                      "-tb", str(self.threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(120):
            try:
                self._post([2, 651], 4)  # warm-up (and the wait for the model to load)
                return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError("llama-server did not answer within 60 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def _post(self, prompt: list[int], n: int) -> dict:
        import urllib.request

        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def token_ms(self, last_position: int, tokens: int = 64) -> float:
        """llama.cpp's own decode time per token (ms, the server's `timings.predicted_per_token_ms`): one greedy
        completion of `tokens` tokens whose last one is at `last_position` (a prompt of arbitrary token ids fills
        the positions before), so that it attends to as many keys as our step at that position does."""
        prompt = [2] + [651 + i % 1000 for i in range(max(1, last_position + 1 - tokens) - 1)]
        return float(self._post(prompt, tokens)["timings"]["predicted_per_token_ms"])


def main() -> None:
    """Measure the grid of --batches x --kv and print (and write) the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--kv-int8", action="store_true")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--kv", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--verify-tokens", type=int, default=0, metavar="T",
                        help="also time verify steps of T tokens per row (speculative decoding: the pending token "
                        "and T - 1 drafts) at each batch and KV length: column 'verify ms' and its ratio to the "
                        "decode step")
    parser.add_argument("--ahead", action="store_true",
                        help="also time each row with steps dispatched one ahead of the host (`time_step_ahead`)")
    parser.add_argument("--loop", action="store_true",
                        help="also time the serving loop decoding each batch (`time_loop`: prompts of "
                        f"{LOOP_PROMPT} tokens, the smallest --kv's programs), planned steps and async scheduling: "
                        "columns 'loop ms' and 'loop ahead'")
    parser.add_argument("--profile", type=pathlib.Path, metavar="DIR",
                        help="after each row, trace its steps with jax.profiler into DIR/b<batch>-kv<len> and print "
                             "where the device's time went (benchmarks/trace_summary.py)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="(embedded model) also measure llama.cpp's own time per decoded token on the same GGUF "
                        "(its llama-server, built by benchmarks/llama_cpp_server.sh, 2 threads) and print the "
                        "B=1 step against it, in interleaved rounds at the same position")
    parser.add_argument("--llama-rounds", type=int, default=5, help="with --llama-cpp: rounds of ours then theirs")
    args = parser.parse_args()
    if args.matmul_kernel != "xla" and args.matmul_precision != "int8":
        parser.error("--matmul-kernel pallas runs int8 weights' products: give --matmul-precision int8")
    if args.attention_kernel != "xla" and args.tensor_parallel > 1:
        parser.error("--attention-kernel pallas runs on one device (as the worker refuses it with --tensor-parallel)")
    backend = jax.default_backend()
    dtype = args.dtype if args.dtype != "auto" else ("float32" if backend == "cpu" else "bfloat16")
    enable_compilation_cache(str(pathlib.Path(args.cache_dir) / "jax"))
    cfg, params = load(args.model, dtype, pathlib.Path(args.cache_dir), args.matmul_precision,
                       args.batch_invariant, args.attention_kernel, args.matmul_kernel)
    slots = max(args.batches)
    kv_buckets = sorted(set(args.kv))
    chunks = (LOOP_PROMPT, min(kv_buckets)) if args.loop else (min(kv_buckets),)
    ecfg = EngineConfig(num_slots=slots, max_model_len=max(kv_buckets), prefill_chunks=chunks,
                        dtype=dtype, kv_int8=args.kv_int8, tensor_parallel=args.tensor_parallel,
                        max_draft_tokens=max(0, args.verify_tokens - 1), max_verify_batch=slots)
    engine = Engine(cfg, params, ecfg)
    del params  # under tensor parallelism the engine keeps its own split copy
    engine.kv_buckets, engine.batch_buckets = tuple(kv_buckets), tuple(sorted(set(args.batches)))
    keys = [ProgramKey("decode", b, 1, L) for b in engine.batch_buckets for L in engine.kv_buckets]
    keys += [ProgramKey("greedy", b, 0, 0) for b in engine.batch_buckets]  # a step = forward + (greedy) sampling
    if args.verify_tokens > 1:
        keys += [ProgramKey(kind, b, args.verify_tokens, L if kind == "verify" else 0) for b in engine.batch_buckets
                 for kind in ("verify", "vgreedy", "vsample")  # the engine verifies once both samplers are there
                 for L in (engine.kv_buckets if kind == "verify" else [0])]
    if args.loop:  # the rows' prompts, their first token, and the sampler's reshape for async scheduling
        keys += [ProgramKey("compute", 1, LOOP_PROMPT, kv_buckets[0])]
        keys += [ProgramKey("greedy", 1, 0, 0)] if 1 not in engine.batch_buckets else []
    compile_s = engine.compile_all(keys=keys)
    if args.loop:
        engine.prepare_ahead()
    device = device_label(args.tensor_parallel)
    if args.compile_only:
        print(f"{cfg.name} on {device}: {len(keys)} programs compiled in {compile_s:.0f} s")
        return
    bandwidth = measure_bandwidth(args.bandwidth_mib << 20)
    weights = decode_bytes(engine, 1, 1).weights
    per_device = " per device" if args.tensor_parallel > 1 else ""
    title = (f"{cfg.name} on {device}: {dtype}, {args.matmul_precision} matmul precision"
             f"{', int8 KV' if args.kv_int8 else ''}")
    resident = sharding.per_device_bytes(engine.params)
    facts = (f"weights read per step{per_device} {weights / 2**30:.2f} GiB (resident{per_device}: "
             f"{resident / 2**30:.2f} GiB); bandwidth {bandwidth / 1e9:.0f} GB/s (a device copy of "
             f"{args.bandwidth_mib} MiB, bytes read + written); {len(keys)} programs compiled in {compile_s:.0f} s")
    print(f"{title}; {facts}")
    verify = args.verify_tokens > 1
    print(f"{'batch':>5} {'kv_len':>6} {'step ms':>8} {'tok/s':>8} {'MB/step':>8} {'bw':>5} {'vs B=1':>7}"
          + (f" {'ahead ms':>8} {'bw ahead':>8}" if args.ahead else "")
          + (f" {'verify ms':>9} {'verify/step':>11}" if verify else "")
          + (f" {'loop ms':>8} {'loop ahead':>10}" if args.loop else ""))
    rows = []
    for L in engine.kv_buckets:
        base = None
        for b in engine.batch_buckets:
            seconds = time_step(engine, b, L, args.steps)
            moved = decode_bytes(engine, b, L)
            base = base or seconds
            row = dict(batch=b, kv_len=L, step_ms=seconds * 1e3, tokens_per_s=b / seconds, bytes=moved.total,
                       weight_bytes=moved.weights, kv_bytes=moved.kv, kv_shared_bytes=moved.kv_shared,
                       bandwidth_fraction=moved.total / seconds / bandwidth, vs_batch1=seconds / base)
            rows.append(row)
            extra = ""
            if args.ahead:
                row["ahead_ms"] = time_step_ahead(engine, b, L, args.steps) * 1e3
                row["ahead_bandwidth_fraction"] = moved.total / (row["ahead_ms"] / 1e3) / bandwidth
                extra += f" {row['ahead_ms']:>8.2f} {row['ahead_bandwidth_fraction']:>8.0%}"
            if verify:
                row["verify_ms"] = time_verify(engine, b, L, args.steps) * 1e3
                extra += f" {row['verify_ms']:>9.2f} {row['verify_ms'] / row['step_ms']:>10.2f}x"
            if args.loop and L == engine.kv_buckets[0]:
                row["loop_ms"] = time_loop(engine, b, args.steps, False) * 1e3
                row["loop_ahead_ms"] = time_loop(engine, b, args.steps, True) * 1e3
                extra += f" {row['loop_ms']:>8.2f} {row['loop_ahead_ms']:>10.2f}"
            print(f"{b:>5} {L:>6} {row['step_ms']:>8.2f} {row['tokens_per_s']:>8.1f} {moved.total / 1e6:>8.0f} "
                  f"{row['bandwidth_fraction']:>5.0%} {row['vs_batch1']:>6.2f}x" + extra)
            if args.profile:
                profile_step(engine, b, L, args.steps, args.profile / f"b{b}-kv{L}", row["step_ms"])
    if args.llama_cpp:
        # Interleaved rounds (ours, then llama.cpp, at the same last position), so that both see the same phases
        # of a shared host; the ratio is of the medians.
        from common import preparation

        b, L = min(engine.batch_buckets), engine.kv_buckets[0]
        ours, theirs = [], []
        with LlamaServer(preparation.embedded_gguf(pathlib.Path(args.cache_dir))) as server:
            for _ in range(args.llama_rounds):
                ours.append(time_step(engine, b, L, args.steps) * 1e3)
                theirs.append(server.token_ms(L - 1))
        o, t = statistics.median(ours), statistics.median(theirs)
        print(f"llama.cpp: {t:.2f} ms per decoded token at position {L - 1} (llama-server, 2 threads, same GGUF; "
              f"rounds {', '.join(f'{x:.2f}' for x in theirs)}); our B={b} step at kv {L}: {o:.2f} ms (rounds "
              f"{', '.join(f'{x:.2f}' for x in ours)}) / llama.cpp = {o / t:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(dict(model=cfg.name, device=device, backend=backend, dtype=dtype,
                                             weights=weights, matmul_precision=args.matmul_precision,
                                             tensor_parallel=args.tensor_parallel, bandwidth=bandwidth,
                                             rows=rows), indent=1))
    if args.markdown:
        note = (f"{facts}. MB/step: weights + KV read{per_device} (KV-shared layers' re-reads of their source cache "
                "counted: at 8K they are device-memory traffic); bw: MB/step / step time / bandwidth.")
        append_markdown(args.markdown, f"decode step: {title}", note,
                        ["batch", "kv_len", "step ms", "tok/s", "MB/step", "bw", "vs B=1"],
                        [[r["batch"], r["kv_len"], f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.1f}",
                          f"{r['bytes'] / 1e6:.0f}", f"{r['bandwidth_fraction']:.0%}", f"{r['vs_batch1']:.2f}x"]
                         for r in rows])


if __name__ == "__main__":
    main()
