"""The JSON-Schema policy of `response_format`: which keywords we enforce, and the schema we actually compile.

Holds the keyword policy (`SUPPORTED_KEYWORDS`, `ANNOTATION_KEYWORDS`, `REJECTED_KEYWORDS`,
`SUPPORTED_FORMATS`), `SchemaError`, the static check (`static_check`: meta-schema, then every keyword) and
the rewrite applied before a schema is compiled (`rewrite_formats`). It is apart from the compiler and its cache
(gateway/structured/grammar_cache.py) and from the per-request matcher (gateway/structured/constraints.py) because it is pure policy
over a JSON value: no llguidance, no state. Callers go through `gateway.structured.grammar_cache.check_schema` (or
`grammar_for_json_schema`), which runs these checks, then compiles and caches. (Tool parameters have their own
checks: gateway/structured/tools/tool_calls.py.)

Policy (fail closed). A schema is accepted only if every keyword in it, anywhere (including unused `$defs`), is
either enforced token-by-token by llguidance or a pure annotation; everything else is a SchemaError (HTTP 400),
never silently ignored. The keyword sets below list them with the reason for each rejection; every rejection and
every enforced keyword is tested.

OpenAI's `strict` flag: accepted and ignored — every `json_schema` is enforced, strict or not, and we do not
require OpenAI's strict-mode subset (`additionalProperties: false` everywhere, every property required): any
schema that passes the checks is enforced exactly as written (top-level type need not be an object).

Departures from JSON Schema semantics made by the rewrite (the output still validates against the original
schema; those due to llguidance's options are listed in gateway/structured/grammar_cache.py):
- An object with `properties` and no `additionalProperties` gets no other keys (as in OpenAI's strict mode and
  xgrammar's default; see `rewrite_formats` for when this is not applied): a small model otherwise keeps
  inventing keys until max_tokens.
- `format` `date`, `date-time` and `time` are generated as the subset of RFC 3339 that Python's `datetime` and
  jsonschema accept: real calendar dates (leap years included), years 0001-9999, seconds 00-59 (no leap
  second), at most 9 fraction digits, upper-case `T`/`Z`. (llguidance's own regexes allow 2023-02-29, year
  0000, second 60 and lower-case `t`/`z`.)
- Keys matched by `additionalProperties`/`patternProperties` are not checked for uniqueness by llguidance
  (`{"b": 1, "b": 2}` can be generated; JSON parsers keep the last value, which is valid). This is why
  `minProperties` is rejected: duplicates would collapse below the minimum after parsing.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from gateway.structured import patterns
from gateway.structured.json_schema import format_as_pattern, rewrite, subschemas

__all__ = [
    "ANNOTATION_KEYWORDS",
    "REJECTED_KEYWORDS",
    "SUPPORTED_FORMATS",
    "SUPPORTED_KEYWORDS",
    "SchemaError",
    "rewrite_formats",
    "static_check",
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

#: The SUPPORTED_FORMATS generated from our own patterns (the RFC 3339 subsets of gateway/structured/json_schema.py); the
#: others are left to llguidance's.
_PATTERN_FORMATS = frozenset({"date", "date-time", "time"})

#: Keywords that may give an object node more properties than its `properties` (it is then not closed).
_OPEN_KEYS = frozenset({"additionalProperties", "patternProperties", "allOf", "anyOf", "oneOf", "$ref",
                        "unevaluatedProperties"})


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


# ------------------------------------------------------------------------------------------------------------
# Schema checks
# ------------------------------------------------------------------------------------------------------------


def _ptr(parts: list[Any]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _where(path: str) -> str:
    return path or "/"


def _validator_class(schema: dict, where: str):
    uri = schema.get("$schema")
    if uri is None:
        return jsonschema.Draft202012Validator
    norm = uri.rstrip("#") if isinstance(uri, str) else None
    if norm not in _DRAFTS:
        raise SchemaError(f"{where}: keyword '$schema' at / names an unsupported draft {uri!r} "
                          f"(use 2020-12, 2019-09 or draft-07)", "$schema", "")
    return _DRAFTS[norm]


def static_check(schema: Any, where: str) -> None:
    """Fail closed before compiling: (a) meta-schema validation, then (b) the keyword walk.

    (a) `schema` must be a JSON object valid against its draft's meta-schema (2020-12 by default; `$schema` may
    name 2019-09 or draft-07), every `pattern` compiling in llguidance's dialect (gateway/structured/patterns.py). (b) Every
    keyword anywhere in it is in SUPPORTED_KEYWORDS or ANNOTATION_KEYWORDS (`format` only SUPPORTED_FORMATS,
    `multipleOf` only integers, `$ref` only "#...", `$schema`/`$id` only at the root). What llguidance itself
    rejects is found later, when the schema is compiled (gateway/structured/grammar_cache.py).

    Args:
      schema: the JSON Schema as parsed JSON.
      where: prefix for error messages (e.g. "response_format.json_schema").

    Raises:
      SchemaError: naming the keyword and the JSON pointer of the subschema that holds it.
    """
    if not isinstance(schema, dict):
        raise SchemaError(f"{where}: the schema must be a JSON object, got {type(schema).__name__}", None, "")
    cls = _validator_class(schema, where)
    # (a) malformed: validate against the draft's meta-schema. Its format checker compiles every `pattern` as
    # `format: regex` - in llguidance's dialect, within its budget (gateway/structured/patterns.py), never with Python's `re`.
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
    for parts, sub in subschemas(schema):
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


def rewrite_formats(schema: Any) -> Any:
    """A copy of `schema` as we compile it: format date/date-time/time replaced by our stricter RFC 3339 patterns,
    and objects closed: an object node with `properties` but no `additionalProperties`/`patternProperties` gets
    `additionalProperties: false` (what OpenAI's strict mode and xgrammar's default do), unless combinators or an
    `allOf` could add properties to it or one of its `required` names is not among its properties. Without this a
    model may keep inventing keys (valid, but a runaway); the output still validates against the original.

    Args:
      schema: a schema that passed `static_check`.

    Returns:
      The rewritten copy; `schema` is not changed.
    """
    return rewrite(schema, _compiled_node)


def _compiled_node(schema: dict, out: dict, parent: str | None) -> dict:
    """`rewrite_formats` for one node (`out`, its subschemas done); `parent` "allOf": a member of an `allOf`,
    whose siblings may add properties, so it is not closed."""
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in _PATTERN_FORMATS:
        format_as_pattern(out, fmt)
    props = out.get("properties")
    if (isinstance(props, dict) and parent != "allOf" and not _OPEN_KEYS & out.keys()
            and all(name in props for name in out.get("required", []) if isinstance(name, str))):
        out["additionalProperties"] = False
    return out
