"""The device side of the worker: weights, the KV cache, and a fixed grid of compiled programs.

Every program is one jitted `step` = forward + sample, with the KV cache donated (updated in place, never
copied per token). The grid is enumerated and compiled ahead of time at start-up (`Engine.compile_all`):

  * prefill: batch 1, chunk length C in `prefill_chunks`, KV length bucket L  -> ("prefill", C, L)
  * decode:  batch = all slots, one token per slot, KV length bucket L        -> ("decode", 1, L)

KV length buckets are powers of two from the sliding window up to max_model_len: a full-attention layer reads
only cache positions [0, L), so a short sequence pays for a short cache. Sampling settings, seeds, positions and
token ids are runtime arrays, so no request can trigger a compilation; a shape outside the grid is a bug and
raises KeyError instead of compiling silently. Compiled programs are kept in JAX's persistent compilation cache
(configured by `enable_compilation_cache`), so a restart reloads them from disk.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from model_worker.config import ModelConfig
from model_worker.kv_cache import KVCache
from model_worker.model import forward
from model_worker.params import Params
from model_worker.sampling import SamplingArrays, sample

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes.

    Attributes:
      num_slots: sequences decoded together (rows of the KV cache).
      max_model_len: context limit in tokens (prompt + generated); the full-attention cache length.
      prefill_chunks: prefill chunk lengths; a prompt is cut into chunks of the largest size, its tail padded to
        the smallest chunk that holds it.
      dtype: weights, activations and KV cache dtype ("float32" or "bfloat16").
    """

    num_slots: int = 4
    max_model_len: int = 8192
    prefill_chunks: tuple[int, ...] = (64, 512)
    dtype: str = "float32"

    def kv_buckets(self, window: int) -> tuple[int, ...]:
        """KV length buckets: powers of two from max(window, smallest chunk) up to max_model_len (always included)."""
        buckets, b = [], max(window, min(self.prefill_chunks))
        while b < self.max_model_len:
            buckets.append(b)
            b *= 2
        return tuple(buckets) + (self.max_model_len,)


def _step(params, cache, tokens, positions, slots, logit_rows, sampling, *, cfg, kv_len):
    """forward + sample. Returns (tokens [B] int32, logprobs [B] float32, cache)."""
    logits, cache = forward(params, tokens, positions, cache, slots, cfg, kv_len, logit_rows)
    next_tokens, logprobs = sample(logits, sampling)
    return next_tokens, logprobs, cache


def default_sampling(batch: int) -> SamplingArrays:
    """Greedy settings for `batch` rows (also the abstract shapes used for compilation)."""
    return SamplingArrays(
        temperature=np.zeros(batch, np.float32),
        top_k=np.zeros(batch, np.int32),
        top_p=np.ones(batch, np.float32),
        min_p=np.zeros(batch, np.float32),
        seed=np.zeros((batch, 2), np.uint32),
        step=np.zeros(batch, np.int32),
    )


class Engine:
    """Owns the weights, the KV cache and the compiled programs. Not thread-safe: one loop thread drives it."""

    def __init__(self, cfg: ModelConfig, params: Params, ecfg: EngineConfig):
        """Allocate the KV cache for `ecfg.num_slots` sequences of `ecfg.max_model_len` tokens.

        Raises:
          ValueError: max_model_len exceeds the model's max_position_embeddings, or a chunk exceeds max_model_len.
        """
        if ecfg.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {ecfg.max_model_len} exceeds the model's context of {cfg.max_position_embeddings}"
            )
        if max(ecfg.prefill_chunks) > ecfg.max_model_len:
            raise ValueError(f"prefill chunk {max(ecfg.prefill_chunks)} exceeds max_model_len {ecfg.max_model_len}")
        self.cfg, self.ecfg, self.params = cfg, ecfg, params
        self.dtype = jnp.dtype(ecfg.dtype)
        self.cache = KVCache.zeros(cfg, ecfg.num_slots, ecfg.max_model_len, self.dtype)
        self.kv_buckets = ecfg.kv_buckets(cfg.sliding_window)
        self._programs: dict[tuple[str, int, int], jax.stages.Compiled] = {}

    # ----- the grid -------------------------------------------------------------------------------------------
    def grid(self) -> list[tuple[str, int, int]]:
        """Every program key: ("prefill", chunk, kv_len) and ("decode", 1, kv_len)."""
        keys = [("prefill", c, L) for c in self.ecfg.prefill_chunks for L in self.kv_buckets]
        return keys + [("decode", 1, L) for L in self.kv_buckets]

    def _example_args(self, kind: str, chunk: int):
        batch = 1 if kind == "prefill" else self.ecfg.num_slots
        tokens = np.zeros((batch, chunk), np.int32)
        positions = np.full((batch, chunk), -1, np.int32)
        slots = np.zeros(1, np.int32) if kind == "prefill" else None
        rows = np.zeros(batch, np.int32)
        return tokens, positions, slots, rows, default_sampling(batch)

    def compile_all(self, progress=None) -> float:
        """Compile every program of the grid (ahead of time). Returns the seconds spent.

        Args:
          progress: optional callable(done, total, key) for start-up progress messages.
        """
        t0 = time.perf_counter()
        keys = self.grid()
        for n, key in enumerate(keys):
            kind, chunk, kv_len = key
            fn = jax.jit(
                functools.partial(_step, cfg=self.cfg, kv_len=kv_len), donate_argnames=("cache",)
            )
            self._programs[key] = fn.lower(self.params, self.cache, *self._example_args(kind, chunk)).compile()
            if progress:
                progress(n + 1, len(keys), key)
        return time.perf_counter() - t0

    @property
    def num_programs(self) -> int:
        """Number of compiled programs."""
        return len(self._programs)

    def kv_bucket(self, length: int) -> int:
        """Smallest KV bucket holding `length` positions.

        Raises:
          ValueError: length exceeds max_model_len.
        """
        for b in self.kv_buckets:
            if length <= b:
                return b
        raise ValueError(f"{length} positions exceed max_model_len {self.ecfg.max_model_len}")

    def chunk_size(self, remaining: int) -> int:
        """Chunk length for a prompt with `remaining` uncomputed tokens: the smallest that holds them, else the largest."""
        for c in sorted(self.ecfg.prefill_chunks):
            if remaining <= c:
                return c
        return max(self.ecfg.prefill_chunks)

    # ----- running programs -----------------------------------------------------------------------------------
    def _run(self, key, tokens, positions, slots, rows, sampling) -> tuple[np.ndarray, np.ndarray]:
        program = self._programs[key]
        next_tokens, logprobs, self.cache = program(self.params, self.cache, tokens, positions, slots, rows, sampling)
        return np.asarray(next_tokens), np.asarray(logprobs)

    def prefill(
        self, slot: int, token_ids: list[int], start: int, sampling: SamplingArrays
    ) -> tuple[int, float, int]:
        """Compute one prefill chunk of a sequence in `slot`, starting at position `start`.

        Args:
          slot: cache row.
          token_ids: the prompt tokens still to compute, from position `start` on (only the first chunk's worth
            is used).
          start: position of token_ids[0]; positions < start must already be in the cache.
          sampling: batch-1 settings used if this chunk ends the prompt.
        Returns:
          (sampled token, its logprob, number of tokens consumed). The token is meaningful only when the chunk
          consumed all of token_ids.
        """
        chunk = self.chunk_size(len(token_ids))
        n = min(chunk, len(token_ids))
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :n] = token_ids[:n]
        positions = np.full((1, chunk), -1, np.int32)
        positions[0, :n] = np.arange(start, start + n)
        key = ("prefill", chunk, self.kv_bucket(start + n))
        tok, lp = self._run(key, tokens, positions, np.array([slot], np.int32), np.array([n - 1], np.int32), sampling)
        return int(tok[0]), float(lp[0]), n

    def decode(self, tokens: np.ndarray, positions: np.ndarray, sampling: SamplingArrays) -> tuple[np.ndarray, np.ndarray]:
        """One decode step over all slots.

        Args:
          tokens: [S] int32 last token of each slot (ignored where positions is -1).
          positions: [S] int32 position of that token, -1 for idle slots (they write nothing).
          sampling: [S]-row settings.
        Returns:
          (next tokens [S] int32, logprobs [S] float32).
        """
        kv_len = self.kv_bucket(int(positions.max()) + 1)
        S = self.ecfg.num_slots
        return self._run(
            ("decode", 1, kv_len), tokens.reshape(S, 1), positions.reshape(S, 1), None, np.zeros(S, np.int32), sampling
        )

    def weight_bytes(self) -> int:
        """Bytes of weights on the device."""
        return self.params.nbytes()

    def kv_bytes(self) -> tuple[int, int]:
        """KV bytes (per token of context, per sequence) of the allocated layout."""
        return self.cfg.kv_bytes(self.dtype.itemsize)


def enable_compilation_cache(path: str) -> None:
    """Persist compiled programs under `path` (JAX's persistent compilation cache), whatever their compile time."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
