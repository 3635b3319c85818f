"""Client regexes in llguidance's linear-time dialect (gateway/structured/patterns.py): JSON Schema `pattern` semantics
against Python's `re` (the independent reference, on generated regexes simple enough to be safe there), the
Gemma 4 tool grammar's pattern terminals against the same checker, and proof that a catastrophic regex never
reaches Python's `re` on any path a client can drive (schema checks, enum/const value filters, tool grammars,
jsonschema validation)."""

from __future__ import annotations

import re

import jsonschema
import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from families.gemma3.gateway import PUBLISHED_IDS as GEMMA3_IDS
from families.gemma3.gateway import gemma3_tool_grammar
from families.gemma4.gateway import PUBLISHED_IDS as GEMMA4_IDS
from families.gemma4.gateway import gemma4_tool_grammar
from gateway.structured import grammar_cache, patterns, schema_check
from gateway.structured.tools import tool_calls, tool_schema

HOSTILE = "^(a+)+$"

# Regexes over {a, b, c}: literals, classes, groups, alternation, quantifiers, optional ^/$ at the ends. Small
# enough that Python's backtracking `re` is a safe reference on short strings.
_ATOMS = st.sampled_from(["a", "b", "c", ".", "[ab]", "[^a]", "\\d", "\\w", "x"])


@st.composite
def _regex(draw, depth: int = 0):
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        if depth < 2 and draw(st.booleans()):
            inner = draw(_regex(depth + 1))
            alt = draw(_regex(depth + 1)) if draw(st.booleans()) else None
            atom = f"({inner}|{alt})" if alt else f"({inner})"
        else:
            atom = draw(_ATOMS)
        parts.append(atom + draw(st.sampled_from(["", "", "?", "*", "+", "{1,2}"])))
    return "".join(parts)


@st.composite
def _pattern(draw):
    return ("^" if draw(st.booleans()) else "") + draw(_regex()) + ("$" if draw(st.booleans()) else "")


_TEXT = st.text(alphabet="abcx1_- é\n", max_size=8)


@settings(max_examples=300, deadline=None)
@given(_pattern(), _TEXT)
def test_search_agrees_with_python_re_on_safe_patterns(pattern, text):
    """ECMA-262 `pattern`: a search unless anchored; \\d, \\w ASCII; `.` not a line terminator (re.ASCII); `$`
    only at the very end (Python's `$` also matches before a final newline: \\Z is ECMA's `$`)."""
    reference = pattern[:-1] + "\\Z" if pattern.endswith("$") else pattern
    assert patterns.search(pattern, text) == bool(re.search(reference, text, re.ASCII)), (pattern, text)


def _byte_matcher(regex: str):
    return llguidance.LLMatcher(patterns._byte_tokenizer(), llguidance.LLMatcher.grammar_from_regex(regex),
                                log_level=0)


@settings(max_examples=200, deadline=None)
@given(_pattern(), _TEXT)
def test_gemma4_pattern_terminal_agrees_with_the_checker(pattern, text):
    """The whole-string regex the Gemma 4 grammar uses for a `pattern` accepts exactly what the value checker
    (llguidance's JSON compiler) accepts, so enum filtering and the mask never disagree."""
    schema = tool_schema.SchemaRules(tool_schema.ValueGrammar(52), "t", {}, "r")
    matcher = _byte_matcher(schema.pattern(pattern, ""))
    data = text.encode()
    whole = matcher.try_consume_tokens(list(data)) == len(data) and matcher.is_accepting()
    assert whole == patterns.search(pattern, text), (pattern, text)


def test_pattern_error_kinds():
    for pattern, kind in [("(", "malformed"), ("a{2,1}", "malformed"), ("^(?=a)a", "unsupported"),
                          ("(a)\\1", "unsupported"), ("a" * (patterns.MAX_PATTERN_CHARS + 1), "budget")]:
        with pytest.raises(patterns.PatternError) as err:
            patterns.check(pattern)
        assert err.value.kind == kind, (pattern, err.value)
    with pytest.raises(patterns.PatternError) as err:
        patterns.search("[a-z]{1,100000}", "a" * 5000)  # compiles, then needs more lexer fuel than its budget
    assert err.value.kind == "budget"


@pytest.fixture
def no_python_re_for_client_regexes(monkeypatch):
    """Fail if Python's `re` ever compiles the hostile regex (every `re` entry point goes through _compile)."""
    compile_ = re._compile

    def guarded(pattern, flags):
        assert not (isinstance(pattern, str) and "(a+)+" in pattern), "a client regex reached Python's re"
        return compile_(pattern, flags)

    monkeypatch.setattr(re, "_compile", guarded)
    re.purge()
    yield


def test_hostile_pattern_never_reaches_python_re(no_python_re_for_client_regexes):
    long_bad, long_ok = "a" * 10_000 + "!", "a" * 10_000
    assert not patterns.search(HOSTILE, long_bad) and patterns.search(HOSTILE, long_ok)
    # jsonschema validation (tool arguments, values), pattern and patternProperties
    validator = patterns.validator_for({"type": "object", "properties": {"s": {"pattern": HOSTILE}},
                                        "patternProperties": {HOSTILE: {"type": "integer"}}})
    assert not validator.is_valid({"s": long_bad}) and validator.is_valid({"s": long_ok})
    assert not validator.is_valid({long_ok: "x"}) and validator.is_valid({long_bad: "x"})
    # response_format: the meta-schema's `format: regex` check and the grammar
    grammar_cache.check_schema({"type": "string", "pattern": HOSTILE})
    grammar_cache.check_schema({"type": "object", "patternProperties": {HOSTILE: {"type": "integer"}}})
    # tool parameters with pattern + enum (values filtered by the checker) in both tool formats
    values = ["a" * 40, "a" * 40 + "!", "b"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": HOSTILE, "enum": values}},
        "required": ["s"]}}}
    g4 = gemma4_tool_grammar([tool], "required", False, ids=GEMMA4_IDS)
    assert '"' + "a" * 40 + '"' in g4 and "!" not in g4  # only the matching value is offered
    assert gemma3_tool_grammar([tool], "required", False, ids=GEMMA3_IDS)
    args = '{"s": "' + long_bad + '"}'
    with pytest.raises(tool_calls.ToolCallParseError):
        tool_calls.validate_tool_arguments([tool], "f", args)


def test_schema_regex_problems_are_400_kinds():
    with pytest.raises(schema_check.SchemaError, match="malformed schema"):
        grammar_cache.check_schema({"type": "string", "pattern": "("})
    with pytest.raises(schema_check.SchemaError, match="cannot be enforced"):
        grammar_cache.check_schema({"type": "string", "pattern": "^(?=a)a$"})
    meta_cls, formats = patterns.validator_class(jsonschema.Draft202012Validator)
    meta = meta_cls(jsonschema.Draft202012Validator.META_SCHEMA, format_checker=formats)
    assert meta.is_valid({"pattern": "a+"}) and not meta.is_valid({"pattern": "("})
