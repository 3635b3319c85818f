"""Constrained decoding for OpenAI `response_format`: JSON answers that always parse and validate.

OpenAI's Chat Completions API takes `response_format` = `{"type": "text"}` | `{"type": "json_object"}` |
`{"type": "json_schema", "json_schema": {"name", "description"?, "schema", "strict"?}}` (docs/formats.md §5;
openai-python `src/openai/types/shared_params/response_format_json_schema.py`). This module turns the two JSON
kinds into a token-level constraint that the decode loop applies at every step:

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

Policy (fail closed). `check_schema` accepts a schema only if every keyword in it, anywhere (including unused
`$defs`), is either enforced token-by-token by llguidance or a pure annotation; everything else is a
SchemaError (HTTP 400), never silently ignored. `SUPPORTED_KEYWORDS`, `ANNOTATION_KEYWORDS` and
`REJECTED_KEYWORDS` below list them with the reason for each rejection; every rejection and every enforced
keyword is tested.

OpenAI's `strict` flag: accepted and ignored — every `json_schema` is enforced, strict or not, and we do not
require OpenAI's strict-mode subset (`additionalProperties: false` everywhere, every property required): any
schema that passes `check_schema` is enforced exactly as written (top-level type need not be an object).

Departures from JSON Schema semantics, all of which only *narrow* what is generated (the output still
validates):
- Object properties come in the order of `properties` (then `required`, then additional/pattern properties).
- An object with `properties` and no `additionalProperties` gets no other keys (as in OpenAI's strict mode and
  xgrammar's default; see `_rewrite_formats` for when this is not applied): a small model otherwise keeps
  inventing keys until max_tokens.
- The value is written on one line, compact (`{"a":1,"b":[1,2]}`) or in Python's `json.dumps` style
  (`{"a": 1, "b": [1, 2]}`): the only whitespace allowed is one optional space after `:` and `,`
  (`KEY_SEPARATOR`, `ITEM_SEPARATOR`); none before or after the value, so generation ends right after the
  top-level value and there is no whitespace runaway (a known failure of small models under JSON constraints).
  It also makes structure predictable, so more of it is forced (`Constraint.forced`) instead of sampled:
  for `{"answer": ...}` the forced bytes are `{"answer":`.
- Strings use no `\\uXXXX` escapes except for U+0000..U+001F (which have no other spelling); `\\d`/`\\w` in
  `pattern` are ASCII, as in ECMA-262.
- Numbers under `minimum`/`maximum`/`multipleOf` are written without exponents; `integer` never as `1.0`.
- `format` `date`, `date-time` and `time` are generated as the subset of RFC 3339 that Python's `datetime` and
  jsonschema accept: real calendar dates (leap years included), years 0001-9999, seconds 00-59 (no leap
  second), at most 9 fraction digits, upper-case `T`/`Z`. (llguidance's own regexes allow 2023-02-29, year
  0000, second 60 and lower-case `t`/`z`.)
- Keys matched by `additionalProperties`/`patternProperties` are not checked for uniqueness by llguidance
  (`{"b": 1, "b": 2}` can be generated; JSON parsers keep the last value, which is valid). This is why
  `minProperties` is rejected: duplicates would collapse below the minimum after parsing.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from typing import Any

import jsonschema
import llguidance
import numpy as np

from gateway import patterns
from gateway.json_schema import DATE_REGEX, DATE_TIME_REGEX, TIME_REGEX
from gateway.lru import ByteLRU, text_size

__all__ = [
    "ANNOTATION_KEYWORDS",
    "Constraint",
    "ConstraintError",
    "REJECTED_KEYWORDS",
    "SUPPORTED_FORMATS",
    "SUPPORTED_KEYWORDS",
    "SchemaError",
    "ITEM_SEPARATOR",
    "KEY_SEPARATOR",
    "MAX_SCHEMA_CHARS",
    "build_tokenizer",
    "check_schema",
    "grammar_cache_info",
    "grammar_for_json_object",
    "grammar_for_json_schema",
    "grammar_for_response_format",
    "clear_grammar_cache",
]

# ------------------------------------------------------------------------------------------------------------
# Keyword policy
# ------------------------------------------------------------------------------------------------------------

#: Keywords llguidance 1.9 enforces while generating (verified by the sampler tests for each one).
SUPPORTED_KEYWORDS: frozenset[str] = frozenset({
    # core / applicators
    "type", "enum", "const", "anyOf", "allOf", "oneOf", "$ref", "$defs", "definitions",
    # objects
    "properties", "required", "additionalProperties", "patternProperties", "maxProperties",
    # arrays ("items" as an array and "additionalItems" only where the draft allows them: draft-07, 2019-09)
    "items", "prefixItems", "additionalItems", "minItems", "maxItems",
    # strings ("format": only SUPPORTED_FORMATS)
    "minLength", "maxLength", "pattern", "format",
    # numbers ("multipleOf": integer divisors only)
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})

#: Pure annotations: no effect on validity, accepted anywhere. (`$schema` and `$id` only at the root.)
ANNOTATION_KEYWORDS: frozenset[str] = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
    "$schema", "$id", "$anchor",
})

#: Keywords we know and refuse, with the reason (the SchemaError message says "cannot be enforced").
#: Any other keyword not in SUPPORTED_KEYWORDS/ANNOTATION_KEYWORDS (a typo, `nullable`, `x-guidance`, ...) is
#: refused too: an unknown keyword may carry intent we would silently drop.
REJECTED_KEYWORDS: dict[str, str] = {
    "uniqueItems": "llguidance rejects it as unimplemented",
    "contains": "llguidance rejects it as unimplemented",
    "minContains": "llguidance rejects it as unimplemented",
    "maxContains": "llguidance rejects it as unimplemented",
    "not": "llguidance rejects it as unimplemented",
    "if": "llguidance rejects it as unimplemented",
    "then": "llguidance rejects it as unimplemented",
    "else": "llguidance rejects it as unimplemented",
    "dependentSchemas": "llguidance rejects it as unimplemented",
    "dependentRequired": "llguidance rejects it as unimplemented",
    "dependencies": "llguidance rejects it as unimplemented",
    "propertyNames": "llguidance rejects it as unimplemented",
    "unevaluatedProperties": "llguidance rejects it as unimplemented",
    "unevaluatedItems": "llguidance rejects it as unimplemented",
    "$dynamicRef": "llguidance rejects it as unimplemented",
    "$dynamicAnchor": "llguidance rejects it as unimplemented",
    "$recursiveRef": "llguidance rejects it as unimplemented",
    "$recursiveAnchor": "llguidance rejects it as unimplemented",
    "$vocabulary": "meta-schemas only; llguidance ignores it",
    "minProperties": "llguidance counts generated keys, but does not keep additional keys unique, so "
                     "duplicates can collapse below the minimum after parsing",
    "contentSchema": "llguidance ignores it",
    "contentMediaType": "llguidance ignores it",
    "contentEncoding": "llguidance ignores it",
    "nullable": "not JSON Schema (OpenAPI 3.0); llguidance ignores it — use a type list "
                "[\"string\", \"null\"]",
    "discriminator": "not JSON Schema (OpenAPI); llguidance ignores it",
    "x-guidance": "engine options are chosen by the server",
}

#: `format` values we enforce (and have an independent checker for in the tests). llguidance also knows
#: hostname, duration and uri, but we have no independent validator to prove them, so they are refused.
SUPPORTED_FORMATS: frozenset[str] = frozenset({"date", "date-time", "time", "email", "uuid", "ipv4", "ipv6"})

#: `$schema` values accepted (the draft decides how `items`-as-array and `definitions` are read).
_DRAFTS = {
    "https://json-schema.org/draft/2020-12/schema": jsonschema.Draft202012Validator,
    "https://json-schema.org/draft/2019-09/schema": jsonschema.Draft201909Validator,
    "http://json-schema.org/draft-07/schema": jsonschema.Draft7Validator,
}

# Subschema positions, for walking: keyword -> how its value holds schemas.
_SCHEMA_MAP = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_SCHEMA_ONE = {"additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems", "contentSchema"}
_SCHEMA_LIST = {"anyOf", "oneOf", "allOf", "prefixItems"}  # and "items" when it is a list

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

# RFC 3339 subsets that Python's datetime/jsonschema accept (gateway/json_schema.py).
_FORMAT_PATTERNS = {
    "date": "^" + DATE_REGEX + "$",
    "time": "^" + TIME_REGEX + "$",
    "date-time": "^" + DATE_TIME_REGEX + "$",
}


class SchemaError(ValueError):
    """A response_format schema we refuse: malformed, or using a keyword we cannot enforce.

    Attributes:
      message: the full text, e.g. "response_format.json_schema: keyword 'uniqueItems' at /properties/tags
        cannot be enforced (...)"; also `str(err)`.
      keyword: the offending keyword (e.g. "uniqueItems", "format", "$schema"), or None when no single keyword
        is to blame (e.g. an unsatisfiable schema).
      path: JSON pointer of the subschema holding it, "" for the root.
    """

    def __init__(self, message: str, keyword: str | None = None, path: str = ""):
        super().__init__(message)
        self.message, self.keyword, self.path = message, keyword, path


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
# Schema checks
# ------------------------------------------------------------------------------------------------------------


def _ptr(parts: list[Any]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _where(path: str) -> str:
    return path or "/"


def _subschemas(schema: Any, parts: list[Any]):
    """Yield (json-pointer parts, subschema dict) for every object subschema, pre-order, in document order."""
    if not isinstance(schema, dict):
        return
    yield parts, schema
    for key, value in schema.items():
        if key in _SCHEMA_MAP and isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, parts + [key, name])
        elif key in _SCHEMA_ONE or (key == "items" and not isinstance(value, list)):
            yield from _subschemas(value, parts + [key])
        elif key in _SCHEMA_LIST or (key == "items" and isinstance(value, list)):
            if isinstance(value, list):
                for i, sub in enumerate(value):
                    yield from _subschemas(sub, parts + [key, i])


def _validator_class(schema: dict, where: str):
    uri = schema.get("$schema")
    if uri is None:
        return jsonschema.Draft202012Validator
    norm = uri.rstrip("#") if isinstance(uri, str) else None
    if norm not in _DRAFTS:
        raise SchemaError(f"{where}: keyword '$schema' at / names an unsupported draft {uri!r} "
                          f"(use 2020-12, 2019-09 or draft-07)", "$schema", "")
    return _DRAFTS[norm]


def _static_check(schema: Any, where: str) -> None:
    """Meta-schema validation, then the keyword walk. Raises SchemaError."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{where}: the schema must be a JSON object, got {type(schema).__name__}", None, "")
    cls = _validator_class(schema, where)
    # (a) malformed: validate against the draft's meta-schema. Its format checker compiles every `pattern` as
    # `format: regex` - in llguidance's dialect, within its budget (gateway/patterns.py), never with Python's `re`.
    meta, formats = patterns.validator_class(cls)
    err = jsonschema.exceptions.best_match(meta(cls.META_SCHEMA, format_checker=formats).iter_errors(schema))
    if err is not None:
        path = list(err.absolute_path)
        keyword = str(path[-1]) if path and isinstance(path[-1], str) else None
        holder = _ptr(path[:-1]) if keyword is not None else _ptr(path)
        if err.validator == "format" and err.validator_value == "regex" and isinstance(err.instance, str):
            try:
                patterns.check(err.instance)
            except patterns.PatternError as bad:
                if bad.kind != "malformed":  # a regex, but not one llguidance can enforce
                    shown = f"keyword '{keyword}'" if keyword else "a regex"
                    raise SchemaError(f"{where}: {shown} at {_where(holder)} cannot be enforced: {bad}", keyword,
                                      holder) from None
        shown = f"keyword '{keyword}' at {_where(holder)}" if keyword else f"the schema at {_where(holder)}"
        raise SchemaError(f"{where}: malformed schema: {shown}: {err.message}", keyword, holder)
    # (b) every keyword enforced or an annotation.
    for parts, sub in _subschemas(schema, []):
        path = _ptr(parts)
        for key, value in sub.items():
            if key in ("$schema", "$id") and parts:
                raise SchemaError(f"{where}: keyword '{key}' at {_where(path)} cannot be enforced "
                                  f"(only allowed at the root)", key, path)
            if key in ANNOTATION_KEYWORDS:
                continue
            if key not in SUPPORTED_KEYWORDS:
                why = REJECTED_KEYWORDS.get(key, "unknown keyword")
                raise SchemaError(f"{where}: keyword '{key}' at {_where(path)} cannot be enforced ({why})",
                                  key, path)
            if key == "format" and value not in SUPPORTED_FORMATS:
                raise SchemaError(f"{where}: keyword 'format' at {_where(path)} cannot be enforced for "
                                  f"{value!r} (supported: {', '.join(sorted(SUPPORTED_FORMATS))})",
                                  "format", path)
            if key == "multipleOf" and not (isinstance(value, int) and not isinstance(value, bool)):
                raise SchemaError(f"{where}: keyword 'multipleOf' at {_where(path)} cannot be enforced for "
                                  f"{value!r} (only integer divisors: fractional ones disagree with binary "
                                  f"floating-point validators)", "multipleOf", path)
            if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
                raise SchemaError(f"{where}: keyword '$ref' at {_where(path)} cannot be enforced for "
                                  f"{value!r} (only references inside the schema, '#...')", "$ref", path)


def _rewrite_formats(schema: Any, in_all_of: bool = False) -> Any:
    """A copy of `schema` as we compile it: format date/date-time/time replaced by our stricter RFC 3339 patterns,
    and objects closed: an object node with `properties` but no `additionalProperties`/`patternProperties` gets
    `additionalProperties: false` (what OpenAI's strict mode and xgrammar's default do), unless combinators or an
    `allOf` could add properties to it or one of its `required` names is not among its properties. Without this a
    model may keep inventing keys (valid, but a runaway); the output still validates against the original."""
    if isinstance(schema, list):
        return [_rewrite_formats(s, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAP and isinstance(value, dict):
            out[key] = {k: _rewrite_formats(v) for k, v in value.items()}
        elif key in _SCHEMA_ONE or key in _SCHEMA_LIST or key == "items":
            out[key] = _rewrite_formats(value, in_all_of=key == "allOf")
        else:
            out[key] = value
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in _FORMAT_PATTERNS:
        del out["format"]
        if "pattern" in out:  # both must hold: intersect through allOf (llguidance ANDs the two regexes)
            out["allOf"] = list(out.get("allOf", [])) + [{"pattern": _FORMAT_PATTERNS[fmt]}]
        else:
            out["pattern"] = _FORMAT_PATTERNS[fmt]
    props = out.get("properties")
    open_keys = {"additionalProperties", "patternProperties", "allOf", "anyOf", "oneOf", "$ref",
                 "unevaluatedProperties"}
    if (isinstance(props, dict) and not in_all_of and not open_keys & out.keys()
            and all(name in props for name in out.get("required", []) if isinstance(name, str))):
        out["additionalProperties"] = False
    return out


def _llg_error_keyword(msg: str) -> str | None:
    for needle, keyword in (("patternProperty", "patternProperties"), ("oneOf", "oneOf"),
                            ("regex", "pattern"), ("format", "format"), ("Properties", "maxProperties"),
                            ("$ref", "$ref"), ("circular", "$ref"), ("Resource", "$ref"),
                            ("Pointer", "$ref")):
        if needle in msg:
            return keyword
    return None


# ------------------------------------------------------------------------------------------------------------
# Grammar cache
# ------------------------------------------------------------------------------------------------------------

#: Largest schema accepted, in characters of compact JSON (the gateway's MAX_SCHEMA_BYTES is checked first).
MAX_SCHEMA_CHARS = 1 << 20
#: llguidance's budgets for a client grammar (its defaults, with error messages that do not echo the grammar):
#: lexer fuel to build it and per token, Earley items per token and per grammar row, lexer states, grammar
#: symbols; each bounds the time a grammar may take (figures: docs/performance.md). A grammar that needs more is
#: an error; see `Constraint`.
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
    _static_check(schema, where)
    with _cache_lock:
        _stats["compiles"] += 1
    grammar = llguidance.LLMatcher.grammar_from_json_schema(_rewrite_formats(schema), overrides=_LLG_OPTIONS)
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
    loop may prefer `asyncio.to_thread` (figures: docs/performance.md).

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


# ------------------------------------------------------------------------------------------------------------
# Per-request constraint
# ------------------------------------------------------------------------------------------------------------

# Compiled matchers in their initial state, keyed by (tokenizer id, grammar); a request gets a deep_copy, much
# cheaper than a compile (figures: docs/performance.md). The tokenizer is held in the entry so its id stays unique.
_templates: ByteLRU[tuple[int, str], tuple[Any, Any]] = ByteLRU(
    GRAMMAR_CACHE_BYTES, lambda key, entry: text_size(key[1]) + _MATCHER_OVERHEAD)


def _matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    key = (id(tokenizer), grammar)
    entry = _templates.get(key)
    if entry is not None and entry[0] is tokenizer:
        return entry[1].deep_copy()
    template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    if template.is_error():
        raise ConstraintError(f"the grammar does not compile: {_first_line(template.get_error())}")
    _templates.put(key, (tokenizer, template))
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
            gateway/tool_calls.py end with `<[106]>` or `<[50]>`): stop ids are then masked and consumed by the
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

    def text(self) -> str:
        """The text of the tokens advanced so far (stop token excluded)."""
        return self._tok.decode_str(self._tokens)

    # -- updates ---------------------------------------------------------------------------------------------

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
