"""The exact tokens of recent answers, so a conversation sent back as chat messages renders token-for-token as
the model produced it.

Agents resend the whole conversation every turn, the model's earlier answers included. Re-tokenizing an answer's
text rarely gives back the same tokens (templates trim it; text can split differently), and then the new prompt
departs from the KV the worker kept right where the answer starts, so the answer is recomputed every turn. The
gateway remembers, for every answer it returns (gateway/generation/choices.py `remember_answer`: calls, a thought,
answers cut by `max_tokens` or a stop string), its generated token ids under the answer as the client sees it —
its `content`, its `tool_calls` (name and arguments text, a cut-off call's JSON prefix included) and its
`reasoning_content` — and passes the ids with any assistant message that carries exactly that answer
(`ChatMessage.generated_token_ids`).

Safety. Entries are scoped: a request finds only answers remembered under its own scope (its API key's tenant and
its `cache_salt`: `history_scope`), so one tenant can never plant token ids under a text another tenant later sends. The
tokenizer service uses the ids only when their control tokens are exactly those the template itself renders for that
message (tokenizer_svc `chat_template.Segment.fallback`), so ids with a control token forced by `logit_bias` never forge
a turn. Memory is bounded by bytes (`ByteLRU`), not entries.
"""

from __future__ import annotations

import json

from gateway.core.lru import ByteLRU, text_size

#: Estimated bytes of remembered answers (keys and ids).
HISTORY_BYTES = 64 << 20


def history_scope(tenant: str, cache_salt: str | None) -> str:
    """The answer-history scope of a request: its tenant (gateway/api/auth.py; "" when the API is open) and its
    `cache_salt`, joined by a NUL (a tenant is hex, so the first NUL ends it and the pair is unambiguous)."""
    return f"{tenant}\x00{cache_salt or ''}"


def prefix_salt(scope: str, shared: bool = False) -> str:
    """The worker's prefix-cache scope (`PrefillRequest.cache_salt`) of a request whose answer-history scope is
    `scope`: its `cache_salt` alone when the API is open (or with `shared`, the `--share-prefix-cache-across-keys`
    opt-in), else the tenant and the salt. Per tenant by default because a prefix hit is visible to the client
    (`cached_tokens`, and the time to first token): a shared cache tells tenant B whether tenant A sent a text."""
    tenant, _, salt = scope.partition("\x00")
    return salt if shared or not tenant else scope


def answer_key(content: str | None, tool_calls: list[tuple[str, str]] = (), reasoning: str | None = None) -> str:
    """The lookup key of an assistant answer: its content (None for a tool-call answer without text), its calls'
    (name, arguments text) and its reasoning_content (None or "" for none), exactly as returned to the client.

    The reasoning is part of the key because the ids hold the thought: a client that drops reasoning_content
    sends another message (the template renders no thought for it), which must not get ids that write one."""
    answer = [content, [list(c) for c in tool_calls]] + ([reasoning] if reasoning else [])
    return json.dumps(answer, ensure_ascii=False, separators=(",", ":"))


class AnswerHistory:
    """An LRU map from (scope, answer key) to the token ids the model generated for that answer."""

    def __init__(self, budget: int = HISTORY_BYTES):
        """Args: budget: estimated bytes of entries kept (least recently used forgotten first)."""
        self._map: ByteLRU[tuple[str, str], tuple[int, ...]] = ByteLRU(
            budget, lambda key, ids: text_size(key[0], key[1]) + 8 * len(ids))

    def remember(self, scope: str, key: str, token_ids: list[int]) -> None:
        """Record an answer returned in full (`key` from `answer_key`)."""
        if key and token_ids:
            self._map.put((scope, key), tuple(token_ids))

    def lookup(self, scope: str, key: str) -> tuple[int, ...] | None:
        """The generated ids of exactly this answer within `scope`, or None."""
        return self._map.get((scope, key))

    def __len__(self) -> int:
        return len(self._map)
