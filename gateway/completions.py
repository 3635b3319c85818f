"""OpenAI request bodies -> prompts and GenParams; generations -> OpenAI response objects and SSE chunks.

Both endpoints run `n` choices per prompt concurrently through `generate.generate`; streaming merges the choices'
deltas as they arrive. Usage sums completion tokens over choices and counts each prompt once, identically for
streamed and non-streamed responses.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from gateway.clients import Backends
from gateway.errors import ApiError
from gateway.generate import Delta, GenParams, generate
from gateway.openai_types import ChatCompletionRequest, CompletionRequest, SamplingFields
from protos import common_pb2, tokenizer_pb2


def sampling_from_request(req: SamplingFields) -> common_pb2.SamplingParams:
    """OpenAI sampling fields -> worker SamplingParams (OpenAI defaults: temperature 1, top_p 1).

    Raises:
      ApiError: 400 for a logit_bias key that is not a token id.
    """
    sp = common_pb2.SamplingParams(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=max(req.top_k or 0, 0),
        min_p=float(req.min_p or 0.0),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=float(req.repetition_penalty or 1.0),
    )
    for key, bias in (req.logit_bias or {}).items():
        try:
            sp.logit_bias[int(key)] = float(bias)
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    if req.seed is not None:
        sp.seed = req.seed & 0xFFFFFFFFFFFFFFFF
    return sp


def validate_fields(req: SamplingFields, max_tokens: int | None, param: str = "max_tokens") -> None:
    """Checks that need no backend (done first, so bad input is a 400 even while a backend is down).

    Raises:
      ApiError: 400 for bad stop strings or max_tokens.
    """
    stops = req.stop_list()
    if len(stops) > 4:
        raise ApiError(400, f"at most 4 stop sequences are allowed, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop sequences must not be empty", param="stop")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{param} must be at least 1, got {max_tokens}", param=param)


def gen_params(req: SamplingFields, max_tokens: int | None, choice: int, top_logprobs: int = 0,
               share_prompt_with: str | None = None) -> GenParams:
    """GenParams for choice number `choice` (a seeded request gives choice i the seed + i).

    Args:
      top_logprobs: alternatives per token to return (logprobs are always computed by the worker).
      share_prompt_with: request id of choice 0 when this choice shares its prompt (n > 1).
    Raises:
      ApiError: 400 for bad stop strings, max_tokens or logit_bias.
    """
    validate_fields(req, max_tokens)
    stops = req.stop_list()
    sp = sampling_from_request(req)
    sp.logprobs = True
    sp.top_logprobs = top_logprobs
    if sp.HasField("seed"):
        sp.seed = (sp.seed + choice) & 0xFFFFFFFFFFFFFFFF
    return GenParams(
        sampling=sp,
        max_tokens=max_tokens,
        stop=stops,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        allowed_token_ids=list(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
        share_prompt_with=share_prompt_with,
    )


def choice_jobs(prompt: list[int], req: SamplingFields, max_tokens: int | None, n: int, first_index: int = 0,
                top_logprobs: int = 0, constraint=None) -> list[tuple[int, list[int], GenParams, str]]:
    """(index, prompt, params, request id) for the n choices of one prompt; choices 1..n-1 share choice 0's
    prompt KV on the worker instead of computing the prompt again. `constraint`: a factory of per-choice
    grammar matchers, or None."""
    rid0 = f"gen-{uuid.uuid4().hex}"
    jobs = []
    for j in range(n):
        params = gen_params(req, max_tokens, j, top_logprobs, share_prompt_with=rid0 if j else None)
        params.constraint = constraint() if constraint is not None else None
        jobs.append((first_index + j, prompt, params, rid0 if j == 0 else f"{rid0}-{j}"))
    return jobs


def check_model(backends: Backends, model: str | None) -> str:
    """The served model id; a request naming another model is a 404 (as vLLM does).

    Raises:
      ApiError: 404 unknown model; 503 not ready.
    """
    name = backends.ready_facts().name
    if model is not None and model != name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{name}`.", param="model",
                       code="model_not_found")
    return name


async def completion_prompts(backends: Backends, req: CompletionRequest) -> list[tuple[list[int], str]]:
    """The prompts of a completion request as (token ids, text); text prompts get BOS and parse control tokens.

    Raises:
      ApiError: 400 for an empty prompt or out-of-range token ids.
    """
    p = req.prompt
    if isinstance(p, str):
        texts: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        texts = [list(p)]
    else:
        texts = list(p)
    if not texts:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    out = []
    vocab = backends.ready_facts().vocab_size
    for item in texts:
        if isinstance(item, str):
            reply = await backends.call(
                "tokenizer service",
                backends.tokenizer.Encode(tokenizer_pb2.EncodeRequest(text=item, add_bos=True, parse_special=True)),
            )
            out.append((list(reply.token_ids), item))
        else:
            if not item:
                raise ApiError(400, "prompt token lists must not be empty", param="prompt")
            bad = [t for t in item if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt token id {bad[0]} is out of range [0, {vocab})", param="prompt")
            out.append((list(item), ""))
    return out


def message_to_pb(m, answers=None) -> tokenizer_pb2.ChatMessage:
    """OpenAI ChatMessage -> tokenizer proto (an assistant answer we generated carries its exact token ids)."""
    pb = tokenizer_pb2.ChatMessage(role=m.role, name=m.name or "", tool_call_id=m.tool_call_id or "",
                                   reasoning_content=m.reasoning_content or "")
    if isinstance(m.content, str):
        pb.content = m.content
        exact = answers.lookup(m.content) if answers is not None and m.role == "assistant" else None
        if exact:
            pb.generated_token_ids.extend(exact)
    elif m.content is not None:
        pb.content_parts.extend(tokenizer_pb2.ContentPart(type=p.type, text=p.text or "") for p in m.content)
    for call in m.tool_calls or []:
        pb.tool_calls.append(tokenizer_pb2.ToolCall(id=call.id, name=call.function.name,
                                                    arguments_json=call.function.arguments))
    return pb


async def chat_prompt(backends: Backends, req: ChatCompletionRequest, template_kwargs: dict | None = None
                      ) -> list[int]:
    """Render the conversation (and `req.tools`) with the model's chat template; `template_kwargs` are the
    template options (chat_template_kwargs plus what the plan derived, e.g. enable_thinking).

    Raises:
      ApiError: 400 when the template cannot render it (the tokenizer service names the problem).
    """
    request = tokenizer_pb2.ChatTemplateRequest(
        messages=[message_to_pb(m, backends.answers) for m in req.messages],
        add_generation_prompt=True,
        tools_json=json.dumps(req.tools) if req.tools else "",
        template_kwargs_json=json.dumps(template_kwargs) if template_kwargs else "",
    )
    reply = await backends.call("tokenizer service", backends.tokenizer.ApplyChatTemplate(request))
    return list(reply.token_ids)


async def run_choices(
    backends: Backends, jobs: list[tuple[int, list[int], GenParams, str]]
) -> AsyncIterator[tuple[int, Delta]]:
    """Run several generations concurrently; yields (choice index, delta) as they arrive.

    Raises:
      ApiError: the first error of any choice (the others are cancelled and aborted).
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index, prompt, params, rid):
        try:
            async for delta in generate(backends, prompt, params, rid):
                await queue.put((index, delta))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put(exc)
            raise
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(*job)) for job in jobs]
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


def remember_answer(backends: Backends, text: str, delta: Delta, tokens: list) -> None:
    """Remember a whole answer's exact ids (all generated tokens but a final stop token) for later turns."""
    if not delta.whole:
        return
    ids = [t.token_id for t in tokens]
    facts = backends.ready_facts()
    if ids and ids[-1] in facts.stop_ids:
        ids = ids[:-1]
    backends.answers.remember(text, ids)


class ResponseIds:
    """id/created/model shared by every chunk of one response."""

    def __init__(self, prefix: str, model: str):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def head(self, obj: str) -> dict:
        """The common fields of a response or chunk object."""
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}
