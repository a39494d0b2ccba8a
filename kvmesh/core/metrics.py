"""Prometheus metrics of the scheduler and gateway services (docs/telemetry.md, "Metrics").

Names and meanings follow vLLM's (``vllm:`` → ``kvmesh:``) where they overlap. Each service has
its own :class:`prometheus_client.CollectorRegistry` and its own HTTP server (``metrics_port`` of
its settings), so the two services of ``kvmesh serve`` in one process never collide; there the
gateway's endpoint (``kvmesh serve --metrics-port``) also carries the scheduler's series
(:func:`include_registry`), one endpoint per process.

Scheduler (labels ``model_name`` and, per replica, ``replica`` = the replica's index):

* observed when a request's outputs reach the service (:meth:`SchedulerMetrics.observer`, called
  on the event loop with each step's :class:`scheduler.engine_records.EngineOutput` batch, one clock
  read per batch): ``inter_token_latency_seconds`` (one observation per output carrying tokens,
  after the request's first: the time since its previous one; one token per step → a request
  with n output tokens gives n-1 observations); at finish, from the engine's own timestamps,
  ``time_to_first_token_seconds`` (arrival → first token; requests that produced one),
  ``e2e_request_latency_seconds`` (arrival → finish), ``request_queue_time_seconds`` (arrival →
  first scheduled; requests that were scheduled), ``prompt_tokens_total``,
  ``generation_tokens_total``, ``request_success_total{finished_reason}`` (stop, length, abort),
  and speculative decoding's ``spec_decode_num_drafts_total`` (steps that verified proposals),
  ``spec_decode_num_draft_tokens_total`` (proposals verified), ``spec_decode_num_accepted_tokens_total``
  and ``spec_decode_num_emitted_tokens_total`` (accepted + the target's own token of each such
  step); acceptance rate = accepted / draft tokens, mean accepted length = emitted / drafts;
* read at scrape time (:class:`_ReplicaCollector`) from the stats each replica's engine loop
  pushes after every step (its :class:`scheduler.engine_records.EngineStats`; no lock taken):
  ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (blocks held by
  requests / all blocks, 0..1), ``prefix_cache_queries_total`` and ``prefix_cache_hits_total``
  (prompt tokens looked up / found, as GetStats: once per request, at its first admission, so
  the hits equal the sum of the responses' ``cached_prompt_tokens``),
  ``prefix_cache_preempted_queries_total`` and ``prefix_cache_preempted_hits_total`` (what
  re-admissions after a preemption by recompute looked up again, prompt + output so far, and
  found; queries - hits = tokens computed again), ``num_preemptions_total``, the KV cache's
  capacity ``kv_cache_blocks``, ``kv_cache_bytes_per_token`` (all layers, quantization scales
  included) and ``max_concurrency`` (sequences of ``max_model_len`` tokens the pool holds),
  ``spec_decode_propose_seconds_total`` (time spent proposing: prompt lookup or the draft model); and the router's
  ``router_requests_total``, ``router_prefix_routed_total``, ``router_fallbacks_total``.

Gateway (labels ``model_name`` and ``tenant``: the caller's tenant by its API key, "" without
keys or for a refused key, so bounded by the keys file's tenants): ``gateway_requests_total{method,
code}`` (Generate/Chat RPCs and HTTP ChatCompletions/Completions requests by final gRPC status
name; UNAUTHENTICATED for a missing or wrong key), ``gateway_time_to_first_token_seconds`` (Submit
sent → first token received), ``gateway_prompt_tokens_total`` and ``gateway_generation_tokens_total``
(of finished requests, for per-tenant usage), and ``gateway_requests_running`` (streams in flight,
no labels).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvmesh.core.errors import DependencyUnavailableError
from kvmesh.core.net import connect_address

log = logging.getLogger("kvmesh.metrics")

PREFIX = "kvmesh:"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)   # vLLM's 1-2-5 series (tokens)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)

# Every metric family a service exports, as scraped (counters with their _total suffix;
# histograms add _bucket/_sum/_count). tests/test_deploy.py checks the Grafana dashboard against these.
SCHEDULER_METRICS = {
    "kvmesh:time_to_first_token_seconds": "histogram",
    "kvmesh:inter_token_latency_seconds": "histogram",
    "kvmesh:e2e_request_latency_seconds": "histogram",
    "kvmesh:request_queue_time_seconds": "histogram",
    "kvmesh:time_per_output_token_seconds": "histogram",
    "kvmesh:request_prompt_tokens": "histogram",
    "kvmesh:request_generation_tokens": "histogram",
    "kvmesh:prompt_tokens_total": "counter",
    "kvmesh:generation_tokens_total": "counter",
    "kvmesh:request_success_total": "counter",
    "kvmesh:num_requests_running": "gauge",
    "kvmesh:num_requests_waiting": "gauge",
    "kvmesh:kv_cache_usage_perc": "gauge",
    "kvmesh:prefix_cache_queries_total": "counter",
    "kvmesh:prefix_cache_hits_total": "counter",
    "kvmesh:prefix_cache_preempted_queries_total": "counter",
    "kvmesh:prefix_cache_preempted_hits_total": "counter",
    "kvmesh:num_preemptions_total": "counter",
    "kvmesh:kv_cache_blocks": "gauge",
    "kvmesh:kv_cache_bytes_per_token": "gauge",
    "kvmesh:max_concurrency": "gauge",
    "kvmesh:spec_decode_num_drafts_total": "counter",
    "kvmesh:spec_decode_num_draft_tokens_total": "counter",
    "kvmesh:spec_decode_num_accepted_tokens_total": "counter",
    "kvmesh:spec_decode_num_emitted_tokens_total": "counter",
    "kvmesh:spec_decode_propose_seconds_total": "counter",
    "kvmesh:kv_tier_hits_total": "counter",
    "kvmesh:kv_tier_bytes_loaded_total": "counter",
    "kvmesh:kv_tier_bytes_stored_total": "counter",
    "kvmesh:kv_tier_load_seconds_total": "counter",
    "kvmesh:kv_tier_integrity_failures_total": "counter",
    "kvmesh:kv_tier_unavailable_total": "counter",
    "kvmesh:router_requests_total": "counter",
    "kvmesh:router_prefix_routed_total": "counter",
    "kvmesh:router_fallbacks_total": "counter",
}
GATEWAY_METRICS = {
    "kvmesh:gateway_requests_total": "counter",
    "kvmesh:gateway_time_to_first_token_seconds": "histogram",
    "kvmesh:gateway_prompt_tokens_total": "counter",
    "kvmesh:gateway_generation_tokens_total": "counter",
    "kvmesh:gateway_requests_running": "gauge",
}


def _base(name: str) -> str:
    """prometheus_client takes a counter's name without ``_total``."""
    return name.removesuffix("_total")


class SchedulerMetrics:
    """The scheduler's metrics in their own registry. ``service`` (a
    :class:`scheduler.service.SchedulerService`) is read at scrape time for the gauges and the
    engine/router counters."""

    def __init__(self, model_name: str, service):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ("model_name", "replica")

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        def counter(name, doc, extra=()):
            return Counter(_base(name), doc, labels + extra, registry=r)

        self.ttft = hist("kvmesh:time_to_first_token_seconds", "Arrival to first token (seconds).", TTFT_BUCKETS)
        self.itl = hist("kvmesh:inter_token_latency_seconds",
                        "Time between a request's consecutive token outputs (seconds).", ITL_BUCKETS)
        self.e2e = hist("kvmesh:e2e_request_latency_seconds", "Arrival to finish (seconds).", REQUEST_BUCKETS)
        self.queue = hist("kvmesh:request_queue_time_seconds", "Arrival to first scheduled (seconds).",
                          REQUEST_BUCKETS)
        self.tpot = hist("kvmesh:time_per_output_token_seconds",
                         "Per request: (finish - first token) / (output tokens - 1), seconds (TPOT).", ITL_BUCKETS)
        self.req_prompt = hist("kvmesh:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.req_gen = hist("kvmesh:request_generation_tokens", "Output tokens per finished request.", TOKEN_BUCKETS)
        self.prompt_tokens = counter("kvmesh:prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("kvmesh:generation_tokens_total", "Output tokens of finished requests.")
        self.success = counter("kvmesh:request_success_total", "Finished requests by finish reason.",
                               ("finished_reason",))
        self.spec_drafts = counter("kvmesh:spec_decode_num_drafts_total",
                                   "Speculative steps (steps that verified proposals) of finished requests.")
        self.spec_draft_tokens = counter("kvmesh:spec_decode_num_draft_tokens_total",
                                         "Proposed tokens verified, of finished requests.")
        self.spec_accepted = counter("kvmesh:spec_decode_num_accepted_tokens_total",
                                     "Proposed tokens accepted, of finished requests.")
        self.spec_emitted = counter("kvmesh:spec_decode_num_emitted_tokens_total",
                                    "Tokens emitted by speculative steps (accepted + one per step), of finished "
                                    "requests.")
        self.registry.register(_ReplicaCollector(self, service))

    def observer(self, replica: int) -> Callable[[list], None]:
        """The callback of one replica's :class:`scheduler.async_engine.AsyncEngine` (``on_outputs``):
        called on the event loop with each batch of outputs."""
        labels = (self.model_name, str(replica))
        itl, ttft, e2e, queue, tpot, req_prompt, req_gen = (m.labels(*labels) for m in (
            self.itl, self.ttft, self.e2e, self.queue, self.tpot, self.req_prompt, self.req_gen))
        prompt, gen = self.prompt_tokens.labels(*labels), self.generation_tokens.labels(*labels)
        drafts, draft_tokens, accepted, emitted = (m.labels(*labels) for m in (
            self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.spec_emitted))
        last: dict[str, float] = {}          # request id -> time of its latest token output

        def observe(outputs: list) -> None:
            try:
                now = time.monotonic()
                for o in outputs:
                    if o.new_token_ids:
                        prev = last.get(o.request_id)
                        if prev is not None:
                            itl.observe(now - prev)
                        last[o.request_id] = now
                    if o.finished:
                        last.pop(o.request_id, None)
                        end = o.finished_time or now
                        if o.first_token_time:
                            ttft.observe(o.first_token_time - o.arrival_time)
                        if o.first_scheduled_time:
                            queue.observe(o.first_scheduled_time - o.arrival_time)
                        e2e.observe(end - o.arrival_time)
                        if o.first_token_time and o.num_output_tokens > 1:
                            tpot.observe((end - o.first_token_time) / (o.num_output_tokens - 1))
                        req_prompt.observe(o.num_prompt_tokens)
                        req_gen.observe(o.num_output_tokens)
                        prompt.inc(o.num_prompt_tokens)
                        gen.inc(o.num_output_tokens)
                        drafts.inc(o.num_drafts)
                        draft_tokens.inc(o.num_draft_tokens)
                        accepted.inc(o.num_accepted_tokens)
                        emitted.inc(o.num_accepted_tokens + o.num_drafts)
                        reason = o.finish_reason.value if o.finish_reason is not None else "unknown"
                        self.success.labels(*labels, reason).inc()
            except Exception:               # metrics never break delivery
                log.exception("recording metrics failed")

        return observe


class _ReplicaCollector:
    """Gauges and engine/router counters, read at scrape time."""

    def __init__(self, metrics: SchedulerMetrics, service):
        self.metrics, self.service = metrics, service

    def describe(self):
        return []          # unchecked collector: names are not registered up front

    def collect(self):
        model, labels = self.metrics.model_name, ["model_name", "replica"]
        running = GaugeMetricFamily("kvmesh:num_requests_running", "Requests in the running batch.", labels=labels)
        waiting = GaugeMetricFamily("kvmesh:num_requests_waiting", "Requests waiting to be scheduled.",
                                    labels=labels)
        usage = GaugeMetricFamily("kvmesh:kv_cache_usage_perc",
                                  "KV cache usage: blocks held by requests / all blocks (1 = full).", labels=labels)
        queries = CounterMetricFamily("kvmesh:prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(once per request, at its first admission).", labels=labels)
        hits = CounterMetricFamily("kvmesh:prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                   "(once per request, at its first admission).", labels=labels)
        re_queries = CounterMetricFamily("kvmesh:prefix_cache_preempted_queries",
                                         "Tokens (prompt + output so far) looked up again in the prefix cache by "
                                         "re-admissions after a preemption.", labels=labels)
        re_hits = CounterMetricFamily("kvmesh:prefix_cache_preempted_hits",
                                      "Tokens found in the prefix cache by re-admissions after a preemption "
                                      "(the rest was computed again).", labels=labels)
        preempt = CounterMetricFamily("kvmesh:num_preemptions", "Preemptions.", labels=labels)
        blocks = GaugeMetricFamily("kvmesh:kv_cache_blocks", "KV cache blocks in the pool.", labels=labels)
        per_token = GaugeMetricFamily("kvmesh:kv_cache_bytes_per_token",
                                      "KV cache bytes of one token over all layers (scales included).",
                                      labels=labels)
        concurrency = GaugeMetricFamily("kvmesh:max_concurrency",
                                        "Sequences of max_model_len tokens the KV pool holds at once.",
                                        labels=labels)
        up = GaugeMetricFamily("kvmesh:replica_up", "1 while the replica's engine loop runs, 0 while it is down.",
                               labels=labels)
        restarts = CounterMetricFamily("kvmesh:replica_restarts", "Restarts of the replica's engine process "
                                       "after it died or hung.", labels=labels)
        propose = CounterMetricFamily("kvmesh:spec_decode_propose_seconds",
                                      "Time spent proposing speculative tokens (seconds).", labels=labels)
        for r in list(self.service.replicas):
            st, info = r.aengine.stats, r.info          # pushed by the engine loop after each step
            lv = [model, str(r.index)]
            running.add_metric(lv, st.num_running)
            waiting.add_metric(lv, r.num_waiting())
            usage.add_metric(lv, st.used_blocks / info.num_blocks if info.num_blocks else 0.0)
            queries.add_metric(lv, st.prefix_cache_queries)
            hits.add_metric(lv, st.prefix_cache_hits)
            re_queries.add_metric(lv, st.prefix_cache_preempted_queries)
            re_hits.add_metric(lv, st.prefix_cache_preempted_hits)
            preempt.add_metric(lv, st.num_preemptions)
            propose.add_metric(lv, st.spec_propose_seconds)
            blocks.add_metric(lv, info.num_blocks)
            per_token.add_metric(lv, info.kv_bytes_per_token)
            concurrency.add_metric(lv, info.max_concurrency)
            up.add_metric(lv, 1.0 if r.healthy else 0.0)
            restarts.add_metric(lv, r.restarts)
        replicas = list(self.service.replicas)
        up_total = GaugeMetricFamily("kvmesh:replicas_up", "Replicas whose engine loop runs.", labels=["model_name"])
        up_total.add_metric([model], sum(r.healthy for r in replicas))
        yield from (running, waiting, usage, queries, hits, re_queries, re_hits, preempt, propose, blocks, per_token,
                    concurrency, up, restarts, up_total)
        yield from self._tiers(model, replicas)
        router = self.service.router
        if router is not None:
            st = router.stats
            for name, doc, value in (
                    ("kvmesh:router_requests", "Requests routed to a replica.", st.routed),
                    ("kvmesh:router_prefix_routed", "Requests routed to a replica that could reuse part of the prompt.",
                     st.prefix_hits),
                    ("kvmesh:router_fallbacks", "Requests routed by load because the prefix index was unavailable.",
                     st.fallbacks)):
                c = CounterMetricFamily(name, doc, labels=["model_name"])
                c.add_metric([model], value)
                yield c


    @staticmethod
    def _tiers(model: str, replicas):
        """KV tiers below each replica's pool (docs/kvstore.md, "KV tiers")."""
        labels, tiered = ["model_name", "replica", "tier"], ["model_name", "replica"]
        hits = CounterMetricFamily("kvmesh:kv_tier_hits", "KV blocks loaded from a tier below the pool instead "
                                   "of recomputed.", labels=labels)
        loaded = CounterMetricFamily("kvmesh:kv_tier_bytes_loaded", "Bytes of KV blocks loaded from a tier.",
                                     labels=labels)
        stored = CounterMetricFamily("kvmesh:kv_tier_bytes_stored", "Bytes of evicted KV blocks stored in a tier "
                                     "(redis: queued for writing).", labels=labels)
        seconds = CounterMetricFamily("kvmesh:kv_tier_load_seconds", "Time spent looking up KV blocks in the tiers "
                                      "and copying them into the pool (seconds).", labels=tiered)
        bad = CounterMetricFamily("kvmesh:kv_tier_integrity_failures", "Stored KV blocks found corrupted or in "
                                  "another format (recomputed).", labels=tiered)
        down = CounterMetricFamily("kvmesh:kv_tier_unavailable", "Look-ups that found the Redis tier down or slow "
                                   "(recomputed).", labels=tiered)
        for r in replicas:
            st, lv = r.aengine.stats, [model, str(r.index)]
            hits.add_metric(lv + ["host"], st.kv_tier_host_hits)
            hits.add_metric(lv + ["redis"], st.kv_tier_redis_hits)
            loaded.add_metric(lv + ["host"], st.kv_tier_host_bytes_loaded)
            loaded.add_metric(lv + ["redis"], st.kv_tier_redis_bytes_loaded)
            stored.add_metric(lv + ["host"], st.kv_tier_host_bytes_stored)
            stored.add_metric(lv + ["redis"], st.kv_tier_redis_bytes_stored)
            seconds.add_metric(lv, st.kv_tier_load_seconds)
            bad.add_metric(lv, st.kv_tier_integrity_failures)
            down.add_metric(lv, st.kv_tier_unavailable)
        yield from (hits, loaded, stored, seconds, bad, down)


class GatewayMetrics:
    """The gateway's request-level metrics in their own registry. ``servicer`` (a
    :class:`gateway.stream.RequestPath`) gives the model name and the streams in flight."""

    def __init__(self, servicer):
        self.registry = r = CollectorRegistry()
        self.servicer = servicer
        self.requests = Counter(_base("kvmesh:gateway_requests_total"),
                                "Generate/Chat RPCs and HTTP ChatCompletions/Completions by final gRPC status code.",
                                ("model_name", "method", "code", "tenant"), registry=r)
        self.ttft = Histogram("kvmesh:gateway_time_to_first_token_seconds",
                              "Submit sent to the scheduler → first token received (seconds).",
                              ("model_name", "tenant"), registry=r, buckets=TTFT_BUCKETS)
        self.prompt_tokens = Counter(_base("kvmesh:gateway_prompt_tokens_total"),
                                     "Prompt tokens of finished requests.", ("model_name", "tenant"), registry=r)
        self.generation_tokens = Counter(_base("kvmesh:gateway_generation_tokens_total"),
                                         "Output tokens of finished requests.", ("model_name", "tenant"), registry=r)
        running = Gauge("kvmesh:gateway_requests_running", "Streams in flight through this gateway.",
                        registry=r)
        running.set_function(lambda: len(servicer.live))

    @property
    def model_name(self) -> str:
        info = self.servicer.info
        return info.name if info is not None else ""

    def request_done(self, method: str, code: str, tenant: str = "") -> None:
        self.requests.labels(self.model_name, method, code, tenant).inc()

    def denied(self, method: str) -> None:
        """An RPC refused for a missing or wrong API key (counted for Generate and Chat)."""
        if method in ("Generate", "Chat"):
            self.request_done(method, "UNAUTHENTICATED")

    def first_token(self, seconds: float, tenant: str = "") -> None:
        self.ttft.labels(self.model_name, tenant).observe(seconds)

    def usage(self, usage, tenant: str = "") -> None:
        """A finished request's ``kvmesh.v1.Usage`` (tokens)."""
        self.prompt_tokens.labels(self.model_name, tenant).inc(usage.prompt_tokens)
        self.generation_tokens.labels(self.model_name, tenant).inc(usage.completion_tokens)


class _RegistryView:
    """A collector yielding every metric of another registry at each scrape."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        yield from self.registry.collect()


def include_registry(target: CollectorRegistry, other: CollectorRegistry) -> None:
    """Expose ``other``'s metrics through ``target`` too (``kvmesh serve``: one endpoint, the
    gateway's, carries both services' series). The two registries must not share metric names
    (the gateway's are ``kvmesh:gateway_*``)."""
    target.register(_RegistryView(other))


class MetricsServer:
    """A running ``/metrics`` HTTP server; ``port`` is the bound port."""

    def __init__(self, httpd, thread, host: str):
        self.httpd, self.thread, self.host = httpd, thread, host
        self.port = httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{connect_address(self.host, self.port)}/metrics"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer | None:
    """Serve ``registry`` at ``http://host:port/metrics`` (port 0 = any free port) on a daemon
    thread; None when ``port`` is -1 (off). Raises DependencyUnavailableError if the port cannot be bound."""
    if port < 0:
        return None
    try:
        httpd, thread = start_http_server(port, addr=host or "0.0.0.0", registry=registry)
    except OSError as e:
        raise DependencyUnavailableError(f"cannot serve metrics on {host}:{port} ({e}): is the port in use? choose another "
                                         "metrics port (0 = any free port, -1 = off)") from None
    return MetricsServer(httpd, thread, host)
