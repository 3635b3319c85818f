"""Model families: one registry from the names a checkpoint declares to the package that serves it.

A family (Gemma 3, Gemma 4, ...) is one plug-in package `families/<name>/` with three part modules, each imported
lazily by the service that needs it, so the gateway and the tokenizer service never import JAX. Each part module
defines `PART`, an instance of the type its service declares, and the service loads it typed (`load_part`), so a
family that misses a field fails with a TypeError naming it, never with an AttributeError mid-request:

- `worker.py` (model worker; may import JAX): `PART = model_worker.modeling.config.WorkerPart(...)`: config parsing from
  a Hugging Face config.json and from GGUF metadata, the family's presets, and the tensor names its checkpoints add
  to the Gemma-style ones of model_worker/checkpoints/hf_loader.py.
- `tokenizer.py` (tokenizer service; no JAX): `PART = tokenizer_svc.chat_template.TokenizerPart(...)`: the built-in
  chat template (`render`), the template's facts (whether it declares tools and has a thinking mode, advertised in
  the tokenizer's `Info`) and the answer format (how its tool calls are spelled inside a checkpoint's own Jinja
  template, for splicing remembered answers; None when the family has no native call syntax).
- `gateway.py` (gateway; no JAX): `PART = gateway.core.tool_format.FamilyFormat(...)`: the tool grammar builder and
  incremental parser, the grammar's end tokens, the call markers, budget-aware endings, the thought channel.
  Control tokens are named by spelling; the gateway looks their ids up in the vocabulary the tokenizer service
  sends and passes them in, and refuses (503) a vocabulary that lacks one.

This module sits below the services (it imports nothing of ours); the family packages sit above them (they import
the part types), and the services reach a family's parts only by name, through `Family.part`. The package's
`__init__.py` holds only its `FAMILY` descriptor (plain data from this module), so looking a family up imports
nothing heavy. Adding a family is one package plus one line in `REGISTERED`.

Keys, as the field's loaders use them: Hugging Face config.json `model_type` (also `text_config.model_type` of a
multimodal checkpoint) and `architectures`, as vLLM's and mini-sglang's model registries key on them; GGUF
`general.architecture`, as llama.cpp's `llm_arch_from_string` does. A name no family claims is an
`UnknownFamilyError` naming what is supported, never a silent fallback to another family's formats.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable, Mapping
from typing import Literal, TypeVar

Part = Literal["worker", "tokenizer", "gateway"]
T = TypeVar("T")

REGISTERED: tuple[str, ...] = (
    "families.gemma3",
    "families.gemma4",
)
"""The family packages, one line each; each package's `__init__` defines `FAMILY`."""


class UnknownFamilyError(ValueError):
    """A checkpoint (or a backend's `Info`) names a model family no registered package serves."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family's identity and where its parts live.

    Attributes:
      name: the family's name, as the worker's and tokenizer's `Info` report it ("gemma3").
      package: the import path of the family's package ("families.gemma3").
      hf_model_types: config.json `model_type` values (top level or `text_config`) this family serves.
      hf_architectures: config.json `architectures` entries this family serves.
      gguf_architectures: GGUF `general.architecture` values this family serves.
    """

    name: str
    package: str
    hf_model_types: frozenset[str] = frozenset()
    hf_architectures: frozenset[str] = frozenset()
    gguf_architectures: frozenset[str] = frozenset()

    def part(self, part: Part, kind: type[T]) -> T:
        """The `PART` of the family's `worker`, `tokenizer` or `gateway` module, imported on first use (the worker
        part imports JAX; the others never do), checked to be a `kind` (the part type the calling service
        declares).

        Raises:
          TypeError: the module's `PART` is missing or not a `kind` (the message names the module).
        """
        module = importlib.import_module(f"{self.package}.{part}")
        value = getattr(module, "PART", None)
        if not isinstance(value, kind):
            raise TypeError(f"{module.__name__}.PART must be a {kind.__module__}.{kind.__qualname__}, "
                            f"not {type(value).__name__}")
        return value


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order (imports only the packages' descriptors)."""
    return tuple(importlib.import_module(p).FAMILY for p in REGISTERED)


def _supported(keys: Iterable[str]) -> str:
    return ", ".join(sorted(keys)) or "none"


def by_name(name: str) -> Family:
    """The family called `name` (as `Info` reports it).

    Raises:
      UnknownFamilyError: no registered family has that name; the message lists the supported ones.
    """
    for family in families():
        if family.name == name:
            return family
    raise UnknownFamilyError(
        f"unknown model family {name!r}; supported families: {_supported(f.name for f in families())}")


def from_hf_config(config: Mapping) -> Family:
    """The family serving a Hugging Face config.json: matched by `model_type` (top level, then `text_config`),
    else by an `architectures` entry.

    Raises:
      UnknownFamilyError: nothing matches; the message names the config's model_type and architectures and lists
        every supported model_type.
    """
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    types = [t for t in (config.get("model_type"), text.get("model_type")) if isinstance(t, str)]
    archs = [a for a in (config.get("architectures") or []) if isinstance(a, str)]
    for family in families():
        if any(t in family.hf_model_types for t in types) or any(a in family.hf_architectures for a in archs):
            return family
    supported = _supported(t for f in families() for t in f.hf_model_types)
    raise UnknownFamilyError(
        f"unsupported model: config.json has model_type {types[0] if types else None!r} and architectures "
        f"{archs}; supported model_type values: {supported}")


def from_gguf(meta: Mapping) -> Family:
    """The family serving a GGUF file, by its `general.architecture` metadata.

    Raises:
      UnknownFamilyError: no family serves that architecture; the message lists the supported ones.
    """
    arch = meta.get("general.architecture")
    for family in families():
        if arch in family.gguf_architectures:
            return family
    supported = _supported(a for f in families() for a in f.gguf_architectures)
    raise UnknownFamilyError(
        f"unsupported GGUF: general.architecture is {arch!r}; supported architectures: {supported}")
