"""Gemma 4 thinking: route `<|channel>thought\\n ... <channel|>` to `reasoning_content`, the rest to `content`.

Gemma 4 writes its reasoning in a channel before the answer (formats.md §4.3 point 5): `<|channel>` (id 100),
the label `thought\\n`, the reasoning, `<channel|>` (id 101), then the answer. The router works on token ids as
they arrive (the channel markers are control tokens, matched by id, never by text), so streamed and
non-streamed responses split identically: text before `<|channel>` or after `<channel|>` is content; text inside
is reasoning with the `thought\\n` label removed.
"""

from __future__ import annotations

import codecs

LABEL = "thought\n"


class ReasoningRouter:
    """Splits one generation's tokens into (reasoning, content) text deltas."""

    def __init__(self, token_bytes: list[bytes], special_ids: set[int], open_id: int, close_id: int):
        """Args: token_bytes/special_ids: the vocabulary (control tokens produce no text); open_id/close_id: the
        ids of `<|channel>` and `<channel|>`."""
        self._bytes, self._special = token_bytes, special_ids
        self.open_id, self.close_id = open_id, close_id
        self.inside = False
        self._label = ""  # reasoning text held until we know whether it starts with the label
        self._decoders = {k: codecs.getincrementaldecoder("utf-8")(errors="replace") for k in ("r", "c")}

    def push(self, token_id: int) -> tuple[str, str]:
        """Add one token; returns (reasoning delta, content delta)."""
        if token_id == self.open_id:
            self.inside, self._label = True, ""
            return "", ""
        if token_id == self.close_id:
            self.inside = False
            held, self._label = self._label, ""
            return (held if held and not LABEL.startswith(held) else ""), ""
        if token_id in self._special:
            return "", ""
        if not self.inside:
            return "", self._decoders["c"].decode(self._bytes[token_id])
        text = self._decoders["r"].decode(self._bytes[token_id])
        if self._label is not None:
            self._label += text
            if LABEL.startswith(self._label):
                return "", ""
            held, self._label = self._label, None
            return (held[len(LABEL):] if held.startswith(LABEL) else held), ""
        return text, ""

    def flush(self) -> tuple[str, str]:
        """End of generation: any held text."""
        reasoning = self._decoders["r"].decode(b"", final=True)
        if self._label:
            reasoning = self._label + reasoning
        return reasoning, self._decoders["c"].decode(b"", final=True)
