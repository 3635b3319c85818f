"""Budget-aware endings inside a value (gateway/structured/endings.py): sampled structured answers end valid within max_tokens.

Model-free, with the real vocabularies (the embedded Gemma 3's; the Gemma 4 test tokenizer's). The adversary stands
in for a model sampled at temperature 1.5: each step it takes the grammar's forced tokens, else a seeded random
choice among the tokens the mask allows, weighted towards long tokens and tokens outside ASCII (the CJK and
private-use runaway that an unforced string showed, which a uniform choice over 262k tokens also favours). Over 50 seeds per case and
budgets from the shortest valid answer up, every json_schema answer must parse and validate with jsonschema, and
every required tool call must parse (not truncated) with arguments that validate; an answer with room to spare must
be the one the bare grammar gives, token for token.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from families.gemma3.gateway import PUBLISHED_IDS as GEMMA3_IDS
from families.gemma3.gateway import Gemma3ToolCallParser, gemma3_tool_grammar
from families.gemma4.gateway import PUBLISHED_IDS as GEMMA4_IDS
from families.gemma4.gateway import Gemma4ToolCallParser, gemma4_tool_grammar
from gateway.generation.reasoning import ThoughtFirst
from gateway.structured.budget import BudgetedUnits
from gateway.structured.constraints import Constraint
from gateway.structured.endings import BudgetedEnding, Work, ending_tables, grammar_specials, shortest_ending
from gateway.structured.grammar_cache import grammar_for_json_schema
from tests.gateway.conftest import N_VOCAB

SEEDS = 50
#: The issue's schema: {city: string, days: integer 1-14, mode: enum, stops: array of <= 3 strings}.
TRIP = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "mode": {"enum": ["car", "train", "bicycle"]},
    "stops": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["city", "days", "mode", "stops"], "additionalProperties": False}
#: Elements whose shortest form is long (one `,{` raises the ending a lot), optional keys, formats, lengths.
VISITS = {"type": "object", "properties": {
    "visits": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {
            "place": {"type": "string", "minLength": 2}, "date": {"type": "string", "format": "date"},
            "note": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {"enum": ["x", "yy"]}}},
        "required": ["place", "date"], "additionalProperties": False}},
    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    "ok": {"type": "boolean"}},
    "required": ["visits", "code"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]}},
    "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "minLength": 1},
                                     "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def weights3(g3):
    return _weights(g3[0])


@pytest.fixture(scope="module")
def weights4(g4):
    return _weights(g4[0])


def _weights(tok) -> np.ndarray:
    """The adversary's preference per token: (bytes + 1)^2, times 4 outside ASCII; control tokens 1."""
    w = np.ones(N_VOCAB)
    for i in range(tok.vocab_size):
        if not tok.is_special_token(i):
            b = tok.decode_bytes([i])
            w[i] = (len(b) + 1) ** 2 * (4 if any(c >= 0x80 for c in b) else 1)
    return w


def _sample(c, budget: int, seed: int, weights: np.ndarray) -> list[int]:
    """Generate at most `budget` tokens as the adversary (module docstring); forced tokens are taken as the gateway
    takes them (a run, cut at the budget)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < budget and not c.finished():
        forced = [] if c.done() else c.forced()
        if forced:
            for t in forced[: budget - len(out)]:
                c.advance(t)
                out.append(t)
            continue
        allowed = np.unpackbits(np.frombuffer(c.mask(), np.uint8), bitorder="little").astype(bool)
        p = np.where(allowed[:N_VOCAB], weights, 0.0)
        t = int(rng.choice(N_VOCAB, p=p / p.sum()))
        c.advance(t)
        out.append(t)
    return out


def _shortest(c) -> int:
    need = c.shortest()
    assert need is not None
    return need


def _budgets(shortest: int) -> list[int]:
    """One budget per seed, from the shortest answer up: most within a few tokens of it (where the ending is
    forced or the mask filtered), some with room."""
    return [shortest + (0, 1, 2, 2, 3, 5, 8, 13, 30, 60)[s % 10] for s in range(SEEDS)]


# ------------------------------------------------------------------------------------------------ json_schema


@pytest.mark.parametrize("schema", [TRIP, VISITS], ids=["trip", "visits"])
def test_sampled_json_answers_end_valid_within_their_budget(g3, weights3, schema):
    tok, _ = g3
    tables, grammar = ending_tables(tok), grammar_for_json_schema(schema)
    make = lambda budget: BudgetedEnding(Constraint(tok, grammar, N_VOCAB, [1, 106]), budget, tables)  # noqa
    shortest = _shortest(make(1000))
    checker = jsonschema.FormatChecker()
    for seed, budget in enumerate(_budgets(shortest)):
        c = make(budget)
        out = _sample(c, budget, seed, weights3)
        text = tok.decode_str(out[:-1])
        assert len(out) <= budget and out[-1] in (1, 106) and c.finished(), (seed, budget, text)
        jsonschema.validate(json.loads(text), schema, format_checker=checker)


def test_the_issue_case_closes_the_string_instead_of_running_to_the_limit(g3, weights3):
    """`{"city":"` then rare characters: at max_tokens 120 the answer still ends valid, and every budget from the
    shortest answer up gives one; below it the planner refuses (the shortest answer is what `shortest()` says)."""
    tok, _ = g3
    tables, grammar = ending_tables(tok), grammar_for_json_schema(TRIP)
    c = BudgetedEnding(Constraint(tok, grammar, N_VOCAB, [1, 106]), 120, tables)
    opening = tok.tokenize_str('{"city":"')
    for t in opening:
        c.advance(t)
    cjk = [t for t in tok.tokenize_str("東京都渋谷区神宮前一丁目二番地三号" * 8)]
    out = list(opening)
    for t in cjk:  # a model that only wants CJK: it takes every CJK token the mask lets through
        if c.finished() or c.forced():
            break
        if not np.frombuffer(c.mask(), np.uint8)[t >> 3] >> (t & 7) & 1:
            break
        c.advance(t)
        out.append(t)
    out += _sample(c, 120 - len(out), 1, weights3)
    assert len(out) <= 120 and c.finished() and c.capped()
    value = json.loads(tok.decode_str(out[:-1]))
    jsonschema.validate(value, TRIP)
    assert value["city"].startswith("東京都")


# ------------------------------------------------------------------------------------------------ tool calls


def _calls(parser, token_bytes, out):
    """The tool calls a family's parser reads in `out`."""
    for t in out:
        parser.feed(t, token_bytes[t])
    parser.finish()
    return parser.result()


@pytest.mark.parametrize("family, choice", [
    ("gemma3", "required"), ("gemma3", {"type": "function", "function": {"name": "search"}}),
    ("gemma4", "required")], ids=["gemma3-required", "gemma3-named", "gemma4-required"])
def test_sampled_required_tool_calls_end_valid_within_their_budget(g3, g4, weights3, weights4, family, choice):
    tok, token_bytes = g3 if family == "gemma3" else g4
    weights = weights3 if family == "gemma3" else weights4
    grammar_of, ids, stops, parser = ((gemma3_tool_grammar, GEMMA3_IDS, [1, 106], Gemma3ToolCallParser)
                                      if family == "gemma3" else
                                      (gemma4_tool_grammar, GEMMA4_IDS, [1, 50, 106], Gemma4ToolCallParser))
    parallel = choice == "required"
    tables = ending_tables(tok)

    def make(budget):
        def build(n):
            return Constraint(tok, grammar_of(TOOLS, choice, parallel, n or 16, ids=ids), N_VOCAB, stops,
                              grammar_ends=True)
        inner = BudgetedUnits(build, budget, parser(ids=ids), token_bytes, 3) if parallel else build(None)
        return BudgetedEnding(inner, budget, tables)

    shortest = _shortest(make(1000))
    for seed, budget in enumerate(_budgets(shortest)):
        c = make(budget)
        out = _sample(c, budget, seed, weights)
        result = _calls(parser(ids=ids), token_bytes, out)
        assert len(out) <= budget and c.finished() and not result.truncated, (seed, budget, tok.decode_str(out))
        assert result.tool_calls, (seed, budget)
        for call in result.tool_calls:
            jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])


# ------------------------------------------------------------------------------------------------ unchanged


def _follow(c, script: list[int], budget: int) -> list[int]:
    """A greedy model that wants `script`: it takes its next token whenever the mask allows it, else (the budget
    ran short) what the grammar forces, else the allowed token of smallest id."""
    out: list[int] = []
    while len(out) < budget and not c.finished():
        mask = np.frombuffer(c.mask(), np.uint8)
        want = script[len(out)] if len(out) < len(script) else None
        if want is not None and mask[want >> 3] >> (want & 7) & 1:
            t = want
        else:
            forced = c.forced()
            t = forced[0] if forced else int(np.flatnonzero(np.unpackbits(mask, bitorder="little"))[0])
        c.advance(t)
        out.append(t)
    return out


def test_a_greedy_answer_that_fits_is_unchanged(g3):
    """An answer that fits its budget (exactly, or with room) is the model's own, token for token (with room, nothing
    is forced; at an exact fit the forced ending is the model's own); one token less, and the answer still ends
    valid (forced, its stop within the budget)."""
    tok, _ = g3
    tables, grammar = ending_tables(tok), grammar_for_json_schema(TRIP)
    answer = {"city": "Paris", "days": 3, "mode": "train", "stops": ["Dijon", "Lyon"]}
    script = tok.tokenize_str(json.dumps(answer, separators=(",", ":"))) + [106]
    for budget in (len(script), len(script) + 1, len(script) + 20, 500):
        c = BudgetedEnding(Constraint(tok, grammar, N_VOCAB, [1, 106]), budget, tables)
        assert _follow(c, script, budget) == script, budget
        assert c.capped() == (budget == len(script))  # an exact fit ends as forced: the model's own ending
    c = BudgetedEnding(Constraint(tok, grammar, N_VOCAB, [1, 106]), len(script) - 1, tables)
    out = _follow(c, script, len(script) - 1)
    assert out[-1] in (1, 106) and c.capped()
    jsonschema.validate(json.loads(tok.decode_str(out[:-1])), TRIP)


def test_the_shortest_ending_of_a_thought_closes_it_first(g4):
    """Gemma 4 thinking before a JSON answer: inside the thought, the ending is the channel's close token, then the
    shortest answer; a budget that runs short inside the thought still ends with a valid answer."""
    tok, token_bytes = g4
    tables, grammar = ending_tables(tok), grammar_for_json_schema(TRIP)
    c = BudgetedEnding(ThoughtFirst(Constraint(tok, grammar, N_VOCAB, [1, 106]), N_VOCAB, 100, 101, [1, 106]),
                       40, tables)
    shortest = c.shortest()
    thought = [100] + tok.tokenize_str("let me think " * 20)
    out = _follow(c, thought, 40)
    assert len(out) <= 40 and c.finished() and 101 in out
    answer = out[out.index(101) + 1:-1]
    jsonschema.validate(json.loads(tok.decode_str(answer)), TRIP)
    assert len(answer) + 1 == shortest


def test_the_search_finds_the_shortest_values_and_the_grammars_control_tokens(g3, g4):
    tok3, _ = g3
    c = Constraint(tok3, grammar_for_json_schema(TRIP), N_VOCAB, [1, 106])
    for t in tok3.tokenize_str('{"city":"Ro'):
        c.advance(t)
    ending = shortest_ending(c.matcher_copy(), ending_tables(tok3))
    value = json.loads("{" + tok3.decode_str(c._tokens + ending)[1:])
    assert value["city"] == "Ro" and value["days"] == 1 and value["stops"] == []
    tok4, _ = g4
    grammar = gemma4_tool_grammar(TOOLS, "required", True, 16, ids=GEMMA4_IDS)
    specials = grammar_specials(grammar)
    assert 52 in specials and 50 in specials
    c = Constraint(tok4, grammar, N_VOCAB, [1, 50, 106], grammar_ends=True)
    ending = shortest_ending(c.matcher_copy(), ending_tables(tok4), specials)
    assert ending is not None and ending[-1] == 50
    assert shortest_ending(c.matcher_copy(), ending_tables(tok4), specials, limit=3) is None
    assert shortest_ending(c.matcher_copy(), ending_tables(tok4), specials, work=Work(5)) is None  # bounded work


def test_a_grammar_without_a_found_ending_is_left_as_it_was(g3):
    """A pattern of non-ASCII letters is outside the search's alphabet: no ending, so nothing is forced or filtered
    (the budget cuts the answer, as before) and the planner has no shortest answer to refuse a limit by."""
    tok, _ = g3
    schema = {"type": "string", "pattern": "^[éж]{3}$"}
    bare = Constraint(tok, grammar_for_json_schema(schema), N_VOCAB, [1, 106])
    c = BudgetedEnding(Constraint(tok, grammar_for_json_schema(schema), N_VOCAB, [1, 106]), 3, ending_tables(tok))
    assert c.shortest() is None
    for t in tok.tokenize_str('"éж'):  # 3 tokens or more: the budget would be spent with the value still open
        assert c.mask() == bare.mask() and c.forced() == bare.forced()
        c.advance(t)
        bare.advance(t)
    assert not c.capped()


def test_a_grammar_without_a_found_ending_is_not_searched_at_every_token(g3, monkeypatch):
    """After a search finds no ending, the next waits `RETRY_AFTER_NONE` tokens: a client's schema whose ending is
    beyond the search (a string of at least 4,500 characters) costs a few failing searches per answer, not one per
    token, and its masks are the grammar's own."""
    from gateway.structured import endings

    tok, _ = g3
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 4500}}, "required": ["a"]}
    grammar = grammar_for_json_schema(schema)
    bare = Constraint(tok, grammar, N_VOCAB, [1, 106])
    c = BudgetedEnding(Constraint(tok, grammar, N_VOCAB, [1, 106]), 100, ending_tables(tok))
    searches = []
    search = endings.shortest_ending
    monkeypatch.setattr(endings, "shortest_ending", lambda *a, **k: searches.append(1) or search(*a, **k))
    steps = 96
    head = tok.tokenize_str('{"a": "')
    script = head + [tok.tokenize_str("x")[-1]] * (steps - len(head))  # one character a token
    for t in script:
        assert c.mask() == bare.mask() and c.forced() == bare.forced()
        c.advance(t)
        bare.advance(t)
    assert 1 <= len(searches) <= steps // endings.RETRY_AFTER_NONE + 2, len(searches)
