"""The answer budget — how many tokens a choice may generate — read from the request once and decided once.

Two steps, both here and nowhere else in the gateway:

1. `read_limit` at the front door, before any backend is asked: which field set the limit (`max_tokens`, or
   `max_completion_tokens`, which wins), OpenAI's default of 16 for a completion without one, the
   `--max-tokens-cap` (a 400 past it, or a lowering for the Messages API), and the range (at least 1). The result,
   an `AnswerLimit`, keeps the field's name for every later error.
2. `answer_budget` once the prompt is tokenized: the int each choice's `GenParams.max_tokens` carries to the
   worker — as asked, or what the context leaves (at most the cap) when nothing was asked; a 400 naming the field
   when the prompt and the limit exceed `max_model_len`.

The worker checks the number again at its own trust boundary (model_worker/server/service.py); nothing between
re-derives it.
"""

from __future__ import annotations

import dataclasses

from gateway.core.errors import ApiError
from gateway.core.limits import Limits
from gateway.core.openai_types import CompletionRequest, SamplingFields

#: OpenAI's answer limit for a completion that sends no `max_tokens` (a chat without one gets what fits).
COMPLETION_DEFAULT = 16


@dataclasses.dataclass(frozen=True)
class AnswerLimit:
    """The answer limit a request asks for (`read_limit`).

    Attributes:
      asked: tokens per choice (None: whatever fits, at most `--max-tokens-cap`); already within the cap.
      param: the request field that set it, named in errors (`max_tokens`, `max_completion_tokens`; the Responses
        and Messages APIs rename it back to their own field).
      sent: the client sent it (False: a default the server chose, a completion's 16): only a limit sent is
        refused for being below a grammar's shortest answer; a chosen one cuts the answer, as before.
      clamp: a limit beyond the cap or the context's room is lowered to it instead of refused (Anthropic's
        Messages API: Claude Code asks for 32,000 on every request).
    """

    asked: int | None
    param: str = "max_tokens"
    sent: bool = True
    clamp: bool = False

    def floor_param(self) -> str | None:
        """The field to name when a budget is below a grammar's shortest answer: this limit's, when the client
        sent it as it stands; None when the server chose or lowered it (the answer is then only cut)."""
        return self.param if self.asked is not None and self.sent and not self.clamp else None

    def echoed(self, budget: int, limits: Limits) -> int | None:
        """What the Responses API echoes as `max_output_tokens`: the first prompt's `budget` when the request or
        the server's cap set a limit, None when only the context bounds it."""
        return budget if self.asked is not None or limits.max_tokens_cap is not None else None


def read_limit(req: SamplingFields, limits: Limits, clamp: bool = False) -> AnswerLimit:
    """The answer limit `req` asks for, checked without any backend (so bad input is a 400 even while a backend
    is down).

    Args:
      req: a `CompletionRequest` (its `max_tokens`; absent: 16, at most the cap; null: whatever fits) or a
        `ChatCompletionRequest` (`max_completion_tokens`, else `max_tokens`; absent or null: whatever fits).
      clamp: lower a limit past the cap to it instead of refusing it (`AnswerLimit.clamp`).
    Raises:
      ApiError: 400 naming the field for a limit below 1, or above `--max-tokens-cap` without `clamp`.
    """
    cap = limits.max_tokens_cap
    if isinstance(req, CompletionRequest):
        sent = "max_tokens" in req.model_fields_set
        asked = req.max_tokens if sent else COMPLETION_DEFAULT if cap is None else min(COMPLETION_DEFAULT, cap)
        param = "max_tokens"
    else:
        sent = True
        asked, param = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                        else (req.max_tokens, "max_tokens"))
    if clamp and asked is not None and cap is not None:
        asked = min(asked, cap)
    if asked is not None and asked < 1:
        raise ApiError(400, f"{param} must be at least 1, got {asked}", param=param)
    if asked is not None and cap is not None and asked > cap:
        raise ApiError(400, f"{param} must be at most {cap} on this server, got {asked}", param=param)
    return AnswerLimit(asked, param, sent, clamp)


def answer_budget(prompt_len: int, limit: AnswerLimit, limits: Limits, max_model_len: int) -> int:
    """A prompt's answer limit in tokens, decided here once for every front door and carried in `GenParams` to
    the worker: `limit.asked` as sent, lowered to the context's room when `limit.clamp`; when absent, what fits in
    the context (`max_model_len - prompt_len`), at most `--max-tokens-cap`.

    Raises:
      ApiError: 400 (`context_length_exceeded`, naming the field) when the prompt leaves no room, or the prompt and
        the limit asked exceed max_model_len.
    """
    asked, room = limit.asked, max_model_len - prompt_len
    if room <= 0:
        raise ApiError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                 f"{prompt_len} tokens, which leaves no room for a completion. Please shorten the prompt.",
            param="messages" if limit.param == "max_completion_tokens" else "prompt",
            code="context_length_exceeded")
    if asked is None:
        return room if limits.max_tokens_cap is None else min(limits.max_tokens_cap, room)
    if limit.clamp:
        asked = min(asked, room)
    if asked > room:
        raise ApiError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                 f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} for the completion). Please "
                 f"reduce the prompt or {limit.param}.", param=limit.param, code="context_length_exceeded")
    return asked
