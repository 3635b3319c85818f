"""Incremental parsers of generated tool calls, the machinery every format shares: output bookkeeping (content, a
call's first delta once its name is complete, then argument fragments as OpenAI chat deltas, and the whole answer
as `ParsedOutput`), incremental UTF-8, and control tokens recognised by id, never by their text.

Each family's parser (its call syntax) subclasses `TokenParser` in its gateway part: families/gemma4/gateway.py
(native syntax, arguments converted to JSON on the fly), families/gemma3/gateway.py (the JSON format, arguments
verbatim). A parser names the control tokens it acts on by spelling (`SPELLINGS`) and always gets their ids
from the caller (`ids`, required: resolved from the served vocabulary, gateway/core/tool_format.py, or a family's
published ids for text with the tokens spelled out), so a parser never assumes a vocabulary.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Mapping

from gateway.core.tool_format import ParsedOutput, ToolCall
from gateway.generation.detokenizer import Utf8Decoder


@dataclasses.dataclass
class OpenCall:
    """One call as the parser reads it: its index, id, name, the argument fragments streamed so far, and whether
    it is complete."""

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
        self.calls: list[OpenCall] = []
        self.pending: list[tuple] = []

    def text(self, text: str) -> None:
        """Answer text (content) written by the model outside any call."""
        if text:
            self.content.append(text)
            self.pending.append(("content", text))

    def open(self, name: str) -> OpenCall:
        """A new call of tool `name` (its header delta: index, id, name); returns it for `args`."""
        call = OpenCall(len(self.calls), f"{self.id_prefix}{len(self.calls)}", name)
        self.calls.append(call)
        self.pending.append(("header", call))
        return call

    def args(self, call: OpenCall, fragment: str) -> None:
        """The next piece of `call`'s arguments as JSON text."""
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
        """The content and the complete calls so far (`truncated`: the answer was cut before its end)."""
        calls = [ToolCall(c.id, c.name, "".join(c.fragments)) for c in self.calls if c.complete]
        return ParsedOutput("".join(self.content), calls, truncated)


class _TokenText:
    """Token text -> characters: str as is; bytes decoded incrementally (a character split across tokens comes
    out whole with the token that completes it; gateway/generation/detokenizer.py `Utf8Decoder`)."""

    def __init__(self):
        self._decoder = Utf8Decoder()

    def chars(self, text: str | bytes) -> str:
        """The characters one token adds (bytes of a character split across tokens come with its last token)."""
        return text if isinstance(text, str) else self._decoder.decode(text)

    def flush(self) -> str:
        """A boundary (a control token, the end of generation): an incomplete character held so far is dropped,
        never turned into U+FFFD (its bytes were cut by the boundary, not written invalid)."""
        return self._decoder.flush()


class TokenParser:
    """What every format's parser shares: output bookkeeping, incremental UTF-8, control ids, and
    feed/finish/result/progress (the `gateway.core.tool_format.ToolCallParser` interface). Subclasses set `SPELLINGS`
    (the control tokens they act on) and define `_special(token_id)` (a control token), `_chars_in(chars)`
    (text), `_truncated()` and `_in_call()`.

    Args:
      id_prefix: prefix of the call ids (`{id_prefix}{n}`).
      control_ids: the vocabulary's control tokens: never text (their spellings are dropped from content).
      ids: spelling -> id of at least `SPELLINGS` (required, keyword-only: the served vocabulary's,
        gateway/core/tool_format.py, or the family's published ids for spelled-out text).

    Raises:
      gateway.core.tool_format.UnknownTokenError: `ids` lacks one of `SPELLINGS`.
    """

    SPELLINGS: tuple[str, ...] = ()
    #: Attributes set in __init__ and never changed: a deep copy shares them. The control ids are thousands of
    #: ints in a Gemma vocabulary, and a constrained draft copies its parser at every step (gateway/structured/budget.py
    #: `BudgetedUnits.fork`): copying them made that ~2.5 ms, sharing them ~0.1 ms.
    SHARED: tuple[str, ...] = ("ids", "_control")

    def __init__(self, id_prefix: str = "call_", control_ids: Iterable[int] | None = None, *,
                 ids: Mapping[str, int]):
        self.ids = {s: ids[s] for s in self.SPELLINGS}  # the control tokens this parser acts on
        self._out = _Deltas(id_prefix)
        self._chars = _TokenText()
        self._control = frozenset(self.ids.values()) | frozenset(control_ids or ())

    def __deepcopy__(self, memo: dict) -> TokenParser:
        """An independent copy of the parser's state; the attributes named in `SHARED` are shared, not copied."""
        twin = copy.copy(self)
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            if name not in self.SHARED:
                setattr(twin, name, copy.deepcopy(value, memo))
        return twin

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
        (gateway/structured/budget.py)."""
        return sum(c.complete for c in self._out.calls), self._in_call()

    def _in_call(self) -> bool:
        raise NotImplementedError

    def _special(self, token_id: int) -> None:
        raise NotImplementedError

    def _chars_in(self, chars: str) -> None:
        raise NotImplementedError

    def _truncated(self) -> bool:
        raise NotImplementedError


def parse_marked(text: str, parser: TokenParser) -> ParsedOutput:
    """Feed `parser` a whole answer written with its control tokens spelled out (`parser.ids`' spellings, each
    fed as that token; the text between them as one piece each) and return its result.

    Raises:
      ToolCallParseError: malformed call syntax.
    """
    ids = parser.ids
    pattern = re.compile("(" + "|".join(re.escape(k) for k in sorted(ids, key=len, reverse=True)) + ")")
    for n, piece in enumerate(pattern.split(text)):
        if n % 2:
            parser.feed(ids[piece], piece)
        elif piece:
            parser.feed(-1, piece)
    parser.finish()
    return parser.result()
