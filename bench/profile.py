"""Where a model step's time goes: a per-op breakdown of decode steps and of a prefill.

Builds an in-process engine (no mesh), fills it with ``B`` PolicyDesk requests whose
prompts are ~1.6k tokens (row i on the i-th of the 8 policies, cyclically, so rows beyond the 8th share a policy's
prefix blocks with earlier ones; ``--shared-prefix`` puts them all on one policy), runs them until every prompt is
prefilled, then profiles ``--steps`` decode steps with ``torch.profiler`` and prints:

- the wall time of a decode step (median) and its split into the engine's phases
  (``schedule``, ``prepare``, ``forward``, ``sample``, ``update``: ``record_function`` labels);
- the ops with the most self CPU time (count, total ms, ms per step, share);
- the roofline: bytes a decode step must read (weights + the K/V of every distinct block the
  rows attend to: a policy prefix that rows share through the prefix cache counts once) over the read
  bandwidth measured in the same run (``sum`` of a 1 GiB float32 tensor, 2 threads), as
  tokens/s and as the share the measured step reaches.

Then the same for the prefill of one ``--prefill-tokens`` prompt (cold: no prefix cache).

Usage::

    python -m bench.profile [--model smollm2-135m-instruct] [--dtype bfloat16] [--batch 1 8 32]
                            [--context 1600] [--steps 16] [--top 20] [--out profile.json]
    # a speculative step (issue 31): the draft's and the verification's share
    python -m bench.profile --model qwen2.5-coder-1.5b-instruct --batch 1 8 \
        --engine-arg speculative_method=draft --engine-arg draft_model=qwen2.5-coder-0.5b-instruct

Keep its tables in docs/engine.md ("Profile") with the CPU model it prints.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from bench import command
from bench.machine import cpu_model, read_bandwidth
from bench.markdown import add_output_args


def policy_prompts(tokenizer, n: int, context: int, shared: bool) -> list[list[int]]:
    """``n`` PolicyDesk prompts cut or padded (by repeating the policy) to ``context`` tokens."""
    import policydesk
    names = sorted({q["policy"] for q in policydesk.questions()})
    out = []
    for i in range(n):
        policy = names[0 if shared else i % len(names)]
        ids = tokenizer.encode(policydesk.system_message(policy))
        while len(ids) < context:
            ids = ids + ids
        # rows on one policy still differ in their last token (own blocks after the shared ones)
        out.append(ids[: context - 1] + [ids[(i + 7) % len(ids)]])
    return out


def _table(prof, steps: int, top: int) -> list[dict]:
    rows = []
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]:
        rows.append({"op": e.key, "count": e.count, "self_ms": e.self_cpu_time_total / 1e3,
                     "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                     "share": e.self_cpu_time_total / max(total, 1)})
    return rows


# the record_function labels of the engine step (scheduler/engine.py, workers/model_runner.py) and,
# with speculative decoding, of its parts: ``verify`` (rejection, inside ``sample``), ``propose``
# (the draft model, after ``sample``) split into ``draft_catch_up`` (one forward over the tokens
# the target committed, first proposal) and ``draft_decode`` (each further proposal)
PHASES = ("schedule", "prepare", "forward", "sample", "verify", "propose", "draft_catch_up", "draft_decode",
          "update")


def _phases(prof, steps: int) -> dict[str, float]:
    """ms per step of each record_function label of the engine (CPU total, not self)."""
    out = {}
    for e in prof.key_averages():
        if e.key in PHASES:
            out[e.key] = e.cpu_time_total / 1e3 / steps
    return out


def profile_decode(engine, tokenizer, batch: int, context: int, steps: int, top: int, shared: bool) -> dict:
    from kvmesh.core.sampling import SamplingParams
    per_step = 1 + (engine.cfg.num_speculative_tokens if engine.cfg.speculative_method else 0)
    params = SamplingParams(temperature=0.0, max_tokens=(steps + 8) * per_step, ignore_eos=True)
    for i, ids in enumerate(policy_prompts(tokenizer, batch, context, shared)):
        engine.add_request(f"p{batch}-{i}", ids, params)
    reqs = [engine.scheduler.requests[f"p{batch}-{i}"] for i in range(batch)]
    while any(r.num_output_tokens == 0 for r in reqs):      # prefill every prompt
        engine.step()
    for _ in range(2):                                        # warm-up decodes
        engine.step()
    walls = []
    emitted = sum(r.num_output_tokens for r in reqs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
    emitted = sum(r.num_output_tokens for r in reqs) - emitted
    # the same steps without the profiler, for honest wall times
    plain = []
    for _ in range(min(steps, 4)):
        t = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t)
    kv_blocks = len({b for r in reqs for b in r.block_table})   # distinct blocks: a shared prefix counts once
    for r in reqs:
        engine.abort_request(r.request_id)
    engine.step()
    return {"batch": batch, "context": context, "kv_blocks": kv_blocks, "step_ms": statistics.median(plain) * 1e3,
            "tokens_per_step": emitted / steps,         # > batch only with speculation (accepted proposals)
            "step_ms_profiled": statistics.median(walls) * 1e3,
            "phases_ms": _phases(prof, steps), "ops": _table(prof, steps, top)}


def profile_prefill(engine, tokenizer, tokens: int, top: int) -> dict:
    from kvmesh.core.sampling import SamplingParams
    ids = policy_prompts(tokenizer, 1, tokens, True)[0]
    ids = ids[::-1]                      # a prompt no earlier request cached
    engine.add_request("prefill", ids, SamplingParams(temperature=0.0, max_tokens=1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        wall = time.perf_counter() - t
    engine.step()
    return {"tokens": tokens, "ttft_ms": wall * 1e3, "phases_ms": _phases(prof, 1), "ops": _table(prof, 1, top)}


def decode_bytes(engine, kv_blocks: int) -> int:
    """Bytes one decode step must read: every weight once, plus the K/V of every distinct block
    the rows attend to (``kv_blocks``; a prefix that rows share through the prefix cache is
    counted once, as cascade attention reads it)."""
    runner = engine.executor.runner
    from workers.kv_cache import bytes_per_block
    m = runner.model.cfg
    return runner.weight_bytes + kv_blocks * bytes_per_block(m.num_layers, runner.block_size, m.num_kv_heads,
                                                              m.head_dim, runner.kv_dtype)


def _print(res: dict, bw: float) -> None:
    print(f"\n# CPU: {res['cpu']}; read bandwidth {bw / 1e9:.1f} GB/s; model {res['model']} {res['torch_dtype']} "
          f"(dtype {res['dtype']}), weights {res['weight_format']}, kernels {res['kernel_isa']}; torch threads {res['threads']}")
    if res["speculative_method"]:
        print(f"speculation: {res['speculative_method']} {res['draft_model']}, k <= {res['num_speculative_tokens']}")
    for d in res["decode"]:
        need = d["bytes"] / bw
        print(f"\n## decode, batch {d['batch']}, context {d['context']}: step {d['step_ms']:.2f} ms "
              f"({d['batch'] / d['step_ms'] * 1e3:.1f} tok/s); roofline {d['bytes'] / 1e6:.0f} MB/step -> "
              f"{need * 1e3:.2f} ms ({1 / need * d['batch']:.0f} tok/s); measured/roofline {need * 1e3 / d['step_ms']:.0%}")
        print(f"output tokens per step {d['tokens_per_step']:.2f} -> {d['tokens_per_step'] / d['step_ms'] * 1e3:.1f} "
              f"tok/s")
        print("phases (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in d["phases_ms"].items()))
        _ops(d["ops"])
    p = res["prefill"]
    print(f"\n## prefill of {p['tokens']} tokens (cold): {p['ttft_ms']:.0f} ms")
    print("phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in p["phases_ms"].items()))
    _ops(p["ops"])


def _ops(rows: list[dict]) -> None:
    print(f"| op | calls | ms/step | share |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['count']} | {r['ms_per_step']:.3f} | {r['share']:.1%} |")


def main(argv: list[str] | None = None) -> dict:
    ap = command.parser(__doc__, prog="python -m bench.profile")
    ap.add_argument("--dtype", default="bfloat16", help="activation dtype; auto: kvmesh's default here")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=1600)
    ap.add_argument("--prefill-tokens", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--shared-prefix", action="store_true", help="all rows on one policy (cascade attention)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra EngineConfig field, e.g. attention_backend=torch (repeatable)")
    add_output_args(ap, table=False)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvmesh.core.engine_config import EngineConfig
    from scheduler.engine import LLMEngine
    from transformers import AutoTokenizer
    extra = {}
    for kv in args.engine_arg:
        k, _, v = kv.partition("=")
        extra[k] = v
    max_len = max(args.context, args.prefill_tokens) + (args.steps + 8) * 5 + 64    # k <= 4 proposals a step
    cfg = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                       enable_prefix_caching=True, max_num_seqs=max(args.batch),
                       max_num_batched_tokens=4096, max_model_len=max(max_len, 2048),
                       kv_cache_memory=float(2 * 2**30), num_threads=args.threads, **extra)
    engine = LLMEngine(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(engine.model_dir))
    bw = read_bandwidth()
    from workers import kernels
    from workers.loader import resolve_weight_format
    res = {"cpu": cpu_model(), "bandwidth_bytes_per_s": bw, "model": args.model, "dtype": args.dtype,
           "torch_dtype": str(cfg.torch_dtype).removeprefix("torch."), "kernel_isa": kernels.isa(),
           "weight_format": resolve_weight_format(cfg.weight_format, engine.model_dir),
           "threads": torch.get_num_threads(), "speculative_method": cfg.speculative_method,
           "num_speculative_tokens": cfg.num_speculative_tokens if cfg.speculative_method else 0,
           "draft_model": cfg.draft_model if cfg.uses_draft else "", "decode": []}
    for b in args.batch:
        d = profile_decode(engine, tokenizer, b, args.context, args.steps, args.top, args.shared_prefix)
        d["bytes"] = decode_bytes(engine, d["kv_blocks"])
        res["decode"].append(d)
    res["prefill"] = profile_prefill(engine, tokenizer, args.prefill_tokens, args.top)
    _print(res, bw)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    engine.shutdown()
    return res


if __name__ == "__main__":
    main()
