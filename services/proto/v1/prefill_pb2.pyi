from moemesh.proto.v1 import common_pb2 as _common_pb2
from moemesh.proto.v1 import telemetry_pb2 as _telemetry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheTensorLayout(_message.Message):
    __slots__ = ("token_shape",)
    TOKEN_SHAPE_FIELD_NUMBER: _ClassVar[int]
    token_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("dtype", "tensors", "model_id")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    tensors: _containers.RepeatedCompositeFieldContainer[CacheTensorLayout]
    model_id: str
    def __init__(self, dtype: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[CacheTensorLayout, _Mapping]]] = ..., model_id: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "num_computed_tokens", "layout", "max_chunk_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    num_computed_tokens: int
    layout: KVLayout
    max_chunk_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_computed_tokens: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "num_cached_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    num_cached_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("start_token", "num_tokens", "data")
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start_token: int
    num_tokens: int
    data: bytes
    def __init__(self, start_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("chunk", "done")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    chunk: KVChunk
    done: PrefillDone
    def __init__(self, chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...
