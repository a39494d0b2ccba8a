from kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "session_id", "cache_salt", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    session_id: str
    cache_salt: str
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finished", "finish_reason", "stop_reason", "usage", "timings", "replica")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finished: bool
    finish_reason: _common_pb2.FinishReason
    stop_reason: str
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    replica: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., replica: _Optional[int] = ...) -> None: ...

class SchedulerAbortRequest(_message.Message):
    __slots__ = ("request_id", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class SchedulerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("name", "max_model_len", "vocab_size", "dtype", "kv_cache_dtype", "block_size", "eos_token_ids", "num_replicas", "pipeline_parallel_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_model_len: int
    vocab_size: int
    dtype: str
    kv_cache_dtype: str
    block_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_replicas: int
    pipeline_parallel_size: int
    def __init__(self, name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_replicas: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("replica", "healthy", "num_waiting", "num_running", "num_waiting_tokens", "num_running_tokens", "num_blocks", "num_used_blocks", "num_cached_blocks", "num_steps", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "replica_id", "indexed", "index_resyncs", "index_failures", "kv_cache_dtype", "kv_cache_bytes_per_token", "max_concurrency", "restarts", "pid", "prefix_cache_preempted_queries", "prefix_cache_preempted_hits", "kv_tier_host_hits", "kv_tier_redis_hits", "kv_tier_host_bytes_loaded", "kv_tier_redis_bytes_loaded", "kv_tier_host_bytes_stored", "kv_tier_redis_bytes_stored", "kv_tier_blocks_offloaded", "kv_tier_load_seconds", "kv_tier_integrity_failures", "kv_tier_unavailable", "kv_tier_host_bytes", "stage_pids")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INDEXED_FIELD_NUMBER: _ClassVar[int]
    INDEX_RESYNCS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_PREEMPTED_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_PREEMPTED_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_HOST_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_REDIS_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_HOST_BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_REDIS_BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_HOST_BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_REDIS_BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BLOCKS_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_INTEGRITY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGE_PIDS_FIELD_NUMBER: _ClassVar[int]
    replica: int
    healthy: bool
    num_waiting: int
    num_running: int
    num_waiting_tokens: int
    num_running_tokens: int
    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_steps: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    replica_id: str
    indexed: bool
    index_resyncs: int
    index_failures: int
    kv_cache_dtype: str
    kv_cache_bytes_per_token: float
    max_concurrency: int
    restarts: int
    pid: int
    prefix_cache_preempted_queries: int
    prefix_cache_preempted_hits: int
    kv_tier_host_hits: int
    kv_tier_redis_hits: int
    kv_tier_host_bytes_loaded: int
    kv_tier_redis_bytes_loaded: int
    kv_tier_host_bytes_stored: int
    kv_tier_redis_bytes_stored: int
    kv_tier_blocks_offloaded: int
    kv_tier_load_seconds: float
    kv_tier_integrity_failures: int
    kv_tier_unavailable: int
    kv_tier_host_bytes: int
    stage_pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, replica: _Optional[int] = ..., healthy: _Optional[bool] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ..., num_running_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., replica_id: _Optional[str] = ..., indexed: _Optional[bool] = ..., index_resyncs: _Optional[int] = ..., index_failures: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., kv_cache_bytes_per_token: _Optional[float] = ..., max_concurrency: _Optional[int] = ..., restarts: _Optional[int] = ..., pid: _Optional[int] = ..., prefix_cache_preempted_queries: _Optional[int] = ..., prefix_cache_preempted_hits: _Optional[int] = ..., kv_tier_host_hits: _Optional[int] = ..., kv_tier_redis_hits: _Optional[int] = ..., kv_tier_host_bytes_loaded: _Optional[int] = ..., kv_tier_redis_bytes_loaded: _Optional[int] = ..., kv_tier_host_bytes_stored: _Optional[int] = ..., kv_tier_redis_bytes_stored: _Optional[int] = ..., kv_tier_blocks_offloaded: _Optional[int] = ..., kv_tier_load_seconds: _Optional[float] = ..., kv_tier_integrity_failures: _Optional[int] = ..., kv_tier_unavailable: _Optional[int] = ..., kv_tier_host_bytes: _Optional[int] = ..., stage_pids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("replicas", "routing", "scheduler_id", "index", "routed_requests", "prefix_routed", "prefix_routed_blocks", "routing_fallbacks")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ROUTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ROUTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStats]
    routing: str
    scheduler_id: str
    index: str
    routed_requests: int
    prefix_routed: int
    prefix_routed_blocks: int
    routing_fallbacks: int
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStats, _Mapping]]] = ..., routing: _Optional[str] = ..., scheduler_id: _Optional[str] = ..., index: _Optional[str] = ..., routed_requests: _Optional[int] = ..., prefix_routed: _Optional[int] = ..., prefix_routed_blocks: _Optional[int] = ..., routing_fallbacks: _Optional[int] = ...) -> None: ...
