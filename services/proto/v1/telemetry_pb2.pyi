from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("worker_id", "role", "num_waiting", "num_running", "num_waiting_for_kv", "num_blocks_total", "num_blocks_used", "kv_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "ttft_p90_s", "itl_p90_s", "num_requests_finished", "num_kv_exports_held")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_S_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_S_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_EXPORTS_HELD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_waiting: int
    num_running: int
    num_waiting_for_kv: int
    num_blocks_total: int
    num_blocks_used: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    ttft_p90_s: float
    itl_p90_s: float
    num_requests_finished: int
    num_kv_exports_held: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting_for_kv: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., kv_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., ttft_p90_s: _Optional[float] = ..., itl_p90_s: _Optional[float] = ..., num_requests_finished: _Optional[int] = ..., num_kv_exports_held: _Optional[int] = ...) -> None: ...
