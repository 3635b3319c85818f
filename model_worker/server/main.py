"""Model worker process: flags -> prepared model -> gRPC server (NOT_SERVING) -> load + compile -> SERVING."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import signal
import threading
import time
from typing import TYPE_CHECKING

from grpc_health.v1 import health_pb2

from common import network, preparation, uds
from model_worker.numerics.xla_options import INVARIANT_CPU_FLAGS, add_xla_flags
from protos import model_worker_pb2, model_worker_pb2_grpc

if TYPE_CHECKING:  # the engine imports JAX, which the worker loads only once its flags are read
    from model_worker.engine.engine import Engine

log = logging.getLogger("gemma_serve.worker")


class FlagsRefused(Exception):
    """The worker's flags ask for what this model or these devices cannot do (the message gives the numbers): the
    worker exits 2, which `gemma-serve up` takes as refused flags and does not restart (a SystemExit raised in the
    loading thread would escape asyncio as a crash, exit 1, and be restarted)."""


def write_weights(reader, out: pathlib.Path, name: str) -> None:
    """The worker's part of a prepared GGUF: `model.safetensors` (`gguf_convert`'s weights: int8 blocks stay int8,
    exact) and `config.json` (the ModelConfig), each written atomically; first of all `layout.json`
    (`preparation.LAYOUT`: the config and each array's shape and dtype, forecast from the GGUF's header in a
    fraction of a second), from which a worker waiting for these files compiles its first programs meanwhile
    (`model_worker.server.early`).

    Args:
      reader: an open `gguf.GGUFReader`.
      out: the prepared directory (exists).
      name: the model name stored in the config.
    Raises:
      families.UnknownFamilyError: from `convert_gguf`, for a GGUF whose `general.architecture` no registered
        family serves (the worker then fails to start with that message).
      NotImplementedError, ValueError: from `convert_gguf`, for a family without a GGUF loader or a malformed file.
    """
    from safetensors.numpy import save_file

    from model_worker.checkpoints.gguf_convert import convert_gguf
    from model_worker.modeling.config import config_to_dict
    from model_worker.numerics.quant import int8_to_flat
    from model_worker.server.early import write_layout

    cfg, layout = convert_gguf(reader, name, values=False)
    write_layout(out / preparation.LAYOUT, cfg, int8_to_flat(layout))
    cfg, flat = convert_gguf(reader, name)
    tmp = out / "model.safetensors.partial"
    save_file(int8_to_flat(flat), str(tmp))
    os.replace(tmp, out / "model.safetensors")
    tmp = out / "config.json.partial"
    tmp.write_text(json.dumps(config_to_dict(cfg), indent=1))
    os.replace(tmp, out / "config.json")


PREPARE_PARTS: dict[str, preparation.PartBuilder] = {"weights": write_weights}
"""The prepared parts the worker reads (`common.preparation.prepare`)."""



def async_scheduling(args: argparse.Namespace, platform: str) -> bool:
    """Whether the loop dispatches decode steps ahead (`--async-scheduling`): on, off, or auto = off the CPU only.
    On an accelerator the host's work between steps (~2.5 ms a step on a TPU v5e: docs/performance.md) idles the
    device unless the next step is already queued; on CPU the host and the device share the cores, and a step
    dispatched ahead competes with the host's work instead of hiding it."""
    return args.async_scheduling == "on" or (args.async_scheduling == "auto" and platform != "cpu")


def prepare_async_scheduling(args: argparse.Namespace, engine: Engine) -> bool:
    """`async_scheduling` for this engine, with what it needs beyond the grid compiled when it is on
    (`Engine.prepare_ahead`), so that nothing compiles while serving. Returns the loop's `async_scheduling`."""
    ahead = async_scheduling(args, engine.platform)
    if ahead:
        engine.prepare_ahead()
    return ahead


def speculation_drafts(args: argparse.Namespace, invariant: bool, precision: str = "bfloat16") -> int:
    """The engine's `max_draft_tokens`: `--max-draft-tokens` with speculation on where it is exact (a row's logits
    batch-invariant: a verify step's positions then equal the decode steps'), else 0 (no verify programs).

    Not given, it is 3 with int8 products (`precision`) and 7 otherwise: the int8 kernel reads its weights once
    whatever the rows but is bound by arithmetic from a few rows, so a verify step of 4 positions costs ~1.2 plain
    decode steps and one of 8 ~2.4 (2-core CPU, docs/performance.md): 8 pays less than 4 at any acceptance below
    ~0.95 per drafted token, and loses to plain decoding below ~0.55.

    Raises:
      FlagsRefused: a negative `--max-draft-tokens`.
    """
    drafts = args.max_draft_tokens
    if drafts is None:
        drafts = 3 if precision == "int8" else 7
    if drafts < 0:
        raise FlagsRefused(f"--max-draft-tokens must be >= 0, got {drafts}")
    if args.speculation == "off" or drafts == 0:
        return 0
    if drafts & (drafts + 1):
        raise FlagsRefused(f"--max-draft-tokens must be one less than a power of two (1, 3, 7, 15, ...), got "
                           f"{drafts}")
    if drafts > args.prefix_slack:
        raise FlagsRefused(f"--max-draft-tokens {drafts} exceeds --prefix-slack {args.prefix_slack} "
                           "(rejected drafts overwrite that many sliding-ring entries)")
    if not invariant:
        log.warning("speculation off: these numerics are not batch-invariant, so verified drafts could change a "
                    "request's tokens (--batch-invariant makes it exact)")
        return 0
    return drafts


def load_engine(prepared, args: argparse.Namespace, weights: tuple | None = None):
    """Load the prepared weights onto the device and compile the program grid.

    The model family comes from the `families` registry: a checkpoint directory's from its config.json
    (`hf_loader.load_checkpoint`), a prepared GGUF's from the `architecture` its config.json records.

    With `weights` ((config, flat dict), e.g. `early.read_layout`'s zeros), those instead of the prepared files,
    silently, and only the serving set is compiled (into the executable cache; `early.EarlyCompile`): returns None.

    Returns:
      (engine, WorkerInfoResponse); the response's `architecture` is the family's registry name.
    Raises:
      families.UnknownFamilyError: the model's family is not registered (the message lists the supported ones).
      NotImplementedError: the family has no loader for the checkpoint's format or variant.
      ValueError: bad sizes (see Engine) or weights that do not match the config.
      FlagsRefused: `--num-slots` (a number, or the one slot `auto` falls back to) needs more memory than the
        device has (`memory.check_slots`: the message gives weights, KV per slot, temporaries and the limit).
    """
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from model_worker.engine import memory
    from model_worker.engine.engine import Engine, EngineConfig, compile_threads
    from model_worker.engine.executables import ExecutableCache
    from model_worker.modeling.attention import resolve_attention_kernel
    from model_worker.modeling.config import config_from_dict
    from model_worker.modeling.params import at_matmul_mode, matmul_mode, to_device
    from model_worker.server.service import engine_facts

    backend = jax.default_backend()
    dtype = args.dtype if args.dtype != "auto" else ("float32" if backend == "cpu" else "bfloat16")
    # The engine's programs come from the executable cache (below), which skips tracing and lowering too; JAX's
    # own cache stays off in the worker, because an executable that JAX loaded from it serializes without its
    # object code on XLA CPU (jaxlib 0.10: the reloaded program then fails with "Function ... not found").
    jax.config.update("jax_enable_compilation_cache", False)
    say = (lambda *a: None) if weights is not None else log.info
    t0 = time.perf_counter()
    # Split over several devices, the weights are staged in host memory and each device then receives only its
    # shard (`Engine` places them): loaded onto the first device whole, a model that needs the split to fit would
    # not fit there.
    staging = jax.devices("cpu")[0] if args.tensor_parallel > 1 else None
    say("loading %s weights (%s) onto %s", prepared.name, dtype, "host memory" if staging else backend)
    with jax.default_device(staging) if staging else contextlib.nullcontext():
        if weights is not None:
            cfg, flat = weights
        elif prepared.kind == "checkpoint":
            from model_worker.checkpoints.hf_loader import load_checkpoint, stop_token_ids

            cfg, flat = load_checkpoint(prepared.dir, jnp.dtype(dtype))
            cfg = dataclasses.replace(cfg, stop_token_ids=stop_token_ids(prepared.dir, cfg))
        else:
            cfg = config_from_dict(json.loads((prepared.dir / "config.json").read_text()))
            flat = load_file(str(prepared.dir / "model.safetensors"))
        params = to_device(cfg, flat, jnp.dtype(dtype))
        del flat  # the file's arrays: only the converted ones are needed from here on
        try:
            precision, invariant = matmul_mode(args.matmul_precision, args.batch_invariant, dtype,
                                               tensor_parallel=args.tensor_parallel,
                                               gguf=prepared.kind != "checkpoint")
        except ValueError as err:
            raise FlagsRefused(str(err)) from None
        kernel = resolve_attention_kernel(getattr(args, "attention_kernel", "auto"), backend, args.tensor_parallel)
        if kernel == "pallas" and args.tensor_parallel > 1:
            raise FlagsRefused("--attention-kernel pallas runs on one device (a Mosaic kernel is not partitioned "
                               "across devices); use xla with --tensor-parallel")
        if precision == "int8" and args.tensor_parallel > 1:
            raise FlagsRefused("--matmul-precision int8 runs on one device (its products are not split across "
                               "devices); use bfloat16 with --tensor-parallel")
        if getattr(args, "matmul_kernel", "xla") != "xla" and args.tensor_parallel > 1:
            raise FlagsRefused("--matmul-kernel pallas runs on one device; use xla with --tensor-parallel")
        try:
            cfg, params = at_matmul_mode(cfg, params, dtype, precision, invariant,
                                         getattr(args, "matmul_kernel", "xla"))
        except ValueError as err:
            raise FlagsRefused(str(err)) from None
        cfg = dataclasses.replace(cfg, attention_kernel=kernel)
        if precision == "float32" and backend != "cpu":
            # float32 products mean float32 here too: a TPU (and a GPU's TF32) multiplies float32 operands at lower
            # precision by default (one bfloat16 pass on a TPU). The worker owns the process: set it for every
            # program it traces.
            jax.config.update("jax_default_matmul_precision", "highest")
    say("weights loaded in %.1f s (%.2f GiB%s; %s activations, %s matmul precision%s)",
             time.perf_counter() - t0, params.nbytes() / 2**30, " in host memory" if staging else " on the device",
             dtype, precision, ", batch-invariant" if invariant else "")
    ecfg = EngineConfig(
        num_slots=1 if args.num_slots == "auto" else args.num_slots,  # decided below (memory.size_slots)
        max_model_len=args.max_model_len,
        prefill_chunks=tuple(sorted(args.prefill_chunks)),
        tail_chunks=tail_chunks(args.tail_chunks, args.prefill_chunks, backend),
        dtype=dtype,
        kv_int8=args.kv_cache_dtype == "int8",
        prefix_slack=args.prefix_slack,
        max_waiting=args.max_waiting,
        tensor_parallel=args.tensor_parallel,
        max_draft_tokens=speculation_drafts(args, cfg.batch_invariant, precision),
    )
    try:
        ecfg, footprint, limit = memory.size_slots(cfg, params, ecfg, auto=args.num_slots == "auto")
    except memory.SlotsDoNotFit as err:
        raise FlagsRefused(f"--num-slots {args.num_slots}: {err}") from None
    say("%s", memory.slots_text(ecfg.num_slots, args.num_slots == "auto", footprint, limit))
    try:
        engine = Engine(cfg, params, ecfg)
    except ValueError as err:  # sizes this model cannot take, a split that cuts quantization groups
        raise FlagsRefused(str(err)) from None
    del params  # under tensor parallelism the engine holds its own split copy
    if engine.mesh is not None:
        say("tensor parallel %d over %s", ecfg.tensor_parallel, ", ".join(map(str, engine.mesh.devices.flat)))
        if backend == "cpu":
            log.warning("tensor parallel %d over simulated CPU devices: for testing, no faster than one device",
                        ecfg.tensor_parallel)
    grid = engine.grid()
    say("the grid: %d programs (batch buckets %s, KV buckets %s, chunks %s, tail chunks %s)", len(grid),
             engine.batch_buckets, engine.kv_buckets, ecfg.prefill_chunks, ecfg.tail_chunks or "none")
    executables = ExecutableCache(pathlib.Path(args.cache_dir) / "executables")
    threads = min(args.compile_threads or compile_threads(), len(grid))
    if weights is not None:
        engine.compile_all(keys=engine.serving_set(), cache=executables, threads=threads)
        return None
    first = start_programs(engine, executables, args.serve_first)
    if len(first) < len(grid):
        log.info("compiling the %d programs that serve every request first (%d more load from the executable cache; "
                 "the other %d compile while serving)", len(set(first) - set(engine.cached(first, executables))),
                 len(engine.cached(first, executables)), len(grid) - len(first))
    seconds = engine.compile_all(lambda n, total, key: log.info("compiled %d/%d %s", n, total, key), keys=first,
                                 cache=executables, threads=threads)
    log.info("compiled %d programs in %.1f s, %d at a time (%d loaded from %s, %d stored there)",
             engine.num_programs, seconds, threads, executables.loaded, executables.directory, executables.stored)
    log.info("ran each forward program once (warm-up) in %.1f s", engine.warm_up())
    usage = memory.device_usage(engine)
    for device in usage:
        log.info("%s", device.line())
    if usage and usage[0].temporaries > footprint.temporaries(ecfg.num_slots):
        log.warning("the compiled programs' temporaries (%s) exceed the estimate the slots were sized with (%s)",
                    memory.size_text(usage[0].temporaries), memory.size_text(footprint.temporaries(ecfg.num_slots)))
    for u in usage:  # the measured figures must fit too: an out-of-memory step later would be fatal
        held = u.weights + u.kv + u.penalties + u.temporaries
        if u.capacity:  # programs compiled in the background get no more temporaries than the device has left
            left = u.capacity - (u.weights + u.kv + u.penalties)
            engine.temp_budget = left if engine.temp_budget is None else min(engine.temp_budget, left)
        if u.capacity and held > u.capacity:
            raise FlagsRefused(f"--num-slots {ecfg.num_slots}: device {u.device.id} needs {memory.size_text(held)} "
                               f"(weights, KV, penalty state and the compiled programs' temporaries) but reports "
                               f"{memory.size_text(u.capacity)}; ask for fewer slots")
    per_token, per_seq = engine.kv_bytes()
    info = model_worker_pb2.WorkerInfoResponse(
        model_name=prepared.name,
        architecture=cfg.architecture,
        vocab_size=cfg.vocab_size,
        max_model_len=ecfg.max_model_len,
        num_slots=ecfg.num_slots,
        dtype=dtype,
        weight_bytes=engine.weight_bytes(),
        kv_bytes_per_token=per_token,
        kv_bytes_per_sequence=per_seq,
        default_stop_token_ids=list(cfg.stop_token_ids),
        num_compiled_programs=engine.num_programs,
        backend=backend,
        max_waiting=ecfg.max_waiting if ecfg.max_waiting is not None else 2**31 - 1,
        **engine_facts(cfg, ecfg),
        device_memory=[model_worker_pb2.DeviceMemory(
            device_id=u.device.id, device_kind=u.device.device_kind, weight_bytes=u.weights, kv_bytes=u.kv,
            penalty_bytes=u.penalties, temp_bytes=u.temporaries, capacity_bytes=u.capacity or 0) for u in usage],
    )
    return engine, info


def start_programs(engine, executables, serve_first: bool) -> list:
    """The programs a worker has before it serves: with `serve_first`, every program the executable cache holds
    (loading takes seconds) and the serving set (`Engine.serving_set`), in the grid's order; else the whole grid.
    The rest compile in the background (`serve`)."""
    grid = engine.grid()
    if not serve_first:
        return grid
    first = set(engine.cached(grid, executables)) | set(engine.serving_set())
    return [key for key in grid if key in first]


#: `--tail-chunks` on CPU when not given (an accelerator pads nearly for free: none there).
CPU_TAIL_CHUNKS = (16, 32)


def tail_chunks(given: list[int] | None, prefill_chunks: list[int], backend: str) -> tuple[int, ...]:
    """The engine's tail chunks: `--tail-chunks` as given (none: off), else `CPU_TAIL_CHUNKS` on CPU, keeping
    only those below the smallest prefill chunk (the defaults with `--prefill-chunks 16` leave none); none off
    CPU (given ones are dropped with a warning: the engine would compile them and never run them).

    Raises:
      FlagsRefused: a given tail chunk that is not positive and below the smallest prefill chunk.
    """
    if given is None:
        return tuple(c for c in CPU_TAIL_CHUNKS if c < min(prefill_chunks)) if backend == "cpu" else ()
    if any(not 0 < c < min(prefill_chunks) for c in given):
        raise FlagsRefused(f"--tail-chunks {' '.join(map(str, given))}: each must be positive and below the smallest "
                           f"prefill chunk {min(prefill_chunks)}")
    if given and backend != "cpu":
        log.warning("--tail-chunks %s ignored on %s: only a CPU engine runs tail chunks (an accelerator pads a "
                    "chunk nearly for free)", " ".join(map(str, given)), backend)
        return ()
    return tuple(sorted(set(given)))


def simulate_cpu_devices(n: int) -> None:
    """Give XLA's CPU backend `n` devices (`--xla_force_host_platform_device_count`), so `--tensor-parallel n` runs
    on a CPU host too (for testing: the devices share the host's cores). Only the CPU backend reads the flag, so a
    GPU or TPU worker is unaffected. No-op once jax is imported (the flag is read when its backends start) or when
    XLA_FLAGS already sets a count."""
    if n > 1:
        add_xla_flags(f"--xla_force_host_platform_device_count={n}")


def device_problem(tensor_parallel: int) -> str | None:
    """Why this process cannot split the model over `tensor_parallel` devices (a message with the numbers), or
    None when it has that many."""
    import jax

    devices = jax.devices()
    if tensor_parallel <= len(devices):
        return None
    return (f"--tensor-parallel {tensor_parallel} needs {tensor_parallel} devices; this worker sees {len(devices)} "
            f"({jax.default_backend()}: {', '.join(str(d) for d in devices)})")


async def serve(args: argparse.Namespace) -> int:
    """Run the worker until SIGTERM/SIGINT. Returns the process exit code (2: flags this host cannot honour)."""
    from model_worker.server.metrics import WorkerMetrics
    from model_worker.server.service import SERVICE_NAME, WorkerServicer
    from model_worker.serving.loop import FAULT_ENV, EngineLoop, wait_idle
    from model_worker.serving.slo import SloSettings

    problem = device_problem(args.tensor_parallel)
    if problem:
        log.error("%s", problem)
        return 2

    try:  # refused TLS flags or host before anything binds
        network.internal_server_tls(args)
    except network.NetworkConfigError as err:
        log.error("%s", err)
        return 2
    metrics = WorkerMetrics()
    metrics_uds = args.metrics_uds or (uds.sibling(args.uds, "metrics") if args.uds else None)
    try:
        metrics.serve(args.worker_metrics_port, args.host, str(metrics_uds) if metrics_uds else None)
    except (uds.SocketPathError, OSError) as err:
        log.error("cannot serve metrics: %s", err)
        return 2

    servicer = WorkerServicer(model_worker_pb2.WorkerInfoResponse(), max_session_ttl=args.max_session_ttl)
    try:
        server, health_servicer, address = await network.internal_server(
            args, args.worker_port, SERVICE_NAME, lambda s: model_worker_pb2_grpc.add_ModelWorkerServicer_to_server(
                servicer, s))
    except network.NetworkConfigError as err:
        log.error("%s", err)
        return 2
    await server.start()
    log.info("model worker listening on %s (NOT_SERVING until compiled)", address)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    loader = asyncio.ensure_future(asyncio.to_thread(_prepare_and_load, args))
    await asyncio.wait([loader, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("stopping before the engine was ready")
        await server.stop(1)
        # Nothing to drain; the loader thread cannot be interrupted and asyncio.run would wait for it to finish
        # loading and compiling (minutes) before exiting.
        logging.shutdown()
        os._exit(0)
    try:
        engine, info = loader.result()
    except FlagsRefused as err:  # flags this model or device cannot honour (`load_engine` says which): not a crash
        log.error("%s", err)
        await server.stop(0)
        return 2
    except (FileNotFoundError, ValueError) as err:  # a model spec that is no model (`preparation.prepare`): one line
        log.error("failed to load the model: %s", err)
        await server.stop(0)
        return 1
    except Exception:
        log.exception("failed to load the model")
        await server.stop(0)
        return 1
    metrics.programs.set(engine.num_programs)
    later = [key for key in engine.grid() if key not in engine.ready_programs()]
    metrics.programs_compiling.set(len(later))
    fatal = asyncio.Event()
    aio_loop = asyncio.get_running_loop()
    fault = os.environ.get(FAULT_ENV)
    loop = EngineLoop(engine, token_budget=args.prefill_token_budget, metrics=metrics,
                      on_fatal=lambda exc: aio_loop.call_soon_threadsafe(fatal.set),
                      fault_salt=fault or None, lease_preempt_after=args.lease_preempt_after,
                      speculation=args.speculation,
                      async_scheduling=prepare_async_scheduling(args, engine),
                      slo=SloSettings(args.slo_ttft, args.slo_tpot, args.slo_policy))
    timed = engine.time_programs()
    loop.seed_step_model(timed)
    log.info("timed %d of %d forward programs for the step-time model in %.1f s", len(timed), engine.num_programs,
             sum(t for _, t in timed))
    loop.start()
    servicer.set_ready(loop, info)
    servicer.programs_compiling = len(later)  # before SERVING: a load report in between would say 0 (full speed)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("model worker SERVING %s on %s%s", info.model_name, address,
             f" ({len(later)} programs compiling in the background)" if later else ", every program compiled")
    background = start_background(engine, later, args, metrics, servicer) if later else None
    await asyncio.wait([asyncio.ensure_future(stop.wait()), asyncio.ensure_future(fatal.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if background is not None and not background.done.is_set():
        background.stop()  # no further compile starts; those running finish (`_exit`)
        log.info("background compilation stopped with %d programs left", background.total - background.compiled
                 - len(background.failed))
    if fatal.is_set():
        # The KV buffers may be gone with the failed step: end here so the supervisor starts a fresh worker. The
        # grace lets every stream receive its UNAVAILABLE first.
        log.error("engine failed: exiting for a restart")
        await server.stop(1)
        return await _exit(background, 3)
    servicer.draining = True
    log.info("draining: new requests refused, running ones may finish (at most %.0f s)", args.drain_timeout)
    if not await asyncio.to_thread(wait_idle, loop, args.drain_timeout):
        log.warning("drain timeout: cutting the requests still running")
    log.info("shutting down")
    await server.stop(2)
    loop.stop()
    return await _exit(background, 0, engine)


#: Seconds an exiting worker waits for the compiles still running on its background threads.
COMPILE_EXIT_WAIT_S = 30.0


async def _exit(background, code: int, engine=None) -> int:
    """Return `code` once no background compile runs. A compile in XLA cannot be interrupted, and a process whose
    interpreter finalizes while one runs aborts (SIGABRT from C++); so wait for it up to `COMPILE_EXIT_WAIT_S`
    seconds, then end the process at once (`os._exit`, after flushing the log), skipping the finalization.
    With `engine` (a clean stop, its loop gone), first store the programs the loop had no idle moment to store, so
    that a restart loads them."""
    if background is None or await asyncio.to_thread(background.stop, COMPILE_EXIT_WAIT_S):
        stored = engine.store_deferred(None) if engine is not None else 0
        if stored:
            log.info("stored %d programs compiled in the background into the executable cache", stored)
        return code
    log.warning("a background compile is still running after %.0f s: exiting without waiting for it",
                COMPILE_EXIT_WAIT_S)
    logging.shutdown()
    os._exit(code)


#: Cores from which the serving set compiles while the weights are written (`early.EarlyCompile`). On two the
#: preparation and the compile share them: with the worker's imports and CPU kernel warm the worker was SERVING
#: 46 s after `up` either way; on a new machine (no bytecode yet) it reached the layout only as the weights were
#: done (docs/performance.md, "The first minute again").
EARLY_MIN_CPUS = 4


def _prepare_and_load(args: argparse.Namespace):
    """The loader thread's work: the CPU kernel, the model files, the engine (`load_engine`'s result and errors).

    The CPU's block-int8 kernel is built (or loaded) first: under `gemma-serve up` the launcher is preparing the
    model files meanwhile and `preparation.prepare` would only wait for them, so a new machine's C++ build (~7 s)
    leaves the first answer's critical path (docs/performance.md, "The first minute"); nothing to do off CPU. With
    serve-first on a host of `EARLY_MIN_CPUS` cores or more, the serving set then compiles from the weights' layout
    while the weights are still being written (`early.EarlyCompile`), and the engine loads it from the executable
    cache."""
    import jax

    from model_worker.numerics import q8

    if jax.default_backend() == "cpu":
        q8.kernel_available()
    from model_worker.server.early import EarlyCompile

    def compile_early(cfg, flat) -> None:
        try:
            load_engine(preparation.PreparedModel("early", "gguf", pathlib.Path()), args, weights=(cfg, flat))
        except FlagsRefused:
            pass  # the real load refuses them in turn, with the message

    early = None
    if args.serve_first and (os.cpu_count() or 1) >= EARLY_MIN_CPUS:
        # the serving set compiles from the layout while the weights are written
        early = EarlyCompile(args.model, pathlib.Path(args.cache_dir), compile_early).watch()
    try:
        prepared = preparation.prepare(args.model, pathlib.Path(args.cache_dir), PREPARE_PARTS)
    finally:
        if early is not None:
            early.finish()
    return load_engine(prepared, args)


def start_background(engine, keys: list, args: argparse.Namespace, metrics, servicer):
    """Compile `keys` while the worker serves (`Engine.compile_in_background`, from the executable cache where it
    holds them), each into the metrics and the log as it arrives, and a last line when every program is ready:
    the worker's full speed. Returns the `BackgroundCompile`."""
    from model_worker.engine.engine import compile_threads
    from model_worker.engine.executables import ExecutableCache

    started = time.perf_counter()
    executables = ExecutableCache(pathlib.Path(args.cache_dir) / "executables")
    total = len(keys)
    counts = {"done": 0, "failed": 0}
    lock = threading.Lock()  # the callback runs on every compiling thread

    def compiled(key, ok: bool) -> None:
        with lock:
            counts["done"] += 1
            counts["failed"] += not ok
            done, failed = counts["done"], counts["failed"]
        metrics.programs_compiling.set(total - done)
        servicer.programs_compiling = total - done
        if ok:
            metrics.programs.inc()
        log.info("compiled in the background %d/%d %s%s", done, total, key,
                 "" if ok else " (FAILED: serving without it)")
        if done == total:
            log.info("full speed: every program of the grid compiled, %.1f s after serving began (%d failed)",
                     time.perf_counter() - started, failed)

    servicer.programs_compiling = total
    threads = min(args.compile_threads or compile_threads(), total)
    job = engine.compile_in_background(keys, cache=executables, threads=threads, on_compiled=compiled, process=True)
    return job


def run(args: argparse.Namespace) -> int:
    """Entry point of `gemma-serve worker`."""
    simulate_cpu_devices(args.tensor_parallel)
    add_xla_flags(*INVARIANT_CPU_FLAGS)
    return asyncio.run(serve(args))
