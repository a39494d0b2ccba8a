"""Executors: how the engine loop reaches the model. The engine only calls this interface.

``submit(out)`` starts one model step (a micro-batch) and returns a handle whose
``result()`` waits for its :class:`ModelRunnerOutput`; up to ``max_inflight`` steps may be
in flight at once (pipeline parallelism: one micro-batch per stage, as vLLM's PP). An executor
whose parts can die on their own (Ray stages) also has ``check_health()``, which the engine
process calls while idle.

- :class:`InProcessExecutor`: the whole model in the engine's own process (tests, offline
  ``LLM``); a step completes inside ``submit``.
- :class:`RayPipelineExecutor`: one Ray actor per pipeline stage and tensor-parallel rank
  (:mod:`workers.stage`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Protocol

import torch

from kvmesh.core.errors import DependencyUnavailableError, EngineError, SettingsError
from kvmesh.core.telemetry import StageSpans, tracing_enabled
from workers.model_runner import ModelRunner, ModelRunnerOutput
from workers.step import ScheduledStep, StepDecoder, StepEncoder
from workers.tensor_parallel import check_split


class StepHandle(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class Executor(Protocol):
    num_blocks: int
    kv_cache_bytes: int
    max_inflight: int

    def submit(self, out: ScheduledStep) -> StepHandle: ...

    def free_requests(self, request_ids: list[str]) -> None: ...

    def shutdown(self) -> None: ...

    # KV tiers (kvstore/tiers.py): whole blocks out of the pool and back, one body per stage
    kv_layer_ranges: list[tuple[int, int]]

    def save_blocks(self, block_ids: list[int]) -> list[list[bytes]]: ...

    def load_blocks(self, block_ids: list[int], bodies: list[list[bytes]]) -> None: ...


class Completed:
    """The handle of a step that already ran."""

    def __init__(self, output: ModelRunnerOutput):
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class InProcessExecutor:
    """The whole model in this process; one step at a time. Each step goes through the step
    format every executor uses (:mod:`workers.step`): encoded, then decoded into the runner's
    :class:`~workers.step.StepInput` (handed over as it is: no pickling)."""

    max_inflight = 1

    def __init__(self, cfg, model_dir: str, num_blocks: int | None = None):
        self.runner = ModelRunner(cfg, model_dir, num_blocks)
        self.block_size = cfg.block_size
        self.num_blocks = self.runner.num_blocks
        self.kv_cache_bytes = self.runner.kv_cache_bytes
        self.encoder, self.decoder = StepEncoder(cfg.block_size), StepDecoder()
        m = self.runner.model
        self.spans = StageSpans(0, m.start_layer, m.end_layer)   # one stage: the whole model

    def execute(self, out: ScheduledStep) -> ModelRunnerOutput:
        delta = self.encoder.encode(out)
        step = self.decoder.apply(delta)
        t0 = time.time_ns()
        result = self.runner.execute(step)
        self.decoder.record(result.sampled)
        self.spans.record(step.seqs, t0, time.time_ns())
        if delta.done:
            self._free(self.decoder.free(delta.done))
        return result

    def submit(self, out: ScheduledStep) -> Completed:
        return Completed(self.execute(out))

    def free_requests(self, request_ids: list[str]) -> None:
        self.decoder.free(self.encoder.free(request_ids))
        self._free(request_ids)

    def _free(self, request_ids: list[str]) -> None:
        self.runner.free_requests(request_ids)
        self.spans.finish(request_ids)

    @property
    def kv_layer_ranges(self) -> list[tuple[int, int]]:
        m = self.runner.model
        return [(m.start_layer, m.end_layer)]

    def save_blocks(self, block_ids: list[int]) -> list[list[bytes]]:
        """Bodies of blocks ``block_ids`` (:func:`workers.kv_blocks.save_blocks`), one stage each."""
        from workers.kv_blocks import save_blocks
        return [[b] for b in save_blocks(self.runner.kv_caches, block_ids)]

    def load_blocks(self, block_ids: list[int], bodies: list[list[bytes]]) -> None:
        """Write saved bodies (``bodies[i][0]``) into blocks ``block_ids`` before the next step."""
        from workers.kv_blocks import load_blocks
        load_blocks(self.runner.kv_caches, block_ids, [b[0] for b in bodies])

    def shutdown(self) -> None:
        self.runner = None


def split_layers(num_layers: int, pp: int, split: list[int] | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` decoder-layer ranges of ``pp`` stages: ``split`` (layers per stage)
    or an even split, earlier stages taking the remainder. Raises EngineError."""
    if split is None:
        if pp > num_layers:
            raise SettingsError(f"pp={pp} stages for a model of {num_layers} layers")
        split = [num_layers // pp + (i < num_layers % pp) for i in range(pp)]
    if len(split) != pp or sum(split) != num_layers or min(split) < 1:
        raise SettingsError(f"pp_layers {split} must be {pp} positive counts summing to the model's {num_layers} layers")
    bounds, start = [], 0
    for n in split:
        bounds.append((start, start + n))
        start += n
    return bounds


def _drop_sigterm_note(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("SIGTERM handler is not set")


LOCAL_RAY_STARTS = 3     # tries of ensure_ray to start a local instance (its raylet's start can time out)


def ensure_ray(address: str = "", num_cpus: float | None = None) -> None:
    """Connect to Ray: the cluster at ``address``, or a local instance started here with no
    dashboard, no usage stats and logs under Ray's temp dir. Idempotent."""
    # Ray reads these when it is imported, so they are set first.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's abseil failure-signal handler turns SIGTERM into an abort ~3 s later, cutting the
    # graceful shutdown of `kvmesh serve` short.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    if not address:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")      # a local instance needs no token
        # Ray's raylet starts its workers at nice 15 (its worker_niceness) unless told otherwise;
        # the stage actors are on every request's path, so a local instance runs them at the
        # caller's priority (a cluster's nodes need it at `ray start`: deploy/Dockerfile)
        os.environ.setdefault("RAY_worker_niceness", "0")
    import ray

    if ray.is_initialized():
        return
    # ray.init from a thread other than the main one (the engine loop's) warns that it set no
    # SIGTERM handler on every start; kvmesh handles SIGTERM itself, so that line is dropped
    logging.getLogger("ray._private.worker").addFilter(_drop_sigterm_note)
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    # A local instance whose raylet does not register within Ray's fixed 30 s (seen on a
    # 2-core machine running two test processes and a compiler) is stopped and started again,
    # up to LOCAL_RAY_STARTS times in all; other errors are raised as they come.
    for attempt in range(1, LOCAL_RAY_STARTS + 1):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            return
        except Exception as e:      # Ray raises a bare Exception for it
            if "timed out during startup" not in str(e) or attempt == LOCAL_RAY_STARTS:
                raise
            ray.shutdown()
            print(f"kvmesh: the local Ray instance timed out during startup (start {attempt} of "
                  f"{LOCAL_RAY_STARTS}); starting it again", file=sys.stderr, flush=True)



def _first_line(e: BaseException) -> str:
    """The first line of a Ray error's message (the rest: actor ids, addresses, advice)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


WATCH_AFTER_S = 1.0      # seconds a tensor-parallel step runs before its handle watches every rank


class RayHandle:
    """The in-flight step of a :class:`RayPipelineExecutor`: ``ref`` is the result of its last
    stage (its rank 0 under tensor parallelism), ``stage`` that stage's index. ``ranks``: under
    tensor parallelism, ``{ref: (stage, rank)}`` of every other actor's call of the step, watched
    once the step has run :data:`WATCH_AFTER_S`, so that a rank that dies mid-step fails the step
    within about a second instead of after its peers' communicator timeout.

    Raises (``result``): EngineError naming the stage (and rank) when the step failed: an actor
    died, or its step failed (an earlier stage died: its link closed; or an error in the step).
    The engine loop dies of it, and with it the replica (:mod:`scheduler.engine_core`)."""

    def __init__(self, ref, stage: int, ranks: dict | None = None):
        self.ref, self.stage, self.ranks = ref, stage, ranks or {}

    def result(self) -> ModelRunnerOutput:
        import ray
        where = f"pipeline stage {self.stage}" + (" rank 0" if self.ranks else "")
        try:
            # a step that is done within a second (decode) costs one wait; a longer one (a prefill
            # chunk, or a rank gone) watches the other ranks from then on
            slow = bool(self.ranks) and not ray.wait([self.ref], timeout=WATCH_AFTER_S)[0]
            pending = [self.ref, *self.ranks] if slow else [self.ref]
            while len(pending) > 1 and self.ref in pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for r in ready:
                    if r != self.ref:
                        stage, rank = self.ranks[r]
                        where = f"pipeline stage {stage} rank {rank}"
                        ray.get(r)                  # raises when that rank failed or died
                        where = f"pipeline stage {self.stage} rank 0"
            return ray.get(self.ref)
        except ray.exceptions.ActorDiedError as e:
            raise DependencyUnavailableError(f"{where} died: {_first_line(e)}") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, EngineError) else repr(e.cause)
            raise DependencyUnavailableError(f"{where}: {cause}") from None
        except ray.exceptions.RayError as e:       # lost objects, a dead owner, ...
            raise DependencyUnavailableError(f"{where}: {_first_line(e)}") from None


# --stage-placement -> Ray placement group strategy (one bundle per stage)
PLACEMENT_STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict-spread": "STRICT_SPREAD"}


class RayPipelineExecutor:
    """A replica's model as ``pp x tp`` Ray actors: ``pp`` pipeline stages of ``tp``
    tensor-parallel ranks each (:mod:`workers.tensor_parallel`; ``stages`` lists them stage by
    stage, rank by rank).

    The actors are placed by a Ray placement group of one ``{"CPU": stage_num_cpus}`` bundle
    per actor (``placement``: ``pack`` puts them on as few nodes as fit, ``spread`` on
    different nodes where it can, ``strict-spread`` on different nodes or not at all); each
    actor runs in its bundle, and the group is removed at :meth:`shutdown`. A stage's ranks
    form their group once loaded (:meth:`workers.stage.PipelineStage.connect_tp`): through
    shared memory when they landed on one node, else gloo over TCP. Rank r of stage k sends its
    hidden states to rank r of stage k+1 (every rank holds the whole hidden state after the
    layer's all-reduce); rank 0 of the last stage samples, and its result is the step's.

    ``submit`` sends every stage the step's incremental message (:mod:`workers.step`: a
    request's prompt-side data and block ids once, then per step its new tokens and new
    blocks) at once; stage k+1 prepares its inputs and takes stage k's hidden states (``[T,
    hidden_size]``) from the TCP link between them (:class:`workers.stage.StageLink`, set up
    here), and the last stage's result comes back through Ray. Each actor runs its calls in
    submission order, so with ``pp`` micro-batches in flight every stage has work. The last
    stage samples; with speculative decoding it also verifies the proposals and runs the
    draft model, whose proposals for a request's next step come back with this step's output
    (docs/spec_decode.md).

    Args:
        cfg: the replica's EngineConfig.
        model_dir: checkpoint directory (the same path on every node).
        pp: stages.
        layer_split: decoder layers per stage (None: even split).
        tp: tensor-parallel ranks per stage.
        stage_num_cpus: CPUs each stage reserves (> 0); its torch threads unless
            ``cfg.num_threads`` is set.
        replica: the replica's index (messages, spans).
        placement: ``pack``, ``spread`` or ``strict-spread`` (:data:`PLACEMENT_STRATEGIES`).
        placement_timeout: seconds to wait for the placement group.
    Raises:
        EngineError: a bad layer split or placement, head counts ``tp`` does not divide (the
            message names them), the stages cannot be placed within
            ``placement_timeout`` (the message names the bundles asked for and what the
            cluster has free), a stage fails to load the model, or consecutive stages cannot
            connect (their nodes must reach each other on any TCP port, as Ray's workers do).
    """

    def __init__(self, cfg, model_dir: str, pp: int, layer_split: list[int] | None = None,
                 stage_num_cpus: float = 1.0, replica: int = 0, placement: str = "pack",
                 placement_timeout: float = 60.0, tp: int = 1):
        import threading

        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from workers.kv_cache import budget_bytes, bytes_per_block, kv_dtype
        from workers.checkpoint import load_config
        from workers.stage import PipelineStage

        if placement not in PLACEMENT_STRATEGIES:
            raise SettingsError(f"stage placement must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {placement!r}")
        if stage_num_cpus <= 0:
            raise SettingsError(f"stage_num_cpus must be > 0, got {stage_num_cpus}")
        m = load_config(model_dir)
        bounds = split_layers(m.num_layers, pp, layer_split)
        check_split(m, tp, cfg.weight_format, cfg.quant_group_size)
        per_block = bytes_per_block(m.num_layers, cfg.block_size, m.num_kv_heads, m.head_dim,
                                    kv_dtype(cfg.kv_cache_dtype, cfg.torch_dtype))
        self.num_blocks = budget_bytes(cfg.kv_cache_memory, torch.device(cfg.device)) // per_block
        if self.num_blocks < 1:
            raise SettingsError(f"KV cache budget holds no block of {per_block} bytes; raise --kv-cache-memory")
        self.block_size = cfg.block_size
        self.max_inflight = pp
        self.tp = tp
        self.stages = []
        self.encoder = StepEncoder(cfg.block_size)
        self._lock = threading.Lock()       # encoder state and the stage calls, in one order
        bundles = [{"CPU": float(stage_num_cpus)} for _ in range(pp * tp)]
        strategy = PLACEMENT_STRATEGIES[placement]
        self.placement_group = placement_group(bundles, strategy=strategy)
        if not self.placement_group.wait(timeout_seconds=placement_timeout):
            free = {k: v for k, v in sorted(ray.available_resources().items()) if not k.startswith("node:")}
            nodes = sum(n["Alive"] for n in ray.nodes())
            self.shutdown()
            what = f"{pp} pipeline stages" + (f" x {tp} tensor-parallel ranks" if tp > 1 else "")
            raise DependencyUnavailableError(f"replica {replica}: Ray could not place {what} within "
                                             f"{placement_timeout:g} s: asked for bundles {bundles} with strategy {strategy} "
                                             f"(--stage-placement {placement}, --stage-num-cpus); the cluster has {free} "
                                             f"free on {nodes} alive node(s)")
        cfg = cfg.replace(num_threads=cfg.num_threads or max(1, round(stage_num_cpus)))
        actor = ray.remote(PipelineStage)
        self.stages = [actor.options(num_cpus=stage_num_cpus, max_concurrency=1,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(
                                         self.placement_group, placement_group_bundle_index=i * tp + r))
                       .remote(cfg, model_dir, start, end, self.num_blocks, i, replica, r, tp)
                       for i, (start, end) in enumerate(bounds) for r in range(tp)]
        try:
            infos = ray.get([s.info.remote() for s in self.stages])
        except ray.exceptions.RayError as e:
            self.shutdown()
            lines = str(e).strip().splitlines()     # the traceback's last line names the error
            raise DependencyUnavailableError(f"replica {replica}: a pipeline stage failed to start: "
                                             f"{lines[-1] if lines else e!r}") from None
        try:
            # hidden states: stage k -> k+1 over TCP, rank r to rank r
            for prev, nxt in zip(self.stages, self.stages[tp:]):
                host, port, token = ray.get(nxt.listen.remote())
                ray.get([prev.connect_next.remote(host, port, token), nxt.accept_prev.remote()])
            if tp > 1:
                self._connect_tp(infos, replica)
                infos = ray.get([s.info.remote() for s in self.stages])
        except ray.exceptions.RayError as e:
            self.shutdown()
            lines = str(e).strip().splitlines()
            raise DependencyUnavailableError(f"replica {replica}: pipeline stages or tensor-parallel ranks could not "
                                             f"connect: {lines[-1] if lines else e!r}") from None
        self.stage_info = infos
        self.kv_cache_bytes = sum(i["kv_cache_bytes"] for i in infos)
        self.layer_bounds = bounds

    def _connect_tp(self, infos: list[dict], replica: int) -> None:
        """Form each stage's tensor-parallel group: shared memory where its ranks share a node,
        gloo (rank 0's address) otherwise."""
        import uuid

        import ray
        tp = self.tp
        for i in range(0, len(self.stages), tp):
            ranks, nodes = self.stages[i:i + tp], {info["node_id"] for info in infos[i:i + tp]}
            if len(nodes) == 1:
                kind, address = "shm", f"kvmesh-tp-{replica}-{i // tp}-{uuid.uuid4().hex[:12]}"
            else:
                kind, address = "gloo", f"tcp://{infos[i]['ip']}:{ray.get(ranks[0].free_port.remote())}"
            ray.get([r.connect_tp.remote(kind, address) for r in ranks])

    def submit(self, out: ScheduledStep) -> RayHandle:
        """Start one step on the stages; the handle's ``result()`` waits for its output (rank 0
        of the last stage's)."""
        with self._lock:
            delta = self.encoder.encode(out)
            refs = [stage.execute.remote(delta) for stage in self.stages]
        tp = self.tp
        last = len(refs) - tp
        ranks = {ref: divmod(i, tp) for i, ref in enumerate(refs) if i != last} if tp > 1 else None
        return RayHandle(refs[last], len(refs) // tp - 1, ranks)

    @property
    def kv_layer_ranges(self) -> list[tuple[int, int]]:
        return list(self.layer_bounds)

    def save_blocks(self, block_ids: list[int]) -> list[list[bytes]]:
        """Bodies of blocks ``block_ids``: ``[block][stage]``, each stage its own layers (under
        tensor parallelism its ranks' parts, each its KV heads, one after the other). Runs after
        the steps already submitted (each stage runs its calls in order) and waits. Raises
        EngineError when a stage fails."""
        import ray
        with self._lock:
            refs = [s.save_blocks.remote(block_ids) for s in self.stages]
        try:
            parts = ray.get(refs)
        except ray.exceptions.RayError as e:
            raise DependencyUnavailableError(f"saving KV blocks failed on a pipeline stage: {_first_line(e)}") from None
        tp = self.tp
        stages = [[b"".join(ranks) for ranks in zip(*parts[i:i + tp])] for i in range(0, len(parts), tp)]
        return [list(p) for p in zip(*stages)]

    def load_blocks(self, block_ids: list[int], bodies: list[list[bytes]]) -> None:
        """Send each stage its bodies (``bodies[i][stage]``) of blocks ``block_ids``; a stage
        writes them before any step submitted later (no wait here: the copy overlaps the
        stages' work in flight). Under tensor parallelism rank r of a stage gets the r-th of
        ``tp`` equal parts of each body (:meth:`save_blocks`)."""
        tp = self.tp
        with self._lock:
            for i, s in enumerate(self.stages):
                stage, r = divmod(i, tp)
                part = [b[stage] for b in bodies]
                if tp > 1:
                    part = [body[r * len(body) // tp: (r + 1) * len(body) // tp] for body in part]
                s.load_blocks.remote(block_ids, part)

    def check_health(self, timeout: float = 10.0) -> None:
        """Raise EngineError when a stage is dead or does not answer within ``timeout`` seconds
        (a hung process). The engine loop calls it while it has no step in flight: a stage that
        dies while its replica is idle takes the replica down at once, not at the next request."""
        import ray
        try:
            ray.get([s.info.remote() for s in self.stages], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise DependencyUnavailableError(f"a pipeline stage did not answer a health check within {timeout:g} s") from None
        except ray.exceptions.RayError as e:
            raise DependencyUnavailableError(f"a pipeline stage is down: {_first_line(e)}") from None

    def release_memory(self) -> None:
        """Have every stage give its freed memory back to the OS (no wait; each runs it after the
        calls submitted before). The engine process calls it once its replica has gone idle."""
        with self._lock:
            for stage in self.stages:
                stage.release_memory.remote()

    def free_requests(self, request_ids: list[str]) -> None:
        """Forget finished or aborted requests on every stage (the last keeps per-request
        sampler state, each one the request's state and span). Called between the steps that
        include them: a stage runs the call after the steps submitted before it."""
        with self._lock:
            handles = self.encoder.free(request_ids)
            if handles:
                for stage in self.stages:
                    stage.free_requests.remote(handles)

    def shutdown(self) -> None:
        """Kill the stage actors and remove the placement group (idempotent)."""
        import ray
        if tracing_enabled() and self.stages:       # the stages' last spans, before they are killed
            try:
                ray.get([s.flush_telemetry.remote() for s in self.stages], timeout=15)
            except Exception:
                pass
        for s in self.stages:
            ray.kill(s)
        self.stages = []
        pg, self.placement_group = getattr(self, "placement_group", None), None
        if pg is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(pg)
            except Exception:                       # Ray already shut down
                pass


def create_executor(cfg, model_dir: str, sched_cfg, replica: int = 0) -> Executor:
    """The executor of one replica, as the scheduler service's settings say.

    Args:
        cfg: the replica's resolved :class:`kvmesh.core.engine_config.EngineConfig`.
        model_dir: checkpoint directory.
        sched_cfg: :class:`kvmesh.core.service_config.SchedulerConfig` (``executor`` — ``auto`` is local at
            pp 1 without ``ray_address`` —, ``pp``, ``pp_layers``, ``ray_address``,
            ``stage_num_cpus``: 0 shares this machine's cores among the stages).
        replica: index of the replica.
    Raises:
        EngineError: bad pipeline settings, or the model cannot be loaded.
    """
    if sched_cfg.resolved_executor() == "local":
        return InProcessExecutor(cfg, model_dir)
    cpus = sched_cfg.cpus_per_stage()
    need = sched_cfg.replicas * sched_cfg.pp * sched_cfg.tensor_parallel_size * cpus
    ensure_ray(sched_cfg.ray_address, num_cpus=max(os.cpu_count() or 1, need))
    return RayPipelineExecutor(cfg, model_dir, sched_cfg.pp, sched_cfg.layer_split(), cpus, replica,
                               placement=sched_cfg.stage_placement, tp=sched_cfg.tensor_parallel_size)


def ray_address_of_this_process() -> str:
    """The GCS address (``host:port``) of the Ray this process is connected to, for other
    processes of this machine to join the same instance (engine processes, docs/mesh.md)."""
    import ray
    return ray.get_runtime_context().gcs_address
