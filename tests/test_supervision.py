"""The launcher's restart policy, the gateway's drain state and the worker's huge-pages re-exec, without processes
(the e2e fault tests kill and restart the real ones)."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
import time

import pytest

from gateway.backends.admission import Admission
from gateway.core.errors import ApiError
from gemma_serve.cli import build_parser
from gemma_serve.launcher import Restarts, connect_host, service_commands


def test_restarts_back_off_then_give_up_on_a_crash_loop():
    r = Restarts()
    delays = [r.delay("worker", t) for t in (0.0, 10.0, 20.0, 30.0, 40.0)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert r.delay("worker", 50.0) is None  # the sixth crash within 5 minutes
    assert r.delay("tokenizer", 50.0) == 1.0  # counted per service
    spaced = Restarts()
    assert [spaced.delay("worker", t * 400.0) for t in range(8)] == [1.0] * 8  # crashes far apart never add up


def test_draining_refuses_new_requests_and_waits_for_running_ones():
    async def main():
        adm = Admission()
        release = asyncio.Event()

        async def request():
            with adm.serving():
                await release.wait()

        running = asyncio.ensure_future(request())
        await asyncio.sleep(0)
        drain = asyncio.ensure_future(adm.drain(timeout=5))
        await asyncio.sleep(0.05)
        assert adm.draining and not drain.done() and adm.active == 1
        with pytest.raises(ApiError) as err:
            adm.admit()
        assert err.value.status == 503 and err.value.code == "shutting_down"
        release.set()
        assert await drain is True and adm.active == 0
        await running
        stuck = Admission()
        with stuck.serving():
            assert await stuck.drain(timeout=0.05) is False

    asyncio.run(main())


def test_up_keeps_internal_services_on_loopback_and_passes_keys_by_environment():
    args = build_parser().parse_args(["up", "--host", "0.0.0.0", "--api-key", "secret-key", "--drain-timeout", "7"])
    cmds = service_commands(args)
    for name in ("worker", "tokenizer"):
        assert cmds[name][cmds[name].index("--host") + 1] == "127.0.0.1"
    assert cmds["gateway"][cmds["gateway"].index("--host") + 1] == "0.0.0.0"
    assert all("secret-key" not in " ".join(cmd) for cmd in cmds.values())  # never on a command line (ps)
    assert all(cmd[cmd.index("--drain-timeout") + 1] == "7.0" for cmd in cmds.values())
    assert connect_host("0.0.0.0") == "127.0.0.1" and connect_host("10.0.0.5") == "10.0.0.5"


def test_a_drain_that_times_out_ends_running_streams_with_an_error_event():
    """RequestGuard + Admission: a stream still running when the drain times out is cut at once and ends with an
    SSE error event and [DONE] (not a silently truncated stream); a request arriving meanwhile gets a 503."""
    from gateway.api.http_guard import RequestGuard
    from gateway.core.limits import Limits

    async def slow_stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(1000):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            await asyncio.sleep(0.01)

    async def main():
        adm = Admission()
        guard = RequestGuard(slow_stream, Limits(), admission=adm)
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "GET", "path": "/v1/x", "headers": []}
        running = asyncio.ensure_future(guard(dict(scope), receive, send))
        await asyncio.sleep(0.05)
        assert not await adm.drain(timeout=0.05)
        late: list[dict] = []

        async def send_late(message):
            late.append(message)

        await guard(dict(scope), receive, send_late)
        assert late[0]["status"] == 503 and b"shutting_down" in late[1]["body"]
        await adm.cut()
        await asyncio.wait_for(running, 2)
        tail = sent[-1]
        assert tail["more_body"] is False and b'"shutting_down"' in tail["body"]
        assert tail["body"].rstrip().endswith(b"data: [DONE]")

    asyncio.run(main())


def test_the_worker_command_re_executes_itself_with_huge_pages(monkeypatch, tmp_path):
    """`gemma-serve worker` asks glibc for transparent huge pages through `GLIBC_TUNABLES` (read only at process
    start, hence a re-exec of the same command), keeps other tunables, and leaves an explicit choice alone."""
    from gemma_serve import cli

    calls = []
    monkeypatch.setattr(cli.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.setattr(cli.sys, "argv", [cli.__file__, "worker", "--num-slots", "4"])  # python -m gemma_serve.cli
    monkeypatch.setattr(cli.sys, "platform", "linux")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    cli._with_huge_pages()
    (exe, argv, env), = calls
    assert argv == [exe, "-m", "gemma_serve.cli", "worker", "--num-slots", "4"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    script = str(tmp_path / "gemma-serve")  # the console script: its own command line again
    pathlib.Path(script).write_text("#!/bin/sh\n")
    monkeypatch.setattr(cli.sys, "argv", [script, "worker"])
    calls.clear()
    cli._with_huge_pages()
    assert [c[:2] for c in calls] == [(script, [script, "worker"])]
    assert env[cli.REEXEC_MARK] == "1"
    # The script refused by execve itself (not merely by access(), which ignores capabilities): `python -m` then.
    calls.clear()

    def refuse_script(exe, argv, env):
        if exe == script:
            raise PermissionError(13, "Permission denied")
        calls.append((exe, argv, env))

    monkeypatch.setattr(cli.os, "execve", refuse_script)
    monkeypatch.setattr(cli.os, "access", lambda *a: False)  # what a capability-only traversal looks like
    cli._with_huge_pages()
    assert [c[1] for c in calls] == [[sys.executable, "-m", "gemma_serve.cli", "worker"]]
    monkeypatch.setattr(cli.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    calls.clear()
    cli._with_huge_pages()  # access() saying no does not keep the script from running itself again
    assert [c[:2] for c in calls] == [(script, [script, "worker"])]
    calls.clear()
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv(cli.REEXEC_MARK, "1")  # already re-executed (a secure-mode glibc dropped the tunable)
    cli._with_huge_pages()
    monkeypatch.delenv(cli.REEXEC_MARK)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")  # the operator's choice
    cli._with_huge_pages()
    monkeypatch.setattr(cli.sys, "platform", "darwin")
    monkeypatch.delenv("GLIBC_TUNABLES")
    cli._with_huge_pages()
    assert calls == []


def test_up_on_a_model_that_does_not_exist_says_so_and_leaves_no_service(tmp_path):
    """A model path that does not exist ends `up` in one line and exit 2 (checked before the services start, which
    otherwise start before the model is prepared: their start overlaps the preparation), no service left behind and
    no traceback from one that got as far as loading (each service says a wrong model spec in one line too)."""
    import psutil

    from tests.transport import socket_folder

    missing = tmp_path / "nowhere" / "model.gguf"
    proc = subprocess.Popen([sys.executable, "-m", "gemma_serve.cli", "up", "--uds", str(socket_folder()),
                             "--cache-dir", str(tmp_path / "cache"), "--model", str(missing)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = []
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                children += [c for c in psutil.Process(proc.pid).children() if c not in children]
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and f"model path {missing} does not exist" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_a_service_given_a_model_that_does_not_exist_says_so_in_one_line(tmp_path):
    """The tokenizer service started on its own (as `up` or an operator's manifest starts it) on a missing model
    path: exit 1 with "failed to load the tokenizer: model path ... does not exist", and no traceback (a wrong model
    spec is the operator's mistake, not a crash)."""
    from tests.transport import socket_folder

    missing = tmp_path / "nowhere" / "model.gguf"
    r = subprocess.run([sys.executable, "-m", "gemma_serve.cli", "tokenizer", "--uds",
                        str(socket_folder() / "tokenizer.sock"), "--cache-dir", str(tmp_path / "cache"),
                        "--model", str(missing)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"failed to load the tokenizer: model path {missing} does not exist" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
