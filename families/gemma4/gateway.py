"""Gemma 4's gateway part: its native tool-call format (grammar and incremental parser) and its thought channel,
as the `PART` the gateway uses (gateway/core/tool_format.py; interface in common/families.py).

Tool calls (native format, docs/formats.md §4.2-4.4)
----------------------------------------------------
The model writes calls in its trained syntax, then stops on `<|tool_response>`::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|><|tool_response>

`<|tool_call>`, `<tool_call|>`, `<|tool_response>`, the string delimiter `<|"|>` and the end of turn `<turn|>` are
control tokens (ids 48, 49, 50, 52 and 106 in the published vocabulary; the gateway passes the served
vocabulary's as `ids`): the grammar references them by id (`<[48]>`), so they are matched as tokens and never as
text, and no text in the grammar (call names, keys, strings, free text) can contain a control token. Arguments are
the tool's `parameters` schema written in Gemma syntax (gateway/structured/tools/tool_schema.py builds the rules):

- objects `{key:value,...}` with bare keys, **in the chat template's order** (keys sorted case-insensitively,
  Jinja `dictsort`): the order Gemma 4's template writes calls in, so the model sees its own calls in history exactly
  as the template renders them. Required properties are mandatory, optional ones optional; no other keys.
- strings `<|"|>raw text<|"|>` (no escapes: the text is everything between the delimiters);
- numbers as Python prints them (what the template writes for a JSON number, so generated calls re-render
  exactly): integers `0|-?[1-9][0-9]*`; other numbers in fixed notation with at most 15 significant digits and
  `1e-4 <= |x| < 1e15` (`3.5`, `-0.25`, `100.0`); no exponents, no `1.50`, no `-0`;
- `true`, `false`, `null`, arrays `[v,...]`, nested objects.

Grammars per tool_choice (CALL_i = `<[48]> "call:NAME_i" ARGS_i <[49]>`; CALLS = 1 to max_calls of
`(CALL_0|CALL_1|...)`, exactly one call when `parallel` is false):

- `"none"` (or no tools): None; the gateway bans `<|tool_call>` and `<tool_call|>` (`PART.call_markers`).
- `"auto"`: `start: TEXT? <[106]> | TEXT? CALLS <[50]>` - an answer, or optional text then calls (Gemma 4's
  template renders such leading text after the tool results when the message comes back in history); the lazy
  trigger (gateway/structured/tools/tool_calls.py) is the `<|tool_call>` token.
- `"required"`: `start: CALLS <[50]>`.
- named `{"type": "function", "function": {"name": X}}`: `start: CALL_X <[50]>` — exactly one call.

The parser converts the arguments to JSON text as they arrive (keys -> `"key"`, Gemma strings -> JSON strings
with quotes, backslashes and control characters escaped, numbers/literals as they are) and streams them.

Thinking
--------
Gemma 4 writes its reasoning in a channel before the answer (docs/formats.md §4.3 point 5): `<|channel>`, the
label `thought\n`, the reasoning, `<channel|>`, then the answer (gateway/generation/reasoning.py routes it); the
template turns it on with `enable_thinking`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gateway.core.tool_format import FamilyFormat, ParsedOutput, ReasoningFormat
from gateway.generation.tool_parsers import OpenCall, TokenParser, parse_marked
from gateway.structured.tools.tool_calls import (
    MAX_PARALLEL_CALLS,
    ToolCallParseError,
    cached_grammar,
    callable_tools,
    checked_grammar,
)
from gateway.structured.tools.tool_schema import SchemaRules, ValueGrammar

# Control tokens, by spelling (docs/formats.md §4.2).
TOOL_CALL = "<|tool_call>"
TOOL_CALL_END = "<tool_call|>"
TOOL_RESPONSE = "<|tool_response>"
STRING = '<|"|>'
TURN_END = "<turn|>"
EOS = "<eos>"
CHANNEL_OPEN = "<|channel>"
CHANNEL_CLOSE = "<channel|>"

PUBLISHED_IDS: Mapping[str, int] = {
    EOS: 1, TOOL_CALL: 48, TOOL_CALL_END: 49, TOOL_RESPONSE: 50, STRING: 52, CHANNEL_OPEN: 100, CHANNEL_CLOSE: 101,
    TURN_END: 106,
}
"""The ids of the published Gemma 4 vocabulary (identical across sizes): `PART.published_ids`, and what
`parse_gemma4_tool_calls` reads spelled-out text with. The grammar and parser take the ids they use as an
argument (the gateway passes the served vocabulary's)."""

CALL_MARKERS = (TOOL_CALL, TOOL_CALL_END)
"""Banned under tool_choice "none" and inside a thought (there is no grammar then)."""
GEMMA4_NONE_BANNED_IDS = tuple(PUBLISHED_IDS[s] for s in CALL_MARKERS)
"""The call markers' published ids."""
END_TOKENS = (TOOL_RESPONSE, TURN_END)
"""What a tool grammar ends with: the stop ids of a request with calls."""
_GRAMMAR_TOKENS = (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, STRING, TURN_END)


def gemma4_tool_grammar(tools: list[dict], tool_choice: Any = "auto", parallel: bool = True,
                        max_calls: int = MAX_PARALLEL_CALLS, *, ids: Mapping[str, int]) -> str | None:
    """The llguidance Lark grammar of a Gemma 4 answer under `tool_choice` (see the module docstring), or None
    for "none" (then the gateway bans `CALL_MARKERS`). At most `max_calls` calls (1..MAX_PARALLEL_CALLS; 1 without
    `parallel`): a budget-aware ending lowers it (gateway/structured/budget.py). Control tokens are referenced by their
    ids in `ids` (spelling -> id; required: the vocabulary served, or `PUBLISHED_IDS` for the published one). Cached
    by a hash of the arguments.

    Raises:
      ToolSchemaError: a tool or its schema cannot be enforced (the error names the keyword and path).
      ToolChoiceError: tool_choice is malformed or names an unknown tool.
      gateway.core.tool_format.UnknownTokenError: `ids` lacks one of the grammar's control tokens.
    """
    used = {s: ids[s] for s in _GRAMMAR_TOKENS}
    return cached_grammar("gemma4", used, tools, tool_choice, parallel, max_calls,
                          lambda: _build(tools, tool_choice, parallel, max_calls, used))


def _build(tools: list[dict], tool_choice: Any, parallel: bool, max_calls: int, ids: dict[str, int]) -> str | None:
    mode, callable_fns = callable_tools(tools, tool_choice)
    if mode == "none":
        return None
    parallel = parallel and mode != "named"
    g = ValueGrammar(ids[STRING])
    calls = []
    for i, fn in callable_fns:
        args = SchemaRules(g, fn["name"], fn.get("parameters") or {}, f"t{i}_").parameters()
        call = f"call_{i}"
        g.rules[call] = f'<[{ids[TOOL_CALL]}]> {json.dumps("call:" + fn["name"])} {args} <[{ids[TOOL_CALL_END]}]>'
        calls.append(call)
    one = calls[0] if len(calls) == 1 else "(" + " | ".join(calls) + ")"
    many = f"{one}{{1,{max_calls}}}" if parallel and max_calls > 1 else one
    if mode == "auto":
        start = (f"start: TEXT? <[{ids[TURN_END]}]> | TEXT? {many} <[{ids[TOOL_RESPONSE]}]>\n"
                 "TEXT: /(?s:.+)/\n")
    else:
        start = f"start: {many} <[{ids[TOOL_RESPONSE]}]>\n"
    return checked_grammar(start + g.text(), [fn for _, fn in callable_fns])


_SCALAR = re.compile(r"^(?:-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null)$")


class Gemma4ToolCallParser(TokenParser):
    """Incremental parser of a Gemma 4 answer: free text and `<|tool_call>call:NAME{...}<tool_call|>` calls.

    Feed every generated token in order with `feed(token_id, text)` (text as str, or the token's bytes; control
    tokens are recognised by id, their text is ignored). Each call returns the OpenAI `delta`s produced by that
    token: `{"content": text}`, a call's first delta `{"tool_calls": [{"index", "id", "type": "function",
    "function": {"name", "arguments": ""}}]}` (once its name is complete) and then argument fragments
    `{"tool_calls": [{"index", "function": {"arguments": fragment}}]}` as the arguments arrive, converted to
    JSON. `finish()` flushes; `result()` gives the whole answer. Control tokens other than the tool and turn
    markers are dropped from content (pass the vocabulary's control ids as `control_ids`). `ids` (required):
    the control tokens' ids (spelling -> id), as `TokenParser` takes them.
    """

    SPELLINGS = (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, STRING, TURN_END, EOS)

    def __init__(self, id_prefix: str = "call_", control_ids: Iterable[int] | None = None, *,
                 ids: Mapping[str, int]):
        super().__init__(id_prefix, control_ids, ids=ids)
        self._open_id, self._close_id, self._string_id = (self.ids[s] for s in (TOOL_CALL, TOOL_CALL_END, STRING))
        self._end_ids = {self.ids[s] for s in (TOOL_RESPONSE, TURN_END, EOS)}
        self._state = "text"  # text | name | args | closed (args done, waiting for <tool_call|>) | done
        self._name = ""
        self._call: OpenCall | None = None
        self._stack: list[dict] = []
        self._in_string = False
        self._scalar: str | None = None

    def _truncated(self) -> bool:
        return self._state in ("name", "args", "closed")

    def _in_call(self) -> bool:
        return self._truncated()

    # -- tokens

    def _special(self, tid: int) -> None:
        if self._state == "done":
            return
        if tid == self._open_id:
            if self._state != "text":
                raise ToolCallParseError("<|tool_call> inside a tool call")
            self._state, self._name = "name", ""
        elif tid == self._close_id:
            if self._state != "closed":
                raise ToolCallParseError("<tool_call|> before the call's arguments were complete")
            self._call.complete = True
            self._state, self._call = "text", None
        elif tid == self._string_id and self._state == "args":
            self._string_delimiter()
        elif tid in self._end_ids:
            if self._state != "text":
                raise ToolCallParseError("the answer ended inside a tool call")
            self._state = "done"
        elif self._state != "text":
            raise ToolCallParseError(f"control token {tid} inside a tool call")

    def _chars_in(self, chars: str) -> None:
        for ch in chars:
            if self._state in ("text", "done"):
                if self._state == "text":
                    self._out.text(ch)
            elif self._state == "name":
                self._name_char(ch)
            elif self._state == "args":
                self._arg_char(ch)
            elif not ch.isspace():
                raise ToolCallParseError(f"text {ch!r} after a call's arguments")

    def _name_char(self, ch: str) -> None:
        if ch != "{":
            self._name += ch
            return
        name = self._name.strip()
        if not name.startswith("call:") or not name[5:]:
            raise ToolCallParseError(f"expected call:NAME{{, got {name!r}")
        self._call = self._out.open(name[5:])
        self._state = "args"
        self._stack = [{"kind": "obj", "expect": "key", "key": "", "first": True}]
        self._out.args(self._call, "{")

    # -- arguments

    def _emit(self, text: str) -> None:
        self._out.args(self._call, text)

    def _string_delimiter(self) -> None:
        if self._in_string:
            self._in_string = False
            self._emit('"')
            self._value_done()
            return
        frame = self._stack[-1]
        if self._scalar is not None or frame["expect"] != "value":
            raise ToolCallParseError("a string where a key, comma or bracket was expected")
        self._in_string = True
        self._emit('"')

    def _arg_char(self, ch: str) -> None:
        if self._in_string:
            self._emit(json.dumps(ch, ensure_ascii=False)[1:-1])
            return
        if self._scalar is not None:
            if ch not in ",}]" and not ch.isspace():
                self._scalar += ch
                return
            self._end_scalar()
        if ch.isspace():
            return
        frame = self._stack[-1]
        expect = frame["expect"]
        if frame["kind"] == "obj" and expect in ("key", "key_more"):
            if ch == "}" and expect == "key" and frame["first"]:
                self._close("}")
            elif ch == ":" and expect == "key_more":
                self._emit(json.dumps(frame["key"], ensure_ascii=False) + ":")
                frame["expect"], frame["key"] = "value", ""
            elif ch in ':,{}[]':
                raise ToolCallParseError(f"unexpected {ch!r} in a key")
            else:
                frame["key"] += ch
                frame["expect"] = "key_more"
        elif expect == "value":
            if ch == "]" and frame["kind"] == "arr" and frame["first"]:
                self._close("]")
            elif ch == "{":
                frame["first"] = False
                self._stack.append({"kind": "obj", "expect": "key", "key": "", "first": True})
                self._emit("{")
            elif ch == "[":
                frame["first"] = False
                self._stack.append({"kind": "arr", "expect": "value", "first": True})
                self._emit("[")
            elif ch in "-0123456789tfn":
                frame["first"] = False
                self._scalar = ch
            else:
                raise ToolCallParseError(f"unexpected {ch!r} where a value was expected")
        elif expect == "comma":
            if ch == ",":
                frame["expect"], frame["first"] = ("key" if frame["kind"] == "obj" else "value"), False
                self._emit(",")
            elif ch == ("}" if frame["kind"] == "obj" else "]"):
                self._close(ch)
            else:
                raise ToolCallParseError(f"unexpected {ch!r} after a value")

    def _end_scalar(self) -> None:
        scalar, self._scalar = self._scalar, None
        if not _SCALAR.match(scalar):
            raise ToolCallParseError(f"{scalar!r} is not a number, true, false or null")
        self._emit(scalar)
        self._value_done()

    def _value_done(self) -> None:
        self._stack[-1]["expect"] = "comma"
        self._stack[-1]["first"] = False

    def _close(self, ch: str) -> None:
        self._stack.pop()
        self._emit(ch)
        if self._stack:
            self._value_done()
        else:
            self._state = "closed"
            try:
                json.loads("".join(self._call.fragments))
            except json.JSONDecodeError as err:  # pragma: no cover - the scanner only emits valid JSON
                raise ToolCallParseError(f"call arguments are not valid JSON ({err})") from None


def parse_gemma4_tool_calls(text: str, id_prefix: str = "call_") -> ParsedOutput:
    """Parse a whole Gemma 4 answer written with its control tokens spelled out (`<|tool_call>`, `<|"|>`,
    ...), read as the published vocabulary's tokens (`PUBLISHED_IDS`).

    Raises:
      ToolCallParseError: malformed call syntax.
    """
    return parse_marked(text, Gemma4ToolCallParser(id_prefix, ids=PUBLISHED_IDS))


def _parser(ids: Mapping[str, int], id_prefix: str = "call_", control_ids: Iterable[int] = (),
            calls_only: bool = False) -> Gemma4ToolCallParser:
    """`PART.tool_parser`: every answer is parsed the same way (text before calls is content either way)."""
    return Gemma4ToolCallParser(id_prefix, control_ids, ids=ids)


def _budget_close(tokenize: Callable[[str], list[int]]) -> int:
    """`<tool_call|>` ends the last call; the grammar then forces `<|tool_response>`: one token to close."""
    return 1


PART = FamilyFormat(
    name="gemma4",
    tool_grammar=gemma4_tool_grammar,
    tool_parser=_parser,
    end_tokens=END_TOKENS,
    call_markers=CALL_MARKERS,
    budget_close=_budget_close,
    reasoning=ReasoningFormat(CHANNEL_OPEN, CHANNEL_CLOSE, label="thought\n"),
    thinking=True,
    published_ids=PUBLISHED_IDS,
)
"""Gemma 4's output formats for the gateway."""
