"""gateway.structured.constraints (with gateway/structured/schema_check.py and gateway/structured/grammar_cache.py):
JSON answers that always parse and validate.

The core check is model-free: for every schema of the corpus (tests/gateway/constraint_schemas.py) a sampler
picks tokens at random among those the mask allows, feeds them back with advance(), and every finished output
must parse and validate with jsonschema (formats checked). The sampler is biased, on purpose and only among
allowed tokens, towards tokens containing `"`, `}` or `]` (and the stop ids): uniform sampling over Gemma's
262k tokens almost never closes a string. A quarter of the samples use a weaker bias. Outputs that hit the
step cap are counted, and most must finish.

At every step it also checks the mask's invariants: its length, no control token ever allowed except the stop
ids, the stop ids allowed exactly when the value may end, and only the stop ids once done().

Run with `-s` to see the timing report (per-mask median/p99, compile and per-request costs).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import statistics
import time
import zlib

import jsonschema
import llguidance
import numpy as np
import pytest

from gateway.structured import constraints as C
from gateway.structured import grammar_cache, schema_check
from tests.gateway.constraint_schemas import CORPUS

STOP = [1, 106]  # <eos>, <end_of_turn>
SAMPLES = 20     # per schema
MAX_STEPS = 300  # per sample
TIMES: dict[str, list[float]] = {"mask": [], "tokenizer": [], "constraint": []}
RESULTS: dict[str, tuple[int, int]] = {}  # name -> (finished, samples)
DUPLICATE_KEYS = [0]


# ------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer_json(prepared) -> str:
    return (prepared.dir / "tokenizer.json").read_text()


@pytest.fixture(scope="session")
def vocab_size(prepared) -> int:
    return json.loads((prepared.dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="session")
def llg_tok(tokenizer_json, vocab_size):
    t0 = time.perf_counter()
    tok = C.build_tokenizer(tokenizer_json, vocab_size, STOP)
    TIMES["tokenizer"].append(time.perf_counter() - t0)
    return tok


@pytest.fixture(scope="session")
def tables(llg_tok, vocab_size):
    """Packed bitsets over the vocabulary: tokens that close something (and the stops); control tokens
    other than the stops."""
    closer = np.zeros(vocab_size, bool)
    control = np.zeros(vocab_size, bool)
    for i in range(llg_tok.vocab_size):
        if llg_tok.is_special_token(i):
            control[i] = True
        else:
            b = llg_tok.decode_bytes([i])
            closer[i] = b'"' in b or b"}" in b or b"]" in b
    closer[STOP] = True
    control[STOP] = False
    return {
        "closer": np.packbits(closer, bitorder="little"),
        "control": np.packbits(control, bitorder="little"),
        "n_control": int(control.sum()),
    }


def ids_of(mask) -> np.ndarray:
    """Token ids whose bit is set in a mask (bytes or uint8 array), LSB first."""
    arr = np.frombuffer(mask, np.uint8) if isinstance(mask, bytes) else mask
    nz = np.flatnonzero(arr)
    bits = np.unpackbits(arr[nz][:, None], axis=1, bitorder="little").astype(bool)
    return (nz[:, None] * 8 + np.arange(8))[bits]


def accepts(tok, grammar: str, text: str, vocab_size: int = 262144) -> bool:
    """Whether `text` (tokenized by the model's tokenizer) is a complete value under `grammar`."""
    c = C.Constraint(tok, grammar, vocab_size, STOP)
    for t in tok.tokenize_str(text):
        try:
            c.advance(t)
        except C.ConstraintError:
            return False
    return c.is_accepting()


def raw_accepts(tok, schema, text: str, overrides=None) -> bool:
    """Whether llguidance itself, with no checks of ours, accepts `text` for `schema`."""
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides),
                             log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tok.tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def sample(c: C.Constraint, rng, bias: float, tables, nbytes: int, max_steps: int = MAX_STEPS) -> bool:
    """Drive `c` with random allowed tokens until a stop token (True) or the step cap (False).

    Checks the mask invariants at every step."""
    for _ in range(max_steps):
        forced = c.forced()
        if forced and rng.random() < 0.5:
            assert not set(forced) & set(STOP)
            first = np.frombuffer(c.mask(), np.uint8)
            assert first[forced[0] >> 3] >> (forced[0] & 7) & 1, "a forced token the mask does not allow"
            for t in forced:
                c.advance(t)
            continue
        t0 = time.perf_counter()
        m = c.mask()
        TIMES["mask"].append(time.perf_counter() - t0)
        assert len(m) == nbytes
        arr = np.frombuffer(m, np.uint8)
        assert not (arr & tables["control"]).any(), f"a control token allowed after {c.text()!r}"
        stop_bits = [bool(arr[s >> 3] >> (s & 7) & 1) for s in STOP]
        assert all(b == c.is_accepting() for b in stop_bits), f"stop ids vs accepting after {c.text()!r}"
        if c.done():
            assert sorted(ids_of(arr).tolist()) == sorted(STOP), f"done, yet more than stops: {c.text()!r}"
        cand = None
        if rng.random() < bias:
            closing = arr & tables["closer"]
            if closing.any():
                cand = ids_of(closing)
        if cand is None:
            cand = ids_of(arr)
        assert len(cand), f"nothing allowed after {c.text()!r}"
        t = int(rng.choice(cand))
        c.advance(t)
        if t in STOP:
            assert c.done()
            return True
    return False


# Format checkers: jsonschema's own (date, email "has an @", ipv4, ipv6, uuid) plus strict ones for the rest.
FORMATS = jsonschema.FormatChecker()
_TIME_RE = re.compile(r"(?:[01]\d|2[0-3]):[0-5]\d:(?:[0-5]\d|60)(?:\.\d+)?"
                      r"(?:[Zz]|[+-](?:[01]\d|2[0-3]):[0-5]\d)", re.ASCII)
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LOCAL_RE = re.compile(_ATEXT + r"(?:\." + _ATEXT + r")*", re.ASCII)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_DOMAIN_RE = re.compile(_LABEL + r"(?:\." + _LABEL + r")*", re.ASCII)


@FORMATS.checks("time", raises=ValueError)
def _is_time(s):  # RFC 3339 full-time, and Python can read it
    if not isinstance(s, str):
        return True
    return bool(_TIME_RE.fullmatch(s)) and datetime.time.fromisoformat(s) is not None


@FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(s):  # RFC 3339 date-time, and Python can read it
    if not isinstance(s, str):
        return True
    return (len(s) > 11 and s[10] in "Tt" and FORMATS.conforms(s[:10], "date") and _is_time(s[11:])
            and datetime.datetime.fromisoformat(s) is not None)


@FORMATS.checks("email", raises=ValueError)
def _is_email(s):  # RFC 5321 Mailbox: dot-string "@" (domain | "[" IPv4 "]")
    if not isinstance(s, str):
        return True
    local, at, domain = s.rpartition("@")
    if not at or not _LOCAL_RE.fullmatch(local):
        return False
    if domain.startswith("[") and domain.endswith("]"):
        return ipaddress.IPv4Address(domain[1:-1]) is not None
    return bool(_DOMAIN_RE.fullmatch(domain))


def validate(schema, text: str) -> list[str]:
    """Errors of `text` against `schema` (parse errors included); counts duplicate object keys."""
    def pairs(kv):
        keys = [k for k, _ in kv]
        DUPLICATE_KEYS[0] += len(keys) - len(set(keys))
        return dict(kv)

    try:
        value = json.loads(text, object_pairs_hook=pairs)
    except ValueError as e:
        return [f"does not parse: {e}"]
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return [e.message for e in cls(schema, format_checker=FORMATS).iter_errors(value)]


def _keywords(schema, acc: set) -> set:
    if isinstance(schema, dict):
        for k, v in schema.items():
            acc.add(k)
            if k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
                for sub in v.values():
                    _keywords(sub, acc)
            elif k not in ("const", "enum", "default", "examples"):
                _keywords(v, acc)
    elif isinstance(schema, list):
        for x in schema:
            _keywords(x, acc)
    return acc


def _formats(schema, acc: set) -> set:
    if isinstance(schema, dict):
        if isinstance(schema.get("format"), str):
            acc.add(schema["format"])
        for k, v in schema.items():
            if k not in ("const", "enum", "default", "examples"):
                _formats(v, acc)
    elif isinstance(schema, list):
        for x in schema:
            _formats(x, acc)
    return acc


# ------------------------------------------------------------------------------------------------------------
# The corpus: accepted and enforced
# ------------------------------------------------------------------------------------------------------------


def test_corpus_covers_every_supported_keyword_and_format():
    assert len(CORPUS) >= 40
    assert len({n for n, _ in CORPUS}) == len(CORPUS)
    used = set()
    for _, s in CORPUS:
        _keywords(s, used)
    assert schema_check.SUPPORTED_KEYWORDS <= used, schema_check.SUPPORTED_KEYWORDS - used
    assert schema_check.ANNOTATION_KEYWORDS <= used, schema_check.ANNOTATION_KEYWORDS - used
    formats = set()
    for _, s in CORPUS:
        _formats(s, formats)
    assert formats == schema_check.SUPPORTED_FORMATS
    # every claimed format really is checked by the validator used below (jsonschema skips unknown formats)
    assert schema_check.SUPPORTED_FORMATS <= set(FORMATS.checkers)


@pytest.mark.parametrize("name,schema", CORPUS, ids=[n for n, _ in CORPUS])
def test_corpus_schema_is_enforced(name, schema, llg_tok, vocab_size, tables):
    grammar_cache.check_schema(schema)
    grammar = grammar_cache.grammar_for_json_schema(schema)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    nbytes = (vocab_size + 7) // 8
    finished, invalid = 0, []
    for k in range(SAMPLES):
        t0 = time.perf_counter()
        c = C.Constraint(llg_tok, grammar, vocab_size, STOP)
        TIMES["constraint"].append(time.perf_counter() - t0)
        if sample(c, rng, 0.5 if k % 4 == 0 else 0.85, tables, nbytes):
            finished += 1
            text = c.text()
            assert text == text.strip(), f"whitespace around the value: {text!r}"
            errors = validate(schema, text)
            if errors:
                invalid.append((text, errors[:2]))
    RESULTS[name] = (finished, SAMPLES)
    assert not invalid, f"{len(invalid)} invalid outputs for {name}: {invalid[:3]}"
    assert finished >= SAMPLES // 4, f"only {finished}/{SAMPLES} samples of {name} finished"


def test_corpus_summary():
    """Hundreds of samples in total, nearly all finished (run after the parametrized test above)."""
    if len(RESULTS) < len(CORPUS):
        pytest.skip("the whole corpus did not run")
    finished = sum(f for f, _ in RESULTS.values())
    total = sum(n for _, n in RESULTS.values())
    print(f"\ncorpus: {len(CORPUS)} schemas, {finished}/{total} samples finished and valid; "
          f"{total - finished} hit the {MAX_STEPS}-step cap; {DUPLICATE_KEYS[0]} duplicate additional keys")
    assert total >= 800
    assert finished >= 0.9 * total


def test_json_object_grammar(llg_tok, vocab_size, tables):
    grammar = grammar_cache.grammar_for_json_object()
    rng = np.random.default_rng(7)
    nbytes = (vocab_size + 7) // 8
    start = C.Constraint(llg_tok, grammar, vocab_size, STOP)
    # an object, and no whitespace before it
    assert {llg_tok.decode_str([int(i)])[0] for i in ids_of(start.mask())} == {"{"}
    finished = 0
    for k in range(20):
        c = C.Constraint(llg_tok, grammar, vocab_size, STOP)
        if sample(c, rng, 0.85, tables, nbytes):
            finished += 1
            assert isinstance(json.loads(c.text()), dict), c.text()
    assert finished >= 15
    for text, ok in [('{}', True), ('{"a": [1, {"b": null}], "c": "d"}', True), ('[1]', False),
                     ('"x"', False), (' {}', False), ('{"a":1', False)]:
        assert accepts(llg_tok, grammar, text, vocab_size) is ok, text


# ------------------------------------------------------------------------------------------------------------
# Fail closed: rejected keywords, malformed schemas
# ------------------------------------------------------------------------------------------------------------

_TAGGED = [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
           {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]

# keyword -> (example subschema, with that keyword first among the rejected ones; proof of llguidance's
# behaviour). Proof: "unimplemented" = llguidance refuses the grammar; ("ignored", text) = llguidance accepts
# `text` although the keyword forbids it (or, for keywords of no use to us, just compiles it).
REJECTED_EXAMPLES: dict[str, tuple[dict, object]] = {
    "uniqueItems": ({"type": "array", "uniqueItems": True}, "unimplemented"),
    "contains": ({"type": "array", "contains": {"const": 1}}, "unimplemented"),
    "minContains": ({"minContains": 2, "contains": {"const": 1}}, "unimplemented"),
    "maxContains": ({"maxContains": 2, "contains": {"const": 1}}, "unimplemented"),
    "not": ({"not": {"type": "string"}}, "unimplemented"),
    "if": ({"if": {"type": "string"}, "then": {"minLength": 2}}, "unimplemented"),
    "then": ({"then": {"minLength": 2}}, "unimplemented"),
    "else": ({"else": {"minLength": 2}}, "unimplemented"),
    "dependentSchemas": ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "unimplemented"),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, "unimplemented"),
    "dependencies": ({"type": "object", "dependencies": {"a": ["b"]}}, "unimplemented"),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 3}}, "unimplemented"),
    "unevaluatedProperties": ({"type": "object", "unevaluatedProperties": False}, "unimplemented"),
    "unevaluatedItems": ({"type": "array", "unevaluatedItems": False}, "unimplemented"),
    "$dynamicRef": ({"$dynamicRef": "#a"}, "unimplemented"),
    "$dynamicAnchor": ({"$dynamicAnchor": "a", "type": "string"}, "unimplemented"),
    "$recursiveRef": ({"$recursiveRef": "#"}, "unimplemented"),
    "$recursiveAnchor": ({"$recursiveAnchor": "a", "type": "object"}, "unimplemented"),
    "$vocabulary": ({"$vocabulary": {"https://example.com/v": True}, "type": "string"}, ("ignored", '"x"')),
    # duplicates collapse after parsing: llguidance counts 2 members, json.loads keeps 1 -> invalid
    "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
                      ("ignored", '{"a":1,"a":2}')),
    "contentSchema": ({"type": "string", "contentSchema": {"type": "integer"}}, ("ignored", '"[]"')),
    "contentMediaType": ({"type": "string", "contentMediaType": "application/json"}, ("ignored", '"{"')),
    "contentEncoding": ({"type": "string", "contentEncoding": "base64"}, ("ignored", '"!!!"')),
    "nullable": ({"type": "string", "nullable": True}, ("ignored-null", "null")),
    "discriminator": ({"oneOf": _TAGGED, "discriminator": {"propertyName": "k"}}, ("ignored", '{"k":"a"}')),
    "x-guidance": ({"x-guidance": {"lenient": True}, "type": "array", "uniqueItems": True},
                   ("ignored", "[1,1]")),
}


def test_every_rejected_keyword_has_an_example():
    assert set(REJECTED_EXAMPLES) == set(schema_check.REJECTED_KEYWORDS)
    assert not set(schema_check.REJECTED_KEYWORDS) & (schema_check.SUPPORTED_KEYWORDS | schema_check.ANNOTATION_KEYWORDS)


@pytest.mark.parametrize("keyword", sorted(REJECTED_EXAMPLES))
def test_rejected_keyword(keyword, llg_tok):
    sub, proof = REJECTED_EXAMPLES[keyword]
    # refused at the root and nested, naming the keyword and where it is
    for schema, path in [(sub, ""), ({"type": "object", "properties": {"tags": sub}}, "/properties/tags"),
                         ({"$defs": {"unused": sub}, "type": "integer"}, "/$defs/unused")]:
        with pytest.raises(schema_check.SchemaError) as e:
            grammar_cache.check_schema(schema)
        assert e.value.keyword == keyword and e.value.path == path, e.value
        expected = f"response_format.json_schema: keyword '{keyword}' at {path or '/'} cannot be enforced"
        assert expected in str(e.value)
    # and it really is not enforced by llguidance
    raw_grammar = llguidance.LLMatcher.grammar_from_json_schema(sub)
    error = llguidance.LLMatcher.validate_grammar(raw_grammar)
    if proof == "unimplemented":
        assert "Unimplemented keys" in error and f'"{keyword}"' in error, error
        return
    assert error == "", error
    kind, text = proof
    if kind == "ignored-null":  # nullable: null should be allowed, llguidance does not allow it
        assert not raw_accepts(llg_tok, sub, text) and raw_accepts(llg_tok, sub, '"s"')
        return
    assert raw_accepts(llg_tok, sub, text), text
    if keyword == "minProperties":
        assert validate(sub, text), "duplicate keys should make it invalid after parsing"


def test_x_guidance_overrides_are_ours(llg_tok):
    """Even if a schema's x-guidance got through, our overrides win: lenient stays off."""
    schema = {"x-guidance": {"lenient": True, "whitespace_flexible": True}, "type": "array",
              "uniqueItems": True}
    g = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=grammar_cache._LLG_OPTIONS)
    assert "Unimplemented keys" in llguidance.LLMatcher.validate_grammar(g)


@pytest.mark.parametrize("schema,keyword,path", [
    ({"type": "array", "items": {"type": "string", "format": "hostname"}}, "format", "/items"),
    ({"type": "string", "format": "duration"}, "format", ""),
    ({"type": "string", "format": "uri"}, "format", ""),
    ({"type": "string", "format": "no-such-format"}, "format", ""),
    ({"type": "number", "multipleOf": 0.1}, "multipleOf", ""),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
     "$ref", "/properties/a"),
    ({"type": "object", "properties": {"a": {"$schema": "https://json-schema.org/draft/2020-12/schema"}}},
     "$schema", "/properties/a"),
    ({"anyOf": [{"$id": "https://example.com/x", "type": "string"}]}, "$id", "/anyOf/0"),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "string"}, "$schema", ""),
    ({"type": "string", "minLenght": 2}, "minLenght", ""),
])
def test_other_refusals(schema, keyword, path):
    with pytest.raises(schema_check.SchemaError) as e:
        grammar_cache.check_schema(schema)
    assert (e.value.keyword, e.value.path) == (keyword, path), e.value
    assert f"keyword '{keyword}' at {path or '/'}" in str(e.value)


def test_why_fractional_multiple_of_is_refused(llg_tok):
    schema = {"type": "number", "multipleOf": 0.1}
    assert raw_accepts(llg_tok, schema, "0.3")  # llguidance is exact in decimal...
    assert validate(schema, "0.3")              # ...but binary floating-point validators disagree


@pytest.mark.parametrize("schema,keyword,path", [
    ({"type": "strin"}, "type", ""),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": "0"}}},
     "minimum", "/properties/a"),
    ({"type": "string", "minLength": -1}, "minLength", ""),
    ({"type": "object", "required": "a"}, "required", ""),
    ({"type": "string", "pattern": "("}, "pattern", ""),
    ({"anyOf": []}, "anyOf", ""),
    ({"type": "array", "items": [{"type": "integer"}]}, "items", ""),  # the array form is not 2020-12
    ({"$defs": 3}, "$defs", ""),
    ({"properties": []}, "properties", ""),
    ({"enum": "a"}, "enum", ""),
    ({"type": "array", "items": {"maxItems": 1.5}}, "maxItems", "/items"),
])
def test_malformed_schema(schema, keyword, path):
    with pytest.raises(schema_check.SchemaError) as e:
        grammar_cache.check_schema(schema)
    assert isinstance(e.value, ValueError)
    assert (e.value.keyword, e.value.path) == (keyword, path), e.value
    assert str(e.value).startswith("response_format.json_schema: malformed schema")


@pytest.mark.parametrize("schema", ["string", [], True, None, 3, {"const": float("nan")}, {"enum": [{1, 2}]},
                                    {"enum": ["x" * (grammar_cache.MAX_SCHEMA_CHARS + 1)]}])
def test_not_a_schema_object(schema):
    with pytest.raises(schema_check.SchemaError):
        grammar_cache.check_schema(schema)


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "integer", "enum": ["a"]}, None),                                   # unsatisfiable
    ({"type": "object", "required": ["z"], "additionalProperties": False}, None),  # unsatisfiable
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),              # overlapping branches
    ({"type": "string", "pattern": "^(?=a)a+$"}, "pattern"),                        # look-around
    ({"type": "string", "pattern": "^(a)\\1$"}, "pattern"),                         # back-reference
    ({"type": "object", "patternProperties": {"^x": {}, "^xy": {}}}, "patternProperties"),  # not disjoint
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True, "maxProperties": 1},
     "maxProperties"),                                                              # open object, a not required
    ({"$ref": "#/$defs/missing"}, "$ref"),
    ({"$defs": {"a": {"$ref": "#/$defs/a", "type": "object"}}, "$ref": "#/$defs/a"}, "$ref"),
])
def test_llguidance_refusals_become_schema_errors(schema, keyword):
    with pytest.raises(schema_check.SchemaError) as e:
        grammar_cache.check_schema(schema)
    assert e.value.keyword == keyword, e.value
    assert "cannot be enforced" in str(e.value)


def test_response_format_helper():
    assert grammar_cache.grammar_for_response_format(None) is None
    assert grammar_cache.grammar_for_response_format({"type": "text"}) is None
    assert grammar_cache.grammar_for_response_format({"type": "json_object"}) == grammar_cache.grammar_for_json_object()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for strict in (True, False, None):
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}
        assert grammar_cache.grammar_for_response_format(rf) == grammar_cache.grammar_for_json_schema(schema)
    bad_formats = ({"type": "xml"}, {"type": "json_schema"},
                   {"type": "json_schema", "json_schema": {"name": "x"}},
                   {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}},
                   "json")
    for bad in bad_formats:
        with pytest.raises(schema_check.SchemaError):
            grammar_cache.grammar_for_response_format(bad)


# ------------------------------------------------------------------------------------------------------------
# Constraint behaviour
# ------------------------------------------------------------------------------------------------------------


def test_generation_ends_right_after_the_value(llg_tok, vocab_size):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    c = C.Constraint(llg_tok, grammar_cache.grammar_for_json_schema(schema), vocab_size, STOP)
    for t in llg_tok.tokenize_str('{"a": 12'):
        assert not c.done()
        c.advance(t)
    assert not c.is_accepting() and not set(STOP) & set(ids_of(c.mask()).tolist())
    with pytest.raises(C.ConstraintError):
        c.advance(106)  # the value is not complete
    c.advance(llg_tok.tokenize_str("}")[0])
    assert c.done() and c.is_accepting() and c.text() == '{"a": 12}'
    assert ids_of(c.mask()).tolist() == STOP  # exactly the stop ids: no whitespace, nothing else
    assert c.forced() == []
    with pytest.raises(C.ConstraintError):
        c.advance(llg_tok.tokenize_str(" ")[0])
    c.advance(106)
    assert c.done()
    with pytest.raises(C.ConstraintError):
        c.mask()
    with pytest.raises(C.ConstraintError):
        c.advance(1)


def test_stop_ids_other_than_the_tokenizers_eos(llg_tok, vocab_size):
    """The tokenizer's EOS set is [1, 106]; a request stopping only on 106 gets exactly 106."""
    c = C.Constraint(llg_tok, grammar_cache.grammar_for_json_schema({"const": "x"}), vocab_size, [106])
    for t in c.forced():
        c.advance(t)
    assert c.done() and ids_of(c.mask()).tolist() == [106]
    with pytest.raises(C.ConstraintError):
        c.advance(1)
    c.advance(106)


def test_a_top_level_number_may_stop_or_continue(llg_tok, vocab_size):
    c = C.Constraint(llg_tok, grammar_cache.grammar_for_json_schema({"type": "integer"}), vocab_size, STOP)
    assert not set(STOP) & set(ids_of(c.mask()).tolist())
    for t in llg_tok.tokenize_str("12"):
        c.advance(t)
    allowed = set(ids_of(c.mask()).tolist())
    assert set(STOP) <= allowed and llg_tok.tokenize_str("3")[0] in allowed
    assert c.is_accepting() and not c.done()


def test_forced_tokens_spell_the_expected_text(llg_tok, vocab_size):
    c = C.Constraint(llg_tok, grammar_cache.grammar_for_json_schema({"const": "exactly this"}), vocab_size, STOP)
    forced = c.forced()
    assert llg_tok.decode_str(forced) == '"exactly this"'
    for t in forced:
        c.advance(t)
    assert c.done()

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    c = C.Constraint(llg_tok, grammar_cache.grammar_for_json_schema(schema), vocab_size, STOP)
    forced = c.forced()
    # llguidance forces the bytes {"answer": but holds back the token(s) whose tokenization could merge with
    # what follows (Gemma has both `":` and `": ` style tokens)
    assert llg_tok.decode_str(forced) == '{"answer'
    for t in forced:
        c.advance(t)
    for t in llg_tok.tokenize_str('": 4}'):
        c.advance(t)
    assert c.done() and c.text() == '{"answer": 4}'

    # a const object: forced in runs; only at the separators (optional space) is there a choice, a tiny one
    c = C.Constraint(llg_tok, grammar_cache.grammar_for_json_schema({"const": {"k": [1, None]}}), vocab_size, STOP)
    target, forced_bytes, sampled = '{"k":[1,null]}', 0, 0
    while not c.done():
        rest = target[len(c.text()):]
        forced = c.forced()
        if forced:
            assert rest.startswith(llg_tok.decode_str(forced)), (c.text(), forced)
            forced_bytes += len(llg_tok.decode_str(forced))
            for t in forced:
                c.advance(t)
            continue
        allowed = ids_of(c.mask())
        assert 0 < len(allowed) <= 16, [llg_tok.decode_str([int(t)]) for t in allowed]
        t = llg_tok.tokenize_str(rest)[0]
        assert t in allowed
        c.advance(t)
        sampled += 1
    assert c.text() == target and sampled <= 4 and forced_bytes >= len(target) // 2


def test_control_tokens_never_inside_json_strings(llg_tok, vocab_size, tables):
    c = C.Constraint(llg_tok, grammar_cache.grammar_for_json_object(), vocab_size, STOP)
    states = []
    for piece in ['{"', 'ke', 'y":', ' "', 'val']:  # inside a key, then inside a value
        for t in llg_tok.tokenize_str(piece):
            c.advance(t)
        states.append(c.text())
        mask = np.frombuffer(c.mask(), np.uint8)
        allowed = set(ids_of(mask).tolist())
        if c.text().endswith(('"', 'ke', 'val')):
            assert len(allowed) > 200_000, c.text()  # nearly any text
        assert not (mask & tables["control"]).any()
        for t in (0, 1, 2, 3, 105, 106):  # <pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn>
            assert t not in allowed, (t, c.text())
        assert 248 not in allowed  # <0x0A>: a raw newline inside a string is not JSON
        for t in (105, 106, 1):
            with pytest.raises(C.ConstraintError):
                c.advance(t)
    assert tables["n_control"] > 6000
    assert c.text() == '{"key": "val'  # refused tokens left the state alone


def test_advance_refuses_and_keeps_state(llg_tok, vocab_size):
    c = C.Constraint(llg_tok, grammar_cache.grammar_for_json_schema({"type": "array", "items": {"type": "integer"}}),
                     vocab_size, STOP)
    for bad in [llg_tok.tokenize_str("{")[0], vocab_size + 5, -1, llg_tok.tokenize_str("a")[0]]:
        with pytest.raises(C.ConstraintError):
            c.advance(bad)
    for t in llg_tok.tokenize_str("[1, 2]"):
        c.advance(t)
    assert c.done() and json.loads(c.text()) == [1, 2]


def test_one_line_json_only(llg_tok, vocab_size):
    g = grammar_cache.grammar_for_json_schema({"type": "object", "properties": {"a": {"type": "integer"},
                                                                   "b": {"type": "array"}}})
    for text, ok in [('{"a":1,"b":[1,2]}', True), ('{"a": 1, "b": [1, 2]}', True), ('{ "a":1}', False),
                     ('{"a":  1}', False), ('{"a":1 ,"b":[]}', False), ('{\n  "a": 1\n}', False),
                     (' {"a":1}', False), ('{"a":1}', True)]:
        assert accepts(llg_tok, g, text, vocab_size) is ok, text


def test_date_formats_are_strict(llg_tok, vocab_size):
    date = grammar_cache.grammar_for_json_schema({"type": "string", "format": "date"})
    for text, ok in [("2024-02-29", True), ("2000-02-29", True), ("2023-02-28", True), ("2023-02-29", False),
                     ("1900-02-29", False), ("0000-01-01", False), ("0001-01-01", True),
                     ("2024-13-01", False),
                     ("2024-04-31", False), ("2024-12-31", True)]:
        assert accepts(llg_tok, date, json.dumps(text), vocab_size) is ok, text
    # llguidance's own "date" allows 2023-02-29, which Python/jsonschema reject: that is why we rewrite it
    assert raw_accepts(llg_tok, {"type": "string", "format": "date"}, '"2023-02-29"')
    t = grammar_cache.grammar_for_json_schema({"type": "string", "format": "time"})
    for text, ok in [("12:00:00Z", True), ("23:59:59.123456789+05:30", True), ("23:59:60Z", False),
                     ("12:00:00z", False), ("12:00:00", False), ("24:00:00Z", False)]:
        assert accepts(llg_tok, t, json.dumps(text), vocab_size) is ok, text
    dt = grammar_cache.grammar_for_json_schema({"type": "string", "format": "date-time", "pattern": "^2"})
    for text, ok in [("2024-02-29T00:00:00Z", True), ("2024-02-29t00:00:00Z", False),
                     ("1999-01-01T00:00:00Z", False), ("2023-02-29T00:00:00Z", False)]:
        assert accepts(llg_tok, dt, json.dumps(text), vocab_size) is ok, text


def test_mask_bit_layout_matches_llguidance(llg_tok, vocab_size):
    """llguidance's uint32 words, read little-endian, give the same bits as our LSB-first bytes."""
    grammar = grammar_cache.grammar_for_json_object()
    for prefix in ["", '{"']:
        c = C.Constraint(llg_tok, grammar, vocab_size, STOP)
        m = llguidance.LLMatcher(llg_tok, grammar, log_level=0)
        for t in llg_tok.tokenize_str(prefix) if prefix else []:
            c.advance(t)
            assert m.consume_token(t)
        words = np.frombuffer(m.compute_bitmask(), "<u4")
        theirs = {32 * w + j for w in np.flatnonzero(words) for j in range(32) if words[w] >> j & 1}
        ours = set(ids_of(c.mask()).tolist())
        assert ours == theirs and len(ours) > 0
    start = ids_of(C.Constraint(llg_tok, grammar, vocab_size, STOP).mask())
    assert all(llg_tok.decode_str([int(i)]).startswith("{") for i in start)
    assert llg_tok.tokenize_str('{"')[0] in start


def test_vocab_sizes(llg_tok, tokenizer_json, vocab_size):
    g = grammar_cache.grammar_for_json_object()
    # a model vocabulary larger than the tokenizer's, not a multiple of 8: padded with zero bits
    c = C.Constraint(llg_tok, g, vocab_size + 13, STOP)
    m = np.frombuffer(c.mask(), np.uint8)
    assert len(m) == (vocab_size + 13 + 7) // 8
    assert not m[vocab_size // 8:].any()
    # the same, with llguidance told the larger size (its last word is partly past the vocabulary)
    big = C.build_tokenizer(tokenizer_json, vocab_size + 6, STOP)
    c = C.Constraint(big, g, vocab_size + 6, STOP)
    for t in llg_tok.tokenize_str('{"a'):
        c.advance(t)
    m = np.frombuffer(c.mask(), np.uint8)
    assert len(m) == (vocab_size + 6 + 7) // 8 and m[: vocab_size // 8].any()
    assert not m[vocab_size // 8:].any()  # the 6 ids past the tokenizer (and 2 pad bits) are never allowed
    with pytest.raises(ValueError):
        C.Constraint(llg_tok, g, vocab_size - 8, STOP)
    with pytest.raises(ValueError):
        C.build_tokenizer(tokenizer_json, 1000, STOP)
    with pytest.raises(ValueError):
        C.Constraint(llg_tok, g, vocab_size, [107])  # "\n" is text, not a stop token
    with pytest.raises(ValueError):
        C.build_tokenizer(tokenizer_json, vocab_size, [])


# ------------------------------------------------------------------------------------------------------------
# Cache and timing
# ------------------------------------------------------------------------------------------------------------


def test_grammar_cache_compiles_once(monkeypatch, llg_tok, vocab_size):
    grammar_cache.clear_grammar_cache()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"], "additionalProperties": False}
    same = json.loads(json.dumps(schema, indent=2))  # an equal object, parsed again
    g = grammar_cache.grammar_for_json_schema(schema)
    grammar_cache.check_schema(schema)
    assert grammar_cache.grammar_for_json_schema(same) == g
    info = grammar_cache.grammar_cache_info()
    assert info["compiles"] == 1 and info["misses"] == 1 and info["hits"] == 2 and info["size"] == 1
    # key order is meaning for generation (property order), so it is part of the key
    swapped = {**schema, "properties": {"b": schema["properties"]["b"], "a": schema["properties"]["a"]}}
    g2 = grammar_cache.grammar_for_json_schema(swapped)
    assert grammar_cache.grammar_cache_info()["compiles"] == 2
    assert accepts(llg_tok, g, '{"a":1,"b":""}', vocab_size)
    assert not accepts(llg_tok, g, '{"b":"","a":1}', vocab_size)
    assert accepts(llg_tok, g2, '{"b":"","a":1}', vocab_size)
    grammar_cache.clear_grammar_cache()
    grammar_cache.grammar_for_json_schema(schema)
    # refused schemas are not cached: each check compiles (and fails) again
    for _ in range(2):
        with pytest.raises(schema_check.SchemaError):
            grammar_cache.check_schema({"type": "integer", "enum": ["a"]})
    assert grammar_cache.grammar_cache_info()["size"] == 1
    # LRU eviction by bytes: a budget that holds two of these (equal-sized) grammars
    grammar_cache.clear_grammar_cache()
    grammar_cache.grammar_for_json_schema({"const": 9})
    monkeypatch.setattr(grammar_cache._cache, "budget", int(2.5 * grammar_cache.grammar_cache_info()["bytes"]))
    grammar_cache.clear_grammar_cache()
    for i in range(3):
        grammar_cache.grammar_for_json_schema({"const": i})
    assert grammar_cache.grammar_cache_info()["size"] == 2
    grammar_cache.grammar_for_json_schema({"const": 2})
    assert grammar_cache.grammar_cache_info()["compiles"] == 3
    grammar_cache.grammar_for_json_schema({"const": 0})  # evicted first
    assert grammar_cache.grammar_cache_info()["compiles"] == 4


def test_timing_report(llg_tok, vocab_size):
    """Prints the costs (run with -s); asserts only generous bounds."""
    grammar_cache.clear_grammar_cache()
    compile_ms = []
    for _, schema in CORPUS:
        t0 = time.perf_counter()
        grammar_cache.grammar_for_json_schema(schema)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    first_ms, copy_ms = [], []
    for _, schema in CORPUS:  # first Constraint of a grammar compiles the matcher; later ones deep_copy it
        g = grammar_cache.grammar_for_json_schema(schema)
        t0 = time.perf_counter()
        C.Constraint(llg_tok, g, vocab_size, STOP)
        first_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        C.Constraint(llg_tok, g, vocab_size, STOP)
        copy_ms.append((time.perf_counter() - t0) * 1e3)
    if not TIMES["mask"]:  # the corpus did not run: measure a short walk
        c = C.Constraint(llg_tok, grammar_cache.grammar_for_json_object(), vocab_size, STOP)
        for t in llg_tok.tokenize_str('{"key": "value with some words", "n": [1, 2, 3]}'):
            t0 = time.perf_counter()
            c.mask()
            TIMES["mask"].append(time.perf_counter() - t0)
            c.advance(t)
    mask_ms = np.array(TIMES["mask"]) * 1e3
    tok_s = TIMES["tokenizer"][0] if TIMES["tokenizer"] else float("nan")
    print(f"\nLLTokenizer build: {tok_s:.2f} s (vocab {vocab_size})"
          f"\nmask(): n={len(mask_ms)} median {np.median(mask_ms):.3f} ms, "
          f"p99 {np.percentile(mask_ms, 99):.3f} ms, max {mask_ms.max():.3f} ms"
          f"\nschema compile+check (cold, {len(compile_ms)} schemas): "
          f"median {statistics.median(compile_ms):.2f} ms, max {max(compile_ms):.2f} ms"
          f"\nConstraint(): first per grammar median {statistics.median(first_ms):.2f} ms "
          f"(max {max(first_ms):.2f}), then deep_copy median {statistics.median(copy_ms):.3f} ms")
    assert np.median(mask_ms) < 5
    assert statistics.median(compile_ms) < 200


@pytest.mark.parametrize("schema, text, ok", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1, "b": 2}', False),   # closed
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     '{"a": 1, "b": 2}', True),                                                                   # explicitly open
    ({"type": "object"}, '{"b": 2}', True),                                                       # no properties
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, '{"a": 1, "b": 2}', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"]}, '{"z": 1}', True),
])
def test_objects_with_properties_are_closed_unless_something_could_open_them(llg_tok, schema, text, ok):
    assert accepts(llg_tok, grammar_cache.grammar_for_json_schema(schema), text) is ok
