"""A checkpoint's own Jinja chat template (`chat_template.jinja`), rendered as transformers renders it, with
message content kept as data (`JinjaTemplate`; docs/architecture.md, "Chat templates" and "Exact history").

Where the template writes an answer's thought and tool calls exactly as the model writes them (a family's
`AnswerFormat`, from its tokenizer part), that part of the output is replaced by the answer's generated ids, or
by its cut-off call left open, so the history re-tokenizes as generated.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from common import families
from common.json_prefix import close_json_prefix
from tokenizer_svc.chat_template import (
    AnswerFormat,
    Message,
    Segment,
    TemplateError,
    call_arguments,
    control,
    text_parts,
    tokenizer_part,
)
from tokenizer_svc.tokenizer import TextTokenizer


def answer_format_for(control_tokens: Iterable[str]) -> AnswerFormat | None:
    """The answer format of the first registered family whose format's control tokens are all among
    `control_tokens` (a vocabulary's): for a template whose family is not given, a model can only write a
    family's call syntax when its vocabulary has that syntax's control tokens. None when no family's fits."""
    controls = set(control_tokens)
    for family in families.families():
        answer_format = tokenizer_part(family).answer_format
        if answer_format is not None and answer_format.control_tokens <= controls:
            return answer_format
    return None


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
    an answer's calls (and thought) exactly as the model's family writes them (its `AnswerFormat`: Gemma 4's
    template's syntax), that part of the output is replaced by the answer's generated ids or by its cut call left
    open, as generated (`_answers_to_splice`). If the rendered prompt does not start with BOS, BOS is prepended
    (exactly one BOS).

    Attributes:
      family: the model family the checkpoint declares (None when not given); `Info` derives the template's
        facts from it.
      answer_format: the answer syntax spliced (the family's; without a family, `answer_format_for` the
        control tokens), or None.
    """

    def __init__(self, source: str, control_tokens: Iterable[str], special_tokens: dict[str, str] | None = None,
                 special_ids: Iterable[int] = (), family: families.Family | None = None):
        """Args:
          source: the template text.
          control_tokens: spellings of the tokenizer's control (special) tokens.
          special_tokens: template variables such as {"bos_token": "<bos>", "eos_token": "<eos>"}.
          special_ids: the control tokens' ids (generated ids containing one are not rendered verbatim).
          family: the checkpoint's model family (its tokenizer part's `answer_format` is spliced).

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
        self.family = family
        self.answer_format = tokenizer_part(family).answer_format if family else answer_format_for(tokens)

    @classmethod
    def for_tokenizer(cls, source: str, tokenizer: TextTokenizer,
                      family: families.Family | None = None) -> JinjaTemplate:
        """A template whose control tokens are `tokenizer`'s special tokens and whose bos/eos/pad/unk variables
        are its spellings; `family` as in the constructor."""
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
                   tokenizer.special_ids, family)

    @classmethod
    def from_file(cls, path: pathlib.Path, tokenizer: TextTokenizer,
                  family: families.Family | None = None) -> JinjaTemplate:
        """Load `path` (a checkpoint's chat_template.jinja) for `tokenizer` (and the checkpoint's `family`).

        Raises:
          TemplateError: the template does not parse (the message names the file).
        """
        try:
            return cls.for_tokenizer(pathlib.Path(path).read_text(encoding="utf-8"), tokenizer, family)
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
                segs.append(control(piece))
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
        answers = _answers_to_splice(messages, self.special_ids, self.answer_format)
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
        if bos and not (segs and segs[0] == control(bos)):
            segs.insert(0, control(bos))
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
        d["content"] = [{"type": "text", "text": text} for text in text_parts(m, index)]
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
    """An assistant message whose thought and calls a checkpoint template's output gets in the family's syntax
    (its `AnswerFormat`) as the model wrote them (`_answers_to_splice`).

    Attributes:
      calls: anchored at its first call's name (else at its content: a thought answer without calls).
      thought: the thought channel the family's template writes for its reasoning ([] without reasoning).
      text: its content as the family's template writes model text.
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


def _answers_to_splice(messages: list[Message], special_ids: frozenset[int],
                       answer_format: AnswerFormat | None) -> dict[int, _Answer]:
    """The assistant messages a `JinjaTemplate` renders through `_splice_answers`: those with calls and generated
    ids or a cut-off last call, and thought answers (reasoning, no calls) whose ids hold a control token; none
    without an `answer_format`.

    Why: a template renders calls from mappings, so it can neither leave a cut-off call open nor write the exact
    ids of a thought or calls (they hold control tokens, which message content never becomes). Where the
    template writes calls (and the thought) exactly as the family's own template does, that part of its output is
    replaced by the ids (their `fallback`: the same part as generated) or, without ids, by the cut call left
    open; anywhere else (another call syntax) the template's rendering stands.

    Raises:
      TemplateError: malformed tool-call arguments.
    """
    out: dict[int, _Answer] = {}
    for i, m in enumerate(messages if answer_format else ()):
        ids = tuple(m.generated_ids)
        if m.role != "assistant" or not (m.tool_calls or (ids and m.reasoning and special_ids & set(ids))):
            continue
        where = f"messages[{i}]"
        cut = bool(m.tool_calls) and call_arguments(m.tool_calls[-1][2], f"{where}.tool_calls[{len(m.tool_calls) - 1}]",
                                                    last=True) is None
        if m.tool_calls and not (ids or cut):
            continue
        text = answer_format.text(m, i)
        out[i] = _Answer(bool(m.tool_calls), answer_format.thought(m.reasoning) if m.reasoning else [], text,
                         answer_format.calls(m.tool_calls, where, True), answer_format.calls(m.tool_calls, where, False),
                         ids,
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

    An answer with calls: right after its anchor the output must continue with its calls exactly as the family's
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
            start -= len(template.answer_format.call_head)
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
