"""Pydantic models of the OpenAI request bodies we accept. Unknown fields are ignored.

Types are strict where the API is: `max_tokens: 3.5` or `"3"` is a 400, not a silent conversion (3.0 is the integer
3, as JSON Schema reads it). Range checks
that OpenAI documents (temperature 0..2, top_p 0..1, penalties -2..2, logit_bias -100..100) are enforced here, and
every integer the protos carry is bounded to what they can hold (int32 token ids and counts, a 64-bit seed), every
float is finite, and names (`model`, `user`, `cache_salt`, message `name`, `tool_call_id`) are short — so no value
a client sends can overflow on its way to a backend. Checks that need the model (context length, token ids
against the vocabulary) or a limit flag happen in gateway/planning/planner.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
)

from gateway.core.limits import MAX_NAME_CHARS


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 3.0: an integral float is taken as the integer (3.5 and "3" stay errors)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


_UNION_TAG = re.compile(r"^(?:constrained-\w+|function-\w+|(?:list|dict|tuple|set)\[.*\]|str|int|float|bool|"
                        r"json-or-python\[.*\]|tokenize-\w+)$")


def error_param(loc: tuple) -> str | None:
    """The request field a pydantic error location names, dotted ("messages.0.role", "stop_token_ids.1"): the
    union-member tags pydantic puts in locations (`constrained-str`, `list[int]`, ...) are left out."""
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and _UNION_TAG.match(p))]
    return ".".join(parts) or None


def int_in(lo: int, hi: int):
    """An integer in [lo, hi]: strict, except that an integral float (3.0) is that integer, as in JSON Schema.
    (The bounds sit inside the type, so the JSON schema carries them as minimum/maximum.)"""
    return Annotated[StrictInt, Field(ge=lo, le=hi), BeforeValidator(_integral)]


#: A number (int or float, never a bool or a string).
Number = StrictFloat
#: A protobuf int32: larger values cannot reach the worker.
Int32 = int_in(-(2**31), 2**31 - 1)
#: A token id as the protos carry it (int32, non-negative); the vocabulary bound is checked with the model.
TokenId = int_in(0, 2**31 - 1)
Name = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS)]


class _Body(BaseModel):
    # NaN and infinities are refused in every float field (the JSON body parser refuses them too).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    """`stream_options`: include_usage adds a final chunk with the token counts."""

    include_usage: StrictBool = False


class SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: Name | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    #: Up to the worker's MAX_TOP_K (its top-k runs lax.top_k over a fixed 1024).
    top_k: int_in(-1, 1024) | None = None
    min_p: Number | None = Field(default=None, ge=0, lt=1)
    n: int_in(1, 16) = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    #: At most 4 non-empty stop sequences (OpenAI); their total bytes are bounded by --max-stop-bytes.
    stop: (Annotated[StrictStr, Field(min_length=1)]
           | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=4)] | None) = None
    seed: int_in(-(2**63), 2**64 - 1) | None = None
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(default=None, gt=0, le=1e6)
    #: At most the worker's MAX_LOGIT_BIAS (300) entries.
    logit_bias: dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None = Field(default=None, max_length=300)
    user: Name | None = None
    response_format: dict[str, Any] | None = None
    # vLLM-compatible extensions.
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    #: Isolates this request's cached prefixes and remembered answers from requests with another salt (vLLM).
    cache_salt: Name | None = None
    #: Admission order among the worker's waiting requests with the same latency deadline (vLLM's field: lower
    #: first; requests without a TTFT target share one deadline).
    priority: int_in(-(2**31), 2**31 - 1) = 0

    def stop_list(self) -> list[str]:
        """`stop` as a list."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stops


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: (StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    #: Absent: OpenAI's default of 16 (gateway/planning/answer_limit.py); null means "whatever fits".
    max_tokens: Int32 | None = None
    echo: StrictBool = False
    logprobs: int_in(0, 20) | None = None
    #: Not supported: a non-empty suffix is a 400 (the schema says so: at most 0 characters).
    suffix: StrictStr | None = Field(default=None, json_schema_extra={"maxLength": 0})
    #: Only 1 or n (one answer per choice); the schema advertises 1.
    best_of: int_in(1, 16) | None = Field(default=None, json_schema_extra={"maximum": 1})


class ContentPart(_Body):
    """One part of list-form message content (text only: the served models read no images)."""

    type: Literal["text"]
    text: StrictStr | None = None


class FunctionCall(_Body):
    """`function` of a tool call."""

    name: StrictStr = Field(max_length=64)
    arguments: StrictStr = "{}"


class ToolCall(_Body):
    """An assistant message's tool call."""

    id: Name = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Name | None = None
    reasoning_content: StrictStr | None = None


class ChatPromptFields(_Body):
    """The fields that decide a chat prompt's tokens, shared by chat completions and `/tokenize` (so a client
    counts exactly the prompt a chat completion would use)."""

    messages: list[ChatMessage] = Field(min_length=1)
    #: OpenAI tool objects; `function.strict` (a bool) is accepted: every tool's schema is always enforced.
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    #: vLLM: end the prompt with the start of the model's turn.
    add_generation_prompt: StrictBool = True
    #: vLLM: the final message (an assistant message) is a prefilled answer the model continues; its turn is left
    #: open and no generation prompt follows. Both this and an explicit `add_generation_prompt: true` is a 400.
    continue_final_message: StrictBool = False

    def generation_prompt(self) -> bool:
        """Whether the prompt ends with a generation prompt: `add_generation_prompt`, off when continuing the
        final message (unless both were asked for, which the planner refuses)."""
        return self.add_generation_prompt and not self.continue_final_message


class Prediction(_Body):
    """OpenAI Predicted Outputs: text the answer is expected to repeat (a file being edited), a source of draft
    tokens for speculative decoding. It never changes the answer, only how fast it comes."""

    type: Literal["content"]
    content: StrictStr | list[ContentPart]

    def text(self) -> str:
        """The predicted text (list-form content joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(SamplingFields, ChatPromptFields):
    """POST /v1/chat/completions."""

    prediction: Prediction | None = None
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: StrictBool = False
    top_logprobs: int_in(0, 20) | None = None
    parallel_tool_calls: StrictBool | None = None


class TokenizeCompletionRequest(_Body):
    """POST /tokenize with a raw prompt (vLLM's shape): the ids `/v1/completions` would use for it."""

    model: Name | None = None
    prompt: StrictStr
    #: Prepend BOS (unless the text already starts with it), as a completion prompt gets.
    add_special_tokens: StrictBool = True
    #: Also return each id's vocabulary piece.
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(ChatPromptFields):
    """POST /tokenize with chat messages (vLLM's shape): exactly the prompt ids `/v1/chat/completions` would use
    for the same messages, tools, tool_choice, template kwargs and `cache_salt`."""

    model: Name | None = None
    #: The answer-history scope, as a chat completion's: remembered answers render as the ids they were generated as.
    cache_salt: Name | None = None
    #: Accepted for vLLM compatibility; the chat template already emits the prompt's one BOS, so nothing is added.
    add_special_tokens: StrictBool = False
    #: Also return each id's vocabulary piece.
    return_token_strs: StrictBool | None = False


def _tokenize_kind(body: Any) -> str:
    return "tokenize-chat" if isinstance(body, dict) and "messages" in body else "tokenize-prompt"


#: The body of POST /tokenize: the chat form when it has `messages`, else the prompt form.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("tokenize-prompt")] | Annotated[TokenizeChatRequest, Tag("tokenize-chat")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's shape): token ids -> text, control tokens spelled out."""

    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(min_length=1)]


class TokenizeResponse(BaseModel):
    """The answer of POST /tokenize (vLLM's shape): the ids, their count, the context length to compare with."""

    count: int
    max_model_len: int
    tokens: list[int]
    #: Each id's vocabulary piece, with `return_token_strs: true`.
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """The answer of POST /detokenize (vLLM's shape)."""

    prompt: str
