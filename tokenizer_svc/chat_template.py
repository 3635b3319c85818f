"""Chat templates rendered as segments, so message content is always data.

A template produces a list of `Segment`s: control tokens (`<bos>`, `<start_of_turn>`...) and text. Text
segments are tokenized with control-token parsing off, control segments map to their ids, so text typed by a user
(`<end_of_turn>` inside a message) can never become a control token, and every prompt has exactly one BOS (the
one the template emits). For content free of control-token spellings, the ids equal those of rendering the
official Jinja template to a string and tokenizing it with special tokens parsed (tests prove this).

Gemma 3 (formats.md §4.1; the `chat_template` of Hugging Face `google/gemma-3-*-it` tokenizer_config.json):
`<bos>`, then per message `<start_of_turn>{role}\\n{content|trim}<end_of_turn>\\n` with role assistant -> model;
a leading system (or developer) message is folded into the first user turn as `{system}\\n\\n`; roles must
alternate user/model starting with user; generation prompt `<start_of_turn>model\\n`.
"""

from __future__ import annotations

import dataclasses

from tokenizer_svc.tokenizer import TextTokenizer


class TemplateError(ValueError):
    """The conversation cannot be rendered by the template; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """A piece of a rendered prompt: a control token (by spelling) or plain text."""

    text: str
    control: bool = False


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


def render_gemma3(messages: list[Message], add_generation_prompt: bool) -> list[Segment]:
    """Render a conversation with the Gemma 3 template.

    Raises:
      TemplateError: empty conversation, unknown or unsupported role (tool), system message not first, tool
        calls, non-text content, or roles that do not alternate user/assistant starting with user.
    """
    if not messages:
        raise TemplateError("messages must contain at least one message")
    for i, m in enumerate(messages):
        if m.role not in ("system", "developer", "user", "assistant", "tool"):
            raise TemplateError(f"messages[{i}]: unknown role {m.role!r}")
        if m.role == "tool" or m.tool_calls:
            raise TemplateError(f"messages[{i}]: tool calls and tool results are not supported by the Gemma 3 template")
    prefix, body, offset = "", messages, 0
    if messages[0].role in ("system", "developer"):
        prefix, body, offset = _text_of(messages[0], 0, trim=False) + "\n\n", messages[1:], 1
    segs = [Segment("<bos>", control=True)]
    for n, m in enumerate(body):
        i = n + offset
        if m.role in ("system", "developer"):
            raise TemplateError(f"messages[{i}]: a {m.role} message is only supported as the first message")
        expected = "user" if n % 2 == 0 else "assistant"
        if m.role != expected:
            raise TemplateError(
                f"messages[{i}]: roles must alternate user/assistant starting with user; got {m.role!r} where "
                f"{expected!r} was expected"
            )
        role = "model" if m.role == "assistant" else "user"
        text = _text_of(m, i, trim=True)
        segs += [
            Segment("<start_of_turn>", control=True),
            Segment(f"{role}\n" + (prefix if n == 0 else "") + text),
            Segment("<end_of_turn>", control=True),
            Segment("\n"),
        ]
    if add_generation_prompt:
        segs += [Segment("<start_of_turn>", control=True), Segment("model\n")]
    return segs


def tokenize_segments(segments: list[Segment], tokenizer: TextTokenizer) -> tuple[list[int], str]:
    """Segments -> (token ids, rendered text). Adjacent text segments are joined before encoding.

    Raises:
      TemplateError: a control token of the template is missing from the vocabulary.
    """
    ids: list[int] = []
    pending = ""
    for seg in segments + [Segment("", control=True)]:
        if not seg.control:
            pending += seg.text
            continue
        if pending:
            ids += tokenizer.encode(pending, parse_special=False)
            pending = ""
        if seg.text:
            try:
                ids.append(tokenizer.token_id(seg.text))
            except KeyError:
                raise TemplateError(f"the vocabulary has no control token {seg.text!r}") from None
    return ids, "".join(s.text for s in segments)


TEMPLATES = {"gemma3": render_gemma3}
