"""Client regular expressions in one linear-time dialect: llguidance's, the one its token masks enforce.

A regex a client sends — a JSON-schema `pattern` or `patternProperties` key, in `response_format` or a tool's
`parameters` — never reaches Python's backtracking `re`: there `^(a+)+$` against 26 characters takes seconds and
each extra character doubles it. llguidance compiles a regex into a lazily built automaton (regex derivatives), so
checking a value costs time linear in its length, and every compile and step is bounded by the fuel of its
`ParserLimits` (`LIMITS`); a regex that needs more is refused as too complex.

Semantics are JSON Schema's (ECMA-262): a `pattern` matches anywhere in the string unless `^`/`$` anchor it, and
`\\d`/`\\w` are ASCII. `search(pattern, value)` does not reimplement them: it compiles `{"type": "string",
"pattern": pattern}` with llguidance's JSON compiler — the very code that builds the token masks of a
`response_format` — and feeds it the value's JSON text byte by byte. So a value the checker accepts is exactly a
value the mask lets the model write. `validator_for(schema)` gives jsonschema validators whose `pattern`,
`patternProperties` and `format: regex` checks go through here.

Compiled matchers are cached per pattern in a `ByteLRU` (`CACHE_BYTES`).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import llguidance

from gateway.core.lru import ByteLRU, text_size

#: llguidance budgets for one client regex: lexer fuel to build it and per byte checked, grammar symbols. The
#: defaults are 1,000,000 / 200,000 / 500,000, sized for a whole grammar; a value's regex gets a tenth
#: (figures: docs/performance.md).
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=100_000, step_lexer_fuel=20_000, step_max_items=5_000,
                                   max_lexer_states=20_000, max_grammar_size=50_000, verbose_errors=False)
#: Longest pattern accepted, in characters.
MAX_PATTERN_CHARS = 4096
#: Estimated bytes of compiled matchers kept (a matcher of a small regex holds a few KiB).
CACHE_BYTES = 16 << 20
_MATCHER_BYTES = 4096  # charged per cached matcher on top of its pattern's length


class PatternError(ValueError):
    """A regex llguidance cannot compile, or one that needs more than its budget (`LIMITS`).

    Attributes:
      pattern: the offending regex.
      reason: why, one line (llguidance's words).
      kind: "malformed" (not a regex at all), "unsupported" (a regex feature llguidance lacks: look-around,
        back-references) or "budget" (too complex for `LIMITS`).
    """

    def __init__(self, pattern: str, reason: str, kind: str = "malformed"):
        shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
        super().__init__(f"pattern {shown!r}: {reason}")
        self.pattern, self.reason, self.kind = pattern, reason, kind


class _ByteVocabulary:
    """A tokenizer whose tokens are the 256 bytes (and an end token), so a matcher consumes text byte by byte."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


_tokenizer: llguidance.LLTokenizer | None = None
_tokenizer_lock = threading.Lock()
_matchers: ByteLRU[str, Any] = ByteLRU(CACHE_BYTES, lambda key, value: text_size(key) + _MATCHER_BYTES)


def _byte_tokenizer() -> llguidance.LLTokenizer:
    global _tokenizer
    with _tokenizer_lock:
        if _tokenizer is None:
            _tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()), slices=[])
        return _tokenizer


def _one_line(error: str) -> str:
    return " ".join(error.split())[:300]


def _template(pattern: str):
    """The compiled string-with-pattern matcher of `pattern` in its initial state (cached). Raises PatternError."""
    if not isinstance(pattern, str):
        raise PatternError(repr(pattern), "a pattern must be a string")
    found = _matchers.get(pattern)
    if found is not None:
        if isinstance(found, PatternError):
            raise found
        return found
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(pattern, f"longer than {MAX_PATTERN_CHARS} characters", "budget")
    result: Any
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern},
                                                                overrides={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=LIMITS)
        result = _error(pattern, matcher.get_error()) if matcher.is_error() else matcher
    except (ValueError, RuntimeError) as err:
        result = _error(pattern, str(err))
    _matchers.put(pattern, result)
    if isinstance(result, PatternError):
        raise result
    return result


def _error(pattern: str, error: str) -> PatternError:
    """llguidance's error about `pattern` as a PatternError of the right kind."""
    text = _one_line(error).replace("<non-verbose/>", "").strip()
    if "too many" in text or "fuel" in text or "limit" in text:
        return PatternError(pattern, f"too complex for the regex budget ({text})", "budget")
    if "not supported" in text:
        return PatternError(pattern, f"not a regex llguidance supports ({text})", "unsupported")
    return PatternError(pattern, f"not a valid regex ({text})", "malformed")


def check(pattern: str) -> None:
    """Compile `pattern` (cached) or raise PatternError: invalid in llguidance's dialect (look-around,
    back-references), longer than MAX_PATTERN_CHARS, or over its budget."""
    _template(pattern)


def search(pattern: str, value: str) -> bool:
    """Whether JSON Schema's `pattern` matches `value` (anywhere unless anchored), in time linear in len(value).

    Raises:
      PatternError: the pattern does not compile, or checking the value needed more than its budget.
    """
    try:
        text = json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False  # a lone surrogate: no JSON text spells it, so no mask would allow it either
    matcher = _template(pattern).deep_copy()
    consumed = matcher.try_consume_tokens(list(text))
    if matcher.is_error():
        raise _error(pattern, matcher.get_error())
    return consumed == len(text) and matcher.is_accepting()


# ----------------------------------------------------------------------------------------- jsonschema hooks


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, pattern_properties, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in pattern_properties.items():
        for key, value in instance.items():
            if search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _is_regex(instance: object) -> bool:
    if not isinstance(instance, str):
        return True
    try:
        check(instance)
    except PatternError:
        return False
    return True


def _format_checker(base: jsonschema.FormatChecker) -> jsonschema.FormatChecker:
    """`base` (a draft's format checker) with `regex` checked by llguidance instead of `re.compile`."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(base.checkers)
    checker.checkers["regex"] = (_is_regex, ())
    return checker


_EXTENDED: dict[type, tuple[type, jsonschema.FormatChecker]] = {}


def validator_class(cls: type) -> tuple[type, jsonschema.FormatChecker]:
    """(a jsonschema validator class like `cls` whose `pattern`/`patternProperties` use `search`, its draft's
    format checker with `regex` checked by `check`)."""
    if cls not in _EXTENDED:
        extended = jsonschema.validators.extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties})
        _EXTENDED[cls] = (extended, _format_checker(cls.FORMAT_CHECKER))
    return _EXTENDED[cls]


def validator_for(schema: Any, default: type = jsonschema.Draft202012Validator):
    """A validator of `schema` (its `$schema` draft, else `default`) that never runs Python's `re` on a client
    regex; validating may raise PatternError."""
    cls = jsonschema.validators.validator_for(schema, default=default) if isinstance(schema, dict) else default
    extended, formats = validator_class(cls)
    return extended(schema, format_checker=formats)


def clear_cache() -> None:
    """Forget every compiled matcher (tests)."""
    _matchers.clear()
