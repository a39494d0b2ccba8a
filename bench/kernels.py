"""Microbenchmark: native paged attention (``kvmesh::paged_attention``) vs the PyTorch path.

``python -m bench.kernels [--repeats N] [--threads N] [--isa scalar|avx2|avx512|avx512bf16|amx] [--cpu-time]``

``--cpu-time`` times each call by the CPU time of this process instead of the wall clock:
with ``--threads 1`` on a host whose other processes take the cores now and then, it counts
only the work of the call (the wall clock counts the time slices spent waiting too).

Per layer call, for SmolLM2-135M (H=9, KVH=3, D=64) and Qwen2.5-0.5B (H=14, KVH=2, D=64)
shapes, block size 16, bfloat16 queries, KV cache bfloat16 and int8, random non-contiguous
block tables:

- decode, batch 1 / 8 / 32, 1,600 tokens of context each;
- one 256-token prefill chunk after 1,400 cached tokens;
- one cold 1,500-token prefill (no cached context; the reference is SDPA with ``is_causal`` on
  the chunk's own K/V, what the engine runs for it when the kernel does not, and the native
  kernel reads the same K/V from the cache).

The reference is the engine's own path, ``workers.layers.attention.paged_attention`` (gather
through ``KVCache.read`` — dequantizing an int8 cache — then SDPA), called with no new tokens
to write. Reported: median milliseconds per call over ``--repeats`` runs (after one warm-up),
the speedup, and for the native kernel the achieved bandwidth in GB/s of K and V read (each
sequence's K/V bytes once, scales excluded) and GFLOP/s (4 * H * D per query and visible key:
QK^T and PV). The CPU model (/proc/cpuinfo) and the kernel path
are printed first. A second table times the KV cache write (``kvmesh::reshape_and_cache`` vs
``KVCache.write``) for 32 decode tokens and one 256-token chunk.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.machine import cpu_model, time_call

from workers.kv_cache import KVCache
from workers.layers.attention import AttentionMetadata, PrefillChunk, block_index, paged_attention, set_decode_tables

MODELS = {"smollm2-135m": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64)}
BS = 16


CLOCK = time.perf_counter     # --cpu-time: time.process_time (CPU seconds of this process)


def _median_ms(fn, repeats: int) -> float:
    return time_call(fn, repeats, CLOCK) * 1e3


def _cache(num_blocks: int, kvh: int, d: int, kv_dtype: torch.dtype, gen: torch.Generator) -> KVCache:
    vals = torch.randn(2, num_blocks, BS, kvh, d, generator=gen)
    if kv_dtype == torch.int8:
        cache = KVCache(torch.zeros(2, num_blocks, BS, kvh, d, dtype=torch.int8), torch.zeros(2, num_blocks, kvh))
        cache.write(vals[0].reshape(-1, kvh, d), vals[1].reshape(-1, kvh, d), torch.arange(num_blocks * BS))
        return cache
    return KVCache(vals.to(kv_dtype))


def case(model: str, kv_dtype: torch.dtype, batch: int, ctx: int, n_new: int, repeats: int,
         gen: torch.Generator) -> dict:
    """One row: ``batch`` sequences of ``ctx + n_new`` keys with ``n_new`` query tokens each."""
    from workers import kernels

    h, kvh, d = MODELS[model]
    total = ctx + n_new
    nb_seq = (total + BS - 1) // BS
    cache = _cache(batch * nb_seq + 8, kvh, d, kv_dtype, gen)
    perm = torch.randperm(cache.data.shape[1], generator=gen)
    tables = [perm[i * nb_seq:(i + 1) * nb_seq].tolist() for i in range(batch)]
    q = torch.randn(batch * n_new, h, d, generator=gen).to(torch.bfloat16)
    scale = d ** -0.5
    empty = torch.empty(0, kvh, d, dtype=torch.bfloat16)
    md = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
    if n_new == 1:
        md.num_decode_tokens = batch
        set_decode_tables(md, tables, [total] * batch, BS, torch.bfloat16, "cpu")
    else:
        md.prefills = [PrefillChunk(i * n_new, (i + 1) * n_new, ctx, block_index(t, "cpu")) for i, t in enumerate(tables)]
    qsl = torch.arange(0, batch * n_new + 1, n_new, dtype=torch.int32)
    lens = torch.full((batch,), total, dtype=torch.int32)
    bt = torch.tensor(tables, dtype=torch.int32)

    if ctx == 0:       # a cold prefill: SDPA on the chunk's own K/V (read here from the cache)
        kk, vv = (x.reshape(-1, kvh, d)[:total].transpose(0, 1).unsqueeze(0)
                  for x in cache.read(torch.tensor(tables[0]), torch.bfloat16))
        qq = q.transpose(0, 1).unsqueeze(0)
        ref_ms = _median_ms(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale,
                                                                   enable_gqa=h != kvh), repeats)
    else:
        ref_ms = _median_ms(lambda: paged_attention(q, empty, empty, cache, md, scale), repeats)
    nat_ms = _median_ms(lambda: kernels.paged_attention(q, cache.data, cache.scales, qsl, lens, bt, scale), repeats)
    kv_bytes = 2 * batch * total * kvh * d * cache.data.element_size()
    flops = 4 * batch * h * d * sum(ctx + i + 1 for i in range(n_new))      # QK^T and PV, causal
    return {"gflops": flops / nat_ms / 1e6, "model": model, "kv": str(kv_dtype).removeprefix("torch."), "batch": batch, "ctx": ctx, "new": n_new,
            "ref_ms": ref_ms, "native_ms": nat_ms, "speedup": ref_ms / nat_ms, "gbps": kv_bytes / nat_ms / 1e6}


def write_case(model: str, kv_dtype: torch.dtype, batch: int, n_new: int, repeats: int, gen: torch.Generator) -> dict:
    """``KVCache.write`` vs ``kvmesh::reshape_and_cache``: ``batch`` sequences writing
    ``n_new`` tokens each at random positions of their own blocks (bfloat16 K/V)."""
    from workers import kernels

    _, kvh, d = MODELS[model]
    per_seq = (n_new + BS - 1) // BS + 1
    cache = _cache(batch * per_seq + 8, kvh, d, kv_dtype, gen)
    perm = torch.randperm(cache.data.shape[1], generator=gen)
    slots = []
    for i in range(batch):
        start = int(torch.randint(1, BS, (1,), generator=gen))      # mid-block, as in decode
        blocks = perm[i * per_seq:(i + 1) * per_seq]
        slots += [int(blocks[(start + j) // BS]) * BS + (start + j) % BS for j in range(n_new)]
    sm = torch.tensor(slots)
    k = torch.randn(len(slots), kvh, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(len(slots), kvh, d, generator=gen).to(torch.bfloat16)
    ref_ms = _median_ms(lambda: cache.write(k, v, sm), repeats)
    nat_ms = _median_ms(lambda: kernels.reshape_and_cache(k, v, cache.data, cache.scales, sm), repeats)
    return {"ref_ms": ref_ms, "native_ms": nat_ms}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument("--isa", default="auto", help="kernel path: auto, scalar, avx2, avx512, avx512bf16, amx")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--cpu-time", action="store_true",
                    help="time calls by this process's CPU time (use with --threads 1 on a busy host)")
    args = ap.parse_args(argv)
    from workers import kernels

    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    if not kernels.available():
        raise SystemExit(f"native kernels unavailable: {kernels.unavailable_reason()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels.set_isa(args.isa)
    print(f"CPU: {cpu_model()}  threads: {torch.get_num_threads()}  kernel path: {kernels.isa()} "
          f"(CPU supports {kernels.cpu_isa()})  torch {torch.__version__}")
    print("q bfloat16, block size 16, median of", args.repeats, "calls per layer",
          "(CPU time of the process)" if args.cpu_time else "(wall clock)", "\n")
    hdr = f"{'model':14} {'kv':9} {'batch':>5} {'ctx':>5} {'new':>4} {'ref ms':>8} {'native ms':>9} {'speedup':>7} {'GB/s':>6} {'GFLOP/s':>7}"
    print(hdr)
    print("-" * len(hdr))
    gen = torch.Generator().manual_seed(0)
    for model in args.models:
        for kv in (torch.bfloat16, torch.int8):
            for batch, ctx, new in ((1, 1599, 1), (8, 1599, 1), (32, 1599, 1), (1, 1400, 256), (1, 0, 1500)):
                r = case(model, kv, batch, ctx, new, args.repeats, gen)
                print(f"{r['model']:14} {r['kv']:9} {r['batch']:5d} {r['ctx'] + r['new']:5d} {r['new']:4d} "
                      f"{r['ref_ms']:8.3f} {r['native_ms']:9.3f} {r['speedup']:6.2f}x {r['gbps']:6.1f} {r['gflops']:7.1f}", flush=True)
    print("\nKV cache write (reshape_and_cache vs KVCache.write), bfloat16 K/V, per layer call")
    for model in args.models:
        for kv in (torch.bfloat16, torch.int8):
            for batch, new in ((32, 1), (1, 256)):
                r = write_case(model, kv, batch, new, args.repeats, gen)
                print(f"{model:14} {str(kv).removeprefix('torch.'):9} {batch:5d} seqs x {new:3d} tokens "
                      f"{r['ref_ms']:8.3f} ms -> {r['native_ms']:7.3f} ms  {r['ref_ms'] / r['native_ms']:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
