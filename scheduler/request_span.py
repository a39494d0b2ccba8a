"""The scheduler's span of one request (``kvmesh.scheduler.request``, :mod:`kvmesh.telemetry`):
started when a ``Submit`` call is routed, ended with the request's outcome and its phases
(``queue``, ``prefill``, ``decode``) once it is over; nothing is emitted per step or token."""

from __future__ import annotations

import sys
import time

import grpc

from kvmesh.core import telemetry
from scheduler.engine_records import EngineOutput
from kvmesh.core.sampling import SamplingParams


def start_request_span(tracer, context, model: str, request, rid: str, replica, params: SamplingParams):
    """The span of one request (``request``: the ``SubmitRequest``, routed to ``replica``, a
    :class:`scheduler.replica.Replica`), a child of the gateway's span when the call's metadata
    (``context``) carries its ``traceparent``. Not current: ended by :func:`end_request_span`."""
    return tracer.start_span(
        "kvmesh.scheduler.request", context=telemetry.extract_metadata(context.invocation_metadata()),
        kind=telemetry.trace.SpanKind.SERVER, attributes={
            "gen_ai.request.model": model, "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids), "kvmesh.request_id": rid,
            "kvmesh.session_id": request.session_id, "kvmesh.replica": replica.index,
            "kvmesh.replica_id": replica.replica_id, "kvmesh.tenant": request.tenant})


def end_request_span(tracer, span, last: EngineOutput | None, block_size: int) -> None:
    """End a request's span with its outcome, and give it the children ``queue`` (arrival →
    first scheduled), ``prefill`` (→ first token) and ``decode`` (→ finished), built from the
    request's timestamps now that it is over: nothing is emitted per step or token."""
    exc = sys.exception()
    if last is None or not last.finished:
        if exc is not None and not isinstance(exc, grpc.aio.AbortError):
            span.record_exception(exc)
        span.set_status(telemetry.trace.StatusCode.ERROR,
                        "the request ended without a final message (cancelled, or it failed)")
        span.end()
        return
    o = last
    reason = o.finish_reason.value if o.finish_reason is not None else "unspecified"
    end = o.finished_time or time.monotonic()
    attrs = {"gen_ai.usage.input_tokens": o.num_prompt_tokens, "gen_ai.usage.output_tokens": o.num_output_tokens,
             "gen_ai.response.finish_reasons": [reason], "kvmesh.finish_reason": reason,
             "kvmesh.prefix_cache.hit_tokens": o.num_cached_tokens,
             "kvmesh.prefix_cache.hit_blocks": o.num_cached_tokens // block_size,
             "kvmesh.queue_time_s": (o.first_scheduled_time or end) - o.arrival_time}
    if o.first_token_time:
        attrs["kvmesh.ttft_s"] = o.first_token_time - o.arrival_time
    if o.stop_reason is not None:
        attrs["kvmesh.stop_reason"] = str(o.stop_reason)
    span.set_attributes(attrs)
    parent = telemetry.trace.set_span_in_context(span)
    phases = [("queue", o.arrival_time, o.first_scheduled_time or end)]
    if o.first_scheduled_time:
        phases.append(("prefill", o.first_scheduled_time, o.first_token_time or end))
    if o.first_token_time:
        phases.append(("decode", o.first_token_time, end))
    for name, t0, t1 in phases:
        child = tracer.start_span(name, context=parent, start_time=telemetry.epoch_ns(t0))
        child.end(end_time=telemetry.epoch_ns(t1))
    span.end()
