"""ConstraintDriver never sends the worker a message for a step at or past max_tokens: the worker ends the Decode
stream there, and a message written after that end fails the whole call (gRPC marks it INTERNAL). Its drafts
(speculative decoding of constrained requests) carry exactly the masks that step-by-step decoding would send."""

from __future__ import annotations

import numpy as np
import pytest

from families.gemma3.gateway import PUBLISHED_IDS as GEMMA3_IDS
from families.gemma3.gateway import Gemma3ToolCallParser, gemma3_tool_grammar
from gateway.generation.generate import ConstraintDriver
from gateway.structured.budget import BudgetedUnits
from gateway.structured.constraints import Constraint
from gateway.structured.endings import BudgetedEnding, ending_tables
from gateway.structured.grammar_cache import grammar_for_json_schema
from protos import common_pb2
from tests.gateway.conftest import N_VOCAB, TokenBytes


class ForcingConstraint:
    """A grammar that forces token 7 forever (a long forced run at every step)."""

    vocab_size = 16

    def __init__(self):
        self.advanced = []

    def mask(self) -> bytes:
        return bytes([0x80, 0])

    def forced(self) -> list[int]:
        return [7] * 40

    def done(self) -> bool:
        return False

    def finished(self) -> bool:
        return False

    def advance(self, token: int) -> None:
        self.advanced.append(token)


def _steps(messages) -> list[tuple[int, int]]:
    """(first step, last step) each message covers."""
    return [(m.step, m.step + max(len(m.forced.token_ids), 1) - 1) for m in messages]


def test_nothing_is_sent_at_or_past_max_tokens():
    for max_tokens in (2, 5, 13, 30):
        driver = ConstraintDriver(ForcingConstraint(), max_tokens=max_tokens)
        sent = driver.on_tokens([common_pb2.GeneratedToken(token_id=7)])
        assert sent and all(last < max_tokens for _, last in _steps(sent)), (max_tokens, _steps(sent))
        assert len(driver.c.advanced) <= max_tokens
        more = driver.on_tokens([common_pb2.GeneratedToken(token_id=7, forced=True)] * (max_tokens - 1))
        assert all(last < max_tokens for _, last in _steps(more)), (max_tokens, _steps(more))


def test_without_a_limit_the_whole_run_is_sent():
    driver = ConstraintDriver(ForcingConstraint())
    (run, mask) = driver.on_tokens([common_pb2.GeneratedToken(token_id=7)])
    assert list(run.forced.token_ids) == [7] * 40 and mask.step == 41


# ----- drafts: a verified draft gets exactly the masks step-by-step decoding gets ------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _allowed(mask: bytes, token: int) -> bool:
    return bool(mask[token >> 3] >> (token & 7) & 1)


def _choose(mask: bytes, script: list[int], at: int, tok) -> tuple[int, list[int]]:
    """A scripted model: the script's token at `at` if the mask allows it, else a shorter piece of its text (the
    script re-spelled after it), else the lowest allowed token. Returns (token, script)."""
    want = script[at] if at < len(script) else None
    if want is not None and _allowed(mask, want):
        return want, script
    if want is not None:
        wanted = tok.decode_bytes([want])
        for k in range(len(wanted) - 1, 0, -1):
            piece = tok.tokenize_bytes(wanted[:k])[0]
            if _allowed(mask, piece):
                rest = tok.tokenize_bytes(tok.decode_bytes(script[at:])[len(tok.decode_bytes([piece])):])
                return piece, script[:at] + [piece] + rest
    return int(np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little"))[0]), script


def _simulate(make, script: list[int], max_tokens: int, max_draft: int, context: list[int], tok):
    """Drive a ConstraintDriver as the worker would, one token per step (forced runs appended as runs): the
    tokens, the mask sent for every sampled step, and the drafts sent (step -> (tokens, masks))."""
    driver = ConstraintDriver(make(), max_tokens=max_tokens, context=context)
    driver.max_draft = max_draft
    masks, drafts, tokens, run = {0: driver.initial_mask()}, {}, [], []
    while len(tokens) < max_tokens:
        if run:
            sent = driver.on_tokens([common_pb2.GeneratedToken(token_id=t, forced=True) for t in run])
            tokens += run
            run = []
        else:
            token, script = _choose(masks[len(tokens)], script, len(tokens), tok)
            tokens.append(token)
            if driver.c.finished() or len(tokens) >= max_tokens:
                break
            sent = driver.on_tokens([common_pb2.GeneratedToken(token_id=token)])
        for m in sent:
            if m.HasField("forced"):
                run = list(m.forced.token_ids)
            else:
                masks[m.step] = m.mask.allowed
                if m.draft.token_ids:
                    drafts[m.step] = (list(m.draft.token_ids), [x.allowed for x in m.draft.masks])
        if not run and len(tokens) not in masks:
            break
    return tokens, masks, drafts


def _g3_tools(tok, budget):
    def make():
        grammar = lambda n: Constraint(tok, gemma3_tool_grammar(TOOLS, "required", True, n or 16, ids=GEMMA3_IDS),  # noqa
                                       N_VOCAB, [1, 106], grammar_ends=True)
        return BudgetedUnits(grammar, budget, Gemma3ToolCallParser(ids=GEMMA3_IDS), TokenBytes(tok),
                             len(tok.tokenize_str("]}")) + 2)
    call = '{"name": "get_weather", "arguments": {"city": "%s"}}'
    answer = '{"tool_calls": [' + ", ".join(call % c for c in ("Oslo", "Paris", "Oslo", "Paris")) + "]}"
    return make, tok.tokenize_str(answer) + [106], tok.tokenize_str("Earlier: " + call % "Oslo" + ", " + call % "Paris")


def _json(tok, budget):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}}}, "required": ["name", "tags"], "additionalProperties": False}
    make = lambda: Constraint(tok, grammar_for_json_schema(schema), N_VOCAB, [1, 106])  # noqa
    answer = '{"name": "gemma-serve", "tags": ["fast", "exact", "fast", "exact"]}'
    return make, tok.tokenize_str(answer) + [106], tok.tokenize_str("Tags are fast and exact: " + answer[:40])


def _json_ended(tok, budget):
    """The JSON case inside BudgetedEnding (gateway/structured/endings.py): a budget short of the answer forces its ending."""
    make, script, context = _json(tok, budget)
    tables = ending_tables(tok)
    return (lambda: BudgetedEnding(make(), budget, tables)), script, context


@pytest.mark.parametrize("case,budget", [(_g3_tools, 200), (_g3_tools, 48), (_json, 80), (_json_ended, 20)],
                         ids=["tool-calls", "tool-calls-capped-by-the-budget", "json-schema",
                              "json-ended-by-the-budget"])
def test_drafts_carry_the_masks_step_by_step_decoding_would_send(g3, case, budget):
    """The same scripted model driven with and without drafts: the same tokens and step masks; every draft's
    mask at position i equals the mask step-by-step decoding sent at that step whenever the draft's tokens up to
    i are the tokens that came (grammar forks through the budget wrapper and its unit parser, including a budget
    that caps the calls); drafts are sent and some are right (forced tokens and the context's n-grams), so the
    comparison is not vacuous."""
    tok = g3[0]
    make, script, context = case(tok, budget)
    plain = _simulate(make, script, budget, 0, context, tok)
    tokens, masks, drafts = _simulate(make, script, budget, 7, context, tok)
    assert (tokens, masks) == plain[:2] and not plain[2]
    right = total = 0
    for step, (draft, draft_masks) in drafts.items():
        assert len(draft) == len(draft_masks) <= min(7, budget - step - 1)
        assert _allowed(masks[step], draft[0])
        for i, token in enumerate(draft):
            if tokens[step:step + i + 1] != draft[:i + 1]:
                break
            right += 1
            assert step + i + 1 in masks, "a draft never runs into a step that is not sampled"
            assert draft_masks[i] == masks[step + i + 1], (step, i)
        total += len(draft)
    assert right >= 5 and total >= 10, "drafts were sent, and some were right (the assertions above ran)"
