"""Budget-aware endings (gateway/structured/budget.py) on scripted token streams, model-free, with the real
vocabularies.

A scripted "model" wants to write a fixed answer (calls of known sizes); each step it takes its next token if the
constraint's mask allows it, else the grammar's forced token, else the only allowed stop token. The budget is
set to run out before, inside and after a unit; the answer must end after a complete call when the budget
cannot fit another, be cut (never invented) otherwise, and always parse.
"""

from __future__ import annotations

import json

import numpy as np

from families.gemma3.gateway import PUBLISHED_IDS as GEMMA3_IDS
from families.gemma3.gateway import Gemma3ToolCallParser, gemma3_tool_grammar
from families.gemma4.gateway import PUBLISHED_IDS as GEMMA4_IDS
from families.gemma4.gateway import Gemma4ToolCallParser, gemma4_tool_grammar
from gateway.generation.reasoning import ThoughtFirst
from gateway.planning.chat_plan import _array_units
from gateway.structured.budget import BudgetedUnits, JsonArrayProgress
from gateway.structured.constraints import Constraint
from gateway.structured.grammar_cache import grammar_for_json_schema
from tests.gateway.conftest import N_VOCAB

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _allowed(mask: bytes, token: int) -> bool:
    return bool(mask[token >> 3] >> (token & 7) & 1)


def _drive(constraint, script: list[int], budget: int, stops: set[int], tok) -> list[int]:
    """Generate at most `budget` tokens, preferring the script's next token (or a shorter piece of its text),
    else a forced one, else an allowed stop or closing bracket (module docstring)."""
    out: list[int] = []
    while len(out) < budget and not constraint.finished():
        mask = constraint.mask()
        want = script[len(out)] if len(out) < len(script) else None
        wanted = tok.decode_bytes([want]) if want is not None else b""
        shorter = [tok.tokenize_bytes(wanted[:k])[0] for k in range(len(wanted) - 1, 0, -1)]
        if want is not None and _allowed(mask, want):
            token = want
        elif any(_allowed(mask, t) for t in shorter):  # the model spells its text in smaller pieces
            token = next(t for t in shorter if _allowed(mask, t))
            script = script[:len(out)] + [token] + tok.tokenize_bytes(tok.decode_bytes(script[len(out):])[
                len(tok.decode_bytes([token])):])
        else:
            forced = constraint.forced()
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little"))
            closing = [t for t in allowed if t in stops] or [
                t for t in allowed if t < 1000 and set(tok.decode_bytes([int(t)]) or b"?") <= set(b"]}")]
            token = forced[0] if forced else int(closing[0])
        constraint.advance(token)
        out.append(token)
    return out


def _g3_case(g3, budget: int, cities: list[str]):
    tok, token_bytes = g3
    calls = ", ".join('{"name": "get_weather", "arguments": {"city": "%s"}}' % c for c in cities)
    script = tok.tokenize_str('{"tool_calls": [' + calls + "]}") + [106]
    make = lambda n: Constraint(  # noqa
        tok, gemma3_tool_grammar(TOOLS, "required", True, n or 16, ids=GEMMA3_IDS), N_VOCAB, [1, 106],
        grammar_ends=True)
    c = BudgetedUnits(make, budget, Gemma3ToolCallParser(ids=GEMMA3_IDS), token_bytes,
                      len(tok.tokenize_str("]}")) + 2)
    out = _drive(c, script, budget, {106}, tok)
    ended = [1] if c.capped() and out[-1] == 106 else []  # what the gateway counts: capped, ended by a stop
    parser = Gemma3ToolCallParser(ids=GEMMA3_IDS)
    for t in out:
        parser.feed(t, token_bytes[t])
    parser.finish()
    return script, out, parser.result(), c, ended


def _unit(g3, city="Oslo") -> int:
    tok, _ = g3
    return len(tok.tokenize_str(', {"name": "get_weather", "arguments": {"city": "%s"}}' % city))


def test_gemma3_budget_ends_after_the_last_call_that_fits(g3):
    """The issue's case: the model wants a fourth call the budget cannot fit: the answer ends after three."""
    tok, _ = g3
    opening = len(tok.tokenize_str('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}'))
    budget = opening + 2 * _unit(g3) + _unit(g3) // 2  # room for 2.5 more calls and the close
    script, out, result, c, ended = _g3_case(g3, budget, ["Oslo"] * 4)
    assert len(out) <= budget and out[-1] == 106 and c.finished()
    assert not result.truncated and [json.loads(x.arguments) for x in result.tool_calls] == [{"city": "Oslo"}] * 3
    assert c.max_units == 3 and ended == [1]


def test_gemma3_budget_with_room_changes_nothing(g3):
    script, out, result, c, ended = _g3_case(g3, 200, ["Oslo", "Paris", "Rome", "Bergen"])
    assert out == script and len(result.tool_calls) == 4 and c.max_units is None and not ended


def test_gemma3_budget_before_the_first_unit_is_a_plain_cut(g3):
    """No unit has been measured yet: nothing is forced, max_tokens cuts the call (finish_reason length)."""
    script, out, result, c, ended = _g3_case(g3, 8, ["Oslo", "Paris"])
    assert out == script[:8] and result.truncated and not result.tool_calls and not ended


def test_gemma3_budget_inside_a_longer_unit_is_never_invented(g3):
    """A call much longer than the ones before it is not closed early: the budget cuts it (only ending is
    forced), and the calls before it stay complete."""
    long_city = "Llanfairpwllgwyngyllgogerychwyrndrobwllllantysiliogogogoch" * 2
    tok, _ = g3
    opening = len(tok.tokenize_str('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}'))
    budget = opening + _unit(g3) + 8  # the second unit (long) starts with room for a short one only
    script, out, result, c, ended = _g3_case(g3, budget, ["Oslo", long_city])
    assert out == script[:budget] and result.truncated and len(result.tool_calls) == 1


def test_gemma3_budget_at_the_boundary(g3):
    """Room for two calls and the close (plus the spare token): both calls, then the close, within budget —
    the third call's `}},` token (which would start another call) is masked."""
    tok, _ = g3
    two = tok.tokenize_str('{"tool_calls": [' + ", ".join(['{"name": "get_weather", "arguments": {"city": "Oslo"}}'] * 2)
                           + "]}") + [106]
    script, out, result, c, ended = _g3_case(g3, len(two) + 1, ["Oslo"] * 3)
    assert len(out) <= len(two) + 1 and out[-1] == 106 and c.finished()
    assert len(result.tool_calls) == 2 and not result.truncated and ended == [1]


def test_gemma4_budget_ends_after_the_last_call_that_fits(g4):
    tok, token_bytes = g4
    call = [48] + tok.tokenize_str("call:get_weather{city:") + [52] + tok.tokenize_str("Oslo") + [52] + \
        tok.tokenize_str("}") + [49]
    script = call * 4 + [50]
    make = lambda n: Constraint(  # noqa
        tok, gemma4_tool_grammar(TOOLS, "required", True, n or 16, ids=GEMMA4_IDS), N_VOCAB, [1, 50, 106],
        grammar_ends=True)
    budget = 3 * len(call) + 3  # three calls and the close, not a fourth
    c = BudgetedUnits(make, budget, Gemma4ToolCallParser(ids=GEMMA4_IDS), token_bytes, 1)
    out = _drive(c, script, budget, {50}, tok)
    assert out == call * 3 + [50] and c.max_units == 3
    parser = Gemma4ToolCallParser(ids=GEMMA4_IDS)
    for t in out:
        parser.feed(t, token_bytes[t])
    assert len(parser.result().tool_calls) == 3 and not parser.result().truncated


def test_json_array_budget_ends_after_the_last_element_that_fits(g3):
    """A JSON answer whose schema is an array ends after a complete element (finish_reason stop), not inside
    one; with room, nothing changes."""
    tok, token_bytes = g3
    schema = {"type": "array", "items": {"type": "object", "properties": {"city": {"type": "string"}},
                                         "required": ["city"]}}
    capped = _array_units({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    make = lambda n: Constraint(tok, grammar_for_json_schema(schema) if n is None else capped(n), N_VOCAB,  # noqa
                                [1, 106])
    script = tok.tokenize_str(json.dumps([{"city": "Oslo"}] * 5)) + [106]
    element = len(tok.tokenize_str(', {"city": "Oslo"}'))
    for budget, want in ((len(script) + 3 * element + 5, 5), (len(tok.tokenize_str('[{"city": "Oslo"}')) + 2 * element + 4, 3)):
        c = BudgetedUnits(make, budget, JsonArrayProgress(), token_bytes, 3)
        out = _drive(c, script, budget, {106}, tok)
        assert len(out) <= budget and out[-1] == 106 and c.finished()
        assert json.loads(tok.decode_str(out[:-1])) == [{"city": "Oslo"}] * want
        assert c.max_units == (None if want == 5 else want)


def test_json_array_progress_counts_elements_not_nested_values():
    progress = JsonArrayProgress()
    seen = []
    for piece in ['[{"a": "x]}\\"', ',"}, ', '"b, c"', ", 12", ", [1, 2]", "]"]:
        progress.feed(0, piece.encode())
        seen.append(progress.progress())
    assert seen == [(0, True), (1, False), (2, False), (2, True), (4, False), (4, False)]  # 12 ends at its comma


def test_a_thought_is_no_part_of_any_unit(g4):
    """Gemma 4 thinking before a JSON array: brackets in the thought are not elements and the thought's length
    is not a unit's, so a budget with room for the array ends nothing early."""
    tok, token_bytes = g4
    schema = {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}}
    capped = _array_units({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})

    def make(n):
        inner = Constraint(tok, grammar_for_json_schema(schema) if n is None else capped(n), N_VOCAB, [1, 106])
        return ThoughtFirst(inner, N_VOCAB, 100, 101, [1, 106])

    answer = tok.tokenize_str('["a", "b", "c"]') + [106]
    script = [100] + tok.tokenize_str("thought\n" + "[1, 2, 3] " * 40) + [101] + answer
    c = BudgetedUnits(make, len(script) + 2, JsonArrayProgress(), token_bytes, 3)
    assert _drive(c, script, len(script) + 2, {106}, tok) == script and c.max_units in (None, 3)


def test_json_array_progress_counts_a_last_number():
    progress = JsonArrayProgress()
    progress.feed(0, b"[1, 2]")
    assert progress.progress() == (2, False)


def test_gemma3_budget_before_the_first_call_ends(g3):
    """No call is complete yet, but the budget could not fit a second call as long as the first already is: the
    first call is the last (a `}},` token would otherwise end it and open a second that max_tokens cuts)."""
    tok, _ = g3
    first = len(tok.tokenize_str('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}'))
    script, out, result, c, ended = _g3_case(g3, first + _unit(g3) // 2, ["Oslo", "Tokyo"])
    assert out[-1] == 106 and not result.truncated and c.max_units == 1 and ended == [1]
    assert [json.loads(x.arguments) for x in result.tool_calls] == [{"city": "Oslo"}]


def test_a_parsers_copy_shares_only_what_never_changes():
    """`copy.deepcopy` of a tool-call parser (what `BudgetedUnits.fork` does at every drafted step) shares the
    control ids (thousands of them: copying them cost ~2.5 ms a step) and copies the state: the copy and the
    original, fed different continuations, each end with their own call and neither sees the other's."""
    import copy

    parser = Gemma3ToolCallParser("call_", range(6000), ids=GEMMA3_IDS)
    for ch in '{"tool_calls": [{"name": "f", "arguments": {"a": "':
        parser.feed(-1, ch)
    twin = copy.deepcopy(parser)
    assert twin._control is parser._control and twin._out is not parser._out
    for ch in 'x"}}]}':
        parser.feed(-1, ch)
    for ch in 'yz"}}]}':
        twin.feed(-1, ch)
    assert [c.arguments for c in parser.result().tool_calls] == ['{"a": "x"}']
    assert [c.arguments for c in twin.result().tool_calls] == ['{"a": "yz"}']
