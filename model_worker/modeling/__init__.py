"""The model as pure functions over pytrees and a static config: `model.forward(params, ..., cfg) -> (logits,
cache)`, attention (XLA and the batch-invariant blocked loop), the decoder's layers, the config, the KV cache, the
weights' pytree (`params`) and sampling (`sampling`: the sample programs' bodies). May import numerics and the
serving room's records (`serving.sampling_settings`); never the engine or the server."""
