"""Running a planned request's choices, and the pieces of OpenAI response objects both endpoints share.

Both endpoints run `n` choices per prompt concurrently through `generate.generate`; streaming merges the choices'
deltas as they arrive. Usage sums completion tokens over choices and counts each prompt once, identically for
streamed and non-streamed responses.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from gateway.backends.history import answer_key
from gateway.backends.views import AnswerBook, WorkerView
from gateway.core.tool_format import SpecialTokens, family_format
from gateway.generation.detokenizer import dangling, prompt_tail
from gateway.generation.generate import Delta, generate


async def run_choices(backends: WorkerView, jobs: list) -> AsyncIterator[tuple[int, Delta]]:
    """Run the planned jobs (gateway/planning/planner.Job) concurrently; yields (choice index, delta) as they arrive.

    Raises:
      ApiError: the first error of any choice (the others are cancelled and aborted).
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(job):
        try:
            async for delta in generate(backends, job.prompt, job.params, job.request_id):
                await queue.put((job.index, delta))
        except BaseException as exc:
            await queue.put(exc)
            raise
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
               prediction: tuple[int, int] | None = None) -> dict:
    """OpenAI usage object (cached_tokens: prompt tokens whose KV was reused; prediction: with Predicted Outputs,
    (accepted, rejected) prediction tokens, reported in `completion_tokens_details` as OpenAI does)."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if prediction is not None:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                              "rejected_prediction_tokens": prediction[1]}
    return usage


def remember_answer(backends: AnswerBook, scope: str, splitter, delta: Delta, tokens: list, end_ids: list[int]) -> None:
    """Remember an answer's exact ids under the message returned for it (content, tool calls, reasoning_content),
    within `scope`, so that message sent back renders as generated (gateway/backends/history.py) — every shape we
    return: text, calls (parallel ones too), text and calls, a thought, content null, and answers cut by `max_tokens`
    (a call cut off inside its arguments included).

    The ids are all generated tokens but a final one of `end_ids` (the chat plan's: the request's stop ids, the
    model's and a tool grammar's end tokens; the template writes the end of the turn), cut to
    what the client received: a stop string that cut the text leaves the ids of exactly the text returned (none
    are remembered when that text ends inside a token), a call cut off before its name was complete (so not
    returned; in a format whose calls open with a control token, like Gemma 4's `<|tool_call>`) is left out, an
    answer cut before any call was returned keeps only its content's ids, and the byte tokens of a character the
    cut left incomplete are dropped (the text drops it too). Inside a returned cut call the ids run to the cut,
    also where its JSON arguments stop short of it (a key or number still being written): the model's own text."""
    facts = backends.ready_facts()
    ids = [t.token_id for t in tokens]
    if ids and ids[-1] in end_ids:
        ids = ids[:-1]
    message = splitter.message()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    if not delta.whole and not splitter.truncated:  # a stop string cut the content (a cut call is returned whole)
        ids = _ids_of_text(ids, message["content"] or "", facts)
    opener = _call_opener(facts) if splitter.truncated else None
    if opener is not None and ids.count(opener) > len(calls):
        ids = ids[:len(ids) - ids[::-1].index(opener) - 1]
    elif splitter.truncated and not calls:  # cut before any call was returned: keep only the content's ids
        ids = _ids_of_text(ids, message["content"] or "", facts)
    ids = _without_dangling_bytes(ids, facts)
    if ids:
        backends.answers.remember(scope, answer_key(message["content"], calls, message.get("reasoning_content")), ids)


def _call_opener(facts) -> int | None:
    """The id of the control token that opens a call in the served family's format (its first call marker), or
    None for a format whose calls are text (Gemma 3's). Looked up only for an answer cut short."""
    markers = family_format(facts.architecture).call_markers
    return SpecialTokens(facts.token_bytes, facts.special_ids)[markers[0]] if markers else None


def _without_dangling_bytes(ids: list[int], facts) -> list[int]:
    """`ids` without the trailing byte tokens of a character the cut left incomplete (the text returned drops
    it: gateway/generation/detokenizer.py), so remembered ids never carry bytes the client did not get."""
    tail = prompt_tail(facts.token_bytes, facts.special_ids, ids)
    extra = dangling(tail)
    while extra > 0 and ids and ids[-1] not in facts.special_ids:
        extra -= len(facts.token_bytes[ids[-1]])
        ids = ids[:-1]
    return ids


def _ids_of_text(ids: list[int], text: str, facts) -> list[int]:
    """The prefix of `ids` whose text after its last control token is exactly `text` (the content a stop string
    cut; a thought before it ends with a control token), or [] when none is."""
    start = max((n + 1 for n, t in enumerate(ids) if t in facts.special_ids), default=0)
    want, size = text.encode("utf-8"), 0
    for n in range(start, len(ids) + 1):
        if size == len(want):
            return ids[:n] if b"".join(facts.token_bytes[t] for t in ids[start:n]) == want else []
        if n == len(ids) or size > len(want):
            return []
        size += len(facts.token_bytes[ids[n]])
    return []


class ResponseIds:
    """id/created/model shared by every chunk of one response."""

    def __init__(self, prefix: str, model: str):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def head(self, obj: str) -> dict:
        """The common fields of a response or chunk object."""
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}
