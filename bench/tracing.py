"""Tracing overhead: the same PolicyDesk requests through the mesh (``kvmesh serve``, Ray
executor, one stage) with tracing off (``OTEL_TRACES_EXPORTER=none``) and on (``otlp``,
every request sampled, spans exported over OTLP/gRPC to a collector in this process that
counts them). Runs alternate off/on ``--repeats`` times; the figure is the ratio of median
throughputs. Workload and measurements: :mod:`bench.mesh`.

Usage::

    python -m bench.tracing [--requests 32] [--concurrency 16] [--repeats 2] [--out docs/tracing.json]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import threading
from concurrent import futures

import grpc

from bench import command
from bench.markdown import add_output_args, md_table, write_json
from bench.mesh import mesh_passes
from bench.served import served


class CountingCollector:
    """An OTLP/gRPC trace endpoint that counts the spans it receives."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans, lock = 0, threading.Lock()
        outer = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with lock:
                    outer.spans += n
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def run(args, tracing: bool, collector: CountingCollector) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", KVMESH_NUM_THREADS=str(args.threads),
               OTEL_TRACES_EXPORTER="otlp" if tracing else "none", OTEL_TRACES_SAMPLER="always_on",
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.port}", OTEL_EXPORTER_OTLP_INSECURE="true")
    before = collector.spans
    label = f"tracing {'on' if tracing else 'off'}"
    with served(["serve", "--model", args.model, "--port", "0", "--scheduler-port", "0"], env, "gateway") as address:
        rows = asyncio.run(mesh_passes(address, args, label))
    row = rows[-1]
    row["spans_exported"] = collector.spans - before       # counted after serve stopped (flushed)
    return row


def main(argv=None) -> int:
    ap = command.parser(__doc__)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    add_output_args(ap, table=False)
    args = ap.parse_args(argv)
    collector = CountingCollector()
    rows = []
    for i in range(args.repeats):
        for tracing in (False, True):
            print(f"run {i + 1}: tracing {'on' if tracing else 'off'} ...", file=sys.stderr, flush=True)
            rows.append(run(args, tracing, collector))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    med = {t: statistics.median(r["output_tok_s"] for r in rows if r["system"] == f"tracing {t}") for t in ("off", "on")}
    itl = {t: statistics.median(r["itl_p50_ms"] for r in rows if r["system"] == f"tracing {t}") for t in ("off", "on")}
    spans = {t: [r["spans_exported"] for r in rows if r["system"] == f"tracing {t}"] for t in ("off", "on")}
    print(md_table(("tracing", "runs", "output tok/s (median)", "ITL p50 ms (median)", "spans exported per run"),
                   [(t, len(spans[t]), f"{med[t]:.1f}", f"{itl[t]:.1f}", f"{statistics.median(spans[t]):.0f}")
                    for t in ("off", "on")]))
    print(f"\nthroughput with tracing on / off = {med['on'] / med['off']:.3f} "
          f"(overhead {100 * (1 - med['on'] / med['off']):.1f}%; target <= 5%)")
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
