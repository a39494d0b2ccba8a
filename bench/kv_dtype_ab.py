"""Decode ITL with a quantized KV cache against a bfloat16 one, alternating inside one process.

Issue 13's target "int8 KV decode ITL <= 1.1x bf16 KV ITL" as a paired measurement: one engine
per KV cache dtype (``--kv-dtypes``, the first is the baseline; same model, same weights format,
same threads) in one process, each holding ``B`` PolicyDesk rows decoding at ~1.6k tokens of
context (row i on the i-th of the 8 policies, as ``bench.profile``); then one decode step of each
engine in turn, ``--rounds`` times, so that a host whose speed drifts moves every variant alike.
Prints, per batch size, the median step time (= ITL of every row) of each dtype and its ratio to
the baseline's, with the CPU model.

Usage::

    python -m bench.kv_dtype_ab [--model smollm2-135m-instruct] [--batch 1 8 32] [--rounds 24]
                                [--kv-dtypes auto int8 fp8] [--threads N] [--out ab.json]
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench import command
from bench.machine import cpu_model


def _fill(engine, tokenizer, batch: int, steps: int, tag: str) -> list:
    """Add ``batch`` requests at 1.6k context and step until each has its first token."""
    from bench.profile import policy_prompts
    from kvmesh.core.sampling import SamplingParams
    for i, ids in enumerate(policy_prompts(tokenizer, batch, 1600, False)):
        engine.add_request(f"{tag}{i}", ids, SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    reqs = [engine.scheduler.requests[f"{tag}{i}"] for i in range(batch)]
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    return reqs


def measure(engines: dict, tokenizer, batch: int, rounds: int) -> dict[str, list[float]]:
    """``{kv dtype: [step ms, ...]}``: ``rounds`` decode steps of each engine, interleaved."""
    reqs = {name: _fill(eng, tokenizer, batch, rounds + 2, f"b{batch}") for name, eng in engines.items()}
    for eng in engines.values():        # one warm step each at this batch size
        eng.step()
    res: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, eng in engines.items():
            t = time.perf_counter()
            eng.step()
            res[name].append((time.perf_counter() - t) * 1e3)
    for name, eng in engines.items():
        for r in reqs[name]:
            eng.abort_request(r.request_id)
        eng.step()
        assert eng.stats().used == 0
    return res


def main(argv: list[str] | None = None) -> None:
    ap = command.parser(__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto", "int8"])
    ap.add_argument("--threads", type=int, default=0, help="engine torch threads (0: the engine's default)")
    ap.add_argument("--out", default=None, help="write the step times as JSON here")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.hub.pull import resolve_model
    from scheduler.engine import LLMEngine
    from workers import kernels

    engines = {kv: LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", kv_cache_dtype=kv,
                                          max_num_seqs=max(64, max(args.batch)), num_threads=args.threads))
               for kv in args.kv_dtypes}
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    print(f"# CPU: {cpu_model()}; kernel path {kernels.isa()}; torch threads {torch.get_num_threads()}; "
          f"model {args.model} bfloat16; KV cache dtypes {', '.join(args.kv_dtypes)} (baseline {args.kv_dtypes[0]}); "
          f"wall clock, {args.rounds} interleaved steps each")
    out = {"cpu": cpu_model(), "model": args.model, "rounds": args.rounds, "batches": {}}
    base = args.kv_dtypes[0]
    print("\n| batch | " + " | ".join(f"{kv} step ms (median)" for kv in args.kv_dtypes) + " | "
          + " | ".join(f"{kv} / {base}" for kv in args.kv_dtypes[1:]) + " |")
    print("|---" * (2 * len(args.kv_dtypes)) + "|")
    for b in args.batch:
        res = measure(engines, tokenizer, b, args.rounds)
        med = {kv: statistics.median(xs) for kv, xs in res.items()}
        print(f"| {b} | " + " | ".join(f"{med[kv]:.2f}" for kv in args.kv_dtypes) + " | "
              + " | ".join(f"{med[kv] / med[base]:.3f}x" for kv in args.kv_dtypes[1:]) + " |", flush=True)
        out["batches"][str(b)] = {"step_ms": res, "median_ms": med}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
