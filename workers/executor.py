"""Executors: how the engine loop reaches the model. The engine only calls this interface.

``InProcessExecutor`` runs the model runner in the engine's own process (tests, offline
``LLM``); a Ray pipeline executor (one actor per stage) implements the same methods.
"""

from __future__ import annotations

from typing import Protocol

from scheduler.scheduler import SchedulerOutput
from workers.model_runner import ModelRunner, ModelRunnerOutput


class Executor(Protocol):
    num_blocks: int
    kv_cache_bytes: int

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    def free_requests(self, request_ids: list[str]) -> None: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """The whole model in this process."""

    def __init__(self, cfg, model_dir: str, num_blocks: int | None = None):
        self.runner = ModelRunner(cfg, model_dir, num_blocks)
        self.num_blocks = self.runner.num_blocks
        self.kv_cache_bytes = self.runner.kv_cache_bytes

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def free_requests(self, request_ids: list[str]) -> None:
        self.runner.free_requests(request_ids)

    def shutdown(self) -> None:
        self.runner = None


def create_executor(cfg, model_dir: str, sched_cfg, replica: int = 0) -> Executor:
    """The executor of one replica, as the scheduler service's settings say.

    Args:
        cfg: the replica's resolved :class:`kvmesh.config.EngineConfig`.
        model_dir: checkpoint directory.
        sched_cfg: :class:`kvmesh.config.SchedulerConfig` (``executor``, ``pp``, ``pp_layers``,
            ``ray_address``, ``stage_num_cpus``).
        replica: index of the replica (names its Ray actors).
    Raises:
        EngineError: bad pipeline settings, or the model cannot be loaded.
    """
    if sched_cfg.executor == "local":
        return InProcessExecutor(cfg, model_dir)
    raise NotImplementedError("Ray pipeline executor: in progress")
