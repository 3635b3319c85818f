"""Checkpoints into weights: Hugging Face safetensors directories (`hf_loader`), compressed-tensors int4
(`ct_loader`), GGUF files (`gguf_convert`, `gguf_int8`: their blocks kept as int8). May import modeling (the config
and the weights' pytree) and numerics (the weight formats)."""
