"""Budget-aware endings of constrained answers: end where the grammar allows the answer to end, instead of letting
`max_tokens` cut it inside a unit.

A base model asked for tool calls often writes one valid call after another until `max_tokens` cuts the last one
(`finish_reason: "length"`), and agent frameworks then treat the whole turn as failed. None of vLLM, SGLang or
llama.cpp look at the budget. Here, a constrained answer made of repeated units ends after a complete unit when
the budget left could not fit another one:

- **Units.** Tool calls (both formats, `parallel_tool_calls` on), and the elements of a JSON answer whose
  schema's top level is an array (`response_format` json_schema; values nested deeper are not units: ending
  inside an object would leave out the model's remaining keys). U is the largest number of tokens one unit
  took: each unit after the first counted from the end of the previous one (so separators count), the first
  from the token that opened it (`<|tool_call>`, the one holding the `{` of a Gemma 3 call, or the element's
  first character). A thought before the answer (Gemma 4 thinking) is no part of any unit. C is the number of tokens
  that close the answer after a unit (Gemma 3 `]}`, `<end_of_turn>` and one spare token, since the model may
  split a call's last brackets differently, e.g. `"` `}}` against `"}}`; Gemma 4 `<|tool_response>`; JSON `]`,
  the stop token and a spare one).
- **Rule.** With B tokens left (max_tokens minus every token generated so far, a thought included), the answer
  may not start another unit once B, less what the unit in progress is expected to take still (U minus the
  tokens it has taken, at least 1), is below U + C. Then the grammar is rebuilt with at most the units already
  started (tool grammars' `max_calls`, the array's `maxItems`) and the tokens so far are replayed into it, so
  from the end of the last unit the mask allows only the closing tokens (`finish_reason` `tool_calls` /
  `stop`). Deciding before the unit ends matters: a token such as `}},` would otherwise finish one call and
  start the next in one step.
- **Before the first unit completes**, the unit in progress stands for U (the next one is taken to be at least
  as long as it is so far): when the budget could not fit a second one that long, the first one is the last.
  This matters because a token such as `}},` ends the first call and opens the second in one step.
- **Here only ending is forced; nothing is invented.** This rule never closes a unit in progress early (its content
  is the model's). When even it does not fit, gateway/structured/endings.py (`BudgetedEnding`, around this wrapper) closes it
  with the shortest valid ending as the tokens left reach that ending's length.

Each answer that ended (with a stop, not `length`) after the budget capped it is counted in the gateway metric
`gemma_serve:gateway_budget_endings_total{kind}` (kind `tool_calls` or `json`; gateway/generation/generate.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from gateway.structured.constraints import ConstraintError
from gateway.structured.tools.tool_calls import ToolCallParseError


class BudgetedUnits:
    """A constraint (gateway/structured/constraints.Constraint, possibly inside reasoning.ThoughtFirst) that ends the answer
    after a complete unit when the budget could not fit another (module docstring). Same interface as
    Constraint: mask(), forced(), done(), finished(), advance(token_id), vocab_size.

    Args:
      make: `make(None)` builds the answer's constraint, `make(n)` the same allowing at most n units.
      budget: max_tokens of the generation (every generated token counts, forced ones included).
      parser: follows the units as tokens arrive: `feed(token_id, token_bytes)` and `progress() -> (complete
        units, whether one is open)` — a family's tool-call parser (families/<name>/gateway.py) or `JsonArrayProgress`.
      token_bytes: each token id's bytes (the vocabulary).
      close_tokens: C, the tokens that close the answer after a complete unit.
      kind: the kind of unit ("tool_calls" | "json"), the metric's label.
    """

    def __init__(self, make: Callable[[int | None], object], budget: int, parser, token_bytes,
                 close_tokens: int, kind: str = "tool_calls"):
        self._make = make
        self.inner = make(None)
        self.vocab_size = self.inner.vocab_size
        self.budget = int(budget)
        self._parser = parser
        self._bytes = token_bytes
        self._close = int(close_tokens)
        self.kind = kind
        self._tokens: list[int] = []
        self._done = 0  # complete calls
        self._unit_start: int | None = None  # tokens before the first call opened
        self._last_end: int | None = None  # tokens up to the end of the last complete call
        self._units: list[int] = []  # tokens each complete unit took
        self._answer_start: int | None = None  # tokens before the answer (after a thought)
        self._failed_at = -1  # complete units when capping last failed (retried once more units complete)
        self.max_units: int | None = None  # set once the budget capped the units

    # -- the Constraint interface

    def mask(self) -> bytes:
        """The inner constraint's mask (after a cap: no new call)."""
        return self.inner.mask()

    def forced(self) -> list[int]:
        """The inner constraint's forced tokens."""
        return self.inner.forced()

    def done(self) -> bool:
        """True when the answer is complete."""
        return self.inner.done()

    def finished(self) -> bool:
        """True once the answer's stop token was consumed."""
        return self.inner.finished()

    def fork(self) -> BudgetedUnits:
        """An independent copy of the current state (see `Constraint.fork`): the inner constraint forked, the unit
        parser and the counts copied (the vocabulary and the grammar builder shared)."""
        twin = copy.copy(self)
        twin.inner = self.inner.fork()
        twin._parser = copy.deepcopy(self._parser)
        twin._tokens, twin._units = list(self._tokens), list(self._units)
        return twin

    def advance(self, token_id: int) -> None:
        """Consume a generated token; may cap the units (module docstring).

        Raises:
          ConstraintError: the token is not allowed.
        """
        self.inner.advance(token_id)
        self._tokens.append(int(token_id))
        if getattr(self.inner, "state", "answer") != "answer":
            return  # a thought (reasoning.ThoughtFirst): not part of any unit
        if self._answer_start is None:
            self._answer_start = len(self._tokens) - 1
        try:
            self._parser.feed(int(token_id), self._bytes[token_id])
        except ToolCallParseError:  # pragma: no cover - the grammar only lets well-formed calls through
            return
        self._observe()
        self._maybe_cap()

    # -- budget

    def _observe(self) -> None:
        """Update the unit sizes from the parser's progress."""
        done, inside = self._parser.progress()
        n = len(self._tokens)
        if inside and self._unit_start is None:
            self._unit_start = n - 1
        if done > self._done:
            first = self._unit_start if self._unit_start is not None else self._answer_start or 0
            start = self._last_end if self._last_end is not None else first
            self._units.append(n - start)
            self._done, self._last_end = done, n

    @property
    def max_unit(self) -> int:
        """U: the largest unit so far."""
        return max(self._units, default=0)

    def capped(self) -> bool:
        """True once the budget capped the units: if the answer then ends with a stop (not `length`), its ending
        was forced by the budget (the gateway counts it)."""
        return self.max_units is not None

    def _maybe_cap(self) -> None:
        if self.max_units is not None or self.inner.finished() or self._failed_at == self._done:
            return
        n = len(self._tokens)
        if self._done:
            taken = n - self._last_end
        elif self._unit_start is not None:
            taken = n - self._unit_start  # the first unit, still open
        else:
            return
        size = max(self.max_unit, taken)  # the next unit: at least as long as the longest so far, the open one too
        to_come = max(size - taken, 1) if taken else 0  # the unit in progress, if one has begun
        if self.budget - n - to_come >= size + self._close:
            return
        for cap in sorted({max(self._done, 1), self._done + 1}):
            try:
                constraint = self._make(cap)
                for t in self._tokens:
                    constraint.advance(t)
            except (ConstraintError, ValueError):
                continue  # the tokens so far already started unit number cap + 1
            self.inner, self.max_units = constraint, cap
            return
        self._failed_at = self._done


class JsonArrayProgress:
    """Follows the elements of a top-level JSON array as its bytes arrive (the `parser` of BudgetedUnits for a
    JSON answer): an element is complete at its closing bracket or quote, or, for a number or literal, at the
    `,` or `]` after it. Multi-byte UTF-8 never holds ASCII bytes, so structure is read from the bytes directly."""

    def __init__(self):
        self._depth = 0
        self._string = self._escape = False
        self._items = 0
        self._open = False  # an element has begun and is not complete

    def feed(self, token_id: int, data: bytes) -> None:
        """Add one token's bytes (control tokens carry no structure: pass b"")."""
        for c in data.decode("latin-1"):
            if self._depth == 0 and c not in "[{":
                continue  # outside the array (or after it)
            self._char(c)

    def _char(self, c: str) -> None:
        if self._string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._string = False
                self._element_done(at_depth=1)
            return
        if c == '"':
            self._string = True
            self._open = self._open or self._depth == 1
        elif c in "[{":
            self._depth += 1
            self._open = self._open or self._depth == 2
        elif c in "]}":
            self._element_done(at_depth=1)  # a number or literal ended by the array's `]`
            self._depth -= 1
            self._element_done(at_depth=1)
        elif c == "," and self._depth == 1:
            self._element_done(at_depth=1)
        elif self._depth == 1 and not c.isspace():
            self._open = True  # a number or literal

    def _element_done(self, at_depth: int) -> None:
        if self._depth == at_depth and self._open:
            self._items += 1
            self._open = False

    def progress(self) -> tuple[int, bool]:
        """(complete elements, whether one is open)."""
        return self._items, self._open
