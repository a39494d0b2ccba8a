"""OpenTelemetry traces across the mesh (kvmesh/core/telemetry.py, docs/telemetry.md).

The end-to-end test runs ``kvmesh serve --executor ray --pp 2 -tp 3`` as a subprocess exporting OTLP
to a collector stub served here (``TraceService/Export``), sends a streamed Generate with a
W3C ``traceparent`` of a known trace, and checks the span tree: caller → gateway → scheduler
request → queue/prefill/decode, and one worker span per pipeline stage and tensor-parallel rank."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent import futures

import grpc
import pytest

from kvmesh.core import telemetry

from test_cli_mesh import MODEL, Served, mesh_env   # tests/ is on sys.path (no __init__.py: prepend import mode)

OTEL_VARS = ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")


# ---- tracing off ----------------------------------------------------------------------------------

def test_tracing_off_by_default_is_a_no_op(monkeypatch):
    for k in OTEL_VARS:
        monkeypatch.delenv(k, raising=False)
    from opentelemetry import trace
    assert not telemetry.tracing_enabled()
    before = dict(telemetry._providers)
    tracer = telemetry.setup_tracing(telemetry.GATEWAY)
    assert isinstance(tracer, trace.NoOpTracer)
    assert telemetry._providers == before                  # no provider, no exporter, no export thread
    assert not any("OtelBatchSpan" in t.name for t in threading.enumerate() if t.name)
    with tracer.start_as_current_span("kvmesh.gateway.generate") as span:
        assert not span.is_recording()
        assert telemetry.traceparent(span) is None
        assert telemetry.inject_metadata(span) is None
    # worker side: steps of untraced requests keep nothing
    from workers.step import SeqInput
    spans = telemetry.StageSpans(0, 0, 30)
    spans.record([SeqInput("r", 0, [1, 2, 3], [0], True)], 0, 10)
    assert spans._live == {}
    spans.finish(["r"])
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert isinstance(telemetry.setup_tracing(telemetry.GATEWAY), trace.NoOpTracer)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        telemetry.setup_tracing(telemetry.GATEWAY)


def test_metadata_round_trip_and_epoch_clock(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ctx = telemetry.extract_metadata((("user-agent", "x"), ("traceparent", tp), ("bin-bin", b"\x00")))
    from opentelemetry import trace
    parent = trace.get_current_span(ctx).get_span_context()
    assert f"{parent.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    tracer = telemetry.setup_tracing("kvmesh-test")
    try:
        span = tracer.start_span("x", context=ctx)
        assert span.is_recording()
        child_tp = telemetry.traceparent(span)
        assert child_tp.startswith("00-0af7651916cd43dd8448eb211c80319c-")
        assert dict(telemetry.inject_metadata(span))["traceparent"] == child_tp
        span.end()
    finally:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
        telemetry.shutdown_tracing("kvmesh-test")
    now = time.monotonic()
    assert abs(telemetry.epoch_ns(now) - time.time_ns()) < 50e6


def test_epoch_clock_follows_a_stepped_wall_clock_and_stays_exact(monkeypatch):
    """A wall clock stepped after import (offset 0.8 s stale) is picked up; one reading converts
    to one timestamp every time (phase spans share their boundaries exactly)."""
    monkeypatch.setattr(telemetry, "_epoch_offset_ns", telemetry._epoch_offset_ns - 800_000_000)
    now = time.monotonic()
    assert abs(telemetry.epoch_ns(now) - time.time_ns()) < 50e6
    assert len({telemetry.epoch_ns(now) for _ in range(1000)}) == 1


# ---- end to end: the mesh exporting to a collector stub ------------------------------------------

class Collector:
    """An OTLP/gRPC trace collector: keeps every span it receives as a dict."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        spans, lock = self.spans, self.lock = [], threading.Lock()

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                got = []
                for rs in request.resource_spans:
                    res = {a.key: _value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            got.append({"service": res.get("service.name"), "name": s.name,
                                        "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                        "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                                        "end": s.end_time_unix_nano,
                                        "attrs": {a.key: _value(a.value) for a in s.attributes}})
                with lock:
                    spans.extend(got)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def snapshot(self) -> list[dict]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, pred, timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.snapshot()
            if pred(spans):
                return spans
            time.sleep(0.2)
        return self.snapshot()


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _generate(address: str, prompt: str, metadata=()) -> list:
    from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc
    with grpc.insecure_channel(address) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        req = llm_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0))
        return list(stub.Generate(req, metadata=metadata, timeout=120))


@pytest.mark.mesh
def test_one_trace_per_request_across_gateway_scheduler_and_ray_stages(smollm2_dir):
    collector = Collector()
    env = mesh_env(RAY_AUTH_MODE="disabled", OTEL_TRACES_EXPORTER="otlp",
                   OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.port}",
                   OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_BSP_SCHEDULE_DELAY="100")
    for k in ("OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED", "OTEL_TRACES_SAMPLER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        env.pop(k, None)
    srv = Served(["serve", "--model", MODEL, "--executor", "ray", "--pp", "2", "-tp", "3", "--stage-num-cpus", "0.5",
                  "--port", "0", "--scheduler-port", "0", "--grace", "2"], env)
    trace_id, caller = os.urandom(16).hex(), os.urandom(8).hex()
    try:
        t0 = time.monotonic()
        srv.wait_listening(timeout=300)
        t_up = time.monotonic() - t0
        outs = _generate(srv.address(), "The capital of France is", (("traceparent", f"00-{trace_id}-{caller}-01"),))
        assert outs[-1].finished and outs[-1].usage.completion_tokens == 6
        outs2 = _generate(srv.address(), "Once upon a time")          # no traceparent: a trace of its own
        assert outs2[-1].finished

        def complete(spans):
            mine = [s for s in spans if s["trace_id"] == trace_id]
            return sum(s["name"] == "kvmesh.worker.execute" for s in mine) >= 6 and len(mine) >= 11
        t1 = time.monotonic()
        spans = collector.wait_for(complete, 30)
        t_spans = time.monotonic() - t1
        rc, took = srv.stop(signal.SIGTERM, timeout=120)
        assert rc == 0, srv.stderr
        time.sleep(0.5)
        spans = collector.snapshot()
    finally:
        srv.kill()
        collector.server.stop(0)

    mine = [s for s in spans if s["trace_id"] == trace_id]
    by_name = {}
    for s in mine:
        by_name.setdefault(s["name"], []).append(s)
    (gw,) = by_name["kvmesh.gateway.generate"]
    assert gw["parent"] == caller and gw["service"] == "kvmesh-gateway"
    assert gw["attrs"]["gen_ai.operation.name"] == "text_completion"
    assert gw["attrs"]["gen_ai.request.model"] == MODEL
    assert gw["attrs"]["gen_ai.usage.output_tokens"] == 6 and gw["attrs"]["gen_ai.response.finish_reasons"] == ["length"]
    assert gw["attrs"]["gen_ai.request.max_tokens"] == 6 and gw["attrs"]["gen_ai.request.temperature"] == 0.0
    n_prompt = gw["attrs"]["gen_ai.usage.input_tokens"]
    (sched,) = by_name["kvmesh.scheduler.request"]
    assert sched["parent"] == gw["span_id"] and sched["service"] == "kvmesh-scheduler"
    assert sched["attrs"]["kvmesh.request_id"] == outs[-1].request_id == gw["attrs"]["kvmesh.request_id"]
    assert sched["attrs"]["gen_ai.usage.output_tokens"] == 6 and sched["attrs"]["kvmesh.finish_reason"] == "length"
    assert sched["attrs"]["kvmesh.ttft_s"] > 0 and "kvmesh.prefix_cache.hit_blocks" in sched["attrs"]
    phases = {}
    for name in ("queue", "prefill", "decode"):
        (p,) = by_name[name]
        assert p["parent"] == sched["span_id"] and p["service"] == "kvmesh-scheduler"
        assert sched["start"] <= p["start"] <= p["end"] <= sched["end"]
        phases[name] = p
    assert phases["queue"]["end"] == phases["prefill"]["start"] and phases["prefill"]["end"] == phases["decode"]["start"]
    workers = by_name["kvmesh.worker.execute"]
    assert len(workers) == 6, workers         # pp 2 x tp 3: one span per stage and rank
    assert sorted((w["attrs"]["kvmesh.stage.index"], w["attrs"]["kvmesh.stage.tp_rank"]) for w in workers) == [
        (i, r) for i in range(2) for r in range(3)]
    for w in workers:
        assert w["parent"] == sched["span_id"] and w["service"] == "kvmesh-worker"
        a = w["attrs"]
        assert a["kvmesh.request_id"] == outs[-1].request_id
        assert a["kvmesh.worker.steps"] == 6          # one prefill + 5 decode steps (the 6th token is not fed back)
        assert a["kvmesh.worker.tokens"] == n_prompt + 5 and a["kvmesh.worker.compute_s"] > 0
        assert a["kvmesh.stage.end_layer"] > a["kvmesh.stage.start_layer"]
        assert a["kvmesh.stage.tp_size"] == 3
        assert phases["prefill"]["start"] - 1e9 <= w["start"] <= w["end"] <= sched["end"] + 1e9   # clocks of one host
    # the request without traceparent: its own trace, rooted at the gateway
    other = [s for s in spans if s["trace_id"] != trace_id]
    roots = [s for s in other if s["name"] == "kvmesh.gateway.generate"]
    assert len(roots) == 1 and roots[0]["parent"] == ""
    rest = {s["name"] for s in other if s["trace_id"] == roots[0]["trace_id"]}
    assert {"kvmesh.scheduler.request", "queue", "prefill", "decode", "kvmesh.worker.execute"} <= rest
    print(f"serve --pp 2 with OTLP: up in {t_up:.1f} s, spans complete {t_spans:.1f} s after the stream, "
          f"SIGTERM -> exit in {took:.1f} s; {len(spans)} spans")
