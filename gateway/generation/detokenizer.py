"""Incremental detokenization from the vocabulary's bytes, and stop-string matching.

UTF-8 at every boundary (`Utf8Decoder`, which every text path of the gateway uses: the generated text, chat
content, Gemma 4 reasoning, tool-call arguments and logprob token strings):
- a character split across tokens comes out whole with the token that completes it (the tokens before it give "");
- bytes that can never become valid UTF-8 become U+FFFD as soon as that is known, one per maximal invalid
  subpart, as `bytes.decode(errors="replace")` gives;
- an incomplete character at the end of a generation (cut by `max_tokens`, a stop string, an abort, a stop token)
  is dropped: it was cut by us, not written invalid by the model, and a U+FFFD there would be text the model
  never wrote (its raw bytes stay in the logprobs' `bytes`);
- a prompt given as token ids may end inside a character (byte-fallback tokens): the decoder is primed with the
  prompt's dangling bytes, so an answer that completes the character emits it whole (and nothing else of the
  prompt); an answer that does not continue it drops those bytes silently (they belong to the prompt).
Control tokens are never part of a character: skipped ones are invisible, kept ones are ASCII text.

`StopMatcher` holds back just enough text to catch a stop string that straddles token boundaries, so a stop string
never leaks into the output.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


def dangling(data: bytes) -> int:
    """How many bytes at the end of `data` begin a character that more bytes could still complete (0-3).

    Bytes that are already invalid (a surrogate's `ED A0`, an overlong `E0 80`) are not dangling: no continuation
    can make them valid."""
    for k in range(1, min(3, len(data)) + 1):
        byte = data[-k]
        if byte < 0x80:
            return 0
        if byte >= 0xC0:  # the last lead byte
            try:
                data[-k:].decode("utf-8")
            except UnicodeDecodeError as err:
                return k if err.reason == "unexpected end of data" and err.start == 0 else 0
            return 0
    return 0


def prompt_tail(token_bytes: Sequence[bytes], special_ids: set[int], prompt_ids: Sequence[int]) -> bytes:
    """At least the last 4 bytes of a prompt's text (fewer if it is shorter), control tokens passed over: enough
    to find its dangling bytes (`dangling`)."""
    tail, i = b"", len(prompt_ids)
    while i > 0 and len(tail) < 4:
        i -= 1
        if prompt_ids[i] not in special_ids:
            tail = token_bytes[prompt_ids[i]] + tail
    return tail


def _char_length(lead: int) -> int:
    return 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


class Utf8Decoder:
    """Bytes -> text, incrementally, under the rules of the module docstring (whole characters only, U+FFFD only
    for bytes that can never be valid, an incomplete tail dropped at `flush`, optional priming with the bytes
    before the stream)."""

    def __init__(self):
        """A decoder with nothing held."""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._open = b""  # primed bytes + stream bytes of the character that spans the boundary
        self._primed = 0  # how many bytes of `_open` came before the stream

    def prime(self, before: bytes) -> None:
        """Start a stream that follows `before` (e.g. the prompt's bytes; only its last 3 matter): its dangling
        bytes, if any, are held for the stream's first bytes to complete."""
        k = dangling(before)
        self._decoder.reset()
        self._open, self._primed = (before[-k:], k) if k else (b"", 0)

    def decode(self, data: bytes) -> str:
        """Add bytes; returns the text they complete (possibly '')."""
        if self._open:
            data = self._across(data)
        text = self._decoder.decode(data)
        held = self._decoder.getstate()[0]
        if held and dangling(held) < len(held):  # held by Python's decoder but already invalid (ED A0)
            self._decoder.reset()
            text += held.decode("utf-8", errors="replace")
        return text

    def peek(self, data: bytes) -> str:
        """What `decode(data)` would return now, leaving the decoder unchanged."""
        state, opened = self._decoder.getstate(), (self._open, self._primed)
        try:
            return self.decode(data)
        finally:
            self._decoder.setstate(state)
            self._open, self._primed = opened

    def flush(self) -> str:
        """End of the stream: drop an incomplete trailing character. Returns '' (invalid bytes were already
        replaced when they arrived, so nothing else can be held)."""
        self._decoder.reset()
        self._open, self._primed = b"", 0
        return ""

    def _across(self, data: bytes) -> bytes:
        """The bytes to decode now while a primed character is open: the whole character (with the bytes after
        it) once complete; nothing while it stays a valid prefix; the stream's own bytes, primed ones dropped,
        once the stream does not continue it."""
        buf = self._open + data
        n = _char_length(buf[0])
        if len(buf) < n:
            if dangling(buf) == len(buf):
                self._open = buf
                return b""
        else:
            try:
                buf[:n].decode("utf-8")
                self._open, self._primed = b"", 0
                return buf
            except UnicodeDecodeError:
                pass
        own, self._open, self._primed = buf[self._primed:], b"", 0
        return own


class IncrementalDetokenizer:
    """Token ids -> text deltas for one sequence (mini-sglang detokenize.py keeps offsets; we keep a decoder)."""

    def __init__(self, token_bytes: list[bytes], special_ids: set[int], skip_special_tokens: bool = True):
        """Args: token_bytes: bytes of each token id; special_ids: control ids; skip_special_tokens: leave them out."""
        self._bytes = token_bytes
        self._special = special_ids
        self._skip = special_ids if skip_special_tokens else set()
        self._text = Utf8Decoder()

    def prime(self, prompt_ids: Sequence[int]) -> None:
        """Continue after a prompt: hold the prompt's dangling bytes (a prompt given as token ids may end inside
        a character) for the first generated tokens to complete. Control tokens in the prompt carry no
        character bytes and are passed over. Only the last few tokens are read."""
        self._text.prime(prompt_tail(self._bytes, self._special, prompt_ids))

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that became complete (possibly empty)."""
        if token_id in self._skip:
            return ""
        return self._text.decode(self._bytes[token_id])

    def peek(self, token_id: int) -> str:
        """What `push(token_id)` would return now, leaving the state unchanged (for logprob alternatives)."""
        if token_id in self._skip:
            return ""
        return self._text.peek(self._bytes[token_id])

    def flush(self) -> str:
        """End of sequence: drops an incomplete trailing character; returns '' (see `Utf8Decoder.flush`)."""
        return self._text.flush()


class StopMatcher:
    """Finds the earliest stop string in streamed text and withholds text that could still begin one."""

    def __init__(self, stops: list[str]):
        """Args: stops: non-empty stop strings."""
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that matched (the earliest in the text)

    def push(self, text: str) -> str:
        """Add text; returns the text that is now safe to emit. After a match, `stopped` is True and the match and
        everything after it are dropped."""
        if self.stopped:
            return ""
        self._buffer += text
        hits = [(i, n) for n, i in enumerate(self._buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            at, which = min(hits)
            self.stopped, self.matched = True, self._stops[which]
            out, self._buffer = self._buffer[:at], ""
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
