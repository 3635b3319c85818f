"""Tool parameters' JSON Schemas, checked and translated into Lark rules for the arguments' values.

The supported subset is documented in gateway/structured/tools/tool_calls.py ("JSON Schema support"); anything outside it is a
`ToolSchemaError` naming the keyword and path (fail closed). `SchemaRules` walks one tool's `parameters` and
writes Lark rules for its values in the bare-key call syntax Gemma 4 was trained on (families/gemma4/gateway.py:
objects `{key:value,...}` with bare keys in the chat template's `dictsort` order, strings between a delimiter
control token, numbers as Python prints them, `true`/`false`/`null`, arrays); the string delimiter's id is the
grammar's parameter (`ValueGrammar(string_id)`), so the rules reference the token by the id the served
vocabulary gives it. A format that writes arguments as JSON (Gemma 3's) runs the same walk only as its check
(`check_parameters`), so every format accepts and refuses exactly the same schemas.
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import llguidance

from gateway.core.lru import ByteLRU, text_size
from gateway.structured import patterns
from gateway.structured.json_schema import FORMAT_REGEXES
from gateway.structured.tools.tool_calls import (
    INTEGER_REGEX,
    NUMBER_REPR_REGEX,
    ToolSchemaError,
    escaped_at,
    int_range_regex,
    uint_range_regex,
    validation_schema,
    value_validator,
)


def _lark_regex(regex: str) -> str:
    return "/" + regex.replace("/", "\\/") + "/"


def _python_number(value: float) -> str:
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


class SchemaRules:
    """Translates one tool's `parameters` JSON Schema into Lark rules of its values in the bare-key syntax (module
    docstring), adding them to `grammar`; rule names start with `prefix`.

    Raises (from its methods):
      ToolSchemaError: a keyword or value outside the supported subset (naming the tool, keyword and path).
    """

    def __init__(self, grammar: ValueGrammar, tool: str, root: dict, prefix: str):
        self.g, self.tool, self.root, self.prefix = grammar, tool, root, prefix
        self.refs: dict[str, str] = {}

    def error(self, keyword: str, path: str, reason: str) -> ToolSchemaError:
        """The ToolSchemaError for `keyword` at `path` (a JSON pointer inside the parameters), saying why."""
        return ToolSchemaError(f"tool {self.tool!r}: JSON Schema keyword {keyword!r} at {path or '/'} is not "
                               f"supported: {reason}", self.tool, keyword, path)

    def rule(self, body: str) -> str:
        """Add a rule with this body; returns its name."""
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
        """The JSON types `core` allows (its `type`, else implied by its keywords; `nullable` adds "null")."""
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
        """The Lark expression of the values of type `t` valid against `core`."""
        if t == "null":
            return '"null"'
        if t == "boolean":
            return '"true" | "false"'
        if t == "string":
            return f"<[{self.g.string_id}]> {self.string_terminal(core, path)} <[{self.g.string_id}]>"
        if t in ("integer", "number"):
            return self.number(t, core, path)
        if t == "array":
            return self.array(core, path)
        return self.object(core, path)

    # -- references and combinations

    def ref(self, core: dict, path: str) -> str:
        """The rule of a local `$ref` (one rule per target, so recursive schemas terminate)."""
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
        """The rule of `anyOf` / `oneOf` (oneOf only with alternatives of different JSON types)."""
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
        """The rule of `enum` / `const`: the scalar values that also satisfy the sibling keywords."""
        kw = "enum" if "enum" in core else "const"
        values = core["enum"] if kw == "enum" else [core["const"]]
        if not isinstance(values, list) or not values:
            raise self.error(kw, path, "expected a non-empty list")
        siblings = {k: v for k, v in core.items() if k not in ("enum", "const")}
        if siblings.keys() - {"type", "nullable"} - _STRING_KW - _NUMBER_KW:
            raise self.error(kw, path, f"{kw} together with {sorted(siblings.keys())}")
        if core.get("nullable") is True and None not in values:
            values = [*values, None]
        check = value_validator(validation_schema(siblings))
        alts = []
        for v in values:
            if isinstance(v, (dict, list)) or (isinstance(v, float) and not math.isfinite(v)):
                raise self.error(kw, path, f"only string, number, boolean and null values, got {v!r}")
            if not check.is_valid(v):
                continue
            if isinstance(v, str):
                s = self.g.string_id
                alts.append(f"<[{s}]> {json.dumps(v)} <[{s}]>" if v else f"<[{s}]> <[{s}]>")
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
        """The terminal of a string's text (between the delimiters): length, `pattern` and `format`."""
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
            if fmt not in FORMAT_REGEXES:
                raise self.error("format", path, f"format {fmt!r} (supported: {', '.join(sorted(FORMAT_REGEXES))})")
            parts.append(FORMAT_REGEXES[fmt])
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
        """The terminal of an integer or number within its bounds, as Python prints it."""
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
        pos = uint_range_regex(max(lo_i, 0) if lo_i is not None else 0, None if hi_i is None else hi_i - 1)
        neg = None
        if lo_i is None or lo_i < 0:
            neg = uint_range_regex(max(-hi_i, 0) if hi_i is not None else 0, None if lo_i is None else -lo_i - 1)
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
        """The rule of an array: `items`, `minItems`, `maxItems`."""
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
        """The rule of an object: its declared keys in `dictsort` order (required ones mandatory), or free-form
        identifier keys when it declares no `properties`."""
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


_REGEX_PROBLEMS: ByteLRU[str, str] = ByteLRU(4 << 20, text_size)


def _regex_problem(regex: str) -> str:
    """'' if llguidance compiles `regex` as a terminal within its budget, else its error message (cached)."""
    problem = _REGEX_PROBLEMS.get(regex)
    if problem is None:
        problem = llguidance.LLMatcher.validate_grammar(f"start: T\nT: {_lark_regex(regex)}\n",
                                                        limits=patterns.LIMITS)
        _REGEX_PROBLEMS.put(regex, problem)
    return problem


class ValueGrammar:
    """Collects the rules and terminals of one grammar's argument values; strings are delimited by the control
    token `string_id` (Gemma 4's `<|"|>`, by the id the served vocabulary gives it)."""

    def __init__(self, string_id: int):
        self.string_id = string_id
        self.rules: dict[str, str] = {}
        self.terminals: dict[str, str] = {}  # expression -> name
        self.counter = 0
        self.need_any = False
        self.need_any_key = False

    def new_name(self, prefix: str) -> str:
        """A fresh rule name starting with `prefix`."""
        self.counter += 1
        return f"{prefix}{self.counter}"

    def add_rule(self, prefix: str, body: str) -> str:
        """Add a rule named after `prefix`; returns its name."""
        name = self.new_name(prefix)
        self.rules[name] = body
        return name

    def terminal(self, *regexes: str) -> str:
        """The terminal matching all of `regexes` (an intersection), one name per distinct expression."""
        return self.terminal_expr(" & ".join(_lark_regex(r) for r in regexes))

    def terminal_expr(self, expr: str) -> str:
        """The terminal of a Lark terminal expression (deduplicated)."""
        if expr not in self.terminals:
            self.terminals[expr] = f"T{len(self.terminals)}"
        return self.terminals[expr]

    def any_value(self) -> str:
        """The rule of any Gemma value (free-form objects and arrays; keys are identifiers)."""
        self.need_any = self.need_any_key = True
        return "any_value"

    def text(self) -> str:
        """The grammar text: the rules, the any-value rules when used, the terminals."""
        lines = [f"{name}: {body}" for name, body in self.rules.items()]
        if self.need_any:
            s = self.string_id
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


def check_parameters(name: str, parameters: dict) -> None:
    """Check one tool's `parameters` schema against the supported subset, as a format that writes its arguments
    as JSON does (it builds its grammar with llguidance's JSON compiler, but must refuse what Gemma 4's cannot
    enforce, so both formats accept the same tools).

    Raises:
      ToolSchemaError: the schema uses something outside the subset (the error names the keyword and path).
    """
    SchemaRules(ValueGrammar(string_id=0), name, parameters or {}, "x_").parameters()


def relax_parameters(name: str, parameters: dict, max_drops: int = 64) -> tuple[dict, list[str]]:
    """A copy of a tool's `parameters` with every keyword the supported subset cannot enforce removed (an unknown
    `format`, `propertyNames`, ...), and what was removed ("keyword at /path"). For tools a client does not ask to
    be strict (Anthropic tools, Responses tools with `strict: false`): agent clients send dozens of tools, and one
    odd keyword should loosen that tool's arguments, not refuse the whole turn.

    Raises:
      ToolSchemaError: a problem that removing a keyword cannot fix (the tool itself, an unresolvable `$ref`),
        or more than `max_drops` removals.
    """
    schema = copy.deepcopy(parameters or {})
    dropped: list[str] = []
    for _ in range(max_drops + 1):
        try:
            check_parameters(name, schema)
            return schema, dropped
        except ToolSchemaError as err:
            node = _at_pointer(schema, err.path)
            if not isinstance(node, dict) or err.keyword not in node or len(dropped) >= max_drops:
                raise
            del node[err.keyword]
            dropped.append(f"{err.keyword} at {err.path or '/'}")
    raise ToolSchemaError(f"tool {name!r}: too many unsupported keywords", name, "parameters", "")


def _at_pointer(schema: Any, pointer: str) -> Any:
    """The node of `schema` at a JSON pointer ("" is the root), or None."""
    node = schema
    for part in pointer.split("/")[1:] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
