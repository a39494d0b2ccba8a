"""``kvmesh generate``: stream one completion to the terminal, with the engine in this process or
through a gateway (``--server``); a summary line (tokens, TTFT, decode tokens/s) on stderr."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvmesh.cli.remote import add_server_arg, connect, response_summary, rpc_error, stream_responses
from kvmesh.cli.sampling import add_sampling_args, sampling_kwargs, sampling_params
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import SettingsError
from kvmesh.core.flags import add_engine_args, engine_kwargs, given_flags
from kvmesh.core.sampling import SamplingParams


def register(sub) -> None:
    """Add ``generate`` to the top-level subparsers ``sub``."""
    p = sub.add_parser("generate", help="stream one completion to the terminal",
                       description="Stream a completion to stdout; a summary line (tokens, TTFT, "
                                   "decode tokens/s, finish reason) goes to stderr. With --server, "
                                   "through a kvmesh gateway; otherwise the engine runs in this process.")
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    add_server_arg(p, required=False)
    add_sampling_args(p, max_tokens=256)
    add_engine_args(p)
    p.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    """``kvmesh generate``: exit code 0; bad flags raise SettingsError (exit 2)."""
    params = sampling_params(args)          # bad values fail before the model loads
    if args.system is not None and not args.chat:
        raise SettingsError("--system needs --chat")
    if args.server is not None:
        given = given_flags(args, EngineConfig, skip=("model",))
        if given:
            raise SettingsError(f"{', '.join(given)}: engine settings are the server's, not for --server")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.server is not None:
        return _generate_remote(args, prompt)
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


def _generate_remote(args: argparse.Namespace, prompt: str) -> int:
    """``generate --server``: the Generate RPC (Chat with ``--chat``) of a gateway."""
    import grpc

    kw = sampling_kwargs(args)
    try:
        with connect(args.server, args.wait, args.api_key, args.tls_ca_file) as client:
            if args.chat:
                system = [{"role": "system", "content": args.system}] if args.system else []
                call = client.chat(system + [{"role": "user", "content": prompt}], model=args.model or "", **kw)
            else:
                call = client.generate(prompt, model=args.model or "", **kw)
            _, final = stream_responses(sys.stdout, call)
    except grpc.RpcError as e:
        return rpc_error(e, args.server)
    print(response_summary(final), file=sys.stderr, flush=True)
    return 0
