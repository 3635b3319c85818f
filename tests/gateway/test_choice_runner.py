"""The choice runner behind every chat front door (gateway/generation/choice_runner.py): a choice's deltas go through
its output splitter; at its end the usage is summed (cached prompt tokens of choice 0 only) and the answer is
remembered in the answer history under the message returned, unless the door asks not to (a raw completion). Against
test_planner's fake backends and a planned two-choice chat request."""

from __future__ import annotations

from gateway.backends.history import answer_key
from gateway.generation.choice_runner import ChoiceRunner
from gateway.generation.generate import Delta
from protos import common_pb2
from tests.gateway.test_planner import _Backends, _chat


def _delta(text: str, ids: list[int], finish: str | None = None, **usage) -> Delta:
    tokens = [common_pb2.GeneratedToken(token_id=i) for i in ids]
    return Delta(text, ids, [0.0] * len(ids), finish, common_pb2.Usage(**usage) if finish else None, tokens,
                 whole=True)


def test_each_choice_is_routed_summed_and_remembered():
    backends = _Backends()
    plan = _chat(backends, {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 5})
    runner = ChoiceRunner(backends, plan)
    out = runner.feed(0, _delta("Hel", [40]))
    assert out == [{"content": "Hel"}] and runner.finish_reason(0) is None
    runner.feed(1, _delta("Yo", [41], "length", completion_tokens=1, cached_tokens=3))
    out = runner.feed(0, _delta("lo", [42], "stop", completion_tokens=2, cached_tokens=3,
                                accepted_prediction_tokens=1))
    assert {"content": "lo"} in out
    assert runner.finish_reason(0) == "stop" and runner.finish_reason(1) == "length"
    assert (runner.usage.completion_tokens, runner.usage.cached_tokens) == (3, 3)  # the shared prompt once
    assert runner.predicted() == (1, 0)
    assert [[t.token_id for t in tokens] for tokens in runner.tokens] == [[40, 42], [41]]
    scope = plan.scope
    assert backends.answers.lookup(scope, answer_key("Hello")) == (40, 42)
    assert backends.answers.lookup(scope, answer_key("Yo")) == (41,)


def test_a_door_may_run_choices_without_remembering_them():
    backends = _Backends()
    plan = _chat(backends, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
    runner = ChoiceRunner(backends, plan, remember=False)
    runner.feed(0, _delta("Hello", [40, 42], "stop", completion_tokens=2))
    assert runner.finish_reason(0) == "stop" and backends.answers.lookup(plan.scope, answer_key("Hello")) is None
