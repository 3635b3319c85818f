"""Tool calls, the part every model family shares: the OpenAI `tools` / `tool_choice` fields, the JSON Schema subset
a tool's parameters may use, validation of call arguments, the tool-grammar cache and the number regexes.

Each family writes calls in its own format, defined in its gateway part behind `gateway.core.tool_format.FamilyFormat`
(grammar builder, incremental parser, end tokens, call markers): Gemma 4's native syntax in
families/gemma4/gateway.py, Gemma 3's JSON format (this project's convention) in families/gemma3/gateway.py. The
parsers' shared machinery is gateway/generation/tool_parsers.py; gateway/structured/tools/tool_schema.py checks a tool's schema against the
subset below and translates it into Lark rules.

tool_choice (every format; the grammar is an llguidance Lark grammar the gateway masks with)
-------------------------------------------------------------------------------------------
- `"none"` (or no tools): no grammar. The model must still not call: the gateway bans the format's call markers
  (`FamilyFormat.call_markers`) in its sampling mask.
- `"auto"`: free text, or text then calls (lazy trigger, below), then the format's end token.
- `"required"`: only calls, 1 to `max_calls` of them (exactly one when `parallel_tool_calls` is false).
- named `{"type": "function", "function": {"name": X}}`: exactly one call of X, as OpenAI and vLLM answer a named
  choice (whatever `parallel_tool_calls` says).

Lazy trigger (`tool_choice: "auto"`, every format; llguidance's lazy lexemes, the technique llama.cpp calls lazy
grammars): a call may start anywhere in the answer. Text before it is free — any bytes, as without tools — until
the format's trigger appears (a control token, or text matched on bytes at any token boundary, also when it is
split over several tokens or a token holds text before it). From the trigger on, the rest of the call is held to
the tools' grammar (a token that would complete the trigger and continue it wrongly is masked), parsed
incrementally and streamed as `tool_calls` deltas; the text before it is `content`. Consequence: prose that
happens to contain the trigger becomes a call. After the calls only the end of turn may follow.

Parallel calls are capped at MAX_PARALLEL_CALLS per answer in every format: a greedy base model (the embedded
Gemma 3, asked `tool_choice: "required"`) otherwise repeats the same call until `max_tokens` (seen: 446 identical
calls, the last one cut off). The grammar ends the answer after the last allowed call. Grammars are cached by a
hash of (format, its control-token ids, tools, tool_choice, parallel, max calls).

Call ids are `{id_prefix}{n}`, n counting the calls of one response from 0, so they are unique within a
response; pass a per-response prefix (e.g. `f"call_{request_id}_{choice}_"`) to make them unique across a
conversation.


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
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import llguidance

from gateway.core.lru import ByteLRU, text_size
from gateway.structured import patterns
from gateway.structured.json_schema import rewrite


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


def callable_tools(tools: list[dict], tool_choice: Any) -> tuple[str, list[tuple[int, dict]]]:
    """(mode, [(index in tools, function)] the answer may call): every tool, or only the named one (which is
    called exactly once: the grammar builders treat "named" as not parallel).

    Raises:
      ToolSchemaError, ToolChoiceError: as `resolve_tool_choice`.
    """
    mode, chosen = resolve_tool_choice(tools, tool_choice)
    fns = list(enumerate(_functions(tools)))
    return mode, [(i, fn) for i, fn in fns if mode != "named" or fn["name"] == chosen]


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


def uint_range_regex(a: int, b: int | None) -> str | None:
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
        r = uint_range_regex(max(lo, 0) if lo is not None else 0, hi)
        if r:
            alts.append(r)
    if lo is None or lo < 0:
        r = uint_range_regex(-hi if hi is not None and hi < 0 else 1, -lo if lo is not None else None)
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


def escaped_at(text: str, index: int) -> bool:
    """Whether the character at `index` of `text` is escaped (preceded by an odd number of backslashes)."""
    n = 0
    while index - 1 - n >= 0 and text[index - 1 - n] == "\\":
        n += 1
    return n % 2 == 1


_REGEX_PROBLEMS: ByteLRU[str, str] = ByteLRU(4 << 20, text_size)


# ----------------------------------------------------------------------------------------------- grammars

#: Tool grammars by a hash of (format, ids, tools, tool_choice, parallel, max calls), charged by the grammar's length.
_CACHE: ByteLRU[str, str] = ByteLRU(32 << 20, lambda key, grammar: text_size(key, grammar))
_NO_GRAMMAR = ""  # cached "no grammar" (tool_choice none)


# Most tool calls in one answer (see the module docstring).
MAX_PARALLEL_CALLS = 16


def cached_grammar(kind: str, ids: Mapping[str, int], tools: list[dict], tool_choice: Any, parallel: bool,
                   max_calls: int, build: Callable[[], str | None]) -> str | None:
    """The grammar `build()` returns, cached by a hash of the format's name, the control-token ids it references
    (`ids`: the spellings the grammar uses -> their ids), the tools, tool_choice, parallel and max_calls; None
    (tool_choice "none") is cached too. The same arguments return the same string object."""
    key = hashlib.sha256(json.dumps([kind, sorted(ids.items()), tools, tool_choice, bool(parallel), max_calls],
                                    separators=(",", ":"), ensure_ascii=False, default=repr).encode()).hexdigest()
    grammar = _CACHE.get(key)
    if grammar is None:
        grammar = build() or _NO_GRAMMAR
        _CACHE.put(key, grammar)
    return grammar or None


def checked_grammar(grammar: str, fns: list[dict]) -> str:
    """`grammar` if llguidance compiles it.

    Raises:
      ToolSchemaError: it does not compile (a schema llguidance cannot handle), naming the tool when there is one.
    """
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        tool = fns[0]["name"] if len(fns) == 1 else "tools"
        raise ToolSchemaError(f"the tools' schemas cannot be compiled into a grammar: {problem}", tool, "schema", "")
    return grammar


# -------------------------------------------------------------------------------------------- validation

TOOL_SUBSCHEMA_KEYWORDS = frozenset({"properties", "$defs", "definitions", "items", "additionalProperties",
                                     "anyOf", "oneOf", "allOf"})
"""The subschema keywords (gateway/structured/json_schema.py `SUBSCHEMA_KEYWORDS`) of the subset tool parameters may use
(module docstring): the tools' schema rewrites descend only into these, and copy any other as it is."""


def validation_schema(schema: Any) -> Any:
    """A copy of `schema` with OpenAPI `nullable` removed and `nullable: true` rewritten as JSON Schema ("or
    null"), for jsonschema validators (which do not know `nullable`): the tool's parameters as checked by
    gateway/structured/tools/tool_schema.py in, a JSON Schema out."""
    return rewrite(schema, _nullable_node, TOOL_SUBSCHEMA_KEYWORDS)


def _nullable_node(schema: dict, out: dict, parent: str | None) -> dict:
    """One node of `validation_schema` (`out`: its copy, subschemas done)."""
    if out.pop("nullable", None) is not True:
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


def value_validator(schema: Any):
    """A validator of `schema` with its draft's own formats (FormatChecker() mixes drafts) whose `pattern`
    checks run in llguidance's linear-time dialect (gateway/structured/patterns.py), never Python's `re`."""
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
    error = next(iter(value_validator(validation_schema(params)).iter_errors(value)), None)
    if error is not None:
        raise ToolCallParseError(f"{name}: arguments do not match the schema: {error.message}")
    return value
