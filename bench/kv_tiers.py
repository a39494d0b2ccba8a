"""KV tiers benchmark: a returning PolicyDesk chat whose KV blocks left the pool, with and
without the tiers below it (kvstore/tiers.py).

Workload: ``--chats`` chats of ``policydesk/data/chats.jsonl`` (different policies first).
Turn 1 (the policy's system message + the first question, ~1.5-1.7k tokens through the chat
template) runs; its answer (greedy, ``--max-tokens``, EOS ignored) joins the conversation; then
turn 2 (the whole conversation + the second question) runs, and its time to first token
(TTFT: the request's arrival in the engine to its first token) is measured.

Scenarios (in-process ``LLMEngine``s, every configuration's engines loaded at once and run in
turn, chat by chat, so that other load on a shared machine slows them alike; ``--threads``
torch threads):

- ``evicted``: turn 2 comes back to the same replica after the pool lost the chat
  (``reset_prefix_cache``: the pool only; with a host tier the blocks move down to it):
  ``recompute`` (no tiers), ``host`` (``--kv-offload-host-memory``), ``redis`` (Redis tier only,
  written through at turn 1).
- ``other-replica``: turn 2 goes to a second engine (as after a restart or a load shift):
  ``recompute`` (no shared tier) and ``redis`` (both engines on one Redis tier).

Greedy outputs of turn 2 are compared across every configuration (identical = ``same``).

Usage::

    python -m bench.kv_tiers                          # prints the table
    python -m bench.kv_tiers --out docs/kv_tiers.json --chats 6
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid

import policydesk
from bench import command
from bench.engine_offline import percentile
from bench.machine import cpu_model
from bench.markdown import add_output_args


def conversations(n: int) -> list[dict]:
    """``n`` PolicyDesk chats of two turns or more, policies in rotation."""
    by_policy: dict[str, list[dict]] = {}
    for c in policydesk.chats():
        if len(c["turns"]) >= 2:
            by_policy.setdefault(c["policy"], []).append(c)
    names = sorted(by_policy)
    out = [by_policy[p][k] for k in range(max(map(len, by_policy.values()))) for p in names if k < len(by_policy[p])]
    return out[:n]


def encode(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def run_one(engine, ids: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """(output ids, TTFT seconds, cached prompt tokens) of one request run alone."""
    from kvmesh.core.sampling import SamplingParams
    rid = uuid.uuid4().hex
    req = engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    return list(req.output_token_ids), req.first_token_time - req.arrival_time, req.num_cached_tokens


def make_engine(args, **kw):
    from kvmesh.core.engine_config import EngineConfig
    from scheduler.engine import LLMEngine
    cfg = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                       max_model_len=4096, num_threads=args.threads, **kw)
    return LLMEngine(cfg)


CONFIGS = [("evicted", "recompute"), ("evicted", "host"), ("evicted", "redis"),
           ("other-replica", "recompute"), ("other-replica", "redis")]


def setup(args, scenario: str, config: str) -> dict:
    """The engines of one configuration: ``a`` serves turn 1, ``b`` turn 2 (``a`` itself when
    the chat comes back to the same replica)."""
    prefix = f"kvmesh-bench-{uuid.uuid4().hex[:8]}"
    tiers = {"recompute": {}, "host": dict(kv_offload_host_memory=args.host_memory),
             "redis": dict(kv_offload_redis_url=args.redis_url, kv_offload_prefix=prefix)}[config]
    a = make_engine(args, **tiers)
    b = make_engine(args, **tiers) if scenario == "other-replica" else a
    for e in {id(a): a, id(b): b}.values():
        run_one(e, list(range(1, 40)), 2)                  # first-call costs, not measured
    return {"scenario": scenario, "config": config, "a": a, "b": b, "prefix": prefix, "rows": []}


def turn_pair(args, tok, cfg: dict, chat: dict) -> None:
    a, b = cfg["a"], cfg["b"]
    msgs = [{"role": "system", "content": policydesk.system_message(chat["policy"])},
            {"role": "user", "content": chat["turns"][0]["user"]}]
    ids1 = encode(tok, msgs)
    out1, ttft1, _ = run_one(a, ids1, args.max_tokens)
    msgs += [{"role": "assistant", "content": tok.decode(out1, skip_special_tokens=True)},
             {"role": "user", "content": chat["turns"][1]["user"]}]
    ids2 = encode(tok, msgs)
    if cfg["scenario"] == "evicted":
        a.reset_prefix_cache(offload=True)                  # the pool forgets; a host tier keeps
        a.step()                                            # (copied out before the next step)
    if a.tiers is not None:
        a.tiers.flush()                                     # the chat comes back later: writes are done
    out2, ttft2, cached = run_one(b, ids2, args.max_tokens)
    for e in {id(a): a, id(b): b}.values():                 # every chat starts cold
        e.reset_prefix_cache()
        if e.tiers is not None and e.tiers.host is not None:
            e.tiers.host._values.clear()
            e.tiers.host.bytes = 0
    cfg["rows"].append({"chat": chat["id"], "prompt1": len(ids1), "prompt2": len(ids2), "ttft1": ttft1,
                        "ttft2": ttft2, "cached2": cached, "out2": out2})


def finish(args, cfg: dict) -> dict:
    a, b, rows = cfg["a"], cfg["b"], cfg["rows"]
    st = b.snapshot()
    if a.tiers is not None and a.tiers.redis is not None:
        import redis
        r = redis.Redis.from_url(args.redis_url)
        keys = list(r.scan_iter(match=f"{cfg['prefix']}:*", count=1000))
        if keys:
            r.delete(*keys)
    for e in {id(a): a, id(b): b}.values():
        e.shutdown()
    t2 = [r["ttft2"] for r in rows]
    return {"scenario": cfg["scenario"], "config": cfg["config"], "rows": rows,
            "ttft2_median": statistics.median(t2), "ttft2_p90": percentile(t2, 90),
            "cached2_mean": statistics.mean(r["cached2"] for r in rows),
            "prompt2_mean": statistics.mean(r["prompt2"] for r in rows),
            "tier_load_seconds": st.kv_tier_load_seconds, "host_hits": st.kv_tier_host_hits,
            "redis_hits": st.kv_tier_redis_hits,
            "bytes_loaded": st.kv_tier_host_bytes_loaded + st.kv_tier_redis_bytes_loaded}


def table(results: list[dict]) -> str:
    base = {r["scenario"]: r for r in results if r["config"] == "recompute"}
    ref_out = {row["chat"]: row["out2"] for row in results[0]["rows"]}
    lines = ["| scenario | config | turn-2 prompt tokens | cached | TTFT median | TTFT p90 | speed-up (median / p90) "
             "| MB loaded per turn | greedy output |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = base[r["scenario"]]
        same = all(row["out2"] == ref_out[row["chat"]] for row in r["rows"])
        mb = r["bytes_loaded"] / len(r["rows"]) / 1e6
        lines.append(f"| {r['scenario']} | {r['config']} | {r['prompt2_mean']:.0f} | {r['cached2_mean']:.0f} "
                     f"| {r['ttft2_median'] * 1e3:.0f} ms | {r['ttft2_p90'] * 1e3:.0f} ms "
                     f"| {b['ttft2_median'] / r['ttft2_median']:.1f}x / {b['ttft2_p90'] / r['ttft2_p90']:.1f}x "
                     f"| {mb:.1f} | {'same' if same else 'DIFFERENT'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = command.parser(__doc__, prog="python -m bench.kv_tiers")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--host-memory", default="2GiB")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--scenarios", default="evicted,other-replica")
    add_output_args(p, table=False)
    args = p.parse_args(argv)
    from kvmesh.hub.pull import resolve_model
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    chats = conversations(args.chats)
    scenarios = args.scenarios.split(",")
    cfgs = [setup(args, sc, c) for sc, c in CONFIGS if sc in scenarios]
    t0 = time.perf_counter()
    for i, chat in enumerate(chats):            # configurations interleaved per chat: a machine
        for cfg in cfgs:                        # shared with other jobs slows them alike
            turn_pair(args, tok, cfg, chat)
        print(f"chat {i + 1}/{len(chats)}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    results = [finish(args, cfg) for cfg in cfgs]
    print(f"CPU: {cpu_model()}; model {args.model}, dtype {args.dtype}, {args.threads} threads, "
          f"{len(chats)} chats, {args.max_tokens} output tokens per turn")
    print(table(results))
    if args.out:
        meta = {"cpu": cpu_model(), "model": args.model, "dtype": args.dtype, "threads": args.threads,
                "chats": len(chats), "max_tokens": args.max_tokens}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
