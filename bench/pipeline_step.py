"""Per-step cost of the Ray pipeline executor and the size of its step message.

A batch of ``--batch`` requests decoding at ``--context`` tokens (SmolLM2, bfloat16, one torch
thread in this process and in every stage actor), with penalties off and on, runs through three
executors in one process, alternating step by step (paired: the figure is the median of the
per-step differences, which cancels most of the machine's drift): the in-process executor, a
pp=1 and a pp=2 :class:`workers.executor.RayPipelineExecutor`.

- bytes per step: ``pickle.dumps`` of what goes to ``stage.execute.remote`` — the incremental
  :class:`workers.step.StepDelta` of a steady decode step (no block boundary crossed),
  of a step where every request gains a block, and of the first step (every request new) —
  against the full :class:`workers.step.StepInput` it decodes to (what was sent before the
  incremental messages).
- time per step: ``submit`` to ``result`` in this process, and its legs from the stages' own
  clocks (:meth:`workers.stage.PipelineStage.step_times`, epoch ns on one machine): dispatch
  (submit → stage 0 starts), each stage's compute (its input ready → its output ready), the
  stage-to-stage hop (stage k's output ready → stage k+1 has it) and return (the last stage
  is done → the result is here).

The context is not prefilled: the requests' blocks are allocated and hold whatever the cache
holds (zeros); a decode step's cost does not depend on those values, and the set-up takes
seconds instead of a 13k-token prefill per executor on a small CPU.

Usage::

    python -m bench.pipeline_step [--batch 8] [--context 1600] [--steps 40] [--out docs/pipeline_step.json]
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

from bench import command
from bench.markdown import add_output_args


def _requests(n: int, context: int, penalties: bool, vocab: int, bm):
    import random

    from kvmesh.core.sampling import SamplingParams
    from scheduler.request import Request
    rng = random.Random(0)
    kw = dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2) if penalties else {}
    reqs = []
    for i in range(n):
        sp = SamplingParams(temperature=0.7 if penalties else 0.0, seed=i if penalties else None, max_tokens=512,
                            ignore_eos=True, **kw)
        r = Request(f"bench-{'pen' if penalties else 'plain'}-{i}-0123456789abcdef", [rng.randrange(vocab) for _ in range(context)],
                    sp, eos_token_ids=(2,))
        assert bm.allocate(r, context)
        r.num_computed_tokens = context - 1        # the last prompt token is the first decode
        reqs.append(r)
    return reqs


def _step(reqs, bm):
    from scheduler.scheduler import ScheduledSeq, SchedulerOutput
    out = SchedulerOutput()
    for r in reqs:
        assert bm.allocate(r, 1)
        out.seqs.append(ScheduledSeq(r, r.num_computed_tokens, 1, True))
    out.num_batched_tokens = len(reqs)
    return out


def _advance(reqs, sampled):
    for r in reqs:
        r.num_computed_tokens += 1
        r.output_token_ids.append(sampled[r.request_id][-1])


def measure(model: str, batch: int, context: int, steps: int, penalties: bool, executors: dict) -> dict:
    from scheduler.block_manager import BlockManager
    from workers.step import StepDecoder, StepEncoder

    first = next(iter(executors.values()))
    bs = first.block_size
    bm = BlockManager(min(e.num_blocks for e in executors.values()), bs, False, 0)
    reqs = _requests(batch, context, penalties, 49152, bm)
    full_b, delta_b = {}, {}
    enc, dec = StepEncoder(bs), StepDecoder()
    times = {name: [] for name in executors}
    marks = {name: [] for name in executors}  # (submit ns, result ns) of each measured step
    total = steps + 3
    for i in range(total):
        out = _step(reqs, bm)
        kind = "first" if i == 0 else ("new block" if all(r.num_computed_tokens % bs == 0 for r in reqs) else "steady")
        delta = enc.encode(out)
        full = dec.apply(delta)
        full_b.setdefault(kind, len(pickle.dumps(full)))
        delta_b.setdefault(kind, len(pickle.dumps(delta)))
        sampled = None
        order = list(executors.items())
        order = order[i % len(order):] + order[: i % len(order)]    # rotate who goes first
        for name, ex in order:
            t0, n0 = time.perf_counter(), time.time_ns()
            res = ex.submit(out).result()
            dt = time.perf_counter() - t0
            if i >= 3:                       # warm-up: the first steps build rows, caches, Ray leases
                times[name].append(dt)
                marks[name].append((n0, time.time_ns()))
            sampled = sampled or res.sampled
        dec.record(sampled)
        _advance(reqs, sampled)
    for ex in executors.values():
        ex.free_requests([r.request_id for r in reqs])
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)
    row = {"penalties": penalties, "batch": batch, "context": context, "steps": steps,
           "full_step_input_bytes": full_b, "step_delta_bytes": delta_b,
           "step_ms_p50": {k: ms(v) for k, v in times.items()}}
    base = times.get("in-process")
    if base:
        row["paired_overhead_ms"] = {k: ms([a - b for a, b in zip(v, base)]) for k, v in times.items() if k != "in-process"}
    if "ray pp=1" in times and "ray pp=2" in times:
        row["paired_pp2_minus_pp1_ms"] = ms([a - b for a, b in zip(times["ray pp=2"], times["ray pp=1"])])
    import ray
    for name, ex in executors.items():      # the legs of a step, from the stages' own clocks
        if not name.startswith("ray") or not hasattr(ex.stages[0], "step_times"):
            continue
        clocks = [ray.get(s.step_times.remote())[-steps:] for s in ex.stages]
        legs = []
        for i, (m0, m1) in enumerate(marks[name]):
            st = [c[i] for c in clocks]      # per stage: (start, input ready, output ready, end)
            leg = {"dispatch": st[0][0] - m0, "return": m1 - st[-1][3]}
            for k, c in enumerate(st):
                leg[f"stage{k}"] = c[2] - c[1]
            for k in range(1, len(st)):
                leg[f"hop{k - 1}{k}"] = st[k][1] - st[k - 1][2]
            legs.append(leg)
        row[f"{name} legs_ms_p50"] = {k: round(statistics.median(x[k] for x in legs) / 1e6, 3) for k in legs[0]}
    return row


def main(argv=None) -> int:
    ap = command.parser(__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1600)
    ap.add_argument("--steps", type=int, default=40, help="measured steps per penalty setting (after 3 warm-up)")
    ap.add_argument("--dtype", default="bfloat16")
    add_output_args(ap, table=False)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import torch

    from bench.machine import cpu_model
    from kvmesh.core.engine_config import EngineConfig
    from workers.executor import InProcessExecutor, RayPipelineExecutor, ensure_ray
    from kvmesh.hub.pull import resolve_model

    torch.set_num_threads(1)
    model_dir = str(resolve_model(args.model))
    kv = (args.batch * (args.context + 2 * args.steps + 64)) * 24 * 1024 * 1.5     # bf16 SmolLM2: ~23 KiB a token
    cfg = EngineConfig(model=model_dir, dtype=args.dtype, kv_cache_memory=kv, max_model_len=args.context + 1024,
                       max_num_seqs=args.batch, num_threads=1, enable_prefix_caching=False)
    ensure_ray(num_cpus=4)
    executors = {"in-process": InProcessExecutor(cfg, model_dir),
                 "ray pp=1": RayPipelineExecutor(cfg, model_dir, 1),
                 "ray pp=2": RayPipelineExecutor(cfg, model_dir, 2)}
    try:
        rows = [measure(args.model, args.batch, args.context, args.steps, p, executors) for p in (False, True)]
    finally:
        for ex in executors.values():
            ex.shutdown()
    result = {"cpu": cpu_model(), "model": args.model, "dtype": args.dtype, "rows": rows}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
