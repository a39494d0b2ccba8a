"""Batching policies, one class each over the replica's block manager, chosen once from
``EngineConfig.policy`` (docs/engine.md, "Batching policies")."""

from __future__ import annotations

from kvmesh.core.engine_config import POLICIES
from kvmesh.core.errors import SettingsError
from scheduler.batching.continuous import ContinuousBatching
from scheduler.batching.naive import NaiveBatching
from scheduler.batching.static import StaticBatching
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler

BATCHING: dict[str, type[Scheduler]] = {"continuous": ContinuousBatching, "static": StaticBatching,
                                        "naive": NaiveBatching}
assert tuple(BATCHING) == POLICIES, "kvmesh.core.engine_config.POLICIES (the --policy choices) must name these classes"


def make_scheduler(block_manager: BlockManager, policy: str = "continuous", *, max_num_seqs: int = 64,
                   max_num_batched_tokens: int = 2048, max_model_len: int = 2048, enable_chunked_prefill: bool = True,
                   max_prefill_tokens_with_decodes: int = 0, speculative_method: str = "", num_speculative_tokens: int = 0,
                   speculative_adaptive: bool = True, speculative_max_batch_tokens: int = 0) -> Scheduler:
    """The scheduler of ``policy`` (one of :data:`kvmesh.core.engine_config.POLICIES`). Chunked prefill (with its cap
    ``max_prefill_tokens_with_decodes``) and speculation
    (``speculative_method`` ``""``, ``ngram`` or ``draft``; ``num_speculative_tokens`` proposals
    at most; ``speculative_adaptive``; ``speculative_max_batch_tokens``) are knobs of the continuous policy; the other arguments
    are :class:`scheduler.scheduler.Scheduler`'s.

    Raises:
        SettingsError: unknown policy, or speculation under a policy other than ``continuous``.
    """
    if policy not in BATCHING:
        raise SettingsError(f"unknown scheduling policy {policy!r}; choose one of {POLICIES}")
    limits = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                  max_model_len=max_model_len)
    if policy == "continuous":
        return ContinuousBatching(block_manager, **limits, enable_chunked_prefill=enable_chunked_prefill,
                                  max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
                                  speculative_method=speculative_method,
                                  num_speculative_tokens=num_speculative_tokens,
                                  speculative_adaptive=speculative_adaptive,
                                  speculative_max_batch_tokens=speculative_max_batch_tokens)
    if speculative_method:
        raise SettingsError(f"speculative_method {speculative_method!r} needs policy 'continuous' (got {policy!r})")
    return BATCHING[policy](block_manager, **limits)
