"""Tokenizer service process: flags -> prepared model -> tokenizer -> gRPC server (health SERVING once loaded)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import tokenizer_pb2_grpc

log = logging.getLogger("gemma_serve.tokenizer")
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def load_tokenizer(model: str, cache_dir: pathlib.Path):
    """Prepare the model (if needed) and load its tokenizer. Returns (TextTokenizer, template name)."""
    from gemma_serve.models import prepare
    from tokenizer_svc.tokenizer import TextTokenizer

    prepared = prepare(model, cache_dir)
    if prepared.kind == "gguf":
        return TextTokenizer.from_prepared(prepared.dir), "gemma3"
    return TextTokenizer.from_tokenizer_json(prepared.dir), "gemma3"


async def serve(args: argparse.Namespace) -> int:
    """Run the tokenizer service until SIGTERM/SIGINT. Returns the exit code."""
    from tokenizer_svc.service import SERVICE_NAME, TokenizerServicer

    server = grpc.aio.server(options=GRPC_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer = TokenizerServicer()
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{args.host}:{args.tokenizer_port}"
    server.add_insecure_port(address)
    await server.start()
    log.info("tokenizer service listening on %s (NOT_SERVING until loaded)", address)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        tok, template = await asyncio.to_thread(load_tokenizer, args.model, pathlib.Path(args.cache_dir))
    except Exception:  # noqa: BLE001 - report and exit non-zero
        log.exception("failed to load the tokenizer")
        await server.stop(0)
        return 1
    servicer.set_ready(tok, template)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("tokenizer service SERVING (%d tokens, template %s)", tok.vocab_size, template)
    await stop.wait()
    log.info("shutting down")
    await server.stop(2)
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of `gemma-serve tokenizer`."""
    return asyncio.run(serve(args))
