"""The gateway answers 503 (OpenAI-shaped) while its backends are down or still loading, and keeps running."""

from __future__ import annotations

from fastapi.testclient import TestClient

from gateway.api.app import create_app
from gateway.backends.clients import Backends
from tests.e2e.stacks import free_ports


def test_backends_down_give_503_not_500():
    tok, worker = free_ports(2)  # nothing listens there
    with TestClient(create_app(Backends(f"127.0.0.1:{tok}", f"127.0.0.1:{worker}"))) as client:
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json()["backends"] == {"tokenizer service": "UNREACHABLE", "model worker": "UNREACHABLE"}
        for path, body in [("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/models", None)]:
            r = client.post(path, json=body) if body else client.get(path)
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["type"] == "service_unavailable"
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}).status_code == 400


def test_a_bad_token_id_prompt_names_the_id():
    """`prompt: [-1]` fails as a string, as strings and as token ids: the error is the token id's value, not
    "should be a valid string" (the first union member's type mismatch). Checked before any backend."""
    tok, worker = free_ports(2)
    with TestClient(create_app(Backends(f"127.0.0.1:{tok}", f"127.0.0.1:{worker}"))) as client:
        r = client.post("/v1/completions", json={"prompt": [5, -1]})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "prompt.1" and "greater than or equal to 0" in error["message"], error
