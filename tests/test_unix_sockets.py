"""Unix domain sockets as a transport (common/uds.py): paths checked before a bind with one line naming the
problem, stale sockets replaced and live ones refused, owner-only modes, `up --uds DIR` wiring every service through
sockets, and the three services themselves started on sockets with every internet socket refused
(`scripts/no_inet.sh`, as on the TPU host), answering health checks and /metrics there."""

from __future__ import annotations

import os
import pathlib
import socket
import stat
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import network, uds
from gemma_serve.cli import build_parser
from gemma_serve.launcher import Launcher, internal_addresses, service_commands, socket_paths
from tests.transport import socket_folder

REPO = pathlib.Path(__file__).resolve().parents[1]


def _listening(path: pathlib.Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)
    return s


def test_addresses_parse_as_grpc_reads_them():
    assert uds.path_of("unix:/run/gs/worker.sock") == pathlib.Path("/run/gs/worker.sock")
    assert uds.path_of("unix:///run/gs/worker.sock") == pathlib.Path("/run/gs/worker.sock")
    assert uds.path_of("unix:rel/w.sock") == pathlib.Path("rel/w.sock")
    assert uds.address_of("rel/w.sock") == "unix:" + os.path.abspath("rel/w.sock")
    for bad in ("unix:", "unix://", "127.0.0.1:5", "unix:/tmp/a%41b.sock"):  # gRPC would bind a%41b as aAb
        with pytest.raises(uds.SocketPathError):
            uds.path_of(bad)
    with pytest.raises(uds.SocketPathError, match="holds a '%'"):
        uds.check_path("/tmp/a%41b.sock")
    assert uds.sibling("/d/worker.sock", "metrics") == pathlib.Path("/d/worker-metrics.sock")
    assert uds.sibling("/d/api", "grpc") == pathlib.Path("/d/api-grpc.sock")
    assert set(uds.socket_names(2)) == {"api", "generate", "tokenizer", "worker-0", "worker-0-metrics",
                                        "worker-1", "worker-1-metrics"}


def test_check_path_replaces_a_stale_socket_and_refuses_a_live_one_or_a_file():
    d = socket_folder()
    stale = d / "stale.sock"
    _listening(stale).close()  # a killed run's socket: the file stays, nobody answers
    assert stale.exists() and uds.check_path(stale) == stale and not stale.exists()
    live = d / "live.sock"
    server = _listening(live)
    try:
        with pytest.raises(uds.SocketPathError, match=f"{live} is in use"):
            uds.check_path(live)
    finally:
        server.close()
    plain = d / "file.sock"
    plain.write_text("not a socket")
    with pytest.raises(uds.SocketPathError, match=f"{plain} exists and is not a socket"):
        uds.check_path(plain)
    assert plain.read_text() == "not a socket"  # never removed
    with pytest.raises(uds.SocketPathError, match="its folder does not exist"):
        uds.check_path(d / "missing" / "x.sock")
    long = d / ("x" * 120 + ".sock")
    with pytest.raises(uds.SocketPathError, match="holds at most"):
        uds.check_path(long)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any folder: the refusal is for other users")
def test_check_path_refuses_a_folder_it_cannot_write():
    d = socket_folder()
    os.chmod(d, 0o500)
    try:
        with pytest.raises(uds.SocketPathError, match="not writable"):
            uds.check_path(d / "x.sock")
    finally:
        os.chmod(d, 0o700)


def test_bind_makes_an_owner_only_socket_and_a_private_folder():
    d = socket_folder()
    old_umask = os.umask(0)  # the most permissive: the socket must still be owner-only from its bind on
    try:
        sock = uds.bind(d / "api.sock")
        with uds.owner_only():
            raw = socket.socket(socket.AF_UNIX)
            raw.bind(str(d / "raw.sock"))
        assert stat.S_IMODE((d / "raw.sock").stat().st_mode) == 0o600  # as gRPC's bind inside `add_port`
        raw.close()
    finally:
        os.umask(old_umask)
    try:
        assert stat.S_IMODE((d / "api.sock").stat().st_mode) == 0o600
        with pytest.raises(uds.SocketPathError, match="is in use"):  # bound and listening: alive, never stale
            uds.check_path(d / "api.sock")
    finally:
        sock.close()
    made = uds.private_dir(d / "new" / "run")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and made.is_absolute()
    os.chmod(made, 0o777)
    with pytest.raises(uds.SocketPathError, match="writable by other users"):
        uds.private_dir(made)
    (d / "afile").write_text("")
    with pytest.raises(uds.SocketPathError, match="not a folder"):
        uds.private_dir(d / "afile")
    if os.geteuid() == 0:  # only root can give a folder away
        theirs = d / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(uds.SocketPathError, match="belongs to another user"):
            uds.private_dir(theirs)


def test_grpc_port_on_a_socket_refuses_a_live_one_and_serves_owner_only():
    d = socket_folder()
    address = f"unix:{d / 'svc.sock'}"
    first = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), first)
    network.add_port(first, address, None)
    first.start()
    try:
        assert stat.S_IMODE((d / "svc.sock").stat().st_mode) == 0o600
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        second = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(1))
        with pytest.raises(network.NetworkConfigError, match="is in use"):  # gRPC alone would unlink it silently
            network.add_port(second, address, None)
    finally:
        first.stop(0)


def test_up_uds_wires_every_service_through_sockets_in_one_folder():
    d = socket_folder() / "run"
    args = build_parser().parse_args(["up", "--uds", str(d), "--workers", "2", "--host", "0.0.0.0"])
    Launcher(args)  # creates the private folder, checks every path
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    paths = socket_paths(args)
    cmds = service_commands(args)
    flag = lambda cmd, name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert flag(cmds["tokenizer"], "--uds") == paths["tokenizer"] == str(d / "tokenizer.sock")
    for i in range(2):
        w = cmds[f"worker-{i}"]
        assert flag(w, "--uds") == str(d / f"worker-{i}.sock")
        assert flag(w, "--metrics-uds") == str(d / f"worker-{i}-metrics.sock")
    gw = cmds["gateway"]
    assert flag(gw, "--uds") == str(d / "api.sock") and flag(gw, "--grpc-uds") == str(d / "generate.sock")
    assert flag(gw, "--tokenizer-addr") == f"unix:{d / 'tokenizer.sock'}"
    assert [gw[i + 1] for i, a in enumerate(gw) if a == "--worker-addr"] == \
        [f"unix:{d / 'worker-0.sock'}", f"unix:{d / 'worker-1.sock'}"]
    assert internal_addresses(args)["worker-1"] == f"unix:{d / 'worker-1.sock'}"
    # a public --host 0.0.0.0 is unused over sockets; the refusal of a non-loopback internal host does not apply
    Launcher(build_parser().parse_args(["up", "--uds", str(d), "--internal-host", "0.0.0.0"]))


def test_up_uds_refuses_a_folder_others_can_write_before_any_model_work(tmp_path):
    d = socket_folder()
    os.chmod(d, 0o777)
    out = subprocess.run([sys.executable, "-m", "gemma_serve.cli", "up", "--uds", str(d), "--cache-dir",
                          str(tmp_path), "--model", "/nonexistent"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 2 and f"the socket folder {d} is writable by other users" in out.stderr, out.stderr


def _no_inet_env() -> dict[str, str]:
    """The environment of `scripts/no_inet.sh`: the shim built and preloaded (internet sockets refused)."""
    lib = socket_folder() / "no_inet.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(REPO / "scripts" / "no_inet.c"), "-ldl"],
                   check=True, capture_output=True)
    return {**os.environ, "LD_PRELOAD": str(lib)}


def test_the_shim_refuses_internet_sockets_only():
    code = ("import socket\ntry:\n    socket.socket()\nexcept OSError as e:\n    print(e.errno)\n"
            "socket.socket(socket.AF_UNIX).close(); print('unix')")
    out = subprocess.run([sys.executable, "-c", code], env=_no_inet_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["97", "unix"], out.stderr


@pytest.mark.slow  # the embedded model's tokenizer, services in processes
def test_services_serve_on_sockets_where_no_internet_socket_may_be_opened(prepared, tmp_path):
    """The tokenizer service and a gateway started with `--uds` on a host that refuses internet sockets: the
    tokenizer answers its health check on its socket, the gateway its /health (503: no worker) on its REST socket
    and gRPC Generate on its own; SIGTERM stops both with exit 0. (The worker's sockets are crossed by the e2e
    stacks, whose embedded stack runs over `up --uds`.)"""
    if subprocess.run(["which", "gcc"], capture_output=True).returncode:
        pytest.skip("no C compiler to build the no-inet shim")
    d = socket_folder()
    env = {**_no_inet_env(), "PYTHONUNBUFFERED": "1"}
    base = [sys.executable, "-m", "gemma_serve.cli"]
    common = ["--model", str(prepared.dir), "--cache-dir", str(tmp_path)]
    tok = subprocess.Popen(base + ["tokenizer", *common, "--uds", str(d / "tok.sock")], env=env, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    gw = subprocess.Popen(base + ["gateway", *common, "--uds", str(d / "api.sock"), "--tokenizer-addr",
                                  f"unix:{d / 'tok.sock'}", "--worker-addr", f"unix:{d / 'worker.sock'}"],
                          env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert tok.poll() is None and gw.poll() is None, (tok.poll(), gw.poll())
            try:
                with grpc.insecure_channel(f"unix:{d / 'tok.sock'}") as ch:
                    status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING and (d / "api-grpc.sock").exists():
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "the services did not come up on their sockets"
            time.sleep(0.3)
        # The HTTP socket is bound before gRPC starts, so a request made now is held until the app serves (its
        # start-up took over 5 s on a loaded 2-core host): the rest of the deadline, not a short timeout.
        code, body = uds.http_get(d / "api.sock", "/health", timeout=max(5.0, deadline - time.monotonic()))
        assert code == 503 and b"worker" in body
        for name in ("tok.sock", "api.sock", "api-grpc.sock"):
            assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
        from protos import gateway_pb2, gateway_pb2_grpc

        with grpc.insecure_channel(f"unix:{d / 'api-grpc.sock'}") as ch:
            with pytest.raises(grpc.RpcError) as err:  # reached: the gateway answers that no worker serves
                list(gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(text="hi"), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    finally:
        for p in (gw, tok):
            p.terminate()
        outs = [p.communicate(timeout=60)[0] for p in (gw, tok)]
    assert (gw.returncode, tok.returncode) == (0, 0), outs
