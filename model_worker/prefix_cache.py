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
slot's KV waits for it instead (`Placement.leader`): when the shared part is all but the prompt's last token, or
at least `min_share` tokens longer than the best exact reuse. The scheduler copies the leader's slot once it has
computed the shared part (`best_source`).

Shared prompts (a system prompt common to many conversations): when a prompt shares >= `min_share` tokens with a
slot whose ring cannot serve that split, the sequence computes its prompt and, exactly when it has computed the
shared part, the engine copies its slot into a spare one that is *pinned* as a snapshot of that prefix; later
conversations copy from the snapshot. At most `max_snapshots` are pinned (LRU among them).

Scopes: every slot's KV carries the `cache_salt` of the request that computed it, and a prompt is matched only
against slots of its own salt, so a prefix hit (and the `cached_tokens` a client sees) never reveals what a
request with another salt computed (vLLM's `cache_salt`). Eviction ignores salts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model_worker.scheduler import Sequence


@dataclasses.dataclass
class SlotEntry:
    """One slot's contents.

    Attributes:
      tokens: the token ids whose KV the slot holds (positions 0..len-1) while no sequence owns it.
      owner: the running sequence using the slot, or None.
      last_used: clock value of the last admission or release (LRU).
      pinned: a shared-prefix snapshot, evicted only after unpinned slots.
      salt: the cache_salt of the requests whose KV the slot holds (only prompts with this salt reuse it).
    """

    tokens: list[int] = dataclasses.field(default_factory=list)
    owner: Sequence | None = None
    last_used: int = 0
    pinned: bool = False
    salt: str = ""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a new sequence goes: its slot, a slot to copy from first (or None), and its reused prefix length;
    or a leader whose prompt computation it waits for, to copy `share` tokens of it then."""

    slot: int
    copy_from: int | None
    cached: int
    leader: Sequence | None = None
    share: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Owns the slots' histories, owners and LRU order."""

    def __init__(self, num_slots: int, slack: int, max_snapshots: int | None = None, min_share: int = 32):
        """Args: num_slots: slots; slack: ring positions beyond the window (see KVCache); max_snapshots: pinned
        shared-prefix snapshots at most (default num_slots // 4); min_share: shortest prefix worth a snapshot."""
        self.entries = [SlotEntry() for _ in range(num_slots)]
        self.slack = slack
        self.max_snapshots = max(0, num_slots // 4) if max_snapshots is None else max_snapshots
        self.min_share = min_share
        self.clock = 0
        self.queries = self.hits = 0  # metrics: admissions looked up, admissions that reused a prefix

    def history(self, slot: int) -> list[int]:
        """Token ids whose KV slot `slot` holds now."""
        e = self.entries[slot]
        return e.owner.tokens[: e.owner.num_computed] if e.owner is not None else e.tokens

    def has_free(self) -> bool:
        """Whether some slot has no running sequence."""
        return any(e.owner is None for e in self.entries)

    def exact_split(self, end: int, split: int) -> bool:
        """Whether a slot whose KV holds positions 0..end-1 serves a prompt that shares its first `split` tokens
        exactly: full layers hold every position, sliding rings only `slack` + 1 positions beyond the window."""
        return split >= end - self.slack - 1

    def _usable(self, slot: int, prompt: list[int], salt: str) -> tuple[int, int]:
        """(exact reusable prefix length, plain common prefix length) of `prompt` against a slot; (0, 0) for a
        slot of another salt."""
        if self.entries[slot].salt != salt:
            return 0, 0
        history = self.history(slot)
        lcp = min(common_prefix(history, prompt), len(prompt) - 1)
        exact = lcp if self.exact_split(len(history), lcp) else 0
        return exact, lcp

    def _pending(self, slot: int, seq: Sequence) -> int:
        """Prompt tokens `seq` shares with the prompt the slot's running sequence is computing, when that one has
        not computed them all yet (0 otherwise; followers and forks compute no prompt of their own)."""
        e = self.entries[slot]
        owner = e.owner
        if owner is None or e.salt != seq.cache_salt or owner.leader is not None or owner.fork_of is not None:
            return 0
        lcp = min(common_prefix(owner.prompt, seq.prompt), len(seq.prompt) - 1)
        return lcp if lcp > owner.num_computed else 0

    def best_source(self, seq: Sequence) -> tuple[int | None, int]:
        """(slot, tokens) of the longest exactly reusable prefix of `seq`'s prompt in another slot now; (None, 0)
        when there is none."""
        best, usable = None, 0
        for slot in range(len(self.entries)):
            exact = self._usable(slot, seq.prompt, seq.cache_salt)[0] if slot != seq.slot else 0
            if exact > usable:
                best, usable = slot, exact
        return best, usable

    def place(self, seq: Sequence, reuse: bool = True) -> Placement | None:
        """Choose a slot for a new sequence (None: every slot is in use, wait). Sets seq.snapshot_at when its
        prompt shares a prefix that is worth pinning."""
        self.clock += 1
        best, best_usable, share, leader, lead = None, 0, 0, None, 0
        if reuse:
            for slot in range(len(self.entries)):
                exact, lcp = self._usable(slot, seq.prompt, seq.cache_salt)
                if exact > best_usable or (exact == best_usable and exact and self._takeover_ok(slot)):
                    best, best_usable = slot, exact
                if not exact and lcp >= self.min_share:
                    share = max(share, lcp)
                pending = self._pending(slot, seq)
                if pending > lead:
                    leader, lead = self.entries[slot].owner, pending
        gain = lead - best_usable
        if leader is not None and gain > 0 and (gain >= self.min_share or lead == len(seq.prompt) - 1):
            target = self.victim()  # wait for the leader's prefix in a slot of its own
            if target is None:
                return None
            self.queries += 1
            self._own(target, seq)
            return Placement(slot=target, copy_from=None, cached=0, leader=leader, share=lead)
        if best is not None and self._takeover_ok(best):
            target, source = best, None
        else:
            target = self.victim(exclude=best)
            source = best if best is not None and best_usable else None
        if target is None:
            return None
        if source is None and target != best:
            best_usable = 0
        self.queries += 1
        self.hits += bool(best_usable)
        if share > best_usable + self.min_share and self.max_snapshots:
            seq.snapshot_at = share
        self._own(target, seq)
        return Placement(slot=target, copy_from=source, cached=best_usable)

    def _own(self, slot: int, seq: Sequence) -> None:
        e = self.entries[slot]
        e.owner, e.pinned, e.tokens, e.last_used, e.salt = seq, False, [], self.clock, seq.cache_salt

    def _takeover_ok(self, slot: int) -> bool:
        e = self.entries[slot]
        return e.owner is None and not e.pinned

    def victim(self, exclude: int | None = None) -> int | None:
        """A slot without a running sequence to (re)use: empty first, then least recently used unpinned, then
        least recently used pinned. None if every slot is in use."""
        candidates = [i for i, e in enumerate(self.entries) if e.owner is None and i != exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda i: (bool(self.entries[i].tokens), self.entries[i].pinned,
                                              self.entries[i].last_used))

    def release(self, seq: Sequence) -> None:
        """The sequence finished: its slot keeps the KV of everything it computed, for later prompts."""
        if seq.slot is None:
            return
        e = self.entries[seq.slot]
        if e.owner is seq:
            e.tokens, e.owner, e.last_used = seq.tokens[: seq.num_computed], None, self.clock

    def snapshot_slot(self, source: int) -> int | None:
        """A slot to hold a new snapshot of `source` (evicting the oldest snapshot beyond max_snapshots)."""
        pinned = [i for i, e in enumerate(self.entries) if e.pinned and e.owner is None]
        if len(pinned) >= self.max_snapshots:
            slot = min(pinned, key=lambda i: self.entries[i].last_used, default=None)
        else:
            slot = self.victim(exclude=source)
        return slot

    def pin(self, slot: int, tokens: list[int], salt: str = "") -> None:
        """Mark a slot as a snapshot holding `tokens`, computed under `salt`."""
        self.clock += 1
        e = self.entries[slot]
        e.tokens, e.owner, e.pinned, e.last_used, e.salt = list(tokens), None, True, self.clock, salt

    def cached_slots(self) -> int:
        """Slots holding a finished sequence's or a snapshot's KV."""
        return sum(1 for e in self.entries if e.owner is None and e.tokens)
