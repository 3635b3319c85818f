"""API keys (gateway/api/auth.py): where they come from, what a request without a valid one gets on REST and gRPC, and
that the caller's tenant scopes the answer history."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest
from fastapi.testclient import TestClient

from gateway.api import app as app_module
from gateway.api import grpc_service
from gateway.api.app import create_app
from gateway.api.auth import ENV_VAR, ApiKeys, add_flags, child_env
from gateway.backends.history import AnswerHistory, answer_key, history_scope
from gateway.core.errors import ApiError
from protos import gateway_pb2
from tests.gateway.test_http_guard import _backends, _error


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_flags(p)
    return p.parse_args(list(argv))


def test_keys_come_from_flags_file_and_environment(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# team keys\n\n  key-b  \nkey-c\n")
    keys = ApiKeys.from_args(_args("--api-key", "key-a", "--api-key-file", str(f)), {ENV_VAR: "key-d, key-e"})
    assert len(keys) == 5
    tenants = {keys.tenant(f"Bearer {k}") for k in ("key-a", "key-b", "key-c", "key-d", "key-e")}
    assert len(tenants) == 5 and all("key" not in t for t in tenants)  # a digest, never the key
    assert keys.tenant("bearer   key-a") == keys.tenant("Bearer key-a")  # the scheme is case-insensitive
    assert not ApiKeys.from_args(_args(), {})  # none: the API is open
    assert ApiKeys().tenant(None) == ""


@pytest.mark.parametrize("bad", ["", "two words", "a,b", "tab\tkey", "nul\x00"])
def test_unusable_keys_are_refused_at_start(bad):
    with pytest.raises(ValueError):
        ApiKeys([bad])


def test_an_unreadable_key_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--api-key-file"):
        ApiKeys.from_args(_args("--api-key-file", str(tmp_path / "missing")), {})


@pytest.mark.parametrize("value", [None, "", "Bearer", "Bearer wrong", "Basic a2V5LWE=", "key-a", "Bearer key-a2"])
def test_a_missing_or_wrong_key_is_401(value):
    with pytest.raises(ApiError) as err:
        ApiKeys(["key-a"]).tenant(value)
    assert err.value.status == 401 and err.value.code == "invalid_api_key"
    assert err.value.headers == {"WWW-Authenticate": "Bearer"}
    assert err.value.grpc_code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_launcher_hands_keys_to_the_gateway_by_environment(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("key-b\n")
    env = child_env(_args("--api-key", "key-a", "--api-key-file", str(f)), {ENV_VAR: "key-c", "HOME": "/h"})
    assert env == {ENV_VAR: "key-a,key-b,key-c", "HOME": "/h"}
    assert ApiKeys.from_args(_args(), env).tenant("Bearer key-b")


@pytest.fixture
def keyed():
    with TestClient(create_app(_backends(), keys=ApiKeys(["key-a"]))) as c:
        yield c


def test_rest_routes_need_a_key_but_health_and_metrics_do_not(keyed):
    for path in ("/v1/models", "/v1/nope"):
        err = _error(keyed.get(path), 401)
        assert err["code"] == "invalid_api_key"
        _error(keyed.get(path, headers={"Authorization": "Bearer key-b"}), 401)
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer key-a"}).status_code == 200
    _error(keyed.get("/v1/nope", headers={"Authorization": "Bearer key-a"}), 404)
    # Refused before the body is read or checked: a huge or broken body without a key is still a 401.
    _error(keyed.post("/v1/completions", content=b"{not json"), 401)
    assert keyed.get("/metrics").status_code == 200
    assert keyed.get("/health").status_code == 503  # open (no backend runs here), not 401
    doc = keyed.get("/openapi.json").json()
    assert doc["components"]["securitySchemes"]["apiKey"] == {"type": "http", "scheme": "bearer"}
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"apiKey": []}] and "401" in chat["responses"]
    assert "security" not in doc["paths"]["/health"]["get"]


def _tenant_seen(monkeypatch, target, name: str) -> list[str]:
    """Make `target.<name>` (the planner entry point an endpoint calls) record its tenant and refuse the request."""
    seen: list[str] = []

    async def plan(ctx, *args, **kwargs):
        seen.append(ctx.tenant)
        raise ApiError(400, "planned")

    monkeypatch.setattr(target, name, plan)
    return seen


def test_the_rest_caller_tenant_reaches_the_planner(keyed, monkeypatch):
    seen = _tenant_seen(monkeypatch, app_module, "plan_chat_completion")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for key in ("key-a", "key-a"):
        _error(keyed.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}), 400)
    assert seen == [ApiKeys(["key-a"]).tenant("Bearer key-a")] * 2 and seen[0]


class _Context:
    """The part of a grpc.aio context Generate uses."""

    def __init__(self, metadata):
        self.metadata, self.code = metadata, None

    def invocation_metadata(self):
        return grpc.aio.Metadata(*self.metadata)

    async def abort(self, code, details):
        self.code = code
        raise grpc.aio.AbortError()


def test_grpc_generate_needs_a_key_and_passes_its_tenant(monkeypatch):
    keys = ApiKeys(["key-a", "key-b"])
    seen = _tenant_seen(monkeypatch, grpc_service, "plan_completion")
    servicer = grpc_service.GatewayServicer(_backends(), keys=keys)
    request = gateway_pb2.GenerateRequest(text="hi", max_tokens=1)
    for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                           ((("authorization", "Bearer key-c"),), grpc.StatusCode.UNAUTHENTICATED),
                           ((("authorization", "Bearer key-b"),), grpc.StatusCode.INVALID_ARGUMENT)):
        ctx = _Context(metadata)

        async def call(ctx=ctx):
            async for _ in servicer.Generate(request, ctx):
                pass

        with pytest.raises(grpc.aio.AbortError):
            asyncio.run(call())
        assert ctx.code == code
    assert seen == [keys.tenant("Bearer key-b")]


def test_tenants_never_share_remembered_answers():
    h = AnswerHistory()
    a, b = ApiKeys(["key-a"]).tenant("Bearer key-a"), ApiKeys(["key-b"]).tenant("Bearer key-b")
    h.remember(history_scope(a, "salt"), answer_key("Hi!"), [5, 6])
    assert h.lookup(history_scope(a, "salt"), answer_key("Hi!")) == (5, 6)
    for scope in (history_scope(b, "salt"), history_scope("", "salt"), history_scope(a, None)):
        assert h.lookup(scope, answer_key("Hi!")) is None
    assert history_scope("", "a\x00b") != history_scope("a", "b")
