"""The OpenAI-compatible REST API: routes only; the work is in completions.py and generate.py.

Errors are OpenAI-shaped (`{"error": {message, type, param, code}}`): 400 for bad values, 404 for an unknown
model, 429 when the worker's queue is full, 503 while a backend is down or loading, and a generic 500 body (never
a stack trace) for anything unexpected. A client that disconnects aborts its generation on the worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.chat_plan import constraint_factory, plan_chat
from gateway.clients import Backends
from gateway.completions import (
    ResponseIds,
    chat_prompt,
    remember_answer,
    check_model,
    choice_jobs,
    completion_prompts,
    run_choices,
    usage_dict,
    validate_fields,
)
from gateway.logprobs import CompletionLogprobs, chat_content, visible
from gateway.errors import ApiError
from gateway.generate import resolve_max_tokens
from gateway.openai_types import ChatCompletionRequest, CompletionRequest
from protos import tokenizer_pb2

log = logging.getLogger("gemma_serve.gateway")


def _validation_error(exc: RequestValidationError) -> ApiError:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", []) if p != "body"]
    param = ".".join(loc) or None
    return ApiError(400, f"{param or 'request'}: {first.get('msg', 'invalid value')}", param=param,
                    code="invalid_value")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _cancel_on_disconnect(request: Request, coro):
    """Run a handler coroutine; cancel it (aborting its generations) if the client disconnects first."""
    work = asyncio.ensure_future(coro)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    done, _ = await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        watcher.cancel()
        return work.result()
    work.cancel()
    log.info("client disconnected; request cancelled")
    return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled", "param": None,
                                   "code": None}}, status_code=499)


async def _primed(agen: AsyncIterator) -> AsyncIterator:
    """Start a generator now (so errors before the first item become HTTP errors); returns a re-iterable stream."""
    first = await agen.__anext__()

    async def rest():
        yield first
        async for item in agen:
            yield item

    return rest()


def create_app(backends: Backends) -> FastAPI:
    """The FastAPI application over `backends`."""
    app = FastAPI(title="gemma-serve", description="OpenAI-compatible API of gemma-serve")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        if request.url.path != "/metrics":
            backends.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.get("/metrics")
    async def metrics():
        body, content_type = backends.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        err = _validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(ApiError(500, "internal server error", code="internal_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        statuses = await backends.health()
        ok = all(s == "SERVING" for s in statuses.values()) and backends.facts is not None
        body = {"status": "ok" if ok else "unavailable", "backends": statuses}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        facts = backends.ready_facts()
        return {
            "object": "list",
            "data": [{"id": facts.name, "object": "model", "created": int(time.time()), "owned_by": "gemma-serve",
                      "max_model_len": facts.max_model_len}],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _cancel_on_disconnect(request, _completions(backends, body)) if not body.stream else \
            await _completions(backends, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _cancel_on_disconnect(request, _chat(backends, body)) if not body.stream else \
            await _chat(backends, body)

    return app


# ----- /v1/completions -----------------------------------------------------------------------------------------
async def _completions(backends: Backends, req: CompletionRequest):
    validate_fields(req, req.max_tokens)
    model = check_model(backends, req.model)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, 1, req.n):
        raise ApiError(400, "best_of other than n is not supported", param="best_of")
    prompts = await completion_prompts(backends, req)
    max_len = backends.ready_facts().max_model_len
    jobs = []
    for p, (ids, _) in enumerate(prompts):
        resolve_max_tokens(len(ids), req.max_tokens, max_len)
        jobs += choice_jobs(ids, req, req.max_tokens, req.n, p * req.n, top_logprobs=req.logprobs or 0)
    echoes = [await _echo_text(backends, ids, text) if req.echo else "" for ids, text in prompts]
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    ids = ResponseIds("cmpl", model)
    if req.stream:
        stream = await _primed(run_choices(backends, jobs))
        return StreamingResponse(_completion_chunks(backends, ids, stream, req, echoes, prompt_tokens),
                                 media_type="text/event-stream")
    got = await _collect(run_choices(backends, jobs), len(jobs))
    facts = backends.ready_facts()
    choices = []
    for i in range(len(jobs)):
        echo = echoes[i // req.n]
        lp = None
        if req.logprobs is not None:
            lp = CompletionLogprobs(facts, req.logprobs, len(echo)).chunk(
                visible(facts, got.tokens[i], req.skip_special_tokens))
        choices.append({"index": i, "text": echo + got.texts[i], "logprobs": lp, "finish_reason": got.finishes[i]})
    cached = sum(got.cached(p * req.n) for p in range(len(prompts)))
    usage = usage_dict(prompt_tokens, got.completion_tokens, cached)
    return {**ids.head("text_completion"), "choices": choices, "usage": usage}


async def _echo_text(backends: Backends, ids: list[int], text: str) -> str:
    if text:
        return text
    reply = await backends.call("tokenizer service", backends.tokenizer.Decode(
        tokenizer_pb2.DecodeTokensRequest(token_ids=ids, skip_special_tokens=True)))
    return reply.text


class _Gathered:
    """Every choice of a non-streamed response: texts, finish reasons, token protos, last deltas."""

    def __init__(self, count: int):
        self.texts, self.finishes = [""] * count, [None] * count
        self.tokens: list[list] = [[] for _ in range(count)]
        self.last: list = [None] * count

    @property
    def completion_tokens(self) -> int:
        return sum(d.usage.completion_tokens for d in self.last if d is not None)

    def cached(self, index: int) -> int:
        return self.last[index].usage.cached_tokens if self.last[index] is not None else 0


async def _collect(stream, count: int, routes: list | None = None) -> _Gathered:
    """Gather every choice; with `routes` (chat), each delta also goes through its choice's ChatRoute exactly as
    the stream would send it."""
    out = _Gathered(count)
    async for index, delta in stream:
        out.texts[index] += delta.text
        out.tokens[index] += delta.tokens
        if routes is not None:
            routes[index].feed(delta)
        if delta.finish_reason:
            if routes is not None:
                routes[index].finish()
            out.finishes[index] = delta.finish_reason
            out.last[index] = delta
    return out


async def _completion_chunks(backends: Backends, ids: ResponseIds, stream, req: CompletionRequest, echoes,
                             prompt_tokens: int):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    facts = backends.ready_facts()
    completion_tokens = cached = 0
    logprobs: dict[int, CompletionLogprobs] = {}
    try:
        async for index, delta in stream:
            text = delta.text
            if index not in logprobs:
                text = echoes[index // req.n] + text
                logprobs[index] = CompletionLogprobs(facts, req.logprobs or 0, len(text) - len(delta.text))
            if delta.finish_reason:
                completion_tokens += delta.usage.completion_tokens
                cached += delta.usage.cached_tokens if index % req.n == 0 else 0
            lp = None
            if req.logprobs is not None:
                lp = logprobs[index].chunk(visible(facts, delta.tokens, req.skip_special_tokens))
            if text or delta.finish_reason or (lp and lp["tokens"]):
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": delta.finish_reason}
                yield _sse({**ids.head("text_completion"), "choices": [choice], **extra})
        if include_usage:
            usage = usage_dict(prompt_tokens, completion_tokens, cached)
            yield _sse({**ids.head("text_completion"), "choices": [], "usage": usage})
    except ApiError as err:
        yield _sse(err.body())
    yield "data: [DONE]\n\n"


# ----- /v1/chat/completions ------------------------------------------------------------------------------------
async def _chat(backends: Backends, req: ChatCompletionRequest):
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    validate_fields(req, max_tokens, param)
    model = check_model(backends, req.model)
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    facts = backends.ready_facts()
    plan = plan_chat(req, facts)
    prompt = await chat_prompt(backends, req, plan.template_kwargs)
    resolve_max_tokens(len(prompt), max_tokens, facts.max_model_len, param)
    jobs = choice_jobs(prompt, req, max_tokens, req.n, top_logprobs=req.top_logprobs or 0,
                       constraint=await constraint_factory(backends, plan))
    for _, _, params, _ in jobs:
        params.stop_token_ids = sorted(set(params.stop_token_ids) | set(plan.request_stop_ids(facts)))
        for tid in plan.banned_ids:
            params.sampling.logit_bias[tid] = -100.0
    ids = ResponseIds("chatcmpl", model)
    routes = [plan.route(facts, req.stop_list(), f"call_{ids.id[-12:]}_{i}_") for i in range(len(jobs))]
    if req.stream:
        stream = await _primed(run_choices(backends, jobs))
        return StreamingResponse(_chat_chunks(backends, ids, stream, req, len(prompt), routes),
                                 media_type="text/event-stream")
    got = await _collect(run_choices(backends, jobs), len(jobs), routes)
    choices = []
    for i, route in enumerate(routes):
        lp = None
        if req.logprobs:
            lp = {"content": chat_content(facts, visible(facts, got.tokens[i], req.skip_special_tokens),
                                          req.top_logprobs or 0)}
        if route.plain():
            remember_answer(backends, route.content, got.last[i], got.tokens[i])
        choices.append({"index": i, "message": route.message(), "logprobs": lp,
                        "finish_reason": route.finish_reason(got.finishes[i])})
    usage = usage_dict(len(prompt), got.completion_tokens, got.cached(0))
    return {**ids.head("chat.completion"), "choices": choices, "usage": usage}


async def _chat_chunks(backends: Backends, ids: ResponseIds, stream, req: ChatCompletionRequest,
                       prompt_tokens: int, routes: list):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    head = ids.head("chat.completion.chunk")
    facts = backends.ready_facts()
    completion_tokens = cached = 0
    started = set()
    tokens: dict[int, list] = {}

    def chunk(index, delta, finish=None, logprobs=None):
        return _sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                           "finish_reason": finish}], **extra})

    try:
        async for index, delta in stream:
            route = routes[index]
            if index not in started:
                started.add(index)
                yield chunk(index, {"role": "assistant", "content": ""})
            tokens.setdefault(index, []).extend(delta.tokens)
            lp = None
            if req.logprobs:
                lp = {"content": chat_content(facts, visible(facts, delta.tokens, req.skip_special_tokens),
                                              req.top_logprobs or 0)}
            out = route.feed(delta)
            if delta.finish_reason:
                out += route.finish()
            for n, d in enumerate(out):
                yield chunk(index, d, logprobs=lp if n == 0 else None)
            if not out and lp and lp["content"]:
                yield chunk(index, {"content": ""}, logprobs=lp)
            if delta.finish_reason:
                completion_tokens += delta.usage.completion_tokens
                cached += delta.usage.cached_tokens if index == 0 else 0
                if route.plain():
                    remember_answer(backends, route.content, delta, tokens[index])
                yield chunk(index, {}, route.finish_reason(delta.finish_reason))
        if include_usage:
            yield _sse({**head, "choices": [], "usage": usage_dict(prompt_tokens, completion_tokens, cached)})
    except ApiError as err:
        yield _sse(err.body())
    yield "data: [DONE]\n\n"
