"""Ablation: the same PolicyDesk workload through each serving configuration, one row per
technique, each with the symptom it treats; one table of measured figures and ratios to the
first row.

Rows (:data:`ROWS`, declared as data: name, symptom, EngineConfig and SchedulerConfig
overrides). Rows 1-6 build the serving stack up; each later row adds one setting to row 5
(continuous batching + prefix caching, one replica):

 1. naive loop: no KV cache, every token recomputes the whole sequence, batch 1 (baseline)
 2. + KV cache, batch 1 (continuous policy, max_num_seqs 1)            → ITL
 3. static batching (a batch is admitted when the previous one ended)  → throughput
 4. continuous batching                                                → throughput, TTFT under load
 5. + prefix caching                                                   → TTFT (shared policy prefixes)
 6. + prefix-aware routing over 2 replicas                             → TTFT / throughput at scale
 7. on, as the engine grows: int8 / int4 (AWQ, RTN) weights, int8 / fp8 KV cache, speculative
    decoding (ngram; draft only with ``--draft-model``).
 8. last: the reference runtime (PyTorch attention and ops, ``KVMESH_NATIVE_KERNELS=0``) with
    row 5's settings: the baseline that the native runtime of rows 1-7 is judged against.

A row whose settings EngineConfig refuses, or whose engine fails to start or serve, is shown as
``not available: <error>`` and the table goes on.

Measurement: each row runs in its own fresh child process (``--child``,
:mod:`bench.ablation_child`), which starts a
``kvmesh serve`` subprocess (gateway + scheduler, executor ``local``: every replica in that one
process, no Ray) and sends it the workload through the gateway's gRPC API with the load
generator of :mod:`bench.serve`: ``--num-prompts`` PolicyDesk requests (``load_requests
("policydesk")``, ``--seed``), all at t=0 with at most ``--max-concurrency`` in flight, greedy,
exactly ``--max-tokens`` output tokens (EOS ignored), after one unmeasured warm-up request per
replica. Reported per row:

- output tokens/s, TTFT p50/p90, ITL p50 (client side, :func:`bench.serve.metrics.summarize`)
- peak RSS of the server process (weights, KV pool, activations, gRPC, tokenizer; every
  replica, since executor ``local`` keeps them in that one process): its ``VmHWM``
  (/proc/PID/status) read after the load run and the faithfulness answers, before it stops
  (:func:`bench.ablation_child.peak_rss`; ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` of the row's child is kept as
  ``server_maxrss_rusage_bytes``, and is the fallback without /proc)
- the server's RSS at that moment (``server_end_rss_bytes``: steady state, without the load-time
  peak of reading and converting the checkpoint, which often sets the peak)
- KV pool bytes (blocks of every replica x bytes per block, scales included) and the KV bytes
  in use at the busiest moment (``GetStats`` polled every 50 ms during the load run)
- faithfulness (unless ``--no-faithfulness``): after the load run, the same server answers
  the PolicyDesk set greedily through its gateway (:mod:`bench.faithfulness`; by default all
  96 questions and every turn of all 24 chats, 212 items, each chat with the row's own earlier
  replies): key-fact accuracy with its 95% interval, agreement with the reference's greedy
  answers, and the paired gate (:mod:`bench.gate`: items lost / gained against the reference,
  McNemar's exact p, verdict PASS / FAIL / NO EVIDENCE). The reference is computed once per
  table, in this process, with the unoptimised configuration in the table's dtype: dense
  weights and KV cache, continuous batching with prefix caching, no speculation (row 5's
  settings, the base of every later row; without prefix caching each of the 212 items would
  prefill its ~1.6k-token policy again; the naive loop would give the same answers up to float
  rounding, at ~30x the cost).
  Rows 1-6 change only scheduling, so they should agree with it exactly; the others change
  numerics (the last row, the reference runtime, is the baseline of the native runtime that
  row 5 uses).

Usage::

    kvmesh bench ablation --out docs/ablation.json --markdown docs/benchmarks.md
    kvmesh bench ablation --rows 2 5 --num-prompts 2 --max-tokens 4 --no-faithfulness   # smoke
    kvmesh bench ablation --table docs/ablation.json                                    # print again
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import command
from bench.ablation_child import run_child
from bench.markdown import add_output_args, print_saved_table, run_meta, write_json, write_markdown

MARK_BEGIN, MARK_END = "<!-- bench:ablation begin -->", "<!-- bench:ablation end -->"


@dataclass(frozen=True)
class Row:
    """One configuration of the ablation: ``engine`` and ``scheduler`` are EngineConfig and
    SchedulerConfig overrides on top of the table's settings (model, dtype, KV budget ...).
    ``needs_draft``: only with ``--draft-model`` (it becomes ``draft_model``). ``env``: extra
    environment variables of the row's server (e.g. ``KVMESH_NATIVE_KERNELS=0``)."""

    key: str
    name: str
    symptom: str
    engine: dict = field(default_factory=dict)
    scheduler: dict = field(default_factory=dict)
    needs_draft: bool = False
    env: dict = field(default_factory=dict)


# The ladder starts from dense weights (weight_format none); the weight-format rows change only that.
_DENSE = {"weight_format": "none"}
_CONT = {**_DENSE, "policy": "continuous", "enable_prefix_caching": False}
_PREFIX = {**_DENSE, "policy": "continuous", "enable_prefix_caching": True}

ROWS: list[Row] = [
    Row("naive", "naive loop (recompute everything, batch 1)", "baseline",
        {**_DENSE, "policy": "naive", "max_num_seqs": 1}),
    Row("kv-cache", "+ KV cache, batch 1", "latency (ITL)", {**_CONT, "max_num_seqs": 1}),
    Row("static", "static batching", "throughput", {**_DENSE, "policy": "static", "enable_prefix_caching": False}),
    Row("continuous", "continuous batching", "throughput, TTFT under load", _CONT),
    Row("prefix-caching", "+ prefix caching", "TTFT (shared policy prefixes)", _PREFIX),
    Row("prefix-routing", "+ prefix-aware routing, 2 replicas", "TTFT / throughput at scale", _PREFIX,
        {"replicas": 2, "routing": "prefix"}),
    Row("gguf-weights", "+ the published GGUF's quantized weights", "memory (weights), decode speed",
        {**_PREFIX, "weight_format": "gguf"}),
    Row("int8-weights", "+ int8 weights", "memory (weights), decode speed", {**_PREFIX, "weight_format": "int8"}),
    Row("int4-awq", "+ int4 weights (AWQ)", "memory (weights), decode speed",
        {**_PREFIX, "weight_format": "int4", "enable_calibration": True}),
    Row("int4-rtn", "+ int4 weights (RTN)", "memory (weights), decode speed",
        {**_PREFIX, "weight_format": "int4", "enable_calibration": False}),
    Row("int8-kv", "+ int8 KV cache", "memory (KV), concurrency", {**_PREFIX, "kv_cache_dtype": "int8"}),
    Row("fp8-kv", "+ fp8 KV cache", "memory (KV), concurrency", {**_PREFIX, "kv_cache_dtype": "fp8"}),
    Row("spec-ngram", "+ speculative decoding (ngram)", "latency (ITL)", {**_PREFIX, "speculative_method": "ngram"}),
    Row("spec-draft", "+ speculative decoding (draft model)", "latency (ITL)",
        {**_PREFIX, "speculative_method": "draft"}, needs_draft=True),
    Row("reference-runtime", "reference runtime (PyTorch attention and ops, no native kernels)",
        "baseline of the native runtime (row 5)", {**_PREFIX, "attention_backend": "torch"},
        env={"KVMESH_NATIVE_KERNELS": "0"}),
]

# The reference of the faithfulness columns: row 5's settings (continuous batching + prefix
# caching, the configuration every later row adds one setting to), dense, in the table's dtype.
REFERENCE_ROW = "prefix-caching"


def select_rows(selectors: list[str] | None, draft_model: str) -> list[tuple[int, Row]]:
    """``(1-based index, Row)`` for ``selectors`` (row keys or indices, in the order given;
    commas also separate), or every row (the draft row only with a draft model). Raises
    ValueError for an unknown selector."""
    if not selectors:
        return [(i, r) for i, r in enumerate(ROWS, 1) if draft_model or not r.needs_draft]
    out = []
    for s in (x for sel in selectors for x in sel.split(",") if x):
        if s.isdigit() and 1 <= int(s) <= len(ROWS):
            i = int(s)
        else:
            i = next((k for k, r in enumerate(ROWS, 1) if r.key == s), None)
            if i is None:
                raise ValueError(f"unknown row {s!r}; rows are 1-{len(ROWS)} or {', '.join(r.key for r in ROWS)}")
        out.append((i, ROWS[i - 1]))
    return out


def row_settings(row: Row, args) -> tuple[dict, dict]:
    """The EngineConfig and SchedulerConfig keywords of ``row`` in this table."""
    engine = {"model": args.model, "dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory,
              "max_model_len": args.max_model_len, **row.engine}
    sched = {"executor": "local", "replicas": 1, **row.scheduler}
    engine["num_threads"] = max(1, args.threads // sched["replicas"])
    if row.needs_draft:
        engine["draft_model"] = args.draft_model
        if args.draft_num_layers:
            engine["draft_num_layers"] = args.draft_num_layers
    return engine, sched


def check_settings(engine: dict, sched: dict) -> str | None:
    """None when EngineConfig and SchedulerConfig accept the settings, else the error."""
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.core.errors import EngineError
    from kvmesh.core.service_config import SchedulerConfig

    try:
        EngineConfig(**engine)
        SchedulerConfig(**sched)
    except (EngineError, TypeError) as e:
        return str(e)
    return None



# ---- parent: the table --------------------------------------------------------------------------

def _short_error(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    pick = next((ln for ln in reversed(lines) if "Error" in ln or "error:" in ln), lines[-1] if lines else "failed")
    return pick[:240]


def run_row(index: int, row: Row, args) -> dict:
    """Run one row in a fresh child process; the row's result (``available`` False with
    ``error`` when its settings are refused or its engine fails)."""
    engine, sched = row_settings(row, args)
    base = {"index": index, "key": row.key, "name": row.name, "symptom": row.symptom,
            "engine": row.engine, "scheduler": row.scheduler}
    if row.needs_draft and not args.draft_model:
        return {**base, "available": False, "error": "needs --draft-model"}
    err = check_settings(engine, sched)
    if err:
        return {**base, "available": False, "error": err}
    spec = {"engine": engine, "scheduler": sched, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
            "max_concurrency": args.max_concurrency, "seed": args.seed,
            "faithfulness_questions": 0 if args.no_faithfulness else args.faithfulness_questions,
            "faithfulness_chats": 0 if args.no_faithfulness else args.faithfulness_chats,
            "faithfulness_max_tokens": args.faithfulness_max_tokens, "env": row.env}
    print(f"running row {index} {row.key} ...", file=sys.stderr, flush=True)
    # its own process group, so that a row past --row-timeout goes with its server
    proc = subprocess.Popen([sys.executable, "-m", "bench.ablation", "--child", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {**base, "available": False, "error": f"timed out after {args.row_timeout:g} s (--row-timeout)"}
    if proc.returncode != 0:
        return {**base, "available": False, "error": _short_error(stderr)}
    return {**base, "available": True, **command.child_answer(stdout)}


def add_faithfulness(row: dict, items: list[dict], reference: list[dict] | None) -> None:
    """Score a row's answers against the reference answers and judge them with the paired gate
    (in place: ``faithfulness``)."""
    from bench import faithfulness

    answers = row.pop("answers", None)
    if answers is None or reference is None:
        return
    res = faithfulness.evaluate(answers, items, reference)
    row["faithfulness"] = {k: res[k] for k in ("num_items", "accuracy", "grounding", "agreement", "num_diverging",
                                               "mean_first_divergence", "gate")}
    row["faithfulness"]["reference_accuracy"] = res["reference"]["accuracy"]
    row["faithfulness"]["answers"] = [{k: q[k] for k in ("id", "correct", "reference_correct", "first_divergence",
                                                         "text")} for q in res["items"]]


def add_ratios(rows: list[dict]) -> None:
    """``ratios`` of each available row to the first available row (same key: value / first's)."""
    first = next((r for r in rows if r["available"]), None)
    for r in rows:
        if not r["available"] or first is None:
            continue
        r["ratios"] = {}
        for k in ("output_throughput", "median_ttft_ms", "p90_ttft_ms", "median_itl_ms"):
            a, b = r["load"].get(k), first["load"].get(k)
            r["ratios"][k] = a / b if a is not None and b else None
        r["ratios"]["server_peak_rss_bytes"] = r["server_peak_rss_bytes"] / first["server_peak_rss_bytes"]


def _num(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _x(v) -> str:
    return "" if v is None else f" ({v:.2f}x)"


def table(rows: list[dict]) -> str:
    """The markdown table; ratios (in brackets) are to the first available row."""
    from bench.faithfulness import fmt_share

    lines = ["| # | configuration | output tok/s | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | peak RSS GiB "
             "| end RSS GiB | KV pool / peak used MiB | key-fact acc [95% CI] | agree | lost / gained (p) | gate "
             "| symptom treated |", "|" + "---|" * 14]
    for r in rows:
        if not r["available"]:
            err = r["error"].replace("|", "/")
            lines.append(f"| {r['index']} | {r['name']} | not available: {err} | - | - | - | - | - | - | - | - | - "
                         f"| - | {r['symptom']} |")
            continue
        ld, x = r["load"], r.get("ratios", {})
        f = r.get("faithfulness")
        acc = fmt_share(f["accuracy"]["overall"]) if f else "-"
        agree = f"{100 * f['agreement']:.0f}%" if f else "-"
        paired = f"{f['gate']['reference_only']} / {f['gate']['test_only']} ({f['gate']['p_value']:.2g})" if f else "-"
        gate = f["gate"]["verdict"] if f else "-"
        lines.append(
            f"| {r['index']} | {r['name']} | {_num(ld.get('output_throughput'))}{_x(x.get('output_throughput'))} "
            f"| {_num(ld.get('median_ttft_ms'), '.0f')}{_x(x.get('median_ttft_ms'))} "
            f"| {_num(ld.get('p90_ttft_ms'), '.0f')} "
            f"| {_num(ld.get('median_itl_ms'))}{_x(x.get('median_itl_ms'))} "
            f"| {r['server_peak_rss_bytes'] / 2**30:.2f}{_x(x.get('server_peak_rss_bytes'))} "
            f"| {_num(r.get('server_end_rss_bytes', 0) / 2**30, '.2f')} "
            f"| {r['kv_pool_bytes'] / 2**20:.0f} / {r['kv_peak_used_bytes'] / 2**20:.0f} "
            f"| {acc} | {agree} | {paired} | {gate} | {r['symptom']} |")
    return "\n".join(lines)


def reference_answers(args, items: list[dict]) -> list[dict]:
    """The faithfulness reference's greedy answers (row 5's settings, dense, the table's dtype),
    computed here or loaded from / saved to ``--reference``."""
    from bench import faithfulness

    ref_row = next(r for r in ROWS if r.key == REFERENCE_ROW)
    engine, _ = row_settings(ref_row, args)
    ref_kw = faithfulness.reference_engine_kwargs(engine, args.dtype)
    meta = {"model": args.model, "max_tokens": args.faithfulness_max_tokens, "dtype": args.dtype}
    path = Path(args.reference) if args.reference else None
    answers = faithfulness.load_reference(path, meta, items) if path else None
    if answers is None:
        print(f"faithfulness reference ({REFERENCE_ROW}, dense, dtype {args.dtype}) ...", file=sys.stderr, flush=True)
        answers, _ = faithfulness.answer_with_llm(ref_kw, items, args.faithfulness_max_tokens)
        if path:
            path.write_text(json.dumps({**meta, "engine": ref_kw, "answers": answers}, indent=1))
    return answers


def description() -> str:
    """The command's description: what it measures and its rows."""
    return (__doc__.split("\n\n")[0] + "\n\nRows:\n"
            + "\n".join(f"  {i:2d} {r.key:15s} {r.name} -> {r.symptom}" for i, r in enumerate(ROWS, 1))
            + "\n\nEach row runs in a fresh process with its own `kvmesh serve` (executor local); see "
              "docs/benchmarks.md.")


def add_parser(subparsers, help: str) -> argparse.ArgumentParser:
    """``kvmesh bench ablation`` (:mod:`bench.command`)."""
    return command.add_parser(subparsers, "ablation", help, description(), add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.ablation``: the same as ``kvmesh bench ablation``."""
    return command.main("kvmesh bench ablation", description(), add_arguments, run, argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="model of every row (smollm2-135m-instruct)")
    p.add_argument("--dtype", default="auto", help="weights/activations dtype of every row (auto)")
    p.add_argument("--rows", nargs="+", metavar="ROW", help="rows to run, by index or key (default: all; "
                                                            "spec-draft only with --draft-model)")
    p.add_argument("--draft-model", default="", metavar="NAME|DIR", help="draft model of the spec-draft row")
    p.add_argument("--draft-num-layers", type=int, default=0, metavar="N",
                   help="keep only the draft's first N layers (0 = all; with the target itself as the draft, "
                        "a self-speculative draft)")
    p.add_argument("--num-prompts", type=int, default=16, metavar="N", help="PolicyDesk requests per row (16)")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N",
                   help="output tokens per request, EOS ignored (32)")
    p.add_argument("--max-concurrency", type=int, default=8, metavar="N", help="requests in flight (8)")
    p.add_argument("--seed", type=int, default=0, help="workload sampling seed (0)")
    p.add_argument("--kv-cache-memory", default="1GiB", metavar="BYTES", help="KV pool per replica (1GiB)")
    p.add_argument("--max-model-len", type=int, default=4096, metavar="N", help="(4096)")
    p.add_argument("--threads", type=int, default=2, metavar="N",
                   help="torch threads per row, split among its replicas (2)")
    p.add_argument("--row-timeout", type=float, default=1800, metavar="S",
                   help="a row still running after S seconds is stopped and shown as not available (1800)")
    p.add_argument("--faithfulness-questions", type=int, default=96, metavar="N",
                   help="PolicyDesk questions answered greedily per row after the load run (96 = all)")
    p.add_argument("--faithfulness-chats", type=int, default=24, metavar="N",
                   help="PolicyDesk multi-turn chats answered turn by turn per row, every turn scored (24 = all)")
    p.add_argument("--faithfulness-max-tokens", type=int, default=64, metavar="N",
                   help="answer length limit per turn (64)")
    p.add_argument("--no-faithfulness", action="store_true", help="skip the faithfulness columns")
    p.add_argument("--reference", metavar="FILE",
                   help="faithfulness reference answers: loaded when FILE exists, else computed and written there")
    add_output_args(p, markers="ablation")
    command.add_child_arg(p)


def run(args: argparse.Namespace) -> int:
    """Run the rows (or one row, in a row's child process), print and write the table."""
    if command.answered_child(args, run_child) or print_saved_table(args, table):
        return 0
    from bench import faithfulness

    try:
        selected = select_rows(args.rows, args.draft_model)
        items = [] if args.no_faithfulness else faithfulness.select_items(args.faithfulness_questions,
                                                                          args.faithfulness_chats)
    except ValueError as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 2
    for k in ("num_prompts", "max_tokens", "max_concurrency", "threads"):
        if getattr(args, k) < 1:
            print(f"kvmesh: error: --{k.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    t_start = time.time()
    import torch
    torch.set_num_threads(args.threads)
    reference = reference_answers(args, items) if items else None
    rows = []
    workload = (f"{args.num_prompts} PolicyDesk prompts (seed {args.seed}) x {args.max_tokens} output tokens, "
                f"max concurrency {args.max_concurrency}, model {args.model}, dtype {args.dtype}, "
                f"KV pool {args.kv_cache_memory} per replica, {args.threads} torch threads per row"
                + ("" if args.no_faithfulness else
                   f"; faithfulness: {len(items)} items ({args.faithfulness_questions} questions, every turn of "
                   f"{args.faithfulness_chats} chats) x {args.faithfulness_max_tokens} tokens, paired gate vs the "
                   f"{REFERENCE_ROW} row's settings"))
    meta = run_meta(args.command_line, workload=workload)
    for index, row in selected:
        r = run_row(index, row, args)
        add_faithfulness(r, items, reference)
        rows.append(r)
        add_ratios(rows)
        print(table(rows[-1:]), file=sys.stderr, flush=True)
        meta["elapsed_s"] = time.time() - t_start
        write_json(args.out, {"meta": meta, "rows": rows})    # keeps partial results if a later row breaks the run
    meta["elapsed_s"] = time.time() - t_start
    print(table(rows))
    write_json(args.out, {"meta": meta, "rows": rows})
    if args.markdown:
        write_markdown(args.markdown, MARK_BEGIN, MARK_END, meta, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
