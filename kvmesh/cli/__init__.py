"""The ``kvmesh`` command line: one module per command.

    kvmesh models list | pull NAME...   known models; fetch pinned GGUF weights (--dense)  (models.py)
    kvmesh generate --prompt TEXT       stream one completion, here or via --server ADDR (generate.py)
    kvmesh chat --server ADDR           interactive multi-turn chat through a gateway     (chat.py)
    kvmesh serve                        the mesh: scheduler + gateway in one process,     (services.py)
                                        each replica's engine in a process of its own
    kvmesh scheduler | gateway          one service alone (compose, Kubernetes)           (services.py)
    kvmesh demo                         the mesh as serve, and a two-turn PolicyDesk chat  (demo.py)
    kvmesh bench engine|serve|ablation  benchmarks, registered by their bench modules     (bench.py)
    kvmesh eval faithfulness            the PolicyDesk quality gate                       (bench.py)

Settings are one dataclass per service (:mod:`kvmesh.core.engine_config`,
:mod:`kvmesh.core.service_config`); every field has a flag, generated from the field
(:mod:`kvmesh.core.flags`), and an environment variable
(``KVMESH_<FIELD>``, ``KVMESH_SCHEDULER_<FIELD>``, ``KVMESH_GATEWAY_<FIELD>``; a flag wins). Bad
arguments and a refused request (:class:`~kvmesh.core.errors.EngineError`, a gRPC status such as
INVALID_ARGUMENT) print ``kvmesh: error: <message>`` on stderr and exit 2; a server or
dependency that is down or overloaded (UNAVAILABLE, :class:`~kvmesh.core.errors.DependencyUnavailableError`,
e.g. a failed download) prints the same way and exits 1.

Importing this package loads neither torch nor a benchmark module: the engine loads when a
command runs it, a benchmark module when its command is run (tests/test_cli.py checks it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from kvmesh.cli import bench, chat, demo, generate, models, services
from kvmesh.cli.remote import ServerUnavailable
from kvmesh.core.errors import DependencyUnavailableError, EngineError

__all__ = ["build_parser", "main"]


def build_parser(argv: list[str] | tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The whole ``kvmesh`` parser. The benchmark command that ``argv`` names (``bench serve``
    ...) is registered by its module, the others by name only (:mod:`kvmesh.cli.bench`). Each
    command's parser sets ``func``, a callable (args) -> exit code."""
    from kvmesh import __version__

    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: an LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    models.register(sub)
    generate.register(sub)
    chat.register(sub)
    services.register(sub)
    demo.register(sub)
    bench.register(sub, list(argv))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code: 0, 2 for a bad argument or a refused
    request, 1 for a server or dependency that is down, 130 on Ctrl-C."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Ray starts its processes with fork+exec: grpc's fork handlers are not needed and only log
    # "skipping fork() handlers" lines (read when grpc is first imported, hence here)
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as e:             # --help, --version, or argparse's "error: ..." (code 2)
        return e.code if isinstance(e.code, int) else 0
    args.command_line = "kvmesh " + shlex.join(argv)      # for the records a command writes
    try:
        return args.func(args)
    except (ServerUnavailable, DependencyUnavailableError) as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1
    except EngineError as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nkvmesh: interrupted", file=sys.stderr)
        return 130
