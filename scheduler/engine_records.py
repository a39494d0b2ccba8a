"""The plain values an engine hands out (:mod:`scheduler.engine`): :class:`EngineOutput` per request
and step, :class:`EngineInfo` once loaded, :class:`EngineStats` after each step. Plain data: they
cross process boundaries (:mod:`scheduler.engine_core`).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import FinishReason, SpecDecodeCounts

@dataclass
class EngineOutput(SpecDecodeCounts):
    """What one step produced for one request. Times are seconds (monotonic clock)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding, cumulative over the request (docs/spec_decode.md)
    num_drafts: int = 0               # steps that verified proposals
    num_draft_tokens: int = 0         # proposals verified
    num_accepted_tokens: int = 0      # proposals accepted


@dataclass
class EngineInfo:
    """What a replica's callers need to know of its engine once it has loaded (GetModelInfo,
    the router's block hashes, KV gauges). Plain values: it crosses process boundaries."""

    model: str
    max_model_len: int            # tokens, resolved
    vocab_size: int
    dtype: str                    # weights and activations, e.g. "bfloat16"
    kv_cache_dtype: str           # stored K/V, e.g. "int8"
    block_size: int               # tokens per KV block
    num_blocks: int
    eos_token_ids: tuple[int, ...]
    hash_seed: int                # seed of the prefix-cache block hashes
    kv_bytes_per_token: float     # K and V of one token over all layers, scales included
    max_concurrency: int          # sequences of max_model_len tokens the pool holds at once


@dataclass
class EngineStats:
    """A replica's state, pushed by its engine loop after each step (and after new requests
    arrive), so that readers never take the engine's lock. Token counts are tokens; ``num_added``
    counts the requests the engine had received when the snapshot was taken (a client adds
    its own later submissions to the load it reads, :meth:`EngineCoreClient.load`)."""

    num_waiting: int = 0
    num_running: int = 0
    waiting_tokens: int = 0       # tokens of waiting requests not yet computed
    running_tokens: int = 0       # tokens of running requests
    num_blocks: int = 0
    used_blocks: int = 0
    cached_blocks: int = 0
    prefix_cache_queries: int = 0         # prompt tokens looked up, once per request (BlockStats)
    prefix_cache_hits: int = 0
    prefix_cache_preempted_queries: int = 0   # looked up again by re-admissions after a preemption
    prefix_cache_preempted_hits: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    spec_propose_seconds: float = 0.0
    num_added: int = 0
    # KV tiers below the pool (kvstore.tiers.TierStats): blocks loaded, bytes, seconds
    kv_tier_host_hits: int = 0
    kv_tier_redis_hits: int = 0
    kv_tier_host_bytes_loaded: int = 0
    kv_tier_redis_bytes_loaded: int = 0
    kv_tier_host_bytes_stored: int = 0
    kv_tier_redis_bytes_stored: int = 0
    kv_tier_blocks_offloaded: int = 0
    kv_tier_load_seconds: float = 0.0          # look-ups and copies into the pool
    kv_tier_integrity_failures: int = 0
    kv_tier_unavailable: int = 0
    kv_tier_host_bytes: int = 0                # held by the host tier now (bounded by its capacity)
