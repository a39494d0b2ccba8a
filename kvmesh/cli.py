"""The ``kvmesh`` command line.

    kvmesh models list                  known models, pulled or not, and where
    kvmesh models pull NAME...          fetch and convert pinned weights (see workers.registry)
    kvmesh generate --prompt TEXT       stream one completion (``--chat`` applies the chat template)
    kvmesh demo                         a two-turn PolicyDesk chat with TTFT, tokens/s, prefix-cache hits

Engine settings are the fields of :class:`kvmesh.config.EngineConfig`; every one has a flag
(:data:`ENGINE_FLAGS`) and a ``KVMESH_<FIELD>`` environment variable (a flag wins). Bad arguments
and :class:`EngineError` print ``kvmesh: error: <message>`` on stderr and exit 2.

Importing this module stays light (no torch): the engine loads only when a command needs it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from scheduler.request import EngineError, SamplingParams
from scheduler.scheduler import POLICIES

DEMO_MODEL = "qwen2.5-coder-0.5b-instruct"
DEMO_QUESTION = "travel-02"


# ---- engine settings ---------------------------------------------------------------------------

def _memory(v: str) -> float:
    from kvmesh.config import _parse_bytes
    try:
        n = _parse_bytes(v)
    except ValueError:
        n = -1.0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected bytes (2GiB, 512MB, 1e9) or a fraction (0.5), got {v!r}")
    return n


# (flag, EngineConfig field, add_argument keywords). One row per EngineConfig field.
ENGINE_FLAGS: list[tuple[str, str, dict]] = [
    ("--model", "model", dict(metavar="NAME|DIR", help="known model name (see `kvmesh models list`) or a "
                                                       "Hugging Face checkpoint directory")),
    ("--dtype", "dtype", dict(help="weights/activations: auto (bfloat16 on CUDA and bf16-capable CPUs, else float32), "
                                   "float32, bfloat16")),
    ("--kv-cache-dtype", "kv_cache_dtype", dict(help="auto (= dtype), float32, bfloat16")),
    ("--block-size", "block_size", dict(type=int, metavar="N", help="tokens per KV block (power of two; 16)")),
    ("--kv-cache-memory", "kv_cache_memory", dict(type=_memory, metavar="BYTES|FRACTION",
                                                  help="KV cache budget: bytes (2GiB) or a fraction of free "
                                                       "memory (0.5); default 2GiB")),
    ("--max-model-len", "max_model_len", dict(type=int, metavar="N",
                                              help="longest prompt + output in tokens (0 = model's, at most 8192)")),
    ("--max-num-seqs", "max_num_seqs", dict(type=int, metavar="N", help="most sequences per step (64)")),
    ("--max-num-batched-tokens", "max_num_batched_tokens", dict(type=int, metavar="N",
                                                                help="token budget per step (2048)")),
    ("--policy", "policy", dict(choices=POLICIES, help="batching policy (continuous)")),
    ("--no-prefix-caching", "enable_prefix_caching", dict(action="store_const", const=False,
                                                          help="do not reuse KV blocks of shared prefixes")),
    ("--no-chunked-prefill", "enable_chunked_prefill", dict(action="store_const", const=False,
                                                            help="prefill each prompt in one step")),
    ("--device", "device", dict(help="cpu, cuda, cuda:1 ... (cpu)")),
    ("--num-threads", "num_threads", dict(type=int, metavar="N", help="torch intra-op threads (0 = torch's default)")),
]


def add_engine_args(p: argparse.ArgumentParser, *, default_model: str | None = None) -> None:
    """Add one flag per EngineConfig field. Unset flags stay None, so ``KVMESH_*`` variables and
    EngineConfig's defaults apply (``default_model`` is the exception: it beats KVMESH_MODEL)."""
    g = p.add_argument_group("engine settings", "Each flag also reads KVMESH_<FIELD> (e.g. KVMESH_DTYPE, "
                                                "KVMESH_ENABLE_PREFIX_CACHING=0); a flag wins.")
    for flag, field, kw in ENGINE_FLAGS:
        g.add_argument(flag, dest=field, default=default_model if field == "model" else None, **kw)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings of parsed ``args`` as EngineConfig keywords (None = not given)."""
    return {field: getattr(args, field) for _, field, _ in ENGINE_FLAGS}


# ---- streaming and reporting -------------------------------------------------------------------

def add_sampling_args(p: argparse.ArgumentParser, *, max_tokens: int, temperature: float | None = None) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"most tokens to generate ({max_tokens})")
    g.add_argument("--temperature", type=float, default=temperature, metavar="T",
                   help=f"0 = greedy ({1.0 if temperature is None else temperature})")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass (1.0 = off)")
    g.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (-1 = off)")
    g.add_argument("--min-p", type=float, metavar="P", help="drop tokens below P x the top probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float, metavar="R", help="CTRL-style penalty (1.0 = off)")
    g.add_argument("--seed", type=int, help="per-request sampling seed")
    g.add_argument("--stop", nargs="+", default=[], metavar="S", help="stop strings (not included in the output)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the sampling flags; raises EngineError for a bad value."""
    kw = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
          if getattr(args, k) is not None}
    return SamplingParams(max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, **kw)


async def stream_to(out, llm, prompt, params: SamplingParams):
    """Generate ``prompt`` (text or token ids) on ``llm`` (an AsyncLLM), writing text deltas to
    ``out`` as they arrive, and return the final RequestOutput."""
    final = None
    async for ro in llm.generate(None, prompt, params):
        if ro.outputs[0].delta_text:
            out.write(ro.outputs[0].delta_text)
            out.flush()
        final = ro
    if not final.outputs[0].text.endswith("\n"):
        out.write("\n")
    out.flush()
    return final


def summary(ro) -> str:
    """One line: prompt/output tokens, TTFT, decode tokens/s (after the first token), finish reason."""
    m, c = ro.metrics, ro.outputs[0]
    n_out = len(c.token_ids)
    ttft = f"{m.ttft:.3f}" if m.ttft is not None else "-"
    span = (m.finished_time or 0) - (m.first_token_time or 0)
    decode = f"{(n_out - 1) / span:.1f}" if n_out > 1 and m.first_token_time and span > 0 else "-"
    return (f"prompt {len(ro.prompt_token_ids)} tokens ({m.num_cached_tokens} from prefix cache), "
            f"output {n_out} tokens, TTFT {ttft} s, decode {decode} tokens/s, finish {c.finish_reason}")


# ---- commands ----------------------------------------------------------------------------------

def cmd_models_list(args: argparse.Namespace) -> int:
    from workers.registry import DEFAULT_MODEL, KNOWN_MODELS, is_pulled, kvmesh_home, model_dir

    print(f"models live in {kvmesh_home() / 'models'} (KVMESH_HOME)")
    rows = [("NAME", "STATE", "UPSTREAM", "PATH")]
    for name, spec in sorted(KNOWN_MODELS.items()):
        pulled = is_pulled(name)
        label = name + (" (default)" if name == DEFAULT_MODEL else "") + (" (demo)" if name == DEMO_MODEL else "")
        rows.append((label, "pulled" if pulled else "not pulled", spec.hf_repo, str(model_dir(name)) if pulled else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[3])
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from workers.registry import pull_cli
    return pull_cli(args.names, progress=not args.quiet, force=args.force)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)          # bad values fail before the model loads
    if args.system is not None and not args.chat:
        raise EngineError("--system needs --chat")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    return asyncio.run(_generate(args, prompt, params))


async def _generate(args: argparse.Namespace, prompt: str, params: SamplingParams) -> int:
    from kvmesh.llm import AsyncLLM

    llm = AsyncLLM(**engine_kwargs(args))
    try:
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            prompt = llm.encode_chat(system + [{"role": "user", "content": prompt}])
        ro = await stream_to(sys.stdout, llm, prompt, params)
    finally:
        await llm.shutdown()
    print(summary(ro), file=sys.stderr, flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from bench import policydesk

    question = next((q for q in policydesk.questions() if q["id"] == args.question), None)
    if question is None:
        raise EngineError(f"no PolicyDesk question {args.question!r} in {policydesk.DATA_DIR / 'questions.jsonl'}")
    # The follow-up: the opening turn of the first chat about the same policy.
    follow_up = next(c["turns"][0] for c in policydesk.chats() if c["policy"] == question["policy"])
    turns = [(question["question"], question["reference_answer"]),
             (follow_up["user"], follow_up["reference_answer"])]
    params = sampling_params(args)
    system = policydesk.system_message(question["policy"])
    return asyncio.run(_demo(args, question["policy"], system, turns, params))


async def _demo(args: argparse.Namespace, policy: str, system: str, turns: list[tuple[str, str]],
                params: SamplingParams) -> int:
    from kvmesh.llm import AsyncLLM

    out = sys.stdout
    print(f"kvmesh: loading {args.model} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    llm = AsyncLLM(**engine_kwargs(args))
    cfg = llm.engine.engine.cfg
    out.write(f"PolicyDesk demo: {args.model} ({cfg.torch_dtype}, {cfg.device}), loaded in "
              f"{time.monotonic() - t0:.1f} s\nsystem: PolicyDesk prompt + policy '{policy}'\n")
    messages = [{"role": "system", "content": system}]
    try:
        for n, (user, reference) in enumerate(turns, 1):
            messages.append({"role": "user", "content": user})
            out.write(f"\n[turn {n}] user: {user}\n[turn {n}] assistant: ")
            ro = await stream_to(out, llm, llm.encode_chat(messages), params)
            messages.append({"role": "assistant", "content": ro.outputs[0].text})
            out.write(f"  (reference answer: {reference})\n  {summary(ro)}\n")
            if n > 1:
                m = ro.metrics
                out.write(f"  prefix cache: turn {n} reused {m.num_cached_tokens} of its "
                          f"{len(ro.prompt_token_ids)} prompt tokens from the earlier turns\n")
            out.flush()
    finally:
        await llm.shutdown()
    return 0


# ---- parser ------------------------------------------------------------------------------------

def register_commands(sub) -> None:
    """Add every subcommand to ``sub`` (the top-level subparsers). Each parser sets ``func``, a
    callable (args) -> exit code. New commands (``kvmesh bench ...``) register here."""
    models = sub.add_parser("models", help="list and pull known models")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    p = msub.add_parser("list", help="known models, pulled or not, and where")
    p.set_defaults(func=cmd_models_list)
    p = msub.add_parser("pull", help="download pinned weights and convert them (idempotent)")
    p.add_argument("names", nargs="+", metavar="NAME", help="known model name(s)")
    p.add_argument("--force", action="store_true", help="convert again even if already pulled")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_models_pull)

    p = sub.add_parser("generate", help="stream one completion to the terminal",
                       description="Stream a completion to stdout; a summary line (tokens, TTFT, "
                                   "decode tokens/s, finish reason) goes to stderr.")
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    add_sampling_args(p, max_tokens=256)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="a two-turn PolicyDesk chat: streamed answers, TTFT, tokens/s, prefix-cache hits",
                       description="Ask a PolicyDesk question (bench/data/policydesk) with the policy in the "
                                   "system message, then a follow-up turn that reuses the cached prefix.")
    p.add_argument("--question", default=DEMO_QUESTION, metavar="ID",
                   help=f"question id from questions.jsonl ({DEMO_QUESTION})")
    add_sampling_args(p, max_tokens=160, temperature=0.0)
    add_engine_args(p, default_model=DEMO_MODEL)
    p.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks (see docs/)")
    bsub = bench.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    # `kvmesh bench engine ARGS` hands ARGS to bench.engine_offline (see main())
    bsub.add_parser("engine", help="offline engine benchmark: naive / static / continuous (± prefix caching), "
                                   "fp32 and bf16; `kvmesh bench engine --help` for its flags")


def build_parser() -> argparse.ArgumentParser:
    from kvmesh import __version__

    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: an LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for a bad argument or an EngineError)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "engine"]:
        from bench.engine_offline import main as bench_engine
        try:
            return bench_engine(argv[2:])
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 0
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:             # --help, --version, or argparse's "error: ..." (code 2)
        return e.code if isinstance(e.code, int) else 0
    try:
        return args.func(args)
    except EngineError as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nkvmesh: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
