from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerInfoResponse(_message.Message):
    __slots__ = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "stop_token_ids", "chat_template", "source", "family", "supports_tools", "supports_thinking")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_TOOLS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_THINKING_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    chat_template: str
    source: str
    family: str
    supports_tools: bool
    supports_thinking: bool
    def __init__(self, vocab_size: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., chat_template: _Optional[str] = ..., source: _Optional[str] = ..., family: _Optional[str] = ..., supports_tools: _Optional[bool] = ..., supports_thinking: _Optional[bool] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("text", "add_bos", "parse_special")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_bos: bool
    parse_special: bool
    def __init__(self, text: _Optional[str] = ..., add_bos: _Optional[bool] = ..., parse_special: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeTokensRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens", "return_token_strs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    return_token_strs: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., return_token_strs: _Optional[bool] = ...) -> None: ...

class DecodeTokensResponse(_message.Message):
    __slots__ = ("text", "token_strs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, text: _Optional[str] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("type", "text")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    type: str
    text: str
    def __init__(self, type: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "content_parts", "tool_calls", "tool_call_id", "name", "reasoning_content", "generated_token_ids")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_PARTS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    content_parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    reasoning_content: str
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., content_parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., generated_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatTemplateRequest(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools_json", "template_kwargs_json", "continue_final_message", "tool_choice")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools_json: str
    template_kwargs_json: str
    continue_final_message: bool
    tool_choice: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools_json: _Optional[str] = ..., template_kwargs_json: _Optional[str] = ..., continue_final_message: _Optional[bool] = ..., tool_choice: _Optional[str] = ...) -> None: ...

class ChatTemplateResponse(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class GetVocabRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetVocabResponse(_message.Message):
    __slots__ = ("token_bytes", "special_token_ids", "bos_token_id", "eos_token_id", "tokenizer_json")
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    token_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    special_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    eos_token_id: int
    tokenizer_json: str
    def __init__(self, token_bytes: _Optional[_Iterable[bytes]] = ..., special_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., tokenizer_json: _Optional[str] = ...) -> None: ...
