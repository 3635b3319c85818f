"""Compiling `response_format` schemas to llguidance grammars, and the caches that make it cheap per request.

Holds the llguidance options every schema is compiled with (`ITEM_SEPARATOR`, `KEY_SEPARATOR`), the budgets a
client grammar gets (`LIMITS`), the grammar LRU keyed by schema and the matcher-template LRU keyed by grammar,
and the entry points: `grammar_for_response_format`, `grammar_for_json_schema`, `grammar_for_json_object`,
`check_schema`, `grammar_cache_info`, `clear_grammar_cache`. It sits between the pure schema policy
(gateway/structured/schema_check.py: what is accepted, and the rewrite) and the per-request matcher
(gateway/structured/constraints.py: `Constraint`) because it owns the process-wide state: a schema compile and a matcher
compile each cost up to tens of milliseconds, far more than a copy of a compiled matcher, so each is done once
per distinct schema/grammar and shared (figures: docs/performance.md, "JSON-schema compile" and "Per-request
matcher from a cached template").

Departures from JSON Schema semantics due to llguidance and the options given to it, all of which only
*narrow* what is generated (the output still validates; those due to the rewrite are in
gateway/structured/schema_check.py):
- Object properties come in the order of `properties` (then `required`, then additional/pattern properties).
- The value is written on one line, compact (`{"a":1,"b":[1,2]}`) or in Python's `json.dumps` style
  (`{"a": 1, "b": [1, 2]}`): the only whitespace allowed is one optional space after `:` and `,`
  (`KEY_SEPARATOR`, `ITEM_SEPARATOR`); none before or after the value, so generation ends right after the
  top-level value and there is no whitespace runaway (a known failure of small models under JSON constraints).
  It also makes structure predictable, so more of it is forced (`Constraint.forced`) instead of sampled:
  for `{"answer": ...}` the forced bytes are `{"answer":`.
- Strings use no `\\uXXXX` escapes except for U+0000..U+001F (which have no other spelling); `\\d`/`\\w` in
  `pattern` are ASCII, as in ECMA-262.
- Numbers under `minimum`/`maximum`/`multipleOf` are written without exponents; `integer` never as `1.0`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import llguidance

from gateway.core.lru import ByteLRU, text_size
from gateway.structured.schema_check import SchemaError, rewrite_formats, static_check

__all__ = [
    "GRAMMAR_CACHE_BYTES",
    "ITEM_SEPARATOR",
    "KEY_SEPARATOR",
    "LIMITS",
    "MAX_SCHEMA_CHARS",
    "check_schema",
    "clear_grammar_cache",
    "grammar_cache_info",
    "grammar_for_json_object",
    "grammar_for_json_schema",
    "grammar_for_response_format",
    "matcher_template",
]

# ------------------------------------------------------------------------------------------------------------
# llguidance options
# ------------------------------------------------------------------------------------------------------------

#: Separators (llguidance regexes) between array items / object members, and between a key and its value.
#: With whitespace_flexible off they are the only places whitespace may appear: one optional space.
ITEM_SEPARATOR = ", ?"
KEY_SEPARATOR = ": ?"

#: Options given to llguidance as `overrides` (they win over a schema's own "x-guidance", which we refuse
#: anyway).
_LLG_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,  # no whitespace but the separators' optional space
    "item_separator": ITEM_SEPARATOR,
    "key_separator": KEY_SEPARATOR,
    "lenient": False,              # unimplemented keywords are errors, never ignored
    "coerce_one_of": False,        # oneOf only where llguidance proves the branches disjoint, else an error
}


def _llg_error_keyword(msg: str) -> str | None:
    """The schema keyword an llguidance compile error is about (by words in its text), or None."""
    for needle, keyword in (("patternProperty", "patternProperties"), ("oneOf", "oneOf"),
                            ("regex", "pattern"), ("format", "format"), ("Properties", "maxProperties"),
                            ("$ref", "$ref"), ("circular", "$ref"), ("Resource", "$ref"),
                            ("Pointer", "$ref")):
        if needle in msg:
            return keyword
    return None


# ------------------------------------------------------------------------------------------------------------
# Budgets and caches
# ------------------------------------------------------------------------------------------------------------

#: Largest schema accepted, in characters of compact JSON (the gateway's MAX_SCHEMA_BYTES is checked first).
MAX_SCHEMA_CHARS = 1 << 20
#: llguidance's budgets for a client grammar (its defaults, with error messages that do not echo the grammar):
#: lexer fuel to build it and per token, Earley items per token and per grammar row, lexer states, grammar
#: symbols; each bounds the time a grammar may take (figures: docs/performance.md, "llguidance work rates"). A
#: grammar that needs more is an error; see `Constraint` (gateway/structured/constraints.py).
LIMITS = llguidance.LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                   step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
                                   verbose_errors=False)
#: Estimated bytes of grammar text kept (compiled grammars by schema, matcher templates by grammar).
GRAMMAR_CACHE_BYTES = 64 << 20
#: Estimated bytes of a compiled matcher beyond its grammar text (lexer and parser tables).
_MATCHER_OVERHEAD = 64 << 10
_cache: ByteLRU[str, str] = ByteLRU(GRAMMAR_CACHE_BYTES, lambda key, grammar: text_size(key, grammar))
_cache_lock = threading.Lock()
_stats = {"hits": 0, "misses": 0, "compiles": 0}

# Compiled matchers in their initial state, keyed by (tokenizer id, grammar); a request gets a deep_copy, much
# cheaper than a compile (figures: docs/performance.md, "Per-request matcher from a cached template"). The
# tokenizer is held in the entry so its id stays unique.
_templates: ByteLRU[tuple[int, str], tuple[Any, Any]] = ByteLRU(
    GRAMMAR_CACHE_BYTES, lambda key, entry: text_size(key[1]) + _MATCHER_OVERHEAD)


def _schema_key(schema: Any, where: str) -> str:
    # Canonical JSON *keeping key order*: for llguidance key order is meaning (the order of `properties` is
    # the order generated; applicators apply in order of appearance), so sort_keys would merge schemas whose
    # outputs differ. Equal dicts written in the same order share an entry, whatever their whitespace/escapes.
    try:
        canon = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"{where}: the schema is not JSON: {e}", None, "") from e
    if len(canon) > MAX_SCHEMA_CHARS:
        raise SchemaError(f"{where}: the schema is too large ({len(canon)} characters of JSON; at most "
                          f"{MAX_SCHEMA_CHARS})", None, "")
    return hashlib.sha256(canon.encode()).hexdigest()


def _compile(schema: dict, where: str) -> str:
    """Check, rewrite and compile one schema to a validated llguidance grammar string; raises SchemaError."""
    static_check(schema, where)
    with _cache_lock:
        _stats["compiles"] += 1
    grammar = llguidance.LLMatcher.grammar_from_json_schema(rewrite_formats(schema), overrides=_LLG_OPTIONS)
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS)
    if error:
        first = " ".join(error.split())[:400]
        keyword = _llg_error_keyword(first)
        if first.startswith("oneOf constraints are not supported"):
            first = ("its branches are not provably disjoint (use anyOf, or make the branches disjoint, "
                     "e.g. by a const property)")
        shown = f"keyword '{keyword}'" if keyword else "the schema"
        raise SchemaError(f"{where}: {shown} cannot be enforced: {first}", keyword, "")
    return grammar


def grammar_for_json_schema(schema: dict, *, where: str = "response_format.json_schema") -> str:
    """The llguidance grammar (a JSON string) enforcing `schema`; checked with check_schema's rules.

    Compiled and validated once per distinct schema: an LRU cache (256 entries) keyed by the SHA-256 of the
    schema's compact JSON. Key order is kept, not sorted: llguidance generates properties in the order of
    `properties`, so `{"a", "b"}` and `{"b", "a"}` are different grammars. Two requests racing on the same new
    schema may both compile it (harmless). A large schema's compile is long enough that callers on an event
    loop may prefer `asyncio.to_thread` (figures: docs/performance.md, "JSON-schema compile").

    Args:
      schema: the JSON Schema (`response_format.json_schema.schema`).
      where: prefix for error messages (e.g. "tools[0].function.parameters").

    Raises:
      SchemaError: malformed, unenforceable keyword, or rejected by llguidance (e.g. unsatisfiable,
        overlapping `oneOf` branches, a `pattern` with look-around or back-references).
    """
    key = _schema_key(schema, where)
    grammar = _cache.get(key)
    with _cache_lock:
        _stats["hits" if grammar is not None else "misses"] += 1
    if grammar is None:
        grammar = _compile(schema, where)  # outside the lock: big schemas take tens of ms
        _cache.put(key, grammar)
    return grammar


def grammar_for_json_object() -> str:
    """The grammar for `response_format: {"type": "json_object"}`: any JSON object (any keys and values),
    written like schema outputs (one line, see the module docstring). Cached like a schema."""
    return grammar_for_json_schema({"type": "object"}, where="response_format")


def check_schema(schema: dict, *, where: str = "response_format.json_schema") -> None:
    """Fail closed: return None if `schema` can be enforced exactly, else raise SchemaError.

    Checks, in order: (a) the schema is a JSON object and valid against its draft's meta-schema (2020-12 by
    default; `$schema` may name 2019-09 or draft-07), `pattern`s compile; (b) every keyword anywhere in it is
    in SUPPORTED_KEYWORDS or ANNOTATION_KEYWORDS (`format` only SUPPORTED_FORMATS, `multipleOf` only integers,
    `$ref` only "#..."); (c) llguidance compiles it. The result is cached (grammar_for_json_schema), so
    checking then building costs one compile.

    Raises:
      SchemaError(message, keyword, path), e.g. "response_format.json_schema: keyword 'uniqueItems' at
      /properties/tags cannot be enforced (...)".
    """
    grammar_for_json_schema(schema, where=where)


def grammar_for_response_format(response_format: dict | None) -> str | None:
    """The grammar for an OpenAI `response_format` object, or None for text (no constraint).

    Accepts `None`/`{"type": "text"}`, `{"type": "json_object"}` and
    `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}` (`strict` is
    ignored: we always enforce; `schema` is required here, although OpenAI's type marks it optional).

    Raises:
      SchemaError: an unknown type, a missing/invalid `json_schema.schema`, or a schema check_schema refuses.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise SchemaError("response_format: must be an object", None, "")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar_for_json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise SchemaError("response_format.json_schema: must be an object with a 'schema'", None, "")
        return grammar_for_json_schema(spec["schema"])
    raise SchemaError(f"response_format.type: unsupported {kind!r} (text, json_object or json_schema)",
                      None, "")


def grammar_cache_info() -> dict[str, int]:
    """{"hits", "misses", "compiles", "size", "bytes"}: counters since start (or clear_grammar_cache), entries and
    their estimated bytes."""
    with _cache_lock:
        return dict(_stats, size=len(_cache), bytes=_cache.nbytes)


def clear_grammar_cache() -> None:
    """Empty the grammar cache, the matcher templates and the counters (tests)."""
    _cache.clear()
    _templates.clear()
    with _cache_lock:
        _stats.update(hits=0, misses=0, compiles=0)


def matcher_template(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """The compiled matcher for `grammar` in its initial state, shared: callers must `deep_copy()` it, never
    advance it (gateway/structured/constraints.py `Constraint` does).

    Cached by (tokenizer, grammar) in an LRU of GRAMMAR_CACHE_BYTES, since a matcher compile costs as much as
    a schema compile and a copy is much cheaper (figures: docs/performance.md, "Per-request matcher from a cached
    template"). Compiled under `LIMITS`.

    Args:
      tokenizer: from gateway.structured.constraints.build_tokenizer.
      grammar: an llguidance grammar string (e.g. from grammar_for_json_schema).

    Returns:
      The template; when the grammar does not compile, a matcher whose `is_error()` is true (not cached).
    """
    key = (id(tokenizer), grammar)
    entry = _templates.get(key)
    if entry is not None and entry[0] is tokenizer:
        return entry[1]
    template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    if not template.is_error():
        _templates.put(key, (tokenizer, template))
    return template
