"""Gemma 3's tokenizer part: its built-in chat template and the template's facts (see `families`).

The template (docs/formats.md §4.1; the `chat_template` of Hugging Face `google/gemma-3-*-it`
tokenizer_config.json): `<bos>`, then per message `<start_of_turn>{role}\\n{content|trim}<end_of_turn>\\n` with
role assistant -> model; a leading system (or developer) message is folded into the first user turn as
`{system}\\n\\n`; roles must alternate user/model starting with user; generation prompt `<start_of_turn>model\\n`.
Gemma 3 has no tool format: with tools, tool calls or tool results the renderer writes this project's JSON tool
format (documented in families/gemma3/gateway.py, whose grammars make the model answer in it). No thinking mode.
"""

from __future__ import annotations

import json

from tokenizer_svc.chat_template import (
    Message,
    Segment,
    TemplateError,
    TemplateFacts,
    TokenizerPart,
    call_arguments,
    check_roles,
    control,
    text_of,
    tool_result_text,
)

TEMPLATE_FACTS = TemplateFacts(supports_tools=True, supports_thinking=False, end_of_turn=("<end_of_turn>",))
"""Tools in this project's JSON format (the template declares them); no thinking mode."""


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
    """The Gemma 3 tool declarations (families/gemma3/gateway.py documents the format): the intro, one JSON line per
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
            block = label + (tool_result_text(m, i) or "").strip()
            if prev == "tool":
                turns[-1][2].append("\n\n" + block)
            else:
                turns.append(("user", i, [block]))
            continue
        if m.role == "user" and n and body[n - 1].role == "tool":
            turns[-1][2].append("\n\n" + text_of(m, i, trim=True))
            continue
        if m.role == "assistant":
            calls = list(m.tool_calls)
            if m.tool_calls:
                has_text = m.content is not None and m.content.strip() or m.parts
                text = text_of(m, i, trim=True) if has_text else ""
                text = (text + "\n\n" if text else "") + gemma3_tool_calls_text(m.tool_calls, f"messages[{i}]")
            else:
                text = text_of(m, i, trim=True)
            if m.generated_ids:
                turns.append(("assistant", i, [Segment("", ids=tuple(m.generated_ids), fallback=(Segment(text),))]))
            else:
                turns.append(("assistant", i, [text]))
        else:
            turns.append((m.role, i, [text_of(m, i, trim=True)]))
    return turns


def render(
    messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None = None, options: dict | None = None,
    *, tool_choice: str = "auto",
) -> list[Segment]:
    """Render a conversation with the Gemma 3 template (docs/formats.md §4.1). `options` are accepted and ignored.

    Without tools, tool calls and tool messages this is the official template. Gemma 3 has no tool format; this
    project's JSON format (documented in families/gemma3/gateway.py) adds: tool declarations (`gemma3_tools_text`;
    under `tool_choice` "none" without the call instructions) at the start of the first user turn after the
    system text; assistant calls rendered as
    `{"tool_calls": [{"name": ..., "arguments": ...}]}` (`gemma3_tool_calls_text`); tool results as a user turn
    of "Tool result for NAME (ID):\n..." blocks, which a following user message joins.

    Raises:
      TemplateError: empty conversation, unknown role, system message not first, a tool message that does not
        answer a call message, malformed tools or tool-call arguments, non-text content, or roles that do not
        alternate user/assistant starting with user.
    """
    check_roles(messages)
    prefix, body, offset = "", messages, 0
    if messages[0].role in ("system", "developer"):
        prefix, body, offset = text_of(messages[0], 0, trim=False) + "\n\n", messages[1:], 1
    if tools:
        prefix += gemma3_tools_text(tools, callable_=tool_choice != "none") + "\n\n"
    segs = [control("<bos>")]
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
        segs += [control("<start_of_turn>"), *content, control("<end_of_turn>"), Segment("\n")]
    if add_generation_prompt:
        segs += [control("<start_of_turn>"), Segment("model\n")]
    return [s for s in segs if s.control or s.text or s.ids]


PART = TokenizerPart(render=render, template_facts=TEMPLATE_FACTS, answer_format=None)  # no native call syntax
"""This family's tokenizer part (`common.families`)."""
