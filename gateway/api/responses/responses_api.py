"""`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}` and `POST /v1/responses/input_tokens`: the OpenAI
Responses API over the chat request plan (gateway/api/responses/responses_request.py) and the answer's blocks
(gateway/generation/answer_blocks.py).

The answer's blocks become output items: a thought a `reasoning` item (its text as `reasoning_text` content),
text a `message` item with one `output_text` part, a tool call a `function_call` item. Streaming sends OpenAI's
event sequence, every event with `type` and `sequence_number`: `response.created`, `response.in_progress`, then
per item `output_item.added`, (`content_part.added`, `output_text.delta`... or `reasoning_text.delta`...,
`*.done`, `content_part.done`) or (`function_call_arguments.delta`..., `.done`), `output_item.done`, and last
`response.completed` — or `response.incomplete` with `incomplete_details.reason: max_output_tokens` — carrying
the whole response. The unary response is the one the last event carries. Errors are OpenAI-shaped; one during a
stream is an `error` event.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from gateway.api.responses.response_store import ResponseStore
from gateway.api.responses.responses_request import CHAT_PARAM, ResponsesRequest, chat_request
from gateway.backends.views import ModelFactsView, RunningView
from gateway.core.errors import ApiError, renamed_params
from gateway.core.openai_types import TokenizeChatRequest
from gateway.generation.answer_blocks import AnswerEnd, Block, BlockEvent, answer_events
from gateway.planning.context import RequestContext
from gateway.planning.planner import Plan, plan_chat_completion, tokenize

#: Response header naming what a request asked for that was left out (hosted tools, reasoning on a model
#: without thinking), instead of refusing the request: agent clients send such fields on every request.
WARNING_HEADER = "x-gemma-serve-warning"


#: Seconds the worker keeps a stored response's KV leased to its conversation (unless `x-session-ttl` says
#: otherwise), so the turn that continues it by `previous_response_id` is a prefix hit; the worker lends a leased
#: slot to others when they wait.
STORED_LEASE_S = 60.0


def warning_headers(warnings: list[str]) -> dict[str, str]:
    """The warning header of a response (none without warnings): printable ASCII (names a client sent are
    escaped), at most 1,000 characters."""
    if not warnings:
        return {}
    text = "; ".join(warnings).encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if 32 <= ord(c) < 127 else " " for c in text)
    return {WARNING_HEADER: text if len(text) <= 1000 else text[:997] + "..."}


@dataclasses.dataclass
class _Turn:
    """One planned Responses request: its id, request, chat plan, conversation and warnings."""

    id: str
    req: ResponsesRequest
    plan: Plan
    conversation: list[dict]
    session_key: str
    created_at: int
    warnings: list[str]


async def create(ctx: RequestContext, store: ResponseStore, req: ResponsesRequest):
    """Answer `POST /v1/responses` (a dict, or a StreamingResponse of events).

    Raises:
      ApiError: 400 for bad fields (named as the Responses API names them), 404 for an unknown or expired
        `previous_response_id`, and the chat path's errors.
    """
    backends, tenant = ctx.backends, ctx.tenant
    turn = await _plan(ctx, store, req)
    headers = warning_headers(turn.warnings)
    if req.stream:
        events = _stream(backends, store, tenant, turn)
        first = await events.__anext__()  # errors before the first event are HTTP errors

        async def body():
            yield first
            async for chunk in events:
                yield chunk

        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
    builder = _Builder(turn)
    end = None
    async for event in answer_events(backends, turn.plan):
        if isinstance(event, AnswerEnd):
            end = event
        elif isinstance(event, BlockEvent):
            builder.events(event)  # the items the stream would show
    response = builder.response(end)
    _keep(store, tenant, turn, builder, response)
    return JSONResponse(response, headers=headers)


async def count_input_tokens(ctx: RequestContext, store: ResponseStore, req: ResponsesRequest) -> dict:
    """`POST /v1/responses/input_tokens`: the prompt tokens `POST /v1/responses` would use for the same body."""
    warnings: list[str] = []
    history = _history(store, ctx.tenant, req)
    chat, _ = chat_request(req, history.messages if history else [], has_thinking(ctx.backends), warnings)
    fields = {k: getattr(chat, k) for k in ("messages", "tools", "tool_choice", "reasoning_effort", "model")}
    with renamed_params(CHAT_PARAM):
        ids, _ = await tokenize(ctx, TokenizeChatRequest(**fields))
    return {"object": "response.input_tokens", "input_tokens": len(ids)}


def stored(store: ResponseStore, tenant: str, response_id: str) -> dict:
    """`GET /v1/responses/{id}`.

    Raises:
      ApiError: 404 for an unknown, expired or deleted id (or another tenant's).
    """
    entry = store.get(tenant, response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry.response


def delete(store: ResponseStore, tenant: str, response_id: str) -> dict:
    """`DELETE /v1/responses/{id}`.

    Raises:
      ApiError: 404 as `stored`.
    """
    if not store.delete(tenant, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id[:80]}' not found.", param="response_id",
                    code="not_found")


def _history(store: ResponseStore, tenant: str, req: ResponsesRequest):
    if req.previous_response_id is None:
        return None
    entry = store.get(tenant, req.previous_response_id)
    if entry is None:
        raise ApiError(404, f"Previous response with id '{req.previous_response_id[:80]}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    return entry


def has_thinking(backends: ModelFactsView) -> bool:
    """Whether the served model has a thinking mode (else the agent APIs ignore thinking fields, with a
    warning, instead of refusing them as chat completions do)."""
    return bool(backends.ready_facts().output_format().thinking)


async def _plan(ctx: RequestContext, store: ResponseStore, req: ResponsesRequest) -> _Turn:
    rid = f"resp_{uuid.uuid4().hex}"
    warnings: list[str] = []
    session = ctx.session
    history = _history(store, ctx.tenant, req)
    chat, conversation = chat_request(req, history.messages if history else [], has_thinking(ctx.backends), warnings)
    key = session.key or req.prompt_cache_key or (history.session_key if history else None) or \
        (rid if req.store else None)
    ttl = session.ttl or (STORED_LEASE_S if req.store and key else 0.0)
    with renamed_params(CHAT_PARAM):
        turn_ctx = dataclasses.replace(ctx, session=dataclasses.replace(session, key=key, ttl=ttl))
        plan = await plan_chat_completion(turn_ctx, chat, call_prefix=f"call_{rid[-12:]}_")
    return _Turn(rid, req, plan, conversation, key or "", int(time.time()), warnings)


def _keep(store: ResponseStore, tenant: str, turn: _Turn, builder: _Builder, response: dict) -> None:
    """Store a finished response (with `store: true`) with its conversation and the answer as one assistant
    message (exactly the chat message the splitter returns, so the next turn renders it as generated)."""
    if turn.req.store:
        store.put(tenant, response, turn.conversation + [turn.plan.splitters[0].message()], turn.session_key,
                  _input_items(turn))


def _input_items(turn: _Turn) -> list[dict]:
    """The request's input as items with ids, a string input as one user message."""
    items = turn.req.input
    if isinstance(items, str) or items is None:
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items or ""}]}]
    out = []
    for i, item in enumerate(items):
        item = {"type": "message", **item} if "role" in item and "type" not in item else dict(item)
        if isinstance(item.get("content"), str) and item.get("type") == "message":
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        item.setdefault("id", f"item_{turn.id[5:]}_{i}")
        out.append(item)
    return out


def input_items(store: ResponseStore, tenant: str, response_id: str, after: str | None, limit: int,
                order: str) -> dict:
    """`GET /v1/responses/{id}/input_items`: a page of a stored response's input items (OpenAI's list shape).

    Raises:
      ApiError: 404 as `stored`; 400 for a limit outside 1..100 or an unknown order.
    """
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, got {order[:20]!r}", param="order")
    entry = store.get(tenant, response_id)
    if entry is None:
        raise _not_found(response_id)
    items = entry.input_items if order == "asc" else entry.input_items[::-1]
    ids = [item["id"] for item in items]
    start = ids.index(after) + 1 if after in ids else 0
    page = items[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}


async def _stream(backends: RunningView, store: ResponseStore, tenant: str, turn: _Turn) -> AsyncIterator[str]:
    builder = _Builder(turn)
    yield builder.sse("response.created", response=builder.response(None))
    yield builder.sse("response.in_progress", response=builder.response(None))
    try:
        async for event in answer_events(backends, turn.plan):
            if isinstance(event, AnswerEnd):
                response = builder.response(event)
                _keep(store, tenant, turn, builder, response)
                kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                yield builder.sse(kind, response=response)
            elif isinstance(event, BlockEvent):
                for chunk in builder.events(event):
                    yield chunk
    except ApiError as err:
        yield builder.sse("error", code=err.code, message=err.message, param=err.param)


class _Builder:
    """Builds one response's output items, events and final object from its answer's blocks."""

    def __init__(self, turn: _Turn):
        self.turn = turn
        self.blocks: list[Block] = []
        self.sequence = 0

    def sse(self, kind: str, **fields) -> str:
        """One server-sent event (`event:` line and JSON data with `type` and `sequence_number`)."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def item_id(self, block: Block) -> str:
        prefix = {"reasoning": "rs", "text": "msg", "call": "fc"}[block.kind]
        return f"{prefix}_{self.turn.id[5:]}_{block.index}"

    def item(self, block: Block, status: str) -> dict:
        """The output item of a block (text and arguments as they are now)."""
        base = {"id": self.item_id(block), "type": "", "status": status}
        if block.kind == "reasoning":
            return {**base, "type": "reasoning", "summary": [], "content": [_part(block)]}
        if block.kind == "text":
            return {**base, "type": "message", "role": "assistant", "content": [_part(block)]}
        return {**base, "type": "function_call", "call_id": block.call_id, "name": block.name,
                "arguments": block.text}

    def events(self, event: BlockEvent) -> list[str]:
        """The stream events of one block event."""
        block = event.block
        where = {"item_id": self.item_id(block), "output_index": block.index}
        if event.kind == "start":
            self.blocks.append(block)
            out = [self.sse("response.output_item.added", output_index=block.index,
                            item=self.item(block, "in_progress"))]
            if block.kind != "call":
                out.append(self.sse("response.content_part.added", **where, content_index=0, part=_part(block)))
            return out
        if event.kind == "delta":
            if block.kind == "call":
                return [self.sse("response.function_call_arguments.delta", **where, delta=event.text)]
            if block.kind == "reasoning":
                return [self.sse("response.reasoning_text.delta", **where, content_index=0, delta=event.text)]
            return [self.sse("response.output_text.delta", **where, content_index=0, delta=event.text, logprobs=[])]
        status = "incomplete" if event.incomplete else "completed"
        if block.kind == "call":
            # A call cut by max_output_tokens is not announced as done: its arguments may not parse.
            out = [] if event.incomplete else [self.sse("response.function_call_arguments.done", **where,
                                                        name=block.name, arguments=block.text)]
        else:
            kind = "reasoning_text" if block.kind == "reasoning" else "output_text"
            extra = {} if block.kind == "reasoning" else {"logprobs": []}
            out = [self.sse(f"response.{kind}.done", **where, content_index=0, text=block.text, **extra),
                   self.sse("response.content_part.done", **where, content_index=0, part=_part(block))]
        return out + [self.sse("response.output_item.done", output_index=block.index,
                               item=self.item(block, status))]

    def response(self, end: AnswerEnd | None) -> dict:
        """The response object: in progress (no end yet), completed, or incomplete (cut by max_output_tokens)."""
        req = self.turn.req
        status = "in_progress" if end is None else "incomplete" if end.finish_reason == "length" else "completed"
        output = [self.item(b, "incomplete" if status == "incomplete" and b is self.blocks[-1] else "completed")
                  for b in self.blocks] if end is not None else []
        chat = self.turn.plan
        return {
            "id": self.turn.id, "object": "response", "created_at": self.turn.created_at, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": chat.asked_limit, "model": chat.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled", "user": req.user, "metadata": req.metadata or {},
            "usage": _usage(end) if end is not None else None,
        }


def _part(block: Block) -> dict:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": block.text}
    return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}


def _usage(end: AnswerEnd) -> dict:
    return {"input_tokens": end.prompt_tokens, "input_tokens_details": {"cached_tokens": end.cached_tokens},
            "output_tokens": end.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
            "total_tokens": end.prompt_tokens + end.completion_tokens}
