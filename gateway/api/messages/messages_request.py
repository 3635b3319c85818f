"""The Anthropic Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`) and its translation into
the chat request every front door plans through (gateway/planning/planner.py).

Translation: `system` (a string or text blocks; blocks matching `Limits.drop_system_patterns`, client metadata
that changes every request, left out) becomes one system message; a user message's `tool_result` blocks become
tool messages (before its text, in order; `is_error` results are prefixed "Error: "); an assistant message's
`thinking` becomes `reasoning_content`, its `text` the content and its `tool_use` blocks `tool_calls` (their
`input` written back as the arguments text the answer was generated with, when this gateway returned that call:
`CallArguments`, so the conversation renders as generated). Tools with `input_schema` become function tools;
server tools (a `type` such as `web_search_20250305`, `bash_20250124`) are left out and named in a warning header.
`tool_choice` auto/any/tool/none map to auto/required/named/none (`disable_parallel_tool_use` to
`parallel_tool_calls: false`); `thinking.type: enabled` turns the model's thinking on (`budget_tokens` is not
enforced); `metadata.user_id` is the session key.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictStr, WithJsonSchema

from gateway.api.responses.responses_request import (
    extras,
    merge_turns,
    relaxed,
    schema_object,
    validated_chat,
)
from gateway.core.errors import ApiError
from gateway.core.lru import ByteLRU, text_size
from gateway.core.openai_types import ChatCompletionRequest, Int32, Name, Number, _Body, int_in

#: Chat request fields -> the Messages field a client sent (errors name the client's field).
CHAT_PARAM = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", "stop": "stop_sequences",
              "prompt": "messages",
              "messages": "messages", "tools": "tools", "tool_choice": "tool_choice",
              "chat_template_kwargs": "thinking", "response_format": "output_config.format"}


_TEXT_BLOCK = schema_object(["type", "text"], type={"const": "text"}, text={"type": "string"})
#: The messages documented in the OpenAPI schema (checked by `chat_request`, which names the bad field).
MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": schema_object(
    ["role", "content"], role={"enum": ["user", "assistant"]},
    content={"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [
        _TEXT_BLOCK,
        schema_object(["type", "id", "name", "input"], type={"const": "tool_use"}, id={"type": "string"},
             name={"type": "string"}, input={"type": "object"}),
        schema_object(["type", "tool_use_id", "content"], type={"const": "tool_result"}, tool_use_id={"type": "string"},
             content={"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
             is_error={"type": "boolean"}),
    ]}}]})}
SYSTEM_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]}
TOOLS_SCHEMA = {"type": "array", "items": schema_object(["name", "input_schema"], name={"type": "string", "minLength": 1},
                                               description={"type": "string"},
                                               input_schema={"type": "object"})}


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: the prompt fields of a Messages request."""

    model: Name | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1), WithJsonSchema(MESSAGES_SCHEMA)]
    system: Annotated[StrictStr | list[dict[str, Any]] | None, WithJsonSchema(SYSTEM_SCHEMA)] = None
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema(TOOLS_SCHEMA)] = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages (`max_tokens` is required, as in Anthropic's API)."""

    max_tokens: int_in(1, 2**31 - 1)
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = Field(default=None, ge=0, le=1)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: Int32 | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    #: `format` (`{"type": "json_schema", "schema"}`: structured output, enforced by the grammar) and `effort`.
    output_config: dict[str, Any] | None = None

    def session_key(self) -> str | None:
        """`metadata.user_id` (a string), the conversation's session key."""
        user = (self.metadata or {}).get("user_id")
        return user[:256] if isinstance(user, str) and user else None


class CallArguments:
    """The arguments text of the tool calls this gateway returned, by call id within an answer-history scope, so
    a `tool_use.input` sent back (a JSON object) is written as the exact text generated (bounded by bytes)."""

    def __init__(self, budget: int = 16 << 20):
        self._map: ByteLRU[tuple[str, str], str] = ByteLRU(budget, lambda key, text: text_size(*key, text))

    def remember(self, scope: str, call_id: str, arguments: str) -> None:
        """Record a returned call's arguments text."""
        self._map.put((scope, call_id), arguments)

    def text(self, scope: str, call_id: str, value: Any) -> str:
        """The arguments text of `value` (a tool_use `input`): the generated text when it parses to `value`,
        else compact JSON."""
        known = self._map.get((scope, call_id))
        if known is not None:
            try:
                if json.loads(known) == value:
                    return known
            except ValueError:
                pass
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def chat_request(req: CountTokensRequest, thinking: bool, drop: tuple[str, ...], calls: CallArguments,
                 scope: str, warnings: list[str]) -> ChatCompletionRequest:
    """The chat request of a Messages request (or a count_tokens request).

    Args:
      thinking: the served model has a thinking mode (else `thinking` is ignored, with a warning).
      drop: regular expressions of system text blocks to leave out (matched at the block's start).
      calls, scope: returned calls' arguments texts, and the request's answer-history scope.
      warnings: what was left out is appended here.
    Raises:
      ApiError: 400 naming the Messages field.
    """
    messages = merge_turns(_system(req.system, drop) + _messages(req.messages, calls, scope))
    body: dict[str, Any] = {**extras(req), "messages": messages, "model": req.model}
    tools = _tools(req.tools, warnings)
    if tools:
        body["tools"] = tools
    if req.tool_choice is not None:
        body.update(_tool_choice(req.tool_choice))
    kind = (req.thinking or {}).get("type")
    if kind is not None:
        if not thinking:
            warnings.append("thinking ignored: this model has no thinking mode")
        else:
            body["chat_template_kwargs"] = {"enable_thinking": kind in ("enabled", "adaptive")}
    if isinstance(req, MessagesRequest):
        body["response_format"] = _response_format(req.output_config)
        body.update(max_completion_tokens=req.max_tokens, stop=req.stop_sequences or None,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, user=req.session_key())
    return validated_chat(body, CHAT_PARAM, "messages")


def _response_format(config: dict | None) -> dict | None:
    """`output_config.format` as a chat `response_format` (None without one).

    Raises:
      ApiError: 400 for a format other than json_schema.
    """
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _system(system: str | list[dict] | None, drop: tuple[str, ...]) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    texts = []
    for i, block in enumerate(system):
        text = block.get("text") if isinstance(block, dict) and block.get("type") == "text" else None
        if not isinstance(text, str):
            raise ApiError(400, f"system.{i}: system blocks must be text blocks", param=f"system.{i}")
        if not any(re.match(pattern, text) for pattern in drop):
            texts.append(text)
    return [{"role": "system", "content": "\n\n".join(texts)}] if texts else []


def _messages(messages: list[dict], calls: CallArguments, scope: str) -> list[dict]:
    out: list[dict] = []
    for i, message in enumerate(messages):
        param = f"messages.{i}"
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant", "system"):
            raise ApiError(400, f"{param}.role must be user or assistant, got {role!r}", param=f"{param}.role")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ApiError(400, f"{param}.content must be a string or a list of content blocks",
                           param=f"{param}.content")
        if role == "system":  # Claude Code's mid-conversation system messages: text for the turn they sit in
            out.append({"role": "system", "content": _result_text(blocks, f"{param}.content")})
        else:
            out += _user(blocks, param) if role == "user" else [_assistant(blocks, param, calls, scope)]
    return out


def _user(blocks: list, param: str) -> list[dict]:
    out, texts = [], []
    for j, block in enumerate(blocks):
        where = f"{param}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_string(block, "text", where))
        elif kind == "tool_result":
            text = _result_text(block.get("content"), where)
            out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
                        "content": ("Error: " + text) if block.get("is_error") else text})
        else:
            raise ApiError(400, f"{where}: user content blocks of type {kind!r} are not supported (text and "
                                "tool_result are; this model reads text)", param=f"{where}.type")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(blocks: list, param: str, calls: CallArguments, scope: str) -> dict:
    message: dict = {"role": "assistant", "content": None}
    texts, thoughts = [], []
    for j, block in enumerate(blocks):
        where = f"{param}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_string(block, "text", where))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", where))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            call_id, value = _string(block, "id", where), block.get("input", {})
            if not isinstance(value, dict):
                raise ApiError(400, f"{where}.input must be an object", param=f"{where}.input")
            message.setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": {
                "name": _string(block, "name", where), "arguments": calls.text(scope, call_id, value)}})
        else:
            raise ApiError(400, f"{where}: assistant content blocks of type {kind!r} are not supported (text, "
                                "thinking and tool_use are)", param=f"{where}.type")
    if texts or "tool_calls" not in message:
        message["content"] = "".join(texts)
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    return message


def _string(block: dict, field: str, where: str) -> str:
    value = block.get(field)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{field} must be a string", param=f"{where}.{field}")
    return value


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of blocks", param=f"{where}.content")
    texts = []
    for k, block in enumerate(content):
        if not (isinstance(block, dict) and block.get("type") == "text"):
            raise ApiError(400, f"{where}.content.{k}: only text blocks are supported in a tool_result",
                           param=f"{where}.content.{k}")
        texts.append(_string(block, "text", f"{where}.content.{k}"))
    return "".join(texts)


def _tools(tools: list[dict] | None, warnings: list[str]) -> list[dict]:
    out, left = [], []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind not in (None, "custom") or "input_schema" not in tool:
            left.append(str(kind or tool.get("name") or f"tools.{i}"))
            continue
        schema = tool.get("input_schema")
        function = {"name": tool.get("name"),
                    "parameters": schema if tool.get("strict") is True else relaxed(tool.get("name"), schema, warnings)}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    if left:
        warnings.append(f"tools left out (only client tools with input_schema are served): {', '.join(left)}")
    return out


def _tool_choice(choice: dict) -> dict:
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise ApiError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}",
                       param="tool_choice.type")
    return out
