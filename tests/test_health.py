"""Health a load balancer can trust: the gateway's health follows the scheduler's, liveness stays
up through a replica restart (real gRPC over loopback, a real scheduler whose one replica runs
SmolLM2-135M in a real Ray stage actor, the real gateway with its HTTP API).

The operator's report: ``kvmesh serve --executor ray`` with one replica, ``kill -9`` of its
``ray::PipelineStage``: the replica came back by itself, but the gateway said SERVING the whole
time. Here the gateway's "" and ``kvmesh.v1.LLMService`` go NOT_SERVING (and ``/health`` 503)
while the scheduler has no replica up, SERVING again after the restart, and ``liveness`` never
leaves SERVING.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
from kvmesh.core.grpc_server import LIVENESS
from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc, scheduler_pb2 as pb, scheduler_pb2_grpc

aio = pytest.mark.asyncio(loop_scope="module")

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
LLM_SERVICE, SCHEDULER_SERVICE = "kvmesh.v1.LLMService", "kvmesh.v1.SchedulerService"


async def until(predicate, what: str, timeout: float) -> None:
    """Poll ``predicate()`` every 50 ms until truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.05)


class Watched:
    """Every status a health service reports on a ``Health.Watch`` stream, with when it came."""

    def __init__(self, channel, service: str):
        self.service, self.seen = service, []
        self.task = asyncio.ensure_future(self._run(health_pb2_grpc.HealthStub(channel)))

    async def _run(self, stub) -> None:
        async for r in stub.Watch(health_pb2.HealthCheckRequest(service=self.service)):
            self.seen.append((time.monotonic(), r.status))

    @property
    def last(self):
        return self.seen[-1][1] if self.seen else None

    def statuses(self) -> list:
        return [s for _, s in self.seen]


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def local_ray():
    """This module's local Ray (2 logical CPUs), shut down at the end."""
    import ray
    from workers.executor import ensure_ray
    if ray.is_initialized():
        ray.shutdown()
    ensure_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ray_mesh(local_ray, smollm2_dir):
    """A scheduler with one replica on a Ray stage (pp 1) and a gateway in front of it (gRPC, HTTP
    and a health-only port, as deployed), in this event loop."""
    from gateway.server import serve_gateway
    from scheduler.service import serve_scheduler
    # restart_wait: the requests' own 120 s (a restart takes 4-7 s idle, up to 74 s beside 2 busy
    # processes and another test module), not the default 30 s
    sched = await serve_scheduler(SchedulerConfig(port=0, replicas=1, executor="ray", pp=1, stage_num_cpus=1,
                                                  restart_wait=120),
                                  EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=32 * 2**20,
                                               max_model_len=256, num_threads=1))
    gw = None
    try:
        await sched.wait_ready()
        gw = await serve_gateway(GatewayConfig(port=0, http_port=0, health_port=0, scheduler_address=sched.address,
                                               connect_timeout=60, default_timeout=120))
        yield sched, gw
    finally:
        if gw is not None:
            await gw.stop(0)
        await sched.stop(0)


@pytest.mark.chaos
@aio
async def test_gateway_health_follows_the_scheduler_through_a_stage_kill(ray_mesh, prose_ids):
    """kill -9 of the replica's stage: the gateway's "" and LLMService (on its health-only port,
    which the probes ask) go NOT_SERVING, as does ``/health``, while the scheduler has no replica
    up; a request sent meanwhile is still passed on and served after the restart; both names
    SERVING again once the replica is back; ``liveness`` SERVING throughout."""
    sched, gw = ray_mesh
    health_url = gw.http.url.removesuffix("/v1") + "/health"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.health_server.health_port}") as probe_ch, \
            grpc.aio.insecure_channel(sched.address) as sched_ch, grpc.aio.insecure_channel(gw.address) as gw_ch:
        watched = {name: Watched(probe_ch, name) for name in ("", LLM_SERVICE, LIVENESS)}
        sched_health = Watched(sched_ch, SCHEDULER_SERVICE)
        try:
            await until(lambda: all(w.last == SERVING for w in watched.values()), "the gateway SERVING", 30)
            assert await asyncio.to_thread(http_status, health_url) == 200

            old = sched.service.replicas[0].aengine
            os.kill(old.stage_pids[0], signal.SIGKILL)
            # the replica is noticed dead by its engine's idle health check of the stage (every 1 s)
            await until(lambda: sched_health.last == NOT_SERVING, "the scheduler NOT_SERVING", 60)
            await until(lambda: watched[""].last == NOT_SERVING and watched[LLM_SERVICE].last == NOT_SERVING,
                        "the gateway NOT_SERVING", 10)
            code = await asyncio.to_thread(http_status, health_url)
            back_already = sched_health.last == SERVING     # the restart raced the HTTP call
            assert code == 503 or back_already, code
            # requests are still passed on: the scheduler waits for its restarting replica
            sent = llm_pb2_grpc.LLMServiceStub(gw_ch).Generate(llm_pb2.GenerateRequest(
                prompt_token_ids=llm_pb2.TokenIds(ids=prose_ids[:12]), sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_tokens=4, ignore_eos=True)), timeout=120)

            await until(lambda: watched[""].last == SERVING and watched[LLM_SERVICE].last == SERVING,
                        "the gateway SERVING after the restart", 120)
            assert await asyncio.to_thread(http_status, health_url) == 200
            replies = [m async for m in sent]
            assert replies[-1].finished and replies[-1].usage.completion_tokens == 4
            st = (await scheduler_pb2_grpc.SchedulerServiceStub(sched_ch).GetStats(pb.GetStatsRequest())).replicas[0]
            assert st.restarts == 1 and st.healthy and sched.service.replicas[0].aengine is not old
            for name in ("", LLM_SERVICE):
                assert watched[name].statuses() == [SERVING, NOT_SERVING, SERVING], (name, watched[name].seen)
            assert watched[LIVENESS].statuses() == [SERVING], watched[LIVENESS].seen
        finally:
            for w in (*watched.values(), sched_health):
                w.task.cancel()
            await asyncio.gather(*(w.task for w in (*watched.values(), sched_health)), return_exceptions=True)


@aio
async def test_the_gateways_watch_does_not_hold_up_the_schedulers_stop(ray_mesh):
    """The gateway holds a Health.Watch open on its scheduler; at the scheduler's graceful stop
    that stream sends NOT_SERVING and ends, so a stop with a 60 s grace and nothing in flight
    returns at once (a Watch stream that stayed open would hold it for the whole grace), and the
    gateway reports NOT_SERVING, liveness still SERVING."""
    sched, gw = ray_mesh
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.health_server.health_port}") as probe_ch:
        health = health_pb2_grpc.HealthStub(probe_ch)
        assert (await health.Check(health_pb2.HealthCheckRequest(service=LLM_SERVICE))).status == SERVING
        t0 = time.monotonic()
        await sched.stop(grace=60)
        assert time.monotonic() - t0 < 30
        await until(lambda: not gw.path.serving, "the gateway NOT_SERVING", 10)
        for name in ("", LLM_SERVICE):
            assert (await health.Check(health_pb2.HealthCheckRequest(service=name))).status == NOT_SERVING
        assert (await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS))).status == SERVING
