"""JSON Schema facts shared by the gateway's two schema compilers — `response_format` (gateway/structured/schema_check.py
and gateway/structured/grammar_cache.py, through llguidance's JSON compiler) and tool parameters (gateway/structured/tools/tool_calls.py,
gateway/structured/tools/tool_schema.py and the families' gateway parts, in each family's call syntax) — so both find
subschemas in the same places and generate exactly the same values for a `format`.

- Where subschemas sit: `SUBSCHEMA_KEYWORDS` (keyword -> how its value holds them), walked by `subschemas`
  (pre-order, for checks) and `rewrite` (a bottom-up copy, for the schemas we compile).
- Formats: `FORMAT_REGEXES` (format -> unanchored regex) and `format_as_pattern`, the rule that turns a
  `format` into a `pattern` that a regex engine enforces.

`format` `date`, `time` and `date-time` are the subset of RFC 3339 that Python's `datetime` and jsonschema
accept: real calendar dates (Feb 29 only in leap years), years 0001-9999, seconds 00-59 (no leap second), at
most 9 fraction digits, upper-case `T`/`Z`. (llguidance's own regexes allow 2023-02-29, year 0000, second 60
and lower-case `t`/`z`.) The regexes are unanchored (Rust `regex` syntax, which Python's `re` also reads).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Literal

__all__ = [
    "DATE_REGEX",
    "DATE_TIME_REGEX",
    "FORMAT_REGEXES",
    "SUBSCHEMA_KEYWORDS",
    "TIME_REGEX",
    "format_as_pattern",
    "rewrite",
    "subschemas",
]

# ---------------------------------------------------------------------------------------------------- formats

_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"

DATE_REGEX = (r"(?:" + _YEAR + r"-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
              r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))|" + _LEAP_YEAR + r"-02-29)")
"""An RFC 3339 full-date Python's `date.fromisoformat` accepts (leap years by the Gregorian rule)."""

TIME_REGEX = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?"
              r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
"""An RFC 3339 full-time with an offset, no leap second."""

DATE_TIME_REGEX = DATE_REGEX + "T" + TIME_REGEX
"""An RFC 3339 date-time (upper-case `T`)."""

_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"

FORMAT_REGEXES: Mapping[str, str] = {
    "date": DATE_REGEX,
    "time": TIME_REGEX,
    "date-time": DATE_TIME_REGEX,
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": "[A-Za-z0-9._%+\\-]{1,64}@[A-Za-z0-9\\-]{1,63}(?:\\.[A-Za-z0-9\\-]{1,63}){1,8}",
    "ipv4": f"(?:{_OCTET}\\.){{3}}{_OCTET}",
}
"""String `format` -> the unanchored regex of the strings we generate for it. Tool parameters support exactly
these formats (every tool format writes the same strings); `response_format` uses the date and time ones and
leaves its other formats to llguidance (gateway/structured/schema_check.py)."""


def format_as_pattern(node: dict, fmt: str, grouped: bool = False) -> dict:
    """Replace `node`'s `format` by the anchored pattern of `FORMAT_REGEXES[fmt]`, so a regex enforces it.

    The pattern becomes `node["pattern"]`; when the node already has a `pattern`, both must hold, so it is
    added as one more `allOf` member `{"pattern": ...}` instead (llguidance ANDs the two regexes).

    Args:
      node: a schema object being rewritten (changed in place); its `format`, if still there, is removed.
      fmt: a key of FORMAT_REGEXES.
      grouped: anchor as `^(?:R)$` rather than `^R$`. Both match the same strings (no regex in the table has a
        top-level `|`); the Gemma 3 tool schemas use the grouped spelling and `response_format` the other,
        each keeping its own so that the schemas compiled (and their cache keys) stay byte for byte the same.

    Returns:
      `node`.

    Raises:
      KeyError: `fmt` is not in FORMAT_REGEXES.
    """
    regex = FORMAT_REGEXES[fmt]
    pattern = f"^(?:{regex})$" if grouped else f"^{regex}$"
    node.pop("format", None)
    if "pattern" in node:
        node["allOf"] = [*node.get("allOf", []), {"pattern": pattern}]
    else:
        node["pattern"] = pattern
    return node


# ---------------------------------------------------------------------------------------------------- walking

Holds = Literal["map", "schema", "list", "schema-or-list"]
"""How a keyword's value holds subschemas: a map of name -> schema, one schema, a list of schemas, or either
of the last two (`items`: a schema, or in draft-07/2019-09 a list)."""

SUBSCHEMA_KEYWORDS: Mapping[str, Holds] = {
    **dict.fromkeys(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"), "map"),
    **dict.fromkeys(("additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
                     "propertyNames", "unevaluatedProperties", "unevaluatedItems", "contentSchema"),
                    "schema"),
    **dict.fromkeys(("anyOf", "oneOf", "allOf", "prefixItems"), "list"),
    "items": "schema-or-list",
}
"""Every JSON Schema keyword (drafts 7 to 2020-12) whose value holds subschemas, and how it holds them."""

Parts = list[str | int]
"""The JSON-pointer parts of a subschema (keywords, property names, list indices); [] for the root."""


def subschemas(schema: Any) -> Iterator[tuple[Parts, dict]]:
    """Every object subschema of `schema` with its pointer parts, pre-order, in document order: for checks
    that must see every keyword anywhere (unused `$defs` included).

    Positions follow SUBSCHEMA_KEYWORDS. A value of the wrong shape for its keyword (a map keyword's
    non-object, a list keyword's non-list, a list where one schema belongs) is not entered, and boolean
    schemas are not yielded. Raises nothing.

    Yields:
      (parts, subschema dict), starting with ([], schema) when `schema` is a dict.
    """
    yield from _subschemas(schema, [])


def _subschemas(schema: Any, parts: Parts) -> Iterator[tuple[Parts, dict]]:
    if not isinstance(schema, dict):
        return
    yield parts, schema
    for key, value in schema.items():
        if key in SUBSCHEMA_KEYWORDS:
            for tail, sub in _held(SUBSCHEMA_KEYWORDS[key], value):
                yield from _subschemas(sub, [*parts, key, *tail])


def _held(holds: Holds, value: Any) -> Iterator[tuple[Parts, Any]]:
    """(parts below the keyword, value) of each subschema a keyword's `value` holds, if of the right shape."""
    if holds == "map":
        if isinstance(value, dict):
            yield from (([name], sub) for name, sub in value.items())
    elif isinstance(value, list):
        if holds != "schema":
            yield from (([i], sub) for i, sub in enumerate(value))
    elif holds != "list":
        yield [], value


Finish = Callable[[dict, dict, "str | None"], dict]
"""`finish(original node, rewritten copy, parent keyword)` -> the node's final form (see `rewrite`)."""


def rewrite(schema: Any, finish: Finish, keywords: Collection[str] = SUBSCHEMA_KEYWORDS) -> Any:
    """A copy of `schema` rewritten bottom-up (the schema we compile from a client's): each object node is
    copied with its subschemas already rewritten, then `finish(original, copy, parent)` gives its final form
    (it may change the copy in place and return it). `parent` is the keyword whose value holds the node
    ("properties" for a property's schema, "allOf" for an `allOf` member), None for the root.

    Args:
      schema: a JSON Schema (any JSON value; a list is rewritten element by element).
      finish: as above.
      keywords: the keywords of SUBSCHEMA_KEYWORDS to descend into; the others' values are copied as they are.
        Tool parameters pass only those their subset allows (gateway/structured/tools/tool_calls.py), so that nothing inside a
        keyword the tool checks reject is rewritten.

    Returns:
      The copy (`schema` itself is not changed). A subschema keyword's value is rewritten whatever its shape
      (a list element by element, a non-object as it is), except a map keyword's, entered only when an object.

    Raises:
      Whatever `finish` raises.
    """
    return _rewrite(schema, finish, keywords, None)


def _rewrite(value: Any, finish: Finish, keywords: Collection[str], parent: str | None) -> Any:
    if isinstance(value, list):
        return [_rewrite(v, finish, keywords, parent) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, sub in value.items():
        holds = SUBSCHEMA_KEYWORDS.get(key) if key in keywords else None
        if holds == "map" and isinstance(sub, dict):
            out[key] = {name: _rewrite(s, finish, keywords, key) for name, s in sub.items()}
        elif holds is not None and holds != "map":
            out[key] = _rewrite(sub, finish, keywords, key)
        else:
            out[key] = sub
    return finish(value, out, parent)
