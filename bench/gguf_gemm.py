"""The GGUF-block kernel (``kvmesh::gguf_linear``) on Qwen2.5-Coder-1.5B's projection shapes, against the bandwidth.

Builds the 28 layers' projections of Qwen2.5-Coder-1.5B (Q4_K_M) with random integers and scales
in the kernel's layout (``workers.kernels.gemm.pack_gguf_qweight`` / ``pack_gguf_scales``):
qkv 2048x1536, o 1536x1536, gate_up 17920x1536 as 4-bit k-quant lanes (Q4_K: groups of 32),
down 1536x8960 as 6-bit lanes (Q6_K: groups of 16), distinct tensors on 2 MiB pages as the model's (~0.9 GB, nothing stays in
cache between matrices), and times

- one pass over the chain at each ``--m`` (rows of x; M = 1 is a decode step's projections), in
  ms, with the panel bytes read per second beside the read bandwidth measured in the same run
  (``bench.machine.read_bandwidth``): M = 1 is bound by memory;
- one Q4_K gate_up and one Q6_K down matrix, and SmolLM2-135M's Q4_1 gate_up (3072x576: the
  flat scheme), at ``--m-compute`` rows on one thread (the compute-bound prefill case), in GMAC/s;
  with ``--dense``, beside each the dense bf16 GEMM (``bf16_linear``) of the same shape on the
  same x, the format the GGUF blocks are compared with.

Each figure is the median (chain) or best (one matrix) of ``--runs`` timed runs after a
warm-up. The kernel path is the active level's: the CPU's best, or ``--isa`` (e.g.
``avx512bf16`` on a Xeon with AMX: the avx512vnni path a Zen 4 runs); printed. x is float32, or
``--x-dtype bfloat16`` (the engine's activations where the CPU has AVX512-BF16).

Usage::

    python -m bench.gguf_gemm [--m 1 8 64] [--m-compute 64] [--runs 6] [--isa auto] [--x-dtype float32] [--out gguf_gemm.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LAYERS = 28
SHAPES = [(2048, 1536, 4, 32), (1536, 1536, 4, 32), (17920, 1536, 4, 32), (1536, 8960, 6, 16)]   # N, K, bits, G


def _matrix(n: int, k: int, bits: int, G: int, gen: torch.Generator, flat: bool = False):
    from workers.kernels import gemm
    if flat:            # Q4_1: w = s q + z per group of 32, s and z float16
        q = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
        s = torch.rand(n, k // G, generator=gen) * 0.02
        z = -s * torch.randint(0, 2 ** bits, (n, k // G), generator=gen)
        return (gemm.pack_gguf_qweight(q, bits), gemm.pack_gguf_scales(s.half().float(), z.half().float(), torch.float16),
                None, bits, G, n, k)
    q = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    sc = torch.randint(-63, 64, (n, k // G), generator=gen, dtype=torch.int8)
    m = torch.randint(0, 64, (n, k // G), generator=gen, dtype=torch.int8)
    d = torch.rand(n, k // 256, generator=gen) * 1e-3
    dmin = torch.rand(n, k // 256, generator=gen) * 1e-3
    d, dmin = d.half().float(), dmin.half().float()
    if bits == 6:       # Q6_K: m = sc and dmin = 32 d, kept as sc and d alone (Linear.set_gguf)
        return (gemm.pack_gguf_qweight(q, bits), gemm.pack_gguf_scales(sc, None, torch.int8),
                gemm.pack_gguf_scales(d, None, torch.float16), bits, G, n, k)
    return (gemm.pack_gguf_qweight(q, bits), gemm.pack_gguf_scales(sc, m, torch.int8),
            gemm.pack_gguf_scales(d, dmin, torch.float16), bits, G, n, k)


def _bytes(mat) -> int:
    return mat[0].numel() + mat[1].numel() + mat[2].numel() * 2


def _run(mat, x):
    from workers.kernels import gemm
    qw, scales, supers, bits, G, n, _ = mat
    return gemm.gguf_linear(x, qw, scales, supers, bits, G, n)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.gguf_gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--m-compute", type=int, default=64)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--isa", default="auto", help="kernel level: auto, scalar, avx2, avx512, avx512bf16, amx")
    ap.add_argument("--x-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dense", action="store_true", help="also time bf16_linear on each compute matrix's shape")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from bench.machine import cpu_model, read_bandwidth
    from workers import kernels
    from workers.kernels import gemm
    if not gemm.gguf_available():
        raise SystemExit("the native kernels are not built here")
    kernels.set_isa(args.isa)
    xdt = getattr(torch, args.x_dtype)
    gen = torch.Generator().manual_seed(0)
    chain = [_matrix(*s, gen) for _ in range(LAYERS) for s in SHAPES]
    # on 2 MiB pages, as the model's (workers.layers.linear.gguf_to_huge_pages)
    from workers.huge_pages import to_huge_pages
    moved = iter(to_huge_pages([t for m in chain for t in m[:3]]))
    chain = [(next(moved), next(moved), next(moved)) + m[3:] for m in chain]
    nbytes = sum(_bytes(m) for m in chain)
    bw = read_bandwidth()
    res = {"cpu": cpu_model(), "path": kernels.path("gguf_linear"), "x_dtype": args.x_dtype, "threads": torch.get_num_threads(),
           "bandwidth_bytes_per_s": bw, "chain_bytes": nbytes, "chain": [], "compute": []}
    print(f"# CPU: {res['cpu']}; gguf_linear path {res['path']}; x {args.x_dtype}; {res['threads']} threads; read bandwidth "
          f"{bw / 1e9:.1f} GB/s; chain {nbytes / 1e6:.0f} MB")
    for M in args.m:
        xs = {k: torch.randn(M, k, generator=gen).to(xdt) for k in {s[1] for s in SHAPES}}
        times = []
        for i in range(args.runs + 1):
            t = time.perf_counter()
            for mat in chain:
                _run(mat, xs[mat[6]])
            if i:
                times.append(time.perf_counter() - t)
        med = statistics.median(times)
        row = {"m": M, "ms": med * 1e3, "gb_s": nbytes / med / 1e9, "share_of_bandwidth": nbytes / med / bw}
        res["chain"].append(row)
        print(f"chain M={M}: {row['ms']:.1f} ms, {row['gb_s']:.1f} GB/s ({row['share_of_bandwidth']:.0%} of the "
              f"read bandwidth)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, shape, flat in (("Q4_K gate_up 17920x1536", SHAPES[2], False), ("Q6_K down 1536x8960", SHAPES[3], False),
                                  ("Q4_1 gate_up 3072x576", (3072, 576, 4, 32), True)):
            mat = _matrix(*shape, gen, flat=flat)
            x = torch.randn(args.m_compute, shape[1], generator=gen).to(xdt)
            _run(mat, x)
            best = float("inf")
            for _ in range(args.runs):
                t = time.perf_counter()
                _run(mat, x)
                best = min(best, time.perf_counter() - t)
            row = {"matrix": name, "m": args.m_compute, "ms": best * 1e3,
                   "gmac_s": args.m_compute * shape[0] * shape[1] / best / 1e9}
            line = f"{name}, M={args.m_compute}, one thread: {row['ms']:.1f} ms, {row['gmac_s']:.1f} GMAC/s"
            if args.dense:
                packed = gemm.pack_bf16_weight(torch.randn(shape[0], shape[1], generator=gen))
                gemm.bf16_linear(x, packed, shape[0])
                dense = float("inf")
                for _ in range(args.runs):
                    t = time.perf_counter()
                    gemm.bf16_linear(x, packed, shape[0])
                    dense = min(dense, time.perf_counter() - t)
                row["dense_ms"] = dense * 1e3
                line += f"; dense bf16 {row['dense_ms']:.1f} ms ({best / dense:.2f}x its time)"
            res["compute"].append(row)
            print(line)
    finally:
        torch.set_num_threads(threads)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
