"""Stored Responses (`store: true`): what `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` need.

Each tenant (API key; "" when the API is open) has its own byte-bounded LRU (gateway/core/lru.py), so one tenant can
neither read another's responses nor push them out; an entry also expires after a time limit. An entry holds the
response object as returned and the conversation it ends as chat messages (the request's messages, without its
`instructions`, which OpenAI does not carry over, and the answer as one assistant message), so the next turn's
prompt is the same conversation plus the new input — a prefix hit on the worker.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

from gateway.core.lru import ByteLRU


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    """A stored response: the object as returned, the conversation's chat messages, the session key its turns
    route by (the first response id of the chain), when it was stored (monotonic seconds), and its request's
    input items (`GET /v1/responses/{id}/input_items`)."""

    response: dict
    messages: list[dict]
    session_key: str
    stored_at: float
    input_items: list[dict] = dataclasses.field(default_factory=list)


class ResponseStore:
    """Per-tenant, byte-bounded, expiring map from response id to StoredResponse."""

    def __init__(self, budget_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        """
        Args:
          budget_bytes: bytes of stored entries per tenant (estimated as their JSON's length).
          ttl_s: seconds an entry stays retrievable.
          clock: monotonic seconds (tests pass a fake one).
        """
        self.budget, self.ttl, self._clock = budget_bytes, ttl_s, clock
        self._tenants: dict[str, ByteLRU[str, StoredResponse]] = {}

    def _lru(self, tenant: str) -> ByteLRU[str, StoredResponse]:
        lru = self._tenants.get(tenant)
        if lru is None:
            lru = self._tenants[tenant] = ByteLRU(self.budget, lambda key, entry: len(key) + _size(entry))
        return lru

    def put(self, tenant: str, response: dict, messages: list[dict], session_key: str,
            input_items: list[dict] | None = None) -> bool:
        """Store a response under its `id`; False when it alone is larger than the budget (not stored)."""
        entry = StoredResponse(response, messages, session_key, self._clock(), input_items or [])
        return self._lru(tenant).put(response["id"], entry)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The live entry of `response_id` within `tenant`, or None (unknown, evicted, expired or another
        tenant's)."""
        lru = self._tenants.get(tenant)
        entry = lru.get(response_id) if lru is not None else None
        if entry is not None and self._clock() - entry.stored_at > self.ttl:
            lru.pop(response_id)
            return None
        return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget a response; False when there was none."""
        if self.get(tenant, response_id) is None:
            return False
        self._tenants[tenant].pop(response_id)
        return True


def _size(entry: StoredResponse) -> int:
    return len(json.dumps([entry.response, entry.messages, entry.input_items], ensure_ascii=False)) + \
        len(entry.session_key)
