"""Prometheus metrics (kvmesh/core/metrics.py) of a real scheduler (local executor, SmolLM2-135M in
float32) and gateway in one process, each on its own free metrics port, scraped over HTTP.

One known workload goes through the gateway: 5 greedy requests with ignore_eos (finish length),
1 that ends on a stop token id (finish stop), 1 aborted by the scheduler's Abort RPC after its
first token (finish abort), 1 refused by the gateway (unknown model). The scraped counters and
histogram counts must equal what the final messages report.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh import cli
from kvmesh.core import flags
from kvmesh.core.errors import EngineError
from kvmesh.core.metrics import GATEWAY_METRICS, SCHEDULER_METRICS
from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

KV_MEMORY = 48 * 2**20
PROMPTS = ["The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
           "combined movable metal type, oil-based ink and a wine press into a machine that could print "
           "pages quickly. Within fifty years",
           "Water boils at", "Once upon a time, in a small village,",
           "The three primary colours are", "def fibonacci(n):"]
MAX_TOKENS = [3, 5, 6, 8, 4]


class Mesh:
    def __init__(self, smollm2_dir):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="metrics-mesh", daemon=True)
        self.thread.start()
        self.sched, self.gw = self.run(self._start(smollm2_dir))
        self.channels = [grpc.insecure_channel(a) for a in (self.gw.address, self.sched.address)]
        self.stub = llm_pb2_grpc.LLMServiceStub(self.channels[0])
        self.sched_stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channels[1])

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, smollm2_dir):
        from gateway.server import serve_gateway
        from kvmesh.core.engine_config import EngineConfig
        from scheduler.service import serve_scheduler
        sched = await serve_scheduler(SchedulerConfig(executor="local", port=0, metrics_port=0),
                                      EngineConfig(model=str(smollm2_dir), dtype="float32",
                                                   kv_cache_memory=KV_MEMORY, max_model_len=256))
        await sched.wait_ready()
        gw = await serve_gateway(GatewayConfig(port=0, scheduler_address=sched.address, connect_timeout=60,
                                               metrics_port=0))
        return sched, gw

    def close(self):
        for c in self.channels:
            c.close()
        self.run(self.gw.stop(0))
        self.run(self.sched.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def mesh(smollm2_dir):
    m = Mesh(smollm2_dir)
    yield m
    m.close()


def scrape(url: str) -> dict[str, list]:
    """Sample name → [(labels, value)] of the exposition at ``url``."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for lv, v in samples.get(name, []) if labels.items() <= lv.items())


def greedy(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **kw)


def generate(mesh, prompt: str, sampling, request_id: str = "") -> list:
    return list(mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=prompt, sampling=sampling,
                                                           request_id=request_id)))


def test_metrics_servers_start_on_their_own_ports(mesh):
    sm, gm = mesh.sched.metrics, mesh.gw.metrics
    assert sm.port > 0 and gm.port > 0 and sm.port != gm.port
    assert sm.url == f"http://127.0.0.1:{sm.port}/metrics"
    sched, gw = scrape(sm.url), scrape(gm.url)
    assert not any(n.startswith("kvmesh:gateway_") for n in sched)      # separate registries
    assert not any(n.startswith("kvmesh:") and not n.startswith("kvmesh:gateway_") for n in gw)


def test_metrics_match_the_workload(mesh):
    sm_url, gm_url = mesh.sched.metrics.url, mesh.gw.metrics.url
    with ThreadPoolExecutor(5) as pool:
        finals = [msgs[-1] for msgs in pool.map(lambda a: generate(mesh, a[0], greedy(a[1])), zip(PROMPTS, MAX_TOKENS))]
    assert [f.finish_reason for f in finals] == [common_pb2.FINISH_REASON_LENGTH] * 5
    assert [f.usage.completion_tokens for f in finals] == MAX_TOKENS
    # the first prompt again (prefix-cache hits), then stopped at its third greedy token
    ref = generate(mesh, PROMPTS[0], greedy(3))
    finals.append(ref[-1])
    stop_id = [t for m in ref for t in m.token_ids][2]
    finals.append(generate(mesh, PROMPTS[0], greedy(20, stop_token_ids=[stop_id]))[-1])
    assert finals[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    # aborted by the scheduler's Abort RPC after its first token
    stream = mesh.stub.Generate(llm_pb2.GenerateRequest(prompt=PROMPTS[1], sampling=greedy(200), request_id="ab"))
    assert next(stream).token_ids
    assert mesh.sched_stub.Abort(scheduler_pb2.SchedulerAbortRequest(request_id="ab")).found
    finals.append(list(stream)[-1])
    assert finals[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    # refused by the gateway: counted there only
    with pytest.raises(grpc.RpcError) as e:
        list(mesh.stub.Generate(llm_pb2.GenerateRequest(model="no-such-model", prompt="hi")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    n_requests = len(finals)
    assert n_requests == 8
    prompt_tokens = sum(f.usage.prompt_tokens for f in finals)
    gen_tokens = sum(f.usage.completion_tokens for f in finals)

    # the abort's finish reaches the metrics on the scheduler's loop: wait for it
    end = time.monotonic() + 10
    while True:
        s = scrape(sm_url)
        if total(s, "kvmesh:request_success_total", finished_reason="abort") >= 1 or time.monotonic() > end:
            break
        time.sleep(0.05)
    model = s["kvmesh:request_success_total"][0][0]["model_name"]
    assert model.endswith("smollm2-135m-instruct")
    assert total(s, "kvmesh:request_success_total", finished_reason="length") == 6
    assert total(s, "kvmesh:request_success_total", finished_reason="stop") == 1
    assert total(s, "kvmesh:request_success_total", finished_reason="abort") == 1
    assert total(s, "kvmesh:prompt_tokens_total") == prompt_tokens
    assert total(s, "kvmesh:generation_tokens_total") == gen_tokens
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert total(s, f"kvmesh:{h}_count") == n_requests, h
        assert total(s, f"kvmesh:{h}_bucket", le="+Inf") == n_requests, h
        assert total(s, f"kvmesh:{h}_sum") > 0, h
    # one inter-token latency per token output after a request's first: n output tokens → n-1
    assert total(s, "kvmesh:inter_token_latency_seconds_count") == gen_tokens - n_requests
    # TPOT once per request with at least 2 output tokens; token-count histograms per request
    assert total(s, "kvmesh:time_per_output_token_seconds_count") == sum(
        f.usage.completion_tokens > 1 for f in finals)
    assert total(s, "kvmesh:request_prompt_tokens_count") == n_requests
    assert total(s, "kvmesh:request_prompt_tokens_sum") == prompt_tokens
    assert total(s, "kvmesh:request_generation_tokens_sum") == gen_tokens
    # idle at the end; prefix cache counters as GetStats says
    stats = mesh.sched_stub.GetStats(scheduler_pb2.GetStatsRequest())
    (rep,) = stats.replicas
    assert (rep.num_running, rep.num_waiting, rep.num_used_blocks) == (0, 0, 0)
    s = scrape(sm_url)
    assert [v for _, v in s["kvmesh:num_requests_running"]] == [0]
    assert [v for _, v in s["kvmesh:num_requests_waiting"]] == [0]
    assert [v for _, v in s["kvmesh:kv_cache_usage_perc"]] == [0]
    assert s["kvmesh:kv_cache_usage_perc"][0][0] == {"model_name": model, "replica": "0"}
    assert total(s, "kvmesh:prefix_cache_queries_total") == rep.prefix_cache_queries > 0
    assert total(s, "kvmesh:prefix_cache_hits_total") == rep.prefix_cache_hits > 0   # the repeated prompt
    assert total(s, "kvmesh:router_requests_total") == stats.routed_requests == n_requests
    assert total(s, "kvmesh:router_fallbacks_total") == stats.routing_fallbacks == 0
    # every name the code declares is scraped under that exact name
    for name, kind in SCHEDULER_METRICS.items():
        assert (name + "_bucket" if kind == "histogram" else name) in s, name

    g = scrape(gm_url)
    assert total(g, "kvmesh:gateway_requests_total", method="Generate", code="OK") == n_requests
    assert total(g, "kvmesh:gateway_requests_total", code="INVALID_ARGUMENT") == 1
    assert total(g, "kvmesh:gateway_time_to_first_token_seconds_count") == n_requests
    assert [v for _, v in g["kvmesh:gateway_requests_running"]] == [0]
    for name, kind in GATEWAY_METRICS.items():
        assert (name + "_bucket" if kind == "histogram" else name) in g, name


def test_prefix_cache_counters_match_responses_under_preemption(mesh):
    """A preemption storm: 8 concurrent requests sharing a cached prefix need ~104 blocks of the
    pool's 68, so the scheduler preempts (by recompute) and re-admits. The prefix-cache counters
    count each request's prompt once, at its first admission: their deltas (GetStats and
    Prometheus alike) equal the responses' prompt tokens and cached prompt tokens; what the
    re-admissions looked up again is counted apart (``*_preempted_*``)."""
    shared = PROMPTS[0]
    stub = mesh.sched_stub
    (rep0,) = stub.GetStats(scheduler_pb2.GetStatsRequest()).replicas
    s0 = scrape(mesh.sched.metrics.url)
    finals = [generate(mesh, shared, greedy(2))[-1]]         # caches the shared prefix's full blocks
    prompts = [f"{shared} Story number {i}:" for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        finals += [msgs[-1] for msgs in pool.map(lambda p: generate(mesh, p, greedy(150)), prompts)]
    assert [f.finish_reason for f in finals] == [common_pb2.FINISH_REASON_LENGTH] * len(finals)
    (rep,) = stub.GetStats(scheduler_pb2.GetStatsRequest()).replicas
    s = scrape(mesh.sched.metrics.url)
    assert rep.num_preemptions > rep0.num_preemptions                  # the storm did preempt
    assert (rep.num_running, rep.num_waiting, rep.num_used_blocks) == (0, 0, 0)
    prompt_tokens = sum(f.usage.prompt_tokens for f in finals)
    cached_tokens = sum(f.usage.cached_prompt_tokens for f in finals)
    assert cached_tokens > 0                                           # the shared prefix hit
    assert rep.prefix_cache_queries - rep0.prefix_cache_queries == prompt_tokens
    assert rep.prefix_cache_hits - rep0.prefix_cache_hits == cached_tokens
    # re-admissions after preemption: prompt + output so far looked up again, apart
    re_queries = rep.prefix_cache_preempted_queries - rep0.prefix_cache_preempted_queries
    re_hits = rep.prefix_cache_preempted_hits - rep0.prefix_cache_preempted_hits
    assert re_queries > 0 and 0 <= re_hits <= re_queries
    for name, field in (("queries", "prefix_cache_queries"), ("hits", "prefix_cache_hits"),
                        ("preempted_queries", "prefix_cache_preempted_queries"),
                        ("preempted_hits", "prefix_cache_preempted_hits")):
        metric = f"kvmesh:prefix_cache_{name}_total"
        assert total(s, metric) - total(s0, metric) == getattr(rep, field) - getattr(rep0, field), metric
        assert total(s, metric) == getattr(rep, field), metric


def test_metrics_port_settings(monkeypatch):
    assert SchedulerConfig().metrics_port == -1 and GatewayConfig().metrics_port == -1   # off by default
    for off in ("", "off", "-1"):
        monkeypatch.setenv("KVMESH_SCHEDULER_METRICS_PORT", off)
        assert SchedulerConfig.from_env().metrics_port == -1
    monkeypatch.setenv("KVMESH_GATEWAY_METRICS_PORT", "9451")
    assert GatewayConfig.from_env().metrics_port == 9451
    with pytest.raises(EngineError, match="metrics_port"):
        GatewayConfig(metrics_port=70000)
    args = cli.build_parser().parse_args(["serve", "--metrics-port", "0", "--scheduler-metrics-port", "9461"])
    assert flags.gateway_kwargs(args)["metrics_port"] == 0 and flags.scheduler_kwargs(args)["metrics_port"] == 9461
    args = cli.build_parser().parse_args(["scheduler", "--metrics-port", "off"])
    assert flags.scheduler_kwargs(args)["metrics_port"] == -1
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["gateway", "--metrics-port", "x"])


def test_metrics_port_in_use_is_an_error():
    import socket

    from prometheus_client import CollectorRegistry

    from kvmesh.core.metrics import start_metrics_server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(EngineError, match="metrics"):
            start_metrics_server(CollectorRegistry(), "127.0.0.1", s.getsockname()[1])
    assert start_metrics_server(CollectorRegistry(), "127.0.0.1", -1) is None
