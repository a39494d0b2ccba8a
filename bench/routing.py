"""KV-aware routing benchmark: multi-turn PolicyDesk chats across the replicas of one scheduler
service, routed by ``prefix`` / ``round_robin`` / ``random`` / ``load``, plus a reference: one
replica whose KV pool holds everything (its prefix-cache hit rate is the ceiling).

Workload: ``--sessions`` chats of ``policydesk/data/chats.jsonl`` (policies in rotation,
over the first ``--policies`` policies), started in a seeded random order (so that arrival
order does not line up with the policies: round robin would split them evenly by accident),
session k at ``k x --stagger`` seconds (default 0: all at t=0), each sending ``--turns`` turns
one after the other. A turn's prompt is the policy's system message + the
conversation so far (earlier answers included) through the model's chat template, tokenized
here and sent as token ids to ``SchedulerService.Submit`` with the session's id; greedy,
exactly ``--max-tokens`` output tokens (EOS ignored). Each configuration is a fresh
``kvmesh scheduler`` subprocess (executor ``local``: every replica in that one process, one
engine thread each with ``--threads`` torch threads; the reference gets ``replicas x threads``).

KV pools: the working set is every policy's system message once plus every session's
conversation (its last prompt + answer, system message excluded), in tokens; each replica's
pool holds ``--pool-fraction`` of it (default 0.6: one replica cannot hold every policy), the
reference's ``--reference-fraction`` (1.5).

Measured per configuration, client side: prefix-cache hit rate (cached prompt tokens /
prompt tokens, from each response's usage), TTFT (request sent → first token message)
p50/p90 over all turns and p90 over the follow-up turns (2 and later: the ones routing can
help; every configuration must compute each policy's first turn), output tokens/s over the whole run (wall = first request to last answer), requests
per replica, and the scheduler's GetStats (preemptions, prefix-routed requests, fallbacks).

Usage::

    python -m bench.routing --out docs/routing.json --markdown docs/routing.md
    python -m bench.routing --sessions 2 --turns 2 --routing prefix      # smoke test
    python -m bench.routing --table docs/routing.json                      # print the table again
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time

import policydesk
from bench import command
from bench.engine_offline import percentile
from bench.markdown import add_output_args, command_line, run_meta, saved_rows, write_json, write_markdown
from bench.served import served

MARK_BEGIN, MARK_END = "<!-- bench:routing begin -->", "<!-- bench:routing end -->"


# ---- workload ---------------------------------------------------------------------------------

def pick_chats(sessions: int, policies: int, seed: int = 0) -> list[dict]:
    """``sessions`` chats, policies in rotation over the first ``policies`` (sorted) policies,
    then shuffled (seeded). Raises SystemExit when the data set has too few."""
    by_policy: dict[str, list[dict]] = {}
    for c in policydesk.chats():
        by_policy.setdefault(c["policy"], []).append(c)
    names = sorted(by_policy)[:policies]
    ordered = [by_policy[p][k] for k in range(max(map(len, by_policy.values()))) for p in names
               if k < len(by_policy[p])]
    if sessions > len(ordered):
        raise SystemExit(f"--sessions {sessions}: only {len(ordered)} chats on {len(names)} policies")
    chosen = ordered[:sessions]
    random.Random(seed).shuffle(chosen)
    return chosen


def working_set_tokens(tok, chats: list[dict], turns: int, max_tokens: int) -> int:
    """Tokens of every system message once + every conversation after its system message
    (answers counted as ``max_tokens`` each, estimated with a placeholder answer)."""
    total = sum(len(encode(tok, [system(p)])) for p in {c["policy"] for c in chats})
    for c in chats:
        msgs = [system(c["policy"])]
        for t in c["turns"][:turns]:
            msgs += [{"role": "user", "content": t["user"]}, {"role": "assistant", "content": "x " * max_tokens}]
        total += len(encode(tok, msgs)) - len(encode(tok, msgs[:1]))
    return total


def system(policy: str) -> dict:
    return {"role": "system", "content": policydesk.system_message(policy)}


def encode(tok, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tok.encode(text, add_special_tokens=False)


async def run_sessions(address: str, tok, chats: list[dict], args):
    """Every session concurrently, its turns in order. Returns (wall seconds, one row per turn,
    the scheduler's GetStatsResponse at the end)."""
    import grpc
    from kvmesh.v1 import common_pb2, scheduler_pb2 as pb, scheduler_pb2_grpc

    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        async def warm_up():        # first-call costs, not measured (no full block: nothing cached)
            call = stub.Submit(pb.SubmitRequest(prompt_token_ids=list(range(1, 9)),
                                                sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0)))
            return [m async for m in call]

        await asyncio.gather(*(warm_up() for _ in range(args.replicas)))

        async def session(i: int, chat: dict) -> list[dict]:
            await asyncio.sleep(i * args.stagger)
            msgs, rows = [system(chat["policy"])], []
            for k, t in enumerate(chat["turns"][:args.turns]):
                msgs.append({"role": "user", "content": t["user"]})
                ids = encode(tok, msgs, generation_prompt=True)
                t0, first, answer, last = time.perf_counter(), None, [], None
                async for m in stub.Submit(pb.SubmitRequest(prompt_token_ids=ids, sampling=sampling,
                                                            session_id=f"s{i}")):
                    if m.token_ids and first is None:
                        first = time.perf_counter()
                    answer += m.token_ids
                    last = m
                msgs.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
                rows.append({"session": i, "policy": chat["policy"], "turn": k, "replica": last.replica,
                             "prompt_tokens": last.usage.prompt_tokens,
                             "cached_tokens": last.usage.cached_prompt_tokens,
                             "output_tokens": len(answer), "ttft": first - t0})
            return rows

        t0 = time.perf_counter()
        per_session = await asyncio.gather(*(session(i, c) for i, c in enumerate(chats)))
        wall = time.perf_counter() - t0
        stats = await stub.GetStats(pb.GetStatsRequest())
    rows = [r for s in per_session for r in s]
    return wall, rows, stats


# ---- one configuration ------------------------------------------------------------------------

def run_config(name: str, routing: str, replicas: int, blocks: int, per_block: int, threads: int,
               tok, chats, args) -> dict:
    """Start a ``kvmesh scheduler`` subprocess, run the sessions, stop it; one summary row."""
    env = dict(os.environ, KVMESH_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    for k in [k for k in env if k.startswith("KVMESH_SCHEDULER_") or k == "KVMESH_REDIS_URL"]:
        del env[k]
    cmd = ["scheduler", "--executor", "local", "--port", "0",
           "--replicas", str(replicas), "--routing", routing, "--model", args.model, "--dtype", args.dtype,
           "--kv-cache-memory", str(blocks * per_block), "--max-model-len", str(args.max_model_len)]
    if args.redis_url and routing == "prefix":
        cmd += ["--redis-url", args.redis_url, "--index-prefix", f"kvmesh-bench-{os.getpid()}-{name}"]
    print(f"running {name}: {replicas} replica(s) x {blocks} blocks, routing {routing} ...", file=sys.stderr, flush=True)
    with served(cmd, env, "scheduler") as address:
        wall, rows, stats = asyncio.run(run_sessions(address, tok, chats, args))
    ttft = [r["ttft"] for r in rows]
    warm = [r["ttft"] for r in rows if r["turn"] > 0] or ttft
    prompt, cached = sum(r["prompt_tokens"] for r in rows), sum(r["cached_tokens"] for r in rows)
    per_replica = [sum(r["replica"] == i for r in rows) for i in range(replicas)]
    return {"config": name, "routing": routing, "replicas": replicas, "blocks_per_replica": blocks,
            "threads_per_replica": threads, "requests": len(rows), "prompt_tokens": prompt,
            "cached_prompt_tokens": cached, "hit_rate": cached / prompt, "ttft_p50_s": statistics.median(ttft),
            "ttft_p90_s": percentile(ttft, 90), "ttft_p90_followup_s": percentile(warm, 90), "output_tokens": sum(r["output_tokens"] for r in rows),
            "wall_s": wall, "output_tok_s": sum(r["output_tokens"] for r in rows) / wall,
            "requests_per_replica": per_replica,
            "preemptions": sum(r.num_preemptions for r in stats.replicas),
            "prefix_routed": stats.prefix_routed, "routing_fallbacks": stats.routing_fallbacks, "turns": rows}


# ---- report -----------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["config"] == "reference"), None)
    lines = ["| config | replicas x blocks | hit rate | vs ceiling | TTFT p50 s | TTFT p90 s "
             "| TTFT p90 follow-ups s | output tok/s | wall s | requests per replica | preemptions |", "|" + "---|" * 11]
    for r in rows:
        vs = f"{r['hit_rate'] / ref['hit_rate']:.0%}" if ref and ref["hit_rate"] else "-"
        lines.append(f"| {r['config']} | {r['replicas']} x {r['blocks_per_replica']} | {r['hit_rate']:.1%} | {vs} "
                     f"| {r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | {r['ttft_p90_followup_s']:.2f} | {r['output_tok_s']:.1f} | {r['wall_s']:.1f} "
                     f"| {'/'.join(map(str, r['requests_per_replica']))} | {r['preemptions']} |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> str:
    """The issue's targets: prefix hit rate >= 90% of the ceiling, TTFT p90 >= 2x better than round robin."""
    by = {r["config"]: r for r in rows}
    out = []
    if "prefix" in by and "reference" in by:
        v = by["prefix"]["hit_rate"] / by["reference"]["hit_rate"]
        out.append(f"prefix hit rate / single-replica ceiling = {v:.0%} (target >= 90%: {'met' if v >= 0.9 else 'NOT met'})")
    if "prefix" in by and "round_robin" in by:
        for key, what in (("ttft_p90_s", "all turns"), ("ttft_p90_followup_s", "follow-up turns")):
            v = by["round_robin"][key] / by["prefix"][key]
            out.append(f"TTFT p90 ({what}) round_robin / prefix = {v:.2f}x (target >= 2x: {'met' if v >= 2 else 'NOT met'})")
    return "\n".join(f"- {line}" for line in out)


def main(argv=None) -> int:
    ap = command.parser(__doc__)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--policies", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="session order")
    ap.add_argument("--stagger", type=float, default=0.0, help="seconds between session starts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--routing", nargs="+", default=["prefix", "round_robin", "random", "load"])
    ap.add_argument("--no-reference", action="store_true", help="skip the single-replica reference")
    ap.add_argument("--pool-fraction", type=float, default=0.6, help="each replica's KV pool / working set")
    ap.add_argument("--reference-fraction", type=float, default=1.5, help="the reference's KV pool / working set")
    ap.add_argument("--redis-url", default="", help="prefix routing through this Redis (default: in-process index)")
    add_output_args(ap, markers="routing")
    args = ap.parse_args(argv)
    if args.table:
        rows = saved_rows(args.table)
        print(table(rows) + "\n\n" + targets(rows))
        return 0

    from transformers import AutoTokenizer

    from kvmesh.core.engine_config import EngineConfig
    from workers.kv_cache import bytes_per_block, kv_dtype
    from workers.checkpoint import load_config
    from kvmesh.hub.pull import resolve_model

    t_start = time.time()
    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ecfg, m = EngineConfig(model=args.model, dtype=args.dtype), load_config(model_dir)
    per_block = bytes_per_block(m.num_layers, ecfg.block_size, m.num_kv_heads, m.head_dim,
                                kv_dtype(ecfg.kv_cache_dtype, ecfg.torch_dtype))
    chats = pick_chats(args.sessions, args.policies, args.seed)
    ws = working_set_tokens(tok, chats, args.turns, args.max_tokens)
    need = -(-(args.max_model_len) // ecfg.block_size)            # one longest sequence must fit
    blocks = max(need, round(args.pool_fraction * ws / ecfg.block_size))
    ref_blocks = max(need, round(args.reference_fraction * ws / ecfg.block_size))
    workload = (f"{len(chats)} sessions x {args.turns} turns over {len({c['policy'] for c in chats})} policies, "
                f"session starts {args.stagger} s apart, "
                f"{args.max_tokens} output tokens per turn, working set {ws} tokens, dtype {ecfg.torch_dtype}, "
                f"executor local")
    print(f"workload: {workload}", file=sys.stderr)
    rows = []
    for routing in args.routing:
        rows.append(run_config(routing, routing, args.replicas, blocks, per_block, args.threads, tok, chats, args))
        print(table(rows[-1:]), file=sys.stderr)
    if not args.no_reference:
        rows.append(run_config("reference", "load", 1, ref_blocks, per_block, args.threads * args.replicas,
                               tok, chats, args))
    meta = run_meta(command_line("python -m bench.routing", argv), elapsed_s=time.time() - t_start, workload=workload,
                    working_set_tokens=ws)
    print(table(rows) + "\n\n" + targets(rows))
    write_json(args.out, {"meta": meta, "rows": rows})
    if args.markdown:
        write_markdown(args.markdown, MARK_BEGIN, MARK_END, meta, table(rows), targets(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
