"""The gateway's OpenAPI document: FastAPI's, made true to what the routes do, so that clients and API fuzzers
(schemathesis) generating requests from it produce mostly valid ones.

- Errors are documented as they are sent: the OpenAI error object for 400, 404, 413, 429 and 503 (FastAPI's
  default 422 is never sent: validation failures are 400).
- `model` is the one served model id once the backends are ready (any other is a 404).
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


def openapi_schema(app, backends) -> dict:
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
    facts = backends.facts
    if facts is None:
        return schema  # not cached: the model id is not known yet
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        model = schema["components"]["schemas"].get(name, {}).get("properties", {}).get("model")
        if model is not None:
            model.clear()
            model.update({"anyOf": [{"type": "string", "enum": [facts.name]}, {"type": "null"}],
                          "title": "Model", "description": "The served model id (any other is a 404)."})
    app.openapi_schema = schema
    return schema
