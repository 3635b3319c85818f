"""Which model worker serves a request: session affinity, prefix awareness and bounded load (stdlib only).

Each worker keeps its own KV and prefix cache (docs/architecture.md, "Prefix reuse"), so a request is cheapest
on the worker that already holds its prompt's beginning. `Router.pick` decides in this order:

- With a session key (an agent conversation): rendezvous (highest-random-weight) hashing of the key over the
  healthy workers, so every turn lands on the same worker and several gateway replicas with the same view of
  workers and loads agree without talking to each other. Adding or removing a worker moves only the keys whose
  top choice it becomes or was.
- Without one: the worker whose prefix index holds the longest leading run of the prompt's block hashes
  (`block_hashes`), when that run is long enough and longer than every other worker's; otherwise rendezvous
  hashing of the caller's tiebreak key (a hash of the conversation's first messages).

Before both, a conversation that is resident somewhere (its session or tiebreak key was routed to a worker
within `conversation_ttl`: an agent between turns) goes back to that worker, wherever an earlier spill put it.

Every choice is bounded by load (Mirrokni, Thorup, Zadimoghaddam 2018, "Consistent Hashing with Bounded Loads"):
a worker at capacity passes the request on to the next worker in the key's rendezvous order; below its slot count a
worker is never at capacity, and a worker holding as many resident conversations as it has slots takes no new
conversation while another worker has room (its conversations would evict each other's KV). The prefix index
is approximate, like llm-d's approximate prefix scorer and SGLang's cache-aware router: it remembers what the
gateway routed where (`Router.record`), not what each worker still holds.

The router is plain single-threaded Python, meant to be called from the gateway's event loop.
"""

from __future__ import annotations

import array
import bisect
import collections
import dataclasses
import hashlib
import math
import struct
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Literal

#: Why a worker was chosen (`Choice.reason`):
#:   "session"        the session key's top rendezvous choice;
#:   "session_spill"  the session key's top choice was at capacity: the first worker under capacity in its order;
#:   "prefix"         the worker whose index holds the longest leading run of the prompt's blocks;
#:   "hash"           no session and no deciding prefix: the tiebreak key's top rendezvous choice;
#:   "hash_spill"     as "hash", but the top choice was at capacity;
#:   "unhealthy"      no worker passed its last health check: the key's worker is tried anyway
#:                    (gateway/backends/workers.py `WorkerPool.route`; `pick` itself never returns it).
Reason = Literal["session", "session_spill", "prefix", "hash", "hash_spill", "unhealthy"]
REASONS: tuple[Reason, ...] = ("session", "session_spill", "prefix", "hash", "hash_spill", "unhealthy")

_BLOCK_SEED = b"gemma-serve/blocks/"
_TOKENS = "i"  # C int: 4 bytes on every platform CPython supports; token ids are int32 in the protos


class NoWorkerError(LookupError):
    """No healthy worker exists: the gateway answers 503 (the request may be retried)."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """The worker a request goes to (`addr`, "host:port") and why (`reason`, one of `REASONS`)."""

    addr: str
    reason: Reason


def block_hashes(token_ids: Sequence[int], block_tokens: int, salt: str = "") -> list[int]:
    """Chained 64-bit hashes of the full blocks of a prompt, the keys of the router's prefix index.

    Hash i covers tokens [0, (i + 1) * block_tokens) through the chain h_i = blake2b-64(h_{i-1} || block i's
    tokens as little-endian int32), so equal hashes mean equal prefixes, not just equal blocks. The chain starts
    from a hash of `salt` (the request's `cache_salt`), so prompts with different salts never match, as the
    worker's prefix cache never shares KV across salts. A trailing partial block is ignored.

    Args:
      token_ids: the prompt's token ids, each in [-2**31, 2**31).
      block_tokens: tokens per block (>= 1).
      salt: the cache scope.

    Returns:
      len(token_ids) // block_tokens unsigned 64-bit ints.

    Raises:
      ValueError: block_tokens < 1, or a token id that is not an int32.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    try:
        packed = array.array(_TOKENS, token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be int32: {e}") from None
    if sys.byteorder == "big":  # pragma: no cover - replicas on any host must agree
        packed.byteswap()
    data, step = memoryview(packed).cast("B"), 4 * block_tokens
    prev = hashlib.blake2b(_BLOCK_SEED + salt.encode(), digest_size=8).digest()
    out = []
    for start in range(0, len(data) - step + 1, step):
        prev = hashlib.blake2b(prev + data[start:start + step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def _weight(key: str, addr: str) -> int:
    """The rendezvous weight of `addr` for `key`: a stable 64-bit hash (never Python's salted `hash()`, so that
    every process and replica ranks alike); the key's length comes first, so no (key, addr) pair shares its
    bytes with another."""
    kb = key.encode()
    return int.from_bytes(
        hashlib.blake2b(struct.pack("<Q", len(kb)) + kb + addr.encode(), digest_size=8).digest(), "little")


def rendezvous_order(key: str, addrs: Iterable[str]) -> list[str]:
    """`addrs` from `key`'s first choice to its last (highest rendezvous weight first, ties by address): the
    order in which a key passes from a worker at capacity to the next. Independent of the input's order."""
    return sorted(addrs, key=lambda a: (_weight(key, a), a), reverse=True)


@dataclasses.dataclass
class _Worker:
    """One worker's routing state: health, the load it reports, the gateway's in-flight count, and the prefix
    index (block hash -> None, least recently recorded first)."""

    healthy: bool = True
    load: float = 0.0
    inflight: int = 0
    slots: int = 0  # requests the worker runs at once (0: unknown)
    headroom: int = -1  # more requests it takes within its latency targets (-1: unknown, no targets)
    # conversations (session or tiebreak keys) routed here, with when they were last seen, oldest first
    conversations: collections.OrderedDict[str, float] = dataclasses.field(default_factory=collections.OrderedDict)
    index: collections.OrderedDict[int, None] = dataclasses.field(default_factory=collections.OrderedDict)

    @property
    def effective_load(self) -> float:
        """The load routing compares: reported + in flight."""
        return self.load + self.inflight


class Router:
    """Routes requests to workers; see the module docstring for the policy.

    Loads are in requests: `set_load` takes what the worker reports (the gateway passes its waiting + running
    requests) and `add_inflight` adds the gateway's own count of requests it routed there and has not seen
    finish, so a burst between two load reports spreads instead of piling onto one worker. A request the worker
    already reports counts twice until it finishes; every worker's requests count so, which keeps the comparison
    with the mean fair.

    Capacity (Mirrokni, Thorup, Zadimoghaddam 2018, "Consistent Hashing with Bounded Loads"): over the n healthy
    workers with total effective load T, capacity = ceil((1 + epsilon) * (T + 1) / n), the bound counting the
    request being placed. A worker whose load is at or above it is full and passes the request to the next
    worker in the key's rendezvous order, so with integer loads no worker holds more than the capacity after an
    assignment. Some worker is always below capacity (for non-negative loads the least loaded one carries at
    most T / n < (T + 1) / n <= capacity), so a pick never fails while a healthy worker exists. The bound is
    enforced, not probabilistic, whatever the probe order; the rendezvous order is each key's own pseudo-random
    permutation, so a full worker's keys spread over all the others rather than onto one successor.

    Health: an unhealthy worker is out of every ranking at once and rejoins, with the same choices as before,
    when healthy again. Its prefix index is kept: if it kept its cache (a network blip) the index is still
    right; if it restarted empty, the prefixes recorded for it were sent to no other worker either, so sending
    them back costs nothing a different choice would have saved.
    """

    def __init__(self, epsilon: float = 0.25, min_match_blocks: int = 2, index_blocks: int = 16384,
                 conversation_ttl: float = 120.0):
        """
        Args:
          epsilon: the bounded-load slack (>= 0, finite): a worker is full at (1 + epsilon) x the mean load
            (plus the new request). Smaller balances more tightly and moves more keys off their first choice.
          min_match_blocks: the shortest leading run of blocks (>= 1) that can decide by prefix.
          index_blocks: the most block hashes remembered per worker (>= 1), least recently recorded dropped first.
          conversation_ttl: seconds a conversation counts as resident on the worker that served its last turn
            (an agent's think time between turns): its later turns go back there, and a worker holding as many
            resident conversations as it has slots takes no new one while another worker has room (its
            conversations would evict each other's KV).

        Raises:
          ValueError: an argument out of its range or of the wrong type.
        """
        _check_finite("epsilon", epsilon)
        _check_count("min_match_blocks", min_match_blocks)
        _check_count("index_blocks", index_blocks)
        self.epsilon = float(epsilon)
        self.min_match_blocks = min_match_blocks
        self.index_blocks = index_blocks
        _check_finite("conversation_ttl", conversation_ttl)
        self.conversation_ttl = float(conversation_ttl)
        self._workers: dict[str, _Worker] = {}

    def set_workers(self, addrs: Iterable[str]) -> None:
        """Make `addrs` ("host:port") the current workers: removed ones lose all their state, new ones start
        healthy with load 0 and an empty index, the others keep theirs.

        Raises:
          ValueError: an address that is not a non-empty string.
        """
        wanted = set(addrs)
        for addr in wanted:
            if not isinstance(addr, str) or not addr:
                raise ValueError(f"a worker address must be a non-empty string, got {addr!r}")
        self._workers = {a: self._workers.get(a) or _Worker() for a in sorted(wanted)}

    def set_healthy(self, addr: str, healthy: bool) -> bool:
        """Take `addr` out of routing (False) or back in (True).

        Returns:
          Whether `addr` is a current worker (a late report about a removed one is ignored).
        """
        worker = self._workers.get(addr)
        if worker is not None:
            worker.healthy = bool(healthy)
        return worker is not None

    def set_load(self, addr: str, load: float) -> bool:
        """Set the load `addr` reports, in requests (the gateway passes waiting + running).

        Returns:
          Whether `addr` is a current worker (a late report about a removed one is ignored).

        Raises:
          ValueError: a negative or non-finite load.
        """
        _check_finite("load", load)
        worker = self._workers.get(addr)
        if worker is not None:
            worker.load = float(load)
        return worker is not None

    def set_headroom(self, addr: str, rows: int) -> bool:
        """Set the headroom `addr` reports: more requests it can take within its running requests' latency
        targets (-1: unknown). A worker with none left is passed over like a full one, before load and prefix
        matches are weighed (it stays the last resort: a pick never fails on it).

        Returns:
          Whether `addr` is a current worker.
        """
        worker = self._workers.get(addr)
        if worker is not None:
            worker.headroom = int(rows)
        return worker is not None

    def add_inflight(self, addr: str, delta: int) -> bool:
        """Count requests the gateway routed to `addr` (+1 when sent, -1 when finished). The count never goes
        below 0: a request that finishes after its worker left and rejoined is simply not counted.

        Returns:
          Whether `addr` is a current worker (a request finishing on a removed one is ignored).
        """
        worker = self._workers.get(addr)
        if worker is not None:
            worker.inflight = max(0, worker.inflight + int(delta))
        return worker is not None

    def set_slots(self, addr: str, slots: int) -> bool:
        """Set how many requests `addr` runs at once (its engine's slots). A worker below its slot count is never
        full: it can still hold every conversation routed to it, so affinity is kept at light load, where the
        relative bound alone (a worker with 1 request when the mean is 0.25) would move conversations off
        workers with idle slots. Above it, the relative bound applies as usual.

        Returns:
          Whether `addr` is a current worker.
        """
        worker = self._workers.get(addr)
        if worker is not None:
            worker.slots = max(0, int(slots))
        return worker is not None

    def inflight(self, addr: str) -> int:
        """The gateway's in-flight count for `addr` (0 for an unknown worker)."""
        worker = self._workers.get(addr)
        return worker.inflight if worker is not None else 0

    def capacity(self) -> int:
        """The bounded-load capacity now: ceil((1 + epsilon) * (total effective load + 1) / healthy workers).

        Raises:
          NoWorkerError: no healthy worker.
        """
        return self._capacity(self._healthy())

    def pick(self, session_key: str | None, blocks: Sequence[int] | None, tiebreak_key: str,
             now: float | None = None) -> Choice:
        """Choose the worker for one request (see the module docstring). The caller then `record`s the
        request's blocks for the chosen worker and counts it with `add_inflight`.

        Args:
          session_key: the conversation's affinity key, or None. With a key, a prefix still decides first (see
            below): a conversation that once spilled stays where its KV went instead of bouncing back to its first
            choice; without spills the prefix's worker is the key's first choice anyway.
          blocks: the prompt's `block_hashes`, or None.
          tiebreak_key: the rendezvous key when neither a session nor a prefix decides.

        A prefix decides only when its leading run is at least `min_match_blocks` long and strictly longer than
        every other healthy worker's (a prefix all workers hold, such as a shared system prompt, gives no reason
        to prefer one), and only while that worker is under capacity: load overrides every prefix match, however
        long, with the same bound as sessions, so no pick ever lands on a full worker. A prefix-routed request
        over capacity goes to the tiebreak key's rendezvous choice, where its conversation then stays.

        Raises:
          NoWorkerError: no healthy worker.
        """
        healthy = self._healthy()
        cap = self._capacity(healthy)
        now = time.monotonic() if now is None else now
        conversation = session_key if session_key is not None else (tiebreak_key or None)
        home = self._home(conversation, healthy, now) if conversation else None  # a later turn: where its KV is
        held = next((a for a in (home, self._prefix_winner(healthy, blocks) if blocks else None)
                     if a is not None and self._has_room(a, cap)), None)
        if session_key is not None:
            if held is not None:
                first = rendezvous_order(session_key, healthy)[0]
                return Choice(held, "session" if held == first else "session_spill")
            return self._rendezvous(session_key, healthy, cap, "session", "session_spill", now)
        if held is not None:
            return Choice(held, "prefix")
        return self._rendezvous(tiebreak_key, healthy, cap, "hash", "hash_spill", now)

    def record(self, addr: str, blocks: Sequence[int], conversation: str | None = None,
               now: float | None = None) -> bool:
        """Remember that `addr` was sent the prompt with these `block_hashes`, evicting the least recently
        recorded hashes beyond `index_blocks`.

        The blocks are recorded last to first, so a prompt's leading blocks are its most recent: eviction drops
        a prefix's tail before its head (SGLang's radix cache evicts leaves first), and since chained hashes
        make every later record of block i also record blocks 0..i-1 after it, each worker's index holds a
        leading run of every chain, which `matched_blocks` finds by bisection.

        `conversation` (the session or tiebreak key given to `pick`) becomes resident on `addr` as of `now`
        (default: the monotonic clock), and leaves every other worker.

        Returns:
          Whether `addr` is a current worker (nothing is recorded otherwise).
        """
        worker = self._workers.get(addr)
        if worker is None:
            return False
        if conversation is not None:
            for w in self._workers.values():
                w.conversations.pop(conversation, None)
            worker.conversations[conversation] = time.monotonic() if now is None else now
        index = worker.index
        for h in reversed(blocks):
            index[h] = None
            index.move_to_end(h)
        while len(index) > self.index_blocks:
            index.popitem(last=False)
        return True

    def matched_blocks(self, addr: str, blocks: Sequence[int]) -> int:
        """How many leading blocks of `blocks` `addr`'s index holds (0 for an unknown worker)."""
        worker = self._workers.get(addr)
        if worker is None:
            return 0
        index = worker.index
        return bisect.bisect_left(range(len(blocks)), True, key=lambda i: blocks[i] not in index)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per worker, for debugging and metrics: healthy, load (reported), inflight, indexed_blocks."""
        return {addr: {"healthy": w.healthy, "load": w.load, "inflight": w.inflight, "indexed_blocks": len(w.index)}
                for addr, w in self._workers.items()}

    def _healthy(self) -> list[str]:
        healthy = [a for a, w in self._workers.items() if w.healthy]
        if not healthy:
            raise NoWorkerError(f"no healthy model worker (of {len(self._workers)})")
        return healthy

    def _capacity(self, healthy: list[str]) -> int:
        total = sum(self._workers[a].effective_load for a in healthy)
        return math.ceil((1 + self.epsilon) * (total + 1) / len(healthy))

    def _has_room(self, addr: str, cap: int) -> bool:
        """Whether `addr` takes one more request: headroom within its latency targets (when it reports any), and
        under the bounded-load capacity or its slot count."""
        w = self._workers[addr]
        if w.headroom == 0:
            return False
        return w.effective_load < max(cap, w.slots)

    def _resident(self, addr: str, now: float) -> int:
        """Conversations resident on `addr` (seen within `conversation_ttl`), forgetting older ones."""
        convs = self._workers[addr].conversations
        while convs and now - next(iter(convs.values())) > self.conversation_ttl:
            convs.popitem(last=False)
        return len(convs)

    def _home(self, conversation: str, healthy: list[str], now: float) -> str | None:
        """The healthy worker `conversation` is resident on, if any."""
        for addr in healthy:
            seen = self._workers[addr].conversations.get(conversation)
            if seen is not None and now - seen <= self.conversation_ttl:
                return addr
        return None

    def _takes_new(self, addr: str, cap: int, now: float) -> bool:
        """Room for a new conversation: room for a request, and fewer resident conversations than slots (when
        the worker's slots are known)."""
        w = self._workers[addr]
        return self._has_room(addr, cap) and not (w.slots and self._resident(addr, now) >= w.slots)

    def _rendezvous(self, key: str, healthy: list[str], cap: int, top: Reason, spill: Reason,
                    now: float | None = None) -> Choice:
        """`key`'s first worker in rendezvous order with room for a new conversation, else with room for a request
        (`top` if it is the first choice)."""
        order = rendezvous_order(key, healthy)
        workers = self._workers
        now = time.monotonic() if now is None else now
        addr = next((a for a in order if self._takes_new(a, cap, now)), None)
        addr = addr or next((a for a in order if self._has_room(a, cap)), None)
        if addr is None:  # only when every worker reports no headroom (see set_headroom): never fail a pick
            addr = min(order, key=lambda a: workers[a].effective_load)
        return Choice(addr, top if addr == order[0] else spill)

    def _prefix_winner(self, healthy: list[str], blocks: Sequence[int]) -> str | None:
        """The worker whose leading run is at least `min_match_blocks` and longer than every other's, or None."""
        runs = sorted(((self.matched_blocks(a, blocks), a) for a in healthy), reverse=True)
        best = runs[0][0]
        runner_up = runs[1][0] if len(runs) > 1 else 0
        return runs[0][1] if best >= self.min_match_blocks and best > runner_up else None


def _check_finite(name: str, value: object) -> None:
    """Raise ValueError unless `value` is a finite number >= 0 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_count(name: str, value: object) -> None:
    """Raise ValueError unless `value` is an int >= 1 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
