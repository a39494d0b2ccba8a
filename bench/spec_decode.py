"""Speculative-decoding benchmark: no speculation vs prompt lookup (``ngram``) vs a draft model
(``draft``) vs both (``ngram+draft``: lookup where it matches, the draft elsewhere), greedy, on
the same engine and the same requests, in one run.

Workloads (every request greedy, stops at EOS or ``--max-tokens``):

- ``policydesk``: PolicyDesk questions in the prompt layout of :mod:`policydesk` (system
  message = system prompt + one policy text, then the question, through the chat template);
  answers quote the policy, so proposals are often right. Run closed-loop at each
  ``--concurrency`` (1: one request at a time; 8: eight in flight, the next one added as soon as
  one finishes).
  With ``--warm`` each prompt is run once, untimed, before its workload: the timed requests
  find their prompts in the prefix cache (the target's and the draft's K/V), as PolicyDesk's
  users find the policies others asked about.
- ``poor-guess``: continue a salad of random words (seeded) at concurrency 1: the
  continuation is unpredictable, so most proposals are rejected; shows the wasted work.

Every configuration runs in its own subprocess (model loading is not timed; one warm-up request
first); configurations alternate (none, ngram, draft, ngram+draft, none, ...) for ``--reps`` rounds and the
table shows medians over the rounds. Per workload, concurrency and configuration:

- E2EL p50: request latency, arrival → last token (s); TPOT p50: (E2EL - TTFT) / (tokens - 1)
- decode tok/s: median over requests of 1 / TPOT (a request's own output rate)
- output tok/s: all output tokens / wall time of the workload; speedup = that / ``none``'s
- acceptance rate: accepted / verified proposals; mean accepted length: tokens emitted per
  speculative step (1 + accepted / steps); rejected/token: verified-but-rejected proposals per
  output token (the wasted verification work); propose s: time spent proposing.

Two setups: the default drafts Qwen2.5-Coder-1.5B-Instruct with Qwen2.5-Coder-0.5B-Instruct;
``--quick`` uses SmolLM2-135M-Instruct drafting for itself: with all its layers (the default)
every greedy proposal is accepted, which checks the machinery and shows the cost of a draft as
large as the target; ``--draft-num-layers N`` keeps its first N layers (a cheaper, worse draft).
``--draft-vocab-size N [M ...]`` runs each draft configuration with the draft's lm_head cut to
the first N token ids (``draft_vocab_size``; 0: the whole vocabulary) and ``--draft-quantization
Q [...]`` with its GGUF blocks requantized (``draft_quantization``: ``q4_1``, or ``as-published``);
given several values, each draft configuration runs once per combination, labelled e.g.
``draft@32768/q4_1``.
Usage::

    python -m bench.spec_decode [--quick] [--questions 16] [--max-tokens 128] [--reps 3] [--warm] [--out docs/spec_decode.json]
    python -m bench.spec_decode --table docs/spec_decode.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import policydesk
from bench import command
from bench.engine_offline import percentile, policydesk_conversations
from bench.markdown import add_output_args

CONFIGS = ("none", "ngram", "draft", "ngram+draft")
SETUPS = {   # name: (target, draft, draft layers)
    "qwen": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", 0),
    "quick": ("smollm2-135m-instruct", "smollm2-135m-instruct", 0),
}


def poor_guess_prompts(n: int, words: int = 200, seed: int = 0) -> list[str]:
    """``n`` prompts of ``words`` random words (drawn from the PolicyDesk policies) to continue."""
    text = " ".join(p.read_text(encoding="utf-8") for p in sorted((policydesk.DATA_DIR / "policies").glob("*.md")))
    vocab = sorted(set(re.findall(r"[A-Za-z]{3,}", text)))
    rng = random.Random(seed)
    return ["Continue this text: " + " ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def run_workload(engine, prompts: list[list[int]], max_tokens: int, concurrency: int, tag: str,
                 warm: bool = False) -> dict:
    """Closed loop: keep ``concurrency`` requests in flight until all ``prompts`` finished.
    Returns the workload's measurements (see the module docstring). The prefix cache starts
    empty; with ``warm``, each prompt is first run alone, untimed, for 3 tokens (so that a draft
    model is asked for proposals and writes the prompt's K/V too): the timed requests then find
    their prompts cached, as PolicyDesk's users do on the policies others asked about."""
    from kvmesh.core.sampling import SamplingParams
    engine.block_manager.reset_prefix_cache()
    if warm:
        for i, ids in enumerate(prompts):
            engine.add_request(f"{tag}-warm-{i}", ids, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    pending = list(enumerate(prompts))
    inflight: set[str] = set()
    done = []
    propose0 = getattr(engine, "spec_propose_seconds", 0.0)
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < concurrency:
            i, ids = pending.pop(0)
            rid = f"{tag}-{i}"
            engine.add_request(rid, ids, sp)
            inflight.add(rid)
        for o in engine.step():
            if o.finished and o.request_id in inflight:
                inflight.discard(o.request_id)
                done.append(o)
    wall = time.perf_counter() - t0
    e2el = [o.finished_time - o.arrival_time for o in done]
    tpot = [(o.finished_time - o.first_token_time) / (o.num_output_tokens - 1)
            for o in done if o.num_output_tokens > 1]
    n_out = sum(o.num_output_tokens for o in done)
    drafts = sum(getattr(o, "num_drafts", 0) for o in done)
    verified = sum(getattr(o, "num_draft_tokens", 0) for o in done)
    accepted = sum(getattr(o, "num_accepted_tokens", 0) for o in done)
    return {
        "requests": len(done), "output_tokens": n_out, "wall_s": wall, "output_tok_s": n_out / wall,
        "e2el_p50_s": percentile(e2el, 50), "e2el_p90_s": percentile(e2el, 90),
        "tpot_p50_s": percentile(tpot, 50) if tpot else None,
        "decode_tok_s_p50": statistics.median(1 / t for t in tpot) if tpot else None,
        "num_drafts": drafts, "num_draft_tokens": verified, "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / verified if verified else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "rejected_per_output_token": (verified - accepted) / n_out if n_out else None,
        "propose_s": getattr(engine, "spec_propose_seconds", 0.0) - propose0,
    }


def run_child(args) -> dict:
    """Child process: one configuration over every workload."""
    import torch
    torch.set_num_threads(args.threads)
    from kvmesh import LLM
    from kvmesh.core.sampling import SamplingParams
    target, draft, layers = SETUPS[args.setup]
    spec = {} if args.config == "none" else {"speculative_method": args.config,
                                             "num_speculative_tokens": args.k,
                                             "speculative_adaptive": not args.fixed_k}
    if "draft" in args.config:
        spec.update(draft_model=draft, draft_num_layers=args.draft_num_layers if args.draft_num_layers >= 0 else layers)
        if args.draft_vocab_size[0] >= 0:
            spec.update(draft_vocab_size=args.draft_vocab_size[0])
        if args.draft_quantization[0] != "default":
            spec.update(draft_quantization="" if args.draft_quantization[0] == "as-published" else args.draft_quantization[0])
    llm = LLM(target, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.max_model_len, **spec)
    eng = llm.engine
    questions = [llm.encode_chat(c) for c in policydesk_conversations(args.questions)]
    salad = [llm.encode_prompt(p)[1] for p in poor_guess_prompts(args.poor_requests)]
    eng.add_request("warmup", questions[0][:64], SamplingParams(temperature=0.0, max_tokens=8))
    while eng.has_unfinished_requests():
        eng.step()
    rows = []
    for c in args.concurrency:
        rows.append({"workload": "policydesk", "concurrency": c, "warm": args.warm,
                     **run_workload(eng, questions, args.max_tokens, c, f"pd{c}", warm=args.warm)})
    if args.poor_requests:
        rows.append({"workload": "poor-guess", "concurrency": 1,
                     **run_workload(eng, salad, args.max_tokens, 1, "pg")})
    for r in rows:
        r.update(config=args.label or args.config, target=target, draft=draft if "draft" in args.config else None,
                 kv_cache_bytes=eng.executor.kv_cache_bytes)
    return {"rows": rows}


def summarize(runs: list[dict]) -> list[dict]:
    """Median over rounds of each (workload, concurrency, config); speedup vs ``none``."""
    order = list(dict.fromkeys(r["config"] for r in runs))      # configurations in the order they ran
    keys = sorted({(r["workload"], r["concurrency"], r["config"]) for r in runs},
                  key=lambda k: (k[0], k[1], order.index(k[2])))
    out = []
    for wl, c, cfg in keys:
        rs = [r for r in runs if (r["workload"], r["concurrency"], r["config"]) == (wl, c, cfg)]
        row = {"workload": wl, "concurrency": c, "config": cfg, "rounds": len(rs)}
        for f, v in rs[0].items():
            if isinstance(v, (int, float)) and f not in ("concurrency", "round"):
                vals = [r[f] for r in rs if r.get(f) is not None]
                row[f] = statistics.median(vals) if vals else None
            elif f not in row and f != "round":
                row[f] = v
        out.append(row)
    for row in out:
        base = next((b for b in out if (b["workload"], b["concurrency"], b["config"])
                     == (row["workload"], row["concurrency"], "none")), None)
        row["speedup"] = row["output_tok_s"] / base["output_tok_s"] if base else None
    return out


def table(rows: list[dict]) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)
    lines = ["| workload | conc. | config | E2EL p50 s | TPOT p50 ms | decode tok/s | output tok/s | speedup "
             "| acceptance | mean accepted len | rejected/token | propose s |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['config']} | {f(r['e2el_p50_s'], '.2f')} "
                     f"| {f(r['tpot_p50_s'] and r['tpot_p50_s'] * 1e3, '.1f')} | {f(r['decode_tok_s_p50'], '.1f')} "
                     f"| {f(r['output_tok_s'], '.1f')} | {f(r['speedup'], '.2f')} | {f(r['acceptance_rate'], '.2f')} "
                     f"| {f(r['mean_accepted_length'], '.2f')} | {f(r['rejected_per_output_token'], '.2f')} "
                     f"| {f(r['propose_s'], '.2f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="SmolLM2-135M drafting for itself")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--questions", type=int, default=16, help="PolicyDesk requests per concurrency level")
    ap.add_argument("--poor-requests", type=int, default=4, help="poor-guess requests (0: skip the workload)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3, help="rounds; configurations alternate within a round")
    ap.add_argument("--warm", action="store_true",
                    help="run each PolicyDesk prompt once, untimed, before its workload (prompt prefixes warm)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--fixed-k", action="store_true", help="no adaptive k (--fixed-speculative-tokens)")
    ap.add_argument("--draft-num-layers", type=int, default=-1, help="draft layers kept (-1: the setup's default)")
    ap.add_argument("--draft-vocab-size", type=int, nargs="+", default=[-1],
                    help="the draft proposes only the first N token ids (draft_vocab_size; 0: all; -1: the "
                         "engine's default); several sizes run each draft configuration once per size")
    ap.add_argument("--draft-quantization", nargs="+", default=["default"],
                    choices=["default", "as-published", "q4_1"],
                    help="the draft's GGUF blocks requantized (draft_quantization; default: the engine's); several "
                         "values run each draft configuration once per value")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    add_output_args(ap, table=False)
    ap.add_argument("--table", metavar="JSON", help="print the table of a saved run and exit")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    ap.add_argument("--label", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return command.answer(run_child(args))
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["summary"]))
        return 0
    setup = "quick" if args.quick else "qwen"
    runs: list[dict] = []
    sizes, quants = args.draft_vocab_size, args.draft_quantization

    def label(cfg: str, vocab: int, quant: str) -> str:
        if "draft" not in cfg:
            return cfg
        parts = ([str(vocab)] if len(sizes) > 1 else []) + ([quant] if len(quants) > 1 else [])
        return f"{cfg}@{'/'.join(parts)}" if parts else cfg

    variants = [(cfg, v, q, label(cfg, v, q)) for cfg in args.configs
                for v in (sizes if "draft" in cfg else [-1]) for q in (quants if "draft" in cfg else ["default"])]
    for rnd in range(args.reps):
        for cfg, vocab, quant, name in variants:
            cmd = [sys.executable, "-m", "bench.spec_decode", "--child", "--config", cfg, "--setup", setup,
                   "--label", name, "--draft-vocab-size", str(vocab), "--draft-quantization", quant,
                   "--questions", str(args.questions), "--poor-requests", str(args.poor_requests),
                   "--max-tokens", str(args.max_tokens), "--concurrency", *map(str, args.concurrency),
                   "--k", str(args.k), "--draft-num-layers", str(args.draft_num_layers), "--dtype", args.dtype,
                   "--device", args.device, "--kv-cache-memory", args.kv_cache_memory,
                   "--max-model-len", str(args.max_model_len), "--threads", str(args.threads)]
            cmd += ["--fixed-k"] if args.fixed_k else []
            cmd += ["--warm"] if args.warm else []
            print(f"round {rnd + 1}/{args.reps}: {name} ...", file=sys.stderr, flush=True)
            answer = command.run_child(cmd)
            if answer is None:
                return 1
            rows = answer["rows"]
            runs += [dict(r, round=rnd) for r in rows]
            for r in rows:
                print(json.dumps(r), file=sys.stderr, flush=True)
            if args.out:                     # keep partial results if a later run fails
                Path(args.out).write_text(json.dumps({"summary": summarize(runs), "runs": runs}, indent=2))
    summary = summarize(runs)
    print(table(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
