"""Unix domain sockets: every listener of the stack can be a socket path instead of a host and a port.

Why: co-located services (three processes on one TPU VM, containers of one pod sharing a volume) need no port at
all, and some hosts allow none (a sandbox that refuses internet sockets, even on loopback). A socket in a private
folder is reachable only by the folder's owner (connecting needs search permission on the folder and write
permission on the socket), so no port is exposed and no other user of the machine can call the services, which
trust every caller (common/network.py).

Addresses are gRPC's: `unix:PATH` (relative or absolute) or `unix:///ABSOLUTE/PATH`; `gemma-serve up --uds DIR`
puts every socket in DIR (`socket_names`). Before a socket is bound, `check_path` refuses a path that cannot work
with one line naming it (too long for `sun_path`, a missing or unwritable folder, a file that is not a socket, a
socket another server answers on) and removes a stale socket left by a killed run; `private_dir` creates the
folder of `up --uds` with mode 0700 and refuses one that other users may write to. Sockets are made mode 0600.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import logging
import os
import pathlib
import socket
import ssl
import stat

log = logging.getLogger("gemma_serve.uds")

UNIX = "unix:"
#: Bytes of a socket path, without its NUL: `sun_path` holds 108 on Linux (104 on macOS and the BSDs).
MAX_PATH_BYTES = 107 if os.uname().sysname == "Linux" else 103
#: Mode of every socket the stack binds: its owner only (the folder's mode is the other guard).
SOCKET_MODE = 0o600
#: Listen backlog of the sockets `bind` makes (as uvicorn's default).
BACKLOG = 2048


class SocketPathError(ValueError):
    """A socket path (or `--uds` folder) that cannot be used; the message names it and says why."""


def is_unix(address: str) -> bool:
    """Whether `address` is a unix socket address (`unix:...`)."""
    return address.startswith(UNIX)


def path_of(address: str) -> pathlib.Path:
    """The socket path of a `unix:PATH` or `unix:///PATH` address (as gRPC reads them).

    Raises:
      SocketPathError: not a unix address, or no path in it.
    """
    if not is_unix(address):
        raise SocketPathError(f"{address!r} is not a unix socket address (unix:PATH)")
    rest = address[len(UNIX):].removeprefix("//")  # unix:///abs/path: an empty authority, then the absolute path
    if not rest:
        raise SocketPathError(f"{address!r} names no socket path")
    if "%" in rest:  # gRPC percent-decodes a unix: address: the checks would look at another file than it binds
        raise SocketPathError(f"socket path {rest!r} holds a '%': choose a path without one")
    return pathlib.Path(rest)


def address_of(path: str | os.PathLike) -> str:
    """The `unix:` address of a socket path (made absolute: the processes of a stack may differ in their working
    folder)."""
    return UNIX + os.path.abspath(path)


def socket_names(workers: int = 1) -> dict[str, str]:
    """The file name of each listener of `gemma-serve up --uds DIR` in DIR: "api" (the OpenAI REST API), "generate"
    (the gateway's gRPC Generate), "tokenizer", and per worker its gRPC and metrics sockets ("worker",
    "worker-metrics"; with several workers "worker-0", "worker-0-metrics", ...)."""
    names = {"api": "api.sock", "generate": "generate.sock", "tokenizer": "tokenizer.sock"}
    for w in (["worker"] if workers == 1 else [f"worker-{i}" for i in range(workers)]):
        names[w] = f"{w}.sock"
        names[f"{w}-metrics"] = f"{w}-metrics.sock"
    return names


def sibling(path: str | os.PathLike, suffix: str) -> pathlib.Path:
    """`path` with `-suffix` before its extension: the default socket of a service's second listener
    (`worker.sock` -> `worker-metrics.sock`)."""
    p = pathlib.Path(path)
    return p.with_name(f"{p.stem}-{suffix}{p.suffix or '.sock'}")


def private_dir(path: str | os.PathLike) -> pathlib.Path:
    """The folder of `up --uds`: created with mode 0700 (its parents as the umask says) when missing; an existing
    one must be a folder of this user's that no other user may write to (else someone could replace a socket with
    their own). Returns it as an absolute path.

    Raises:
      SocketPathError: naming the folder and the problem.
    """
    d = pathlib.Path(os.path.abspath(path))
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as err:
        raise SocketPathError(f"cannot create the socket folder {d}: {err.strerror}") from None
    try:
        st = d.stat()
    except OSError as err:
        raise SocketPathError(f"cannot use the socket folder {d}: {err.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SocketPathError(f"--uds {d} exists and is not a folder")
    if st.st_uid != os.geteuid():
        raise SocketPathError(f"the socket folder {d} belongs to another user (uid {st.st_uid}): they could replace "
                              "the sockets; use a folder of your own")
    if st.st_mode & 0o022:
        raise SocketPathError(f"the socket folder {d} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                              f"they could replace the sockets; use a private folder (chmod go-w {d})")
    if not os.access(d, os.W_OK | os.X_OK):
        raise SocketPathError(f"the socket folder {d} is not writable by this user")
    return d


def check_path(path: str | os.PathLike) -> pathlib.Path:
    """Make `path` ready to be bound: refuse what cannot work, remove a stale socket. Returns it absolute.

    A socket file nobody answers on (a killed run's) is removed; one a live server answers on is refused, so a
    second stack never takes the sockets of a running one (gRPC and asyncio would silently unlink it).

    Raises:
      SocketPathError: the path is too long for a socket, its folder is missing or not writable, it exists and is
        not a socket, or a server answers on it.
    """
    p = pathlib.Path(os.path.abspath(path))
    if "%" in str(p):
        raise SocketPathError(f"socket path {p} holds a '%' (gRPC would read it percent-encoded): choose a path "
                              "without one")
    size = len(os.fsencode(str(p)))
    if size > MAX_PATH_BYTES:
        raise SocketPathError(f"socket path {p} is {size} bytes; a unix socket path holds at most {MAX_PATH_BYTES}: "
                              "use a shorter folder")
    try:
        if not p.parent.is_dir():
            raise SocketPathError(f"cannot create socket {p}: its folder does not exist")
        if not os.access(p.parent, os.W_OK | os.X_OK):
            raise SocketPathError(f"cannot create socket {p}: its folder is not writable by this user")
        try:
            st = p.lstat()
        except FileNotFoundError:
            return p
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketPathError(f"{p} exists and is not a socket: remove it or choose another path")
        if _answers(p):
            raise SocketPathError(f"{p} is in use: another server answers on it")
        log.info("removing the stale socket %s (nothing answers on it)", p)
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    except OSError as err:  # a folder above it this user cannot enter, another user's stale socket, ...
        raise SocketPathError(f"cannot use the socket path {p}: {err.strerror or err}") from None
    return p


def _answers(path: pathlib.Path) -> bool:
    """Whether a server listens on the socket at `path` (one with a full queue counts: it is alive)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError as err:
            if err.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            if isinstance(err, TimeoutError) or err.errno == errno.EAGAIN:
                return True
            raise SocketPathError(f"cannot check the socket {path}: {err.strerror or err}") from None
        return True


@contextlib.contextmanager
def owner_only():
    """While inside, files and sockets are created owner-only (umask 0177): a socket must not be reachable by
    others between its bind and a chmod (gRPC listens as it binds). The umask is the process's: other threads
    creating files meanwhile get owner-only ones too, which is harmless."""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def bind(path: str | os.PathLike, mode: int = SOCKET_MODE) -> socket.socket:
    """A stream socket bound at `path` (after `check_path`) with `mode` (owner-only from the start), listening
    (uvicorn and socketserver may call listen again).

    Raises:
      SocketPathError: as `check_path`, or the bind failed.
    """
    p = check_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with owner_only():
            sock.bind(str(p))
        os.chmod(p, mode)
        sock.listen(BACKLOG)  # listening at once: a second check of this path sees it alive, not stale
    except OSError as err:
        sock.close()
        raise SocketPathError(f"cannot bind the socket {p}: {err.strerror}") from None
    return sock


def secure_after_bind(path: str | os.PathLike, mode: int = SOCKET_MODE) -> None:
    """Give a socket that another library bound (gRPC) the stack's mode.

    Raises:
      SocketPathError: the socket is not there.
    """
    try:
        os.chmod(path, mode)
    except OSError as err:
        raise SocketPathError(f"cannot set the mode of the socket {path}: {err.strerror}") from None


class UnixHTTPConnection(http.client.HTTPConnection):
    """`http.client` over a unix socket (the launcher's health checks, the tests' probes). `context`: TLS over the
    socket, verifying the server as "localhost"."""

    def __init__(self, path: str | os.PathLike, timeout: float = 5.0, context: ssl.SSLContext | None = None):
        super().__init__("localhost", timeout=timeout)
        self.socket_path, self.context = str(path), context

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
            self.sock = self.context.wrap_socket(sock, server_hostname="localhost") if self.context else sock
        except BaseException:
            sock.close()
            raise


def http_get(path: str | os.PathLike, target: str, timeout: float = 5.0,
             context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """GET `target` ("/health") from the HTTP server on the socket at `path`: (status, body).

    Raises:
      OSError: nothing answers (or the connection broke).
    """
    conn = UnixHTTPConnection(path, timeout, context)
    try:
        conn.request("GET", target, headers={"Host": "localhost"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except http.client.HTTPException as err:
        raise OSError(f"bad HTTP answer on {path}: {err}") from err
    finally:
        conn.close()
