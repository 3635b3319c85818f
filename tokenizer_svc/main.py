"""Tokenizer service process: flags -> prepared model -> tokenizer -> gRPC server (health SERVING once loaded)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import pathlib
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gemma_serve import network, preparation
from protos import tokenizer_pb2_grpc

log = logging.getLogger("gemma_serve.tokenizer")


def write_tokenizer(reader, out: pathlib.Path, name: str) -> None:
    """The tokenizer service's part of a prepared GGUF: the tokenizer rebuilt from the GGUF vocabulary
    (`gguf_tokenizer.build_and_cache`: tokenizer.json, vocab_meta.json, token_bytes.bin, each atomic). `name` is
    unused (the part builders' common signature).

    Raises:
      ValueError: an unsupported vocabulary.
    """
    from tokenizer_svc.gguf_tokenizer import build_and_cache

    build_and_cache(reader, out)


PREPARE_PARTS: dict[str, preparation.PartBuilder] = {"tokenizer": write_tokenizer}
"""The prepared parts the tokenizer service reads (`gemma_serve.preparation.prepare`)."""



def choose_template(directory: pathlib.Path, tokenizer):
    """The chat template of a checkpoint directory: its own `chat_template.jinja` when present ("checkpoint",
    rendered by `JinjaTemplate` with content kept as data), else the built-in "gemma4" when config.json's
    `model_type` (or `text_config.model_type`) is gemma4 / gemma4_text, else the built-in "gemma3".

    Returns:
      (template name, renderer).

    Raises:
      TemplateError: chat_template.jinja does not parse.
    """
    from tokenizer_svc.chat_template import TEMPLATES, JinjaTemplate

    jinja = directory / "chat_template.jinja"
    if jinja.exists():
        return "checkpoint", JinjaTemplate.from_file(jinja, tokenizer)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    model_types = {config.get("model_type"), text_config.get("model_type")}
    name = "gemma4" if model_types & {"gemma4", "gemma4_text"} else "gemma3"
    return name, TEMPLATES[name]


def load_tokenizer(model: str, cache_dir: pathlib.Path):
    """Prepare the model (if needed) and load its tokenizer and chat template (a GGUF is Gemma 3: "gemma3"; a
    checkpoint directory: `choose_template`). Returns (TextTokenizer, template name, renderer)."""
    from tokenizer_svc.chat_template import TEMPLATES
    from tokenizer_svc.tokenizer import TextTokenizer

    prepared = preparation.prepare(model, cache_dir, PREPARE_PARTS)
    if prepared.kind == "gguf":
        return TextTokenizer.from_prepared(prepared.dir), "gemma3", TEMPLATES["gemma3"]
    tokenizer = TextTokenizer.from_tokenizer_json(prepared.dir)
    return (tokenizer, *choose_template(prepared.dir, tokenizer))


async def serve(args: argparse.Namespace) -> int:
    """Run the tokenizer service until SIGTERM/SIGINT. Returns the exit code."""
    from tokenizer_svc.service import SERVICE_NAME, TokenizerServicer

    try:
        tls = network.internal_server_tls(args)
    except network.NetworkConfigError as err:
        log.error("%s", err)
        return 2
    server = grpc.aio.server(options=network.SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer = TokenizerServicer()
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{args.host}:{args.tokenizer_port}"
    network.add_server_port(server, address, tls)
    await server.start()
    log.info("tokenizer service listening on %s (NOT_SERVING until loaded)", address)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        tok, template, render = await asyncio.to_thread(load_tokenizer, args.model, pathlib.Path(args.cache_dir))
    except Exception:  # noqa: BLE001 - report and exit non-zero
        log.exception("failed to load the tokenizer")
        await server.stop(0)
        return 1
    servicer.set_ready(tok, template, render)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("tokenizer service SERVING (%d tokens, template %s)", tok.vocab_size, template)
    await stop.wait()
    log.info("shutting down (running calls may finish within %.0f s)", args.drain_timeout)
    await server.stop(args.drain_timeout)  # new calls are refused at once; returns as soon as the running ones end
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of `gemma-serve tokenizer`."""
    return asyncio.run(serve(args))
