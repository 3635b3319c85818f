"""Prefix reuse over the slots: which tokens each slot's KV holds, who uses it, and which slot a new prompt gets.

Every slot keeps its KV after its sequence finishes, so the slots double as the prefix cache. A new prompt is
matched against every slot's token history (running or finished): with a common prefix of `usable` tokens the
sequence starts with `num_computed = usable` and only the rest is computed. Full-attention layers hold every
position, so any split is exact for them; sliding layers hold a ring of window + `slack` positions, which holds
the right window at a split point at most `slack` + 1 tokens behind the slot's end — the agent case, where the
next turn extends the previous one (often after a few tokens that differ: a trimmed trailing newline, the
end-of-turn marker). A match further back is not exact and is not used.

Placement: a finished slot whose history matches is taken over in place (no copy); a match in a running or
pinned slot is copied into another slot first. Otherwise the new sequence gets an empty slot, else the least
recently used finished slot (LRU eviction), pinned snapshots last.

Prompts in flight: a running sequence's slot holds only what it has computed so far, so a burst of identical
prompts would otherwise find nothing to reuse and compute the prompt once per slot. A new prompt sharing more
with a prompt being computed right now (its `leader`: running, still short of the shared part) than with any
slot's KV waits for it instead (`Placement.leader`, a slot): when the shared part is all but the prompt's last
token, or at least `min_share` tokens longer than the best exact reuse. The scheduler copies the leader's slot
once it has computed the shared part (`best_source`).

Shared prompts (a system prompt common to many conversations): when a prompt shares >= `min_share` tokens with a
slot whose ring cannot serve that split, the placement says so (`Placement.snapshot_at`): the sequence computes
its prompt and, exactly when it has computed the shared part, the engine copies its slot into a spare one
(`snapshot_slot`) that is *pinned* as a snapshot of that prefix (`pin`); later conversations copy from the
snapshot. At most `max_snapshots` are pinned (LRU among them).

The cache knows token ids, salts and slot numbers only, never the scheduler's sequences: the scheduler describes
its running slots with `LiveSlot`s, applies the `Placement` it gets back, and reports what a finished slot holds
(`release`). So the scheduler alone changes sequences (docs/architecture.md, "Continuous batching").

Session leases: a request of a session that asks for one (`release(..., session, ttl)`) leaves its slot leased
to the session for `ttl` seconds (an agent's think time): no other prompt takes the slot over or evicts it, though
prompts that share its prefix may copy from it; the session's next request takes it over in place and may renew
it. Leases never starve anyone: at most `max_leases` (a quarter of the slots) are held at once (a new one ends the
oldest), and a prompt that has waited too long for a slot (`place(..., preempt=True)`, the scheduler's
`lease_preempt_after`) takes the oldest lease's slot (`preempted` counts it).

Scopes: every slot's KV carries the `cache_salt` of the request that computed it, and a prompt is matched only
against slots of its own salt, so a prefix hit (and the `cached_tokens` a client sees) never reveals what a
request with another salt computed (vLLM's `cache_salt`). Eviction ignores salts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from collections.abc import Sequence as Tokens


@dataclasses.dataclass
class SlotEntry:
    """One slot's contents.

    Attributes:
      tokens: the token ids whose KV the slot holds (positions 0..len-1) while no sequence runs in it.
      busy: a running sequence uses the slot (its history is then the scheduler's `LiveSlot.history`).
      last_used: clock value of the last admission or release (LRU).
      pinned: a shared-prefix snapshot, evicted only after unpinned slots.
      salt: the cache_salt of the requests whose KV the slot holds (only prompts with this salt reuse it).
    """

    tokens: list[int] = dataclasses.field(default_factory=list)
    busy: bool = False
    last_used: int = 0
    pinned: bool = False
    salt: str = ""
    lease: str = ""  # the session the slot is leased to ("" none)
    lease_until: float = 0.0  # when the lease ends (time.monotonic())
    lease_since: float = 0.0


@dataclasses.dataclass(frozen=True)
class LiveSlot:
    """A busy slot as the scheduler describes it to the cache (the cache never sees its sequences).

    Attributes:
      history: the token ids whose KV the slot holds so far (positions 0..len-1).
      prompt: the prompt the slot is computing, or () when it computes none of its own (it waits to copy another
        slot: a follower of a leader, or a fork of an `n` > 1 request); only such prompts can lead a new one.
    """

    history: Tokens[int]
    prompt: Tokens[int] = ()


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a new sequence goes: its slot, a slot to copy from first (or None), and its reused prefix length;
    or a leader slot whose prompt computation it waits for, to copy `share` tokens of it then.

    Attributes:
      slot: the slot the sequence gets (now marked busy).
      copy_from: a slot whose KV to copy over `slot` first, or None.
      cached: prompt tokens whose KV is there once the copy (if any) is done.
      leader: the busy slot computing a prompt that shares `share` tokens with this one, or None.
      share: prompt tokens to take from the leader's slot once it has computed them.
      snapshot_at: pin a copy of the slot once this many prompt tokens are computed (a shared prefix worth
        keeping), or None.
    """

    slot: int
    copy_from: int | None
    cached: int
    leader: int | None = None
    share: int = 0
    snapshot_at: int | None = None


def common_prefix(a: Tokens[int], b: Tokens[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Owns the slots' histories, busy marks and LRU order. Methods that look at running slots take the
    scheduler's `live` view: slot -> `LiveSlot`, one per busy slot."""

    def __init__(self, num_slots: int, slack: int, max_snapshots: int | None = None, min_share: int = 32,
                 clock=time.monotonic):
        """Args: num_slots: slots; slack: ring positions beyond the window (see KVCache); max_snapshots: pinned
        shared-prefix snapshots at most (default num_slots // 4, and at least one from 2 slots on: agent clients
        start every session with the same long system prompt and tools, which a sliding-window slot that ran
        past them cannot serve exactly); min_share: shortest prefix worth a snapshot;
        clock: seconds, for lease expiry."""
        self.entries = [SlotEntry() for _ in range(num_slots)]
        self.max_leases = num_slots // 4
        self.now = clock
        self.preempted = 0  # metrics: leases ended early by a prompt that waited too long for a slot
        self.slack = slack
        default = max(1, num_slots // 4) if num_slots >= 2 else 0
        self.max_snapshots = default if max_snapshots is None else max_snapshots
        self.min_share = min_share
        self.clock = 0
        self.queries = self.hits = 0  # metrics: admissions looked up, admissions that reused a prefix

    def history(self, slot: int, live: Mapping[int, LiveSlot]) -> Tokens[int]:
        """Token ids whose KV slot `slot` holds now."""
        return live[slot].history if self.entries[slot].busy else self.entries[slot].tokens

    def has_free(self) -> bool:
        """Whether some slot has no running sequence."""
        return any(not e.busy for e in self.entries)

    def exact_split(self, end: int, split: int) -> bool:
        """Whether a slot whose KV holds positions 0..end-1 serves a prompt that shares its first `split` tokens
        exactly: full layers hold every position, sliding rings only `slack` + 1 positions beyond the window."""
        return split >= end - self.slack - 1

    def _usable(self, slot: int, prompt: Tokens[int], salt: str, live: Mapping[int, LiveSlot]) -> tuple[int, int]:
        """(exact reusable prefix length, plain common prefix length) of `prompt` against a slot; (0, 0) for a
        slot of another salt."""
        if self.entries[slot].salt != salt:
            return 0, 0
        history = self.history(slot, live)
        lcp = min(common_prefix(history, prompt), len(prompt) - 1)
        exact = lcp if self.exact_split(len(history), lcp) else 0
        return exact, lcp

    def _pending(self, slot: int, prompt: Tokens[int], salt: str, live: Mapping[int, LiveSlot]) -> int:
        """Tokens `prompt` shares with the prompt a busy slot is computing, when that slot has not computed them
        all yet (0 otherwise; followers and forks compute no prompt of their own)."""
        e = self.entries[slot]
        if not e.busy or e.salt != salt:
            return 0
        running = live[slot]
        lcp = min(common_prefix(running.prompt, prompt), len(prompt) - 1)
        return lcp if lcp > len(running.history) else 0

    def best_source(self, prompt: Tokens[int], salt: str, own_slot: int,
                    live: Mapping[int, LiveSlot]) -> tuple[int | None, int]:
        """(slot, tokens) of the longest exactly reusable prefix of `prompt` (computed under `salt`) in a slot
        other than `own_slot` now; (None, 0) when there is none."""
        best, usable = None, 0
        for slot in range(len(self.entries)):
            exact = self._usable(slot, prompt, salt, live)[0] if slot != own_slot else 0
            if exact > usable:
                best, usable = slot, exact
        return best, usable

    def place(self, prompt: Tokens[int], salt: str, live: Mapping[int, LiveSlot],
              reuse: bool = True, session: str = "", preempt: bool = False) -> Placement | None:
        """Choose a slot for a new prompt computed under `salt` and mark it busy (None: every slot is in use,
        wait). reuse=False places it without looking for a prefix (a fork, or penalties over the whole prompt).
        `session`: the prompt's session (it may take over its own leased slot); `preempt`: it has waited long
        enough to take the oldest lease's slot when no other slot is free."""
        self.clock += 1
        self._expire_leases()
        best, best_usable, share, leader, lead = None, 0, 0, None, 0
        if reuse:
            for slot in range(len(self.entries)):
                exact, lcp = self._usable(slot, prompt, salt, live)
                if exact > best_usable or (exact == best_usable and exact and self._takeover_ok(slot, session)):
                    best, best_usable = slot, exact
                if not exact and lcp >= self.min_share:
                    share = max(share, lcp)
                pending = self._pending(slot, prompt, salt, live)
                if pending > lead:
                    leader, lead = slot, pending
        gain = lead - best_usable
        if leader is not None and gain > 0 and (gain >= self.min_share or lead == len(prompt) - 1):
            target = self.victim(session=session, preempt=preempt)  # wait for the leader's prefix in a slot of its own
            if target is None:
                return None
            self.queries += 1
            self._own(target, salt)
            return Placement(slot=target, copy_from=None, cached=0, leader=leader, share=lead)
        if best is not None and self._takeover_ok(best, session):
            target, source = best, None
        else:
            target = self.victim(exclude=best, session=session, preempt=preempt)
            source = best if best is not None and best_usable else None
        if target is None:
            return None
        if source is None and target != best:
            best_usable = 0
        self.queries += 1
        self.hits += bool(best_usable)
        snapshot_at = share if share > best_usable + self.min_share and self.max_snapshots else None
        self._own(target, salt)
        return Placement(slot=target, copy_from=source, cached=best_usable, snapshot_at=snapshot_at)

    def _own(self, slot: int, salt: str) -> None:
        e = self.entries[slot]
        e.busy, e.pinned, e.tokens, e.last_used, e.salt = True, False, [], self.clock, salt
        e.lease = ""

    def _takeover_ok(self, slot: int, session: str = "") -> bool:
        e = self.entries[slot]
        return not e.busy and not e.pinned and e.lease in ("", session)

    def victim(self, exclude: int | None = None, session: str = "", preempt: bool = False) -> int | None:
        """A slot without a running sequence to (re)use: empty first, then least recently used unpinned, then
        least recently used pinned; slots leased to another session only for a prompt placed with `preempt`
        (the oldest lease first). None if every slot is in use."""
        free = [i for i, e in enumerate(self.entries) if not e.busy and i != exclude]
        candidates = [i for i in free if self.entries[i].lease in ("", session)]
        if candidates:
            return min(candidates, key=lambda i: (bool(self.entries[i].tokens), self.entries[i].pinned,
                                                  self.entries[i].last_used))
        if free and preempt:
            self.preempted += 1
            return min(free, key=lambda i: self.entries[i].lease_since)
        return None

    def release(self, slot: int, history: Tokens[int], session: str = "", ttl: float = 0.0) -> None:
        """A busy slot's sequence finished: the slot keeps the KV of `history` (everything it computed), for later
        prompts; leased to `session` for `ttl` seconds when both are given (ending any other lease of that
        session, and the oldest lease beyond `max_leases`); ttl 0 ends the session's lease."""
        e = self.entries[slot]
        e.tokens, e.busy, e.last_used = list(history), False, self.clock
        if not session:
            return
        now = self.now()
        for other in self.entries:
            if other.lease == session:
                other.lease = ""
        if ttl > 0 and self.max_leases > 0:
            e.lease, e.lease_until, e.lease_since = session, now + ttl, now
            held = sorted((x for x in self.entries if x.lease), key=lambda x: x.lease_since)
            for x in held[: max(0, len(held) - self.max_leases)]:
                x.lease = ""

    def _expire_leases(self) -> None:
        now = self.now()
        for e in self.entries:
            if e.lease and now >= e.lease_until:
                e.lease = ""

    def leased_slots(self) -> int:
        """Slots leased to a session now."""
        self._expire_leases()
        return sum(1 for e in self.entries if e.lease)

    def snapshot_slot(self, source: int) -> int | None:
        """A slot to hold a new snapshot of `source` (evicting the oldest snapshot beyond max_snapshots)."""
        pinned = [i for i, e in enumerate(self.entries) if e.pinned and not e.busy]
        if len(pinned) >= self.max_snapshots:
            slot = min(pinned, key=lambda i: self.entries[i].last_used, default=None)
        else:
            slot = self.victim(exclude=source)
        return slot

    def pin(self, slot: int, tokens: Tokens[int], salt: str = "") -> None:
        """Mark a slot as a snapshot holding `tokens`, computed under `salt`."""
        self.clock += 1
        e = self.entries[slot]
        e.tokens, e.busy, e.pinned, e.last_used, e.salt = list(tokens), False, True, self.clock, salt

    def cached_slots(self) -> int:
        """Slots holding a finished sequence's or a snapshot's KV."""
        return sum(1 for e in self.entries if not e.busy and e.tokens)
