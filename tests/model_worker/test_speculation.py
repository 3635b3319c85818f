"""Exact speculative decoding on a real engine: with speculation on (every draft verified: `speculation="always"`)
a request gets exactly the tokens, logprobs and top logprobs it gets with speculation off, bit for bit; and the
same for async scheduling (decode steps dispatched from the previous step's tokens on the device) against steps
planned one at a time.

The model is the tiny random Gemma 4 (sliding window 8, KV sharing, per-layer inputs) in the batch-invariant
bfloat16 mode, the CPU default where speculation is on. A random model rarely repeats its context, so most tests
draft from a prediction (OpenAI Predicted Outputs) that is the speculation-off output, whole or with every few
tokens changed: drafts are then accepted for long runs and rejected at known places, rings of the sliding layers
wrap inside drafted runs (prompts and outputs far longer than the window), and the tests assert that verification
actually ran and accepted tokens, so they fail if speculation silently never happens.
"""

from __future__ import annotations

import dataclasses
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.checkpoints.hf_loader import load_checkpoint
from model_worker.engine.engine import Engine, EngineConfig
from model_worker.modeling.params import for_matmul_precision, to_device
from model_worker.modeling.sampling import pack_mask
from model_worker.serving.loop import EngineLoop
from model_worker.serving.sequence import Finish, GrammarDraft, SamplingSpec, Sequence, TokenEvent
from tests.gemma4_tiny import SHARED, write_checkpoint

pytestmark = pytest.mark.slow  # compiles model programs: outside `make test-fast`

DRAFTS = 3
SHARED_VOCAB = SHARED["vocab_size"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-spec")
    write_checkpoint(SHARED, out)
    cfg, flat = load_checkpoint(out, jnp.float32)
    cfg, params = for_matmul_precision(cfg, to_device(cfg, flat, jnp.float32), "bfloat16", batch_invariant=True)
    eng = Engine(cfg, params, EngineConfig(num_slots=2, max_model_len=96, prefill_chunks=(8,), kv_bucket_factor=16,
                                           prefix_slack=4, max_draft_tokens=DRAFTS, max_verify_batch=2))
    eng.compile_all()
    return eng


@dataclasses.dataclass
class Request:
    prompt: list[int]
    spec: SamplingSpec = dataclasses.field(default_factory=lambda: SamplingSpec(top_logprobs=3))
    max_tokens: int = 40
    prediction: list[int] = dataclasses.field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    fork_of: int | None = None
    allowed: list[int] | None = None
    grammar: bool = False  # constrained: a client sends each step's `toy_mask` (see `GrammarClient`)
    client_drafts: list[int] | None = None  # the client's draft source (with grammar): drafts sent with the masks


@dataclasses.dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]
    tops: list[tuple[list[int], list[float]]]
    finish: Finish
    last: TokenEvent


def toy_mask(previous: int) -> np.ndarray:
    """A made-up grammar over the tiny vocabulary: after token p, the tokens t in [3, 500) with (t + p) % 3 != 0
    (what is allowed depends on what was taken, as a real grammar's masks do). Packed uint32 words."""
    allowed = np.zeros(SHARED_VOCAB, bool)
    t = np.arange(3, 500)
    allowed[t[(t + previous) % 3 != 0]] = True
    return pack_mask(allowed)


class GrammarClient:
    """The client of a constrained sequence, as the gateway is: for every token the worker emits, the mask of
    the next step (`toy_mask`) and, with `drafts`, a draft from that step (the next `DRAFTS` tokens of `drafts`)
    with the mask each draft token leads to — sent from the engine thread, like a fast gateway."""

    def __init__(self, loop: EngineLoop, request_id: str, drafts: list[int] | None):
        self.loop, self.request_id, self.drafts, self.received = loop, request_id, drafts, 0

    def on_event(self, ev: TokenEvent) -> None:
        for token in ev.token_ids:
            self.received += 1
            step, draft = self.received, None
            if self.drafts is not None and self.drafts[step:step + DRAFTS]:
                tokens = self.drafts[step:step + DRAFTS]
                draft = GrammarDraft(step, tokens, [toy_mask(t) for t in tokens])
            if ev.finish == Finish.NONE:
                self.loop.add_mask(self.request_id, step, toy_mask(token), draft)


def run(engine, mode: str, requests: list[Request], async_scheduling: bool = False,
        one_by_one: bool = False) -> tuple[list[Result], dict]:
    """Submit every request at once (`one_by_one`: each after the previous one ended, so that a later one can
    reuse an earlier one's slot) on a fresh loop in `mode`; their results and the loop's step counts (with the
    scheduler's reused prompt tokens as "reused")."""
    loop = EngineLoop(engine, speculation=mode, async_scheduling=async_scheduling)
    loop.start()
    results: list[Result] = []
    done = []
    try:
        for i, r in enumerate(requests):
            res = Result([], [], [], Finish.NONE, TokenEvent([], []))
            event = threading.Event()
            client = GrammarClient(loop, f"r{i}", r.client_drafts) if r.grammar else None

            def sink(ev, res=res, event=event, client=client):
                if client is not None:
                    client.on_event(ev)
                res.tokens += ev.token_ids
                res.logprobs += ev.logprobs
                res.tops += ev.top
                if ev.finish != Finish.NONE:
                    res.finish, res.last = ev.finish, ev
                    event.set()

            allowed = None
            if r.allowed is not None:
                mask = np.zeros(engine.cfg.vocab_size, bool)
                mask[r.allowed] = True
                allowed = pack_mask(mask)
            seq = Sequence(f"r{i}", list(r.prompt), r.spec, r.max_tokens, r.stop_ids, sink,
                           fork_of=None if r.fork_of is None else f"r{r.fork_of}", prediction=list(r.prediction),
                           allowed=allowed, constrained=r.grammar, drafts_with_masks=r.grammar,
                           masks={0: toy_mask(r.prompt[-1])} if r.grammar else {})
            results.append(res)
            done.append(event)
            loop.submit(seq)
            if one_by_one:
                assert event.wait(300)
        for event in done:
            assert event.wait(300)
    finally:
        loop.stop()
    return results, {**loop.steps, "reused": loop.scheduler.reused_tokens}


def assert_same(on: list[Result], off: list[Result]) -> None:
    """Speculation on and off gave the same tokens, logprobs and top logprobs (exactly) and the same endings."""
    for i, (a, b) in enumerate(zip(on, off)):
        assert a.tokens == b.tokens, f"request {i}: tokens differ"
        assert a.logprobs == b.logprobs, f"request {i}: logprobs differ"
        assert a.tops == b.tops, f"request {i}: top logprobs differ"
        assert a.finish == b.finish


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def corrupt(tokens: list[int], every: int) -> list[int]:
    """`tokens` with every `every`-th one changed (a prediction that is right in runs and wrong between them)."""
    return [t if (i + 1) % every else (t + 1) % 500 for i, t in enumerate(tokens)]


def test_greedy_with_an_exact_prediction_accepts_whole_drafts(engine):
    """A prediction equal to the output: every draft is accepted (3 per step), the prompt (30 tokens) and the
    output (40) are both several windows (8) long, so rings wrap inside verified runs; the result is the same."""
    off, _ = run(engine, "off", [Request(prompt(1, 30))])
    on, steps = run(engine, "always", [Request(prompt(1, 30), prediction=off[0].tokens)])
    assert_same(on, off)
    assert steps["accepted_tokens"] == steps["drafted_tokens"] > 0
    assert steps["decode"] < len(off[0].tokens) // 2  # several tokens per step
    assert (on[0].last.accepted_prediction, on[0].last.rejected_prediction) == (40, 0)


@pytest.mark.parametrize("every", [3, 4, 5])
def test_rejected_drafts_leave_no_trace(engine, every):
    """A prediction wrong every 3rd, 4th or 5th token: drafts are rejected at every offset of a run (so the
    KV and ring positions after a rejection were written by the verify step and must be rewritten before they are
    read), and the output is still exactly speculation-off's."""
    off, _ = run(engine, "off", [Request(prompt(2, 20), max_tokens=48)])
    on, steps = run(engine, "always", [Request(prompt(2, 20), max_tokens=48, prediction=corrupt(off[0].tokens, every))])
    assert_same(on, off)
    assert 0 < steps["accepted_tokens"] < steps["drafted_tokens"]
    usage = on[0].last
    assert every - 1 <= usage.accepted_prediction < 48 and usage.accepted_prediction + usage.rejected_prediction == 48


SEEDED = [
    SamplingSpec(temperature=0.9, seed=11, top_p=0.9, top_logprobs=5),
    SamplingSpec(temperature=1.3, seed=12, top_k=20, min_p=0.02, top_logprobs=2),
    SamplingSpec(temperature=0.7, seed=13, presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3,
                 top_logprobs=1),
    SamplingSpec(temperature=0.0, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.5,
                 bias_ids=(7, 8, 9), bias_vals=(5.0, -3.0, 2.0), top_logprobs=4),
]


@pytest.mark.parametrize("spec", SEEDED, ids=["top-p", "top-k-min-p", "penalties", "greedy-penalties-bias"])
def test_seeded_sampling_penalties_and_bias_are_exact(engine, spec):
    """Seeded sampling (its random draw depends only on the seed and the output step), penalties updated token by
    token inside a verified run, and logit_bias: the same tokens and logprobs; with a prediction from the
    speculation-off run, drafts are accepted (penalties on accepted tokens weigh on the positions after them).
    (Prompt seed 13: seed 3 meets the tiny configs' chunk-versus-decode difference pinned below.)"""
    off, _ = run(engine, "off", [Request(prompt(13, 24), spec=spec)])
    on, steps = run(engine, "always", [Request(prompt(13, 24), spec=spec, prediction=corrupt(off[0].tokens, 7))])
    assert_same(on, off)
    assert steps["accepted_tokens"] > 0


def test_batched_with_other_requests_forks_and_stop_ids(engine):
    """Two requests at once (one greedy, one seeded, different lengths), then `n` = 2 (a fork of the first
    prompt), and a stop id that falls inside a drafted run: every request's output is exactly what it is with
    speculation off."""
    base_off, _ = run(engine, "off", [Request(prompt(4, 17)), Request(prompt(5, 9), spec=SEEDED[0], max_tokens=30)])
    stop = base_off[0].tokens[21]
    requests = [Request(prompt(4, 17), prediction=base_off[0].tokens),
                Request(prompt(5, 9), spec=SEEDED[0], max_tokens=30, prediction=base_off[1].tokens),
                Request(prompt(4, 17), spec=SEEDED[1], prediction=base_off[0].tokens),
                Request(prompt(4, 17), spec=SEEDED[1], fork_of=2, prediction=base_off[0].tokens),
                Request(prompt(4, 17), stop_ids=frozenset({stop}), prediction=base_off[0].tokens)]
    off, _ = run(engine, "off", [dataclasses.replace(r, prediction=[]) for r in requests])
    on, steps = run(engine, "always", requests)
    assert_same(on, off)
    assert on[4].finish == Finish.STOP and on[4].tokens[-1] == stop
    assert steps["verify"] > 0 and steps["accepted_tokens"] > 0


def test_prefix_hit_and_constant_mask(engine):
    """The same conversation sent again (a prefix-cache hit: the slot's KV was written partly by verify steps,
    including rejected positions) and a request with one allowed-token set for every step (drafts checked under
    its mask at every position): the same results as speculation off."""
    first = prompt(6, 26)
    off1, _ = run(engine, "off", [Request(first)])
    follow = first + off1[0].tokens + prompt(7, 5)
    allowed = sorted(set(off1[0].tokens[:10]) | set(range(10, 40)))
    requests = [Request(first, prediction=corrupt(off1[0].tokens, 4)), Request(follow, max_tokens=20),
                Request(prompt(8, 12), max_tokens=30, allowed=allowed)]
    off, _ = run(engine, "off", [dataclasses.replace(r, prediction=[]) for r in requests])
    on = []
    for r in requests:  # one after another, so the second one hits the first one's slot
        result, _ = run(engine, "always", [r])
        on += result
    assert_same(on, off)
    assert all(t in allowed for t in on[2].tokens)


@pytest.mark.parametrize("spec", [SamplingSpec(top_logprobs=2), SEEDED[2]], ids=["greedy", "seeded-penalties"])
def test_constrained_drafts_with_a_mask_per_position(engine, spec):
    """A constrained request whose client sends a draft with every mask, and the mask each draft token leads to
    (a grammar's masks depend on the tokens taken: `toy_mask`), beside an unconstrained request: each draft
    position is sampled under its own mask, so the output equals speculation off token for token — with drafts
    that are the speculation-off answer (accepted whole) and the same answer wrong every 3rd token (rejected at
    every offset)."""
    base = [Request(prompt(21, 19), spec=spec, grammar=True), Request(prompt(22, 11), max_tokens=30)]
    off, _ = run(engine, "off", base)
    assert all(toy_mask_allows(p, t) for p, t in zip([base[0].prompt[-1], *off[0].tokens], off[0].tokens))
    for drafts in (off[0].tokens, corrupt(off[0].tokens, 3)):
        on, steps = run(engine, "always", [dataclasses.replace(base[0], client_drafts=drafts), base[1]])
        assert_same(on, off)
        assert steps["verify"] > 0 and steps["accepted_tokens"] > 0


def toy_mask_allows(previous: int, token: int) -> bool:
    return 3 <= token < 500 and (token + previous) % 3 != 0


def test_every_program_run_is_in_the_compiled_grid(engine):
    """Verify steps run only programs of the grid compiled at start (a draft never costs a compile): every key the
    engine ran is in `grid()`, verify keys among them."""
    off, _ = run(engine, "off", [Request(prompt(9, 10), max_tokens=12)])
    run(engine, "always", [Request(prompt(9, 10), max_tokens=12, prediction=off[0].tokens)])
    grid = set(engine.grid())
    assert set(engine.calls) <= grid
    assert any(key.kind == "verify" for key in engine.calls)
    assert any(key.kind in ("vgreedy", "vsample") for key in engine.calls)


def test_tiny_chunk_and_decode_agree_at_every_position(engine):
    """The logits of position 28 computed in a prompt chunk (positions 24-28) and in a decode step are identical
    for this token sequence on the tiny config, with no draft involved. They differed (in the last bits of
    attention) while the batch-invariant GEMMs took row counts as they came: 5 chunk rows against 1 decode row
    times the heads per KV head; every count is now padded to a multiple of `quant.GEMM_ROW_MULTIPLE`."""
    from model_worker.serving.engine_api import DecodeBatch, PromptChunk

    tokens = prompt(3, 24) + [150, 482, 299, 118, 323]
    for slot, upto in ((0, 29), (1, 24)):
        pos = 0
        while pos < upto:
            pending, n = engine.dispatch_compute(chunk=PromptChunk(slot, tokens[pos:upto], pos, [False] * (upto - pos),
                                                                   True))
            pos += n
        if slot == 0:
            chunk_logits = np.asarray(pending.logits)[0]
    for t in range(24, 29):
        pending = engine.dispatch_decode(batch=DecodeBatch([1], [tokens[t]], [t], [True]))
    assert np.array_equal(chunk_logits, np.asarray(pending.logits)[0])


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_verify_steps_equal_decode_steps_on_the_embedded_model(gemma3, precision):
    """The embedded Gemma 3 (batch-invariant bfloat16, the CPU default, and block-int8) at positions 600-615, past its sliding
    ring (window 512 + slack 8): a verify step of 8 tokens gives the logits, tokens, logprobs and penalty history
    of 8 decode steps (seeded sampling with repetition, frequency and presence penalties), and after a verify
    step whose 4th draft is rejected, decoding on from the accepted tokens gives the decode-only path's logits
    (the rejected positions' KV and ring entries left no trace)."""
    from model_worker.engine.programs import ProgramKey
    from model_worker.modeling.sampling import SamplingArrays
    from model_worker.serving.engine_api import DecodeBatch, PromptChunk, VerifyBatch

    cfg, params = for_matmul_precision(*gemma3, precision, batch_invariant=True)
    eng = Engine(cfg, params, EngineConfig(num_slots=2, max_model_len=1024, prefill_chunks=(64,), prefix_slack=8,
                                           max_draft_tokens=7, max_verify_batch=1))
    # the programs this test runs: one chunk size, decode and verify at the largest KV bucket (the engine takes the
    # cheapest ready program, and the bucket changes no logit), their sampling
    eng.compile_all(keys=[ProgramKey("compute", 1, 64, 1024), ProgramKey("decode", 1, 1, 1024),
                          ProgramKey("sample", 1, 0, 0), ProgramKey("verify", 1, 8, 1024),
                          ProgramKey("vsample", 1, 8, 0)])
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, 600).tolist()
    spec = SamplingArrays.defaults(1, cfg.vocab_size)
    spec.temperature[:], spec.seed[:], spec.repetition_penalty[:] = 0.8, (5, 0), 1.3
    spec.frequency_penalty[:], spec.presence_penalty[:], spec.top_logprobs[:] = 0.5, 0.4, 5

    def prefill(slot):
        pos = 0
        while pos < len(tokens):
            _, n = eng.dispatch_compute(chunk=PromptChunk(slot, tokens[pos:], pos, [False] * (len(tokens) - pos),
                                                          True))
            pos += n

    def decode(slot, token, position, step):
        spec.step[:] = step
        pending = eng.dispatch_decode(batch=DecodeBatch([slot], [token], [position], [step > 0]))
        out = eng.sample(pending, sampling=spec, clear_penalties=[False], active=[True])
        return np.asarray(pending.logits)[0], out

    for slot in (0, 1):
        prefill(slot)
    logits, sampled, outs, last = [], [], [], tokens[-1]
    for t in range(16):  # the decode-only path in slot 0 (the first input is the prompt's last token)
        lg, out = decode(0, last, 599 + t, t)
        logits.append(lg)
        outs.append(out)
        last = int(out.tokens[0])
        sampled.append(last)
    spec.step[:] = 0
    pending = eng.dispatch_verify(batch=VerifyBatch([1], [[tokens[-1], *sampled[:7]]], [599], [False]))
    verified = eng.sample_verify(pending, sampling=spec, clear_penalties=[False], active=[True])
    assert verified.emitted[0] == 8
    assert verified.tokens[0].tolist() == sampled[:8]
    assert verified.logprobs[0].tolist() == [float(o.logprobs[0]) for o in outs[:8]]
    assert np.array_equal(verified.top_ids[0], np.stack([o.top_ids[0] for o in outs[:8]]))
    # a verify step from position 607 whose 4th draft is wrong, then decode steps from the accepted tokens
    spec.step[:] = 8
    drafts = sampled[8:11] + [(sampled[11] + 1) % cfg.vocab_size] + sampled[12:15]
    pending = eng.dispatch_verify(batch=VerifyBatch([1], [[sampled[7], *drafts]], [607], [True]))
    verified = eng.sample_verify(pending, sampling=spec, clear_penalties=[False], active=[True])
    assert verified.emitted[0] == 4 and verified.tokens[0, :4].tolist() == sampled[8:12]
    for t in range(12, 16):  # positions 611-614: the rejected drafts had written 611-614 and ring entries
        lg, out = decode(1, sampled[t - 1], 599 + t, t)
        assert np.array_equal(lg, logits[t]) and int(out.tokens[0]) == sampled[t]
    # the same tokens committed to both slots' penalty histories, the rejected drafts' not among them
    assert all(np.array_equal(np.asarray(a)[0], np.asarray(a)[1]) for a in (eng.pstate.ids, eng.pstate.counts))


@pytest.mark.parametrize("spec", [SamplingSpec(top_logprobs=3), *SEEDED],
                         ids=["greedy", "top-p", "top-k-min-p", "penalties", "greedy-penalties-bias"])
def test_async_scheduling_gives_exactly_the_planned_steps_results(engine, spec):
    """Decode steps dispatched ahead from the previous step's sampled tokens on the device (speculation off):
    the same tokens, logprobs and top logprobs as steps planned one at a time — greedy, seeded draws (their step
    index moves on with each step ahead), penalties (whose history each step ahead records) and bias — for two
    rows at once, one of them ending at a stop id while a step ahead carries it; most decode steps went ahead."""
    base, _ = run(engine, "off", [Request(prompt(4, 17), spec=spec)])
    requests = [Request(prompt(4, 17), spec=spec, stop_ids=frozenset({base[0].tokens[25]})),
                Request(prompt(5, 9), spec=spec, max_tokens=36)]
    off, _ = run(engine, "off", requests)
    on, steps = run(engine, "off", requests, async_scheduling=True)
    assert_same(on, off)
    assert on[0].finish == Finish.STOP and len(on[1].tokens) == 36
    assert steps["ahead"] >= steps["decode"] // 2 > 0


def test_async_scheduling_then_the_conversation_continued_reuses_its_slot_exactly(engine):
    """A request ending at a stop id while a step ahead wrote one position past its end, then the conversation
    sent again with more tokens (a prefix hit on that slot, rings wrapped: window 8), and a second answer: the
    same as with every step planned."""
    first = prompt(6, 26)
    base, _ = run(engine, "off", [Request(first)])
    stop = frozenset({base[0].tokens[20]})
    answer = base[0].tokens[: base[0].tokens.index(base[0].tokens[20]) + 1]
    requests = [Request(first, stop_ids=stop), Request(first + answer + prompt(7, 5), max_tokens=24)]
    off, off_steps = run(engine, "off", requests, one_by_one=True)
    on, steps = run(engine, "off", requests, async_scheduling=True, one_by_one=True)
    assert_same(on, off)
    assert on[0].tokens == answer and steps["ahead"] > 0
    assert steps["reused"] == off_steps["reused"] >= len(first)
