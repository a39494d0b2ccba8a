"""OpenTelemetry tracing for kvmesh's services (docs/telemetry.md).

Configured by the standard ``OTEL_*`` environment variables:

* ``OTEL_TRACES_EXPORTER``: ``otlp`` (OTLP over gRPC to ``OTEL_EXPORTER_OTLP_ENDPOINT``,
  ``OTEL_EXPORTER_OTLP_INSECURE``, ...), ``console`` (stdout), or ``none``: kvmesh's default when
  unset (unlike the SDK's ``otlp``). Several may be given, comma-separated. ``OTEL_SDK_DISABLED=true``
  turns tracing off too. Off, :func:`setup_tracing` returns the API's no-op tracer: spans are
  non-recording and cost next to nothing, nothing is exported.
* ``OTEL_SERVICE_NAME`` overrides the service name a caller passes (``kvmesh-gateway``,
  ``kvmesh-scheduler``, ``kvmesh-worker``); ``OTEL_RESOURCE_ATTRIBUTES`` adds attributes.
* ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default ``parentbased_always_on``) and
  ``OTEL_BSP_*`` (the BatchSpanProcessor's delay and queue sizes) as the SDK reads them.

Each service gets its own TracerProvider (``kvmesh serve`` runs the gateway and the scheduler in
one process, each under its own service name); none is installed as the global provider.
Context crosses process boundaries as a W3C ``traceparent``: gRPC metadata between gateway and
scheduler (:func:`inject_metadata`, :func:`extract_metadata`), a field of
:class:`workers.step.SeqInput` into the Ray stage actors (:class:`StageSpans`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

GATEWAY, SCHEDULER, WORKER = "kvmesh-gateway", "kvmesh-scheduler", "kvmesh-worker"
EXPORTERS = ("otlp", "console", "none")

_PROPAGATOR = TraceContextTextMapPropagator()
_providers: dict[str, object] = {}          # service name -> TracerProvider (only while tracing is on)
_lock = threading.Lock()
# monotonic seconds -> epoch ns: one offset per process, so spans built from the engine's
# monotonic timestamps line up with each other


def exporters() -> list[str]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names ([] when tracing is off). Raises ValueError
    for an unknown one."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    bad = [n for n in names if n not in EXPORTERS]
    if bad:
        raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {bad[0]!r} (kvmesh supports {', '.join(EXPORTERS)})")
    return [n for n in names if n != "none"]


def tracing_enabled() -> bool:
    return bool(exporters())


def setup_tracing(service_name: str) -> trace.Tracer:
    """The tracer of this process's ``service_name`` (created on first call, with a
    BatchSpanProcessor per exporter); the no-op tracer when tracing is off."""
    names = exporters()
    if not names:
        return trace.NoOpTracer()
    with _lock:
        provider = _providers.get(service_name)
        if provider is None:
            provider = _providers[service_name] = _make_provider(service_name, names)
    return provider.get_tracer("kvmesh")


def _make_provider(service_name: str, names: list[str]):
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))   # sampler from OTEL_TRACES_SAMPLER
    for n in names:
        if n == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter()       # OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _INSECURE, _HEADERS ...
        else:
            exporter = ConsoleSpanExporter(service_name=name)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def shutdown_tracing(service_name: str | None = None) -> None:
    """Flush and shut down the provider of ``service_name`` (None: every provider of this
    process). Blocks while the last spans are exported. A later :func:`setup_tracing` starts
    a new provider."""
    with _lock:
        names = list(_providers) if service_name is None else [service_name]
        providers = [_providers.pop(n) for n in names if n in _providers]
    for p in providers:
        p.shutdown()       # BatchSpanProcessor.shutdown exports what is queued


# ---- context propagation ------------------------------------------------------------------------

def extract_metadata(metadata: Iterable | None) -> Context:
    """The context a gRPC caller sent (W3C ``traceparent``/``tracestate`` in its metadata)."""
    carrier = {}
    for k, v in metadata or ():
        if isinstance(v, str):
            carrier[k.lower()] = v
    return _PROPAGATOR.extract(carrier)


def inject_metadata(span: trace.Span | None = None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying ``span``'s context (default: the current span), or None when it
    is not recording (tracing off, or not sampled)."""
    span = span or trace.get_current_span()
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items()) or None


def traceparent(span: trace.Span) -> str | None:
    """``span``'s W3C traceparent header value, or None when it is not recording."""
    if not span.is_recording():
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def parent_context(traceparent_value: str) -> Context:
    return _PROPAGATOR.extract({"traceparent": traceparent_value})


_epoch_offset_ns = time.time_ns() - time.monotonic_ns()
_EPOCH_STEP_NS = 10_000_000


def epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading of this process as epoch nanoseconds (span timestamps).
    One wall-clock offset converts every reading (so the same reading, e.g. the end of one
    phase and the start of the next, always gives the same timestamp); it is re-read when the
    wall clock has moved more than 10 ms away from it (NTP, a VM resumed), which would
    otherwise date every later span wrongly."""
    global _epoch_offset_ns
    now = time.time_ns() - time.monotonic_ns()
    if abs(now - _epoch_offset_ns) > _EPOCH_STEP_NS:
        _epoch_offset_ns = now
    return int(monotonic_s * 1e9) + _epoch_offset_ns


# ---- worker spans -------------------------------------------------------------------------------


def _client_request_id(engine_id: str) -> str:
    """The caller's request id of an engine request id: the engine runs each submission as
    ``<request id>#<n>`` (scheduler.async_engine.OutputStreams), so that an id is free again as soon
    as its stream ends; spans carry the id the client knows."""
    head, sep, tail = engine_id.rpartition("#")
    return head if sep and tail.isdigit() else engine_id

class StageSpans:
    """One span per (request, stage) for the model execution of a request's steps on one
    pipeline stage (or the whole model in-process): ``kvmesh.worker.execute``, from the start of
    the first step that included the request to the end of the last, emitted when the request
    is freed (:meth:`finish`), so nothing is exported per step or per token. Steps of requests
    without a ``traceparent`` cost one attribute check each.

    Attributes: ``kvmesh.request_id``, ``kvmesh.replica``, ``kvmesh.stage.index``,
    ``kvmesh.stage.start_layer`` / ``end_layer`` ([start, end) decoder layers),
    ``kvmesh.stage.tp_rank`` / ``tp_size`` (the stage's tensor-parallel rank: one span per rank),
    ``kvmesh.worker.steps``, ``kvmesh.worker.compute_s`` (wall time of the steps that included
    the request on this stage, whole batch), ``kvmesh.worker.tokens`` (tokens of this request
    computed here).
    """

    def __init__(self, stage: int, start_layer: int, end_layer: int, replica: int = 0, tracer=None,
                 tp_rank: int = 0, tp_size: int = 1):
        self.attributes = {"kvmesh.replica": replica, "kvmesh.stage.index": stage,
                           "kvmesh.stage.start_layer": start_layer, "kvmesh.stage.end_layer": end_layer,
                           "kvmesh.stage.tp_rank": tp_rank, "kvmesh.stage.tp_size": tp_size}
        self._tracer = tracer
        self._live: dict[str, list] = {}    # rid -> [traceparent, start ns, end ns, steps, compute s, tokens]

    def record(self, seqs, t0_ns: int, t1_ns: int) -> None:
        """One step ran from ``t0_ns`` to ``t1_ns`` (epoch ns) over ``seqs`` (SeqInputs)."""
        dt = (t1_ns - t0_ns) / 1e9
        for s in seqs:
            acc = self._live.get(s.request_id)
            if acc is None:
                if not s.traceparent:
                    continue
                acc = self._live[s.request_id] = [s.traceparent, t0_ns, t1_ns, 0, 0.0, 0]
            acc[2] = t1_ns
            acc[3] += 1
            acc[4] += dt
            acc[5] += len(s.token_ids)

    def finish(self, request_ids: Iterable[str]) -> None:
        """Emit the spans of these requests (those that were traced here)."""
        for rid in request_ids:
            acc = self._live.pop(rid, None)
            if acc is None:
                continue
            if self._tracer is None:
                self._tracer = setup_tracing(WORKER)
            tp, start, end, steps, compute, tokens = acc
            span = self._tracer.start_span("kvmesh.worker.execute", context=parent_context(tp),
                                           kind=trace.SpanKind.INTERNAL, start_time=start, attributes={
                                               **self.attributes, "kvmesh.request_id": _client_request_id(rid),
                                               "kvmesh.worker.steps": steps,
                                               "kvmesh.worker.compute_s": compute, "kvmesh.worker.tokens": tokens})
            span.end(end_time=end)
