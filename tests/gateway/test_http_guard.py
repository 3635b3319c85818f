"""The REST gateway under bad and hostile requests, without backends: every answer is a bounded, OpenAI-shaped
error (gateway/api/http_guard.py, gateway/core/openai_types.py, gateway/planning/planner.py), the connection stays
usable, and a good request still works afterwards. Keep-alive and connection limits are checked on a real uvicorn
server."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import grpc
import httpx
import pytest
import uvicorn
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from gateway.api import http_guard
from gateway.api.app import create_app
from gateway.api.http_protocol import GuardedH11Protocol
from gateway.backends.clients import Backends
from gateway.backends.model_facts import ModelFacts
from gateway.core.errors import from_rpc_error
from gateway.core.limits import Limits
from tests.e2e.stacks import free_ports
from tests.transport import HttpEndpoint

ERROR_KEYS = {"message", "type", "param", "code"}


def _backends(max_waiting: int = 4) -> Backends:
    tok, worker = free_ports(2)  # nothing listens: any backend call would be a 503
    backends = Backends(f"127.0.0.1:{tok}", f"127.0.0.1:{worker}")
    backends.facts = ModelFacts(name="m", max_model_len=100, vocab_size=10, token_bytes=[b"ab"] * 10,
                                special_ids=set(), bos_id=2, stop_ids=[1], max_waiting=max_waiting, architecture="gemma3")
    return backends


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS, err
    if param is not None:
        assert err["param"] == param, err
    assert r.headers.get("x-request-id")
    return err


@pytest.fixture
def client():
    limits = Limits(max_body_bytes=65536, max_messages=3, max_tools=2, max_stop_bytes=16, max_tokens_cap=8)
    with TestClient(create_app(_backends(), limits)) as c:
        yield c


def _chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **extra}


def test_routes_and_methods_answer_openai_errors(client):
    assert _error(client.get("/v1/nope"), 404)["code"] == "not_found"
    assert _error(client.get("/v1/chat/completions"), 405)["code"] == "method_not_allowed"
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"  # still serving


def test_request_ids_are_echoed_or_assigned(client):
    assert client.get("/v1/models", headers={"X-Request-Id": "abc-123.x:y"}).headers["x-request-id"] == "abc-123.x:y"
    for bad in ["has space", "x" * 129, "é"]:
        rid = client.get("/v1/models", headers={"X-Request-Id": bad.encode("utf-8")}).headers["x-request-id"]
        assert rid.startswith("req-") and rid != bad
    assert client.get("/v1/nope").headers["x-request-id"].startswith("req-")


@pytest.mark.parametrize("body,why", [
    (b'{"prompt": "\xff"}', "UTF-8"), (b'{"prompt": "a", "temperature": NaN}', "NaN"),
    (b'{"prompt": "a", "logit_bias": {"1": 1e400}}', "out of range"), (b'{"prompt": "\\ud800"}', "surrogate"),
    (b'{"prompt": "a", "model": "\\udfff"}', "surrogate"), (b"[" * 100 + b"]" * 100, "nested deeper"),
    (b'{"prompt": ' + b"[" * 3000, "nested deeper"), (b"{not json", "not valid JSON"),
])
def test_unacceptable_json_bodies_are_400(client, body, why):
    err = _error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json" and why in err["message"], err


def test_body_limit_counts_streamed_bytes(client):
    big = json.dumps({"prompt": "x" * 70_000}).encode()
    assert _error(client.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
                  413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is counted as the bytes arrive
        yield b'{"prompt": "'
        for _ in range(70):
            yield b"x" * 1000
        yield b'"}'

    _error(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert client.get("/v1/models").status_code == 200


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "top_k": 2**31}, "top_k"), ({"prompt": "a", "top_k": 1025}, "top_k"), ({"prompt": "a", "stop_token_ids": [2**40]}, "stop_token_ids.0"),
    ({"prompt": "a", "allowed_token_ids": [2**31]}, "allowed_token_ids.0"),
    ({"prompt": "a", "logit_bias": {"1": 1e300}}, "logit_bias.1"), ({"prompt": "a", "seed": 2**64}, "seed"),
    ({"prompt": "a", "max_tokens": 2**31}, "max_tokens"), ({"prompt": "a", "model": "m" * 300}, "model"),
    ({"prompt": "a", "user": "u" * 300}, "user"), ({"prompt": [[1, 2**31]]}, "prompt.list[list[int]].0.1"),
    ({"prompt": "a", "repetition_penalty": 1e300}, "repetition_penalty"),
    ({"prompt": "a", "cache_salt": "s" * 300}, "cache_salt"),
])
def test_out_of_range_values_are_400_naming_the_field(client, body, param):
    err = _error(client.post("/v1/completions", json=body), 400)
    assert err["param"] is not None and err["param"].startswith(param.split(".")[0]), err


def test_chat_fields_are_checked(client):
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "a"}]}), 400,
           "messages.0.role")
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}] * 4}), 400,
           "messages")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    _error(client.post("/v1/chat/completions", json=_chat(tools=[tool] * 3)), 400, "tools")
    _error(client.post("/v1/chat/completions", json=_chat(stop=["x" * 10, "y" * 10])), 400, "stop")
    _error(client.post("/v1/chat/completions", json=_chat(max_tokens=9)), 400, "max_tokens")
    _error(client.post("/v1/chat/completions", json=_chat(max_completion_tokens=9)), 400, "max_completion_tokens")


def test_deep_tool_call_arguments_are_400_before_any_backend(client):
    deep = "[" * 3000 + "]" * 3000
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]}]
    _error(client.post("/v1/chat/completions", json={"messages": messages}), 400,
           "messages.1.tool_calls.0.function.arguments")
    surrogate = '{"a": "\\ud800"}'  # valid JSON text whose value no tokenizer can encode
    messages[1]["tool_calls"][0]["function"]["arguments"] = surrogate
    _error(client.post("/v1/chat/completions", json={"messages": messages}), 400,
           "messages.1.tool_calls.0.function.arguments")


def test_generations_beyond_the_worker_queue_are_400_not_429(client):
    err = _error(client.post("/v1/completions", json={"prompt": ["a"] * 5}), 400, "prompt")
    assert "at most 4" in err["message"]
    _error(client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2}), 400, "prompt")
    _error(client.post("/v1/chat/completions", json=_chat(n=5)), 400, "n")


def test_text_that_cannot_fit_is_refused_before_tokenizing(client):
    # 10 tokens of at most 2 bytes each: max_model_len 100 tokens spell at most 200 bytes; the tokenizer (not
    # running: a call would be a 503) is never asked.
    err = _error(client.post("/v1/completions", json={"prompt": "x" * 201}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "201 bytes" in err["message"]
    err = _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 300}]}),
                 400, "messages")
    assert err["code"] == "context_length_exceeded"
    assert _error(client.post("/v1/completions", json={"prompt": "x" * 200}), 503)  # fits: goes to the tokenizer


def test_oversized_or_deep_schemas_are_400(client):
    deep = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"p": deep}}  # 81 JSON levels inside the body's 4
    r = client.post("/v1/chat/completions", json=_chat(response_format={"type": "json_schema",
                                                                        "json_schema": {"name": "x", "schema": deep}}))
    assert "nested deeper" in _error(r, 400)["message"]


def test_backend_errors_map_to_the_right_status():
    def rpc(code, details):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)

    too_big = from_rpc_error(rpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)"),
                             "tokenizer service")
    assert too_big.status == 413 and not too_big.headers
    full = from_rpc_error(rpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"), "model worker")
    assert full.status == 429 and full.headers["Retry-After"] == "1"
    bug = from_rpc_error(rpc(grpc.StatusCode.UNKNOWN, "Exception calling application: RecursionError: ..."),
                         "tokenizer service")
    assert bug.status == 500 and "RecursionError" not in bug.message


# -------------------------------------------------------------------------------------- a real HTTP server


@contextlib.contextmanager
def _serve(limits: Limits, routes=None, protocol=GuardedH11Protocol):
    """The gateway app on a real uvicorn server in a thread (backends absent), with the gateway's HTTP protocol,
    on a loopback port or a unix socket (tests/transport.py); yields its `HttpEndpoint`."""
    endpoint = HttpEndpoint.free()
    holder: list = []
    app = create_app(_backends(), limits, open_connections=lambda: len(holder[0].server_state.connections))
    if routes:
        routes(app.fastapi)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", http=protocol, **endpoint.uvicorn_kwargs()))
    holder.append(server)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield endpoint
    finally:
        server.should_exit = True
        thread.join(10)


def _bug_routes(app):
    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret internals")

    @app.get("/boom-stream")
    async def boom_stream():
        async def events():
            yield "data: {}\n\n"
            raise RuntimeError("secret internals")

        return StreamingResponse(events(), media_type="text/event-stream")


def test_a_500_keeps_the_connection_and_hides_internals():
    with _serve(Limits(), _bug_routes) as endpoint, endpoint.client() as http:
        r = http.get("/boom", headers={"X-Request-Id": "r-1"})
        err = _error(r, 500)
        assert "secret" not in r.text and "r-1" in err["message"] and err["type"] == "internal_error"
        assert http.get("/v1/models").status_code == 200  # the same keep-alive connection
        assert len({id(c) for c in [http]}) == 1
        streamed = http.get("/boom-stream").text
        assert streamed.startswith("data: {}") and '"internal_error"' in streamed and "secret" not in streamed
        assert streamed.rstrip().endswith("data: [DONE]")
        assert http.get("/v1/models").status_code == 200


def test_connections_beyond_the_limit_get_an_openai_503():
    with _serve(Limits(max_connections=2)) as endpoint:
        held = [endpoint.connect() for _ in range(2)]
        time.sleep(0.2)  # let the server register them
        try:
            with endpoint.client() as http:
                r = http.get("/v1/models")
            err = _error(r, 503)
            assert err["code"] == "too_many_connections" and r.headers["connection"] == "close"
        finally:
            for s in held:
                s.close()
        time.sleep(0.2)
        with endpoint.client() as http:
            assert http.get("/v1/models").status_code == 200


def test_cors_is_off_by_default_and_on_for_named_origins():
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    with TestClient(create_app(_backends())) as c:
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": "https://x"}).headers
        assert "access-control-allow-origin" not in c.options("/v1/completions", headers=preflight).headers
    with TestClient(create_app(_backends(), Limits(cors_origins=("https://app.example",)))) as c:
        r = c.options("/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": "https://evil"}).headers


def test_metrics_label_routes_not_raw_paths(client):
    for junk in ("/a", "/b/c", "/v1/x%20y"):
        client.get(junk)
    client.get("/v1/models")
    text = client.get("/metrics").text
    assert 'path="unmatched",status="404"} 3.0' in text and 'path="/v1/models",status="200"}' in text
    assert "/b/c" not in text
    assert "gemma_serve:gateway_num_requests_running 0.0" in text
    assert "gemma_serve:gateway_num_requests_waiting 0.0" in text


def test_openapi_document_is_true_to_the_routes():
    """Standard JSON Schema keywords only, the served model, token ids below the vocabulary, max_tokens within
    the cap, the OpenAI error object for every error status, and streams as text/event-stream."""
    with TestClient(create_app(_backends(), Limits(max_tokens_cap=4))) as c:
        doc = c.get("/openapi.json").json()

    def keys(node):
        if isinstance(node, dict):
            yield from node
            for v in node.values():
                yield from keys(v)
        elif isinstance(node, list):
            for v in node:
                yield from keys(v)

    assert not set(keys(doc["components"])) & {"ge", "le", "gt", "lt"}
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["model"]["anyOf"][0]["enum"] == ["m"]
    assert props["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == 9
    assert props["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 4}
    op = doc["paths"]["/v1/chat/completions"]["post"]
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert {"400", "404", "413", "429", "503"} <= set(op["responses"]) and "422" not in op["responses"]
    schemas = doc["components"]["schemas"]
    branches = [schemas[b["$ref"].rsplit("/", 1)[1]] if "$ref" in b else b for b in schemas["ChatMessage"]["oneOf"]]
    assert {r for branch in branches for r in branch["properties"]["role"]["enum"]} == {
        "system", "developer", "user", "assistant", "tool"}
    first = [option["prefixItems"][-1]["$ref"] for option in schemas["ChatCompletionRequest"]["properties"][
        "messages"]["anyOf"]]
    assert first == ["#/components/schemas/UserMessage"] * 2  # a conversation starts with the user
    reasoning = schemas["ChatCompletionRequest"]["properties"]["reasoning_effort"]["anyOf"][0]["enum"]
    assert reasoning == ["none", "minimal"]  # the served model (Gemma 3) cannot think


def test_refused_json_values_name_their_field(client):
    for body, param in [(b'{"prompt": "a", "model": "\\ud800"}', "model"),
                        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages.0.content"),
                        (b'{"prompt": "a", "logit_bias": {"5": 1e999}}', None)]:
        err = _error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
                     400, param)
        assert err["code"] == "invalid_json"


def _raw(endpoint: HttpEndpoint, data: bytes, wait: float = 5.0) -> bytes:
    """Send raw bytes on a new connection; everything the server sends until it closes (or `wait` passes)."""
    with endpoint.connect() as sock:
        sock.settimeout(wait)
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def _json_tail(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


class _QuickHeaders(GuardedH11Protocol):
    header_timeout = 0.5


def test_incomplete_headers_are_dropped_after_the_header_deadline():
    """A slowloris socket (half a request line, then silence) is closed, so it cannot hold a connection slot."""
    with _serve(Limits(max_connections=2), protocol=_QuickHeaders) as endpoint:
        t0 = time.monotonic()
        with endpoint.connect() as sock:
            sock.settimeout(10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            assert sock.recv(100) == b""  # closed by the server
        assert time.monotonic() - t0 < 5
        with endpoint.client() as http:  # a kept-alive connection: its second request is held to it too
            assert http.get("/v1/models").status_code == 200
            time.sleep(1.0)
            assert http.get("/v1/models").status_code == 200


def test_malformed_http_gets_a_json_400_with_a_request_id():
    with _serve(Limits()) as endpoint:
        for data in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
                     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
            raw = _raw(endpoint, data)
            head = raw.split(b"\r\n\r\n", 1)[0].lower()
            assert head.startswith(b"http/1.1 400") and b"x-request-id: req-" in head, raw
            assert set(_json_tail(raw)["error"]) == ERROR_KEYS


def test_a_stalled_body_is_408(monkeypatch):
    monkeypatch.setattr(http_guard, "BODY_IDLE_TIMEOUT", 0.5)
    with _serve(Limits()) as endpoint:
        t0 = time.monotonic()
        raw = _raw(endpoint, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"messages\": []}")
        assert raw.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 4, raw
        assert _json_tail(raw)["error"]["code"] == "request_timeout"


def test_refusals_before_routing_count_under_the_route(client):
    client.post("/v1/chat/completions", content=b'{"temperature": NaN}', headers={"content-type": "application/json"})
    text = client.get("/metrics").text
    assert 'path="/v1/chat/completions",status="400"} 1.0' in text


def test_messages_name_the_real_problem(client):
    five = _error(client.post("/v1/chat/completions", json=_chat(stop=list("abcde"))), 400, "stop")
    assert "at most 4" in five["message"], five
    prompts = _error(client.post("/v1/completions", json={"prompt": ["hi"] * 5}), 400, "prompt")
    assert "5 generations" in prompts["message"]
    _error(client.post("/v1/completions", json={"prompt": "hi", "n": 5}), 400, "n")
    _error(client.post("/v1/chat/completions", json=_chat(stream_options={"include_usage": True})), 400,
           "stream_options")
    assert _error(client.get("/v1/models/"), 404)["code"] == "not_found"  # no redirect for a trailing slash
