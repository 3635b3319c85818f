"""The plain-Python scheduler: admission, one prefill chunk per iteration, finishing, abort, slot reuse."""

from __future__ import annotations

import pytest

from model_worker.scheduler import Finish, SamplingSpec, Scheduler, Sequence


def seq(rid, prompt_len=3, max_tokens=4, stop=()):
    return Sequence(rid, list(range(1, prompt_len + 1)), SamplingSpec(), max_tokens, frozenset(stop), lambda ev: None)


def test_admission_is_fifo_and_bounded_by_slots():
    s = Scheduler(num_slots=2, max_model_len=100)
    for r in "abc":
        s.add(seq(r))
    work = s.schedule()
    assert sorted(x.request_id for x in s.running.values()) == ["a", "b"]
    assert [x.request_id for x in s.waiting] == ["c"]
    assert work.prefill.request_id == "a" and work.decode == []


def test_oldest_pending_prompt_is_prefilled_first_and_decoders_keep_running():
    s = Scheduler(num_slots=3, max_model_len=100)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    s.schedule()
    a.num_computed = 3
    s.append_token(a, 9)
    work = s.schedule()
    assert work.prefill is b and work.decode == [a]


def test_finish_reasons_and_slot_reuse():
    s = Scheduler(num_slots=1, max_model_len=6)
    a = seq("a", prompt_len=3, max_tokens=10, stop=[7])
    s.add(a)
    s.add(seq("b"))
    s.schedule()
    a.num_computed = 3
    assert s.append_token(a, 5) == Finish.NONE
    assert s.append_token(a, 7) == Finish.STOP
    s.finish(a)
    assert s.schedule().prefill.request_id == "b", "the freed slot is reused at the next iteration"
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
    assert s.abort("a") is a and not s.running and s.free_slots == [0]
    assert s.abort("zzz") is None
    assert not s.has_work()


def test_duplicate_ids_rejected():
    s = Scheduler(num_slots=1, max_model_len=100)
    s.add(seq("a"))
    with pytest.raises(KeyError):
        s.add(seq("a"))
