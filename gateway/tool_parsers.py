"""Incremental parsers of generated tool calls (the formats are documented in gateway/tool_calls.py): they turn
the generated tokens into OpenAI chat deltas as they arrive — content, a call's first delta (index, id, type,
name) once its name is complete, then argument fragments converted to JSON text — and the whole answer
(`ParsedOutput`). Control tokens are recognised by id, never by their text.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable

from gateway.detokenizer import Utf8Decoder
from gateway.tool_calls import (
    GEMMA3_CALL_TRIGGER,
    GEMMA3_CONTROL_IDS,
    GEMMA3_END_OF_TURN,
    GEMMA3_EOS,
    GEMMA4_CONTROL_IDS,
    GEMMA4_EOS,
    GEMMA4_STRING,
    GEMMA4_TOOL_CALL,
    GEMMA4_TOOL_CALL_END,
    GEMMA4_TOOL_RESPONSE,
    GEMMA4_TURN_END,
    ParsedOutput,
    ToolCall,
    ToolCallParseError,
    escaped_at,
)



@dataclasses.dataclass
class _Call:
    index: int
    id: str
    name: str
    fragments: list[str] = dataclasses.field(default_factory=list)
    complete: bool = False


class _Deltas:
    """Output bookkeeping shared by both parsers: content, calls, and the OpenAI deltas of the current step."""

    def __init__(self, id_prefix: str):
        self.id_prefix = id_prefix
        self.content: list[str] = []
        self.calls: list[_Call] = []
        self.pending: list[tuple] = []

    def text(self, text: str) -> None:
        if text:
            self.content.append(text)
            self.pending.append(("content", text))

    def open(self, name: str) -> _Call:
        call = _Call(len(self.calls), f"{self.id_prefix}{len(self.calls)}", name)
        self.calls.append(call)
        self.pending.append(("header", call))
        return call

    def args(self, call: _Call, fragment: str) -> None:
        if fragment:
            call.fragments.append(fragment)
            self.pending.append(("args", call, fragment))

    def take(self) -> list[dict]:
        """The deltas since the last take: adjacent content and same-call argument pieces merged."""
        out: list[dict] = []
        last: tuple | None = None
        for item in self.pending:
            if item[0] == "content":
                if last and last[0] == "content":
                    out[-1]["content"] += item[1]
                else:
                    out.append({"content": item[1]})
            elif item[0] == "header":
                call = item[1]
                out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            else:
                call, fragment = item[1], item[2]
                if last and last[0] == "args" and last[1] is call:
                    out[-1]["tool_calls"][0]["function"]["arguments"] += fragment
                else:
                    out.append({"tool_calls": [{"index": call.index, "function": {"arguments": fragment}}]})
            last = item
        self.pending = []
        return out

    def result(self, truncated: bool) -> ParsedOutput:
        calls = [ToolCall(c.id, c.name, "".join(c.fragments)) for c in self.calls if c.complete]
        return ParsedOutput("".join(self.content), calls, truncated)


class _TokenText:
    """Token text -> characters: str as is; bytes decoded incrementally (a character split across tokens comes
    out whole with the token that completes it; gateway/detokenizer.py `Utf8Decoder`)."""

    def __init__(self):
        self._decoder = Utf8Decoder()

    def chars(self, text: str | bytes) -> str:
        return text if isinstance(text, str) else self._decoder.decode(text)

    def flush(self) -> str:
        """A boundary (a control token, the end of generation): an incomplete character held so far is dropped,
        never turned into U+FFFD (its bytes were cut by the boundary, not written invalid)."""
        return self._decoder.flush()


_SCALAR = re.compile(r"^(?:-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null)$")


class _TokenParser:
    """What both parsers share: output bookkeeping, incremental UTF-8, control ids, and feed/finish/result.
    Subclasses define `_special(token_id)` (a control token), `_chars_in(chars)` (text) and `_truncated()`."""

    BASE_CONTROL_IDS: frozenset[int] = frozenset()

    def __init__(self, id_prefix: str = "call_", control_ids: Iterable[int] | None = None):
        self._out = _Deltas(id_prefix)
        self._chars = _TokenText()
        self._control = self.BASE_CONTROL_IDS | frozenset(control_ids or ())

    def feed(self, token_id: int, text: str | bytes = "") -> list[dict]:
        """Consume one generated token (text as str, or the token's bytes; a control token is recognised by id
        and its text ignored); returns the deltas it produced.

        Raises:
          ToolCallParseError: the output is not well-formed call syntax.
        """
        if token_id in self._control:
            self._chars_in(self._chars.flush())
            self._special(token_id)
        else:
            self._chars_in(self._chars.chars(text))
        return self._out.take()

    def finish(self) -> list[dict]:
        """End of generation (stop token, length limit or abort): flush and return the last deltas."""
        self._chars_in(self._chars.flush())
        self._end()
        return self._out.take()

    def _end(self) -> None:
        """End of generation: release anything held back (subclasses that hold text override this)."""

    def result(self) -> ParsedOutput:
        """The content and the complete calls so far."""
        return self._out.result(self._truncated())

    def progress(self) -> tuple[int, bool]:
        """(complete calls so far, whether a call is open now), cheaply, for budget-aware endings
        (gateway/budget.py)."""
        return sum(c.complete for c in self._out.calls), self._in_call()

    def _in_call(self) -> bool:
        raise NotImplementedError

    def _special(self, token_id: int) -> None:
        raise NotImplementedError

    def _chars_in(self, chars: str) -> None:
        raise NotImplementedError

    def _truncated(self) -> bool:
        raise NotImplementedError


class Gemma4ToolCallParser(_TokenParser):
    """Incremental parser of a Gemma 4 answer: free text and `<|tool_call>call:NAME{...}<tool_call|>` calls.

    Feed every generated token in order with `feed(token_id, text)` (text as str, or the token's bytes; control
    tokens are recognised by id, their text is ignored). Each call returns the OpenAI `delta`s produced by that
    token: `{"content": text}`, a call's first delta `{"tool_calls": [{"index", "id", "type": "function",
    "function": {"name", "arguments": ""}}]}` (once its name is complete) and then argument fragments
    `{"tool_calls": [{"index", "function": {"arguments": fragment}}]}` as the arguments arrive, converted to
    JSON. `finish()` flushes; `result()` gives the whole answer. Control tokens other than the tool and turn
    markers are dropped from content (pass the vocabulary's control ids as `control_ids`).
    """

    BASE_CONTROL_IDS = GEMMA4_CONTROL_IDS

    def __init__(self, id_prefix: str = "call_", control_ids: Iterable[int] | None = None):
        super().__init__(id_prefix, control_ids)
        self._state = "text"  # text | name | args | closed (args done, waiting for <tool_call|>) | done
        self._name = ""
        self._call: _Call | None = None
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
        if tid == GEMMA4_TOOL_CALL:
            if self._state != "text":
                raise ToolCallParseError("<|tool_call> inside a tool call")
            self._state, self._name = "name", ""
        elif tid == GEMMA4_TOOL_CALL_END:
            if self._state != "closed":
                raise ToolCallParseError("<tool_call|> before the call's arguments were complete")
            self._call.complete = True
            self._state, self._call = "text", None
        elif tid == GEMMA4_STRING and self._state == "args":
            self._string_delimiter()
        elif tid in (GEMMA4_TOOL_RESPONSE, GEMMA4_TURN_END, GEMMA4_EOS):
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


class Gemma3ToolCallParser(_TokenParser):
    """Incremental parser of a Gemma 3 answer in this project's JSON tool format (gateway/tool_calls.py), with the
    same interface and deltas as `Gemma4ToolCallParser`. Text is content until the call trigger
    (`GEMMA3_CALL_TRIGGER`, `{"tool_calls"`) appears anywhere in it — the lazy trigger of `tool_choice: "auto"`;
    text that could still be the start of the trigger is held back (at most its length minus one characters)
    until it is decided. From the trigger on the text is the calls object. Argument fragments are the generated
    JSON text, verbatim.
    """

    BASE_CONTROL_IDS = GEMMA3_CONTROL_IDS

    def __init__(self, id_prefix: str = "call_", control_ids: Iterable[int] | None = None):
        super().__init__(id_prefix, control_ids)
        self._state = "text"  # text | json | after | done
        self._held = ""  # content that may be the start of the call trigger
        self._stack: list[dict] = []  # frames: {"kind": obj|arr, "expect", "key", "index"}
        self._string: str | None = None  # raw text of a string being read (wrapper level)
        self._capture: dict | None = None  # arguments being copied: depth, in_string, escape
        self._call: dict | None = None  # {"name", "open": _Call | None, "args": bool}

    def _special(self, token_id: int) -> None:
        self._end()
        if token_id in (GEMMA3_END_OF_TURN, GEMMA3_EOS) and self._state != "done":
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


def _parse_marked(text: str, parser, ids: dict[str, int]) -> ParsedOutput:
    pattern = re.compile("(" + "|".join(re.escape(k) for k in sorted(ids, key=len, reverse=True)) + ")")
    for n, piece in enumerate(pattern.split(text)):
        if n % 2:
            parser.feed(ids[piece], piece)
        elif piece:
            parser.feed(-1, piece)
    parser.finish()
    return parser.result()


def parse_gemma4_tool_calls(text: str, id_prefix: str = "call_") -> ParsedOutput:
    """Parse a whole Gemma 4 answer written with its control tokens spelled out (`<|tool_call>`, `<|"|>`, ...).

    Raises:
      ToolCallParseError: malformed call syntax.
    """
    ids = {"<|tool_call>": GEMMA4_TOOL_CALL, "<tool_call|>": GEMMA4_TOOL_CALL_END,
           "<|tool_response>": GEMMA4_TOOL_RESPONSE, '<|"|>': GEMMA4_STRING, "<turn|>": GEMMA4_TURN_END,
           "<eos>": GEMMA4_EOS}
    return _parse_marked(text, Gemma4ToolCallParser(id_prefix), ids)


def parse_gemma3_tool_calls(text: str, id_prefix: str = "call_") -> ParsedOutput:
    """Parse a whole Gemma 3 answer (JSON tool format; `<end_of_turn>`/`<eos>` spelled out end it).

    Raises:
      ToolCallParseError: a malformed calls object.
    """
    ids = {"<end_of_turn>": GEMMA3_END_OF_TURN, "<eos>": GEMMA3_EOS}
    return _parse_marked(text, Gemma3ToolCallParser(id_prefix), ids)
