from protos import common_pb2 as _common_pb2
from protos import tokenizer_pb2 as _tokenizer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatInput(_message.Message):
    __slots__ = ("messages", "tools_json", "template_kwargs_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_tokenizer_pb2.ChatMessage]
    tools_json: str
    template_kwargs_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[_tokenizer_pb2.ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., template_kwargs_json: _Optional[str] = ...) -> None: ...

class TokenInput(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "tokens", "sampling", "max_tokens", "stop", "stop_token_ids", "include_special_tokens", "n", "allowed_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    chat: ChatInput
    tokens: TokenInput
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_special_tokens: bool
    n: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., tokens: _Optional[_Union[TokenInput, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "tokens", "finish_reason", "usage", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.GeneratedToken]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    index: int
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[_common_pb2.GeneratedToken, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...
