"""The tokenizer service's gRPC servicer: proto <-> TextTokenizer and the chat templates; `Info` advertises the
model family and its template's facts (`chat_template.TemplateFacts`)."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc

from common import families
from protos import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.chat_template import (
    TEMPLATES,
    Message,
    Renderer,
    TemplateError,
    continue_final_message,
    tokenize_segments,
    tokenizer_part,
)
from tokenizer_svc.tokenizer import TextTokenizer

SERVICE_NAME = "gemma_serve.v1.Tokenizer"
#: `ChatTemplateRequest.tool_choice` values ("" means "auto").
TOOL_CHOICES = ("auto", "required", "named", "none")
log = logging.getLogger("gemma_serve.tokenizer")


def tools_from_json(text: str) -> list[dict]:
    """`ChatTemplateRequest.tools_json` (the OpenAI `tools` array as JSON; "" for none) -> list of tool dicts.

    Raises:
      TemplateError: not JSON, or not an array of objects.
    """
    if not text.strip():
        return []
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as err:
        raise TemplateError(f"tools_json is not valid JSON: {err}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise TemplateError("tools_json must be a JSON array of tool objects")
    return tools


def options_from_json(text: str) -> dict:
    """`ChatTemplateRequest.template_kwargs_json` (a JSON object; "" for none) -> template options dict.

    Raises:
      TemplateError: not JSON, or not an object.
    """
    if not text.strip():
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise TemplateError(f"template_kwargs_json is not valid JSON: {err}") from None
    if not isinstance(options, dict):
        raise TemplateError("template_kwargs_json must be a JSON object")
    return options


def message_from_pb(m: tokenizer_pb2.ChatMessage) -> Message:
    """Proto ChatMessage -> template Message."""
    return Message(
        role=m.role,
        content=m.content if m.HasField("content") else None,
        parts=[(p.type, p.text) for p in m.content_parts],
        tool_calls=[(c.id, c.name, c.arguments_json) for c in m.tool_calls],
        tool_call_id=m.tool_call_id,
        name=m.name,
        reasoning=m.reasoning_content,
        generated_ids=tuple(m.generated_token_ids),
    )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Tokenizer RPCs over one TextTokenizer and one chat template."""

    def __init__(self, tokenizer: TextTokenizer | None = None, template: str | None = None,
                 render: Renderer | None = None):
        """Args: tokenizer: the loaded tokenizer (None until `set_ready`); template, render: see `set_ready`
        (required with a tokenizer).

        Raises:
          UnknownFamilyError: see `set_ready`.
        """
        self.tok: TextTokenizer | None = None
        if tokenizer is not None:
            self.set_ready(tokenizer, template, render)

    def set_ready(self, tokenizer: TextTokenizer, template: str, render: Renderer | None = None) -> None:
        """Start answering with this tokenizer and template.

        Args:
          tokenizer: the loaded tokenizer.
          template: the template's name, reported by Info: a family's name for its built-in template ("gemma3",
            "gemma4"), or "checkpoint" for a checkpoint's `JinjaTemplate`.
          render: the renderer (a `JinjaTemplate`, carrying its checkpoint's family, for "checkpoint"); default
            the family's built-in one (`TEMPLATES[template]`).

        Raises:
          UnknownFamilyError: neither `render` carries a family nor `template` names a registered one.
        """
        family = getattr(render, "family", None) or families.by_name(template)
        self.family, self.facts = family, tokenizer_part(family).template_facts
        self.template_name, self.render = template, render if render is not None else TEMPLATES[template]
        self.tok = tokenizer

    async def _ready(self, context) -> TextTokenizer:
        if self.tok is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer is still loading")
        return self.tok

    async def Info(self, request, context):
        t = await self._ready(context)
        return tokenizer_pb2.TokenizerInfoResponse(
            vocab_size=t.vocab_size,
            bos_token_id=t.bos_id,
            eos_token_id=t.eos_id,
            pad_token_id=t.pad_id,
            stop_token_ids=t.stop_ids,
            chat_template=self.template_name,
            source=t.source,
            family=self.family.name,
            supports_tools=self.facts.supports_tools,
            supports_thinking=self.facts.supports_thinking,
        )

    async def Encode(self, request, context):
        await self._ready(context)
        # Off the event loop, which also answers health checks: a long text takes a while to encode.
        ids = await asyncio.to_thread(self.tok.encode, request.text, parse_special=request.parse_special,
                                      add_bos=request.add_bos)
        return tokenizer_pb2.EncodeResponse(token_ids=ids)

    async def Decode(self, request, context):
        await self._ready(context)
        try:
            text = self.tok.decode(list(request.token_ids), request.skip_special_tokens)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        reply = tokenizer_pb2.DecodeTokensResponse(text=text)
        if request.return_token_strs:
            spell = self.tok.tok.id_to_token
            reply.token_strs.extend(spell(i) or "" for i in request.token_ids)
        return reply

    async def ApplyChatTemplate(self, request, context):
        await self._ready(context)
        try:
            ids, text = await asyncio.to_thread(self._render, request)
        except TemplateError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except RecursionError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the conversation's JSON (tools, tool-call "
                                "arguments or template options) is nested too deeply")
        except Exception:
            log.exception("ApplyChatTemplate failed")
            await context.abort(grpc.StatusCode.INTERNAL, "the chat template failed on this conversation")
        return tokenizer_pb2.ChatTemplateResponse(token_ids=ids, text=text)

    def _render(self, request) -> tuple[list[int], str]:
        """Render and tokenize a ChatTemplateRequest (on a worker thread). Raises TemplateError."""
        tools = tools_from_json(request.tools_json)
        options = options_from_json(request.template_kwargs_json)
        messages = [message_from_pb(m) for m in request.messages]
        tool_choice = request.tool_choice or "auto"
        if tool_choice not in TOOL_CHOICES:
            raise TemplateError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {tool_choice[:40]!r}")
        if request.continue_final_message:
            if request.add_generation_prompt:
                raise TemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
            segments = continue_final_message(self.render, messages, tools, options, tool_choice=tool_choice)
        else:
            segments = self.render(messages, request.add_generation_prompt, tools, options, tool_choice=tool_choice)
        try:
            return tokenize_segments(segments, self.tok)
        except UnicodeEncodeError:
            raise TemplateError("the conversation contains text that is not valid Unicode (a lone surrogate)") \
                from None

    async def GetVocab(self, request, context):
        t = await self._ready(context)
        return tokenizer_pb2.GetVocabResponse(
            token_bytes=t.token_bytes,
            special_token_ids=sorted(t.special_ids),
            bos_token_id=t.bos_id,
            eos_token_id=t.eos_id,
            tokenizer_json=t.tok.to_str(),
        )
