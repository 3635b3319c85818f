"""One chat answer as a sequence of blocks — thought, text, tool call — for the APIs whose answers are lists of
typed parts: the Responses API's output items and the Messages API's content blocks.

Both front doors run the same planned chat request (gateway/planning/planner.py) and split its tokens with the same
`ChatSplitter` as Chat Completions; this module only regroups the splitter's chat deltas (`reasoning_content`,
`content`, `tool_calls[i]` fragments) into blocks that open, grow and close in order. A block closes when the
next one opens, so a client sees the blocks one after another, never interleaved. The unary answer is the list
of blocks the stream would have produced, so streamed and unary answers are identical by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Literal

from gateway.backends.views import RunningView
from gateway.generation.choice_runner import ChoiceRunner
from gateway.generation.choices import run_choices
from gateway.generation.generate import Delta

BlockKind = Literal["reasoning", "text", "call"]


@dataclasses.dataclass
class Block:
    """One part of an answer.

    Attributes:
      kind: "reasoning" (the thought channel), "text" (the answer's text) or "call" (a tool call).
      index: the block's position in the answer (0, 1, ...).
      text: the thought or text so far; for a call, its arguments' JSON text so far.
      call_id: a call's id (`call_...`), unique in the response.
      name: a call's function name.
    """

    kind: BlockKind
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""


@dataclasses.dataclass(frozen=True)
class BlockEvent:
    """A change of the answer: `start` (a block opens, `text` empty), `delta` (`text` added to the block) or
    `stop` (the block ends; `incomplete` when the answer's token limit cut it: a call's arguments may then not
    parse)."""

    kind: Literal["start", "delta", "stop"]
    block: Block
    text: str = ""
    incomplete: bool = False


@dataclasses.dataclass(frozen=True)
class AnswerStart:
    """The worker has taken the prompt (the first event of an answer): `cached_tokens` of it were reused."""

    cached_tokens: int


@dataclasses.dataclass(frozen=True)
class AnswerEnd:
    """The end of an answer.

    Attributes:
      finish_reason: the chat finish reason (`stop`, `length`, `tool_calls`, `abort`).
      stop_string: the stop string that ended it, or None.
      prompt_tokens, completion_tokens, cached_tokens: usage (cached: prompt tokens whose KV was reused).
      reasoning_tokens: generated tokens inside the thought channel, counted from the splitter's thought text.
    """

    finish_reason: str
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0


class BlockSplitter:
    """Chat deltas of one choice (`ChatSplitter.feed`/`finish` output) -> BlockEvents, keeping every block."""

    def __init__(self):
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}

    def feed(self, deltas: list[dict]) -> list[BlockEvent]:
        """The events of some chat deltas, in order."""
        out: list[BlockEvent] = []
        for d in deltas:
            if d.get("reasoning_content"):
                out += self._grow("reasoning", d["reasoning_content"])
            if d.get("content"):
                out += self._grow("text", d["content"])
            for call in d.get("tool_calls", []):
                out += self._call(call)
        return out

    def close(self, incomplete: bool = False) -> list[BlockEvent]:
        """Close the open block (the next opens, or the answer ended: `incomplete` when its limit cut it)."""
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("stop", block, incomplete=incomplete)]

    def _start(self, block: Block) -> list[BlockEvent]:
        out = self.close()
        self.blocks.append(block)
        self._open = block
        return out + [BlockEvent("start", block)]

    def _grow(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        out = [] if self._open is not None and self._open.kind == kind else \
            self._start(Block(kind, len(self.blocks)))
        self._open.text += text
        return out + [BlockEvent("delta", self._open, text)]

    def _call(self, call: dict) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        block = self._calls.get(call["index"])
        if block is None:
            function = call.get("function", {})
            block = Block("call", len(self.blocks), call_id=call.get("id", ""), name=function.get("name", ""))
            self._calls[call["index"]] = block
            out += self._start(block)
        fragment = call.get("function", {}).get("arguments", "")
        if fragment:
            block.text += fragment
            out.append(BlockEvent("delta", block, fragment))
        return out


async def answer_events(backends: RunningView,
                        plan) -> AsyncIterator[AnswerStart | BlockEvent | AnswerEnd]:
    """Run a planned one-choice chat request (`planner.Plan`, n = 1); yields an AnswerStart once the worker has
    the prompt, its BlockEvents, and last an AnswerEnd. The answer is remembered in the answer history, as a chat
    completion's is, so a conversation sent back renders as generated.

    Raises:
      ApiError: from planning's leftovers or the backends (before or during the stream).
    """
    chat = plan.splitters[0]  # the chat output's splitter (thought, text, calls); `blocks` regroups its deltas
    runner = ChoiceRunner(backends, plan)
    blocks = BlockSplitter()
    started = False
    async for _, delta in run_choices(backends, plan.jobs):
        if not started:
            started = True
            yield AnswerStart(delta.cached_tokens)
        for event in blocks.feed(runner.feed(0, delta)):
            yield event
        if delta.finish_reason:
            for event in blocks.close(incomplete=delta.finish_reason == "length"):
                yield event
            yield _end(chat, delta, runner.tokens[0], plan.prompt_tokens)


def _end(chat, delta: Delta, tokens: list, prompt_tokens: int) -> AnswerEnd:
    usage = delta.usage
    return AnswerEnd(chat.finish_reason(delta.finish_reason), delta.stop_string, prompt_tokens,
                     usage.completion_tokens, usage.cached_tokens,
                     chat.thought_tokens([t.token_id for t in tokens]))
