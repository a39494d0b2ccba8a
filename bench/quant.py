"""Weight formats compared: stored weight bytes, decode speed, TTFT, greedy agreement, fit.

For a model and a list of formats (``none``, ``int8``, ``int4``, ``fp8``, ``w8a8-int8``, each
optionally ``:float32`` / ``:bfloat16`` for the serving dtype), every format runs in its own
subprocess (in-process engine, greedy, EOS ignored; peak RSS is its own) and reports:

- weight bytes: stored weights incl. scales/zeros (``ModelRunner.weight_bytes``), and the
  ratio to the same model's dense bf16 weights (half the fp32 bytes of the dense model);
- decode tok/s at batch 1: one PolicyDesk prompt, ``--max-tokens`` output tokens, time per
  token after the first, median of ``--runs`` runs; ratio to the ``none:float32`` row;
- decode tok/s at concurrency 16: 16 PolicyDesk prompts at once, tokens generated after every
  request has its first token / that time (median of ``--runs``); ratio to ``none:float32``;
- TTFT of a PolicyDesk prompt with an empty prefix cache (prefill of ~1.5k tokens), median;
- greedy agreement: of the batch-1 run's tokens, how many equal the first row's before they
  first differ (the first row is the reference, ``none:float32`` by default);
- peak RSS of the process.

Quantized checkpoints are built (and calibrated) on first use and cached
(docs/quantization.md); the parent builds them before the timed children run, so no child
times quantization.

Fit mode (``--memory-cap BYTES``): for each format, the weights (bytes of the cached quantized
checkpoint, or 4 bytes x parameters for dense float32) plus the KV budget
(``--kv-cache-memory``) plus ``--overhead`` (interpreter, torch, tokenizer, activations) must
be under the cap; a format that does not fit is reported and not started. Formats that fit
are served in a child process whose peak RSS (``VmHWM``: ``ru_maxrss`` would start at the parent's
peak, carried over fork+exec; see :func:`bench.ablation_child.peak_rss`) is then compared with the cap:
the cap is checked, not enforced (``RLIMIT_AS`` counts virtual reservations of torch's
allocator and OpenMP threads, far above what a process touches, so it fails runs that fit).
Quantization itself needs the dense float32 model once (it runs in the parent, before, with no
cap): that is the documented cost of preparing the cache, not of serving.

``--quality``: no timing; teacher-forced NLL, KL to dense float32 and top-1 agreement on
held-out text (PolicyDesk reference answers by default), one prefill of up to 512 tokens.

Usage::

    python -m bench.quant --quality --formats none int8 int4 fp8 w8a8-int8 [--group-size 64] [--no-calibration]
    python -m bench.quant [--model smollm2-135m-instruct] [--formats none:float32 int8 int4] [--max-tokens 64]
    python -m bench.quant --model qwen2.5-coder-1.5b-instruct --memory-cap 3GiB --formats none:float32 int4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import policydesk
from bench import command
from bench.ablation_child import peak_rss
from bench.markdown import add_output_args

DEFAULT_FORMATS = ["none:float32", "none:bfloat16", "int8", "int4", "fp8", "w8a8-int8"]


def parse_format(spec: str, default_dtype: str) -> tuple[str, str]:
    fmt, _, dtype = spec.partition(":")
    return fmt, dtype or default_dtype


def prompts(llm, n: int) -> list[list[int]]:
    """``n`` single-turn PolicyDesk chats (policies in rotation), token ids."""
    qs = policydesk.questions()
    by_policy: dict[str, list[str]] = {}
    for q in qs:
        by_policy.setdefault(q["policy"], []).append(q["question"])
    names = sorted(by_policy)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        out.append(llm.encode_chat([{"role": "system", "content": policydesk.system_message(name)},
                                    {"role": "user", "content": by_policy[name][(i // len(names)) % len(by_policy[name])]}]))
    return out


def _decode_rate(eng, reqs: list[tuple[str, list[int]]], max_tokens: int) -> tuple[float, list[int]]:
    """Add ``reqs``; once all have their first token, time the rest. Returns (tok/s, tokens of
    the first request)."""
    from kvmesh.core.sampling import SamplingParams
    for rid, ids in reqs:
        eng.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    handles = [eng.scheduler.requests[rid] for rid, _ in reqs]
    while any(r.num_output_tokens == 0 for r in handles):
        eng.step()
    done = sum(r.num_output_tokens for r in handles)
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    dt = time.perf_counter() - t
    return (len(reqs) * max_tokens - done) / dt, list(handles[0].output_token_ids)


def run_one(args) -> dict:
    """Child process: one format; returns its measurements."""
    import torch
    torch.set_num_threads(args.threads)
    from kvmesh import LLM
    from kvmesh.core.sampling import SamplingParams
    llm = LLM(args.model, dtype=args.dtype, weight_format=args.format, quant_group_size=args.group_size,
              enable_calibration=not args.no_calibration, kv_cache_memory=args.kv_cache_memory, max_model_len=4096,
              max_num_seqs=max(16, args.concurrency))
    eng = llm.engine
    ps = prompts(llm, max(args.concurrency, 1))
    llm.generate([ps[0][:32]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))   # warm-up
    b1, c16, ttft, tokens = [], [], [], []
    for run in range(args.runs):
        eng.block_manager.reset_prefix_cache()
        t = time.perf_counter()
        eng.add_request(f"t{run}", ps[0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        ttft.append(time.perf_counter() - t)
        rate, toks = _decode_rate(eng, [(f"b{run}", ps[0])], args.max_tokens)
        b1.append(rate)
        tokens = toks
        if args.concurrency > 1:
            rate, _ = _decode_rate(eng, [(f"c{run}-{i}", p) for i, p in enumerate(ps[: args.concurrency])],
                                   args.max_tokens)
            c16.append(rate)
    return {"format": args.format, "dtype": args.dtype, "weight_bytes": eng.executor.runner.weight_bytes,
            "decode_b1_tok_s": statistics.median(b1), "decode_c_tok_s": statistics.median(c16) if c16 else None,
            "concurrency": args.concurrency, "ttft_s": statistics.median(ttft), "tokens": tokens,
            "peak_rss_bytes": peak_rss(os.getpid()) or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "kv_cache_bytes": eng.executor.kv_cache_bytes}


def quality_text_ids(model_dir, path: str = "", max_tokens: int = 512) -> list[int]:
    """Held-out text for the quality mode: ``path``, or the PolicyDesk reference answers (same
    domain as the default calibration text, the policies, but not part of it)."""
    from pathlib import Path
    from transformers import AutoTokenizer
    text = Path(path).read_text(encoding="utf-8") if path else "\n\n".join(
        q["reference_answer"] for q in policydesk.questions())
    return AutoTokenizer.from_pretrained(str(model_dir)).encode(text)[:max_tokens]


def quality(args, specs: list[tuple[str, str]]) -> str:
    """Teacher-forced quality on held-out text, whole sequence in one prefill: NLL
    (nats/token) and perplexity of the next token, mean KL(dense float32 ‖ format) of the
    next-token distributions, and top-1 agreement with dense float32. Float32 serving."""
    import torch
    torch.set_num_threads(args.threads)
    from workers.kv_cache import allocate_kv_cache
    from workers.layers.attention import AttentionMetadata, PrefillChunk
    from workers.loader import load_model
    from kvmesh.hub.pull import resolve_model
    model_dir = resolve_model(args.model)
    ids = quality_text_ids(model_dir, args.quality_text)
    n, nb = len(ids), -(-len(ids) // 16)

    @torch.inference_mode()
    def logprobs(fmt: str) -> torch.Tensor:
        m = load_model(model_dir, dtype=torch.float32, device="cpu", max_positions=max(n, 64), weight_format=fmt,
                       group_size=args.group_size, calibration=not args.no_calibration)
        c = m.cfg
        kv = allocate_kv_cache(c.num_layers, nb, 16, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
        md = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n, 0, slice(0, nb))])
        return m.compute_logits(m(torch.tensor(ids), torch.arange(n), md, kv))[:-1].log_softmax(-1)

    target = torch.tensor(ids[1:])[:, None]
    base = logprobs("none")
    lines = [f"{n} tokens of held-out text; group size {args.group_size}; calibration "
             f"{'off' if args.no_calibration else 'on'}",
             "| format | NLL nats/token | perplexity | mean KL(dense ‖ format) | top-1 = dense |", "|---|---|---|---|---|"]
    for fmt in dict.fromkeys(f for f, _ in specs):
        lp = base if fmt == "none" else logprobs(fmt)
        nll = -lp.gather(1, target).mean().item()
        kl = (base.exp() * (base - lp)).sum(-1).mean().item()
        top1 = (lp.argmax(-1) == base.argmax(-1)).float().mean().item()
        lines.append(f"| {fmt} | {nll:.4f} | {math.exp(nll):.2f} | {kl:.4f} | {top1:.1%} |")
    return "\n".join(lines)


def _child(args, fmt: str, dtype: str) -> dict | None:
    cmd = [sys.executable, "-m", "bench.quant", "--child", "--format", fmt, "--dtype", dtype, "--model", args.model,
           "--max-tokens", str(args.max_tokens), "--runs", str(args.runs), "--concurrency", str(args.concurrency),
           "--group-size", str(args.group_size), "--kv-cache-memory", args.kv_cache_memory,
           "--threads", str(args.threads)] + (["--no-calibration"] if args.no_calibration else [])
    print(f"running {fmt}:{dtype} ...", file=sys.stderr, flush=True)
    return command.run_child(cmd)


def _agreement(tokens: list[int], ref: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))


def table(rows: list[dict], dense_fp32_bytes: int | None) -> str:
    """Markdown table. ``dense_fp32_bytes``: the checkpoint's parameters x 4, used for "x bf16"
    unless a ``none`` row gives the dense model's real stored bytes (a tied lm_head is a copy)."""
    base = next((r for r in rows if r["format"] == "none" and r["dtype"] == "float32"), None)
    if base:
        dense_fp32_bytes = base["weight_bytes"]
    ref = rows[0]
    head = ("| format | dtype | weight bytes | x bf16 | decode b1 tok/s | x fp32 | decode c{c} tok/s | x fp32 "
            "| TTFT s | greedy = ref | peak RSS GiB |").format(c=rows[0]["concurrency"])
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        ratio = lambda k: f"{r[k] / base[k]:.2f}" if base and r.get(k) and base.get(k) else "-"
        xbf16 = f"{r['weight_bytes'] / (dense_fp32_bytes / 2):.2f}" if dense_fp32_bytes else "-"
        c = f"{r['decode_c_tok_s']:.1f}" if r.get("decode_c_tok_s") else "-"
        lines.append(f"| {r['format']} | {r['dtype']} | {r['weight_bytes']:,} | {xbf16} | {r['decode_b1_tok_s']:.1f} "
                     f"| {ratio('decode_b1_tok_s')} | {c} | {ratio('decode_c_tok_s')} | {r['ttft_s']:.2f} "
                     f"| {_agreement(r['tokens'], ref['tokens'])}/{len(ref['tokens'])} "
                     f"| {r['peak_rss_bytes'] / 2**30:.2f} |")
    return "\n".join(lines)


def _prepare(args, fmt: str) -> int:
    """Build the quantized checkpoint (parent, uncapped) and return its weight bytes on disk
    (dense: 4 bytes x parameters of the checkpoint, plus a tied lm_head's copy)."""
    from kvmesh.hub.pull import resolve_model
    model_dir = resolve_model(args.model)
    if fmt == "none":
        from safetensors import safe_open
        from kvmesh.hub.pull import ensure_dense
        from workers.checkpoint import load_config, safetensors_files
        ensure_dense(model_dir)
        n = 0
        for f in safetensors_files(model_dir):
            with safe_open(str(f), framework="pt") as sf:
                n += sum(_numel(sf.get_slice(k).get_shape()) for k in sf.keys())
        cfg = load_config(model_dir)
        if cfg.tie_word_embeddings:      # the lm_head is a copy of the embeddings in memory
            n += cfg.vocab_size * cfg.hidden_size
        return 4 * n
    from workers.quant.store import ensure_quantized
    q = ensure_quantized(model_dir, fmt, args.group_size, not args.no_calibration, "")
    return (q / "model.safetensors").stat().st_size


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv=None) -> int:
    ap = command.parser(__doc__)
    ap.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS, help="format[:dtype] ...")
    ap.add_argument("--dtype", default="float32", help="serving dtype of formats given without one")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--no-calibration", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory-cap", help="fit mode: bytes (e.g. 3GiB) the serving process may use")
    ap.add_argument("--overhead", default="1GiB", help="fit mode: non-weight, non-KV memory to budget")
    ap.add_argument("--quality", action="store_true",
                    help="print NLL / KL / top-1 agreement vs dense on held-out text instead of timing")
    ap.add_argument("--quality-text", default="", help="held-out text file (default: PolicyDesk reference answers)")
    add_output_args(ap, table=False)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--format", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return command.answer(run_one(args))
    from kvmesh.core.settings import parse_bytes
    specs = [parse_format(s, args.dtype) for s in args.formats]
    if args.quality:
        print(quality(args, specs))
        return 0
    prepared = {fmt: _prepare(args, fmt) for fmt in dict.fromkeys(f for f, _ in specs)}
    dense_fp32 = _prepare(args, "none")
    rows, fit = [], []
    for fmt, dtype in specs:
        if args.memory_cap:
            cap = parse_bytes(args.memory_cap)
            wbytes = prepared[fmt] // (2 if fmt == "none" and dtype == "bfloat16" else 1)
            need = wbytes + parse_bytes(args.kv_cache_memory) + parse_bytes(args.overhead)
            if need > cap:
                fit.append(f"{fmt}:{dtype}: needs ~{need / 2**30:.2f} GiB (weights {wbytes / 2**30:.2f} GiB) "
                           f"> cap {cap / 2**30:.2f} GiB: not started")
                continue
        row = _child(args, fmt, dtype)
        if row is None:
            return 1
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), file=sys.stderr, flush=True)
        if args.memory_cap:
            ok = row["peak_rss_bytes"] <= cap
            fit.append(f"{fmt}:{dtype}: served; peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB "
                       f"{'<=' if ok else '> (OVER)'} cap {cap / 2**30:.2f} GiB")
    if rows:
        print(table(rows, dense_fp32))
    for line in fit:
        print(line)
    if args.out:
        from pathlib import Path
        Path(args.out).write_text(json.dumps({"rows": rows, "fit": fit, "dense_fp32_bytes": dense_fp32}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
