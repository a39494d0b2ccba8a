"""The scheduler gRPC service over loopback with real SmolLM2 weights (executor "local"):
greedy parity with the offline engine, two replicas sharing load, cancellation freeing KV
blocks, status codes of bad requests, queue limit, health, reflection and shutdown.

One two-replica server serves the module; the queue-limit/health/shutdown test starts its own
one-replica server (max_num_seqs 1, max_queued_requests 1)."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.service_config import SchedulerConfig
from kvmesh.core.errors import EngineError
from kvmesh.core.proto import sampling_params_from_proto
from kvmesh.core.sampling import SamplingParams
from kvmesh.v1 import common_pb2, scheduler_pb2 as pb, scheduler_pb2_grpc
from scheduler.router import NoHealthyReplicaError, ReplicaLoad, Router
from scheduler.service import SERVICE_NAME, serve_scheduler

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_LEN = 512
VOCAB = 49152          # SmolLM2
NEW = 16               # greedy tokens per parity request


def _engine_cfg(model_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=MAX_LEN, **kw)


@pytest.fixture(scope="module")
def prompts(prose_ids):
    """Three real-text prompts with no shared prefix (lengths 5, 21, 40)."""
    return [prose_ids[10:15], prose_ids[60:81], prose_ids[120:160]]


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts, h):
    """Offline greedy tokens of ``prompts`` (NEW tokens each, EOS ignored)."""
    eng = h.make_engine(smollm2_dir, kv_cache_memory=64 * 2**20, max_model_len=MAX_LEN)
    reqs = h.run(eng, [(f"ref{i}", p, h.greedy(NEW)) for i, p in enumerate(prompts)])
    return [reqs[f"ref{i}"].output_token_ids for i in range(len(prompts))]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(smollm2_dir):
    srv = await serve_scheduler(SchedulerConfig(port=0, replicas=2, executor="local"), _engine_cfg(smollm2_dir))
    await srv.wait_ready()
    yield srv
    await srv.stop(grace=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(server):
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture
def stub(channel):
    return scheduler_pb2_grpc.SchedulerServiceStub(channel)


def _greedy(max_tokens=NEW, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def _collect(stub, prompt, sampling=None, request_id="", **kw) -> list[pb.SubmitResponse]:
    call = stub.Submit(pb.SubmitRequest(request_id=request_id, prompt_token_ids=prompt,
                                        sampling=sampling or _greedy(), **kw))
    return [m async for m in call]


async def _rest(call) -> list[pb.SubmitResponse]:
    """The remaining messages of a call already read with ``read()``."""
    msgs = []
    while (m := await call.read()) is not grpc.aio.EOF:
        msgs.append(m)
    return msgs


def _tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


async def _wait_idle(stub, timeout=10.0) -> pb.GetStatsResponse:
    """Poll GetStats until no replica holds a block or a request."""
    for _ in range(int(timeout / 0.02)):
        st = await stub.GetStats(pb.GetStatsRequest())
        if all(r.num_used_blocks == 0 and r.num_running == 0 and r.num_waiting == 0 for r in st.replicas):
            return st
        await asyncio.sleep(0.02)
    raise AssertionError(f"replicas still busy: {st}")


async def _assert_serves(stub, prompt):
    msgs = await _collect(stub, prompt, _greedy(2))
    assert len(_tokens(msgs)) == 2 and msgs[-1].finished


# ---------------------------------------------------------------------------------------------
# router and sampling conversion (no server)

async def test_router_least_loaded_ties_lowest_index():     # async only to share the module's loop mark
    r = Router()
    assert r.pick([ReplicaLoad(0, True), ReplicaLoad(1, True)]) == 0
    assert r.pick([ReplicaLoad(0, True, 10, 5), ReplicaLoad(1, True, 0, 14), ReplicaLoad(2, True, 14)]) == 1
    assert r.pick([ReplicaLoad(0, True, 3), ReplicaLoad(1, True, 0, 3)]) == 0
    assert r.pick([ReplicaLoad(0, False), ReplicaLoad(1, True, 100, 100)], session_id="s") == 1
    with pytest.raises(NoHealthyReplicaError, match="no healthy replica"):
        r.pick([ReplicaLoad(0, False), ReplicaLoad(1, False)])


async def test_sampling_params_from_proto_defaults_and_values():
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams(max_tokens=16)
    assert sampling_params_from_proto(common_pb2.SamplingParams(), default_max_tokens=256).max_tokens == 256
    sp = sampling_params_from_proto(common_pb2.SamplingParams(
        temperature=0.0, top_k=5, seed=7, max_tokens=3, min_tokens=1, stop=["\n"], stop_token_ids=[2],
        ignore_eos=True, logprobs=0, skip_special_tokens=False))
    assert (sp.temperature, sp.top_k, sp.seed, sp.max_tokens, sp.min_tokens) == (0.0, 5, 7, 3, 1)
    assert (sp.stop, sp.stop_token_ids, sp.ignore_eos) == (["\n"], [2], True)
    assert (sp.logprobs, sp.skip_special_tokens) == (0, False)
    assert math.isclose(sampling_params_from_proto(common_pb2.SamplingParams(top_p=0.9)).top_p, 0.9, rel_tol=1e-6)
    with pytest.raises(EngineError, match="max_tokens"):
        sampling_params_from_proto(common_pb2.SamplingParams(max_tokens=0))   # set to 0 is not unset
    with pytest.raises(EngineError, match="top_p"):
        sampling_params_from_proto(common_pb2.SamplingParams(top_p=0.0))


# ---------------------------------------------------------------------------------------------
# the two-replica server

async def test_greedy_submit_matches_offline_engine(stub, prompts, reference):
    results = await asyncio.gather(*(_collect(stub, p, request_id=f"par{i}") for i, p in enumerate(prompts)))
    for i, (msgs, p) in enumerate(zip(results, prompts)):
        assert _tokens(msgs) == reference[i], f"prompt {i}"
        assert all(m.request_id == f"par{i}" for m in msgs)
        assert [m.finished for m in msgs] == [False] * (len(msgs) - 1) + [True]
        last = msgs[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.stop_reason == ""
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(p), NEW)
        t = last.timings
        assert 0 <= t.queue_time <= t.ttft <= t.e2e_latency < 60
        assert t.decode_time > 0 and math.isclose(t.ttft + t.decode_time, t.e2e_latency, abs_tol=1e-6)
        assert len({m.replica for m in msgs}) == 1


async def test_stop_token_and_logprobs(stub, prompts, reference):
    stop_id = reference[0][3]
    first = reference[0].index(stop_id)            # it may occur before position 3
    msgs = await _collect(stub, prompts[0], _greedy(stop_token_ids=[stop_id], logprobs=2))
    assert _tokens(msgs) == reference[0][:first + 1]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP and msgs[-1].stop_reason == str(stop_id)
    lps = [lp for m in msgs for lp in m.logprobs]
    assert len(lps) == first + 1
    for tok, lp in zip(_tokens(msgs), lps):
        assert tok in lp.logprobs and 2 <= len(lp.logprobs) <= 3 and all(v <= 0 for v in lp.logprobs.values())


async def test_model_info(stub):
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.max_model_len, info.vocab_size) == (MAX_LEN, VOCAB)
    assert (info.dtype, info.kv_cache_dtype) == ("float32", "float32")
    assert (info.block_size, info.num_replicas, info.pipeline_parallel_size) == (16, 2, 1)
    assert 2 in info.eos_token_ids and info.name


async def test_two_replicas_share_the_load(stub, prompts, reference):
    before = await _wait_idle(stub)
    a, b = await asyncio.gather(_collect(stub, prompts[1], request_id="lb-a"),
                                _collect(stub, prompts[2], request_id="lb-b"))
    assert {a[-1].replica, b[-1].replica} == {0, 1}      # the second went to the idle replica
    assert _tokens(a) == reference[1] and _tokens(b) == reference[2]
    after = await _wait_idle(stub)
    assert [r.replica for r in after.replicas] == [0, 1]
    for r0, r1 in zip(before.replicas, after.replicas):
        assert r1.healthy and r1.num_steps > r0.num_steps and r1.prefix_cache_queries > r0.prefix_cache_queries
        assert r1.num_blocks > 0 and r1.num_cached_blocks > 0 and r1.num_preemptions == 0


async def test_cancel_mid_stream_frees_blocks_others_finish(stub, prompts, reference):
    victim = stub.Submit(pb.SubmitRequest(request_id="victim", prompt_token_ids=prompts[2], sampling=_greedy(300)))
    others = [asyncio.create_task(_collect(stub, prompts[i], request_id=f"co{i}")) for i in (0, 1)]
    got = 0
    async for m in victim:
        got += len(m.token_ids)
        if got >= 3:
            break
    victim.cancel()
    assert victim.cancelled()
    assert await victim.code() == grpc.StatusCode.CANCELLED
    for i, t in zip((0, 1), others):
        assert _tokens(await t) == reference[i]
    await _wait_idle(stub, timeout=5.0)                  # the victim's blocks are back
    assert (await stub.Abort(pb.SchedulerAbortRequest(request_id="victim"))).found is False


async def test_abort_rpc_ends_stream_with_abort(stub, prompts):
    call = stub.Submit(pb.SubmitRequest(request_id="ab", prompt_token_ids=prompts[1], sampling=_greedy(300)))
    msgs = [await call.read()]
    assert (await stub.Abort(pb.SchedulerAbortRequest(request_id="ab"))).found is True
    msgs += await _rest(call)
    assert msgs[-1].finished and msgs[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert 0 < msgs[-1].usage.completion_tokens < 300
    assert await call.code() == grpc.StatusCode.OK
    await _wait_idle(stub)
    assert (await stub.Abort(pb.SchedulerAbortRequest(request_id="nope"))).found is False


BAD = {
    "temperature": (dict(sampling=common_pb2.SamplingParams(temperature=-1.0)), "temperature"),
    "top_p": (dict(sampling=common_pb2.SamplingParams(top_p=1.5)), "top_p"),
    "top_k": (dict(sampling=common_pb2.SamplingParams(top_k=0)), "top_k"),
    "nan": (dict(sampling=common_pb2.SamplingParams(min_p=float("nan"))), "min_p"),
    "max_tokens": (dict(sampling=common_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
    "min_tokens": (dict(sampling=common_pb2.SamplingParams(max_tokens=2, min_tokens=3)), "min_tokens"),
    "logprobs": (dict(sampling=common_pb2.SamplingParams(logprobs=21)), "logprobs"),
    "empty_prompt": (dict(prompt_token_ids=[]), "prompt is empty"),
    "token_id": (dict(prompt_token_ids=[1, VOCAB, 2]), "outside the vocabulary"),
    "prompt_too_long": (dict(prompt_token_ids=[1] * (MAX_LEN + 1)), "exceeds max_model_len"),
    "with_max_tokens": (dict(prompt_token_ids=[1] * 500, sampling=common_pb2.SamplingParams(max_tokens=20)),
                        "exceeds max_model_len"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_bad_request_is_invalid_argument(stub, prompts, case):
    kw, match = dict(BAD[case][0]), BAD[case][1]
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _collect(stub, kw.pop("prompt_token_ids", prompts[0]), **kw)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in ei.value.details()
    await _assert_serves(stub, prompts[0])


async def test_duplicate_request_id_already_exists(stub, prompts):
    call = stub.Submit(pb.SubmitRequest(request_id="dup", prompt_token_ids=prompts[1], sampling=_greedy(300)))
    await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _collect(stub, prompts[0], request_id="dup")
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in ei.value.details()
    call.cancel()
    await _wait_idle(stub)
    await _assert_serves(stub, prompts[0])


@pytest.mark.chaos
async def test_dead_replicas_are_skipped_then_unavailable(server, stub, prompts, reference):
    """A replica whose engine loop died (AsyncEngine.errored) gets no requests; none left → UNAVAILABLE."""
    r0, r1 = server.service.replicas
    try:
        r0.aengine.errored = RuntimeError("test: replica 0 down")
        msgs = await _collect(stub, prompts[0])
        assert msgs[-1].replica == 1 and _tokens(msgs) == reference[0]
        assert [r.healthy for r in (await stub.GetStats(pb.GetStatsRequest())).replicas] == [False, True]
        r1.aengine.errored = RuntimeError("test: replica 1 down")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _collect(stub, prompts[0])
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy replica" in ei.value.details()
    finally:
        r0.aengine.errored = r1.aengine.errored = None
    await _assert_serves(stub, prompts[0])


async def test_reflection_lists_the_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    async for resp in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
        names = {s.name for s in resp.list_services_response.service}
        break
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    assert SERVICE_NAME == "kvmesh.v1.SchedulerService"


async def test_health_serving(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


# ---------------------------------------------------------------------------------------------
# a server of its own: health while loading, queue limit, shutdown with requests in flight

@pytest.mark.parametrize("engine_process", [True, False])
async def test_health_queue_limit_and_stop(smollm2_dir, prompts, engine_process):
    srv = await serve_scheduler(SchedulerConfig(port=0, replicas=1, executor="local", max_queued_requests=1,
                                                engine_process=engine_process),
                                _engine_cfg(smollm2_dir, max_num_seqs=1))
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            check = lambda name="": health.Check(health_pb2.HealthCheckRequest(service=name))   # noqa: E731
            assert (await check()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await check(SERVICE_NAME)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as ei:       # loading
                await _collect(stub, prompts[0])
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in ei.value.details()
            await srv.wait_ready()
            assert (await check()).status == health_pb2.HealthCheckResponse.SERVING
            assert (await check(SERVICE_NAME)).status == health_pb2.HealthCheckResponse.SERVING

            # max_num_seqs 1: `running` runs, `queued` waits, a third one is refused
            running = stub.Submit(pb.SubmitRequest(request_id="run", prompt_token_ids=prompts[0],
                                                   sampling=_greedy(400)))
            await running.read()
            queued = stub.Submit(pb.SubmitRequest(request_id="q", prompt_token_ids=prompts[1], sampling=_greedy(4)))
            for _ in range(500):
                if (await stub.GetStats(pb.GetStatsRequest())).replicas[0].num_waiting == 1:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await _collect(stub, prompts[2])
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_requests" in ei.value.details()

            # stop with both in flight: their streams end with ABORT (or the call is cancelled)
            await srv.stop(grace=2.0)
            for call in (running, queued):
                try:
                    msgs = await _rest(call)
                    assert msgs[-1].finished and msgs[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
                except grpc.aio.AioRpcError as e:
                    assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            aengine = srv.service.replicas[0].aengine
            loop_alive = aengine.process.is_alive() if engine_process else aengine._thread.is_alive()
            assert loop_alive is False
    finally:
        await srv.stop(grace=0)


async def test_bind_error_is_engine_error(server, smollm2_dir):
    with pytest.raises(EngineError, match="cannot listen"):
        await serve_scheduler(SchedulerConfig(port=server.port, replicas=1, executor="local"),
                              _engine_cfg(smollm2_dir))
