"""The n-gram index behind draft tokens without a draft model (speculative decoding; docs/architecture.md,
"Speculative decoding"): the model worker drafts from a sequence's own tokens, its prediction and recent answers
(model_worker/serving/drafting.py); the gateway drafts for constrained requests, whose grammar it holds
(gateway/generation/generate.py, `ConstraintDriver`). Plain Python.

A sequence's next tokens are guessed as the continuation of the most recent earlier occurrence of its last few
tokens (prompt lookup / n-gram speculation, as vLLM's `ngram` proposer and llama.cpp's lookup decoding do).
"""

from __future__ import annotations

from collections.abc import Sequence

#: Longest and shortest n-gram looked up (tokens): longer matches first, down to NGRAM_MIN.
NGRAM_MAX = 4
NGRAM_MIN = 2

class NgramIndex:
    """For n in NGRAM_MIN..NGRAM_MAX, the index after the most recent occurrence of each n-gram of a token
    stream, so the continuation of any suffix is one dictionary lookup. Appending a token costs O(NGRAM_MAX)."""

    def __init__(self, tokens: Sequence[int] = ()):
        """Index `tokens` (appended in order)."""
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens. An n-gram is indexed once the token after it is known (so the stream's own suffix is
        never its own match)."""
        for token in tokens:
            end = len(self.tokens)  # the index `token` takes; the n-grams ending just before it are followed by it
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end >= n:
                    self._after[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def lookup(self, tail: Sequence[int], k: int) -> tuple[int, list[int]]:
        """The continuation (at most `k` tokens) of the longest n-gram ending `tail` that occurred in the stream:
        (n, tokens); (0, []) without a match."""
        for n in range(min(NGRAM_MAX, len(tail)), NGRAM_MIN - 1, -1):
            at = self._after.get(tuple(tail[len(tail) - n:]))
            if at is not None:
                return n, self.tokens[at:at + k]
        return 0, []
