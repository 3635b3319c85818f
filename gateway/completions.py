"""Running a planned request's choices, and the pieces of OpenAI response objects both endpoints share.

Both endpoints run `n` choices per prompt concurrently through `generate.generate`; streaming merges the choices'
deltas as they arrive. Usage sums completion tokens over choices and counts each prompt once, identically for
streamed and non-streamed responses.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from gateway.clients import Backends
from gateway.generate import Delta, generate
from gateway.history import answer_key


async def run_choices(backends: Backends, jobs: list) -> AsyncIterator[tuple[int, Delta]]:
    """Run the planned jobs (gateway/planner.Job) concurrently; yields (choice index, delta) as they arrive.

    Raises:
      ApiError: the first error of any choice (the others are cancelled and aborted).
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(job):
        try:
            async for delta in generate(backends, job.prompt, job.params, job.request_id):
                await queue.put((job.index, delta))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
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


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI usage object (cached_tokens: prompt tokens whose KV was reused)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def remember_answer(backends: Backends, scope: str, route, delta: Delta, tokens: list, stop_ids: list[int]) -> None:
    """Remember a whole answer's exact ids (all generated tokens but a final stop token) under its content and
    tool calls, within `scope`, for later turns (gateway/history.py). Answers with a thought, cut by a stop string
    or with a cut-off call are not remembered: the client cannot send them back as generated."""
    if not delta.whole or route.reasoning or route.truncated:
        return
    ids = [t.token_id for t in tokens]
    if ids and ids[-1] in set(stop_ids) | set(backends.ready_facts().stop_ids):
        ids = ids[:-1]
    message = route.message()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    backends.answers.remember(scope, answer_key(message["content"], calls), ids)


class ResponseIds:
    """id/created/model shared by every chunk of one response."""

    def __init__(self, prefix: str, model: str):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def head(self, obj: str) -> dict:
        """The common fields of a response or chunk object."""
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}
