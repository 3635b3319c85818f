"""The official clients against a stack served on a unix socket (`gemma-serve up --uds DIR`): one request through
each door, each answer checked for its shape, one line of JSON per request on stdout.

    python scripts/socket_clients.py DIR/api.sock [--model gemma-3-270m]

A chat completion, a streamed one, a `json_schema` answer (validated with jsonschema), a `tool_choice: required`
call (its arguments validated against the tool's parameters), the Responses API and Anthropic's Messages API.
Exit status 1 when any check fails. scripts/device_serve.sh runs it on the TPU host, where no TCP socket exists.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import anthropic
import jsonschema
import openai

try:
    import httpx2 as hx  # the HTTP library of the current openai and anthropic SDKs
except ImportError:
    import httpx as hx

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 14}},
          "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def checks(oai: openai.OpenAI, claude: anthropic.Anthropic, model: str):
    """Yield (name, ok, detail) per request."""
    chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=16,
                                       temperature=0)
    yield "chat", chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens > 0, \
        chat.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16, stream=True,
        temperature=0.8, top_p=0.9, seed=1) if c.choices]
    yield "stream", len(pieces) > 1, "".join(pieces)
    js = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Plan a trip."}],
                                     max_tokens=64, temperature=0, response_format={
                                         "type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}})
    text = js.choices[0].message.content
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        ok = js.choices[0].finish_reason == "stop"
    except (ValueError, jsonschema.ValidationError):
        ok = False
    yield "json_schema", ok, text
    tc = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                     max_tokens=48, temperature=0, tools=[TOOL], tool_choice="required")
    calls = tc.choices[0].message.tool_calls or []
    try:
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), TOOL["function"]["parameters"])
        ok = bool(calls) and tc.choices[0].finish_reason == "tool_calls"
    except (ValueError, jsonschema.ValidationError):
        ok = False
    yield "tool_choice_required", ok, [(c.function.name, c.function.arguments) for c in calls]
    r = oai.responses.create(model=model, input="Say hi.", max_output_tokens=16, temperature=0)
    yield "responses", r.status in ("completed", "incomplete") and bool(r.output), r.output_text
    m = claude.messages.create(model=model, max_tokens=16, messages=[{"role": "user", "content": "Hi"}])
    yield "messages", m.stop_reason in ("end_turn", "max_tokens") and bool(m.content), \
        "".join(b.text for b in m.content if b.type == "text")


def main(argv: list[str] | None = None) -> int:
    """Run every check against the socket given on the command line; 0 when all pass, else 1."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("socket", help="the REST API's unix socket (DIR/api.sock of `gemma-serve up --uds DIR`)")
    p.add_argument("--model", default="gemma-3-270m")
    args = p.parse_args(argv)
    http = hx.Client(transport=hx.HTTPTransport(uds=args.socket), timeout=300)  # the SDKs' own HTTP library
    oai = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0)
    claude = anthropic.Anthropic(base_url="http://localhost", api_key="unused", http_client=http, max_retries=0)
    failed = 0
    for name, ok, detail in _timed(checks(oai, claude, args.model)):
        failed += not ok
        print(json.dumps({"check": name, **detail}, ensure_ascii=False), flush=True)
    return 1 if failed else 0


def _timed(gen):
    """(name, ok, {"ok", "seconds" since the previous check, "answer"}) for each check of `gen`."""
    t0 = time.perf_counter()
    for name, ok, detail in gen:
        yield name, ok, {"ok": ok, "seconds": round(time.perf_counter() - t0, 3), "answer": detail}
        t0 = time.perf_counter()


if __name__ == "__main__":
    sys.exit(main())
