"""Tool calls in the model's own format: the formats, and the llguidance grammars that hold the calls to the tools'
JSON Schemas. The incremental parsers that turn generated tokens into OpenAI tool calls (streaming deltas and
final calls) are in gateway/tool_parsers.py.

Gemma 4 (native format, docs/formats.md §4.2-4.4)
--------------------------------------------
The model writes calls in its trained syntax, then stops on `<|tool_response>`::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|><|tool_response>

`<|tool_call>` (48), `<tool_call|>` (49), `<|tool_response>` (50), the string delimiter `<|"|>` (52) and the end of
turn `<turn|>` (106) are control tokens: the grammar references them by id (`<[48]>`), so they are matched as
tokens and never as text, and no text in the grammar (call names, keys, strings, free text) can contain a control
token. Arguments are the tool's `parameters` schema written in Gemma syntax:

- objects `{key:value,...}` with bare keys, **in the chat template's order** (keys sorted case-insensitively,
  Jinja `dictsort`): the order Gemma 4's template writes calls in, so the model sees its own calls in history exactly
  as the template renders them. Required properties are mandatory, optional ones optional; no other keys.
- strings `<|"|>raw text<|"|>` (no escapes: the text is everything between the delimiters);
- numbers as Python prints them (what the template writes for a JSON number, so generated calls re-render
  exactly): integers `0|-?[1-9][0-9]*`; other numbers in fixed notation with at most 15 significant digits and
  `1e-4 <= |x| < 1e15` (`3.5`, `-0.25`, `100.0`); no exponents, no `1.50`, no `-0`;
- `true`, `false`, `null`, arrays `[v,...]`, nested objects.

The parser (gateway/tool_parsers.py) converts the arguments to JSON text as they arrive (keys -> `"key"`, Gemma strings -> JSON strings
with quotes, backslashes and control characters escaped, numbers/literals as they are) and streams them.

Gemma 3 (no native tool format): this project's JSON format
----------------------------------------------------------
Gemma 3 was not trained on tools, so the built-in Gemma 3 template (tokenizer_svc `render_gemma3`) and these
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

       These tools exist but cannot be called in this answer. Each line is one tool's name, description and JSON Schema parameters:
       {"name": "get_weather", "description": "Get the weather.", "parameters": {...}}
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

JSON Schema support (both formats; fail closed)
-----------------------------------------------
Supported: `type` (a name or a list, `"null"` included), OpenAPI `nullable: true`, `enum`/`const` of scalars,
`anyOf`, `oneOf` (only when its alternatives have different JSON types, so at most one can match), `allOf` with
one schema, local `$ref` (`#/$defs/...`, `#/definitions/...`, recursion allowed), `properties`, `required`,
`additionalProperties`, `items` (a schema), `minItems`, `maxItems`, `minLength`, `maxLength`, `pattern`
(anchored or not; `^`/`$` only at the ends), `format` (`date`, `time`, `date-time`, `uuid`, `email`, `ipv4`),
`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` (any integer bound for `integer`; whole-number
bounds for `number`), and the annotations `title`, `description`, `default`, `examples`, `$comment`,
`deprecated`, `readOnly`, `writeOnly`, `$schema`, `$id`.
Rejected with `ToolSchemaError` naming the keyword: everything else, e.g. `multipleOf`, `uniqueItems`,
`prefixItems`/tuple `items`, `contains`, `patternProperties`, `propertyNames`, `minProperties`, `maxProperties`,
`dependentRequired`, `dependentSchemas`, `if`/`then`/`else`, `not`, `unevaluated*`, remote `$ref`, other
formats, fractional `number` bounds, `required` names without a property, property names that cannot be bare
keys (`[\\w$@.-]+`).
Objects: an object with a `properties` keyword gets exactly its declared keys (`"properties": {}` means `{}`),
whatever `additionalProperties` says (extra keys would be valid, but are never produced). An object with no
`properties` keyword is free-form: any identifier keys, values per `additionalProperties` (any value when
absent/true; `{}` when false); its key order is not enforced, so it is the one thing the template may
re-render in a different (sorted) order. `nullable: true` is not JSON Schema: validate with
`validation_schema()` / `validate_tool_arguments()`, which read it as "or null".

Grammars per tool_choice (the gateway masks with an llguidance matcher; None = no grammar)
-----------------------------------------------------------------------------------------
Gemma 4 (CALL_i = `<[48]> "call:NAME_i" ARGS_i <[49]>`; CALLS = 1 to MAX_PARALLEL_CALLS of `(CALL_0|CALL_1|...)`,
exactly one call when `parallel` is false):

- `"none"` (or no tools): None. The model must still not call: the gateway bans `<|tool_call>` and
  `<tool_call|>` (`GEMMA4_NONE_BANNED_IDS`) in its sampling mask.
- `"auto"`: `start: TEXT? <[106]> | TEXT? CALLS <[50]>` - an answer, or optional text then calls (Gemma 4's
  template renders such leading text after the tool results when the message comes back in history).
- `"required"`: `start: CALLS <[50]>`.
- named `{"type": "function", "function": {"name": X}}`: `start: CALL_X <[50]>` — exactly one call, as OpenAI and
  vLLM answer a named choice (whatever `parallel_tool_calls` says).

Gemma 3 (CALLS_JSON = the object of point 2; `<[106]>` = `<end_of_turn>`): `"none"` -> None; `"auto"` ->
`start: TEXT <[106]> | head CALLS_REST <[106]>` with `head[lazy]: TEXT "{\"tool_calls\""` (below);
`"required"` -> `start: CALLS_JSON <[106]>`; named -> the same with exactly one call of tool X. Grammars are cached by a hash of
(format, tools, tool_choice, parallel, max calls).

Lazy trigger (`tool_choice: "auto"`, both formats; llguidance's lazy lexemes, the technique
llama.cpp calls lazy grammars): a call may start anywhere in the answer. Text before it is free — any bytes, as
without tools — until the call's trigger appears: for Gemma 4 the `<|tool_call>` control token, for Gemma 3 the
text `GEMMA3_CALL_TRIGGER` (`{"tool_calls"`), matched on bytes at any token boundary, also when it is split over
several tokens or a token holds text before it. From the trigger on, the rest of the call is held to the tools'
grammar (a token that would complete the trigger and continue it wrongly is masked), parsed incrementally and
streamed as `tool_calls` deltas; the text before it is `content`. Consequence: prose that happens to contain the
trigger becomes a call (for Gemma 3, a `{"tool_calls"` written as an example in an answer is treated as the
start of a call and must be completed as one). After the calls object only the end of turn may follow.

Parallel calls are capped at MAX_PARALLEL_CALLS per answer in both formats: a greedy base model (the embedded Gemma
3, asked `tool_choice: "required"`) otherwise repeats the same call until `max_tokens` (seen: 446 identical calls,
the last one cut off). The grammar ends the answer after the last allowed call.

Call ids are `{id_prefix}{n}`, n counting the calls of one response from 0, so they are unique within a
response; pass a per-response prefix (e.g. `f"call_{request_id}_{choice}_"`) to make them unique across a
conversation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Any

import llguidance

from gateway import patterns
from gateway.json_schema import DATE_REGEX, DATE_TIME_REGEX, TIME_REGEX
from gateway.lru import ByteLRU, text_size

# Gemma 4 control-token ids (docs/formats.md §4.2; identical across sizes).
GEMMA4_EOS = 1
GEMMA4_TOOL_CALL = 48
GEMMA4_TOOL_CALL_END = 49
GEMMA4_TOOL_RESPONSE = 50
GEMMA4_STRING = 52
GEMMA4_TURN_END = 106
GEMMA4_CONTROL_IDS = frozenset({0, 1, 2, 46, 47, 48, 49, 50, 51, 52, 98, 100, 101, 105, 106})
GEMMA4_NONE_BANNED_IDS = (GEMMA4_TOOL_CALL, GEMMA4_TOOL_CALL_END)
"""Ids the gateway bans with tool_choice "none" (there is no grammar then)."""

# Gemma 3 control-token ids (docs/formats.md §4.1).
GEMMA3_EOS = 1
GEMMA3_END_OF_TURN = 106
GEMMA3_CONTROL_IDS = frozenset({0, 1, 2, 3, 105, 106})

# The Gemma 3 call JSON (the template in tokenizer_svc/chat_template.py writes the same text).
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


class ToolSchemaError(ValueError):
    """A tool's schema cannot be enforced (unsupported keyword or value): the request must be rejected.

    Attributes:
      message: what is wrong, naming the tool, keyword and path.
      tool: the tool's name (or `tools[i]` when it has none).
      keyword: the offending JSON Schema keyword (or "name"/"function"/"parameters" for the tool itself).
      path: JSON pointer of the schema node inside the tool's `parameters` ("" for the root).
    """

    def __init__(self, message: str, tool: str, keyword: str, path: str):
        super().__init__(message)
        self.message, self.tool, self.keyword, self.path = message, tool, keyword, path


class ToolChoiceError(ValueError):
    """`tool_choice` is malformed, names a tool that is not in `tools`, or needs tools and there are none."""


class ToolCallParseError(ValueError):
    """The generated text is not a well-formed tool call (cannot happen under the grammar)."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is JSON text (an object), the concatenation of the streamed fragments."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
    """A whole generated answer.

    Attributes:
      content: the text outside calls ("" when none).
      tool_calls: the complete calls, in order.
      truncated: generation stopped inside a call (its streamed fragments are not valid JSON; it is not in
        tool_calls).
    """

    content: str
    tool_calls: list[ToolCall]
    truncated: bool = False


# ------------------------------------------------------------------------------------------- tools and choice

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _functions(tools: list[dict]) -> list[dict]:
    """The `function` objects of an OpenAI `tools` array, checked: type function, unique valid names."""
    out, seen = [], set()
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolSchemaError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{...}}}}",
                                  f"tools[{i}]", "function", "")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolSchemaError(f"tools[{i}]: the name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}",
                                  f"tools[{i}]", "name", "")
        if name in seen:
            raise ToolSchemaError(f"tools[{i}]: duplicate tool name {name!r}", name, "name", "")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolSchemaError(f"tool {name!r}: parameters must be a JSON Schema object", name, "parameters", "")
        out.append(fn)
    return out


def resolve_tool_choice(tools: list[dict], tool_choice: Any) -> tuple[str, str | None]:
    """OpenAI `tool_choice` -> (mode, name): mode "none" | "auto" | "required" | "named" (name set for "named").
    None means the OpenAI default ("auto" with tools, else "none"); "auto" without tools is "none".

    Raises:
      ToolChoiceError: unknown value, a named tool that is not in `tools`, or "required"/named without tools.
    """
    names = [fn["name"] for fn in _functions(tools)]
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not names:
            raise ToolChoiceError('tool_choice "required" needs at least one tool')
        return ("none" if tool_choice == "auto" and not names else tool_choice), None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise ToolChoiceError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}')
    if fn.get("name") not in names:
        raise ToolChoiceError(f"tool_choice names {fn.get('name')!r}, which is not one of the tools")
    return "named", fn["name"]


# ------------------------------------------------------------------------------------------ regex building


def _digits_between(a: str, b: str) -> str:
    """Regex for the digit strings of len(a) between a and b (a <= b, equal lengths, leading zeros allowed)."""
    n = len(a)
    if a == b:
        return a
    if a == "0" * n and b == "9" * n:
        return f"[0-9]{{{n}}}" if n > 1 else "[0-9]"
    if n == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return a[0] + _digits_between(a[1:], b[1:])
    alts = [a[0] + _digits_between(a[1:], "9" * (n - 1))]
    if int(b[0]) - int(a[0]) > 1:
        alts.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}][0-9]{{{n - 1}}}")
    alts.append(b[0] + _digits_between("0" * (n - 1), b[1:]))
    return "(?:" + "|".join(alts) + ")"


def _uint_range(a: int, b: int | None) -> str | None:
    """Regex for canonical decimal integers in [a, b] (0 <= a; b None = unbounded), or None if empty."""
    if b is not None and a > b:
        return None
    alts = []
    if a == 0:
        alts.append("0")
        if b == 0:
            return "0"
        a = 1
    sa = str(a)
    if b is None:
        alts.append(_digits_between(sa, "9" * len(sa)))
        alts.append(f"[1-9][0-9]{{{len(sa)},}}")
    else:
        sb = str(b)
        if len(sa) == len(sb):
            alts.append(_digits_between(sa, sb))
        else:
            alts.append(_digits_between(sa, "9" * len(sa)))
            for k in range(len(sa) + 1, len(sb)):
                alts.append(f"[1-9][0-9]{{{k - 1}}}")
            alts.append(_digits_between("1" + "0" * (len(sb) - 1), sb))
    return "(?:" + "|".join(alts) + ")"


def int_range_regex(lo: int | None, hi: int | None) -> str | None:
    """Regex for canonical integers (no leading zeros, no "-0") in [lo, hi] (None = unbounded), or None if
    the range is empty."""
    alts = []
    if hi is None or hi >= 0:
        r = _uint_range(max(lo, 0) if lo is not None else 0, hi)
        if r:
            alts.append(r)
    if lo is None or lo < 0:
        r = _uint_range(-hi if hi is not None and hi < 0 else 1, -lo if lo is not None else None)
        if r:
            alts.append("-" + r)
    return "(?:" + "|".join(alts) + ")" if alts else None


# Fixed-notation numbers that Python prints back unchanged (repr(float(s)) == s): <= 15 significant digits,
# 1e-4 <= |x| < 1e15, no trailing zeros except the single ".0".
_FRACTION_REPR = "(?:" + "|".join(
    ["0\\.(?:0|0{0,3}[1-9](?:[0-9]{0,13}[1-9])?)"]
    + [f"[1-9][0-9]{{{k - 1}}}\\.(?:0|[0-9]{{0,{14 - k}}}[1-9])" for k in range(1, 15)]
    + ["[1-9][0-9]{14}\\.0"]
) + ")"
NUMBER_REPR_REGEX = f"-?{_FRACTION_REPR}"
INTEGER_REGEX = "(?:0|-?[1-9][0-9]*)"

_FORMATS = {
    "date": DATE_REGEX,  # the same RFC 3339 subset as response_format (gateway/json_schema.py)
    "time": TIME_REGEX,
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": "[A-Za-z0-9._%+\\-]{1,64}@[A-Za-z0-9\\-]{1,63}(?:\\.[A-Za-z0-9\\-]{1,63}){1,8}",
    "ipv4": "(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
}
_FORMATS["date-time"] = DATE_TIME_REGEX


def _lark_regex(regex: str) -> str:
    return "/" + regex.replace("/", "\\/") + "/"


def _python_number(value: int | float) -> str:
    """A number as Python (and so the Jinja template) prints it."""
    return str(value) if isinstance(value, int) else repr(float(value))


# ----------------------------------------------------------------------------------------- schema walking

_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
                "$schema", "$id"}
_STRING_KW = {"minLength", "maxLength", "pattern", "format"}
_NUMBER_KW = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_ARRAY_KW = {"items", "minItems", "maxItems"}
_OBJECT_KW = {"properties", "required", "additionalProperties"}
_STRUCTURE_KW = {"type", "nullable", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"}
_KNOWN = _ANNOTATIONS | _STRING_KW | _NUMBER_KW | _ARRAY_KW | _OBJECT_KW | _STRUCTURE_KW
_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
_KEY = re.compile(r"^[\w$@.\-]+$")
_ATOM = re.compile(r'[A-Za-z_][A-Za-z0-9_]*|"(?:[^"\\]|\\.)*"')


def _pointer_escape(part: str) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def _dictsort(mapping: dict) -> list[tuple[str, Any]]:
    """Jinja's `dictsort` (case-insensitive), the order Gemma 4's template writes mappings in."""
    return sorted(mapping.items(), key=lambda kv: kv[0].lower())


class _Gemma4Schema:
    """Translates one tool's `parameters` JSON Schema into Lark rules for Gemma 4 call syntax."""

    def __init__(self, grammar: _Gemma4Grammar, tool: str, root: dict, prefix: str):
        self.g, self.tool, self.root, self.prefix = grammar, tool, root, prefix
        self.refs: dict[str, str] = {}

    def error(self, keyword: str, path: str, reason: str) -> ToolSchemaError:
        return ToolSchemaError(f"tool {self.tool!r}: JSON Schema keyword {keyword!r} at {path or '/'} is not "
                               f"supported: {reason}", self.tool, keyword, path)

    def rule(self, body: str) -> str:
        return self.g.add_rule(self.prefix, body)

    # -- entry points

    def parameters(self) -> str:
        """The rule of the arguments object."""
        schema = self.root
        if not schema:
            return '"{}"'
        t = schema.get("type", "object")
        if t != "object" or any(k in schema for k in ("anyOf", "oneOf", "allOf", "enum", "const", "$ref")):
            raise self.error("type", "", 'parameters must be a plain {"type": "object"} schema')
        return self.node(schema, "")

    def node(self, schema: Any, path: str) -> str:
        """A Lark atom (rule or terminal name, literal, or parenthesized expression) for the values valid against
        `schema`."""
        expr = self._node(schema, path)
        return expr if _ATOM.fullmatch(expr) else f"({expr})"

    def _node(self, schema: Any, path: str) -> str:
        if schema is True or schema == {}:
            return self.g.any_value()
        if schema is False:
            raise self.error("false", path, "a false schema matches nothing")
        if not isinstance(schema, dict):
            raise self.error("schema", path, f"expected an object, got {type(schema).__name__}")
        for key in schema:
            if key not in _KNOWN:
                raise self.error(key, path, "this keyword cannot be enforced")
        core = {k: v for k, v in schema.items() if k not in _ANNOTATIONS and k not in ("$defs", "definitions")}
        if "$ref" in core:
            return self.ref(core, path)
        if "allOf" in core:
            parts = core["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or len(core) != 1:
                raise self.error("allOf", path, "only allOf with a single schema and no sibling keywords")
            return self.node(parts[0], f"{path}/allOf/0")
        for kw in ("anyOf", "oneOf"):
            if kw in core:
                return self.union(kw, core, path)
        if "enum" in core or "const" in core:
            return self.literals(core, path)
        types = self.types(core, path)
        alts = [self.typed(t, core, path) for t in types]
        return alts[0] if len(alts) == 1 else self.rule(" | ".join(alts))

    def types(self, core: dict, path: str) -> list[str]:
        t = core.get("type")
        if t is None:
            if core.keys() & _OBJECT_KW:
                types = ["object"]
            elif core.keys() & _ARRAY_KW:
                types = ["array"]
            elif core.keys() & _STRING_KW:
                types = ["string"]
            elif core.keys() & _NUMBER_KW:
                types = ["number"]
            else:
                types = ["string", "number", "boolean", "null", "object", "array"]
        else:
            types = [t] if isinstance(t, str) else t
            if not isinstance(types, list) or not types or any(x not in _TYPES for x in types):
                raise self.error("type", path, f"unknown type {t!r}")
            if "integer" in types and "number" in types:
                types = [x for x in types if x != "integer"]
        if core.get("nullable") is True and "null" not in types:
            types = [*types, "null"]
        return list(dict.fromkeys(types))

    def typed(self, t: str, core: dict, path: str) -> str:
        if t == "null":
            return '"null"'
        if t == "boolean":
            return '"true" | "false"'
        if t == "string":
            return f"<[{GEMMA4_STRING}]> {self.string_terminal(core, path)} <[{GEMMA4_STRING}]>"
        if t in ("integer", "number"):
            return self.number(t, core, path)
        if t == "array":
            return self.array(core, path)
        return self.object(core, path)

    # -- references and combinations

    def ref(self, core: dict, path: str) -> str:
        ref = core["$ref"]
        if len(core) != 1 and not (len(core) == 2 and core.get("nullable") is True):
            raise self.error("$ref", path, "$ref with sibling keywords")
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.error("$ref", path, "only local references (#/$defs/...)")
        if ref not in self.refs:
            target: Any = self.root
            for part in [p for p in ref[1:].split("/") if p]:
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise self.error("$ref", path, f"{ref!r} does not resolve")
                target = target[part]
            name = self.g.new_name(self.prefix)
            self.refs[ref] = name
            self.g.rules[name] = self.node(target, ref[1:])
        return self.rule(f'{self.refs[ref]} | "null"') if core.get("nullable") is True else self.refs[ref]

    def union(self, kw: str, core: dict, path: str) -> str:
        options = core[kw]
        extra = set(core) - {kw, "nullable"}
        if extra:
            raise self.error(kw, path, f"{kw} together with {sorted(extra)}")
        if not isinstance(options, list) or not options:
            raise self.error(kw, path, "expected a non-empty list of schemas")
        if kw == "oneOf":
            seen: set[str] = set()
            for i, option in enumerate(options):
                fams = self.families(option, set())
                if fams is None or fams & seen:
                    raise self.error("oneOf", f"{path}/oneOf/{i}", "oneOf alternatives must have different JSON "
                                     "types (use anyOf)")
                seen |= fams
        alts = [self.node(option, f"{path}/{kw}/{i}") for i, option in enumerate(options)]
        if core.get("nullable") is True:
            alts.append('"null"')
        return self.rule(" | ".join(alts))

    def families(self, schema: Any, visiting: set[str]) -> set[str] | None:
        """The JSON types (integer and number as one) `schema` can match, or None if unknown/any."""
        if not isinstance(schema, dict):
            return None
        fams: set[str] = set()
        if "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or ref in visiting:
                return None
            target: Any = self.root
            for part in [p for p in ref[1:].split("/") if p]:
                target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
            sub = self.families(target, visiting | {ref})
            if sub is None:
                return None
            fams |= sub
        elif "anyOf" in schema or "oneOf" in schema or "allOf" in schema:
            for option in schema.get("anyOf", schema.get("oneOf", schema.get("allOf"))) or []:
                sub = self.families(option, visiting)
                if sub is None:
                    return None
                fams |= sub
        elif "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            for v in values if isinstance(values, list) else []:
                fams.add(_family(v))
        elif "type" in schema:
            types = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
            fams |= {"number" if t == "integer" else t for t in types}
        else:
            return None
        if schema.get("nullable") is True:
            fams.add("null")
        return fams

    def literals(self, core: dict, path: str) -> str:
        kw = "enum" if "enum" in core else "const"
        values = core["enum"] if kw == "enum" else [core["const"]]
        if not isinstance(values, list) or not values:
            raise self.error(kw, path, "expected a non-empty list")
        siblings = {k: v for k, v in core.items() if k not in ("enum", "const")}
        if siblings.keys() - {"type", "nullable"} - _STRING_KW - _NUMBER_KW:
            raise self.error(kw, path, f"{kw} together with {sorted(siblings.keys())}")
        if core.get("nullable") is True and None not in values:
            values = [*values, None]
        check = _validator(validation_schema(siblings))
        alts = []
        for v in values:
            if isinstance(v, (dict, list)) or (isinstance(v, float) and not math.isfinite(v)):
                raise self.error(kw, path, f"only string, number, boolean and null values, got {v!r}")
            if not check.is_valid(v):
                continue
            if isinstance(v, str):
                alts.append(f"<[{GEMMA4_STRING}]> {json.dumps(v)} <[{GEMMA4_STRING}]>" if v else
                            f"<[{GEMMA4_STRING}]> <[{GEMMA4_STRING}]>")
            elif v is None:
                alts.append('"null"')
            elif isinstance(v, bool):
                alts.append('"true"' if v else '"false"')
            else:
                alts.append(json.dumps(_python_number(v)))
        if not alts:
            raise self.error(kw, path, "no value satisfies the other keywords")
        return self.rule(" | ".join(dict.fromkeys(alts)))

    # -- scalars

    def string_terminal(self, core: dict, path: str) -> str:
        lo, hi = core.get("minLength", 0), core.get("maxLength")
        for kw, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise self.error(kw, path, f"expected a non-negative integer, got {v!r}")
        parts = []
        if lo or hi is not None:
            parts.append(f"(?s:.{{{lo},{'' if hi is None else hi}}})")
        if "pattern" in core:
            parts.append(self.pattern(core["pattern"], path))
        if "format" in core:
            fmt = core["format"]
            if fmt not in _FORMATS:
                raise self.error("format", path, f"format {fmt!r} (supported: {', '.join(sorted(_FORMATS))})")
            parts.append(_FORMATS[fmt])
        if not parts:
            return self.g.terminal("(?s:.*)")
        return self.g.terminal(*parts)

    def pattern(self, pattern: Any, path: str) -> str:
        """An ECMA `pattern` (matches anywhere unless anchored) -> a whole-string regex for the same strings, or
        for a subset of them (a pattern anchored at both ends is taken as one group)."""
        if not isinstance(pattern, str):
            raise self.error("pattern", path, "expected a string")
        try:
            patterns.check(pattern)
        except patterns.PatternError as err:
            raise self.error("pattern", path, err.reason) from None
        body, start, end = pattern, False, False
        if body.startswith("^"):
            body, start = body[1:], True
        if body.endswith("$") and not escaped_at(body, len(body) - 1):
            body, end = body[:-1], True
        if re.search(r"(?<!\\)[\^$]", body.replace("[^", "[")):
            raise self.error("pattern", path, "^ and $ are supported only at the ends of the pattern")
        # ECMA semantics, as llguidance's JSON compiler gives `pattern`: \d and \w are ASCII.
        body = llguidance.regex_to_lark(body, "dw").replace("\\/", "/")
        regex = ("" if start else "(?s:.*)") + f"(?:{body})" + ("" if end else "(?s:.*)")
        problem = _regex_problem(regex)
        if problem:
            raise self.error("pattern", path, f"the regex does not compile for llguidance ({problem})")
        return regex

    def number(self, t: str, core: dict, path: str) -> str:
        lo, lo_excl = core.get("minimum"), False
        hi, hi_excl = core.get("maximum"), False
        for kw in ("exclusiveMinimum", "exclusiveMaximum"):
            v = core.get(kw)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise self.error(kw, path, f"expected a number, got {v!r}")
            if kw == "exclusiveMinimum" and (lo is None or v >= lo):
                lo, lo_excl = v, True
            if kw == "exclusiveMaximum" and (hi is None or v <= hi):
                hi, hi_excl = v, True
        for kw, v in (("minimum", lo), ("maximum", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise self.error(kw, path, f"expected a finite number, got {v!r}")
        if lo is None and hi is None:
            return self.g.terminal(INTEGER_REGEX if t == "integer" else f"{INTEGER_REGEX}|{NUMBER_REPR_REGEX}")
        # Integers in range (inclusive integer bounds).
        ilo = None if lo is None else (math.floor(lo) + 1 if lo_excl else math.ceil(lo))
        ihi = None if hi is None else (math.ceil(hi) - 1 if hi_excl else math.floor(hi))
        ints = int_range_regex(ilo, ihi) if ilo is None or ihi is None or ilo <= ihi else None
        if t == "integer":
            if ints is None:
                raise self.error("minimum" if lo is not None else "maximum", path, "no integer is in range")
            return self.g.terminal(ints)
        for kw, v in (("minimum", lo), ("maximum", hi)):
            if v is not None and not float(v).is_integer():
                raise self.error(kw, path, "number bounds must be whole numbers")
        lo_i = None if lo is None else int(lo)
        hi_i = None if hi is None else int(hi)
        # Non-integral x = I.F lies in (I, I+1) (or (-I-1, -I)): inside the bounds iff the whole interval is.
        pos = _uint_range(max(lo_i, 0) if lo_i is not None else 0, None if hi_i is None else hi_i - 1)
        neg = None
        if lo_i is None or lo_i < 0:
            neg = _uint_range(max(-hi_i, 0) if hi_i is not None else 0, None if lo_i is None else -lo_i - 1)
        fractions = [f"{pos}\\.[0-9]*[1-9]"] if pos else []
        if neg:
            fractions.append(f"-{neg}\\.[0-9]*[1-9]")
        if ints:
            fractions.append(f"{ints}\\.0")
        alts = [_lark_regex(ints)] if ints else []
        if fractions:
            alts.append(f"({_lark_regex('|'.join(fractions))} & {_lark_regex(NUMBER_REPR_REGEX)})")
        if not alts:
            raise self.error("minimum" if lo is not None else "maximum", path, "no number is in range")
        return self.g.terminal_expr(" | ".join(alts))

    # -- containers

    def array(self, core: dict, path: str) -> str:
        items = core.get("items", True)
        if isinstance(items, list):
            raise self.error("items", path, "tuple items (a list of schemas)")
        lo, hi = core.get("minItems", 0), core.get("maxItems")
        for kw, v in (("minItems", lo), ("maxItems", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise self.error(kw, path, f"expected a non-negative integer, got {v!r}")
        if items is False:
            hi = 0
        if hi is not None and lo > hi:
            raise self.error("minItems", path, "minItems > maxItems")
        if hi == 0:
            return '"[" "]"'
        item = self.node(items, f"{path}/items")
        rest_lo = max(lo - 1, 0)
        count = "*" if rest_lo == 0 and hi is None else f"{{{rest_lo},}}" if hi is None else f"{{{rest_lo},{hi - 1}}}"
        seq = item if count == "{0,0}" else f'{item} ("," {item}){count}'
        return self.rule(f'"[" {seq} "]"' if lo >= 1 else f'"[" ({seq})? "]"')

    def object(self, core: dict, path: str) -> str:
        props = core.get("properties", {})
        required = core.get("required", [])
        extra = core.get("additionalProperties", True)
        if not isinstance(props, dict):
            raise self.error("properties", path, "expected an object")
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            raise self.error("required", path, "expected a list of names")
        for name in required:
            if name not in props:
                raise self.error("required", path, f"{name!r} is required but not in properties")
        if extra not in (True, False):
            self.node(extra, f"{path}/additionalProperties")  # checked even where no extra keys are produced
        if not props and ("properties" in core or extra is False):
            return '"{}"'
        if not props:  # a free-form object: any identifier keys (order not enforced)
            value = self.g.any_value() if extra is True else self.node(extra, f"{path}/additionalProperties")
            pair = self.rule(f'ANY_KEY ":" {value}')
            self.g.need_any_key = True
            return self.rule(f'"{{" ({pair} ("," {pair})*)? "}}"')
        entries = []
        for name, sub in _dictsort(props):
            if not _KEY.match(name):
                raise self.error("properties", f"{path}/properties/{_pointer_escape(name)}",
                                 f"property name {name!r} cannot be written as a bare key")
            value = self.node(sub, f"{path}/properties/{_pointer_escape(name)}")
            entries.append((f"{json.dumps(name + ':')} {value}", name in required))
        # The first key is one of the optional keys before the first required one (or that one): head(i) = entry
        # i, then tail(i+1) = each later entry after a comma (optional ones optional).
        n = len(entries)
        first_required = next((i for i, (_, req) in enumerate(entries) if req), n)
        tails = [""] * (n + 1)
        for i in range(n - 1, 0, -1):
            pair, req = entries[i]
            body = (f'"," {pair}' if req else f'("," {pair})?') + (f" {tails[i + 1]}" if tails[i + 1] else "")
            tails[i] = self.rule(body) if tails[i + 1] else body
        heads = []
        for i in range(min(first_required, n - 1), -1, -1):
            pair, _ = entries[i]
            heads.append(pair + (f" {tails[i + 1]}" if tails[i + 1] else ""))
        head = self.rule(" | ".join(reversed(heads)))
        nullable = first_required == n
        return self.rule(f'"{{" {head}{"?" if nullable else ""} "}}"')


def _family(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def escaped_at(text: str, index: int) -> bool:
    """Whether the character at `index` of `text` is escaped (preceded by an odd number of backslashes)."""
    n = 0
    while index - 1 - n >= 0 and text[index - 1 - n] == "\\":
        n += 1
    return n % 2 == 1


_REGEX_PROBLEMS: ByteLRU[str, str] = ByteLRU(4 << 20, text_size)


def _regex_problem(regex: str) -> str:
    """'' if llguidance compiles `regex` as a terminal within its budget, else its error message (cached)."""
    problem = _REGEX_PROBLEMS.get(regex)
    if problem is None:
        problem = llguidance.LLMatcher.validate_grammar(f"start: T\nT: {_lark_regex(regex)}\n",
                                                        limits=patterns.LIMITS)
        _REGEX_PROBLEMS.put(regex, problem)
    return problem


class _Gemma4Grammar:
    """Collects rules and terminals of one grammar."""

    def __init__(self):
        self.rules: dict[str, str] = {}
        self.terminals: dict[str, str] = {}  # expression -> name
        self.counter = 0
        self.need_any = False
        self.need_any_key = False

    def new_name(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def add_rule(self, prefix: str, body: str) -> str:
        name = self.new_name(prefix)
        self.rules[name] = body
        return name

    def terminal(self, *regexes: str) -> str:
        return self.terminal_expr(" & ".join(_lark_regex(r) for r in regexes))

    def terminal_expr(self, expr: str) -> str:
        if expr not in self.terminals:
            self.terminals[expr] = f"T{len(self.terminals)}"
        return self.terminals[expr]

    def any_value(self) -> str:
        """The rule of any Gemma value (free-form objects and arrays; keys are identifiers)."""
        self.need_any = self.need_any_key = True
        return "any_value"

    def text(self) -> str:
        lines = [f"{name}: {body}" for name, body in self.rules.items()]
        if self.need_any:
            s = GEMMA4_STRING
            string, number = self.terminal("(?s:.*)"), self.terminal(f"{INTEGER_REGEX}|{NUMBER_REPR_REGEX}")
            lines += [
                f'any_value: <[{s}]> {string} <[{s}]> | {number} | "true" | "false" | "null" | any_object | any_array',
                'any_object: "{" (ANY_KEY ":" any_value ("," ANY_KEY ":" any_value)*)? "}"',
                'any_array: "[" (any_value ("," any_value)*)? "]"',
            ]
        if self.need_any_key:
            lines.append("ANY_KEY: /[A-Za-z_][A-Za-z0-9_]*/")
        lines += [f"{name}: {expr}" for expr, name in self.terminals.items()]
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- grammars

#: Tool grammars by a hash of (format, tools, tool_choice, parallel), charged by the grammar's length.
_CACHE: ByteLRU[str, str] = ByteLRU(32 << 20, lambda key, grammar: text_size(key, grammar))
_NO_GRAMMAR = ""  # cached "no grammar" (tool_choice none)


# Most tool calls in one answer (see the module docstring).
MAX_PARALLEL_CALLS = 16


def _cached(kind: str, tools: list[dict], tool_choice: Any, parallel: bool, build: Callable[[], str | None],
            max_calls: int = MAX_PARALLEL_CALLS):
    key = hashlib.sha256(json.dumps([kind, tools, tool_choice, bool(parallel), max_calls], separators=(",", ":"),
                                    ensure_ascii=False, default=repr).encode()).hexdigest()
    grammar = _CACHE.get(key)
    if grammar is None:
        grammar = build() or _NO_GRAMMAR
        _CACHE.put(key, grammar)
    return grammar or None


def gemma4_tool_grammar(tools: list[dict], tool_choice: Any = "auto", parallel: bool = True,
                        max_calls: int = MAX_PARALLEL_CALLS) -> str | None:
    """The llguidance Lark grammar of a Gemma 4 answer under `tool_choice` (see the module docstring), or None
    for "none" (then the gateway bans `GEMMA4_NONE_BANNED_IDS`). At most `max_calls` calls (1..MAX_PARALLEL_CALLS;
    1 without `parallel`): a budget-aware ending lowers it (gateway/budget.py). Cached by a hash of the arguments.

    Raises:
      ToolSchemaError: a tool or its schema cannot be enforced (the error names the keyword and path).
      ToolChoiceError: tool_choice is malformed or names an unknown tool.
    """
    return _cached("gemma4", tools, tool_choice, parallel,
                   lambda: _build_gemma4(tools, tool_choice, parallel, max_calls), max_calls)


def _callable(tools: list[dict], tool_choice: Any) -> tuple[str, list[tuple[int, dict]]]:
    """(mode, [(index in tools, function)] the answer may call): every tool, or only the named one (which is
    called exactly once: the builders treat "named" as not parallel)."""
    mode, chosen = resolve_tool_choice(tools, tool_choice)
    fns = list(enumerate(_functions(tools)))
    return mode, [(i, fn) for i, fn in fns if mode != "named" or fn["name"] == chosen]


def _build_gemma4(tools: list[dict], tool_choice: Any, parallel: bool, max_calls: int) -> str | None:
    mode, callable_fns = _callable(tools, tool_choice)
    if mode == "none":
        return None
    parallel = parallel and mode != "named"
    g = _Gemma4Grammar()
    calls = []
    for i, fn in callable_fns:
        args = _Gemma4Schema(g, fn["name"], fn.get("parameters") or {}, f"t{i}_").parameters()
        call = f"call_{i}"
        g.rules[call] = f'<[{GEMMA4_TOOL_CALL}]> {json.dumps("call:" + fn["name"])} {args} <[{GEMMA4_TOOL_CALL_END}]>'
        calls.append(call)
    one = calls[0] if len(calls) == 1 else "(" + " | ".join(calls) + ")"
    many = f"{one}{{1,{max_calls}}}" if parallel and max_calls > 1 else one
    if mode == "auto":
        start = (f"start: TEXT? <[{GEMMA4_TURN_END}]> | TEXT? {many} <[{GEMMA4_TOOL_RESPONSE}]>\n"
                 "TEXT: /(?s:.+)/\n")
    else:
        start = f"start: {many} <[{GEMMA4_TOOL_RESPONSE}]>\n"
    return _checked(start + g.text(), [fn for _, fn in callable_fns])


def gemma3_tool_grammar(tools: list[dict], tool_choice: Any = "auto", parallel: bool = True,
                        max_calls: int = MAX_PARALLEL_CALLS) -> str | None:
    """The llguidance Lark grammar of a Gemma 3 answer in this project's JSON tool format (module docstring), or
    None for "none". Schemas are checked exactly as for Gemma 4 (same supported keywords); arguments are
    constrained by llguidance's JSON Schema support (`%json`). At most `max_calls` calls (as for Gemma 4).
    Cached by a hash of the arguments.

    Raises:
      ToolSchemaError: a tool or its schema cannot be enforced.
      ToolChoiceError: tool_choice is malformed or names an unknown tool.
    """
    return _cached("gemma3", tools, tool_choice, parallel,
                   lambda: _build_gemma3(tools, tool_choice, parallel, max_calls), max_calls)


def _build_gemma3(tools: list[dict], tool_choice: Any, parallel: bool, max_calls: int) -> str | None:
    mode, callable_fns = _callable(tools, tool_choice)
    if mode == "none":
        return None
    parallel = parallel and mode != "named"
    lines, calls = [], []
    for i, fn in callable_fns:
        params = fn.get("parameters") or {}
        _Gemma4Schema(_Gemma4Grammar(), fn["name"], params, "x_").parameters()  # same checks as Gemma 4
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
    end = f"<[{GEMMA3_END_OF_TURN}]>"
    if mode == "auto":  # the lazy trigger (module docstring)
        start = (f"start: TEXT {end} | head calls_rest {end}\nTEXT: /(?s:.*)/\n"
                 f"head[lazy]: TEXT {json.dumps(GEMMA3_CALL_TRIGGER)}\n")
    else:
        start = f"start: {json.dumps(GEMMA3_CALL_TRIGGER)} calls_rest {end}\n"
    return _checked(start + rest_rule + "\n".join(lines) + "\n", [fn for _, fn in callable_fns])


def _checked(grammar: str, fns: list[dict]) -> str:
    """`grammar` if llguidance compiles it; else a ToolSchemaError (a schema llguidance cannot handle)."""
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        tool = fns[0]["name"] if len(fns) == 1 else "tools"
        raise ToolSchemaError(f"the tools' schemas cannot be compiled into a grammar: {problem}", tool, "schema", "")
    return grammar


_SCHEMA_MAPS = ("properties", "$defs", "definitions")       # keywords holding {name: subschema}
_SCHEMA_VALUES = ("items", "additionalProperties", "anyOf", "oneOf", "allOf")  # a subschema or a list of them


def _rewrite_schema(schema: Any, drop: str, finish: Callable[[dict, dict], dict]) -> Any:
    """A copy of `schema` rewritten bottom-up: every subschema loses the keyword `drop`, then
    `finish(original node, rewritten node)` gives its final form."""
    if isinstance(schema, list):
        return [_rewrite_schema(s, drop, finish) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _rewrite_schema(sub, drop, finish) for name, sub in v.items()}
        elif k in _SCHEMA_VALUES:
            out[k] = _rewrite_schema(v, drop, finish)
        elif k != drop:
            out[k] = v
    return finish(schema, out)


def _gemma3_schema(schema: Any) -> Any:
    """`schema` as llguidance's JSON compiler gets it for Gemma 3, so that both formats produce the same values:
    `additionalProperties: false` on every object with a `properties` keyword (such objects get exactly their
    declared keys; extra keys would be valid, but are never produced), and each `format` replaced by the same
    regex the Gemma 4 grammar uses (as a `pattern`, or an `allOf` pattern next to an existing one)."""
    return _rewrite_schema(schema, "format", _gemma3_node)


def _gemma3_node(schema: dict, out: dict) -> dict:
    if "properties" in out:
        out["additionalProperties"] = False
    if schema.get("format") in _FORMATS:
        pattern = f"^(?:{_FORMATS[schema['format']]})$"
        if "pattern" in out:
            out["allOf"] = [*out.get("allOf", []), {"pattern": pattern}]
        else:
            out["pattern"] = pattern
    return out


# -------------------------------------------------------------------------------------------- validation


def validation_schema(schema: Any) -> Any:
    """`schema` with OpenAPI `nullable: true` rewritten as JSON Schema ("or null"), for jsonschema validators."""
    return _rewrite_schema(schema, "nullable", _nullable_node)


def _nullable_node(schema: dict, out: dict) -> dict:
    if schema.get("nullable") is not True:
        return out
    if "enum" in out or "const" in out:
        values = out.pop("enum") if "enum" in out else [out.pop("const")]
        out["enum"] = values if None in values else [*values, None]
    if "type" in out:
        types = [out["type"]] if isinstance(out["type"], str) else list(out["type"])
        out["type"] = types if "null" in types else [*types, "null"]
        return out
    if "enum" in out:
        return out
    if "anyOf" in out and len(out) == 1:
        return {"anyOf": [*out["anyOf"], {"type": "null"}]}
    defs = {k: out.pop(k) for k in ("$defs", "definitions") if k in out}
    return {**defs, "anyOf": [out, {"type": "null"}]}


def _validator(schema: Any):
    """A validator of `schema` with its draft's own formats (FormatChecker() mixes drafts) whose `pattern`
    checks run in llguidance's linear-time dialect (gateway/patterns.py), never Python's `re`."""
    return patterns.validator_for(schema)


def validate_tool_arguments(tools: list[dict], name: str, arguments: str) -> dict:
    """Parse a call's `arguments` JSON and validate it against the tool's schema (nullable-aware).

    Returns:
      The arguments as a dict.

    Raises:
      ToolCallParseError: unknown tool, not a JSON object, or invalid against the schema (message says why).
    """
    fn = next((f for f in _functions(tools) if f["name"] == name), None)
    if fn is None:
        raise ToolCallParseError(f"no tool named {name!r}")
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as err:
        raise ToolCallParseError(f"{name}: arguments are not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ToolCallParseError(f"{name}: arguments must be a JSON object")
    params = fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    error = next(iter(_validator(validation_schema(params)).iter_errors(value)), None)
    if error is not None:
        raise ToolCallParseError(f"{name}: arguments do not match the schema: {error.message}")
    return value
