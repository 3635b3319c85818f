"""Gemma 4's tokenizer part: its built-in chat template, the template's facts, and the answer syntax a checkpoint
template is matched against (see `families`).

The template: docs/formats.md §4.2-4.4; Google's Gemma 4 E2B/E4B `chat_template.jinja`, July 2026 revision,
whose text is kept in tests/tokenizer_svc/data/gemma4_chat_template.jinja: see `render`. Tool calls are written
in the model's native syntax (`<|tool_call>call:NAME{key:<|"|>v<|"|>}<tool_call|>`), thoughts in its channel
(`<|channel>thought\\n…<channel|>`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from common.json_prefix import close_json_prefix, scan_json_prefix
from tokenizer_svc.chat_template import (
    AnswerFormat,
    Message,
    Segment,
    TemplateError,
    TemplateFacts,
    TokenizerPart,
    call_arguments,
    check_roles,
    control,
    text_parts,
    tool_result_text,
)

TEMPLATE_FACTS = TemplateFacts(supports_tools=True, supports_thinking=True, end_of_turn=("<turn|>",))
"""Native tool calls and the thinking mode (`enable_thinking`, the thought channel)."""

_Q = '<|"|>'  # Gemma 4's string delimiter token (id 52)
_UNDEFINED = object()  # a Jinja Undefined: renders as "", is falsy


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
        return [control(_Q), Segment(value), control(_Q)]
    if isinstance(value, bool):
        return [Segment("true" if value else "false")]
    if isinstance(value, dict):
        out = [Segment("{")]
        for n, (key, item) in enumerate(_dictsort(value)):
            if n:
                out.append(Segment(","))
            out += [control(_Q), Segment(str(key)), control(_Q)] if escape_keys else [Segment(str(key))]
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
        out += [control(_Q), Segment(_jstr(item)), control(_Q)]
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
            fields.append([Segment("description:"), control(_Q), Segment(_jstr(description)), control(_Q)])
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
        fields.append([Segment("type:"), control(_Q), Segment(vtype), control(_Q)])
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
        control(_Q),
        Segment(_jstr(_jget(function, "description"))),
        control(_Q),
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
            out += [Segment("type:"), control(_Q), Segment(_jupper(ptype)), control(_Q), Segment("}")]
    if "response" in function:
        response = function["response"]
        out.append(Segment(",response:{"))
        description = _jget(response, "description")
        if description is not _UNDEFINED and description:
            out += [Segment("description:"), control(_Q), Segment(_jstr(description)), control(_Q), Segment(",")]
        if _jupper(_jget(response, "type")) == "OBJECT":
            out += [Segment("type:"), control(_Q), Segment("OBJECT"), control(_Q), Segment("}")]
    return out + [Segment("}")]


def strip_thinking(text: str) -> str:
    """The template's `strip_thinking` macro: drop every `<|channel>…<channel|>` block, then trim."""
    result = ""
    for part in text.split("<channel|>"):
        result += part.split("<|channel>")[0] if "<|channel>" in part else part
    return result.strip()


def _thought(reasoning: str) -> list[Segment]:
    """The template's thought channel of an assistant message: `<|channel>thought\\n{reasoning}\\n<channel|>`."""
    return [control("<|channel>"), Segment(f"thought\n{reasoning}\n"), control("<channel|>")]


def gemma4_arguments_prefix(arguments_json: str) -> list[Segment]:
    """A cut-off call's arguments (a JSON object prefix) in Gemma 4's call syntax, as far as they go: bare keys,
    strings `<|"|>…` (closed only when complete), scalars as written; nothing is closed. The inverse of the
    conversion families/gemma4/gateway.py's parser makes while the call streams, so the prefix the parser returned renders
    as the model generated it.

    Raises:
      ValueError: not a JSON object prefix.
    """
    out: list[Segment] = []
    for kind, value, complete in scan_json_prefix(arguments_json)[0]:
        if kind == "string":
            out += [control(_Q), Segment(value)] + ([control(_Q)] if complete else [])
        else:
            out.append(Segment(value))
    return out


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
        out += [control("<|tool_call>"), Segment(f"call:{name}")]
        if args is None and not cut_closed:
            return out + gemma4_arguments_prefix(arguments_json)
        out.append(Segment("{"))
        for a, (key, value) in enumerate(_dictsort(close_json_prefix(arguments_json) if args is None else args)):
            out += [Segment(("," if a else "") + f"{key}:")] + _fmt_argument(value, escape_keys=False)
        out += [Segment("}"), control("<tool_call|>")]
    return out


def _text(msg: Message, index: int, model: bool, system: bool = False) -> str:
    """A message's content as the Gemma 4 template renders it: user/system text trimmed, model text with
    thought channels stripped, text parts joined (system parts each followed by a space); null -> ""."""
    if msg.content is not None:
        return strip_thinking(msg.content) if model else msg.content.strip()
    out = ""
    for text in text_parts(msg, index):
        out += strip_thinking(text) if model else text.strip() + (" " if system else "")
    return out


def render(
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
    check_roles(messages)
    tools = tools or []
    options = options or {}
    enable_thinking = bool(options.get("enable_thinking", False))
    preserve_thinking = bool(options.get("preserve_thinking", False))
    segs = [control("<bos>")]
    prev_type: str | None = None
    first_system = messages[0].role in ("system", "developer")
    offset = 1 if first_system else 0
    body = messages[offset:]
    if enable_thinking or tools or first_system:
        segs += [control("<|turn>"), Segment("system\n")]
        if enable_thinking:
            segs += [control("<|think|>"), Segment("\n")]
            prev_type = "think"
        if first_system:
            segs.append(Segment(_text(messages[0], 0, model=False, system=True)))
        for t, tool in enumerate(tools):
            segs += [control("<|tool>")] + _fmt_declaration(tool, t) + [control("<tool|>")]
            prev_type = "tool"
        segs += [control("<turn|>"), Segment("\n")]

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
            segs += [control("<|turn>"), Segment(f"{role}\n")]
        thought = []
        if m.reasoning and (n > last_user or (preserve_thinking and m.tool_calls)):
            thought = _thought(m.reasoning)
        calls = [(call_id, name) for call_id, name, _ in m.tool_calls]
        call_segs = gemma4_call_segments(m.tool_calls, f"messages[{i}]")
        prev_type = "tool_call" if calls else prev_type
        text = _text(m, i, model=role == "model")
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
                segs += [control("<|tool_response>"), Segment(f"response:{name}{{value:")]
                segs += _fmt_argument(tool_result_text(result, k + offset), escape_keys=False)
                segs += [Segment("}"), control("<tool_response|>")]
                consumed.add(k)
                has_results, prev_type = True, "tool_response"
                k += 1
        if not generated:
            segs.append(Segment(text))
        continues_into_next = role == "model" and next_role[n] == "assistant" and (not calls or has_results)
        if prev_type == "tool_call" and not has_results:
            segs.append(control("<|tool_response>"))
        elif continues_into_next:
            pass
        elif not (has_results and not text.strip() and next_role[n] is None):
            segs += [control("<turn|>"), Segment("\n")]
        prev_non_tool_role = m.role

    if add_generation_prompt:
        if prev_type not in ("tool_response", "tool_call"):
            segs += [control("<|turn>"), Segment("model\n")]
        elif prev_type == "tool_response" and enable_thinking:
            segs += [control("<|channel>"), Segment("thought\n")]
    return [s for s in segs if s.control or s.text or s.ids]


ANSWER_FORMAT = AnswerFormat(
    control_tokens=frozenset({"<|tool_call>", "<tool_call|>", _Q, "<|channel>", "<channel|>"}),
    call_head="<|tool_call>call:",
    text=lambda message, index: _text(message, index, model=True),
    thought=_thought,
    calls=lambda calls, where, cut_closed: gemma4_call_segments(calls, where, cut_closed=cut_closed),
)
"""How Gemma 4 writes an answer's thought and calls, for a checkpoint template's output to be matched against."""


PART = TokenizerPart(render=render, template_facts=TEMPLATE_FACTS, answer_format=ANSWER_FORMAT)
"""This family's tokenizer part (`common.families`)."""
