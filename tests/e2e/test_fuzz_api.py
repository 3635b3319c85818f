"""schemathesis against the live gateway's own OpenAPI document (the fuzz stack: --max-tokens-cap 4, in front of the
tiny Gemma 4 stack's backends): requests generated from the schema — valid ones, then invalid ones — never get a 5xx, every error is an OpenAI
error object (Anthropic's on the Messages API), every stream ends as its API says (`[DONE]`; `response.completed`
or `.incomplete`; `message_stop`) with no internal error, and at least 30% of all the generated requests
were valid and answered 200, so the run does not pass on rejections alone.

schemathesis generates the requests (`APIOperation.as_strategy`); hypothesis runs a bounded number of examples
per operation (EXAMPLES), derandomized. (schemathesis's own pytest plugin
does not run under pytest 9's node ids, so hypothesis drives the strategies directly.)
"""

from __future__ import annotations

import collections
import json
import socket

import pytest
import requests
import schemathesis
import urllib3
from hypothesis import HealthCheck, given, settings
from requests.adapters import HTTPAdapter
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 25}
STATUSES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
REASONS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
PER_OP: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)


class _UnixConnection(urllib3.connection.HTTPConnection):
    """urllib3's HTTP connection over a unix socket."""

    def __init__(self, path: str, **kwargs):
        super().__init__("localhost", **kwargs)
        self.socket_path = path

    def _new_conn(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if isinstance(self.timeout, (int, float)):
            sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        return sock


class _UnixPool(urllib3.HTTPConnectionPool):
    def __init__(self, path: str):
        super().__init__("localhost")
        self.socket_path = path

    def _new_conn(self) -> _UnixConnection:
        self.num_connections += 1
        return _UnixConnection(self.socket_path, timeout=self.timeout.connect_timeout)


class _UnixAdapter(HTTPAdapter):
    """A requests transport adapter that sends every request to the HTTP server on one unix socket."""

    def __init__(self, path: str):
        super().__init__()
        self.pool = _UnixPool(path)

    def get_connection_with_tls_context(self, request, verify, proxies=None, cert=None):
        return self.pool

    def close(self) -> None:
        self.pool.close()
        super().close()


def requests_session(stack) -> requests.Session:
    """A `requests` session that reaches the stack's (plain-HTTP) REST API at `stack.base_url`: over its unix
    socket when it serves on one (schemathesis sends its cases with requests)."""
    session = requests.Session()
    if stack.sockets:
        session.mount(stack.base_url, _UnixAdapter(stack.sockets["api"]))
    return session


def openapi_schema(stack):
    """schemathesis's view of the stack's live OpenAPI document."""
    with stack.http(timeout=60) as http:
        r = http.get("/openapi.json")
    assert r.status_code == 200, r.text
    return schemathesis.openapi.from_dict(r.json())


@pytest.fixture(scope="module")
def operations(fuzz_stack):
    schema = openapi_schema(fuzz_stack)
    schema.config.generation.update(deterministic=True)
    ops = [result.ok() for result in schema.get_all_operations()]
    return {f"{op.method.upper()} {op.path}": op for op in ops}


def _check(case, base_url: str, session: requests.Session, mode: str) -> None:
    response = case.call(base_url=base_url, session=session, timeout=120)
    STATUSES[mode][response.status_code] += 1
    PER_OP[(mode, case.path)][response.status_code] += 1
    where = (case.method, case.path, repr(case.body)[:300], response.text[:300])
    assert response.status_code < 500, where
    assert response.headers.get("x-request-id"), where
    anthropic = case.path.startswith("/v1/messages")
    if response.status_code >= 400:
        if anthropic:  # Anthropic's error shape on the Messages API
            body = response.json()
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, where
            REASONS[mode][(case.path, body["error"]["type"], body["error"]["message"][:60])] += 1
            return
        err = response.json()["error"]
        REASONS[mode][(case.path, err["param"], err["message"][:60])] += 1
        assert set(err) == {"message", "type", "param", "code"} and err["message"], where
    elif "text/event-stream" in response.headers.get("content-type", ""):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events, where
        if case.path == "/v1/responses":
            kinds = [json.loads(e)["type"] for e in events]
            assert kinds[0] == "response.created" and kinds[-1] in (
                "response.completed", "response.incomplete", "error"), where
        elif anthropic:
            kinds = [json.loads(e)["type"] for e in events]
            assert kinds[0] == "message_start" and kinds[-1] in ("message_stop", "error"), where
        else:
            assert events[-1] == "[DONE]", where
        for event in events if case.path != "/v1/chat/completions" and case.path != "/v1/completions" else \
                events[:-1]:
            data = json.loads(event)
            assert data.get("error", {}).get("type") not in ("internal_error", "api_error"), where
            assert data.get("code") != "internal_error", where


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("operation", ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                                       "POST /v1/responses", "POST /v1/messages"])
def test_generated_requests_never_fail_the_server(fuzz_stack, operations, operation, mode):
    op = operations[operation]
    if mode == GenerationMode.NEGATIVE and op.method.upper() == "GET":
        pytest.skip("an operation without parameters has no invalid request")
    with requests_session(fuzz_stack) as session:

        @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            _check(case, fuzz_stack.base_url, session, mode.value)

        run()


def test_a_third_of_generated_requests_were_answered(fuzz_stack):
    """Runs after the fuzzing above (file order): of all the requests generated (valid and invalid), at least 30%
    were valid and served (200): the run does not pass on rejections alone. (Valid-looking requests are refused
    for what a schema cannot say: the order of a conversation's roles after its first user message, a tool
    message without its call, top_logprobs without logprobs.)"""
    if not STATUSES["positive"]:
        pytest.skip("the fuzzing tests did not run in this session")
    seen = STATUSES["positive"] + STATUSES["negative"]
    report = {key: dict(c) for key, c in PER_OP.items()}
    print(report, *REASONS["positive"].most_common(25), sep="\n")
    assert seen[200] >= 0.3 * sum(seen.values()), report
