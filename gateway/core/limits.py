"""The gateway's input limits, and the checks of client JSON that every request path shares.

Every limit bounds work or memory that a client's request would otherwise make unbounded; each has a flag on
`gemma-serve gateway` / `up` (see `add_flags`) except the structural ones below, which no valid request comes near.
Defaults follow what OpenAI documents where it documents one (128 tools, 4 stop sequences) and are generous
elsewhere, so that no request a vLLM or OpenAI client would send in practice is refused.

Client JSON (a REST body, a gRPC `*_json` field, a tool call's `arguments` text) is parsed by `parse_json`:
strict UTF-8, no NaN/Infinity, no number that overflows a float, at most `MAX_JSON_DEPTH` levels of nesting and no
lone UTF-16 surrogate in any string (such text cannot be encoded as UTF-8, so no tokenizer or protobuf accepts it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from typing import Any

import numpy as np

from gateway.core.errors import ApiError

#: Deepest nesting of objects and arrays in any client JSON (a body, a schema, tool-call arguments). Python's
#: JSON, jsonschema and the grammar builders recurse per level (a few frames each), so this keeps them far from
#: the interpreter's recursion limit; OpenAI allows 10 levels of schema nesting (20 JSON levels).
MAX_JSON_DEPTH = 64
#: Largest `response_format` schema or set of tool `parameters`, in bytes of compact JSON (OpenAI: 5,000
#: properties and 120,000 characters of names and values).
MAX_SCHEMA_BYTES = 256 << 10
#: Longest `model`, `user`, `cache_salt`, message `name` or `tool_call_id`, in characters.
MAX_NAME_CHARS = 256


#: Claude Code's per-request billing header, the first `system` text block it sends (its version and a hash that
#: changes every request): `x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;`.
DEFAULT_DROP_SYSTEM_PATTERN = r"x-anthropic-billing-header:"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request limits of the gateway (flags; see `add_flags`).

    Attributes:
      max_body_bytes: largest REST body or gRPC request message (413 / RESOURCE_EXHAUSTED beyond it).
      max_messages: most chat messages in one request.
      max_tools: most tools in one request.
      max_stop_bytes: most UTF-8 bytes of all stop strings of one request together.
      max_tokens_cap: largest `max_tokens` a request may ask for (None: only max_model_len bounds it); a request
        without max_tokens gets at most this many.
      max_connections: most open HTTP connections; a request on a connection beyond it gets an OpenAI-shaped 503.
      cors_origins: origins allowed to call the API from a browser (none by default: no CORS headers).
      share_prefix_cache_across_keys: with API keys, let every key's requests reuse KV another key computed (a
        common system prompt); off by default, because a prefix hit shows in `cached_tokens` and the time to
        first token, telling one tenant what another sent recently.
      drop_system_patterns: regular expressions (Python `re`, matched at the start of a text block) of
        Anthropic Messages `system` text blocks left out of the prompt: client metadata that changes on every
        request (Claude Code's billing header) would otherwise defeat prefix reuse.
      responses_store_bytes: most bytes of stored Responses (`store: true`) per tenant, oldest evicted first.
      responses_store_ttl: seconds a stored response stays retrievable (`previous_response_id`, GET).
      anthropic_usage: how the Messages API counts prompt tokens: "inclusive" (default, as vLLM does and as
        `count_tokens` counts: `input_tokens` is the whole prompt, `cache_read_input_tokens` the part of it whose
        KV was reused) or "exclusive" (Anthropic's own accounting: `input_tokens` only the part computed anew;
        clients that add the two, such as Claude Code's context and cost meters, then count each token once).
    """

    max_body_bytes: int = 4 << 20
    max_messages: int = 2048
    max_tools: int = 128
    max_stop_bytes: int = 1024
    max_tokens_cap: int | None = None
    max_connections: int = 512
    cors_origins: tuple[str, ...] = ()
    share_prefix_cache_across_keys: bool = False
    drop_system_patterns: tuple[str, ...] = (DEFAULT_DROP_SYSTEM_PATTERN,)
    responses_store_bytes: int = 64 << 20
    responses_store_ttl: float = 3600.0
    anthropic_usage: str = "inclusive"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Limits:
        """Limits from parsed flags (missing flags keep their defaults)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
        for name in ("cors_origins", "drop_system_patterns"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)


def add_flags(p: argparse.ArgumentParser) -> None:
    """The gateway's limit flags."""
    d = Limits()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body (REST) or message (gRPC Generate) in bytes, counted as it streams in; "
                   "beyond it 413 / RESOURCE_EXHAUSTED (default: %(default)s)")
    p.add_argument("--max-messages", type=int, default=d.max_messages,
                   help="most chat messages in one request (default: %(default)s)")
    p.add_argument("--max-tools", type=int, default=d.max_tools,
                   help="most tools in one request (default: %(default)s, as OpenAI)")
    p.add_argument("--max-stop-bytes", type=int, default=d.max_stop_bytes,
                   help="most UTF-8 bytes of a request's stop strings together (at most 4 strings) "
                   "(default: %(default)s)")
    p.add_argument("--max-tokens-cap", type=int, default=None,
                   help="largest max_tokens a request may ask for (400 beyond it); requests without max_tokens get at "
                   "most this many (default: none, only --max-model-len bounds it)")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="most open HTTP connections; a request on a connection beyond it gets an OpenAI-shaped 503 "
                   "(default: %(default)s)")
    p.add_argument("--cors-origins", nargs="*", default=[],
                   help="origins allowed to call the REST API from a browser, e.g. https://app.example.com or '*' "
                   "(default: none, no CORS headers)")
    p.add_argument("--share-prefix-cache-across-keys", action="store_true", default=None,
                   help="with API keys, let requests of different keys reuse each other's cached prompt prefixes (a "
                   "common system prompt); this reveals to each key, through cached_tokens and the time to first "
                   "token, whether another key sent a text recently (default: the cache is scoped per key)")
    p.add_argument("--drop-system-pattern", dest="drop_system_patterns", action="append", default=None,
                   metavar="REGEX",
                   help="an Anthropic Messages system text block matching this regular expression at its start is "
                   "left out of the prompt (repeatable; default: Claude Code's per-request billing header, "
                   f"{DEFAULT_DROP_SYSTEM_PATTERN!r}, which would otherwise defeat prefix reuse)")
    p.add_argument("--responses-store-bytes", type=int, default=d.responses_store_bytes,
                   help="most bytes of stored Responses (store: true) per API key (default: %(default)s)")
    p.add_argument("--anthropic-usage", choices=("inclusive", "exclusive"), default=d.anthropic_usage,
                   help="Messages API usage: inclusive = input_tokens is the whole prompt (what count_tokens returns) "
                   "and cache_read_input_tokens the reused part of it; exclusive = Anthropic's accounting, "
                   "input_tokens without the cache reads (for Claude Code's context meter) (default: %(default)s)")
    p.add_argument("--responses-store-ttl", type=float, default=d.responses_store_ttl,
                   help="seconds a stored response stays retrievable by previous_response_id (default: %(default)s)")


def limit_args(args: argparse.Namespace) -> list[str]:
    """The limit flags of `args` as a command line (the launcher passes them on to the gateway)."""
    out = []
    for flag in ("max_body_bytes", "max_messages", "max_tools", "max_stop_bytes", "max_tokens_cap", "max_connections",
                 "responses_store_bytes", "responses_store_ttl", "anthropic_usage"):
        value = getattr(args, flag, None)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    if getattr(args, "cors_origins", None):
        out += ["--cors-origins", *args.cors_origins]
    if getattr(args, "share_prefix_cache_across_keys", None):
        out.append("--share-prefix-cache-across-keys")
    for pattern in getattr(args, "drop_system_patterns", None) or []:
        out += ["--drop-system-pattern", pattern]
    return out


# ------------------------------------------------------------------------------------------------ client JSON


class JsonError(ValueError):
    """Client JSON refused by parse_json/check_json (message says why; the caller names the field).

    Attributes:
      syntax: the text is not JSON at all (as opposed to JSON we refuse: too deep, a surrogate, out of range).
      pointer: JSON pointer of the refused value ("/messages/0/content"), or "" when unknown.
    """

    def __init__(self, message: str, syntax: bool = False, pointer: str = ""):
        super().__init__(message)
        self.syntax, self.pointer = syntax, pointer

    @property
    def param(self) -> str | None:
        """The pointer as a dotted field name ("messages.0.content"), or None."""
        return ".".join(p.replace("~1", "/").replace("~0", "~") for p in self.pointer.split("/")[1:]) or None


def _no_constant(name: str):
    raise JsonError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"the number {text[:40]} is out of range")
    return value


def parse_json(data: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse client JSON strictly and check it with `check_json`.

    Raises:
      JsonError: not UTF-8, not JSON, NaN/Infinity or an overflowing number, an integer of over 4,300 digits,
        nesting deeper than `max_depth`, or a lone surrogate in a string.
    """
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as err:
            raise JsonError(f"the body is not valid UTF-8 (byte {err.start})") from None
    try:
        value = json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise JsonError(f"JSON nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as err:
        raise JsonError(f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}", syntax=True) from None
    except JsonError:
        raise
    except ValueError as err:  # int() of too many digits
        raise JsonError(f"a number is out of range: {str(err).splitlines()[0]}") from None
    check_json(value, max_depth)
    return value


def check_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk a parsed JSON value without recursion: at most `max_depth` levels, no lone surrogate in a string or
    key, no non-finite float.

    Raises:
      JsonError: naming the JSON pointer of the first problem.
    """
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        node, depth, where = stack.pop()
        if isinstance(node, str):
            _check_text(node, where)
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise JsonError(f"{_short(where)}: the number is out of range", pointer=where)
        elif isinstance(node, (dict, list)):
            if depth > max_depth:
                raise JsonError(f"JSON nested deeper than {max_depth} levels at {_short(where)}", pointer=where)
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                if isinstance(key, str):
                    _check_text(key, where)
                part = str(key).replace("~", "~0").replace("/", "~1")
                stack.append((child, depth + 1, f"{where}/{part}"))


def _short(pointer: str) -> str:
    """A JSON pointer for a message: "/" for the root, at most 80 characters."""
    return (pointer if len(pointer) <= 80 else "..." + pointer[-77:]) or "/"


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise JsonError(f"{_short(where)}: a lone UTF-16 surrogate (U+{ord(text[err.start]):04X}) is not "
                        f"text", pointer=where) from None


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """The deepest nesting of `[`/`{` in JSON-like text (outside strings), found without parsing — so it is known
    for text too deep for a parser — in linear time at C speed (two fixed regexes and a cumulative sum)."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return max(int(np.cumsum(steps).max()), 0)


def json_field(text: str, param: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a JSON text a client put in a field (tool-call `arguments`, a gRPC `*_json` field); "" -> None.

    Raises:
      ApiError: 400 naming `param`.
    """
    if not text:
        return None
    try:
        return parse_json(text, max_depth)
    except JsonError as err:
        raise ApiError(400, f"{param}: {err}", param=param) from None


def check_field(value: Any, param: str, max_bytes: int | None = None, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Check an already parsed JSON field (a schema, tools) for depth, text and size.

    Raises:
      ApiError: 400 naming `param`.
    """
    try:
        check_json(value, max_depth)
    except JsonError as err:
        raise ApiError(400, f"{param}: {err}", param=param) from None
    if max_bytes is not None:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
        if size > max_bytes:
            raise ApiError(400, f"{param} is too large ({size} bytes of JSON; at most {max_bytes})", param=param)


def utf8_len(text: str) -> int:
    """UTF-8 length of well-formed text (surrogates counted as 3 bytes, never raising)."""
    return len(text.encode("utf-8", "surrogatepass"))
