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
from gateway.clients import GRPC_OPTIONS, Backends
from gateway.grpc_service import GatewayServicer
from protos import gateway_pb2_grpc

log = logging.getLogger("gemma_serve.gateway")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (this process handles SIGTERM/SIGINT for both servers)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(args: argparse.Namespace) -> int:
    """Run the gateway until SIGTERM/SIGINT. Returns the exit code."""
    backends = Backends(args.tokenizer_addr, args.worker_addr, args.served_model_name)
    ready = asyncio.ensure_future(backends.wait_ready())
    grpc_server = grpc.aio.server(options=GRPC_OPTIONS)
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(backends), grpc_server)
    grpc_server.add_insecure_port(f"{args.host}:{args.gateway_grpc_port}")
    await grpc_server.start()
    config = uvicorn.Config(create_app(backends), host=args.host, port=args.http_port, log_level="warning",
                            timeout_graceful_shutdown=5)
    server = _Server(config)
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
