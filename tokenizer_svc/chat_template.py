"""Chat templates rendered as segments, so message content is always data: the pieces every template shares.

A template produces a list of `Segment`s: control tokens (`<bos>`, `<|turn>`...) and text. Text segments are
tokenized with control-token parsing off, control segments map to their ids, so text typed by a user
(`<end_of_turn>` inside a message) can never become a control token, and every prompt has exactly one BOS (the
one the template emits). For content free of control-token spellings, the ids equal those of rendering the
official Jinja template to a string and tokenizing it with special tokens parsed (tests prove this).

Every renderer has one signature, `render(messages, add_generation_prompt, tools, options, *, tool_choice="auto")
-> list[Segment]`: `tools` is the OpenAI `tools` array (list of dicts, [] for none), `options` the template kwargs
(e.g. {"enable_thinking": True}), `tool_choice` the request's resolved mode ("auto", "required", "named" or
"none"). The built-in templates live in the model families' tokenizer parts (`families/<name>/tokenizer.py`:
a `TokenizerPart`: `render`, the template's `TemplateFacts`, the family's `AnswerFormat`); `TEMPLATES` maps a family's name to its
renderer through the registry. A checkpoint's own `chat_template.jinja` is rendered by a
`tokenizer_svc.jinja_template.JinjaTemplate`, which has the same call signature. `continue_final_message` wraps
any of them to end the prompt inside the final assistant message (a prefilled answer the model continues);
`tokenize_segments` turns segments into ids.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable, Iterator, Mapping

from common import families
from common.json_prefix import scan_json_prefix
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
    fallback: tuple[Segment, ...] = ()


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


def control(text: str) -> Segment:
    """A control-token segment (by spelling)."""
    return Segment(text, control=True)


def text_parts(msg: Message, index: int, what: str = "content part") -> list[str]:
    """The texts of a message's list-form content.

    Raises:
      TemplateError: a part that is not text (the served models read text only); `what` names the part in the
        message ("content part", "tool result part").
    """
    for kind, _ in msg.parts:
        if kind != "text":
            raise TemplateError(f"messages[{index}]: {what} type {kind!r} is not supported by this text-only model")
    return [text for _, text in msg.parts]


def text_of(msg: Message, index: int, trim: bool) -> str:
    """The message's text: the string content, or its text parts joined (each trimmed, as the template does).

    Raises:
      TemplateError: a non-text part, or neither content nor parts.
    """
    if msg.content is not None:
        return msg.content.strip() if trim else msg.content
    texts = [text.strip() if trim else text for text in text_parts(msg, index)]
    if not msg.parts:
        raise TemplateError(f"messages[{index}] ({msg.role}) has no content")
    return "".join(texts)


def tool_result_text(msg: Message, index: int) -> str | None:
    """A tool message's content: a string is used as is (JSON text is *not* parsed), text parts are joined;
    None when it has neither.

    Raises:
      TemplateError: a non-text part.
    """
    if msg.content is not None or not msg.parts:
        return msg.content
    return "".join(text_parts(msg, index, "tool result part"))


def check_roles(messages: list[Message]) -> None:
    """Raises TemplateError: no messages, or a role outside `ROLES`."""
    if not messages:
        raise TemplateError("messages must contain at least one message")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise TemplateError(f"messages[{i}]: unknown role {m.role!r}")


# --------------------------------------------------------------------------------------------- tool calls


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


@dataclasses.dataclass(frozen=True)
class TemplateFacts:
    """What a family's built-in chat template can render, advertised by the tokenizer service's `Info` (as TGI's
    InfoResponse advertises its template's abilities), so clients need not guess from the model name.

    Attributes:
      supports_tools: the template declares the request's `tools` and renders tool calls and results (in the
        model's native call syntax, or this project's documented format for a model without one).
      supports_thinking: the template has a thinking mode (`chat_template_kwargs.enable_thinking`) and renders
        an assistant message's `reasoning_content`.
      end_of_turn: spellings of the control tokens that end a model turn (stop ids by default, with EOS).
    """

    supports_tools: bool
    supports_thinking: bool
    end_of_turn: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class AnswerFormat:
    """How a family's model writes an answer's thought and tool calls, as segments: what a checkpoint template's
    output is matched against to splice in the answer as generated (`JinjaTemplate`). A family without a native
    call syntax has none (its tokenizer part's `answer_format` is None).

    Attributes:
      control_tokens: the control-token spellings the format writes; a vocabulary without all of them cannot
        be the family's (`answer_format_for`).
      call_head: what the model writes before an answer's first call's name (Gemma 4: `<|tool_call>call:`).
      text: (message, index) -> its content as the family's template writes model text.
      thought: reasoning text -> the thought channel the family's template writes for it.
      calls: (calls, where, cut_closed) -> an answer's calls as the family's template writes them; a last call cut
        off by max_tokens left open as generated, or with `cut_closed` closed as a template given the mapping it
        reached writes it. Raises TemplateError for malformed arguments.
    """

    control_tokens: frozenset[str]
    call_head: str
    text: Callable[[Message, int], str]
    thought: Callable[[str], list[Segment]]
    calls: Callable[[list[tuple[str, str, str]], str, bool], list[Segment]]

@dataclasses.dataclass(frozen=True)
class TokenizerPart:
    """What a model family gives the tokenizer service (`families/<name>/tokenizer.py` defines `PART`, one of
    these).

    Attributes:
      render: the family's built-in chat template (a `Renderer`).
      template_facts: what that template supports (advertised in the tokenizer's `Info`) and its end-of-turn
        tokens.
      answer_format: how the family's model writes an answer's thought and tool calls, for splicing remembered
        answers into a checkpoint's own template; None when the family has no native call syntax.
    """

    render: Renderer
    template_facts: TemplateFacts
    answer_format: AnswerFormat | None = None


def tokenizer_part(family: families.Family) -> TokenizerPart:
    """The family's tokenizer part, imported on first use.

    Raises:
      TypeError: the family's tokenizer module defines no `TokenizerPart` as `PART`.
    """
    return family.part("tokenizer", TokenizerPart)


class _BuiltinTemplates(Mapping[str, Renderer]):
    """The built-in renderers by family name: each registered family's tokenizer part's `render`, imported on
    first use (an unknown name is a KeyError, as for any mapping)."""

    def __getitem__(self, name: str) -> Renderer:
        try:
            family = families.by_name(name)
        except families.UnknownFamilyError:
            raise KeyError(name) from None
        return tokenizer_part(family).render

    def __iter__(self) -> Iterator[str]:
        return iter([f.name for f in families.families()])

    def __len__(self) -> int:
        return len(families.families())


TEMPLATES: Mapping[str, Renderer] = _BuiltinTemplates()
"""Family name ("gemma3", "gemma4") -> that family's built-in renderer."""
