"""The plain-Python scheduler: admission, one prefill chunk per iteration, finishing, abort, slot reuse."""

from __future__ import annotations

import numpy as np
import pytest

from model_worker.serving.scheduler import Scheduler
from model_worker.serving.sequence import Finish, SamplingSpec, Sequence


def seq(rid, prompt_len=3, max_tokens=4, stop=(), first=1):
    """A sequence with prompt first..first+prompt_len-1 (sequences with the same `first` share their prompt)."""
    return Sequence(rid, list(range(first, first + prompt_len)), SamplingSpec(), max_tokens, frozenset(stop),
                    lambda ev: None)


def test_admission_is_fifo_and_bounded_by_slots():
    s = Scheduler(num_slots=2, max_model_len=100)
    for r in "abc":
        s.add(seq(r))
    work = s.schedule()
    assert sorted(x.request_id for x in s.running.values()) == ["a", "b"]
    assert [x.request_id for x in s.waiting] == ["c"]
    assert work.compute.request_id == "a" and work.decode == []


def test_oldest_pending_prompt_is_prefilled_first_and_decoders_keep_running():
    s = Scheduler(num_slots=3, max_model_len=100)
    a, b = seq("a"), seq("b", first=50)
    s.add(a)
    s.add(b)
    s.schedule()
    a.num_computed = 3
    s.append_token(a, 9)  # a's prompt is computed and its first token sampled: one pending token
    work = s.schedule()
    assert work.compute is b and work.decode == [a]


def test_finish_reasons_and_slot_reuse():
    s = Scheduler(num_slots=1, max_model_len=6)
    a = seq("a", prompt_len=3, max_tokens=10, stop=[7])
    b = seq("b")
    s.add(a)
    s.add(b)
    s.schedule()
    a.num_computed = 3
    assert s.append_token(a, 5) == Finish.NONE
    assert s.append_token(a, 7) == Finish.STOP
    s.finish(a)
    work = s.schedule()
    assert b.slot == 0 and work.decode == [b], "the freed slot is reused at the next iteration"
    assert b.cached_tokens == 2, "b's prompt [1, 2, 3] was a's: all but its last token is reused in place"
    c = seq("c", prompt_len=4, max_tokens=10)
    s2 = Scheduler(num_slots=1, max_model_len=6)
    s2.add(c)
    s2.schedule()
    assert s2.append_token(c, 1) == Finish.NONE
    assert s2.append_token(c, 1) == Finish.LENGTH, "prompt + output reached max_model_len"


def test_abort_waiting_and_running():
    s = Scheduler(num_slots=1, max_model_len=100)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    s.schedule()
    assert s.abort("b") is b and b.finish == Finish.ABORT and not s.waiting
    assert s.abort("a") is a and not s.running and s.cache.has_free()
    assert s.abort("zzz") is None
    assert not s.has_work()


def test_duplicate_ids_rejected():
    s = Scheduler(num_slots=1, max_model_len=100)
    s.add(seq("a"))
    with pytest.raises(KeyError):
        s.add(seq("a"))


def test_constrained_sequence_mask_timing_never_holds_others():
    s = Scheduler(num_slots=2, max_model_len=100)
    a, b = seq("a"), seq("b", first=50)
    a.constrained = True
    s.add(a)
    s.add(b)
    s.schedule()
    for x in (a, b):
        x.num_computed = 3
        s.append_token(x, 9)
    # a joins the step before its mask (needed only at sampling); once it missed a step, it waits for the mask.
    assert s.schedule().decode == [a, b]
    a.missed = True
    assert s.schedule().decode == [b]
    a.masks[1] = np.ones(4, np.uint32)
    assert s.schedule().decode == [a, b]


def test_forced_tokens_make_a_compute_step_and_can_end_the_sequence():
    s = Scheduler(num_slots=1, max_model_len=100)
    a = seq("a", max_tokens=4)
    s.add(a)
    s.schedule()
    a.num_computed = 3
    s.append_token(a, 9)
    a.forced[1] = [5, 6, 7, 8]
    assert s.apply_forced(a) == [5, 6, 7]  # max_tokens 4 ends it after the third forced token
    assert a.finish == Finish.LENGTH and a.output == [9, 5, 6, 7]


def test_fork_waits_for_the_parent_prompt_then_is_copied():
    s = Scheduler(num_slots=2, max_model_len=100)
    parent, child = seq("p", prompt_len=5), seq("c", prompt_len=5)
    child.fork_of = "p"
    s.add(parent)
    s.add(child)
    work = s.schedule()
    assert work.compute is parent and work.copies == [] and child not in work.decode
    parent.num_computed = 5
    s.append_token(parent, 9)
    work = s.schedule()
    assert work.copies == [(parent.slot, child.slot)] and child.num_computed == 4


def _run(s, seq_, upto: int):
    """Pretend the engine computed the sequence's prompt and produced tokens until `upto` outputs."""
    seq_.num_computed = len(seq_.tokens)
    while len(seq_.output) < upto:
        s.append_token(seq_, 50 + len(seq_.output))
        seq_.num_computed = len(seq_.tokens) - 1


def test_prefix_reuse_takes_over_a_finished_conversation():
    s = Scheduler(num_slots=2, max_model_len=1000, slack=4)
    turn1 = Sequence("t1", list(range(1, 41)), SamplingSpec(), 5, frozenset(), lambda ev: None)
    s.add(turn1)
    s.schedule()
    _run(s, turn1, 5)
    slot = turn1.slot
    s.finish(turn1)
    history = turn1.tokens[: turn1.num_computed]
    # Next turn: the whole previous turn (prompt + answer) plus new tokens.
    turn2 = Sequence("t2", turn1.tokens + [7, 8, 9], SamplingSpec(), 5, frozenset(), lambda ev: None)
    s.add(turn2)
    work = s.schedule()
    assert work.copies == [] and turn2.slot == slot
    assert turn2.cached_tokens == len(history) and turn2.pending == len(turn2.prompt) - len(history)


def test_divergence_beyond_the_slack_is_not_reused():
    s = Scheduler(num_slots=4, max_model_len=1000, slack=4)  # 4 slots: room for one pinned snapshot
    a = Sequence("a", list(range(1, 41)), SamplingSpec(), 30, frozenset(), lambda ev: None)
    s.add(a)
    s.schedule()
    _run(s, a, 30)
    s.finish(a)
    # Shares 40 prompt tokens, but the slot's ring has moved 29 positions past them (> slack + 1).
    b = Sequence("b", list(range(1, 41)) + [999], SamplingSpec(), 5, frozenset(), lambda ev: None)
    s.add(b)
    s.schedule()
    assert b.cached_tokens == 0 and b.snapshot_at == 40


def test_running_or_pinned_prefix_is_copied_not_taken():
    s = Scheduler(num_slots=3, max_model_len=1000, slack=4)
    s.cache.pin(2, list(range(1, 33)))
    b = Sequence("b", list(range(1, 33)) + [5, 6], SamplingSpec(), 5, frozenset(), lambda ev: None)
    s.add(b)
    work = s.schedule()
    assert work.copies == [(2, b.slot)] and b.slot != 2 and b.cached_tokens == 32
    assert s.cache.entries[2].pinned


def test_prefix_reuse_stays_within_a_cache_salt():
    """A prompt reuses only KV computed under its own cache_salt: another tenant's identical prompt computes it
    again (so its cached_tokens reveal nothing), and snapshots keep the salt they were computed under."""
    s = Scheduler(num_slots=3, max_model_len=1000, slack=4)
    a = Sequence("a", list(range(1, 41)), SamplingSpec(), 1, frozenset(), lambda ev: None, cache_salt="tenant-a")
    s.add(a)
    s.schedule()
    _run(s, a, 1)
    s.finish(a)
    for rid, salt, cached in [("b", "tenant-b", 0), ("c", "", 0), ("d", "tenant-a", 40)]:
        seq_ = Sequence(rid, list(range(1, 41)) + [7], SamplingSpec(), 1, frozenset(), lambda ev: None,
                        cache_salt=salt)
        s.add(seq_)
        s.schedule()
        assert seq_.cached_tokens == cached, (rid, seq_.cached_tokens)
        s.abort(rid)
        s.schedule()
    s.cache.pin(2, list(range(1, 33)), salt="tenant-b")
    e = Sequence("e", list(range(1, 33)) + [5], SamplingSpec(), 1, frozenset(), lambda ev: None, cache_salt="x")
    s.add(e)
    assert s.schedule().copies == [] and e.cached_tokens == 0


def test_a_prompt_in_flight_is_waited_for_then_copied_and_a_gone_leader_is_survived():
    """b has a's prompt while a computes it: b waits (in its own slot, running nothing) and copies a's slot once a
    has computed it, recomputing only its last token. The same salt only. c waits for a leader that is aborted
    half way: it takes what the leader's slot holds and computes the rest."""
    s = Scheduler(num_slots=4, max_model_len=100, slack=4)
    a, b, c = seq("a", prompt_len=10), seq("b", prompt_len=10), seq("c", prompt_len=12, first=50)
    other = Sequence("o", list(range(1, 11)), SamplingSpec(), 4, frozenset(), lambda ev: None, cache_salt="x")
    for x in (a, b, other):
        s.add(x)
    work = s.schedule()
    assert b.leader is a and b.share == 9 and other.leader is None
    assert work.compute is a and b not in work.decode and work.copies == []
    a.num_computed = 10
    s.append_token(a, 99)
    work = s.schedule()
    assert work.copies == [(a.slot, b.slot)] and b.num_computed == b.cached_tokens == 9 and b.leader is None
    assert work.decode == sorted([a, b], key=lambda x: x.slot) and s.reused_tokens == 9
    s.abort("o")
    leader = seq("l", prompt_len=12, first=50)
    s.add(leader)
    s.schedule()
    s.add(c)
    s.schedule()
    assert c.leader is leader
    leader.num_computed = 4  # one chunk computed, then the client goes away
    slot = leader.slot
    s.abort("l")
    work = s.schedule()
    assert c.leader is None and (slot, c.slot) in work.copies and c.cached_tokens == 4
    assert work.compute is c and c.pending == 8


def _turn(s, rid, prompt, session="", ttl=0.0, outputs=2):
    """Admit, 'compute' and finish one request; returns (its sequence, the slot it ran in)."""
    q = Sequence(rid, list(prompt), SamplingSpec(), 8, frozenset(), lambda ev: None, session=session, lease_ttl=ttl)
    s.add(q)
    s.schedule()
    assert q.slot is not None, rid
    _run(s, q, outputs)
    slot = q.slot
    s.finish(q)
    return q, slot


def test_a_session_lease_survives_a_burst_that_evicts_by_lru_and_its_next_turn_reuses_it():
    """With 4 slots (one lease at most), an agent's leased KV outlives a burst of 4 other prompts that would have
    taken its slot under LRU; the session's next turn takes the slot over (cached = its whole last turn); without
    the lease the same burst evicts it."""
    for ttl, survives in ((60.0, True), (0.0, False)):
        s = Scheduler(num_slots=4, max_model_len=1000, slack=4)
        agent, agent_slot = _turn(s, "agent-1", range(1, 41), session="agent", ttl=ttl)
        for i in range(4):
            _turn(s, f"burst-{i}", range(100 * (i + 1), 100 * (i + 1) + 30))
        nxt, nxt_slot = _turn(s, "agent-2", agent.tokens + [7, 8], session="agent", ttl=ttl)
        assert (nxt.cached_tokens == agent.num_computed) is survives, (ttl, nxt.cached_tokens)
        assert (nxt_slot == agent_slot) is survives
        assert s.cache.leased_slots() == (1 if survives else 0)


def test_leases_are_bounded_expire_end_on_release_and_yield_to_a_long_waiter():
    """At most slots // 4 leases (a new one ends the oldest); a lease ends at its ttl and when the session's
    turn releases it; when every free slot is leased, a waiting prompt gets none until it has waited
    `lease_preempt_after` seconds, then takes the oldest lease's slot (counted)."""
    now = [0.0]
    s = Scheduler(num_slots=4, max_model_len=1000, slack=4, lease_preempt_after=5.0)
    s.cache.now = lambda: now[0]
    _turn(s, "a", range(1, 20), session="A", ttl=100.0)
    now[0] = 1.0
    _turn(s, "b", range(30, 50), session="B", ttl=100.0)
    assert [e.lease for e in s.cache.entries if e.lease] == ["B"]  # 4 slots: one lease; A's ended
    now[0] = 200.0
    assert s.cache.leased_slots() == 0  # B expired
    _turn(s, "b2", range(30, 50), session="B", ttl=100.0)
    _turn(s, "b3", range(30, 52), session="B", ttl=100.0)
    assert s.cache.leased_slots() == 1
    _turn(s, "b4", range(30, 53), session="B", ttl=0.0)  # released by its own turn
    assert s.cache.leased_slots() == 0

    s = Scheduler(num_slots=4, max_model_len=1000, slack=4, lease_preempt_after=5.0)
    s.cache.now = lambda: now[0]
    s.cache.max_leases = 4  # every slot leased: only preemption frees one
    for i, name in enumerate("WXYZ"):
        now[0] = 300.0 + i
        _turn(s, name, range(100 * (i + 1), 100 * (i + 1) + 10), session=name, ttl=1000.0)
    waiter = Sequence("late", list(range(900, 910)), SamplingSpec(), 4, frozenset(), lambda ev: None)
    waiter.arrived_at = 0.0
    s.lease_preempt_after = 1e9  # has not waited long enough
    s.add(waiter)
    s.schedule()
    assert waiter.slot is None and s.cache.preempted == 0
    s.lease_preempt_after = 5.0  # now it has
    s.schedule()
    assert waiter.slot is not None and s.cache.preempted == 1
    assert sorted(e.lease for e in s.cache.entries if e.lease) == ["X", "Y", "Z"]  # the oldest, W, gave way


def test_admits_nothing_only_while_nothing_could_be_placed_or_refused():
    """What async scheduling asks before a step goes ahead: nothing waits; or a queued sequence finds every slot
    running and has no TTFT target (with one, a planned step may refuse it as unreachable)."""
    s = Scheduler(num_slots=1, max_model_len=100)
    assert s.admits_nothing()
    s.add(seq("a"))
    assert not s.admits_nothing(), "a free slot: the next planned step admits it"
    s.schedule()
    s.add(seq("b"))
    assert s.admits_nothing(), "the one slot runs a: b cannot be placed yet"
    late = seq("c")
    late.slo_ttft_s = 1.0
    s.add(late)
    assert not s.admits_nothing(), "c has a TTFT target: a planned step may refuse it"
