"""`EngineLoop` on its own (model_worker/serving/loop.py), driving the hand-computable FakeEngine (next token =
previous + 1): the typed inbox commands, tokens and step counters exactly as the arithmetic says (compute,
decode, mixed and copy steps; prompt tokens against the engine's own count), a duplicate id and a full queue
ended at once, abort, `sampling_rows`, late masks computed again, forced tokens, a failed step (or the fault
salt) ending every sequence with ENGINE_FAILED and calling `on_fatal`, `load`, `snapshot` and `wait_idle`. No
JAX program is compiled; waits are on events with timeouts of seconds."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from model_worker.modeling.sampling import MAX_LOGIT_BIAS, SamplingArrays, mask_words, pack_mask
from model_worker.serving.loop import (
    ENGINE_FAILED,
    FAULT_ENV,
    ROW_SETTINGS,
    Abort,
    AddForced,
    AddMask,
    EngineLoop,
    Submit,
    sampling_rows,
    wait_idle,
)
from model_worker.serving.sequence import Failure, Finish, SamplingSpec, Sequence, TokenEvent
from tests.fakes import FakeEngine, FakeEngineConfig

WAIT = 10.0  # seconds: far beyond what any wait below normally takes (milliseconds)
VOCAB = 1000


class Sink:
    """Collects a sequence's events; `done` is set by its last one. `on_event(event, sink)`, if given, runs on
    the loop thread after each event is recorded."""

    def __init__(self, on_event=None):
        self.events: list[TokenEvent] = []
        self.done = threading.Event()
        self.on_event = on_event

    def __call__(self, event: TokenEvent) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event, self)
        if event.finish != Finish.NONE:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def last(self) -> TokenEvent:
        return self.events[-1]

    def wait(self) -> TokenEvent:
        assert self.done.wait(WAIT), f"no last event in {WAIT} s; got {self.events}"
        return self.last


def make(rid: str, prompt, max_tokens: int, stop=(), on_event=None, **kwargs) -> tuple[Sequence, Sink]:
    """A greedy sequence and its sink."""
    sink = Sink(on_event)
    return Sequence(rid, list(prompt), SamplingSpec(), max_tokens, frozenset(stop), sink, **kwargs), sink


def mask(*allowed: int) -> np.ndarray:
    """Packed words allowing exactly `allowed` over the FakeEngine's vocabulary."""
    bits = np.zeros(VOCAB, bool)
    bits[list(allowed)] = True
    return pack_mask(bits)


@pytest.fixture
def loops():
    """Loops a test started: at teardown each engine's gate is opened and each loop stopped (its thread
    joined)."""
    started: list[EngineLoop] = []
    yield started
    for loop in started:
        loop.engine.gate.set()
        loop.stop()


def start(loops: list[EngineLoop], loop: EngineLoop) -> EngineLoop:
    loops.append(loop)
    loop.start()
    return loop


def engine(num_slots: int = 2, chunk: int = 4, max_waiting: int | None = 64, cls=FakeEngine) -> FakeEngine:
    return cls(FakeEngineConfig(num_slots=num_slots, max_model_len=64, chunk=chunk, prefix_slack=4,
                                max_waiting=max_waiting), vocab=VOCAB)


def test_the_thread_safe_methods_queue_typed_commands_in_order():
    loop = EngineLoop(engine())  # never started: the commands stay in its inbox
    seq, _ = make("a", [1, 2], 3)
    words = mask(7)
    loop.submit(seq)
    assert loop.load() == (0, 1, 0.0), "a submission not yet taken in counts as waiting"
    loop.abort("a")
    loop.add_mask("a", 2, words)
    loop.add_forced("a", 1, [5, 6])
    commands = [loop._inbox.get_nowait() for _ in range(4)]
    assert loop._inbox.empty()
    assert [type(c) for c in commands] == [Submit, Abort, AddMask, AddForced]
    assert commands[0].seq is seq and commands[1] == Abort("a")
    assert (commands[2].request_id, commands[2].step) == ("a", 2) and commands[2].words is words
    assert commands[3] == AddForced("a", 1, [5, 6])


def test_load_counts_only_submissions_in_the_inbox_as_waiting():
    loop = EngineLoop(engine())  # never started
    seq, _ = make("a", [1, 2], 3)
    loop.submit(seq)
    loop.add_mask("a", 0, mask(7))
    loop.abort("nobody")
    assert loop.load() == (0, 1, 0.0)


def test_tokens_follow_the_fake_arithmetic_and_every_step_is_counted(loops):
    """A 6-token prompt in 4-token chunks, then 4 decode steps for 5 tokens; a stop id ends the next one."""
    fake = engine()
    loop = EngineLoop(fake)
    a, a_sink = make("a", range(10, 16), 5)
    loop.submit(a)
    start(loops, loop)
    last = a_sink.wait()
    assert a_sink.tokens == [16, 17, 18, 19, 20] and last.finish == Finish.LENGTH
    assert last.failure == Failure.NONE and last.error is None
    assert a_sink.events[0].cached_tokens == 0 and all(e.logprobs for e in a_sink.events if e.token_ids)
    b, b_sink = make("b", [1, 2], 20, stop=[5])
    loop.submit(b)
    assert b_sink.wait().finish == Finish.STOP and b_sink.tokens == [3, 4, 5], "the stop token is kept"
    loop.stop()
    assert fake.chunks == [(0, 0, 4), (0, 4, 2), (1, 0, 2)], "a in slot 0; b in the empty slot 1"
    assert loop.steps == {"compute": 3, "decode": 4 + 2, "mixed": 0, "copy": 0,
                          "computed_tokens": 6 + 4 + 2 + 2, "prompt_tokens": 8, "verify": 0, "drafted_tokens": 0,
                          "accepted_tokens": 0, "ahead": 0}
    assert fake.prompt_tokens == loop.steps["prompt_tokens"]
    assert (fake.calls["compute"], fake.calls["decode"]) == (3, 6)


def test_a_duplicate_live_id_ends_at_once_and_the_id_is_free_again_after_the_first_ends(loops):
    loop = EngineLoop(engine())
    first, first_sink = make("x", [1, 2], 3)
    dup, dup_sink = make("x", [50, 51], 3)
    loop.submit(first)
    loop.submit(dup)  # both taken in by the first iteration: "x" is live when the second arrives
    start(loops, loop)
    last = dup_sink.wait()
    assert dup_sink.events == [last] and last.finish == Finish.ABORT and last.token_ids == []
    assert last.failure == Failure.DUPLICATE_ID and "'x'" in last.error
    assert first_sink.wait().finish == Finish.LENGTH and first_sink.tokens == [3, 4, 5]
    again, again_sink = make("x", [50, 51], 2)
    loop.submit(again)
    assert again_sink.wait().finish == Finish.LENGTH and again_sink.tokens == [52, 53]


def test_a_full_waiting_queue_ends_the_newcomer_with_queue_full(loops):
    """One slot and one waiting place: q0 holds the slot (its compute held at the gate), q1 waits, q2 is
    refused at once, and the other two run to their ends."""
    fake = engine(num_slots=1, max_waiting=1)
    loop = EngineLoop(fake)
    fake.gate.clear()
    seqs, sinks = zip(*(make(f"q{i}", [10 * i + 1, 10 * i + 2], 2) for i in range(3)), strict=True)
    loop.submit(seqs[0])
    start(loops, loop)
    assert fake.entered.wait(WAIT), "q0 never reached the engine"
    loop.submit(seqs[1])
    loop.submit(seqs[2])
    assert loop.load()[:2] == (1, 2), "running q0; q1 and q2 not taken in yet"
    fake.gate.set()
    last = sinks[2].wait()
    assert sinks[2].events == [last] and last.finish == Finish.ABORT
    assert last.failure == Failure.QUEUE_FULL and "queue full" in last.error
    assert sinks[0].wait().finish == sinks[1].wait().finish == Finish.LENGTH
    assert sinks[0].tokens == [3, 4] and sinks[1].tokens == [13, 14]


def test_abort_ends_a_running_and_a_waiting_sequence_and_frees_the_slot(loops):
    """One slot. `a` asks for its own abort after its third token (from its sink: the command is taken in
    before the next step), `c` is aborted while waiting, an unknown id is ignored; `b` then gets the freed
    slot and runs to its end."""
    fake = engine(num_slots=1)
    loop = EngineLoop(fake)

    def abort_after_three(event, sink):
        if len(sink.tokens) == 3 and event.token_ids:
            loop.abort("a")

    a, a_sink = make("a", [1], 50, on_event=abort_after_three)
    b, b_sink = make("b", [20, 21], 2)
    c, c_sink = make("c", [30, 31], 2)
    for seq in (a, b, c):
        loop.submit(seq)
    loop.abort("c")
    loop.abort("nobody")
    start(loops, loop)
    assert a_sink.wait().finish == Finish.ABORT and a_sink.tokens == [2, 3, 4]
    assert a_sink.last.token_ids == [] and a_sink.last.failure == Failure.NONE
    assert c_sink.wait().finish == Finish.ABORT and c_sink.events == [c_sink.last] and c_sink.tokens == []
    assert b_sink.wait().finish == Finish.LENGTH and b_sink.tokens == [22, 23]
    assert wait_idle(loop, WAIT) and loop.load()[:2] == (0, 0)
    assert fake.chunks == [(0, 0, 2)], "b's prompt computed in the slot a left; c never computed"


def test_sampling_rows_copies_each_setting_splits_the_seed_pads_the_bias_and_takes_the_steps_mask():
    vocab = 100
    scalars = [f for f in dataclasses.fields(SamplingSpec) if f.name in ROW_SETTINGS]
    assert {f.name for f in scalars} == set(ROW_SETTINGS)

    def spec(r: int, **kwargs) -> SamplingSpec:  # every row setting off its default, different in each row
        values = {f.name: f.default + (0.125 * (r + 1) if isinstance(f.default, float) else r + 1)
                  for f in scalars}
        return SamplingSpec(**values, **kwargs)

    step_mask, allowed = pack_mask(np.arange(vocab) < 10), pack_mask(np.arange(vocab) % 2 == 0)
    rows = [
        Sequence("r0", [1], spec(0, seed=0x0123456789ABCDEF, bias_ids=(3, 7), bias_vals=(1.5, -2.0)), 9,
                 frozenset(), None, output=[5, 6], masks={2: step_mask, 3: allowed}, allowed=allowed),
        Sequence("r1", [1], spec(1, seed=2**64 - 1, bias_ids=tuple(range(MAX_LOGIT_BIAS)),
                                 bias_vals=(0.5,) * MAX_LOGIT_BIAS), 9, frozenset(), None, output=[5],
                 allowed=allowed),
        Sequence("r2", [1], spec(2), 9, frozenset(), None, masks={1: step_mask}),  # a later step's mask only
    ]
    s = sampling_rows(rows, vocab)
    defaults = SamplingArrays.defaults(3, vocab)
    for name in ROW_SETTINGS:
        assert getattr(s, name).shape == getattr(defaults, name).shape, name
        assert getattr(s, name).tolist() == pytest.approx([getattr(seq.sampling, name) for seq in rows]), name
    assert s.seed.dtype == np.uint32
    assert s.seed.tolist() == [[0x89ABCDEF, 0x01234567], [2**32 - 1] * 2, [0, 0]], "(low, high) words"
    assert s.step.tolist() == [2, 1, 0], "the index of the token being sampled"
    assert s.bias_ids.shape == (3, MAX_LOGIT_BIAS)
    assert s.bias_ids[0, :3].tolist() == [3, 7, -1] and (s.bias_ids[0, 2:] == -1).all()
    assert s.bias_vals[0, :2].tolist() == [1.5, -2.0] and (s.bias_vals[0, 2:] == 0).all()
    assert s.bias_ids[1].tolist() == list(range(MAX_LOGIT_BIAS)) and (s.bias_vals[1] == 0.5).all()
    assert (s.bias_ids[2] == -1).all()
    assert s.mask.shape == (3, mask_words(vocab)) and s.mask_on.tolist() == [True, True, False]
    assert s.mask[0].tolist() == step_mask.tolist(), "the step's own mask before the standing one"
    assert s.mask[1].tolist() == allowed.tolist(), "the standing mask when the step has none"
    assert s.mask[2].tolist() == defaults.mask[2].tolist()


def test_a_prompt_arriving_while_another_decodes_runs_in_mixed_iterations(loops):
    """`a` decodes; `b`'s 10-token prompt arrives (a's sink holds the engine at the gate after a's first token
    until b is submitted) and is computed in 4-token chunks, each in one mixed pass with a's decode step."""
    fake = engine()
    loop = EngineLoop(fake)
    first = threading.Event()

    def hold_after_first(event, sink):
        if len(sink.tokens) == 1:
            fake.gate.clear()
            first.set()

    a, a_sink = make("a", [100], 30, on_event=hold_after_first)
    b, b_sink = make("b", range(200, 210), 3)
    loop.submit(a)
    start(loops, loop)
    assert first.wait(WAIT)
    loop.submit(b)
    fake.gate.set()
    assert b_sink.wait().finish == Finish.LENGTH and b_sink.tokens == [210, 211, 212]
    assert a_sink.wait().finish == Finish.LENGTH and a_sink.tokens == list(range(101, 131))
    loop.stop()
    assert fake.calls["mixed"] == loop.steps["mixed"] == 3 and loop.steps["compute"] == 3
    assert loop.steps["decode"] == 30, "b's decode steps ran with a's"
    assert loop.steps["prompt_tokens"] == fake.prompt_tokens == 1 + 10
    assert loop.steps["computed_tokens"] == 10 + 30 + 2


def test_a_follower_copies_its_leaders_slot_and_the_counters_agree_with_the_engines(loops):
    """Two identical 10-token prompts arrive together: the first is computed, the second waits for it, copies
    its slot (one copy step) and computes only its last prompt token, in a decode row."""
    fake = engine()
    loop = EngineLoop(fake)
    (a, a_sink), (b, b_sink) = make("a", range(100, 110), 3), make("b", range(100, 110), 3)
    loop.submit(a)
    loop.submit(b)
    start(loops, loop)
    assert a_sink.wait().finish == b_sink.wait().finish == Finish.LENGTH
    assert a_sink.tokens == b_sink.tokens == [110, 111, 112]
    assert (a_sink.events[0].cached_tokens, b_sink.events[0].cached_tokens) == (0, 9)
    loop.stop()
    assert fake.chunks == [(0, 0, 4), (0, 4, 4), (0, 8, 2)]
    assert loop.steps == {"compute": 3, "decode": 3, "mixed": 0, "copy": 1, "computed_tokens": 10 + 5,
                          "prompt_tokens": 11, "verify": 0, "drafted_tokens": 0, "accepted_tokens": 0, "ahead": 0}
    assert (fake.calls["copy"], fake.prompt_tokens) == (1, 11)


def test_snapshot_and_load_report_prefix_reuse_leases_and_an_idle_loop(loops):
    """An agent's second turn extends its first: it takes over the first turn's (leased) slot in place."""
    fake = engine(num_slots=4)  # 4 slots: room for one session lease
    loop = EngineLoop(fake)
    one, one_sink = make("t1", range(100, 110), 3, session="s", lease_ttl=60.0)
    loop.submit(one)
    start(loops, loop)
    one_sink.wait()
    two, two_sink = make("t2", list(range(100, 110)) + one_sink.tokens + [7], 2, session="s", lease_ttl=60.0)
    loop.submit(two)
    assert two_sink.wait().finish == Finish.LENGTH and two_sink.tokens == [8, 9]
    assert two_sink.events[0].cached_tokens == 12, "10 prompt tokens + the 2 answer tokens computed"
    assert wait_idle(loop, WAIT)
    loop.stop()
    snap = loop.last
    assert snap == loop.snapshot()
    assert (snap.running, snap.waiting, snap.kv_usage) == (0, 0, 0.0) == loop.load()
    assert (snap.prefix_queries, snap.prefix_hits, snap.reused_tokens) == (2, 1, 12)
    assert (snap.cached_slots, snap.leased_slots, snap.lease_preemptions) == (1, 1, 0)
    assert snap.steps == loop.steps and loop.steps["prompt_tokens"] == fake.prompt_tokens == 10 + 2


def test_load_counts_running_and_waiting_and_wait_idle_says_whether_the_loop_drained(loops):
    fake = engine()
    loop = EngineLoop(fake)
    sinks = []
    for i in range(3):
        seq, sink = make(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], 2)
        loop.submit(seq)
        sinks.append(sink)
    assert loop.load() == (0, 3, 0.0)
    fake.gate.clear()
    start(loops, loop)
    assert fake.entered.wait(WAIT)  # the first iteration admitted two and holds in r0's compute
    running, waiting, kv = loop.load()
    assert (running, waiting) == (2, 1) and 0.0 <= kv <= 1.0
    assert not wait_idle(loop, timeout=0.2), "nothing can end while the engine is held"
    fake.gate.set()
    assert wait_idle(loop, WAIT)
    assert loop.load()[:2] == (0, 0) and all(s.done.is_set() for s in sinks)
    assert [s.tokens for s in sinks] == [[4, 5], [14, 15], [24, 25]]


class Watched(FakeEngine):
    """A FakeEngine that records each decode step's positions and whether a sampled row was left out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.positions: list[list[int]] = []
        self.second_decode = threading.Event()  # set while the second decode step is being dispatched
        self.inactive = threading.Event()  # set once a sampled step had an inactive row

    def dispatch_decode(self, *, batch):
        self.positions.append(list(batch.positions))
        if len(self.positions) == 2:
            self.second_decode.set()
        return super().dispatch_decode(batch=batch)

    def sample(self, pending, *, sampling, clear_penalties, active):
        if not all(active):
            self.inactive.set()
        return super().sample(pending, sampling=sampling, clear_penalties=clear_penalties, active=active)


def test_a_mask_later_than_mask_wait_leaves_the_row_out_and_it_is_computed_again(loops):
    fake = engine(cls=Watched)
    loop = EngineLoop(fake, mask_wait=0.05)
    seq, sink = make("c", [10], 2, constrained=True, masks={0: mask(50)})
    loop.submit(seq)
    start(loops, loop)
    assert fake.inactive.wait(WAIT), "the step for token 1 ran without its mask"
    assert sink.tokens == [50] and not sink.done.is_set()
    loop.add_mask("c", 1, mask(7))
    assert sink.wait().finish == Finish.LENGTH and sink.tokens == [50, 7]
    loop.stop()
    assert fake.positions == [[0], [1], [1]], "position 1 computed again once its mask came"
    assert loop.steps["decode"] == 3 and loop.steps["computed_tokens"] == 2, "the missed row does not count"


def test_a_mask_arriving_while_its_step_runs_is_used_in_that_step(loops):
    fake = engine(cls=Watched)
    loop = EngineLoop(fake, mask_wait=WAIT)
    seq, sink = make("c", [10], 2, constrained=True, masks={0: mask(50)})
    loop.submit(seq)
    start(loops, loop)
    assert fake.second_decode.wait(WAIT)
    loop.add_mask("c", 1, mask(7))
    assert sink.wait().finish == Finish.LENGTH and sink.tokens == [50, 7]
    loop.stop()
    assert fake.positions == [[0], [1]] and not fake.inactive.is_set()


def test_forced_tokens_are_appended_and_computed_in_one_chunk(loops):
    """Forced [300, 301] from output step 1: after the sampled 11 they are appended (flagged forced), then
    computed with 11 in one 3-token chunk whose sample is 302; a stop id in a forced run ends it there."""
    fake = engine()
    loop = EngineLoop(fake)
    seq, sink = make("f", [10], 6)
    stop, stop_sink = make("g", [40], 6, stop=[5])
    loop.submit(seq)
    loop.add_forced("f", 1, [300, 301])
    loop.submit(stop)
    loop.add_forced("g", 1, [400, 5, 401])
    start(loops, loop)
    assert sink.wait().finish == Finish.LENGTH and sink.tokens == [11, 300, 301, 302, 303, 304]
    assert [(e.token_ids, e.forced) for e in sink.events[:3]] == [([11], [False]), ([300, 301], [True, True]),
                                                                   ([302], [False])]
    last = stop_sink.wait()
    assert last.finish == Finish.STOP and stop_sink.tokens == [41, 400, 5] and last.forced == [True, True]
    loop.stop()
    assert fake.chunks == [(0, 1, 3)], "f's forced run with its last sampled token; g's never computed"
    assert loop.steps["prompt_tokens"] == fake.prompt_tokens == 2, "forced tokens are output, not prompt"


class FailingDecode(FakeEngine):
    """A FakeEngine whose decode step fails (a lost device)."""

    error = RuntimeError("device lost")

    def dispatch_decode(self, *, batch):
        raise self.error


def test_a_failed_step_ends_every_sequence_with_engine_failed_calls_on_fatal_once_and_stops(loops):
    fake = engine(num_slots=1, cls=FailingDecode)
    fatal, calls = threading.Event(), []

    def on_fatal(exc):
        calls.append((exc, threading.current_thread()))
        fatal.set()

    loop = EngineLoop(fake, on_fatal=on_fatal)
    seqs, sinks = zip(*(make(f"s{i}", [10 * i + 1, 10 * i + 2], 5) for i in range(3)), strict=True)
    for seq in seqs:
        loop.submit(seq)  # s0 takes the slot; its prompt chunk works, its first decode step fails
    start(loops, loop)
    assert fatal.wait(WAIT)
    for sink in sinks:
        last = sink.wait()
        assert (last.finish, last.failure, last.error) == (Finish.ABORT, Failure.ENGINE_FAILED, ENGINE_FAILED)
        assert last.token_ids == []
    assert [s.tokens for s in sinks] == [[3], [], []]
    (exc, thread), = calls
    assert exc is FailingDecode.error and loop.failed is exc
    assert thread is not threading.current_thread(), "on_fatal runs on the loop thread"
    thread.join(WAIT)
    assert not thread.is_alive(), "the loop stopped"
    assert loop.load()[0] == 0 and len(calls) == 1


def test_after_a_failed_step_no_ended_sequence_counts_as_waiting(loops):
    fatal = threading.Event()
    loop = EngineLoop(engine(num_slots=1, cls=FailingDecode), on_fatal=lambda exc: fatal.set())
    sinks = []
    for i in range(3):
        seq, sink = make(f"s{i}", [10 * i + 1, 10 * i + 2], 5)
        loop.submit(seq)
        sinks.append(sink)
    start(loops, loop)
    assert fatal.wait(WAIT) and all(s.wait().failure == Failure.ENGINE_FAILED for s in sinks)
    assert loop.load()[:2] == (0, 0)


def test_a_sequence_of_the_fault_salt_fails_its_step_before_the_engine_runs_it(loops):
    fake = engine()
    fatal = []
    loop = EngineLoop(fake, fault_salt="boom", on_fatal=fatal.append)
    ok, ok_sink = make("ok", [1, 2], 2)
    loop.submit(ok)
    start(loops, loop)
    assert ok_sink.wait().finish == Finish.LENGTH and ok_sink.tokens == [3, 4], "other salts run normally"
    fake.gate.clear()  # `long` cannot end before `bad` is in
    long_, long_sink = make("long", [50], 40)
    bad, bad_sink = make("bad", [60, 61], 2, cache_salt="boom")
    loop.submit(long_)
    loop.submit(bad)
    fake.gate.set()
    assert bad_sink.wait().failure == Failure.ENGINE_FAILED and bad_sink.tokens == []
    assert long_sink.wait().failure == Failure.ENGINE_FAILED and long_sink.last.error == ENGINE_FAILED
    assert wait_idle(loop, WAIT)
    loop.stop()
    assert len(fatal) == 1 and isinstance(fatal[0], RuntimeError) and FAULT_ENV in str(fatal[0])
    assert fake.chunks == [(0, 0, 2)], "bad's prompt never reached the engine"


def test_an_idle_loop_stores_what_the_background_compiled(loops):
    """With no work and an empty inbox the loop stores the background's compiled programs into the executable
    cache one at a time (`store_deferred`) until none is left, then waits for commands as before."""
    class Pending(FakeEngine):
        left = 3

        def store_deferred(self, limit=1):
            n = min(self.left, 1 if limit is not None else self.left)
            self.left -= n
            return n

    fake = engine(cls=Pending)
    start(loops, EngineLoop(fake))
    deadline = time.monotonic() + 5
    while fake.left and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.left == 0


# ----- async scheduling: decode steps dispatched from the previous step's tokens on the device --------------------
def test_async_scheduling_dispatches_ahead_and_drops_what_follows_a_stop(loops):
    """Two rows decoding, one ending at a stop id while a step dispatched ahead carries it: the same tokens and
    endings as without async scheduling, the token after the stop never published, and most decode steps were
    dispatched ahead (the fake counts them in calls["ahead"] and in "decode")."""
    outputs = []
    for async_on in (False, True):
        fake = engine()
        loop = start(loops, EngineLoop(fake, async_scheduling=async_on))
        a, a_sink = make("a", [1, 2], 20, stop=[9])
        b, b_sink = make("b", [40, 41], 30)
        loop.submit(a)
        loop.submit(b)
        a_sink.wait(), b_sink.wait()
        outputs.append(([e.token_ids for e in a_sink.events], a_sink.last.finish, b_sink.tokens, b_sink.last.finish))
        if async_on:
            assert fake.calls.get("ahead", 0) >= 20 and loop.steps["ahead"] == fake.calls["ahead"]
            assert loop.steps["decode"] == fake.calls["decode"] and loop.steps["ahead"] < loop.steps["decode"]
        else:
            assert "ahead" not in fake.calls
    assert outputs[0] == outputs[1]
    assert outputs[1][0][-1] == [9] and outputs[1][1] == Finish.STOP and len(outputs[1][2]) == 30


def test_async_scheduling_admits_a_request_that_arrives_while_steps_go_ahead(loops):
    """A request submitted while a long one decodes ahead: the chain of steps ahead stops, the scheduler admits
    it (its prompt computed in chunks beside the decode row), and both get the fake's arithmetic."""
    fake = engine()
    loop = start(loops, EngineLoop(fake, async_scheduling=True))
    b_sink_box = []

    def on_event(event, sink):
        if len(sink.tokens) == 10:  # on the loop thread, while steps go ahead
            b, b_sink = make("b", range(100, 110), 5)
            loop.submit(b)
            b_sink_box.append(b_sink)

    a, a_sink = make("a", [1, 2], 40, on_event=on_event)
    loop.submit(a)
    assert a_sink.wait().finish == Finish.LENGTH and a_sink.tokens == list(range(3, 43))
    b_sink = b_sink_box[0]
    assert b_sink.wait().finish == Finish.LENGTH and b_sink.tokens == [110, 111, 112, 113, 114]
    assert fake.calls["ahead"] > 0 and fake.calls["compute"] >= 3


def test_async_scheduling_goes_on_while_requests_wait_for_a_busy_slot(loops):
    """Two slots busy and a third request queued: the running rows still go ahead (a planned step could not admit
    it), the queued one is admitted when a slot frees, and every output follows the fake's arithmetic."""
    fake = engine()
    loop = start(loops, EngineLoop(fake, async_scheduling=True))
    seqs = [make(rid, [base, base + 1], 30) for rid, base in (("a", 1), ("b", 100), ("c", 200))]
    for seq, _ in seqs:
        loop.submit(seq)
    for (seq, sink), base in zip(seqs, (1, 100, 200)):
        assert sink.wait().finish == Finish.LENGTH and sink.tokens == list(range(base + 2, base + 32))
    assert loop.steps["ahead"] >= 2 * 20, "a and b went ahead while c waited, and c once alone"


def test_async_scheduling_ends_an_aborted_row_and_goes_on_without_an_engine_that_refuses(loops):
    """An abort while steps go ahead ends the row with ABORT (nothing after it); an engine that cannot dispatch
    ahead (no decode program for the rows) decodes as without async scheduling."""
    fake = engine()
    loop = start(loops, EngineLoop(fake, async_scheduling=True))

    def on_event(event, sink):
        if len(sink.tokens) == 8:
            loop.abort("a")

    a, a_sink = make("a", [1, 2], 40, on_event=on_event)
    loop.submit(a)
    assert a_sink.wait().finish == Finish.ABORT
    assert a_sink.tokens == list(range(3, 11)), "the token the step ahead sampled after the abort is dropped"
    refusing = engine()
    refusing.refuse_ahead = True
    loop = start(loops, EngineLoop(refusing, async_scheduling=True))
    b, b_sink = make("b", [1, 2], 12)
    loop.submit(b)
    assert b_sink.wait().finish == Finish.LENGTH and b_sink.tokens == list(range(3, 15))
    assert "ahead" not in refusing.calls and loop.steps["ahead"] == 0


def test_async_scheduling_keeps_constrained_rows_and_token_limits_planned(loops):
    """A constrained row (its mask follows the token it has not seen) never goes ahead; a row one token from its
    limit is not carried past it: no decode step computes a position its sequence never reaches."""
    fake = engine()
    loop = start(loops, EngineLoop(fake, async_scheduling=True))
    c, c_sink = make("c", [1, 2], 4, constrained=True, masks={0: mask(3)})

    def on_event(event, sink):
        if event.finish == Finish.NONE:
            loop.add_mask("c", len(sink.tokens), mask(sink.tokens[-1] + 1))

    c_sink.on_event = on_event
    loop.submit(c)
    assert c_sink.wait().finish == Finish.LENGTH and c_sink.tokens == [3, 4, 5, 6]
    assert "ahead" not in fake.calls
    before = fake.calls["decode"]
    d, d_sink = make("d", [20, 21], 5)  # (not c's prompt, whose KV a prefix hit would reuse)
    loop.submit(d)
    assert d_sink.wait().finish == Finish.LENGTH and d_sink.tokens == [22, 23, 24, 25, 26]
    assert fake.calls["decode"] - before == 4, "4 decode steps after the prompt's token, none past the fifth"
    assert fake.calls["ahead"] == 3


def test_async_scheduling_gives_up_one_ring_position_of_prefix_reuse_without_drafts():
    """A step ahead for a row that then ended wrote one position past the slot's end, as a rejected draft does:
    without drafts the prefix cache's tolerance shrinks by one (with drafts it already gave up more); with no
    slack at all async scheduling stays off."""
    def loop_for(slack: int, drafts: int, async_on: bool) -> EngineLoop:
        fake = FakeEngine(FakeEngineConfig(num_slots=2, max_model_len=64, chunk=4, prefix_slack=slack,
                                           max_draft_tokens=drafts), vocab=VOCAB)
        return EngineLoop(fake, async_scheduling=async_on)

    assert loop_for(4, 0, False).scheduler.cache.slack == 4
    assert loop_for(4, 0, True).scheduler.cache.slack == 3 and loop_for(4, 0, True).async_scheduling
    assert loop_for(4, 3, True).scheduler.cache.slack == 4 - 3
    off = loop_for(0, 0, True)
    assert not off.async_scheduling and off.scheduler.cache.slack == 0


def test_async_scheduling_flag_is_on_off_the_cpu_by_default_and_as_told_otherwise():
    import argparse

    from gemma_serve.cli import build_parser
    from model_worker.server.main import async_scheduling

    assert build_parser().parse_args(["worker"]).async_scheduling == "auto"
    assert build_parser().parse_args(["up", "--async-scheduling"]).async_scheduling == "on", "vLLM's bare flag"
    for flag, platform, expected in (("auto", "cpu", False), ("auto", "tpu", True), ("auto", "gpu", True),
                                     ("on", "cpu", True), ("off", "tpu", False)):
        assert async_scheduling(argparse.Namespace(async_scheduling=flag), platform) is expected, (flag, platform)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--async-scheduling", "sometimes"])
