"""gateway/planning/planner.py, the one request planner of the REST API and gRPC `Generate`, tested directly against a
fake backend: limit and field checks (each a 400 naming the field and the numbers), the model-name check
(404), the choices against the worker's waiting queue, the prompts (text refused by its size before it is
tokenized, ids checked against the vocabulary, the context length), the chat prompt as rendered by the
tokenizer service's `ApplyChatTemplate`, jobs with their parameters, constraints and first masks, and the
route to one worker.

The fake (`_Backends`) implements exactly what the planner calls on `gateway.backends.clients.Backends`: `ready_facts`,
`call`, `tokenizer.Encode`/`ApplyChatTemplate`/`Decode`, `answers`, `grammar_tokenizer`, `route` and
`pool.reserve`. Its vocabulary is tiny and byte-level (ids 0-255 are the bytes, then `<eos>`, `<end_of_turn>`,
`<bos>`), so the ids of a text are its bytes and llguidance (the grammar engine the constraints use) runs on a
259-token tokenizer in microseconds. Expected values come from the documented rules (README, docstrings), not
from the planner's code paths.
"""

from __future__ import annotations

import asyncio
import functools
import json

import llguidance
import numpy as np
import pytest

from gateway.backends.history import AnswerHistory, answer_key, history_scope
from gateway.backends.model_facts import ModelFacts
from gateway.backends.workers import Session
from gateway.core.errors import ApiError
from gateway.core.limits import Limits
from gateway.core.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from gateway.planning.context import RequestContext
from gateway.planning.planner import detokenize, plan_chat_completion, plan_completion, tokenize
from protos import tokenizer_pb2

EOS, END_OF_TURN, BOS = 256, 257, 258
TOKEN_BYTES = [bytes([b]) for b in range(256)] + [b"<eos>", b"<end_of_turn>", b"<bos>"]
VOCAB = len(TOKEN_BYTES)
MAX_LEN = 128
WORKER = "worker-a:50051"
USER = {"role": "user", "content": "Capital of France?"}


class _ByteVocabulary:
    """llguidance's view of the fake vocabulary (a `TokenizerWrapper` source): the bytes, then three control
    tokens."""

    eos_token_id = EOS
    bos_token_id = BOS
    tokens = TOKEN_BYTES
    special_token_ids = (EOS, END_OF_TURN, BOS)

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@functools.cache
def _lltokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()), slices=[])


def _facts(max_model_len: int = MAX_LEN, max_waiting: int = 8) -> ModelFacts:
    return ModelFacts(name="m", max_model_len=max_model_len, vocab_size=VOCAB, token_bytes=list(TOKEN_BYTES),
                      special_ids={EOS, END_OF_TURN, BOS}, bos_id=BOS, stop_ids=[EOS, END_OF_TURN],
                      architecture="gemma3", eos_id=EOS, max_waiting=max_waiting)


class _Tokenizer:
    """The tokenizer service's RPCs the planner uses, recording each request: a text's ids are its UTF-8 bytes
    (after BOS when asked); a chat renders as BOS then `role:content\\n` per message (and `model:` for the
    generation prompt)."""

    def __init__(self):
        self.requests: list = []

    async def Encode(self, request):
        self.requests.append(request)
        bos = [BOS] if request.add_bos else []
        return tokenizer_pb2.EncodeResponse(token_ids=bos + list(request.text.encode()))

    async def ApplyChatTemplate(self, request):
        self.requests.append(request)
        text = "".join(f"{m.role}:{m.content}\n" for m in request.messages)
        text += "model:" if request.add_generation_prompt else ""
        return tokenizer_pb2.ChatTemplateResponse(token_ids=[BOS, *text.encode()])

    async def Decode(self, request):
        self.requests.append(request)
        ids = list(request.token_ids)
        return tokenizer_pb2.DecodeTokensResponse(
            text=b"".join(TOKEN_BYTES[i] for i in ids).decode("utf-8", "replace"),
            token_strs=[TOKEN_BYTES[i].decode("latin-1") for i in ids] if request.return_token_strs else [])


class _Pool:
    """`WorkerPool.reserve`, recorded."""

    def __init__(self):
        self.reservations: list[tuple[str, int]] = []

    def reserve(self, addr: str, count: int):
        self.reservations.append((addr, count))
        return ("reservation", addr, count)


class _Backends:
    """What the planner calls on `gateway.backends.clients.Backends` (module docstring); `facts = None`: a backend is
    away."""

    def __init__(self, facts: ModelFacts | None = None):
        self.facts = facts if facts is not None else _facts()
        self.tokenizer = _Tokenizer()
        self.answers = AnswerHistory()
        self.pool = _Pool()
        self.routes: list[tuple] = []

    def ready_facts(self) -> ModelFacts:
        if self.facts is None:
            raise ApiError(503, "the model is still loading; retry shortly", code="model_loading")
        return self.facts

    async def call(self, backend: str, coro):
        return await coro

    async def grammar_tokenizer(self) -> llguidance.LLTokenizer:
        self.ready_facts()
        return _lltokenizer()

    def route(self, session_key, prompt_ids, salt, tiebreak) -> str:
        self.routes.append((session_key, list(prompt_ids), salt, tiebreak))
        return WORKER


def _context(backends: _Backends, limits: Limits | None = None, **context) -> RequestContext:
    """A request context over the fake backends (`context`: tenant, session, request_id)."""
    return RequestContext(backends, limits or Limits(), **context)


def _complete(backends: _Backends, body: dict, limits: Limits | None = None, **context):
    req = CompletionRequest.model_validate(body)
    return asyncio.run(plan_completion(_context(backends, limits, **context), req, call_prefix="call_"))


def _chat(backends: _Backends, body: dict, limits: Limits | None = None, clamp: bool = False, **context):
    req = ChatCompletionRequest.model_validate(body)
    return asyncio.run(plan_chat_completion(_context(backends, limits, **context), req, call_prefix="call_",
                                            clamp=clamp))


def _refused(plan, backends: _Backends, body: dict, limits: Limits | None = None, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as err:
        plan(backends, body, limits, **kwargs)
    return err.value


def _allowed(mask: bytes) -> set[int]:
    bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


# ---------------------------------------------------------------------------------------- context length


def test_a_prompt_that_leaves_no_room_is_a_400_naming_the_context_length():
    err = _refused(_complete, _Backends(), {"prompt": [7] * MAX_LEN, "max_tokens": 1})
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert f"maximum context length is {MAX_LEN} tokens" in err.message
    assert f"your prompt has {MAX_LEN} tokens" in err.message
    fits = _complete(_Backends(), {"prompt": [7] * (MAX_LEN - 1), "max_tokens": 1})
    assert fits.prompt_tokens == MAX_LEN - 1


def test_a_prompt_plus_max_tokens_beyond_the_context_is_a_400_naming_both_numbers():
    prompt = [7] * (MAX_LEN - 4)
    err = _refused(_complete, _Backends(), {"prompt": prompt, "max_tokens": 5})
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    assert f"requested {MAX_LEN + 1} tokens ({MAX_LEN - 4} in the prompt, 5 for the completion)" in \
        err.message
    assert _complete(_Backends(), {"prompt": prompt, "max_tokens": 4}).jobs[0].params.max_tokens == 4


def test_a_chat_over_the_context_names_the_field_that_set_the_limit():
    """`max_completion_tokens` wins over `max_tokens`, and the 400 names the field that set the limit."""
    prompt = len(_chat(_Backends(), {"messages": [USER], "max_tokens": 1}).prompts[0][0])
    room = MAX_LEN - prompt
    plan = _chat(_Backends(), {"messages": [USER], "max_tokens": room + 1, "max_completion_tokens": room})
    assert plan.jobs[0].params.max_tokens == room
    err = _refused(_chat, _Backends(), {"messages": [USER], "max_completion_tokens": room + 1})
    assert (err.status, err.param) == (400, "max_completion_tokens")
    numbers = f"requested {MAX_LEN + 1} tokens ({prompt} in the prompt, {room + 1} for the completion)"
    assert numbers in err.message


# ------------------------------------------------------------------------------------ max_tokens defaults


@pytest.mark.parametrize("cap, want", [(None, 16), (100, 16), (5, 5)])
def test_a_completion_without_max_tokens_gets_16_at_most_the_cap(cap, want):
    plan = _complete(_Backends(), {"prompt": "Hello"}, Limits(max_tokens_cap=cap))
    assert [job.params.max_tokens for job in plan.jobs] == [want]


def test_max_tokens_null_is_whatever_fits_under_the_cap():
    """`max_tokens: null` on a completion, and an absent one on a chat, means "what fits": the room left in
    max_model_len, decided by the planner (`answer_budget`: the worker receives that number), at most the cap."""
    body = {"prompt": [7] * (MAX_LEN - 14), "max_tokens": None}
    assert _complete(_Backends(), body).jobs[0].params.max_tokens == 14
    assert _complete(_Backends(), body, Limits(max_tokens_cap=20)).jobs[0].params.max_tokens == 14
    assert _complete(_Backends(), body, Limits(max_tokens_cap=10)).jobs[0].params.max_tokens == 10
    chat = _chat(_Backends(), {"messages": [USER]}, Limits(max_tokens_cap=1000))
    assert chat.jobs[0].params.max_tokens == MAX_LEN - len(chat.prompts[0][0])
    assert _chat(_Backends(), {"messages": [USER]}).jobs[0].params.max_tokens == MAX_LEN - len(chat.prompts[0][0])


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ({"prompt": "x", "max_tokens": 9}, "max_tokens must be at most 8 on this server, got 9"),
])
def test_max_tokens_below_one_or_above_the_cap_is_a_400_even_with_the_backends_away(body, message):
    """The checks that need no backend come first: bad input is a 400, not the 503 of a backend away."""
    err = _refused(_complete, _Backends(), body, Limits(max_tokens_cap=8))
    assert (err.status, err.param, err.message) == (400, "max_tokens", message)
    away = _Backends()
    away.facts = None
    assert _refused(_complete, away, body, Limits(max_tokens_cap=8)).status == 400
    assert _refused(_complete, away, {"prompt": "x", "max_tokens": 8}, Limits(max_tokens_cap=8)).status == 503


# ---------------------------------------------------------------------------------------- request fields


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "stop": ["a" * 600, "b" * 600]}, "stop", "1200 bytes"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
    ({"prompt": "x", "suffix": "tail"}, "suffix", "not supported"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of", "best_of"),
])
def test_completion_fields_the_server_cannot_honour_are_a_400_naming_the_field(body, param, words):
    err = _refused(_complete, _Backends(), body)
    assert (err.status, err.param) == (400, param) and words in err.message, err.message


def test_completion_best_of_equal_to_n_is_accepted():
    assert len(_complete(_Backends(), {"prompt": "x", "n": 2, "best_of": 2}).jobs) == 2


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [USER], "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"messages": [USER] * 5}, "messages", "at most 4 messages"),
    ({"messages": [USER], "continue_final_message": True}, "messages", "must be an assistant message"),
    ({"messages": [USER, {"role": "assistant", "content": "The"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message", "Cannot set both"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c0", "function": {"name": "f", "arguments": "[1, 2]"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "must be a JSON object"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c0", "function": {"name": "f", "arguments": '{"a": '}},
        {"id": "c1", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "only an answer's last call"),
])
def test_chat_fields_that_cannot_apply_are_a_400_naming_the_field(body, param, words):
    err = _refused(_chat, _Backends(), body, Limits(max_messages=4))
    assert (err.status, err.param) == (400, param) and words in err.message, err.message


def test_an_answers_last_call_cut_off_by_max_tokens_may_come_back():
    """A prefix of a JSON object as the last call's arguments is what a `length` answer returned: accepted."""
    call = {"id": "c0", "function": {"name": "f", "arguments": '{"city": "Pa'}}
    cut = {"role": "assistant", "tool_calls": [call]}
    plan = _chat(_Backends(), {"messages": [USER, cut, {"role": "user", "content": "go on"}]})
    assert len(plan.jobs) == 1


# ----------------------------------------------------------------------------------------------- token ids


@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", [EOS, VOCAB]),
    ("allowed_token_ids", [0, VOCAB + 40]),
    ("logit_bias", {"0": 1.0, str(VOCAB): -1.0}),
    ("prompt", [1, 2, VOCAB]),
])
def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(field, value):
    body = {"prompt": [1, 2, 3], field: value}
    err = _refused(_complete, _Backends(), body)
    assert (err.status, err.param) == (400, field)
    assert f"[0, {VOCAB})" in err.message, err.message


def test_token_ids_at_the_top_of_the_vocabulary_are_accepted_and_passed_on():
    top = VOCAB - 1
    plan = _complete(_Backends(), {"prompt": [top], "stop_token_ids": [top], "allowed_token_ids": [top],
                                   "logit_bias": {str(top): 5.0}})
    params = plan.jobs[0].params
    assert plan.prompts == [([top], "")] and top in params.stop_token_ids
    assert params.allowed_token_ids == [top]
    assert params.sampling.logit_bias[top] == 5.0


# ----------------------------------------------------------------------------------------- model and choices


def test_another_model_name_is_a_404_and_the_served_name_or_none_is_planned():
    err = _refused(_complete, _Backends(), {"prompt": "x", "model": "gpt-4"})
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    assert "`gpt-4`" in err.message and "`m`" in err.message
    assert _complete(_Backends(), {"prompt": "x", "model": "m"}).model == "m"
    assert _chat(_Backends(), {"messages": [USER]}).model == "m"


@pytest.mark.parametrize("prompt, n, param", [(["a", "b", "c"], 2, "prompt"), (["a"], 5, "n"), ("a", 5, "n")])
def test_more_generations_than_the_waiting_queue_holds_are_a_400(prompt, n, param):
    """prompts x n beyond the worker's waiting queue (4 here) could never be admitted at once."""
    err = _refused(_complete, _Backends(_facts(max_waiting=4)), {"prompt": prompt, "n": n})
    assert (err.status, err.param) == (400, param)
    assert f"asks for {len(prompt if isinstance(prompt, list) else [prompt]) * n} generations" in err.message
    assert "at most 4" in err.message


def test_jobs_are_prompt_major_and_choices_share_their_prompts_request():
    """Prompt p's choices are jobs p*n..p*n+n-1; choice 0 of the first prompt gets the given request id, later
    choices `<id>-j` sharing choice 0's prompt; a seeded request gives choice j the seed + j."""
    backends = _Backends(_facts(max_waiting=4))
    plan = _complete(backends, {"prompt": ["ab", "cde"], "n": 2, "seed": 7}, request_id="req-1")
    assert [job.index for job in plan.jobs] == [0, 1, 2, 3]
    assert [job.prompt for job in plan.jobs] == [[BOS, *b"ab"]] * 2 + [[BOS, *b"cde"]] * 2
    assert plan.prompts == [([BOS, *b"ab"], "ab"), ([BOS, *b"cde"], "cde")] and plan.prompt_tokens == 7
    first, second = plan.jobs[0].request_id, plan.jobs[2].request_id
    assert first == "req-1" and second not in ("req-1", "") and plan.jobs[3].request_id == f"{second}-1"
    assert plan.jobs[1].request_id == "req-1-1"
    assert [job.params.share_prompt_with for job in plan.jobs] == [None, "req-1", None, second]
    assert [job.params.sampling.seed for job in plan.jobs] == [7, 8, 7, 8]
    assert len(plan.splitters) == 4 and backends.pool.reservations == [(WORKER, 4)]


# -------------------------------------------------------------------------------------------------- prompts


def test_a_text_prompt_is_encoded_with_bos_and_control_tokens_parsed():
    backends = _Backends()
    plan = _complete(backends, {"prompt": "Hi"})
    [request] = backends.tokenizer.requests
    assert (request.text, request.add_bos, request.parse_special) == ("Hi", True, True)
    assert plan.prompts == [([BOS, *b"Hi"], "Hi")]


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized():
    """No token spells more than `max_token_bytes` bytes (13 here: `<end_of_turn>`), so text longer than
    max_model_len x that cannot fit: refused without calling the tokenizer service."""
    facts = _facts()
    bound = facts.max_model_len * facts.max_token_bytes
    assert bound == MAX_LEN * 13
    backends = _Backends(facts)
    err = _refused(_complete, backends, {"prompt": "a" * (bound + 1)})
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert f"{bound + 1} bytes" in err.message and f"({bound} bytes)" in err.message
    assert backends.tokenizer.requests == []
    err = _refused(_chat, backends, {"messages": [{"role": "user", "content": "é" * (bound // 2 + 1)}]})
    assert (err.status, err.param) == (400, "messages") and backends.tokenizer.requests == []
    # At the bound it is tokenized, and then refused by its token count.
    err = _refused(_complete, backends, {"prompt": "a" * bound})
    assert len(backends.tokenizer.requests) == 1 and f"your prompt has {bound + 1} tokens" in err.message


def test_tokenize_counts_a_prompt_longer_than_the_context_instead_of_refusing_it():
    backends = _Backends()
    ids, strs = asyncio.run(tokenize(_context(backends), TokenizeCompletionRequest(prompt="a" * 2000)))
    assert ids == [BOS] + [ord("a")] * 2000 and strs is None
    chat = TokenizeChatRequest.model_validate({"messages": [{"role": "user", "content": "b" * 2000}],
                                               "return_token_strs": True})
    ids, strs = asyncio.run(tokenize(_context(backends), chat))
    assert len(ids) > 2000 and strs == [TOKEN_BYTES[i].decode("latin-1") for i in ids]


def test_detokenize_refuses_an_id_outside_the_vocabulary_naming_its_index():
    backends = _Backends()
    with pytest.raises(ApiError) as err:
        asyncio.run(detokenize(backends, DetokenizeRequest(tokens=[104, 105, VOCAB])))
    assert (err.value.status, err.value.param) == (400, "tokens.2")
    assert asyncio.run(detokenize(backends, DetokenizeRequest(tokens=[104, 105]))) == "hi"


def test_a_chat_is_rendered_by_the_tokenizers_chat_template_with_its_messages():
    backends = _Backends()
    messages = [{"role": "system", "content": "Be brief."}, USER, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And Spain?"}]
    body = {"messages": messages, "chat_template_kwargs": {"custom": 1}}
    plan = _chat(backends, body)
    [request] = backends.tokenizer.requests
    assert isinstance(request, tokenizer_pb2.ChatTemplateRequest)
    assert [(m.role, m.content) for m in request.messages] == [(m["role"], m["content"]) for m in messages]
    assert request.add_generation_prompt and not request.continue_final_message
    assert (request.tools_json, request.tool_choice) == ("", "none")
    assert json.loads(request.template_kwargs_json) == {"custom": 1}
    rendered = "".join(f"{m['role']}:{m['content']}\n" for m in messages) + "model:"
    assert plan.prompts == [([BOS, *rendered.encode()], "")] and plan.jobs[0].prompt == plan.prompts[0][0]


def test_continuing_the_final_message_renders_without_a_generation_prompt():
    backends = _Backends()
    _chat(backends, {"messages": [USER, {"role": "assistant", "content": "The capital is"}],
                     "continue_final_message": True})
    [request] = backends.tokenizer.requests
    assert request.continue_final_message and not request.add_generation_prompt


def test_a_remembered_answer_is_sent_with_its_ids_only_within_its_scope():
    """An answer the server generated comes back with its exact ids, for its tenant and cache_salt only."""
    body = {"messages": [USER, {"role": "assistant", "content": "Paris."}, USER], "cache_salt": "s"}
    for tenant, want in (("t", [3, 4]), ("other", [])):
        backends = _Backends()
        backends.answers.remember(history_scope("t", "s"), answer_key("Paris."), [3, 4])
        plan = _chat(backends, body, tenant=tenant)
        [request] = backends.tokenizer.requests
        assert [list(m.generated_token_ids) for m in request.messages] == [[], want, []]
        assert plan.scope == history_scope(tenant, "s")


# ----------------------------------------------------------------------------------- grammars and constraints


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def test_a_json_schema_response_format_gives_every_job_its_own_constraint_and_first_mask():
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    body = {"messages": [USER], "n": 2, "max_tokens": 8, "response_format": response_format}
    plan = _chat(_Backends(), body)
    assert plan.chat.grammar is not None and plan.chat.param == "response_format"
    first, second = (job.params for job in plan.jobs)
    assert first.constraint is not None and second.constraint is not None
    assert first.constraint is not second.constraint
    assert first.constraint_param == "response_format"
    allowed = _allowed(first.initial_mask)
    assert ord("{") in allowed and not allowed & {ord("a"), ord("["), EOS, END_OF_TURN}
    assert {EOS, END_OF_TURN} <= set(first.stop_token_ids)  # a constraint ends with the model's stop tokens


def test_a_completion_response_format_is_constrained_too():
    body = {"prompt": "JSON:", "max_tokens": 8, "response_format": {"type": "json_object"}}
    plan = _complete(_Backends(), body)
    params = plan.jobs[0].params
    assert params.constraint is not None and params.constraint_param == "response_format"
    assert ord("{") in _allowed(params.initial_mask) and ord("J") not in _allowed(params.initial_mask)


def test_without_a_grammar_jobs_carry_no_constraint():
    params = _chat(_Backends(), {"messages": [USER]}).jobs[0].params
    assert params.constraint is None and params.initial_mask is None
    assert params.stop_token_ids == []


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "string", "not": {"const": "x"}}, "not"),
])
def test_an_unenforceable_response_format_schema_is_a_400_naming_the_keyword(schema, keyword):
    backends = _Backends()
    err = _refused(_chat, backends, {"messages": [USER], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert (err.status, err.param, err.code) == (400, "response_format", "unsupported_schema")
    assert keyword in err.message, err.message
    assert backends.tokenizer.requests == []  # refused before the prompt is rendered


def test_a_tool_schema_outside_the_subset_is_a_400_naming_the_keyword_and_path():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}}
    err = _refused(_chat, _Backends(), {"messages": [USER], "tools": [tool]})
    assert (err.status, err.param, err.code) == (400, "tools", "unsupported_schema")
    assert "'multipleOf'" in err.message and "/properties/n" in err.message


def test_tools_are_planned_with_the_families_format_grammar_and_end_tokens():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    backends = _Backends()
    plan = _chat(backends, {"messages": [USER], "tools": [tool], "tool_choice": "required", "max_tokens": 90})
    assert (plan.chat.tool_format, plan.chat.param, plan.chat.calls_only) == ("gemma3", "tools", True)
    params = plan.jobs[0].params
    assert params.constraint is not None and params.constraint_param == "tools"
    assert END_OF_TURN in params.stop_token_ids
    [request] = backends.tokenizer.requests
    assert json.loads(request.tools_json) == [tool] and request.tool_choice == "required"


def test_a_limit_below_the_shortest_answer_is_a_400_naming_it_and_a_server_cap_below_it_is_not():
    """The byte vocabulary spells `{"a":""}` in 8 tokens, and the stop token makes 9: a client's max_tokens of 8 is a
    400 before generation (it could only be cut), 9 is planned; the same budget decided by --max-tokens-cap is
    planned (the answer is cut, as before)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}}}
    for field in ("max_tokens", "max_completion_tokens"):
        err = _refused(_chat, _Backends(), {"messages": [USER], "response_format": fmt, field: 8})
        assert (err.status, err.param, err.code) == (400, field, "max_tokens_too_small"), err.message
        assert "9 tokens" in err.message
    assert _chat(_Backends(), {"messages": [USER], "response_format": fmt, "max_tokens": 9}).jobs[0].params.constraint
    capped = _chat(_Backends(), {"messages": [USER], "response_format": fmt}, Limits(max_tokens_cap=4))
    assert capped.jobs[0].params.max_tokens == 4
    # /v1/completions: a limit sent is refused the same way; its default of 16 (no max_tokens) is the server's
    # choice and cuts a longer answer (here at least 29 tokens), as before
    long = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "minLength": 20}}, "required": ["a"],
        "additionalProperties": False}}}
    err = _refused(_complete, _Backends(), {"prompt": "x", "response_format": long, "max_tokens": 16})
    assert (err.status, err.param, err.code) == (400, "max_tokens", "max_tokens_too_small"), err.message
    default = _complete(_Backends(), {"prompt": "x", "response_format": long})
    assert default.jobs[0].params.max_tokens == 16 and default.jobs[0].params.constraint


def test_response_format_with_tools_is_a_400():
    tool = {"type": "function", "function": {"name": "f"}}
    err = _refused(_chat, _Backends(), {"messages": [USER], "tools": [tool],
                                        "response_format": {"type": "json_object"}})
    assert (err.status, err.param) == (400, "response_format")


# --------------------------------------------------------------------------------------------------- routes


def test_the_session_key_prompt_and_salt_route_the_request_and_the_lease_follows_choice_0():
    backends = _Backends()
    session = Session(key="s1", ttl=30)
    plan = _complete(backends, {"prompt": "ab", "n": 2, "cache_salt": "salt"}, session=session)
    [(key, prompt, salt, tiebreak)] = backends.routes
    assert (key, prompt, salt) == ("s1", [BOS, *b"ab"], "salt") and tiebreak
    assert backends.pool.reservations == [(WORKER, 2)]
    assert all(job.params.worker == WORKER for job in plan.jobs)
    assert all(job.params.reservation == ("reservation", WORKER, 2) for job in plan.jobs)
    assert plan.jobs[0].params.session == Session(key="s1", ttl=30) and plan.jobs[1].params.session is None
    assert all(job.params.cache_salt == "salt" for job in plan.jobs)


def test_the_user_field_stands_in_for_a_missing_session_key():
    backends = _Backends()
    _chat(backends, {"messages": [USER], "user": "u7"})
    assert backends.routes[0][0] == "u7"
    _chat(backends, {"messages": [USER]})
    assert backends.routes[1][0] is None


def test_a_session_lease_without_a_session_is_a_400():
    backends = _Backends()
    err = _refused(_complete, backends, {"prompt": "x"}, session=Session(ttl=10))
    assert (err.status, err.param) == (400, "x-session-id")
    assert backends.routes == [] and backends.pool.reservations == []


def test_conversations_under_one_system_prompt_get_different_tiebreaks_and_a_turn_keeps_its_own():
    """The tiebreak key is the messages up to the first user message: the same for a conversation's next turn,
    different for another conversation."""
    backends = _Backends()
    system = {"role": "system", "content": "Be brief."}
    _chat(backends, {"messages": [system, USER]})
    _chat(backends, {"messages": [system, USER, {"role": "assistant", "content": "Paris."}, USER]})
    _chat(backends, {"messages": [system, {"role": "user", "content": "Capital of Spain?"}]})
    first, next_turn, other = (route[3] for route in backends.routes)
    assert first == next_turn and first != other
