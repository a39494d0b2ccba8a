"""Paired mesh overhead: the same short request alternately through an in-process
:class:`scheduler.async_engine.AsyncEngine` and through the mesh (gateway → scheduler → executor) in
this one process, ``--reps`` times; the figure is the median of the per-pair differences of
TTFT and of median inter-token latency, which cancels most of the machine's drift.

The request (40 prompt tokens, mostly prefix-cached after the first, ``--max-tokens`` greedy
tokens) is sent as token ids, so the difference is transport, not tokenization. Both sides use
one torch thread and float32 SmolLM2. ``--executor local`` isolates gRPC (the model in the
scheduler's process); ``--executor ray`` adds the Ray stage actor.

Usage::

    python -m bench.mesh_overhead --executor local ray [--reps 40] [--out docs/mesh_overhead.json]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

from bench import command
from bench.markdown import add_output_args, md_table, write_json


async def measure(executor: str, reps: int, max_tokens: int, model: str) -> dict:
    import grpc
    import torch

    from gateway.server import serve_gateway
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
    from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc
    from kvmesh.core.sampling import SamplingParams
    from scheduler.async_engine import AsyncEngine
    from scheduler.engine import LLMEngine
    from scheduler.service import serve_scheduler

    torch.set_num_threads(1)
    ecfg = EngineConfig(model=model, dtype="float32", kv_cache_memory=64 * 2**20, num_threads=1)
    engine = AsyncEngine(LLMEngine(ecfg))
    sched = await serve_scheduler(SchedulerConfig(port=0, executor=executor), ecfg)
    await sched.wait_ready()
    gw = await serve_gateway(GatewayConfig(port=0, scheduler_address=sched.address))
    ids = list(range(100, 140))

    def timing(t0, stamps):
        return stamps[0] - t0, statistics.median(b - a for a, b in zip(stamps, stamps[1:]))

    async with grpc.aio.insecure_channel(gw.address) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        req = llm_pb2.GenerateRequest(prompt_token_ids=llm_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True))

        async def in_process():
            t0, stamps = time.perf_counter(), []
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            async for o in engine.generate(None, ids, sp):
                if o.new_token_ids:
                    stamps.append(time.perf_counter())
            return timing(t0, stamps)

        async def mesh():
            t0, stamps = time.perf_counter(), []
            async for m in stub.Generate(req):
                if m.token_ids:
                    stamps.append(time.perf_counter())
            return timing(t0, stamps)

        await in_process(), await mesh()                          # warm-up (prefix cache, connections)
        pairs = [(await in_process(), await mesh()) for _ in range(reps)]
    await gw.stop(0)
    await sched.stop(0)
    await engine.shutdown()
    ms = lambda xs: round(1e3 * statistics.median(xs), 2)
    return {"executor": executor, "reps": reps,
            "engine_ttft_p50_ms": ms(a[0] for a, _ in pairs), "engine_itl_p50_ms": ms(a[1] for a, _ in pairs),
            "mesh_ttft_p50_ms": ms(b[0] for _, b in pairs), "mesh_itl_p50_ms": ms(b[1] for _, b in pairs),
            "ttft_overhead_ms": ms(b[0] - a[0] for a, b in pairs), "itl_overhead_ms": ms(b[1] - a[1] for a, b in pairs)}


def main(argv=None) -> int:
    ap = command.parser(__doc__)
    ap.add_argument("--executor", nargs="+", default=["local", "ray"])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=8)
    add_output_args(ap, table=False)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows = [asyncio.run(measure(ex, args.reps, args.max_tokens, args.model)) for ex in args.executor]
    print(md_table(("executor", "in-process TTFT / ITL p50 ms", "mesh TTFT / ITL p50 ms", "paired TTFT overhead ms",
                    "paired ITL overhead ms"),
                   [(r["executor"], f"{r['engine_ttft_p50_ms']} / {r['engine_itl_p50_ms']}",
                     f"{r['mesh_ttft_p50_ms']} / {r['mesh_itl_p50_ms']}", f"{r['ttft_overhead_ms']:+}",
                     f"{r['itl_overhead_ms']:+}") for r in rows]))
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
