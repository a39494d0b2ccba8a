"""Heavy stop lists vs an unrelated stream (issue 16): does one client's stop list slow others?

A ``kvmesh serve`` subprocess with its defaults (or ``--address`` of a running gateway). One
"unrelated" request (``--max-tokens`` greedy tokens, no stop list) is timed end to end:

- ``alone``: nothing else running;
- ``plain``: while ``--clients`` other clients each stream requests back to back (greedy,
  ``--load-tokens`` tokens, EOS ignored) without stop lists;
- ``heavy``: the same clients, each request carrying the largest stop lists the gateway's
  default limits allow: ``max_stop_strings`` (64) stop strings of 64 characters (4,096 in all,
  ``max_stop_chars``), each starting with a common word so that they keep matching partially,
  different in every request (no reuse of anything built for an earlier one), and
  ``max_stop_token_ids`` (1,024) stop token ids that are never sampled.

``plain`` and ``heavy`` alternate ``--reps`` times; the figure is heavy / plain (median times):
what the stop lists add, with the batching of the other requests cancelled out (the issue's
target is <= 1.2x). heavy / alone is printed too. On a shared machine the times are noisy, so
the bench also reports the CPU time of the ``kvmesh serve`` process itself (gateway and
scheduler service; the engine process excluded) per load request in each phase: the work the
stop lists add on the event loop that serves every stream. ``--stops N --stop-chars C`` send N stop
strings of C characters instead (with a served gateway: raise its limits for them to be
accepted; against an older kvmesh without limits this measures the unbounded case).

Usage::

    python -m bench.stop_lists [--model smollm2-135m-instruct] [--clients 8] [--reps 3]
        [--address HOST:PORT] [--stops 64 --stop-chars 64] [--out result.json]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time

from bench import command
from bench.machine import cpu_model
from bench.markdown import add_output_args

UNRELATED = "The history of the printing press begins"
LOAD = "Once upon a time, in a quiet mountain village, a baker named Clara"
WORDS = (" the", " and", " of", " a", " to", " in", " was", " her", " she", " it")


def stop_strings(n: int, chars: int, salt: str = "") -> list[str]:
    """``n`` distinct stop strings of ``chars`` characters that begin like common output."""
    out = []
    for i in range(n):
        head = WORDS[i % len(WORDS)] + f"\u00a7{i}{salt}\u00a7"
        out.append((head + "\u00b6" * chars)[:chars])
    return out


async def _stream_time(stub, req) -> float:
    t0 = time.perf_counter()
    async for m in stub.Generate(req):
        if m.finished:
            break
    return time.perf_counter() - t0


async def _phase(stub, args, sampling_extra: dict | None, proc=None) -> tuple[float, float | None]:
    """Time the unrelated request, with ``args.clients`` load clients when ``sampling_extra`` is
    not None (their extra sampling fields: the stop lists, or {} for none). Returns the time
    (seconds) and the CPU milliseconds ``proc`` spent per load request (None without either)."""
    from kvmesh.v1 import common_pb2, llm_pb2

    unrelated = llm_pb2.GenerateRequest(prompt=UNRELATED, sampling=common_pb2.SamplingParams(
        temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    stop = asyncio.Event()

    async def client(k: int) -> int:
        n = 0
        while not stop.is_set():
            extra = dict(sampling_extra)
            if "stop" in extra:          # a new list each time
                extra["stop"] = stop_strings(args.stops, args.stop_chars, f"{k}.{n}")
            req = llm_pb2.GenerateRequest(prompt=f"{LOAD} ({k})", sampling=common_pb2.SamplingParams(
                temperature=0, max_tokens=args.load_tokens, ignore_eos=True, **extra))
            await _stream_time(stub, req)
            n += 1
        return n

    cpu0 = _cpu(proc)
    tasks = [] if sampling_extra is None else [asyncio.create_task(client(k)) for k in range(args.clients)]
    if tasks:
        await asyncio.sleep(args.settle)           # the load clients are streaming
    elapsed = await _stream_time(stub, unrelated)
    stop.set()
    done = sum(await asyncio.gather(*tasks))
    per_request = (_cpu(proc) - cpu0) * 1e3 / done if proc is not None and done else None
    return elapsed, per_request


def _cpu(proc) -> float:
    if proc is None:
        return 0.0
    t = proc.cpu_times()
    return t.user + t.system


async def run(address: str, args, proc=None) -> dict:
    import grpc

    from kvmesh.v1 import llm_pb2_grpc

    heavy = dict(stop=stop_strings(args.stops, args.stop_chars),
                 stop_token_ids=list(range(args.stop_token_base, args.stop_token_base + args.stop_token_ids)))
    async with grpc.aio.insecure_channel(address) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        await _phase(stub, args, None)             # warm-up
        res = {"alone": [(await _phase(stub, args, None))[0] for _ in range(args.reps)], "plain": [], "heavy": []}
        cpu = {"plain": [], "heavy": []}
        for _ in range(args.reps):
            for name, extra in (("plain", {}), ("heavy", heavy)):
                t, c = await _phase(stub, args, extra, proc)
                res[name].append(t)
                cpu[name].append(c)
    med = {k: statistics.median(v) for k, v in res.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()} if proc is not None else None
    return {"cpu": cpu_model(), "address": address, "clients": args.clients, "max_tokens": args.max_tokens,
            "load_tokens": args.load_tokens, "stops": args.stops, "stop_chars": args.stop_chars,
            "stop_token_ids": args.stop_token_ids, "times_s": res, "median_s": med,
            "serve_cpu_ms_per_load_request": cpu, "serve_cpu_ms_median": cpu_med,
            "heavy_over_plain": med["heavy"] / med["plain"], "heavy_over_alone": med["heavy"] / med["alone"]}


def main(argv: list[str] | None = None) -> int:
    p = command.parser(__doc__, prog="python -m bench.stop_lists")
    p.add_argument("--address", default="", help="a running gateway (default: start `kvmesh serve`)")
    p.add_argument("--serve-args", default="", help="extra `kvmesh serve` flags, e.g. '--max-stop-strings 100000'")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens of the unrelated stream")
    p.add_argument("--load-tokens", type=int, default=32, help="tokens of each load request")
    p.add_argument("--stops", type=int, default=64)
    p.add_argument("--stop-chars", type=int, default=64)
    p.add_argument("--stop-token-ids", type=int, default=1024)
    p.add_argument("--stop-token-base", type=int, default=40000, help="first stop token id (never sampled)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds the load runs before the timed request")
    add_output_args(p, table=False)
    args = p.parse_args(argv)
    if args.address:
        result = asyncio.run(run(args.address, args))
    else:
        from bench.served import served
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        argv_serve = ["serve", "--model", args.model, "--port", "0", "--scheduler-port", "0", *args.serve_args.split()]
        with served(argv_serve, env, "gateway") as address:
            import psutil
            proc = next(p for p in psutil.Process().children() if "kvmesh.cli" in " ".join(p.cmdline()))
            result = asyncio.run(run(address, args, proc))
    m = result["median_s"]
    print(f"{result['cpu']}\nunrelated stream of {args.max_tokens} tokens, median of {args.reps} "
          f"(alone / with {args.clients} plain clients / with {args.clients} clients sending {args.stops} stop "
          f"strings of {args.stop_chars} chars and {args.stop_token_ids} stop token ids):\n"
          f"  {m['alone']:.2f} s / {m['plain']:.2f} s / {m['heavy']:.2f} s   "
          f"heavy/plain {result['heavy_over_plain']:.2f}x   heavy/alone {result['heavy_over_alone']:.2f}x")
    if result["serve_cpu_ms_median"]:
        c = result["serve_cpu_ms_median"]
        print(f"  kvmesh serve process CPU per load request: plain {c['plain']:.1f} ms / heavy {c['heavy']:.1f} ms "
              f"({c['heavy'] / c['plain']:.2f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
