"""Exec probe for an internal gemma-serve service behind mutual TLS: exit 0 when its grpc.health.v1 status is
SERVING, 1 otherwise (NOT_SERVING, unreachable, a TLS failure).

The kubelet's own gRPC probes speak plain text only, so with `--internal-tls-*` the tokenizer service and the
model worker are probed by this script, run inside their own container (the image has Python, grpcio and
gemma_serve). It dials 127.0.0.1 and verifies the server's certificate for SERVER_NAME (the Service name the
gateway dials: gemma-tokenizer, gemma-worker), presenting the same certificate the service does.

Usage: python grpc_health_tls.py PORT SERVER_NAME [TLS_DIR]
TLS_DIR holds tls.crt, tls.key and ca.crt (the keys of a Secret issued by cert-manager; default
/etc/gemma-serve/tls).
"""

from __future__ import annotations

import pathlib
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.network import InternalTls, sync_channel

DEFAULT_TLS_DIR = "/etc/gemma-serve/tls"
USAGE = "usage: python grpc_health_tls.py PORT SERVER_NAME [TLS_DIR]"
TIMEOUT_S = 4.0  # under the probes' timeoutSeconds (5)


def serving(port: int, server_name: str, tls_dir: pathlib.Path, timeout: float = TIMEOUT_S) -> bool:
    """Whether the service on 127.0.0.1:`port` answers the overall health check ("") with SERVING over mutual
    TLS.

    Raises:
      OSError: a file of `tls_dir` cannot be read.
    """
    tls = InternalTls(cert=(tls_dir / "tls.crt").read_bytes(), key=(tls_dir / "tls.key").read_bytes(),
                      ca=(tls_dir / "ca.crt").read_bytes())
    options = [("grpc.ssl_target_name_override", server_name)]
    with sync_channel(f"127.0.0.1:{port}", tls, options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    """The probe's exit status for `argv` (PORT SERVER_NAME [TLS_DIR]); 2 for a usage error."""
    if len(argv) not in (3, 4) or not argv[1].isdigit():
        print(USAGE, file=sys.stderr)
        return 2
    tls_dir = pathlib.Path(argv[3] if len(argv) == 4 else DEFAULT_TLS_DIR)
    return 0 if serving(int(argv[1]), argv[2], tls_dir) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
