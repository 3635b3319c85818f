"""Access to the real processes: API keys on REST and gRPC `Generate` (the auth gateway, also serving TLS on its
public ports with a throwaway CA), open `/health` and `/metrics`, internal ports on loopback only (or private unix
sockets and no internet listener at all), mutual TLS on the internal links (the embedded stack runs with it), and
refused unsafe network flags."""

from __future__ import annotations

import os
import pathlib
import socket
import stat
import subprocess
import sys

import anthropic
import grpc
import httpx
import openai
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.network import InternalTls, tls_options
from protos import gateway_pb2, gateway_pb2_grpc
from tests.e2e.stacks import API_KEYS, REPO, pki
from tests.transport import needs_tcp

pytestmark = pytest.mark.slow


def _client(stack, key: str) -> openai.OpenAI:
    return stack.openai(api_key=key)


def _generate(stack, metadata=()):
    creds = grpc.ssl_channel_credentials(root_certificates=stack.ca.read_bytes())
    with grpc.secure_channel(stack.grpc_addr, creds, options=tls_options(stack.grpc_addr)) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(text="Hello", max_tokens=2)
        return list(stub.Generate(req, metadata=metadata, timeout=60))


def test_rest_needs_a_valid_key(auth_stack):
    with auth_stack.http() as http:  # the openai client refuses to send no key
        bare = http.post("/v1/completions", json={"model": "x", "prompt": "Hello"})
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as err:
        _client(auth_stack, "wrong-key").completions.create(model="x", prompt="Hello", max_tokens=2)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert err.value.response.headers["www-authenticate"] == "Bearer"
    for key in API_KEYS.values():  # a key from --api-key, --api-key-file and GEMMA_SERVE_API_KEY
        client = _client(auth_stack, key)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2


def test_tenants_share_no_cached_prefix(auth_stack):
    """With API keys the prefix cache is scoped per key: another key sending the same private prompt computes it
    anew (0 cached tokens, so neither its usage nor its time to first token tells it the prompt was sent), while
    the same key gets a full hit."""
    private = "Private notes of tenant A: " + " ".join(f"entry {i} is {i * 7919 % 1000}" for i in range(25))
    a, b = _client(auth_stack, API_KEYS["flag"]), _client(auth_stack, API_KEYS["file"])
    model = a.models.list().data[0].id

    def cached(client) -> tuple[int, int]:
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": private}],
                                             max_tokens=1, temperature=0, extra_body={"cache_salt": "notes"})
        return out.usage.prompt_tokens_details.cached_tokens, out.usage.prompt_tokens

    cached(a)
    hit, prompt = cached(a)
    assert prompt > 150 and hit == prompt - 1
    assert cached(b)[0] == 0


def test_messages_api_takes_the_key_as_x_api_key(auth_stack):
    """Anthropic's clients send the key as `x-api-key`; a wrong one is a 401 in Anthropic's error shape."""
    model = _client(auth_stack, API_KEYS["env"]).models.list().data[0].id
    client = auth_stack.anthropic(api_key=API_KEYS["env"])
    out = client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "Hello"}])
    assert out.usage.output_tokens == 2
    wrong = auth_stack.anthropic(api_key="wrong-key")
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "Hello"}])
    assert err.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": "Incorrect API key provided"}}


def test_health_and_metrics_need_no_key(auth_stack):
    with auth_stack.http() as http:
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and "gemma_serve:gateway_requests_total" in metrics.text
        bare = http.post("/v1/chat/completions", json={})  # refused before the body is read
        assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"


def test_plain_http_is_not_served_on_a_tls_port(auth_stack):
    """Plain HTTP on the TLS port (or, over unix sockets, on the TLS socket) gets no answer."""
    if auth_stack.sockets:
        plain = httpx.HTTPTransport(uds=auth_stack.sockets["api"])
        with httpx.Client(transport=plain, timeout=5) as http, pytest.raises(httpx.HTTPError):
            http.get("http://localhost/health")
        return
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{auth_stack.ports['http']}/health", timeout=5)


def test_grpc_generate_needs_a_valid_key(auth_stack):
    for metadata in ((), (("authorization", "Bearer wrong-key"),), (("authorization", API_KEYS["flag"]),)):
        with pytest.raises(grpc.RpcError) as err:
            _generate(auth_stack, metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    replies = _generate(auth_stack, (("authorization", f"Bearer {API_KEYS['env']}"),))
    assert sum(len(r.tokens) for r in replies) == 2


def _health(address: str, creds: grpc.ChannelCredentials | None):
    channel = grpc.secure_channel(address, creds, options=tls_options(address)) if creds else \
        grpc.insecure_channel(address)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_internal_links_need_a_client_certificate(stack, tmp_path_factory):
    """The embedded stack's worker and tokenizer service speak mutual TLS: a caller with a certificate the test CA
    signed is served; a plain-text caller and a TLS caller without a client certificate are not."""
    p = pki(tmp_path_factory.mktemp)
    tls = InternalTls(p.cert.read_bytes(), p.key.read_bytes(), p.ca.read_bytes())
    for service in ("worker", "tokenizer"):
        address = stack.address(service)
        assert _health(address, tls.channel_credentials()) == health_pb2.HealthCheckResponse.SERVING
        for creds in (None, grpc.ssl_channel_credentials(root_certificates=tls.ca)):
            with pytest.raises(grpc.RpcError) as err:
                _health(address, creds)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def _outward_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_internal_ports_listen_on_loopback_only(stack):
    """Over TCP, the worker's, its metrics' and the tokenizer service's ports answer on loopback only; over unix
    sockets, every socket is its owner's only (mode 0600, in a 0700 folder) and no process of the stack listens
    on an internet socket at all."""
    if stack.sockets:
        for name, path in stack.sockets.items():
            mode = os.stat(path).st_mode
            assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, (name, path, oct(mode))
            folder = stat.S_IMODE(os.stat(pathlib.Path(path).parent).st_mode)
            assert folder == 0o700, (name, path, oct(folder))
        up = psutil.Process(stack.proc.pid)
        processes = [up, *up.children(recursive=True)]
        assert len(processes) >= 4, processes  # `up`, its gateway, tokenizer service and worker
        listening = [(p.pid, p.name(), c.laddr) for p in processes for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert not listening, listening
        return
    needs_tcp()
    address = _outward_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    for name in ("worker", "tokenizer", "metrics"):
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((address, stack.ports[name])) != 0, f"the {name} port answers on {address}"
        with socket.create_connection(("127.0.0.1", stack.ports[name]), timeout=2):
            pass


@pytest.mark.parametrize("argv", [["up", "--internal-host", "0.0.0.0"], ["worker", "--host", "0.0.0.0"],
                                  ["tokenizer", "--host", "0.0.0.0"]], ids=lambda a: a[0])
def test_non_loopback_internal_host_needs_mutual_tls(argv, tmp_path):
    """Refused at once (exit 2, before any model work) without mutual TLS or --insecure-internal."""
    cmd = [sys.executable, "-m", "gemma_serve.cli", *argv, "--cache-dir", str(tmp_path), "--model", "/nonexistent"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--internal-tls-cert" in out.stderr and "--insecure-internal" in out.stderr


def test_partial_tls_flags_are_refused(tmp_path):
    cmd = [sys.executable, "-m", "gemma_serve.cli", "up", "--cache-dir", str(tmp_path), "--model", "/nonexistent",
           "--internal-tls-cert", str(tmp_path / "cert.pem")]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "missing --internal-tls-key, --internal-tls-ca" in out.stderr, out.stderr[-2000:]
