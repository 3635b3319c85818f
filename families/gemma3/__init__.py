"""Gemma 3 (text): the embedded 270M GGUF and Hugging Face Gemma 3 checkpoints' names. Parts: `worker.py`,
`tokenizer.py`, `gateway.py` (see `families`)."""

from common.families import Family

FAMILY = Family(
    name="gemma3",
    package="families.gemma3",
    hf_model_types=frozenset({"gemma3", "gemma3_text"}),
    hf_architectures=frozenset({"Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"}),
    gguf_architectures=frozenset({"gemma3"}),
)
