"""Constrained decoding for OpenAI `response_format`: JSON answers that always parse and validate.

OpenAI's Chat Completions API takes `response_format` = `{"type": "text"}` | `{"type": "json_object"}` |
`{"type": "json_schema", "json_schema": {"name", "description"?, "schema", "strict"?}}` (docs/formats.md §5;
openai-python `src/openai/types/shared_params/response_format_json_schema.py`). The two JSON kinds become a
token-level constraint that the decode loop applies at every step:

    tok = build_tokenizer(tokenizer_json, vocab_size, eos_ids=[1, 106])     # once per process (costly)
    grammar = grammar_for_json_schema(schema)                               # raises SchemaError; cached (LRU)
    c = Constraint(tok, grammar, vocab_size, stop_ids=[1, 106])             # one per request (cheap)
    while not c.done():
        run = c.forced()                      # tokens the grammar forces: feed them without sampling
        ...  or  sample with c.mask() ...     # the allowed-token bitset for the next position
        c.advance(token)
    # then sample/append a stop id (the mask allows exactly the stop ids once done())

The engine is llguidance (`guidance-ai/llguidance`, Python API `llguidance/_lib.pyi`: LLTokenizer, LLMatcher,
grammar_from_json_schema, validate_grammar, compute_ff_tokens, try_consume_tokens, is_accepting, is_stopped).
The LLTokenizer build is the only costly step, so it happens once per process; a schema compile is cached, a
per-request matcher is a `deep_copy` of a cached template, and a next-token bitmask is cheap enough for every
decode step (figures: docs/performance.md; tests/gateway/test_constraints.py reports them).

The work is split in three modules along its seams:
- gateway/structured/schema_check.py: the fail-closed keyword policy (`SUPPORTED_KEYWORDS`, `REJECTED_KEYWORDS`, ...),
  `SchemaError`, and the rewrite every schema gets before it is compiled; the departures from JSON Schema
  semantics this implies.
- gateway/structured/grammar_cache.py: compiling with llguidance (options, budgets), the grammar and matcher-template
  caches, and the entry points (`grammar_for_response_format`, `grammar_for_json_schema`, `check_schema`, ...);
  the departures due to llguidance's options (one-line output, property order).
- this module: the llguidance tokenizer (`build_tokenizer`) and the per-request matcher (`Constraint`,
  `ConstraintError`), which the families' tool grammars (families/<name>/gateway.py) use too.
Each name has one home: import it from the module that defines it.
"""

from __future__ import annotations

import copy
import sys

import llguidance
import numpy as np

from gateway.structured.endings import grammar_specials
from gateway.structured.grammar_cache import matcher_template


class ConstraintError(ValueError):
    """A token the constraint does not allow (or a matcher in an error state)."""


# ------------------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------------------


def build_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """Build llguidance's tokenizer (token trie + mask slices) from a HF `tokenizer.json` *string*.

    Costly in time and memory for Gemma's 262,144 tokens, so the caller builds it once per process and shares it
    across requests (it is immutable and thread-safe) (figures: docs/performance.md).

    Args:
      tokenizer_json: the contents of tokenizer.json (not a path).
      vocab_size: the model's vocabulary size (logits width); may exceed the tokenizer's own size (the extra
        ids are never allowed). Masks of Constraints built on it have ceil(vocab_size / 8) bytes.
      eos_ids: the model's stop tokens (e.g. Gemma: [1 <eos>, 106 <end_of_turn>]). llguidance allows these
        once the grammar is complete. Must be given: llguidance's own guess for Gemma's tokenizer.json is
        wrong (212).

    Raises:
      ValueError: vocab_size smaller than the tokenizer's vocabulary, empty eos_ids, or an unreadable
        tokenizer.
    """
    if not eos_ids:
        raise ValueError("eos_ids must name at least one stop token")
    try:
        tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=int(vocab_size),
                                     eos_token=[int(i) for i in eos_ids])
    except Exception as e:  # llguidance raises ValueError/RuntimeError with its own text
        raise ValueError(f"cannot build the grammar tokenizer: {e}") from e
    return tok


# ------------------------------------------------------------------------------------------------------------
# Per-request constraint
# ------------------------------------------------------------------------------------------------------------


def _matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A fresh matcher for one request: a deep_copy of the cached template; ConstraintError if it is broken."""
    template = matcher_template(tokenizer, grammar)
    if template.is_error():
        raise ConstraintError(f"the grammar does not compile: {_first_line(template.get_error())}")
    return template.deep_copy()


def _first_line(error: str) -> str:
    """llguidance's error, first line only (later lines describe parser state)."""
    lines = error.strip().splitlines()
    return lines[0][:400] if lines else "unknown error"


class Constraint:
    """The grammar state of one request: which token may come next, consuming the tokens that did.

    Built from a shared LLTokenizer (build_tokenizer) and a grammar string (grammar_for_json_schema /
    grammar_for_json_object). Not thread-safe: one request, one decode loop.

    Stop tokens: once the value is complete (`done()`), the mask allows exactly `stop_ids`, so generation ends
    right after the top-level value. Where the value *may* end but could also continue (a top-level number,
    say) the mask allows the stop ids as well as the continuations. A stop token is consumed by `advance()`
    like any other; afterwards nothing more is allowed to be advanced.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int, stop_ids: list[int],
                 grammar_ends: bool = False):
        """
        Args:
          tokenizer: from build_tokenizer (its vocab_size must be <= vocab_size).
          grammar: an llguidance grammar string.
          vocab_size: the model's vocabulary size; mask() has ceil(vocab_size / 8) bytes.
          stop_ids: the tokens that end generation (control tokens of the tokenizer, e.g. [1, 106]).
          grammar_ends: the grammar itself ends with the stop token(s) it allows (the tool-call grammars of
            families/<name>/gateway.py end with `<[106]>` or `<[50]>`): stop ids are then masked and consumed by the
            grammar like any token instead of being allowed whenever the value is complete.

        Raises:
          ValueError: bad sizes, or a stop id that is not a control token (it could be ordinary text).
          ConstraintError: the grammar does not compile.
        """
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size {vocab_size} < the grammar tokenizer's {tokenizer.vocab_size}")
        if not stop_ids:
            raise ValueError("stop_ids must name at least one token")
        for s in stop_ids:
            if not (0 <= s < tokenizer.vocab_size and tokenizer.is_special_token(s)):
                raise ValueError(f"stop id {s} is not a control token of the tokenizer")
        self.vocab_size = int(vocab_size)
        self.stop_ids = [int(s) for s in stop_ids]
        self._tok = tokenizer
        self._m = _matcher(tokenizer, grammar)
        self._tokens: list[int] = []
        self._stopped = False
        n_llg = tokenizer.vocab_size
        self._words = np.zeros((n_llg + 31) // 32, dtype=np.uint32)      # llguidance writes here
        self._nbytes = (self.vocab_size + 7) // 8
        self._out = np.zeros(max(self._nbytes, self._words.nbytes), dtype=np.uint8)
        self._llg_bytes = (n_llg + 7) // 8  # bytes that may hold llguidance bits
        self._last_bits = n_llg % 8         # valid bits of its last byte (0 = all)
        self._eos = [e for e in tokenizer.eos_tokens if e not in self.stop_ids]
        self._stop_set = frozenset(self.stop_ids)
        self._eos_set = frozenset(tokenizer.eos_tokens)
        self._grammar_ends = bool(grammar_ends)
        self.grammar = grammar
        # The control tokens the grammar names, its stop ids first (an ending prefers to end than to open a call).
        self.specials = tuple(sorted(grammar_specials(grammar), key=lambda s: s not in self._stop_set))

    @property
    def grammar_ends(self) -> bool:
        """Whether the grammar consumes its own end token (else a stop id follows the complete value)."""
        return self._grammar_ends

    # -- queries ---------------------------------------------------------------------------------------------

    def mask(self) -> bytes:
        """The allowed-token bitset for the next token.

        Layout: `bytes` of length ceil(vocab_size / 8); token i is allowed iff bit (i % 8) of byte (i // 8) is
        set (least significant bit first, i.e. `np.unpackbits(np.frombuffer(m, np.uint8),
        bitorder="little")`). Bits at or beyond the tokenizer's vocabulary are 0. Stop ids are set iff the
        value may end here; after done() exactly the stop ids are set. (llguidance fills uint32 words, bit j
        of word w = token 32w+j; in little-endian memory that is the same bit layout, byte-swapped on
        big-endian hosts.)

        Raises:
          ConstraintError: the matcher is in an error state, or a stop token was already consumed.
        """
        if self._stopped:
            raise ConstraintError("the constraint is finished (a stop token was consumed)")
        m = self._m
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if m.is_error():
            raise ConstraintError(f"grammar error: {_first_line(m.get_error())}")
        words = self._words.byteswap() if sys.byteorder == "big" else self._words
        out = self._out
        out[: self._words.nbytes] = words.view(np.uint8)
        if self._last_bits:
            out[self._llg_bytes - 1] &= (1 << self._last_bits) - 1
        out[self._llg_bytes:] = 0
        for e in self._eos:
            out[e >> 3] &= ~(1 << (e & 7)) & 0xFF
        if self._grammar_ends:
            return out[: self._nbytes].tobytes()
        accepting = m.is_accepting()
        for s in self.stop_ids:
            if accepting:
                out[s >> 3] |= 1 << (s & 7)
            else:
                out[s >> 3] &= ~(1 << (s & 7)) & 0xFF
        return out[: self._nbytes].tobytes()

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (llguidance `compute_ff_tokens`), possibly empty; never a stop id.

        The caller may append them without sampling, calling advance() for each. llguidance stops short of
        bytes whose tokenization is ambiguous: for `{"answer": <integer>}` the forced bytes are `{"answer":`
        but the forced tokens spell `{"answer`, since Gemma also has tokens such as `":` + space.
        """
        if self._stopped or self._m.is_stopped():
            return []
        return [int(t) for t in self._m.compute_ff_tokens()]

    def done(self) -> bool:
        """True when the value is complete and nothing but a stop token may follow (or one was consumed)."""
        return self._stopped or (self._m.is_stopped() and not self._m.is_error())

    def finished(self) -> bool:
        """True once a stop token was consumed (nothing more can be masked or advanced)."""
        return self._stopped

    def is_accepting(self) -> bool:
        """True when the text so far is a complete value (a stop token is allowed now), e.g. at max_tokens."""
        return self._stopped or self._m.is_accepting()

    def matcher_copy(self) -> llguidance.LLMatcher:
        """A copy of the llguidance matcher in its current state, to search from (gateway/structured/endings.py): changing it
        leaves this constraint as it is."""
        return self._m.deep_copy()

    def text(self) -> str:
        """The text of the tokens advanced so far (stop token excluded)."""
        return self._tok.decode_str(self._tokens)

    # -- updates ---------------------------------------------------------------------------------------------

    def fork(self) -> Constraint:
        """An independent copy of the current state (llguidance `deep_copy`), to follow draft tokens without
        touching this one (speculative decoding: gateway/generation/generate.py `ConstraintDriver`). Its scratch buffers are
        shared: use the two from one thread, one call at a time."""
        twin = copy.copy(self)
        twin._m = self._m.deep_copy()
        twin._tokens = list(self._tokens)
        return twin

    def advance(self, token_id: int) -> None:
        """Consume the token that was generated. The state is unchanged if it is refused.

        Raises:
          ConstraintError: the token is not allowed here (out of range, a stop id before the value is
            complete, a non-stop end token, text the grammar rejects), or the constraint is already finished.
        """
        t = int(token_id)
        if self._stopped:
            raise ConstraintError(f"token {t} after the stop token")
        if t in self._stop_set and not self._grammar_ends:
            if not self._m.is_accepting():
                raise ConstraintError(f"stop token {t} before the JSON value is complete")
            self._stopped = True
            return
        if not 0 <= t < self._tok.vocab_size or t in self._eos_set:
            raise ConstraintError(f"token {t} is not allowed here")
        if self._m.try_consume_tokens([t]) != 1:
            if self._m.is_error():
                raise ConstraintError(f"grammar error: {_first_line(self._m.get_error())}")
            raise ConstraintError(f"token {t} ({self._tok.dbg_tokens([t])}) is not allowed here")
        self._tokens.append(t)
        if t in self._stop_set:
            self._stopped = True
