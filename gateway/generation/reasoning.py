"""Thought channels: split `<open>label ... <close>` into `reasoning_content`, the rest into `content`.

A family with a thought channel names its markers and label in its `ReasoningFormat` (gateway/core/tool_format.py);
Gemma 4's (families/gemma4/gateway.py, docs/formats.md §4.3 point 5) is `<|channel>`, the label `thought\\n`, the
reasoning, `<channel|>`, then the answer. The splitter works on token ids as they arrive (the channel markers are
control tokens, matched by the ids the served vocabulary gives them, never by text), so streamed and non-streamed
responses split identically: text before the open marker or after the close marker is content; text inside is
reasoning with the label removed.
"""

from __future__ import annotations

import copy

from gateway.generation.detokenizer import Utf8Decoder

LABEL = "thought\n"
"""Gemma 4's label, the default of `ReasoningSplitter(label=)`."""


class ReasoningSplitter:
    """Splits one generation's tokens into (reasoning, content) text deltas."""

    def __init__(self, token_bytes: list[bytes], special_ids: set[int], open_id: int, close_id: int,
                 label: str = LABEL):
        """Args: token_bytes/special_ids: the vocabulary (control tokens produce no text); open_id/close_id: the
        ids of the channel markers (Gemma 4's `<|channel>` and `<channel|>`); label: the text the model writes
        after the open marker, not reasoning."""
        self._bytes, self._special = token_bytes, special_ids
        self.open_id, self.close_id, self.label = open_id, close_id, label
        self.inside = False
        self._label = ""  # reasoning text held until we know whether it starts with the label
        self._decoders = {k: Utf8Decoder() for k in ("r", "c")}  # reasoning, content

    def push(self, token_id: int) -> tuple[str, str]:
        """Add one token; returns (reasoning delta, content delta)."""
        if token_id == self.open_id:
            self.inside, self._label = True, ""
            return "", ""
        if token_id == self.close_id:
            self.inside = False
            held, self._label = self._label, ""
            return (held if held and not self.label.startswith(held) else ""), ""
        if token_id in self._special:
            return "", ""
        if not self.inside:
            return "", self._decoders["c"].decode(self._bytes[token_id])
        text = self._decoders["r"].decode(self._bytes[token_id])
        if self._label is not None:
            self._label += text
            if self.label.startswith(self._label):
                return "", ""
            held, self._label = self._label, None
            return held.removeprefix(self.label), ""
        return text, ""

    def flush(self) -> tuple[str, str]:
        """End of generation: any held text (an incomplete trailing character is dropped, never U+FFFD:
        gateway/generation/detokenizer.py)."""
        reasoning = self._decoders["r"].flush()
        if self._label and not self.label.startswith(self._label):  # a bare (partial) label is not reasoning
            reasoning = self._label + reasoning
        return reasoning, self._decoders["c"].flush()


class ThoughtFirst:
    """A constraint that lets a thinking answer (Gemma 4's) open with its thought channel, free, then holds the rest
    of the answer to `inner` (a `gateway.structured.constraints.Constraint`: JSON schema or tool-call grammar).

    States: "start" - the next token is `<|channel>` (then "thinking") or any token `inner` allows (then
    "answer"); "thinking" - any token but the stop ids, until `<channel|>` (then "answer"); "answer" - `inner`
    decides. Same interface as Constraint: mask() -> bytes (bit i of byte i // 8 = token i allowed),
    forced() -> list[int], done() -> bool, advance(token_id).
    """

    def __init__(self, inner, vocab_size: int, open_id: int, close_id: int, stop_ids: list[int]):
        """Args: inner: the answer's constraint; vocab_size: mask width in tokens; open_id/close_id: the channel
        markers' ids; stop_ids: tokens not allowed inside the thought (the stop ids, which would end the turn,
        and any the caller bans there, e.g. the tool-call markers)."""
        self.inner, self.open_id, self.close_id = inner, open_id, close_id
        self.vocab_size = vocab_size
        self.state = "start"
        free = bytearray(b"\xff" * ((vocab_size + 7) // 8))
        if vocab_size % 8:
            free[-1] = (1 << (vocab_size % 8)) - 1
        for s in stop_ids:
            free[s >> 3] &= ~(1 << (s & 7)) & 0xFF
        free[open_id >> 3] &= ~(1 << (open_id & 7)) & 0xFF
        self._free = bytes(free)

    def mask(self) -> bytes:
        """The allowed-token bitset for the next token (see Constraint.mask)."""
        if self.state == "thinking":
            return self._free
        mask = self.inner.mask()
        if self.state == "start":
            mask = bytearray(mask)
            mask[self.open_id >> 3] |= 1 << (self.open_id & 7)
            return bytes(mask)
        return mask

    def forced(self) -> list[int]:
        """Forced tokens (only once the answer has started)."""
        return self.inner.forced() if self.state == "answer" else []

    def done(self) -> bool:
        """True when the answer's constraint is complete."""
        return self.state == "answer" and self.inner.done()

    def finished(self) -> bool:
        """True once the answer's constraint consumed a stop token."""
        return self.state == "answer" and self.inner.finished()

    def fork(self) -> ThoughtFirst:
        """An independent copy of the current state (see `Constraint.fork`)."""
        twin = copy.copy(self)
        twin.inner = self.inner.fork()
        return twin

    def advance(self, token_id: int) -> None:
        """Consume a generated token.

        Raises:
          ValueError (ConstraintError): a token the answer's constraint refuses.
        """
        if self.state == "start" and token_id == self.open_id:
            self.state = "thinking"
        elif self.state == "thinking":
            if token_id == self.close_id:
                self.state = "answer"
        else:
            self.state = "answer"
            self.inner.advance(token_id)
