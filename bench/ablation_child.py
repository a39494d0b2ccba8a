"""One row of ``kvmesh bench ablation`` (:mod:`bench.ablation`), in the row's own child process
(``--child SPEC``): :func:`run_child` starts a ``kvmesh serve`` with the row's settings, runs the
load and the faithfulness answers through it, and measures the server (:func:`peak_rss`, the KV
pool polled during the load).
"""

from __future__ import annotations

import asyncio
import os
import resource
import time

import psutil

def _env(engine: dict, sched: dict, extra: dict | None = None) -> dict:
    """The environment of the row's ``kvmesh serve``: every setting as KVMESH_* variables;
    the caller's other engine/scheduler variables removed; then ``extra``."""
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
    from kvmesh.core.settings import env_var

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for cls in (EngineConfig, SchedulerConfig, GatewayConfig):
        for f in cls.__dataclass_fields__:
            env.pop(env_var(cls, f), None)
    for cls, kw in ((EngineConfig, engine), (SchedulerConfig, sched)):
        for k, v in kw.items():
            env[env_var(cls, k)] = ("1" if v else "0") if isinstance(v, bool) else str(v)
    return {**env, **(extra or {})}


async def _warm_up(address: str, n: int) -> None:
    """``n`` short requests at once (first-call allocations on each replica), not measured."""
    import grpc

    from kvmesh.core.proto import sampling_params_to_proto as sampling
    from kvmesh.v1 import llm_pb2, llm_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)

        async def one():
            return [m async for m in stub.Generate(llm_pb2.GenerateRequest(
                prompt="Hello", sampling=sampling(temperature=0.0, max_tokens=2)))]
        await asyncio.gather(*(one() for _ in range(n)))


class _KVPoller:
    """Polls the scheduler's GetStats every ``period`` seconds: the most KV blocks in use at
    once (summed over replicas), and the last stats."""

    def __init__(self, address: str, period: float = 0.05):
        self.address, self.period = address, period
        self.peak_used_blocks, self.last = 0, None
        self._stop = asyncio.Event()

    async def run(self) -> None:
        import grpc

        from kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

        async with grpc.aio.insecure_channel(self.address) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            while True:
                self.last = await stub.GetStats(scheduler_pb2.GetStatsRequest())
                self.peak_used_blocks = max(self.peak_used_blocks, sum(r.num_used_blocks for r in self.last.replicas))
                if self._stop.is_set():
                    return
                try:
                    await asyncio.wait_for(self._stop.wait(), self.period)
                except asyncio.TimeoutError:
                    pass

    def stop(self) -> None:
        self._stop.set()


def _bytes_per_block(engine: dict) -> int:
    from kvmesh.core.engine_config import EngineConfig
    from workers.kv_cache import bytes_per_block, kv_dtype
    from workers.checkpoint import load_config
    from kvmesh.hub.pull import resolve_model

    cfg = EngineConfig(**engine)
    m = load_config(resolve_model(cfg.model))
    return bytes_per_block(m.num_layers, cfg.block_size, m.num_kv_heads, m.head_dim,
                           kv_dtype(cfg.kv_cache_dtype, cfg.torch_dtype))


async def _measure(gateway: str, scheduler: str, spec: dict, replicas: int) -> dict:
    from bench import faithfulness
    from bench.serve.load import run_benchmark
    from bench.serve.metrics import summarize
    from bench.serve.workload import load_requests

    requests = load_requests("policydesk", num_prompts=spec["num_prompts"], seed=spec["seed"],
                             max_tokens=spec["max_tokens"])
    await _warm_up(gateway, replicas)
    poller = _KVPoller(scheduler)
    poll = asyncio.ensure_future(poller.run())
    t0 = time.perf_counter()
    records = await run_benchmark("kvmesh", gateway, requests, max_concurrency=spec["max_concurrency"],
                                  temperature=0.0, seed=spec["seed"], ignore_eos=True, progress=False,
                                  request_timeout=3600)   # the gateway's max: a batch-1 row queues long
    duration = time.perf_counter() - t0
    poller.stop()
    await poll
    failed = [r for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(records)} requests failed: {failed[0].error}")
    out = {"load": summarize(records, duration), "duration_s": duration,
           "peak_used_blocks": poller.peak_used_blocks,
           "num_blocks": sum(r.num_blocks for r in poller.last.replicas),
           "prefix_cache_hits": sum(r.prefix_cache_hits for r in poller.last.replicas),
           "prefix_cache_queries": sum(r.prefix_cache_queries for r in poller.last.replicas),
           "preemptions": sum(r.num_preemptions for r in poller.last.replicas)}
    if spec["faithfulness_questions"] or spec["faithfulness_chats"]:
        items = faithfulness.select_items(spec["faithfulness_questions"], spec["faithfulness_chats"])
        out["answers"] = await faithfulness.answer_via_gateway(gateway, items, spec["faithfulness_max_tokens"],
                                                               concurrency=spec["max_concurrency"])
    return out


def run_child(spec: dict) -> dict:
    """Child process: serve one row, measure it, stop the server; the row's measurements."""
    from bench.served import served

    engine, sched = spec["engine"], spec["scheduler"]
    addresses: dict = {}
    cmd = ["serve", "--port", "0", "--scheduler-port", "0"]
    t0 = time.perf_counter()
    with served(cmd, _env(engine, sched, spec.get("env")), "gateway", addresses) as gateway:
        startup = time.perf_counter() - t0
        out = asyncio.run(_measure(gateway, addresses["scheduler"], spec, sched["replicas"]))
        servers = psutil.Process().children()          # the `kvmesh serve` process, still running
        hwm = [peak_rss(p.pid) for p in servers]
        now = [p.memory_info().rss for p in servers]
    per_block = _bytes_per_block(engine)
    # its peak, read before it stopped; ru_maxrss of the reaped children as a fallback (it is
    # at least this process's own peak RSS when the server was spawned, see peak_rss)
    rusage = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {**out, "startup_s": startup, "bytes_per_block": per_block,
            "kv_pool_bytes": out["num_blocks"] * per_block, "kv_peak_used_bytes": out["peak_used_blocks"] * per_block,
            "server_peak_rss_bytes": sum(hwm) if hwm and None not in hwm else rusage,
            "server_end_rss_bytes": sum(now),
            "server_maxrss_rusage_bytes": rusage}


def peak_rss(pid: int) -> int | None:
    """Peak resident set size of process ``pid`` in bytes (``VmHWM`` of /proc/PID/status:
    the high-water mark of its own address space), None where /proc has no such line.
    Preferred to ``getrusage(...).ru_maxrss``: on Linux a process's ru_maxrss starts at its
    parent's peak when it is spawned (fork, then exec, carries the high-water mark over)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
