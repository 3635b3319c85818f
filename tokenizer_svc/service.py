"""The tokenizer service's gRPC servicer: proto <-> TextTokenizer and the chat templates."""

from __future__ import annotations

import json

import grpc

from protos import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.chat_template import TEMPLATES, Message, TemplateError, tokenize_segments
from tokenizer_svc.tokenizer import TextTokenizer

SERVICE_NAME = "gemma_serve.v1.Tokenizer"


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
    )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Tokenizer RPCs over one TextTokenizer and one chat template."""

    def __init__(self, tokenizer: TextTokenizer | None = None, template: str = "gemma3"):
        """Args: tokenizer: the loaded tokenizer (None until `set_ready`); template: a key of TEMPLATES."""
        self.tok: TextTokenizer | None = None
        if tokenizer is not None:
            self.set_ready(tokenizer, template)

    def set_ready(self, tokenizer: TextTokenizer, template: str) -> None:
        """Start answering with this tokenizer and template."""
        self.template_name, self.render = template, TEMPLATES[template]
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
        )

    async def Encode(self, request, context):
        await self._ready(context)
        ids = self.tok.encode(request.text, parse_special=request.parse_special, add_bos=request.add_bos)
        return tokenizer_pb2.EncodeResponse(token_ids=ids)

    async def Decode(self, request, context):
        await self._ready(context)
        try:
            text = self.tok.decode(list(request.token_ids), request.skip_special_tokens)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return tokenizer_pb2.DecodeTokensResponse(text=text)

    async def ApplyChatTemplate(self, request, context):
        await self._ready(context)
        try:
            if request.tools_json:
                raise TemplateError(f"tools are not supported by the {self.template_name} template yet")
            if request.template_kwargs_json:
                json.loads(request.template_kwargs_json)
            messages = [message_from_pb(m) for m in request.messages]
            ids, text = tokenize_segments(self.render(messages, request.add_generation_prompt), self.tok)
        except (TemplateError, json.JSONDecodeError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return tokenizer_pb2.ChatTemplateResponse(token_ids=ids, text=text)

    async def GetVocab(self, request, context):
        t = await self._ready(context)
        return tokenizer_pb2.GetVocabResponse(
            token_bytes=t.token_bytes,
            special_token_ids=sorted(t.special_ids),
            bos_token_id=t.bos_id,
            eos_token_id=t.eos_id,
        )
