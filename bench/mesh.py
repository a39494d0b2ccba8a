"""Mesh overhead benchmark: the same PolicyDesk requests through the in-process engine and
through the gRPC mesh on loopback (gateway → scheduler → Ray stage actors), at concurrency 1
and 16, with ``--pp 1`` and ``--pp 2``.

Every system serves the same chats (system prompt + one policy + a question, through the chat
template; greedy, exactly ``--max-tokens`` tokens, EOS ignored). Each system first serves the
whole workload once as a warm-up (so the prefix cache holds every policy in every system),
then the measured passes. Measured per request, on the client side:

- TTFT: request sent → first message carrying a token
- ITL: gaps between consecutive token-carrying messages (one message per engine step)
- output tokens/s: all tokens of a pass / wall time of the pass

The in-process baseline streams :class:`kvmesh.llm.AsyncLLM` outputs in a child process; each mesh is a ``kvmesh serve`` subprocess and the client is this process (grpc.aio).
Usage::

    python -m bench.mesh [--model smollm2-135m-instruct] [--requests 32] [--out docs/mesh.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

from bench import command
from bench.engine_offline import percentile, policydesk_conversations
from bench.markdown import add_output_args, print_saved_table, write_json
from bench.served import served


def _summary(system: str, concurrency: int, wall: float, per_req: list[dict]) -> dict:
    ttft = [r["ttft"] for r in per_req]
    itl = [g for r in per_req for g in r["itl"]]
    n = sum(r["tokens"] for r in per_req)
    front = [r["front_ttft"] for r in per_req if "front_ttft" in r]
    extra = {"front_ttft_p50_ms": 1e3 * statistics.median(front)} if front else {}
    return {**extra, "system": system, "concurrency": concurrency, "requests": len(per_req), "output_tokens": n,
            "wall_s": wall, "output_tok_s": n / wall, "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p90_ms": 1e3 * percentile(ttft, 90), "itl_p50_ms": 1e3 * statistics.median(itl),
            "itl_p90_ms": 1e3 * percentile(itl, 90)}


async def _drive(one, n: int, concurrency: int) -> tuple[float, list[dict]]:
    """Run requests 0..n-1 with at most ``concurrency`` in flight; ``one(i)`` → per-request dict."""
    sem = asyncio.Semaphore(concurrency)

    async def guarded(i):
        async with sem:
            return await one(i)

    t0 = time.perf_counter()
    res = await asyncio.gather(*(guarded(i) for i in range(n)))
    return time.perf_counter() - t0, res


def _timing(t0: float, stamps: list[float], tokens: int) -> dict:
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens}


# ---- in-process baseline (child process) ------------------------------------------------------

def run_engine(args) -> list[dict]:
    """Child process: the same passes on an :class:`kvmesh.llm.AsyncLLM` (engine loop on a
    thread, detokenized text deltas: what the gateway adds over gRPC is the difference)."""
    import torch
    torch.set_num_threads(args.threads)
    from kvmesh.llm import AsyncLLM
    from kvmesh.core.sampling import SamplingParams

    async def main():
        llm = AsyncLLM(args.model, num_threads=args.threads)
        convs = policydesk_conversations(args.requests)

        async def one(i):
            sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            t0, stamps, n = time.perf_counter(), [], 0
            ids = llm.encode_chat(convs[i])          # the gateway tokenizes inside TTFT too
            async for ro in llm.generate(None, ids, sp):
                k = len(ro.outputs[0].delta_token_ids)
                if k:
                    stamps.append(time.perf_counter())
                    n += k
            return _timing(t0, stamps, n)

        rows = []
        await _drive(one, args.requests, 16)                       # warm-up: fills the prefix cache
        for c in args.concurrency:
            wall, per = await _drive(one, args.requests, c)
            rows.append(_summary("engine (in-process)", c, wall, per))
        await llm.shutdown()
        return rows

    return asyncio.run(main())


# ---- the mesh -------------------------------------------------------------------------------

async def mesh_passes(address: str, args, label: str) -> list[dict]:
    """Greedy PolicyDesk chats (``args.requests`` of them, ``args.max_tokens`` tokens each,
    streamed over gRPC from the gateway at ``address``): one warm-up pass at concurrency 16, then
    one pass per ``args.concurrency``; a summary row (``label``, times in seconds) per pass."""
    import grpc
    from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc

    convs = policydesk_conversations(args.requests)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)

        async def one(i):
            req = llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(**m) for m in convs[i]],
                                      sampling=common_pb2.SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                                         ignore_eos=True))
            t0, stamps, n = time.perf_counter(), [], 0
            async for msg in stub.Chat(req):
                if msg.token_ids:
                    stamps.append(time.perf_counter())
                    n += len(msg.token_ids)
                if msg.finished:
                    sched_ttft = msg.timings.ttft
            out = _timing(t0, stamps, n)
            out["front_ttft"] = out["ttft"] - sched_ttft     # gateway + 2 gRPC hops, before the scheduler's clock starts
            return out

        await _drive(one, args.requests, 16)
        rows = []
        for c in args.concurrency:
            wall, per = await _drive(one, args.requests, c)
            rows.append(_summary(label, c, wall, per))
        return rows


def run_mesh(args, pp: int) -> list[dict]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", KVMESH_NUM_THREADS=str(max(1, args.threads // pp)))
    cmd = ["serve", "--model", args.model, "--pp", str(pp), "--port", "0", "--scheduler-port", "0"]
    with served(cmd, env, "gateway") as address:
        return asyncio.run(mesh_passes(address, args, f"mesh pp={pp}"))


def table(rows: list[dict]) -> str:
    lines = ["| system | concurrency | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | output tok/s "
             "| TTFT p50 vs engine | ITL p50 vs engine | gateway+gRPC part of TTFT, p50 |", "|" + "---|" * 10]
    for r in rows:
        b = next((x for x in rows if x["system"].startswith("engine") and x["concurrency"] == r["concurrency"]), None)
        d = lambda k: f"{r[k] - b[k]:+.1f} ms" if b and b is not r else "-"
        front = f"{r['front_ttft_p50_ms']:.1f} ms" if "front_ttft_p50_ms" in r else "-"
        lines.append(f"| {r['system']} | {r['concurrency']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} "
                     f"| {r['itl_p50_ms']:.1f} | {r['itl_p90_ms']:.1f} | {r['output_tok_s']:.1f} "
                     f"| {d('ttft_p50_ms')} | {d('itl_p50_ms')} | {front} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = command.parser(__doc__)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=2, help="torch threads per replica (split among its stages)")
    add_output_args(ap)
    ap.add_argument("--child-engine", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_engine:
        return command.answer(run_engine(args))
    if print_saved_table(args, table):
        return 0
    rows = []
    cmd = [sys.executable, "-m", "bench.mesh", "--child-engine", "--model", args.model, "--requests",
           str(args.requests), "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
           "--concurrency", *map(str, args.concurrency)]
    print("running engine (in-process) ...", file=sys.stderr, flush=True)
    engine_rows = command.run_child(cmd)
    if engine_rows is None:
        return 1
    rows += engine_rows
    for pp in args.pp:
        print(f"running mesh pp={pp} ...", file=sys.stderr, flush=True)
        rows += run_mesh(args, pp)
        write_json(args.out, rows)
    print(table(rows))
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
