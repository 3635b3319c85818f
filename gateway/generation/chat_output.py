"""One chat choice's generated tokens -> OpenAI chat deltas and the final message: `content`,
`reasoning_content` (a family's thought channel: Gemma 4 thinking) and `tool_calls`.

Streamed and non-streamed responses both run every Delta of a choice through one `ChatSplitter`; the non-streamed
message is the merge of the deltas the stream would have sent, so the two are identical by construction.

Two paths:
- text (no tools, a model without a thought channel): `content` is the generated text as `generate` produced it
  (detokenized, stop strings cut).
- tokens (tools requested, or a model with a thought channel): every token is split by id — the family's thought
  channel (Gemma 4's `<|channel>`...`<channel|>`) to `reasoning_content` (gateway/generation/reasoning.py), the rest
  through the family's tool-call parser (its gateway part's `PART.tool_parser`, gateway/core/tool_format.py), which
  emits content and tool-call deltas as the grammar's structure arrives (the first argument fragment leaves before the
  call's closing marker is generated). Control tokens never reach content. Stop strings cut `content` only (they
  end generation either way).
"""

from __future__ import annotations

from gateway.core.errors import ApiError
from gateway.core.tool_format import TokenIds, family_format
from gateway.generation.detokenizer import IncrementalDetokenizer, StopMatcher
from gateway.generation.generate import Delta
from gateway.generation.reasoning import ReasoningSplitter
from gateway.structured.tools.tool_calls import ToolCallParseError


class ChatSplitter:
    """Splits one choice's Deltas into OpenAI chat `delta` objects and accumulates the final message.

    Args:
      token_bytes: each token's bytes (the vocabulary); special_ids: control tokens (no text).
      tool_format: a family's name ("gemma4", "gemma3") to parse tool calls in its format, None for no tool parsing.
      channels: split the family's thought channel into reasoning_content (also takes the token path).
      stops: the request's stop strings (cut content on the token path).
      id_prefix: prefix of the tool-call ids of this choice (unique per response and choice).
      calls_only: the answer is only calls (tool_choice required or named): an answer cut before its call
        trigger completes (Gemma 3's text trigger) is a cut call, never content.
      family: the model family whose formats apply when no `tool_format` names it (a thought channel alone).
      ids: the family's control tokens, spelling -> id in the served vocabulary (`ModelFacts.special_tokens`);
        needed with a tool format or thought channels.

    Raises:
      families.UnknownFamilyError: the family is not registered.
      ValueError: `channels` without a family, or for a family without a thought channel; a tool format or
        channels without `ids`.
      gateway.core.tool_format.UnknownTokenError: the vocabulary lacks a control token the family's format needs.
    """

    def __init__(self, token_bytes: list[bytes], special_ids: set[int], tool_format: str | None = None,
                 channels: bool = False, stops: list[str] | None = None, id_prefix: str = "call_",
                 calls_only: bool = False, family: str | None = None, ids: TokenIds | None = None):
        self.tokens_path = tool_format is not None or channels
        self._bytes = token_bytes
        self._thoughts, self._parser = None, None
        family = tool_format or family
        if self.tokens_path and family is None:
            raise ValueError("splitting out a thought channel needs the model family")
        if self.tokens_path:
            fmt = family_format(family)
            if ids is None:
                raise ValueError("splitting out tool calls or a thought channel needs the control tokens' ids")
            if channels:
                if fmt.reasoning is None:
                    raise ValueError(f"model family {family!r} has no thought channel")
                self._thoughts = ReasoningSplitter(token_bytes, special_ids, ids[fmt.reasoning.open],
                                                   ids[fmt.reasoning.close], fmt.reasoning.label)
            if tool_format is not None:
                self._parser = fmt.tool_parser(ids, id_prefix, special_ids, calls_only)
        self._content = IncrementalDetokenizer(token_bytes, special_ids)
        self._stops = StopMatcher(stops or [])
        self.content, self.reasoning = "", ""
        self.calls: list[dict] = []
        self.truncated = False

    # -- feeding

    def feed(self, delta: Delta) -> list[dict]:
        """The OpenAI deltas produced by one generate() Delta (after the last one, call finish())."""
        if not self.tokens_path:
            return self._record([{"content": delta.text}] if delta.text else [])
        out: list[dict] = []
        for t in delta.tokens:
            out += self._token(t.token_id)
        return self._record(out)

    def finish(self) -> list[dict]:
        """Flush held text at the end of the choice."""
        if not self.tokens_path:
            return []
        out: list[dict] = []
        if self._thoughts is not None:
            reasoning, content = self._thoughts.flush()
            out += [{"reasoning_content": reasoning}] if reasoning else []
            out += self._text(content)
        if self._parser is not None:
            out += self._parsed(self._parser.finish())
            self.truncated = self._parser.result().truncated
        else:
            out += self._text(self._content.flush())
        tail = self._stops.flush()
        out += [{"content": tail}] if tail else []
        return self._record(out)

    def _token(self, tid: int) -> list[dict]:
        thoughts = self._thoughts
        if thoughts is not None and (thoughts.inside or tid in (thoughts.open_id, thoughts.close_id)):
            reasoning, _ = thoughts.push(tid)
            return [{"reasoning_content": reasoning}] if reasoning else []
        if self._parser is not None:
            try:
                return self._parsed(self._parser.feed(tid, self._bytes[tid]))
            except ToolCallParseError as err:
                raise ApiError(500, f"the model's tool call could not be parsed: {err}", code="tool_call") from None
        return self._text(self._content.push(tid))

    def _parsed(self, deltas: list[dict]) -> list[dict]:
        out = []
        for d in deltas:
            if "content" in d:
                out += self._text(d["content"])
            else:
                out.append(d)
        return out

    def _text(self, text: str) -> list[dict]:
        text = self._stops.push(text) if text else ""
        return [{"content": text}] if text else []

    def _record(self, deltas: list[dict]) -> list[dict]:
        for d in deltas:
            self.content += d.get("content", "")
            self.reasoning += d.get("reasoning_content", "")
            for call in d.get("tool_calls", []):
                if call["index"] == len(self.calls):
                    self.calls.append({"id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}})
                self.calls[call["index"]]["function"]["arguments"] += call["function"].get("arguments", "")
        return deltas

    # -- results

    def finish_reason(self, worker_reason: str) -> str:
        """`tool_calls` when the choice returned complete calls (not cut by the length limit or a stop string),
        else the reason."""
        if self.calls and not self.truncated and worker_reason != "length":
            return "tool_calls"
        return worker_reason

    def message(self) -> dict:
        """The non-streamed `message`: content (None when the answer is only tool calls), reasoning_content
        (when there was a thought), tool_calls (when there were calls)."""
        msg: dict = {"role": "assistant", "content": self.content if (self.content or not self.calls) else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg

    def thought_tokens(self, token_ids: list[int]) -> int:
        """How many of a choice's generated `token_ids` belong to its thought channel, markers included (the
        Responses API's `reasoning_tokens`); 0 without a thought channel."""
        if self._thoughts is None:
            return 0
        inside, count = False, 0
        for t in token_ids:
            inside = inside or t == self._thoughts.open_id
            count += inside
            inside = inside and t != self._thoughts.close_id
        return count

    def plain(self) -> bool:
        """True when the answer is plain content (no calls, no thought): its ids may be remembered as history."""
        return not self.calls and not self.reasoning and not self.truncated
