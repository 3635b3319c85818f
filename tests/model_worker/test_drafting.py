"""Drafts (model_worker/serving/drafting.py) and the loop's speculation around them, on the FakeEngine (next = last + 1, so
which drafts are right is known by hand): the n-gram index, predictions, answers scoped by cache salt, the
acceptance estimate and step costs, and a loop that verifies drafts giving exactly what it gives without them.
Exactness on a real model: tests/model_worker/test_speculation.py."""

from __future__ import annotations

import pytest

from common.ngram import NgramIndex
from model_worker.serving.drafting import ANSWERS_PER_SCOPE, Acceptance, Drafter, StepCosts
from model_worker.serving.loop import EngineLoop
from model_worker.serving.sequence import Finish
from tests.fakes import FakeEngine, FakeEngineConfig
from tests.model_worker.test_loop import VOCAB, make


def test_ngram_index_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    idx = NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    assert idx.lookup(idx.tokens[-4:], 3) == (3, [4, 9, 2]), "(1, 2, 3) occurred at the start: its continuation"
    idx.extend([7])
    assert idx.lookup(idx.tokens[-4:], 3) == (0, []), "(3, 7) never occurred before"
    idx = NgramIndex([5, 6, 7, 5, 6, 8, 5, 6])
    assert idx.lookup(idx.tokens[-4:], 2) == (2, [8, 5]), "the latest occurrence of (5, 6), not the first"
    assert NgramIndex([1]).lookup([1], 4) == (0, []), "a single token is never looked up"


def test_prediction_drafts_follow_the_output_then_resync_by_ngrams():
    d = Drafter()
    d.start("r", [100, 101], prediction=[1, 2, 3, 4, 5, 6, 7, 8])
    assert d.propose("r", "", 3) == [1, 2, 3], "an empty output: the prediction's start"
    for t in (1, 2):
        d.append("r", t)
    assert d.propose("r", "", 4) == [3, 4, 5, 6]
    d.append("r", 42)  # leaves the prediction
    assert d.propose("r", "", 4) == []
    for t in (4, 5):  # back on it: (4, 5) occurs in the prediction
        d.append("r", t)
    assert d.propose("r", "", 2) == [6, 7]
    d.verified("r", 2, 2)
    state = d.finish("r", "", [1, 2, 42, 4, 5, 6, 7])
    assert state is not None and state.prediction_accepted == 2 + 2, "two while aligned, two accepted after resync"


def test_answers_are_drafted_only_within_their_cache_scope_and_are_bounded():
    d = Drafter()
    answer = [10, 11, 12, 13, 14, 15]
    d.start("a", [1])
    d.finish("a", "tenant-a", answer)
    for scope, expected in (("tenant-a", [12, 13, 14]), ("tenant-b", []), ("", [])):
        d.start("b", [7, 10, 11])
        assert d.propose("b", scope, 3) == expected, scope
        d.finish("b", scope, [])
    for i in range(ANSWERS_PER_SCOPE + 1):  # the oldest answers give way
        d.start(f"x{i}", [1])
        d.finish(f"x{i}", "tenant-a", [50 + i, 60 + i, 70 + i])
    d.start("b", [7, 10, 11])
    assert d.propose("b", "tenant-a", 3) == [], "the first answer was dropped"


def test_acceptance_estimate_and_probe():
    a = Acceptance()
    assert a.rate == 0.5 and a.expected_tokens(0) == 1.0 and a.expected_tokens(2) == 1.75
    for _ in range(5):
        a.update(4, 4)
    assert a.rate > 0.9
    for _ in range(10):
        a.update(4, 0)
    assert a.rate < 0.15
    a.passed = Acceptance.PROBE_AFTER
    assert a.probe_due
    a.update(1, 1)
    assert not a.probe_due


def test_step_costs_decide_from_tokens_per_second():
    costs = StepCosts()
    assert not costs.worth_verifying(1, 1, 4.0), "no decode step measured yet: decode first"
    for seconds in (0.500, 0.050, 0.060):  # a slow first step (a hiccup) does not set the estimate
        assert not costs.worth_verifying(1, 1, 4.0), "fewer than three decode steps measured: decode first"
        costs.observe("decode", 1, seconds)
    assert costs.estimate("decode", 1) == pytest.approx(0.050), "the least of the first three"
    assert costs.estimate("verify", 1) == pytest.approx(0.075), "the prior until a verify step is measured"
    costs.observe("verify", 1, 0.065)
    assert costs.worth_verifying(1, 1, 1.5) and not costs.worth_verifying(1, 1, 1.2)
    assert not costs.worth_verifying(1, 1, 1.5, beside_chunk=True), "beside a chunk the row's own token is free"
    assert costs.worth_verifying(1, 1, 3.0, beside_chunk=True)


def spec_engine(max_verify_batch: int = 2, step_delay: float = 0.0, verify_delay: float | None = None) -> FakeEngine:
    fake = FakeEngine(FakeEngineConfig(num_slots=2, max_model_len=64, chunk=4, prefix_slack=4, max_draft_tokens=3,
                                       max_verify_batch=max_verify_batch), vocab=VOCAB, step_delay=step_delay)
    fake.verify_delay = step_delay if verify_delay is None else verify_delay
    return fake


def run(mode: str, requests, **kw):
    """Run (rid, prompt, max_tokens, kwargs) requests together on a fresh FakeEngine loop, its steps timed by the
    fake's virtual clock (each step costs exactly its delay); sinks and engine."""
    fake = spec_engine(**kw)
    loop = EngineLoop(fake, speculation=mode, step_clock=fake.clock)
    sinks = []
    for rid, prompt, max_tokens, extra in requests:
        seq, sink = make(rid, prompt, max_tokens, **extra)
        loop.submit(seq)
        sinks.append(sink)
    loop.start()
    try:
        for sink in sinks:
            sink.wait()
    finally:
        loop.stop()
    return sinks, fake, loop


LOOPING = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]  # the fake continues 4, 5, 6, ...: what (2, 3) was followed by


def test_verified_drafts_give_exactly_the_plain_output_in_fewer_steps():
    requests = [("a", LOOPING, 12, {}), ("b", [20, 21, 22, 20, 21], 9, {"stop": [27]})]
    plain, plain_fake, _ = run("off", requests)
    spec, fake, loop = run("always", requests)
    for p, s in zip(plain, spec):
        assert s.tokens == p.tokens and s.events[-1].finish == p.events[-1].finish
        assert [x for e in s.events for x in e.logprobs] == [x for e in p.events for x in e.logprobs]
    assert max(len(e.token_ids) for e in spec[0].events) > 1, "a verify step's tokens arrive in one event"
    assert len(spec[0].events[0].token_ids) == 1, "the first token is an event of its own (the Prefill reply)"
    assert spec[1].tokens[-1] == 27 and spec[1].events[-1].finish == Finish.STOP, "a stop id inside a drafted run"
    assert len(spec[0].tokens) == 12, "max_tokens holds with drafts"
    assert fake.calls.get("verify", 0) > 0 and loop.steps["accepted_tokens"] > 0
    assert fake.calls["decode"] + fake.calls.get("verify", 0) < plain_fake.calls["decode"]


def test_drafts_are_verified_beside_a_prompt_chunk_with_the_plain_output():
    """A row decoding with drafts while another request's long prompt is computed chunk by chunk: the iteration
    computes the chunk and then verifies the row's drafts (instead of carrying the row in the mixed pass), and
    both outputs equal speculation off."""
    requests = [("a", LOOPING, 12, {}), ("b", list(range(30, 70)), 4, {})]
    plain, _, _ = run("off", requests)
    spec, fake, _ = run("always", requests)
    assert [s.tokens for s in spec] == [p.tokens for p in plain]
    pairs = list(zip(fake.order, fake.order[1:]))
    assert ("compute", "verify") in pairs, f"no verify step right after a chunk: {fake.order}"


def test_no_verify_step_beyond_the_largest_verify_batch():
    """Two decoding rows with a largest verify batch of 1: plain decode steps only (the fake raises on a verify
    step outside its grid, as the real engine has no program for it)."""
    requests = [("a", LOOPING, 8, {}), ("b", LOOPING, 8, {})]
    sinks, _, _ = run("always", requests, max_verify_batch=1)
    assert all(len(s.tokens) == 8 for s in sinks)


def test_prediction_usage_reaches_the_last_event():
    prediction = list(range(12, 18)) + [0, 0]  # the fake's output from prompt [10, 11] is 12, 13, ...
    sinks, _, _ = run("always", [("a", [10, 11], 8, {"prediction": prediction})])
    last = sinks[0].events[-1]
    assert sinks[0].tokens == list(range(12, 20))
    assert (last.accepted_prediction, last.rejected_prediction) == (6, 2)


def test_auto_stops_verifying_what_is_never_accepted():
    """Drafts that are always wrong, verify steps three times a decode step's time (measured on the fake's
    virtual clock, so that a loaded machine's scheduling cannot flip the comparison): after the first measurements the auto
    policy passes the drafts over (probing now and then), so most steps are plain decode steps; the output is
    unchanged."""
    prediction = [t for i in range(12, 52) for t in (i, i + 1, 999)]  # every bigram of the output, then a wrong token
    sinks, fake, loop = run("auto", [("a", [10, 11], 40, {"prediction": prediction})], step_delay=0.01,
                            verify_delay=0.03)
    assert sinks[0].tokens == list(range(12, 52))
    assert loop.steps["accepted_tokens"] <= 1, "only the prediction's start (12, 13) is right"
    assert 0 < fake.calls.get("verify", 0) < 10


@pytest.mark.parametrize("drafts, slack, fragment", [
    (-1, 256, ">= 0"), (4, 256, "one less than a power of two"), (15, 8, "exceeds --prefix-slack")])
def test_bad_speculation_flags_are_refused_with_the_numbers(drafts, slack, fragment):
    """`--max-draft-tokens` that no verify program can take is refused at start, naming the flag."""
    import argparse

    from model_worker.server.main import FlagsRefused, speculation_drafts

    args = argparse.Namespace(max_draft_tokens=drafts, prefix_slack=slack, speculation="auto")
    with pytest.raises(FlagsRefused, match=fragment):
        speculation_drafts(args, invariant=True)


def test_speculation_is_off_where_the_numerics_are_not_batch_invariant(caplog):
    import argparse

    from model_worker.server.main import speculation_drafts

    args = argparse.Namespace(max_draft_tokens=7, prefix_slack=256, speculation="auto")
    assert speculation_drafts(args, invariant=True) == 7
    assert speculation_drafts(argparse.Namespace(**{**vars(args), "speculation": "off"}), invariant=True) == 0
    with caplog.at_level("WARNING"):
        assert speculation_drafts(args, invariant=False) == 0
    assert "not batch-invariant" in caplog.text


def test_a_new_sequence_starts_from_its_scopes_recent_acceptance():
    """After a scope's drafts were accepted, its next sequence expects them to be (so a short constrained answer
    gets verified from its first draft); another scope still starts from one-in-two, and a sequence's own
    verified drafts soon outweigh the prior."""
    from model_worker.serving.drafting import Acceptance, Drafter

    d = Drafter()
    d.start("a", [1, 2, 3], scope="tenant-1")
    for _ in range(3):
        d.verified("a", 7, 7, "tenant-1")
    d.finish("a", "tenant-1", [4, 5, 6])
    d.start("b", [1, 2, 3], scope="tenant-1")
    d.start("c", [1, 2, 3], scope="tenant-2")
    fresh = Acceptance().rate
    assert d.states["b"].acceptance.rate > 0.9 > fresh == d.states["c"].acceptance.rate == 0.5
    assert d.expected_tokens("b", 7) > 2 * d.expected_tokens("c", 7)
    for _ in range(4):
        d.verified("b", 7, 0, "tenant-1")
    assert d.states["b"].acceptance.rate < 0.2


def test_default_draft_length_follows_the_matmul_precision():
    """Not given, `--max-draft-tokens` is 3 with int8 products (a verify step of 8 positions costs ~2.4 plain steps
    there, one of 4 ~1.2) and 7 otherwise; a given value wins; `gemma-serve up` passes it only when given."""
    import argparse

    from gemma_serve.cli import build_parser
    from gemma_serve.launcher import service_commands
    from model_worker.server.main import speculation_drafts

    args = argparse.Namespace(max_draft_tokens=None, prefix_slack=256, speculation="auto")
    assert speculation_drafts(args, invariant=True, precision="int8") == 3
    assert speculation_drafts(args, invariant=True, precision="bfloat16") == 7
    assert speculation_drafts(argparse.Namespace(**{**vars(args), "max_draft_tokens": 15}), True, "int8") == 15
    parser = build_parser()
    worker = service_commands(parser.parse_args(["up"]))["worker"]
    assert parser.parse_args(worker[worker.index("worker"):]).max_draft_tokens is None
    worker = service_commands(parser.parse_args(["up", "--max-draft-tokens", "1"]))["worker"]
    assert parser.parse_args(worker[worker.index("worker"):]).max_draft_tokens == 1
