"""``kvmesh demo``: the mesh as ``kvmesh serve`` starts it (the scheduler service and the gateway in
this process, each replica's engine in a process of its own) and a two-turn PolicyDesk chat
through its gateway, with TTFT, decode tokens/s and the prefix-cache hits of the second turn."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from kvmesh.cli.remote import response_summary, rpc_error, stream_responses
from kvmesh.cli.sampling import add_sampling_args, sampling_kwargs
from kvmesh.cli.services import run_services, service_configs
from kvmesh.core.errors import SettingsError
from kvmesh.core.flags import add_engine_args, add_scheduler_args

DEMO_MODEL = "qwen2.5-coder-1.5b-instruct"
DEMO_QUESTION = "travel-02"


def register(sub) -> None:
    """Add ``demo`` to the top-level subparsers ``sub``."""
    p = sub.add_parser("demo", help="a two-turn PolicyDesk chat through a mesh started here: streamed answers, "
                                    "TTFT, tokens/s, prefix-cache hits",
                       description="Start the mesh as kvmesh serve does (the scheduler service and the gateway in "
                                   "this process, each replica's engine in a process of its own) on free ports, "
                                   "ask a PolicyDesk question (policydesk/data) with the policy in the system "
                                   "message through the gateway's Chat RPC, then a follow-up turn in the same "
                                   "session that reuses the cached prefix.")
    p.add_argument("--question", default=DEMO_QUESTION, metavar="ID",
                   help=f"question id from questions.jsonl ({DEMO_QUESTION})")
    add_sampling_args(p, max_tokens=160, temperature=0.0)
    add_scheduler_args(p, listen=None)
    add_engine_args(p, default_model=DEMO_MODEL)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``kvmesh demo``: the mesh on free loopback ports, the two turns, then the mesh stops."""
    import grpc

    import policydesk

    question = next((q for q in policydesk.questions() if q["id"] == args.question), None)
    if question is None:
        raise SettingsError(f"no PolicyDesk question {args.question!r} in {policydesk.DATA_DIR / 'questions.jsonl'}")
    # The follow-up: the opening turn of the first chat about the same policy.
    follow_up = next(c["turns"][0] for c in policydesk.chats() if c["policy"] == question["policy"])
    turns = [(question["question"], question["reference_answer"]),
             (follow_up["user"], follow_up["reference_answer"])]
    kw = sampling_kwargs(args)
    system = policydesk.system_message(question["policy"])
    # The mesh on free loopback ports; the other scheduler and gateway settings from flags / env.
    engine_cfg, sched_cfg, gw_cfg = service_configs(args, host="127.0.0.1", port=0)
    gw_cfg = gw_cfg.replace(host="127.0.0.1", port=0)
    try:
        return run_services(_demo(engine_cfg, sched_cfg, gw_cfg, question["policy"], system, turns, kw))
    except grpc.RpcError as e:
        return rpc_error(e, "the demo's gateway")


async def _demo(engine_cfg, sched_cfg, gw_cfg, policy: str, system: str, turns: list[tuple[str, str]],
                kw: dict) -> int:
    from kvmesh import serve
    from kvmesh.client import Client

    serve.announce(f"starting the mesh: {engine_cfg.model}, {sched_cfg.resolved_executor()} executor, pp {sched_cfg.pp}, "
                   f"{sched_cfg.replicas} replica(s) ...")
    t0 = time.monotonic()

    async def chat(mesh) -> int:
        client = Client(mesh.gateway_address)
        try:
            return await asyncio.to_thread(_demo_chat, client, mesh, time.monotonic() - t0, engine_cfg, sched_cfg,
                                           policy, system, turns, kw)
        finally:
            client.close()          # on Ctrl-C: cancels the stream in flight, so the thread ends

    return await serve.run_services(lambda mesh: serve.start_mesh(mesh, sched_cfg, engine_cfg, gw_cfg),
                                    work=chat, grace=1.0)


def _demo_chat(client, mesh, startup: float, engine_cfg, sched_cfg, policy: str, system: str,
               turns: list[tuple[str, str]], kw: dict) -> int:
    """The demo's conversation (in a thread, while the loop serves the mesh)."""
    from kvmesh.client import new_session_id

    out = sys.stdout
    client.wait_ready(timeout=60)
    info = client.list_models()[0]
    out.write(f"PolicyDesk demo: {info.name} ({info.dtype}, {engine_cfg.device}), mesh up in {startup:.1f} s: "
              f"gateway {mesh.gateway_address} -> scheduler {mesh.scheduler_address} "
              f"({sched_cfg.resolved_executor()} executor, pp {sched_cfg.pp})\n"
              f"system: PolicyDesk prompt + policy '{policy}'\n")
    session = new_session_id()
    messages = [{"role": "system", "content": system}]
    for n, (user, reference) in enumerate(turns, 1):
        messages.append({"role": "user", "content": user})
        out.write(f"\n[turn {n}] user: {user}\n[turn {n}] assistant: ")
        answer, final = stream_responses(out, client.chat(messages, session_id=session, **kw))
        messages.append({"role": "assistant", "content": answer})
        out.write(f"  (reference answer: {reference})\n  {response_summary(final)}\n")
        if n > 1:
            u = final.usage
            out.write(f"  prefix cache: turn {n} reused {u.cached_prompt_tokens} of its "
                      f"{u.prompt_tokens} prompt tokens from the earlier turns\n")
        out.flush()
    return 0
