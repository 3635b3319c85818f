"""`PrefixCache` on its own (model_worker/serving/prefix_cache.py), with the `LiveSlot`s a scheduler would pass:
which slot a new prompt gets and how many of its tokens are reused (the longest exact prefix of its own
`cache_salt`, under the sliding rings' slack rule), free slots before LRU eviction, what `release` records,
pinned snapshots, prompts in flight (leaders), session leases (bounded, expiring, preempted), `best_source`,
and the counters. Plain Python: no engine, no scheduler."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_worker.serving.prefix_cache import LiveSlot, PrefixCache, common_prefix

H = list(range(100, 120))  # a finished request's history: 20 tokens none of the other prompts below contain


def hold(cache: PrefixCache, salt: str = "", session: str = "") -> int:
    """Give a fresh request a slot without looking for a prefix (as the scheduler does for a fork); the slot
    is busy until released."""
    placement = cache.place([0], salt, {}, reuse=False, session=session)
    assert placement is not None and placement.copy_from is None and placement.cached == 0
    return placement.slot


def run(cache: PrefixCache, history: list[int], salt: str = "", session: str = "", ttl: float = 0.0) -> int:
    """A request that runs to its end in the slot it is given: the slot then holds `history` under `salt`."""
    slot = hold(cache, salt, session)
    cache.release(slot, history, session, ttl)
    return slot


def idle(cache: PrefixCache) -> dict[int, LiveSlot]:
    """The live view of the busy slots, as if none had computed anything yet."""
    return {i: LiveSlot([]) for i, e in enumerate(cache.entries) if e.busy}


def exact_reuse(history: list[int], prompt: list[int], slack: int) -> int:
    """The docstrings' rule, computed independently of the module: the common prefix (at most all but the
    prompt's last token, which must be computed to sample from it) is reusable iff the split lies at most
    slack + 1 positions behind the slot's end."""
    lcp = 0
    while lcp < min(len(history), len(prompt)) and history[lcp] == prompt[lcp]:
        lcp += 1
    lcp = min(lcp, len(prompt) - 1)
    return lcp if len(history) - lcp <= slack + 1 else 0


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([7], [8]) == 0


def test_placement_takes_over_the_finished_slot_with_the_longest_prefix_in_place():
    cache = PrefixCache(4, slack=4, min_share=1000)
    short, long_, other = run(cache, H[:10]), run(cache, H), run(cache, [5, 6, 7])
    assert (short, long_, other) == (0, 1, 2), "each new request takes an empty slot"
    p = cache.place(H + [1, 2], "", {})
    assert (p.slot, p.copy_from, p.cached) == (long_, None, 20)
    assert p.leader is None and p.snapshot_at is None
    assert cache.entries[long_].busy and cache.entries[long_].tokens == []
    assert cache.history(long_, {long_: LiveSlot(H[:3])}) == H[:3], "a busy slot's history is the live one"
    # The same prompt as a slot's whole history reuses all but its last token (it must be computed to sample).
    p = cache.place(H[:10], "", idle(cache))
    assert (p.slot, p.copy_from, p.cached) == (short, None, 9)


@pytest.mark.parametrize("slack", [0, 4])
@pytest.mark.parametrize("behind", [0, 1, 2, 4, 5, 6, 10])
def test_a_split_within_the_slack_of_the_slots_end_is_reused_exactly_and_further_back_not(slack, behind):
    """A prompt that diverges from a 20-token history `behind` positions before its end: the sliding rings
    still hold the right window at the split iff behind <= slack + 1 (`exact_split`); else the prompt starts
    from scratch in another (empty) slot and the slot keeps its history."""
    cache = PrefixCache(2, slack=slack, min_share=1000)
    slot = run(cache, H)
    split = len(H) - behind
    assert cache.exact_split(len(H), split) is (behind <= slack + 1)
    p = cache.place(H[:split] + [1, 2], "", {})
    if behind <= slack + 1:
        assert (p.slot, p.copy_from, p.cached) == (slot, None, split)
    else:
        assert (p.slot, p.copy_from, p.cached) == (1 - slot, None, 0)
        assert cache.entries[slot].tokens == H


def test_reuse_never_crosses_salts_and_eviction_ignores_them():
    cache = PrefixCache(3, slack=4, min_share=1000)
    a = run(cache, H, salt="a")
    b = run(cache, H[:10], salt="b")
    p = cache.place(H + [1], "b", {})
    assert (p.slot, p.copy_from, p.cached) == (b, None, 10), "b's shorter prefix, never a's longer one"
    cache.release(b, H[:10])
    p = cache.place(H + [1], "c", {})
    assert (p.slot, p.cached) == (2, 0), "no slot of salt c: an empty slot"
    cache.release(p.slot, [1, 2, 3])
    assert cache.best_source(H + [1], "a", -1, {}) == (a, 20)
    assert cache.best_source(H + [1], "", -1, {}) == (None, 0)
    # Every slot holds KV now: a prompt of salt "c" evicts the least recently used one, a's.
    p = cache.place([50, 51], "c", {})
    assert (p.slot, p.cached) == (a, 0)
    cache.release(a, [50, 51])
    p = cache.place(H + [1], "a", {})
    assert p.cached == 0, "the slot's KV now belongs to salt c"


def test_free_slots_are_used_before_any_is_evicted_then_the_least_recently_used_goes_first():
    cache = PrefixCache(3, slack=4, min_share=1000)
    for slot in range(3):
        assert hold(cache) == slot
    assert not cache.has_free()
    assert cache.place([9, 9], "", idle(cache)) is None, "every slot is in use: wait"
    cache.release(0, [10, 11])
    cache.release(2, [30, 31])
    cache.release(1, [])  # a request that ended before computing anything: an empty slot again
    assert cache.has_free() and cache.cached_slots() == 2
    assert hold(cache) == 1, "the empty slot, though the others were released earlier"
    cache.release(1, [20, 21])
    order = []
    for i in range(6):  # unrelated prompts: LRU eviction, 0 (released first) then 2 then 1, round and round
        slot = hold(cache)
        order.append(slot)
        cache.release(slot, [200 + i, 0])
    assert order == [0, 2, 1, 0, 2, 1]
    # Reusing a slot makes it the most recently used.
    p = cache.place([203, 0, 7], "", {})  # slot 0 holds [203, 0]
    assert (p.slot, p.cached) == (0, 2)
    cache.release(0, [203, 0, 7])
    assert [hold(cache), hold(cache), hold(cache)] == [2, 1, 0]


def test_release_records_the_history_and_cached_slots_counts_what_a_new_prompt_could_reuse():
    cache = PrefixCache(3, slack=4, min_share=1000)
    slot = hold(cache)
    assert cache.cached_slots() == 0, "a busy slot is not a cached one"
    cache.release(slot, (1, 2, 3))
    assert cache.entries[slot].tokens == [1, 2, 3] and not cache.entries[slot].busy
    assert cache.history(slot, {}) == [1, 2, 3] and cache.cached_slots() == 1
    cache.pin(2, [5, 6])
    assert cache.cached_slots() == 2


def test_a_running_slots_prefix_is_copied_into_another_slot():
    cache = PrefixCache(3, slack=4, min_share=1000)
    running = hold(cache)
    live = {running: LiveSlot(H)}  # it has computed H and decodes (no prompt of its own left to compute)
    p = cache.place(H + [1], "", live)
    assert (p.copy_from, p.cached) == (running, 20) and p.slot not in (running, None) and p.leader is None
    live[p.slot] = LiveSlot([])
    assert cache.best_source(H + [1], "", p.slot, live) == (running, 20)
    assert cache.best_source(H + [1], "", running, live) == (None, 0), "its own slot is no source"


def test_a_prompt_in_flight_is_waited_for_when_it_shares_enough():
    """A prompt sharing more with a prompt being computed than with any slot's KV waits for that leader
    (placed with nothing cached): when the shared part is all but its last token, or at least `min_share`
    tokens more than it could reuse now; never across salts. Such a placement is a query, not a hit."""
    prompt = list(range(300, 340))
    cache = PrefixCache(6, slack=4, min_share=32)
    leader = hold(cache)
    live = {leader: LiveSlot(prompt[:4], prompt=prompt)}  # 4 of its 40 prompt tokens computed so far
    p = cache.place(prompt, "", live)
    assert (p.leader, p.share, p.cached, p.copy_from) == (leader, 39, 0, None) and p.slot != leader
    assert (cache.queries, cache.hits) == (2, 0)
    live[p.slot] = LiveSlot([])  # a follower computes no prompt of its own
    p = cache.place(prompt[:37] + [1, 2], "", live)
    assert (p.leader, p.share) == (leader, 37), "37 - 4 >= min_share"
    live[p.slot] = LiveSlot([])
    p = cache.place(prompt[:20] + [1, 2], "", live)
    assert p.leader is None and (p.copy_from, p.cached) == (leader, 4), "20 - 4 < min_share, not all but one"
    live[p.slot] = LiveSlot(prompt[:4])
    p = cache.place(prompt, "x", live)
    assert p.leader is None and (p.copy_from, p.cached) == (None, 0), "another salt's prompt leads no one"
    live[p.slot] = LiveSlot([])
    # Once the leader has computed its prompt, its slot is the source a follower copies.
    live[leader] = LiveSlot(prompt)
    assert cache.best_source(prompt, "", 1, live) == (leader, 39)


def test_a_shared_prefix_the_rings_cannot_serve_asks_for_a_snapshot_which_is_then_copied_and_evicted_last():
    cache = PrefixCache(4, slack=4, max_snapshots=1, min_share=8)
    long_ = run(cache, H + list(range(1, 21)))  # 40 tokens: a split at 12 is 28 behind its end
    p = cache.place(H[:12] + [7], "", {})
    assert (p.cached, p.snapshot_at) == (0, 12) and p.slot != long_
    assert cache.place(H[:6] + [7], "", idle(cache)).snapshot_at is None, "6 shared tokens < min_share"
    computing = p.slot
    snap = cache.snapshot_slot(computing)
    assert snap not in (long_, computing) and not cache.entries[snap].tokens, "an empty slot"
    cache.pin(snap, H[:12])
    assert cache.snapshot_slot(computing) == snap, "max_snapshots reached: the oldest snapshot is replaced"
    for slot in idle(cache):  # both requests end (their KV unrelated to what follows)
        cache.release(slot, [1, 2, 3] if slot == computing else [])
    # A prompt sharing the snapshot copies it: a pinned slot is never taken over in place.
    p = cache.place(H[:12] + [9, 9], "", {})
    assert (p.copy_from, p.cached) == (snap, 12) and p.slot != snap and cache.entries[snap].pinned
    cache.release(p.slot, [4, 5, 6])
    # Unrelated prompts evict the unpinned slots (LRU) first, the snapshot only when nothing else is free.
    evicted = [hold(cache) for _ in range(4)]
    assert evicted[-1] == snap and sorted(evicted[:3]) == sorted(set(range(4)) - {snap})
    assert not cache.entries[snap].pinned and cache.cached_slots() == 0


def test_the_oldest_of_max_snapshots_is_the_one_replaced():
    cache = PrefixCache(5, slack=4, max_snapshots=2, min_share=8)
    source = hold(cache)
    first = cache.snapshot_slot(source)
    cache.pin(first, [1, 2, 3])
    second = cache.snapshot_slot(source)
    assert second not in (source, first)
    cache.pin(second, [4, 5, 6])
    assert cache.snapshot_slot(source) == first
    cache.pin(first, [7, 8, 9])
    assert cache.snapshot_slot(source) == second


def test_a_leased_slot_is_copied_from_but_neither_taken_over_nor_evicted_by_others():
    now = [0.0]
    cache = PrefixCache(4, slack=4, min_share=1000, clock=lambda: now[0])
    leased = run(cache, H, session="s", ttl=30.0)
    assert cache.leased_slots() == 1
    p = cache.place(H + [1], "", {}, session="t")
    assert (p.copy_from, p.cached) == (leased, 20) and p.slot != leased
    cache.release(p.slot, [1, 2])
    for i in range(6):  # unrelated requests cycle through the three other slots
        slot = hold(cache)
        assert slot != leased
        cache.release(slot, [200 + i])
    p = cache.place(H + [1], "", {}, session="s")  # the session's next turn takes its slot over in place
    assert (p.slot, p.copy_from, p.cached) == (leased, None, 20)
    assert cache.leased_slots() == 0, "the lease ends when its slot is taken"


def test_at_most_a_quarter_of_the_slots_are_leased_one_per_session_and_leases_expire():
    now = [0.0]
    cache = PrefixCache(8, slack=4, min_share=1000, clock=lambda: now[0])
    assert cache.max_leases == 2
    slots = {}
    for t, session in enumerate("ABC"):
        now[0] = float(t)
        slots[session] = run(cache, [10 * t + 1, 10 * t + 2], session=session, ttl=100.0)
    assert {e.lease for e in cache.entries if e.lease} == {"B", "C"}, "C's lease ended the oldest, A's"
    now[0] = 3.0
    b2 = run(cache, [50, 51], session="B", ttl=100.0)
    assert [i for i, e in enumerate(cache.entries) if e.lease == "B"] == [b2], "one lease per session"
    run(cache, [60, 61], session="C", ttl=0.0)
    assert {e.lease for e in cache.entries if e.lease} == {"B"}, "ttl 0 ends the session's lease"
    now[0] = 103.0  # B's lease (from t=3, ttl 100) ends now
    assert cache.leased_slots() == 0
    p = cache.place([50, 51, 52], "", {}, session="other")
    assert (p.slot, p.copy_from, p.cached) == (b2, None, 2), "an expired lease no longer protects its slot"
    small = PrefixCache(3, slack=4, clock=lambda: now[0])
    run(small, [1, 2], session="A", ttl=100.0)
    assert small.leased_slots() == 0, "fewer than 4 slots: no leases"


def test_a_prompt_that_waited_long_enough_preempts_the_oldest_lease():
    now = [0.0]
    cache = PrefixCache(8, slack=4, min_share=1000, clock=lambda: now[0])
    for t in range(6):
        run(cache, [t])
    now[0] = 1.0
    oldest = run(cache, [70], session="A", ttl=100.0)
    now[0] = 2.0
    newer = run(cache, [80], session="B", ttl=100.0)
    assert sorted(hold(cache) for _ in range(6)) == sorted(set(range(8)) - {oldest, newer})
    assert cache.place([9], "", idle(cache)) is None and cache.preempted == 0, "only leased slots are free"
    assert cache.place([9], "", idle(cache), preempt=True).slot == oldest and cache.preempted == 1
    assert [e.lease for e in cache.entries if e.lease] == ["B"]
    assert cache.place([9], "", idle(cache), preempt=True).slot == newer and cache.preempted == 2
    assert cache.place([9], "", idle(cache), preempt=True) is None and cache.preempted == 2


def test_queries_count_placements_and_hits_count_those_that_reuse_a_prefix():
    cache = PrefixCache(2, slack=4, min_share=1000)
    slot = run(cache, H)
    assert (cache.queries, cache.hits) == (1, 0)
    cache.place(H + [1], "", {})
    assert (cache.queries, cache.hits) == (2, 1)
    cache.place([7, 8], "", idle(cache))
    assert (cache.queries, cache.hits) == (3, 1)
    assert cache.place([7, 8], "", idle(cache)) is None
    assert (cache.queries, cache.hits) == (3, 1), "no slot: no query"
    cache.release(slot, [])
    cache.place(H, "", {}, reuse=False)
    assert (cache.queries, cache.hits) == (4, 1)


KINDS = ("finished", "busy", "pinned", "empty")
SLOTS = st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(["", "x"]),
                           st.lists(st.integers(0, 2), max_size=12)), min_size=1, max_size=5)
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=14)


def build(slots, slack: int) -> tuple[PrefixCache, dict[int, LiveSlot], list[list[int]]]:
    """A cache whose slot i is `slots[i]` = (kind, salt, history): finished, busy (running, computing no
    prompt of its own), a pinned snapshot, or empty (its history ignored). Returns it, the live view, the
    histories."""
    cache = PrefixCache(len(slots), slack=slack, max_snapshots=0, min_share=1000)
    live, histories = {}, []
    for i, (kind, salt, history) in enumerate(slots):
        assert hold(cache, salt) == i
        if kind == "busy":
            live[i] = LiveSlot(history)
        elif kind == "pinned":
            cache.pin(i, history, salt)
        else:
            history = history if kind == "finished" else []
            cache.release(i, history)
        histories.append(history)
    return cache, live, histories


@settings(max_examples=400, deadline=None, derandomize=True)
@given(slots=SLOTS, prompt=PROMPTS, salt=st.sampled_from(["", "x"]), slack=st.integers(0, 4))
def test_place_reuses_exactly_the_longest_exact_prefix_of_its_own_salt(slots, prompt, salt, slack):
    """For random slot contents and prompts: `cached` is the longest common prefix with the source slot's
    history (capped at all but the prompt's last token), the split is exact under the slack rule, the source
    has the prompt's salt, and no same-salt slot offers a longer exact prefix; a finished slot is taken over
    in place, a busy or pinned one copied; a slot is evicted only when no empty one is free; `best_source`
    agrees."""
    cache, live, histories = build(slots, slack)
    exact = [exact_reuse(h, prompt, slack) if s == salt else 0
             for (_, s, _), h in zip(slots, histories, strict=True)]
    best = max(exact)
    source, usable = cache.best_source(prompt, salt, 0, live)
    assert usable == max(exact[1:], default=0) and (source is None) == (usable == 0)
    assert source is None or exact[source] == usable
    free = [i for i, (kind, _, _) in enumerate(slots) if kind != "busy"]
    p = cache.place(prompt, salt, live)
    if p is None:  # only the pinned source itself is free, and it is never overwritten by its own copy
        assert free == [] or (len(free) == 1 and slots[free[0]][0] == "pinned" and exact[free[0]] == best > 0)
        return
    assert p.leader is None and p.snapshot_at is None and p.slot in free
    assert p.cached == best and (cache.queries, cache.hits) == (len(slots) + 1, int(best > 0))
    src = p.slot if p.copy_from is None else p.copy_from
    if best:
        assert slots[src][1] == salt and exact[src] == best
        assert p.cached == min(common_prefix(histories[src], prompt), len(prompt) - 1)
        assert cache.exact_split(len(histories[src]), p.cached)
    if p.copy_from is None and best:
        assert slots[p.slot][0] == "finished", "taken over in place"
    if p.copy_from is not None:
        assert best and slots[p.copy_from][0] in ("busy", "pinned") and p.slot != p.copy_from
        assert all(slots[i][0] != "finished" for i in range(len(slots)) if exact[i] == best), "in place first"
    victim = p.copy_from is not None or not best  # the slot was chosen by eviction: empty if one is free
    if victim and any(not histories[i] for i in free if i != p.copy_from):
        assert not histories[p.slot]
