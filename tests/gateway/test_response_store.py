"""`ResponseStore` (gateway/api/responses/response_store.py): per tenant, bounded by bytes, expiring."""

from __future__ import annotations

from gateway.api.responses.response_store import ResponseStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_tenants_see_only_their_own_responses():
    store = ResponseStore(1 << 20, 60)
    store.put("a", {"id": "resp_1"}, [{"role": "user", "content": "hi"}], "resp_1")
    assert store.get("a", "resp_1").messages == [{"role": "user", "content": "hi"}]
    assert store.get("b", "resp_1") is None
    assert not store.delete("b", "resp_1") and store.delete("a", "resp_1")
    assert store.get("a", "resp_1") is None and not store.delete("a", "resp_1")


def test_entries_expire_and_the_oldest_are_evicted_by_bytes():
    clock = Clock()
    store = ResponseStore(3000, 10, clock)
    store.put("a", {"id": "old"}, [{"role": "user", "content": "x" * 1000}], "")
    clock.now = 5
    store.put("a", {"id": "new"}, [{"role": "user", "content": "y" * 1000}], "")
    store.put("a", {"id": "newer"}, [{"role": "user", "content": "z" * 1000}], "")
    assert store.get("a", "old") is None  # evicted: three do not fit 3000 bytes
    assert store.get("a", "new") is not None
    clock.now = 16
    assert store.get("a", "new") is None and store.get("a", "newer") is None  # expired
    assert not store.put("a", {"id": "huge"}, [{"role": "user", "content": "w" * 5000}], "")
    store.put("b", {"id": "other"}, [], "")  # another tenant's budget is its own
    assert store.get("b", "other") is not None
