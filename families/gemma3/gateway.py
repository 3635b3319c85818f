"""Gemma 3's gateway part: this project's JSON tool-call format (grammar and incremental parser), as the `PART`
the gateway uses (gateway/core/tool_format.py; interface in common/families.py). Gemma 3 has no thought channel and
no thinking mode.

Tool calls: this project's JSON format (Gemma 3 has no native one)
-----------------------------------------------------------------
Gemma 3 was not trained on tools, so the built-in Gemma 3 template (families/gemma3/tokenizer.py) and these
grammars define a plain-text JSON convention:

1. **Declarations.** When a request has tools, the first user turn starts (after the system text and its blank
   line, if any) with::

       You can call these tools. Each line is one tool's name, description and JSON Schema parameters:
       {"name": "get_weather", "description": "Get the weather.", "parameters": {...}}
       ...

       To call tools, answer with only a JSON object of this form and nothing else:
       {"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}
       List several calls to run them in parallel. Otherwise answer normally. Tool results come back in the next
       user turn.

   followed by a blank line and the user's text. Under `tool_choice: "none"` the tools are still described, as
   OpenAI does, but nothing invites a call (the instructions and their `{"tool_calls"` example are left out, so
   the model has no call syntax to copy into its text)::

       These tools exist but cannot be called in this answer. Each line is one tool's name, description and JSON Schema
       parameters: {"name": "get_weather", "description": "Get the weather.", "parameters": {...}}
       ...

   The gateway passes the resolved mode to the template (`ChatTemplateRequest.tool_choice`).
2. **Calls.** The whole model answer is exactly
   `{"tool_calls": [{"name": "NAME", "arguments": ARGS}, {"name": ..., "arguments": ...}]}` (separators `", "` and
   `": "`, no other whitespace outside ARGS) followed by `<end_of_turn>`. ARGS is a JSON object valid against the
   tool's schema, written with `", "` / `": "` separators and properties in the schema's order. With
   `tool_choice: "auto"` the answer is text, optionally followed by that object (see "Lazy trigger" below).
3. **History.** An assistant message with `tool_calls` renders as that same JSON object, each call's `arguments`
   string inserted verbatim (so an answer sent back unchanged re-renders exactly as generated); text content, if
   any, comes first, followed by a blank line.
4. **Results.** Gemma 3 has no tool role. The `tool` messages answering a call message form one user turn, one
   block per result, blocks separated by a blank line::

       Tool result for get_weather (call_0):
       {"temp": 20}

   (`(id)` is left out when the message has no `tool_call_id`; the name comes from the matching call, else the
   message's `name`.) A user message right after tool results joins that same user turn after a blank line, so
   turns keep alternating user/model.

Grammars per tool_choice (CALLS_JSON = the object of point 2; `<[106]>` = `<end_of_turn>`, by the id the served
vocabulary gives it): `"none"` -> None (no call markers to ban: the call is text); `"auto"` ->
`start: TEXT <[106]> | head CALLS_REST <[106]>` with `head[lazy]: TEXT "{\"tool_calls\""`, the lazy trigger
(gateway/structured/tools/tool_calls.py) being the text `GEMMA3_CALL_TRIGGER`, so a `{"tool_calls"` written as an
example in an answer is the start of a call and must be completed as one; `"required"` -> `start: CALLS_JSON <[106]>`;
named -> the same with exactly one call of tool X. Arguments are constrained by llguidance's JSON Schema support
(`%json`), after the same schema checks as Gemma 4's (gateway/structured/tools/tool_schema.check_parameters).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gateway.core.tool_format import FamilyFormat, ParsedOutput
from gateway.generation.tool_parsers import TokenParser, parse_marked
from gateway.structured.json_schema import FORMAT_REGEXES, format_as_pattern, rewrite
from gateway.structured.tools.tool_calls import (
    MAX_PARALLEL_CALLS,
    TOOL_SUBSCHEMA_KEYWORDS,
    ToolCallParseError,
    cached_grammar,
    callable_tools,
    checked_grammar,
    escaped_at,
    validation_schema,
)
from gateway.structured.tools.tool_schema import check_parameters

# Control tokens, by spelling (docs/formats.md §4.1).
END_OF_TURN = "<end_of_turn>"
EOS = "<eos>"
PUBLISHED_IDS: Mapping[str, int] = {EOS: 1, END_OF_TURN: 106}
"""The ids of the published Gemma 3 vocabulary: `PART.published_ids`, and what `parse_gemma3_tool_calls`
reads spelled-out text with. The grammar and parser take the ids they use as an argument (the gateway passes
the served vocabulary's)."""

# The call JSON (the template in families/gemma3/tokenizer.py writes the same text).
GEMMA3_CALLS_OPEN = '{"tool_calls": ['
GEMMA3_CALLS_CLOSE = "]}"
GEMMA3_CALL_TRIGGER = '{"tool_calls"'
"""The text that starts a Gemma 3 call object in an `auto` answer (a prefix of GEMMA3_CALLS_OPEN)."""
GEMMA3_CALL_SEPARATOR = ", "
GEMMA3_ARGS_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                       "coerce_one_of": True}  # oneOf alternatives are checked to be disjoint first


def gemma3_call_open(name: str) -> str:
    """The text of one Gemma 3 call before its arguments."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def gemma3_tool_grammar(tools: list[dict], tool_choice: Any = "auto", parallel: bool = True,
                        max_calls: int = MAX_PARALLEL_CALLS, *, ids: Mapping[str, int]) -> str | None:
    """The llguidance Lark grammar of a Gemma 3 answer in this project's JSON tool format (module docstring), or
    None for "none". Schemas are checked exactly as for Gemma 4 (same supported keywords). At most `max_calls`
    calls (1..MAX_PARALLEL_CALLS; 1 without `parallel`). `<end_of_turn>` is referenced by its id in `ids`
    (spelling -> id; required: the vocabulary served, or `PUBLISHED_IDS` for the published one). Cached by a
    hash of the arguments.

    Raises:
      ToolSchemaError: a tool or its schema cannot be enforced.
      ToolChoiceError: tool_choice is malformed or names an unknown tool.
      gateway.core.tool_format.UnknownTokenError: `ids` lacks `<end_of_turn>`.
    """
    used = {END_OF_TURN: ids[END_OF_TURN]}
    return cached_grammar("gemma3", used, tools, tool_choice, parallel, max_calls,
                          lambda: _build(tools, tool_choice, parallel, max_calls, used[END_OF_TURN]))


def _build(tools: list[dict], tool_choice: Any, parallel: bool, max_calls: int, end_id: int) -> str | None:
    mode, callable_fns = callable_tools(tools, tool_choice)
    if mode == "none":
        return None
    parallel = parallel and mode != "named"
    lines, calls = [], []
    for i, fn in callable_fns:
        params = fn.get("parameters") or {}
        check_parameters(fn["name"], params)  # the same checks as Gemma 4
        schema = _gemma3_schema(validation_schema(params)) if params else {"type": "object", "properties": {},
                                                                      "additionalProperties": False}
        schema = {**schema, "x-guidance": GEMMA3_ARGS_OPTIONS}
        lines.append(f"call_{i}: {json.dumps(gemma3_call_open(fn['name']))} args_{i} \"}}\"")
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
        calls.append(f"call_{i}")
    one = calls[0] if len(calls) == 1 else "(" + " | ".join(calls) + ")"
    rest = f"{{0,{max_calls - 1}}}"
    many = f'{one} ({json.dumps(GEMMA3_CALL_SEPARATOR)} {one}){rest}' if parallel and max_calls > 1 else one
    after_trigger = json.dumps(GEMMA3_CALLS_OPEN[len(GEMMA3_CALL_TRIGGER):])
    rest_rule = f"calls_rest: {after_trigger} {many} {json.dumps(GEMMA3_CALLS_CLOSE)}\n"
    end = f"<[{end_id}]>"
    if mode == "auto":  # the lazy trigger (module docstring)
        start = (f"start: TEXT {end} | head calls_rest {end}\nTEXT: /(?s:.*)/\n"
                 f"head[lazy]: TEXT {json.dumps(GEMMA3_CALL_TRIGGER)}\n")
    else:
        start = f"start: {json.dumps(GEMMA3_CALL_TRIGGER)} calls_rest {end}\n"
    return checked_grammar(start + rest_rule + "\n".join(lines) + "\n", [fn for _, fn in callable_fns])


def _gemma3_schema(schema: Any) -> Any:
    """`schema` as llguidance's JSON compiler gets it for Gemma 3, so that both formats produce the same values:
    `additionalProperties: false` on every object with a `properties` keyword (such objects get exactly their
    declared keys; extra keys would be valid, but are never produced), and each `format` replaced by the same
    regex the Gemma 4 grammar uses (`json_schema.format_as_pattern`)."""
    return rewrite(schema, _gemma3_node, TOOL_SUBSCHEMA_KEYWORDS)


def _gemma3_node(schema: dict, out: dict, parent: str | None) -> dict:
    """One node of `_gemma3_schema` (`out`: its copy, subschemas done): closed; `format` made a pattern."""
    fmt = out.pop("format", None)
    if "properties" in out:
        out["additionalProperties"] = False
    if fmt in FORMAT_REGEXES:
        format_as_pattern(out, fmt, grouped=True)
    return out


class Gemma3ToolCallParser(TokenParser):
    """Incremental parser of a Gemma 3 answer in this project's JSON tool format (module docstring), with the
    same interface and deltas as Gemma 4's parser (`TokenParser`; `ids` as it takes them). Text is content until
    the call trigger (`GEMMA3_CALL_TRIGGER`, `{"tool_calls"`) appears anywhere in it — the lazy trigger of
    `tool_choice: "auto"`;
    text that could still be the start of the trigger is held back (at most its length minus one characters)
    until it is decided. From the trigger on the text is the calls object. Argument fragments are the generated
    JSON text, verbatim.
    """

    SPELLINGS = (END_OF_TURN, EOS)

    def __init__(self, id_prefix: str = "call_", control_ids: Iterable[int] | None = None, *,
                 ids: Mapping[str, int]):
        super().__init__(id_prefix, control_ids, ids=ids)
        self._end_ids = set(self.ids.values())
        self._state = "text"  # text | json | after | done
        self._held = ""  # content that may be the start of the call trigger
        self._stack: list[dict] = []  # frames: {"kind": obj|arr, "expect", "key", "index"}
        self._string: str | None = None  # raw text of a string being read (wrapper level)
        self._capture: dict | None = None  # arguments being copied: depth, in_string, escape
        self._call: dict | None = None  # {"name", "open": _Call | None, "args": bool}

    def _special(self, token_id: int) -> None:
        self._end()
        if token_id in self._end_ids and self._state != "done":
            if self._state == "json":
                raise ToolCallParseError("the answer ended inside the tool-calls object")
            self._state = "done"
        elif self._state == "json":
            raise ToolCallParseError(f"control token {token_id} inside the tool-calls object")

    def _truncated(self) -> bool:
        return self._state == "json"

    def _in_call(self) -> bool:
        return self._call is not None

    # -- characters

    def calls_only(self) -> None:
        """The answer is only the calls object (tool_choice required or named): it is call syntax from its first
        character, so an answer cut inside the trigger is a cut call, not content."""
        self._state = "json"

    def _end(self) -> None:
        held, self._held = self._held, ""
        self._out.text(held)

    def _chars_in(self, chars: str) -> None:
        for ch in chars:
            if self._state == "text":
                self._text_char(ch)
            elif self._state == "json":
                self._json_char(ch)
            elif self._state == "after" and not ch.isspace():
                raise ToolCallParseError(f"text {ch!r} after the tool-calls object")

    def _text_char(self, ch: str) -> None:
        """Content, except the longest tail that is still a prefix of the trigger; the whole trigger starts the
        calls object."""
        held = self._held + ch
        if held == GEMMA3_CALL_TRIGGER:
            self._held, self._state = "", "json"
            for c in held:
                self._json_char(c)
            return
        keep = next(k for k in range(len(held) + 1) if GEMMA3_CALL_TRIGGER.startswith(held[k:]))
        self._out.text(held[:keep])
        self._held = held[keep:]

    def _path(self) -> tuple:
        return tuple(f["key"] if f["kind"] == "obj" else f["index"] for f in self._stack)

    def _json_char(self, ch: str) -> None:
        if self._capture is not None:
            self._capture_char(ch)
            return
        if self._string is not None:
            self._string += ch
            if ch == '"' and not escaped_at(self._string, len(self._string) - 1):
                self._string_done(json.loads(self._string))
            return
        if ch.isspace():
            return
        frame = self._stack[-1] if self._stack else None
        expect = frame["expect"] if frame else "value"
        if expect == "key":
            if ch == '"':
                self._string = '"'
            elif ch == "}" and frame["first"]:
                self._close()
            else:
                raise ToolCallParseError(f"unexpected {ch!r} where a key was expected")
        elif expect == "colon":
            if ch != ":":
                raise ToolCallParseError(f"unexpected {ch!r} where ':' was expected")
            frame["expect"] = "value"
        elif expect == "value":
            self._value_start(ch)
        elif expect == "comma":
            if ch == ",":
                frame["first"] = False
                if frame["kind"] == "obj":
                    frame["expect"] = "key"
                else:
                    frame["expect"], frame["index"] = "value", frame["index"] + 1
            elif ch == ("}" if frame["kind"] == "obj" else "]"):
                self._close()
            else:
                raise ToolCallParseError(f"unexpected {ch!r} after a value")

    def _value_start(self, ch: str) -> None:
        path = self._path()
        frame = self._stack[-1] if self._stack else None
        if frame and frame["kind"] == "arr" and ch == "]" and frame["first"]:
            self._close()
            return
        if path == () and ch == "{":
            self._stack.append({"kind": "obj", "expect": "key", "key": "", "first": True})
        elif path == ("tool_calls",) and ch == "[":
            self._stack.append({"kind": "arr", "expect": "value", "index": 0, "first": True})
        elif len(path) == 2 and ch == "{":
            self._stack.append({"kind": "obj", "expect": "key", "key": "", "first": True})
            self._call = {"name": None, "open": None}
        elif len(path) == 3 and path[2] == "name" and ch == '"':
            self._string = '"'
        elif len(path) == 3 and path[2] == "arguments" and ch == "{":
            if self._call["open"] is None:
                raise ToolCallParseError('"arguments" before "name"')
            self._capture = {"depth": 1, "in_string": False, "escape": False}
            self._out.args(self._call["open"], "{")
        else:
            raise ToolCallParseError(f"unexpected {ch!r} at {'.'.join(map(str, path)) or 'the start'}")

    def _string_done(self, value: str) -> None:
        self._string = None
        frame = self._stack[-1]
        if frame["expect"] == "key":
            allowed = {(): ("tool_calls",)}.get(self._path()[:-1], ("name", "arguments"))
            if value not in allowed:
                raise ToolCallParseError(f"unexpected key {value!r}")
            frame["key"], frame["expect"] = value, "colon"
            return
        if not isinstance(value, str) or self._call["open"] is not None:
            raise ToolCallParseError("a call's name must be one string")
        self._call["name"] = value
        self._call["open"] = self._out.open(value)
        self._value_done()

    def _capture_char(self, ch: str) -> None:
        cap = self._capture
        self._out.args(self._call["open"], ch)
        if cap["in_string"]:
            if cap["escape"]:
                cap["escape"] = False
            elif ch == "\\":
                cap["escape"] = True
            elif ch == '"':
                cap["in_string"] = False
        elif ch == '"':
            cap["in_string"] = True
        elif ch in "{[":
            cap["depth"] += 1
        elif ch in "}]":
            cap["depth"] -= 1
            if cap["depth"] == 0:
                self._capture = None
                self._call["args"] = True
                self._value_done()

    def _value_done(self) -> None:
        self._stack[-1]["expect"] = "comma"
        self._stack[-1]["first"] = False

    def _close(self) -> None:
        path = self._path()
        self._stack.pop()
        if len(path) == 3:  # a call object
            call = self._call
            if call["open"] is None or not call.get("args"):
                raise ToolCallParseError('a call needs "name" and "arguments"')
            try:
                json.loads("".join(call["open"].fragments))
            except json.JSONDecodeError as err:
                raise ToolCallParseError(f"call arguments are not valid JSON ({err})") from None
            call["open"].complete = True
            self._call = None
        if self._stack:
            self._value_done()
        else:
            self._state = "after"


def parse_gemma3_tool_calls(text: str, id_prefix: str = "call_") -> ParsedOutput:
    """Parse a whole Gemma 3 answer (JSON tool format; `<end_of_turn>`/`<eos>` spelled out end it, read as the
    published vocabulary's tokens, `PUBLISHED_IDS`).

    Raises:
      ToolCallParseError: a malformed calls object.
    """
    return parse_marked(text, Gemma3ToolCallParser(id_prefix, ids=PUBLISHED_IDS))


def _parser(ids: Mapping[str, int], id_prefix: str = "call_", control_ids: Iterable[int] = (),
            calls_only: bool = False) -> Gemma3ToolCallParser:
    """`PART.tool_parser`."""
    parser = Gemma3ToolCallParser(id_prefix, control_ids, ids=ids)
    if calls_only:
        parser.calls_only()
    return parser


def _budget_close(tokenize: Callable[[str], list[int]]) -> int:
    """`]}`, `<end_of_turn>`, and one spare token: a call's last brackets may split differently."""
    return len(tokenize(GEMMA3_CALLS_CLOSE)) + 2


PART = FamilyFormat(
    name="gemma3",
    tool_grammar=gemma3_tool_grammar,
    tool_parser=_parser,
    end_tokens=(END_OF_TURN,),
    call_markers=(),
    budget_close=_budget_close,
    reasoning=None,
    thinking=False,
    published_ids=PUBLISHED_IDS,
)
"""Gemma 3's output formats for the gateway."""
