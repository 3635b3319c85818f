"""Where the services listen, and TLS on their links.

The internal services (model worker, tokenizer service, the worker's metrics) trust every caller: anyone who
reaches the worker can `Prefill`, `Abort` another client's request or attach to its `Decode` stream. So they bind
127.0.0.1 unless told otherwise (`--internal-host` on `up`, `--host` on `worker` / `tokenizer`), and a
non-loopback internal address is refused unless the internal links use mutual TLS (`--internal-tls-cert`,
`--internal-tls-key`, `--internal-tls-ca`: every service presents the certificate and accepts only peers whose
certificate the CA signed) or `--insecure-internal` says the network itself is trusted.

The public ports (the gateway's HTTP API and gRPC `Generate`) take `--ssl-certfile` / `--ssl-keyfile`, as vLLM's
server does; clients then authenticate with API keys (gateway/api/auth.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import pathlib
import socket

import grpc

from common import uds

#: Message size limits of every internal link (a Gemma vocabulary's token table is near gRPC's 4 MiB default;
#: figures: docs/performance.md).
MAX_MESSAGE_BYTES = 64 << 20
_MESSAGE_LIMITS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]

#: Internal servers: accept the clients' keepalive pings (gRPC's default would answer pings more often than every
#: 5 minutes on an idle connection with GOAWAY "too_many_pings").
SERVER_OPTIONS = _MESSAGE_LIMITS + [("grpc.keepalive_permit_without_calls", 1),
                                    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                                    ("grpc.http2.max_ping_strikes", 0)]

#: Internal clients: ping every 10 s and give up on a peer silent for 5 s more, so a backend whose host or network
#: dies (no TCP reset) fails the calls on it within ~15 s instead of at the call deadline; and reconnect at most
#: 2 s apart (gRPC's default backoff grows to 2 minutes, so a restarted backend would wait that long to be used).
CHANNEL_OPTIONS = _MESSAGE_LIMITS + [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                                     ("grpc.keepalive_permit_without_calls", 1),
                                     ("grpc.http2.max_pings_without_data", 0),
                                     ("grpc.initial_reconnect_backoff_ms", 250),
                                     ("grpc.min_reconnect_backoff_ms", 250),
                                     ("grpc.max_reconnect_backoff_ms", 2_000)]


class NetworkConfigError(ValueError):
    """A refused listening address or unusable TLS files (the message says which flag to fix)."""


def add_internal_flags(p: argparse.ArgumentParser) -> None:
    """Flags for TLS on the internal gRPC links (every process of the stack takes the same three)."""
    p.add_argument("--internal-tls-cert", default=None, metavar="PEM",
                   help="certificate (chain) this process presents on internal gRPC links, as server and client")
    p.add_argument("--internal-tls-key", default=None, metavar="PEM", help="private key of --internal-tls-cert")
    p.add_argument("--internal-tls-ca", default=None, metavar="PEM",
                   help="CA that signed the peers' certificates; with the two above, internal links use mutual TLS")
    p.add_argument("--insecure-internal", action="store_true",
                   help="allow a non-loopback internal address without mutual TLS (only on a trusted network)")


def add_public_tls_flags(p: argparse.ArgumentParser) -> None:
    """Flags for TLS on the gateway's public ports (HTTP API and gRPC Generate)."""
    p.add_argument("--ssl-certfile", default=None, metavar="PEM", help="serve the public ports over TLS with this "
                   "certificate (chain)")
    p.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="private key of --ssl-certfile")


def _read(path: str, flag: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as err:
        raise NetworkConfigError(f"cannot read {flag} {path}: {err.strerror}") from None


@dataclasses.dataclass(frozen=True)
class InternalTls:
    """PEM bytes for mutual TLS on the internal links."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InternalTls | None:
        """The internal TLS files named by the flags, or None when none is given.

        Raises:
          NetworkConfigError: when only some of the three flags are given, or a file cannot be read.
        """
        names = {"--internal-tls-cert": getattr(args, "internal_tls_cert", None),
                 "--internal-tls-key": getattr(args, "internal_tls_key", None),
                 "--internal-tls-ca": getattr(args, "internal_tls_ca", None)}
        given = [flag for flag, path in names.items() if path]
        if not given:
            return None
        if len(given) != 3:
            missing = ", ".join(flag for flag, path in names.items() if not path)
            raise NetworkConfigError(f"mutual TLS needs all of --internal-tls-cert, --internal-tls-key and "
                                     f"--internal-tls-ca; missing {missing}")
        return cls(*(_read(path, flag) for flag, path in names.items()))

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: present `cert`, require a client certificate signed by `ca`."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: verify the server against `ca` and present `cert`."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def internal_args(args: argparse.Namespace) -> list[str]:
    """The internal-link flags of `args` as a command line, for a child service."""
    out = []
    for flag in ("internal_tls_cert", "internal_tls_key", "internal_tls_ca"):
        if getattr(args, flag, None):
            out += ["--" + flag.replace("_", "-"), str(pathlib.Path(getattr(args, flag)).resolve())]
    if getattr(args, "insecure_internal", False):
        out.append("--insecure-internal")
    return out


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port reachable from this machine only ("localhost", 127.0.0.0/8, ::1).
    Other names are resolved; a name that resolves to any non-loopback address is not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_internal_host(host: str, tls: InternalTls | None, insecure: bool, flag: str = "--internal-host") -> None:
    """Refuse an internal service on a non-loopback address without mutual TLS.

    Raises:
      NetworkConfigError: naming the flags that would make it acceptable.
    """
    if tls is None and not insecure and not is_loopback(host):
        raise NetworkConfigError(
            f"{flag} {host} would expose the model worker and tokenizer service (which trust every caller) "
            f"beyond this machine: give --internal-tls-cert/--internal-tls-key/--internal-tls-ca for mutual TLS, "
            f"or --insecure-internal on a trusted network")


def internal_server_tls(args: argparse.Namespace) -> InternalTls | None:
    """The mutual TLS of an internal service (`worker`, `tokenizer`) bound to `args.host`, after refusing an unsafe
    bind (`check_internal_host`; a service on a unix socket, `--uds`, binds no host).

    Raises:
      NetworkConfigError: for partial TLS flags, unreadable files or a non-loopback host without mutual TLS.
    """
    tls = InternalTls.from_args(args)
    if not getattr(args, "uds", None):  # on a unix socket (its metrics beside it) no port is opened on --host
        check_internal_host(args.host, tls, args.insecure_internal, "--host")
    return tls


def add_server_port(server, address: str, tls: InternalTls | None) -> None:
    """Listen on an internal service's `address` with mutual TLS when `tls` is set, else in plain text (see
    `add_port`).

    Raises:
      NetworkConfigError: when the address cannot be bound.
    """
    add_port(server, address, tls.server_credentials() if tls else None)


def add_port(server, address: str, credentials: grpc.ServerCredentials | None) -> None:
    """Make the gRPC `server` listen on `address` ("host:port", or "unix:PATH": `common.uds`) with `credentials`
    (TLS) when set, else in plain text. A socket path is checked first (`uds.check_path`: a stale socket is
    replaced, a live one refused, since gRPC would silently take its path) and the socket made owner-only.

    Raises:
      NetworkConfigError: when the address cannot be bound (the message names it and says why).
    """
    path = None
    try:
        if uds.is_unix(address):
            path = uds.check_path(uds.path_of(address))
            address = uds.address_of(path)
        try:
            with uds.owner_only() if path is not None else contextlib.nullcontext():  # gRPC listens as it binds
                port = server.add_secure_port(address, credentials) if credentials else \
                    server.add_insecure_port(address)
        except RuntimeError as err:
            raise NetworkConfigError(f"cannot listen on {address}: {err}") from None
        if port == 0:
            raise NetworkConfigError(f"cannot listen on {address}")
        if path is not None:
            uds.secure_after_bind(path)
    except uds.SocketPathError as err:
        raise NetworkConfigError(str(err)) from None


async def internal_server(args: argparse.Namespace, port: int, service_name: str, add_servicer):
    """An internal service's gRPC server (worker, tokenizer), not yet started: `add_servicer(server)` registers
    the service, a grpc.health.v1 servicer says NOT_SERVING for "" and `service_name` until the caller says
    otherwise, and it listens on `--uds` or `--host` and `port` with the service's mutual TLS
    (`internal_server_tls`).

    Returns:
      (server, health servicer, the address it listens on).
    Raises:
      NetworkConfigError: refused TLS flags or host, or an address that cannot be bound (the message says which).
    """
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    tls = internal_server_tls(args)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    add_servicer(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = listen_address(args.host, port, getattr(args, "uds", None))
    add_server_port(server, address, tls)
    return server, health_servicer, address


def listen_address(host: str, port: int, socket_path: str | None) -> str:
    """A service's gRPC listening address: the unix socket `socket_path` when given (`--uds`), else host:port."""
    if socket_path:
        return uds.address_of(socket_path)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_uds_flag(p: argparse.ArgumentParser, what: str) -> None:
    """`--uds PATH`: listen on a unix socket instead of `--host` and the service's port (common/uds.py)."""
    p.add_argument("--uds", default=None, metavar="PATH",
                   help=f"serve {what} on this unix socket instead of --host and its port: no port is opened (a stale "
                   "socket from a killed run is replaced; the socket is made owner-only)")


def tls_options(address: str, options=()) -> tuple:
    """`options` for a TLS channel to `address`: over a unix socket, the server's certificate is verified for
    "localhost" (gRPC would check it against the socket's path, which no certificate names), unless `options`
    already names the server to verify."""
    options = tuple(options)
    if uds.is_unix(address) and not any(k == "grpc.ssl_target_name_override" for k, _ in options):
        options += (("grpc.ssl_target_name_override", "localhost"),)
    return options


def aio_channel(address: str, tls: InternalTls | None, options=CHANNEL_OPTIONS, interceptors=None) -> grpc.aio.Channel:
    """An asyncio channel to an internal service (host:port or unix:PATH), over mutual TLS when `tls` is set."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=tls_options(address, options),
                                   interceptors=interceptors)


def sync_channel(address: str, tls: InternalTls | None, options=()) -> grpc.Channel:
    """A blocking channel to an internal service (the launcher's health checks), over mutual TLS when set."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls_options(address, options))


def public_server_credentials(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    """TLS credentials for the gateway's gRPC port from --ssl-certfile/--ssl-keyfile (None without them).

    Raises:
      NetworkConfigError: when only one of the two is given, or a file cannot be read.
    """
    cert, key = getattr(args, "ssl_certfile", None), getattr(args, "ssl_keyfile", None)
    if not cert and not key:
        return None
    if not (cert and key):
        raise NetworkConfigError("TLS on the public ports needs both --ssl-certfile and --ssl-keyfile")
    return grpc.ssl_server_credentials([(_read(key, "--ssl-keyfile"), _read(cert, "--ssl-certfile"))])
