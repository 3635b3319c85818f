"""Products and sums with stated guarantees: bf16, int8 and int4 linear layers (`quant`), the block-int8 product
and its CPU kernel through `jax.ffi` (`q8`, sources in `kernels/`, a bit-identical JAX twin beside it), sums in one
fixed order (`fixed_order`), the model's transcendentals made accurate at float32 "highest" precision
(`elementwise`), decode attention for a ragged batch as a Pallas kernel for TPU (`decode_attention`), the XLA
flags that keep CPU numerics batch-invariant (`xla_options`). Imports no other room but serving's records."""
