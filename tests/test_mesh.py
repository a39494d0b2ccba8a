"""The whole mesh as served: gateway → scheduler → Ray pipeline stages, real gRPC on loopback,
real Ray, real SmolLM2 weights (float32). Two meshes share one local Ray instance: ``--pp 1``
and ``--pp 2``; the offline in-process engine is the reference."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvmesh.core.sampling import SamplingParams
from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

KV = 48 * 2**20
MAX_LEN = 512
N_STREAMS = 32
MAX_TOKENS = 12


class Meshes:
    """Schedulers (Ray executor, pp 1 and pp 2) and a gateway for each, on a background loop."""

    def __init__(self, model_dir):
        from workers.executor import ensure_ray
        ensure_ray(num_cpus=8)            # logical CPUs for the 3 stage actors of this module
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers = self._run(self._start(model_dir))
        self.channels = []
        self.stubs, self.sched_stubs = {}, {}
        for pp, (sched, gw) in self.servers.items():
            gch, sch = grpc.insecure_channel(gw.address), grpc.insecure_channel(sched.address)
            self.channels += [gch, sch]
            self.stubs[pp] = llm_pb2_grpc.LLMServiceStub(gch)
            self.sched_stubs[pp] = scheduler_pb2_grpc.SchedulerServiceStub(sch)

    def _run(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, model_dir):
        from gateway.server import serve_gateway
        from kvmesh.core.engine_config import EngineConfig
        from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
        from scheduler.service import serve_scheduler
        ecfg = EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=KV, max_model_len=MAX_LEN,
                            num_threads=1)
        out = {}
        for pp in (1, 2):
            sched = await serve_scheduler(SchedulerConfig(port=0, pp=pp, executor="ray"), ecfg)
            await sched.wait_ready()
            gw = await serve_gateway(GatewayConfig(port=0, scheduler_address=sched.address, default_timeout=120))
            out[pp] = (sched, gw)
        return out

    def stats(self, pp) -> scheduler_pb2.ReplicaStats:
        return self.sched_stubs[pp].GetStats(scheduler_pb2.GetStatsRequest()).replicas[0]

    def close(self):
        import ray
        for c in self.channels:
            c.close()
        for sched, gw in self.servers.values():
            self._run(gw.stop(0))
            self._run(sched.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        ray.shutdown()


@pytest.fixture(scope="module")
def meshes(smollm2_dir):
    m = Meshes(smollm2_dir)
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompts(prose_ids, smollm2_tokenizer):
    """32 different real-text prompts of 20-83 tokens (some share long prefixes)."""
    return [smollm2_tokenizer.decode(prose_ids[(i % 4) * 7: 20 + 2 * i]) for i in range(N_STREAMS)]


@pytest.fixture(scope="module")
def expected(smollm2_dir, prompts):
    from kvmesh import LLM
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=KV, max_model_len=MAX_LEN)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


def _greedy():
    return common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _stream(stub, prompt, cancel_after: int | None = None):
    """(text, token ids, final message or None) of one Generate stream; cancelled after
    ``cancel_after`` token-carrying messages if given."""
    call = stub.Generate(llm_pb2.GenerateRequest(prompt=prompt, sampling=_greedy()), timeout=120)
    text, ids, final, n = "", [], None, 0
    try:
        for m in call:
            text, ids = text + m.text, ids + list(m.token_ids)
            n += bool(m.token_ids)
            if m.finished:
                final = m
            if cancel_after is not None and n >= cancel_after:
                call.cancel()
                break
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED
    return text, ids, final


def _wait_idle(meshes, pp, timeout=10.0):
    end = time.monotonic() + timeout
    while True:
        s = meshes.stats(pp)
        if (s.num_used_blocks, s.num_running, s.num_waiting) == (0, 0, 0) or time.monotonic() > end:
            return s
        time.sleep(0.02)


@pytest.mark.parametrize("pp", [1, 2])
def test_32_concurrent_streams_match_the_offline_engine(meshes, prompts, expected, pp):
    with ThreadPoolExecutor(N_STREAMS) as pool:
        results = list(pool.map(lambda p: _stream(meshes.stubs[pp], p), prompts))
    for (text, ids, final), (want_text, want_ids) in zip(results, expected):
        assert ids == want_ids and text == want_text
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == MAX_TOKENS
    s = _wait_idle(meshes, pp)
    assert s.num_used_blocks == 0 and s.prefix_cache_hits > 0          # shared prefixes were reused


def test_pp2_equals_pp1_through_the_mesh(meshes, prompts):
    chat = [{"role": "user", "content": p} for p in prompts[:4]]
    outs = {}
    for pp in (1, 2):
        outs[pp] = [[(m.text, tuple(m.token_ids)) for m in meshes.stubs[pp].Chat(llm_pb2.ChatRequest(
            messages=[llm_pb2.ChatMessage(**c)], sampling=_greedy()))] for c in chat]
    joined = {pp: [("".join(t for t, _ in msgs), sum((list(i) for _, i in msgs), [])) for msgs in o]
              for pp, o in outs.items()}
    assert joined[1] == joined[2]


@pytest.mark.parametrize("pp", [1, 2])
def test_cancelled_streams_free_their_blocks_and_spare_the_others(meshes, prompts, expected, pp):
    cancel = {3: 1, 10: 2, 21: 4}                          # stream index -> token messages before cancel
    with ThreadPoolExecutor(N_STREAMS) as pool:
        results = list(pool.map(lambda i: _stream(meshes.stubs[pp], prompts[i], cancel.get(i)), range(N_STREAMS)))
    for i, ((text, ids, final), (want_text, want_ids)) in enumerate(zip(results, expected)):
        if i in cancel:
            assert final is None and ids == want_ids[: len(ids)] and len(ids) < MAX_TOKENS
        else:
            assert ids == want_ids and text == want_text
    s = _wait_idle(meshes, pp)
    assert (s.num_used_blocks, s.num_running, s.num_waiting) == (0, 0, 0)


def test_health_and_model_info(meshes):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    for pp, (sched, gw) in meshes.servers.items():
        for addr, service in ((gw.address, "kvmesh.v1.LLMService"), (sched.address, "kvmesh.v1.SchedulerService")):
            with grpc.insecure_channel(addr) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
        info = meshes.sched_stubs[pp].GetModelInfo(scheduler_pb2.GetModelInfoRequest())
        assert info.pipeline_parallel_size == pp and info.num_replicas == 1
