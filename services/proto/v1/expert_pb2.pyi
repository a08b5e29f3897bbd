from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RunExpertsRequest(_message.Message):
    __slots__ = ("layer", "placement_version", "hidden_states", "group_slots", "group_experts", "group_rows", "row_ids", "entry_weights", "sequence_id", "outputs_in_input_dtype")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SLOTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_IDS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_IN_INPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    placement_version: int
    hidden_states: Tensor
    group_slots: _containers.RepeatedScalarFieldContainer[int]
    group_experts: _containers.RepeatedScalarFieldContainer[int]
    group_rows: _containers.RepeatedScalarFieldContainer[int]
    row_ids: _containers.RepeatedScalarFieldContainer[int]
    entry_weights: Tensor
    sequence_id: int
    outputs_in_input_dtype: bool
    def __init__(self, layer: _Optional[int] = ..., placement_version: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., group_slots: _Optional[_Iterable[int]] = ..., group_experts: _Optional[_Iterable[int]] = ..., group_rows: _Optional[_Iterable[int]] = ..., row_ids: _Optional[_Iterable[int]] = ..., entry_weights: _Optional[_Union[Tensor, _Mapping]] = ..., sequence_id: _Optional[int] = ..., outputs_in_input_dtype: _Optional[bool] = ...) -> None: ...

class RunExpertsResponse(_message.Message):
    __slots__ = ("outputs", "sequence_id", "error_code", "error", "compute_s")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    outputs: Tensor
    sequence_id: int
    error_code: str
    error: str
    compute_s: float
    def __init__(self, outputs: _Optional[_Union[Tensor, _Mapping]] = ..., sequence_id: _Optional[int] = ..., error_code: _Optional[str] = ..., error: _Optional[str] = ..., compute_s: _Optional[float] = ...) -> None: ...

class OpenDataPlaneRequest(_message.Message):
    __slots__ = ("session", "backend")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    session: str
    backend: str
    def __init__(self, session: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class OpenDataPlaneResponse(_message.Message):
    __slots__ = ("store_port",)
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    store_port: int
    def __init__(self, store_port: _Optional[int] = ...) -> None: ...

class ExpertStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HostedReplica(_message.Message):
    __slots__ = ("version", "layer", "slot", "expert", "num_tokens")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    version: int
    layer: int
    slot: int
    expert: int
    num_tokens: int
    def __init__(self, version: _Optional[int] = ..., layer: _Optional[int] = ..., slot: _Optional[int] = ..., expert: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class LayerExpert(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class ExpertStatus(_message.Message):
    __slots__ = ("worker_id", "model_id", "dtype", "num_moe_layers", "num_experts", "serving", "active_version", "loaded_versions", "replicas", "hosted_experts", "num_in_flight", "expert_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    HOSTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_id: str
    dtype: str
    num_moe_layers: int
    num_experts: int
    serving: bool
    active_version: int
    loaded_versions: _containers.RepeatedScalarFieldContainer[int]
    replicas: _containers.RepeatedCompositeFieldContainer[HostedReplica]
    hosted_experts: _containers.RepeatedCompositeFieldContainer[LayerExpert]
    num_in_flight: int
    expert_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., num_moe_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., serving: _Optional[bool] = ..., active_version: _Optional[int] = ..., loaded_versions: _Optional[_Iterable[int]] = ..., replicas: _Optional[_Iterable[_Union[HostedReplica, _Mapping]]] = ..., hosted_experts: _Optional[_Iterable[_Union[LayerExpert, _Mapping]]] = ..., num_in_flight: _Optional[int] = ..., expert_tokens: _Optional[_Iterable[int]] = ...) -> None: ...
