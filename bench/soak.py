"""``python -m bench.soak``: a soak of ``kvmesh serve`` through its real gRPC gateway: thousands
of mixed requests, then the statuses, the KV blocks left in use and the memory growth.

The server is ``kvmesh serve --model MODEL`` with its defaults (a subprocess; ``--address``
and ``--scheduler-address`` use a running one instead). ``--requests`` (2000) requests, at most
``--concurrency`` (16) in flight, each of a kind drawn with a seeded RNG (weights in ``KINDS``):

- ``chat``: a PolicyDesk question under its policy's system prompt (Chat; the policies' long
  shared prefixes come from the prefix cache), 4-16 tokens, greedy or sampled: OK;
- ``short``: a short text prompt (Generate), 4-16 tokens: OK;
- ``stop``: a short prompt with stop strings (" ", "."): OK, finish stop (or length);
- ``cancel``: the client cancels the stream after its first token: CANCELLED;
- ``deadline``: a 256-token request with a 0.2 s deadline: DEADLINE_EXCEEDED;
- ``abort``: a 256-token request ended by the gateway's Abort RPC after its first token: OK,
  finish abort;
- ``bad``: a request the gateway must refuse (empty prompt, bad sampling value, unknown role
  or model, negative timeout): INVALID_ARGUMENT.

Any other outcome is unexpected. The resident set size (RSS) of the replica's engine process
(GetStats ``pid``) and of the ``kvmesh serve`` process is read when the first ``--warmup``
(200) requests are done and the server is idle again, every ``--sample-every`` requests, and at
the end when idle; growth = end / warm-up - 1. The engine's RSS is split into its KV pool's
resident pages and the rest: the pool (``kv_cache_memory``) is committed page by page as blocks
are first written (:func:`workers.kv_cache.zeroed_host_tensor`), so it grows with the prefix
cache's contents up to the pool's size, a bound of its own; the rest must not grow. The pool is
found in ``/proc/PID/smaps`` as the anonymous mapping of the pool's size (its layers' mappings,
made one after the other, merge into one). At the end GetStats must show no request running or
waiting and 0 KV blocks in use. Exits 1 when a check fails (unexpected outcomes, blocks in use,
growth of the engine's RSS outside its KV pool over ``--max-growth``, 5%; of its whole RSS
when the pool's mapping was not found).

Usage::

    python -m bench.soak [--requests 2000] [--concurrency 16] [--model smollm2-135m-instruct] [--out soak.json]
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import sys
import time

from bench import command
from bench.machine import cpu_model
from bench.markdown import add_output_args

# kind: (weight, expected outcomes); an outcome is "OK:<finish reason>" or a gRPC status name
KINDS = {
    "chat": (0.30, {"OK:length", "OK:stop"}),
    "short": (0.20, {"OK:length", "OK:stop"}),
    "stop": (0.10, {"OK:stop", "OK:length"}),
    "cancel": (0.10, {"CANCELLED"}),
    "deadline": (0.10, {"DEADLINE_EXCEEDED"}),
    "abort": (0.12, {"OK:abort"}),
    "bad": (0.08, {"INVALID_ARGUMENT"}),
}
SHORT_PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time, in a small village,",
                 "The three primary colours are", "def fibonacci(n):", "A haiku about autumn:",
                 "Explain paged attention in one sentence:", "List three prime numbers:"]


def plan(n: int, seed: int) -> list[str]:
    """The kind of each of ``n`` requests, drawn with the seeded RNG by ``KINDS``' weights."""
    rng = random.Random(seed)
    kinds, weights = list(KINDS), [w for w, _ in KINDS.values()]
    return rng.choices(kinds, weights, k=n)


class Soak:
    """The request mix against one gateway (``stub``: ``LLMServiceStub`` on a grpc.aio channel)."""

    def __init__(self, stub, seed: int):
        import policydesk
        self.stub = stub
        self.rng = random.Random(seed + 1)
        self.questions = policydesk.questions()
        self.systems = {q["policy"]: policydesk.system_message(q["policy"]) for q in self.questions}

    def _sampling(self, max_tokens: int, **kw):
        from kvmesh.v1 import common_pb2
        temperature = self.rng.choice([0.0, 0.8])
        return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, **kw)

    def _call(self, kind: str, rid: str):
        """The RPC of one request of ``kind`` (a stream call)."""
        from google.protobuf.duration_pb2 import Duration

        from kvmesh.v1 import common_pb2, llm_pb2
        s = self.stub
        if kind == "chat":
            q = self.rng.choice(self.questions)
            msgs = [llm_pb2.ChatMessage(role="system", content=self.systems[q["policy"]]),
                    llm_pb2.ChatMessage(role="user", content=q["question"])]
            return s.Chat(llm_pb2.ChatRequest(messages=msgs, sampling=self._sampling(self.rng.randint(4, 16)),
                                              request_id=rid))
        prompt = self.rng.choice(SHORT_PROMPTS)
        if kind == "short":
            return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, sampling=self._sampling(self.rng.randint(4, 16)),
                                                      request_id=rid))
        if kind == "stop":
            return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, request_id=rid,
                                                      sampling=self._sampling(16, stop=[" ", "."])))
        if kind in ("cancel", "abort"):
            return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, request_id=rid,
                                                      sampling=self._sampling(256, ignore_eos=True)))
        if kind == "deadline":
            return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, request_id=rid,
                                                      timeout=Duration(nanos=200_000_000),
                                                      sampling=self._sampling(256, ignore_eos=True)))
        bad = self.rng.randrange(5)
        if bad == 0:
            return s.Generate(llm_pb2.GenerateRequest(prompt="", request_id=rid))
        if bad == 1:
            return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, request_id=rid,
                                                      sampling=common_pb2.SamplingParams(top_p=2.0)))
        if bad == 2:
            return s.Chat(llm_pb2.ChatRequest(messages=[llm_pb2.ChatMessage(role="wizard", content=prompt)],
                                              request_id=rid))
        if bad == 3:
            return s.Generate(llm_pb2.GenerateRequest(model="no-such-model", prompt=prompt, request_id=rid))
        return s.Generate(llm_pb2.GenerateRequest(prompt=prompt, request_id=rid, timeout=Duration(seconds=-1)))

    async def one(self, kind: str, rid: str) -> tuple[str, str]:
        """Send one request of ``kind``; returns (outcome, detail)."""
        import grpc

        from kvmesh.v1 import common_pb2, llm_pb2
        call = self._call(kind, rid)
        final = None
        try:
            async for msg in call:
                if msg.finished:
                    final = msg
                elif msg.token_ids and kind == "cancel":
                    call.cancel()
                    break
                elif msg.token_ids and kind == "abort":
                    await self.stub.Abort(llm_pb2.AbortRequest(request_id=rid))
                    kind = "aborted"            # once
        except grpc.aio.AioRpcError as e:
            return e.code().name, e.details() or ""
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
        if final is None:
            code = await call.code()
            return code.name, "no final message"
        return "OK:" + common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower(), ""


def rss(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes."""
    import psutil
    return psutil.Process(pid).memory_info().rss


def kv_pool_rss(pid: int, pool_bytes: int) -> int:
    """Resident bytes of the KV pool of engine process ``pid`` (Linux): the largest anonymous
    mapping in ``/proc/PID/smaps``, which must be at least 0.9 x ``pool_bytes`` long (the K/V
    data without int8 KV's scales). The layers' mappings, made one after the other at load,
    merge into one; a small neighbour merged into it counts too. Meant for a pool larger than
    the process's other anonymous mappings (the default 2 GiB is). Raises RuntimeError when the
    largest is too small (the KV on a device or in Ray stage actors at pp > 1)."""
    largest = (0, 0)                           # (size, rss) of the largest anonymous mapping, bytes
    anonymous, size = False, 0
    with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:          # a mapping: addr perms offset dev inode [path]
                anonymous = len(head) == 5
            elif anonymous and head[0] == "Size:":
                size = int(head[1]) * 1024
            elif anonymous and head[0] == "Rss:" and size > largest[0]:
                largest = (size, int(head[1]) * 1024)
    if largest[0] < 0.9 * pool_bytes:
        raise RuntimeError(f"no anonymous mapping of the KV pool's {pool_bytes} bytes in process {pid} "
                           f"(the largest has {largest[0]})")
    return largest[1]


async def _stats(sched_stub):
    from kvmesh.v1 import scheduler_pb2
    return await sched_stub.GetStats(scheduler_pb2.GetStatsRequest())


async def _idle(sched_stub, timeout: float = 30.0):
    """GetStats once no request runs or waits and no block is in use (or after ``timeout``)."""
    end = time.monotonic() + timeout
    while True:
        st = await _stats(sched_stub)
        if all(r.num_running == r.num_waiting == r.num_used_blocks == 0 for r in st.replicas) \
                or time.monotonic() > end:
            return st
        await asyncio.sleep(0.1)


async def soak(address: str, sched_address: str, args) -> dict:
    import grpc

    from kvmesh.v1 import llm_pb2_grpc, scheduler_pb2_grpc
    kinds = plan(args.requests, args.seed)
    counts: dict[str, collections.Counter] = {k: collections.Counter() for k in KINDS}
    unexpected: list[dict] = []
    samples: list[dict] = []
    t0 = time.monotonic()
    async with grpc.aio.insecure_channel(address) as ch, grpc.aio.insecure_channel(sched_address) as sch:
        await asyncio.wait_for(ch.channel_ready(), 60)
        stub, sched_stub = llm_pb2_grpc.LLMServiceStub(ch), scheduler_pb2_grpc.SchedulerServiceStub(sch)
        from kvmesh.v1 import scheduler_pb2
        st = await _stats(sched_stub)
        engine_pids = [r.pid for r in st.replicas if r.pid]
        if not engine_pids:
            raise RuntimeError("GetStats shows no engine process (pid 0): run kvmesh serve with engine processes")
        block_size = (await sched_stub.GetModelInfo(scheduler_pb2.GetModelInfoRequest())).block_size
        pools = [r.num_blocks * block_size * round(r.kv_cache_bytes_per_token) for r in st.replicas if r.pid]
        import psutil
        serve_pid = psutil.Process(engine_pids[0]).parent().pid
        runner = Soak(stub, args.seed)

        def sample(done: int, phase: str) -> dict:
            row = {"done": done, "phase": phase, "t": round(time.monotonic() - t0, 1), "serve_rss": rss(serve_pid),
                   "engine_rss": [rss(p) for p in engine_pids], "engine_kv_rss": None}
            try:
                row["engine_kv_rss"] = [kv_pool_rss(p, b) for p, b in zip(engine_pids, pools)]
            except RuntimeError as e:      # the split is best effort: the totals still count
                print(f"  (KV pool not located: {e})", flush=True)
            kv = row["engine_kv_rss"] or [0] * len(engine_pids)
            samples.append(row)
            print(f"  {done:5d} requests  {row['t']:7.1f} s  engine RSS "
                  + " ".join(f"{b / 2**20:.0f} MiB (KV pool {k / 2**20:.0f})" for b, k in zip(row["engine_rss"], kv))
                  + f"  serve RSS {row['serve_rss'] / 2**20:.0f} MiB  ({phase})", flush=True)
            return row

        async def run(lo: int, hi: int) -> None:
            it = iter(range(lo, hi))

            async def worker():
                for i in it:
                    outcome, detail = await runner.one(kinds[i], f"soak-{i}")
                    counts[kinds[i]][outcome] += 1
                    if outcome not in KINDS[kinds[i]][1]:
                        unexpected.append({"i": i, "kind": kinds[i], "outcome": outcome, "detail": detail[:300]})
                    if (i + 1) % args.sample_every == 0:
                        sample(i + 1, "running")

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))

        warm = min(args.warmup, args.requests)
        await run(0, warm)
        await _idle(sched_stub)
        warm_row = sample(warm, "idle after warm-up")
        await run(warm, args.requests)
        final = await _idle(sched_stub)
        end_row = sample(args.requests, "idle at the end")
    wall = time.monotonic() - t0
    reps = [{"replica": r.replica, "pid": r.pid, "num_running": r.num_running, "num_waiting": r.num_waiting,
             "num_used_blocks": r.num_used_blocks, "num_cached_blocks": r.num_cached_blocks,
             "num_preemptions": r.num_preemptions, "restarts": r.restarts} for r in final.replicas]

    def growth(a: int, b: int) -> float:
        return round(100.0 * (b / a - 1.0), 2)

    def mib(xs) -> list[float]:
        return [round(x / 2**20, 1) for x in xs]

    split = warm_row["engine_kv_rss"] is not None and end_row["engine_kv_rss"] is not None
    kv_warm, kv_end = (warm_row["engine_kv_rss"], end_row["engine_kv_rss"]) if split else ([0] * len(pools),) * 2
    rest_warm = [a - k for a, k in zip(warm_row["engine_rss"], kv_warm)]
    rest_end = [a - k for a, k in zip(end_row["engine_rss"], kv_end)]

    return {
        "requests": args.requests, "concurrency": args.concurrency, "warmup": warm, "seed": args.seed,
        "wall_s": round(wall, 1), "outcomes": {k: dict(v) for k, v in counts.items()},
        "unexpected": len(unexpected), "unexpected_examples": unexpected[:20], "replicas": reps,
        "used_blocks_after": sum(r["num_used_blocks"] for r in reps),
        "engine_rss_warm_mib": mib(warm_row["engine_rss"]), "engine_rss_end_mib": mib(end_row["engine_rss"]),
        "engine_rss_growth_pct": [growth(a, b) for a, b in zip(warm_row["engine_rss"], end_row["engine_rss"])],
        "kv_pool_mib": mib(pools), "kv_pool_located": split,
        "kv_pool_rss_warm_mib": mib(kv_warm), "kv_pool_rss_end_mib": mib(kv_end),
        "engine_rss_without_kv_warm_mib": mib(rest_warm), "engine_rss_without_kv_end_mib": mib(rest_end),
        "engine_rss_without_kv_growth_pct": [growth(a, b) for a, b in zip(rest_warm, rest_end)],
        "serve_rss_warm_mib": round(warm_row["serve_rss"] / 2**20, 1),
        "serve_rss_end_mib": round(end_row["serve_rss"] / 2**20, 1),
        "serve_rss_growth_pct": growth(warm_row["serve_rss"], end_row["serve_rss"]),
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    p = command.parser(__doc__, prog="python -m bench.soak")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup", type=int, default=200, help="requests before the warm RSS sample (200)")
    p.add_argument("--sample-every", type=int, default=200, help="an RSS sample every this many requests (200)")
    p.add_argument("--max-growth", type=float, default=5.0, help="engine RSS growth allowed after warm-up, %% (5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", help="a running gateway (host:port) instead of starting kvmesh serve")
    p.add_argument("--scheduler-address", help="its scheduler (host:port), with --address")
    p.add_argument("--serve-args", default="", help="extra arguments of kvmesh serve (one string)")
    add_output_args(p, table=False)
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be >= 1")
    if bool(args.address) != bool(args.scheduler_address):
        p.error("--address and --scheduler-address go together")
    cmd = "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"soak: {args.requests} requests, concurrency {args.concurrency}, {cpu_model()}", flush=True)
    if args.address:
        result = asyncio.run(soak(args.address, args.scheduler_address, args))
    else:
        from bench.served import served
        addresses: dict = {}
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        with served(["serve", "--model", args.model, "--port", "0", "--scheduler-port", "0",
                     *args.serve_args.split()], env, "gateway", addresses) as address:
            result = asyncio.run(soak(address, addresses["scheduler"], args))
    result = {"command": cmd.strip(), "cpu": cpu_model(), "model": args.model, **result}
    for kind, c in result["outcomes"].items():
        print(f"  {kind:9s} " + ", ".join(f"{o} {n}" for o, n in sorted(c.items())))
    r = result
    print(f"unexpected outcomes: {r['unexpected']}; KV blocks in use after: {r['used_blocks_after']}; {r['wall_s']} s\n"
          f"engine RSS {r['engine_rss_warm_mib']} -> {r['engine_rss_end_mib']} MiB ({r['engine_rss_growth_pct']} %): "
          f"KV pool {r['kv_pool_rss_warm_mib']} -> {r['kv_pool_rss_end_mib']} MiB resident of {r['kv_pool_mib']}, "
          f"the rest {r['engine_rss_without_kv_warm_mib']} -> {r['engine_rss_without_kv_end_mib']} MiB "
          f"({r['engine_rss_without_kv_growth_pct']} %)"
          f"{'' if r['kv_pool_located'] else ' [KV pool not located: the rest is the whole RSS]'}\n"
          f"serve RSS {r['serve_rss_warm_mib']} -> {r['serve_rss_end_mib']} MiB ({r['serve_rss_growth_pct']} %)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    ok = (result["unexpected"] == 0 and result["used_blocks_after"] == 0
          and all(g <= args.max_growth for g in result["engine_rss_without_kv_growth_pct"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
