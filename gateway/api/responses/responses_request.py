"""The OpenAI Responses API request (`POST /v1/responses`) and its translation into the chat request every front
door plans through (gateway/planning/planner.py), so its limits, checks, tool formats and constraints are Chat
Completions' by construction.

Translation: `instructions` and the input's leading system/developer messages become one system message (in
that order); message items keep their role (text parts only: the served models read text); `function_call`
items join the assistant message before them as `tool_calls` (a `reasoning` item before them is that message's
`reasoning_content`); `function_call_output` items become tool messages. Function tools (Responses' flat shape)
become chat tools; other tool types (web_search, custom, local_shell, ...) are left out and named in a warning
header. `text.format` becomes `response_format`, `max_output_tokens` `max_completion_tokens`, `reasoning.effort`
`reasoning_effort` (ignored, with a warning, on a model without thinking).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr, ValidationError, WithJsonSchema

from gateway.core.errors import ApiError
from gateway.core.openai_types import ChatCompletionRequest, Int32, Name, Number, _Body
from gateway.structured.tools.tool_calls import ToolSchemaError
from gateway.structured.tools.tool_schema import relax_parameters

#: vLLM's sampling extensions, accepted on the Responses and Messages APIs too (as extra body fields) and
#: passed to the chat request as they are.
SAMPLING_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "logit_bias", "stop", "cache_salt", "ignore_eos", "stop_token_ids")
#: Request fields of the chat request -> the Responses field a client sent (errors name the client's field).
CHAT_PARAM = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
              "reasoning_effort": "reasoning.effort", "messages": "input", "prompt": "input", "tools": "tools",
              "tool_choice": "tool_choice"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def schema_object(required: list[str], **properties) -> dict:
    """A JSON-schema object with these required keys and properties (the OpenAPI documents of the agent APIs)."""
    return {"type": "object", "required": required, "properties": properties}



_TEXT = {"type": "string"}
_PARTS = {"type": "array", "items": schema_object(["type", "text"], type={"enum": ["input_text", "output_text"]},
                                         text=_TEXT)}
#: The input items documented in the OpenAPI schema (checked by `input_messages`, which names the bad field).
INPUT_SCHEMA = {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": {"anyOf": [
    schema_object(["role", "content"], type={"const": "message"}, role={"enum": ["system", "developer", "user", "assistant"]},
         content={"anyOf": [_TEXT, _PARTS]}),
    schema_object(["type", "call_id", "name", "arguments"], type={"const": "function_call"},
         call_id={"type": "string", "minLength": 1}, name={"type": "string", "minLength": 1}, arguments=_TEXT),
    schema_object(["type", "call_id", "output"], type={"const": "function_call_output"},
         call_id={"type": "string", "minLength": 1}, output=_TEXT),
    schema_object(["type", "summary"], type={"const": "reasoning"}, summary={"type": "array", "items": schema_object(
        ["type", "text"], type={"const": "summary_text"}, text=_TEXT)}),
]}}]}


class ResponsesRequest(_Body):
    """POST /v1/responses (and /v1/responses/input_tokens). Items and tools are checked in `chat_request`."""

    model: Name | None = None
    input: Annotated[StrictStr | list[dict[str, Any]] | None, WithJsonSchema(INPUT_SCHEMA)] = None
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: Int32 | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    reasoning: dict[str, Any] | None = None
    #: Echoed in the response (OpenAI: at most 16 pairs, keys of 64 and values of 512 characters).
    metadata: dict[Annotated[StrictStr, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)
    user: Name | None = None
    prompt_cache_key: Name | None = None
    safety_identifier: Name | None = None
    store: StrictBool = False
    previous_response_id: Name | None = None
    stream: StrictBool = False
    background: StrictBool = False
    truncation: Literal["auto", "disabled"] | None = None


def chat_request(req: ResponsesRequest, history: list[dict], thinking: bool,
                 warnings: list[str]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request of a Responses request, and its conversation without `instructions` (what a stored
    response keeps).

    Args:
      history: the stored conversation of `previous_response_id` (chat messages), or [].
      thinking: the served model has a thinking mode (else `reasoning.effort` is ignored with a warning).
      warnings: what was left out is appended here (the response's warning header).
    Raises:
      ApiError: 400 naming the Responses field.
    """
    if req.background:
        raise ApiError(400, "background responses are not supported", param="background")
    if req.input is None and not history:
        raise ApiError(400, "input is required", param="input")
    conversation = history + input_messages(req.input)
    messages = merge_turns(_merge_system(req.instructions, conversation))
    if not messages:
        raise ApiError(400, "input must hold at least one message", param="input")
    body: dict[str, Any] = {**extras(req), "messages": messages, "model": req.model, "stream": False,
                            "user": req.user, "temperature": req.temperature, "top_p": req.top_p,
                            "max_completion_tokens": req.max_output_tokens,
                            "parallel_tool_calls": req.parallel_tool_calls}
    tools = chat_tools(req.tools, warnings)
    if tools:
        body["tools"] = tools
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice, warnings)
    body["response_format"] = _response_format(req.text)
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        if thinking:
            body["reasoning_effort"] = effort
        else:
            warnings.append("reasoning.effort ignored: this model has no thinking mode")
    return validated_chat(body, CHAT_PARAM, "input"), conversation


def validated_chat(body: dict[str, Any], names: dict[str, str], fallback: str) -> ChatCompletionRequest:
    """The chat request of a translated body (None values left out).

    Raises:
      ApiError: 400 naming the client's field (`names`: chat field -> the front door's; `fallback` when the
        error names none).
    """
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        param = names.get(loc[0], loc[0]) if loc else None
        raise ApiError(400, f"{param or fallback}: {first.get('msg', 'invalid value')}", param=param) from None


def relaxed(name: str, parameters: Any, warnings: list[str]) -> Any:
    """A non-strict tool's `parameters` with the keywords the supported subset cannot enforce removed (named in
    `warnings`); unchanged when that cannot fix it (the planner's 400 then names the problem)."""
    if not isinstance(parameters, dict) or not isinstance(name, str):
        return parameters
    try:
        schema, dropped = relax_parameters(name, parameters)
    except ToolSchemaError:
        return parameters
    if dropped:
        warnings.append(f"tool {name!r}: not enforced: {', '.join(dropped)}")
    return schema


def merge_turns(messages: list[dict]) -> list[dict]:
    """Chat messages with consecutive user messages joined into one (blank line between): agent clients send
    several user messages in a row (context, then the prompt) where Gemma's templates want user and assistant
    turns to alternate; leading system and developer messages are joined into one. A system or developer
    message after the first turn becomes user text there."""
    out: list[dict] = []
    for m in messages:
        if m["role"] in ("system", "developer") and out and out[-1]["role"] not in ("system", "developer"):
            m = {"role": "user", "content": m["content"] or ""}
        same = out and (out[-1]["role"] == m["role"] == "user" or
                        out[-1]["role"] in ("system", "developer") and m["role"] in ("system", "developer"))
        if same and isinstance(m.get("content"), str) and isinstance(out[-1].get("content"), str):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m['content']}"}
        else:
            out.append(m)
    return out


def extras(req) -> dict[str, Any]:
    """The request's vLLM sampling extensions (`SAMPLING_EXTRAS`) sent as extra body fields."""
    return {k: v for k, v in (req.model_extra or {}).items() if k in SAMPLING_EXTRAS}


def _merge_system(instructions: str | None, messages: list[dict]) -> list[dict]:
    """`instructions` and the leading system/developer messages as one system message, then the rest."""
    head = [instructions] if instructions else []
    rest = list(messages)
    while rest and rest[0]["role"] in ("system", "developer"):
        head.append(rest.pop(0)["content"] or "")
    return ([{"role": "system", "content": "\n\n".join(head)}] if head else []) + rest


def input_messages(items: str | list[dict] | None) -> list[dict]:
    """Responses input items -> chat messages (see the module docstring).

    Raises:
      ApiError: 400 naming `input.I` for an unknown item type or role, a non-text part, or a call without
        call_id or name.
    """
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        param = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise ApiError(400, f"{param}.role must be system, developer, user or assistant, got {role!r}",
                               param=f"{param}.role")
            message = {"role": role, "content": _text(item.get("content"), f"{param}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            call = {"id": _required(item, "call_id", param), "type": "function",
                    "function": {"name": _required(item, "name", param), "arguments": item.get("arguments") or ""}}
            if not isinstance(call["function"]["arguments"], str):
                raise ApiError(400, f"{param}.arguments must be a string of JSON", param=f"{param}.arguments")
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or reasoning is not None:
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _required(item, "call_id", param),
                        "content": output if isinstance(output, str) else _text(output, f"{param}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, f"{param}.content") if parts else None
        else:
            raise ApiError(400, f"{param}: input items of type {kind!r} are not supported (messages, "
                                "function_call, function_call_output and reasoning are)", param=f"{param}.type")
    return out


def _required(item: dict, field: str, param: str) -> str:
    value = item.get(field)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param}.{field} is required (a non-empty string)", param=f"{param}.{field}")
    return value


def _text(content: Any, param: str) -> str:
    """A message's content (a string, or text parts joined) as text.

    Raises:
      ApiError: 400 for an image, file or audio part, or a malformed one.
    """
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{param} must be a string or a list of parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            texts.append(part.get("refusal") or "")
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise ApiError(400, f"{param}.{j}: only text parts are supported (this model reads text), got "
                                f"{kind!r}", param=f"{param}.{j}")
    return "".join(texts)


def chat_tools(tools: list[dict] | None, warnings: list[str]) -> list[dict]:
    """Responses function tools -> chat tools; other tool types are left out (named in `warnings`)."""
    out, left = [], []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            left.append(str(tool.get("type") or tool.get("name") or f"tools.{i}"))
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        if tool.get("strict") is False and "parameters" in function:
            function["parameters"] = relaxed(function.get("name"), function["parameters"], warnings)
        out.append({"type": "function", "function": function})
    if left:
        warnings.append(f"tools left out (only function tools are served): {', '.join(left)}")
    return out


def chat_tool_choice(choice: str | dict, warnings: list[str]) -> str | dict:
    """A Responses `tool_choice` as a chat one: modes pass; `{"type": "function", "name"}` names the function;
    `allowed_tools` keeps its mode; a hosted tool's choice becomes "auto" (its tool is left out)."""
    if isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind == "allowed_tools":
        return choice.get("mode") or "auto"
    warnings.append(f"tool_choice {kind!r} ignored: that tool type is not served")
    return "auto"


def _response_format(text: dict | None) -> dict | None:
    """`text.format` as a chat `response_format` (None for plain text).

    Raises:
      ApiError: 400 for an unknown format type.
    """
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise ApiError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                   param="text.format.type")
