"""The batched engine on a tiny random Gemma 4: batching never changes a sequence's result, nothing compiles
after warm-up, a lone request uses the smallest programs, and N concurrent requests take about as many decode
steps as the longest one."""

from __future__ import annotations

import collections
import math
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.modeling.params import to_device
from model_worker.serving.engine_api import PromptChunk
from model_worker.serving.loop import EngineLoop, wait_idle
from model_worker.serving.sequence import Finish, SamplingSpec, Sequence
from tests.gemma4_tiny import SHARED, write_checkpoint

pytestmark = pytest.mark.slow  # compiles model programs or reads a reference: outside `make test-fast`

TOL = 2e-4  # float32 summation-order noise between batch shapes (as in test_gemma4_numerics)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    write_checkpoint(SHARED, out)
    cfg, flat = load_checkpoint(out, jnp.float32)
    eng = Engine(cfg, to_device(cfg, flat, jnp.float32),
                 EngineConfig(num_slots=4, max_model_len=128, prefill_chunks=(8, 32), kv_bucket_factor=16,
                              prefix_slack=4))
    eng.compile_all()
    return eng


@pytest.fixture
def loop(engine):
    loop = EngineLoop(engine)
    loop.start()
    yield loop
    loop.stop()


class Collector:
    """A sink that records (token, logprob, top-20 logprobs) per step and signals completion."""

    def __init__(self):
        self.tokens, self.logprobs, self.tops, self.finish = [], [], [], Finish.NONE
        self.done = threading.Event()

    def __call__(self, ev):
        self.tokens += ev.token_ids
        self.logprobs += ev.logprobs
        self.tops += [np.asarray(t[1]) for t in ev.top]
        if ev.finish != Finish.NONE:
            self.finish = ev.finish
            self.done.set()


def make(rid, prompt, max_tokens, temperature=0.0, seed=0):
    sink = Collector()
    spec = SamplingSpec(temperature=temperature, seed=seed, top_logprobs=20)
    return Sequence(rid, list(prompt), spec, max_tokens, frozenset(), sink), sink


def run_alone(loop, rid, prompt, max_tokens, **kw):
    seq, sink = make(rid, prompt, max_tokens, **kw)
    loop.submit(seq)
    assert sink.done.wait(60)
    return sink


REQUESTS = [  # (prompt length, max_tokens): different lengths, some longer than the window (8) and one chunk
    (3, 12), (17, 5), (9, 20), (40, 8), (1, 15), (26, 3),
]


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n, _ in REQUESTS]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_batched_equals_alone_with_joins_and_leaves(loop, temperature):
    prompts = _prompts()
    alone = [run_alone(loop, f"solo{i}", p, m, temperature=temperature, seed=100 + i)
             for i, (p, (_, m)) in enumerate(zip(prompts, REQUESTS))]
    # Now all together, arriving at staggered times (6 sequences, 4 slots: some wait, join and leave mid-flight).
    sinks = []
    for i, (p, (_, m)) in enumerate(zip(prompts, REQUESTS)):
        seq, sink = make(f"batch{i}", p, m, temperature=temperature, seed=100 + i)
        loop.submit(seq)
        sinks.append(sink)
        time.sleep(random.Random(i).uniform(0, 0.05))
    for sink in sinks:
        assert sink.done.wait(120)
    for i, (a, b) in enumerate(zip(alone, sinks)):
        assert len(a.tokens) == len(b.tokens)
        lp_a, lp_b = np.asarray(a.logprobs), np.asarray(b.logprobs)
        top_a, top_b = np.stack(a.tops), np.stack(b.tops)
        assert np.abs(top_a - top_b).max() < TOL, f"request {i}: top-20 log-probabilities differ"
        clear = (top_a[:, 0] - top_a[:, 1]) > 2 * TOL
        same = np.asarray(a.tokens) == np.asarray(b.tokens)
        first_diff = np.argmin(same) if not same.all() else len(same)
        # Tokens agree wherever the choice is clear (up to the first unclear step, after which contexts differ).
        assert same[:first_diff].all() and (first_diff == len(same) or not clear[first_diff]), i
        assert np.abs(lp_a[:first_diff + 1] - lp_b[:first_diff + 1]).max() < TOL


def test_no_compilation_after_warmup_and_smallest_buckets(loop, engine):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None)
    engine.calls.clear()
    # A lone short request runs in the smallest programs.
    run_alone(loop, "short", [5, 6, 7], 4)
    smallest_kv, smallest_chunk = engine.kv_buckets[0], min(engine.ecfg.prefill_chunks)
    assert set(engine.calls) == {("compute", 1, smallest_chunk, smallest_kv), ("decode", 1, 1, smallest_kv),
                                 ("sample", 1, 0, 0)}, engine.calls  # top_logprobs=20: the full sampler
    # A randomized stream: prompt lengths, max_tokens, sampling settings, batch sizes. Every step's forward
    # programs are the ones `step_programs` prices for its shape (the step-time model's features).
    ran, mismatches = [], []
    run_work, observe = loop._run_work, loop._observe_step

    def counted_run(work):
        before = collections.Counter(engine.calls)
        result = run_work(work)
        ran[:] = sorted((collections.Counter(engine.calls) - before).elements())
        return result

    def checked_observe(work, result, seconds):
        forward = sorted(k for k in ran if k.kind in ("compute", "decode", "mixed", "verify"))
        if forward != sorted(engine.step_programs(shape=loop.step_shape(work, result))):
            mismatches.append((loop.step_shape(work, result), forward))
        observe(work, result, seconds)

    loop._observe_step, loop._run_work = checked_observe, counted_run
    rng = random.Random(7)
    sinks = []
    for i in range(24):
        prompt = [rng.randrange(512) for _ in range(rng.randint(1, 90))]
        spec = SamplingSpec(temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5, 50]),
                            top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]), seed=rng.randrange(2**63),
                            presence_penalty=rng.choice([0.0, 0.5]), repetition_penalty=rng.choice([1.0, 1.2]),
                            bias_ids=(3,), bias_vals=(rng.uniform(-5, 5),), top_logprobs=rng.choice([0, 5]))
        if i % 3 == 0:  # plain greedy requests, which batches of their own run through the greedy sampler
            spec = SamplingSpec(seed=spec.seed)
        sink = Collector()
        loop.submit(Sequence(f"r{i}", prompt, spec, rng.randint(1, 128 - len(prompt)), frozenset(), sink))
        sinks.append(sink)
        if rng.random() < 0.3:
            time.sleep(0.02)
    for sink in sinks:
        assert sink.done.wait(300)
    assert compiles == [], f"{len(compiles)} compilations after warm-up"
    assert not mismatches, mismatches[:3]
    assert {k[1] for k in engine.calls if k[0] == "decode"} > {1}, "the stream used several batch buckets"
    assert {k[0] for k in engine.calls} >= {"sample", "greedy"}, engine.calls


def test_decode_steps_follow_the_longest_request(loop):
    steps = dict(loop.steps)
    lengths = [3, 9, 17, 30]
    sinks = []
    for i, m in enumerate(lengths):
        seq, sink = make(f"len{i}", [1 + i, 2, 3], m)
        loop.submit(seq)
        sinks.append(sink)
    for sink in sinks:
        assert sink.done.wait(60)
    decode_steps = loop.steps["decode"] - steps["decode"]
    # The first token of each comes from its prompt step; the rest from shared decode steps.
    assert decode_steps <= max(lengths) + len(lengths), decode_steps
    assert decode_steps < 0.6 * sum(m - 1 for m in lengths), "one sequence after another would take the sum"


def test_a_finished_slot_is_reused_at_the_next_step(engine):
    """Five requests on four slots: the fifth is admitted in the iteration right after the first one finishes."""
    loop = EngineLoop(engine)
    admitted = []
    original = loop.scheduler.schedule

    def schedule():
        work = original()
        admitted.append(sorted(s.request_id for s in loop.scheduler.running.values()))
        return work

    loop.scheduler.schedule = schedule
    loop.start()
    try:
        sinks = []
        for rid, m in (("a", 2), ("b", 30), ("c", 30), ("d", 30), ("e", 5)):
            seq, sink = make(rid, [9, 8, 7], m)
            loop.submit(seq)
            sinks.append(sink)
        for sink in sinks:
            assert sink.done.wait(60)
        assert wait_idle(loop)
    finally:
        loop.stop()
    first_e = next(i for i, ids in enumerate(admitted) if "e" in ids)
    last_a = max(i for i, ids in enumerate(admitted) if "a" in ids)
    assert first_e == last_a + 1, admitted[: first_e + 1]


def run_fresh(engine, rid, prompt, max_tokens):
    """The same request on a loop with an empty prefix cache (nothing reused): the cold reference."""
    loop = EngineLoop(engine)
    loop.start()
    try:
        return run_alone(loop, rid, prompt, max_tokens)
    finally:
        loop.stop()


def assert_same(a, b):
    assert a.tokens == b.tokens
    assert np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs)).max() < TOL
    assert np.abs(np.stack(a.tops) - np.stack(b.tops)).max() < TOL


def submit(loop, rid, prompt, max_tokens):
    seq, sink = make(rid, prompt, max_tokens)
    loop.submit(seq)
    assert sink.done.wait(60)
    return seq, sink


def test_agent_turns_reuse_the_previous_turn_exactly(engine):
    """Turn 2 = turn 1's prompt + answer + new tokens: everything computed before is reused (the window is 8, the
    prompt far longer), and the output equals a cold run, also when the history diverges a few tokens before the
    slot's end (within the ring's slack)."""
    rng = np.random.default_rng(11)
    loop = EngineLoop(engine)
    loop.start()
    try:
        p1 = rng.integers(0, 512, 30).tolist()
        seq1, sink1 = submit(loop, "t1", p1, 10)
        p2 = p1 + sink1.tokens + rng.integers(0, 512, 12).tolist()
        computed = loop.steps["computed_tokens"]
        seq2, sink2 = submit(loop, "t2", p2, 8)
        assert seq2.cached_tokens == len(p1) + 10 - 1, "all of turn 1 but its never-fed last token is reused"
        # Computed: the new prompt tokens, then one token per decode step.
        assert loop.steps["computed_tokens"] - computed == (len(p2) - seq2.cached_tokens) + 7
        # Turn 3 rewrites the last two tokens of turn 2's answer (a client trimming the reply).
        p3 = p2 + sink2.tokens[:-2] + [7, 7] + rng.integers(0, 512, 5).tolist()
        seq3, sink3 = submit(loop, "t3", p3, 6)
        assert seq3.cached_tokens == len(p2) + 6
    finally:
        loop.stop()
    for prompt, sink, n in ((p2, sink2, 8), (p3, sink3, 6)):
        assert_same(sink, run_fresh(engine, "cold", prompt, n))


def test_shared_system_prompt_is_snapshotted_and_reused(engine):
    rng = np.random.default_rng(12)
    system = rng.integers(0, 512, 40).tolist()
    loop = EngineLoop(engine)
    loop.start()
    try:
        a, _ = submit(loop, "a", system + rng.integers(0, 512, 6).tolist(), 20)
        assert a.cached_tokens == 0
        # b shares the 40-token prefix with a's slot, whose ring has moved far past it: b computes the prefix
        # and pins a copy of it on the way.
        b, _ = submit(loop, "b", system + rng.integers(0, 512, 9).tolist(), 4)
        assert b.cached_tokens == 0
        assert any(e.pinned and e.tokens == system for e in loop.scheduler.cache.entries)
        c_prompt = system + rng.integers(0, 512, 7).tolist()
        c, c_sink = submit(loop, "c", c_prompt, 6)
        assert c.cached_tokens == len(system)
        assert loop.scheduler.cache.hits >= 1
    finally:
        loop.stop()
    assert_same(c_sink, run_fresh(engine, "cold", c_prompt, 6))


def test_long_prompt_is_chunked_while_running_streams_keep_decoding(engine):
    """A 100-token prompt arriving while another sequence decodes is computed in budget-sized chunks, each in one
    mixed pass with a decode step of the running sequence (bounded inter-token latency), and gives the same result
    as when computed alone in large chunks."""
    rng = np.random.default_rng(13)
    long_prompt = rng.integers(0, 512, 100).tolist()
    loop = EngineLoop(engine, token_budget=8)
    order = []
    sample_chunk, sample_decode = loop._sample_chunk, loop._sample_decode
    loop._sample_chunk = lambda seq, p, n: (order.append(("compute", seq.request_id, n)),
                                            sample_chunk(seq, p, n))[1]
    loop._sample_decode = lambda seqs, p, **kw: (order.append(("decode", tuple(s.request_id for s in seqs))),
                                                 sample_decode(seqs, p, **kw))[1]
    mixed_before = sum(n for key, n in engine.calls.items() if key[0] == "mixed")
    loop.start()
    try:
        runner, runner_sink = make("runner", [1, 2, 3], 60)
        loop.submit(runner)
        deadline = time.monotonic() + 60
        while len(runner_sink.tokens) < 3 and not runner_sink.done.is_set():
            assert time.monotonic() < deadline, "the runner produced no tokens"
            time.sleep(0.01)
        seq, sink = make("long", long_prompt, 5)
        loop.submit(seq)
        assert sink.done.wait(60) and runner_sink.done.wait(60)
    finally:
        loop.stop()
    assert runner_sink.finish == Finish.LENGTH and sink.finish == Finish.LENGTH
    at = [i for i, o in enumerate(order) if o[0] == "compute" and o[1] == "long"]
    assert len(at) == -(-100 // 8) and all(order[i][2] == 8 for i in at[:-1]) and order[at[-1]][2] == 100 % 8
    for a, b in zip(at, at[1:]):
        assert any(o[0] == "decode" and "runner" in o[1] for o in order[a:b]), "a chunk without a decode step"
    mixed = sum(n for key, n in engine.calls.items() if key[0] == "mixed") - mixed_before
    assert mixed >= len(at) - 1  # every chunk while the runner decodes ran as a mixed step
    assert_same(sink, run_fresh(engine, "cold", long_prompt, 5))


def test_a_lone_prompt_pads_only_its_last_chunk(engine, monkeypatch):
    """Chunks (8, 32): a prompt runs in the largest chunks it fills and only its tail is padded (< 8 pads) - 84
    tokens as 32 + 32 + 8 + 8 + 8, not 32 + 32 + 32; its logits equal those of the same prompt in 8-token
    chunks. The CPU's chunk policy, set here so that the test holds on an accelerator too (whose own policy takes
    the fewest chunks: `Engine.chunk_size`)."""
    monkeypatch.setattr(engine, "_pad_only_tail", True)
    assert [engine.chunk_size(n) for n in (84, 38, 32, 31, 20, 9, 8, 3)] == [32, 32, 32, 8, 8, 8, 8, 8]
    prompt = np.random.default_rng(14).integers(0, 512, 84).tolist()
    before = {k: v for k, v in engine.calls.items() if k[0] == "compute"}
    sink = run_fresh(engine, "lone", prompt, 3)
    ran = {k[2]: v - before.get(k, 0) for k, v in engine.calls.items() if k[0] == "compute" and v > before.get(k, 0)}
    assert ran == {32: 2, 8: 3}
    start, pending = 0, None
    while start < len(prompt):  # the same prompt in 8-token chunks, by hand
        pending, n = engine.dispatch_compute(chunk=PromptChunk(3, prompt[start:start + 8], start, [False] * 8,
                                                         clear_penalties=start == 0))
        start += n
    logprobs = jax.nn.log_softmax(pending.logits[0])
    assert sink.tokens[0] == int(np.argmax(logprobs))
    assert abs(sink.logprobs[0] - float(logprobs[sink.tokens[0]])) < TOL


def test_a_prompt_tail_runs_in_the_cheapest_tail_chunks(engine, tmp_path, monkeypatch):
    """Tail chunks (2, 4) beside chunks (8, 32): once no prefill chunk fills, the tail runs in the cheapest mix
    (`engine._tail_plan`: each chunk costs its length + 8) - 84 tokens as 32 + 32 + 8 + 8 + 4, 23 as 8 + 8 + 8 (a
    tail of 7: one 8 beats 4 + 2 + 2) - and the last token's logits equal the same prompt's without tail chunks;
    tail chunks must lie below the smallest prefill chunk."""
    from model_worker.engine.engine import _tail_plan
    from model_worker.serving.engine_api import StepShape

    assert _tail_plan((16, 32, 64), 20) == (32,) and _tail_plan((16, 32, 64), 40) == (32, 16)
    assert _tail_plan((16, 32, 64), 60) == (64,) and _tail_plan((2, 4, 8), 4) == (4,)
    write_checkpoint(SHARED, tmp_path)
    cfg, flat = load_checkpoint(tmp_path, jnp.float32)
    ecfg = EngineConfig(num_slots=4, max_model_len=128, prefill_chunks=(8, 32), tail_chunks=(2, 4),
                        kv_bucket_factor=16, prefix_slack=4)
    tails = Engine(cfg, to_device(cfg, flat, jnp.float32), ecfg)
    monkeypatch.setattr(tails, "_pad_only_tail", True)  # the CPU's chunk policy (tail chunks are a CPU feature)
    monkeypatch.setattr(engine, "_pad_only_tail", True)
    assert {k.chunk for k in tails.grid() if k.kind == "compute"} == {2, 4, 8, 32}
    assert {k.chunk for k in tails.grid() if k.kind == "mixed"} == {8}
    tails.compile_all(keys=[k for k in tails.grid() if k.kind == "compute"])
    prompt = np.random.default_rng(21).integers(0, 512, 84).tolist()

    def last_logits(eng: Engine, n: int) -> tuple[list[int], np.ndarray]:
        start, sizes, pending = 0, [], None
        while start < n:
            sizes.append(eng.chunk_size(n - start))
            pending, used = eng.dispatch_compute(chunk=PromptChunk(1, prompt[start:n], start, [False] * (n - start),
                                                                   clear_penalties=start == 0))
            start += used
        return sizes, np.asarray(pending.logits[0])

    sizes, with_tails = last_logits(tails, 84)
    assert sizes == [32, 32, 8, 8, 4]
    base_sizes, without = last_logits(engine, 84)
    assert base_sizes == [32, 32, 8, 8, 8]
    np.testing.assert_allclose(with_tails, without, atol=TOL)
    assert last_logits(tails, 23)[0] == [8, 8, 8]
    assert any(k.kind == "compute" and k.chunk == 4 for k in tails.calls)
    # beside decode rows, a tail of several chunks is one mixed pass; the step-time model prices a tail's plan
    wide = Engine(cfg, to_device(cfg, flat, jnp.float32), EngineConfig(
        num_slots=2, max_model_len=128, prefill_chunks=(64,), tail_chunks=(16, 32)))  # (plans only: no programs)
    monkeypatch.setattr(wide, "_pad_only_tail", True)  # the CPU's chunk policy, on every backend
    assert wide.chunk_plan(40) == (32, 16) and wide.chunk_plan(40, beside_decode=True) == (64,)
    assert wide.chunk_plan(20, beside_decode=True) == (32,)
    assert [(k.kind, k.chunk) for k in wide.step_programs(shape=StepShape(chunk_tokens=40))] == [
        ("compute", 32), ("compute", 16)]
    assert [k.kind for k in wide.step_programs(shape=StepShape(rows=1, chunk_tokens=40, longest=9))] == ["mixed"]
    with pytest.raises(ValueError, match="tail chunks"):
        Engine(cfg, to_device(cfg, flat, jnp.float32), EngineConfig(num_slots=1, max_model_len=128,
                                                                    prefill_chunks=(8,), tail_chunks=(8,)))


def test_greedy_sampler_keeps_the_penalty_history_like_the_full_one():
    """The greedy program records input tokens by point updates; the history it leaves equals the full
    program's (active rows record their input token, generated ones also count; inactive rows and padding none)."""
    from model_worker.engine.programs import SampleInputs, greedy_program, sample_program
    from model_worker.modeling.sampling import (
        PenaltyState,
        SamplingArrays,
        dense_from_history,
        history_from_dense,
    )

    rng = np.random.default_rng(3)
    S_, V_ = 6, 300
    seen = rng.random((S_, V_)) < 0.1
    dense = PenaltyState(counts=jnp.asarray(np.where(seen, rng.integers(0, 3, (S_, V_)), 0), jnp.int32),
                         seen=jnp.asarray(seen))
    pstate = history_from_dense(dense, capacity=int(seen.sum(axis=1).max()) + 4)
    logits = jnp.asarray(rng.standard_normal((4, V_)), jnp.float32)
    tokens = np.array([[5], [7], [7], [9]], np.int32)
    positions = np.array([[10], [3], [-1], [4]], np.int32)  # row 2: padding
    slots = np.array([4, 0, 5, 2], np.int32)
    is_output = np.array([[True], [False], [True], [True]])
    active = np.array([True, True, True, False])
    sampling = SamplingArrays.defaults(4, V_)
    inputs = SampleInputs(logits, tokens, positions, slots, is_output, np.zeros(4, bool), active, sampling)
    full_out, full_state = jax.jit(sample_program)(jax.tree.map(jnp.copy, pstate), inputs)
    fast_out, fast_state = jax.jit(greedy_program)(jax.tree.map(jnp.copy, pstate), inputs)
    np.testing.assert_array_equal(np.asarray(fast_out.tokens), np.asarray(full_out.tokens))
    np.testing.assert_array_equal(np.asarray(fast_state.counts), np.asarray(full_state.counts))
    np.testing.assert_array_equal(np.asarray(fast_state.ids), np.asarray(full_state.ids))
    after = dense_from_history(full_state, V_)
    changed = np.asarray(after.counts) != np.asarray(dense.counts)
    assert changed.sum() == 1 and changed[4, 5], "only slot 4's generated token 5 is counted"
    seen_now = np.asarray(after.seen) != np.asarray(dense.seen)
    assert not seen_now[[1, 2, 3, 5]].any(), "only slots 4 and 0 (active, not padding) record a token"


def test_a_copied_slot_keeps_the_history_and_a_cleared_one_starts_empty():
    """A slot copy (prefix reuse, `n` > 1 forks) gives the destination the source's sparse history as it is; the
    destination then records its own tokens on top (a repeated token counted again, not added twice), and a row
    with `clear_penalties` (a fresh sequence in a reused slot) starts from an empty history."""
    from model_worker.engine.programs import CopyInputs, SampleInputs, copy_program, sample_program
    from model_worker.modeling.sampling import (
        SamplingArrays,
        dense_from_history,
        penalty_history_zeros,
        record_tokens,
    )

    V_ = 64
    pstate = penalty_history_zeros(3, 8)
    tokens = jnp.array([[3, 9, 3, 5]], jnp.int32)
    first = record_tokens(jax.tree.map(lambda a: a[:1], pstate), tokens, tokens >= 0,
                          jnp.array([[False, False, True, True]]))  # prompt 3 9, then 3 and 5 generated
    pstate = jax.tree.map(lambda a, r: a.at[0].set(r[0]), pstate, first)
    _, _, pstate = jax.jit(copy_program)(None, pstate, CopyInputs(np.int32(0), np.int32(2)))
    np.testing.assert_array_equal(np.asarray(pstate.ids[2]), np.asarray(pstate.ids[0]))
    np.testing.assert_array_equal(np.asarray(pstate.counts[2]), np.asarray(pstate.counts[0]))
    s = SamplingArrays.defaults(2, V_)
    s.frequency_penalty[:] = 0.5
    inputs = SampleInputs(jnp.zeros((2, V_), jnp.float32), np.array([[9], [7]], np.int32),
                          np.array([[4], [4]], np.int32), np.array([2, 0], np.int32), np.ones((2, 1), bool),
                          np.array([False, True]), np.ones(2, bool), s)
    out, pstate = jax.jit(sample_program)(pstate, inputs)
    dense = dense_from_history(pstate, V_)
    counts, seen = np.asarray(dense.counts), np.asarray(dense.seen)
    assert np.flatnonzero(seen[2]).tolist() == [3, 5, 9] and counts[2, [3, 5, 9]].tolist() == [1, 1, 1]
    assert np.flatnonzero(seen[0]).tolist() == [7] and counts[0, 7] == 1  # cleared, then its own token
    assert not seen[1].any()
    assert int(out.tokens[0]) not in (3, 5, 9) and int(out.tokens[1]) != 7  # penalized tokens lose the argmax


def test_a_burst_of_identical_prompts_costs_one_prefill(engine):
    """8 identical prompts submitted at once on 4 slots (greedy, no stop ids: each runs to max_tokens) on the real
    engine: the prompt is computed once (plus one token per other request), decode steps stay within 1.1 x
    ceil(R / S) x T, and every answer equals the prompt run alone."""
    from prometheus_client import CollectorRegistry

    from model_worker.server.metrics import WorkerMetrics

    prompt, requests, tokens = [(7 * i) % 50 + 3 for i in range(20)], 8, 4
    alone = EngineLoop(engine)
    alone.start()
    try:
        want = run_alone(alone, "alone", prompt, tokens).tokens
    finally:
        alone.stop()
    registry = CollectorRegistry()
    loop = EngineLoop(engine, metrics=WorkerMetrics(registry))
    loop.start()
    try:
        steps = dict(loop.steps)
        sinks = []
        for i in range(requests):
            seq, sink = make(f"burst{i}", prompt, tokens)
            sinks.append(sink)
            loop.submit(seq)
        for sink in sinks:
            assert sink.done.wait(60)
        decode_steps = loop.steps["decode"] - steps["decode"]
    finally:
        loop.stop()
    assert all(sink.tokens == want for sink in sinks)
    computed = registry.get_sample_value("gemma_serve:prompt_tokens_computed_total")
    assert computed <= len(prompt) + requests, computed
    assert decode_steps <= 1.1 * math.ceil(requests / engine.ecfg.num_slots) * tokens, decode_steps
