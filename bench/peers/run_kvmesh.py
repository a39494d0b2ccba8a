"""kvmesh's own row for the peers comparison: the offline :class:`kvmesh.LLM` engine on the same
prompts file, with the same output format as the peer runners (runner_common.py). Runs in
kvmesh's venv::

    .venv/bin/python bench/peers/run_kvmesh.py --model smollm2-135m-instruct --prompts FILE \
        [--batch-sizes 1,8] [--decode-tokens 128] [--dtype bfloat16] [--policy continuous] \
        [--weight-format auto] [--quant-group-size 128] [--threads 2] [--out FILE]

For each batch size B a fresh engine with ``max_num_seqs=B`` (continuous batching, prefix
caching on: kvmesh's default configuration) serves every request, all arriving at t=0; the
single-request run uses a fresh engine too (cold prefix cache), stepping the engine until the
first token (TTFT) and then to the end (decode tok/s after the first token).
"""

from __future__ import annotations

import sys
import time

import runner_common as rc

# This script's directory (sys.path[0], for runner_common) holds bench/peers/gguf.py, which would
# shadow the `gguf` package the gguf weight format reads files with.
sys.path.remove(sys.path[0])

startup_s = 0.0      # of the last engine() call


def main(argv=None) -> int:
    ap = rc.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="known model name or checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"],
                    help="activation dtype; auto: kvmesh's default for this CPU (EngineConfig.torch_dtype)")
    ap.add_argument("--policy", default="continuous", choices=["continuous", "static"])
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--weight-format", default="auto", help="auto (kvmesh's default: a known model's GGUF blocks), "
                    "none (the dense conversion), gguf, int8, int4, fp8, w8a8-int8")
    ap.add_argument("--quant-group-size", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="3GiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args(argv)

    import torch
    torch.set_num_threads(args.threads)
    from kvmesh import LLM, SamplingParams

    rows = rc.load_prompts(args.prompts)
    longest = max(len(r["prompt_token_ids"]) + int(r["max_tokens"]) for r in rows)
    settings = {"model": args.model, "dtype": args.dtype, "policy": args.policy,
                "enable_prefix_caching": not args.no_prefix_caching, "weight_format": args.weight_format,
                "quant_group_size": args.quant_group_size, "kv_cache_memory": args.kv_cache_memory,
                "max_num_batched_tokens": args.max_num_batched_tokens, "threads": args.threads}

    def engine(max_num_seqs: int) -> LLM:
        global startup_s
        t0 = time.perf_counter()
        llm = LLM(args.model, policy=args.policy, enable_prefix_caching=not args.no_prefix_caching,
                  dtype=args.dtype, weight_format=args.weight_format, quant_group_size=args.quant_group_size,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory=args.kv_cache_memory, max_model_len=max(longest, args.decode_tokens + 2048))
        # warm-up (first-call allocations), not timed; then forget its blocks
        llm.generate([rows[0]["prompt_token_ids"][:64]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        llm.engine.block_manager.reset_prefix_cache()
        startup_s = time.perf_counter() - t0
        return llm

    throughput = []
    for b in rc.batch_sizes(args.batch_sizes):
        rss = rc.PeakRss()
        llm = engine(b)
        params = [SamplingParams(temperature=0, max_tokens=int(r["max_tokens"]), ignore_eos=True) for r in rows]
        hits0 = llm.engine.block_manager.hits
        t0 = time.perf_counter()
        outs = llm.generate([r["prompt_token_ids"] for r in rows], params)
        wall = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out == sum(p.max_tokens for p in params), "every request must generate exactly max_tokens"
        throughput.append(rc.throughput_row(b, rows, wall, n_out, policy=args.policy,
                                            prefix_hit_tokens=llm.engine.block_manager.hits - hits0,
                                            startup_s=startup_s, peak_rss_bytes=rss.stop()))
        print(f"kvmesh: batch {b}: {throughput[-1]['output_tok_s']:.1f} output tok/s", file=sys.stderr, flush=True)
        del llm

    rss = rc.PeakRss()
    llm = engine(1)
    from kvmesh.core.sampling import SamplingParams as EngineParams
    eng, n1 = llm.engine, args.decode_tokens
    t0 = time.perf_counter()
    eng.add_request("single", rows[0]["prompt_token_ids"], EngineParams(temperature=0, max_tokens=n1, ignore_eos=True))
    while eng.scheduler.requests["single"].num_output_tokens == 0:
        eng.step()
    t1 = time.perf_counter()
    ids = list(eng.scheduler.requests["single"].output_token_ids)
    while eng.has_unfinished_requests():
        for o in eng.step():
            ids += o.new_token_ids if o.request_id == "single" else []
    t2 = time.perf_counter()
    single = {"prompt_tokens": len(rows[0]["prompt_token_ids"]), "ttft_s": t1 - t0, "decode_tokens": n1,
              "decode_tok_s": (n1 - 1) / (t2 - t1), "token_ids": ids,
              "startup_s": startup_s, "peak_rss_bytes": rss.stop()}

    import kvmesh
    env = rc.environment("torch", "transformers")
    env["packages"]["kvmesh"] = getattr(kvmesh, "__version__", None)
    rc.emit({"peer": "kvmesh", "env": env, "settings": settings, "throughput": throughput, "single": single}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
