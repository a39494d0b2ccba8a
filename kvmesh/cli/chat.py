"""``kvmesh chat``: an interactive multi-turn chat through a gateway's Chat RPC."""

from __future__ import annotations

import argparse
import sys

from kvmesh.cli.remote import add_server_arg, connect, response_summary, rpc_error, stream_responses
from kvmesh.cli.sampling import add_sampling_args, sampling_kwargs


def register(sub) -> None:
    """Add ``chat`` to the top-level subparsers ``sub``."""
    p = sub.add_parser("chat", help="multi-turn chat through a kvmesh gateway",
                       description="Chat through a gateway's Chat RPC: each line of stdin is a user turn "
                                   "(a pipe works too; EOF ends), answers stream to stdout, one summary "
                                   "line per turn (tokens, prefix-cache hits, TTFT, tokens/s) goes to stderr. "
                                   "The whole conversation is sent each turn under one session id, so "
                                   "earlier turns come from the prefix cache. /reset starts over.")
    add_server_arg(p, required=True)
    p.add_argument("--system", metavar="TEXT", help="system message")
    p.add_argument("--model", metavar="NAME", help="model name (default: the served model)")
    p.add_argument("--session-id", metavar="ID", help="session id (default: a new random one)")
    add_sampling_args(p, max_tokens=256)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Multi-turn chat through a gateway's Chat RPC: each stdin line is a user turn (a prompt
    on a terminal); the whole conversation goes with every turn, under one session id."""
    import grpc
    from kvmesh.client import new_session_id

    kw = sampling_kwargs(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    session = args.session_id or new_session_id()
    try:
        client = connect(args.server, args.wait, args.api_key, args.tls_ca_file)
    except grpc.RpcError as e:
        return rpc_error(e, args.server)
    rc, n = 0, 0
    history = list(system)
    with client:
        if interactive:
            try:
                import readline  # noqa: F401  (line editing for input())
            except ImportError:
                pass
            print(f"kvmesh: chat with {args.server} (session {session}); /reset starts over, Ctrl-D ends",
                  file=sys.stderr, flush=True)
        while True:
            try:
                line = input("> ") if interactive else sys.stdin.readline()
            except EOFError:
                break
            if not line:                    # EOF of a pipe
                break
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                history = list(system)
                print("kvmesh: conversation reset", file=sys.stderr, flush=True)
                continue
            if text in ("/quit", "/exit"):
                break
            history.append({"role": "user", "content": text})
            call = None
            try:
                call = client.chat(history, model=args.model or "", session_id=session, **kw)
                answer, final = stream_responses(sys.stdout, call)
            except grpc.RpcError as e:
                history.pop()
                rc = rpc_error(e, args.server)
                if rc != 2 or not interactive:
                    return rc
                continue
            except KeyboardInterrupt:       # stop this answer (the request is aborted), keep chatting
                if call is not None:
                    call.cancel()
                history.pop()
                if not interactive:
                    raise
                print("\nkvmesh: answer interrupted", file=sys.stderr, flush=True)
                continue
            history.append({"role": "assistant", "content": answer})
            n += 1
            print(f"turn {n}: {response_summary(final)}", file=sys.stderr, flush=True)
    return rc
