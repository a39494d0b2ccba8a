"""Which model should serve PolicyDesk: every known model in its useful weight formats, judged
on the whole PolicyDesk set (single questions and chat turns, with 95% intervals) and timed on
this machine.

For each configuration (:data:`CONFIGS`: model, weight format), in a fresh child process
(``--child``; so that one model's memory and threads do not colour the next), an in-process
engine (:class:`kvmesh.LLM`, ``--dtype`` bfloat16, ``--threads`` torch threads):

1. **demo turn**: the demo's first turn (``kvmesh demo``: question ``travel-02`` with the
   travel policy as the system message, greedy, at most 160 tokens) on a cold prefix cache,
   after one 2-token warm-up request: its TTFT (cold, a ~1.4k-token prompt) and end-to-end
   seconds (what a demo user waits for the whole first answer, without the mesh's hops);
2. **decode**: the same conversation again (its prefix now cached), 64 tokens with EOS
   ignored: batch-1 decode tokens/s = 63 / (last token time - first token time);
3. **accuracy**: the whole PolicyDesk set (:func:`bench.faithfulness.select_items`, 96
   questions and 116 chat turns, chats answered turn by turn with the configuration's own
   replies, greedy, ``--max-tokens`` 96): key-fact accuracy of single questions, of chat turns
   and overall, each with its 95% Wilson interval.

A quantized configuration is also judged against the same model's first (dense) configuration
with the paired gate (:func:`bench.gate.verdict`, same items).

Usage::

    python -m bench.model_choice --out docs/model_choice_<date>_<cpu>.json   # then name it in bench/results_page.py
    python -m bench.model_choice --configs smollm2-135m-instruct:none --num-questions 6 --num-chats 1  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from bench import command
from bench.markdown import add_output_args, command_line, print_saved_table, run_meta, write_json, write_markdown

MARK_BEGIN, MARK_END = "<!-- bench:model-choice begin -->", "<!-- bench:model-choice end -->"

# (model, weight format): the known models (kvmesh/hub/models.json) in the formats worth serving.
CONFIGS: list[tuple[str, str]] = [
    ("smollm2-135m-instruct", "none"),
    ("qwen2.5-coder-0.5b-instruct", "none"), ("qwen2.5-coder-0.5b-instruct", "int8"),
    ("qwen2.5-coder-0.5b-instruct", "int4"),
    ("qwen2.5-coder-1.5b-instruct", "none"), ("qwen2.5-coder-1.5b-instruct", "int8"),
    ("qwen2.5-coder-1.5b-instruct", "int4"),
]
DEMO_QUESTION, DEMO_MAX_TOKENS, DECODE_TOKENS = "travel-02", 160, 64


def parse_configs(specs: list[str] | None) -> list[tuple[str, str]]:
    """``MODEL:FORMAT`` strings (FORMAT ``none``, ``int8``, ``int4``; ``MODEL`` alone = ``none``),
    or :data:`CONFIGS`. Raises ValueError for a bad format."""
    if not specs:
        return list(CONFIGS)
    out = []
    for s in specs:
        model, _, fmt = s.partition(":")
        fmt = fmt or "none"
        if fmt not in ("none", "int8", "int4") or not model:
            raise ValueError(f"config {s!r}: expected MODEL[:none|int8|int4]")
        out.append((model, fmt))
    return out


# ---- child: one configuration -------------------------------------------------------------------

def run_child(spec: dict) -> dict:
    """Measure one configuration in this process (see the module docstring)."""
    import torch

    import policydesk
    from bench import faithfulness
    from kvmesh import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], weight_format=spec["weight_format"],
              kv_cache_memory=spec["kv_cache_memory"], num_threads=spec["threads"])
    load_s = time.perf_counter() - t0
    llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=2))
    q = next(q for q in policydesk.questions() if q["id"] == DEMO_QUESTION)
    conv = [{"role": "system", "content": policydesk.system_message(q["policy"])},
            {"role": "user", "content": q["question"]}]
    t1 = time.perf_counter()
    demo = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=DEMO_MAX_TOKENS))[0]
    demo_e2e = time.perf_counter() - t1
    dec = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True))[0]
    n = len(dec.outputs[0].token_ids)
    decode_s = dec.metrics.finished_time - dec.metrics.first_token_time
    items = faithfulness.select_items(spec["num_questions"], spec["num_chats"])
    t2 = time.perf_counter()
    answers = asyncio.run(faithfulness.answer_items(items, faithfulness.llm_generate(llm, spec["max_tokens"])))
    scored = faithfulness.score(answers, items)
    return {"load_s": load_s, "prompt_tokens": len(demo.prompt_token_ids), "ttft_s": demo.metrics.ttft,
            "demo_turn_s": demo_e2e, "demo_tokens": len(demo.outputs[0].token_ids),
            "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "accuracy": scored["accuracy"], "eval_s": time.perf_counter() - t2,
            "items": [{k: r[k] for k in ("id", "correct", "text")} for r in scored["items"]]}


# ---- parent: the table --------------------------------------------------------------------------

def run_config(model: str, fmt: str, args) -> dict:
    """One configuration in a fresh child process; ``available`` False with ``error`` when it fails."""
    spec = {"model": model, "weight_format": fmt, "dtype": args.dtype, "threads": args.threads,
            "kv_cache_memory": args.kv_cache_memory, "num_questions": args.num_questions,
            "num_chats": args.num_chats, "max_tokens": args.max_tokens}
    base = {"model": model, "weight_format": fmt}
    print(f"{model} {fmt} ...", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "bench.model_choice", "--child", json.dumps(spec)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return {**base, "available": False, "error": (lines[-1] if lines else "failed")[:240]}
    return {**base, "available": True, **command.child_answer(proc.stdout)}


def add_gates(rows: list[dict]) -> None:
    """``gate`` of each quantized row against its model's first available row (paired, same items)."""
    from bench import gate

    first: dict[str, dict] = {}
    for r in rows:
        if not r["available"]:
            continue
        ref = first.setdefault(r["model"], r)
        if ref is not r and [i["id"] for i in r["items"]] == [i["id"] for i in ref["items"]]:
            r["gate"] = gate.verdict([i["correct"] for i in r["items"]], [i["correct"] for i in ref["items"]])
            r["gate_reference"] = f"{ref['model']} {ref['weight_format']}"


def table(rows: list[dict]) -> str:
    """The markdown table (accuracy in percent with 95% intervals)."""
    from bench.faithfulness import fmt_share

    lines = ["| model | weights | single questions | chat turns | overall | vs dense (lost / gained, p: verdict) "
             "| cold TTFT s (prompt tokens) | demo turn s | decode tok/s (batch 1) |", "|" + "---|" * 9]
    for r in rows:
        fmt = {"none": "bf16", "int8": "int8", "int4": "int4"}[r["weight_format"]]
        if not r["available"]:
            lines.append(f"| {r['model']} | {fmt} | not available: {r['error'].replace('|', '/')} | | | | | | |")
            continue
        a, g = r["accuracy"], r.get("gate")
        vs = f"{g['reference_only']} / {g['test_only']}, {g['p_value']:.2g}: {g['verdict']}" if g else "-"
        dec = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
        lines.append(f"| {r['model']} | {fmt} | {fmt_share(a['questions'])} | {fmt_share(a['chat_turns'])} "
                     f"| {fmt_share(a['overall'])} | {vs} | {r['ttft_s']:.2f} ({r['prompt_tokens']}) "
                     f"| {r['demo_turn_s']:.1f} ({r['demo_tokens']} tokens) | {dec} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.model_choice", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", metavar="MODEL[:FORMAT]", help="configurations (default: every known "
                                                                          "model in its useful formats)")
    p.add_argument("--dtype", default="bfloat16", help="serving dtype (bfloat16)")
    p.add_argument("--threads", type=int, default=2, metavar="N", help="torch threads (2)")
    p.add_argument("--kv-cache-memory", default="2GiB", metavar="BYTES", help="KV pool (2GiB)")
    p.add_argument("--num-questions", type=int, default=96, metavar="N", help="single questions (96 = all)")
    p.add_argument("--num-chats", type=int, default=24, metavar="N", help="chats, every turn scored (24 = all)")
    p.add_argument("--max-tokens", type=int, default=96, metavar="N", help="answer length limit (96)")
    add_output_args(p, markers="model-choice")
    command.add_child_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if command.answered_child(args, run_child) or print_saved_table(args, table):
        return 0
    from bench import faithfulness
    from bench.machine import cpu_model

    try:
        configs = parse_configs(args.configs)
        faithfulness.select_items(args.num_questions, args.num_chats)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    meta = run_meta(command_line("python -m bench.model_choice", argv), cpu=cpu_model(),
                    workload=f"{args.num_questions} questions + every turn of {args.num_chats} chats, greedy, "
                             f"<= {args.max_tokens} tokens; {args.dtype}, {args.threads} threads")
    rows = []
    for model, fmt in configs:
        rows.append(run_config(model, fmt, args))
        add_gates(rows)
        print(table(rows[-1:]), file=sys.stderr, flush=True)
        meta["elapsed_s"] = time.time() - t0
        write_json(args.out, {"meta": meta, "rows": rows})
    print(table(rows))
    if args.markdown:
        write_markdown(args.markdown, MARK_BEGIN, MARK_END, meta, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
