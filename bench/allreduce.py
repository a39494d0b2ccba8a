"""µs per all-reduce of the tensor-parallel communicators (workers/communicator.py), alone: the
decode step's hidden state (1 x hidden bfloat16) and a prefill chunk's (tokens x hidden), between
``--world-size`` processes of one thread each, back to back (no model work between the calls, so
no rank waits for a slower one: the figure is the communicator's own cost).

Usage::

    python -m bench.allreduce [--world-size 2] [--kind shm gloo] [--hidden 1536] [--tokens 1536]
        [--calls 2000] [--out allreduce.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path



def _rank(kind: str, rank: int, world: int, address: str, shapes: list[tuple[int, int]], calls: int, q) -> None:
    import torch

    from workers.communicator import create_communicator
    torch.set_num_threads(1)
    comm = create_communicator(kind, rank, world, address)
    out = {}
    for shape in shapes:
        x = torch.randn(*shape).to(torch.bfloat16)
        n = max(20, calls if shape[0] == 1 else calls // 50)
        for _ in range(5):
            comm.all_reduce(x)
        samples = []
        for _ in range(5):                       # 5 runs of n calls: the median run
            t = time.perf_counter()
            for _ in range(n):
                comm.all_reduce(x)
            samples.append((time.perf_counter() - t) / n)
        out[f"{shape[0]}x{shape[1]}"] = round(statistics.median(samples) * 1e6, 2)
    comm.close()
    q.put((rank, out))


def measure(kind: str, world: int, shapes: list[tuple[int, int]], calls: int) -> dict:
    """µs per all-reduce of each shape, the slowest rank's."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    if kind == "shm":
        address = f"kvmesh-bench-{uuid.uuid4().hex[:10]}"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    procs = [ctx.Process(target=_rank, args=(kind, r, world, address, shapes, calls, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600)[1] for _ in procs]
    for p in procs:
        p.join(30)
    return {k: max(r[k] for r in results) for k in results[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2, help="ranks (processes), at least 2")
    ap.add_argument("--kind", nargs="+", default=["shm", "gloo"], choices=("shm", "gloo"))
    ap.add_argument("--hidden", type=int, default=1536, help="hidden size (Qwen2.5-1.5B: 1536)")
    ap.add_argument("--tokens", type=int, default=1536, help="rows of the prefill chunk")
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed run of the decode shape (the chunk: 1/50)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.world_size < 2 or args.calls < 20:
        ap.error("--world-size must be at least 2 and --calls at least 20")
    from bench.machine import cpu_model
    shapes = [(1, args.hidden), (args.tokens, args.hidden)]
    rows = {kind: measure(kind, args.world_size, shapes, args.calls) for kind in args.kind}
    result = {"cpu": cpu_model(), "world_size": args.world_size, "dtype": "bfloat16", "us_per_all_reduce": rows}
    print(f"{result['cpu']}, {args.world_size} ranks, bfloat16, µs per all-reduce")
    for kind, r in rows.items():
        print(f"  {kind:5s} " + "  ".join(f"{k}: {v}" for k, v in r.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
