"""How the tests reach the servers they start: TCP on loopback where the host allows it, else unix sockets.

The TPU host's sandbox refuses every internet socket, loopback included (`socket(AF_INET)` fails with
EAFNOSUPPORT), and lets unix sockets through; `scripts/no_inet.sh` gives any Linux machine the same rule. The
product serves over either (`--uds`, common/uds.py); a test whose subject is not the transport asks this module
for an endpoint and runs the same way on both kinds of host. Tests about TCP itself skip without it, naming the
reason (`needs_tcp`).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pathlib
import shutil
import socket
import tempfile

import pytest

_TCP: list[bool] = []

#: The skip reason of a test whose subject is a TCP port.
NO_TCP = "this host allows no TCP socket, not even on loopback (the TPU host's sandbox): the test is about a port"


def tcp_available() -> bool:
    """Whether this process may open an internet socket (checked once). GEMMA_SERVE_TEST_NO_TCP=1 answers False
    on any host, so the e2e tests run over unix sockets as they do on the TPU host."""
    if not _TCP:
        if os.environ.get("GEMMA_SERVE_TEST_NO_TCP"):
            _TCP.append(False)
            return False
        try:
            socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
            _TCP.append(True)
        except OSError:
            _TCP.append(False)
    return _TCP[0]


def needs_tcp() -> None:
    """Skip the calling test on a host without TCP (`NO_TCP`)."""
    if not tcp_available():
        pytest.skip(NO_TCP)


_FOLDERS: list[str] = []


def socket_folder() -> pathlib.Path:
    """A new private folder for unix sockets, short enough for `sun_path` (under the system's temporary folder,
    not pytest's deeper ones); removed when the process exits."""
    if not _FOLDERS:
        atexit.register(lambda: [shutil.rmtree(f, ignore_errors=True) for f in _FOLDERS])
    _FOLDERS.append(tempfile.mkdtemp(prefix="gs-"))
    return pathlib.Path(_FOLDERS[-1])


def grpc_listen(server, credentials=None, name: str = "grpc") -> str:
    """Make a gRPC `server` (not yet started) listen on a free loopback port, or on a unix socket without TCP;
    returns the address clients dial ("127.0.0.1:PORT" or "unix:PATH")."""
    if tcp_available():
        port = server.add_secure_port("127.0.0.1:0", credentials) if credentials else \
            server.add_insecure_port("127.0.0.1:0")
        return f"127.0.0.1:{port}"
    address = f"unix:{socket_folder() / f'{name}.sock'}"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    assert port, f"could not listen on {address}"
    return address


@dataclasses.dataclass(frozen=True)
class HttpEndpoint:
    """Where a test's HTTP server listens: a loopback port, or a unix socket (`path`)."""

    port: int = 0
    path: str | None = None

    @classmethod
    def free(cls) -> HttpEndpoint:
        """A free loopback port, or a fresh socket path without TCP."""
        if tcp_available():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return cls(port=s.getsockname()[1])
        return cls(path=str(socket_folder() / "http.sock"))

    @property
    def base_url(self) -> str:
        return "http://localhost" if self.path else f"http://127.0.0.1:{self.port}"

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config's arguments for this endpoint."""
        return {"uds": self.path} if self.path else {"host": "127.0.0.1", "port": self.port}

    def client(self, **kwargs):
        """An `httpx.Client` on it (base_url set)."""
        import httpx

        transport = httpx.HTTPTransport(uds=self.path) if self.path else None
        return httpx.Client(base_url=self.base_url, transport=transport, **kwargs)

    def connect(self, timeout: float | None = None) -> socket.socket:
        """A raw connected stream socket."""
        if self.path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(self.path)
            return sock
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
