"""The sampling settings of a batch's rows as the serving side fills them in (`SamplingArrays`: numpy on the host,
one row per sequence), the limits the API checks them against, and the packed token masks' layout.

Plain numpy, no JAX: the scheduler, the loop and the servicer (model_worker/serving, model_worker/server) name and
fill these without importing the model's numerics; `model_worker.modeling.sampling` registers `SamplingArrays` as
a pytree and samples from it inside the compiled programs (where its leaves are `jax.Array`s).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

Array = Any  # numpy on the host; a jax.Array inside a program (`model_worker.modeling.sampling`)

# Largest top_k accepted (lax.top_k needs a static k; validated at the API boundary).
MAX_TOP_K = 1024
# Most logit_bias entries per request (OpenAI's limit).
MAX_LOGIT_BIAS = 300
# Most alternatives returned per token (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


def mask_words(vocab: int) -> int:
    """Number of uint32 words of a packed token mask over `vocab` tokens: ceil(vocab / 32)."""
    return (vocab + 31) // 32


@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling settings; every leaf has the batch as its leading axis B.

    Attributes:
      temperature: float32 [B]; 0 means greedy.
      top_k: int32 [B]; 0 disables, otherwise 1..MAX_TOP_K.
      top_p: float32 [B] in (0, 1]; 1 disables.
      min_p: float32 [B] in [0, 1); 0 disables.
      seed: uint32 [B, 2] (low and high words of a 64-bit seed).
      step: int32 [B], index of the token being generated (0 = first generated token).
      presence_penalty: float32 [B]; 0 disables (OpenAI range -2..2).
      frequency_penalty: float32 [B]; 0 disables (OpenAI range -2..2).
      repetition_penalty: float32 [B]; 1 disables (values <= 0 are read as 1).
      bias_ids: int32 [B, MAX_LOGIT_BIAS]; token ids of the logit bias, -1 = unused entry (duplicates add up).
      bias_vals: float32 [B, MAX_LOGIT_BIAS]; added to the logit of bias_ids (OpenAI range -100..100).
      mask: uint32 [B, ceil(V / 32)]; allowed-token bitset: token 32 * w + b is allowed iff (mask[w] >> b) & 1
        (see `pack_mask`). Bits past V are ignored. [B, T, W] in a verify step's sampling (a mask per position).
      mask_on: bool [B] ([B, T] in a verify step's); False: the row is unconstrained and `mask` is ignored.
      top_logprobs: int32 [B] in 0..MAX_TOP_LOGPROBS; alternatives to return per token.
    """

    temperature: Array
    top_k: Array
    top_p: Array
    min_p: Array
    seed: Array
    step: Array
    presence_penalty: Array
    frequency_penalty: Array
    repetition_penalty: Array
    bias_ids: Array
    bias_vals: Array
    mask: Array
    mask_on: Array
    top_logprobs: Array

    @classmethod
    def defaults(cls, batch: int, vocab: int, positions: int = 0) -> SamplingArrays:
        """Greedy settings, every feature off, for `batch` rows over `vocab` tokens, as writable numpy arrays;
        `positions` > 0: a verify step's, with a mask per position (`mask` [B, T, W], `mask_on` [B, T]).

        Also the abstract shapes used for compilation. The mask words are all ones (everything allowed), so a
        row switched to mask_on without a mask written stays unconstrained.
        """
        per = (batch, positions) if positions else (batch,)
        return cls(
            temperature=np.zeros(batch, np.float32),
            top_k=np.zeros(batch, np.int32),
            top_p=np.ones(batch, np.float32),
            min_p=np.zeros(batch, np.float32),
            seed=np.zeros((batch, 2), np.uint32),
            step=np.zeros(batch, np.int32),
            presence_penalty=np.zeros(batch, np.float32),
            frequency_penalty=np.zeros(batch, np.float32),
            repetition_penalty=np.ones(batch, np.float32),
            bias_ids=np.full((batch, MAX_LOGIT_BIAS), -1, np.int32),
            bias_vals=np.zeros((batch, MAX_LOGIT_BIAS), np.float32),
            mask=np.full(per + (mask_words(vocab),), 0xFFFFFFFF, np.uint32),
            mask_on=np.zeros(per, bool),
            top_logprobs=np.zeros(batch, np.int32),
        )


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """Pack bool [V] (or [..., V]) allowed tokens into uint32 [ceil(V / 32)] (or [..., ceil(V / 32)]) words.

    Token 32 * w + b is allowed iff bit b (least significant first) of word w is set; bits past V are 0. The
    same layout as the protocol's `TokenMask.allowed` bytes read as little-endian uint32 words.
    """
    allowed = np.asarray(allowed, bool)
    vocab = allowed.shape[-1]
    padded = np.zeros(allowed.shape[:-1] + (mask_words(vocab) * 32,), bool)
    padded[..., :vocab] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view("<u4").astype(np.uint32)


def mask_words_from_bytes(allowed: bytes, vocab: int) -> np.ndarray:
    """The protocol's `TokenMask.allowed` (token i = byte i // 8, bit i % 8, LSB first) -> uint32 words.

    Missing trailing bytes count as disallowed tokens; bytes past the mask are ignored.

    Raises:
      ValueError: more bytes than ceil(vocab / 8).
    """
    if len(allowed) > (vocab + 7) // 8:
        raise ValueError(f"token mask has {len(allowed)} bytes, vocab {vocab} needs {(vocab + 7) // 8}")
    buf = np.zeros(mask_words(vocab) * 4, np.uint8)
    buf[: len(allowed)] = np.frombuffer(allowed, np.uint8)
    return buf.view("<u4").astype(np.uint32)
