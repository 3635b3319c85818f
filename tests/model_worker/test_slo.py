"""Latency-target admission (model_worker/slo.py) in the plain-Python scheduler, with a scripted step-time model
(`StepTimeModel(coefficients)`: t = c0 + c1*rows + c2*kv + c3*chunk + c4*drafts seconds): admission least slack
first, early refusal exactly when the TTFT target is out of reach (and none without targets or under
best-effort), prompt chunks sized under the tightest TPOT target, admissions held back when one more row would
break it; and the model's fit on recorded steps."""

from __future__ import annotations

import time

import numpy as np
import pytest

from model_worker.scheduler import Scheduler
from model_worker.sequence import Failure, Finish, SamplingSpec, Sequence
from model_worker.slo import MIN_CHUNK, SloAdmission, SloSettings
from model_worker.step_model import MIN_SAMPLES, StepShape, StepTimeModel, fit

#: 10 ms per step, 1 ms per decode row, 0.1 ms per prompt token (a 256-token chunk: 35.6 ms).
SCRIPT = (0.010, 0.001, 0.0, 0.0001, 0.0)


def seq(rid, prompt_len=8, first=1, ttft=None, tpot=None, age=0.0):
    s = Sequence(rid, list(range(first, first + prompt_len)), SamplingSpec(), 16, frozenset(), lambda ev: None,
                 slo_ttft_s=ttft, slo_tpot_s=tpot)
    s.arrived_at = time.monotonic() - age
    return s


def scheduler(slots=1, policy="reject", model=SCRIPT, **defaults) -> Scheduler:
    return Scheduler(num_slots=slots, max_model_len=10_000,
                     slo=SloAdmission(SloSettings(policy=policy, **defaults),
                                      StepTimeModel(model) if model else StepTimeModel()))


def refusals(work) -> dict[str, str]:
    return {e.seq.request_id: e.event.error for e in work.emissions if e.event.failure == Failure.SLO_UNREACHABLE}


def test_admission_is_least_slack_first_and_untargeted_last():
    s = scheduler(slots=1)
    s.add(seq("busy"))
    s.schedule()
    for r, ttft in (("none", None), ("loose", 30.0), ("tight", 10.0)):
        s.add(seq(r, first=100, ttft=ttft))
    s.finish(s.by_id["busy"])
    order = []
    while s.waiting or s.running:
        s.schedule()
        running = next(iter(s.running.values()))
        order.append(running.request_id)
        s.finish(running)
    assert order == ["tight", "loose", "none"]


def test_refused_exactly_when_the_prompts_ahead_cannot_be_computed_in_time():
    # 2560 prompt tokens ahead and its own 256: 11 chunks of 256 at 35.6 ms each = 391.6 ms.
    s = scheduler(slots=2)
    s.add(seq("ahead", prompt_len=2560))
    s.schedule()  # admitted, its prompt not computed yet
    s.add(seq("late", prompt_len=256, first=5000, ttft=0.39))
    s.add(seq("fine", prompt_len=256, first=9000, ttft=0.40))
    refused = refusals(s.schedule())
    assert list(refused) == ["late"]
    assert "390 ms" in refused["late"] and "retry after 1 s" in refused["late"]
    assert s.by_id["fine"].finish == Finish.NONE


def test_a_passed_deadline_is_refused_even_before_the_model_is_fitted():
    s = scheduler(slots=1, model=None)
    s.add(seq("busy"))
    s.schedule()
    s.add(seq("waited", ttft=0.5, age=0.6))
    s.add(seq("fresh", ttft=0.5, first=40))
    assert list(refusals(s.schedule())) == ["waited"]


@pytest.mark.parametrize("settings", [{}, {"policy": "best-effort"}])
def test_no_refusal_without_targets_or_under_best_effort(settings):
    targeted = "policy" in settings
    s = scheduler(slots=1, **settings)
    s.add(seq("busy"))
    s.schedule()
    s.add(seq("w", prompt_len=5000, first=100, ttft=0.01 if targeted else None, age=1.0))
    assert refusals(s.schedule()) == {} and [q.request_id for q in s.waiting] == ["w"]


def test_default_targets_apply_to_requests_without_their_own():
    s = scheduler(slots=1, ttft_s=0.5)
    s.add(seq("busy"))
    s.schedule()
    s.add(seq("w", age=0.6, first=100))
    assert list(refusals(s.schedule())) == ["w"]


def _decoding(s: Scheduler, rid: str, tpot: float | None, first: int) -> Sequence:
    x = seq(rid, first=first, tpot=tpot)
    s.add(x)
    s.schedule()
    x.num_computed = len(x.prompt)
    s.append_token(x, 1)
    return x


def test_chunk_is_the_largest_within_the_tightest_tpot_target():
    s = scheduler(slots=3)
    _decoding(s, "a", 0.050, 1)
    _decoding(s, "b", 0.030, 200)
    s.add(seq("long", prompt_len=5000, first=400))
    work = s.schedule()
    # 2 rows: 12 ms + 0.1 ms per chunk token <= 30 ms -> 180 tokens.
    assert work.compute.request_id == "long" and len(work.chunk.rows.token_ids) == 180
    assert len(work.decode) == 2


def test_chunk_never_drops_below_the_minimum_and_is_unbounded_without_targets():
    s = scheduler(slots=2)
    _decoding(s, "a", 0.005, 1)  # below even an empty step's 11 ms: lost anyway, it holds no admission back
    s.add(seq("long", prompt_len=5000, first=400))
    assert len(s.schedule().chunk.rows.token_ids) == MIN_CHUNK
    free = scheduler(slots=2)
    _decoding(free, "a", None, 1)
    free.add(seq("long", prompt_len=5000, first=400))
    assert len(free.schedule().chunk.rows.token_ids) == 5000


def test_admission_waits_while_one_more_row_would_break_a_tpot_target():
    s = scheduler(slots=3, model=(0.010, 0.010, 0.0, 0.0, 0.0))  # 10 ms per row
    _decoding(s, "a", 0.035, 1)
    _decoding(s, "b", None, 200)  # 2 rows: 30 ms
    s.add(seq("c", first=400))  # 3 rows: 40 ms > 35 ms
    s.schedule()
    assert [q.request_id for q in s.waiting] == ["c"]
    s.finish(s.by_id["b"])
    s.schedule()
    assert not s.waiting


def test_the_model_fits_recorded_steps():
    rng = np.random.default_rng(0)
    truth = np.array([0.004, 0.0008, 2e-6, 1.5e-5, 3e-4])
    model = StepTimeModel()
    shapes = [StepShape(int(r), int(kv), int(c), int(d)) for r, kv, c, d in zip(
        rng.integers(0, 9, 300), rng.integers(0, 4000, 300), rng.choice([0, 64, 256], 300), rng.integers(0, 9, 300))]
    assert model.predict(shapes[0]) is None
    for i, shape in enumerate(shapes):
        model.observe(shape, float(truth @ shape.features()) * (1 + 0.02 * rng.standard_normal()))
        assert model.fitted == (i + 1 >= MIN_SAMPLES)
    assert np.allclose(model.coef, truth, rtol=0.1, atol=1e-6)
    assert model.error_quantile(0.9) < 0.05
    # A feature that never varies gets no coefficient of its own, and none is negative.
    x = np.array([[1, 2, 0, 64, 0], [1, 4, 0, 64, 0], [1, 8, 0, 64, 0]], dtype=float)
    coef = fit(x, x @ np.array([0.01, 0.002, 0, 0.0001, 0]))
    assert (coef >= 0).all() and abs(coef @ x[1] - (0.01 + 0.008 + 0.0064)) < 1e-6


def test_headroom_is_the_rows_that_fit_the_tightest_target():
    slo = SloAdmission(SloSettings(), StepTimeModel((0.010, 0.002, 0.0, 0.0, 0.0)))  # 10 ms + 2 ms per row
    a, b = seq("a", tpot=0.020), seq("b", tpot=None)
    assert slo.headroom([a, b], free_slots=8) == 3  # 14 ms now: 3 more rows reach 20 ms
    assert slo.headroom([a, b], free_slots=2) == 2
    assert slo.headroom([b], free_slots=8) == -1  # no targets: unknown
    assert SloAdmission().headroom([a], free_slots=8) == -1  # no model yet


def test_an_admitted_prompt_that_has_not_started_is_refused_too():
    """With free slots everything is admitted at once, but prompts are computed oldest first: a younger one
    whose turn comes too late is refused before any of it is computed (its slot freed), an older one is not."""
    s = scheduler(slots=3)
    first, second = seq("first", prompt_len=2560), seq("second", prompt_len=2560, first=5000)
    s.add(first)
    s.add(second)
    assert s.schedule().compute is first and second.slot is not None  # both admitted, no targets yet
    first.slo_ttft_s = second.slo_ttft_s = 0.5  # first: 10 chunks, 356 ms; second behind it: 712 ms
    assert list(refusals(s.schedule())) == ["second"] and "second" not in s.by_id and second.slot is None
    assert s.by_id["first"].finish == Finish.NONE
