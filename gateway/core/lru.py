"""One least-recently-used map with a byte budget, for every cache the gateway keys by client input.

A cache keyed by what clients send (schemas, regexes, answer texts) grows with every new key a client invents,
so counting entries is no bound: one entry may be a 100 KiB schema. Each entry here is charged an estimate of the
bytes it holds (the caller's `sizeof`, e.g. the lengths of the key and value strings plus a fixed overhead), and
the least recently used entries are dropped until the total fits the budget. An entry larger than the whole
budget is not stored at all.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Bytes charged per entry on top of its own estimate: the dict slot, the key tuple and the object headers.
ENTRY_OVERHEAD = 200


class ByteLRU(Generic[K, V]):
    """A thread-safe LRU map whose entries' estimated sizes sum to at most `budget` bytes.

    Thread-safe because grammar compilation and mask work run on worker threads next to the event loop.
    """

    def __init__(self, budget: int, sizeof: Callable[[K, V], int]):
        """
        Args:
          budget: the most bytes the entries may hold together (>= 0; 0 stores nothing).
          sizeof: estimated bytes of one entry (key and value), without ENTRY_OVERHEAD.

        Raises:
          ValueError: a negative budget.
        """
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        self.budget = int(budget)
        self._sizeof = sizeof
        self._map: collections.OrderedDict[K, tuple[V, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value under `key` (now the most recently used), or `default`."""
        with self._lock:
            entry = self._map.get(key)
            if entry is None:
                self.misses += 1
                return default
            self._map.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: K, value: V) -> bool:
        """Store `value` under `key` (replacing any), then evict least recently used entries over the budget.

        Returns:
          Whether the entry was stored (False when it alone exceeds the budget).
        """
        size = int(self._sizeof(key, value)) + ENTRY_OVERHEAD
        with self._lock:
            old = self._map.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            if size > self.budget:
                return False
            self._map[key] = (value, size)
            self.nbytes += size
            while self.nbytes > self.budget:
                _, (_, dropped) = self._map.popitem(last=False)
                self.nbytes -= dropped
                self.evictions += 1
            return True

    def pop(self, key: K) -> V | None:
        """Remove and return the value under `key`, or None."""
        with self._lock:
            entry = self._map.pop(key, None)
            if entry is None:
                return None
            self.nbytes -= entry[1]
            return entry[0]

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        with self._lock:
            self._map.clear()
            self.nbytes = 0
            self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map


def text_size(*parts: object) -> int:
    """Estimated bytes of strings, bytes and int sequences: 1 per character or byte, 8 per int (a sizeof helper)."""
    total = 0
    for part in parts:
        if isinstance(part, (str, bytes, bytearray)):
            total += len(part)
        elif isinstance(part, (tuple, list)):
            total += sum(text_size(p) if isinstance(p, (str, bytes, tuple, list)) else 8 for p in part)
        elif part is not None:
            total += 8
    return total
