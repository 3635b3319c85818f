"""What a chat request asks beyond plain text — response_format, tools/tool_choice, thinking — turned into how it
is generated (grammar, extra stop ids, banned ids, template options) and how its output is split (ChatSplitter).

Per model family (ModelFacts.architecture), from its gateway part's `PART` (gateway/core/tool_format.py), with its
control tokens' ids looked up in the served vocabulary: tools in the family's format (its grammar; the grammar's
end tokens added to the stop ids; under `tool_choice: "none"` its call markers banned); thinking, where the family
has it, on with `chat_template_kwargs.enable_thinking` or `reasoning_effort` low|medium|high, returned as
`reasoning_content`, and under a grammar a thinking answer may first write its thought channel freely
(reasoning.ThoughtFirst); asking a family without thinking for it is a 400, as OpenAI answers for models without
reasoning. Gemma 4: native call syntax, thinking; Gemma 3: this project's JSON format, no thinking.
`response_format` and tools together are a 400 (the answer cannot be both a JSON value and a tool call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gateway.backends.model_facts import ModelFacts
from gateway.backends.views import PlanningView
from gateway.core.errors import ApiError
from gateway.core.openai_types import ChatCompletionRequest
from gateway.core.tool_format import FamilyFormat
from gateway.generation.chat_output import ChatSplitter
from gateway.generation.reasoning import ThoughtFirst
from gateway.structured.budget import BudgetedUnits, JsonArrayProgress
from gateway.structured.constraints import Constraint
from gateway.structured.endings import BudgetedEnding, ending_tables
from gateway.structured.grammar_cache import grammar_for_json_schema, grammar_for_response_format
from gateway.structured.schema_check import SchemaError
from gateway.structured.tools import tool_calls as tc

THINKING_EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}


@dataclasses.dataclass
class ChatPlan:
    """How to generate one chat request and split its output.

    Attributes:
      grammar: llguidance grammar of the answer, or None (unconstrained).
      grammar_ends: the grammar consumes its own end token (tool grammars).
      tool_format: the family's name ("gemma4", "gemma3") when the output is parsed for tool calls, else None.
      thinking: thinking is on for this request.
      channels: split the family's thought channel into reasoning_content.
      family: the served model family (its formats split the output).
      stop_ids: the final stop ids the worker receives (`_stop_ids`): the request's `stop_token_ids`, the tool
        grammar's end tokens (Gemma 4 calls end with `<|tool_response>`) and, under a grammar, the model's own.
      grammar_stop_ids: the ids a constraint ends with (the grammar's end tokens and the model's own; empty
        without a grammar): allowed once the value is complete, masked inside a thought.
      end_ids: `stop_ids` and the model's own: a final one is not part of a remembered answer (the template
        writes the end of the turn).
      banned_ids: token ids the answer may not contain (logit bias -inf).
      template_kwargs: options for the chat template (enable_thinking derived from reasoning_effort).
      param: the request field the grammar comes from ("response_format" or "tools"), named in errors.
      unit_grammar: the grammar allowing at most N units — calls (parallel tool calls), or elements of a JSON
        answer whose schema is an array — for budget-aware endings (gateway/structured/budget.py); None: no units.
      unit_kind: "tool_calls" | "json", the kind of unit (a metric label).
      calls_only: the answer is only tool calls (tool_choice required or named).
    """

    grammar: str | None = None
    grammar_ends: bool = False
    tool_format: str | None = None
    thinking: bool = False
    channels: bool = False
    family: str = ""
    stop_ids: list[int] = dataclasses.field(default_factory=list)
    grammar_stop_ids: list[int] = dataclasses.field(default_factory=list)
    end_ids: list[int] = dataclasses.field(default_factory=list)
    banned_ids: list[int] = dataclasses.field(default_factory=list)
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    param: str = "response_format"
    unit_grammar: Callable[[int], str] | None = None
    calls_only: bool = False
    unit_kind: str = ""

    def splitter(self, facts: ModelFacts, stops: list[str], id_prefix: str) -> ChatSplitter:
        """A fresh ChatSplitter for one choice."""
        return ChatSplitter(facts.token_bytes, facts.special_ids, self.tool_format, self.channels, stops, id_prefix,
                            calls_only=self.calls_only, family=self.family, ids=facts.special_tokens)


def plan_chat(req: ChatCompletionRequest, facts: ModelFacts) -> ChatPlan:
    """Validate response_format / tools / tool_choice / thinking fields and plan the request. `req` is a
    ChatCompletionRequest, or any object with its attributes `response_format`, `tools`, `tool_choice`,
    `parallel_tool_calls`, `chat_template_kwargs`, `reasoning_effort` and `stop_token_ids` (the planner builds one
    for a completion's `response_format`).

    Raises:
      ApiError: 400 naming the field: an unenforceable or malformed schema (response_format, or a tool's
        parameters — the message names the keyword and path), a bad tool_choice, response_format with tools,
        thinking on a model without a thought channel.
      families.UnknownFamilyError: `facts.architecture` is not registered (the facts fetch refuses such a model).
    """
    plan = _plan_output(req, facts)
    _stop_ids(plan, req.stop_token_ids or [], facts.output_format().end_tokens if plan.tool_format else (), facts)
    return plan


def _stop_ids(plan: ChatPlan, requested: list[int], end_tokens, facts: ModelFacts) -> None:
    """Set the plan's three stop-id lists (`ChatPlan` attributes), combined here once for the whole request:
    `end_tokens` (spellings: the tool grammar's) always stop generation, whatever the checkpoint's
    generation_config says; under a grammar the model's own stop ids are added to the request's, since a
    constraint ends with a stop token that must end the sequence even with `ignore_eos`."""
    grammar = set(facts.stop_ids) if plan.grammar is not None else set()
    grammar |= {facts.special_tokens[s] for s in end_tokens}
    plan.grammar_stop_ids = sorted(grammar)
    plan.stop_ids = sorted(set(requested) | grammar)
    plan.end_ids = sorted(set(plan.stop_ids) | set(facts.stop_ids))


def _plan_output(req: ChatCompletionRequest, facts: ModelFacts) -> ChatPlan:
    """Everything `plan_chat` decides but the stop ids: grammar, tool mode and format, thinking, banned ids."""
    fmt, ids = facts.output_format(), facts.special_tokens
    plan = ChatPlan(template_kwargs=dict(req.chat_template_kwargs or {}), channels=fmt.reasoning is not None,
                    family=facts.architecture)
    plan.thinking = _thinking(req, fmt, plan.template_kwargs)
    try:
        plan.grammar = grammar_for_response_format(req.response_format)
    except SchemaError as err:
        raise ApiError(400, str(err), param="response_format", code="unsupported_schema") from None
    plan.unit_grammar = _array_units(req.response_format)
    plan.unit_kind = "json" if plan.unit_grammar else ""
    tools = req.tools or []
    try:
        mode, _ = tc.resolve_tool_choice(tools, req.tool_choice)
    except tc.ToolSchemaError as err:
        raise ApiError(400, err.message, param="tools", code="unsupported_schema") from None
    except tc.ToolChoiceError as err:
        raise ApiError(400, str(err), param="tool_choice") from None
    if mode != "none" and plan.grammar is not None:
        raise ApiError(400, "response_format cannot be combined with tools (unless tool_choice is \"none\")",
                       param="response_format")
    if mode == "none":
        if tools:
            plan.banned_ids = [ids[s] for s in fmt.call_markers]
        return plan
    parallel = req.parallel_tool_calls is not False and mode != "named"  # a named choice: exactly one call

    def build(max_calls: int = tc.MAX_PARALLEL_CALLS) -> str | None:
        return fmt.tool_grammar(tools, req.tool_choice, parallel, max_calls, ids=ids)

    try:
        plan.grammar = build()
    except tc.ToolSchemaError as err:
        raise ApiError(400, err.message, param="tools", code="unsupported_schema") from None
    plan.grammar_ends = True
    plan.calls_only = mode in ("required", "named")
    if parallel:
        plan.unit_grammar, plan.unit_kind = build, "tool_calls"
    plan.param = "tools"
    plan.tool_format = facts.architecture
    return plan


def _thinking(req: ChatCompletionRequest, fmt: FamilyFormat, kwargs: dict) -> bool:
    """Whether thinking is on; sets kwargs["enable_thinking"] from reasoning_effort when not given.

    Raises:
      ApiError: 400 for an unknown reasoning_effort, or thinking asked of a model without it.
    """
    if req.reasoning_effort is not None and req.reasoning_effort not in THINKING_EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {', '.join(THINKING_EFFORTS)}, got "
                            f"{req.reasoning_effort!r}", param="reasoning_effort")
    if "enable_thinking" not in kwargs and req.reasoning_effort is not None:
        kwargs["enable_thinking"] = THINKING_EFFORTS[req.reasoning_effort]
    on = bool(kwargs.get("enable_thinking", False))
    if on and not fmt.thinking:
        param = "chat_template_kwargs" if "enable_thinking" in (req.chat_template_kwargs or {}) else \
            "reasoning_effort"
        raise ApiError(400, f"this model ({fmt.name}) has no thinking mode", param=param)
    return on


async def constraint_factory(backends: PlanningView, plan: ChatPlan):
    """A function making one fresh constraint per choice for the plan's grammar, or None when unconstrained.
    `make(budget)` takes the choice's max_tokens: the answer then ends valid within it where the grammar admits a
    short enough ending (gateway/structured/endings.py `BudgetedEnding`), parallel tool calls after the last one that fits
    (gateway/structured/budget.py `BudgetedUnits`); `make()` builds the bare constraint.

    Under thinking (reasoning.ThoughtFirst), the thought channel is free text in which the format's call markers
    (Gemma 4's `<|tool_call>`/`<tool_call|>`) are masked: a call is made only in the answer, after the channel
    closes, so a call is never half in the thought (where it would be reasoning text) and never duplicated.
    """
    if plan.grammar is None:
        return None
    tokenizer = await backends.grammar_tokenizer()
    facts = backends.ready_facts()
    fmt, ids = facts.output_format(), facts.special_tokens
    stops = plan.grammar_stop_ids
    banned_in_thought = [ids[s] for s in fmt.call_markers] if plan.tool_format else []

    def build(max_units: int | None = None):
        grammar = plan.grammar if max_units is None else plan.unit_grammar(max_units)
        inner = Constraint(tokenizer, grammar, facts.vocab_size, stops, grammar_ends=plan.grammar_ends)
        if plan.thinking:
            return ThoughtFirst(inner, facts.vocab_size, ids[fmt.reasoning.open], ids[fmt.reasoning.close],
                                stops + banned_in_thought)
        return inner

    def make(budget: int | None = None):
        if budget is None:
            return build()
        tables = ending_tables(tokenizer)  # built at the first call (~0.2 s, off the event loop), then shared
        if plan.unit_grammar is None:
            return BudgetedEnding(build(), budget, tables)
        if plan.tool_format is not None:
            parser = fmt.tool_parser(ids, "call_", facts.special_ids, False)
            close = fmt.budget_close(tokenizer.tokenize_str)
        else:
            parser, close = JsonArrayProgress(), 3  # `]`, the stop token, a spare one
        units = BudgetedUnits(build, budget, parser, _TextBytes(facts), close, kind=plan.unit_kind)
        return BudgetedEnding(units, budget, tables)

    return make


def _array_units(response_format) -> Callable[[int], str] | None:
    """For a json_schema whose top level is an array: the grammar of the same schema with at most n elements
    (budget-aware endings); else None."""
    spec = (response_format or {}).get("json_schema") if isinstance(response_format, dict) else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict) or schema.get("type") != "array" or not isinstance(schema.get("items"), dict):
        return None

    def capped(n: int) -> str:
        if n < schema.get("minItems", 0):
            raise ValueError(f"{n} elements are fewer than minItems")
        return grammar_for_json_schema({**schema, "maxItems": min(schema.get("maxItems", n), n)})

    return capped


class _TextBytes:
    """token id -> the bytes it adds to the answer's text (control tokens add none)."""

    def __init__(self, facts: ModelFacts):
        self._bytes, self._special = facts.token_bytes, facts.special_ids

    def __getitem__(self, token: int) -> bytes:
        return b"" if token in self._special else self._bytes[token]
