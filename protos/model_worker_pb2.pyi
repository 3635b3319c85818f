from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "num_slots", "headroom_rows", "programs_compiling")
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_PERC_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_ROWS_FIELD_NUMBER: _ClassVar[int]
    PROGRAMS_COMPILING_FIELD_NUMBER: _ClassVar[int]
    num_requests_waiting: int
    num_requests_running: int
    kv_cache_usage_perc: float
    num_slots: int
    headroom_rows: int
    programs_compiling: int
    def __init__(self, num_requests_waiting: _Optional[int] = ..., num_requests_running: _Optional[int] = ..., kv_cache_usage_perc: _Optional[float] = ..., num_slots: _Optional[int] = ..., headroom_rows: _Optional[int] = ..., programs_compiling: _Optional[int] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfoResponse(_message.Message):
    __slots__ = ("model_name", "architecture", "vocab_size", "max_model_len", "num_slots", "dtype", "weight_bytes", "kv_bytes_per_token", "kv_bytes_per_sequence", "default_stop_token_ids", "num_compiled_programs", "backend", "max_waiting", "sliding_window", "prefix_caching", "max_position_embeddings", "kv_cache_dtype", "prefill_chunks", "device_memory")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPILED_PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_slots: int
    dtype: str
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    default_stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_compiled_programs: int
    backend: str
    max_waiting: int
    sliding_window: int
    prefix_caching: bool
    max_position_embeddings: int
    kv_cache_dtype: str
    prefill_chunks: _containers.RepeatedScalarFieldContainer[int]
    device_memory: _containers.RepeatedCompositeFieldContainer[DeviceMemory]
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_slots: _Optional[int] = ..., dtype: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., kv_bytes_per_sequence: _Optional[int] = ..., default_stop_token_ids: _Optional[_Iterable[int]] = ..., num_compiled_programs: _Optional[int] = ..., backend: _Optional[str] = ..., max_waiting: _Optional[int] = ..., sliding_window: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., max_position_embeddings: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., prefill_chunks: _Optional[_Iterable[int]] = ..., device_memory: _Optional[_Iterable[_Union[DeviceMemory, _Mapping]]] = ...) -> None: ...

class DeviceMemory(_message.Message):
    __slots__ = ("device_id", "device_kind", "weight_bytes", "kv_bytes", "penalty_bytes", "temp_bytes", "capacity_bytes")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PENALTY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TEMP_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    device_id: int
    device_kind: str
    weight_bytes: int
    kv_bytes: int
    penalty_bytes: int
    temp_bytes: int
    capacity_bytes: int
    def __init__(self, device_id: _Optional[int] = ..., device_kind: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., penalty_bytes: _Optional[int] = ..., temp_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stopping", "initial_mask", "constrained", "share_prompt_with", "allowed_tokens", "cache_salt", "session_id", "session_ttl_s", "session_release", "prediction_token_ids", "draft_scope", "drafts_with_masks", "slo_ttft_s", "slo_tpot_s", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    INITIAL_MASK_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    SHARE_PROMPT_WITH_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_RELEASE_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SCOPE_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_WITH_MASKS_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    stopping: _common_pb2.StoppingParams
    initial_mask: _common_pb2.TokenMask
    constrained: bool
    share_prompt_with: str
    allowed_tokens: _common_pb2.TokenMask
    cache_salt: str
    session_id: str
    session_ttl_s: float
    session_release: bool
    prediction_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_scope: str
    drafts_with_masks: bool
    slo_ttft_s: float
    slo_tpot_s: float
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[_common_pb2.StoppingParams, _Mapping]] = ..., initial_mask: _Optional[_Union[_common_pb2.TokenMask, _Mapping]] = ..., constrained: _Optional[bool] = ..., share_prompt_with: _Optional[str] = ..., allowed_tokens: _Optional[_Union[_common_pb2.TokenMask, _Mapping]] = ..., cache_salt: _Optional[str] = ..., session_id: _Optional[str] = ..., session_ttl_s: _Optional[float] = ..., session_release: _Optional[bool] = ..., prediction_token_ids: _Optional[_Iterable[int]] = ..., draft_scope: _Optional[str] = ..., drafts_with_masks: _Optional[bool] = ..., slo_ttft_s: _Optional[float] = ..., slo_tpot_s: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "finish_reason", "usage", "max_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: _common_pb2.GeneratedToken
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    max_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[_Union[_common_pb2.GeneratedToken, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., max_draft_tokens: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "step", "mask", "forced", "draft")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    step: int
    mask: _common_pb2.TokenMask
    forced: ForcedTokens
    draft: ConstrainedDraft
    def __init__(self, request_id: _Optional[str] = ..., step: _Optional[int] = ..., mask: _Optional[_Union[_common_pb2.TokenMask, _Mapping]] = ..., forced: _Optional[_Union[ForcedTokens, _Mapping]] = ..., draft: _Optional[_Union[ConstrainedDraft, _Mapping]] = ...) -> None: ...

class ConstrainedDraft(_message.Message):
    __slots__ = ("token_ids", "masks")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    masks: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenMask]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., masks: _Optional[_Iterable[_Union[_common_pb2.TokenMask, _Mapping]]] = ...) -> None: ...

class ForcedTokens(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("tokens", "finish_reason", "usage", "max_draft_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.GeneratedToken]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    max_draft_tokens: int
    def __init__(self, tokens: _Optional[_Iterable[_Union[_common_pb2.GeneratedToken, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., max_draft_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
