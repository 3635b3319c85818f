"""Tiny random Gemma 4 checkpoints written by transformers itself (`Gemma4ForCausalLM.save_pretrained`).

Every parameter is drawn at random (norm weights around 1, layer scalars in [0.3, 1]) so that no feature can hide
behind an identity initialisation. Test-only (imports torch).
"""

from __future__ import annotations

import pathlib

S, F = "sliding_attention", "full_attention"

# KV sharing of both attention types (layers 5, 6 read 3 (sliding); 7 reads 4 (full)), PLE, double-wide MLPs on the
# shared layers, a sliding window (8) much shorter than the test prompts, final soft-capping.
SHARED = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8,
    layer_types=[S, F, S, S, F, S, S, F], num_kv_shared_layers=3, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=512, use_double_wide_mlp=True, final_logit_softcapping=30.0,
)
# attention_k_eq_v (as in 31B): full layers take V from the raw K projection, with their own KV-head count.
K_EQ_V = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, num_global_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8,
    layer_types=[S, S, F, S, S, F], attention_k_eq_v=True, num_kv_shared_layers=0,
    hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
)
CONFIGS = {"kv-shared-ple": SHARED, "k-eq-v": K_EQ_V}


def make_model(kwargs: dict, seed: int = 0):
    """A transformers Gemma4ForCausalLM (float32, eager attention) with every parameter randomised."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    config = Gemma4TextConfig(**kwargs, attn_implementation="eager")
    model = Gemma4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                # q and k are RMS-normalised and attention is unscaled (scale 1.0): weights ~0.4 keep the
                # scores O(1), so softmax does not saturate and amplify float32 rounding into large errors.
                p.copy_(0.4 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.3 + 0.7 * torch.rand(b.shape, generator=gen))
    return model


def write_checkpoint(kwargs: dict, out: pathlib.Path, seed: int = 0, dtype: str = "float32"):
    """Save a random tiny Gemma 4 with save_pretrained; returns the (float32) torch model."""
    import torch

    model = make_model(kwargs, seed)
    copy = make_model(kwargs, seed).to(getattr(torch, dtype)) if dtype != "float32" else model
    copy.save_pretrained(str(out))
    return model


def reference_logits(model, ids) -> "np.ndarray":
    """transformers' full-sequence logits [len(ids), V] (no cache), as float64 numpy."""
    import numpy as np
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray([ids], dtype=np.int64))).logits[0].double().numpy()


class Reference:
    """transformers in float64 (the "exact" answer) and float32 (whose distance to float64 measures how much
    float32 rounding this random model amplifies; our float32 error is judged against that)."""

    def __init__(self, model):
        import copy

        self.f32 = model
        self.f64 = copy.deepcopy(model).double()

    def logits(self, ids):
        """(float64 logits, float32 rounding noise = max |f32 - f64|) for a sequence."""
        import numpy as np

        exact = reference_logits(self.f64, ids)
        return exact, float(np.abs(reference_logits(self.f32, ids) - exact).max())
