"""The native bf16-weight GEMM (:mod:`workers.kernels.gemm`) against ATen, on real projection chains.

For each model's decoder projection chain (every layer's fused qkv, o, gate_up and down
weights, distinct tensors so nothing stays in cache between matrices) and each M (rows of x),
it times one pass over the chain, y = x @ W.T per matrix, for:

- ``aten fp32``: ``torch.mm(x, W_t)`` with fp32 x and a contiguous fp32 ``W_t [K, N]``;
- ``onednn fp32``: the same prepacked oneDNN linear with fp32 x and an fp32 weight;
- ``aten bf16``: ``F.linear(x, W)`` with bf16 x and bf16 ``W [N, K]`` (skipped when the
  previous M's time predicts more than ``--max-seconds``, shown as ``skip``);
- ``onednn bf16``: oneDNN's linear on a weight prepacked for it
  (``torch.ops.mkldnn._reorder_linear_weight(W, 1024)`` then ``_linear_pointwise``: what
  Inductor's ``freezing`` emits), bf16 x;
- ``kernel fp32 x`` / ``kernel bf16 x``: ``bf16_linear(x, pack_bf16_weight(W), N)`` with fp32
  or bf16 activations (weights bf16 either way).

Each cell is the median (``--stat min``: the best) of ``--runs`` timed passes after one warm-up
pass, in ms, and the weight bytes read per second (fp32 bytes for ``aten fp32``, bf16 bytes
for the others). The
header gives the CPU model (/proc/cpuinfo), torch's thread count, the kernel's ISA and the
measured read bandwidth: ``x.sum()`` over a 1 GiB fp32 tensor, median of 5, same run. The
machine may be shared: run twice and compare.

Chains (Linear shapes ``[out, in]``):

- SmolLM2-135M: 30 x [960x576 qkv, 576x576 o, 3072x576 gate_up, 576x1536 down] (212 MB bf16)
- Qwen2.5-0.5B: 24 x [1152x896 qkv, 896x896 o, 9728x896 gate_up, 896x4864 down] (716 MB bf16)

Usage::

    python -m bench.gemm [--models smollm2 qwen2.5-0.5b] [--m 1 8 32 256] [--runs 5] [--out out.json]
    python -m bench.gemm --threads 1 --clock thread     # per-core numbers on a busy machine
    python -m bench.gemm --m 2048 --runs 1 --columns "aten fp32" "kernel fp32 x"   # prefill
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from bench.machine import cpu_model, read_bandwidth, time_call

from bench.markdown import add_output_args
from workers import kernels
from workers.kernels import gemm

CHAINS = {
    "smollm2": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)]),
    "qwen2.5-0.5b": (24, [(1152, 896), (896, 896), (9728, 896), (896, 4864)]),
}
COLUMNS = ("aten fp32", "onednn fp32", "aten bf16", "onednn bf16", "kernel fp32 x", "kernel bf16 x")


_clock = time.perf_counter
_stat = statistics.median


def _time(fn, runs: int) -> float:
    return time_call(fn, runs, _clock, _stat)


def bench_chain(name: str, ms: list[int], runs: int, max_seconds: float,
                columns=COLUMNS) -> list[dict]:
    """Rows ``{model, M, <column>: (ms, GB/s) or None}`` for one chain."""
    layers, shapes = CHAINS[name]
    g = torch.Generator().manual_seed(0)
    mats = [(n, k, torch.randn(n, k, generator=g) * 0.02) for _ in range(layers) for n, k in shapes]
    params = sum(n * k for n, k, _ in mats)
    w32t = [(n, k, w.t().contiguous()) for n, k, w in mats]
    w16 = [(n, k, w.to(torch.bfloat16)) for n, k, w in mats]
    packed = [(n, k, gemm.pack_bf16_weight(w)) for n, k, w in mats]
    onednn = ([(n, k, torch.ops.mkldnn._reorder_linear_weight(w, 1024)) for n, k, w in w16]
              if "onednn bf16" in columns else [])
    onednn32 = ([(n, k, torch.ops.mkldnn._reorder_linear_weight(w, 1024)) for n, k, w in mats]
                if "onednn fp32" in columns else [])
    del mats
    ks = sorted({k for _, k in shapes})
    rows, last = [], {}
    for m in ms:
        x32 = {k: torch.randn(m, k, generator=g) for k in ks}
        x16 = {k: v.to(torch.bfloat16) for k, v in x32.items()}
        fns = {
            "aten fp32": (lambda: [torch.mm(x32[k], w) for _, k, w in w32t], 4),
            "onednn fp32": (lambda: [torch.ops.mkldnn._linear_pointwise(x32[k], w, None, "none", [], "")
                                     for _, k, w in onednn32], 4),
            "aten bf16": (lambda: [F.linear(x16[k], w) for _, k, w in w16], 2),
            "onednn bf16": (lambda: [torch.ops.mkldnn._linear_pointwise(x16[k], w, None, "none", [], "")
                                     for _, k, w in onednn], 2),
            "kernel fp32 x": (lambda: [gemm.bf16_linear(x32[k], p, n) for n, k, p in packed], 2),
            "kernel bf16 x": (lambda: [gemm.bf16_linear(x16[k], p, n) for n, k, p in packed], 2),
        }
        row = {"model": name, "M": m}
        for col, (fn, nbytes) in fns.items():
            prev = last.get(col)
            if col not in columns:
                row[col] = None
                continue
            if prev is not None and prev[1] * m / prev[0] > max_seconds:
                row[col] = None
                continue
            with torch.inference_mode():
                t = _time(fn, runs if (prev is None or prev[1] * m / prev[0] < 2) else 1)
            row[col] = (t * 1e3, params * nbytes / t / 1e9)
            last[col] = (m, t)
        rows.append(row)
        print(_fmt_row(row), flush=True)
    return rows


def _fmt_row(row: dict) -> str:
    cells = []
    for col in COLUMNS:
        v = row.get(col)
        cells.append("skip" if v is None else f"{v[0]:9.1f} ms {v[1]:5.1f} GB/s")
    return f"| {row['model']:13s} | {row['M']:5d} | " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(CHAINS), choices=list(CHAINS))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 8, 32, 256])
    ap.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=COLUMNS,
                    help="what to time (e.g. leave out 'aten bf16' at prefill sizes)")
    ap.add_argument("--runs", type=int, default=5, help="timed passes per cell (median)")
    ap.add_argument("--max-seconds", type=float, default=5.0,
                    help="skip a column whose predicted pass time (linear in M) exceeds this")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: CPU time of the calling thread, immune to preemption on a "
                         "shared machine; only with --threads 1")
    add_output_args(ap, table=False)
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="min: the best pass, an estimate of an idle machine when others "
                         "preempt the threads")
    args = ap.parse_args(argv)
    global _clock, _stat
    _stat = min if args.stat == "min" else statistics.median
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread":
        if torch.get_num_threads() != 1:
            ap.error("--clock thread needs --threads 1")
        _clock = time.thread_time
    if not kernels.available():
        raise SystemExit("kvmesh gemm kernels unavailable")
    bw = read_bandwidth() / 1e9
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"kernel ISA {kernels.path('bf16_linear')}; read bandwidth {bw:.1f} GB/s (sum over 1 GiB fp32); "
          f"{args.clock} clock, {args.stat} of {args.runs}")
    print("| model         |     M | " + " | ".join(f"{c:>22s}" for c in COLUMNS) + " |")
    print("|---|---:|" + "---:|" * len(COLUMNS))
    rows = []
    for name in args.models:
        rows += bench_chain(name, args.m, args.runs, args.max_seconds, args.columns)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_model(), "threads": torch.get_num_threads(), "isa": kernels.path("bf16_linear"),
                       "read_gb_s": bw, "clock": args.clock, "stat": args.stat, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
