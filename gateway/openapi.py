"""The gateway's OpenAPI document: FastAPI's, made true to what the routes do, so that clients and API fuzzers
(schemathesis) generating requests from it produce mostly valid ones.

- Errors are documented as they are sent: the OpenAI error object for 400, 404, 413, 429 and 503 (FastAPI's
  default 422 is never sent: validation failures are 400).
- `model` is the one served model id once the backends are ready (any other is a 404); token ids are below the
  vocabulary size; `max_tokens` is at least 1 and at most `--max-tokens-cap` when one is set.
- Streamed answers are `text/event-stream` (declared on the routes).
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
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for field in ("max_tokens", "max_completion_tokens"):
            for option in props.get(field, {}).get("anyOf", []):
                if option.get("type") == "integer":
                    option["minimum"] = 1
                    if cap is not None:
                        option["maximum"] = cap


def _message_schemas(schemas: dict) -> None:
    """ChatMessage as OpenAI documents it, one schema per role: system, developer and user messages carry content;
    an assistant message content or tool calls; a tool message answers a tool_call_id. (The order rules of a
    conversation — a tool message follows its call — cannot be written in a schema; the template checks them.)"""
    base = schemas.get("ChatMessage")
    if base is None:
        return
    props = base["properties"]
    text = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": props["content"]["anyOf"][1]["items"]}]}

    def role(names: list[str], required: list[str], **fields) -> dict:
        return {"type": "object", "additionalProperties": True, "required": ["role", *required],
                "properties": {"role": {"type": "string", "enum": names}, "name": props["name"], **fields}}

    calls = {"type": "array", "minItems": 1, "items": props["tool_calls"]["anyOf"][0]["items"]}
    schemas["ChatMessage"] = {"title": "ChatMessage", "oneOf": [
        role(["system", "developer", "user"], ["content"], content=text),
        role(["assistant"], ["content"], content=text, reasoning_content=props["reasoning_content"]),
        role(["assistant"], ["tool_calls"], content={"type": "null"}, tool_calls=calls),
        role(["tool"], ["content", "tool_call_id"], content=text, tool_call_id={"type": "string", "maxLength": 256}),
    ]}


def openapi_schema(app, backends, limits) -> dict:
    """The OpenAPI document of `app` (cached once the model is known)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
    schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = _ERROR
    for path in schema.get("paths", {}).values():
        for op in path.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status, text in _ERRORS.items():
                responses[status] = {"description": text, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Error"}}}}
    _bound_max_tokens(schema["components"]["schemas"], limits.max_tokens_cap)
    _message_schemas(schema["components"]["schemas"])
    facts = backends.facts
    if facts is None:
        return schema  # not cached: the model id is not known yet
    _bound_token_ids(schema["components"]["schemas"], facts.vocab_size)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        model = schema["components"]["schemas"].get(name, {}).get("properties", {}).get("model")
        if model is not None:
            model.clear()
            model.update({"anyOf": [{"type": "string", "enum": [facts.name]}, {"type": "null"}],
                          "title": "Model", "description": "The served model id (any other is a 404)."})
    app.openapi_schema = schema
    return schema
