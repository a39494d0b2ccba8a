"""The service commands: ``kvmesh serve`` (the whole mesh: the scheduler and the gateway in one
process, each replica's engine in a process of its own, the model's stages in Ray actors under the
ray executor),
``kvmesh scheduler`` and ``kvmesh gateway`` (one service each, as deploy/ runs them). Their settings are the flags of
:mod:`kvmesh.core.flags` over the ``KVMESH_*`` variables."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
from kvmesh.core.flags import (add_engine_args, add_gateway_args, add_scheduler_args, engine_kwargs, gateway_kwargs,
                               scheduler_kwargs)


def register(sub) -> None:
    """Add ``serve``, ``scheduler`` and ``gateway`` to the top-level subparsers ``sub``."""
    p = sub.add_parser("serve", help="the mesh: scheduler + gateway in one process, the engines in their own",
                       description="Start the scheduler service and the public gateway in one process, each "
                                   "replica's engine in a process of its own (--no-engine-process: a thread), the "
                                   "model in Ray actors under the ray executor (auto: with --pp > 1 or "
                                   "--ray-address). Prints `kvmesh: <service> listening on HOST:PORT` on stderr for "
                                   "each; SIGINT/SIGTERM stops them (exit 0).")
    add_grace_arg(p)
    add_gateway_args(p, in_mesh=True)
    add_scheduler_args(p, listen="--scheduler-")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("scheduler", help="the scheduler service alone",
                       description="The internal scheduler service (kvmesh.v1.SchedulerService): replicas "
                                   "of the model, their engine loops and executors. Settings from flags or "
                                   "KVMESH_SCHEDULER_* / KVMESH_* variables.")
    add_grace_arg(p)
    add_scheduler_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_scheduler)

    p = sub.add_parser("gateway", help="the public gateway alone",
                       description="The public gRPC service (kvmesh.v1.LLMService) in front of a scheduler "
                                   "(--scheduler-address). Settings from flags or KVMESH_GATEWAY_* variables.")
    add_grace_arg(p)
    add_gateway_args(p)
    p.set_defaults(func=cmd_gateway)


def add_grace_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds in-flight requests get to finish while new ones are refused "
                        "with a retry hint; then those left end UNAVAILABLE (5)")


def service_configs(args: argparse.Namespace, **sched_overrides):
    """(EngineConfig, SchedulerConfig, GatewayConfig) from the flags and the environment."""
    return (EngineConfig.from_env(**engine_kwargs(args)),
            SchedulerConfig.from_env(**dict(scheduler_kwargs(args), **sched_overrides)),
            GatewayConfig.from_env(**gateway_kwargs(args)))


def run_services(coro) -> int:
    """Run the services' coroutine to its end; an OSError or RuntimeError (e.g. a port in use)
    prints ``kvmesh: error: ...`` and gives exit code 1."""
    try:
        return asyncio.run(coro)
    except (OSError, RuntimeError) as e:       # e.g. a port in use
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1


def cmd_serve(args: argparse.Namespace) -> int:
    """``kvmesh serve``: the scheduler service and the gateway in this process."""
    from kvmesh import serve

    engine_cfg, sched_cfg, gw_cfg = service_configs(args)
    return run_services(serve.run_services(lambda mesh: serve.start_mesh(mesh, sched_cfg, engine_cfg, gw_cfg),
                                            grace=args.grace))


def cmd_scheduler(args: argparse.Namespace) -> int:
    """``kvmesh scheduler``: the scheduler service alone."""
    from kvmesh import serve

    engine_cfg, sched_cfg, _ = service_configs(args)
    return run_services(serve.run_services(lambda mesh: serve.start_scheduler(mesh, sched_cfg, engine_cfg),
                                            grace=args.grace))


def cmd_gateway(args: argparse.Namespace) -> int:
    """``kvmesh gateway``: the gateway alone, in front of ``--scheduler-address``."""
    from kvmesh import serve

    gw_cfg = GatewayConfig.from_env(**gateway_kwargs(args))
    return run_services(serve.run_services(lambda mesh: serve.start_gateway(mesh, gw_cfg), grace=args.grace))
