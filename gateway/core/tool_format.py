"""The interface between the gateway and a model family's output formats: what each family's gateway part
(`families/<name>/gateway.py`) provides as its `PART`, and how control-token spellings become ids.

A family names its control tokens by spelling (`"<|tool_call>"`, `"<end_of_turn>"`), never by id: the gateway
looks the ids up in the vocabulary the tokenizer service sends (`SpecialTokens`, built from `GetVocab`'s token
bytes and special ids; `ModelFacts.token_id`), so a checkpoint whose vocabulary puts them elsewhere is served
correctly, and one that lacks them fails when the facts are fetched, naming the token. Generic code (chat_plan,
chat_output, completions, openapi) asks the served family's `FamilyFormat` instead of comparing family names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from common import families


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


TokenIds = Mapping[str, int]
"""Control-token spelling -> id in the served vocabulary (a `SpecialTokens`, or a family's published table)."""


class UnknownTokenError(KeyError):
    """A spelling a family's format needs is not a control token of the served vocabulary."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SpecialTokens(Mapping):
    """A vocabulary's control tokens by spelling: `tokens["<|tool_call>"]` -> its id.

    Built from what `GetVocab` sends: each token's bytes (a control token's bytes are its spelling) and the set of
    control-token ids. The table is built on first use (one pass over the special ids), so a splitter or plan that
    needs no control token costs nothing.
    """

    def __init__(self, token_bytes: list[bytes], special_ids: Iterable[int]):
        """Args: token_bytes: each token's bytes (index = id); special_ids: the control tokens' ids."""
        self._bytes, self._special = token_bytes, special_ids
        self._ids: dict[str, int] | None = None

    def _table(self) -> dict[str, int]:
        if self._ids is None:
            self._ids = {self._bytes[i].decode("utf-8", "replace"): i
                         for i in sorted(self._special) if 0 <= i < len(self._bytes) and self._bytes[i]}
        return self._ids

    def __getitem__(self, spelling: str) -> int:
        """The id of the control token spelled `spelling`.

        Raises:
          UnknownTokenError: the vocabulary has no control token with that spelling.
        """
        try:
            return self._table()[spelling]
        except KeyError:
            raise UnknownTokenError(f"the served vocabulary has no control token {spelling!r}") from None

    def __contains__(self, spelling: object) -> bool:
        return spelling in self._table()

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


@runtime_checkable
class ToolCallParser(Protocol):
    """An incremental parser of one answer in a family's tool-call format (gateway/generation/tool_parsers.py has the
    shared machinery): tokens in, OpenAI chat deltas out."""

    def feed(self, token_id: int, text: str | bytes = "") -> list[dict]:
        """Consume one generated token (its text or bytes; a control token is recognised by id); its deltas."""

    def finish(self) -> list[dict]:
        """End of generation: the last deltas."""

    def result(self) -> ParsedOutput:
        """The content and the complete calls so far."""

    def progress(self) -> tuple[int, bool]:
        """(complete calls so far, whether a call is open now), for budget-aware endings
        (gateway/structured/budget.py)."""


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    """A family's thought channel: `open` <label> reasoning `close`, then the answer (control tokens by spelling).

    Attributes:
      open, close: the channel markers' spellings (Gemma 4: `<|channel>`, `<channel|>`).
      label: the text the model writes right after `open`, removed from `reasoning_content`.
    """

    open: str
    close: str
    label: str = ""


@dataclasses.dataclass(frozen=True)
class FamilyFormat:
    """What the gateway needs of one family's output formats; each family's gateway part defines one as `PART`.

    Attributes:
      name: the family's registry name.
      tool_grammar: `(tools, tool_choice, parallel, max_calls, *, ids) -> str | None`: the llguidance Lark grammar of an
        answer under `tool_choice` with at most `max_calls` calls, or None for "none"; control tokens come from
        `ids` (`TokenIds`). Raises ToolSchemaError / ToolChoiceError (gateway/structured/tools/tool_calls.py).
      tool_parser: `(ids, id_prefix, control_ids, calls_only) -> ToolCallParser`: a fresh incremental parser of one
        answer; `control_ids` are the vocabulary's control tokens (never text); `calls_only`: the answer is only
        calls (tool_choice required or named).
      end_tokens: spellings of the tokens the tool grammar ends with: stop ids of a request with calls.
      call_markers: spellings of the control tokens that open and close a call, banned under tool_choice "none" and
        inside a thought (empty for a format without call tokens); the first one opens a call.
      budget_close: `(tokenize) -> int`: how many tokens closing an answer after its last complete call may take,
        given a function tokenizing text to ids (budget-aware endings, gateway/structured/budget.py).
      reasoning: the thought channel split into `reasoning_content`, or None.
      thinking: the chat template has a thinking mode (`enable_thinking`, `reasoning_effort`); needs `reasoning`.
      published_ids: every control token the format names, spelling -> its id in the family's published
        vocabulary: the spellings the gateway checks against the served vocabulary when it fetches the facts, and
        the ids components use when given none (tests, spelled-out text).
    """

    name: str
    tool_grammar: Callable[..., str | None]
    tool_parser: Callable[..., ToolCallParser]
    end_tokens: tuple[str, ...]
    call_markers: tuple[str, ...]
    budget_close: Callable[[Callable[[str], list[int]]], int]
    reasoning: ReasoningFormat | None
    thinking: bool
    published_ids: Mapping[str, int]

    def __post_init__(self):
        if self.thinking and self.reasoning is None:
            raise ValueError(f"{self.name}: a thinking mode needs a thought channel (reasoning)")
        named = set(self.end_tokens) | set(self.call_markers)
        if self.reasoning is not None:
            named |= {self.reasoning.open, self.reasoning.close}
        if not named <= set(self.published_ids):
            raise ValueError(f"{self.name}: published_ids must list {sorted(named - set(self.published_ids))}")

    def resolve(self, ids: TokenIds) -> dict[str, int]:
        """Every spelling the format names -> its id in `ids`.

        Raises:
          UnknownTokenError: `ids` lacks some (a vocabulary that is not this family's); the message names them all.
        """
        missing = [s for s in self.published_ids if s not in ids]
        if missing:
            raise UnknownTokenError(f"the served vocabulary has no control token {', '.join(map(repr, missing))} "
                                    f"(needed by the {self.name} formats)")
        return {s: ids[s] for s in self.published_ids}


def family_format(architecture: Any) -> FamilyFormat:
    """The gateway part of the family the backends report (`Info.architecture`), imported on first use.

    Raises:
      families.UnknownFamilyError: no registered family has that name (the message lists the supported ones).
      TypeError: the family's gateway module defines no `FamilyFormat` as `PART`.
    """
    return families.by_name(architecture).part("gateway", FamilyFormat)
