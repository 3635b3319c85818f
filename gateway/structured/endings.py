"""Budget-aware endings inside a value: when the tokens left reach what the grammar needs to close the answer, the
mask forces the shortest ending, so a constrained answer that admits a short ending ends valid within `max_tokens`.

gateway/structured/budget.py ends an answer between units (tool calls, top-level array elements); this module closes it
from anywhere, inside a string included: sampled at temperature 1 a base model may open a string and fill it with
rare characters until `max_tokens` cuts it (`{"city":"` and a hundred CJK tokens, `finish_reason: "length"`).

- **The ending.** `shortest_ending` searches, from the grammar's current state, the shortest continuation that
  completes the answer: a best-first search by tokens over a small alphabet (the control tokens the grammar names,
  e.g. Gemma 4's string delimiter and a tool grammar's end tokens, stop ids first; one token per printable ASCII
  character; the UTF-8 continuation bytes), with the grammar's forced tokens taken in one piece, states deduplicated
  per cost by the alphabet tokens they allow, a state that looks like its parent (a string's content) expanded only
  when nothing else moves on, and a bound on the states it evaluates (`NODE_BUDGET`). The open string closes, open
  arrays and objects close, required properties still missing get their shortest valid values (`""`, `0`, `[]`, the
  shortest enum value...). Its text is then spelled in the tokenizer's own tokens where the grammar takes them.
  llguidance has no such query (its Python API: masks, forced tokens, consume, accept); the search drives a copy of
  its matcher. `quick_ending` is a greedy, cheaper one (not always the shortest).
- **Need.** N = the ending's tokens, plus the stop token where the grammar does not consume its own end. With B
  tokens left (max_tokens minus every token generated so far, a thought included):
  - B = N: the ending is forced from here: `forced()` returns it (the gateway sends it as a forced run), `mask()`
    allows only its next token (after it, only the stop ids). (B < N from the first token: it never fit — a
    server-side cap — and nothing is forced.)
  - N < B <= N + zone: the mask keeps only the tokens after which an ending still fits in B - 1. Checked one by
    one: every allowed token when fewer than `SMALL_SET` are (an object's declared keys, digits, an enum's values);
    in a larger set (a string's content) those whose text holds a quote or a backslash, ends inside a UTF-8
    character, or is a control token, one per effect (the text from the first quote or backslash on, the bytes a
    character lacks), the rest by a few representatives. A check: after the token, the current ending (or the rest
    of it) must still complete the answer, else `quick_ending`, else `shortest_ending` (`STEP_WORK` grammar
    states a step; a token left unchecked is not allowed), remembered across steps by (effect, ending, the alphabet
    tokens allowed). The zone is `ZONE` tokens, widened to twice the largest rise of N seen over one token.
  - otherwise the grammar's own mask: an answer with room is untouched, and one that fits its budget exactly keeps
    its tokens too (its ending at B = N is a shortest one).
- **Before generation.** When the client's limit, as sent, is below the shortest whole answer, the request is a 400
  naming the limit (planner); a budget the server decided or lowered below it leaves the answer to be cut as before.

Limits: a string whose `pattern` makes the shortest ending grow with its content (`^(a+|b{30})$`), or a single token
that raises N by more than the slack left outside the zone (an optional property, or another array element, whose
shortest form is long), can still be cut by `max_tokens`; a grammar whose shortest ending needs a character outside
the alphabet (a pattern of non-ASCII letters) or more than NODE_BUDGET states gets no forced ending (as before:
`finish_reason: "length"`). Cost: a check of the ending every fourth token far from the end and every token near it
(tens of µs); in the zone, a few ms a step.
"""

from __future__ import annotations

import copy
import heapq
import re
import threading

import llguidance
import numpy as np

from gateway.core.lru import ByteLRU, text_size

__all__ = [
    "NODE_BUDGET",
    "QUICK_BUDGET",
    "STEP_WORK",
    "SMALL_SET",
    "ZONE",
    "BudgetedEnding",
    "EndingTables",
    "Work",
    "ending_tables",
    "grammar_specials",
    "quick_ending",
    "shortest_ending",
]

#: Grammar states one search may evaluate (a copy, a token, a mask each: ~5 µs to 100 µs) before it gives up.
NODE_BUDGET = 4000
#: Grammar states `quick_ending` may evaluate.
QUICK_BUDGET = 400
#: Allowed sets at most this large are checked token by token inside the zone.
SMALL_SET = 96
#: Tokens of slack (B - N) below which the mask is filtered (widened by the rises of N seen).
ZONE = 12
#: Grammar states the checks of one zone step may evaluate in all (a token left unchecked is not allowed: the work
#: of a step is bounded, and deterministic).
STEP_WORK = 8000
#: Tokens between searches after one found no ending (a grammar whose shortest ending is beyond the search).
RETRY_AFTER_NONE = 32
#: Representatives of a large allowed set's plain tokens checked inside the zone.
_REPRESENTATIVES = 6
#: The search spells text one character a token; the tokenizer's own spelling takes at most 1/_SPELLING as many
#: (a bound on how far a search under a limit must look).
_SPELLING = 4
#: Above this many alphabet tokens allowed, a search expands only the preferred ones (a string's content).
_WIDE = 12

# The alphabet in order of preference (ties of the search go to the earlier one): closers first, then the shortest
# values' first characters, then the rest of printable ASCII.
_PREFERRED = b'"}],:0-1.@a{[ntfeA_ /'
_ALPHABET = _PREFERRED + bytes(c for c in range(32, 127) if c not in _PREFERRED)
_SPECIAL_RE = re.compile(r"<\[(\d+)\]>")


def grammar_specials(grammar: str) -> tuple[int, ...]:
    """The control-token ids a grammar names (`<[id]>` in llguidance's Lark syntax), in order of appearance:
    the search's alphabet needs them (Gemma 4's string delimiter, a tool grammar's end tokens). Raises nothing."""
    return tuple(dict.fromkeys(int(x) for x in _SPECIAL_RE.findall(grammar)))


class EndingTables:
    """Per-tokenizer tables of the ending search and filter, built once per tokenizer (`ending_tables`).

    Attributes:
      alphabet: token ids of the printable ASCII characters that are one token each, in order of preference, then
        of the UTF-8 continuation bytes (byte tokens).
      preferred: the subset expanded when many are allowed.
      alphabet_bytes: the indices of the mask bytes that hold the alphabet's bits (where the grammar is, cheaply).
      checked: packed bitset (np.uint8, ceil(vocab/8) bytes, LSB first) of the tokens whose text holds `"` or `\\`
        or ends inside a UTF-8 character, or that are control tokens: those checked one by one inside the zone.
      tok: the llguidance tokenizer.
    """

    def __init__(self, tok: llguidance.LLTokenizer):
        self.tok = tok
        ids = []
        for c in _ALPHABET:
            t = tok.tokenize_bytes(bytes([c]))
            if len(t) == 1 and t[0] not in ids:
                ids.append(int(t[0]))
        self.preferred = frozenset(ids[: len(_PREFERRED)])
        for c in range(0x80, 0xC0):  # UTF-8 continuation bytes: to finish a character a token left incomplete
            t = tok.tokenize_bytes(bytes([c]))
            if len(t) == 1 and t[0] not in ids:
                ids.append(int(t[0]))
        self.alphabet = tuple(ids)
        self.alphabet_bytes = np.array(sorted({t >> 3 for t in ids}), np.int64)  # mask bytes that hold them
        n = tok.vocab_size
        checked = np.zeros(((n + 7) // 8) * 8, bool)
        for i in range(n):
            if tok.is_special_token(i):
                checked[i] = True
            else:
                b = tok.decode_bytes([i])
                checked[i] = b'"' in b or b"\\" in b or _incomplete(b) > 0
        self.checked = np.packbits(checked, bitorder="little")


def _incomplete(text: bytes) -> int:
    """How many bytes the last UTF-8 character of `text` still lacks (0: complete, or not UTF-8 at all)."""
    for back in range(1, min(4, len(text)) + 1):
        c = text[-back]
        if c < 0x80:
            return 0
        if c >= 0xC0:
            size = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            return max(size - back, 0)
    return 0


_tables: dict[int, tuple[llguidance.LLTokenizer, EndingTables]] = {}
# The ending of a grammar's initial state, by (tokenizer id, grammar): every choice of every request with that
# grammar starts there (the planner's check of the client's limit, the first mask).
_initial: ByteLRU[tuple[int, str], tuple[int, ...] | None] = ByteLRU(
    8 << 20, lambda key, ending: text_size(key[1], ending))
_tables_lock = threading.Lock()


def ending_tables(tok: llguidance.LLTokenizer) -> EndingTables:
    """The EndingTables of `tok` (built on first use: ~0.2 s for Gemma's 262,144 tokens; then shared). Raises
    nothing."""
    with _tables_lock:
        entry = _tables.get(id(tok))
        if entry is not None and entry[0] is tok:
            return entry[1]
    tables = EndingTables(tok)
    with _tables_lock:
        _tables[id(tok)] = (tok, tables)
    return tables


# ---------------------------------------------------------------------------------------------- the search


def _allowed_of(m: llguidance.LLMatcher, ids: np.ndarray, words: np.ndarray) -> tuple[int, ...]:
    """The tokens of `ids` (an int64 array) the matcher allows next; `words` is scratch of the mask's width."""
    m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    return tuple(ids[(words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 1].tolist())


def _start(matcher: llguidance.LLMatcher, tables: EndingTables, specials: tuple[int, ...]):
    """A search's alphabet (the grammar's control tokens first), mask scratch, and a copy of the matcher with the
    tokens it forces taken (and those tokens)."""
    ids = np.array(tuple(s for s in specials if s not in tables.alphabet) + tables.alphabet, np.int64)
    words = np.zeros((tables.tok.vocab_size + 31) // 32, np.uint32)
    m = matcher.deep_copy()
    return ids, words, m, _take_forced(m)


class Work:
    """A budget of grammar states to evaluate, shared by the searches it is given to (`take()` spends one)."""

    def __init__(self, states: int):
        self.left = int(states)

    def take(self) -> bool:
        """Spend one state; False once the budget is spent."""
        self.left -= 1
        return self.left >= 0


def shortest_ending(matcher: llguidance.LLMatcher, tables: EndingTables, specials: tuple[int, ...] = (),
                    limit: int | None = None, work: Work | None = None) -> list[int] | None:
    """The shortest token sequence (as far as the search sees) that takes `matcher` to an accepting state.

    Args:
      matcher: the grammar state to end from; not changed (the search works on copies).
      tables: `ending_tables` of the matcher's tokenizer.
      specials: control tokens the grammar uses (`grammar_specials`), added to the alphabet before its characters
        (they close strings and answers), in order of preference (Constraint.specials: its stop ids first).
      limit: give up on endings longer than this many tokens once spelled (None: no limit).
      work: the states it may evaluate (default: a fresh Work(NODE_BUDGET)).

    Returns:
      The tokens ([] when the state already accepts), verified on a copy of the matcher; None when no ending was
      found within `limit` and `work`, or the matcher is in an error state.
    """
    if matcher.is_error():
        return None
    ids, words, start, path = _start(matcher, tables, specials)
    heap = [(len(path), 0, start, path, _allowed_of(start, ids, words))]
    seen: set[tuple[int, bool, tuple[int, ...]]] = set()
    serial = 0
    work = work or Work(NODE_BUDGET)
    while heap:
        cost, _, m, path, allowed = heapq.heappop(heap)
        if m.is_accepting():
            found = _respell(matcher, tables, path)
            return found if limit is None or len(found) <= limit else None
        here = (m.is_accepting(), allowed)
        if len(allowed) > _WIDE:  # many choices (a string's content): the preferred ones, else the first few
            allowed = tuple(t for t in allowed if t in tables.preferred or t not in tables.alphabet) or allowed[:_WIDE]
        children = []
        for t in allowed:
            if not work.take():
                return None
            child = m.deep_copy()
            if child.try_consume_tokens([t]) != 1:
                continue
            child_path = path + (t,) + _take_forced(child)
            if limit is not None and len(child_path) > _SPELLING * limit:
                continue
            children.append((child, child_path, (child.is_accepting(), _allowed_of(child, ids, words))))
        # A child that looks like its parent (a string's content) is taken only when no child moves on.
        moving = [c for c in children if c[2] != here] or children
        for child, child_path, look in moving:
            key = (len(child_path), look)
            if key in seen:
                continue
            seen.add(key)
            serial += 1
            heapq.heappush(heap, (len(child_path), serial, child, child_path, look[1]))
    return None


def quick_ending(matcher: llguidance.LLMatcher, tables: EndingTables, specials: tuple[int, ...] = (),
                 work: Work | None = None) -> list[int] | None:
    """An ending found greedily, not always the shortest: at each step the grammar's forced tokens, else the first
    alphabet token (in order of preference) that moves the grammar to a state that allows other tokens than this
    one does, else the first allowed (a string's minimum length). Tens of times cheaper than `shortest_ending`: the
    zone's checks try it first.

    Args and returns: as `shortest_ending` (`work` by default a fresh Work(QUICK_BUDGET)).
    """
    if matcher.is_error():
        return None
    ids, words, m, path = _start(matcher, tables, specials)
    work = work or Work(QUICK_BUDGET)
    while True:
        if m.is_accepting():
            return _respell(matcher, tables, path)
        here = _allowed_of(m, ids, words)
        chosen = None
        for t in here[:_WIDE]:
            if not work.take():
                return None
            child = m.deep_copy()
            if child.try_consume_tokens([t]) != 1:
                continue
            forced = _take_forced(child)
            if chosen is None:
                chosen = (child, (t, *forced))
            if child.is_accepting() or _allowed_of(child, ids, words) != here:
                chosen = (child, (t, *forced))
                break
        if chosen is None:
            return None
        m, path = chosen[0], path + chosen[1]
    return None


def _take_forced(m: llguidance.LLMatcher) -> tuple[int, ...]:
    """Consume the tokens the grammar forces next; returns them."""
    forced = m.compute_ff_tokens()
    if not forced:
        return ()
    n = m.try_consume_tokens(forced)
    return tuple(forced[:n])


def _respell(matcher: llguidance.LLMatcher, tables: EndingTables, path: tuple[int, ...]) -> list[int]:
    """`path` with each run of text tokens spelled in the tokenizer's own tokens, if the grammar takes that spelling
    and it is shorter; else `path` as found."""
    tok, out, run = tables.tok, [], b""
    for t in path:
        if tok.is_special_token(t):
            out += tok.tokenize_bytes(run) if run else []
            out.append(t)
            run = b""
        else:
            run += tok.decode_bytes([t])
    out += tok.tokenize_bytes(run) if run else []
    if len(out) < len(path):
        check = matcher.deep_copy()
        if check.try_consume_tokens(out) == len(out) and check.is_accepting():
            return [int(t) for t in out]
    return [int(t) for t in path]


# ---------------------------------------------------------------------------------------------- the wrapper


def _core(constraint):
    """The gateway.structured.constraints.Constraint at the bottom of a stack of wrappers (each holds the next in `inner`)."""
    c = constraint
    while not hasattr(c, "matcher_copy"):
        c = c.inner
    return c


def _thought(constraint):
    """The reasoning.ThoughtFirst in a stack of wrappers, or None."""
    c = constraint
    while not hasattr(c, "matcher_copy"):
        if hasattr(c, "close_id") and hasattr(c, "state"):
            return c
        c = c.inner
    return None


class BudgetedEnding:
    """A constraint (Constraint, possibly inside reasoning.ThoughtFirst and budget.BudgetedUnits) whose answer ends
    valid within its budget when the grammar admits a short enough ending (module docstring). Same interface as
    Constraint: mask(), forced(), done(), finished(), advance(token_id), fork(), vocab_size; `capped()` and `kind`
    as BudgetedUnits has them (the gateway's metric of budget endings).

    Args:
      inner: the answer's constraint stack (its bottom is a Constraint; wrappers hold the next one in `inner`).
      budget: max_tokens of the generation (every generated token counts, forced ones and a thought included).
      tables: `ending_tables` of the grammar's tokenizer.
    """

    def __init__(self, inner, budget: int, tables: EndingTables):
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.budget = int(budget)
        self._tables = tables
        self._n = 0  # tokens advanced
        self._ending: list[int] | None = None  # an ending of the current state (None: none found)
        self._stale = True  # `_ending` may no longer complete the answer: check it before use
        self._zone = ZONE
        self._need: int | None = None  # N when last computed
        self._need_at = -1  # self._n then
        self.forcing = False  # the ending is forced (the budget ran short)
        self._work = Work(0)  # what the checks of the zone step in progress may still evaluate
        self._memo: dict[tuple, int | tuple[int]] = {}  # `_fits`: N after a token, or (bound N exceeds,)

    # -- the budget arithmetic

    def _stop_cost(self) -> int:
        """1 when a stop token follows the grammar's end (it is not part of the grammar), else 0."""
        return 0 if _core(self.inner).grammar_ends else 1

    def _ending_now(self) -> list[int] | None:
        """An ending of the current state: the one in force while it still completes the answer, else a new
        search's (with the thought's close token first while in a thought)."""
        if not self._stale:
            return self._ending
        self._stale = False
        core, thought = _core(self.inner), _thought(self.inner)
        if thought is not None and thought.state == "thinking":
            found = shortest_ending(core.matcher_copy(), self._tables, core.specials)
            self._ending = None if found is None else [thought.close_id, *found]
            return self._ending
        if self._n == 0:
            key = (id(self._tables.tok), core.grammar)
            cached = _initial.get(key, ())
            if cached == ():
                found = shortest_ending(core.matcher_copy(), self._tables, core.specials)
                _initial.put(key, None if found is None else tuple(found))
            else:
                found = None if cached is None else list(cached)
            self._ending = found
            return found
        if self._ending is not None:
            m = core.matcher_copy()
            if m.try_consume_tokens(self._ending) == len(self._ending) and m.is_accepting():
                return self._ending
        self._ending = shortest_ending(core.matcher_copy(), self._tables, core.specials)
        return self._ending

    def need(self) -> int | None:
        """N: the tokens that end the answer from here (the ending and the stop token), or None when no ending was
        found. Raises nothing."""
        if self.inner.finished():
            return 0
        ending = self._ending_now()
        need = None if ending is None else len(ending) + self._stop_cost()
        if self._need is not None and need is not None and self._n == self._need_at + 1:
            self._zone = max(self._zone, 2 * (need - self._need + 1))  # N rose this much over one token
        self._need, self._need_at = need, self._n
        return need

    def shortest(self) -> int | None:
        """The shortest whole answer in tokens (called before any token), or None when the search found none: the
        planner refuses a client limit below it. Raises nothing."""
        return self.need()

    def _left(self) -> int:
        """B: the tokens that may still be generated, the next one included."""
        return self.budget - self._n

    def _near(self) -> bool:
        """Whether N must be known now: near the end, every step; far from it, every fourth. After a search that
        found no ending, only every `RETRY_AFTER_NONE` tokens: a grammar without a findable ending (a string of
        thousands of characters at least, say) must not pay a whole failing search per token."""
        if self._need is None:
            return self._need_at < 0 or (self._n - self._need_at) >= RETRY_AFTER_NONE
        return self._left() - self._need <= 4 * self._zone or (self._n - self._need_at) >= 4

    def _must_force(self) -> bool:
        """Whether the ending is forced from here: B has come down to N (B < N: it never fit, nothing to force)."""
        if self.forcing:
            return True
        if self.inner.done() or not self._near():
            return False
        need = self.need()
        self.forcing = need is not None and need == self._left()
        return self.forcing

    # -- the Constraint interface

    def forced(self) -> list[int]:
        """The ending once it is forced; else the inner constraint's forced tokens."""
        if self._must_force():
            return list(self._ending_now() or [])
        return self.inner.forced()

    def mask(self) -> bytes:
        """The allowed-token bitset for the next token (module docstring): the inner mask, filtered inside the
        zone; the ending's next token while it is forced (once it is complete, the stop ids)."""
        if self._must_force():
            ending = self._ending_now()
            if ending:
                return _only([ending[0]], self.vocab_size)
            mask, stops = self.inner.mask(), _core(self.inner).stop_ids
            return _only([s for s in stops if _allows(mask, s)] or list(stops), self.vocab_size)
        mask = self.inner.mask()
        if self.inner.done() or not self._near():
            return mask
        need = self.need()
        if need is None or self._left() - need > self._zone or need > self._left():
            return mask
        return self._filter(mask)

    def done(self) -> bool:
        """True when the answer is complete."""
        return self.inner.done()

    def finished(self) -> bool:
        """True once the answer's stop token was consumed."""
        return self.inner.finished()

    def capped(self) -> bool:
        """True when the budget shaped the ending: the ending was forced here, or the units capped
        (budget.BudgetedUnits inside); the gateway counts such answers when they end with a stop."""
        inner = getattr(self.inner, "capped", None)
        return self.forcing or (inner is not None and inner())

    @property
    def kind(self) -> str:
        """The metric label: BudgetedUnits' kind when it is inside, else "tool_calls" for a tool grammar, "json"."""
        return getattr(self.inner, "kind", "tool_calls" if _core(self.inner).grammar_ends else "json")

    def fork(self) -> BudgetedEnding:
        """An independent copy of the current state (see `Constraint.fork`)."""
        twin = copy.copy(self)
        twin.inner = self.inner.fork()
        twin._ending = None if self._ending is None else list(self._ending)
        return twin

    def advance(self, token_id: int) -> None:
        """Consume a generated token (while the ending is forced, its next one).

        Raises:
          ConstraintError: the token is not allowed.
        """
        t = int(token_id)
        self.inner.advance(t)
        self._n += 1
        if not self._stale and self._ending and self._ending[0] == t:
            self._ending = self._ending[1:]  # still an ending, one token shorter
            if self._need is not None and self._need_at == self._n - 1:
                self._need, self._need_at = self._need - 1, self._n
        else:
            self._stale = True

    # -- the zone

    def _filter(self, mask: bytes) -> bytes:
        """`mask` less the tokens after which no ending fits in the tokens left (module docstring)."""
        left = self._left() - 1  # after the next token
        arr = np.frombuffer(mask, np.uint8)
        heavy = self._tables.checked[: len(arr)]
        ending = self._ending_now() or []
        allowed = _ids(arr)
        small = len(allowed) <= SMALL_SET
        checked, plain = (allowed, allowed[:0]) if small else (_ids(arr & heavy), _ids(arr & ~heavy))
        # Where the grammar is: its ending, and which alphabet tokens it allows (a string's content, a key, ...).
        where = (tuple(ending), arr[self._tables.alphabet_bytes].tobytes())
        keep = np.zeros_like(arr)
        stops = set(_core(self.inner).stop_ids)
        self._work = Work(STEP_WORK)
        verdicts: dict[object, bool] = {}
        for t in checked.tolist():
            if t in stops or (ending and t == ending[0]):
                keep[t >> 3] |= 1 << (t & 7)
                continue
            key = t if small else self._effect(t)  # a large set's tokens go by their effect
            if key not in verdicts:
                # once the step's work is spent, an effect not yet judged is not allowed (without the check's own
                # forks and masks, which the work budget does not count)
                verdicts[key] = self._work.left > 0 and self._fits(t, (key, where), ending, left)
            if verdicts[key]:
                keep[t >> 3] |= 1 << (t & 7)
        if len(plain):
            picks = plain[np.linspace(0, len(plain) - 1, min(_REPRESENTATIVES, len(plain))).astype(int)]
            if all(self._fits(int(t), (("plain", i), where), ending, left) for i, t in enumerate(picks)):
                keep |= arr & ~heavy
        if ending:
            keep[ending[0] >> 3] |= 1 << (ending[0] & 7)
        return keep.tobytes()

    def _effect(self, token: int) -> object:
        """Tokens of a large allowed set (a string's content) alike in what they do to the structure: the text from
        the first quote or backslash on (what comes before is content); for text with neither, the bytes its last
        character lacks; the id of a control token."""
        tok = self._tables.tok
        if tok.is_special_token(token):
            return token
        text = tok.decode_bytes([token])
        cuts = [i for i in (text.find(b'"'), text.find(b"\\")) if i >= 0]
        if not cuts:
            return ("utf-8", _incomplete(text))  # content that leaves a character unfinished: bytes it lacks
        return text[min(cuts):]

    def _fits(self, token: int, key: tuple, ending: list[int], left: int) -> bool:
        """Whether an ending fits in `left` tokens once `token` is taken. Remembered by `key` (the token's effect and
        where the grammar is) across steps: inside one string the same checks recur at every token."""
        known = self._memo.get(key)
        if isinstance(known, int) and known <= left:
            return True
        if isinstance(known, tuple) and left <= known[0]:
            return False  # no ending of at most known[0] tokens
        if len(self._memo) > 4096:
            self._memo.clear()
        after = self._need_after(token, ending, left)
        if after is not None and after > left and isinstance(known, int):
            after = min(after, known)
        self._memo[key] = after if after is not None else (left,)
        return after is not None and after <= left

    def _need_after(self, token: int, ending: list[int], left: int) -> int | None:
        """N once `token` is taken (an upper bound: the current ending, or the rest of it, within `left`, else a
        search's); None when none was found (or this step's searches are spent)."""
        twin = self.inner.fork()
        try:
            twin.advance(token)
        except ValueError:
            return None
        if twin.finished():
            return 0
        stop, thought = self._stop_cost(), _thought(twin)
        if thought is not None and thought.state == "thinking":
            return len(ending) + stop  # a thought's token leaves the ending (close, answer) as it was
        core, tok = _core(twin), self._tables.tok
        m = core.matcher_copy()
        if m.try_consume_tokens(ending) == len(ending) and m.is_accepting():
            if len(ending) + stop <= left:
                return len(ending) + stop
        text, spelled = tok.decode_bytes([token]), tok.decode_bytes(ending)
        if ending and spelled.startswith(text) and not any(tok.is_special_token(e) for e in ending):
            rest = tok.tokenize_bytes(spelled[len(text):])  # the token is the ending's first bytes: the rest ends it
            m = core.matcher_copy()
            if len(rest) + stop <= left and m.try_consume_tokens(rest) == len(rest) and m.is_accepting():
                return len(rest) + stop
        sub = Work(min(QUICK_BUDGET, max(self._work.left, 0)))
        given = sub.left
        quick = quick_ending(core.matcher_copy(), self._tables, core.specials, sub)
        self._work.left -= given - max(sub.left, 0)
        if quick is not None and len(quick) + stop <= left:
            return len(quick) + stop
        if self._work.left <= 0:
            return None  # this step's work is spent: not allowed (the ending's own next token always is)
        found = shortest_ending(core.matcher_copy(), self._tables, core.specials, work=self._work)  # remembered as N
        return None if found is None else len(found) + stop


def _ids(arr: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set in a packed mask (np.uint8, LSB first)."""
    return np.flatnonzero(np.unpackbits(arr, bitorder="little"))


def _allows(mask: bytes, token: int) -> bool:
    return bool(mask[token >> 3] >> (token & 7) & 1)


def _only(tokens: list[int], vocab_size: int) -> bytes:
    """A packed mask allowing exactly `tokens`."""
    out = bytearray((vocab_size + 7) // 8)
    for t in tokens:
        out[t >> 3] |= 1 << (t & 7)
    return bytes(out)
