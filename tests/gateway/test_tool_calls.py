"""Tool calls: grammars in the model's own format (Gemma 4 native syntax, Gemma 3 JSON format), streaming parsers,
schema support, and exact re-rendering of generated calls by the chat templates.

A model-free sampler drives llguidance matchers on the real vocabularies (Gemma 3's tokenizer.json and the Gemma 4
test tokenizer made from it): at each step it picks uniformly among the tokens the grammar's mask allows, except
that with probability BIAS it picks among the allowed "structural" tokens (control tokens and tokens made only of
`{}[],:"` and spaces), and after SOFT_CAP steps among allowed "closing" ones (the closing control tokens first,
then tokens of `}]",` with a quote, then any of `}]",`; after 2 * SOFT_CAP also single printable ASCII
characters, which lead out of formats like email), so answers stay short. Uniform picks over 262,144 tokens give
random Unicode, odd whitespace and non-canonical token splits: a harsh test of escaping, UTF-8 handling and the
grammars. Samples are deterministic (seeded).
"""

from __future__ import annotations

import json
import pathlib

import jsonschema
import llguidance
import numpy as np
import pytest

from families.gemma3.gateway import (
    GEMMA3_CALL_TRIGGER,
    Gemma3ToolCallParser,
    gemma3_tool_grammar,
    parse_gemma3_tool_calls,
)
from families.gemma3.gateway import PUBLISHED_IDS as GEMMA3_IDS
from families.gemma3.tokenizer import render as render_gemma3
from families.gemma4.gateway import (
    GEMMA4_NONE_BANNED_IDS,
    Gemma4ToolCallParser,
    gemma4_tool_grammar,
    parse_gemma4_tool_calls,
)
from families.gemma4.gateway import PUBLISHED_IDS as GEMMA4_IDS
from families.gemma4.tokenizer import render as render_gemma4
from gateway.core.tool_format import ToolCall
from gateway.structured.tools.tool_calls import (
    INTEGER_REGEX,
    MAX_PARALLEL_CALLS,
    NUMBER_REPR_REGEX,
    ToolCallParseError,
    ToolChoiceError,
    ToolSchemaError,
    int_range_regex,
    resolve_tool_choice,
    validate_tool_arguments,
    validation_schema,
)
from tokenizer_svc.chat_template import Message, tokenize_segments
from tokenizer_svc.tokenizer import TextTokenizer

N_VOCAB = 262144
BIAS = 0.35
SOFT_CAP = 80
HARD_CAP = 1500


def _fn(name, parameters, description=""):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


WEATHER = _fn("get_weather", {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "Days": {"type": "integer", "minimum": 1, "maximum": 14, "nullable": True},
    },
    "required": ["city"],
}, "Get the weather for a city.")
SEARCH = _fn("search", {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 40},
        "filters": {
            "type": "object",
            "properties": {
                "lang": {"type": "string", "enum": ["en", "fr", "东京 \"q\""]},
                "since": {"type": ["string", "null"], "format": "date"},
                "max_age": {"type": "integer", "exclusiveMinimum": -5, "maximum": 365},
            },
            "required": ["lang"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["query", "filters"],
}, "Search documents.")
CALCULATOR = _fn("calculator", {
    "type": "object",
    "properties": {
        "a": {"type": "number"},
        "b": {"type": "number", "minimum": -10, "exclusiveMaximum": 10},
        "op": {"type": "string", "enum": ["+", "-", "*", "/"]},
        "precision": {"type": "integer", "minimum": 0},
        "exact": {"type": "boolean"},
    },
    "required": ["a", "b", "op"],
    "additionalProperties": False,
}, "Compute a op b.")
NOW = _fn("now", {"type": "object", "properties": {}})
PROFILE = _fn("update_profile", {
    "type": "object",
    "$defs": {"address": {"type": "object", "properties": {"street": {"type": "string"},
                                                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                          "required": ["zip"]}},
    "properties": {
        "nickname": {"type": ["string", "null"]},
        "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 150}, {"type": "null"}]},
        "contact": {"oneOf": [{"type": "string", "format": "email"}, {"$ref": "#/$defs/address"}]},
        "ratio": {"type": "number", "nullable": True},
        "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
        "id": {"type": "string", "format": "uuid"},
        "code": {"const": "X-1"},
    },
    "required": ["contact", "code"],
})
TOOLS = [WEATHER, SEARCH, CALCULATOR, NOW, PROFILE]
NAMES = [t["function"]["name"] for t in TOOLS]


# ------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def g3_lltok(prepared) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer((prepared.dir / "tokenizer.json").read_text(), n_vocab=N_VOCAB, eos_token=1)


@pytest.fixture(scope="session")
def g4_lltok(gemma4_lltok) -> llguidance.LLTokenizer:
    return gemma4_lltok


@pytest.fixture(scope="session")
def g4_text_tok(gemma4_text_tokenizer) -> TextTokenizer:
    return gemma4_text_tokenizer


class Sampler:
    """Uniform sampling among the grammar-allowed tokens, biased towards structure (module docstring)."""

    def __init__(self, lltok: llguidance.LLTokenizer, structural_specials, closing_specials):
        self.lltok = lltok
        self.token_bytes = [lltok.decode_bytes([i]) for i in range(N_VOCAB)]
        self.special = np.array([lltok.is_special_token(i) for i in range(N_VOCAB)])
        struct, close = np.zeros(N_VOCAB, bool), np.zeros(N_VOCAB, bool)
        for i, b in enumerate(self.token_bytes):
            if b and not self.special[i]:
                struct[i] = all(c in b'{}[],:" ' for c in b)
                close[i] = all(c in b'}]",' for c in b)
        struct[list(structural_specials)] = True
        close[list(closing_specials)] = True
        self.struct, self.close = struct, close
        self.quote = np.array([b'"' in b for b in self.token_bytes])
        self.ascii = np.array([len(b) == 1 and 32 < b[0] < 127 for b in self.token_bytes])
        self.brace = np.array([b.startswith(b"{") for b in self.token_bytes])

    def sample(self, grammar: str, seed: int, stop_ids, first: np.ndarray | None = None,
               prefix: list[int] = ()) -> list[int]:
        """Sample one answer; `first` (a token mask) is preferred at the first step when it allows any; the
        answer starts with `prefix` (which the grammar must accept)."""
        rng = np.random.default_rng(seed)
        matcher = llguidance.LLMatcher(self.lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        assert matcher.consume_tokens(list(prefix)), matcher.get_error()
        out: list[int] = list(prefix)
        while True:
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")[:N_VOCAB]
            allowed = bits.astype(bool)
            assert allowed.any(), f"dead end after {out}"
            tiers = [self.close & self.special, self.close & self.quote] if len(out) >= SOFT_CAP else []
            if len(out) >= 2 * SOFT_CAP:  # e.g. inside an email, where only "@" and a domain lead out
                tiers.append(self.ascii)
            if len(out) >= SOFT_CAP:
                tiers.append(self.close)
            if len(out) >= SOFT_CAP or rng.random() < BIAS:
                tiers.append(self.struct)
            if first is not None and len(out) == len(prefix):
                tiers = [first]
            pool = next((allowed & tier for tier in tiers if (allowed & tier).any()), allowed)
            choices = np.flatnonzero(pool)
            token = int(choices[rng.integers(len(choices))])
            assert matcher.consume_token(token), matcher.get_error()
            out.append(token)
            if token in stop_ids:
                assert matcher.is_accepting()
                return out
            assert len(out) < HARD_CAP, self.lltok.decode_str(out)


@pytest.fixture(scope="session")
def g4_sampler(g4_lltok) -> Sampler:
    return Sampler(g4_lltok, {48, 49, 50, 52, 106}, {49, 50, 52, 106})


@pytest.fixture(scope="session")
def g3_sampler(g3_lltok) -> Sampler:
    return Sampler(g3_lltok, {106}, {106})


# ------------------------------------------------------------------------------------------- sampling runs

CHOICES = [
    ("auto", True),
    ("required", True),
    ("required", False),
    ({"type": "function", "function": {"name": "search"}}, True),
    ({"type": "function", "function": {"name": "update_profile"}}, False),
]
SAMPLES = 40


def _stream(parser, sampler: Sampler, tokens: list[int]):
    """Feed tokens one by one (as bytes); returns the deltas per step."""
    steps = [parser.feed(t, sampler.token_bytes[t]) for t in tokens]
    steps.append(parser.finish())
    return steps


def _check_deltas(steps, result, end_step_of_call):
    """Streamed deltas: one header per call (before its fragments), fragments concatenating to the final
    arguments, the first fragment no later than `end_step_of_call[index]`, content equal to the result's."""
    headers, fragments, first, content = {}, {}, {}, ""
    for step, deltas in enumerate(steps):
        for delta in deltas:
            assert set(delta) in ({"content"}, {"tool_calls"})
            if "content" in delta:
                content += delta["content"]
                continue
            (call,) = delta["tool_calls"]
            index = call["index"]
            if "id" in call:
                assert index not in headers and call["type"] == "function" and call["function"]["arguments"] == ""
                headers[index] = (call["id"], call["function"]["name"])
                fragments[index] = ""
            else:
                assert index in headers and set(call) == {"index", "function"}
                assert call["function"]["arguments"]
                first.setdefault(index, step)
                fragments[index] += call["function"]["arguments"]
    assert content == result.content
    assert [headers[i] for i in sorted(headers)] == [(c.id, c.name) for c in result.tool_calls]
    assert [fragments[i] for i in sorted(fragments)] == [c.arguments for c in result.tool_calls]
    assert len({c.id for c in result.tool_calls}) == len(result.tool_calls)
    for index, end in end_step_of_call.items():
        assert first[index] < end


def _check_calls(result, choice, parallel):
    mode, name = resolve_tool_choice(TOOLS, choice)
    for call in result.tool_calls:
        args = json.loads(call.arguments)
        assert isinstance(args, dict)
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
        validator = jsonschema.Draft202012Validator
        validator(validation_schema(schema), format_checker=validator.FORMAT_CHECKER).validate(args)
        assert validate_tool_arguments(TOOLS, call.name, call.arguments) == args
        if mode == "named":
            assert call.name == name
    if mode in ("required", "named"):
        assert result.tool_calls and result.content == ""
    if not parallel or mode == "named":
        assert len(result.tool_calls) <= 1


@pytest.mark.slow  # random walks through the tool grammars over the 262,144-token vocabulary
@pytest.mark.parametrize("choice, parallel", CHOICES)
def test_gemma4_sampled_tool_calls_parse_validate_and_stream(g4_sampler, g4_text_tok, choice, parallel):
    grammar = gemma4_tool_grammar(TOOLS, choice, parallel, ids=GEMMA4_IDS)
    lltok, n_calls, n_text = g4_sampler.lltok, 0, 0
    for seed in range(SAMPLES):
        # auto: some answers write text first, then the trigger (the <|tool_call> token) mid-answer
        text = LAZY_TEXTS[(seed // 2) % len(LAZY_TEXTS)] if choice == "auto" and seed % 2 else ""
        prefix = lltok.tokenize_str(text) + [48] if choice == "auto" and seed % 2 else []
        tokens = g4_sampler.sample(grammar, seed, {50, 106}, prefix=prefix)
        # Control tokens: only the grammar's own, and inside calls only the string delimiter.
        inside = False
        for t in tokens:
            if t == 48:
                inside = True
            elif t == 49:
                inside = False
            elif inside:
                assert t == 52 or not g4_sampler.special[t], tokens
            else:
                assert t in (50, 106) or not g4_sampler.special[t]
        assert tokens[-1] == (50 if 48 in tokens else 106)
        steps = _stream(parser := Gemma4ToolCallParser(ids=GEMMA4_IDS), g4_sampler, tokens)
        result = parser.result()
        assert not result.truncated
        ends = {}
        for step, t in enumerate(tokens):
            if t == 49:
                ends[len(ends)] = step
        _check_deltas(steps, result, ends)
        _check_calls(result, choice, parallel)
        assert parse_gemma4_tool_calls(lltok.decode_bytes(tokens).decode()) == result
        assert len(result.tool_calls) == tokens.count(48)
        if prefix:
            assert result.tool_calls and result.content == text
        n_calls += bool(result.tool_calls)
        n_text += not result.tool_calls
        if result.tool_calls and not result.content:
            _check_gemma4_round_trip(g4_text_tok, tokens, result)
    if choice == "auto":
        assert n_calls and n_text


def _canonical(tok: TextTokenizer, tokens: list[int], control: set[int]) -> list[int]:
    """Re-tokenize generated tokens canonically: text runs between control tokens encoded as text."""
    out, run = [], []
    for t in tokens + [None]:
        if t is None or t in control:
            if run:
                out += tok.encode(tok.decode(run, skip_special_tokens=False), parse_special=False)
                run = []
            if t is not None:
                out.append(t)
        else:
            run.append(t)
    return out


def _keys_sorted(value) -> bool:
    """Whether every mapping in `value` has its keys in the template's (case-insensitive sorted) order."""
    if isinstance(value, dict):
        keys = list(value)
        return keys == sorted(keys, key=str.lower) and all(_keys_sorted(v) for v in value.values())
    return all(_keys_sorted(v) for v in value) if isinstance(value, list) else True


def _check_gemma4_round_trip(tok: TextTokenizer, tokens: list[int], result):
    """The template re-renders the parsed calls exactly as generated (leading text aside: Gemma 4's template
    writes an assistant message's text after its calls; and free-form objects, whose key order the grammar
    cannot enforce, come back sorted)."""
    if not all(_keys_sorted(json.loads(c.arguments)) for c in result.tool_calls):
        return
    generated = tokens[tokens.index(48):]
    user = Message("user", "Hi")
    prompt, _ = tokenize_segments(render_gemma4([user], True, TOOLS, {}), tok)
    calls = [(c.id, c.name, c.arguments) for c in result.tool_calls]
    ids, text = tokenize_segments(render_gemma4([user, Message("assistant", tool_calls=calls)], False, TOOLS, {}), tok)
    assert ids[: len(prompt)] == prompt
    assert ids[len(prompt):] == _canonical(tok, generated, set(tok.special_ids))
    assert tok.decode(ids[len(prompt):], skip_special_tokens=False) == tok.decode(generated, skip_special_tokens=False)


LAZY_TEXTS = ["", "Sure.", "Let me check the weather first.\n\n", "Uses {braces} and \"quotes\": ", "日本 🙂 "]


def _lazy_prefix(lltok, seed: int) -> list[int]:
    """Text, then the Gemma 3 call trigger — tokenized whole, split over two tokens, byte by byte, or joined to
    the text in one token where the vocabulary has one — as a model could write it in an `auto` answer."""
    text = LAZY_TEXTS[(seed // 2) % len(LAZY_TEXTS)]
    split = (seed // 2) % 4
    if split == 0:
        return lltok.tokenize_str(text + GEMMA3_CALL_TRIGGER)
    if split == 1:
        return lltok.tokenize_str(text + GEMMA3_CALL_TRIGGER[:5]) + lltok.tokenize_str(GEMMA3_CALL_TRIGGER[5:])
    if split == 2:
        return lltok.tokenize_str(text) + [t for ch in GEMMA3_CALL_TRIGGER for t in lltok.tokenize_str(ch)]
    return lltok.tokenize_str(text + ' {"') + lltok.tokenize_str(GEMMA3_CALL_TRIGGER[2:])


@pytest.mark.slow  # random walks through the tool grammars over the 262,144-token vocabulary
@pytest.mark.parametrize("choice, parallel", CHOICES)
def test_gemma3_sampled_tool_calls_parse_validate_and_stream(g3_sampler, text_tokenizer, choice, parallel):
    grammar = gemma3_tool_grammar(TOOLS, choice, parallel, ids=GEMMA3_IDS)
    lltok, n_calls, n_text = g3_sampler.lltok, 0, 0
    for seed in range(SAMPLES):
        prefix = _lazy_prefix(lltok, seed) if choice == "auto" and seed % 2 else []
        first = g3_sampler.brace if seed % 2 and choice != "auto" else None
        tokens = g3_sampler.sample(grammar, seed, {106}, first=first, prefix=prefix)
        assert not any(g3_sampler.special[t] for t in tokens[:-1]) and tokens[-1] == 106
        steps = _stream(parser := Gemma3ToolCallParser(ids=GEMMA3_IDS), g3_sampler, tokens)
        result = parser.result()
        assert not result.truncated
        _check_deltas(steps, result, {i: len(tokens) - 1 for i in range(len(result.tool_calls))})
        _check_calls(result, choice, parallel)
        assert parse_gemma3_tool_calls(lltok.decode_bytes(tokens).decode()) == result
        n_calls += bool(result.tool_calls)
        n_text += not result.tool_calls
        if prefix:  # the text before the trigger is content, the call after it is parsed
            assert result.tool_calls and result.content == lltok.decode_str(prefix).split(GEMMA3_CALL_TRIGGER)[0]
        if result.tool_calls and not result.content:
            user = Message("user", "Hi")
            prompt, _ = tokenize_segments(render_gemma3([user], True, TOOLS), text_tokenizer)
            calls = [(c.id, c.name, c.arguments) for c in result.tool_calls]
            ids, _ = tokenize_segments(render_gemma3([user, Message("assistant", tool_calls=calls)], False, TOOLS),
                                       text_tokenizer)
            assert ids[: len(prompt)] == prompt
            assert ids[len(prompt):] == _canonical(text_tokenizer, tokens, {106}) + [107]
    if choice == "auto":
        assert n_calls and n_text


@pytest.mark.parametrize("kind", ["builtin", "jinja"])
def test_gemma4_template_renders_calls_as_the_grammar_writes_them(g4_text_tok, kind):
    """Numbers, nested values and key order as the grammar allows them are what Google's template writes (the
    checkpoint Jinja file, rendered through JinjaTemplate, and our built-in renderer)."""
    from tokenizer_svc.jinja_template import JinjaTemplate

    template = pathlib.Path(__file__).parents[1] / "tokenizer_svc" / "data" / "gemma4_chat_template.jinja"
    render = render_gemma4 if kind == "builtin" else JinjaTemplate.from_file(template, g4_text_tok)
    generated = ('<|tool_call>call:calculator{a:-0.0001,b:9.5,exact:false,op:<|"|>*<|"|>,precision:12}<tool_call|>'
                 '<|tool_call>call:update_profile{code:<|"|>X-1<|"|>,contact:{street:<|"|>a "b"\\<|"|>,zip:<|"|>12345'
                 '<|"|>},extra:{},nickname:null,ratio:100000000000000.0}<tool_call|><|tool_response>')
    result = parse_gemma4_tool_calls(generated)
    for call in result.tool_calls:
        validate_tool_arguments(TOOLS, call.name, call.arguments)
    calls = [(c.id, c.name, c.arguments) for c in result.tool_calls]
    user = Message("user", "Hi")
    prompt, _ = tokenize_segments(render([user], True, TOOLS, {}), g4_text_tok)
    ids, text = tokenize_segments(render([user, Message("assistant", tool_calls=calls)], False, TOOLS, {}), g4_text_tok)
    assert ids[len(prompt):] == g4_text_tok.encode(generated, parse_special=True)


# ------------------------------------------------------------------------------------ grammar details


def _accepts(lltok, grammar: str, pieces) -> bool:
    """Whether the grammar accepts the pieces (ints: token ids; str: text, tokenized as text only: tokenize_str
    would turn control-token spellings into control tokens) as a complete answer."""
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    for piece in pieces:
        for t in [piece] if isinstance(piece, int) else lltok.greedy_tokenize(piece):
            if not matcher.consume_token(t):
                return False
    return matcher.is_accepting()


def _call4(name, args_text):
    """A Gemma 4 call as pieces: `<|"|>` written as ' Q ' in args_text."""
    pieces = [48, f"call:{name}{{"]
    for n, part in enumerate(args_text.split("Q")):
        if n:
            pieces.append(52)
        if part:
            pieces.append(part)
    return pieces + ["}", 49]


@pytest.mark.parametrize("args, ok", [
    ("a:1,b:-10,op:Q+Q", True), ("a:1,b:-10.0,op:Q+Q", True), ("a:1,b:9.99,op:Q+Q", True),
    ("a:1,b:-9.5,op:Q+Q", True), ("a:0.0001,b:0,op:Q/Q", True), ("a:-123456789012345.0,b:9,op:Q-Q", True),
    ("a:1,b:10,op:Q+Q", False), ("a:1,b:10.0,op:Q+Q", False), ("a:1,b:-10.5,op:Q+Q", False),
    ("a:1.50,b:1,op:Q+Q", False), ("a:1e5,b:1,op:Q+Q", False), ("a:-0,b:1,op:Q+Q", False),
    ("a:01,b:1,op:Q+Q", False), ("a:0.00001,b:1,op:Q+Q", False), ("a:1,op:Q+Q", False),
    ("a:1,b:1,op:Q%Q", False), ("b:1,a:1,op:Q+Q", False), ("a:1,b:1,op:Q+Q,precision:-1", False),
    ("a:1,b:1,exact:true,op:Q+Q,precision:0", True), ("a:1,b:1,op:Q+Q,zzz:1", False),
])
def test_gemma4_grammar_numbers_order_and_enums(g4_lltok, args, ok):
    grammar = gemma4_tool_grammar([CALCULATOR], "required", False, ids=GEMMA4_IDS)
    assert _accepts(g4_lltok, grammar, _call4("calculator", args) + [50]) == ok


@pytest.mark.parametrize("args, ok", [
    ("filters:{lang:QenQ,max_age:-4},query:Qx Q", True), ("filters:{lang:QenQ,max_age:365},query:QxQ", True),
    ("filters:{lang:QenQ,max_age:-5},query:QxQ", False), ("filters:{lang:QenQ,max_age:366},query:QxQ", False),
    ('filters:{lang:Q东京 "q"Q},query:QxQ,tags:[QaQ,QbQ,QcQ]', True),
    ("filters:{lang:QenQ},query:QxQ,tags:[QaQ,QbQ,QcQ,QdQ]", False), ("filters:{lang:QenQ},query:QxQ,tags:[]", False),
    ("filters:{lang:QenQ},query:QQ", False), ("filters:{lang:QenQ,since:Q2023-02-29Q},query:QxQ", False),
    # Feb 29 of a leap year is a date, as for response_format (gateway/structured/json_schema.py)
    ("filters:{lang:QenQ,since:Q2024-02-29Q},query:QxQ", True),
    ("filters:{lang:QenQ,since:Q2024-12-31Q},query:QxQ", True),
    ("filters:{lang:QenQ,since:Q0000-01-01Q},query:QxQ", False), ("filters:{lang:QenQ,since:null},query:QxQ", True),
    ("query:QxQ", False), ("filters:{},query:QxQ", False),
])
def test_gemma4_grammar_strings_arrays_and_nesting(g4_lltok, args, ok):
    grammar = gemma4_tool_grammar([SEARCH], "required", False, ids=GEMMA4_IDS)
    assert _accepts(g4_lltok, grammar, _call4("search", args) + [50]) == ok


@pytest.mark.parametrize("args, ok", [
    ("code:QX-1Q,contact:Qa@b.coQ", True), ("code:QX-2Q,contact:Qa@b.coQ", False),
    ("code:QX-1Q,contact:{zip:Q12345Q}", True), ("code:QX-1Q,contact:{zip:Q1234aQ}", False),
    ("code:QX-1Q,contact:{street:QQ,zip:Q123456Q}", False), ("code:QX-1Q,contact:Qnot-an-emailQ", False),
    ("age:null,code:QX-1Q,contact:Qa@b.coQ,extra:{k:1,k2:-3},id:Q123e4567-e89b-12d3-a456-426614174000Q", True),
    ("code:QX-1Q,contact:Qa@b.coQ,extra:{k:Q1Q}", False), ("code:QX-1Q,contact:Qa@b.coQ,ratio:null", True),
    ("age:151,code:QX-1Q,contact:Qa@b.coQ", False), ("code:QX-1Q,contact:Qa@b.coQ,nickname:null", True),
])
def test_gemma4_grammar_refs_unions_and_formats(g4_lltok, args, ok):
    grammar = gemma4_tool_grammar([PROFILE], "required", False, ids=GEMMA4_IDS)
    assert _accepts(g4_lltok, grammar, _call4("update_profile", args) + [50]) == ok


def test_gemma4_grammar_per_tool_choice(g4_lltok):
    weather = _call4("get_weather", "city:QParisQ")
    now = _call4("now", "")
    auto = gemma4_tool_grammar(TOOLS, "auto", True, ids=GEMMA4_IDS)
    assert _accepts(g4_lltok, auto, ["It is sunny.", 106]) and _accepts(g4_lltok, auto, [106])
    assert _accepts(g4_lltok, auto, weather + [50])
    assert _accepts(g4_lltok, auto, ["Let me check.\n"] + weather + now + [50])
    assert not _accepts(g4_lltok, auto, ["Hi", 50]) and not _accepts(g4_lltok, auto, weather + [106])
    assert not _accepts(g4_lltok, auto, weather + ["ok"] + [50])
    assert not _accepts(g4_lltok, auto, [48, "call:nope{}", 49, 50])
    required = gemma4_tool_grammar(TOOLS, "required", True, ids=GEMMA4_IDS)
    assert _accepts(g4_lltok, required, weather + weather + [50]) and not _accepts(g4_lltok, required, ["x", 106])
    assert not _accepts(g4_lltok, required, ["x"] + weather + [50]) and not _accepts(g4_lltok, required, [50])
    single = gemma4_tool_grammar(TOOLS, "required", False, ids=GEMMA4_IDS)
    assert _accepts(g4_lltok, single, now + [50]) and not _accepts(g4_lltok, single, now + now + [50])
    named = gemma4_tool_grammar(TOOLS, {"type": "function", "function": {"name": "now"}}, True,
                                ids=GEMMA4_IDS)
    assert _accepts(g4_lltok, named, now + [50]) and not _accepts(g4_lltok, named, weather + [50])
    assert not _accepts(g4_lltok, named, now + now + [50])  # a named choice is exactly one call (OpenAI, vLLM)
    # Control tokens are tokens, never text: the spelling of <|"|> or <tool_call|> as text does not count.
    assert not _accepts(g4_lltok, required, [48, 'call:get_weather{city:<|"|>Paris<|"|>}', 49, 50])
    assert not _accepts(g4_lltok, auto, ["<|tool_call>call:now{}<tool_call|>", 50])
    assert gemma4_tool_grammar(TOOLS, "none", True, ids=GEMMA4_IDS) is None
    assert gemma4_tool_grammar([], None, True, ids=GEMMA4_IDS) is None
    assert gemma4_tool_grammar([], "auto", True, ids=GEMMA4_IDS) is None
    assert GEMMA4_NONE_BANNED_IDS == (48, 49)


def test_gemma3_grammar_per_tool_choice(g3_lltok):
    def call(name, args):
        return '{"name": "%s", "arguments": %s}' % (name, args)

    weather, now = call("get_weather", '{"city": "Paris"}'), call("now", "{}")
    auto = gemma3_tool_grammar(TOOLS, "auto", True, ids=GEMMA3_IDS)
    assert _accepts(g3_lltok, auto, ["It is sunny.", 106]) and _accepts(g3_lltok, auto, [106])
    assert _accepts(g3_lltok, auto, ['{"tool_calls": [' + weather + ", " + now + "]}", 106])
    # The lazy trigger: any text (braces included) is content; from `{"tool_calls"` on, anywhere, it is a call.
    assert _accepts(g3_lltok, auto, ["{not json}", 106]) and _accepts(g3_lltok, auto, ['{"tool": 1}', 106])
    assert _accepts(g3_lltok, auto, ['Let me check.\n{"tool_calls": [' + weather + "]}", 106])
    assert not _accepts(g3_lltok, auto, ['Let me check.\n{"tool_calls": 3}', 106])
    assert not _accepts(g3_lltok, auto, ['Let me check. {"tool_calls": [' + weather + "]} Done.", 106])
    assert not _accepts(g3_lltok, auto, ['Let me check. {"tool_calls": [' + weather, 106])
    assert not _accepts(g3_lltok, auto, ['{"tool_calls": [' + call("get_weather", '{"city":"Paris"}') + "]}", 106])
    assert not _accepts(g3_lltok, auto, ['{"tool_calls": [' + call("get_weather", '{"town": "Paris"}') + "]}", 106])
    search = gemma3_tool_grammar([SEARCH], "required", False, ids=GEMMA3_IDS)
    for since, ok in (('"2024-12-31"', True), ('"0000-01-01"', False), ('"2023-02-29"', False), ("null", True),
                      ('"2024-02-29"', True)):
        args = '{"query": "x", "filters": {"lang": "en", "since": %s}}' % since
        assert _accepts(g3_lltok, search, ['{"tool_calls": [' + call("search", args) + "]}", 106]) == ok
    single = gemma3_tool_grammar(TOOLS, "required", False, ids=GEMMA3_IDS)
    assert not _accepts(g3_lltok, single, ['{"tool_calls": [' + now + ", " + now + "]}", 106])
    assert not _accepts(g3_lltok, single, ["Hi", 106])
    named = gemma3_tool_grammar(TOOLS, {"type": "function", "function": {"name": "now"}}, True,
                                ids=GEMMA3_IDS)
    assert _accepts(g3_lltok, named, ['{"tool_calls": [' + now + "]}", 106])
    assert not _accepts(g3_lltok, named, ['{"tool_calls": [' + now + ", " + now + "]}", 106])  # exactly one
    assert not _accepts(g3_lltok, named, ['{"tool_calls": [' + weather + "]}", 106])
    assert gemma3_tool_grammar(TOOLS, "none", True, ids=GEMMA3_IDS) is None


def test_parallel_calls_are_capped(g3_lltok, g4_lltok):
    """At most MAX_PARALLEL_CALLS calls per answer (a greedy base model otherwise repeats one until max_tokens)."""
    now4 = _call4("now", "")
    g4 = gemma4_tool_grammar(TOOLS, "required", True, ids=GEMMA4_IDS)
    assert _accepts(g4_lltok, g4, now4 * MAX_PARALLEL_CALLS + [50])
    assert not _accepts(g4_lltok, g4, now4 * (MAX_PARALLEL_CALLS + 1) + [50])
    now3 = '{"name": "now", "arguments": {}}'
    g3 = gemma3_tool_grammar(TOOLS, "auto", True, ids=GEMMA3_IDS)
    answer = lambda n: ['{"tool_calls": [' + ", ".join([now3] * n) + "]}", 106]
    assert _accepts(g3_lltok, g3, answer(MAX_PARALLEL_CALLS))
    assert not _accepts(g3_lltok, g3, answer(MAX_PARALLEL_CALLS + 1))


def test_tool_grammars_are_cached():
    assert (gemma4_tool_grammar(TOOLS, "auto", True, ids=GEMMA4_IDS)
            is gemma4_tool_grammar(json.loads(json.dumps(TOOLS)), "auto", True, ids=GEMMA4_IDS))
    assert (gemma4_tool_grammar(TOOLS, "auto", True, ids=GEMMA4_IDS)
            is not gemma4_tool_grammar(TOOLS, "auto", False, ids=GEMMA4_IDS))
    assert (gemma3_tool_grammar(TOOLS, "required", True, ids=GEMMA3_IDS)
            is gemma3_tool_grammar(TOOLS, "required", True, ids=GEMMA3_IDS))


def _schema_tool(schema):
    return [_fn("t", {"type": "object", "properties": {"x": schema}})]


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "number", "multipleOf": 2}, "multipleOf"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "prefixItems": [{"type": "string"}]}, "prefixItems"),
    ({"type": "array", "items": [{"type": "string"}]}, "items"),
    ({"type": "array", "contains": {"type": "string"}}, "contains"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "string", "format": "hostname"}, "format"),
    ({"type": "string", "pattern": "a(?=b)"}, "pattern"),
    ({"type": "string", "pattern": "a$|^b"}, "pattern"),
    ({"type": "number", "maximum": 0.5}, "maximum"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "minimum"),
    ({"type": "integer", "exclusiveMinimum": True, "minimum": 1}, "exclusiveMinimum"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"oneOf": [{"type": "string"}, {}]}, "oneOf"),
    ({"allOf": [{"type": "string"}, {"minLength": 2}]}, "allOf"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"$ref": "#/$defs/missing"}, "$ref"),
    ({"type": "object", "properties": {"a b": {"type": "string"}}}, "properties"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ({"enum": [{"a": 1}]}, "enum"),
    ({"type": "string", "enum": [1, 2]}, "enum"),
    ({"type": "strin"}, "type"),
    ({"type": "string", "contentMediaType": "text/html"}, "contentMediaType"),
    ({"type": "array", "unevaluatedItems": False}, "unevaluatedItems"),
])
@pytest.mark.parametrize("build, ids", [(gemma4_tool_grammar, GEMMA4_IDS), (gemma3_tool_grammar, GEMMA3_IDS)],
                         ids=["gemma4_tool_grammar", "gemma3_tool_grammar"])
def test_unsupported_schema_keywords_are_rejected_by_name(schema, keyword, build, ids):
    with pytest.raises(ToolSchemaError) as err:
        build(_schema_tool(schema), "auto", True, ids=ids)
    assert err.value.keyword == keyword and err.value.tool == "t" and err.value.path.startswith("/properties/x")
    assert repr(keyword) in str(err.value)


@pytest.mark.parametrize("tools, keyword", [
    ([{"type": "function", "function": {"name": "a b"}}], "name"),
    ([_fn("a", {}), _fn("a", {})], "name"),
    ([{"type": "retrieval"}], "function"),
    ([_fn("a", {"type": "array"})], "type"),
    ([_fn("a", {"anyOf": [{"type": "object"}]})], "type"),
])
def test_malformed_tools_are_rejected(tools, keyword):
    with pytest.raises(ToolSchemaError) as err:
        gemma4_tool_grammar(tools, "auto", True, ids=GEMMA4_IDS)
    assert err.value.keyword == keyword


@pytest.mark.parametrize("choice", ["sometimes", {"type": "function", "function": {"name": "nope"}},
                                    {"type": "function"}, {"name": "now"}])
def test_bad_tool_choice_is_rejected(choice):
    with pytest.raises(ToolChoiceError):
        gemma4_tool_grammar(TOOLS, choice, True, ids=GEMMA4_IDS)
    with pytest.raises(ToolChoiceError):
        gemma3_tool_grammar(TOOLS, choice, True, ids=GEMMA3_IDS)


def test_resolve_tool_choice_defaults():
    assert resolve_tool_choice(TOOLS, None) == ("auto", None)
    assert resolve_tool_choice([], None) == ("none", None)
    assert resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "now"}}) == ("named", "now")
    with pytest.raises(ToolChoiceError, match="at least one tool"):
        resolve_tool_choice([], "required")


def test_int_range_regex_matches_exactly_the_range():
    import random
    import re

    rng = random.Random(0)
    bounds = [(None, None), (0, None), (None, 0), (-5, 365), (1, 14), (-1000, -7), (7, 7), (0, 0), (99, 1001),
              (-12, None), (None, -30), (123, 98765)]
    bounds += [(a, a + rng.randint(0, 3000)) for a in (rng.randint(-5000, 5000) for _ in range(20))]
    for lo, hi in bounds:
        pattern = re.compile(int_range_regex(lo, hi))
        for v in range(-12000, 12000):
            assert bool(pattern.fullmatch(str(v))) == ((lo is None or v >= lo) and (hi is None or v <= hi)), (lo, hi, v)
        for text in ("-0", "007", "+1", "1.0", "", "-"):
            assert not pattern.fullmatch(text)
    assert int_range_regex(5, 4) is None


def test_number_forms_print_back_unchanged():
    """Every number the grammar allows is printed back by Python (and so by the Jinja template) unchanged."""
    import random
    import re

    rng = random.Random(1)
    number = re.compile(f"{INTEGER_REGEX}|{NUMBER_REPR_REGEX}")
    texts = []
    for _ in range(20000):
        whole = rng.choice(["0", str(rng.randint(1, 10 ** rng.randint(1, 16)))])
        frac = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 17)))
        sign = rng.choice(["", "-"])
        texts += [sign + whole, f"{sign}{whole}.{frac}"]
    n_allowed = 0
    for text in texts:
        if number.fullmatch(text):
            n_allowed += 1
            value = json.loads(text)
            assert str(value) == text, text
    assert n_allowed > 4000
    for value in (0.1, 2.5, -3.75, 1234.5678, 0.0001, 99999999999999.9, 1e-4, 100.0, -0.5):
        assert number.fullmatch(repr(value)), value
    for text in ("1e-05", "1.50", "-0", "0.00001", "1e16", "1234567890123456.0", ".5", "5.", "0.30000000000000004"):
        assert not number.fullmatch(text), text


# ------------------------------------------------------------------------------------------------ parsers


def test_gemma4_parser_streams_json_deltas():
    parser = Gemma4ToolCallParser(id_prefix="call_abc_", ids=GEMMA4_IDS)
    feed = [(48, ""), (-1, "call:get_"), (-1, "weather{city:"), (52, ""), (-1, 'Pa"ri\\s\t'), (-1, "\n\x01"),
            (52, ""), (-1, ",Days:1"), (-1, "2}"), (49, ""), (50, "")]
    steps = [parser.feed(t, text) for t, text in feed]
    header = {"index": 0, "id": "call_abc_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}

    def args(fragment):
        return {"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}

    assert steps == [[], [], [{"tool_calls": [header]}, args('{"city":')], [args('"')], [args('Pa\\"ri\\\\s\\t')],
                     [args("\\n\\u0001")], [args('"')], [args(',"Days":')], [args('12}')], [], []]
    result = parser.result()
    arguments = '{"city":"Pa\\"ri\\\\s\\t\\n\\u0001","Days":12}'
    assert result.tool_calls == [ToolCall("call_abc_0", "get_weather", arguments)]
    assert json.loads(result.tool_calls[0].arguments) == {"city": 'Pa"ri\\s\t\n\x01', "Days": 12}
    assert result.content == "" and not result.truncated


def test_gemma4_parser_content_utf8_nested_and_truncation():
    parser = Gemma4ToolCallParser(control_ids={100}, ids=GEMMA4_IDS)
    out = []
    for t, b in [(-1, b"Caf\xc3"), (-1, b"\xa9 "), (100, b"<|channel>"), (48, b""), (-1, b"call:f{a:[[],{}"),
                 (-1, b",[1,-2.5,true,null],{b:"), (52, b""), (-1, b"\xe6\x9d"), (-1, b"\xb1"), (52, b""),
                 (-1, b"}],c:{},d:false}"), (49, b""), (48, b""), (-1, b"call:g{x:")]:
        out += parser.feed(t, b)
    out += parser.finish()
    result = parser.result()
    assert result.content == "Café " and result.truncated
    assert [c.arguments for c in result.tool_calls] == ['{"a":[[],{},[1,-2.5,true,null],{"b":"東"}],"c":{},"d":false}']
    assert out[0] == {"content": "Caf"} and out[1] == {"content": "é "}
    assert [d["tool_calls"][0]["id"] for d in out if "tool_calls" in d and "id" in d["tool_calls"][0]] == ["call_0",
                                                                                                        "call_1"]
    empty = parse_gemma4_tool_calls("<|tool_call>call:now{}<tool_call|><|tool_response>")
    assert empty.tool_calls == [ToolCall("call_0", "now", "{}")]


@pytest.mark.parametrize("text", [
    "<|tool_call>call:f{a:tru}<tool_call|>",
    "<|tool_call>call:f{a:1<tool_call|>",
    "<|tool_call>f{a:1}<tool_call|>",
    "<|tool_call>call:f{a:1,}<tool_call|>",
    "<|tool_call>call:f{a:1}x<tool_call|>",
    "<|tool_call>call:f{a:1}<|tool_response>",
    '<|tool_call>call:f{<|"|>a<|"|>:1}<tool_call|>',
])
def test_gemma4_parser_rejects_malformed_calls(text):
    with pytest.raises(ToolCallParseError):
        parse_gemma4_tool_calls(text)


def test_gemma3_parser_streams_arguments_verbatim():
    parser = Gemma3ToolCallParser(ids=GEMMA3_IDS)
    pieces = ['{"tool_', 'calls": [{"name": "get_', 'weather", "arguments": {"city"', ': "}\\"{", "n": [1, ',
              '{}]}}, {"name": "now", "arguments": {}}]}']
    steps = [parser.feed(-1, p) for p in pieces] + [parser.feed(106, "")]
    flat = [d for step in steps for d in step]
    assert flat[0] == {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                       "function": {"name": "get_weather", "arguments": ""}}]}
    result = parser.result()
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"city": "}\\"{", "n": [1, {}]}'),
                                                                 ("now", "{}")]
    assert steps[2] == [flat[0], {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}]
    text = parse_gemma3_tool_calls("Use {braces} freely.<end_of_turn>")
    assert text.content == "Use {braces} freely." and text.tool_calls == []
    other = parse_gemma3_tool_calls('{"calls": []} {"tool" {"tool_calls<end_of_turn>')
    assert other.content == '{"calls": []} {"tool" {"tool_calls' and other.tool_calls == []


def test_gemma3_parser_lazy_trigger_streams_content_then_the_call():
    """Text before the trigger streams as content (held back only while it may still be the trigger), then the
    call streams as tool_calls deltas, whatever the token boundaries."""
    answer = 'Checking now {"tool_calls": [{"name": "f", "arguments": {"a": "b"}}]}'
    for cut in range(1, len(answer)):  # every split of the answer over two "tokens"
        parser = Gemma3ToolCallParser(ids=GEMMA3_IDS)
        first = parser.feed(-1, answer[:cut].encode())
        rest = parser.feed(-1, answer[cut:].encode()) + parser.feed(106) + parser.finish()
        content = "".join(d.get("content", "") for d in first + rest)
        assert content == "Checking now "
        held = "".join(d.get("content", "") for d in first)
        assert content.startswith(held) and min(cut, len(content)) - len(held) < len(GEMMA3_CALL_TRIGGER)
        result = parser.result()
        assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", '{"a": "b"}')]


@pytest.mark.parametrize("text", [
    '{"tool_calls": [{"arguments": {}, "name": "x"}]}',
    '{"tool_calls": {}}',
    'Text first {"tool_calls": [{"name": "x"}]}',
    '{"tool_calls": [{"name": "x", "arguments": []}]}',
    '{"tool_calls": [{"name": "x", "arguments": {}}]} trailing',
    '{"tool_calls": [{"name": "x", "arguments": {}}]<end_of_turn>',
])
def test_gemma3_parser_rejects_malformed_calls(text):
    with pytest.raises(ToolCallParseError):
        parse_gemma3_tool_calls(text)


def test_validation_schema_reads_nullable_as_or_null():
    schema = {"type": "object", "properties": {"a": {"type": "integer", "nullable": True},
                                               "b": {"enum": ["x"], "nullable": True},
                                               "c": {"$ref": "#/$defs/d", "nullable": True}},
              "$defs": {"d": {"type": "string"}}}
    validator = jsonschema.Draft202012Validator(validation_schema(schema))
    assert validator.is_valid({"a": None, "b": None, "c": None}) and validator.is_valid({"a": 1, "b": "x", "c": "s"})
    assert not validator.is_valid({"a": "1"})
    with pytest.raises(ToolCallParseError, match="do not match"):
        validate_tool_arguments(TOOLS, "get_weather", '{"city": 3}')
    with pytest.raises(ToolCallParseError, match="no tool"):
        validate_tool_arguments(TOOLS, "nope", "{}")


def test_recursive_refs_are_supported(g4_lltok, g3_lltok):
    tree = _fn("tree", {
        "type": "object",
        "$defs": {"node": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "properties": {"root": {"$ref": "#/$defs/node"}},
        "required": ["root"],
    })
    g4 = gemma4_tool_grammar([tree], "required", False, ids=GEMMA4_IDS)
    assert _accepts(g4_lltok, g4, _call4("tree", "root:{children:[{children:[],name:QaQ}],name:QbQ}") + [50])
    assert not _accepts(g4_lltok, g4, _call4("tree", "root:{children:[{}],name:QbQ}") + [50])
    result = parse_gemma4_tool_calls('<|tool_call>call:tree{root:{children:[{name:<|"|>a<|"|>}],name:<|"|>b<|"|>}}'
                                     "<tool_call|><|tool_response>")
    assert validate_tool_arguments([tree], "tree", result.tool_calls[0].arguments)["root"]["children"][0]["name"] == "a"
    g3 = gemma3_tool_grammar([tree], "required", False, ids=GEMMA3_IDS)
    args = '{"root": {"name": "b", "children": [{"name": "a", "children": []}]}}'
    assert _accepts(g3_lltok, g3, ['{"tool_calls": [{"name": "tree", "arguments": ' + args + "}]}", 106])
