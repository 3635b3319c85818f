"""Tokenizer service process: flags -> prepared model -> tokenizer -> gRPC server (health SERVING once loaded)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import pathlib
import signal

from grpc_health.v1 import health_pb2

from common import families, network, preparation
from protos import tokenizer_pb2_grpc
from tokenizer_svc.chat_template import tokenizer_part

log = logging.getLogger("gemma_serve.tokenizer")


def write_tokenizer(reader, out: pathlib.Path, name: str) -> None:
    """The tokenizer service's part of a prepared GGUF: first its model family (`general.architecture`, checked
    against the family registry and recorded in gguf_architecture.json, so an unsupported GGUF fails before the
    tokenizer is built), then the tokenizer rebuilt from the GGUF vocabulary (`gguf_tokenizer.build_and_cache`:
    tokenizer.json, vocab_meta.json, token_bytes.bin, each atomic). `name` is unused (the part builders' common
    signature). A directory prepared before the family was recorded learns it at load (`_recorded_architecture`).

    Raises:
      UnknownFamilyError: no registered family serves the architecture (the message lists the supported ones).
      ValueError: the GGUF has no `general.architecture`, or an unsupported vocabulary.
    """
    from tokenizer_svc import gguf_tokenizer

    meta = gguf_tokenizer.read_architecture(reader)
    families.from_gguf(meta)
    gguf_tokenizer.write_architecture(meta, out)
    gguf_tokenizer.build_and_cache(reader, out)


PREPARE_PARTS: dict[str, preparation.PartBuilder] = {"tokenizer": write_tokenizer}
"""The prepared parts the tokenizer service reads (`common.preparation.prepare`)."""


def checkpoint_family(directory: pathlib.Path) -> families.Family:
    """The model family of a checkpoint directory, from its config.json (`families.from_hf_config`: `model_type`,
    `text_config.model_type` or `architectures`).

    Raises:
      UnknownFamilyError: config.json is missing or names no registered family (the message lists the supported
        model types).
    """
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return families.from_hf_config(config if isinstance(config, dict) else {})


def choose_template(directory: pathlib.Path, tokenizer):
    """The chat template of a checkpoint directory: its own `chat_template.jinja` when present ("checkpoint", a
    `JinjaTemplate` with content kept as data and the checkpoint's family attached), else its family's built-in
    template (named after the family). The family is known either way (`checkpoint_family`).

    Returns:
      (template name, renderer).

    Raises:
      UnknownFamilyError: see `checkpoint_family`.
      TemplateError: chat_template.jinja does not parse.
    """
    from tokenizer_svc.jinja_template import JinjaTemplate

    family = checkpoint_family(directory)
    jinja = directory / "chat_template.jinja"
    if jinja.exists():
        return "checkpoint", JinjaTemplate.from_file(jinja, tokenizer, family)
    return family.name, tokenizer_part(family).render


def load_tokenizer(model: str, cache_dir: pathlib.Path):
    """Prepare the model (if needed) and load its tokenizer and chat template: a GGUF's family from its recorded
    `general.architecture` (`families.from_gguf`), rendered by the family's built-in template; a checkpoint
    directory's by `choose_template`. The family is looked up first, so an unsupported model fails at once.

    Returns:
      (TextTokenizer, template name, renderer).

    Raises:
      UnknownFamilyError: the model names no registered family (the message lists the supported ones).
      TemplateError, ValueError, FileNotFoundError: see `choose_template` and `common.preparation.prepare`.
    """
    from tokenizer_svc.tokenizer import TextTokenizer

    prepared = preparation.prepare(model, cache_dir, PREPARE_PARTS)
    if prepared.kind == "gguf":
        family = families.from_gguf(_recorded_architecture(prepared, cache_dir))
        part = tokenizer_part(family)
        return (TextTokenizer.from_prepared(prepared.dir, part.template_facts.end_of_turn), family.name,
                part.render)
    family = checkpoint_family(prepared.dir)
    tokenizer = TextTokenizer.from_tokenizer_json(prepared.dir, tokenizer_part(family).template_facts.end_of_turn)
    return (tokenizer, *choose_template(prepared.dir, tokenizer))


def _recorded_architecture(prepared: preparation.PreparedModel, cache_dir: pathlib.Path | None) -> dict[str, str]:
    """A prepared GGUF's recorded `general.architecture` (written with the tokenizer part). A directory whose
    tokenizer part an earlier release prepared lacks it: then it is read from the source GGUF the manifest names,
    once, and recorded, so such a directory keeps working (also when passed as `--model`).

    Raises:
      FileNotFoundError: neither recorded nor the source GGUF still there.
      ValueError: the source GGUF has no `general.architecture`.
    """
    from tokenizer_svc import gguf_tokenizer

    try:
        return gguf_tokenizer.load_architecture(prepared.dir)
    except FileNotFoundError:
        pass
    source = json.loads((prepared.dir / preparation.MANIFEST).read_text()).get("source", "")
    if source == preparation.EMBEDDED:
        path = preparation.embedded_gguf(pathlib.Path(cache_dir or preparation.default_cache_dir()))
    else:
        path = pathlib.Path(source)
    if not source or not path.is_file():
        raise FileNotFoundError(f"{prepared.dir} was prepared by an earlier release without its model family, and "
                                f"its source GGUF {source!r} is gone; prepare it again")
    log.info("reading the model family of %s from %s", prepared.dir, path)
    meta = gguf_tokenizer.read_architecture(preparation.open_gguf(path))
    gguf_tokenizer.write_architecture(meta, prepared.dir)
    return meta


async def serve(args: argparse.Namespace) -> int:
    """Run the tokenizer service until SIGTERM/SIGINT. Returns the exit code."""
    from tokenizer_svc.service import SERVICE_NAME, TokenizerServicer

    servicer = TokenizerServicer()
    try:
        server, health_servicer, address = await network.internal_server(
            args, args.tokenizer_port, SERVICE_NAME, lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(
                servicer, s))
    except network.NetworkConfigError as err:
        log.error("%s", err)
        return 2
    await server.start()
    log.info("tokenizer service listening on %s (NOT_SERVING until loaded)", address)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        tok, template, render = await asyncio.to_thread(load_tokenizer, args.model, pathlib.Path(args.cache_dir))
        servicer.set_ready(tok, template, render)
    except Exception as err:
        # An unsupported model, a path that does not exist or is no model: the message says it all.
        if isinstance(err, (families.UnknownFamilyError, FileNotFoundError, ValueError)):
            log.error("failed to load the tokenizer: %s", err)
        else:
            log.exception("failed to load the tokenizer")
        await server.stop(0)
        return 1
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("tokenizer service SERVING (%d tokens, family %s, template %s)", tok.vocab_size, servicer.family.name,
             template)
    await stop.wait()
    log.info("shutting down (running calls may finish within %.0f s)", args.drain_timeout)
    await server.stop(args.drain_timeout)  # new calls are refused at once; returns as soon as the running ones end
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of `gemma-serve tokenizer`."""
    return asyncio.run(serve(args))
