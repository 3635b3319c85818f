"""The model worker: owns the accelerator, the weights and the batched KV state; serves Prefill/Decode over gRPC.

Rooms, from the top down (an import points only down this list; `tests/test_layers.py` holds it):

  server/       the process: flags, model loading and start-up (`main`), the gRPC servicer (`service`), metrics.
  engine/       the JAX engine: weights, KV cache and the compiled program grid (`engine`, `programs`), compiled in
                the background while serving (`background_compile`), the executable cache, memory sizing,
                tensor-parallel layouts. Implements the serving room's engine contract.
  checkpoints/  reading checkpoints into weights: Hugging Face safetensors, compressed-tensors int4, GGUF.
  modeling/     the model as pure functions: `forward(params, ..., cfg) -> (logits, cache)`, attention, layers, the
                config, the KV cache, the weights' pytree (`params`) and sampling.
  numerics/     products and sums with their guarantees: bf16 / int8 / int4 linear layers, the block-int8 CPU
                kernel through `jax.ffi` (with `kernels/`), fixed-order sums, XLA flags.
  serving/      no JAX: the engine contract (`engine_api`), the scheduler, the engine loop, sequences, the prefix
                cache, drafting, latency targets and the step-time model, and the sampling settings' record.
"""
