"""One request planner for the REST API and gRPC `Generate`: a validated request in, everything needed to run and
answer it out — prompts as token ids, one job per choice (GenParams, request id), grammars, output splitters.

Both APIs go through here (gRPC `Generate` first turns its message into the same pydantic request models the REST
endpoints validate, `gateway/api/grpc_service.py` `request_model`), so every limit and check holds on both by
construction. Order of checks: what needs no backend (types and ranges, stop strings, max_tokens against the cap,
message and tool counts, choices against the worker's queue), then the model name, the chat plan (schemas and
tool grammars, compiled off the event loop under llguidance's budgets), the prompt's size before it is tokenized,
the tokens, the context length, and last the grammar's first mask (so a grammar over its budget is a 400, not a
failure mid-generation). Everything raises `ApiError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import re
import types
import uuid

from common.json_prefix import scan_json_prefix
from gateway.backends.history import answer_key, history_scope, prefix_salt
from gateway.backends.model_facts import ModelFacts
from gateway.backends.views import ModelFactsView, PlanningView, TokenizerView
from gateway.backends.workers import Session, tiebreak_key
from gateway.core.errors import ApiError
from gateway.core.limits import (
    MAX_JSON_DEPTH,
    MAX_SCHEMA_BYTES,
    JsonError,
    Limits,
    check_field,
    json_depth,
    parse_json,
)
from gateway.core.openai_types import (
    ChatCompletionRequest,
    ChatPromptFields,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from gateway.generation.chat_output import ChatSplitter
from gateway.generation.generate import GenParams
from gateway.planning.answer_limit import AnswerLimit, answer_budget, read_limit
from gateway.planning.chat_plan import ChatPlan, constraint_factory, plan_chat
from gateway.planning.context import RequestContext
from gateway.structured.constraints import ConstraintError
from gateway.structured.tools.tool_calls import resolve_tool_choice
from protos import common_pb2, tokenizer_pb2

#: Grammar compilation (schema checks, llguidance compile, first masks) runs here, off the event loop; two
#: threads, so a client's costly schema (bounded by MAX_SCHEMA_BYTES and llguidance's budgets) takes at most two
#: of the gateway's cores from the rest.
_COMPILE_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclasses.dataclass
class Job:
    """One choice to generate: its index in the response, prompt ids, parameters and worker request id."""

    index: int
    prompt: list[int]
    params: GenParams
    request_id: str


@dataclasses.dataclass
class Plan:
    """A planned request.

    Attributes:
      model: the served model id (the response's `model`).
      prompts: (token ids, text) per prompt; text is "" for a prompt given as ids.
      n: choices per prompt.
      jobs: one per choice, prompt-major (prompt p's choices are jobs p*n .. p*n+n-1).
      chat: the chat plan (grammar, tool format, thinking), also for a completion with `response_format`.
      splitters: one ChatSplitter per job (chat answers; gRPC splits every answer with them).
      scope: the answer-history scope (the tenant and `cache_salt`: gateway/backends/history.py `history_scope`).
      asked_limit: the first prompt's answer limit when the request or the server's `--max-tokens-cap` set one,
        None when only the context bounds it (what the Responses API echoes as `max_output_tokens`); each job's
        `params.max_tokens` holds the limit decided (`answer_limit.answer_budget`).
    """

    model: str
    prompts: list[tuple[list[int], str]]
    n: int
    jobs: list[Job]
    chat: ChatPlan
    splitters: list[ChatSplitter]
    scope: str
    asked_limit: int | None = None

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the request (each prompt counted once, whatever n)."""
        return sum(len(ids) for ids, _ in self.prompts)


@dataclasses.dataclass(frozen=True)
class Ask:
    """What a request asks beyond its prompts and sampling fields, every default and limit resolved once, at
    its front door (`plan_completion`, `plan_chat_completion`; the Responses and Messages APIs translate into
    the latter).

    Attributes:
      model: the served model id.
      limit: the answer limit asked for and the field that set it (`answer_limit.read_limit`).
      top_logprobs: alternatives per token to return.
      chat: the chat plan (grammar, tool format, thinking).
      call_prefix: the prefix of tool-call ids.
      request_id: the worker request id of choice 0 of the first prompt (None: a new one).
      scope: the answer-history scope (tenant and `cache_salt`: gateway/backends/history.py).
      session: the request's session headers.
      prediction: the token ids of OpenAI Predicted Outputs, or None.
    """

    model: str
    limit: AnswerLimit
    top_logprobs: int
    chat: ChatPlan
    call_prefix: str
    request_id: str | None
    scope: str
    session: Session
    prediction: list[int] | None = None


# ----------------------------------------------------------------------------------------------- entry points


async def plan_completion(ctx: RequestContext, req: CompletionRequest, *, call_prefix: str) -> Plan:
    """Plan a `/v1/completions` request (or a gRPC `text`/`tokens` input).

    Args:
      ctx: the request's context (gateway/planning/context.py): its backends' view, limits, tenant (part of the
        answer-history scope), session (its key, else the request's `user` field, decides which worker serves it
        and names the KV lease it may ask the worker for) and worker request id.
      call_prefix: prefix of tool-call ids (unused without tools; splitters are still made for gRPC).
    """
    backends, limits = ctx.backends, ctx.limits
    check_request(req, limits)
    limit = read_limit(req, limits)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, 1, req.n):
        raise ApiError(400, "best_of other than n is not supported", param="best_of")
    texts = _prompt_items(req.prompt)
    _check_choices(len(texts), req.n, backends.ready_facts())
    _check_token_ids(req, backends.ready_facts())
    model = check_model(backends, req.model)
    fields = types.SimpleNamespace(response_format=req.response_format, tools=None, tool_choice=None,
                                   parallel_tool_calls=None, chat_template_kwargs=None, reasoning_effort=None,
                                   stop_token_ids=req.stop_token_ids)
    chat = await _chat_plan(backends, fields)
    chat.channels = False  # raw prompts: the text as generated
    prompts = [await _completion_prompt(backends, item) for item in texts]
    ask = Ask(model, limit, req.logprobs or 0, chat, call_prefix, ctx.request_id,
              history_scope(ctx.tenant, req.cache_salt), ctx.session)
    return await _build_jobs(backends, req, limits, prompts, ask)


async def plan_chat_completion(ctx: RequestContext, req: ChatCompletionRequest, *, call_prefix: str,
                               clamp: bool = False) -> Plan:
    """Plan a `/v1/chat/completions` request (or a gRPC `chat` input, or a translated Responses or Messages
    request); arguments as `plan_completion`'s, and `clamp` as `AnswerLimit.clamp`."""
    backends, limits = ctx.backends, ctx.limits
    check_request(req, limits)
    limit = read_limit(req, limits, clamp)
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    check_chat_prompt_fields(req, limits)
    _check_choices(1, req.n, backends.ready_facts())
    _check_token_ids(req, backends.ready_facts())
    model = check_model(backends, req.model)
    chat = await _chat_plan(backends, req)
    scope = history_scope(ctx.tenant, req.cache_salt)
    prompt = await _chat_prompt(backends, req, chat.template_kwargs, scope)
    ask = Ask(model, limit, req.top_logprobs or 0, chat, call_prefix, ctx.request_id, scope, ctx.session,
              await _prediction(backends, req))
    return await _build_jobs(backends, req, limits, [(prompt, "")], ask)


async def _prediction(backends: TokenizerView, req: ChatCompletionRequest) -> list[int] | None:
    """The token ids of a request's `prediction` (OpenAI Predicted Outputs; encoded as answer text: no BOS,
    control tokens parsed), or None without one.

    Raises:
      ApiError: 400 when it has more tokens than max_model_len (no answer can repeat it).
    """
    if req.prediction is None:
        return None
    text = req.prediction.text()
    _check_prompt_bytes(len(text.encode("utf-8")), backends.ready_facts(), "prediction")
    ids = await _encode(backends, text, False)
    limit = backends.ready_facts().max_model_len
    if len(ids) > limit:
        raise ApiError(400, f"prediction has {len(ids)} tokens, more than the model's context of {limit}",
                       param="prediction")
    return ids


async def tokenize(ctx: RequestContext, req: TokenizeCompletionRequest | TokenizeChatRequest
                   ) -> tuple[list[int], list[str] | None]:
    """`POST /tokenize`: the prompt ids the matching endpoint would use — a raw prompt's as `/v1/completions`
    encodes it (control tokens parsed; BOS with `add_special_tokens`), chat messages' as `/v1/chat/completions`
    renders them (the same checks, chat plan and `_chat_prompt`, so `usage.prompt_tokens` equals the count).
    A prompt longer than max_model_len is counted, not refused (the body limit bounds the work).

    Returns:
      (ids, each id's vocabulary piece when `return_token_strs`, else None).
    Raises:
      ApiError: 400 for bad fields (as chat completions name them) or both `prompt` and `messages`; 404 for
        another model; 503 while a backend is away.
    """
    backends, limits = ctx.backends, ctx.limits
    if isinstance(req, TokenizeChatRequest):
        if "prompt" in (req.model_extra or {}):
            raise ApiError(400, "give either prompt or messages, not both", param="prompt")
        check_chat_prompt_fields(req, limits)
        check_model(backends, req.model)
        fields = types.SimpleNamespace(response_format=None, tools=req.tools, tool_choice=req.tool_choice,
                                       parallel_tool_calls=None, chat_template_kwargs=req.chat_template_kwargs,
                                       reasoning_effort=req.reasoning_effort, stop_token_ids=None)
        chat = await _chat_plan(backends, fields)
        ids = await _chat_prompt(backends, req, chat.template_kwargs, history_scope(ctx.tenant, req.cache_salt),
                                 check_size=False)
    else:
        check_model(backends, req.model)
        ids = await _encode(backends, req.prompt, req.add_special_tokens)
    if not req.return_token_strs:
        return ids, None
    reply = await backends.call("tokenizer service", backends.tokenizer.Decode(
        tokenizer_pb2.DecodeTokensRequest(token_ids=ids, return_token_strs=True)))
    return ids, list(reply.token_strs)


async def detokenize(backends: TokenizerView, req: DetokenizeRequest) -> str:
    """`POST /detokenize`: the text of token ids, control tokens spelled out (as vLLM's, which decodes with
    transformers' defaults).

    Raises:
      ApiError: 400 for an id outside the vocabulary (naming its index), 404 for another model, 503 while the
        tokenizer service is away.
    """
    check_model(backends, req.model)
    vocab = backends.ready_facts().vocab_size
    for i, token in enumerate(req.tokens):
        if token >= vocab:
            raise ApiError(400, f"tokens.{i}: token id {token} is out of range [0, {vocab})", param=f"tokens.{i}")
    reply = await backends.call("tokenizer service", backends.tokenizer.Decode(
        tokenizer_pb2.DecodeTokensRequest(token_ids=req.tokens, skip_special_tokens=False)))
    return reply.text


# --------------------------------------------------------------------------------------------- common checks


def check_request(req: SamplingFields, limits: Limits) -> None:
    """Checks that need no backend (done first, so bad input is a 400 even while a backend is down; the answer
    limit's come next, in `answer_limit.read_limit`).

    Raises:
      ApiError: 400 for bad stop strings or stream_options without stream.
    """
    if getattr(req, "stream_options", None) is not None and not getattr(req, "stream", False):
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    stops = req.stop_list()
    if len(stops) > 4:
        raise ApiError(400, f"at most 4 stop sequences are allowed, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop sequences must not be empty", param="stop")
    size = sum(len(s.encode("utf-8")) for s in stops)
    if size > limits.max_stop_bytes:
        raise ApiError(400, f"the stop sequences have {size} bytes together; at most {limits.max_stop_bytes} are "
                            "allowed", param="stop")


def check_model(backends: ModelFactsView, model: str | None) -> str:
    """The served model id; a request naming another model is a 404 (as vLLM does).

    Raises:
      ApiError: 404 unknown model; 503 not ready.
    """
    name = backends.ready_facts().name
    if model is not None and model != name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{name}`.", param="model",
                       code="model_not_found")
    return name


def _check_token_ids(req: SamplingFields, facts: ModelFacts) -> None:
    """Token ids a request names must be in the vocabulary.

    Raises:
      ApiError: 400 naming the field.
    """
    vocab = facts.vocab_size
    for param, ids in (("stop_token_ids", req.stop_token_ids), ("allowed_token_ids", req.allowed_token_ids)):
        bad = [t for t in ids or [] if t >= vocab]
        if bad:
            raise ApiError(400, f"{param}: token id {bad[0]} is out of range [0, {vocab})", param=param)
    for key in req.logit_bias or {}:
        if not (key.isdecimal() and len(key) <= 10 and int(key) < vocab):
            raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab}), got {key[:20]!r}",
                           param="logit_bias")


def _check_choices(prompts: int, n: int, facts: ModelFacts) -> None:
    """A request's generations (prompts x n) must fit the worker's waiting queue at once: more could never be
    admitted, so a 429 would invite retries that cannot succeed. The error names `n` when n alone is over."""
    cap = max(facts.max_waiting, 1)
    if prompts * n > cap:
        raise ApiError(400, f"this request asks for {prompts * n} generations (prompts x n); at most {cap} are "
                            "allowed per request on this server", param="n" if n > cap or prompts == 1 else "prompt")


def check_chat_prompt_fields(req: ChatPromptFields, limits: Limits) -> None:
    """Checks of the fields that make a chat prompt (chat completions and `/tokenize` alike), needing no backend.

    Raises:
      ApiError: 400 for more messages or tools than the limits allow, a non-boolean `tools[].function.strict`,
        tool-call arguments nested too deeply, or a `continue_final_message` that cannot apply.
    """
    if len(req.messages) > limits.max_messages:
        raise ApiError(400, f"at most {limits.max_messages} messages are allowed, got {len(req.messages)}",
                       param="messages")
    if req.tools is not None and len(req.tools) > limits.max_tools:
        raise ApiError(400, f"at most {limits.max_tools} tools are allowed, got {len(req.tools)}", param="tools")
    for i, tool in enumerate(req.tools or []):
        function = tool.get("function")
        strict = function.get("strict") if isinstance(function, dict) else None
        if strict is not None and not isinstance(strict, bool):
            param = f"tools.{i}.function.strict"
            raise ApiError(400, f"{param} must be a boolean", param=param)
    _check_tool_call_arguments(req)
    _check_continuation(req)


def _check_continuation(req: ChatPromptFields) -> None:
    """`continue_final_message` (vLLM) needs a final assistant message with text to continue, and excludes an
    explicit `add_generation_prompt: true` (vLLM's message).

    Raises:
      ApiError: 400 naming `continue_final_message` or `messages`.
    """
    if not req.continue_final_message:
        return
    if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       param="continue_final_message")
    last, index = req.messages[-1], len(req.messages) - 1
    if last.role != "assistant":
        raise ApiError(400, f"continue_final_message: the final message must be an assistant message (the answer "
                            f"to continue), got role {last.role!r}", param="messages")
    if last.tool_calls:
        raise ApiError(400, "continue_final_message: only an answer's text can be continued, and the final "
                            "message has tool_calls", param=f"messages.{index}.tool_calls")
    if last.content is None or last.content == []:
        raise ApiError(400, "continue_final_message: the final message has no content to continue",
                       param=f"messages.{index}.content")


def _check_tool_call_arguments(req: ChatCompletionRequest) -> None:
    """Tool-call `arguments` sent back are JSON text inside the body: bound their nesting, refuse text no tokenizer
    can encode, and require a JSON object — or, for an assistant message's last call, a prefix of one: the call
    an answer cut off by `max_tokens` returns (the family's template, families/<name>/tokenizer.py, renders it as generated). Anything
    else could never have come from this server.

    Raises:
      ApiError: 400 naming the field (`messages.I.tool_calls.J.function.arguments`).
    """
    for i, m in enumerate(req.messages):
        calls = m.tool_calls or []
        for j, call in enumerate(calls):
            param = f"messages.{i}.tool_calls.{j}.function.arguments"
            text = call.function.arguments
            if json_depth(text) > MAX_JSON_DEPTH:
                raise ApiError(400, f"{param}: JSON nested deeper than {MAX_JSON_DEPTH} levels", param=param)
            if not text.strip():
                continue  # no arguments
            try:
                value = parse_json(text)
            except JsonError as err:
                if not err.syntax:
                    raise ApiError(400, f"{param}: {err}", param=param) from None
                if not (m.role == "assistant" and j == len(calls) - 1 and _cut_off_arguments(text, param)):
                    raise ApiError(400, f"{param}: the arguments are not valid JSON ({err}); only an answer's "
                                        "last call, cut off by max_tokens, may end early", param=param) from None
                continue
            if not isinstance(value, dict):
                raise ApiError(400, f"{param}: the arguments must be a JSON object, got {type(value).__name__}",
                               param=param)


def _cut_off_arguments(text: str, param: str) -> bool:
    """True when `text` is a prefix of a JSON object (with no lone surrogate in its strings).

    Raises:
      ApiError: 400 naming `param` for a lone surrogate.
    """
    try:
        items, _ = scan_json_prefix(text)
    except ValueError:
        return False
    if any(kind in ("key", "string") and _SURROGATE.search(value) for kind, value, _ in items):
        raise ApiError(400, f"{param}: a string holds a lone surrogate", param=param)
    return True


def _prompt_items(prompt) -> list:
    """A completion's `prompt` as a list of prompts (strings or id lists).

    Raises:
      ApiError: 400 for an empty prompt.
    """
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return items


# --------------------------------------------------------------------------------------------------- prompts


def _check_prompt_bytes(size: int, facts: ModelFacts, param: str) -> None:
    """Refuse, before tokenizing, text that cannot fit: no token spells more than `facts.max_token_bytes` bytes,
    so text of more than max_model_len x that many bytes has more than max_model_len tokens."""
    bound = facts.max_model_len * max(facts.max_token_bytes, 1)
    if size > bound:
        raise ApiError(400, f"This model's maximum context length is {facts.max_model_len} tokens; your prompt has "
                            f"{size} bytes of text, more than any {facts.max_model_len} tokens can spell "
                            f"({bound} bytes). Please shorten the prompt.", param=param,
                       code="context_length_exceeded")


async def _encode(backends: TokenizerView, text: str, add_bos: bool) -> list[int]:
    """A raw prompt's ids: control tokens written in it parsed, BOS prepended with `add_bos` (exactly one)."""
    reply = await backends.call("tokenizer service", backends.tokenizer.Encode(
        tokenizer_pb2.EncodeRequest(text=text, add_bos=add_bos, parse_special=True)))
    return list(reply.token_ids)


async def _completion_prompt(backends: TokenizerView, item) -> tuple[list[int], str]:
    """One completion prompt as (ids, text): text gets BOS and control-token parsing; ids are checked."""
    facts = backends.ready_facts()
    if isinstance(item, str):
        _check_prompt_bytes(len(item.encode("utf-8")), facts, "prompt")
        return await _encode(backends, item, add_bos=True), item
    if not item:
        raise ApiError(400, "prompt token lists must not be empty", param="prompt")
    bad = [t for t in item if not 0 <= t < facts.vocab_size]
    if bad:
        raise ApiError(400, f"prompt token id {bad[0]} is out of range [0, {facts.vocab_size})", param="prompt")
    return list(item), ""


def message_to_pb(m, answers=None, scope: str = "") -> tokenizer_pb2.ChatMessage:
    """OpenAI ChatMessage -> tokenizer proto; an assistant answer we generated (looked up by its content, tool
    calls and reasoning_content in `answers`, within `scope`: gateway/backends/history.py) carries its exact token ids."""
    pb = tokenizer_pb2.ChatMessage(role=m.role, name=m.name or "", tool_call_id=m.tool_call_id or "",
                                   reasoning_content=m.reasoning_content or "")
    if isinstance(m.content, str):
        pb.content = m.content
    elif m.content is not None:
        pb.content_parts.extend(tokenizer_pb2.ContentPart(type=p.type, text=p.text or "") for p in m.content)
    calls = [(call.function.name, call.function.arguments) for call in m.tool_calls or []]
    for call in m.tool_calls or []:
        pb.tool_calls.append(tokenizer_pb2.ToolCall(id=call.id, name=call.function.name,
                                                    arguments_json=call.function.arguments))
    if answers is not None and m.role == "assistant" and (m.content is None or isinstance(m.content, str)):
        exact = answers.lookup(scope, answer_key(m.content, calls, m.reasoning_content))
        if exact:
            pb.generated_token_ids.extend(exact)
    return pb


async def _chat_prompt(backends: PlanningView, req: ChatPromptFields, template_kwargs: dict, scope: str,
                       check_size: bool = True) -> list[int]:
    """Render the conversation (and `req.tools`) with the model's chat template (answers sent back carry the
    exact ids remembered within the answer-history `scope`). The template learns the resolved tool_choice (the
    Gemma 3 prompt under "none" describes the tools without inviting a call) and whether the prompt ends with a
    generation prompt or inside the final message (`continue_final_message`). `req` has been checked
    (`check_chat_prompt_fields`, and its tool_choice by the chat plan).

    Args:
      check_size: refuse text that cannot fit max_model_len before tokenizing it (off for `/tokenize`, which
        counts any prompt the body limit lets through).
    Raises:
      ApiError: 400 when the text cannot fit max_model_len, or the template cannot render it (the tokenizer
        service names the problem).
    """
    facts = backends.ready_facts()
    if check_size:
        _check_prompt_bytes(sum(_text_bytes(m) for m in req.messages), facts, "messages")
    mode, _ = resolve_tool_choice(req.tools or [], req.tool_choice)
    request = tokenizer_pb2.ChatTemplateRequest(
        messages=[message_to_pb(m, backends.answers, scope) for m in req.messages],
        add_generation_prompt=req.generation_prompt(),
        tools_json=json.dumps(req.tools) if req.tools else "",
        template_kwargs_json=json.dumps(template_kwargs) if template_kwargs else "",
        continue_final_message=req.continue_final_message,
        tool_choice=mode,
    )
    reply = await backends.call("tokenizer service", backends.tokenizer.ApplyChatTemplate(request))
    return list(reply.token_ids)


def _text_bytes(m) -> int:
    """Bytes of a message's text that certainly become prompt tokens (templates trim content)."""
    if isinstance(m.content, str):
        return len(m.content.strip().encode("utf-8"))
    return sum(len((p.text or "").strip().encode("utf-8")) for p in m.content or [])


# ---------------------------------------------------------------------------------------------- grammar, jobs


async def _chat_plan(backends: ModelFactsView, req) -> ChatPlan:
    """The chat plan of a request (its schema and tools checked for size and depth, then compiled off the
    event loop)."""
    if req.response_format is not None:
        check_field(req.response_format, "response_format", MAX_SCHEMA_BYTES)
    if req.tools:
        check_field(req.tools, "tools", MAX_SCHEMA_BYTES)
    facts = backends.ready_facts()
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_COMPILE_POOL, plan_chat, req, facts)


async def _build_jobs(backends: PlanningView, req: SamplingFields, limits: Limits, prompts: list[tuple[list[int], str]],
                  ask: Ask) -> Plan:
    """Resolve each prompt's answer limit, compile each choice's constraint (with its first mask), route the
    request to one worker (all its prompts and choices: `n` choices share their prompt's KV there), and build
    every job's GenParams in one piece."""
    facts = backends.ready_facts()
    salt = prefix_salt(ask.scope, limits.share_prefix_cache_across_keys)
    answer_limits = [answer_budget(len(ids), ask.limit, limits, facts.max_model_len) for ids, _ in prompts]
    constraints = await _constraints(backends, ask.chat, [n for n in answer_limits for _ in range(req.n)],
                                     ask.limit.floor_param())
    session = _session(ask.session, req)
    worker = backends.route(session.key, prompts[0][0], salt, _tiebreak(req, prompts))
    reservation = backends.pool.reserve(worker, len(prompts) * req.n)
    jobs: list[Job] = []
    for p, (ids, _) in enumerate(prompts):
        rid0 = ask.request_id if ask.request_id and p == 0 else f"gen-{uuid.uuid4().hex}"
        for j in range(req.n):
            index = p * req.n + j
            constraint, mask = constraints[index]
            params = GenParams(
                sampling=sampling_params(req, j, ask.top_logprobs, ask.chat.banned_ids),
                max_tokens=answer_limits[p], stop=req.stop_list(), stop_token_ids=ask.chat.stop_ids,
                ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
                allowed_token_ids=list(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
                share_prompt_with=rid0 if j else None, constraint=constraint, initial_mask=mask,
                constraint_param=ask.chat.param, cache_salt=salt, worker=worker, reservation=reservation,
                # the lease follows choice 0's slot
                session=session if session.key is not None and not j else None,
                prediction=ask.prediction, draft_scope=ask.scope, slo_ttft_s=session.ttft_s,
                slo_tpot_s=session.tpot_s, priority=req.priority)
            jobs.append(Job(index, ids, params, rid0 if j == 0 else f"{rid0}-{j}"))
    splitters = [ask.chat.splitter(facts, req.stop_list(), f"{ask.call_prefix}{job.index}_") for job in jobs]
    return Plan(ask.model, prompts, req.n, jobs, ask.chat, splitters, ask.scope,
                ask.limit.echoed(answer_limits[0], limits))


def _session(session: Session, req: SamplingFields) -> Session:
    """The request's session with its key resolved: `x-session-id`, else the `user` field (None: no session).

    Raises:
      ApiError: 400 for a lease (ttl or release) without a session key.
    """
    key = session.key or req.user or None
    if (session.ttl or session.release) and key is None:
        raise ApiError(400, "a session lease (x-session-ttl, x-session-release) needs a session: send x-session-id "
                            "or the user field", param="x-session-id")
    return dataclasses.replace(session, key=key)


def _tiebreak(req, prompts: list[tuple[list[int], str]]) -> str:
    """The conversation key that places a request no session or prefix places (gateway/backends/workers.py): a chat's
    messages up to its first user message (what a conversation keeps from turn to turn, and what tells two
    conversations under one system prompt apart), else the head of the first prompt."""
    messages = getattr(req, "messages", None)
    if messages:
        parts = []
        for m in messages:
            parts.append(f"{m.role}:{m.content}")
            if m.role == "user":
                break
        return tiebreak_key(parts)
    return tiebreak_key([" ".join(map(str, prompts[0][0][:256]))])


async def _constraints(backends: PlanningView, chat: ChatPlan, budgets: list[int],
                       limit_param: str | None = None) -> list[tuple[object, bytes | None]]:
    """(constraint, first mask) per choice, each knowing its token budget (gateway/structured/budget.py, gateway/structured/endings.py);
    (None, None) per choice without a grammar. Compiled off the event loop. `limit_param` names the request field
    the budgets come from when they are the client's as sent (None: the server decided or lowered them — no limit
    sent, `--max-tokens-cap`, the Messages API's clamp — and a budget below the shortest answer only cuts it, as
    before).

    Raises:
      ApiError: 400 naming the grammar's field when it exceeds llguidance's budget or does not compile; 400 naming
        `limit_param` when a budget the client sent is below the shortest valid answer.
    """
    factory = await constraint_factory(backends, chat)
    if factory is None:
        return [(None, None)] * len(budgets)

    def build() -> list[tuple[object, bytes | None]]:
        out = []
        for budget in budgets:
            try:
                constraint = factory(budget)
                mask = constraint.mask()
            except (ConstraintError, ValueError) as err:
                raise ApiError(400, f"{chat.param}: the grammar cannot be used: {err}", param=chat.param,
                               code="unsupported_schema") from None
            shortest = constraint.shortest() if limit_param is not None else None
            if shortest is not None and shortest > budget:
                raise ApiError(400, f"{limit_param} is {budget}, below the shortest valid answer that {chat.param} "
                                    f"allows ({shortest} tokens)", param=limit_param, code="max_tokens_too_small")
            out.append((constraint, mask))
        return out

    return await asyncio.get_running_loop().run_in_executor(_COMPILE_POOL, build)


# ------------------------------------------------------------------------------------------ sampling params


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
        token = int(key) if key.isdecimal() and len(key) <= 10 else -1
        if not 0 <= token < 2**31:
            raise ApiError(400, f"logit_bias keys must be token ids, got {key[:20]!r}", param="logit_bias")
        sp.logit_bias[token] = float(bias)
    if req.seed is not None:
        sp.seed = req.seed & 0xFFFFFFFFFFFFFFFF
    return sp


def sampling_params(req: SamplingFields, choice: int, top_logprobs: int = 0,
                    banned_ids: list[int] = ()) -> common_pb2.SamplingParams:
    """The worker SamplingParams of choice number `choice` (a seeded request gives choice i the seed + i), with
    logprobs always computed, `top_logprobs` alternatives, and `banned_ids` (a chat plan's) biased to -100.

    Raises:
      ApiError: 400 for a bad logit_bias.
    """
    sp = sampling_from_request(req)
    sp.logprobs = True
    sp.top_logprobs = top_logprobs
    if sp.HasField("seed"):
        sp.seed = (sp.seed + choice) & 0xFFFFFFFFFFFFFFFF
    for tid in banned_ids:
        sp.logit_bias[tid] = -100.0
    return sp
