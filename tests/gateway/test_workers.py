"""The gateway's worker pool (gateway/backends/workers.py): which workers a `--worker-addr` stands for, workers joining
and leaving when a name's addresses change, and a failed worker leaving the routing ring until its health check
passes. DNS is replaced by a table (`socket.getaddrinfo` monkeypatched); no worker process runs."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.backends import workers
from gateway.backends.worker_choice import NoWorkerError
from gateway.backends.workers import WorkerPool, resolve_target, split_target


def _fake_dns(monkeypatch, table: dict[str, list[str]]) -> None:
    def getaddrinfo(host, port, type=0, **kw):
        if host not in table:
            raise socket.gaierror(f"unknown host {host}")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port) if ":" not in a else (a, port, 0, 0)) for a in table[host]]

    monkeypatch.setattr(workers.socket, "getaddrinfo", getaddrinfo)


def test_split_target_needs_a_port():
    assert split_target("w:50052") == ("w", 50052)
    assert split_target("[::1]:7") == ("::1", 7)
    for bad in ("w", "w:", "w:0", "w:70000", "w:x"):
        with pytest.raises(ValueError, match="host:port"):
            split_target(bad)


def test_a_name_with_several_addresses_is_one_worker_per_address(monkeypatch):
    _fake_dns(monkeypatch, {"workers.svc": ["10.0.0.2", "10.0.0.1", "fd00::1"], "one": ["10.0.0.9"],
                            "dual": ["10.0.0.5", "fd00::5"]})
    assert resolve_target("workers.svc:50052") == {"10.0.0.1:50052": "workers.svc", "10.0.0.2:50052": "workers.svc"}
    assert resolve_target("one:50052") == {"one:50052": "one"}  # one address: the name is kept (TLS, logs)
    assert resolve_target("dual:1") == {"dual:1": "dual"}  # a dual-stack host is one worker, not two
    assert resolve_target("10.1.2.3:9") == {"10.1.2.3:9": "10.1.2.3"}  # no lookup for an IP literal


def test_workers_join_and_leave_with_the_names_addresses(monkeypatch):
    table = {"workers.svc": ["10.0.0.1", "10.0.0.2"]}
    _fake_dns(monkeypatch, table)

    async def scenario():
        pool = WorkerPool(["workers.svc:50052"], None, [], refresh_s=0.0)
        await pool.resolve(force=True)
        first = sorted(pool.workers)
        table["workers.svc"] = ["10.0.0.2", "10.0.0.3", "10.0.0.4"]
        await pool.resolve(force=True)
        second = sorted(pool.workers)
        del table["workers.svc"]  # DNS trouble: the pool keeps what it had
        await pool.resolve(force=True)
        third = sorted(pool.workers)
        await pool.close()
        return first, second, third

    first, second, third = asyncio.run(scenario())
    assert first == ["10.0.0.1:50052", "10.0.0.2:50052"]
    assert second == ["10.0.0.2:50052", "10.0.0.3:50052", "10.0.0.4:50052"]
    assert third == second


def test_only_serving_workers_are_routed_to_and_a_failed_one_leaves_at_once():
    async def scenario():
        pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], None, [])
        await pool.resolve(force=True)
        # nothing has passed a health check yet: the key's worker is tried anyway (a dead one fails its call)
        assert pool.route(None, list(range(100)), "", "k").reason == "unhealthy"
        for w in pool.workers.values():  # as a health poll that saw both serving
            w.status = "SERVING"
            pool.router.set_healthy(w.addr, True)
        picks = {pool.route(f"s{i}", [], "", "k").addr for i in range(50)}
        pool.mark_failed("127.0.0.1:1")
        after = {pool.route(f"s{i}", [], "", "k").addr for i in range(50)}
        pool.refuse("127.0.0.1:2", "serves another model")
        assert pool.route("s0", [], "", "k").addr == "127.0.0.1:1"  # down, but the only one with our model
        pool.refuse("127.0.0.1:1", "serves another model")
        with pytest.raises(NoWorkerError):  # never a worker that serves another model
            pool.route("s0", [], "", "k")
        await pool.close()
        return picks, after

    picks, after = asyncio.run(scenario())
    assert picks == {"127.0.0.1:1", "127.0.0.1:2"}
    assert after == {"127.0.0.1:2"}


def test_no_worker_address_is_refused():
    with pytest.raises(ValueError, match="--worker-addr"):
        WorkerPool([], None, [])
    with pytest.raises(ValueError, match="host:port"):
        WorkerPool(["nowhere"], None, [])


def test_session_headers_parse_and_bad_values_are_a_400_naming_the_header():
    from gateway.backends.workers import Session
    from gateway.core.errors import ApiError

    def parse(**headers):
        return Session.from_headers(lambda name: headers.get(name.replace("-", "_")))

    assert parse() == Session(None, 0.0, False)
    assert parse(x_session_id="a" * 300, x_session_ttl="90", x_session_release="true") == Session("a" * 256, 90.0,
                                                                                                  True)
    for header, value in (("x_session_ttl", "-1"), ("x_session_ttl", "nan"), ("x_session_ttl", "inf"),
                          ("x_session_ttl", "soon"), ("x_session_release", "maybe")):
        with pytest.raises(ApiError) as err:
            parse(x_session_id="s", **{header: value})
        assert err.value.status == 400 and err.value.param == header.replace("_", "-")


def test_tail_chunks_reach_the_worker_and_default_to_16_32_on_cpu_only():
    """`gemma-serve up --tail-chunks 8 16` hands them to the worker; not given: the worker picks 16 32 on CPU
    (those below the smallest prefill chunk), none on an accelerator (given ones dropped there); `--tail-chunks`
    alone turns them off; a tail chunk not below the smallest prefill chunk is refused with the numbers."""
    from gemma_serve.cli import build_parser
    from gemma_serve.launcher import service_commands
    from model_worker.server.main import FlagsRefused, tail_chunks

    parser = build_parser()
    for given, expected in ((["--tail-chunks", "8", "16"], [8, 16]), (["--tail-chunks"], []), ([], None)):
        cmd = service_commands(parser.parse_args(["up", *given]))["worker"]
        assert parser.parse_args(cmd[cmd.index("worker"):]).tail_chunks == expected
    assert tail_chunks(None, [64, 512], "cpu") == (16, 32)
    assert tail_chunks(None, [32, 512], "cpu") == (16,)
    assert tail_chunks(None, [64, 512], "tpu") == ()
    assert tail_chunks([], [64, 512], "cpu") == ()
    assert tail_chunks([24, 8, 8], [64], "cpu") == (8, 24)
    assert tail_chunks([24, 8], [64], "gpu") == ()  # (with a warning: an accelerator never runs them)
    with pytest.raises(FlagsRefused, match="below the smallest prefill chunk 64"):
        tail_chunks([64], [64, 512], "cpu")


def test_up_workers_runs_n_workers_on_consecutive_ports_behind_one_gateway():
    """`gemma-serve up --workers 3`: three worker command lines on --worker-port + i and --worker-metrics-port + i,
    the gateway given each one's address, and every command line accepted by the CLI's own parser."""
    from gemma_serve.cli import build_parser
    from gemma_serve.launcher import service_commands

    parser = build_parser()
    args = parser.parse_args(["up", "--workers", "3", "--worker-port", "6000", "--worker-metrics-port", "7000"])
    cmds = service_commands(args)
    assert [n for n in cmds if n.startswith("worker")] == ["worker-0", "worker-1", "worker-2"]
    for i in range(3):
        worker = parser.parse_args(cmds[f"worker-{i}"][cmds[f"worker-{i}"].index("worker"):])
        assert (worker.worker_port, worker.worker_metrics_port) == (6000 + i, 7000 + i)
    gateway = parser.parse_args(cmds["gateway"][cmds["gateway"].index("gateway"):])
    assert gateway.worker_addr == ["127.0.0.1:6000", "127.0.0.1:6001", "127.0.0.1:6002"]
    assert list(service_commands(parser.parse_args(["up"]))) == ["tokenizer", "worker", "gateway"]
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--workers", "0"])


def test_up_gives_each_worker_its_own_tensor_parallel_devices(monkeypatch):
    """`up --workers 2 --tensor-parallel 2`: every worker command line carries --tensor-parallel 2; on a 4-GPU
    host worker i sees only GPUs 2i and 2i+1 (narrowed from the caller's CUDA_VISIBLE_DEVICES); 2 x 2 devices on a
    3-GPU host and several workers on a TPU host are refused with the numbers; CPU workers need no split (each
    process has its own simulated devices); one worker needs no probe: it gets the first N GPUs."""
    from gemma_serve.cli import build_parser
    from gemma_serve.launcher import service_commands, worker_devices

    parser = build_parser()
    args = parser.parse_args(["up", "--workers", "2", "--tensor-parallel", "2"])
    for name in ("worker-0", "worker-1"):
        cmd = service_commands(args)[name]
        assert parser.parse_args(cmd[cmd.index("worker"):]).tensor_parallel == 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert worker_devices(args, probe=lambda: ("gpu", 4)) == {"worker-0": {"CUDA_VISIBLE_DEVICES": "0,1"},
                                                              "worker-1": {"CUDA_VISIBLE_DEVICES": "2,3"}}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert worker_devices(args, probe=lambda: ("gpu", 4))["worker-1"] == {"CUDA_VISIBLE_DEVICES": "6,7"}
    with pytest.raises(ValueError, match="needs 4 devices; this host has 3"):
        worker_devices(args, probe=lambda: ("gpu", 3))
    with pytest.raises(ValueError, match="TPU host"):
        worker_devices(args, probe=lambda: ("tpu", 8))
    assert worker_devices(args, probe=lambda: ("cpu", 1)) == {}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # one worker: its first N GPUs, no probe
    assert worker_devices(parser.parse_args(["up", "--tensor-parallel", "4"]), probe=None) == {
        "worker": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}}
    assert worker_devices(parser.parse_args(["up"]), probe=None) == {}


def test_a_worker_without_the_devices_it_needs_refuses_its_flags(tmp_path):
    """`gemma-serve worker --tensor-parallel 3` where XLA is told of 2 CPU devices exits with code 2 (which stops
    `up` instead of restarting it) and says how many devices it needs and sees, before loading any model."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.e2e.stacks import free_ports

    port, metrics = free_ports(2)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run([sys.executable, "-m", "gemma_serve.cli", "worker", "--model", "embedded",
                          "--cache-dir", str(tmp_path), "--worker-port", str(port), "--worker-metrics-port",
                          str(metrics), "--tensor-parallel", "3"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--tensor-parallel 3 needs 3 devices; this worker sees 2" in out.stderr
    assert not list(tmp_path.glob("**/*.safetensors"))  # refused before preparing the model


def test_flags_the_model_cannot_honour_exit_2_from_the_loading_thread(tmp_path, monkeypatch):
    """A refusal raised while the model loads (`FlagsRefused`: slots that do not fit, a split that cuts
    quantization groups, a context the model does not have) ends the worker with exit code 2, which `up` does not
    restart, not as a crash (exit 1, restarted)."""
    from gemma_serve.cli import build_parser
    from model_worker.server import main
    from tests.e2e.stacks import free_ports

    def refuse(prepared, args):
        raise main.FlagsRefused("--num-slots 512: needs 90 GiB, the device reports 80 GiB")

    monkeypatch.setattr(main.preparation, "prepare", lambda *a, **k: None)
    monkeypatch.setattr(main, "load_engine", refuse)
    port, metrics = free_ports(2)
    args = build_parser().parse_args(["worker", "--cache-dir", str(tmp_path), "--worker-port", str(port),
                                      "--worker-metrics-port", str(metrics), "--num-slots", "512"])
    assert main.run(args) == 2


def test_a_late_health_answer_keeps_a_worker_routed_but_a_dead_one_leaves_at_once(monkeypatch):
    """A real health server on a unix socket: checks past their deadline (a worker busy holding the GIL) keep the
    worker SERVING for `LATE_GRACE_S` (1 s here), then it counts as UNREACHABLE; a timely answer makes it SERVING
    again; once its server is gone, the next poll says UNREACHABLE (no grace for a connection that fails)."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.transport import socket_folder

    monkeypatch.setattr(workers, "LATE_GRACE_S", 1.0)
    delay = [0.0]

    class Health(health_pb2_grpc.HealthServicer):
        async def Check(self, request, context):
            await asyncio.sleep(delay[0])
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def scenario():
        addr = f"unix:{socket_folder() / 'w.sock'}"
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
        server.add_insecure_port(addr)
        await server.start()
        pool = WorkerPool([addr], None, [])
        first = (await pool.poll(timeout=0.2))[addr]
        delay[0] = 0.5
        late, t0 = [], time.monotonic()
        while not late or late[-1] == "SERVING":
            late.append((await pool.poll(timeout=0.2))[addr])
        waited = time.monotonic() - t0
        delay[0] = 0.0
        again = (await pool.poll(timeout=0.2))[addr]
        await server.stop(None)
        gone = (await pool.poll(timeout=0.2))[addr]
        await pool.close()
        return first, late, waited, again, gone

    first, late, waited, again, gone = asyncio.run(scenario())
    assert first == "SERVING" and late[-1] == "UNREACHABLE" and len(late) >= 3, late
    assert 1.0 <= waited < 3.0, waited
    assert (again, gone) == ("SERVING", "UNREACHABLE")
