"""Offline engine benchmark: the PolicyDesk workload through naive, static and continuous
batching (prefix caching off, then on), in float32 and bfloat16, in one run.

Every system does the same work: each request is the PolicyDesk prompt layout (system
prompt + one policy text of ~1,300-1,600 tokens + a question, through the chat template) and
generates exactly ``OUTPUT_LENS[i % 6]`` tokens with EOS ignored. Each configuration runs in
its own subprocess (so peak RSS is its own) and reports:

- output tokens/s = all generated tokens / wall time of the whole workload
- TTFT p50/p90 over requests (all requests arrive at t=0, so TTFT includes queueing)
- batch-1 decode tokens/s: one request alone, 128 tokens, after its first token
- peak RSS of the process (bytes)

``naive`` recomputes the whole sequence for every token (O(n^2)); on this CPU the full
workload would take hours, so it runs the first ``--naive-requests`` requests of the same
workload and its rates are rates over those. Usage::

    python -m bench.engine_offline [--model smollm2-135m-instruct] [--requests 48] [--out docs/engine_offline.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import policydesk
from bench import command
from bench.markdown import add_output_args, print_saved_table, write_json

OUTPUT_LENS = (16, 32, 64, 128, 256, 64)

CONFIGS = [
    # name, policy, prefix caching, dtype
    ("naive", "naive", False, "bfloat16"),
    ("static", "static", False, "bfloat16"),
    ("continuous", "continuous", False, "bfloat16"),
    ("continuous+prefix", "continuous", True, "bfloat16"),
    ("naive", "naive", False, "float32"),
    ("static", "static", False, "float32"),
    ("continuous", "continuous", False, "float32"),
    ("continuous+prefix", "continuous", True, "float32"),
]


def policydesk_conversations(n: int) -> list[list[dict]]:
    """``n`` single-turn PolicyDesk chats: policies in rotation, each with its own questions
    (prompt layout of :mod:`policydesk`)."""
    by_policy: dict[str, list[str]] = {}
    for q in policydesk.questions():
        by_policy.setdefault(q["policy"], []).append(q["question"])
    names = sorted(by_policy)
    convs = []
    for i in range(n):
        name = names[i % len(names)]
        qs = by_policy[name]
        convs.append([{"role": "system", "content": policydesk.system_message(name)},
                      {"role": "user", "content": qs[(i // len(names)) % len(qs)]}])
    return convs


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_one(args) -> dict:
    """Child process: run one configuration and return its measurements."""
    import torch
    torch.set_num_threads(args.threads)
    from kvmesh import LLM, SamplingParams
    llm = LLM(args.model, policy=args.policy, enable_prefix_caching=args.prefix, dtype=args.dtype,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory, max_model_len=4096)
    n = args.naive_requests if args.policy == "naive" else args.requests
    convs = policydesk_conversations(n)
    prompts = [llm.encode_chat(c) for c in convs]
    params = [SamplingParams(temperature=0, max_tokens=OUTPUT_LENS[i % len(OUTPUT_LENS)], ignore_eos=True)
              for i in range(n)]
    # warm-up (first-call allocations), not timed
    llm.generate([prompts[0][:64]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.engine.block_manager.reset_prefix_cache()

    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(p.max_tokens for p in params), "every request must generate exactly max_tokens"
    ttfts = [o.metrics.ttft for o in outs]

    # batch-1 decode: one request alone (a prompt of this workload), time per token after the first
    llm.engine.block_manager.reset_prefix_cache()
    n1 = 32 if args.policy == "naive" else 128
    from kvmesh.core.sampling import SamplingParams as SP
    eng = llm.engine
    eng.add_request("b1", prompts[0], SP(temperature=0, max_tokens=n1, ignore_eos=True))
    while eng.scheduler.requests["b1"].num_output_tokens == 0:
        eng.step()
    t1 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    decode_b1 = (n1 - 1) / (time.perf_counter() - t1)
    return {
        "config": args.name, "dtype": args.dtype, "requests": n, "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": n_out, "wall_s": wall, "output_tok_s": n_out / wall,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "decode_b1_tok_s": decode_b1, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "kv_cache_bytes": eng.executor.kv_cache_bytes, "prefix_hit_tokens": eng.block_manager.hits,
        "preemptions": eng.scheduler.num_preemptions,
    }


def table(rows: list[dict]) -> str:
    head = ("| config | dtype | requests | output tok/s | wall s | TTFT p50 s | TTFT p90 s | batch-1 decode tok/s "
            "| peak RSS GiB | x naive | x static |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        base = {k: next((b for b in rows if b["config"] == k and b["dtype"] == r["dtype"]), None) for k in ("naive", "static")}
        ratio = lambda b: f"{r['output_tok_s'] / b['output_tok_s']:.2f}" if b else "-"
        lines.append(f"| {r['config']} | {r['dtype']} | {r['requests']} | {r['output_tok_s']:.1f} | {r['wall_s']:.1f} "
                     f"| {r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | {r['decode_b1_tok_s']:.1f} "
                     f"| {r['peak_rss_bytes'] / 2**30:.2f} | {ratio(base['naive'])} | {ratio(base['static'])} |")
    return "\n".join(lines)


def add_parser(subparsers, help: str) -> argparse.ArgumentParser:
    """``kvmesh bench engine`` (:mod:`bench.command`)."""
    return command.add_parser(subparsers, "engine", help, __doc__.split("\n\n")[0], add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.engine_offline``: the same as ``kvmesh bench engine``."""
    return command.main("python -m bench.engine_offline", __doc__.split("\n\n")[0], add_arguments, run, argv)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=command.DEFAULT_MODEL)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--naive-requests", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=48, help="batch size for static; sequence cap for continuous")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="3GiB")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="config names to run (default: all)")
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    add_output_args(ap)
    # child mode
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--name"); ap.add_argument("--policy"); ap.add_argument("--dtype")
    ap.add_argument("--prefix", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Each configuration in a child process (or, with ``--child``, one of them here); the table."""
    if args.child:
        return command.answer(run_one(args))
    if print_saved_table(args, table):
        return 0
    rows = []
    for name, policy, prefix, dtype in CONFIGS:
        if (args.only and name not in args.only) or dtype not in args.dtypes:
            continue
        cmd = [sys.executable, "-m", "bench.engine_offline", "--child", "--name", name, "--policy", policy,
               "--dtype", dtype, "--model", args.model, "--requests", str(args.requests),
               "--naive-requests", str(args.naive_requests), "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--kv-cache-memory", args.kv_cache_memory, "--threads", str(args.threads)] + (["--prefix"] if prefix else [])
        print(f"running {name} {dtype} ...", file=sys.stderr, flush=True)
        row = command.run_child(cmd)
        if row is None:
            return 1
        rows.append(row)
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        write_json(args.out, rows)       # keeps partial results if a later configuration fails
    print(table(rows))
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
