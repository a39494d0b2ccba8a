"""One pipeline stage of a replica, run as a Ray actor by :class:`workers.executor.RayPipelineExecutor`.

A stage holds a contiguous range of decoder layers (the first also the embeddings, the last
also the final norm, lm_head, sampler and, with ``speculative_method=draft``, the draft model) and the paged KV cache of those layers only. Block
ids are the replica's: every stage has the same number of blocks, indexed by the same block
tables.
"""

from __future__ import annotations

import time

import torch

from kvmesh import telemetry
from kvmesh.telemetry import StageSpans
from workers.model_runner import ModelRunner, ModelRunnerOutput, StepInput


class PipelineStage:
    """Layers ``[start_layer, end_layer)`` of the model.

    Args:
        cfg: the replica's EngineConfig (``num_threads`` sets this process's torch threads).
        model_dir: checkpoint directory (readable on the actor's node).
        start_layer, end_layer: decoder layers held here.
        num_blocks: KV pool size, in blocks, shared by all stages.
        index: stage number (0 = first).
        replica: the replica's index (span attributes).
    Raises:
        EngineError: the checkpoint cannot be loaded (surfaces as a RayTaskError on the caller).
    """

    def __init__(self, cfg, model_dir: str, start_layer: int, end_layer: int, num_blocks: int, index: int,
                 replica: int = 0):
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.index = index
        self.runner = ModelRunner(cfg, model_dir, num_blocks, start_layer, end_layer)
        # one span per traced request on this stage (kvmesh/telemetry.py); OTEL_* come from the
        # actor's environment (a local Ray's workers inherit the driver's)
        self.spans = StageSpans(index, self.runner.model.start_layer, self.runner.model.end_layer, replica,
                                telemetry.setup_tracing(telemetry.WORKER))

    def info(self) -> dict:
        m = self.runner.model
        return {"index": self.index, "start_layer": m.start_layer, "end_layer": m.end_layer,
                "num_blocks": self.runner.num_blocks, "kv_cache_bytes": self.runner.kv_cache_bytes}

    def execute(self, step: StepInput, hidden: torch.Tensor | None) -> torch.Tensor | ModelRunnerOutput:
        """Run this stage on a step: ``hidden`` is the previous stage's output (None on the
        first stage). Returns hidden states ``[T, hidden_size]``, or, on the last stage, the
        sampled (or verified) tokens and the draft model's proposals."""
        t0 = time.time_ns()
        out = self.runner.execute(step, hidden)
        self.spans.record(step.seqs, t0, time.time_ns())
        return out

    def free_requests(self, request_ids: list[str]) -> None:
        """Forget finished requests (the last stage's seeded generators) and emit their spans."""
        self.runner.free_requests(request_ids)
        self.spans.finish(request_ids)

    def flush_telemetry(self) -> None:
        """Export the queued spans (before the actor is killed)."""
        telemetry.shutdown_tracing()
