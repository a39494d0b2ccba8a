"""Peer runner: llama.cpp through llama-cpp-python (llamacpp-venv) on the PolicyDesk prompts.

It runs the GGUF file kvmesh's safetensors were converted from (``--gguf``, re-joined by
bench/peers/gguf.py), in that file's own quantization (SmolLM2-135M: Q4_1 blocks, Q8_0 token
embedding): the weights kvmesh serves with ``--weight-format gguf``.
``Llama`` is one sequence at a time, so the throughput pass serves the prompts one after
another (B=1; other batch sizes are skipped); llama-cpp-python keeps the previous prompt's KV and
reuses the longest common prefix, its form of prefix caching. The single-request run starts from
an empty KV cache (``reset()``): TTFT = prefill + first token, decode tok/s after the first
token. Greedy (``temp=0``), EOS ignored (``Llama.generate`` never stops on its own).
Input/output formats: runner_common.py. Usage (from the repo root)::

    ~/.cache/kvmesh/peers/llamacpp-venv/bin/python bench/peers/run_llamacpp.py --gguf FILE --prompts FILE \
        [--batch-sizes 1] [--decode-tokens 128] [--threads 2] [--n-batch 512] [--out FILE]
"""

from __future__ import annotations

import sys
import time

import runner_common as rc


def main(argv=None) -> int:
    ap = rc.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="the model's GGUF file")
    ap.add_argument("--n-batch", type=int, default=512, help="llama.cpp prompt batch (tokens per prefill call)")
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp flash attention")
    args = ap.parse_args(argv)

    import llama_cpp
    from llama_cpp import Llama

    rows = rc.load_prompts(args.prompts)
    longest = max(len(r["prompt_token_ids"]) + int(r["max_tokens"]) for r in rows)
    n_ctx = max(longest, len(rows[0]["prompt_token_ids"]) + args.decode_tokens) + 16
    rss = rc.PeakRss()
    t_start = time.perf_counter()
    llm = Llama(model_path=args.gguf, n_ctx=n_ctx, n_batch=args.n_batch, n_ubatch=args.n_batch,
                n_threads=args.threads, n_threads_batch=args.threads, flash_attn=args.flash_attn,
                seed=0, verbose=False)

    # The runner feeds kvmesh's token ids, so every system prefills the same tokens. llama.cpp's
    # own tokenizer (used by its server) may split the text differently (SmolLM2: it merges "\n\n"
    # into one token where the Hugging Face tokenizer gives two): recorded, not fatal.
    own = [llm.tokenize(r["prompt"].encode(), add_bos=False, special=True) for r in rows if r.get("prompt")]
    agree = [a == r["prompt_token_ids"] for a, r in zip(own, rows)]

    def run(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        """Generate ``n`` tokens greedily after ``ids``; returns the tokens and the time each was ready."""
        out, stamps = [], []
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(tok)
            stamps.append(time.perf_counter())
            if len(out) == n:
                break
        return out, stamps

    run(rows[0]["prompt_token_ids"][:64], 4)            # warm-up, not timed
    llm.reset()
    startup_s = time.perf_counter() - t_start            # start-up to ready: load + warm-up

    throughput = []
    for b in rc.batch_sizes(args.batch_sizes):
        if b != 1:
            print(f"llamacpp: batch {b} skipped (llama-cpp-python's Llama is single-sequence)", file=sys.stderr)
            continue
        llm.reset()
        n_out = 0
        t0 = time.perf_counter()
        for r in rows:
            n_out += len(run(r["prompt_token_ids"], int(r["max_tokens"]))[0])
        throughput.append(rc.throughput_row(1, rows, time.perf_counter() - t0, n_out,
                                            policy="sequential, longest-common-prefix KV reuse"))
        print(f"llamacpp: batch 1: {throughput[-1]['output_tok_s']:.1f} output tok/s", file=sys.stderr, flush=True)

    llm.reset()
    n1 = args.decode_tokens
    t0 = time.perf_counter()
    ids, stamps = run(rows[0]["prompt_token_ids"], n1)
    single = {"prompt_tokens": len(rows[0]["prompt_token_ids"]), "ttft_s": stamps[0] - t0, "decode_tokens": n1,
              "decode_tok_s": (n1 - 1) / (stamps[-1] - stamps[0]), "token_ids": ids,
              "startup_s": startup_s, "peak_rss_bytes": rss.stop()}

    meta = llm.metadata
    env = rc.environment("llama_cpp_python")
    env["system_info"] = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    rc.emit({"peer": "llamacpp", "env": env,
             "settings": {"gguf": args.gguf, "file_type": meta.get("general.file_type"),
                          "quantization": "the GGUF's own (see general.file_type)", "n_ctx": n_ctx,
                          "n_batch": args.n_batch, "threads": args.threads, "flash_attn": args.flash_attn,
                          "tokenizer_agrees_with_kvmesh": all(agree) if agree else None,
                          "own_tokenizer_prompt_tokens": sum(map(len, own)) if own else None},
             "throughput": throughput, "single": single}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
