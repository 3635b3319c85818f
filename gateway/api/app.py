"""The OpenAI-compatible REST API: the endpoints only; planning is in gateway/planning/, running in
gateway/generation/ (`choices`, `choice_runner`, `generate`), the rules every request obeys (request ids, body and
connection limits, JSON checks, a 500 that keeps the connection) in http_guard.py.

Errors are OpenAI-shaped (`{"error": {message, type, param, code}}`) on every path, unknown paths and methods
included: 400 for bad values, 404 for an unknown model or path, 405 for a wrong method, 413 for a body over the
limit, 429 when the worker's queue is full, 503 while a backend is down or loading (or beyond the connection
limit), and a generic 500 naming the request id (never internals) for our own bugs. A client that disconnects
aborts its generation on the worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.api.auth import ApiKeys
from gateway.api.http_guard import RequestGuard
from gateway.api.messages import messages_api
from gateway.api.messages.messages_request import CallArguments, CountTokensRequest, MessagesRequest
from gateway.api.openapi import openapi_schema
from gateway.api.responses import responses_api
from gateway.api.responses.response_store import ResponseStore
from gateway.api.responses.responses_request import ResponsesRequest
from gateway.backends.clients import Backends
from gateway.backends.views import AnswerBook, ModelFactsView, TokenizerView
from gateway.backends.workers import Session
from gateway.core.errors import ApiError, error_body
from gateway.core.limits import Limits
from gateway.core.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    error_param,
)
from gateway.generation.choice_runner import ChoiceRunner
from gateway.generation.choices import ResponseIds, run_choices, usage_dict
from gateway.generation.detokenizer import dangling, prompt_tail
from gateway.generation.logprobs import CompletionLogprobs, TokenStrings, chat_content, visible
from gateway.planning.context import RequestContext
from gateway.planning.planner import Plan, detokenize, plan_chat_completion, plan_completion, tokenize
from protos import tokenizer_pb2

log = logging.getLogger("gemma_serve.gateway")


def _validation_error(exc: RequestValidationError) -> ApiError:
    first = _telling_error(exc.errors())
    param = error_param(tuple(first.get("loc", ())))
    return ApiError(400, f"{param or 'request'}: {first.get('msg', 'invalid value')}", param=param,
                    code="invalid_value")


def _telling_error(errors: list[dict]) -> dict:
    """The error to report: the first, unless it is a type mismatch of one union member (`stop` given as a list of
    5 strings fails both as a string and as a list; `prompt: [-1]` as a string and as token ids) while another
    member of the same field, or an item inside it, failed on its value — that one says what is wrong."""
    if not errors:
        return {}
    first = errors[0]
    if first.get("type", "").endswith("_type"):
        field = error_param(tuple(first.get("loc", ()))) or ""
        for err in errors[1:]:
            param = error_param(tuple(err.get("loc", ()))) or ""
            inside = param == field or param.startswith(field + ".")
            if inside and not err.get("type", "").endswith("_type"):
                return err
    return first


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
    log.info("client disconnected; request %s cancelled", request.state.request_id)
    err = ApiError(499, "client disconnected", code="cancelled")
    return JSONResponse(error_body(err, request.url.path), status_code=499)


async def _primed(agen: AsyncIterator) -> AsyncIterator:
    """Start a generator now (so errors before the first item become HTTP errors); returns a re-iterable stream."""
    first = await agen.__anext__()

    async def rest():
        yield first
        async for item in agen:
            yield item

    return rest()


_STREAM_RESPONSES = {200: {"description": "The completion, or with `stream: true` a stream of server-sent events "
                                          "(`data: {chunk}` lines, then `data: [DONE]`).",
                           "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def create_app(backends: Backends, limits: Limits | None = None,
               open_connections: Callable[[], int] | None = None, keys: ApiKeys | None = None):
    """The ASGI application over `backends`: the FastAPI endpoints wrapped in RequestGuard (and CORS when
    `limits.cors_origins` names origins).

    Args:
      limits: the gateway's limits (default: Limits()).
      open_connections: the HTTP server's open connection count, for `limits.max_connections` (None: unchecked).
      keys: the API keys every `/v1` endpoint requires (None or empty: the API is open).
    """
    limits = limits or Limits()
    app = FastAPI(title="gemma-serve", description="OpenAI-compatible API of gemma-serve")
    app.router.redirect_slashes = False  # "/v1/models/" is an unknown path (404 JSON), not a redirect

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(error_body(exc, request.url.path), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on "
                   f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        err = ApiError(exc.status_code, message, code={404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code))
        return JSONResponse(error_body(err, request.url.path), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        # Starlette's outermost layer answers with this, then re-raises to RequestGuard, which logs the bug and
        # keeps the connection (the server would close it).
        rid = request.state.request_id
        err = ApiError(500, f"internal server error (request id {rid})", code="internal_error")
        return JSONResponse(error_body(err, request.url.path), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        err = _validation_error(exc)
        return JSONResponse(error_body(err, request.url.path), status_code=err.status)

    @app.get("/metrics")
    async def metrics():
        body, content_type = backends.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/health")
    async def health():
        statuses = await backends.health()
        ok = all(s == "SERVING" for s in statuses.values()) and backends.facts is not None
        ok = ok and not backends.admission.draining
        status = "draining" if backends.admission.draining else "ok" if ok else "unavailable"
        body = {"status": status, "backends": statuses, "workers": backends.worker_statuses,
                "programs_compiling": backends.pool.programs_compiling()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        """The served model, in OpenAI's list shape with the fields Anthropic's `models.list` reads too (`type`,
        `display_name`, `created_at`, `has_more`, `first_id`, `last_id`)."""
        facts = backends.ready_facts()
        now = int(time.time())
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        return {
            "object": "list",
            "data": [{"id": facts.name, "object": "model", "created": now, "owned_by": "gemma-serve",
                      "max_model_len": facts.max_model_len, "type": "model", "display_name": facts.name,
                      "created_at": created}],
            "has_more": False, "first_id": facts.name, "last_id": facts.name,
        }

    @app.post("/v1/completions", responses=_STREAM_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        work = _completions(_context(request, backends, limits), body)
        return await (work if body.stream else _cancel_on_disconnect(request, work))

    @app.post("/v1/chat/completions", responses=_STREAM_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        work = _chat(_context(request, backends, limits), body)
        return await (work if body.stream else _cancel_on_disconnect(request, work))

    store = ResponseStore(limits.responses_store_bytes, limits.responses_store_ttl)

    @app.post("/v1/responses", responses=_STREAM_RESPONSES)
    async def responses(body: ResponsesRequest, request: Request):
        """The OpenAI Responses API (gateway/api/responses/responses_api.py)."""
        work = responses_api.create(_context(request, backends, limits), store, body)
        return await (work if body.stream else _cancel_on_disconnect(request, work))

    @app.post("/v1/responses/input_tokens")
    async def responses_input_tokens(body: ResponsesRequest, request: Request):
        """The prompt tokens `POST /v1/responses` would use for the same body."""
        return await responses_api.count_input_tokens(_context(request, backends, limits, session=False), store,
                                                      body)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        """A stored response (`store: true`)."""
        return responses_api.stored(store, request.state.tenant, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def get_input_items(response_id: str, request: Request, after: str | None = None, limit: int = 20,
                              order: str = "desc"):
        """A stored response's input items, paged."""
        return responses_api.input_items(store, request.state.tenant, response_id, after, limit, order)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        """Forget a stored response."""
        return responses_api.delete(store, request.state.tenant, response_id)

    calls = CallArguments()

    @app.post("/v1/messages", responses=_STREAM_RESPONSES)
    async def messages(body: MessagesRequest, request: Request):
        """The Anthropic Messages API (gateway/api/messages/messages_api.py)."""
        work = messages_api.create(_context(request, backends, limits), calls, body)
        return await (work if body.stream else _cancel_on_disconnect(request, work))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest, request: Request):
        """The prompt tokens `POST /v1/messages` would use for the same body."""
        return await messages_api.count_tokens(_context(request, backends, limits, session=False), calls, body)

    async def tenant_of(request: Request) -> str:
        """The caller's tenant on /tokenize and /detokenize. They sit at the root, as vLLM serves them, outside
        RequestGuard's `/v1` key check, but they expose the chat template and the answer history's exact ids, so
        with API keys they need one too (401 before the body is validated)."""
        return keys.tenant(request.headers.get("authorization")) if keys else ""

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_route(body: TokenizeRequest, tenant: str = Depends(tenant_of)):
        """The prompt ids a request would use (vLLM's /tokenize): `prompt` as /v1/completions encodes it, or
        `messages` (with tools, tool_choice, chat_template_kwargs, add_generation_prompt, continue_final_message)
        exactly as /v1/chat/completions renders them, so `count` is its `usage.prompt_tokens`."""
        ctx = RequestContext(backends.for_request(), limits, tenant)
        ids, strs = await tokenize(ctx, body)
        return {"count": len(ids), "max_model_len": ctx.backends.ready_facts().max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=[Depends(tenant_of)])
    async def detokenize_route(body: DetokenizeRequest):
        """The text of token ids, control tokens spelled out (vLLM's /detokenize)."""
        return {"prompt": await detokenize(backends.for_request(), body)}

    app.openapi = lambda: openapi_schema(app, backends, limits, keyed=bool(keys),
                                         keyed_paths=("/tokenize", "/detokenize"))
    asgi = app
    if limits.cors_origins:
        asgi = CORSMiddleware(asgi, allow_origins=list(limits.cors_origins), allow_methods=["GET", "POST"],
                              allow_headers=["*"], expose_headers=["X-Request-Id"])
    count = lambda template, status: backends.metrics.requests.labels(template, str(status)).inc()
    paths = frozenset(getattr(route, "path", "") for route in app.routes)
    guard = RequestGuard(asgi, limits, open_connections, count, keys, paths, backends.admission)
    guard.fastapi = app  # the endpoints, for tests and the OpenAPI schema
    return guard


# ----- /v1/completions -----------------------------------------------------------------------------------------
def _context(request: Request, backends: Backends, limits: Limits, session: bool = True) -> RequestContext:
    """The request's context (gateway/planning/context.py): the backends' view for it, the limits, the tenant
    RequestGuard found for its key and, unless `session` is False (the token-counting endpoints, which place
    nothing), its session headers (`x-session-id`, `-ttl`, `-release`, `x-slo-*`: gateway/backends/workers.py
    `Session`): its conversation's turns go to one worker (gateway/backends/worker_choice.py), which may keep its
    KV between turns.

    Raises:
      ApiError: 400 for a malformed session header.
    """
    sessions = Session.from_headers(request.headers.get) if session else Session()
    return RequestContext(backends.for_request(), limits, request.state.tenant, sessions)


async def _completions(ctx: RequestContext, req: CompletionRequest):
    backends = ctx.backends
    ids = ResponseIds("cmpl", "")
    plan = await plan_completion(ctx, req, call_prefix=f"call_{ids.id[-12:]}_")
    ids.model = plan.model
    echoes = [await _echo_text(backends, p_ids, text) if req.echo else "" for p_ids, text in plan.prompts]
    if req.stream:
        stream = await _primed(run_choices(backends, plan.jobs))
        return StreamingResponse(_completion_chunks(backends, ids, stream, req, echoes, plan.prompt_tokens,
                                                    [job.prompt for job in plan.jobs]),
                                 media_type="text/event-stream")
    got = await _collect(run_choices(backends, plan.jobs), len(plan.jobs))
    facts = backends.ready_facts()
    choices = []
    for i in range(len(plan.jobs)):
        echo = echoes[i // req.n]
        lp = None
        if req.logprobs is not None:
            lp = CompletionLogprobs(facts, req.logprobs, len(echo), plan.jobs[i].prompt).chunk(
                visible(facts, got.tokens[i], req.skip_special_tokens))
        choices.append({"index": i, "text": echo + got.texts[i], "logprobs": lp, "finish_reason": got.finishes[i]})
    cached = sum(got.cached(p * req.n) for p in range(len(plan.prompts)))
    usage = usage_dict(plan.prompt_tokens, got.completion_tokens, cached)
    return {**ids.head("text_completion"), "choices": choices, "usage": usage}


async def _echo_text(backends: TokenizerView, ids: list[int], text: str) -> str:
    """The prompt as echoed: its text, or for ids their decoded text without the bytes of a character the
    prompt leaves open (the answer emits that character whole: gateway/generation/detokenizer.py)."""
    if text:
        return text
    reply = await backends.call("tokenizer service", backends.tokenizer.Decode(
        tokenizer_pb2.DecodeTokensRequest(token_ids=ids, skip_special_tokens=True)))
    facts = backends.ready_facts()
    if dangling(prompt_tail(facts.token_bytes, facts.special_ids, ids)):
        return reply.text.rstrip("\ufffd")
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

    def predicted(self) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens over every choice (OpenAI Predicted Outputs)."""
        done = [d.usage for d in self.last if d is not None]
        return (sum(u.accepted_prediction_tokens for u in done), sum(u.rejected_prediction_tokens for u in done))


async def _collect(stream, count: int) -> _Gathered:
    """Gather every choice of a completion (its text and tokens as generated; chat answers go through the
    `ChoiceRunner` instead)."""
    out = _Gathered(count)
    async for index, delta in stream:
        out.texts[index] += delta.text
        out.tokens[index] += delta.tokens
        if delta.finish_reason:
            out.finishes[index] = delta.finish_reason
            out.last[index] = delta
    return out


async def _completion_chunks(backends: ModelFactsView, ids: ResponseIds, stream, req: CompletionRequest, echoes,
                             prompt_tokens: int, prompts: list[list[int]]):
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
                logprobs[index] = CompletionLogprobs(facts, req.logprobs or 0, len(text) - len(delta.text),
                                                     prompts[index])
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
async def _chat(ctx: RequestContext, req: ChatCompletionRequest):
    backends = ctx.backends
    ids = ResponseIds("chatcmpl", "")
    plan = await plan_chat_completion(ctx, req, call_prefix=f"call_{ids.id[-12:]}_")
    ids.model = plan.model
    if req.stream:
        stream = await _primed(run_choices(backends, plan.jobs))
        return StreamingResponse(_chat_chunks(backends, ids, stream, req, plan), media_type="text/event-stream")
    runner = ChoiceRunner(backends, plan)
    async for index, delta in run_choices(backends, plan.jobs):
        runner.feed(index, delta)
    facts = backends.ready_facts()
    choices = []
    for i, splitter in enumerate(plan.splitters):
        lp = None
        if req.logprobs:
            lp = {"content": chat_content(facts, visible(facts, runner.tokens[i], req.skip_special_tokens),
                                          req.top_logprobs or 0)}
        choices.append({"index": i, "message": splitter.message(), "logprobs": lp,
                        "finish_reason": runner.finish_reason(i)})
    usage = usage_dict(plan.prompt_tokens, runner.usage.completion_tokens, runner.usage.cached_tokens,
                       runner.predicted() if req.prediction is not None else None)
    return {**ids.head("chat.completion"), "choices": choices, "usage": usage}


async def _chat_chunks(backends: AnswerBook, ids: ResponseIds, stream, req: ChatCompletionRequest, plan: Plan):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    head = ids.head("chat.completion.chunk")
    facts = backends.ready_facts()
    runner = ChoiceRunner(backends, plan)
    started = set()
    strings: dict[int, TokenStrings] = {}  # logprob token strings continue across a choice's chunks

    def chunk(index, delta, finish=None, logprobs=None):
        return _sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                           "finish_reason": finish}], **extra})

    try:
        async for index, delta in stream:
            if index not in started:
                started.add(index)
                strings[index] = TokenStrings(facts, plan.jobs[index].prompt)
                yield chunk(index, {"role": "assistant", "content": ""})
            lp = None
            if req.logprobs:
                lp = {"content": chat_content(facts, visible(facts, delta.tokens, req.skip_special_tokens),
                                              req.top_logprobs or 0, strings[index])}
            out = runner.feed(index, delta)
            for n, d in enumerate(out):
                yield chunk(index, d, logprobs=lp if n == 0 else None)
            if not out and lp and lp["content"]:
                yield chunk(index, {"content": ""}, logprobs=lp)
            if delta.finish_reason:
                yield chunk(index, {}, runner.finish_reason(index))
        if include_usage:
            predicted = runner.predicted() if req.prediction is not None else None
            yield _sse({**head, "choices": [], "usage": usage_dict(plan.prompt_tokens, runner.usage.completion_tokens,
                                                                   runner.usage.cached_tokens, predicted)})
    except ApiError as err:
        yield _sse(err.body())
    yield "data: [DONE]\n\n"
