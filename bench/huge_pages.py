"""Microbenchmark: SmolLM2-135M's 120 projection GEMMs (``kvmesh::bf16_linear`` on packed
panels) with the panels on 4 KiB pages vs on 2 MiB pages (:mod:`workers.huge_pages`), the two
alternated in one process; random weights of the model's shapes.

``python -m bench.huge_pages [--rounds 25] [--threads 2] [--batch 1 8]``

Prints the CPU model, then per batch size the median milliseconds of the chain on each layout,
the weight read rate (MB of panels per ms) and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.machine import cpu_model

# 30 layers x (qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576): [out, in]
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


def _chain(panels, x_by_in, out_features) -> float:
    from workers.kernels.gemm import bf16_linear
    t = time.perf_counter()
    for p, (n, k) in zip(panels, out_features):
        bf16_linear(x_by_in[k], p, n)
    return (time.perf_counter() - t) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.huge_pages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args(argv)
    from workers import huge_pages
    from workers.kernels.gemm import pack_bf16_weight
    torch.set_num_threads(args.threads)
    print(cpu_model(), f"threads {args.threads}; huge pages available: {huge_pages.available()}")
    if not huge_pages.available():
        return 1
    torch.manual_seed(0)
    small = [pack_bf16_weight(torch.randn(s, dtype=torch.bfloat16)) for s in SHAPES]
    huge = huge_pages.to_huge_pages(small)
    mb = sum(p.numel() * p.element_size() for p in small) / 1e6
    thp = next((ln.split()[1] for ln in open("/proc/self/smaps_rollup") if ln.startswith("AnonHugePages")), "?")
    print(f"panels: {mb:.0f} MB; this process's AnonHugePages: {int(thp) / 1024:.0f} MB (what the kernel granted)")
    print("| M | 4 KiB pages ms | 2 MiB pages ms | GB/s 4 KiB / 2 MiB | 2 MiB speed-up |\n|---|---|---|---|---|")
    for m in args.batch:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (576, 1536)}
        a, b = [], []
        for _ in range(args.rounds):
            a.append(_chain(small, xs, SHAPES))
            b.append(_chain(huge, xs, SHAPES))
        ma, mb_ = statistics.median(a), statistics.median(b)
        print(f"| {m} | {ma:.2f} | {mb_:.2f} | {mb / ma:.1f} / {mb / mb_:.1f} | {ma / mb_:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
