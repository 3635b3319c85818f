"""API keys: who may call the gateway's API, and which tenant a request belongs to.

Keys come from `--api-key` (repeatable), `--api-key-file` (one key per line; blank lines and `#` comments skipped)
and the environment variable `GEMMA_SERVE_API_KEY` (one key, or several separated by commas). With none, the API is
open, as vLLM's is without `--api-key`. With any, every `/v1/...` endpoint needs `Authorization: Bearer <key>` on REST
(401, an OpenAI-shaped error with code `invalid_api_key`, as OpenAI answers) and the metadata `authorization:
Bearer <key>` on gRPC `Generate` (UNAUTHENTICATED); `/health` and `/metrics` stay open for probes and scrapers.

A request's tenant is a digest of its key (never the key itself): it scopes the answer history, so two tenants
never share the exact token ids of earlier answers. Keys are compared through their SHA-256 digests, so the time a
check takes does not depend on how much of a wrong key matches.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
from collections.abc import Iterable

from gateway.core.errors import ApiError

ENV_VAR = "GEMMA_SERVE_API_KEY"
_CHALLENGE = {"WWW-Authenticate": "Bearer"}  # RFC 6750: a 401 names the scheme it wants


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKeys:
    """The accepted API keys (as digests). Falsy when there are none (the API is open)."""

    def __init__(self, keys: Iterable[str] = ()):
        """
        Raises:
          ValueError: for an empty key or one with whitespace or control characters (it could never be sent in an
            `Authorization` header as given) or a comma (the environment variable separates keys with commas).
        """
        self._tenants: dict[str, str] = {}
        for key in keys:
            if not key or any(c.isspace() or c == "," or ord(c) < 32 or ord(c) == 127 for c in key):
                raise ValueError("an API key must be non-empty, without whitespace, commas or control characters")
            digest = _digest(key)
            self._tenants[digest] = digest[:16]

    def __bool__(self) -> bool:
        return bool(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: dict[str, str] | None = None) -> ApiKeys:
        """The keys named by the flags of `add_flags` and the environment.

        Raises:
          ValueError: for an unreadable key file or an invalid key.
        """
        return cls(collect_keys(args, os.environ if environ is None else environ))

    def tenant(self, authorization: str | None) -> str:
        """The tenant of a request from its `Authorization` value ("" when the API is open).

        Raises:
          ApiError: 401 (code `invalid_api_key`) when keys are set and the value is missing, not a Bearer
            credential, or not one of them.
        """
        if not self._tenants:
            return ""
        if not authorization:
            raise ApiError(401, "You didn't provide an API key: send it as 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers=_CHALLENGE)
        scheme, _, token = authorization.strip().partition(" ")
        tenant = self._tenants.get(_digest(token.strip())) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key", headers=_CHALLENGE)
        return tenant


def collect_keys(args: argparse.Namespace, environ) -> list[str]:
    """Every key from `--api-key`, `--api-key-file` and `GEMMA_SERVE_API_KEY`, in that order.

    Raises:
      ValueError: when the key file cannot be read.
    """
    keys = list(getattr(args, "api_key", None) or [])
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read --api-key-file {path}: {err}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    keys += [k.strip() for k in environ.get(ENV_VAR, "").split(",") if k.strip()]
    return keys


def add_flags(p: argparse.ArgumentParser) -> None:
    """The gateway's authentication flags."""
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="an API key clients must send as 'Authorization: Bearer KEY' (repeatable; also "
                   f"--api-key-file and env {ENV_VAR}, comma-separated; default: none, the API is open)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="a file of API keys, one per line (blank lines and # comments skipped)")


def child_env(args: argparse.Namespace, environ) -> dict[str, str]:
    """The environment that hands a child gateway every key of `args` and `environ` (keys stay out of its
    command line, which other local users can read)."""
    env = dict(environ)
    keys = collect_keys(args, environ)
    if keys:
        env[ENV_VAR] = ",".join(keys)
    return env
