"""Pydantic models of the OpenAI request bodies we accept (formats.md §5). Unknown fields are ignored.

Types are strict where the API is: `max_tokens: 3.5` or `"3"` is a 400, not a silent conversion. Range checks
that OpenAI documents (temperature 0..2, top_p 0..1, penalties -2..2, at most 4 stop strings) are enforced here;
checks that need the model (context length, token ids) happen in the route.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    """`stream_options`: include_usage adds a final chunk with the token counts."""

    include_usage: StrictBool = False


class SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: Number | None = Field(default=None, ge=0, lt=1)
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(default=None, gt=0)
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    # vLLM-compatible extensions.
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    stop_token_ids: list[StrictInt] | None = None
    allowed_token_ids: list[StrictInt] | None = None

    def stop_list(self) -> list[str]:
        """`stop` as a list (at most 4 strings, none empty)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stops


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class ContentPart(_Body):
    """One part of list-form message content."""

    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(_Body):
    """`function` of a tool call."""

    name: StrictStr
    arguments: StrictStr = "{}"


class ToolCall(_Body):
    """An assistant message's tool call."""

    id: StrictStr = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One chat message."""

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: StrictStr | None = None
