"""The device side of the worker: weights, the KV cache, per-slot penalty state, and a fixed grid of programs.

Every model program is jitted with the KV cache and the penalty state donated (updated in place, never copied
per token). The grid is enumerated and compiled ahead of time at start-up (`Engine.compile_all`) from one table,
`programs.PROGRAMS`, which gives each kind's body, donated state, shape grid and example inputs (lowering,
warm-up and dispatch all read it); a key is `programs.ProgramKey(kind, batch, chunk, kv_len)`:

  * compute (batch 1, C tokens of one slot, KV bucket L) -> ("compute", 1, C, L): prompt chunks and forced-token
    runs (several tokens per slot in one step)
  * decode  (B slots, one token each, KV bucket L)        -> ("decode", B, 1, L), B in the batch buckets
  * mixed   (one slot's chunk of C tokens + a decode batch)-> ("mixed", B, C, max_model_len), C the smallest
    chunk: a prompt chunk and the running streams' next tokens in one pass over the weights
    (`model.forward_batches`); one KV bucket only, the largest (`programs._mixed_grid`)
  * sample  (B rows of logits)                            -> ("sample", B, 0, 0): penalties, masks, sampling
  * greedy  (B rows, plain greedy, no penalty clearing)   -> ("greedy", B, 0, 0): mask + argmax only
  * copy    (one slot's KV and penalty rows to another)   -> ("copy", 1, 0, 0): prefix reuse, `n` > 1
  * verify  (B slots, T tokens each: pending + drafts)     -> ("verify", B, T, max_model_len), T = 1 +
    max_draft_tokens, B in the batch buckets up to max_verify_batch; its sampling ("vsample" / "vgreedy", (B, T,
    0)) walks the positions in order (speculative decoding; none when max_draft_tokens is 0)

The forward programs return logits that stay on the device; sampling is a separate program, dispatched once
the token masks of constrained rows have arrived, so a client builds step t's mask while step t's forward pass
runs (JAX dispatches asynchronously).

Batch buckets are powers of two up to num_slots: a lone sequence runs the B=1 programs, and a decode batch of n
sequences runs the smallest bucket >= n, padded with idle slots (position -1: they write nothing). KV buckets
are the sliding window times powers of `kv_bucket_factor`, capped by max_model_len: full-attention layers read
only cache positions [0, L). Sampling settings, seeds, masks, positions and token ids are runtime arrays, so no
request can trigger a compilation; a shape outside the grid is a bug and raises KeyError instead of compiling
silently. The worker keeps its compiled programs in the executable cache (`executables.py`; `compile_all`'s
`cache`), which a restart loads without tracing or lowering; benchmarks and tests compiling in-process use JAX's
persistent compilation cache (`enable_compilation_cache`).

With `EngineConfig.tensor_parallel` > 1 the same grid runs over a mesh of that many devices: weights, KV cache,
penalty state and logits split as `model_worker.engine.sharding` says, every program compiled with explicit in/out
shardings (docs/architecture.md, "Tensor parallelism").
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import queue
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model_worker.engine import background_compile, compile_process, sharding
from model_worker.engine.background_compile import BackgroundCompile, background_order, serving_set
from model_worker.engine.executables import ExecutableCache, fingerprint
from model_worker.engine.programs import (
    PROGRAMS,
    ChunkInputs,
    CopyInputs,
    GridSizes,
    ProgramKey,
    ProgramKind,
    SampleInputs,
    idle_batch,
    lower_on_one_device,
    program_keys,
)
from model_worker.modeling.config import ModelConfig
from model_worker.modeling.kv_cache import KVCache
from model_worker.modeling.model import Batch
from model_worker.modeling.params import Params
from model_worker.modeling.sampling import (
    SampleOutput,
    SamplingArrays,
    is_plain_greedy,
    penalty_capacity,
    penalty_history_zeros,
)
from model_worker.serving.engine_api import (
    DecodeBatch,
    HostOutput,
    PromptChunk,
    StepShape,
    VerifyBatch,
    VerifyOutput,
)

log = logging.getLogger(__name__)


def compile_threads() -> int:
    """Programs `Engine.compile_all` compiles at once by default: `GEMMA_SERVE_COMPILE_THREADS`, else one per core
    this process may run on (`os.sched_getaffinity`), at most 16 (each compile holds its own temporaries)."""
    env = os.environ.get("GEMMA_SERVE_COMPILE_THREADS", "")
    if env.strip().isdecimal() and int(env) > 0:
        return int(env)
    if env:
        log.warning("GEMMA_SERVE_COMPILE_THREADS=%r is not a positive integer; using one thread per core", env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 16))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes.

    Attributes:
      num_slots: sequences held at once (rows of the KV cache); the largest decode batch.
      max_model_len: context limit in tokens (prompt + generated); the full-attention cache length.
      prefill_chunks: chunk lengths of the compute program; a prompt is cut into the largest chunks that it fills,
        and only its last chunk is padded (`Engine.chunk_size`).
      tail_chunks: shorter compute chunks (each below the smallest prefill chunk) for what is left of a prompt
        once no prefill chunk fills: on CPU its tail runs in the cheapest mix of these and the smallest prefill
        chunk (`Engine.chunk_size`) instead of one chunk mostly padding. Compute programs only (a mixed step
        keeps the smallest prefill chunk).
      dtype: weights and activations dtype ("float32" or "bfloat16").
      kv_int8: store K/V as int8 with per-token, per-head scales.
      kv_bucket_factor: ratio between consecutive KV-length buckets.
      prefix_slack: sliding-ring positions kept beyond the window, so a new prompt that diverges from a slot's
        history at most this many tokens before its end reuses the slot exactly (prefix reuse).
      max_waiting: bound of the waiting queue (requests beyond it are refused: RESOURCE_EXHAUSTED).
      tensor_parallel: devices one engine splits its weights, KV cache and logits over (a mesh of that many
        devices, axis "model"; `model_worker.engine.sharding`); 1: one device, no mesh, today's programs exactly.
      max_draft_tokens: most drafted tokens per row of a verify step (speculative decoding); 0: no verify
        programs; at most prefix_slack (`reuse_slack`), and 1 + max_draft_tokens a power of two (`__init__`).
        Exact only where a row's logits do not depend on the program computing them (batch-invariant numerics):
        the worker turns it off otherwise.
      max_verify_batch: the largest batch bucket that gets verify programs (larger batches decode plainly: their
        steps are closer to compute-bound, where checking drafts costs what it saves).
    """

    num_slots: int = 4
    max_model_len: int = 8192
    prefill_chunks: tuple[int, ...] = (64, 512)
    tail_chunks: tuple[int, ...] = ()
    dtype: str = "float32"
    kv_int8: bool = False
    kv_bucket_factor: int = 4
    prefix_slack: int = 256
    max_waiting: int | None = 64
    tensor_parallel: int = 1
    max_draft_tokens: int = 0
    max_verify_batch: int = 2

    @property
    def reuse_slack(self) -> int:
        """How far before a slot's end a new prompt may diverge and still reuse the slot exactly: `prefix_slack`
        less the drafts of a verify step, whose rejected positions overwrite that many ring entries older than the
        window (entries no later step attends to, but which a prefix reuse at the deepest split would read)."""
        return max(0, self.prefix_slack - self.max_draft_tokens)

    def verify_batches(self) -> tuple[int, ...]:
        """Batch buckets with verify programs (none without drafts)."""
        if self.max_draft_tokens <= 0:
            return ()
        return tuple(b for b in self.batch_buckets() if b <= max(1, self.max_verify_batch))

    def kv_buckets(self, window: int) -> tuple[int, ...]:
        """KV length buckets: window * factor**i below max_model_len, then max_model_len."""
        buckets, b = [], max(window, min(self.prefill_chunks))
        while b < self.max_model_len:
            buckets.append(b)
            b *= self.kv_bucket_factor
        return tuple(buckets) + (self.max_model_len,)

    def batch_buckets(self) -> tuple[int, ...]:
        """Decode batch sizes: powers of two below num_slots, then num_slots."""
        buckets, b = [], 1
        while b < self.num_slots:
            buckets.append(b)
            b *= 2
        return tuple(buckets) + (self.num_slots,)


def host_output(out: SampleOutput, rows: int) -> HostOutput:
    """The first `rows` rows of a sample program's output, copied to the host (blocks until it is done)."""
    fields = jax.device_get((out.tokens, out.logprobs, out.top_ids, out.top_logprobs, out.mask_empty))
    return HostOutput(*(np.asarray(f)[:rows] for f in fields))


@dataclasses.dataclass
class Sampled:
    """A dispatched sample program whose outputs are still on the device (JAX runs it asynchronously): what a
    decode step dispatched one step ahead takes its input tokens from (`Engine.dispatch_decode_after`).

    Attributes:
      out: the program's `SampleOutput` (B rows, the batch bucket) on the device.
      slots: int32 [num_rows]; the slots of its real rows, in order.
    """

    out: SampleOutput
    slots: np.ndarray

    def result(self) -> HostOutput:
        """The real rows' results on the host (blocks until the sampling is done)."""
        return host_output(self.out, len(self.slots))


@functools.cache
def _as_column(batch: int) -> Callable[[jax.Array], jax.Array]:
    """A compiled [batch] -> [batch, 1] reshape: a sample program's tokens as a decode step's input tokens, on the
    device (one tiny program per batch bucket, compiled by `Engine.prepare_ahead` before serving)."""
    return jax.jit(lambda tokens: tokens[:, None]).lower(jax.ShapeDtypeStruct((batch,), jnp.int32)).compile()


@dataclasses.dataclass
class Pending:
    """A dispatched forward pass whose logits await sampling (JAX runs it asynchronously meanwhile).

    Attributes:
      logits: [B, V] float32 on the device.
      slots, tokens, positions, is_output: the batch rows' inputs, padded to B: slots [B] int32; tokens,
        positions [B, 1] int32 (position -1: nothing to record, e.g. a chunk that recorded its own); is_output
        [B, 1] bool.
      num_rows: how many rows belong to real sequences (the first `num_rows` of the batch).
    """

    logits: jax.Array
    slots: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    is_output: np.ndarray
    num_rows: int

    @staticmethod
    def of_chunk(chunk: ChunkInputs, slot: int, logits: jax.Array) -> Pending:
        """A chunk's last-token logits [1, V] awaiting sampling (the chunk recorded its own inputs)."""
        b = chunk.batch
        return Pending(logits, np.array([slot], np.int32), b.tokens[:, :1], np.full((1, 1), -1, np.int32),
                       chunk.is_output[:, :1], 1)

    def sample_inputs(self, clear_penalties: Sequence[bool], active: Sequence[bool], sampling: SamplingArrays,
                      vocab: int) -> SampleInputs:
        """The sample program's inputs: the real rows' flags (`num_rows` each) and settings padded to the batch
        (padding rows are greedy, inactive and clear nothing)."""
        batch = self.slots.shape[0]
        flags = lambda values: np.array(list(values) + [False] * (batch - self.num_rows), bool)
        return SampleInputs(self.logits, self.tokens, self.positions, self.slots, self.is_output,
                            flags(clear_penalties), flags(active), _pad_rows(sampling, batch, vocab))


@dataclasses.dataclass
class _DecodeRows:
    """Host arrays of one decode batch padded to its bucket: the program's `Batch`, its slots ([B] int32), the
    rows' `is_output` ([B, 1] bool), and how many rows are real (the first `num_rows`)."""

    batch: Batch
    slots: np.ndarray
    is_output: np.ndarray
    num_rows: int

    def pending(self, logits: jax.Array) -> Pending:
        """The batch's logits [B, V] awaiting sampling."""
        b = self.batch
        return Pending(logits, self.slots, b.tokens, b.positions, self.is_output, self.num_rows)


class Engine:
    """Owns the weights, the KV cache, the penalty state and the compiled programs. One thread drives it."""

    def __init__(self, cfg: ModelConfig, params: Params, ecfg: EngineConfig, devices=None):
        """Allocate the KV cache and penalty state for `ecfg.num_slots` sequences of `ecfg.max_model_len` tokens.

        With `ecfg.tensor_parallel` N > 1 (or `devices` given), the engine builds a mesh over the first N of
        `devices` (default `jax.devices()`; several workers on one host each pass their own devices), places the
        weights split as `sharding.Layout` says (`params` may live anywhere; the engine keeps the split copy),
        creates the cache and penalty state already split, and compiles every program with explicit in/out
        shardings (a donated array comes back with exactly its input sharding). `mesh` and `layout` are None
        otherwise (N = 1 without `devices`: no mesh, the programs of a single device).

        Raises:
          ValueError: max_model_len exceeds the model's max_position_embeddings, a chunk exceeds max_model_len,
            tensor_parallel exceeds the devices available (both numbers given), or a quantized weight's split
            would cut a quantization group (`sharding.Layout.place_params`).
        """
        if ecfg.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {ecfg.max_model_len} exceeds the model's context of {cfg.max_position_embeddings}"
            )
        if ecfg.max_draft_tokens and (ecfg.max_draft_tokens + 1) & ecfg.max_draft_tokens:
            raise ValueError(f"max_draft_tokens + 1 must be a power of two (verify steps of 2, 4, 8, ... tokens per "
                             f"row keep their products' rows in the same kernel blocks as decode steps: "
                             f"docs/architecture.md, Speculative decoding), got {ecfg.max_draft_tokens}")
        if ecfg.max_draft_tokens and ecfg.max_verify_batch < ecfg.num_slots and \
                ecfg.max_verify_batch not in ecfg.batch_buckets():
            raise ValueError(f"max_verify_batch {ecfg.max_verify_batch} must be a batch bucket "
                             f"{ecfg.batch_buckets()} (the loop drafts for up to that many rows)")
        if ecfg.max_draft_tokens > ecfg.prefix_slack:
            raise ValueError(f"max_draft_tokens {ecfg.max_draft_tokens} exceeds prefix_slack {ecfg.prefix_slack}: a "
                             "rejected draft would overwrite ring entries still in the window")
        if ecfg.tail_chunks and not 0 < min(ecfg.tail_chunks) <= max(ecfg.tail_chunks) < min(ecfg.prefill_chunks):
            raise ValueError(f"tail chunks {ecfg.tail_chunks} must be positive and below the smallest prefill chunk "
                             f"{min(ecfg.prefill_chunks)}")
        if max(ecfg.prefill_chunks) > ecfg.max_model_len:
            raise ValueError(f"prefill chunk {max(ecfg.prefill_chunks)} exceeds max_model_len {ecfg.max_model_len}")
        self.cfg, self.ecfg, self.params = cfg, ecfg, params
        self.dtype = jnp.dtype(ecfg.dtype)
        self.mesh, self.layout = None, None
        if ecfg.tensor_parallel != 1 or devices is not None:
            self.mesh = sharding.make_mesh(ecfg.tensor_parallel, devices)
            self.layout = sharding.Layout(cfg, self.mesh)
            self.params = self.layout.place_params(params)
            self.cache = self.layout.zeros_cache(cfg, ecfg.num_slots, ecfg.max_model_len, self.dtype,
                                                 ecfg.kv_int8, ecfg.prefix_slack, self._bf16_bits())
            self.pstate = self.layout.zeros_penalties(ecfg.num_slots, ecfg.max_model_len)
            for note in self.layout.summary():  # a split that frees less memory than asked: worth a warning
                log.warning("tensor parallel %d: %s", ecfg.tensor_parallel, note)
        else:
            self.cache = KVCache.zeros(cfg, ecfg.num_slots, ecfg.max_model_len, self.dtype, int8=ecfg.kv_int8,
                                       slack=ecfg.prefix_slack, bf16_bits=self._bf16_bits())
            self.pstate = penalty_history_zeros(ecfg.num_slots, penalty_capacity(ecfg.max_model_len, cfg.vocab_size))
        self.kv_buckets = ecfg.kv_buckets(cfg.sliding_window)
        self.batch_buckets = ecfg.batch_buckets()
        self._programs: dict[ProgramKey, jax.stages.Compiled] = {}
        # Programs compiled on background threads, waiting for the loop's thread to adopt them (`adopt_programs`):
        # only that thread runs programs, since a run replaces the donated state.
        self._arrivals: queue.SimpleQueue[tuple[ProgramKey, jax.stages.Compiled]] = queue.SimpleQueue()
        self._deferred_cache: ExecutableCache | None = None  # where the background's deferred stores go
        # The state's shapes, dtypes and shardings, for lowering on any thread: the arrays themselves are replaced
        # (donated) by every step the loop's thread runs meanwhile.
        # (Shardings only under a mesh: a single device's programs are lowered as from uncommitted arrays, with no
        # sharding annotations, exactly as before; the calling thread's default device places them.)
        keep = self.mesh is not None
        self._abstract_state = {name: jax.tree_util.tree_map(lambda a: _abstract(a, keep), getattr(self, name))
                                for name in ("params", "cache", "pstate")}
        self.temp_budget: int | None = None  # bytes a background program's temporaries may take (None: no bound)
        self.calls: collections.Counter = collections.Counter()  # program key -> times run
        self._pad_only_tail = jax.default_backend() == "cpu"  # chunk_size's policy
        self.mixed_chunk = min(ecfg.prefill_chunks)  # the chunk of a mixed step (`dispatch_mixed`)

    # ----- the grid -------------------------------------------------------------------------------------------
    @property
    def platform(self) -> str:
        """The platform the engine's state lives on ("cpu", "tpu", "gpu"): the mesh's devices, else the default
        device in effect (a test may set the CPU on a TPU host)."""
        if self.mesh is not None:
            return self.mesh.devices.flat[0].platform
        device = jax.config.jax_default_device
        device = jax.devices(device)[0] if isinstance(device, str) else device or jax.devices()[0]
        return device.platform

    def _bf16_bits(self) -> bool:
        """Whether a bfloat16 KV cache is stored as its bits (`kv_cache.storage_dtype`): on CPU only, whose XLA
        has no in-place bfloat16 write; elsewhere bfloat16 itself, which the Pallas attention kernel reads as it is."""
        return self.platform == "cpu"

    def grid(self) -> list[ProgramKey]:
        """Every program key (kind, batch, tokens per row, kv_len), kind by kind (`programs.PROGRAMS`)."""
        chunks = tuple(sorted(set(self.ecfg.prefill_chunks) | set(self.ecfg.tail_chunks)))
        return program_keys(GridSizes(chunks, tuple(self.kv_buckets),
                                      tuple(self.batch_buckets), self.mixed_chunk, self.ecfg.num_slots,
                                      self.ecfg.max_draft_tokens + 1, self.ecfg.verify_batches()))

    def _lower(self, key: ProgramKey) -> jax.stages.Lowered:
        """The program of `key`, lowered for its shapes."""
        if self.layout is None:
            return lower_on_one_device(key, self.cfg, self._abstract_state)
        kind = PROGRAMS[key.kind]
        fn = functools.partial(kind.fn, cfg=self.cfg, kv_len=key.kv_len) if kind.model else kind.fn
        state, inputs = self._state(kind, abstract=True), kind.example(key, self.cfg.vocab_size)
        if kind.samples:
            fn = functools.partial(fn, vocab_parts=self.layout.vocab_parts)
        # Explicit shardings: the state keeps its own (a donated array comes back exactly as it went in), host
        # inputs are replicated, logits stay split over the vocabulary from the forward programs into sampling.
        state_sh = tuple(jax.tree_util.tree_map(lambda a: a.sharding, x) for x in state)
        donated_sh = tuple(state_sh[kind.state.index(name)] for name in kind.donated)
        result_sh = self.layout.logits if kind.model else self.layout.replicated
        return jax.jit(fn, donate_argnames=kind.donated, in_shardings=state_sh + self.layout.input_shardings(inputs),
                       out_shardings=(result_sh, *donated_sh)).lower(*state, *inputs)

    def _state(self, kind: ProgramKind, abstract: bool = False) -> tuple:
        """A program's leading arguments: the engine state it names (params, cache, penalty state); `abstract`:
        their shapes, dtypes and shardings only (`jax.ShapeDtypeStruct`s, for lowering on any thread)."""
        if abstract:
            return tuple(self._abstract_state[name] for name in kind.state)
        return tuple(getattr(self, name) for name in kind.state)

    def _run(self, key: ProgramKey, *inputs, count: bool = True):
        """Run the compiled program of `key` on the engine state and `inputs`; keep the state it returns (its
        donated arguments are gone) and return its result. `count`: note the run in `calls`.

        Raises:
          KeyError: `key` is not compiled (a shape outside the grid is a bug, never a silent compile).
        """
        kind = PROGRAMS[key.kind]
        if count:
            self.calls[key] += 1
        result, *state = self._programs[key](*self._state(kind), *inputs)
        for name, value in zip(kind.donated, state):
            setattr(self, name, value)
        return result

    def compile_all(self, progress: Callable[[int, int, ProgramKey], None] | None = None,
                    keys: Iterable[ProgramKey] | None = None, cache: ExecutableCache | None = None,
                    threads: int | None = None) -> float:
        """Compile every program of the grid (or just `keys`, for benchmarks) ahead of time, several at once.
        Returns the seconds.

        Why threads: XLA compiles (and loads a serialized executable) in C++ without the GIL, one program on one
        core, while the host's other cores idle; a TPU host's 13 cores took ~12 s per program one after another
        (docs/performance.md, "On a TPU v5e"). Tracing and lowering stay serialized by the GIL, a small share.

        Args:
          progress: optional callable(done, total, key) for start-up progress messages, in the order they finish.
          keys: a subset of `grid()` to compile instead of all of it.
          cache: load each program from it when stored there, else compile and store it (a restarted worker then
            skips tracing and lowering: `model_worker.engine.executables`).
          threads: programs compiled at once (default `compile_threads()`); 1 compiles them one after another.
        Raises:
          the first compile's exception (the programs not yet started are cancelled).
        """
        t0 = time.perf_counter()
        keys = self.grid() if keys is None else list(keys)
        threads = max(1, min(threads or compile_threads(), len(keys)))
        build = self._builder(cache)
        if threads == 1:
            for n, key in enumerate(keys):
                self._programs[key] = build(key)
                if progress:
                    progress(n + 1, len(keys), key)
            return time.perf_counter() - t0
        compiled: dict[ProgramKey, jax.stages.Compiled] = {}
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
            pending = {pool.submit(build, key): key for key in keys}
            try:
                for n, done in enumerate(concurrent.futures.as_completed(pending)):
                    compiled[pending[done]] = done.result()
                    if progress:
                        progress(n + 1, len(keys), pending[done])
            except BaseException:
                for f in pending:
                    f.cancel()
                raise
        for key in keys:  # the grid's order, whatever order they finished in
            self._programs[key] = compiled[key]
        return time.perf_counter() - t0

    def _builder(self, cache: ExecutableCache | None, defer: bool = False, child=None
                 ) -> Callable[[ProgramKey], jax.stages.Compiled]:
        """`_compile` for any thread, under the calling thread's JAX settings that shape a program
        (`jax.default_device`, a `jax.default_matmul_precision` block: thread-local), so a program does not
        depend on which thread compiled it; `defer`: the cache's stores wait for `store_deferred`; `child`: a
        (`CompileProcess`, device) pair that compiles each program instead (`_from_child`; its fingerprint is
        taken under the same settings)."""
        device, precision = jax.config.jax_default_device, jax.config.jax_default_matmul_precision

        def build(key: ProgramKey) -> jax.stages.Compiled:
            with contextlib.ExitStack() as scope:
                if device is not None:
                    scope.enter_context(jax.default_device(device))
                if precision is not None:
                    scope.enter_context(jax.default_matmul_precision(precision))
                if child is not None:
                    return self._from_child(key, cache, *child)
                return self._compile(key, cache, defer)

        return build

    def cached(self, keys: Iterable[ProgramKey], cache: ExecutableCache) -> list[ProgramKey]:
        """Those of `keys` that `cache` holds (a restart loads them in seconds: `compile_all` takes them first)."""
        return [key for key in keys if cache.has(self._fingerprint(key))]

    def serving_set(self) -> list[ProgramKey]:
        """The fewest programs that serve every request (`background_compile.serving_set`), in the grid."""
        grid = set(self.grid())
        return [k for k in serving_set(self.kv_buckets, self.ecfg.prefill_chunks, self.ecfg.num_slots) if k in grid]

    def compile_in_background(self, keys: Iterable[ProgramKey], cache: ExecutableCache | None = None,
                              threads: int | None = None,
                              on_compiled: Callable[[ProgramKey, bool], None] | None = None,
                              process: bool = False) -> BackgroundCompile:
        """Compile `keys` on background threads, most useful first (`background_compile.background_order`), while
        the loop's thread serves with the programs it has; each compiled program waits for `adopt_programs`.

        Args: as `compile_all`'s; on_compiled: called with (key, succeeded) after each (from a compiling thread);
        process: with a `cache`, have a child process compile and store them, the threads here only loading each
        (`compile_process`: the loop keeps the GIL); where no child can serve this engine, or for a program it
        fails, the threads compile it here.
        Returns: the running `BackgroundCompile` (its `pending`, `failed`, `done`, `stop`).
        """
        order = background_order(keys, self.kv_buckets[-1], self.ecfg.prefill_chunks)
        threads = threads or compile_threads()
        deliver = lambda key, compiled: self._arrivals.put((key, compiled))
        self._deferred_cache = cache
        child = None
        if process and cache is not None and order and self.mesh is None:
            device = jax.config.jax_default_device  # the device the programs run on, as `_builder` sees it
            device = jax.devices(device)[0] if isinstance(device, str) else device or jax.devices()[0]
            child = compile_process.start(self.cfg, self._abstract_state, [device], cache, threads)
        if child is None:
            return BackgroundCompile(self._builder(cache, defer=True), order, threads, deliver, on_compiled).start()
        log.info("compiling %d programs in a process of its own (pid %d)", len(order), child.pid)
        try:
            job = BackgroundCompile(self._builder(cache, defer=True, child=(child, device)), order, threads,
                                    deliver, on_compiled, lambda stopped: child.close(kill=stopped))
            job.process = child
            return job.start()
        except BaseException:
            child.close(kill=True)
            raise

    def _from_child(self, key: ProgramKey, cache: ExecutableCache, child: compile_process.CompileProcess,
                    device) -> jax.stages.Compiled:
        """`key` compiled and stored by `child`, loaded from `cache` onto `device`; a program the child does not
        deliver (it failed, it died, its entry does not load) is compiled here (`_compile`), unless the child was
        closed (the job stopped: `CompileProcessClosed` goes up)."""
        fp = self._fingerprint(key)
        try:
            child.compile(key, fp)
            compiled = cache.load(fp, [device])
            if compiled is not None:
                return compiled
            reason = "its stored program did not load"
        except compile_process.CompileProcessClosed:
            raise
        except compile_process.CompileProcessError as err:
            reason = str(err)
        if child.closed:
            raise compile_process.CompileProcessClosed(reason)
        log.warning("the compile process did not deliver %s (%s); compiling it in the worker", key, reason)
        return self._compile(key, cache, defer=True)

    def store_deferred(self, limit: int | None = 1) -> int:
        """Store up to `limit` (None: all) programs compiled in the background into the executable cache they
        came from; the loop calls it when it has no work (serializing holds the GIL: `ExecutableCache.get_or_compile`).
        Returns how many. Contract: `engine_api.Engine.store_deferred`."""
        return 0 if self._deferred_cache is None else self._deferred_cache.store_deferred(limit)

    def adopt_programs(self) -> list[ProgramKey]:
        """Take in the programs compiled in the background since the last call, each run once on padding first
        (a program's first run costs more: `warm_up`), so the next steps may use them. Call on the loop's thread,
        between steps (a run replaces the donated state). A program whose temporaries exceed `temp_budget` is
        dropped, with a warning (the engine serves with the programs it has). Returns the keys adopted."""
        adopted = []
        while True:
            try:
                key, compiled = self._arrivals.get_nowait()
            except queue.Empty:
                return adopted
            analysis = compiled.memory_analysis()
            temp = int(analysis.temp_size_in_bytes) if analysis is not None else 0
            if self.temp_budget is not None and temp > self.temp_budget:
                log.warning("program %s needs %d bytes of temporaries, beyond the %d left on the device: not used",
                            key, temp, self.temp_budget)
                continue
            self._programs[key] = compiled
            kind = PROGRAMS[key.kind]
            if kind.warm:
                jax.block_until_ready(self._run(key, *kind.example(key, self.cfg.vocab_size), count=False))
            adopted.append(key)

    def _compile(self, key: ProgramKey, cache: ExecutableCache | None, defer: bool = False) -> jax.stages.Compiled:
        """The compiled program of `key`: from `cache` when it holds it, else lowered, compiled and stored (or
        queued for `store_deferred`); `defer` (the background's compiles) also lowers one at a time
        (`background_compile.lowering`: the GIL-bound part, beside a serving loop)."""
        def lower() -> jax.stages.Lowered:
            with background_compile.lowering() if defer else contextlib.nullcontext():
                return self._lower(key)

        if cache is None:
            return lower().compile()
        devices = None if self.mesh is None else list(self.mesh.devices.flat)
        return cache.get_or_compile(self._fingerprint(key), lower, devices, defer)

    def _fingerprint(self, key: ProgramKey) -> str:
        """The executable cache's key of a program (`executables.fingerprint`), over `program_config(self.ecfg)`:
        a flag that changes only which programs the grid holds (chunks, buckets, drafts, the queue) leaves the
        programs both grids hold where they are in the cache."""
        kind = PROGRAMS[key.kind]
        return fingerprint(key, self.cfg, program_config(self.ecfg),
                           (*self._state(kind, abstract=True), *kind.example(key, self.cfg.vocab_size)))

    def warm_up(self) -> float:
        """Run every compiled forward program (compute, decode, mixed) once on all-padding inputs. Returns seconds.

        The first call of a compiled program costs much more than later ones on XLA CPU, which a fresh server would
        otherwise spend inside its first requests' steps (figures: docs/performance.md). Padding (position
        -1) writes nothing to the KV cache and records nothing in the penalty history, so the state is unchanged;
        `calls` does not count these runs.
        """
        t0 = time.perf_counter()
        for key in list(self._programs):
            kind = PROGRAMS[key.kind]
            if kind.warm:
                jax.block_until_ready(self._run(key, *kind.example(key, self.cfg.vocab_size), count=False))
        return time.perf_counter() - t0

    def prepare_ahead(self) -> None:
        """Compile what `dispatch_decode_after` needs beyond the grid (a reshape per batch bucket, milliseconds
        each): call before serving with async scheduling, so that no compile happens while serving."""
        if self.mesh is None:
            for batch in self.batch_buckets:
                _as_column(batch)

    def time_programs(self, budget: float = 1.0) -> list[tuple[ProgramKey, float]]:
        """Run the compiled forward programs once more each on all-padding inputs, timed, until `budget` seconds
        are spent (call after `warm_up`: a program's first run costs more than later ones): the kinds in turn
        (one program of each kind, then the next of each), each kind's cheapest first, so a short budget still
        covers every kind.
        Returns (key, seconds) pairs: the step-time model's first fit (model_worker/serving/step_model.py), so a fresh
        worker predicts its first steps instead of admitting first-come first-served. Changes no state, as
        `warm_up`."""
        def work(key: ProgramKey) -> int:
            return key.batch * max(key.chunk, 1) * key.kv_len

        by_kind: dict[str, list[ProgramKey]] = {}
        for k in sorted((k for k in self._programs if PROGRAMS[k.kind].warm), key=work):
            by_kind.setdefault(k.kind, []).append(k)
        order = [k for turn in itertools.zip_longest(*by_kind.values()) for k in turn if k is not None]
        timed: list[tuple[ProgramKey, float]] = []
        t0 = time.perf_counter()
        for key in order:
            if time.perf_counter() - t0 > budget:
                break
            kind = PROGRAMS[key.kind]
            inputs = kind.example(key, self.cfg.vocab_size)
            started = time.perf_counter()
            jax.block_until_ready(self._run(key, *inputs, count=False))
            timed.append((key, time.perf_counter() - started))
        return timed

    @property
    def num_programs(self) -> int:
        """Number of compiled programs."""
        return len(self._programs)

    def ready_programs(self) -> set[ProgramKey]:
        """The keys of the programs compiled (and adopted) so far."""
        return set(self._programs)

    def temp_bytes(self) -> int:
        """The largest step temporaries of the compiled programs, in bytes per device (XLA's
        `memory_analysis().temp_size_in_bytes`: buffers a step needs besides its arguments and results); 0
        before `compile_all`. For the worker's memory report (`model_worker.engine.memory`)."""
        analyses = (p.memory_analysis() for p in self._programs.values())
        return max((int(a.temp_size_in_bytes) for a in analyses if a is not None), default=0)

    def kv_bucket(self, length: int) -> int:
        """Smallest KV bucket of the grid holding `length` positions.

        Raises:
          ValueError: length exceeds max_model_len.
        """
        for b in self.kv_buckets:
            if length <= b:
                return b
        raise ValueError(f"{length} positions exceed max_model_len {self.ecfg.max_model_len}")

    def batch_bucket(self, rows: int) -> int:
        """Smallest decode batch bucket of the grid holding `rows` sequences."""
        return next(b for b in self.batch_buckets if rows <= b)

    # ----- which programs are ready -----------------------------------------------------------------------------
    # A worker serves once its serving set is compiled and adopts the rest as they arrive (`adopt_programs`), so
    # every choice below takes the cheapest program that is ready: the smallest batch bucket holding the rows,
    # then the smallest KV bucket holding the positions, the largest prompt chunk the tokens fill. Which one runs
    # changes no token (batch-invariant numerics: model_worker/engine/background_compile.py).
    def _has(self, key: ProgramKey) -> bool:
        """Whether `key` is ready to run; before anything is compiled every program of the grid counts (a fresh
        engine plans with what `compile_all` will give it)."""
        return key in self._programs or (not self._programs and key.kv_len in (0, *self.kv_buckets))

    def _ready_kv(self, kind: str, batch: int, chunk: int, length: int) -> int | None:
        """The smallest KV bucket >= `length` with a ready (kind, batch, chunk) program, or None."""
        return next((L for L in self.kv_buckets if L >= length and self._has(ProgramKey(kind, batch, chunk, L))),
                    None)

    def _ready_batch(self, kind: str, rows: int, chunk: int, length: int) -> tuple[int, int] | None:
        """(batch bucket, KV bucket) of the cheapest ready (kind, B, chunk, L) program for `rows` rows of up to
        `length` positions, preferring a batch whose sample program is ready too, or None."""
        for sampled in (True, False):
            for b in self.batch_buckets:
                if b >= rows and (not sampled or self._has(ProgramKey("sample", b, 0, 0))):
                    L = self._ready_kv(kind, b, chunk, length)
                    if L is not None:
                        return b, L
        return None

    def _verify_bucket(self, rows: int) -> int | None:
        """The smallest verify batch bucket holding `rows` whose verify and sampling programs are ready, or None."""
        T, largest = self.ecfg.max_draft_tokens + 1, self.kv_buckets[-1]
        return next((b for b in self.ecfg.verify_batches() if b >= rows
                     and self._has(ProgramKey("verify", b, T, largest)) and self._has(ProgramKey("vsample", b, T, 0))),
                    None)

    def can_verify(self, *, rows: int) -> bool:
        """Whether a verify step of `rows` rows can run now. Contract: `engine_api.Engine.can_verify`."""
        return self._verify_bucket(rows) is not None

    def chunk_size(self, remaining: int, start: int = 0) -> int:
        """Chunk length for `remaining` tokens from position `start`.

        CPU: the largest chunk they fill, else (the tail) the smallest that holds them, so only a prompt's last
        chunk is padded, by less than the smallest chunk: 600 tokens with chunks (64, 512) run as 512 + 64 + 64
        (40 pads), not 512 + 512 (424 pads). On CPU a chunk costs about the same per token at every size, so a
        padded token costs as much as a real one (figures: docs/performance.md). With `tail_chunks`, a tail runs
        in the cheapest mix of them and the smallest prefill chunk (`_tail_plan`): 130 tokens with (16, 32) and
        (64, 512) as 64 + 64 + 16, not 64 + 64 + 64. Other platforms: the smallest chunk that holds them, else
        the largest (an accelerator reads all weights per chunk and pads nearly for free, so fewer, larger chunks
        win; not measured here). Only chunks with a ready program count (a worker still compiling).
        """
        return self.chunk_plan(remaining, start=start)[0]

    def chunk_plan(self, remaining: int, beside_decode: bool = False, start: int = 0) -> tuple[int, ...]:
        """The chunk lengths `remaining` tokens from position `start` run in from here, one compute step each
        (`chunk_size` is the first): a prefill chunk they fill, or their tail's plan (`_tail_plan`; one chunk
        elsewhere than on CPU), among the chunks with a ready program. `beside_decode`: the step also decodes
        (`dispatch_mixed`), where a tail that would take more than one step runs as one mixed pass of
        `mixed_chunk` instead (its decode rows ride on the chunk's products, and the prompt does not wait a step
        more)."""
        ready = lambda c: self._ready_kv("compute", 1, c, start + min(c, remaining)) is not None
        chunks = sorted(c for c in self.ecfg.prefill_chunks if ready(c)) or sorted(self.ecfg.prefill_chunks)
        tails = tuple(sorted(c for c in self.ecfg.tail_chunks if ready(c)))
        filled = [c for c in chunks if c <= remaining]
        if filled and self._pad_only_tail:
            return (filled[-1],)
        if self._pad_only_tail and tails and remaining > 0:
            plan = _tail_plan(tails + (chunks[0],), remaining)
            return (self.mixed_chunk,) if beside_decode and len(plan) > 1 else plan
        return (next((c for c in chunks if c >= remaining), chunks[-1]),)

    # ----- running programs -----------------------------------------------------------------------------------
    def dispatch_compute(self, *, chunk: PromptChunk) -> tuple[Pending, int]:
        """Dispatch one chunk of a slot's pending tokens (asynchronously): the largest chunk size the tokens fill
        (`chunk_size`), in the smallest ready KV bucket holding them. Arguments, result and errors:
        `engine_api.Engine.dispatch_compute`."""
        size = self.chunk_size(len(chunk.token_ids), chunk.start)
        inputs, n = ChunkInputs.make(size, chunk.slot, list(chunk.token_ids), chunk.start, list(chunk.is_output),
                                     chunk.clear_penalties)
        self.kv_bucket(chunk.start + n)  # raises ValueError beyond max_model_len
        kv_len = self._ready_kv("compute", 1, size, chunk.start + n)
        if kv_len is None:
            raise KeyError(f"no compiled compute program of {size} tokens holds {chunk.start + n} positions")
        key = ProgramKey("compute", 1, size, kv_len)
        return Pending.of_chunk(inputs, chunk.slot, self._run(key, inputs)), n

    def dispatch_decode(self, *, batch: DecodeBatch) -> Pending:
        """Dispatch one decode step for the given slots (one token each), in the smallest ready batch bucket.
        Arguments, result and errors: `engine_api.Engine.dispatch_decode`."""
        length = max(batch.positions) + 1
        self.kv_bucket(length)  # raises ValueError beyond max_model_len
        found = self._ready_batch("decode", len(batch.slots), 1, length)
        if found is None:
            return self._decode_in_chunks(batch)
        d = self._decode_rows(batch, found[0])
        return d.pending(self._run(ProgramKey("decode", found[0], 1, found[1]), d.batch))

    def _decode_in_chunks(self, batch: DecodeBatch) -> Pending:
        """A decode step with no decode program ready yet (a worker serving with its serving set): each row's one
        token as a prompt chunk of its own (the smallest ready chunk; it records its token as a chunk does), the
        rows' logits gathered into one batch bucket whose sample program is ready. The same logits as a decode
        step's (batch-invariant numerics), a row at a time: slower, for the seconds until a decode program arrives.

        Raises:
          KeyError: no compute program holds a row's position, or no sample program the rows.
        """
        n = len(batch.slots)
        bucket = next((b for b in self.batch_buckets if b >= n and self._has(ProgramKey("sample", b, 0, 0))), None)
        if bucket is None:
            raise KeyError(f"no compiled decode or sample program holds {n} rows")
        logits = []
        for slot, token, pos, out in zip(batch.slots, batch.tokens, batch.positions, batch.is_output):
            pending, _ = self.dispatch_compute(chunk=PromptChunk(slot, [token], pos, [out], False))
            logits.append(pending.logits)
        d = self._decode_rows(batch, bucket)
        d.batch.positions[:] = -1  # each chunk recorded its own token
        padding = jnp.zeros((bucket - n, self.cfg.vocab_size), logits[0].dtype)
        return d.pending(jnp.concatenate(logits + [padding]))

    def dispatch_mixed(self, *, chunk: PromptChunk, batch: DecodeBatch) -> tuple[Pending, int, Pending]:
        """One chunk of a slot's pending tokens (as `dispatch_compute`) and a decode step of other slots (as
        `dispatch_decode`) in one forward pass when the chunk is `mixed_chunk` long and its "mixed" program is
        ready (the decode rows ride on the chunk's matrix products, the weights are read once); otherwise the two
        programs one after the other. Arguments, result and errors: `engine_api.Engine.dispatch_mixed`.
        """
        if chunk.slot in batch.slots:
            raise ValueError(f"slot {chunk.slot} cannot take a chunk and decode in the same step")
        size = self.chunk_plan(len(chunk.token_ids), beside_decode=True, start=chunk.start)[0]
        largest = self.kv_buckets[-1]
        found = self._ready_batch("mixed", len(batch.slots), size, largest) if size == self.mixed_chunk else None
        if found is None:
            pending, n = self.dispatch_compute(chunk=chunk)
            return pending, n, self.dispatch_decode(batch=batch)
        inputs, n = ChunkInputs.make(size, chunk.slot, list(chunk.token_ids), chunk.start, list(chunk.is_output),
                                     chunk.clear_penalties)
        self.kv_bucket(max(batch.positions) + 1)  # raises ValueError beyond max_model_len, as the others do
        self.kv_bucket(chunk.start + n)
        d = self._decode_rows(batch, found[0], exclude=chunk.slot)
        key = ProgramKey("mixed", found[0], size, largest)
        logits, d_logits = self._run(key, inputs, d.batch)
        return Pending.of_chunk(inputs, chunk.slot, logits), n, d.pending(d_logits)

    def step_programs(self, *, shape: StepShape) -> tuple[ProgramKey, ...]:
        """The forward programs a step of this shape runs, chosen as `dispatch_compute`, `dispatch_mixed`,
        `dispatch_decode` and `dispatch_verify` choose them (chunk size, batch and KV buckets, among the ready
        programs); lengths beyond the grid are clamped to its largest bucket; a prompt tail that runs in several
        tail chunks lists them all. Contract: `engine_api.Engine.step_programs`."""
        keys: list[ProgramKey] = []
        largest = self.kv_buckets[-1]
        rows = min(shape.rows, self.ecfg.num_slots)
        buckets = self.ecfg.verify_batches()
        verify = self._verify_bucket(min(rows, buckets[-1])) if rows and shape.draft_tokens and buckets else None
        if shape.chunk_tokens:
            start = max(0, shape.chunk_end - shape.chunk_tokens)
            plan = self.chunk_plan(shape.chunk_tokens, beside_decode=bool(rows and verify is None), start=start)
            mixed = (self._ready_batch("mixed", rows, plan[0], largest)
                     if rows and verify is None and plan[0] == self.mixed_chunk else None)
            if mixed is not None:
                keys.append(ProgramKey("mixed", mixed[0], plan[0], largest))
                rows = 0
            else:  # a tail planned as several chunks is priced whole (the latency-target admission plans with it)
                end = min(max(shape.chunk_end, shape.chunk_tokens), largest)
                keys += [ProgramKey("compute", 1, size, self._ready_kv("compute", 1, size, end) or largest)
                         for size in plan]
        if rows and verify is not None:
            keys.append(ProgramKey("verify", verify, self.ecfg.max_draft_tokens + 1, largest))
        elif rows:
            length = min(max(shape.longest, 1), largest)
            found = self._ready_batch("decode", rows, 1, length) or (self.batch_bucket(rows), largest)
            keys.append(ProgramKey("decode", found[0], 1, found[1]))
        return tuple(keys)

    def _decode_rows(self, decode: DecodeBatch, batch: int, exclude: int | None = None) -> _DecodeRows:
        """A decode batch padded to `batch` rows with idle slots (position -1: they write nothing and their
        outputs are ignored); `exclude` (a mixed step's chunk slot) only when no other slot is left."""
        slots, tokens, positions, is_output = decode.slots, decode.tokens, decode.positions, decode.is_output
        n = len(slots)
        idle = [s for s in range(self.ecfg.num_slots) if s not in set(slots) and s != exclude]
        idle = (idle + ([] if exclude is None else [exclude]))[: batch - n]
        row_slots = np.array(list(slots) + idle, np.int32)
        rows = idle_batch(batch, 1, row_slots)
        rows.tokens[:n, 0] = tokens
        rows.positions[:n, 0] = positions
        outs: np.ndarray = np.zeros((batch, 1), bool)
        outs[:n, 0] = is_output
        return _DecodeRows(rows, row_slots, outs, n)

    def sample(self, pending: Pending, *, sampling: SamplingArrays, clear_penalties: Sequence[bool],
               active: Sequence[bool]) -> HostOutput:
        """Sample the pending logits (blocks until the forward pass and the sampling are done): the `greedy`
        program when every real row is plain greedy, clears nothing and that program is ready, else the full
        `sample` program (which draws the same for such rows). Arguments and result: `engine_api.Engine.sample`."""
        return self.sample_async(pending, sampling=sampling, clear_penalties=clear_penalties, active=active).result()

    def sample_async(self, pending: Pending, *, sampling: SamplingArrays, clear_penalties: Sequence[bool],
                     active: Sequence[bool]) -> Sampled:
        """`sample` without waiting: the sample program dispatched, its outputs left on the device (`Sampled`;
        its `result()` is what `sample` returns). Contract: `engine_api.Engine.sample_async`."""
        n, B = pending.num_rows, pending.slots.shape[0]
        greedy = not any(clear_penalties[:n]) and is_plain_greedy(sampling, n)
        key = ProgramKey("greedy", B, 0, 0) if greedy and self._has(ProgramKey("greedy", B, 0, 0)) else \
            ProgramKey("sample", B, 0, 0)
        inputs = pending.sample_inputs(clear_penalties, active, sampling, self.cfg.vocab_size)
        return Sampled(self._run(key, inputs), np.asarray(pending.slots[:n]))

    def dispatch_decode_after(self, *, batch: DecodeBatch, previous: Sampled) -> Pending | None:
        """A decode step of the rows `previous` sampled (the same slots, in order), each taking its input token
        from `previous`'s outputs on the device, at `batch.positions` (`batch.tokens` is not read): dispatched
        before `previous`'s results reach the host, so that the host's work between steps overlaps the device's
        (vLLM's async scheduling). The same program, inputs and results as `dispatch_decode` given those tokens.

        Returns None (nothing dispatched) where that cannot be done: a position beyond max_model_len, no decode
        program ready in `previous`'s batch bucket (a worker still compiling decodes row by row), other slots than
        `previous`'s, or an engine split over several devices (whose programs take inputs placed as they say).
        Contract: `engine_api.Engine.dispatch_decode_after`."""
        B = previous.out.tokens.shape[0]
        length = max(batch.positions) + 1
        if self.mesh is not None or length > self.ecfg.max_model_len or list(batch.slots) != list(previous.slots):
            return None
        found = self._ready_batch("decode", len(batch.slots), 1, length)
        if found is None or found[0] != B:
            return None
        d = self._decode_rows(batch, B)
        d.batch = dataclasses.replace(d.batch, tokens=_as_column(B)(previous.out.tokens))
        return d.pending(self._run(ProgramKey("decode", B, 1, found[1]), d.batch))

    def dispatch_verify(self, *, batch: VerifyBatch) -> Pending:
        """Dispatch a verify step (asynchronously) in the smallest ready verify batch bucket holding its rows, rows
        padded with idle slots and each row's tokens with position -1. Arguments, result and errors:
        `engine_api.Engine.dispatch_verify`."""
        n, T = len(batch.slots), self.ecfg.max_draft_tokens + 1
        B = self._verify_bucket(n)
        if B is None or any(not 1 <= len(t) <= T for t in batch.tokens):
            buckets = self.ecfg.verify_batches()
            raise ValueError(f"a verify step takes 1 to {buckets[-1] if buckets else 0} rows of 1 to {T} tokens "
                             f"(with its programs compiled)")
        idle = [s for s in range(self.ecfg.num_slots) if s not in set(batch.slots)][: B - n]
        slots = np.array(list(batch.slots) + idle, np.int32)
        rows = dataclasses.replace(idle_batch(B, T, slots), logit_rows=None)
        outs: np.ndarray = np.zeros((B, T), bool)
        for r, (tokens, start) in enumerate(zip(batch.tokens, batch.positions)):
            self.kv_bucket(start + len(tokens))  # raises ValueError beyond max_model_len
            rows.tokens[r, : len(tokens)] = tokens
            rows.positions[r, : len(tokens)] = np.arange(start, start + len(tokens))
            outs[r, : len(tokens)] = True
            outs[r, 0] = batch.is_output[r]
        logits = self._run(ProgramKey("verify", B, T, self.kv_buckets[-1]), rows)
        return Pending(logits, slots, rows.tokens, rows.positions, outs, n)

    def sample_verify(self, pending: Pending, *, sampling: SamplingArrays, clear_penalties: Sequence[bool],
                      active: Sequence[bool]) -> VerifyOutput:
        """Sample a verify step: the `vgreedy` program when every real row is plain greedy, clears nothing and
        that program is ready, else `vsample`. Arguments and result: `engine_api.Engine.sample_verify`."""
        n = pending.num_rows
        greedy = not any(clear_penalties[:n]) and is_plain_greedy(sampling, n)
        B, T = pending.tokens.shape
        key = ProgramKey("vgreedy" if greedy and self._has(ProgramKey("vgreedy", B, T, 0)) else "vsample", B, T, 0)
        inputs = pending.sample_inputs(clear_penalties, active, _per_position(sampling, T), self.cfg.vocab_size)
        out = host_output(self._run(key, inputs), n)
        following = np.concatenate([pending.tokens[:n, 1:], np.full((n, 1), -1, np.int32)], axis=1)
        drafted = np.concatenate([pending.positions[:n, 1:] >= 0, np.zeros((n, 1), bool)], axis=1)
        accepted = np.cumprod((out.tokens == following) & drafted, axis=1).sum(axis=1)
        return VerifyOutput(out.tokens, out.logprobs, out.top_ids, out.top_logprobs, out.mask_empty,
                            (accepted + 1).astype(np.int32))

    # Convenience for tests and benchmarks: dispatch + sample in one call, positional arguments.
    def compute(self, slot: int, token_ids: Sequence[int], start: int, is_output: Sequence[bool],
                sampling: SamplingArrays, clear_penalties: bool) -> tuple[HostOutput, int]:
        """dispatch_compute + sample (all rows active)."""
        pending, n = self.dispatch_compute(chunk=PromptChunk(slot, token_ids, start, is_output, clear_penalties))
        return self.sample(pending, sampling=sampling, clear_penalties=[False], active=[True]), n

    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
               is_output: Sequence[bool], sampling: SamplingArrays,
               clear_penalties: Sequence[bool] | None = None) -> HostOutput:
        """dispatch_decode + sample (all rows active)."""
        pending = self.dispatch_decode(batch=DecodeBatch(slots, tokens, positions, is_output))
        return self.sample(pending, sampling=sampling, clear_penalties=clear_penalties or [False] * len(slots),
                           active=[True] * len(slots))

    def copy_slot(self, *, src: int, dst: int) -> None:
        """Copy one slot's KV cache rows and penalty history to another slot."""
        self._run(ProgramKey("copy", 1, 0, 0), CopyInputs(np.asarray(src, np.int32), np.asarray(dst, np.int32)))

    def weight_bytes(self) -> int:
        """Bytes of weights on the device (all devices together under tensor parallelism; per device:
        `sharding.per_device_bytes(engine.params)`)."""
        return self.params.nbytes()

    def kv_bytes(self) -> tuple[int, int]:
        """KV bytes (per token of context, per sequence), measured from the allocated arrays: full-attention
        layers grow with the context; sliding rings (window + slack) are a fixed per-sequence cost."""
        per_token = per_seq = 0
        arrays = zip(self.cache.k, self.cache.v, self.cache.k_scale, self.cache.v_scale)
        for i, group in enumerate(arrays):
            row_bytes = sum(a.nbytes for a in group if a is not None) // self.ecfg.num_slots
            if row_bytes == 0:
                continue
            if self.cfg.layers[i].attention == "full":
                per_token += row_bytes // self.ecfg.max_model_len
            else:
                per_seq += row_bytes
        return per_token, per_seq


def program_config(ecfg: EngineConfig) -> EngineConfig:
    """`ecfg` with the fields that decide only the grid or the scheduling at their defaults: what a compiled
    program is a function of beyond its key and abstract arguments. No program reads `prefill_chunks`,
    `tail_chunks`, `kv_bucket_factor` or `max_verify_batch` (they pick the keys), `max_draft_tokens` (a verify
    program's length is its key's chunk) or `max_waiting` (the queue); the rest shape the state (slots, lengths,
    dtypes, the ring's slack, the mesh) and stay."""
    return dataclasses.replace(ecfg, prefill_chunks=EngineConfig.prefill_chunks, tail_chunks=(),
                               kv_bucket_factor=EngineConfig.kv_bucket_factor, max_waiting=EngineConfig.max_waiting,
                               max_draft_tokens=0, max_verify_batch=EngineConfig.max_verify_batch)


#: A chunk's fixed cost in tokens' worth of its per-token cost (on CPU, 8 to 64-token chunks at position 1,000
#: of the embedded model took ~11 ms + ~1.4 ms per token: docs/performance.md, "Tail chunks").
CHUNK_FIXED_TOKENS = 8


@functools.lru_cache(maxsize=4096)
def _tail_plan(sizes: tuple[int, ...], remaining: int) -> tuple[int, ...]:
    """The chunks (largest first) that compute `remaining` tokens at the least cost, each chunk costing its
    length plus `CHUNK_FIXED_TOKENS` (a padded token costs as much as a real one), ties to fewer chunks: with
    sizes (16, 32, 64), 20 tokens -> (32,), 40 -> (32, 16), 60 -> (64,)."""
    best: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
    for r in range(1, remaining + 1):
        options = []
        for c in sizes:
            cost, rest = best[max(0, r - c)]
            options.append((cost + c + CHUNK_FIXED_TOKENS, len(rest) + 1, tuple(sorted((c, *rest), reverse=True))))
        cost, _, plan = min(options)
        best[r] = (cost, plan)
    return best[remaining][1]


def _abstract(leaf, sharding: bool):
    """A state leaf's shape, dtype and (with `sharding`) sharding as a `jax.ShapeDtypeStruct`; anything but a JAX
    array as it is."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding if sharding else None)
    return leaf


def _pad_rows(sampling: SamplingArrays, batch: int, vocab: int) -> SamplingArrays:
    """Extend `sampling` (n rows) to `batch` rows with greedy defaults (with a mask per position when it has)."""
    n = sampling.temperature.shape[0]
    if n == batch:
        return sampling
    pad = SamplingArrays.defaults(batch - n, vocab, sampling.mask.shape[1] if sampling.mask.ndim == 3 else 0)
    return jax.tree_util.tree_map(lambda a, b: np.concatenate([a, b]), sampling, pad)


def _per_position(sampling: SamplingArrays, positions: int) -> SamplingArrays:
    """A verify step's sampling with a mask per position ([n, T, W]): a row's one mask repeated, or its mask per
    position as given ([n, t, W], t <= T) with the last one repeated to T (positions past a row's drafts are
    never taken)."""
    mask, on = sampling.mask, sampling.mask_on
    if mask.ndim == 2:
        mask, on = mask[:, None], on[:, None]
    if mask.shape[1] < positions:
        extra = positions - mask.shape[1]
        mask = np.concatenate([mask, np.repeat(mask[:, -1:], extra, axis=1)], axis=1)
        on = np.concatenate([on, np.repeat(on[:, -1:], extra, axis=1)], axis=1)
    return dataclasses.replace(sampling, mask=mask[:, :positions], mask_on=on[:, :positions])


def enable_compilation_cache(path: str) -> None:
    """Persist compiled programs under `path` (JAX's persistent compilation cache), whatever their compile time."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
