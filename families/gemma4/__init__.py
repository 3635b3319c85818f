"""Gemma 4 (text decoder of E2B/E4B and the dense sizes, in bf16, compressed-tensors int4 and QAT q4_0 form).
Parts: `worker.py`, `tokenizer.py`, `gateway.py` (see `families`)."""

from common.families import Family

FAMILY = Family(
    name="gemma4",
    package="families.gemma4",
    hf_model_types=frozenset({"gemma4", "gemma4_text"}),
    hf_architectures=frozenset({"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"}),
    gguf_architectures=frozenset(),
)
