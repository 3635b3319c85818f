"""Serving without JAX: the engine contract (`engine_api`), the plain-Python scheduler (`scheduler`), the engine
loop that drives any engine through the contract (`loop`), sequences and their events (`sequence`), the prefix
cache and session leases (`prefix_cache`), drafting (`drafting`), latency targets (`slo`) and the step-time model
(`step_model`), and the sampling settings' record (`sampling_settings`). Imports no other room and no JAX
(`tests/test_layers.py`), so the scheduling logic is tested against a fake engine in milliseconds."""
