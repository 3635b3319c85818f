"""The exact tokens of recent answers, so a conversation sent back as chat messages renders token-for-token as
the model produced it.

Agents resend the whole conversation every turn, the model's earlier answers included. Re-tokenizing an answer's
text rarely gives back the same tokens (templates trim it; text can split differently), and then the new prompt
departs from the KV the worker kept right where the answer starts, so the answer is recomputed every turn. The
gateway remembers, for each answer it returned whole (no stop string cut it), the text -> token ids, and passes the
ids with any assistant message whose content is exactly that text (`ChatMessage.generated_token_ids`).
"""

from __future__ import annotations

import collections


class AnswerHistory:
    """An LRU map from answer text to the token ids the model generated for it."""

    def __init__(self, capacity: int = 4096):
        """Args: capacity: answers remembered (least recently used forgotten first)."""
        self.capacity = capacity
        self._map: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()

    def remember(self, text: str, token_ids: list[int]) -> None:
        """Record an answer returned in full."""
        if not text or not token_ids:
            return
        self._map[text] = tuple(token_ids)
        self._map.move_to_end(text)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def lookup(self, text: str) -> tuple[int, ...] | None:
        """The generated ids of an answer with exactly this text, or None."""
        ids = self._map.get(text)
        if ids is not None:
            self._map.move_to_end(text)
        return ids
