"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic Messages API over the chat request plan
(gateway/api/messages/messages_request.py) and the answer's blocks (gateway/generation/answer_blocks.py).

The answer's blocks become content blocks: a thought `thinking` (with an empty `signature`: nothing to verify), text
`text`, a tool call `tool_use` (`input` the parsed arguments; a call cut by `max_tokens` whose arguments do not
parse gets `{}`). `stop_reason`: `tool_use` for complete calls, `max_tokens`, `stop_sequence` (naming it), else
`end_turn`. Usage: `input_tokens` the whole prompt (what `count_tokens` returns for the same request) and
`cache_read_input_tokens` the part of it whose KV was reused, known when the worker takes the prompt and sent in
`message_start`; `--anthropic-usage exclusive` counts as Anthropic does (`input_tokens` without the cache reads).
Streaming sends `message_start`, `ping`, per block `content_block_start` / `content_block_delta` (`text_delta`,
`thinking_delta`, `input_json_delta`: the call's arguments text as generated, so the fragments join into exactly the
unary `input`) / `content_block_stop`, then `message_delta` (stop reason and usage) and `message_stop`. Errors take
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`, gateway/core/errors.py `anthropic_body`), also as
an `error` event inside a stream.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from gateway.api.messages.messages_request import (
    CHAT_PARAM,
    CallArguments,
    CountTokensRequest,
    MessagesRequest,
    chat_request,
)
from gateway.api.responses.responses_api import has_thinking, warning_headers
from gateway.backends.history import history_scope
from gateway.backends.views import RunningView
from gateway.core.errors import ApiError, anthropic_body, renamed_params
from gateway.core.openai_types import TokenizeChatRequest
from gateway.generation.answer_blocks import AnswerEnd, AnswerStart, Block, BlockEvent, answer_events
from gateway.planning.context import RequestContext
from gateway.planning.planner import Plan, plan_chat_completion, tokenize


@dataclasses.dataclass
class _Turn:
    id: str
    plan: Plan
    scope: str
    warnings: list[str]
    exclusive: bool = False  # Anthropic's usage accounting (`Limits.anthropic_usage`)


async def create(ctx: RequestContext, calls: CallArguments, req: MessagesRequest):
    """Answer `POST /v1/messages` (a JSONResponse, or a StreamingResponse of events).

    Raises:
      ApiError: 400 for bad fields (named as the Messages API names them) and the chat path's errors; the
        endpoints answer them in Anthropic's shape.
    """
    backends = ctx.backends
    turn = await _plan(ctx, calls, req)
    headers = warning_headers(turn.warnings)
    if req.stream:
        return StreamingResponse(_stream(backends, calls, turn), media_type="text/event-stream", headers=headers)
    blocks: list[Block] = []
    end = None
    async for event in answer_events(backends, turn.plan):
        if isinstance(event, AnswerEnd):
            end = event
        elif isinstance(event, BlockEvent) and event.kind == "start":
            blocks.append(event.block)
    _remember_calls(calls, turn, blocks)
    message = _message(turn, [_content(b) for b in blocks], end)
    return JSONResponse(message, headers=headers)


async def count_tokens(ctx: RequestContext, calls: CallArguments, req: CountTokensRequest) -> dict:
    """`POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt `POST /v1/messages` would use."""
    scope = history_scope(ctx.tenant, None)
    chat = chat_request(req, has_thinking(ctx.backends), ctx.limits.drop_system_patterns, calls, scope, [])
    fields = {k: getattr(chat, k) for k in ("messages", "tools", "tool_choice", "chat_template_kwargs", "model")}
    with renamed_params(CHAT_PARAM):
        ids, _ = await tokenize(ctx, TokenizeChatRequest(**fields))
    return {"input_tokens": len(ids)}


async def _plan(ctx: RequestContext, calls: CallArguments, req: MessagesRequest) -> _Turn:
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    warnings: list[str] = []
    limits = ctx.limits
    scope = history_scope(ctx.tenant, None)
    chat = chat_request(req, has_thinking(ctx.backends), limits.drop_system_patterns, calls, scope, warnings)
    session = dataclasses.replace(ctx.session, key=ctx.session.key or req.session_key())
    with renamed_params(CHAT_PARAM):
        plan = await plan_chat_completion(dataclasses.replace(ctx, session=session), chat,
                                          call_prefix=f"toolu_{mid[4:16]}_", clamp=True)
    applied = plan.jobs[0].params.max_tokens
    if applied is not None and applied < req.max_tokens:
        warnings.append(f"max_tokens lowered from {req.max_tokens} to {applied} (the context's room, "
                        "or --max-tokens-cap)")
    return _Turn(mid, plan, scope, warnings, limits.anthropic_usage == "exclusive")


def _remember_calls(calls: CallArguments, turn: _Turn, blocks: list[Block]) -> None:
    for block in blocks:
        if block.kind == "call":
            calls.remember(turn.scope, block.call_id, block.text)


def _content(block: Block) -> dict:
    """A finished block as a content block."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    try:
        value = json.loads(block.text) if block.text.strip() else {}
    except ValueError:
        value = {}  # a call cut by max_tokens
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": value if isinstance(value, dict) else {}}


def _stop_reason(end: AnswerEnd) -> str:
    if end.finish_reason == "tool_calls":
        return "tool_use"
    if end.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if end.stop_string is not None else "end_turn"


def _usage(turn: _Turn, cached: int, output_tokens: int) -> dict:
    """The usage object: `input_tokens` the whole prompt (what `count_tokens` returns) and
    `cache_read_input_tokens` the part of it whose KV was reused, or with `--anthropic-usage exclusive`
    (Anthropic's accounting) `input_tokens` only the part computed anew; no cache writes to bill."""
    prompt = turn.plan.prompt_tokens
    return {"input_tokens": prompt - cached if turn.exclusive else prompt, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message(turn: _Turn, content: list[dict], end: AnswerEnd | None, cached: int = 0) -> dict:
    return {"id": turn.id, "type": "message", "role": "assistant", "model": turn.plan.model, "content": content,
            "stop_reason": _stop_reason(end) if end else None,
            "stop_sequence": end.stop_string if end and _stop_reason(end) == "stop_sequence" else None,
            "usage": _usage(turn, end.cached_tokens if end else cached, end.completion_tokens if end else 0)}


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def _start_block(block: Block) -> dict:
    if block.kind == "call":
        return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}
    return {"type": "thinking", "thinking": "", "signature": ""} if block.kind == "reasoning" else \
        {"type": "text", "text": ""}


def _delta(event: BlockEvent) -> dict:
    kind = event.block.kind
    if kind == "call":
        return {"type": "input_json_delta", "partial_json": event.text}
    return {"type": "thinking_delta", "thinking": event.text} if kind == "reasoning" else \
        {"type": "text_delta", "text": event.text}


async def _stream(backends: RunningView, calls: CallArguments, turn: _Turn) -> AsyncIterator[str]:
    """The Messages event stream. `message_start` waits for the worker to take the prompt, so its usage has the
    cached tokens (as Anthropic's does); the response's headers are already out."""
    blocks: list[Block] = []
    started = False
    try:
        async for event in answer_events(backends, turn.plan):
            if isinstance(event, AnswerStart):
                started = True
                yield _sse("message_start", {"message": _message(turn, [], None, event.cached_tokens)})
                yield _sse("ping", {})
            elif isinstance(event, AnswerEnd):
                _remember_calls(calls, turn, blocks)
                reason = _stop_reason(event)
                yield _sse("message_delta", {
                    "delta": {"stop_reason": reason,
                              "stop_sequence": event.stop_string if reason == "stop_sequence" else None},
                    "usage": _usage(turn, event.cached_tokens, event.completion_tokens)})
                yield _sse("message_stop", {})
            elif event.kind == "start":
                blocks.append(event.block)
                yield _sse("content_block_start", {"index": event.block.index,
                                                   "content_block": _start_block(event.block)})
            elif event.kind == "delta":
                yield _sse("content_block_delta", {"index": event.block.index, "delta": _delta(event)})
            else:
                yield _sse("content_block_stop", {"index": event.block.index})
    except ApiError as err:
        if not started:
            yield _sse("message_start", {"message": _message(turn, [], None)})
        body = anthropic_body(err)
        yield _sse("error", {"error": body["error"]})
