"""Pydantic models of the OpenAI request bodies we accept. Unknown fields are ignored.

Types are strict where the API is: `max_tokens: 3.5` or `"3"` is a 400, not a silent conversion. Range checks
that OpenAI documents (temperature 0..2, top_p 0..1, penalties -2..2, logit_bias -100..100) are enforced here, and
every integer the protos carry is bounded to what they can hold (int32 token ids and counts, a 64-bit seed), every
float is finite, and names (`model`, `user`, `cache_salt`, message `name`, `tool_call_id`) are short — so no value
a client sends can overflow on its way to a backend. Checks that need the model (context length, token ids
against the vocabulary) or a limit flag happen in gateway/planner.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from gateway.limits import MAX_NAME_CHARS

Number = Union[StrictInt, StrictFloat]
#: A protobuf int32: larger values cannot reach the worker.
Int32 = Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)]
#: A token id as the protos carry it (int32, non-negative); the vocabulary bound is checked with the model.
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
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
    top_k: Int32 | None = Field(default=None, ge=-1)
    min_p: Number | None = Field(default=None, ge=0, lt=1)
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(default=None, gt=0, le=1e6)
    logit_bias: dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    user: Name | None = None
    response_format: dict[str, Any] | None = None
    # vLLM-compatible extensions.
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None
    #: Isolates this request's cached prefixes and remembered answers from requests with another salt (vLLM).
    cache_salt: Name | None = None

    def stop_list(self) -> list[str]:
        """`stop` as a list."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stops


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int32 | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=16)


class ContentPart(_Body):
    """One part of list-form message content."""

    type: StrictStr
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


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: StrictStr | None = None

    def completion_limit(self) -> tuple[int | None, str]:
        """(the answer's token limit, the field that set it): `max_completion_tokens` wins over `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"
