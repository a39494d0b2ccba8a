"""Tensor parallelism against one process and against pipeline parallelism: batch-1 decode, cold
TTFT and the all-reduce's share of a step.

One engine per configuration, built, measured and shut down in turn (one at a time: on a small
machine two would share its cores):

- ``tp1``: the model in this process, ``--threads`` torch threads (the local executor: what
  ``kvmesh serve`` runs by default);
- ``tp2``: two tensor-parallel ranks, Ray actors of one CPU and one thread each
  (:class:`workers.executor.RayPipelineExecutor`; shared-memory all-reduce on one node, gloo
  across nodes);
- ``pp2``: two pipeline stages, Ray actors of one CPU and one thread each.

For each: the cold TTFT of one ``--context``-token PolicyDesk prompt (prefix caching off: the
whole prompt is prefilled, in chunks of the default token budget), then ``--decode`` greedy
tokens of the same request, whose median step time gives the batch-1 decode tok/s. Under
tensor parallelism each rank's time in its communicator (all-reduces and the logits gather,
waiting for the other rank included: :class:`workers.tensor_parallel.TensorParallel`) over the
decode steps and the prefill is reported, per call and as the share of the step. The roofline of
a decode step (the weight bytes it reads, all ranks together, over the read bandwidth measured in
the same run) is put beside it.

On a cluster of two nodes (``ray start --head --num-cpus 1`` and ``ray start --address ...
--num-cpus 1``) ``--ray-address ADDR --placement strict-spread`` puts the ranks of ``tp2`` (and
the stages of ``pp2``) on different nodes; ``tp1`` then still runs in this process.

Usage::

    python -m bench.tensor_parallel [--model qwen2.5-coder-1.5b-instruct] [--configs tp1 tp2 pp2]
        [--context 1500] [--decode 48] [--out docs/tensor_parallel.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench import command
from bench.markdown import add_output_args, md_table

CONFIGS = ("tp1", "tp2", "pp2")


def _engine(name: str, cfg, model_dir: str, threads: int, ray_address: str, placement: str):
    from kvmesh.core.service_config import SchedulerConfig
    from scheduler.engine import LLMEngine
    from workers.executor import create_executor
    if name == "tp1":
        return LLMEngine(cfg.replace(num_threads=threads))
    tp, pp = (2, 1) if name == "tp2" else (1, 2)
    sc = SchedulerConfig(pp=pp, tensor_parallel_size=tp, stage_num_cpus=1, executor="ray", ray_address=ray_address,
                         stage_placement=placement)
    return LLMEngine(cfg.replace(num_threads=1), executor_factory=lambda c, d: create_executor(c, d, sc))


def _comm(engine) -> tuple[int, int]:
    """(comm ns, calls) summed over the engine's tensor-parallel ranks (0, 0 without)."""
    stages = getattr(engine.executor, "stages", None)
    if not stages or getattr(engine.executor, "tp", 1) == 1:
        return 0, 0
    import ray
    stats = ray.get([s.tp_stats.remote() for s in stages])
    return sum(s["comm_ns"] for s in stats), sum(s["comm_calls"] for s in stats)


def _roofline(engine, context: int, bandwidth: float, step_ms: float) -> dict:
    """Bytes a decode step reads (every rank's or stage's weights, and the K/V of ``context``
    tokens) over ``bandwidth`` (bytes/s), and the share of it the measured step reaches."""
    ex = engine.executor
    if getattr(ex, "stages", None):
        import ray
        weights = sum(i["weight_bytes"] for i in ray.get([s.info.remote() for s in ex.stages]))
    else:
        weights = ex.runner.weight_bytes
    m = engine.model_config
    kv = ex.kv_cache_bytes * context // (ex.num_blocks * engine.cfg.block_size)      # the pool's bytes per token
    limit_ms = (weights + kv) / bandwidth * 1e3
    return {"weight_bytes": weights, "kv_bytes": kv, "roofline_step_ms": round(limit_ms, 2),
            "share_of_roofline": round(limit_ms / step_ms, 3), "layers": m.num_layers}


def measure(engine, prompt: list[int], decode: int) -> dict:
    """Cold TTFT of ``prompt`` and the median decode step of ``decode`` greedy tokens after it."""
    from kvmesh.core.sampling import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("warm", prompt[:64], sp)                  # first-step costs: rows, Ray leases
    while engine.has_unfinished_requests():
        engine.step()
    ranks = max(1, getattr(engine.executor, "tp", 1))
    c0 = _comm(engine)
    t0 = time.perf_counter()
    req = engine.add_request("cold", prompt, SamplingParams(temperature=0.0, max_tokens=decode + 1, ignore_eos=True))
    while req.num_output_tokens == 0:
        engine.step()
    ttft = time.perf_counter() - t0
    c1 = _comm(engine)
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    c2 = _comm(engine)
    step = statistics.median(steps[2:]) if len(steps) > 4 else statistics.median(steps)
    n = len(steps)
    row = {"ttft_s": round(ttft, 3), "decode_step_ms": round(step * 1e3, 2), "decode_tok_s": round(1 / step, 2),
           "decode_steps": n}
    if c2[1]:
        comm_step = (c2[0] - c1[0]) / ranks / n / 1e6            # per rank, per decode step
        calls = (c2[1] - c1[1]) / ranks / n
        row.update(comm_ms_per_step=round(comm_step, 3), comm_calls_per_step=round(calls, 1),
                   comm_us_per_call=round(1e3 * comm_step / calls, 1),
                   comm_share_of_step=round(comm_step / (step * 1e3), 3),
                   prefill_comm_share=round((c1[0] - c0[0]) / ranks / 1e9 / ttft, 3))
    return row


def main(argv=None) -> int:
    ap = command.parser(__doc__)
    ap.set_defaults(model="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--context", type=int, default=1500, help="prompt tokens of the cold TTFT")
    ap.add_argument("--decode", type=int, default=48, help="decode steps measured after it")
    ap.add_argument("--threads", type=int, default=0, help="torch threads of tp1 (0: this machine's cores)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weight-format", default="auto")
    ap.add_argument("--ray-address", default="", help="a Ray cluster (empty: a local instance)")
    ap.add_argument("--placement", default="pack", choices=("pack", "spread", "strict-spread"))
    add_output_args(ap, table=False)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from bench.machine import cpu_model, read_bandwidth
    from bench.profile import policy_prompts
    from gateway.text import load_tokenizer
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.hub.pull import resolve_model
    from workers.executor import ensure_ray

    model_dir = str(resolve_model(args.model))
    threads = args.threads or len(os.sched_getaffinity(0))
    cfg = EngineConfig(model=model_dir, dtype=args.dtype, weight_format=args.weight_format, max_model_len=4096,
                       kv_cache_memory=512 * 2**20, enable_prefix_caching=False)
    prompt = policy_prompts(load_tokenizer(model_dir), 1, args.context, shared=True)[0]
    if any(c != "tp1" for c in args.configs):
        ensure_ray(args.ray_address, num_cpus=None if args.ray_address else max(2, threads))
    import torch
    torch.set_num_threads(threads)
    bandwidth = read_bandwidth()
    rows = {}
    for name in args.configs:
        t = time.perf_counter()
        engine = _engine(name, cfg, model_dir, threads, args.ray_address, args.placement)
        up = time.perf_counter() - t
        try:
            row = measure(engine, prompt, args.decode)
            row.update(_roofline(engine, args.context + args.decode // 2, bandwidth, row["decode_step_ms"]))
        finally:
            engine.shutdown()
        row["startup_s"] = round(up, 1)
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    base = rows.get("tp1")
    if base:
        for row in rows.values():
            row["decode_vs_tp1"] = round(row["decode_tok_s"] / base["decode_tok_s"], 3)
            row["ttft_vs_tp1"] = round(row["ttft_s"] / base["ttft_s"], 3)
    result = {"cpu": cpu_model(), "model": args.model, "dtype": args.dtype, "context": args.context,
              "ray_address": args.ray_address, "placement": args.placement, "threads_tp1": threads,
              "read_bandwidth_gb_s": round(bandwidth / 1e9, 1), "configs": rows}
    print(md_table(["config", "cold TTFT s", "decode tok/s", "vs tp1 (decode)", "vs tp1 (TTFT)", "comm share"],
                   [[k, r["ttft_s"], r["decode_tok_s"], r.get("decode_vs_tp1", ""), r.get("ttft_vs_tp1", ""),
                     r.get("comm_share_of_step", "")] for k, r in rows.items()]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
