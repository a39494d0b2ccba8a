"""The flash attention paths (AMX tiles or AVX512-BF16 registers) on and off, alternating inside
one process (the ratios that hold on a shared host whose speed drifts between runs).

Builds one in-process engine (SmolLM2 bf16 by default) and flips the model runner's switches
between measurements: ``prefill_native`` (prefill chunks through ``kvmesh::paged_attention``
instead of SDPA) and ``native_cascade`` (decode rows sharing a policy prefix read it once, as
a group). Three measurements, each alternating the variants ``--rounds`` times, medians
printed with the CPU model:

- ``ttft``: a cold ~1,500-token PolicyDesk prompt (a fresh first token each time, so nothing is
  cached), SDPA vs kernel prefill;
- ``decode``: one decode step of ``--batch`` rows at 1.6k context on the 8 policies (rows on one
  policy share its prefix blocks), with and without cascade groups;
- ``offline``: the issue-13 workload of ``bench.peers`` (48 requests over 6 policies, output
  lengths 16-256, EOS ignored) as output tokens/s, for SDPA prefill / kernel prefill / kernel
  prefill + cascade.

Usage::

    python -m bench.runtime_ab [--model smollm2-135m-instruct] [--rounds 8] [--batch 32]
                               [--only ttft decode offline] [--threads N] [--cpu-time]

The switches only change anything on a CPU whose kernel path is ``amx`` or ``avx512bf16``
(elsewhere the runner never sets them; the script says so and stops). ``--cpu-time`` times
``ttft`` and ``decode`` by the CPU time of the process instead of the wall clock: with
``--threads 1`` on a host whose other processes take the cores now and then, it counts only
the work measured.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench import command
from bench.machine import cpu_model

CLOCK = time.perf_counter     # --cpu-time: time.process_time


def _ttft(engine, tokenizer, rounds: int) -> dict:
    from bench.profile import policy_prompts
    from kvmesh.core.sampling import SamplingParams
    runner = engine.executor.runner
    base = policy_prompts(tokenizer, 1, 1500, True)[0][::-1]
    res = {"sdpa": [], "kernel": []}
    for i in range(rounds):
        for name, flag in (("sdpa", False), ("kernel", True)):
            runner.prefill_native = flag
            ids = [100 + 2 * i + flag] + base[1:]             # uncached: a new first token
            engine.add_request(f"ttft{i}{name}", ids, SamplingParams(temperature=0.0, max_tokens=1))
            t = CLOCK()
            while engine.has_unfinished_requests():
                engine.step()
            res[name].append((CLOCK() - t) * 1e3)
    runner.prefill_native = True
    return res


def _decode(engine, tokenizer, batch: int, rounds: int) -> dict:
    from bench.profile import policy_prompts
    from kvmesh.core.sampling import SamplingParams
    runner = engine.executor.runner
    for i, ids in enumerate(policy_prompts(tokenizer, batch, 1600, False)):
        engine.add_request(f"dec{i}", ids, SamplingParams(temperature=0.0, max_tokens=4 * rounds + 8, ignore_eos=True))
    reqs = [engine.scheduler.requests[f"dec{i}"] for i in range(batch)]
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    res = {"plain": [], "cascade": []}
    for _ in range(2 * rounds):
        for name, flag in (("plain", False), ("cascade", True)):
            runner.native_cascade = flag
            t = CLOCK()
            engine.step()
            res[name].append((CLOCK() - t) * 1e3)
    for r in reqs:
        engine.abort_request(r.request_id)
    engine.step()
    runner.native_cascade = True
    return res


def _offline(model: str, rounds: int) -> dict:
    from bench.peers import runner_common as rc
    from bench.peers.compare import write_workload
    from kvmesh.llm import LLM
    from kvmesh.core.sampling import SamplingParams
    import tempfile
    from pathlib import Path

    from kvmesh.hub.pull import resolve_model
    with tempfile.TemporaryDirectory() as tmp:
        _, prompts = write_workload(Path(resolve_model(model)), 48, [16, 32, 64, 128, 256, 64], Path(tmp))
        rows = rc.load_prompts(str(prompts))
    longest = max(len(r["prompt_token_ids"]) + int(r["max_tokens"]) for r in rows)
    llm = LLM(model, dtype="bfloat16", max_num_seqs=48, max_model_len=longest + 64)
    runner = llm.engine.executor.runner
    params = [SamplingParams(temperature=0, max_tokens=int(r["max_tokens"]), ignore_eos=True) for r in rows]
    llm.generate([rows[0]["prompt_token_ids"][:64]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    variants = {"sdpa prefill": (False, False), "kernel prefill": (True, False), "kernel prefill + cascade": (True, True)}
    res = {k: [] for k in variants}
    for _ in range(rounds):
        for name, (pn, nc) in variants.items():
            runner.prefill_native, runner.native_cascade = pn, nc
            llm.engine.block_manager.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate([r["prompt_token_ids"] for r in rows], params)
            res[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    return res


def main(argv: list[str] | None = None) -> None:
    ap = command.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--only", nargs="+", default=["ttft", "decode", "offline"], choices=["ttft", "decode", "offline"])
    ap.add_argument("--threads", type=int, default=0, help="engine torch threads (0: the engine's default)")
    ap.add_argument("--cpu-time", action="store_true", help="time ttft/decode by CPU time (use with --threads 1)")
    args = ap.parse_args(argv)
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    from transformers import AutoTokenizer

    from kvmesh.core.engine_config import EngineConfig
    from scheduler.engine import LLMEngine
    from workers import kernels
    from kvmesh.hub.pull import resolve_model
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", max_num_seqs=max(64, args.batch),
                                    num_threads=args.threads))
    runner = engine.executor.runner
    print(f"# CPU: {cpu_model()}; kernel path {kernels.isa()}; torch threads {torch.get_num_threads()}; "
          f"model {args.model} bfloat16; {'CPU time of the process' if args.cpu_time else 'wall clock'}")
    if not runner.prefill_native:
        raise SystemExit("the flash attention paths are off on this CPU (kernel path is neither amx nor avx512bf16): "
                         "nothing to compare")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))

    def show(title: str, res: dict, unit: str) -> None:
        print(f"\n## {title}")
        for name, xs in res.items():
            print(f"{name:26} median {statistics.median(xs):8.1f} {unit}   ({', '.join(f'{x:.0f}' for x in xs)})")

    if "ttft" in args.only:
        show("cold TTFT, 1,500-token prompt", _ttft(engine, tokenizer, args.rounds), "ms")
    if "decode" in args.only:
        show(f"decode step, batch {args.batch} at 1.6k context on 8 policies", _decode(engine, tokenizer, args.batch,
                                                                                      args.rounds), "ms")
    if "offline" in args.only:
        del engine
        show("offline issue-13 workload (48 requests)", _offline(args.model, max(1, args.rounds // 4)), "tok/s")


if __name__ == "__main__":
    main()
