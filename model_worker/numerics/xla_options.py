"""XLA options the worker (and the tests that run its programs in process) set before jax starts its backends:
`XLA_FLAGS` is read once, when the first backend starts, so these helpers import nothing from jax.

`INVARIANT_CPU_FLAGS`: XLA CPU's fusion emitters (its default code generator) emit a product and the add that
consumes it as one fused multiply-add (one rounding instead of two) inside a fusion, and which ops share a fusion
depends on the shapes of the program: a 1-row decode step and a 64-row prompt chunk then give the same row other
last bits (measured: the tiny Gemma 4 configs' chunk-vs-decode logits differ by ~2e-6 on an AMD EPYC Zen 4; the
layer scalar's product fused into the next layer's residual add). The classic emitters keep the products XLA
writes, and every batch-invariance test passes with them on the CPUs checked, at the same decode step time
(docs/performance.md). Only the CPU backend reads the flag; GPU and TPU workers are unaffected. The emitters
give other last bits, which bfloat16 products turn into bfloat16-sized differences (a logprob of the embedded
model moved by 0.02 against the fusion emitters' after 10 tokens): logits of the bfloat16 path are equal across
batch shapes, not across compilers.
"""

from __future__ import annotations

import os
import sys

INVARIANT_CPU_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def add_xla_flags(*flags: str) -> None:
    """Append each `--name=value` flag to `XLA_FLAGS` unless XLA_FLAGS already sets that name (the user's choice
    wins). No-op once jax is imported (its backends may have read the flags already)."""
    if "jax" in sys.modules:
        return
    current = os.environ.get("XLA_FLAGS", "")
    for flag in flags:
        if flag.split("=")[0] not in current:
            current = f"{current} {flag}".strip()
    os.environ["XLA_FLAGS"] = current
