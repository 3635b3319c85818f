"""Fair service under a burst, on the real EngineLoop over the hand-computable FakeEngine, by counts (never clocks):
admission follows arrival order, and R identical prompts arriving together cost one prefill (the others wait for
it and copy its slot, later ones find it in the prefix cache) and about ceil(R / S) * T decode steps."""

from __future__ import annotations

import math
import threading

import pytest
from prometheus_client import CollectorRegistry

from model_worker.server.metrics import WorkerMetrics
from model_worker.serving.loop import EngineLoop, wait_idle
from model_worker.serving.sequence import Finish, SamplingSpec, Sequence
from tests.fakes import FakeEngine, FakeEngineConfig


class Sink:
    """Records a sequence's tokens and signals its end."""

    def __init__(self):
        self.tokens, self.cached, self.finish = [], 0, Finish.NONE
        self.done = threading.Event()

    def __call__(self, ev):
        self.tokens += ev.token_ids
        self.cached += ev.cached_tokens
        if ev.finish != Finish.NONE:
            self.finish = ev.finish
            self.done.set()


def make(rid: str, prompt: list[int], max_tokens: int) -> tuple[Sequence, Sink]:
    """A greedy sequence with no stop ids (ignore_eos: it always runs to max_tokens)."""
    sink = Sink()
    return Sequence(rid, list(prompt), SamplingSpec(), max_tokens, frozenset(), sink), sink


def record_admissions(loop: EngineLoop) -> list[str]:
    """The request ids in the order the scheduler gives them a slot (admission order, `Work.admitted`)."""
    order = []
    schedule = loop.scheduler.schedule

    def recording():
        work = schedule()
        order.extend(seq.request_id for seq in work.admitted)
        return work

    loop.scheduler.schedule = recording
    return order


def run(loop: EngineLoop, sinks: list[Sink]) -> None:
    try:
        for sink in sinks:
            assert sink.done.wait(30)
        assert wait_idle(loop)
    finally:
        loop.stop()


def test_admission_follows_arrival_order():
    """Twelve requests on two slots (distinct prompts, identical ones, prompts sharing a long prefix with the one
    being prefilled or with a finished slot): they get slots in exactly the order they arrived."""
    engine = FakeEngine(FakeEngineConfig(num_slots=2, max_model_len=128, chunk=8, prefix_slack=8))
    loop = EngineLoop(engine)
    order = record_admissions(loop)
    shared = list(range(100, 140))
    prompts = [shared + [1], list(range(7, 17)), shared + [2, 3], shared + [1], list(range(30, 35)),
               shared + [4], list(range(7, 17)), [5, 6], shared + [1], list(range(60, 90)), shared, [9] * 12]
    sinks = []
    for i, prompt in enumerate(prompts):
        seq, sink = make(f"r{i}", prompt, 3 + i % 4)
        loop.submit(seq)  # before start: all of them arrive in one iteration
        sinks.append(sink)
    loop.start()
    run(loop, sinks)
    assert order == [f"r{i}" for i in range(len(prompts))]
    for prompt, sink in zip(prompts, sinks):  # FakeEngine: a prompt ending in t generates t+1, t+2, ...
        assert sink.finish == Finish.LENGTH and sink.tokens == [prompt[-1] + 1 + j for j in range(len(sink.tokens))]


@pytest.mark.parametrize("arrival", ["together", "while_prefilling"])
def test_a_burst_of_identical_prompts_costs_one_prefill(arrival):
    """R = 16 identical prompts, S = 4 slots, T = 20 tokens each (ignore_eos): the prompt is computed once (the
    first wave waits for the first prompt and copies its slot, later waves take over finished slots), so the
    prompt tokens computed are one prompt plus the one last prompt token each other request recomputes; the
    sequences of a wave decode in step, so decode steps stay within 10% of ceil(R / S) * T."""
    requests, slots, max_tokens, prompt = 16, 4, 20, list(range(200, 230))
    # prefix_slack >= T: a finished slot's rings still hold the prompt's window (docs/architecture.md)
    engine = FakeEngine(FakeEngineConfig(num_slots=slots, max_model_len=128, chunk=8, prefix_slack=max_tokens))
    registry = CollectorRegistry()
    loop = EngineLoop(engine, metrics=WorkerMetrics(registry))
    order = record_admissions(loop)
    seqs, sinks = zip(*(make(f"r{i}", prompt, max_tokens) for i in range(requests)))
    if arrival == "together":
        for seq in seqs:
            loop.submit(seq)
        loop.start()
    else:  # the others arrive while the first one's first prompt chunk is running
        engine.gate.clear()
        loop.submit(seqs[0])
        loop.start()
        assert engine.entered.wait(10)
        for seq in seqs[1:]:
            loop.submit(seq)
        engine.gate.set()
    run(loop, list(sinks))

    assert order == [s.request_id for s in seqs]
    expected = [prompt[-1] + 1 + j for j in range(max_tokens)]
    assert all(s.tokens == expected and s.finish == Finish.LENGTH for s in sinks)
    assert [s.cached for s in sinks] == [0] + [len(prompt) - 1] * (requests - 1)
    # by the engine's own count of the prompt tokens it was given, and by the worker's metric
    assert engine.prompt_tokens == len(prompt) + (requests - 1)
    assert registry.get_sample_value("gemma_serve:prompt_tokens_computed_total") == engine.prompt_tokens
    assert registry.get_sample_value("gemma_serve:prompt_tokens_cached_total") == (requests - 1) * (len(prompt) - 1)
    assert registry.get_sample_value("gemma_serve:prompt_tokens_total") == requests * len(prompt)
    assert engine.calls["decode"] <= 1.1 * math.ceil(requests / slots) * max_tokens, engine.calls


def test_followers_of_a_long_shared_prefix_copy_it_exactly():
    """Two prompts sharing a 40-token prefix arrive together; the first is computed in 32-token chunks. Its chunk
    stops at the shared prefix (running on would move its sliding rings more than the slack past it), the second
    copies the slot there and computes only its own 12 tokens; a third prompt sharing too little (4 tokens, a
    chat template's header) does not wait."""
    engine = FakeEngine(FakeEngineConfig(num_slots=3, max_model_len=128, chunk=32, prefix_slack=4))
    loop = EngineLoop(engine)
    shared = list(range(300, 340))
    a, a_sink = make("a", shared + list(range(1, 21)), 2)
    b, b_sink = make("b", shared + list(range(21, 33)), 2)
    c, c_sink = make("c", shared[:4] + list(range(50, 60)), 2)
    for seq in (a, b, c):
        loop.submit(seq)
    loop.start()
    run(loop, [a_sink, b_sink, c_sink])
    a_slot = engine.chunks[0][0]  # the oldest prompt is computed first
    assert [(start, n) for slot, start, n in engine.chunks if slot == a_slot] == [(0, 32), (32, 8), (40, 20)]
    assert b_sink.cached == 40 and c_sink.cached == 0
    assert engine.prompt_tokens == 60 + 12 + 14
    assert b_sink.tokens == [33, 34] and c_sink.tokens == [60, 61]
