"""Chat templates rendered as segments, so message content is always data.

A template produces a list of `Segment`s: control tokens (`<bos>`, `<|turn>`...) and text. Text segments are
tokenized with control-token parsing off, control segments map to their ids, so text typed by a user
(`<end_of_turn>` inside a message) can never become a control token, and every prompt has exactly one BOS (the
one the template emits). For content free of control-token spellings, the ids equal those of rendering the
official Jinja template to a string and tokenizing it with special tokens parsed (tests prove this).

Every renderer has one signature, `render(messages, add_generation_prompt, tools, options, *, tool_choice="auto")
-> list[Segment]`: `tools` is the OpenAI `tools` array (list of dicts, [] for none), `options` the template kwargs
(e.g. {"enable_thinking": True}), `tool_choice` the request's resolved mode ("auto", "required", "named" or
"none"; only the Gemma 3 renderer reads it). `TEMPLATES` maps the built-in names to renderers; a checkpoint's own
`chat_template.jinja` is rendered by a `JinjaTemplate`, which has the same call signature.
`continue_final_message` wraps any of them to end the prompt inside the final assistant message (a prefilled
answer the model continues).

Gemma 3 (docs/formats.md §4.1; the `chat_template` of Hugging Face `google/gemma-3-*-it` tokenizer_config.json):
`<bos>`, then per message `<start_of_turn>{role}\\n{content|trim}<end_of_turn>\\n` with role assistant -> model;
a leading system (or developer) message is folded into the first user turn as `{system}\\n\\n`; roles must
alternate user/model starting with user; generation prompt `<start_of_turn>model\\n`. Gemma 3 has no tool
format: with tools, tool calls or tool results the renderer writes this project's JSON tool format (documented in
gateway/tool_calls.py, whose grammars make the model answer in it).

Gemma 4 (docs/formats.md §4.2-4.4; Google's Gemma 4 E2B/E4B `chat_template.jinja`, July 2026 revision, whose text is
kept in tests/tokenizer_svc/data/gemma4_chat_template.jinja): see `render_gemma4`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import secrets
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from tokenizer_svc.tokenizer import TextTokenizer


class TemplateError(ValueError):
    """The conversation cannot be rendered by the template; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """A piece of a rendered prompt: a control token (by spelling), plain text, or exact token ids (an assistant
    message's generated tokens, rendered verbatim).

    An ids segment carries `fallback`: the segments the template renders for the same part of the message. The
    ids are used only when their control tokens are exactly the fallback's (in order) — ids a client got by
    forcing a control token (say with logit_bias) never forge a turn; `tokenize_segments` renders the fallback
    instead.
    """

    text: str
    control: bool = False
    ids: tuple[int, ...] | None = None
    fallback: tuple["Segment", ...] = ()


@dataclasses.dataclass
class Message:
    """A chat message (OpenAI shape, already validated for types).

    Attributes:
      role: "system", "developer", "user", "assistant" or "tool".
      content: string content, or None (null / list form).
      parts: list-form content as (type, text) pairs.
      tool_calls: (id, name, arguments_json) of an assistant message.
      tool_call_id: for role "tool".
      name: optional author / function name.
      reasoning: reasoning text of an assistant message.
    """

    role: str
    content: str | None = None
    parts: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    tool_calls: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    tool_call_id: str = ""
    name: str = ""
    reasoning: str = ""
    generated_ids: tuple[int, ...] = ()


Renderer = Callable[..., list[Segment]]
"""`render(messages, add_generation_prompt, tools, options, *, tool_choice="auto") -> segments`, the signature of
every template."""

ROLES = ("system", "developer", "user", "assistant", "tool")


def _control(text: str) -> Segment:
    return Segment(text, control=True)


def _text_of(msg: Message, index: int, trim: bool) -> str:
    """The message's text: the string content, or its text parts joined (each trimmed, as the template does)."""
    if msg.content is not None:
        return msg.content.strip() if trim else msg.content
    texts = []
    for kind, text in msg.parts:
        if kind != "text":
            raise TemplateError(f"messages[{index}]: content part type {kind!r} is not supported by this text-only model")
        texts.append(text.strip() if trim else text)
    if not msg.parts:
        raise TemplateError(f"messages[{index}] ({msg.role}) has no content")
    return "".join(texts)


def _check_roles(messages: list[Message]) -> None:
    if not messages:
        raise TemplateError("messages must contain at least one message")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise TemplateError(f"messages[{i}]: unknown role {m.role!r}")


# --------------------------------------------------------------------------------------- cut-off tool calls
# An answer cut by `max_tokens` inside a call returns that call with the arguments written so far: a prefix of a
# JSON object (gateway/tool_parsers.py: Gemma 3 arguments are the generated JSON text; Gemma 4's are its syntax
# converted to JSON as it streams). Sent back, such a call is rendered as generated — left open — so the
# conversation re-tokenizes as the model wrote it. Only an answer's last call can be cut.

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


def call_arguments(arguments_json: str, where: str, last: bool) -> dict | None:
    """A call's `arguments` text -> dict ("" means no arguments), or None for a cut-off call: `last` (the answer's
    last call) and the text a prefix of a JSON object.

    Raises:
      TemplateError: not JSON (and not such a prefix), or not a JSON object.
    """
    if last and arguments_json.strip():
        try:
            if not scan_json_prefix(arguments_json)[1]:
                return None
        except ValueError:
            pass  # parse_tool_arguments names the problem
    return parse_tool_arguments(arguments_json, where)


def gemma4_arguments_prefix(arguments_json: str) -> list[Segment]:
    """A cut-off call's arguments (a JSON object prefix) in Gemma 4's call syntax, as far as they go: bare keys,
    strings `<|"|>…` (closed only when complete), scalars as written; nothing is closed. The inverse of the
    conversion gateway/tool_parsers.py makes while the call streams, so the prefix the parser returned renders
    as the model generated it.

    Raises:
      ValueError: not a JSON object prefix.
    """
    out: list[Segment] = []
    for kind, value, complete in scan_json_prefix(arguments_json)[0]:
        if kind == "string":
            out += [_control(_Q), Segment(value)] + ([_control(_Q)] if complete else [])
        else:
            out.append(Segment(value))
    return out


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


# ---------------------------------------------------------------------------------------------------- Gemma 3


GEMMA3_TOOLS_INTRO = (
    "You can call these tools. Each line is one tool's name, description and JSON Schema parameters:\n"
)
#: The intro under `tool_choice: "none"`: the tools are described (as OpenAI does) but nothing invites a call.
GEMMA3_TOOLS_NONE_INTRO = (
    "These tools exist but cannot be called in this answer. Each line is one tool's name, description and JSON "
    "Schema parameters:\n"
)
GEMMA3_TOOLS_HOWTO = (
    "To call tools, answer with only a JSON object of this form and nothing else:\n"
    '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}\n'
    "List several calls to run them in parallel. Otherwise answer normally. Tool results come back in the next "
    "user turn."
)


def gemma3_tools_text(tools: list[dict], callable_: bool = True) -> str:
    """The Gemma 3 tool declarations (gateway/tool_calls.py documents the format): the intro, one JSON line per
    tool (name, description, parameters), a blank line, the instructions. With `callable_` false (`tool_choice:
    "none"`) only the "cannot be called" intro and the declaration lines: no call format, whose JSON example a
    model would copy into its answer.

    Raises:
      TemplateError: a tool is not {"type": "function", "function": {"name": ..., ...}}.
    """
    lines = []
    for t, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TemplateError(f"tools[{t}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        decl = {"name": function["name"], "description": function.get("description") or "",
                "parameters": function.get("parameters") or {"type": "object", "properties": {}}}
        lines.append(json.dumps(decl, ensure_ascii=False))
    if not callable_:
        return GEMMA3_TOOLS_NONE_INTRO + "\n".join(lines)
    return GEMMA3_TOOLS_INTRO + "\n".join(lines) + "\n\n" + GEMMA3_TOOLS_HOWTO


def gemma3_tool_calls_text(calls: list[tuple[str, str, str]], where: str) -> str:
    """An assistant message's calls in the Gemma 3 JSON format: `{"tool_calls": [{"name": N, "arguments": A}, ...]}`
    with each `arguments` JSON text inserted verbatim (stripped; "" -> {}), so generated calls re-render exactly.
    A last call cut off by max_tokens (its arguments a JSON object prefix) ends the text where the generation
    ended: its arguments as they are, nothing closed.

    Raises:
      TemplateError: arguments that are not a JSON object (nor, for the last call, a prefix of one).
    """
    text = '{"tool_calls": ['
    for c, (_, name, arguments) in enumerate(calls):
        head = (", " if c else "") + '{"name": ' + json.dumps(name) + ', "arguments": '
        if call_arguments(arguments, f"{where}.tool_calls[{c}]", last=c == len(calls) - 1) is None:
            return text + head + arguments.lstrip()
        text += head + (arguments.strip() or "{}") + "}"
    return text + "]}"


def _gemma3_turns(body: list[Message], offset: int) -> list[tuple[str, int, list]]:
    """Messages -> (role, index of the first message, content pieces) turns. Tool results answering a call
    message form one user turn ("Tool result for NAME (ID):\n{content}" blocks), and a user message right after
    them joins that turn; a piece is text or a Segment of generated ids (its fallback: the text)."""
    turns: list[tuple[str, int, list]] = []
    calls: list[tuple[str, str, str]] = []
    for n, m in enumerate(body):
        i = n + offset
        if m.role in ("system", "developer"):
            raise TemplateError(f"messages[{i}]: a {m.role} message is only supported as the first message")
        if m.tool_calls and m.role != "assistant":
            raise TemplateError(f"messages[{i}]: only assistant messages can have tool_calls")
        if m.role == "tool":
            prev = body[n - 1].role if n else None
            if not calls or prev not in ("assistant", "tool"):
                raise TemplateError(
                    f"messages[{i}]: a tool message must directly follow an assistant message with tool_calls "
                    "(or another tool message answering the same calls)"
                )
            name = next((nm for cid, nm, _ in calls if cid == m.tool_call_id), m.name)
            if not name:
                raise TemplateError(f"messages[{i}]: tool_call_id {m.tool_call_id!r} matches none of the tool calls")
            label = f"Tool result for {name}" + (f" ({m.tool_call_id})" if m.tool_call_id else "") + ":\n"
            block = label + (_tool_result_text(m, i) or "").strip()
            if prev == "tool":
                turns[-1][2].append("\n\n" + block)
            else:
                turns.append(("user", i, [block]))
            continue
        if m.role == "user" and n and body[n - 1].role == "tool":
            turns[-1][2].append("\n\n" + _text_of(m, i, trim=True))
            continue
        if m.role == "assistant":
            calls = list(m.tool_calls)
            if m.tool_calls:
                has_text = m.content is not None and m.content.strip() or m.parts
                text = _text_of(m, i, trim=True) if has_text else ""
                text = (text + "\n\n" if text else "") + gemma3_tool_calls_text(m.tool_calls, f"messages[{i}]")
            else:
                text = _text_of(m, i, trim=True)
            if m.generated_ids:
                turns.append(("assistant", i, [Segment("", ids=tuple(m.generated_ids), fallback=(Segment(text),))]))
            else:
                turns.append(("assistant", i, [text]))
        else:
            turns.append((m.role, i, [_text_of(m, i, trim=True)]))
    return turns


def _tool_result_text(msg: Message, index: int) -> str | None:
    if msg.content is not None or not msg.parts:
        return msg.content
    for kind, _ in msg.parts:
        if kind != "text":
            raise TemplateError(f"messages[{index}]: tool result part type {kind!r} is not supported")
    return "".join(text for _, text in msg.parts)


def render_gemma3(
    messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None = None, options: dict | None = None,
    *, tool_choice: str = "auto",
) -> list[Segment]:
    """Render a conversation with the Gemma 3 template (docs/formats.md §4.1). `options` are accepted and ignored.

    Without tools, tool calls and tool messages this is the official template. Gemma 3 has no tool format; this
    project's JSON format (documented in gateway/tool_calls.py) adds: tool declarations (`gemma3_tools_text`;
    under `tool_choice` "none" without the call instructions) at the start of the first user turn after the
    system text; assistant calls rendered as
    `{"tool_calls": [{"name": ..., "arguments": ...}]}` (`gemma3_tool_calls_text`); tool results as a user turn
    of "Tool result for NAME (ID):\n..." blocks, which a following user message joins.

    Raises:
      TemplateError: empty conversation, unknown role, system message not first, a tool message that does not
        answer a call message, malformed tools or tool-call arguments, non-text content, or roles that do not
        alternate user/assistant starting with user.
    """
    _check_roles(messages)
    prefix, body, offset = "", messages, 0
    if messages[0].role in ("system", "developer"):
        prefix, body, offset = _text_of(messages[0], 0, trim=False) + "\n\n", messages[1:], 1
    if tools:
        prefix += gemma3_tools_text(tools, callable_=tool_choice != "none") + "\n\n"
    segs = [_control("<bos>")]
    for n, (role, i, pieces) in enumerate(_gemma3_turns(body, offset)):
        expected = "user" if n % 2 == 0 else "assistant"
        if role != expected:
            got = messages[i].role
            raise TemplateError(
                f"messages[{i}]: roles must alternate user/assistant starting with user; got {got!r} where "
                f"{expected!r} was expected"
            )
        head = ("model" if role == "assistant" else "user") + "\n" + (prefix if n == 0 else "")
        content = [Segment(head)]
        for piece in pieces:
            content.append(piece if isinstance(piece, Segment) else Segment(piece))
        segs += [_control("<start_of_turn>"), *content, _control("<end_of_turn>"), Segment("\n")]
    if add_generation_prompt:
        segs += [_control("<start_of_turn>"), Segment("model\n")]
    return [s for s in segs if s.control or s.text or s.ids]


# ---------------------------------------------------------------------------------------------------- Gemma 4

_Q = '<|"|>'  # Gemma 4's string delimiter token (id 52)
_UNDEFINED = object()  # a Jinja Undefined: renders as "", is falsy


def parse_tool_arguments(arguments_json: str, where: str) -> dict:
    """A tool call's `arguments` JSON text -> dict ("" means no arguments). Gemma 4's template needs a mapping
    (its July 2026 revision refuses string arguments), so the text is parsed here.

    Raises:
      TemplateError: not JSON, or not a JSON object.
    """
    if not arguments_json.strip():
        return {}
    try:
        value = json.loads(arguments_json)
    except json.JSONDecodeError as err:
        raise TemplateError(f"{where}: arguments are not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise TemplateError(f"{where}: arguments must be a JSON object, got {type(value).__name__}")
    return value


def _jstr(value: Any) -> str:
    """Jinja's `{{ value }}`: Python's str(), Undefined -> ""."""
    return "" if value is _UNDEFINED else str(value)


def _jupper(value: Any) -> str:
    """Jinja's `value | upper`."""
    return _jstr(value).upper()


def _jget(value: Any, key: str) -> Any:
    """Jinja's `value[key]` for the keys the Gemma 4 template reads (a missing key is Undefined)."""
    return value.get(key, _UNDEFINED) if isinstance(value, dict) else _UNDEFINED


def _dictsort(mapping: dict) -> list[tuple[Any, Any]]:
    """Jinja's `dictsort`: by key, case-insensitively."""
    return sorted(mapping.items(), key=lambda kv: kv[0].lower() if isinstance(kv[0], str) else kv[0])


def _jiter(value: Any, where: str) -> list:
    if value is _UNDEFINED or value is None:
        return []
    try:
        return list(value)
    except TypeError:
        raise TemplateError(f"{where}: expected a list, got {type(value).__name__}") from None


def _fmt_argument(value: Any, escape_keys: bool = True) -> list[Segment]:
    """The template's `format_argument` macro: strings `<|"|>…<|"|>`, bools true/false, null, {k:v}, [..]."""
    if value is None:
        return [Segment("null")]
    if isinstance(value, str):
        return [_control(_Q), Segment(value), _control(_Q)]
    if isinstance(value, bool):
        return [Segment("true" if value else "false")]
    if isinstance(value, dict):
        out = [Segment("{")]
        for n, (key, item) in enumerate(_dictsort(value)):
            if n:
                out.append(Segment(","))
            out += [_control(_Q), Segment(str(key)), _control(_Q)] if escape_keys else [Segment(str(key))]
            out.append(Segment(":"))
            out += _fmt_argument(item, escape_keys)
        return out + [Segment("}")]
    if isinstance(value, (list, tuple)):
        out = [Segment("[")]
        for n, item in enumerate(value):
            if n:
                out.append(Segment(","))
            out += _fmt_argument(item, escape_keys)
        return out + [Segment("]")]
    return [Segment(_jstr(value))]


def _quoted_list(items: Iterable) -> list[Segment]:
    out: list[Segment] = []
    for n, item in enumerate(items):
        if n:
            out.append(Segment(","))
        out += [_control(_Q), Segment(_jstr(item)), _control(_Q)]
    return out


def _fmt_parameters(properties: dict, filter_keys: bool = False) -> list[Segment]:
    """The template's `format_parameters` macro: one `name:{description,enum|items,nullable,properties,
    required,type}` entry per property, properties sorted case-insensitively, types upper-cased."""
    standard_keys = ("description", "type", "properties", "required", "nullable")
    out: list[Segment] = []
    first = True
    for key, value in _dictsort(properties):
        if filter_keys and key in standard_keys:
            continue
        if not first:
            out.append(Segment(","))
        first = False
        fields: list[list[Segment]] = []
        description = _jget(value, "description")
        if description is not _UNDEFINED and description:
            fields.append([Segment("description:"), _control(_Q), Segment(_jstr(description)), _control(_Q)])
        vtype = _jupper(_jget(value, "type"))
        if vtype == "STRING":
            enum = _jget(value, "enum")
            if enum is not _UNDEFINED and enum:
                fields.append([Segment("enum:")] + _fmt_argument(enum))
        elif vtype == "ARRAY":
            items = _jget(value, "items")
            if isinstance(items, dict) and items:
                inner: list[Segment] = [Segment("items:{")]
                n = 0
                for item_key, item_value in _dictsort(items):
                    if item_value is None:
                        continue
                    if n:
                        inner.append(Segment(","))
                    n += 1
                    if item_key == "properties":
                        nested = _fmt_parameters(item_value) if isinstance(item_value, dict) else []
                        inner += [Segment("properties:{")] + nested + [Segment("}")]
                    elif item_key == "required":
                        inner += [Segment("required:[")] + _quoted_list(_jiter(item_value, key)) + [Segment("]")]
                    elif item_key == "type":
                        upper = _jupper(item_value) if isinstance(item_value, str) else [
                            _jupper(t) for t in _jiter(item_value, key)
                        ]
                        inner += [Segment("type:")] + _fmt_argument(upper)
                    else:
                        inner += [Segment(f"{item_key}:")] + _fmt_argument(item_value)
                fields.append(inner + [Segment("}")])
        nullable = _jget(value, "nullable")
        if nullable is not _UNDEFINED and nullable:
            fields.append([Segment("nullable:true")])
        if vtype == "OBJECT":
            nested_props = _jget(value, "properties")
            if isinstance(nested_props, dict):
                fields.append([Segment("properties:{")] + _fmt_parameters(nested_props) + [Segment("}")])
            elif isinstance(value, dict):
                fields.append([Segment("properties:{")] + _fmt_parameters(value, filter_keys=True) + [Segment("}")])
            required = _jget(value, "required")
            if required is not _UNDEFINED and required:
                fields.append([Segment("required:[")] + _quoted_list(_jiter(required, key)) + [Segment("]")])
        fields.append([Segment("type:"), _control(_Q), Segment(vtype), _control(_Q)])
        out.append(Segment(f"{_jstr(key)}:{{"))
        for n, field in enumerate(fields):
            out += ([Segment(",")] if n else []) + field
        out.append(Segment("}"))
    return out


def _fmt_declaration(tool: Any, index: int) -> list[Segment]:
    """The template's `format_function_declaration`: `declaration:NAME{description:…,parameters:{…}}`.

    Faithful to the template's quirks: the parameters object is closed only when it has a `type`, and a
    `response` declaration only when its type is OBJECT.
    """
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict):
        raise TemplateError(f"tools[{index}]: expected {{\"type\": \"function\", \"function\": {{...}}}}")
    out = [
        Segment(f"declaration:{_jstr(_jget(function, 'name'))}{{description:"),
        _control(_Q),
        Segment(_jstr(_jget(function, "description"))),
        _control(_Q),
    ]
    params = _jget(function, "parameters")
    if params is not _UNDEFINED and params:
        if not isinstance(params, dict):
            raise TemplateError(f"tools[{index}]: parameters must be a JSON Schema object")
        out.append(Segment(",parameters:{"))
        props = _jget(params, "properties")
        if props is not _UNDEFINED and props:
            if not isinstance(props, dict):
                raise TemplateError(f"tools[{index}]: parameters.properties must be an object")
            out += [Segment("properties:{")] + _fmt_parameters(props) + [Segment("},")]
        required = _jget(params, "required")
        if required is not _UNDEFINED and required:
            out += [Segment("required:[")] + _quoted_list(_jiter(required, f"tools[{index}]")) + [Segment("],")]
        ptype = _jget(params, "type")
        if ptype is not _UNDEFINED and ptype:
            out += [Segment("type:"), _control(_Q), Segment(_jupper(ptype)), _control(_Q), Segment("}")]
    if "response" in function:
        response = function["response"]
        out.append(Segment(",response:{"))
        description = _jget(response, "description")
        if description is not _UNDEFINED and description:
            out += [Segment("description:"), _control(_Q), Segment(_jstr(description)), _control(_Q), Segment(",")]
        if _jupper(_jget(response, "type")) == "OBJECT":
            out += [Segment("type:"), _control(_Q), Segment("OBJECT"), _control(_Q), Segment("}")]
    return out + [Segment("}")]


def strip_thinking(text: str) -> str:
    """The template's `strip_thinking` macro: drop every `<|channel>…<channel|>` block, then trim."""
    result = ""
    for part in text.split("<channel|>"):
        result += part.split("<|channel>")[0] if "<|channel>" in part else part
    return result.strip()


def _gemma4_thought(reasoning: str) -> list[Segment]:
    """The template's thought channel of an assistant message: `<|channel>thought\\n{reasoning}\\n<channel|>`."""
    return [_control("<|channel>"), Segment(f"thought\n{reasoning}\n"), _control("<channel|>")]


def gemma4_call_segments(calls: list[tuple[str, str, str]], where: str, cut_closed: bool = False) -> list[Segment]:
    """An assistant message's calls as the Gemma 4 template writes them:
    `<|tool_call>call:NAME{key:value,…}<tool_call|>` per call, keys sorted as the template's `dictsort`.

    A last call cut off by max_tokens (arguments a JSON object prefix) is written as it was generated, left open:
    `<|tool_call>call:NAME{key:<|"|>partial` (`gemma4_arguments_prefix`), no closing; with `cut_closed`, as a
    template given the mapping it had reached (`close_json_prefix`) writes it, closed.

    Raises:
      TemplateError: arguments that are not a JSON object (nor, for the last call, a prefix of one).
    """
    out: list[Segment] = []
    for c, (_, name, arguments_json) in enumerate(calls):
        args = call_arguments(arguments_json, f"{where}.tool_calls[{c}]", last=c == len(calls) - 1)
        out += [_control("<|tool_call>"), Segment(f"call:{name}")]
        if args is None and not cut_closed:
            return out + gemma4_arguments_prefix(arguments_json)
        out.append(Segment("{"))
        for a, (key, value) in enumerate(_dictsort(close_json_prefix(arguments_json) if args is None else args)):
            out += [Segment(("," if a else "") + f"{key}:")] + _fmt_argument(value, escape_keys=False)
        out += [Segment("}"), _control("<tool_call|>")]
    return out


def _gemma4_text(msg: Message, index: int, model: bool, system: bool = False) -> str:
    """A message's content as the Gemma 4 template renders it: user/system text trimmed, model text with
    thought channels stripped, text parts joined (system parts each followed by a space); null -> ""."""
    if msg.content is not None:
        return strip_thinking(msg.content) if model else msg.content.strip()
    out = ""
    for kind, text in msg.parts:
        if kind != "text":
            raise TemplateError(f"messages[{index}]: content part type {kind!r} is not supported by this text-only model")
        out += strip_thinking(text) if model else text.strip() + (" " if system else "")
    return out


def _tool_result_body(msg: Message, index: int) -> str | None:
    """A tool message's content: a string is used as is (JSON text is *not* parsed), text parts are joined."""
    if msg.content is not None:
        return msg.content
    if not msg.parts:
        return None
    for kind, _ in msg.parts:
        if kind != "text":
            raise TemplateError(f"messages[{index}]: tool result part type {kind!r} is not supported")
    return "".join(text for _, text in msg.parts)


def render_gemma4(
    messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None = None, options: dict | None = None,
    *, tool_choice: str = "auto",
) -> list[Segment]:
    """Render a conversation with the Gemma 4 template (docs/formats.md §4.2-4.4; Google's E2B/E4B
    `chat_template.jinja`, July 2026 revision, mirrored branch for branch).

    Layout: `<bos>`; a system turn `<|turn>system\\n[<|think|>\\n]{system text}{<|tool>declaration:…<tool|>…}
    <turn|>\\n` when thinking is on, tools are given, or the first message is system/developer; then
    `<|turn>{user|model|system}\\n{content}<turn|>\\n` per message. An assistant message renders its reasoning
    (`<|channel>thought\\n{reasoning}\\n<channel|>`) when it comes after the last user message (or, with the
    `preserve_thinking` option, when it has tool calls), then its calls `<|tool_call>call:NAME{k:v,…}<tool_call|>`
    (a last call cut off by max_tokens as generated, left open: `gemma4_call_segments`), then the results of the
    tool messages that follow it, in the same model turn
    (`<|tool_response>response:NAME{value:<|"|>…<|"|>}<tool_response|>`, NAME found by tool_call_id), then its
    text. A following assistant message continues the same model turn. Calls without results end with
    `<|tool_response>`. Generation prompt: `<|turn>model\\n` (E2B/E4B revision: no empty thought channel),
    nothing after a tool call, and after tool results only `<|channel>thought\\n` when thinking is on.
    An answer's generated ids stand for all it wrote, in the model's order (thought, text, calls), with that
    part as their fallback; its text is then not written again after the results.

    Options: `enable_thinking`, `preserve_thinking` (truthy values, as in Jinja). `tool_choice` is accepted and
    ignored: the declarations stay as the model was trained on them, and under "none" the gateway bans the call
    tokens instead.

    Raises:
      TemplateError: empty conversation, unknown role, a tool message that does not follow an assistant
        message with tool calls (or matches none of its calls and has no name), non-text content, malformed
        tool-call arguments or tool declarations.
    """
    _check_roles(messages)
    tools = tools or []
    options = options or {}
    enable_thinking = bool(options.get("enable_thinking", False))
    preserve_thinking = bool(options.get("preserve_thinking", False))
    segs = [_control("<bos>")]
    prev_type: str | None = None
    first_system = messages[0].role in ("system", "developer")
    offset = 1 if first_system else 0
    body = messages[offset:]
    if enable_thinking or tools or first_system:
        segs += [_control("<|turn>"), Segment("system\n")]
        if enable_thinking:
            segs += [_control("<|think|>"), Segment("\n")]
            prev_type = "think"
        if first_system:
            segs.append(Segment(_gemma4_text(messages[0], 0, model=False, system=True)))
        for t, tool in enumerate(tools):
            segs += [_control("<|tool>")] + _fmt_declaration(tool, t) + [_control("<tool|>")]
            prev_type = "tool"
        segs += [_control("<turn|>"), Segment("\n")]

    last_user = max((n for n, m in enumerate(body) if m.role == "user"), default=-1)
    next_role: list[str | None] = [None] * len(body)  # role of the next non-tool message
    for n in range(len(body) - 2, -1, -1):
        next_role[n] = body[n + 1].role if body[n + 1].role != "tool" else next_role[n + 1]
    consumed: set[int] = set()
    prev_non_tool_role: str | None = None
    for n, m in enumerate(body):
        i = n + offset
        if m.role == "tool":
            if n not in consumed:
                raise TemplateError(
                    f"messages[{i}]: a tool message must directly follow an assistant message with tool_calls "
                    "(or another tool message answering the same calls)"
                )
            continue
        if m.tool_calls and m.role != "assistant":
            raise TemplateError(f"messages[{i}]: only assistant messages can have tool_calls")
        prev_type = None
        role = "model" if m.role == "assistant" else m.role
        if not (role == "model" and prev_non_tool_role == "assistant"):
            segs += [_control("<|turn>"), Segment(f"{role}\n")]
        thought = []
        if m.reasoning and (n > last_user or (preserve_thinking and m.tool_calls)):
            thought = _gemma4_thought(m.reasoning)
        calls = [(call_id, name) for call_id, name, _ in m.tool_calls]
        call_segs = gemma4_call_segments(m.tool_calls, f"messages[{i}]")
        prev_type = "tool_call" if calls else prev_type
        text = _gemma4_text(m, i, model=role == "model")
        # An answer's generated ids stand for all the model wrote, in its order: thought, text, calls (the
        # template writes text after the calls' results; with the ids it is where the model wrote it).
        generated = tuple(m.generated_ids) if role == "model" else ()
        if generated:
            written = thought + [Segment(text)] + call_segs
            segs.append(Segment("", ids=generated, fallback=tuple(s for s in written if s.control or s.text)))
            text = "" if calls else text or "x"  # without calls: non-empty, the turn is closed as for any answer
        else:
            segs += thought + call_segs
        has_results = False
        if calls:
            k = n + 1
            while k < len(body) and body[k].role == "tool":
                result = body[k]
                name = result.name or "unknown"
                matched = False
                for call_id, call_name in calls:
                    if call_id == result.tool_call_id:
                        name, matched = call_name, True
                if not matched and not result.name:
                    raise TemplateError(
                        f"messages[{k + offset}]: tool_call_id {result.tool_call_id!r} matches none of the tool calls "
                        f"of messages[{i}]"
                    )
                segs += [_control("<|tool_response>"), Segment(f"response:{name}{{value:")]
                segs += _fmt_argument(_tool_result_body(result, k + offset), escape_keys=False)
                segs += [Segment("}"), _control("<tool_response|>")]
                consumed.add(k)
                has_results, prev_type = True, "tool_response"
                k += 1
        if not generated:
            segs.append(Segment(text))
        continues_into_next = role == "model" and next_role[n] == "assistant" and (not calls or has_results)
        if prev_type == "tool_call" and not has_results:
            segs.append(_control("<|tool_response>"))
        elif continues_into_next:
            pass
        elif not (has_results and not text.strip() and next_role[n] is None):
            segs += [_control("<turn|>"), Segment("\n")]
        prev_non_tool_role = m.role

    if add_generation_prompt:
        if prev_type not in ("tool_response", "tool_call"):
            segs += [_control("<|turn>"), Segment("model\n")]
        elif prev_type == "tool_response" and enable_thinking:
            segs += [_control("<|channel>"), Segment("thought\n")]
    return [s for s in segs if s.control or s.text or s.ids]


# ---------------------------------------------------------------------------------------- checkpoint templates

_ESC = "\ue000"  # starts an escape inside message data; the data's own U+E000 is written twice
_CODE_BASE = 0xF0000  # control token i is escaped as _ESC + chr(_CODE_BASE + i) (Supplementary PUA-A)
_MAX_CODES = 0xFFFFE - _CODE_BASE
_IDS_BASE = 0x100000  # message k's generated ids are marked as _ESC + chr(_IDS_BASE + k) (Supplementary PUA-B)


def _trie_regex(tokens: Iterable[str]) -> str:
    """A regex matching any of `tokens`, leftmost-longest, with common prefixes factored out: a plain
    alternation of Gemma's ~6,000 control tokens is orders of magnitude slower per "<" in the text
    (figures: docs/performance.md)."""
    trie: dict = {}
    for token in tokens:
        node = trie
        for ch in token:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch != ""]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return build(trie)


def _compile_jinja(source: str):
    """Compile a chat template the way transformers does (utils/chat_template_utils.py,
    `_cached_compile_jinja_template`): ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols),
    its `tojson` filter (no HTML escaping, ensure_ascii off), `raise_exception` and `strftime_now` globals, and
    the `{% generation %}` tag (rendered as its body; we do not track assistant masks).

    Raises:
      TemplateError: the template does not parse.
    """
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise TemplateError(f"the chat template does not parse: {err} (line {err.lineno})") from None


class JinjaTemplate:
    """A checkpoint's Jinja chat template (`chat_template.jinja`), rendered as transformers renders it
    (`apply_chat_template` -> `render_jinja_template`: variables messages, tools, add_generation_prompt, the
    special-token strings bos_token/eos_token/..., and the template kwargs; keys whose value is null are dropped
    from messages) but with message content kept as data:

    1. every control-token spelling (the tokenizer's special tokens) inside the request's strings — message
       fields, tool-call arguments, tools, option values, and dict keys inside them — is replaced by a private
       escape (U+E000 + a Supplementary-Private-Use code; a U+E000 already in the data is doubled), so the
       template never sees a control token that came from the user;
    2. the rendered text is split on control-token spellings: those are the template's own, and become control
       segments;
    3. the text between them is un-escaped (restoring the user's spellings) and is tokenized later with
       control-token parsing off.

    Limits: a template that inspects content for control tokens (Gemma 4's `strip_thinking` splitting assistant
    content on `<channel|>`) does not see the user's spellings, so they stay text instead of being stripped; a
    control token the template assembles from user text plus its own literal text is a control token.
    Tool-call arguments are parsed from JSON into mappings (OpenAI sends a JSON string; Gemma 4's template needs
    a mapping); a last call cut off by max_tokens becomes the mapping it had reached. Where the template writes
    an answer's calls (and thought) exactly as Gemma 4's template does, that part of the output is replaced by the
    answer's generated ids or by its cut call left open, as generated (`_answers_to_splice`). If the rendered
    prompt does not start with BOS, BOS is prepended (exactly one BOS).
    """

    def __init__(self, source: str, control_tokens: Iterable[str], special_tokens: dict[str, str] | None = None,
                 special_ids: Iterable[int] = ()):
        """Args:
          source: the template text.
          control_tokens: spellings of the tokenizer's control (special) tokens.
          special_tokens: template variables such as {"bos_token": "<bos>", "eos_token": "<eos>"}.
          special_ids: the control tokens' ids (generated ids containing one are not rendered verbatim).

        Raises:
          TemplateError: the template does not parse.
          ValueError: more control tokens than escape codes (65,534).
        """
        self.source = source
        self._template = _compile_jinja(source)
        tokens = sorted({t for t in control_tokens if t}, key=lambda t: (-len(t), t))
        if len(tokens) > _MAX_CODES:
            raise ValueError(f"{len(tokens)} control tokens exceed the {_MAX_CODES} escape codes")
        self.control_tokens = tokens
        self._code = {t: _ESC + chr(_CODE_BASE + n) for n, t in enumerate(tokens)}
        self._token_of = {chr(_CODE_BASE + n): t for n, t in enumerate(tokens)}
        self._pattern = re.compile(_trie_regex(tokens)) if tokens else None
        self._splitter = re.compile(f"({self._pattern.pattern})") if tokens else None
        self.special_tokens = dict(special_tokens or {})
        self.special_ids = frozenset(special_ids)

    @classmethod
    def for_tokenizer(cls, source: str, tokenizer: TextTokenizer) -> JinjaTemplate:
        """A template whose control tokens are `tokenizer`'s special tokens and whose bos/eos/pad/unk variables
        are its spellings."""
        spell = tokenizer.tok.id_to_token
        controls = [spell(i) for i in sorted(tokenizer.special_ids)]
        special = {"bos_token": spell(tokenizer.bos_id), "eos_token": spell(tokenizer.eos_id)}
        pad = spell(tokenizer.pad_id)
        if pad is not None:
            special["pad_token"] = pad
        unk = tokenizer.tok.token_to_id("<unk>")
        if unk is not None:
            special["unk_token"] = "<unk>"
        return cls(source, [c for c in controls if c is not None], {k: v for k, v in special.items() if v},
                   tokenizer.special_ids)

    @classmethod
    def from_file(cls, path: pathlib.Path, tokenizer: TextTokenizer) -> JinjaTemplate:
        """Load `path` (a checkpoint's chat_template.jinja) for `tokenizer`.

        Raises:
          TemplateError: the template does not parse (the message names the file).
        """
        try:
            return cls.for_tokenizer(pathlib.Path(path).read_text(encoding="utf-8"), tokenizer)
        except TemplateError as err:
            raise TemplateError(f"{path}: {err}") from None

    # -- escaping --------------------------------------------------------------------------------------------

    def escape(self, value: Any) -> Any:
        """Replace control-token spellings in every string of `value` (recursively, dict keys too)."""
        if isinstance(value, str):
            value = value.replace(_ESC, _ESC + _ESC)
            return self._pattern.sub(lambda m: self._code[m.group()], value) if self._pattern else value
        if isinstance(value, dict):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v) for v in value]
        return value

    def unescape(self, text: str) -> str:
        """Undo `escape` in a piece of rendered text (unknown or cut escapes stay as they are)."""
        if _ESC not in text:
            return text
        out, i = [], 0
        while i < len(text):
            ch = text[i]
            nxt = text[i + 1] if i + 1 < len(text) else ""
            if ch == _ESC and nxt == _ESC:
                out.append(_ESC)
                i += 2
            elif ch == _ESC and nxt in self._token_of:
                out.append(self._token_of[nxt])
                i += 2
            else:
                out.append(ch)
                i += 1
        return "".join(out)

    def split(self, rendered: str, generated: dict[int, tuple[int, ...]] | None = None) -> list[Segment]:
        """Rendered text -> segments: control-token spellings are control segments, generated-ids markers are
        ids segments, the rest un-escaped text."""
        pieces = self._splitter.split(rendered) if self._splitter else [rendered]
        segs = []
        for n, piece in enumerate(pieces):
            if n % 2:
                segs.append(_control(piece))
            elif piece:
                segs += self._text_and_ids(piece, generated or {})
        return segs

    def _text_and_ids(self, piece: str, generated: dict[int, tuple[int, ...]]) -> list[Segment]:
        """Split a text piece on generated-ids markers (an unpaired _ESC + marker code cannot come from data)."""
        out, text, i = [], "", 0
        while i < len(piece):
            if piece[i] == _ESC and i + 1 < len(piece):
                nxt = piece[i + 1]
                if nxt == _ESC or nxt in self._token_of:
                    text += piece[i : i + 2]
                    i += 2
                    continue
                if ord(nxt) - _IDS_BASE in generated:
                    out += [Segment(self.unescape(text)), Segment("", ids=generated[ord(nxt) - _IDS_BASE])]
                    text, i = "", i + 2
                    continue
            text += piece[i]
            i += 1
        out.append(Segment(self.unescape(text)))
        return [s for s in out if s.text or s.ids]

    # -- rendering -------------------------------------------------------------------------------------------

    def render(
        self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None = None,
        options: dict | None = None, *, tool_choice: str = "auto",
    ) -> list[Segment]:
        """Render the conversation. See the class docstring. `tool_choice` is accepted and ignored (the template
        decides how tools are declared; the gateway's grammar or banned ids enforce the choice).

        Raises:
          TemplateError: empty conversation, non-text content, malformed tool-call arguments, a reserved option
            name, or the template refused (`raise_exception`) or failed to render the conversation.
        """
        import jinja2

        if not messages:
            raise TemplateError("messages must contain at least one message")
        chat = [_message_dict(m, i) for i, m in enumerate(messages)]
        # A message's content holds data only, never a control token: ids with one are not used (see Segment)
        # unless they replace a thought or calls the template wrote in Gemma 4's syntax (`_answers_to_splice`).
        generated = {i: tuple(m.generated_ids) for i, m in enumerate(messages)
                     if m.role == "assistant" and m.generated_ids and not m.tool_calls
                     and not self.special_ids & set(m.generated_ids)}
        answers = _answers_to_splice(messages, self.special_ids)
        options = dict(options or {})
        for reserved in ("messages", "tools", "add_generation_prompt", "documents"):
            if reserved in options:
                raise TemplateError(f"template option {reserved!r} is reserved")
        variables = {**self.special_tokens, **self.escape(options)}
        try:
            while True:  # at most twice: answers whose splice fails are rendered by the template alone
                escaped = self.escape(chat)
                for i in generated:  # the marker is set after escaping, so it stays a single (unpaired) escape
                    escaped[i]["content"] = _ESC + chr(_IDS_BASE + i)
                _mark_answers(escaped, answers)
                rendered = self._template.render(
                    messages=escaped,
                    tools=self.escape(list(tools)) if tools else None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **variables,
                )
                segs, failed = _splice_answers(self, rendered, generated, answers)
                if not failed:
                    break
                answers = {i: a for i, a in answers.items() if i not in failed}
        except jinja2.exceptions.TemplateError as err:
            raise TemplateError(f"the chat template refused the conversation: {self.unescape(str(err))}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise TemplateError(f"the chat template failed on this conversation: {err!r}") from None
        bos = self.special_tokens.get("bos_token")
        if bos and not (segs and segs[0] == _control(bos)):
            segs.insert(0, _control(bos))
        return segs

    __call__ = render


def _message_dict(m: Message, index: int) -> dict:
    """Message -> the OpenAI-shaped dict a Jinja template reads (null fields left out, as transformers does;
    tool-call arguments parsed into a mapping — a last call cut off by max_tokens as the mapping it had reached,
    `close_json_prefix`; reasoning under reasoning_content and thinking)."""
    d: dict[str, Any] = {"role": m.role}
    if m.content is not None:
        d["content"] = m.content
    elif m.parts:
        for kind, _ in m.parts:
            if kind != "text":
                raise TemplateError(f"messages[{index}]: content part type {kind!r} is not supported by this text-only model")
        d["content"] = [{"type": "text", "text": text} for _, text in m.parts]
    if m.tool_calls:
        d["tool_calls"] = []
        for c, (call_id, name, args) in enumerate(m.tool_calls):
            arguments = call_arguments(args, f"messages[{index}].tool_calls[{c}]", last=c == len(m.tool_calls) - 1)
            arguments = close_json_prefix(args) if arguments is None else arguments
            d["tool_calls"].append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    if m.role == "tool" or m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.name:
        d["name"] = m.name
    if m.reasoning:
        d["reasoning_content"] = m.reasoning
        d["thinking"] = m.reasoning
    return d


@dataclasses.dataclass
class _Answer:
    """An assistant message whose thought and calls a checkpoint template's output gets in Gemma 4's syntax as the
    model wrote them (`_answers_to_splice`).

    Attributes:
      calls: anchored at its first call's name (else at its content: a thought answer without calls).
      thought: the thought channel the Gemma 4 template writes for its reasoning ([] without reasoning).
      text: its content as the Gemma 4 template writes model text.
      expected: its calls as the template writes them from mappings (a cut call closed), to find them.
      written: its calls as generated (a cut call left open).
      ids: its generated ids (() when not remembered).
      drop_content: the ids hold its text (before the calls), so the template must not write it again.
    """

    calls: bool
    thought: list[Segment]
    text: str
    expected: list[Segment]
    written: list[Segment]
    ids: tuple[int, ...]
    drop_content: bool


def _answers_to_splice(messages: list[Message], special_ids: frozenset[int]) -> dict[int, _Answer]:
    """The assistant messages a `JinjaTemplate` renders through `_splice_answers`: those with calls and generated
    ids or a cut-off last call, and thought answers (reasoning, no calls) whose ids hold a control token.

    Why: a template renders calls from mappings, so it can neither leave a cut-off call open nor write the exact
    ids of a thought or calls (they hold control tokens, which message content never becomes). Where the
    template writes calls (and the thought) exactly as Gemma 4's own template does, that part of its output is
    replaced by the ids (their `fallback`: the same part as generated) or, without ids, by the cut call left
    open; anywhere else (another call syntax) the template's rendering stands.

    Raises:
      TemplateError: malformed tool-call arguments.
    """
    out: dict[int, _Answer] = {}
    for i, m in enumerate(messages):
        ids = tuple(m.generated_ids)
        if m.role != "assistant" or not (m.tool_calls or (ids and m.reasoning and special_ids & set(ids))):
            continue
        where = f"messages[{i}]"
        cut = bool(m.tool_calls) and call_arguments(m.tool_calls[-1][2], f"{where}.tool_calls[{len(m.tool_calls) - 1}]",
                                                    last=True) is None
        if m.tool_calls and not (ids or cut):
            continue
        text = _gemma4_text(m, i, model=True)
        out[i] = _Answer(bool(m.tool_calls), _gemma4_thought(m.reasoning) if m.reasoning else [], text,
                         gemma4_call_segments(m.tool_calls, where, cut_closed=True),
                         gemma4_call_segments(m.tool_calls, where), ids,
                         drop_content=bool(m.tool_calls and ids and text))
    return out


def _mark_answers(escaped: list[dict], answers: dict[int, _Answer]) -> None:
    """Put each answer's anchor (a single escape, which data cannot form: its own escapes are doubled) into the
    escaped message dicts: before its first call's name, or as its content."""
    for i, answer in answers.items():
        mark = _ESC + chr(_IDS_BASE + i)
        if answer.calls:
            function = escaped[i]["tool_calls"][0]["function"]
            function["name"] = mark + function["name"]
            if answer.drop_content:
                escaped[i].pop("content", None)
        else:
            escaped[i]["content"] = mark


def _splice_answers(template: JinjaTemplate, rendered: str, generated: dict[int, tuple[int, ...]],
                    answers: dict[int, _Answer]) -> tuple[list[Segment], set[int]]:
    """Split a rendering (`JinjaTemplate.split`) with each answer's part replaced (`_answers_to_splice`).

    An answer with calls: right after its anchor the output must continue with its calls exactly as Gemma 4's
    template writes them (`expected`), optionally preceded by its thought channel; a thought answer: its thought
    channel right before the anchor. Returns (segments, the answers whose part was not found): the caller
    renders again without those.
    """
    marks = {chr(_IDS_BASE + i): i for i in answers}
    pieces, at, size, pos = [], {}, 0, 0
    for found in re.finditer(f"{_ESC}(.)", rendered, re.DOTALL):  # left to right: a doubled escape is data
        if found.group(1) in marks:
            pieces.append(rendered[pos:found.start()])
            size += found.start() - pos
            at.setdefault(marks[found.group(1)], size)
            pos = found.end()
    text = "".join(pieces) + rendered[pos:]

    def spelled(segs: list[Segment]) -> str:
        return "".join(s.text if s.control else template.escape(s.text) for s in segs)

    regions, failed = [], set()
    for i, answer in answers.items():
        start = end = at.get(i, -1)
        if answer.calls:
            start -= len("<|tool_call>call:")
            expected = spelled(answer.expected)
            end = start + len(expected)
            if start < 0 or text[start:end] != expected:
                failed.add(i)
                continue
        thought = spelled(answer.thought)
        wrote_thought = bool(thought) and start >= len(thought) and text[start - len(thought):start] == thought
        if start < 0 or not (answer.calls or wrote_thought):
            failed.add(i)
            continue
        start -= len(thought) if wrote_thought else 0
        written = (answer.thought if wrote_thought else []) + \
            ([Segment(answer.text)] if answer.drop_content or not answer.calls else []) + answer.written
        written = [s for s in written if s.control or s.text]
        regions.append((start, end, [Segment("", ids=answer.ids, fallback=tuple(written))] if answer.ids else written))
    segs: list[Segment] = []
    pos = 0
    for start, end, replacement in sorted(regions, key=lambda r: r[0]):
        if start < pos:  # overlapping parts cannot come from a template that writes calls as Gemma 4's does
            return [], {i for i in answers}
        segs += template.split(text[pos:start], generated) + replacement
        pos = end
    return segs + template.split(text[pos:], generated), failed


# ------------------------------------------------------------------------------------- continue final message


def continue_final_message(render: Renderer, messages: list[Message], tools: list[dict] | None = None,
                           options: dict | None = None, *, tool_choice: str = "auto") -> list[Segment]:
    """Render a conversation whose final (assistant) message is a prefilled answer to continue: the prompt ends
    right after that message's text — its turn left open, no generation prompt — as transformers'
    `apply_chat_template(continue_final_message=True)` does, for any renderer (built-in or `JinjaTemplate`).

    Like transformers, a marker is appended to the final message's text (its last text part for list content)
    and the rendering is cut where the marker lands. Unlike transformers, the text is kept as sent at its end:
    the marker sits after any trailing whitespace, so a template's `trim` cannot drop it (the continuation
    starts exactly where the client's text ends, whatever the template). The marker is a private-use character
    plus a random nonce, so message data cannot imitate it. The final message is rendered from its text, never
    from remembered generated ids.

    Raises:
      TemplateError: the final message is not an assistant message, has tool calls or no text to continue, or
        the template does not render its text (or anything `render` raises).
    """
    if not messages or messages[-1].role != "assistant":
        raise TemplateError("continue_final_message: the final message must be an assistant message")
    final, index = messages[-1], len(messages) - 1
    if final.tool_calls:
        raise TemplateError(f"continue_final_message: messages[{index}] has tool calls; only an answer's text can "
                            "be continued")
    mark = "\ue000continue-" + secrets.token_hex(8)
    if final.content is not None:
        marked = dataclasses.replace(final, content=final.content + mark, generated_ids=())
    else:
        last = max((k for k, (kind, _) in enumerate(final.parts) if kind == "text"), default=None)
        if last is None:
            raise TemplateError(f"continue_final_message: messages[{index}] has no text to continue")
        parts = list(final.parts)
        parts[last] = ("text", parts[last][1] + mark)
        marked = dataclasses.replace(final, parts=parts, generated_ids=())
    segments = render(messages[:-1] + [marked], False, tools, options, tool_choice=tool_choice)
    for i in range(len(segments) - 1, -1, -1):
        seg = segments[i]
        at = seg.text.rfind(mark) if not seg.control and seg.ids is None else -1
        if at >= 0:
            return segments[:i] + ([Segment(seg.text[:at])] if at else [])
    raise TemplateError("continue_final_message: the chat template does not render the final message's text, so "
                        "it cannot be continued")


# --------------------------------------------------------------------------------------------- tokenization


def tokenize_segments(segments: list[Segment], tokenizer: TextTokenizer) -> tuple[list[int], str]:
    """Segments -> (token ids, rendered text). Adjacent text segments are joined before encoding.

    Raises:
      TemplateError: a control token of the template is missing from the vocabulary.
    """
    segments = _resolve_generated(segments, tokenizer)
    ids: list[int] = []
    pending = ""
    for seg in segments + [Segment("", control=True)]:
        if not seg.control and seg.ids is None:
            pending += seg.text
            continue
        if pending:
            ids += tokenizer.encode(pending, parse_special=False)
            pending = ""
        if seg.ids is not None:
            ids += list(seg.ids)
        elif seg.text:
            try:
                ids.append(tokenizer.token_id(seg.text))
            except KeyError:
                raise TemplateError(f"the vocabulary has no control token {seg.text!r}") from None
    return ids, "".join(s.text if s.ids is None else tokenizer.decode(list(s.ids), False) for s in segments)


def _resolve_generated(segments: list[Segment], tokenizer: TextTokenizer) -> list[Segment]:
    """Each ids segment stays when its control tokens are exactly its fallback's, else becomes the fallback."""
    out: list[Segment] = []
    for seg in segments:
        if seg.ids is None:
            out.append(seg)
            continue
        expected = [tokenizer.token_id(f.text) for f in seg.fallback if f.control and f.text]
        actual = [t for t in seg.ids if t in tokenizer.special_ids]
        out += [seg] if actual == expected else list(seg.fallback)
    return out


TEMPLATES: dict[str, Renderer] = {"gemma3": render_gemma3, "gemma4": render_gemma4}
