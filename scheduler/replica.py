"""A replica of the scheduler service: one engine loop (an engine process, or a thread of the
scheduler's process) with its load, stats and KV-event publisher; how replicas are built, and
how a dead engine process is restarted (with backoff) and a hung one killed (the watchdog).

The servicer (:mod:`scheduler.service`) routes requests to replicas and reads only what each
engine loop pushes (``aengine.info``, ``aengine.stats``), never an engine's lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.service_config import SchedulerConfig
from kvmesh.v1 import scheduler_pb2
from scheduler.async_engine import AsyncEngine
from scheduler.engine import LLMEngine
from scheduler.engine_records import EngineStats
from kvmesh.core.errors import EngineError
from scheduler.router import ReplicaLoad

_TIER_STATS = [f.name for f in dataclasses.fields(EngineStats) if f.name.startswith("kv_tier_")]  # ReplicaStats too
log = logging.getLogger("kvmesh.scheduler")


class Replica:
    """One engine loop: its engine process (:class:`scheduler.engine_core.EngineCoreClient`)
    or a thread of this process (:class:`scheduler.async_engine.AsyncEngine`), both as ``aengine``.
    Reads only what the loop pushes (``aengine.info``, ``aengine.stats``), never the engine's
    lock. ``replica_id`` is its name in the prefix index; ``publisher`` sends its KV events
    there (None: not published)."""

    def __init__(self, index: int, aengine, replica_id: str = ""):
        self.index, self.aengine, self.replica_id = index, aengine, replica_id or str(index)
        self.info = aengine.info
        self.publisher = None
        self.restarts = 0

    @property
    def healthy(self) -> bool:
        return self.aengine.is_up()

    def num_waiting(self) -> int:
        return self.aengine.stats.num_waiting + self.aengine.pending_load()[0]

    def load(self) -> ReplicaLoad:
        st = self.aengine.stats
        _, pending_tokens = self.aengine.pending_load()
        return ReplicaLoad(self.index, self.healthy, st.waiting_tokens + pending_tokens, st.running_tokens,
                           self.info.num_blocks * self.info.block_size)

    def start_publishing(self, index) -> None:
        """Publish this replica's KV events to ``index``: a snapshot of its cached blocks, then
        every event, with heartbeats. Attached under ``kv_lock``, so no event is missed."""
        from kvstore.publisher import KVEventPublisher

        with self.aengine.kv_lock:
            self.publisher = KVEventPublisher(index, self.replica_id, self.aengine.cached_block_hashes)
            self.aengine.set_kv_sink(self.publisher)

    def stop_publishing(self) -> None:
        """Stop publishing; the publisher removes the replica's entries from the index (blocks
        until its thread has ended, a fraction of a second). Idempotent."""
        with self.aengine.kv_lock:
            pub, self.publisher = self.publisher, None
            self.aengine.set_kv_sink(None)
        if pub is not None:
            pub.close()

    def stats(self) -> scheduler_pb2.ReplicaStats:
        st, load, info, pub = self.aengine.stats, self.load(), self.info, self.publisher
        return scheduler_pb2.ReplicaStats(
            replica=self.index, healthy=self.healthy, num_waiting=self.num_waiting(), num_running=st.num_running,
            num_waiting_tokens=load.waiting_tokens, num_running_tokens=load.running_tokens,
            num_blocks=info.num_blocks, num_used_blocks=st.used_blocks, num_cached_blocks=st.cached_blocks,
            num_steps=st.num_steps, num_preemptions=st.num_preemptions,
            prefix_cache_queries=st.prefix_cache_queries, prefix_cache_hits=st.prefix_cache_hits,
            prefix_cache_preempted_queries=st.prefix_cache_preempted_queries,
            prefix_cache_preempted_hits=st.prefix_cache_preempted_hits,
            replica_id=self.replica_id, indexed=pub is not None,
            index_resyncs=pub.resyncs if pub else 0, index_failures=pub.failures if pub else 0,
            kv_cache_dtype=info.kv_cache_dtype, kv_cache_bytes_per_token=info.kv_bytes_per_token,
            max_concurrency=info.max_concurrency, restarts=self.restarts, pid=getattr(self.aengine, "pid", 0),
            stage_pids=stage_pids(self.aengine),
            **{name: getattr(st, name) for name in _TIER_STATS})

    async def shutdown(self) -> None:
        await close_engine_loop(self.aengine)


def stage_pids(aengine) -> list[int]:
    """Process ids of an engine loop's Ray pipeline stages, by stage (empty when its model runs
    in its own process): an engine process reports them when it is ready; an engine thread's
    executor holds them."""
    pids = getattr(aengine, "stage_pids", None)
    if pids is None:
        executor = getattr(getattr(aengine, "engine", None), "executor", None)
        pids = [i["pid"] for i in getattr(executor, "stage_info", ())]
    return list(pids)


async def close_engine_loop(aengine) -> None:
    """Stop an engine loop: an engine process (its executor stops with it), or an engine
    thread and then its engine's executor."""
    await aengine.shutdown()
    engine = getattr(aengine, "engine", None)
    if engine is not None:
        await asyncio.to_thread(engine.shutdown)


def check_tensor_parallel(ec: EngineConfig, size: int) -> None:
    """Refuse, before any process starts, a ``size`` the local model (a pulled known model or a
    checkpoint directory) cannot be split by: its head counts, its int4 groups
    (:mod:`workers.tensor_parallel`). A model not pulled yet is left to its ranks' own checks
    (nothing is pulled here). Raises SettingsError."""
    from kvmesh.hub.pull import resolve_model
    from workers.checkpoint import load_config
    from workers.tensor_parallel import check_split
    if size == 1:
        return
    try:
        model_dir = resolve_model(ec.model, pull_if_missing=False)
    except Exception:                  # not pulled yet, or not a model: the engine says so
        return
    check_split(load_config(model_dir), size, ec.weight_format, ec.quant_group_size)


async def start_engine_processes(sc: SchedulerConfig, ec: EngineConfig) -> tuple[list, SchedulerConfig]:
    """One engine process per replica (:mod:`scheduler.engine_core`), loading concurrently.
    A Ray executor's local Ray is started here first, so that every replica joins the same.
    Returns each replica's started client or the exception it failed with, and the settings
    the engine processes got (Ray address resolved; what a restart uses)."""
    from scheduler.engine_core import EngineCoreClient
    check_tensor_parallel(ec, sc.tensor_parallel_size)         # before Ray starts
    if sc.resolved_executor() == "ray":
        from workers.executor import ensure_ray, ray_address_of_this_process
        cpus = sc.cpus_per_stage()
        await asyncio.to_thread(ensure_ray, sc.ray_address,
                                max(os.cpu_count() or 1, sc.replicas * sc.pp * sc.tensor_parallel_size * cpus))
        sc = sc.replace(ray_address=sc.ray_address or ray_address_of_this_process(), stage_num_cpus=cpus)
    clients = [EngineCoreClient(ec, sc, i, collect_events=sc.routing == "prefix") for i in range(sc.replicas)]
    started = await asyncio.gather(*(c.start() for c in clients), return_exceptions=True)
    return [e if isinstance(e, BaseException) else c for c, e in zip(clients, started)], sc


async def build_engine_threads(sc: SchedulerConfig, ec: EngineConfig) -> list:
    """Engines in this process, each loop on a thread (:class:`scheduler.async_engine.AsyncEngine`);
    each item is the engine loop or the exception its engine failed with."""
    def build(i: int) -> LLMEngine:
        from workers.executor import create_executor
        return LLMEngine(ec, executor_factory=lambda cfg, model_dir: create_executor(cfg, model_dir, sc, i))

    # the first replica alone (its executor may start Ray), then the others concurrently
    built = await asyncio.gather(asyncio.to_thread(build, 0), return_exceptions=True)
    if not isinstance(built[0], BaseException):
        built += await asyncio.gather(*(asyncio.to_thread(build, i) for i in range(1, sc.replicas)),
                                      return_exceptions=True)
    return [e if isinstance(e, BaseException) else AsyncEngine(e) for e in built]


async def restart_engine_process(replica: Replica, ec: EngineConfig, sc: SchedulerConfig, *,
                                 stopping: Callable[[], bool],
                                 install: Callable[[Replica, object], Awaitable[None]]) -> None:
    """Replace a dead replica's engine process: reap the old one (its Ray stages, owned by it,
    go with it), start a new one with the settings ``sc`` of :func:`start_engine_processes`,
    retrying with backoff (0.5 s doubling to 30 s) until it starts or ``stopping()``; then
    ``await install(replica, client)`` gives it to the replica."""
    from scheduler.engine_core import EngineCoreClient
    delay = 0.5
    await close_engine_loop(replica.aengine)
    while not stopping():
        t0 = time.monotonic()
        client = EngineCoreClient(ec, sc, replica.index, collect_events=sc.routing == "prefix")
        try:
            await client.start()
        except EngineError as e:
            log.error("replica %d: restart failed (%s); next try in %.1f s", replica.index, e, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 30.0)
            continue
        if stopping():
            await close_engine_loop(client)
            return
        await install(replica, client)
        log.warning("replica %d: engine process restarted (pid %d) in %.1f s", replica.index, client.pid,
                    time.monotonic() - t0)
        return


async def watch_steps(replicas: Callable[[], list[Replica]], timeout: float, stopping: Callable[[], bool]) -> None:
    """The watchdog: kill an engine process that has requests and sent nothing for ``timeout``
    seconds (a hung step); its death then restarts it. Runs until ``stopping()``."""
    while not stopping():
        await asyncio.sleep(min(1.0, timeout / 4))
        for r in replicas():
            stalled = getattr(r.aengine, "stalled_for", None)
            if stalled is not None and stalled() > timeout:
                log.error("replica %d: no step for %.0f s with requests open (step_timeout): killing its "
                          "engine process", r.index, stalled())
                r.aengine.kill(f"killed by the watchdog after {timeout:g} s without a step")
