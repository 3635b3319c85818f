"""The gateway's worker routing policy (gateway/backends/worker_choice.py): rendezvous session affinity that replicas
agree on and that moves few keys, the bounded-load capacity (checked against its formula with loads tracked here),
health, the prefix index and its LRU (against a list model kept here), and chained block hashes."""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.backends.worker_choice import (
    REASONS,
    Choice,
    NoWorkerError,
    Router,
    block_hashes,
    rendezvous_order,
)

WORKERS = [f"10.0.0.{i}:50052" for i in range(5)]
BLOCK = 4  # tokens per block in these tests


def _router(workers=WORKERS, **kwargs) -> Router:
    router = Router(**kwargs)
    router.set_workers(workers)
    return router


def _sessions(router: Router, keys) -> dict[str, Choice]:
    return {k: router.pick(k, None, "unused") for k in keys}


def _capacity(eps: float, loads) -> int:
    """The bounded-load capacity, from its definition (Mirrokni, Thorup, Zadimoghaddam 2018)."""
    return math.ceil((1 + eps) * (sum(loads) + 1) / len(loads))


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 262144 for i in range(n)]


KEYS = [f"session-{i}" for i in range(2000)]


# --- session affinity -----------------------------------------------------------------------------------------


def test_replicas_agree_whatever_the_order_workers_joined():
    loads = dict(zip(WORKERS, [3, 0, 5, 1, 2], strict=True))
    one = _router()
    other = Router()
    other.set_workers(reversed(WORKERS[2:]))
    other.set_workers(WORKERS[::-1])  # joined in another order, in two steps
    for router in (one, other):
        for addr, load in loads.items():
            router.set_load(addr, load)
    a, b = _sessions(one, KEYS[:500]), _sessions(other, KEYS[:500])
    assert a == b
    cap = _capacity(0.25, loads.values())  # 3: the workers at 3 and 5 are full
    assert {c.addr for c in a.values()} == {w for w, load in loads.items() if load < cap}
    assert {c.reason for c in a.values()} == {"session", "session_spill"}


def test_the_hash_is_stable_across_processes():
    """Python's `hash()` of a str changes with PYTHONHASHSEED; the routing hash must not."""
    code = ("import sys; from gateway.backends.worker_choice import Router; r = Router(); r.set_workers(sys.argv[1:]); "
            "print([r.pick(f'k{i}', None, '').addr for i in range(50)])")
    outs = {subprocess.run([sys.executable, "-c", code, *WORKERS], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    here = str([c.addr for c in _sessions(_router(), [f"k{i}" for i in range(50)]).values()])
    assert outs == {here + "\n"}


def test_removing_a_worker_moves_exactly_its_keys():
    before = _sessions(_router(), KEYS)
    gone = WORKERS[2]
    after = _sessions(_router([w for w in WORKERS if w != gone]), KEYS)
    moved = {k for k in KEYS if before[k].addr != after[k].addr}
    assert moved == {k for k in KEYS if before[k].addr == gone}
    assert all(c.reason == "session" for c in after.values())


def test_adding_a_worker_moves_keys_only_onto_it_about_a_sixth():
    before = _sessions(_router(), KEYS)
    new = "10.0.0.9:50052"
    after = _sessions(_router([*WORKERS, new]), KEYS)
    moved = [k for k in KEYS if before[k].addr != after[k].addr]
    assert all(after[k].addr == new for k in moved)
    assert 0.10 <= len(moved) / len(KEYS) <= 0.25


def test_a_full_worker_passes_each_key_to_its_next_choice():
    router = _router()
    before = _sessions(router, KEYS[:600])
    full = collections.Counter(c.addr for c in before.values()).most_common(1)[0][0]
    next_choice = _sessions(_router([w for w in WORKERS if w != full]), KEYS[:600])
    router.set_load(full, 100)  # capacity ceil(1.25 * 101 / 5) = 26
    assert router.capacity() == _capacity(0.25, [100, 0, 0, 0, 0]) == 26
    after = _sessions(router, KEYS[:600])
    for key, choice in after.items():
        if before[key].addr == full:
            assert choice == Choice(next_choice[key].addr, "session_spill")
        else:
            assert choice == before[key]


def test_a_worker_just_under_capacity_keeps_its_keys():
    router = _router()
    key = KEYS[0]
    top = router.pick(key, None, "").addr
    for addr in WORKERS:
        router.set_load(addr, 3)
    router.set_load(top, 4)  # capacity ceil(1.25 * 17 / 5) = 5
    assert router.pick(key, None, "") == Choice(top, "session")
    router.set_load(top, 5)  # capacity ceil(1.25 * 18 / 5) = 5: full
    assert router.pick(key, None, "").reason == "session_spill"


REQUESTS = st.lists(st.tuples(st.sampled_from(["session", "hash", "prefix"]), st.integers(0, 30)), min_size=1,
                    max_size=120)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 7), eps=st.sampled_from([0.0, 0.1, 0.25, 1.0]),
       start=st.lists(st.integers(0, 12), min_size=7, max_size=7), requests=REQUESTS)
def test_no_assignment_exceeds_the_capacity(n, eps, start, requests):
    """Assign requests one by one, the loads tracked here: the chosen worker is never full, whatever the reason
    (a prefix held by one worker lures every request of its conversations there)."""
    workers = WORKERS[:n] + [f"10.0.1.{i}:1" for i in range(max(0, n - 5))]
    router = _router(workers, epsilon=eps)
    loads = dict(zip(workers, start, strict=False))
    for addr, load in loads.items():
        router.set_load(addr, load)
    lure = block_hashes(_tokens(1, 8 * BLOCK), BLOCK)
    router.record(workers[0], lure)
    for kind, key in requests:
        cap = _capacity(eps, loads.values())
        choice = router.pick(f"s{key}" if kind == "session" else None, lure if kind == "prefix" else None, f"t{key}")
        assert loads[choice.addr] + 1 <= cap
        assert choice.reason in REASONS
        loads[choice.addr] += 1
        router.add_inflight(choice.addr, +1)


# --- health and membership -------------------------------------------------------------------------------------


def test_an_unhealthy_worker_leaves_the_ring_and_rejoins_with_the_same_choices():
    router = _router()
    before = _sessions(router, KEYS[:400])
    sick = WORKERS[1]
    assert router.set_healthy(sick, False)
    during = _sessions(router, KEYS[:400])
    without = _sessions(_router([w for w in WORKERS if w != sick]), KEYS[:400])
    assert during == without  # its keys go to their next choice, as if it had left
    assert all(router.pick(None, None, k).addr != sick for k in KEYS[:400])
    router.set_healthy(sick, True)
    assert _sessions(router, KEYS[:400]) == before


def test_no_healthy_worker_is_a_lookup_error():
    router = _router()
    for addr in WORKERS:
        router.set_healthy(addr, False)
    with pytest.raises(NoWorkerError):
        router.pick("s", None, "t")
    with pytest.raises(LookupError):
        router.pick(None, [1, 2, 3], "t")
    with pytest.raises(NoWorkerError):
        _router([]).pick(None, None, "t")


def test_membership_changes_drop_and_reset_state():
    router = _router(WORKERS[:2])
    a, b = WORKERS[:2]
    router.set_load(a, 7)
    router.add_inflight(a, +2)
    router.set_healthy(a, False)
    router.record(a, [1, 2, 3])
    router.set_workers([b])
    assert not router.set_load(a, 1) and not router.set_healthy(a, True) and not router.add_inflight(a, -1)
    assert not router.record(a, [4])
    assert router.matched_blocks(a, [1, 2, 3]) == 0
    router.set_workers([a, b])
    assert router.snapshot()[a] == {"healthy": True, "load": 0.0, "inflight": 0, "indexed_blocks": 0}


def test_inflight_adds_to_the_load_and_never_goes_negative():
    router = _router(WORKERS[:2])
    a, b = WORKERS[:2]
    router.add_inflight(a, -1)
    assert router.snapshot()[a]["inflight"] == 0
    router.set_load(a, 2)
    router.add_inflight(a, +3)
    router.add_inflight(a, -1)
    assert router.capacity() == _capacity(0.25, [2 + 2, 0])
    assert router.snapshot() == {a: {"healthy": True, "load": 2.0, "inflight": 2, "indexed_blocks": 0},
                                 b: {"healthy": True, "load": 0.0, "inflight": 0, "indexed_blocks": 0}}


@pytest.mark.parametrize("kwargs", [{"epsilon": -0.1}, {"epsilon": math.inf}, {"epsilon": math.nan},
                                    {"epsilon": "0.25"}, {"min_match_blocks": 0}, {"min_match_blocks": 1.5},
                                    {"index_blocks": 0}, {"index_blocks": True}])
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError):
        Router(**kwargs)


def test_bad_loads_and_addresses():
    router = _router()
    for load in (-1, math.nan, math.inf, "3"):
        with pytest.raises(ValueError):
            router.set_load(WORKERS[0], load)
    with pytest.raises(ValueError):
        router.set_workers(["10.0.0.1:1", ""])
    assert set(router.snapshot()) == set(WORKERS)  # a refused update changes nothing


# --- prefix awareness ------------------------------------------------------------------------------------------


def _off_hash(router: Router, tiebreak: str) -> str:
    """A worker that is not the tiebreak key's rendezvous choice, so a prefix choice is visible."""
    return next(w for w in WORKERS if w != router.pick(None, None, tiebreak).addr)


def test_a_recorded_prefix_brings_the_next_turn_to_its_worker():
    router = _router()
    turn1 = _tokens(1, 10 * BLOCK + 3)
    x = _off_hash(router, "conv-1")
    assert router.record(x, block_hashes(turn1, BLOCK))
    turn2 = block_hashes(turn1 + _tokens(2, 6 * BLOCK), BLOCK)
    assert router.matched_blocks(x, turn2) == 10
    assert router.pick(None, turn2, "conv-1") == Choice(x, "prefix")


def test_a_prefix_every_worker_holds_does_not_decide():
    router = _router()
    system = _tokens(0, 6 * BLOCK)
    for addr in WORKERS:
        router.record(addr, block_hashes(system, BLOCK))
    firsts = {}
    for conv in range(60):
        prompt = block_hashes(system + _tokens(100 + conv, 3 * BLOCK), BLOCK)
        choice = router.pick(None, prompt, f"conv-{conv}")
        assert choice == Choice(router.pick(None, None, f"conv-{conv}").addr, "hash")
        firsts[conv] = choice.addr
        router.record(choice.addr, prompt)
    assert len(set(firsts.values())) == len(WORKERS)  # spread, not funnelled to one worker
    for conv in range(60):  # each conversation's own turns then stick to its worker
        prompt = block_hashes(system + _tokens(100 + conv, 3 * BLOCK) + _tokens(1, 2 * BLOCK), BLOCK)
        assert router.pick(None, prompt, "another tiebreak") == Choice(firsts[conv], "prefix")


def test_an_equal_best_match_on_two_workers_does_not_decide():
    router = _router()
    prompt = block_hashes(_tokens(3, 5 * BLOCK), BLOCK)
    router.record(WORKERS[0], prompt)
    router.record(WORKERS[1], prompt)
    router.record(WORKERS[2], prompt[:2])
    assert router.pick(None, prompt, "t").reason == "hash"


def test_a_match_shorter_than_min_match_blocks_does_not_decide():
    router = _router(min_match_blocks=2)
    prompt = block_hashes(_tokens(4, 5 * BLOCK), BLOCK)
    x = _off_hash(router, "t")
    router.record(x, prompt[:1])
    assert router.pick(None, prompt, "t").reason == "hash"
    router.record(x, prompt[:2])
    assert router.pick(None, prompt, "t") == Choice(x, "prefix")


def test_load_overrides_a_match_at_capacity():
    router = _router()
    prompt = block_hashes(_tokens(5, 40 * BLOCK), BLOCK)
    x = _off_hash(router, "t")
    router.record(x, prompt)
    for addr in WORKERS:
        router.set_load(addr, 3)
    router.set_load(x, 4)  # capacity ceil(1.25 * 17 / 5) = 5
    assert router.pick(None, prompt, "t") == Choice(x, "prefix")
    router.add_inflight(x, +1)  # 5: full
    assert router.capacity() == _capacity(0.25, [5, 3, 3, 3, 3]) == 5
    choice = router.pick(None, prompt, "t")
    assert choice.addr != x and choice.reason == "hash"
    router.add_inflight(x, -1)
    assert router.pick(None, prompt, "t") == Choice(x, "prefix")


def test_a_full_hash_choice_spills():
    router = _router()
    top = router.pick(None, None, "t").addr
    router.set_load(top, 50)
    choice = router.pick(None, None, "t")
    assert choice.addr != top and choice.reason == "hash_spill"


def test_a_session_follows_its_kv_after_a_spill_and_its_key_otherwise():
    """A session whose prompt prefix sits on another worker than its key's first choice (it spilled there on an
    earlier turn) stays with its KV while that worker has room; a prefix every worker holds, or none, leaves
    the key's rendezvous choice."""
    router = _router()
    prompt = block_hashes(_tokens(6, 8 * BLOCK), BLOCK)
    top = router.pick("s", None, "t").addr
    other = next(w for w in WORKERS if w != top)
    assert router.pick("s", prompt, "t") == Choice(top, "session")
    router.record(other, prompt)
    assert router.pick("s", prompt, "t") == Choice(other, "session_spill")
    for w in WORKERS:
        router.record(w, prompt)
    assert router.pick("s", prompt, "t") == Choice(top, "session")


def test_a_different_salt_never_matches():
    router = _router()
    tokens = _tokens(7, 8 * BLOCK)
    x = _off_hash(router, "t")
    router.record(x, block_hashes(tokens, BLOCK, salt="tenant-a"))
    assert router.pick(None, block_hashes(tokens, BLOCK, salt="tenant-a"), "t") == Choice(x, "prefix")
    other = block_hashes(tokens, BLOCK, salt="tenant-b")
    assert router.matched_blocks(x, other) == 0
    assert router.pick(None, other, "t").reason == "hash"


def test_the_index_evicts_the_least_recently_recorded_blocks_tails_first():
    a, b, c = (block_hashes(_tokens(10 + i, 4 * BLOCK), BLOCK) for i in range(3))
    router = _router(WORKERS[:1], index_blocks=8)
    w = WORKERS[0]
    router.record(w, a)
    router.record(w, b)
    router.record(w, c[:2])  # two over the cap: a's last two blocks go, its leading ones stay
    assert [router.matched_blocks(w, p) for p in (a, b, c)] == [2, 4, 2]
    assert router.snapshot()[w]["indexed_blocks"] == 8
    router.record(w, a[:2])  # a's head is now the most recent: b's tail goes next
    router.record(w, c)
    assert [router.matched_blocks(w, p) for p in (a, b, c)] == [2, 2, 4]


PROMPTS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 4)), min_size=1, max_size=25)


@settings(max_examples=80, deadline=None)
@given(records=PROMPTS, cap=st.integers(1, 12))
def test_matched_blocks_is_the_leading_run_of_a_recency_list(records, cap):
    """Prompts sharing prefixes (a system prompt, a conversation, its turns), recorded under a small cap: the
    bisection in `matched_blocks` counts exactly the leading blocks a plain recency list holds."""
    def prompt(system, conv, turns):
        return _tokens(system, 2 * BLOCK) + _tokens(50 + conv, BLOCK) + _tokens(99, turns * BLOCK)

    router = _router(WORKERS[:1], index_blocks=cap)
    recency: list[int] = []  # least recently recorded first
    for rec in records:
        blocks = block_hashes(prompt(*rec), BLOCK)
        router.record(WORKERS[0], blocks)
        for h in reversed(blocks):
            if h in recency:
                recency.remove(h)
            recency.append(h)
        del recency[:-cap]
    for rec in records:
        blocks = block_hashes(prompt(*rec), BLOCK)
        leading = next((i for i, h in enumerate(blocks) if h not in recency), len(blocks))
        assert router.matched_blocks(WORKERS[0], blocks) == leading
    assert router.snapshot()[WORKERS[0]]["indexed_blocks"] == len(recency)


# --- block hashes ----------------------------------------------------------------------------------------------


def test_block_hashes_chain():
    tokens = _tokens(8, 6 * BLOCK)
    base = block_hashes(tokens, BLOCK)
    assert len(base) == 6 and len(set(base)) == 6 and all(0 <= h < 2**64 for h in base)
    first = block_hashes([tokens[0] + 1, *tokens[1:]], BLOCK)
    assert all(x != y for x, y in zip(base, first, strict=True))  # token 0 reaches every hash
    edited = list(tokens)
    edited[3 * BLOCK + 2] += 1  # a token of block 3
    third = block_hashes(edited, BLOCK)
    assert third[:3] == base[:3] and all(x != y for x, y in zip(base[3:], third[3:], strict=True))
    repeated = block_hashes(tokens[:BLOCK] * 2, BLOCK)
    assert repeated[0] != repeated[1]  # equal blocks at different depths differ


def test_block_hashes_ignore_a_partial_block_and_depend_on_the_salt():
    tokens = _tokens(9, 3 * BLOCK + BLOCK - 1)
    assert block_hashes(tokens, BLOCK) == block_hashes(tokens[:3 * BLOCK], BLOCK)
    assert len(block_hashes(tokens, BLOCK)) == 3
    assert block_hashes(tokens[:BLOCK - 1], BLOCK) == []
    salted = block_hashes(tokens, BLOCK, salt="s")
    assert not set(salted) & set(block_hashes(tokens, BLOCK))
    assert block_hashes(tokens, BLOCK, salt="s") == salted
    assert block_hashes(tokens, 2 * BLOCK)[0] != block_hashes(tokens, BLOCK)[1]


@pytest.mark.parametrize("tokens, block_tokens", [([1, 2], 0), ([1, 2], -1), ([1, 2], True), ([1, 2], 1.0),
                                                  ([-2**31 - 1], 1), ([2**31], 1), (["a"], 1)])
def test_block_hashes_refuse_bad_input(tokens, block_tokens):
    with pytest.raises(ValueError):
        block_hashes(tokens, block_tokens)


def test_a_worker_with_a_free_slot_keeps_its_keys_and_a_full_one_spills():
    """The slot floor (`Router.set_slots`): at light load a worker under its slot count is never full (the relative
    bound alone would move keys off a worker holding 1 request while the mean is 0.5); once its slots are taken,
    keys beyond spill to a worker with room."""
    router = Router(epsilon=0.25)
    router.set_workers(["a:1", "b:1"])
    for addr in ("a:1", "b:1"):
        router.set_slots(addr, 4)
    keys = [k for k in (f"k{i}" for i in range(400)) if router.pick(k, None, "t").addr == "a:1"][:8]
    assert len(keys) == 8
    router.add_inflight("a:1", 3)  # 3 of 4 slots busy, the other worker idle: still a's
    assert all(router.pick(k, None, "t") == Choice("a:1", "session") for k in keys)
    router.add_inflight("a:1", 1)  # a's slots all taken: its keys go to b
    assert {router.pick(k, None, "t") for k in keys} == {Choice("b:1", "session_spill")}


def test_resident_conversations_fill_a_worker_and_come_back_to_it():
    """Conversations stay resident for `conversation_ttl` after a turn (an agent thinking): a worker holding as
    many as it has slots takes no new one while another has room, its own conversations come back to it after
    a spill put them elsewhere, and a conversation not seen for longer than the ttl is forgotten."""
    router = Router(epsilon=0.25, conversation_ttl=60.0)
    router.set_workers(["a:1", "b:1"])
    for addr in ("a:1", "b:1"):
        router.set_slots(addr, 2)
    keys = [k for k in (f"k{i}" for i in range(400)) if router.pick(k, None, "t", now=0.0).addr == "a:1"][:3]
    for k in keys[:2]:  # two conversations take a's two slots' worth of KV, then think (nothing in flight)
        router.record(router.pick(k, None, "t", now=0.0).addr, [], k, now=0.0)
    third = router.pick(keys[2], None, "t", now=1.0)
    assert third == Choice("b:1", "session_spill")  # a is full of resident conversations
    router.record(third.addr, [], keys[2], now=1.0)
    assert router.pick(keys[2], None, "t", now=2.0) == Choice("b:1", "session_spill")  # stays with its KV
    assert router.pick(keys[0], None, "t", now=2.0) == Choice("a:1", "session")
    assert router.pick(None, None, "conv-x", now=2.0).addr in ("a:1", "b:1")
    router.record("b:1", [], "conv-x", now=2.0)  # a keyless conversation (its tiebreak key) is resident too
    assert router.pick(None, None, "conv-x", now=3.0) == Choice("b:1", "prefix")
    later = 2.0 + 61.0  # past the ttl: nothing is resident any more, the key's first choice takes it again
    assert router.pick(keys[2], None, "t", now=later) == Choice("a:1", "session")


def test_a_worker_without_headroom_within_its_latency_targets_is_passed_over():
    """A worker reporting no headroom (its running requests' TPOT targets leave no room) is passed over like a
    full one, even for a key whose first choice it is; with no headroom anywhere a pick still succeeds."""
    router = Router()
    router.set_workers(["a:1", "b:1"])
    key = next(k for k in (f"conv-{i}" for i in range(100)) if rendezvous_order(k, ["a:1", "b:1"])[0] == "a:1")
    assert router.pick(key, None, "").addr == "a:1"
    router.set_headroom("a:1", 0)
    assert router.pick(key, None, "").addr == "b:1"
    router.set_headroom("b:1", 0)
    assert router.pick(key, None, "").addr in ("a:1", "b:1")
    router.set_headroom("a:1", -1)  # unknown again: slots and load decide
    assert router.pick(key, None, "").addr == "a:1"
