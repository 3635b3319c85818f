"""One choice runner behind every chat front door: it feeds each choice's deltas through its output splitter, gathers
its tokens, and at the choice's end closes the splitter, adds its usage to the request's and remembers the answer in
the answer history (gateway/backends/history.py: every answer returned is remembered, so a conversation sent back
renders as generated). The doors (`app` streamed and whole chat completions, `answer_blocks` under the Responses and
Messages APIs, gRPC `Generate`) then only render their own shapes.

Plain Python over `planner.Plan` and `generate.Delta`: no I/O but the history's.
"""

from __future__ import annotations

import dataclasses

from gateway.backends.views import AnswerBook
from gateway.generation.choices import remember_answer


@dataclasses.dataclass
class Usage:
    """Token counts summed over a request's finished choices: generated tokens, choice 0's cached prompt tokens
    (the prompt is shared by every choice), and the accepted / rejected prediction tokens (OpenAI Predicted
    Outputs)."""

    completion_tokens: int = 0
    cached_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class ChoiceRunner:
    """The per-choice bookkeeping of one planned request (`planner.Plan`). One owner: the request's handler."""

    def __init__(self, backends: AnswerBook, plan, remember: bool = True):
        """Args: backends: for the answer history; plan: the planned request (its jobs and splitters, one per
        choice); remember: remember each answer (chat answers: True; a raw completion's text is not a message a
        client sends back)."""
        self.backends, self.plan, self.remember = backends, plan, remember
        count = len(plan.jobs)
        self.tokens: list[list] = [[] for _ in range(count)]  # GeneratedTokens per choice
        self.last: list = [None] * count  # each choice's final Delta (None while it runs)
        self.usage = Usage()

    def feed(self, index: int, delta) -> list[dict]:
        """One delta of choice `index`: its chat deltas (the splitter's output; at the end, with the splitter's last
        ones). At the choice's end its usage is added and its answer remembered."""
        splitter = self.plan.splitters[index]
        self.tokens[index].extend(delta.tokens)
        out = splitter.feed(delta)
        if delta.finish_reason:
            out += splitter.finish()
            self._finished(index, delta)
        return out

    def _finished(self, index: int, delta) -> None:
        self.last[index] = delta
        u = delta.usage
        self.usage.completion_tokens += u.completion_tokens
        self.usage.cached_tokens += u.cached_tokens if index == 0 else 0
        self.usage.accepted_prediction_tokens += u.accepted_prediction_tokens
        self.usage.rejected_prediction_tokens += u.rejected_prediction_tokens
        if self.remember:
            remember_answer(self.backends, self.plan.scope, self.plan.splitters[index], delta, self.tokens[index],
                            self.plan.chat.end_ids)

    def finish_reason(self, index: int) -> str | None:
        """Choice `index`'s finish reason as the API reports it (`tool_calls` for an answer of calls), None while
        it runs."""
        last = self.last[index]
        return None if last is None else self.plan.splitters[index].finish_reason(last.finish_reason)

    def predicted(self) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens over the finished choices."""
        return self.usage.accepted_prediction_tokens, self.usage.rejected_prediction_tokens
