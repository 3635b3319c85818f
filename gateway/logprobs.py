"""OpenAI logprobs objects from the worker's per-token log-probabilities.

Values are the worker's `log_softmax` of the processed logits (after logit bias, penalties and masks, before
temperature: model_worker/sampling.py). Token strings come from the vocabulary bytes (a byte-fallback piece that
is part of a multi-byte character shows as U+FFFD in `token`; `bytes` is always exact). Control tokens left out
of the text (skip_special_tokens) are left out of the logprobs too.
"""

from __future__ import annotations

from gateway.clients import ModelFacts
from protos import common_pb2


def _token(facts: ModelFacts, token_id: int) -> tuple[str, list[int]]:
    raw = facts.token_bytes[token_id]
    return raw.decode("utf-8", errors="replace"), list(raw)


def visible(facts: ModelFacts, tokens: list[common_pb2.GeneratedToken], skip_special: bool):
    """The tokens that appear in the text."""
    return [t for t in tokens if not (skip_special and t.token_id in facts.special_ids)]


def chat_content(facts: ModelFacts, tokens: list[common_pb2.GeneratedToken], top_n: int) -> list[dict]:
    """`choices[].logprobs.content` entries: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
    out = []
    for t in tokens:
        text, raw = _token(facts, t.token_id)
        alts = []
        for alt in list(t.top_logprobs)[:top_n]:
            alt_text, alt_raw = _token(facts, alt.token_id)
            alts.append({"token": alt_text, "logprob": alt.logprob, "bytes": alt_raw})
        out.append({"token": text, "logprob": t.logprob, "bytes": raw, "top_logprobs": alts})
    return out


class CompletionLogprobs:
    """Accumulates the legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, facts: ModelFacts, top_n: int, offset: int = 0):
        self.facts, self.top_n, self.offset = facts, top_n, offset

    def chunk(self, tokens: list[common_pb2.GeneratedToken]) -> dict:
        """The logprobs object for these tokens (text offsets continue from the previous chunk)."""
        obj = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            text, _ = _token(self.facts, t.token_id)
            obj["tokens"].append(text)
            obj["token_logprobs"].append(t.logprob)
            top = {}
            for alt in list(t.top_logprobs)[: self.top_n]:
                top.setdefault(_token(self.facts, alt.token_id)[0], alt.logprob)
            obj["top_logprobs"].append(top)
            obj["text_offset"].append(self.offset)
            self.offset += len(text)
        return obj

