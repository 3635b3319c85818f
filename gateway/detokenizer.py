"""Incremental detokenization from the vocabulary's bytes, and stop-string matching.

`IncrementalDetokenizer` turns a stream of token ids into text without ever emitting part of a UTF-8 character:
a byte-fallback token that starts a multi-byte character is held until the character completes (Python's
incremental UTF-8 decoder; a sequence that can never complete becomes U+FFFD, as `bytes.decode(errors="replace")`
would give). `StopMatcher` holds back just enough text to catch a stop string that straddles token boundaries,
so a stop string never leaks into the output.
"""

from __future__ import annotations

import codecs


class IncrementalDetokenizer:
    """Token ids -> text deltas for one sequence (mini-sglang detokenize.py keeps offsets; we keep a decoder)."""

    def __init__(self, token_bytes: list[bytes], special_ids: set[int], skip_special_tokens: bool = True):
        """Args: token_bytes: bytes of each token id; special_ids: control ids; skip_special_tokens: leave them out."""
        self._bytes = token_bytes
        self._skip = special_ids if skip_special_tokens else set()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that became complete (possibly empty)."""
        if token_id in self._skip:
            return ""
        return self._decoder.decode(self._bytes[token_id])

    def flush(self) -> str:
        """End of sequence: the text of any incomplete trailing bytes (U+FFFD), else ''."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds the earliest stop string in streamed text and withholds text that could still begin one."""

    def __init__(self, stops: list[str]):
        """Args: stops: non-empty stop strings."""
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buffer = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add text; returns the text that is now safe to emit. After a match, `stopped` is True and the match and
        everything after it are dropped."""
        if self.stopped:
            return ""
        self._buffer += text
        hits = [i for i in (self._buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._buffer = self._buffer[: min(hits)], ""
            return out
        cut = len(self._buffer) - self._hold
        if cut <= 0:
            return ""
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out

    def flush(self) -> str:
        """End of sequence: release the held-back text."""
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out
