"""Engine processes (scheduler/engine_core.py) behind the real scheduler service, real SmolLM2:
the defaults use the machine (local executor at pp 1, torch threads = the cores, shared among
replicas), an engine process killed mid-stream ends its streams with UNAVAILABLE and the
service reports NOT_SERVING, a request the core rejects is INVALID_ARGUMENT with the service
still serving, and the wire format round-trips every output field."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.config import EngineConfig, SchedulerConfig, available_cpus
from kvmesh.v1 import common_pb2, scheduler_pb2 as pb, scheduler_pb2_grpc
from scheduler.engine import EngineOutput
from scheduler.engine_core import _output_of, _output_row, _pack, _unpack
from scheduler.request import FinishReason
from scheduler.service import SERVICE_NAME, serve_scheduler

aio = pytest.mark.asyncio(loop_scope="module")


def _engine_cfg(model_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=512, **kw)


def _greedy(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_output_rows_round_trip():
    o = EngineOutput("r1", [5, 6], [{5: -0.25, 9: -1.5}, {6: -0.5}], True, FinishReason.STOP, "</s>", 12, 8, 2,
                     1.5, 1.6, 1.7, 2.0, 1, 4, 3)
    back = _output_of(_unpack(_pack(_output_row(o))))
    assert back == o and back.finish_reason is FinishReason.STOP


def test_executor_auto_resolution():
    assert SchedulerConfig().resolved_executor() == "local"
    assert SchedulerConfig(pp=2).resolved_executor() == "ray"
    assert SchedulerConfig(ray_address="auto").resolved_executor() == "ray"
    assert SchedulerConfig(executor="ray").resolved_executor() == "ray"
    assert SchedulerConfig(replicas=1, pp=1).cpus_per_stage() == max(1, available_cpus())
    assert SchedulerConfig(replicas=available_cpus() + 1).cpus_per_stage() == 1
    assert SchedulerConfig(stage_num_cpus=0.5).cpus_per_stage() == 0.5


@aio
@pytest.mark.parametrize("replicas", [1, 2])
async def test_default_engine_processes_use_the_cores(smollm2_dir, replicas):
    """Defaults: each replica's loop in its own process, local executor, torch threads = this
    machine's cores over the replicas (measured inside the process: torch.get_num_threads)."""
    srv = await serve_scheduler(SchedulerConfig(port=0, replicas=replicas), _engine_cfg(smollm2_dir))
    try:
        await srv.wait_ready()
        clients = [r.aengine for r in srv.service.replicas]
        assert all(c.pid != os.getpid() and c.process.is_alive() for c in clients)
        assert [c.num_threads for c in clients] == [max(1, available_cpus() // replicas)] * replicas
    finally:
        await srv.stop(grace=1.0)
    assert not any(c.process.is_alive() for c in clients)


@aio
async def test_killed_engine_process_unavailable_and_not_serving(smollm2_dir, prose_ids, caplog):
    """restart_replicas off: the service stays NOT_SERVING with a clear log line."""
    srv = await serve_scheduler(SchedulerConfig(port=0, replicas=1, restart_replicas=False), _engine_cfg(smollm2_dir))
    try:
        await srv.wait_ready()
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            # a request the core rejects: INVALID_ARGUMENT naming the problem, the service serves on
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await _drain(stub.Submit(pb.SubmitRequest(prompt_token_ids=[10**7], sampling=_greedy(4))))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in ei.value.details()
            msgs = await _drain(stub.Submit(pb.SubmitRequest(prompt_token_ids=prose_ids[:20], sampling=_greedy(4))))
            assert msgs[-1].finished and sum(len(m.token_ids) for m in msgs) == 4

            call = stub.Submit(pb.SubmitRequest(prompt_token_ids=prose_ids[:20], sampling=_greedy(400)))
            await call.read()                                    # streaming
            pid = srv.service.replicas[0].aengine.pid
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await _drain(call)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "exited" in ei.value.details()
            assert time.monotonic() - t0 < 5.0
            for _ in range(100):
                st = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                if st.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.05)
            assert st.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            assert not (await stub.GetStats(pb.GetStatsRequest())).replicas[0].healthy
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await _drain(stub.Submit(pb.SubmitRequest(prompt_token_ids=prose_ids[:20], sampling=_greedy(4))))
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert any("NOT_SERVING" in r.getMessage() for r in caplog.records)
    finally:
        await srv.stop(grace=0)


async def _health(health, name: str = "") -> int:
    return (await health.Check(health_pb2.HealthCheckRequest(service=name))).status


async def _until(predicate, timeout: float):
    t0 = time.monotonic()
    while not await predicate():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


@aio
async def test_killed_engine_process_is_restarted(smollm2_dir, prose_ids, caplog):
    """A killed engine process: in-flight streams UNAVAILABLE at once, NOT_SERVING while it is
    down, a request sent meanwhile waits for the restart and is served, the replica back and
    SERVING within 30 s with a new pid, its restart counted in GetStats and /metrics."""
    import urllib.request
    srv = await serve_scheduler(SchedulerConfig(port=0, replicas=1, metrics_port=0), _engine_cfg(smollm2_dir))
    try:
        await srv.wait_ready()
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            call = stub.Submit(pb.SubmitRequest(prompt_token_ids=prose_ids[:20], sampling=_greedy(400)))
            await call.read()
            old_pid = srv.service.replicas[0].aengine.pid
            os.kill(old_pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await _drain(call)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            assert await _health(health) == health_pb2.HealthCheckResponse.NOT_SERVING or \
                srv.service.replicas[0].healthy       # (a very fast restart may already be back)
            # sent while the replica is down: waits for the restart, then is served
            msgs = await _drain(stub.Submit(pb.SubmitRequest(prompt_token_ids=prose_ids[:20], sampling=_greedy(4))))
            assert msgs[-1].finished and sum(len(m.token_ids) for m in msgs) == 4
            SERVING = health_pb2.HealthCheckResponse.SERVING
            await _until(lambda: _health_is(health, SERVING), 30)
            assert await _health(health, SERVICE_NAME) == SERVING
            st = (await stub.GetStats(pb.GetStatsRequest())).replicas[0]
            assert st.healthy and st.restarts == 1 and st.pid not in (0, old_pid)
            body = urllib.request.urlopen(srv.metrics.url, timeout=10).read().decode()
            assert 'kvmesh:replica_restarts_total{model_name=' in body and "kvmesh:replicas_up{" in body
            assert any(line.startswith("kvmesh:replicas_up{") and line.endswith(" 1.0") for line in body.splitlines())
        assert any("restarted" in r.getMessage() for r in caplog.records)
    finally:
        await srv.stop(grace=0)


async def _health_is(health, status) -> bool:
    return await _health(health) == status


@aio
async def test_watchdog_kills_a_hung_engine_process(smollm2_dir, prose_ids):
    """An engine process that stops stepping (SIGSTOP) with a request open is killed after
    step_timeout and restarted; the request ends UNAVAILABLE naming the watchdog."""
    srv = await serve_scheduler(SchedulerConfig(port=0, replicas=1, step_timeout=2.0), _engine_cfg(smollm2_dir))
    try:
        await srv.wait_ready()
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            call = stub.Submit(pb.SubmitRequest(prompt_token_ids=prose_ids[:20], sampling=_greedy(400)))
            await call.read()
            pid = srv.service.replicas[0].aengine.pid
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await _drain(call)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "watchdog" in ei.value.details()
            assert 2.0 <= time.monotonic() - t0 < 10
            await _until(lambda: _replica_back(stub, pid), 30)
    finally:
        await srv.stop(grace=0)


async def _replica_back(stub, old_pid: int) -> bool:
    st = (await stub.GetStats(pb.GetStatsRequest())).replicas[0]
    return st.healthy and st.pid != old_pid and st.restarts == 1


async def _drain(call) -> list[pb.SubmitResponse]:
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out
