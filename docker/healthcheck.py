"""The images' HEALTHCHECK: `python healthcheck.py tokenizer|worker|gateway` exits 0 when the service in this
container is ready, 1 when it is not (loading, compiling, draining, unreachable), 2 on a usage error, and prints
what it saw (Docker keeps it: `docker inspect --format '{{json .State.Health}}' CONTAINER`).

tokenizer, worker: grpc.health.v1 `Check("")` must answer SERVING (NOT_SERVING while the tokenizer loads and while
the worker loads its weights and compiles, which takes minutes). gateway: `GET /health` must answer 200 (503 until
the tokenizer and at least one worker serve, and while draining).

It reads the variables docker/entrypoint.sh builds the command line from: the port (TOKENIZER_PORT, WORKER_PORT,
HTTP_PORT), GEMMA_SERVE_HOST (a wildcard address is checked on loopback), INTERNAL_TLS_CERT / _KEY / _CA (then
the gRPC check uses mutual TLS with the service's own certificate, verifying the server's certificate for
INTERNAL_TLS_SERVER_NAME, by default for the address dialled: set it to the name the gateway dials, e.g. worker-1)
and SSL_CERTFILE (then /health is fetched over HTTPS, unverified: it is this container's own process). Only the
standard library, grpcio and grpcio-health-checking (dependencies of gemma-serve) are used.
"""

from __future__ import annotations

import os
import pathlib
import sys

TIMEOUT_S = 4.0  # under the HEALTHCHECK --timeout (5 s)
#: service -> (the variable of the port checked, its default in docker/entrypoint.sh)
PORTS = {"tokenizer": ("TOKENIZER_PORT", "50051"), "worker": ("WORKER_PORT", "50052"),
         "gateway": ("HTTP_PORT", "8000")}


def grpc_serving(address: str) -> tuple[bool, str]:
    """(whether grpc.health.v1 at `address` answers SERVING, what it answered), over mutual TLS when the
    INTERNAL_TLS_* variables are set.

    Raises:
      OSError: an INTERNAL_TLS_* file cannot be read.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from common.network import InternalTls, sync_channel

    tls, options = None, []
    if os.environ.get("INTERNAL_TLS_CERT"):
        cert, key, ca = (pathlib.Path(os.environ[f"INTERNAL_TLS_{part}"]).read_bytes() for part in ("CERT", "KEY", "CA"))
        tls = InternalTls(cert=cert, key=key, ca=ca)
        if os.environ.get("INTERNAL_TLS_SERVER_NAME"):
            options.append(("grpc.ssl_target_name_override", os.environ["INTERNAL_TLS_SERVER_NAME"]))
    with sync_channel(address, tls, options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=TIMEOUT_S)
        except grpc.RpcError as err:
            return False, f"{err.code().name}: {err.details()}"
    return (reply.status == health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def http_ok(url: str) -> tuple[bool, str]:
    """(whether GET `url` answers 200, the status and body); an https URL is not verified (our own process, whose
    certificate names a public host)."""
    import ssl
    import urllib.error
    import urllib.request

    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as resp:
            return resp.status == 200, f"{resp.status} {resp.read(2000).decode(errors='replace')}"
    except urllib.error.HTTPError as err:
        return False, f"{err.code} {err.read(2000).decode(errors='replace')}"
    except OSError as err:
        return False, f"unreachable: {err}"


def main(argv: list[str]) -> int:
    """The exit status of the check of the service `argv[1]` (see the module docstring)."""
    if len(argv) != 2 or argv[1] not in PORTS:
        print(f"usage: healthcheck.py {'|'.join(PORTS)}", file=sys.stderr)
        return 2
    from gemma_serve.launcher import connect_host

    var, default = PORTS[argv[1]]
    host = connect_host(os.environ.get("GEMMA_SERVE_HOST", "0.0.0.0"))
    address = f"{f'[{host}]' if ':' in host else host}:{os.environ.get(var) or default}"
    if argv[1] == "gateway":
        scheme = "https" if os.environ.get("SSL_CERTFILE") else "http"
        ok, seen = http_ok(f"{scheme}://{address}/health")
    else:
        ok, seen = grpc_serving(address)
    print(f"{argv[1]} {address}: {seen}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
