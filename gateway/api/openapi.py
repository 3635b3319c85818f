"""The gateway's OpenAPI document: FastAPI's, made true to what the endpoints do, so that clients and API fuzzers
(schemathesis) generating requests from it produce mostly valid ones.

- Errors are documented as they are sent: the OpenAI error object for 400, 404, 413, 429 and 503 (FastAPI's
  default 422 is never sent: validation failures are 400); Anthropic's error object on the Messages API.
- Once the backends are ready, what the served model decides: `model` is its id (any other is a 404), token ids
  and logit_bias keys are below its vocabulary size, prompt lists fit the worker's queue, reasoning_effort turns
  thinking on only for a model that has it; `max_tokens` is at least 1 and at most `--max-tokens-cap`.
- Chat messages per role as OpenAI documents them (content required except on an assistant's tool-call message),
  a conversation starting with a user message (after at most one system message), tools as OpenAI's tool
  objects. What a schema cannot say (roles alternating later on, a tool message following its call) is checked
  by the chat template, and a 400 names it.
- Streamed answers are `text/event-stream` (declared on the endpoints).
- `/tokenize` (a raw prompt, or chat messages described as for chat completions) and `/detokenize` are documented
  with vLLM's request and response shapes; with API keys they declare bearer authentication like the `/v1` endpoints.
"""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
_ERRORS = {
    "400": "Invalid request: the message names the field",
    "404": "Unknown model or route",
    "413": "Request body over the limit",
    "429": "The model worker's queue is full; retry after Retry-After seconds",
    "503": "A backend is loading or down, or too many connections",
}


def _walk(node, visit) -> None:
    """Call visit(schema dict) on every dict in a JSON document."""
    if isinstance(node, dict):
        visit(node)
        for value in node.values():
            _walk(value, visit)
    elif isinstance(node, list):
        for value in node:
            _walk(value, visit)


def _bound_token_ids(schemas: dict, vocab_size: int) -> None:
    def visit(node):
        if node.get("type") == "integer" and node.get("minimum") == 0 and node.get("maximum") == 2**31 - 1:
            node["maximum"] = vocab_size - 1

    _walk(schemas, visit)


def _bound_max_tokens(schemas: dict, cap: int | None) -> None:
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "MessagesRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            options = props.get(field, {}).get("anyOf", [props.get(field, {})])
            for option in options:
                if option.get("type") == "integer":
                    option["minimum"] = 1
                    if cap is not None:
                        option["maximum"] = cap


def _agent_api_schemas(schemas: dict) -> None:
    """The Responses and Messages requests as their APIs document them: Responses' `input` required (this
    server keeps no conversation unless asked: `store`), `background` only false; a Messages conversation of
    user messages (text and tool_result blocks) and assistant messages (text and tool_use blocks), starting
    with a user message."""
    responses = schemas.get("ResponsesRequest")
    if responses is not None:
        responses.setdefault("required", []).append("input")
        responses["properties"]["background"] = {"type": "boolean", "enum": [False]}
        responses["properties"].pop("previous_response_id", None)  # only ids this server returned: not fuzzable
    messages = schemas.get("MessagesRequest")
    if messages is None:
        return
    items = messages["properties"]["messages"]["items"]["properties"]["content"]["anyOf"][1]["items"]["anyOf"]
    text, tool_use, tool_result = items

    def turn(role: str, block: dict) -> dict:
        return {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"const": role}, "content": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                                                "items": {"anyOf": [text, block]}}]}}}

    user, assistant = turn("user", tool_result), turn("assistant", tool_use)
    conversation = {"type": "array", "minItems": 1, "prefixItems": [user], "items": {"anyOf": [user, assistant]}}
    for name in ("MessagesRequest", "CountTokensRequest"):
        if name in schemas:
            schemas[name]["properties"]["messages"] = conversation


def _message_schemas(schemas: dict) -> None:
    """ChatMessage as OpenAI documents it, one schema per role: system, developer and user messages carry content;
    an assistant message content or tool calls; a tool message answers a tool_call_id. (The order rules of a
    conversation — a tool message follows its call — cannot be written in a schema; the template checks them.)
    Tools as OpenAI's tool objects (`strict` included). Both chat request models (chat completions, /tokenize's
    chat form) get the same messages, tools and tool_choice."""
    base = schemas.get("ChatMessage")
    if base is None:
        return
    props = base["properties"]
    text = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": props["content"]["anyOf"][1]["items"]}]}

    def role(names: list[str], required: list[str], **fields) -> dict:
        return {"type": "object", "additionalProperties": True, "required": ["role", *required],
                "properties": {"role": {"type": "string", "enum": names}, "name": props["name"], **fields}}

    calls = {"type": "array", "minItems": 1, "items": props["tool_calls"]["anyOf"][0]["items"]}
    schemas["SystemMessage"] = role(["system", "developer"], ["content"], content=text)
    schemas["UserMessage"] = role(["user"], ["content"], content=text)
    schemas["ChatMessage"] = {"title": "ChatMessage", "oneOf": [
        {"$ref": "#/components/schemas/SystemMessage"}, {"$ref": "#/components/schemas/UserMessage"},
        role(["assistant"], ["content"], content=text, reasoning_content=props["reasoning_content"]),
        role(["assistant"], ["tool_calls"], content={"type": "null"}, tool_calls=calls),
        role(["tool"], ["content", "tool_call_id"], content=text, tool_call_id={"type": "string", "maxLength": 256}),
    ]}
    # A conversation starts with a user message, after at most one system (or developer) message.
    message = {"$ref": "#/components/schemas/ChatMessage"}
    chat: dict = {}  # the fields of both chat request models (chat completions, /tokenize's chat form)
    chat["messages"] = {"title": "Messages", "anyOf": [
        {"type": "array", "minItems": 1, "prefixItems": [{"$ref": "#/components/schemas/UserMessage"}],
         "items": message},
        {"type": "array", "minItems": 2, "prefixItems": [{"$ref": "#/components/schemas/SystemMessage"},
                                                        {"$ref": "#/components/schemas/UserMessage"}],
         "items": message}]}
    chat["tool_choice"] = {"title": "Tool Choice", "anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
        {"type": "null"}]}
    # OpenAI's tool object; its `parameters` JSON Schema is checked when the request is planned.
    chat["tools"] = {"title": "Tools", "anyOf": [{"type": "array", "items": {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
                "strict": {"type": ["boolean", "null"]}}}}}}, {"type": "null"}]}
    for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
        if name in schemas:
            schemas[name]["properties"].update(chat)


def _model_facts(schemas: dict, facts) -> None:
    """What depends on the served model: its id, token ids below its vocabulary, logit_bias keys that are token
    ids, prompt lists within the worker's queue, and reasoning_effort only where the model can think."""
    from gateway.structured.tools.tool_calls import int_range_regex

    _bound_token_ids(schemas, facts.vocab_size)
    thinking = facts.output_format().thinking
    completion = schemas["CompletionRequest"]["properties"]
    for option in completion["prompt"]["anyOf"]:  # several prompts: strings, or token-id lists
        if option.get("type") == "array" and option["items"].get("type") in ("string", "array"):
            option["maxItems"] = max(facts.max_waiting, 1)
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "MessagesRequest",
                 "CountTokensRequest", *_ROOT_REQUESTS):
        props = schemas.get(name, {}).get("properties", {})
        if "model" in props:
            props["model"] = {"anyOf": [{"type": "string", "enum": [facts.name]}, {"type": "null"}],
                              "title": "Model", "description": "The served model id (any other is a 404)."}
        if "logit_bias" in props:
            bias = props["logit_bias"]["anyOf"][0]
            bias["propertyNames"] = {"pattern": f"^{int_range_regex(0, facts.vocab_size - 1)}$"}
        if not thinking and "reasoning_effort" in props:  # only the efforts that turn it off
            props["reasoning_effort"]["anyOf"][0]["enum"] = ["none", "minimal"]


#: The request models of the endpoints at the root (vLLM's /tokenize and /detokenize).
_ROOT_REQUESTS = ("TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest")


def openapi_schema(app, backends, limits, keyed: bool = False, keyed_paths: tuple[str, ...] = ()) -> dict:
    """The OpenAPI document of `app` (cached once the model is known); with `keyed`, the `/v1` operations and
    those of `keyed_paths` declare bearer authentication and their 401."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
    schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = _ERROR
    schema["components"]["schemas"]["AnthropicError"] = _ANTHROPIC_ERROR
    if keyed:
        schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    for path, item in schema.get("paths", {}).items():
        for op in item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            errors = dict(_ERRORS)
            if keyed and (path.startswith("/v1/") or path in keyed_paths):
                op["security"] = [{"apiKey": []}]
                errors["401"] = "missing or wrong API key"
            shape = "AnthropicError" if path.startswith("/v1/messages") else "Error"
            for status, text in errors.items():
                responses[status] = {"description": text, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{shape}"}}}}
    _bound_max_tokens(schema["components"]["schemas"], limits.max_tokens_cap)
    _message_schemas(schema["components"]["schemas"])
    _agent_api_schemas(schema["components"]["schemas"])
    facts = backends.facts
    if facts is None:
        return schema  # not cached: the model id is not known yet
    _model_facts(schema["components"]["schemas"], facts)
    app.openapi_schema = schema
    return schema
