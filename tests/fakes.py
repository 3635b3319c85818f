"""Test doubles whose output can be computed by hand (JetStream mock_engine style).

FakeEngine: the next token is always (previous token + 1) % vocab, so a prompt ending in t generates t+1, t+2, ...
It has the Engine interface the EngineLoop uses (ecfg, prefill, decode) and counts its calls.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np


@dataclasses.dataclass(frozen=True)
class FakeEngineConfig:
    num_slots: int = 2
    max_model_len: int = 64
    chunk: int = 4


class FakeEngine:
    """next = (last + 1) % vocab; prefill consumes at most `chunk` tokens per call."""

    def __init__(self, ecfg: FakeEngineConfig = FakeEngineConfig(), vocab: int = 1000, step_delay: float = 0.0):
        self.ecfg, self.vocab, self.step_delay = ecfg, vocab, step_delay
        self.calls = {"prefill": 0, "decode": 0}
        self.gate = threading.Event()
        self.gate.set()

    def prefill(self, slot, token_ids, start, sampling):
        self.gate.wait()
        self.calls["prefill"] += 1
        n = min(self.ecfg.chunk, len(token_ids))
        return (token_ids[n - 1] + 1) % self.vocab, -0.5, n

    def decode(self, tokens, positions, sampling):
        self.gate.wait()
        if self.step_delay:
            threading.Event().wait(self.step_delay)
        self.calls["decode"] += 1
        return (tokens + 1) % self.vocab, np.full(tokens.shape, -0.25, np.float32)
