"""Gateway process: uvicorn (REST) and the gRPC Generate server on one asyncio loop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

import grpc
import uvicorn

from gateway.app import create_app
from gateway.clients import Backends
from gateway.grpc_service import GatewayServicer, add_to_server
from gateway.limits import Limits

log = logging.getLogger("gemma_serve.gateway")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (this process handles SIGTERM/SIGINT for both servers)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(args: argparse.Namespace) -> int:
    """Run the gateway until SIGTERM/SIGINT. Returns the exit code."""
    limits = Limits.from_args(args)
    backends = Backends(args.tokenizer_addr, args.worker_addr, args.served_model_name)
    ready = asyncio.ensure_future(backends.wait_ready())
    # Generate requests over the body limit are refused by gRPC itself (RESOURCE_EXHAUSTED) before parsing.
    grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", limits.max_body_bytes),
                                           ("grpc.max_send_message_length", 64 << 20)])
    add_to_server(GatewayServicer(backends, limits), grpc_server)
    grpc_server.add_insecure_port(f"{args.host}:{args.gateway_grpc_port}")
    await grpc_server.start()
    holder: list[_Server] = []
    app = create_app(backends, limits, open_connections=lambda: len(holder[0].server_state.connections))
    # uvicorn's own connection limit answers plain text; it is only a backstop far above ours (RequestGuard).
    config = uvicorn.Config(app, host=args.host, port=args.http_port, log_level="warning",
                            timeout_graceful_shutdown=5, limit_concurrency=2 * limits.max_connections + 64)
    server = _Server(config)
    holder.append(server)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    http = asyncio.ensure_future(server.serve())
    log.info("gateway listening on http://%s:%d (gRPC Generate on %s:%d)", args.host, args.http_port, args.host,
             args.gateway_grpc_port)
    await asyncio.wait([http, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
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
