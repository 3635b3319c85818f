"""Gateway process: uvicorn (REST) and the gRPC Generate server on one asyncio loop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

import grpc
import uvicorn

from common import network, uds
from gateway.api.app import create_app
from gateway.api.auth import ApiKeys
from gateway.api.grpc_service import GatewayServicer, add_to_server
from gateway.api.http_protocol import GuardedH11Protocol
from gateway.backends.clients import Backends, Timeouts
from gateway.core.limits import Limits

log = logging.getLogger("gemma_serve.gateway")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (this process handles SIGTERM/SIGINT for both servers)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(args: argparse.Namespace) -> int:
    """Run the gateway until SIGTERM/SIGINT. Returns the exit code."""
    limits = Limits.from_args(args)
    try:
        keys = ApiKeys.from_args(args)
        tls = network.InternalTls.from_args(args)
        public_tls = network.public_server_credentials(args)
    except ValueError as err:
        log.error("%s", err)
        return 2
    timeouts = Timeouts(tokenizer=args.tokenizer_timeout, worker=args.worker_timeout)
    try:
        backends = Backends(args.tokenizer_addr, args.worker_addr or ["127.0.0.1:50052"], args.served_model_name,
                            tls, timeouts, args.worker_refresh)
    except ValueError as err:
        log.error("%s", err)
        return 2
    ready = asyncio.ensure_future(backends.watch())
    # Generate requests over the body limit are refused by gRPC itself (RESOURCE_EXHAUSTED) before parsing.
    grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", limits.max_body_bytes),
                                           ("grpc.max_send_message_length", network.MAX_MESSAGE_BYTES)])
    add_to_server(GatewayServicer(backends, limits, keys), grpc_server)
    grpc_uds = args.grpc_uds or (uds.sibling(args.uds, "grpc") if args.uds else None)
    address = network.listen_address(args.host, args.gateway_grpc_port, grpc_uds)
    try:
        http_socket = uds.bind(args.uds) if args.uds else None  # checked, owner-only; before gRPC takes its path
        network.add_port(grpc_server, address, public_tls)
    except (uds.SocketPathError, network.NetworkConfigError) as err:
        log.error("%s", err)
        return 2
    await grpc_server.start()
    holder: list[_Server] = []
    app = create_app(backends, limits, open_connections=lambda: len(holder[0].server_state.connections), keys=keys)
    # uvicorn's own connection limit answers plain text; it is only a backstop far above ours (RequestGuard). Its
    # graceful shutdown is short: the drain (gateway/backends/admission.py) has already finished or cut every request.
    config = uvicorn.Config(app, host=args.host, port=args.http_port, log_level="warning",
                            timeout_graceful_shutdown=2, limit_concurrency=2 * limits.max_connections + 64,
                            ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, http=GuardedH11Protocol)
    server = _Server(config)
    holder.append(server)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    http = asyncio.ensure_future(server.serve(sockets=[http_socket] if http_socket else None))
    scheme = "https" if public_tls else "http"
    log.info("gateway listening on %s (gRPC Generate on %s%s; %s)",
             f"unix socket {args.uds} ({scheme})" if args.uds else f"{scheme}://{args.host}:{args.http_port}",
             address, " over TLS" if public_tls else "",
             f"{len(keys)} API key(s) required on /v1" if keys else "no API key required")
    await asyncio.wait([http, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    log.info("draining: %d request(s) running, new ones refused (at most %.0f s)", backends.admission.active,
             args.drain_timeout)
    if not await backends.admission.drain(args.drain_timeout):
        log.warning("drain timeout: cutting the %d request(s) still running", backends.admission.active)
        await backends.admission.cut()
    log.info("shutting down")
    server.should_exit = True
    await http
    ready.cancel()
    await grpc_server.stop(2)
    await backends.close()
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of `gemma-serve gateway`."""
    return asyncio.run(serve(args))
