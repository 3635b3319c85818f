"""OpenAI logprobs objects from the worker's per-token log-probabilities.

Values are the worker's `log_softmax` of the processed logits (after logit bias, penalties and masks, before
temperature: model_worker/modeling/sampling.py). Control tokens left out of the text (skip_special_tokens) are left out
of the logprobs too.

Token strings. Each token's `token` is the text that token completes, decoded exactly as the answer's text is
(gateway/generation/detokenizer.py): a token that is a piece of a character split across tokens (Gemma's byte-fallback
tokens `<0xF0>`...) gives "", and the token that completes the character carries the whole character — with the
dangling bytes of a token-id prompt when the answer completes a character the prompt began. So a choice's token
strings concatenate to exactly its text (up to a stop string's cut), completions' `text_offset` stays consistent,
and a piece of a character is never U+FFFD (U+FFFD appears only for bytes that can never be valid UTF-8).
OpenAI and vLLM decode each token on its own and show a replacement character for such pieces, which breaks both
properties and shows text the answer does not contain. `bytes` is always the token's exact raw bytes. An
alternative's `token` is the text it would have completed in the chosen token's place (a control token: its
spelling).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.backends.model_facts import ModelFacts
from gateway.generation.detokenizer import IncrementalDetokenizer
from protos import common_pb2


def visible(facts: ModelFacts, tokens: list[common_pb2.GeneratedToken], skip_special: bool):
    """The tokens that appear in the text."""
    return [t for t in tokens if not (skip_special and t.token_id in facts.special_ids)]


class TokenStrings:
    """The `token` strings of one choice's visible tokens, in order (module docstring).

    Args:
      facts: the vocabulary.
      prompt_ids: the choice's prompt (its dangling bytes prime the decoder, as for the answer's text).
    """

    def __init__(self, facts: ModelFacts, prompt_ids: Sequence[int] = ()):
        self._facts = facts
        # Only visible tokens arrive here, so a control token that does is text (skip_special_tokens off).
        self._detok = IncrementalDetokenizer(facts.token_bytes, facts.special_ids, skip_special_tokens=False)
        self._detok.prime(prompt_ids)

    def alternative(self, token_id: int) -> str:
        """What `token_id` would complete at the current position (call before `chosen`)."""
        if token_id in self._facts.special_ids:
            return self._facts.token_bytes[token_id].decode("utf-8", errors="replace")
        return self._detok.peek(token_id)

    def chosen(self, token_id: int) -> str:
        """The text the generated token completes; advances to the next position."""
        return self._detok.push(token_id)


def chat_content(facts: ModelFacts, tokens: list[common_pb2.GeneratedToken], top_n: int,
                 strings: TokenStrings | None = None) -> list[dict]:
    """`choices[].logprobs.content` entries: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}.

    Args:
      tokens: visible tokens (see `visible`).
      strings: the choice's TokenStrings, carried across a stream's chunks (None: these tokens start the answer).
    """
    strings = strings if strings is not None else TokenStrings(facts)
    out = []
    for t in tokens:
        alts = [{"token": strings.alternative(alt.token_id), "logprob": alt.logprob,
                 "bytes": list(facts.token_bytes[alt.token_id])} for alt in list(t.top_logprobs)[:top_n]]
        out.append({"token": strings.chosen(t.token_id), "logprob": t.logprob,
                    "bytes": list(facts.token_bytes[t.token_id]), "top_logprobs": alts})
    return out


class CompletionLogprobs:
    """Accumulates the legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, facts: ModelFacts, top_n: int, offset: int = 0, prompt_ids: Sequence[int] = ()):
        """Args: facts: the vocabulary; top_n: alternatives per token; offset: the text offset of the first token
        (the echoed prompt's length); prompt_ids: the choice's prompt (see TokenStrings)."""
        self.facts, self.top_n, self.offset = facts, top_n, offset
        self.strings = TokenStrings(facts, prompt_ids)

    def chunk(self, tokens: list[common_pb2.GeneratedToken]) -> dict:
        """The logprobs object for these visible tokens (strings and text offsets continue from the previous
        chunk)."""
        obj = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            top = {}
            for alt in list(t.top_logprobs)[: self.top_n]:
                top.setdefault(self.strings.alternative(alt.token_id), alt.logprob)
            text = self.strings.chosen(t.token_id)
            obj["tokens"].append(text)
            obj["token_logprobs"].append(t.logprob)
            obj["top_logprobs"].append(top)
            obj["text_offset"].append(self.offset)
            self.offset += len(text)
        return obj

