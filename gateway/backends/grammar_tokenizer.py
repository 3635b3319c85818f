"""The llguidance tokenizer of the served vocabulary, which every grammar of the structured room is compiled
against: built once per vocabulary (a costly build that holds the GIL throughout; figures: docs/performance.md),
before the model facts are published or while the worker still compiles, and rebuilt only when the vocabulary
changes. Owned by `Backends` (clients.py)."""

from __future__ import annotations

import asyncio


class GrammarTokenizer:
    """The built tokenizer and the inputs it was built for."""

    def __init__(self):
        self.built = None  # the llguidance.LLTokenizer, None until the first build
        self._key: tuple | None = None  # (tokenizer JSON, vocabulary size, eos) it was built for
        self._lock = asyncio.Lock()

    async def build(self, tokenizer_json: str, vocab_size: int, eos_id: int) -> None:
        """Build it (on a thread) unless the one held was built for the same inputs. Its EOS is the tokenizer's
        eos only: other stop ids (end of turn, `<|tool_response>`) are handled by the constraint, and tool
        grammars reference them as tokens.

        Raises:
          ValueError: an unreadable tokenizer JSON or a vocabulary larger than `vocab_size`
            (gateway/structured/constraints.py `build_tokenizer`).
        """
        from gateway.structured.constraints import build_tokenizer

        key = (tokenizer_json, vocab_size, eos_id)
        async with self._lock:
            if self.built is None or self._key != key:
                self.built = await asyncio.to_thread(build_tokenizer, tokenizer_json, vocab_size, [eos_id])
                self._key = key
