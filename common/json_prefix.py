"""JSON-object prefixes: the arguments of a tool call cut off by `max_tokens`.

An answer cut by `max_tokens` inside a call returns that call with the arguments written so far: a prefix of a
JSON object (the families' tool-call parsers, families/<name>/gateway.py: Gemma 3 arguments are the generated JSON text; Gemma 4's are its syntax
converted to JSON as it streams). Sent back, such a call is rendered as generated — left open — so the
conversation re-tokenizes as the model wrote it (docs/architecture.md, "Exact history"). Only an answer's last
call can be cut. Pure Python (the gateway checks such arguments with the same scanner before dispatch).
"""

from __future__ import annotations

import json
import re
from typing import Any

_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_JSON_NUMBER_START = re.compile(r"-|-?(?:0|[1-9][0-9]*)(?:\.|(?:\.[0-9]+)?(?:[eE][+-]?[0-9]*)?)")
_JSON_LITERALS = ("true", "false", "null")
_JSON_SCALAR_CHARS = re.compile(r"[^\s,:\[\]{}\"]*")
_JSON_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
_JSON_CUT_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")
_JSON_CUT_HIGH_SURROGATE = re.compile(r"(?<!\\)((?:\\\\)*)\\u[dD][89abAB][0-9a-fA-F]{2}$")

JsonItem = tuple[str, str, bool]
"""One lexical item of a JSON object prefix: (kind, value, complete). Kinds: "open" / "close" ("{", "[", "}",
"]"), "comma", "colon", "key" and "string" (value: the decoded text so far), "scalar" (a number or literal as
written)."""


def scan_json_prefix(text: str) -> tuple[list[JsonItem], bool]:
    """Lex `text` as a JSON object or a prefix of one (whitespace between items is dropped).

    Returns (items, complete): complete is True when the object is closed (only whitespace may follow). The last
    item of a prefix may be incomplete: a string or key cut inside (a cut escape sequence, or a high surrogate
    whose pair was cut, is left out of its value) or a scalar that is a prefix of a number or literal. Iterative,
    so nesting depth costs no recursion.

    Raises:
      ValueError: the text is no prefix of any JSON object (the message says where).
    """
    items: list[JsonItem] = []
    stack: list[list[str]] = []  # [bracket, expected]: key/key_or_close/colon/value/value_or_close/comma_or_close
    i, n, closed = 0, len(text), False
    while i < n:
        ch = text[i]
        if ch in " \t\n\r":
            i += 1
            continue
        if closed:
            raise ValueError(f"text after the closed object at character {i}")
        if not stack:
            if ch != "{":
                raise ValueError("arguments must be a JSON object")
            stack.append(["{", "key_or_close"])
            items.append(("open", "{", True))
            i += 1
            continue
        frame = stack[-1]
        expect = frame[1]
        if ch == '"' and expect in ("key", "key_or_close", "value", "value_or_close"):
            kind = "key" if expect.startswith("key") else "string"
            body = _JSON_STRING_BODY.match(text, i + 1)
            complete = body.end() < n and text[body.end()] == '"'
            raw = body.group()
            if not complete:
                cut = _JSON_CUT_ESCAPE.fullmatch(text, body.end())
                if body.end() < n and not cut:
                    raise ValueError(f"invalid character in a string at character {body.end()}")
                raw = _JSON_CUT_HIGH_SURROGATE.sub(r"\1", raw)
            items.append((kind, json.loads(f'"{raw}"'), complete))
            frame[1] = "colon" if kind == "key" else "comma_or_close"
            i = body.end() + 1 if complete else n
        elif ch in "{[" and expect in ("value", "value_or_close"):
            frame[1] = "comma_or_close"
            stack.append([ch, "key_or_close" if ch == "{" else "value_or_close"])
            items.append(("open", ch, True))
            i += 1
        elif ch in "}]" and ch == "]}"[frame[0] == "{"] and expect in ("key_or_close", "value_or_close",
                                                                      "comma_or_close"):
            stack.pop()
            items.append(("close", ch, True))
            closed = not stack
            i += 1
        elif ch == ":" and expect == "colon":
            frame[1] = "value"
            items.append(("colon", ":", True))
            i += 1
        elif ch == "," and expect == "comma_or_close":
            frame[1] = "key" if frame[0] == "{" else "value"
            items.append(("comma", ",", True))
            i += 1
        elif expect in ("value", "value_or_close"):
            end = _JSON_SCALAR_CHARS.match(text, i).end()
            word = text[i:end]
            complete = bool(_JSON_NUMBER.fullmatch(word)) or word in _JSON_LITERALS
            cut = end == n and (_JSON_NUMBER_START.fullmatch(word) or any(w.startswith(word) for w in _JSON_LITERALS))
            if not (complete or cut) or not word:
                raise ValueError(f"expected a value at character {i}")
            items.append(("scalar", word, complete))
            frame[1] = "comma_or_close"
            i = end
        else:
            raise ValueError(f"unexpected {ch!r} at character {i}")
    return items, closed


def close_json_prefix(arguments_json: str) -> dict:
    """The mapping a cut-off call's arguments had reached: a cut string keeps its text, a cut number or literal
    that is not yet one, and a key without its value, are left out; open objects and arrays are closed. For
    templates that can only render a call from a mapping (checkpoint Jinja templates).

    Raises:
      ValueError: not a JSON object prefix.
    """
    root: dict = {}
    containers: list[tuple[dict | list, list[str]]] = []  # (container, [pending key])

    def attach(value: Any) -> None:
        container, key = containers[-1]
        if isinstance(container, list):
            container.append(value)
        elif key:
            container[key.pop()] = value

    for kind, value, complete in scan_json_prefix(arguments_json)[0]:
        if kind == "open":
            new: dict | list = {} if value == "{" else []
            if containers:
                attach(new)
            containers.append((root if not containers else new, []))
        elif kind == "close":
            containers.pop()
        elif kind == "key":
            containers[-1][1][:] = [value] if complete else []
        elif kind == "string":
            attach(value)
        elif kind == "scalar" and complete:
            attach(json.loads(value))
    return root

