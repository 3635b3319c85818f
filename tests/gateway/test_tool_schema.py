"""gateway/structured/tools/tool_schema.py: a tool's `parameters` JSON Schema checked against the supported subset and
translated into Lark rules (`SchemaRules`, `ValueGrammar`, `check_parameters`).

References, independent of the module: `jsonschema` (Draft 2020-12 with its format checker) says which values
a schema allows; llguidance (the grammar engine the gateway masks with) says which values a produced grammar
accepts, first checking that the grammar compiles (`LLMatcher.validate_grammar`, as
gateway/structured/tools/tool_calls.py `checked_grammar` does). Values are written in Gemma 4's call syntax by a small
writer here (`_gemma`: bare keys in Jinja `dictsort` order, strings between the `<|"|>` control token, numbers as Python
prints them), and fed to a matcher over a byte-level vocabulary (ids 0-255 the bytes, 256 an end token, 257 the string
delimiter), so no model tokenizer is needed. The documented departures from JSON Schema
(gateway/structured/tools/tool_calls.py, "JSON Schema support") are tested as such: only declared keys are produced,
free-form keys are identifiers, `format`s are generated as `gateway.structured.json_schema.FORMAT_REGEXES` spells them.
"""

from __future__ import annotations

import functools
import math
import re

import jsonschema
import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.structured.json_schema import FORMAT_REGEXES
from gateway.structured.tools.tool_calls import ToolSchemaError
from gateway.structured.tools.tool_schema import SchemaRules, ValueGrammar, check_parameters

END, STRING = 256, 257


class _ByteVocabulary:
    """A `TokenizerWrapper` source: the 256 bytes, an end token and the string delimiter `<|"|>`."""

    eos_token_id = END
    bos_token_id = None
    tokens = (*(bytes([b]) for b in range(256)), b"<end>", b'<|"|>')
    special_token_ids = (END, STRING)

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@functools.cache
def _tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()), slices=[])


def _grammar(parameters: dict, tool: str = "f") -> str:
    """The grammar of the tool's arguments (start = the arguments object), checked to compile."""
    g = ValueGrammar(STRING)
    start = SchemaRules(g, tool, parameters, "t0_").parameters()
    grammar = f"start: {start}\n{g.text()}"
    assert llguidance.LLMatcher.validate_grammar(grammar) == "", grammar
    return grammar


@functools.cache
def _template(grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(_tokenizer(), grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _gemma(value) -> list[int]:
    """A JSON value in Gemma 4's call syntax, as token ids of the byte vocabulary."""
    if value is None or isinstance(value, bool):
        return list({None: b"null", True: b"true", False: b"false"}[value])
    if isinstance(value, int):
        return list(str(value).encode())
    if isinstance(value, float):
        return list(repr(value).encode())
    if isinstance(value, str):
        return [STRING, *value.encode(), STRING]
    if isinstance(value, list):
        out = [ord("[")]
        for i, item in enumerate(value):
            out += ([ord(",")] if i else []) + _gemma(item)
        return [*out, ord("]")]
    out = [ord("{")]
    for i, (key, item) in enumerate(sorted(value.items(), key=lambda kv: kv[0].lower())):
        out += ([ord(",")] if i else []) + list(f"{key}:".encode()) + _gemma(item)
    return [*out, ord("}")]


def _accepts(grammar: str, value) -> bool:
    """Whether the grammar accepts `value` (an arguments object) as a complete answer."""
    matcher = _template(grammar).deep_copy()
    return all(matcher.consume_token(t) for t in _gemma(value)) and matcher.is_accepting()


def _valid(schema: dict, value) -> bool:
    validator = jsonschema.Draft202012Validator
    return validator(schema, format_checker=validator.FORMAT_CHECKER).is_valid(value)


def _wrap(schema, defs: dict | None = None) -> dict:
    """Tool parameters with one required property `v` holding `schema` (and `$defs` at the root)."""
    parameters = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    return {**parameters, "$defs": defs} if defs else parameters


def _error(parameters) -> ToolSchemaError:
    with pytest.raises(ToolSchemaError) as err:
        SchemaRules(ValueGrammar(STRING), "f", parameters, "t0_").parameters()
    with pytest.raises(ToolSchemaError) as same:
        check_parameters("f", parameters)
    assert (same.value.keyword, same.value.path) == (err.value.keyword, err.value.path)
    return err.value


# ---------------------------------------------------------------------------- accepted values == valid values

NODE = {"type": "object", "properties": {"name": {"type": "string"},
                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["name"]}
OBJ3 = {"type": "object", "required": ["b"], "additionalProperties": False,
        "properties": {"b": {"type": "string"}, "a": {"type": "integer"}, "C": {"type": "boolean"}}}
OBJ2 = {"type": "object", "additionalProperties": False,
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
ANNOTATED = {"type": "integer", "title": "T", "description": "d", "default": 1, "examples": [2],
             "deprecated": False, "$comment": "c"}


def _case(name: str, schema, values: list, reference=None, defs: dict | None = None):
    """One schema of `v` and values for it; `reference`: its JSON Schema reading where it uses OpenAPI
    `nullable` (jsonschema does not know it)."""
    return pytest.param(schema, reference, defs, values, id=name)


CASES = [
    _case("string-length", {"type": "string", "minLength": 1, "maxLength": 3},
          ["", "a", "a\"}", "abcd", "éé", "東京都市", 1, None]),
    _case("integer-range", {"type": "integer", "minimum": -5, "maximum": 12},
          [-6, -5, 0, 7, 12, 13, 120, -50, 1.5, "3"]),
    _case("integer-exclusive", {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 7},
          [-3, -2, 0, 6, 7]),
    _case("integer-tighter-bound-wins",
          {"type": "integer", "minimum": 0, "exclusiveMinimum": 5, "maximum": 9, "exclusiveMaximum": 100},
          [0, 5, 6, 9, 10]),
    _case("number-range", {"type": "number", "minimum": -2, "maximum": 10},
          [-3, -2, -2.5, -1.5, 0, 0.25, 9.999, 10, 10.0, 10.5, 11, "1"]),
    _case("number-exclusive", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
          [0, 0.0, 0.0001, 0.5, 0.9999, 1, 1.0, -0.5]),
    _case("number-free", {"type": "number"}, [0, -7, 3.25, 123456789.5, 0.001, "x", None]),
    _case("boolean", {"type": "boolean"}, [True, False, None, 0, "true"]),
    _case("null", {"type": "null"}, [None, False, 0, ""]),
    _case("type-list", {"type": ["integer", "null"]}, [1, None, "1", 1.5, True]),
    _case("integer-and-number", {"type": ["number", "integer"], "maximum": 3}, [3, 2.5, -7, 3.5, 4, "x"]),
    _case("nullable", {"type": "string", "nullable": True}, ["x", None, 1], {"type": ["string", "null"]}),
    _case("enum-with-siblings", {"enum": ["a", "bb", "ccc", 1, None], "type": "string", "maxLength": 2},
          ["a", "bb", "ccc", 1, None, "d"]),
    _case("enum-number-bound", {"enum": [1, 5, 7.5, 10, "x"], "minimum": 5}, [1, 5, 7.5, 10, "x", 6]),
    _case("const", {"const": "on"}, ["on", "off", None, ""]),
    _case("const-nullable", {"const": 3, "nullable": True}, [3, None, 4, "3"], {"enum": [3, None]}),
    _case("array-bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
          [[], [1], [1, 2, 3], [1, 2, 3, 4], ["a"], [1, "a"], 1]),
    _case("array-unbounded", {"type": "array", "items": {"type": "string"}},
          [[], ["a"], ["a", "b", "c", "d", "e"], [1], [["a"]]]),
    _case("array-exactly-two", {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
          [[True], [True, False], [True, False, True]]),
    _case("array-items-false", {"type": "array", "items": False}, [[], [1], [None]]),
    _case("object-required-optional", OBJ3,
          [{"b": "x"}, {"a": 1, "b": "x"}, {"a": 1, "b": "x", "C": True}, {"b": "x", "C": False},
           {"a": 1}, {}, {"b": 1}, {"b": "x", "d": 1}, {"a": 1, "C": True}]),
    _case("object-all-optional", OBJ2, [{}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {"a": "x"}, {"c": 1}]),
    _case("object-empty-properties", {"type": "object", "properties": {}, "additionalProperties": False},
          [{}, {"a": 1}]),
    _case("free-form-typed-values", {"type": "object", "additionalProperties": {"type": "integer"}},
          [{}, {"x": 1, "y_2": -3}, {"x": "a"}, {"x": 1, "y": [1]}]),
    _case("any", {}, [1, -0.5, "a", None, True, [1, {"k": "v"}], {"k": [True, None]}]),
    _case("ref-recursive", {"$ref": "#/$defs/node"},
          [{"name": "a"}, {"name": "a", "kids": [{"name": "b", "kids": []}]}, {"kids": []},
           {"name": "a", "kids": [{"kids": []}]}, {"name": "a", "kids": [{"name": 1}]}], defs={"node": NODE}),
    _case("ref-nullable", {"$ref": "#/$defs/pos", "nullable": True}, [1, None, 0, "1"],
          {"anyOf": [{"$ref": "#/$defs/pos"}, {"type": "null"}]}, {"pos": {"type": "integer", "minimum": 1}}),
    _case("anyOf", {"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string", "maxLength": 1}]},
          [10, 9, "a", "ab", None]),
    _case("anyOf-nullable", {"anyOf": [{"type": "integer"}, {"type": "boolean"}], "nullable": True},
          [1, True, None, "x"], {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "null"}]}),
    _case("oneOf-different-types", {"oneOf": [{"type": "integer"}, {"type": "string", "minLength": 2}]},
          [1, "ab", "a", None, 1.5]),
    _case("allOf-single", {"allOf": [{"type": "integer", "maximum": 0}]}, [0, 1, -4]),
    _case("pattern-anchored", {"type": "string", "pattern": "^[a-z]+[0-9]?$"},
          ["abc", "abc1", "abc12", "1abc", "", "ab-c"]),
    _case("pattern-unanchored", {"type": "string", "pattern": "ab"}, ["ab", "xxaby", "ba", "a b", ""]),
    _case("pattern-with-length", {"type": "string", "pattern": "^a", "maxLength": 3},
          ["a", "abc", "abcd", "ba", ""]),
    _case("annotations-ignored", ANNOTATED, [1, "1"]),
]


@pytest.mark.parametrize("schema, reference, defs, values", CASES)
def test_the_grammar_accepts_exactly_the_values_the_schema_allows(schema, reference, defs, values):
    """Each value is accepted iff jsonschema finds it valid (both outcomes occur, except under `{}`)."""
    grammar = _grammar(_wrap(schema, defs))
    check_parameters("f", _wrap(schema, defs))
    expected = _wrap(schema if reference is None else reference, defs)
    outcomes = {}
    for value in values:
        valid = _valid(expected, {"v": value})
        outcomes[repr(value)] = valid
        assert _accepts(grammar, {"v": value}) == valid, (value, valid)
    assert len(set(outcomes.values())) == 2 or schema == {}, outcomes


def test_keys_are_written_in_dictsort_order_only():
    """Gemma 4's template writes keys sorted case-insensitively; the grammar allows no other order."""
    grammar = _grammar({"type": "object", "properties": {"B": {"type": "integer"}, "a": {"type": "integer"}}})
    assert _accepts(grammar, {"a": 1, "B": 2})
    matcher = _template(grammar).deep_copy()
    assert not all(matcher.consume_token(t) for t in b"{B:2,a:1}")


def test_only_declared_keys_are_produced_whatever_additional_properties_says():
    """A documented departure: extra keys are valid under `additionalProperties: true`, but never produced."""
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    assert _valid(parameters, {"a": 1, "b": 2}) and not _accepts(_grammar(parameters), {"a": 1, "b": 2})


def test_free_form_objects_take_identifier_keys_only():
    """A documented departure: an object without `properties` gets keys `[A-Za-z_][A-Za-z0-9_]*`."""
    grammar = _grammar(_wrap({"type": "object"}))
    assert _accepts(grammar, {"v": {"key_1": 1, "_x": {"y": []}}})
    assert _valid({"type": "object"}, {"a-b": 1}) and not _accepts(grammar, {"v": {"a-b": 1}})


@pytest.mark.parametrize("parameters", [{}, None])
def test_no_parameters_means_an_empty_arguments_object(parameters):
    g = ValueGrammar(STRING)
    assert SchemaRules(g, "f", parameters or {}, "t0_").parameters() == '"{}"'
    check_parameters("f", parameters)
    grammar = _grammar(parameters or {})
    assert _accepts(grammar, {}) and not _accepts(grammar, {"a": 1})


@pytest.mark.parametrize("value", [1.50, 2.0, 1e16, 1e-5, 0.0001, 0.1 + 0.2, 123456789012345.0])
def test_numbers_are_written_only_as_python_prints_them_in_fixed_notation(value):
    """Numbers are Python's repr in fixed notation with at most 15 significant digits and 1e-4 <= |x| < 1e15
    (tool_calls.NUMBER_REPR_REGEX); other spellings of a valid number are refused."""
    grammar = _grammar(_wrap({"type": "number"}))
    r = repr(value)
    ok = "e" not in r and len(r.replace(".", "").strip("0")) <= 15
    matcher = _template(grammar).deep_copy()
    written = [*b"{v:", *r.encode(), *b"}"]
    assert (all(matcher.consume_token(t) for t in written) and matcher.is_accepting()) == ok, r
    matcher = _template(grammar).deep_copy()
    assert not all(matcher.consume_token(t) for t in b"{v:1.50}")


# ----------------------------------------------------------------------------------------------- formats

FORMAT_SAMPLES = {
    "date": ["2024-02-29", "2023-02-29", "2024-13-01", "0000-01-01", "9999-12-31", "2024-1-01", "2024-04-31"],
    "time": ["23:59:59Z", "23:59:60Z", "12:00:00+01:00", "12:00:00", "12:00:00.123456789Z", "12:00:00z",
             "24:00:00Z", "12:00:00.1234567890Z"],
    "date-time": ["2024-01-02T03:04:05Z", "2024-01-02t03:04:05Z", "2024-01-02 03:04:05Z",
                  "2024-02-30T00:00:00+00:00", "2024-12-31T23:59:59.5-05:30"],
    "uuid": ["123e4567-e89b-12d3-a456-426614174000", "123E4567-E89B-12D3-A456-426614174000",
             "123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"],
    "email": ["a@b.co", "first.last+tag@example.org", "a@b", "@b.co", "a b@c.de", "a@@b.co"],
    "ipv4": ["192.168.0.1", "0.0.0.0", "255.255.255.255", "256.1.1.1", "01.1.1.1", "1.2.3"],
}


@pytest.mark.parametrize("fmt", sorted(FORMAT_REGEXES))
def test_a_format_accepts_exactly_the_strings_its_regex_spells(fmt):
    """Strings of a `format` are generated as FORMAT_REGEXES spells them; where jsonschema checks the format
    (date, uuid, email, ipv4), every accepted string is valid for it too."""
    assert fmt in FORMAT_SAMPLES
    schema = {"type": "string", "format": fmt}
    grammar = _grammar(_wrap(schema))
    checked = fmt in jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers
    outcomes = set()
    for text in FORMAT_SAMPLES[fmt]:
        spelled = re.fullmatch(FORMAT_REGEXES[fmt], text) is not None
        outcomes.add(spelled)
        assert _accepts(grammar, {"v": text}) == spelled, text
        if spelled and checked:
            assert _valid(schema, text), text
    assert outcomes == {True, False}


def test_a_format_and_a_pattern_must_both_hold():
    grammar = _grammar(_wrap({"type": "string", "format": "date", "pattern": "^2024-"}))
    assert _accepts(grammar, {"v": "2024-05-06"})
    assert not _accepts(grammar, {"v": "2023-05-06"}) and not _accepts(grammar, {"v": "2024-05-32"})


# ------------------------------------------------------------------------------------------ property tests


@st.composite
def _int_bounds(draw):
    bound = st.none() | st.integers(-10**6, 10**6)
    return {kw: v for kw, v in (("minimum", draw(bound)), ("maximum", draw(bound)),
                                ("exclusiveMinimum", draw(bound)), ("exclusiveMaximum", draw(bound)))
            if v is not None}


@settings(max_examples=60, deadline=None)
@given(bounds=_int_bounds(), data=st.data())
def test_integers_are_accepted_iff_within_their_bounds(bounds, data):
    """Any mix of inclusive and exclusive integer bounds: accepted iff jsonschema finds the integer in range;
    a range with no integer is a ToolSchemaError."""
    schema = {"type": "integer", **bounds}
    lo = max([bounds.get("minimum", -math.inf), bounds.get("exclusiveMinimum", -math.inf) + 1])
    hi = min([bounds.get("maximum", math.inf), bounds.get("exclusiveMaximum", math.inf) - 1])
    if lo > hi:
        assert _error(_wrap(schema)).keyword in ("minimum", "maximum")
        return
    grammar = _grammar(_wrap(schema))
    edges = [int(e) + d for e in (lo, hi) if math.isfinite(e) for d in (-1, 0, 1)]
    for x in [*edges, data.draw(st.integers(-2 * 10**6, 2 * 10**6)), data.draw(st.integers())]:
        assert _accepts(grammar, {"v": x}) == _valid(schema, x), (schema, x)


@settings(max_examples=40, deadline=None)
@given(lo=st.none() | st.integers(-300, 300), span=st.none() | st.integers(0, 400),
       exclusive=st.booleans(), hundredths=st.lists(st.integers(-100_000, 100_000), min_size=4, max_size=4))
def test_numbers_with_whole_bounds_are_accepted_iff_within_them(lo, span, exclusive, hundredths):
    """`number` with whole-number bounds: a value with up to two decimals (as Python prints it) is accepted
    iff in range."""
    bounds = {}
    if lo is not None:
        bounds["exclusiveMinimum" if exclusive else "minimum"] = lo
    if span is not None:
        bounds["exclusiveMaximum" if exclusive else "maximum"] = (lo or 0) + span + (1 if exclusive else 0)
    schema = {"type": "number", **bounds}
    grammar = _grammar(_wrap(schema))
    values = [k / 100 for k in hundredths] + [float(v) for v in bounds.values()] + list(bounds.values())
    for x in values:
        assert _accepts(grammar, {"v": x}) == _valid(schema, x), (schema, x)


@settings(max_examples=40, deadline=None)
@given(lo=st.integers(0, 4), extra=st.none() | st.integers(0, 4),
       texts=st.lists(st.text(max_size=9), min_size=3, max_size=3))
def test_strings_are_accepted_iff_their_length_in_characters_is_within_bounds(lo, extra, texts):
    schema = {"type": "string", "minLength": lo, **({} if extra is None else {"maxLength": lo + extra})}
    grammar = _grammar(_wrap(schema))
    for text in texts:
        assert _accepts(grammar, {"v": text}) == _valid(schema, text), (schema, text)


@settings(max_examples=30, deadline=None)
@given(lo=st.integers(0, 3), extra=st.none() | st.integers(0, 3),
       arrays=st.lists(st.lists(st.integers(-3, 3), max_size=7), min_size=3, max_size=3))
def test_arrays_are_accepted_iff_their_length_and_items_are_valid(lo, extra, arrays):
    schema = {"type": "array", "items": {"type": "integer", "minimum": -2}, "minItems": lo,
              **({} if extra is None else {"maxItems": lo + extra})}
    grammar = _grammar(_wrap(schema))
    for array in arrays:
        assert _accepts(grammar, {"v": array}) == _valid(schema, array), (schema, array)


# ------------------------------------------------------------------------------------- unsupported schemas

UNSUPPORTED = [
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "prefixItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "object", "maxProperties": 1}, "maxProperties"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas"),
    ({"if": {"type": "integer"}, "then": {"minimum": 0}}, "if"),
    ({"not": {"type": "null"}}, "not"),
    ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"type": "array", "items": [{"type": "integer"}]}, "items"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"$ref": "#/$defs/missing"}, "$ref"),
    ({"$ref": "#/$defs/x", "minimum": 1}, "$ref"),
    ({"type": "string", "format": "hostname"}, "format"),
    ({"type": "number", "minimum": 0.5}, "minimum"),
    ({"type": "number", "maximum": 2.5}, "maximum"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "minimum"),
    ({"type": "integer", "minimum": True}, "minimum"),
    ({"type": "string", "maxLength": -1}, "maxLength"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems"),
    ({"type": "string", "pattern": "(?=a)b"}, "pattern"),
    ({"type": "string", "pattern": "a^b"}, "pattern"),
    ({"type": "decimal"}, "type"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "/oneOf/1"),
    ({"anyOf": [{"type": "integer"}], "minimum": 1}, "anyOf"),
    ({"anyOf": []}, "anyOf"),
    ({"allOf": [{"type": "integer"}, {"minimum": 0}]}, "allOf"),
    ({"enum": [{"a": 1}]}, "enum"),
    ({"enum": ["a", "b"], "minItems": 1}, "enum"),
    ({"enum": ["abc"], "maxLength": 2}, "enum"),
    ({"const": 1, "type": "string"}, "const"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ({"type": "object", "properties": {"a": False}}, "false", "/properties/a"),
    ({"anyOf": [{"type": "string"}, {"type": "integer", "multipleOf": 2}]}, "multipleOf", "/anyOf/1"),
    ({"$ref": "#/$defs/bad"}, "uniqueItems", "/$defs/bad"),
]


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[f"{i}-{case[1]}" for i, case in enumerate(UNSUPPORTED)])
def test_a_schema_outside_the_subset_is_an_error_naming_the_keyword_and_its_path(case):
    """Deep inside the parameters (the items of a nested property), so the JSON pointer is checked too: the
    path is that of the node holding the keyword (a `$ref` target's is its pointer in the document)."""
    schema, keyword, *inside = case
    parameters = {"type": "object",
                  "$defs": {"x": {"type": "integer"}, "bad": {"type": "array", "uniqueItems": True}},
                  "properties": {"outer": {"type": "object", "properties": {
                      "inner": {"type": "array", "items": schema}}}}}
    err = _error(parameters)
    where = "/properties/outer/properties/inner/items"
    path = inside[0] if inside and inside[0].startswith("/$defs") else where + (inside[0] if inside else "")
    assert (err.tool, err.keyword, err.path) == ("f", keyword, path)
    assert f"{keyword!r}" in err.message and err.path in err.message and "'f'" in err.message


@pytest.mark.parametrize("name, path", [("a b", "/properties/a b"), ("a/b", "/properties/a~1b"),
                                        ("t~x", "/properties/t~0x")])
def test_a_property_name_that_cannot_be_a_bare_key_is_refused_with_an_escaped_pointer(name, path):
    err = _error({"type": "object", "properties": {name: {"type": "string"}}})
    assert (err.keyword, err.path) == ("properties", path)


@pytest.mark.parametrize("parameters", [{"type": "array"}, {"type": "object", "anyOf": [{}]},
                                        {"$ref": "#/$defs/p", "$defs": {"p": {"type": "object"}}}])
def test_the_parameters_must_be_a_plain_object_schema(parameters):
    err = _error(parameters)
    assert (err.keyword, err.path) == ("type", "")
    assert "at / " in err.message


def test_additional_properties_is_checked_even_where_it_produces_no_value():
    """Subschemas are checked where they are, not only where values are produced: `additionalProperties`
    under declared properties produces nothing but is still checked."""
    err = _error({"type": "object", "properties": {"a": {"type": "integer"}},
                  "additionalProperties": {"type": "string", "format": "uri"}})
    assert (err.keyword, err.path) == ("format", "/additionalProperties")


# ---------------------------------------------------------------------------------------------- ValueGrammar


def test_value_grammar_names_rules_and_deduplicates_terminals():
    g = ValueGrammar(STRING)
    assert g.terminal("a+") == g.terminal("a+") == "T0" and g.terminal("b") == "T1"
    assert g.terminal("a+", "b+") == "T2"  # an intersection is one terminal
    assert g.add_rule("p_", '"x" T0') == "p_1" and g.new_name("p_") == "p_2"
    text = g.text()
    assert 'p_1: "x" T0' in text.splitlines() and "T0: /a+/" in text.splitlines()
    assert "T2: /a+/ & /b+/" in text.splitlines()
    assert "any_value" not in text and "ANY_KEY" not in text


def test_value_grammar_adds_the_any_value_rules_only_when_used_with_its_string_token():
    g = ValueGrammar(STRING)
    assert g.any_value() == "any_value"
    text = g.text()
    assert f"any_value: <[{STRING}]> " in text and "ANY_KEY: /[A-Za-z_][A-Za-z0-9_]*/" in text
    assert "any_object:" in text and "any_array:" in text
    other = ValueGrammar(99)
    SchemaRules(other, "f", _wrap({"type": "string"}), "t0_").parameters()
    assert "<[99]>" in other.text() and "<[257]>" not in other.text()


def test_a_slash_in_a_regex_is_escaped_for_lark():
    grammar = _grammar(_wrap({"type": "string", "pattern": "^a/b$"}))
    assert "a\\/b" in grammar
    assert _accepts(grammar, {"v": "a/b"}) and not _accepts(grammar, {"v": "a\\/b"})


def test_two_tools_share_one_grammar_under_their_own_prefixes():
    """The rules of each tool start with its prefix, so several tools' rules live in one ValueGrammar."""
    g = ValueGrammar(STRING)
    first = SchemaRules(g, "a", _wrap({"type": "integer", "maximum": 3}), "t0_").parameters()
    second = SchemaRules(g, "b", _wrap({"type": "string", "maxLength": 1}), "t1_").parameters()
    assert first.startswith("t0_") and second.startswith("t1_")
    grammar = f"start: {first} | {second}\n{g.text()}"
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    assert _accepts(grammar, {"v": 3}) and _accepts(grammar, {"v": "x"})
    assert not _accepts(grammar, {"v": 4}) and not _accepts(grammar, {"v": "xy"})
